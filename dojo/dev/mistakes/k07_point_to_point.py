"""k07's mistakes catalogue: real mistakes with send/recv, isend/irecv and batch_isend_irecv, and
right answers written another way. See ``dojo/dev/mistakes/__init__.py`` for what each list promises."""

from __future__ import annotations

import torch
import torch.distributed as dist

from dojo.dev.mistakes import Mistake, RightAnswer

TAG_TO_LEFT, TAG_TO_RIGHT = 1, 2


def _ring(need: int = 2) -> tuple[int, int]:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if world_size < need:
        raise ValueError(f"needs a world of at least {need} ranks, this one has {world_size}")
    return rank, world_size


def _pong_checks(rounds: int) -> int:
    rank, _ = _ring()
    if rounds < 1:
        raise ValueError(f"ping-pong needs at least one round, got rounds={rounds}")
    return rank


# --------------------------------------------------------------------------- ping_pong


def both_serve(rounds, device="cpu"):
    rank = _pong_checks(rounds)
    if rank > 1:
        return []
    peer = 1 - rank
    ball = torch.zeros(1, dtype=torch.int64, device=device)
    received = []
    for _ in range(rounds):
        dist.send(ball, dst=peer)  # "send, then receive": on both ranks
        dist.recv(ball, src=peer)
        received.append(int(ball.item()))
        ball += 1
    return received


def noted_after_adding(rounds, device="cpu"):
    rank = _pong_checks(rounds)
    if rank > 1:
        return []
    ball = torch.zeros(1, dtype=torch.int64, device=device)
    received = []
    for _ in range(rounds):
        if rank == 0:
            dist.send(ball, dst=1)
            dist.recv(ball, src=1)
        else:
            dist.recv(ball, src=0)
        ball += 1
        received.append(int(ball.item()))  # noted after the increment
        if rank == 1:
            dist.send(ball, dst=0)
    return received


def returns_tensors(rounds, device="cpu"):
    rank = _pong_checks(rounds)
    if rank > 1:
        return []
    ball = torch.zeros(1, dtype=torch.int64, device=device)
    received = []
    for _ in range(rounds):
        if rank == 0:
            dist.send(ball, dst=1)
            dist.recv(ball, src=1)
        else:
            dist.recv(ball, src=0)
        received.append(ball)  # the tensor itself (the same one every round), not its value
        ball += 1
        if rank == 1:
            dist.send(ball, dst=0)
    return received


def only_rank_0_adds(rounds, device="cpu"):
    rank = _pong_checks(rounds)
    if rank > 1:
        return []
    ball = torch.zeros(1, dtype=torch.int64, device=device)
    received = []
    for _ in range(rounds):
        if rank == 0:
            dist.send(ball, dst=1)
            dist.recv(ball, src=1)
            received.append(int(ball.item()))
            ball += 1
        else:
            dist.recv(ball, src=0)
            received.append(int(ball.item()))
            dist.send(ball, dst=0)  # bounced back as it came
    return received


def ping_pong_with_fresh_buffers(rounds, device="cpu"):
    """Right: a new tensor for every message, the counter kept as a Python int."""
    rank = _pong_checks(rounds)
    if rank > 1:
        return []
    peer, received, value = 1 - rank, [], 0
    for turn in range(2 * rounds):
        if (turn % 2 == 0) == (rank == 0):  # rank 0 sends on even turns, rank 1 on odd ones
            dist.send(torch.tensor([value], dtype=torch.int64, device=device), dst=peer)
        else:
            buffer = torch.empty(1, dtype=torch.int64, device=device)
            dist.recv(buffer, src=peer)
            value = int(buffer.item())
            received.append(value)
            value += 1
    return received


# --------------------------------------------------------------------------- token_ring


def everyone_receives_first(token, device="cpu"):
    rank, world_size = _ring()
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    held = torch.tensor([token], dtype=torch.int64, device=device)
    dist.recv(held, src=left)  # rank 0 too: nobody starts the token
    received = int(held.item())
    held += rank + 1
    dist.send(held, dst=right)
    return received


def right_without_modulo(token, device="cpu"):
    rank, world_size = _ring()
    right, left = rank + 1, (rank - 1) % world_size  # the last rank's right is world_size
    held = torch.tensor([token], dtype=torch.int64, device=device)
    if rank == 0:
        held += 1
        dist.send(held, dst=right)
        dist.recv(held, src=left)
        return int(held.item())
    dist.recv(held, src=left)
    received = int(held.item())
    held += rank + 1
    dist.send(held, dst=right)
    return received


def left_without_modulo(token, device="cpu"):
    rank, world_size = _ring()
    right, left = (rank + 1) % world_size, rank - 1  # rank 0's left is -1
    held = torch.tensor([token], dtype=torch.int64, device=device)
    if rank == 0:
        held += 1
        dist.send(held, dst=right)
        dist.recv(held, src=left)
        return int(held.item())
    dist.recv(held, src=left)
    received = int(held.item())
    held += rank + 1
    dist.send(held, dst=right)
    return received


def returns_after_adding(token, device="cpu"):
    rank, world_size = _ring()
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    held = torch.tensor([token], dtype=torch.int64, device=device)
    if rank == 0:
        held += 1
        dist.send(held, dst=right)
        dist.recv(held, src=left)
        return int(held.item())
    dist.recv(held, src=left)
    held += rank + 1
    dist.send(held, dst=right)
    return int(held.item())  # read after its own addition


def rank_0_adds_twice(token, device="cpu"):
    rank, world_size = _ring()
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    held = torch.tensor([token], dtype=torch.int64, device=device)
    if rank == 0:
        held += 1
        dist.send(held, dst=right)
        dist.recv(held, src=left)
        held += 1  # "every rank adds when the token reaches it": rank 0 again
        return int(held.item())
    dist.recv(held, src=left)
    received = int(held.item())
    held += rank + 1
    dist.send(held, dst=right)
    return received


def rank_0_never_adds(token, device="cpu"):
    rank, world_size = _ring()
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    held = torch.tensor([token], dtype=torch.int64, device=device)
    if rank == 0:  # only starts the token
        dist.send(held, dst=right)
        dist.recv(held, src=left)
        return int(held.item())
    dist.recv(held, src=left)
    received = int(held.item())
    held += rank + 1
    dist.send(held, dst=right)
    return received


def token_ring_as_a_python_int(token, device="cpu"):
    """Right: the token kept as a Python int, a new tensor for each message."""
    rank, world_size = _ring()
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    buffer = torch.empty(1, dtype=torch.int64, device=device)
    if rank != 0:
        dist.recv(buffer, src=left)
        token = int(buffer.item())
    dist.send(torch.tensor([token + rank + 1], dtype=torch.int64, device=device), dst=right)
    if rank == 0:
        dist.recv(buffer, src=left)
        token = int(buffer.item())
    return token


# --------------------------------------------------------------------------- shift_right


def send_then_recv(tensor):
    rank, world_size = _ring()
    received = torch.empty_like(tensor)
    dist.send(tensor, dst=(rank + 1) % world_size)  # every rank sends first: nobody receives
    dist.recv(received, src=(rank - 1) % world_size)
    return received


def isend_never_waited(tensor):
    rank, world_size = _ring()
    received = torch.empty_like(tensor)
    dist.isend(tensor, dst=(rank + 1) % world_size)  # "it's sent": the request is dropped
    dist.irecv(received, src=(rank - 1) % world_size).wait()
    return received


def irecv_never_waited(tensor):
    rank, world_size = _ring()
    received = torch.empty_like(tensor)
    sending = dist.isend(tensor, dst=(rank + 1) % world_size)
    dist.irecv(received, src=(rank - 1) % world_size)  # returned before the data is in
    sending.wait()
    return received


def received_into_sent_tensor(tensor):
    rank, world_size = _ring()
    requests = [
        dist.isend(tensor, dst=(rank + 1) % world_size),
        dist.irecv(tensor, src=(rank - 1) % world_size),  # "in place, to save memory"
    ]
    for request in requests:
        request.wait()
    return tensor


def shifted_left(tensor):
    rank, world_size = _ring()
    received = torch.empty_like(tensor)
    requests = [
        dist.isend(tensor, dst=(rank - 1) % world_size),  # left and right mixed up
        dist.irecv(received, src=(rank + 1) % world_size),
    ]
    for request in requests:
        request.wait()
    return received


def shift_right_without_modulo(tensor):
    rank, world_size = _ring()
    received = torch.empty_like(tensor)
    requests = [
        dist.isend(tensor, dst=rank + 1),  # the last rank sends to world_size
        dist.irecv(received, src=(rank - 1) % world_size),
    ]
    for request in requests:
        request.wait()
    return received


def shift_even_odd(tensor):
    """Right: blocking calls, ordered so that every send has a receiver ready (the lesson's
    other way out)."""
    rank, world_size = _ring()
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    received = torch.empty_like(tensor)
    if rank % 2 == 0:
        dist.send(tensor, dst=right)
        dist.recv(received, src=left)
    else:
        dist.recv(received, src=left)
        dist.send(tensor, dst=right)
    return received


def shift_batched(tensor):
    """Right: the two operations in one batch_isend_irecv."""
    rank, world_size = _ring()
    received = torch.empty_like(tensor)
    operations = [
        dist.P2POp(dist.irecv, received, (rank - 1) % world_size),
        dist.P2POp(dist.isend, tensor, (rank + 1) % world_size),
    ]
    for request in dist.batch_isend_irecv(operations):
        request.wait()
    return received


# --------------------------------------------------------------------------- receive_while_working


def blocking_recv_before_work(source, buffer, work):
    dist.recv(buffer, src=source)  # waits for the data before any work starts
    return buffer, work()


def wait_before_work(source, buffer, work):
    request = dist.irecv(buffer, src=source)
    request.wait()  # non-blocking call, blocking use: the work waits for the message
    return buffer, work()


def read_before_wait(source, buffer, work):
    request = dist.irecv(buffer, src=source)
    result = work()
    copy = buffer.clone()  # read while the message may still be on its way
    request.wait()
    return copy, result


def never_waits(source, buffer, work):
    dist.irecv(buffer, src=source)
    return buffer, work()  # "irecv fills it in the background": not by now


def work_then_blocking_recv(source, buffer, work):
    result = work()
    dist.recv(buffer, src=source)  # right values, but nothing travelled during the work
    return buffer, result


def receive_in_a_batch(source, buffer, work):
    """Right: the irecv posted through batch_isend_irecv (a batch of one)."""
    requests = dist.batch_isend_irecv([dist.P2POp(dist.irecv, buffer, source)])
    result = work()
    for request in requests:
        request.wait()
    return buffer, result


# --------------------------------------------------------------------------- halo_exchange


def _halo_checks(strip):
    rank, world_size = _ring()
    if strip.dim() != 1 or strip.numel() == 0:
        raise ValueError(
            f"halo_exchange needs a non-empty 1-D strip, got shape {tuple(strip.shape)}"
        )
    return rank, world_size, (rank - 1) % world_size, (rank + 1) % world_size


def _post(operations):
    for request in dist.batch_isend_irecv(operations):
        request.wait()


def halo_without_tags(strip):
    rank, world_size, left, right = _halo_checks(strip)
    from_left, from_right = torch.empty_like(strip[:1]), torch.empty_like(strip[:1])
    _post(  # every message with the default tag 0
        [
            dist.P2POp(dist.isend, strip[:1].clone(), left),
            dist.P2POp(dist.isend, strip[-1:].clone(), right),
            dist.P2POp(dist.irecv, from_left, left),
            dist.P2POp(dist.irecv, from_right, right),
        ]
    )
    return torch.cat([from_left, strip, from_right])


def receive_tags_swapped(strip):
    rank, world_size, left, right = _halo_checks(strip)
    from_left, from_right = torch.empty_like(strip[:1]), torch.empty_like(strip[:1])
    _post(
        [
            dist.P2POp(dist.isend, strip[:1].clone(), left, tag=TAG_TO_LEFT),
            dist.P2POp(dist.isend, strip[-1:].clone(), right, tag=TAG_TO_RIGHT),
            # "from the left: TAG_TO_LEFT": but that message travelled to the right
            dist.P2POp(dist.irecv, from_left, left, tag=TAG_TO_LEFT),
            dist.P2POp(dist.irecv, from_right, right, tag=TAG_TO_RIGHT),
        ]
    )
    return torch.cat([from_left, strip, from_right])


def receive_peers_swapped(strip):
    rank, world_size, left, right = _halo_checks(strip)
    from_left, from_right = torch.empty_like(strip[:1]), torch.empty_like(strip[:1])
    _post(
        [
            dist.P2POp(dist.isend, strip[:1].clone(), left, tag=TAG_TO_LEFT),
            dist.P2POp(dist.isend, strip[-1:].clone(), right, tag=TAG_TO_RIGHT),
            dist.P2POp(dist.irecv, from_left, right, tag=TAG_TO_RIGHT),  # peers mixed up:
            dist.P2POp(dist.irecv, from_right, left, tag=TAG_TO_LEFT),  # these never pair up
        ]
    )
    return torch.cat([from_left, strip, from_right])


def edges_swapped(strip):
    rank, world_size, left, right = _halo_checks(strip)
    from_left, from_right = torch.empty_like(strip[:1]), torch.empty_like(strip[:1])
    _post(
        [
            dist.P2POp(dist.isend, strip[-1:].clone(), left, tag=TAG_TO_LEFT),  # last goes left
            dist.P2POp(dist.isend, strip[:1].clone(), right, tag=TAG_TO_RIGHT),
            dist.P2POp(dist.irecv, from_left, left, tag=TAG_TO_RIGHT),
            dist.P2POp(dist.irecv, from_right, right, tag=TAG_TO_LEFT),
        ]
    )
    return torch.cat([from_left, strip, from_right])


def halo_not_batched(strip):
    rank, world_size, left, right = _halo_checks(strip)
    from_left, from_right = torch.empty_like(strip[:1]), torch.empty_like(strip[:1])
    requests = [  # right messages, but not the batch this step is about
        dist.isend(strip[:1].clone(), dst=left, tag=TAG_TO_LEFT),
        dist.isend(strip[-1:].clone(), dst=right, tag=TAG_TO_RIGHT),
        dist.irecv(from_left, src=left, tag=TAG_TO_RIGHT),
        dist.irecv(from_right, src=right, tag=TAG_TO_LEFT),
    ]
    for request in requests:
        request.wait()
    return torch.cat([from_left, strip, from_right])


def batch_not_waited(strip):
    rank, world_size, left, right = _halo_checks(strip)
    from_left, from_right = torch.empty_like(strip[:1]), torch.empty_like(strip[:1])
    dist.batch_isend_irecv(  # the requests are dropped: nobody waits for the edges
        [
            dist.P2POp(dist.isend, strip[:1].clone(), left, tag=TAG_TO_LEFT),
            dist.P2POp(dist.isend, strip[-1:].clone(), right, tag=TAG_TO_RIGHT),
            dist.P2POp(dist.irecv, from_left, left, tag=TAG_TO_RIGHT),
            dist.P2POp(dist.irecv, from_right, right, tag=TAG_TO_LEFT),
        ]
    )
    return torch.cat([from_left, strip, from_right])


def halo_receives_first(strip):
    rank, world_size, left, right = _halo_checks(strip)
    from_left, from_right = torch.empty_like(strip[:1]), torch.empty_like(strip[:1])
    dist.recv(from_left, src=left, tag=TAG_TO_RIGHT)  # every rank waits for its neighbour,
    dist.recv(from_right, src=right, tag=TAG_TO_LEFT)  # which waits too: nobody ever sends
    dist.send(strip[:1].clone(), dst=left, tag=TAG_TO_LEFT)
    dist.send(strip[-1:].clone(), dst=right, tag=TAG_TO_RIGHT)
    return torch.cat([from_left, strip, from_right])


def halo_with_views(strip):
    """Right: sends slices of the strip itself (no copies), receives first, fills one new tensor."""
    rank, world_size, left, right = _halo_checks(strip)
    halo = torch.empty(strip.numel() + 2, dtype=strip.dtype, device=strip.device)
    halo[1:-1] = strip
    _post(
        [
            dist.P2POp(dist.irecv, halo[:1], left, tag=TAG_TO_RIGHT),
            dist.P2POp(dist.irecv, halo[-1:], right, tag=TAG_TO_LEFT),
            dist.P2POp(dist.isend, strip[:1], left, tag=TAG_TO_LEFT),
            dist.P2POp(dist.isend, strip[-1:], right, tag=TAG_TO_RIGHT),
        ]
    )
    return halo


# --------------------------------------------------------------------------- the catalogue

# Each mistake must fail the named tests with a message that says all of `says`.
MISTAKES = [
    Mistake(
        "both_serve",
        replaces="ping_pong",
        fails=["test_ping_pong[2]"],
        says=["rank 0 and rank 1 both began with send", "rank 1 receives first"],
    ),
    Mistake(
        "noted_after_adding",
        replaces="ping_pong",
        fails=["test_ping_pong"],
        says=["noted the counter after adding 1", "Note the value as it arrives"],
    ),
    Mistake(
        "returns_tensors",
        replaces="ping_pong",
        fails=["test_ping_pong[2]"],
        says=["return a list of Python ints", "int(ball.item())"],
    ),
    Mistake(
        "only_rank_0_adds",
        replaces="ping_pong",
        fails=["test_ping_pong[2]"],
        says=["rank 1 sent the counter back without adding 1"],
    ),
    Mistake(
        "everyone_receives_first",
        replaces="token_ring",
        fails=["test_token_ring[2]", "test_token_ring[3]"],
        says=["every rank began with recv", "Rank 0 starts it"],
    ),
    Mistake(
        "right_without_modulo",
        replaces="token_ring",
        fails=["test_token_ring"],  # every world: its last rank sends to dst=world_size
        says=["which is not a rank of this world of", "(rank + 1) % world_size"],
    ),
    Mistake(
        "left_without_modulo",
        replaces="token_ring",
        fails=["test_token_ring"],  # every world: rank 0 receives from src=-1
        says=["with src=-1, which is not a rank of this world of", "(rank - 1) % world_size"],
    ),
    Mistake(
        "returns_after_adding",
        replaces="token_ring",
        fails=["test_token_ring"],
        says=["returned the token after adding its own", "Return the value as it arrived"],
    ),
    Mistake(
        "rank_0_adds_twice",
        replaces="token_ring",
        fails=["test_token_ring"],
        says=["rank 0", "added its 1 twice"],
    ),
    Mistake(
        "rank_0_never_adds",
        replaces="token_ring",
        fails=["test_token_ring"],
        says=["rank 0 never added its 1"],
    ),
    Mistake(
        "send_then_recv",
        replaces="shift_right",
        fails=["test_shift_right[2]", "test_shift_right[3]"],
        says=["every rank was stuck in a blocking send", "Post dist.isend and dist.irecv first"],
    ),
    Mistake(
        "isend_never_waited",
        replaces="shift_right",
        fails=["test_shift_right[2]"],
        says=["never called wait() on the request of its isend", "Call .wait() on every request"],
    ),
    Mistake(
        "irecv_never_waited",
        replaces="shift_right",
        fails=["test_shift_right[2]"],
        says=["never called wait() on the request of its irecv", "still be on its way"],
    ),
    Mistake(
        "received_into_sent_tensor",
        replaces="shift_right",
        fails=["test_shift_right[2]"],
        says=["received into the tensor it was sending", "torch.empty_like(tensor)"],
    ),
    Mistake(
        "shifted_left",
        replaces="shift_right",
        fails=["test_shift_right[3]"],
        says=["its right neighbour's: the data moved left"],
    ),
    Mistake(
        "shift_right_without_modulo",
        replaces="shift_right",
        fails=["test_shift_right"],  # every world: its last rank sends to dst=world_size
        says=["which is not a rank of this world of", "(rank + 1) % world_size"],
    ),
    Mistake(
        "blocking_recv_before_work",
        replaces="receive_while_working",
        fails=["test_receive_while_working_reads_the_buffer_only_after_wait"],
        says=["rank 1 waits in a blocking dist.recv before it called work()", "posts dist.irecv"],
    ),
    Mistake(
        "wait_before_work",
        replaces="receive_while_working",
        fails=["test_receive_while_working_reads_the_buffer_only_after_wait"],
        says=["rank 1 waits on its irecv's request before it called work()"],
    ),
    Mistake(
        "read_before_wait",
        replaces="receive_while_working",
        fails=["test_receive_while_working_reads_the_buffer_only_after_wait"],
        says=["it was read before the message arrived", "call wait() on the request first"],
    ),
    Mistake(
        "never_waits",
        replaces="receive_while_working",
        fails=["test_receive_while_working_reads_the_buffer_only_after_wait"],
        says=["never called wait() on the request of its irecv"],
    ),
    Mistake(
        "work_then_blocking_recv",
        replaces="receive_while_working",
        fails=["test_receive_while_working_reads_the_buffer_only_after_wait"],
        says=["blocking dist.recv after work()", "Post dist.irecv before calling work()"],
    ),
    Mistake(
        "halo_without_tags",
        replaces="halo_exchange",
        fails=["test_halo_exchange[2]"],
        says=["with tag=0, expected TAG_TO_LEFT", "tag each message with the direction it travels"],
    ),
    Mistake(
        "receive_tags_swapped",
        replaces="halo_exchange",
        fails=["test_halo_exchange[2]"],
        says=["put on its left the element received with tag=1 (TAG_TO_LEFT)", "TAG_TO_RIGHT"],
    ),
    Mistake(
        "receive_peers_swapped",
        replaces="halo_exchange",
        fails=["test_halo_exchange[3]"],
        says=["waits for a message from rank", "a receive matches only a send with the same tag"],
    ),
    Mistake(
        "edges_swapped",
        replaces="halo_exchange",
        fails=["test_halo_exchange[2]", "test_halo_exchange[3]"],
        says=["Are the two edges swapped?"],
    ),
    Mistake(
        "halo_not_batched",
        replaces="halo_exchange",
        fails=["test_halo_exchange[2]"],
        says=["never called dist.batch_isend_irecv"],
    ),
    Mistake(
        "halo_receives_first",
        replaces="halo_exchange",
        fails=["test_halo_exchange[2]", "test_halo_exchange[3]"],
        says=[
            "every rank is inside a blocking recv (rank 0 in recv(src=",
            "none of them sends",
            "post the sends with dist.isend before receiving",
        ],
    ),
    Mistake(
        "batch_not_waited",
        replaces="halo_exchange",
        fails=["test_halo_exchange[2]", "test_halo_exchange[3]"],
        says=["never called wait() on the request of its", "Call .wait() on every request"],
    ),
]

# Each right answer must pass every test of its step.
RIGHT_ANSWERS = [
    RightAnswer("ping_pong_with_fresh_buffers", replaces="ping_pong"),
    RightAnswer("token_ring_as_a_python_int", replaces="token_ring"),
    RightAnswer("shift_even_odd", replaces="shift_right"),
    RightAnswer("shift_batched", replaces="shift_right"),
    RightAnswer("receive_in_a_batch", replaces="receive_while_working"),
    RightAnswer("halo_with_views", replaces="halo_exchange"),
]
