"""k07 · Point-to-point: send and recv, isend and irecv, batch_isend_irecv.

THE IDEA
    A collective involves every rank; a point-to-point message involves two. One rank calls
    ``dist.send(tensor, dst)``, and ``dst`` calls ``dist.recv(buffer, src)`` into a buffer of
    the same shape and dtype that it allocated beforehand. Both calls *block*: ``send`` returns
    once the receiver has taken the data (gloo waits for the matching ``recv``), ``recv`` once
    the data is in the buffer. Ping-pong between two ranks:

        rank 0                      rank 1
        send(0)  ------------->     recv -> 0
        recv -> 1  <-----------     send(0 + 1)
        send(1 + 1) ---------->     recv -> 2         ... and so on

    Blocking calls need an order both sides agree on. A token passed round a ring is easy:
    rank 0 sends first and every other rank receives first, so the token travels one hop at
    a time:  0 -> 1 -> 2 -> 3 -> 0.

    A *shift*, where every rank passes its own tensor to its right neighbour at the same time,
    is where blocking calls bite. "Everyone sends first, then receives" deadlocks:

        rank 0: send -> 1 ...waits for rank 1 to recv      rank 1 is in send -> 2
        rank 1: send -> 2 ...waits for rank 2 to recv      rank 2 is in send -> 3
        rank 2: send -> 3 ...                              ...
        rank 3: send -> 0 ...waits for rank 0 to recv      rank 0 is in send: a cycle

    (Some transports buffer *small* messages, MPI's "eager" sends for one, so the naive shift
    can pass a quick test and hang on real tensors; gloo waits for the receiver at any size.)
    Ways out: even ranks send first while odd ranks receive first (an order that always has a
    receiver ready), or the non-blocking calls. ``dist.isend`` and ``dist.irecv`` return at
    once with a request; ``request.wait()`` blocks until that message is done. Post both, then
    wait on both, and no rank is ever stuck in a send while its neighbour is stuck in one too.

    Non-blocking has one rule: the buffer of an ``irecv`` holds nothing useful until ``wait()``
    has returned (and the tensor of an ``isend`` must not be changed before its ``wait()``).
    Between posting and waiting is where a rank gets to do other work: that is the point.

        irecv(buf) ---- work() ---- wait() ---- read buf
                   ^ the data arrives somewhere in here

    ``dist.batch_isend_irecv([P2POp(dist.isend, t, peer), P2POp(dist.irecv, b, peer), ...])``
    posts many operations in one go and returns their requests. A *halo exchange* sends a
    strip's first element to the left neighbour and its last element to the right one, and
    receives the neighbours' edges in return (stencil codes do this every step):

        rank 0 [0 1 2]    rank 1 [10 11 12]    rank 2 [20 21 22]      (a ring of 3)
        after:  22 | 0 1 2 | 10     2 | 10 11 12 | 20     12 | 20 21 22 | 0

    On a ring of two ranks the left and the right neighbour are the same rank, and two
    messages travel each way between the same pair: give each direction its own ``tag`` so
    that the receiver cannot mix them up.

STEPS
    1. ``ping_pong``: ranks 0 and 1 bat a counter back and forth with ``send``/``recv``.
    2. ``token_ring``: one token round the ring with ``send``/``recv``; who goes first?
    3. ``shift_right``: every rank passes its tensor right, all at once, with
       ``isend``/``irecv`` and ``wait``, without deadlock.
    4. ``receive_while_working``: post an ``irecv``, do other work, and read the buffer only
       after ``wait()``.
    5. ``halo_exchange``: four operations in one ``batch_isend_irecv``, tags to tell the two
       directions apart.

WHAT THE TESTS CHECK
    Exact values on every rank for worlds of 2, 3 and 4 ranks. ``shift_right`` moves 8 MB
    per rank, more than a transport buffers, so a shift that can deadlock does, and the
    test proves it by running the naive "send, then recv" shift next to yours: the naive one
    must end as the harness's deadlock report, yours must finish. ``receive_while_working``
    faces a sender that starts only once your work has begun and then dawdles for 0.3 s, so
    a buffer read before ``wait()`` still holds its zeros. ``halo_exchange`` must use
    ``batch_isend_irecv`` and get both edges right on a ring of two. Bad arguments (a world of
    one rank, zero rounds, an empty strip) raise ``ValueError``.

RUN IT
    .venv/bin/python -m katas.k07_point_to_point --world-size 4
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from dojo.console import run_program, say
from dojo.launch import add_launch_arguments, launch_world
from dojo.todo import KataTodo

# Tags tell apart messages that travel between the same two ranks (halo_exchange on 2 ranks).
TAG_TO_LEFT = 1
TAG_TO_RIGHT = 2


def _ring_position(need: int, what: str) -> tuple[int, int]:
    """This rank and the world size, refusing worlds too small for ``what``."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if world_size < need:
        raise ValueError(
            f"{what} needs a world of at least {need} ranks, this one has {world_size}"
        )
    return rank, world_size


def ping_pong(rounds: int, device: torch.device | str = "cpu") -> list[int]:
    """Ranks 0 and 1 bat a counter back and forth ``rounds`` times; other ranks sit out.

    Rank 0 serves 0. Whoever receives the counter adds 1 and sends it back, so rank 1
    receives 0, 2, 4, ... and rank 0 receives 1, 3, 5, ... Returns the values this rank
    received, in order (``[]`` on ranks 2 and up). Use blocking ``send`` and ``recv`` on a
    one-element int64 tensor on ``device``.
    """
    rank, _ = _ring_position(2, "ping-pong")
    if rounds < 1:
        raise ValueError(f"ping-pong needs at least one round, got rounds={rounds}")
    if rank > 1:
        return []
    # TODO: ranks 0 and 1 bat the counter back and forth `rounds` times with blocking send and
    #   recv, rank 0 serving first. Return what this rank received, as Python ints in the order
    #   they arrived. The tests expect [1, 3, 5] on rank 0 and [0, 2, 4] on rank 1 after 3
    #   rounds, no message at all from ranks 2 and up, and no deadlock.
    raise KataTodo("k07", 1, "ping-pong with send and recv")


def token_ring(token: int, device: torch.device | str = "cpu") -> int:
    """Pass one token round the ring 0 -> 1 -> ... -> N-1 -> 0 with blocking send/recv.

    Rank 0 starts with ``token``. Every rank, when the token reaches it, adds ``rank + 1`` and
    passes it to its right neighbour; rank 0 adds its 1 before the first send and then
    receives the token back at the end. Returns the value this rank received: on rank r > 0,
    ``token + 1 + 2 + ... + r``; on rank 0, the token after the whole round.
    """
    rank, world_size = _ring_position(2, "a token ring")
    # TODO: the token goes once round the ring, one hop at a time, rightwards, with blocking
    #   send and recv, and grows by rank + 1 at each rank. Return what reached this rank. The
    #   tests check every rank's value in rings of 2, 3 and 4 ranks (including the two ends of
    #   the ring), that each rank makes one recv and one send, and that nothing deadlocks.
    raise KataTodo("k07", 2, "a token round the ring with send and recv")


def shift_right(tensor: torch.Tensor) -> torch.Tensor:
    """Every rank sends ``tensor`` to its right neighbour and returns its left neighbour's.

    All ranks do this at the same time, so blocking calls in the order "send, then recv" can
    deadlock: post ``isend`` and ``irecv`` first, then ``wait()`` on both requests.
    """
    rank, world_size = _ring_position(2, "a ring shift")
    # TODO: return the left neighbour's tensor (same shape and dtype) and leave `tensor` as it
    #   was. The tests shift 8 MB per rank, so an order in which every rank can sit in a blocking
    #   send deadlocks, and they check that every request you post is waited on before you
    #   return.
    raise KataTodo("k07", 3, "shift right with isend, irecv and wait")


def receive_while_working(
    source: int, buffer: torch.Tensor, work: Callable[[], Any]
) -> tuple[torch.Tensor, Any]:
    """Receive into ``buffer`` from ``source`` while calling ``work()``; return both results.

    Post a non-blocking ``irecv``, call ``work()`` while the message travels, then ``wait()``
    before the buffer is used: ``(buffer, work's result)``.
    """
    # TODO: the message must travel while work() runs, and `buffer` must hold it when this
    #   function returns. The test's sender starts only once work() has begun, and sends only
    #   when you wait for the message: a receive that blocks before work(), a buffer read
    #   before the receive has completed, or a request never waited on, all fail.
    raise KataTodo("k07", 4, "irecv, work, then wait before reading")


def halo_exchange(strip: torch.Tensor) -> torch.Tensor:
    """This rank's 1-D ``strip`` with its neighbours' edges around it (a periodic ring).

    Send ``strip[0]`` to the left neighbour and ``strip[-1]`` to the right one; receive the
    left neighbour's last element and the right neighbour's first, all four operations in one
    ``dist.batch_isend_irecv``. Returns ``[left's last, *strip, right's first]``.
    """
    rank, world_size = _ring_position(2, "a halo exchange")
    if strip.dim() != 1 or strip.numel() == 0:
        raise ValueError(
            f"halo_exchange needs a non-empty 1-D strip, got shape {tuple(strip.shape)}"
        )
    # TODO: return [left neighbour's last, *strip, right neighbour's first] and leave `strip`
    #   as it was. The four messages go out in one dist.batch_isend_irecv, every request is
    #   waited on, and each message carries the tag of the direction it travels (TAG_TO_LEFT,
    #   TAG_TO_RIGHT): the tests run rings of 2, 3 and 4, and on a ring of two both neighbours
    #   are the same rank.
    raise KataTodo("k07", 5, "a halo exchange with batch_isend_irecv")


# ------------------------------------------------------------------------------ the program


def _say_in_rank_order(rank: int, world_size: int, text: str | None) -> None:
    """Print ``text`` (None: nothing) once every lower rank has printed its line."""
    for turn in range(world_size):
        dist.barrier()
        if turn == rank and text is not None:
            say(rank, text)


def show(rank: int, world_size: int) -> None:
    """What each rank of the program does: four exchanges, each printed in rank order."""
    from dojo.devices import rank_device

    device = rank_device()
    received = ping_pong(3, device)
    _say_in_rank_order(rank, world_size, f"ping-pong: received {received}" if rank < 2 else None)
    got = token_ring(100, device)
    how = "got the token back as" if rank == 0 else "received the token as"
    _say_in_rank_order(rank, world_size, f"token ring: {how} {got}")
    mine = torch.full((2,), rank, device=device)
    _say_in_rank_order(
        rank,
        world_size,
        f"shift right: sent {mine.tolist()}, received {shift_right(mine).tolist()}",
    )
    strip = torch.arange(3, device=device) + 10 * rank
    _say_in_rank_order(
        rank, world_size, f"halo exchange: {strip.tolist()} -> {halo_exchange(strip).tolist()}"
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description="Ping-pong, a token ring, a ring shift and a halo exchange."
    )
    add_launch_arguments(parser)
    args = parser.parse_args(argv)
    if args.world_size < 2:
        parser.error("point-to-point needs at least two ranks: use --world-size 2 or more")
    launch_world(show, args.world_size, backend=args.backend, device=args.device)
    say(None, f"{args.world_size} ranks exchanged messages point to point, and none deadlocked")
    return 0


if __name__ == "__main__":
    run_program(main)
