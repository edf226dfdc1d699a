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

    Pipelining (what gloo and NCCL do, and the reference; your ring need not). In one step as
    above a rank waits for the whole chunk, then adds it, then sends it on: nothing travels
    while it adds, and it adds nothing while the chunk travels. Cut each chunk into slices
    (``_slicing``: ``SLICE_BYTES`` each) and post the recv of the next slice before adding this
    one: gloo's own thread receives slice j+1 while the rank adds slice j, and each slice
    travels on as soon as it is summed. The all-gather posts every recv at once, straight into
    place, and passes each slice on the moment it arrives.

        whole chunks:  recv chunk ......... | add ..... | send it on (next step) ...
        in slices:     recv s0 | recv s1 | recv s2 | recv s3
                                 add s0  | add s1  | add s2  | add s3
                                           send s0 | send s1 | send s2 | send s3

    Each element is added in the same order as before (the same bits); only the timing
    changes. The overlap needs a core to spare: over loopback a message is copied by the CPU
    too, so with 4 ranks on a 2-core laptop every core is busy already (the benchmark's CPU
    column shows more CPU seconds than wall seconds) and slices gain little there. With a core
    per rank, or a real network, the wire and the adds run at once: that is why gloo and NCCL
    slice (``python -m benchmarks.allreduce --impl solutions``; ``dojo solution k09`` shows the
    code once you have passed).

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
    closely for floats) on 1 to 4 ranks, for lengths that do not divide by the world size,
    lengths below it and a gradient-sized one (600,001 elements); that the optimal ring gives bitwise identical results on every rank and
    the pass-along ring, as the lesson says, does not; how many elements each rank sends
    ((N-1) tensors, then 2(N-1)/N of one); that no collective is called; that the tensor
    passed in holds the sum (in place, like ``dist.all_reduce``).

RUN IT
    .venv/bin/python -m katas.k09_ring_allreduce --world-size 4
    .venv/bin/python -m benchmarks.allreduce          # your ring against gloo's all_reduce, 4 KB to 64 MB
    .venv/bin/python -m dojo trace k09                # your ring as a timeline: traces/k09/*.png and .json

    The timeline draws one lane per rank and one bar per torch.distributed call, an arrow from
    each send to its recv, and above the calls a strip per part of the program (the program
    names them with torch.profiler.record_function): the pass-along ring, the reduce-scatter's
    N-1 steps, the all-gather's, then dist.all_reduce. A thin bar after an isend or irecv is
    the message still in flight, until its wait(); white gaps are where a rank adds chunks or
    waits. The reference's is docs/timelines/k09_ring_allreduce.png; open the .json in
    https://ui.perfetto.dev (or chrome://tracing) to zoom into single calls and follow arrows.
"""

from __future__ import annotations

import argparse
import contextlib

import torch
import torch.distributed as dist
from torch.profiler import record_function

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


# The pipelined ring's slices (see PIPELINING in the lesson): about this many bytes each.
SLICE_BYTES = 1 << 20


def _slicing(bounds: list[tuple[int, int]], element_size: int) -> list[list[tuple[int, int]]]:
    """Each chunk's ``(start, stop)`` cut into the same number of slices of at most about
    ``SLICE_BYTES``: every rank cuts every chunk alike, so each slice sent has its recv."""
    longest = bounds[0][1] - bounds[0][0]
    parts = max(1, -(-longest * element_size // SLICE_BYTES))
    return [
        [(start + a, start + b) for a, b in chunk_bounds(stop - start, parts)]
        for start, stop in bounds
    ]


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
    # Each part is named (torch's record_function) for `dojo trace k09`'s timeline: a labelled
    # strip above the calls it made. The ring runs as its two halves to show both.
    results = {}
    with _count_sent_elements() as sent, record_function("pass-along ring"):
        results["pass-along"] = pass_along_allreduce(mine.clone()).cpu()
    sent_by = {"pass-along": sent[0]}
    ring = mine.clone()
    with _count_sent_elements() as sent:
        with record_function("ring: reduce-scatter"):
            owned = ring_reduce_scatter(ring)
        with record_function("ring: all-gather"):
            results["ring"] = ring_all_gather(ring, owned).cpu()
    sent_by["ring"] = sent[0]
    for name, total in results.items():
        say(
            rank,
            f"{name:>10}: first sum {total[0].item():.9g}, sent {sent_by[name]} elements "
            f"= {sent_by[name] / length:.2f}x the tensor",
        )
    reference = mine.clone()
    with record_function("dist.all_reduce (the reference)"):
        dist.all_reduce(reference)
    results["dist.all_reduce"] = reference.cpu()
    return results


def _verdict(name: str, per_rank: list[dict]) -> str:
    """Whether every rank holds the same bits, and how far each rank's sum is from its
    dist.all_reduce's (the reference itself is compared with nothing)."""
    sums = [results[name] for results in per_rank]
    differing = sum(int((s != sums[0]).sum()) for s in sums[1:])
    text = f"{name:>15}: every rank holds the same bits: " + (
        "yes" if differing == 0 else f"NO ({differing} numbers differ from rank 0's)"
    )
    if name == "dist.all_reduce":
        return text + " (the reference the rings are compared with)"
    references = [results["dist.all_reduce"] for results in per_rank]
    close = all(torch.allclose(s, r, rtol=1e-5, atol=1e-3) for s, r in zip(sums, references))
    equal = sum(int((s == r).sum()) for s, r in zip(sums, references))
    largest = max(
        float((s - r).abs().max()) if s.numel() else 0.0 for s, r in zip(sums, references)
    )
    return (
        text + f"; close to dist.all_reduce: {'yes' if close else 'NO'} ({equal} of "
        f"{sum(s.numel() for s in sums)} numbers on all ranks bitwise equal to it, the largest "
        f"difference {largest:.3g})"
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Two rings against dist.all_reduce.")
    add_launch_arguments(parser)
    parser.add_argument("--length", type=int, default=1000, help="numbers per rank (default 1000)")
    args = parser.parse_args(argv)
    per_rank = launch_world(
        _demo, args.world_size, args.length, backend=args.backend, device=args.device
    )
    for name in ("pass-along", "ring", "dist.all_reduce"):
        say(None, _verdict(name, per_rank))
    return 0


if __name__ == "__main__":
    run_program(main)
