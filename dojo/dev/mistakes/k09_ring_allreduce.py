"""k09's mistakes catalogue: real mistakes in the chunk arithmetic and the two rings, and right
answers written another way. See ``dojo/dev/mistakes/__init__.py`` for what each list promises."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from dojo.dev.mistakes import Mistake, RightAnswer

# The catalogue's rings call the reference's helpers (chunk_bounds, _flat, the exchange), so each
# entry differs from the reference in the one function it replaces.


def _kata():
    from dojo.harness.impl import load_kata

    return load_kata("k09_ring_allreduce")


# --------------------------------------------------------------------------- chunk_bounds


def bounds_remainder_to_last(length, world_size):
    if world_size < 1 or length < 0:
        raise ValueError(f"need length >= 0 and world_size >= 1, got {length}, {world_size}")
    size = length // world_size  # the last chunk takes whatever is left over
    bounds = [(i * size, (i + 1) * size) for i in range(world_size)]
    bounds[-1] = (bounds[-1][0], length)
    return bounds


def bounds_ceil_then_clip(length, world_size):
    if world_size < 1 or length < 0:
        raise ValueError(f"need length >= 0 and world_size >= 1, got {length}, {world_size}")
    size = math.ceil(length / world_size)  # every chunk as long as the longest, the end clipped
    return [(min(i * size, length), min((i + 1) * size, length)) for i in range(world_size)]


def bounds_larger_last(length, world_size):
    if world_size < 1 or length < 0:
        raise ValueError(f"need length >= 0 and world_size >= 1, got {length}, {world_size}")
    base, extra = divmod(length, world_size)
    bounds, start = [], 0
    for index in range(world_size):
        stop = start + base + (1 if index >= world_size - extra else 0)  # the last ones longer
        bounds.append((start, stop))
        start = stop
    return bounds


def bounds_inclusive_stop(length, world_size):
    if world_size < 1 or length < 0:
        raise ValueError(f"need length >= 0 and world_size >= 1, got {length}, {world_size}")
    base, extra = divmod(length, world_size)
    bounds, start = [], 0
    for index in range(world_size):
        size = base + (1 if index < extra else 0)
        bounds.append((start, start + size - 1))  # "the last element", not one past it
        start += size
    return bounds


def bounds_without_checks(length, world_size):
    base, extra = divmod(length, world_size)  # world_size 0: ZeroDivisionError
    bounds, start = [], 0
    for index in range(world_size):
        stop = start + base + (1 if index < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def bounds_silent_value_error(length, world_size):
    if world_size < 1 or length < 0:
        raise ValueError("invalid input")
    return bounds_without_checks(length, world_size)


# --------------------------------------------------------------------------- _send_right_receive_left


def send_first_blocking(outgoing, incoming):
    rank, world = dist.get_rank(), dist.get_world_size()
    if outgoing.numel():
        dist.send(outgoing, (rank + 1) % world)  # every rank sends first: nobody receives
    if incoming.numel():
        dist.recv(incoming, (rank - 1) % world)


def isend_never_waited(outgoing, incoming):
    rank, world = dist.get_rank(), dist.get_world_size()
    if outgoing.numel():
        dist.isend(outgoing, (rank + 1) % world)  # the request is dropped, never waited on
    if incoming.numel():
        dist.recv(incoming, (rank - 1) % world)


def receives_from_the_right(outgoing, incoming):
    rank, world = dist.get_rank(), dist.get_world_size()
    right = (rank + 1) % world
    request = dist.isend(outgoing, right) if outgoing.numel() else None
    if incoming.numel():
        dist.recv(incoming, right)  # "my neighbour": the one it sends to
    if request is not None:
        request.wait()


# --------------------------------------------------------------------------- pass_along_allreduce


def pass_along_keeps_sending_own(tensor):
    kata = _kata()
    flat = kata._flat(tensor)
    outgoing, incoming = flat.clone(), torch.empty_like(flat)
    for _ in range(dist.get_world_size() - 1):
        kata._send_right_receive_left(outgoing, incoming)  # outgoing is never updated
        flat += incoming
    return tensor


def pass_along_forgets_own(tensor):
    kata = _kata()
    flat = kata._flat(tensor)
    outgoing, incoming = flat.clone(), torch.empty_like(flat)
    flat.zero_()  # "the sum starts at zero": its own tensor is lost
    for _ in range(dist.get_world_size() - 1):
        kata._send_right_receive_left(outgoing, incoming)
        flat += incoming
        outgoing, incoming = incoming, outgoing
    return tensor


def pass_along_sends_running_sum(tensor):
    kata = _kata()
    flat = kata._flat(tensor)
    incoming = torch.empty_like(flat)
    for _ in range(dist.get_world_size() - 1):
        kata._send_right_receive_left(flat.clone(), incoming)  # passes on its sum so far
        flat += incoming
    return tensor


def pass_along_not_in_place(tensor):
    kata = _kata()
    outgoing, incoming = tensor.clone(), torch.empty_like(tensor)
    for _ in range(dist.get_world_size() - 1):
        kata._send_right_receive_left(outgoing, incoming)
        tensor = tensor + incoming  # a new tensor: the caller's is left as it was
        outgoing, incoming = incoming, outgoing
    return tensor


# --------------------------------------------------------------------------- ring_reduce_scatter


def _reduce_scatter_with(tensor, send_index, recv_index, combine, owned):
    """The reference's loop with the chunk indices, the combining and the result swapped out."""
    kata = _kata()
    rank, world = dist.get_rank(), dist.get_world_size()
    flat = kata._flat(tensor)
    bounds = kata.chunk_bounds(flat.numel(), world)
    incoming = torch.empty(bounds[0][1] - bounds[0][0], dtype=flat.dtype)
    for step in range(world - 1):
        a, b = bounds[send_index(rank, step, world)]
        c, d = bounds[recv_index(rank, step, world)]
        arrived = incoming[: d - c]
        kata._send_right_receive_left(flat[a:b], arrived)
        combine(flat[c:d], arrived)
    return owned(rank, world)


def _add(into, arrived):
    into += arrived


def _right_owner(rank, world):
    return (rank + 1) % world


def reduce_scatter_index_fixed(tensor):
    # The chunk index does not move with the step: every step sends the rank's own chunk.
    return _reduce_scatter_with(
        tensor, lambda r, s, n: r, lambda r, s, n: (r - 1) % n, _add, _right_owner
    )


def reduce_scatter_index_wrong_way(tensor):
    # The index moves up instead of down the ring: each chunk is passed on before it is summed.
    return _reduce_scatter_with(
        tensor, lambda r, s, n: (r + s) % n, lambda r, s, n: (r + s - 1) % n, _add, _right_owner
    )


def reduce_scatter_stores(tensor):
    def store(into, arrived):
        into.copy_(arrived)  # stored, as the all-gather does, instead of added

    return _reduce_scatter_with(
        tensor, lambda r, s, n: (r - s) % n, lambda r, s, n: (r - s - 1) % n, store, _right_owner
    )


def reduce_scatter_returns_rank(tensor):
    # "Each rank owns its own chunk": right sums, wrong index returned.
    return _reduce_scatter_with(
        tensor,
        lambda r, s, n: (r - s) % n,
        lambda r, s, n: (r - s - 1) % n,
        _add,
        lambda r, n: r,
    )


def reduce_scatter_padded(tensor):
    # A course's way: a zero-padded copy cut into N equal chunks, reduce-scattered, copied back.
    kata = _kata()
    rank, world = dist.get_rank(), dist.get_world_size()
    flat = kata._flat(tensor)
    size = -(-flat.numel() // world)
    padded = torch.zeros(size * world, dtype=flat.dtype)
    padded[: flat.numel()] = flat
    spare = torch.empty(size, dtype=flat.dtype)
    for step in range(world - 1):
        a, c = (rank - step) % world * size, (rank - step - 1) % world * size
        kata._send_right_receive_left(padded[a : a + size], spare)
        padded[c : c + size] += spare
    flat.copy_(padded[: flat.numel()])
    return (rank + 1) % world


def reduce_scatter_all_reduces_chunks(tensor):
    kata = _kata()
    rank, world = dist.get_rank(), dist.get_world_size()
    flat = kata._flat(tensor)
    for start, stop in kata.chunk_bounds(flat.numel(), world):
        dist.all_reduce(flat[start:stop])  # "reduce each chunk": the very collective to build
    return (rank + 1) % world


# --------------------------------------------------------------------------- ring_all_gather


def _all_gather_with(tensor, owned, send_index, recv_index, add):
    kata = _kata()
    world = dist.get_world_size()
    flat = kata._flat(tensor)
    bounds = kata.chunk_bounds(flat.numel(), world)
    for step in range(world - 1):
        a, b = bounds[send_index(owned, step, world)]
        c, d = bounds[recv_index(owned, step, world)]
        if add:
            arrived = torch.empty(d - c, dtype=flat.dtype)
            kata._send_right_receive_left(flat[a:b], arrived)
            flat[c:d] += arrived
        else:
            kata._send_right_receive_left(flat[a:b], flat[c:d])
    return tensor


def all_gather_adds(tensor, owned):
    # The reduce-scatter's loop copied: the final chunks are added to what was there.
    return _all_gather_with(
        tensor, owned, lambda o, s, n: (o - s) % n, lambda o, s, n: (o - s - 1) % n, add=True
    )


all_gather_adds_in_the_whole_ring = all_gather_adds  # the same mistake, seen by the whole ring


def all_gather_wrong_way(tensor, owned):
    # The index moves up: from step 1 on a rank passes on a chunk it has not received yet.
    return _all_gather_with(
        tensor, owned, lambda o, s, n: (o + s) % n, lambda o, s, n: (o + s - 1) % n, add=False
    )


def all_gather_assumes_owner(tensor, owned):
    # `owned` ignored: "the reduce-scatter leaves rank r with chunk r + 1 anyway".
    guessed = (dist.get_rank() + 1) % dist.get_world_size()
    return _all_gather_with(
        tensor, guessed, lambda o, s, n: (o - s) % n, lambda o, s, n: (o - s - 1) % n, add=False
    )


# --------------------------------------------------------------------------- ring_allreduce


def ring_allreduce_world_of_one_returns_none(tensor):
    if dist.get_world_size() == 1:
        return  # "nothing to do" -- but the caller expects the tensor back
    kata = _kata()
    owned = kata.ring_reduce_scatter(tensor)
    return kata.ring_all_gather(tensor, owned)


def _exchange(outgoing, incoming, right, left):
    """A course's exchange: isend right, recv from the left, wait (an empty chunk: neither)."""
    request = dist.isend(outgoing, right) if outgoing.numel() else None
    if incoming.numel():
        dist.recv(incoming, left)
    if request is not None:
        request.wait()


def _ring_on_chunks(tensor, chunks):
    """A course's whole ring over the views ``chunks`` of the flat tensor: add N-1 steps, then
    store N-1 steps (the real students' code, adapted only to the kata's names)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world, (rank - 1) % world
    for step in range(world - 1):
        arriving = chunks[(rank - step - 1) % world]
        incoming = torch.empty_like(arriving)
        _exchange(chunks[(rank - step) % world], incoming, right, left)
        arriving += incoming
    for step in range(world - 1):
        outgoing, arriving = chunks[(rank + 1 - step) % world], chunks[(rank - step) % world]
        _exchange(outgoing.clone(), arriving, right, left)
    return tensor


def ring_allreduce_on_torch_chunk(tensor):
    # A course's ring cut with torch.chunk, which returns FEWER than N pieces for a tensor of
    # fewer than N elements (and 3, 3, 3, 1 for 10 on 4): chunks[...] is then out of range.
    chunks = list(torch.chunk(_kata()._flat(tensor), dist.get_world_size()))
    return _ring_on_chunks(tensor, chunks)


def ring_allreduce_sends_before_its_loop(tensor):
    # A repository's ring: its own chunk goes out before the loop, each summed chunk at the end
    # of its step. Right on 2 ranks and more; on a world of one rank its first send is to itself.
    kata = _kata()
    rank, world = dist.get_rank(), dist.get_world_size()
    flat = kata._flat(tensor)
    bounds = kata.chunk_bounds(flat.numel(), world)
    right, left = (rank + 1) % world, (rank - 1) % world
    spare = torch.empty(bounds[0][1] - bounds[0][0], dtype=flat.dtype)
    a, b = bounds[rank]
    sends = [dist.isend(flat[a:b], right)] if b > a else []  # right is itself on one rank
    for step in range(world - 1):
        c, d = bounds[(rank - step - 1) % world]
        if d > c:
            dist.recv(spare[: d - c], left)
            flat[c:d] += spare[: d - c]
            if step < world - 2:
                sends.append(dist.isend(flat[c:d], right))
    for request in sends:
        request.wait()
    return kata.ring_all_gather(tensor, (rank + 1) % world)


def ring_allreduce_from_a_zeroed_buffer(tensor):
    # A repository's ring: the sums kept in a buffer of its own, made with torch.zeros_like and
    # never filled from the input (meant: flat.clone()), copied back at the end.
    kata = _kata()
    world = dist.get_world_size()
    if world == 1:
        return tensor  # nothing to add on one rank
    flat = kata._flat(tensor)
    buffer = torch.zeros_like(flat)
    chunks = [buffer[a:b] for a, b in kata.chunk_bounds(flat.numel(), world)]
    _ring_on_chunks(buffer, chunks)
    flat.copy_(buffer)
    return tensor


def ring_allreduce_padded_to_equal_chunks(tensor):
    # A course's ring (the way it asks): the tensor padded with zeros to N equal chunks, the ring
    # run on the padded copy, the padding cut off at the end. Right sums; the padding travels.
    kata = _kata()
    world = dist.get_world_size()
    flat = kata._flat(tensor)
    size = -(-flat.numel() // world)
    padded = torch.zeros(size * world, dtype=flat.dtype)
    padded[: flat.numel()] = flat
    _ring_on_chunks(padded, list(padded.split(size)) if size else [padded] * world)
    flat.copy_(padded[: flat.numel()])
    return tensor


# --------------------------------------------------------------------------- right answers


def bounds_from_tensor_split(length, world_size):
    """torch's own rule, asked of torch."""
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if length < 0:
        raise ValueError(f"length must be at least 0, got {length}")
    sizes = [len(part) for part in torch.arange(length).tensor_split(world_size)]
    stops = [sum(sizes[: i + 1]) for i in range(world_size)]
    return [(stop - size, stop) for stop, size in zip(stops, sizes)]


def even_ranks_send_first(outgoing, incoming):
    """Blocking calls, ordered so that no cycle waits: even ranks send first, odd ranks receive."""
    rank, world = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world, (rank - 1) % world
    if rank % 2 == 0:
        if outgoing.numel():
            dist.send(outgoing, right)
        if incoming.numel():
            dist.recv(incoming, left)
    else:
        if incoming.numel():
            dist.recv(incoming, left)
        if outgoing.numel():
            dist.send(outgoing, right)


def exchange_with_batch_isend_irecv(outgoing, incoming):
    rank, world = dist.get_rank(), dist.get_world_size()
    ops = []
    if outgoing.numel():
        ops.append(dist.P2POp(dist.isend, outgoing, (rank + 1) % world))
    if incoming.numel():
        ops.append(dist.P2POp(dist.irecv, incoming, (rank - 1) % world))
    for request in dist.batch_isend_irecv(ops) if ops else []:
        request.wait()


def reduce_scatter_with_copies(tensor):
    """irecv into fresh buffers, clones sent, the owned chunk worked out from the last step."""
    kata = _kata()
    rank, world = dist.get_rank(), dist.get_world_size()
    flat = kata._flat(tensor)
    bounds = kata.chunk_bounds(flat.numel(), world)
    right, left = (rank + 1) % world, (rank - 1) % world
    last = rank
    for step in range(world - 1):
        out_chunk, in_chunk = (rank - step) % world, (rank - step - 1) % world
        a, b = bounds[out_chunk]
        c, d = bounds[in_chunk]
        outgoing = flat[a:b].clone()
        arrived = torch.empty(d - c, dtype=flat.dtype)
        requests = []
        if b > a:
            requests.append(dist.isend(outgoing, right))
        if d > c:
            requests.append(dist.irecv(arrived, left))
        for request in requests:
            request.wait()
        flat[c:d] += arrived
        last = in_chunk
    return last if world > 1 else 0


def all_gather_through_a_buffer(tensor, owned):
    """Receive into a spare buffer and copy into place."""
    kata = _kata()
    world = dist.get_world_size()
    flat = kata._flat(tensor)
    bounds = kata.chunk_bounds(flat.numel(), world)
    spare = torch.empty(bounds[0][1] - bounds[0][0], dtype=flat.dtype)
    for step in range(world - 1):
        a, b = bounds[(owned - step) % world]
        c, d = bounds[(owned - step - 1) % world]
        kata._send_right_receive_left(flat[a:b], spare[: d - c])
        flat[c:d] = spare[: d - c]
    return tensor


def ring_allreduce_in_one_loop(tensor):
    """Both halves in one loop of 2(N-1) steps: add while reducing, store while gathering."""
    kata = _kata()
    rank, world = dist.get_rank(), dist.get_world_size()
    flat = kata._flat(tensor)
    bounds = kata.chunk_bounds(flat.numel(), world)
    spare = torch.empty(bounds[0][1] - bounds[0][0], dtype=flat.dtype)
    for step in range(2 * (world - 1)):
        a, b = bounds[(rank - step) % world]
        c, d = bounds[(rank - step - 1) % world]
        kata._send_right_receive_left(flat[a:b], spare[: d - c])
        if step < world - 1:
            flat[c:d] += spare[: d - c]
        else:
            flat[c:d] = spare[: d - c]
    return tensor


def ring_allreduce_on_tensor_split(tensor):
    """The course's ring on torch.tensor_split, which always returns N pieces (some maybe empty,
    which nobody sends): the kata's chunks."""
    return _ring_on_chunks(tensor, _kata()._flat(tensor).tensor_split(dist.get_world_size()))


# --------------------------------------------------------------------------- the catalogue

BOUNDS_TESTS = [
    "test_chunk_bounds_examples[10-4-expected0]",
    "test_chunk_bounds_cover_every_length",
]

# Each mistake must fail the named tests with a message that says all of `says`.
MISTAKES = [
    Mistake(
        "bounds_remainder_to_last",
        replaces="chunk_bounds",
        fails=BOUNDS_TESTS,
        says=["differ by more than one", "spread the remainder", "over the first chunks"],
    ),
    Mistake(
        "bounds_ceil_then_clip",
        replaces="chunk_bounds",
        fails=BOUNDS_TESTS,
        says=["differ by more than one", "spread the remainder", "over the first chunks"],
    ),
    Mistake(
        "bounds_larger_last",
        replaces="chunk_bounds",
        fails=BOUNDS_TESTS,
        says=["put the larger chunks last", "the larger chunks come first"],
    ),
    Mistake(
        "bounds_inclusive_stop",
        replaces="chunk_bounds",
        fails=BOUNDS_TESTS,
        says=["stop is exclusive, as in a slice", "each chunk starts where the previous one stops"],
    ),
    Mistake(
        "bounds_without_checks",
        replaces="chunk_bounds",
        fails=["test_chunk_bounds_rejects_bad_input[10-0-world_size]"],
        says=["raised ZeroDivisionError", "must raise ValueError saying what is wrong"],
    ),
    Mistake(
        "bounds_silent_value_error",
        replaces="chunk_bounds",
        fails=["test_chunk_bounds_rejects_bad_input"],
        says=["raised ValueError('invalid input')", "say what is wrong, naming"],
    ),
    Mistake(
        "send_first_blocking",
        replaces="_send_right_receive_left",
        fails=["test_pass_along_equals_all_reduce[2]"],
        says=[
            "rank 0 was blocked in dist.send to rank 1",
            "Every rank is blocked in a blocking dist.send",
            "Post the send with dist.isend",
        ],
    ),
    Mistake(
        "isend_never_waited",
        replaces="_send_right_receive_left",
        fails=["test_pass_along_equals_all_reduce[2]", "test_pass_along_equals_all_reduce[3]"],
        says=["never waited on", "call request.wait()"],
    ),
    Mistake(
        "receives_from_the_right",
        replaces="_send_right_receive_left",
        fails=["test_pass_along_equals_all_reduce[3]"],
        says=["was blocked in dist.recv from rank", "receive from the left one, (rank - 1) % N"],
    ),
    Mistake(
        "pass_along_keeps_sending_own",
        replaces="pass_along_allreduce",
        fails=["test_pass_along_equals_all_reduce[3]", "test_pass_along_equals_all_reduce[4]"],
        says=[" x rank ", "a tensor was added more than once", "not your own tensor again"],
    ),
    Mistake(
        "pass_along_forgets_own",
        replaces="pass_along_allreduce",
        fails=["test_pass_along_equals_all_reduce[1]", "test_pass_along_equals_all_reduce[4]"],
        says=["every other rank's tensor but not its own", "start the sum from your own tensor"],
    ),
    Mistake(
        "pass_along_sends_running_sum",
        replaces="pass_along_allreduce",
        fails=["test_pass_along_equals_all_reduce[3]"],
        says=["added more than once", "not your own tensor again nor your running sum"],
    ),
    Mistake(
        "pass_along_not_in_place",
        replaces="pass_along_allreduce",
        fails=["test_pass_along_equals_all_reduce[2]"],
        says=["the tensor passed in still holds rank 0's own values", "work in place"],
    ),
    Mistake(
        "reduce_scatter_index_fixed",
        replaces="ring_reduce_scatter",
        fails=[
            "test_reduce_scatter_leaves_one_summed_chunk_per_rank[3]",
            "test_reduce_scatter_leaves_one_summed_chunk_per_rank[4]",
        ],
        says=[
            "rank 0 should own chunk 1",
            "rank 0's value only",
            "the chunk index must move with the step",
            "in step 1 it sent chunk 0, expected chunk",
        ],
    ),
    Mistake(
        "reduce_scatter_index_wrong_way",
        replaces="ring_reduce_scatter",
        fails=[  # on 2 ranks there is one step: either way is right
            "test_reduce_scatter_leaves_one_summed_chunk_per_rank[3]",
            "test_reduce_scatter_leaves_one_summed_chunk_per_rank[4]",
        ],
        says=["the chunks went round the wrong way", "in step 1 it sent chunk 1, expected chunk"],
    ),
    Mistake(
        "reduce_scatter_stores",
        replaces="ring_reduce_scatter",
        fails=[
            "test_reduce_scatter_leaves_one_summed_chunk_per_rank[2]",
            "test_reduce_scatter_leaves_one_summed_chunk_per_rank[3]",
        ],
        says=["holds rank 1's value only", "stored instead of added"],
    ),
    Mistake(
        "reduce_scatter_returns_rank",
        replaces="ring_reduce_scatter",
        fails=["test_reduce_scatter_leaves_one_summed_chunk_per_rank"],  # on every world
        says=["returned the chunk indices [0, 1", "rank r owns chunk (r + 1) % N"],
    ),
    Mistake(
        "reduce_scatter_padded",
        replaces="ring_reduce_scatter",
        fails=["test_reduce_scatter_leaves_one_summed_chunk_per_rank"],  # on every world
        says=["the tensor was padded to N = ", "right elsewhere", "(N-1)/N of it per rank"],
    ),
    Mistake(
        "reduce_scatter_all_reduces_chunks",
        replaces="ring_reduce_scatter",
        fails=["test_reduce_scatter_leaves_one_summed_chunk_per_rank[2]"],
        says=["the ring called dist.all_reduce", "point-to-point calls only"],
    ),
    Mistake(
        "all_gather_adds",
        replaces="ring_all_gather",
        fails=[
            "test_all_gather_copies_every_owned_chunk_everywhere[2]",
            "test_all_gather_copies_every_owned_chunk_everywhere[3]",
        ],
        says=["the arriving chunk was added", "store it"],
    ),
    Mistake(
        "all_gather_adds_in_the_whole_ring",
        replaces="ring_all_gather",
        # the all-gather's own test names it first; the whole ring's says it too
        fails=[
            "test_all_gather_copies_every_owned_chunk_everywhere[2]",
            "test_ring_allreduce_equals_all_reduce[4]",
        ],
        says=["added", "all-gather", "store"],
    ),
    Mistake(
        "all_gather_wrong_way",
        replaces="ring_all_gather",
        fails=[
            "test_all_gather_copies_every_owned_chunk_everywhere[3]",
            "test_all_gather_copies_every_owned_chunk_everywhere[4]",
        ],
        says=["passed on a chunk it had not received yet", "in step 1 it sent chunk"],
    ),
    Mistake(
        "all_gather_assumes_owner",
        replaces="ring_all_gather",
        fails=[
            "test_all_gather_copies_every_owned_chunk_everywhere[2]",
            "test_all_gather_copies_every_owned_chunk_everywhere[3]",
        ],
        says=["rank 0 was told it owns chunk 0", "use `owned` rather than assuming"],
    ),
    Mistake(
        "ring_allreduce_world_of_one_returns_none",
        replaces="ring_allreduce",
        fails=["test_ring_allreduce_equals_all_reduce[1]"],
        says=["it returned None", "also when there is nothing to send"],
    ),
    Mistake(
        "ring_allreduce_on_torch_chunk",
        replaces="ring_allreduce",
        fails=["test_ring_allreduce_equals_all_reduce[2]"],
        says=["raised IndexError", "torch.chunk(t, n) returns FEWER than n pieces"],
    ),
    Mistake(
        "ring_allreduce_sends_before_its_loop",
        replaces="ring_allreduce",
        fails=["test_ring_allreduce_equals_all_reduce[1]"],
        says=["a rank sent to (or received from) itself", "with world_size 1 the ring must not"],
    ),
    Mistake(
        "ring_allreduce_from_a_zeroed_buffer",
        replaces="ring_allreduce",
        fails=[
            "test_ring_allreduce_equals_all_reduce[2]",
            "test_ring_allreduce_equals_all_reduce[4]",
        ],
        says=[
            "holds zeros (no rank's value)",
            "sent held only zeros",
            "never reached what the ring sends",
        ],
    ),
    Mistake(
        "ring_allreduce_padded_to_equal_chunks",
        replaces="ring_allreduce",
        fails=["test_ring_allreduce_sends_two_n_minus_one_over_n"],  # on every world
        says=[
            "the tensor was padded to N = ",
            "the padding travelled with it",
            "right elsewhere",
            "so that only the tensor's own elements travel",
        ],
    ),
]

# Each right answer must pass every test of its step.
RIGHT_ANSWERS = [
    RightAnswer("bounds_from_tensor_split", replaces="chunk_bounds"),
    RightAnswer("even_ranks_send_first", replaces="_send_right_receive_left"),
    RightAnswer("exchange_with_batch_isend_irecv", replaces="_send_right_receive_left"),
    RightAnswer("reduce_scatter_with_copies", replaces="ring_reduce_scatter"),
    RightAnswer("all_gather_through_a_buffer", replaces="ring_all_gather"),
    RightAnswer("ring_allreduce_in_one_loop", replaces="ring_allreduce"),
    RightAnswer("ring_allreduce_on_tensor_split", replaces="ring_allreduce"),
]
