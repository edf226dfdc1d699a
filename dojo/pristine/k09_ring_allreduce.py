"""k09 · A ring all-reduce of your own: the pass-along ring, then the bandwidth-optimal ring.

THE IDEA
    ``dist.all_reduce`` leaves the sum of every rank's tensor on every rank. Here you build it
    from point-to-point calls only, on a ring: each rank sends to its right neighbour
    (rank + 1) and receives from its left neighbour (rank - 1), all at the same time.

        rank 0 --> rank 1 --> rank 2 --> rank 3 --.
          ^                                       |
          '---------------------------------------'

    The pass-along ring (the tutorial's ``allreduce``): every rank passes on the whole tensor it
    received last; after N-1 hops every rank has seen every tensor and added it to its sum.
    Each rank sends (N-1) whole tensors: 3x the tensor on 4 ranks, 7x on 8. It also adds in a
    different order on every rank (rank 2 computes x2 + x1 + x0 + x3, rank 0 computes
    x0 + x3 + x2 + x1), and float addition is not associative, so the ranks can disagree in
    the last bits: with x0 = 1e8, x1 = 1, x2 = -1e8 in float32 on 3 ranks, rank 0 ends with
    (1e8 + -1e8) + 1 = 1, ranks 1 and 2 with 0 (1e8 + 1 rounds back to 1e8). Replicas whose
    gradients differ by a bit drift apart.

    The bandwidth-optimal ring cuts the tensor into N chunks and moves chunks, not tensors:

        reduce-scatter: N-1 steps; in step s rank r sends chunk (r - s) % N and adds the chunk
        (r - s - 1) % N that arrives. Chunk c travels the ring once, gathering one addend at
        each rank, and ends fully summed on rank (c - 1) % N: rank r owns chunk (r + 1) % N.

                    chunk 0   chunk 1   chunk 2   chunk 3          (4 ranks: who holds each summed chunk)
            after:  rank 3    rank 0    rank 1    rank 2

        all-gather: N-1 more steps; in step s rank r sends chunk (owned - s) % N and stores
        the chunk (owned - s - 1) % N that arrives. Every summed chunk travels the ring once.

    Each rank sends 2(N-1) chunks, 2(N-1)/N of the tensor (1.5x on 4 ranks, never above 2x,
    however many ranks), and every chunk is summed on one rank only and then copied, so every
    rank holds the same bits. A tensor whose length does not divide by N gets chunks one
    element apart (10 elements on 4 ranks: 3, 3, 2, 2); one shorter than N has empty chunks,
    which nobody sends.

    Sending without deadlock (k07): every rank sends and receives at once, so post the send
    without waiting, then receive, then wait for the send:

        request = dist.isend(outgoing, right)
        dist.recv(incoming, left)
        request.wait()

    Call the point-to-point functions through the ``dist`` module (``dist.isend``,
    ``dist.recv``, ``dist.send``, ``dist.irecv``, ``dist.batch_isend_irecv``), not through
    names imported from it: the tests count what you send by wrapping ``dist.isend`` and
    ``dist.send``, and they stop you calling collectives (``dist.all_reduce`` and friends).

STEPS
    1. ``chunk_bounds(length, world_size)``: the ``(start, stop)`` of each rank's chunk, sizes
       as equal as possible, the larger ones first (``torch.tensor_split``'s rule).
    2. ``pass_along_allreduce(tensor)``: the tutorial's ring, in place.
    3. ``ring_reduce_scatter(tensor)``: the first half of the optimal ring; return the index of
       the chunk this rank now holds fully summed.
    4. ``ring_all_gather(tensor, owned)`` and ``ring_allreduce(tensor)``: the second half, and
       the two halves together.

WHAT THE TESTS CHECK
    The chunk arithmetic; that both rings equal ``dist.all_reduce`` (exactly for integers,
    closely for floats) on 1 to 4 ranks, for lengths that do not divide by the world size and
    lengths below it; that the optimal ring gives bitwise identical results on every rank and
    the pass-along ring, as the lesson says, does not; how many elements each rank sends
    ((N-1) tensors, then 2(N-1)/N of one); that no collective is called; that the tensor
    passed in holds the sum (in place, like ``dist.all_reduce``).

RUN IT
    python -m katas.k09_ring_allreduce --world-size 4
    python -m benchmarks.allreduce          # your ring against gloo's all_reduce, 4 KB to 64 MB
    python -m dojo trace k09                # your ring as a timeline: traces/k09/*.png and .json

    The timeline draws one lane per rank and one bar per torch.distributed call, an arrow from
    each send to its recv: the reduce-scatter's N-1 steps, then the all-gather's, each rank
    sending to rank + 1, and the white gaps where a rank adds chunks or waits. The reference's
    is docs/timelines/k09_ring_allreduce.png; open the .json in https://ui.perfetto.dev (or
    chrome://tracing) to zoom into single calls and follow the arrows.
"""

from __future__ import annotations

import argparse
import contextlib

import torch
import torch.distributed as dist

from dojo.console import run_program, say
from dojo.devices import rank_device
from dojo.launch import add_launch_arguments, launch_world
from dojo.todo import KataTodo


def chunk_bounds(length: int, world_size: int) -> list[tuple[int, int]]:
    """``(start, stop)`` of each of ``world_size`` chunks of ``length`` elements, in order.

    Sizes differ by at most one, the larger first: ``chunk_bounds(10, 4)`` is
    ``[(0, 3), (3, 6), (6, 8), (8, 10)]``; ``chunk_bounds(2, 4)`` is
    ``[(0, 1), (1, 2), (2, 2), (2, 2)]``.
    """
    # TODO: return world_size (start, stop) pairs, in order, that tile 0..length with no gap or
    # overlap (stop is exclusive, as in a slice): sizes differ by at most one, the larger first.
    # The tests compare every length from 0 to 3N+1 on 1 to 8 chunks with torch.tensor_split's
    # chunks; world_size < 1 or length < 0 must raise ValueError naming the bad argument.
    raise KataTodo("k09", 1, "the (start, stop) of each chunk")


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    """A 1-D view of ``tensor``: writing to it writes to ``tensor`` (so it must be contiguous)."""
    if not tensor.is_contiguous():
        raise ValueError("the ring works in place on a contiguous tensor: pass tensor.contiguous()")
    return tensor.view(-1)


def _send_right_receive_left(outgoing: torch.Tensor, incoming: torch.Tensor) -> None:
    """Send ``outgoing`` to the right neighbour while receiving ``incoming`` from the left one."""
    # TODO: every rank calls this at the same moment: send `outgoing` to the right neighbour
    # and fill `incoming` from the left one, without deadlocking, and return only once your send
    # has finished (its buffer is reused next). An empty tensor is neither sent nor received (the
    # neighbours work out the same sizes). The tests report a rank stuck in a send or recv, and
    # a dist.isend request that is never waited on.
    raise KataTodo("k09", 2, "send right while receiving from the left")


def pass_along_allreduce(tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` over all ranks in place by passing whole tensors around the ring."""
    # TODO: after N-1 hops of one whole tensor each, the tensor passed in holds the sum over
    # every rank, each rank's tensor counted once, changed in place and returned. Each rank adds
    # in the order things arrive, its own tensor first. The tests check the sums (integers
    # exactly), (N-1) x numel elements sent per rank, and that the lesson's 1e8, 1, -1e8 example
    # ends differently on different ranks.
    raise KataTodo("k09", 2, "the pass-along ring")


def ring_reduce_scatter(tensor: torch.Tensor) -> int:
    """Reduce-scatter ``tensor`` in place around the ring; return the chunk now fully summed here.

    Rank r ends owning chunk ``(r + 1) % world_size``; its other chunks hold partial sums.
    """
    # TODO: in N-1 steps, each sending one chunk (chunk_bounds) to the right, leave chunk
    # (rank + 1) % N of the tensor summed over every rank, and return that index; the other
    # chunks may hold partial sums. The tests check the owned chunk exactly (integers, lengths
    # 1 to 1001 on 2 to 4 ranks), the returned indices, N-1 chunks sent per rank, and show the
    # order of the chunks you sent when a sum is wrong.
    raise KataTodo("k09", 3, "reduce-scatter around the ring")


def ring_all_gather(tensor: torch.Tensor, owned: int) -> torch.Tensor:
    """Copy every rank's owned chunk to every rank, in place; this rank owns chunk ``owned``.

    The right neighbour must own chunk ``owned + 1`` (as ``ring_reduce_scatter`` leaves it).
    """
    # TODO: in N-1 steps, each sending one chunk to the right, give every rank every rank's
    # owned chunk, in place; each chunk arrives final, so nothing is added. Return tensor. The
    # tests hand out owned chunks other than (rank + 1) % N too, fill the rest with each rank's
    # own marker, and count (N-1) x length elements sent in all.
    raise KataTodo("k09", 4, "all-gather around the ring")


def ring_allreduce(tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` over all ranks in place: reduce-scatter, then all-gather."""
    # TODO: the tensor passed in holds the sum over every rank (in place, returned), with the
    # same bits on every rank, sending 2(N-1)/N of the tensor per rank, on 1 to 4 ranks.
    raise KataTodo("k09", 4, "reduce-scatter, then all-gather")


# ------------------------------------------------------------------------- the program


@contextlib.contextmanager
def _count_sent_elements():
    """Count the elements this rank sends through ``dist.isend`` (``dist.send`` uses it too)."""
    sent = [0]
    original = dist.isend

    def counting_isend(tensor, *args, **kwargs):
        sent[0] += tensor.numel()
        return original(tensor, *args, **kwargs)

    dist.isend = counting_isend
    try:
        yield sent
    finally:
        dist.isend = original


def _demo(rank: int, world_size: int, length: int) -> dict:
    device = rank_device()
    # Big and small numbers mixed: the order of the additions shows in the last bits.
    generator = torch.Generator().manual_seed(rank)
    mine = (torch.randn(length, generator=generator) * 10.0 ** (3 * (rank % 3))).to(device)
    say(rank, f"holds {length} numbers, the first {mine[0].item():.9g}")
    results = {}
    for name, ring in (("pass-along", pass_along_allreduce), ("ring", ring_allreduce)):
        with _count_sent_elements() as sent:
            total = ring(mine.clone())
        results[name] = total.cpu()
        say(
            rank,
            f"{name:>10}: first sum {total[0].item():.9g}, sent {sent[0]} elements "
            f"= {sent[0] / length:.2f}x the tensor",
        )
    reference = mine.clone()
    dist.all_reduce(reference)
    results["dist.all_reduce"] = reference.cpu()
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Two rings against dist.all_reduce.")
    add_launch_arguments(parser)
    parser.add_argument("--length", type=int, default=1000, help="numbers per rank (default 1000)")
    args = parser.parse_args(argv)
    per_rank = launch_world(
        _demo, args.world_size, args.length, backend=args.backend, device=args.device
    )
    for name in ("pass-along", "ring", "dist.all_reduce"):
        sums = [results[name] for results in per_rank]
        agree = all(torch.equal(s, sums[0]) for s in sums)
        close = torch.allclose(sums[0], per_rank[0]["dist.all_reduce"], rtol=1e-5, atol=1e-3)
        differing = sum(int((s != sums[0]).sum()) for s in sums[1:])
        say(
            None,
            f"{name:>15}: every rank holds the same bits: {'yes' if agree else 'NO'}"
            + ("" if agree else f" ({differing} numbers differ from rank 0's)")
            + f"; close to dist.all_reduce: {'yes' if close else 'NO'}",
        )
    return 0


if __name__ == "__main__":
    run_program(main)
