"""k09 ring all-reduce: the chunk arithmetic, the pass-along ring, the bandwidth-optimal ring.

Inside each rank the learner's functions run while ``dist.send``/``dist.isend`` are wrapped to
count the elements sent, and the collectives are replaced by functions that fail: the kata is
to build all-reduce from point-to-point calls alone.
"""

import contextlib
import functools
import threading

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from dojo.impl import load_kata
from dojo.testing import run_program

KATA = "k09_ring_allreduce"
DEADLINE_S = 10.0  # a ring that deadlocks ends as a stuck-rank report, not a hang
# Lengths that do and do not divide by the world size, and lengths below it.
LENGTHS = (1, 2, 3, 5, 10, 12, 1001)
COUNTED = (
    "(sends are counted by wrapping dist.isend and dist.send: call them through the dist module, "
    "not as names imported from it)"
)
COLLECTIVES = (
    "all_reduce",
    "reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "gather",
    "scatter",
)


# ------------------------------------------------------------------ helpers shared by ranks and tests


def expected_bounds(length, world_size):
    """The chunks of torch.tensor_split: sizes differ by at most one, the larger first."""
    sizes = [len(c) for c in torch.arange(length).tensor_split(world_size)]
    starts = [sum(sizes[:i]) for i in range(world_size)]
    return [(s, s + n) for s, n in zip(starts, sizes)]


def make_input(rank, length, dtype, shape=None):
    """What rank ``rank`` holds: integers, plain floats, or floats of very different sizes."""
    generator = torch.Generator().manual_seed(1000 * rank + length)
    if dtype == "int64":
        data = torch.randint(-1000, 1000, (length,), generator=generator)
    elif dtype == "float32":
        data = torch.randn(length, generator=generator)
    else:  # "mixed": 1, 1e3, 1e6 by rank, where the order of additions shows in the last bits
        data = torch.randn(length, generator=generator) * 10.0 ** (3 * (rank % 3))
    return data.reshape(shape) if shape else data


@contextlib.contextmanager
def watching_sends():
    """Count the elements this rank sends, and make every collective fail, inside the block."""
    sent = {"elements": 0, "messages": 0}
    inside = threading.local()  # dist.send calls dist.isend in some torch versions: count once
    patched = []

    def patch(name, replacement):
        for module in (dist, c10d):
            if hasattr(module, name):
                patched.append((module, name, getattr(module, name)))
                setattr(module, name, replacement)

    def counting(original):
        def send(tensor, *args, **kwargs):
            if not getattr(inside, "active", False):
                sent["elements"] += tensor.numel()
                sent["messages"] += 1
            inside.active = True
            try:
                return original(tensor, *args, **kwargs)
            finally:
                inside.active = False

        return send

    def forbidden(name):
        def collective(*args, **kwargs):
            raise AssertionError(
                f"the ring called dist.{name}: build it from point-to-point calls only "
                "(dist.isend/dist.irecv/dist.send/dist.recv)"
            )

        return collective

    for name in ("send", "isend"):
        patch(name, counting(getattr(dist, name)))
    for name in COLLECTIVES:
        patch(name, forbidden(name))
    try:
        yield sent
    finally:
        for module, name, original in reversed(patched):
            setattr(module, name, original)


def _run_cases(rank, world_size, function_name, cases):
    """Run the learner's all-reduce on every case; return what each rank got and sent."""
    ring = getattr(load_kata(KATA), function_name)
    outcomes = []
    for length, dtype, shape in cases:
        mine = make_input(rank, length, dtype, shape)
        expected = mine.clone()
        dist.all_reduce(expected)
        given = mine.clone()
        with watching_sends() as sent:
            returned = ring(given)
        outcomes.append(
            {
                "case": (length, dtype, shape),
                "given": given,
                "expected": expected,
                "returned_given": returned is given,
                "sent": dict(sent),
            }
        )
    return outcomes


def _cases():
    cases = [(n, dtype, None) for n in LENGTHS for dtype in ("int64", "float32", "mixed")]
    return cases + [(21, "int64", (3, 7))]


@functools.cache
def world_outcomes(function_name, world_size):
    """Every case on one world (a world costs ~0.2 s); tests of the same ring share it.

    A failure is not cached, so each test that needs a failed world reports it.
    """
    from dojo.world import run_world

    return run_world(_run_cases, world_size, function_name, _cases(), deadline=DEADLINE_S)


def _describe(case):
    length, dtype, shape = case
    what = {"int64": "integers", "float32": "floats", "mixed": "floats of mixed sizes"}[dtype]
    return f"a tensor of shape {tuple(shape)}" if shape else f"{length} {what}"


def check_sums(outcomes_by_rank, name):
    """Every rank holds dist.all_reduce's answer: exactly for integers, closely for floats."""
    for rank, outcomes in enumerate(outcomes_by_rank):
        for outcome in outcomes:
            got, expected, (_, dtype, _) = outcome["given"], outcome["expected"], outcome["case"]
            where = f"{name} on rank {rank} with {_describe(outcome['case'])}"
            assert got.shape == expected.shape and got.dtype == expected.dtype, (
                f"{where}: the tensor became {got.dtype} of shape {tuple(got.shape)}, expected it "
                f"to stay {expected.dtype} of shape {tuple(expected.shape)}"
            )
            if dtype == "int64":
                wrong = (got != expected).nonzero().flatten()
                ok = len(wrong) == 0
            else:
                # Sums in another order differ in the last bits only (scaled by the addends' size).
                scale = 1.0 if dtype == "float32" else 1e6
                close = torch.isclose(got, expected, rtol=1e-5, atol=1e-5 * scale)
                wrong = (~close).nonzero().flatten()
                ok = len(wrong) == 0
            if not ok:
                i = int(wrong[0])
                flat_got, flat_expected = got.reshape(-1), expected.reshape(-1)
                raise AssertionError(
                    f"{where}: element {i} holds {flat_got[i].item()!r}, dist.all_reduce gives "
                    f"{flat_expected[i].item()!r} ({len(wrong)} of {got.numel()} elements wrong). "
                    "Does the sum work in place on the tensor passed in, and does every rank's "
                    "tensor reach every other rank?"
                )
            assert outcome["returned_given"], (
                f"{where}: return the tensor you were given (it holds the sum, in place, like "
                "dist.all_reduce), not a new one"
            )


# ------------------------------------------------------------------ step 1: chunk arithmetic


@pytest.mark.step(1)
@pytest.mark.parametrize(
    "length, world_size, expected",
    [
        (10, 4, [(0, 3), (3, 6), (6, 8), (8, 10)]),
        (8, 4, [(0, 2), (2, 4), (4, 6), (6, 8)]),
        (2, 4, [(0, 1), (1, 2), (2, 2), (2, 2)]),
        (0, 3, [(0, 0), (0, 0), (0, 0)]),
        (7, 1, [(0, 7)]),
    ],
)
def test_chunk_bounds_examples(kata, length, world_size, expected):
    got = kata.chunk_bounds(length, world_size)
    assert [tuple(b) for b in got] == expected, (
        f"chunk_bounds({length}, {world_size}) returned {got!r}, expected {expected}: "
        "chunk sizes differ by at most one, the larger chunks first"
    )


@pytest.mark.step(1)
def test_chunk_bounds_cover_every_length(kata):
    for world_size in range(1, 9):
        for length in range(0, 3 * world_size + 2):
            got = [tuple(b) for b in kata.chunk_bounds(length, world_size)]
            expected = expected_bounds(length, world_size)
            assert got == expected, (
                f"chunk_bounds({length}, {world_size}) returned {got}, expected {expected} "
                f"(torch.tensor_split's chunks): {world_size} chunks, in order, covering 0..{length}"
            )


@pytest.mark.step(1)
@pytest.mark.parametrize("length, world_size", [(10, 0), (-1, 2)])
def test_chunk_bounds_rejects_bad_input(kata, length, world_size):
    with pytest.raises(ValueError):
        kata.chunk_bounds(length, world_size)


# ------------------------------------------------------------------ step 2: the pass-along ring


@pytest.mark.step(2)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_pass_along_equals_all_reduce(kata, world_size):
    by_rank = world_outcomes("pass_along_allreduce", world_size)
    check_sums(by_rank, "pass_along_allreduce")
    for rank, outcomes in enumerate(by_rank):
        for outcome in outcomes:
            numel = outcome["given"].numel()
            sent = outcome["sent"]["elements"]
            assert sent == (world_size - 1) * numel, (
                f"pass_along_allreduce on rank {rank} of {world_size} with "
                f"{_describe(outcome['case'])} sent {sent} elements, expected {world_size - 1} "
                f"whole tensors = {(world_size - 1) * numel}: pass the whole tensor on at each of "
                f"the N-1 hops {COUNTED}"
            )


def _three_ranks_cancel(rank, world_size):
    ring = load_kata(KATA).pass_along_allreduce
    mine = torch.tensor([[1e8, 1.0, -1e8][rank]], dtype=torch.float32)
    with watching_sends():
        ring(mine)
    return mine.item()


@pytest.mark.step(2)
def test_pass_along_ranks_disagree_in_the_last_bits(world):
    """The lesson's example: 1e8, 1 and -1e8 summed in a different order on each rank."""
    got = world.run(_three_ranks_cancel, 3, deadline=DEADLINE_S)
    assert all(value in (0.0, 1.0) for value in got), (
        f"ranks 0, 1, 2 holding 1e8, 1, -1e8 (float32) ended with {got}: any order of these "
        "additions gives 0 or 1"
    )
    assert len(set(got)) > 1, (
        f"every rank ended with {got[0]}: the pass-along ring adds in a different order on each "
        "rank (its own tensor first, then each arrival), so float rounding should make the ranks "
        "disagree here. Each rank should start from its own tensor and add what arrives from its "
        "left neighbour, hop by hop"
    )


# ------------------------------------------------------------------ step 3: reduce-scatter


def _reduce_scatter(rank, world_size, lengths):
    kata = load_kata(KATA)
    outcomes = []
    for length in lengths:
        mine = make_input(rank, length, "int64")
        expected = mine.clone()
        dist.all_reduce(expected)
        given = mine.clone()
        with watching_sends() as sent:
            owned = kata.ring_reduce_scatter(given)
        outcomes.append(
            {
                "length": length,
                "owned": owned,
                "given": given,
                "expected": expected,
                "sent": sent["elements"],
            }
        )
    return outcomes


@pytest.mark.step(3)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_reduce_scatter_leaves_one_summed_chunk_per_rank(world, world_size):
    by_rank = world.run(_reduce_scatter, world_size, LENGTHS, deadline=DEADLINE_S)
    for i, length in enumerate(LENGTHS):
        bounds = expected_bounds(length, world_size)
        owners = [outcomes[i]["owned"] for outcomes in by_rank]
        assert sorted(owners) == list(range(world_size)), (
            f"with {length} elements on {world_size} ranks, ring_reduce_scatter returned the chunk "
            f"indices {owners} (rank 0 first): every chunk must end summed on exactly one rank, so "
            f"each of 0..{world_size - 1} once"
        )
        for rank, outcomes in enumerate(by_rank):
            outcome = outcomes[i]
            start, stop = bounds[outcome["owned"]]
            got, expected = outcome["given"][start:stop], outcome["expected"][start:stop]
            assert torch.equal(got, expected), (
                f"with {length} integers on {world_size} ranks, rank {rank} says it owns chunk "
                f"{outcome['owned']} (elements {start}..{stop - 1}), which holds {got.tolist()}, "
                f"but the sum over all ranks is {expected.tolist()}: add each arriving chunk into "
                "your own, and pass on the chunk you just summed"
            )
            low, high = (
                (world_size - 1) * (length // world_size),
                (world_size - 1) * -(-length // world_size),
            )
            assert low <= outcome["sent"] <= high, (
                f"with {length} elements on {world_size} ranks, rank {rank} sent {outcome['sent']} "
                f"elements in the reduce-scatter, expected N-1 = {world_size - 1} chunks "
                f"({low}..{high} elements): send one chunk per step, never the whole tensor"
            )
        total = sum(outcomes[i]["sent"] for outcomes in by_rank)
        assert total == (world_size - 1) * length, (
            f"with {length} elements on {world_size} ranks the reduce-scatter sent {total} elements "
            f"in all, expected (N-1) x {length} = {(world_size - 1) * length}: each chunk travels "
            f"N-1 hops {COUNTED}"
        )


# ------------------------------------------------------------------ step 4: all-gather, whole ring


def _all_gather(rank, world_size, cases):
    """Rank r owns chunk (r + shift) % N, holding its final value; the rest is garbage (-1)."""
    kata = load_kata(KATA)
    results = []
    for length, shift in cases:
        answer = torch.arange(length) * 10
        owned = (rank + shift) % world_size
        start, stop = expected_bounds(length, world_size)[owned]
        mine = torch.full((length,), -1)
        mine[start:stop] = answer[start:stop]
        with watching_sends() as sent:
            kata.ring_all_gather(mine, owned)
        results.append((mine, answer, sent["elements"]))
    return results


@pytest.mark.step(4)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_all_gather_copies_every_owned_chunk_everywhere(world, world_size):
    cases = [(10, 1), (10, 0), (5, 1), (3, 1)]
    by_rank = world.run(_all_gather, world_size, cases, deadline=DEADLINE_S)
    for i, (length, shift) in enumerate(cases):
        for rank, results in enumerate(by_rank):
            got, answer, _ = results[i]
            assert torch.equal(got, answer), (
                f"on {world_size} ranks with {length} elements, rank r owning chunk (r + {shift}) % "
                f"{world_size}, rank {rank} ended with {got.tolist()}, expected {answer.tolist()} "
                "(-1 marks a chunk that never arrived): send the chunk you own first, then pass on "
                "each chunk as it arrives, using `owned` rather than assuming which chunk it is"
            )
        total = sum(results[i][2] for results in by_rank)
        assert total == (world_size - 1) * length, (
            f"the all-gather of {length} elements on {world_size} ranks sent {total} elements in "
            f"all, expected (N-1) x {length} = {(world_size - 1) * length}: each owned chunk "
            f"travels N-1 hops, once {COUNTED}"
        )


@pytest.mark.step(4)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_ring_allreduce_equals_all_reduce(kata, world_size):
    by_rank = world_outcomes("ring_allreduce", world_size)
    check_sums(by_rank, "ring_allreduce")


@pytest.mark.step(4)
@pytest.mark.parametrize("world_size", [3, 4])
def test_ring_allreduce_is_bitwise_identical_on_every_rank(kata, world_size):
    by_rank = world_outcomes("ring_allreduce", world_size)
    for i, case in enumerate(_cases()):
        if case[1] != "mixed":
            continue
        first = by_rank[0][i]["given"]
        for rank in range(1, world_size):
            other = by_rank[rank][i]["given"]
            differ = (other != first).nonzero().flatten()
            assert len(differ) == 0, (
                f"ring_allreduce with {_describe(case)} on {world_size} ranks: rank {rank} and "
                f"rank 0 differ in {len(differ)} elements (element {int(differ[0])}: "
                f"{other[differ[0]].item()!r} vs {first[differ[0]].item()!r}). Each chunk should "
                "be summed on one rank only and then copied: is every rank adding on its own?"
            )


@pytest.mark.step(4)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ring_allreduce_sends_two_n_minus_one_over_n(kata, world_size):
    by_rank = world_outcomes("ring_allreduce", world_size)
    n = world_size
    for i, (length, _, _) in enumerate(_cases()):
        sent = [outcomes[i]["sent"]["elements"] for outcomes in by_rank]
        if length % n == 0:
            expected = 2 * (n - 1) * length // n
            assert sent == [expected] * n, (
                f"ring_allreduce of {length} elements on {n} ranks: the ranks sent {sent} elements, "
                f"expected 2(N-1)/N of the tensor = {expected} each (N-1 chunks of {length // n} in "
                "the reduce-scatter, N-1 more in the all-gather)"
            )
        low, high = 2 * (n - 1) * (length // n), 2 * (n - 1) * -(-length // n)
        assert all(low <= s <= high for s in sent) and sum(sent) == 2 * (n - 1) * length, (
            f"ring_allreduce of {length} elements on {n} ranks: the ranks sent {sent} elements; "
            f"each should send 2(N-1) chunks ({low}..{high} elements), {2 * (n - 1) * length} in all "
            f"{COUNTED}"
        )


@pytest.mark.step(4)
def test_program_shows_both_rings(kata):
    """`python -m katas.k09_ring_allreduce`: both rings against dist.all_reduce."""
    result = run_program(KATA, "--world-size", "3", "--length", "200", timeout=90)
    assert result.returncode == 0, (
        f"the program failed (exit {result.returncode}):\n{result.stderr}"
    )
    lines = result.stdout.splitlines()
    for name in ("pass-along", "ring"):
        verdict = next(
            (line for line in lines if line.startswith("[main]") and f" {name}:" in line), None
        )
        assert verdict is not None, f"no verdict line for the {name} ring in:\n{result.stdout}"
        assert "close to dist.all_reduce: yes" in verdict, (
            f"the {name} ring's sum is wrong:\n{verdict}"
        )
    ring_line = next(line for line in lines if line.startswith("[main]") and " ring:" in line)
    assert "same bits: yes" in ring_line, (
        f"the optimal ring must agree bitwise on every rank:\n{ring_line}"
    )
