"""k27 interleaved and zero-bubble pipelines: virtual stages, the schedules as data, the clock,
run_schedule with tagged messages, the backward split into B and W."""

from __future__ import annotations

import functools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dojo.harness.calls import recording
from dojo.harness.impl import load_kata
from dojo.harness.world import RankFailed, WorldDeadlock, run_world
from dojo.spec import pipelines
from dojo.spec.cuda import on_cuda, rank_gpu
from dojo.spec.testing import run_module_ok, shared_run
from dojo.todo import KataTodo
from dojo.toy_models import make_tokens, make_transformer, transformer_loss

KATA = "k27_interleaved_pipeline"
PER_MICRO_BATCH = 2  # sequences per micro-batch
DEADLINE = 20
# torch's schedules add the unscaled micro-batch gradients and divide by m at the end
TORCH = {"rtol": 1e-5, "atol": 1e-7}


def _refuses(call: str, fn, *args, why: str) -> None:
    try:
        got = fn(*args)
    except ValueError:
        return
    except KataTodo:
        raise
    except Exception as error:
        raise AssertionError(f"{call} raised {type(error).__name__}: {error}; {why}") from None
    raise AssertionError(f"{call} returned {got!r}: {why}")


# --------------------------------------------------------------------------- step 1


@pytest.mark.step(1)
def test_virtual_stage_is_looped(kata):
    for p in (1, 2, 4):
        for c in range(3):
            for r in range(p):
                got = kata.virtual_stage(p, c, r)
                assert got == c * p + r, (
                    f"virtual_stage(stages={p}, chunk={c}, rank={r}) returned {got}, expected "
                    f"{c * p + r}: the placement is looped, chunk c of rank r is virtual stage "
                    "c * p + r (rank 0 holds stages 0, p, 2p, ...), not r * v + c"
                )


def _expected_names(model, p, v, r, c) -> set[str]:
    pieces = p * v
    size = len(model.blocks) // pieces
    s = c * p + r
    prefixes = [f"blocks.{i}." for i in range(s * size, (s + 1) * size)]
    if s == 0:
        prefixes.append("embedding.")
    if s == pieces - 1:
        prefixes += ["norm.", "output."]
    return {n for n, _ in model.named_parameters() if any(n.startswith(x) for x in prefixes)}


def _blocks(names) -> list[int]:
    return sorted({int(n.split(".")[1]) for n in names if n.startswith("blocks.")})


@pytest.mark.step(1)
@pytest.mark.parametrize(("p", "v"), [(2, 2), (4, 2), (2, 4), (2, 1), (1, 2)])
def test_split_chunks_gives_each_chunk_its_virtual_stage(kata, p, v):
    model = make_transformer(0, 8)
    own = {id(q): n for n, q in model.named_parameters()}
    seen: set[str] = set()
    for r in range(p):
        call = f"split_chunks(<TinyTransformer of 8 blocks>, stages={p}, chunks={v}, rank={r})"
        got = kata.split_chunks(model, p, v, r)
        assert isinstance(got, (list, tuple)) and len(got) == v, (
            f"{call} returned {got!r}: return a list of {v} Stages, chunk 0 first"
        )
        for c, chunk in enumerate(got):
            names = set()
            for name, param in chunk.named_parameters():
                assert own.get(id(param)) == name, (
                    f"{call}: chunk {c}'s {name} is not the model's own parameter of that name: "
                    "chunks hold the model's own modules (no copies), blocks keyed by their index "
                    "in the model"
                )
                names.add(name)
            want = _expected_names(model, p, v, r, c)
            if names != want:
                raise AssertionError(
                    f"{call}: chunk {c} holds the blocks {_blocks(names)}, expected "
                    f"{_blocks(want)} (virtual stage {c * p + r} of {p * v}): chunk c of rank r is "
                    "virtual stage c * p + r, each holding 8 / (p * v) consecutive blocks; the "
                    "embedding only on virtual stage 0, the norm and the output only on the last"
                    + (
                        f" (it has {sorted({n.split('.')[0] for n in names ^ want} - {'blocks'})} "
                        "wrong)"
                        if _blocks(names) == _blocks(want)
                        else ""
                    )
                )
            seen |= names
    missing = sorted({n for n, _ in model.named_parameters()} - seen)
    assert not missing, f"split over stages={p}, chunks={v}: no chunk holds {missing[:4]}"


@pytest.mark.step(1)
@pytest.mark.parametrize(("p", "v", "r"), [(2, 3, 0), (3, 1, 0), (2, 0, 0), (2, 2, 2), (16, 1, 0)])
def test_split_chunks_refuses_what_does_not_fit(kata, p, v, r):
    _refuses(
        f"split_chunks(<TinyTransformer of 8 blocks>, stages={p}, chunks={v}, rank={r})",
        kata.split_chunks,
        make_transformer(0, 8),
        p,
        v,
        r,
        why="raise ValueError: the 8 blocks must cut into p * v equal virtual stages (and a "
        "rank is between 0 and p - 1, chunks at least 1); say what to use instead",
    )


# --------------------------------------------------------------------------- step 2


def _orders(p, v, m, r, warm_up, zero_bubble):
    total = v * m
    warm = min(warm_up, total)
    forwards, backwards, pending, actions = [0] * v, [0] * v, [], []

    def forward(k):
        c = (k // p) % v
        actions.append(("F", c, forwards[c]))
        forwards[c] += 1

    def backward(k):
        c = v - 1 - (k // p) % v
        actions.append(("B", c, backwards[c]))
        pending.append((c, backwards[c]))
        backwards[c] += 1
        if zero_bubble and k >= r:
            actions.append(("W", *pending.pop(0)))

    for k in range(warm):
        forward(k)
    for k in range(total - warm):
        forward(warm + k)
        backward(k)
    for k in range(total - warm, total):
        backward(k)
    while zero_bubble and pending:
        actions.append(("W", *pending.pop(0)))
    return actions


def interleaved(p, v, m, r):
    return _orders(p, v, m, r, (v - 1) * p + 2 * (p - 1 - r), False)


def zero_bubble(p, v, m, r):
    return _orders(p, v, m, r, (v - 1) * p + (p - 1 - r), True)


def _as_actions(call, got):
    try:
        return [(str(k), int(c), int(i)) for k, c, i in got]
    except (TypeError, ValueError):
        raise AssertionError(
            f"{call} returned {got!r}: return a list of (kind, chunk, micro-batch)"
        ) from None


def _diagnose(call, got, want, p, v, m, r, kind):
    if sorted(got) != sorted(want):
        return (
            f"{call} returned {got}: each chunk 0..{v - 1} needs exactly one F and one B of every "
            f"micro-batch 0..{m - 1}"
            + (" and one W" if kind == "zb" else "")
            + f". Expected {want}"
        )
    forwards = [a for a in got if a[0] == "F"]
    if forwards != [a for a in want if a[0] == "F"]:
        return (
            f"{call}: its forwards run in the order {forwards[: 2 * p + 2]}..., expected "
            f"{[a for a in want if a[0] == 'F'][: 2 * p + 2]}...: forwards go in rounds of p = {p} "
            "micro-batches, chunk 0, then chunk 1, ... (the k-th forward is on chunk (k // p) % v)"
        )
    backwards = [a for a in got if a[0] == "B"]
    if backwards != [a for a in want if a[0] == "B"]:
        return (
            f"{call}: its backwards run in the order {backwards[: 2 * p + 2]}..., expected "
            f"{[a for a in want if a[0] == 'B'][: 2 * p + 2]}...: backwards also go in rounds of "
            "p micro-batches, but the chunks in reverse (the last chunk first: its gradient "
            "arrives first)"
        )
    first = next(k for k, a in enumerate(got) if a[0] == "B")
    expected_first = next(k for k, a in enumerate(want) if a[0] == "B")
    if kind == "interleaved" and first != expected_first:
        return (
            f"{call}: {first} forwards before the first backward, expected {expected_first}: the "
            "warm-up is (v - 1) * p + 2 * (p - 1 - rank) forwards (at most v * m), then one "
            "forward and one backward, the forward first"
        )
    if kind == "zb" and [a for a in got if a[0] != "W"] == [a for a in want if a[0] != "W"]:
        return (
            f"{call} returned {got}, expected {want}: its F and B are right, its W's are not. Each "
            "W is the oldest B's whose W has not run, right after a B, but rank r puts its first "
            "r off: they run at the end, after the last B"
        )
    return (
        f"{call} returned {got}, expected {want}: "
        + (
            "the warm-up is (v - 1) * p + 2 * (p - 1 - rank) forwards"
            if kind == "interleaved"
            else "the warm-up is (v - 1) * p + (p - 1 - rank) forwards"
        )
        + ", then one forward and one backward while forwards are left, then the backwards left"
    )


SHAPES = [(2, 2, 2), (2, 2, 4), (2, 3, 4), (4, 2, 4), (4, 2, 8), (3, 2, 6), (2, 2, 8)]


@pytest.mark.step(2)
def test_interleaved_actions_as_data(kata):
    for p, v, m in SHAPES:
        for r in range(p):
            call = f"interleaved_actions(stages={p}, chunks={v}, micro_batches={m}, rank={r})"
            got = _as_actions(call, kata.interleaved_actions(p, v, m, r))
            want = interleaved(p, v, m, r)
            if got != want:
                raise AssertionError(_diagnose(call, got, want, p, v, m, r, "interleaved"))


@pytest.mark.step(2)
@pytest.mark.parametrize(
    ("p", "v", "m", "r"), [(2, 2, 3, 0), (4, 2, 6, 1), (2, 1, 4, 0), (2, 2, 4, 2), (1, 2, 2, 0)]
)
def test_interleaved_actions_refuse_what_does_not_fit(kata, p, v, m, r):
    _refuses(
        f"interleaved_actions(stages={p}, chunks={v}, micro_batches={m}, rank={r})",
        kata.interleaved_actions,
        p,
        v,
        m,
        r,
        why="raise ValueError saying what to do: interleaving sends micro-batches in rounds of p "
        "(m a multiple of p), needs at least 2 chunks and 2 ranks, a rank between 0 and p - 1",
    )


def _torch_order(rank, world_size, name, v, m):
    from torch.distributed import pipelining

    stages = [
        pipelining.PipelineStage(
            torch.nn.Linear(2, 2), c * world_size + rank, world_size * v, "cpu"
        )
        for c in range(v)
    ]
    schedule = getattr(pipelining, name)(stages, m, loss_fn=transformer_loss)
    kinds = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "B", "BACKWARD_WEIGHT": "W"}
    return {
        r: [
            (kinds[a.computation_type.name], a.stage_index // world_size, a.microbatch_index)
            for a in actions
            if a is not None
        ]
        for r, actions in schedule.pipeline_order.items()
    }


def _against_torchs_order(kata, function, name, cases):
    pytest.importorskip("torch.distributed.pipelining", reason="no torch.distributed.pipelining")
    for p, v, m in cases:
        theirs = run_world(_torch_order, p, name, v, m, deadline=DEADLINE)[0]
        for r in range(p):
            call = f"{function}(stages={p}, chunks={v}, micro_batches={m}, rank={r})"
            got = _as_actions(call, getattr(kata, function)(p, v, m, r))
            assert got == theirs[r], (
                f"{call} returned {got}; torch's {name} runs {theirs[r]} on rank {r}"
            )


@pytest.mark.step(2)
def test_interleaved_actions_are_torchs_order(kata):
    _against_torchs_order(
        kata, "interleaved_actions", "ScheduleInterleaved1F1B", [(2, 2, 4), (4, 2, 8)]
    )


# --------------------------------------------------------------------------- step 3

# the lesson's pictures: interleaved p = 2, v = 2, m = 4 (B two ticks); ZB-H1 p = 2, m = 4
PICTURES = {
    "interleaved": (
        [
            [0, 1, 2, 3, 4, 6, 8, 9, 11, 12, 14, 15, 18, 21, 23, 25],
            [1, 2, 3, 4, 6, 7, 9, 10, 12, 13, 15, 16, 18, 19, 21, 23],
        ],
        27,
    ),
    "zb": ([[0, 1, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]], 13),
    # one micro-batch round 2 ranks and back: rank 0's chunk 1 waits for rank 1's chunk 0
    "round-trip": ([[0, 2, 6, 10], [1, 3, 4, 8]], 12),
}
ROUND_TRIP = [("F", 0, 0), ("F", 1, 0), ("B", 1, 0), ("B", 0, 0)]
SCHEDULE_OF = {
    "interleaved": lambda r: interleaved(2, 2, 4, r),
    "zb": lambda r: zero_bubble(2, 1, 4, r),
    "round-trip": lambda r: ROUND_TRIP,
}
NAMED = {
    "interleaved": "interleaved, p=2, v=2, m=4",
    "zb": "ZB-H1, p=2, m=4",
    "round-trip": "one micro-batch on p=2, v=2",
}


@pytest.mark.step(3)
@pytest.mark.parametrize("kind", ["interleaved", "zb", "round-trip"])
def test_simulate_places_each_action_on_the_clock(kata, kind):
    schedules = [SCHEDULE_OF[kind](r) for r in range(2)]
    timeline = kata.simulate(schedules)
    ticks, length = PICTURES[kind]
    got = [list(t) for t in timeline.ticks]
    if got != ticks:
        raise AssertionError(
            f"simulate({NAMED[kind]}) put the actions at ticks {got}, expected {ticks}. Chunk c of "
            "rank r is virtual stage s = c * p + r: an F of i waits for stage s - 1's F of i (rank "
            "0's chunk c waits for rank p - 1's chunk c - 1), a B for stage s + 1's B (the last "
            "stage's for its own F), a W for its own B. F and W take one tick, B one when its W "
            "is in the schedule, else two (it does the weights' work too)"
        )
    assert timeline.length == length, (
        f"simulate: length {timeline.length}, expected {length} (the tick the last action ends)"
    )


@pytest.mark.step(3)
def test_bubble_matches_the_formula(kata):
    for p, v, m in [(2, 2, 4), (2, 3, 4), (4, 2, 4), (4, 2, 8), (2, 2, 8)]:
        timeline = kata.simulate([interleaved(p, v, m, r) for r in range(p)])
        formula = (p - 1) / (v * m)
        for r in range(p):
            assert timeline.busy[r] == 3 * v * m, (
                f"simulate(interleaved, p={p}, v={v}, m={m}): rank {r} busy {timeline.busy[r]} "
                f"ticks, expected {3 * v * m} (v * m forwards of 1 tick, backwards of 2)"
            )
            assert abs(timeline.bubble[r] - formula) < 1e-12, (
                f"simulate(interleaved, p={p}, v={v}, m={m}): rank {r}'s bubble is "
                f"{timeline.bubble[r]:.4f}, expected (p-1)/(v*m) = {formula:.4f}: a rank's bubble "
                "is its idle ticks (the run's length - its busy ticks) over its busy ticks"
            )


@pytest.mark.step(3)
@pytest.mark.parametrize(
    "stuck",
    [
        [[("B", 0, 0), ("F", 0, 0)], [("F", 0, 0), ("B", 0, 0)]],
        [[("F", 0, 0), ("W", 0, 0), ("B", 0, 0)], [("F", 0, 0), ("B", 0, 0), ("W", 0, 0)]],
    ],
    ids=["backward-first", "weight-first"],
)
def test_simulate_refuses_a_schedule_that_waits_for_ever(kata, stuck):
    why = (
        "no action here can ever start: an action waits for one that comes after it (a W waits "
        "for its own B)"
    )
    pipelines.check_refuses_for_ever(kata.simulate, stuck, why)


# --------------------------------------------------------------------------- step 4


def _micro_batches(m: int, seed: int = 1):
    return pipelines.micro_batches(m, PER_MICRO_BATCH, seed)


SCHEDULE_FUNCTIONS = {"interleaved": interleaved, "zb": zero_bubble}


def _pipeline_rank(rank, world_size, kind, v, m, group_ranks=None):
    kata = load_kata(KATA)
    placed = pipelines.stage_of(rank, world_size, group_ranks)
    if placed is None:
        return None
    group, p, me = placed
    model = make_transformer(0, p * v)
    chunks = kata.split_chunks(model, p, v, me)
    actions = SCHEDULE_FUNCTIONS[kind](p, v, m, me)
    with recording() as calls:
        run = kata.run_schedule(chunks, actions, _micro_batches(m), process_group=group)
    grads = {
        n: None if q.grad is None else q.grad.clone()
        for chunk in chunks
        for n, q in chunk.named_parameters()
    }
    return {
        "grads": grads,
        "loss": run.loss,
        "peak": run.peak_activations,
        "calls": [(c.name, dict(c.peers), c.shapes[:1]) for c in calls],
    }


def _one_process(blocks: int, m: int):
    model = make_transformer(0, blocks)
    batches = _micro_batches(m)
    last = None
    for tokens, targets in batches:
        before = {
            n: None if q.grad is None else q.grad.clone() for n, q in model.named_parameters()
        }
        (transformer_loss(model(tokens), targets) / m).backward()
        last = {
            n: q.grad - (0 if before[n] is None else before[n]) for n, q in model.named_parameters()
        }
    looped = {n: q.grad.clone() for n, q in model.named_parameters()}
    model.zero_grad()
    tokens = torch.cat([t for t, _ in batches])
    targets = torch.cat([t for _, t in batches])
    loss = transformer_loss(model(tokens), targets)
    return looped, last, loss.item()


@functools.cache
def _reference(blocks: int, m: int):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks run
    try:
        return _one_process(blocks, m)
    finally:
        torch.set_num_threads(threads)


def _run(kind, p, v, m, group_ranks=None, world_size=None):
    where = f"run_schedule({kind}, p={p}, v={v}, m={m})" + (
        f" on the group {group_ranks} of {world_size} ranks" if group_ranks else ""
    )
    try:
        results = run_world(
            _pipeline_rank, world_size or p, kind, v, m, group_ranks, deadline=DEADLINE
        )
    except WorldDeadlock as deadlock:
        raise AssertionError(
            f"{where}: the ranks waited for each other for ever. Send with dist.isend (a blocking "
            "send waits for its recv); receive each tensor from the rank that holds virtual stage "
            "s - 1 (activations) or s + 1 (gradients), rank (s -+ 1) % p as a global rank of the "
            "group, with the tag its sender gave it.\n" + str(deadlock)
        ) from None
    except RankFailed as failure:
        text = str(failure)
        if "NoneType" in text or "Expected parameter `tensor`" in text:
            raise AssertionError(
                f"{where}: a rank sent None back: the received activations have no gradient. "
                "requires_grad_() on the tensor you recv before the chunk runs on it.\n" + text
            ) from None
        # torch refuses a peer outside the group, or gloo finds no connection to it
        if "is not part of group" in text or "Pair is not connected" in text:
            raise AssertionError(
                f"{where}: a rank named a peer outside its group: send and recv take global "
                "ranks, so the rank of virtual stage s is dist.get_global_rank(group, s % p) "
                "(group: process_group, or dist.group.WORLD for None).\n" + text
            ) from None
        raise
    members = group_ranks or list(range(p))
    return where, [results[r] for r in members]


def check_gradients(where, results, blocks, m):
    looped, last, loss = _reference(blocks, m)
    for r, got in enumerate(results):
        for name, grad in got["grads"].items():
            if grad is None:
                raise AssertionError(f"{where}: rank {r}'s {name} got no gradient")
            if torch.equal(grad, looped[name]):
                continue
            if torch.allclose(grad, looped[name] * m, rtol=1e-5, atol=1e-7):
                raise AssertionError(
                    f"{where}: rank {r}'s {name}.grad is {m} times one process's: divide each "
                    f"micro-batch's loss by the number of micro-batches ({m})"
                )
            if m > 1 and torch.allclose(grad, last[name], rtol=1e-5, atol=1e-7):
                raise AssertionError(
                    f"{where}: rank {r}'s {name}.grad holds only the last micro-batch's gradient: "
                    "let the gradients accumulate over the whole step"
                )
            gap = (grad - looped[name]).abs().max().item()
            raise AssertionError(
                f"{where}: rank {r}'s {name}.grad differs from one process looping over the same "
                f"micro-batches by up to {gap:.3g} (it should be bitwise equal: each chunk's "
                "backwards run in micro-batch order). Wrong values usually mean a recv took "
                "another message's tensor (same shape, wrong micro-batch or chunk): tag each "
                "message by what it is"
            )
    got = results[-1]["loss"]
    assert got is not None and abs(got - loss) <= 1e-5 * abs(loss), (
        f"{where}: the last rank returned the loss {got!r}, expected {loss:.6f} (the sum of each "
        "micro-batch's loss / m)"
    )


def check_messages(where, results, p, v, m, members=None):
    members = members or list(range(p))
    last = p * v - 1
    sent, received = {}, {}
    for r, got in enumerate(results):
        for name, peers, _ in got["calls"]:
            if name in ("send", "isend"):
                key = (members[r], peers.get("dst"), peers.get("tag", 0))
                sent[key] = sent.get(key, 0) + 1
            elif name in ("recv", "irecv"):
                key = (peers.get("src"), members[r], peers.get("tag", 0))
                received[key] = received.get(key, 0) + 1
    expected = 0
    for s in range(last + 1):
        expected += m * ((s > 0) + (s < last))
    total = sum(sent.values())
    assert total == expected and sum(received.values()) == expected, (
        f"{where}: the ranks made {total} sends and {sum(received.values())} recvs, expected "
        f"{expected} of each: per micro-batch, one activation leaves every virtual stage but the "
        "last, one gradient every virtual stage but the first"
    )
    repeated = sorted(k for k, n in sent.items() if n > 1)
    if repeated:
        src, dst, tag = repeated[0]
        raise AssertionError(
            f"{where}: rank {src} sent {sent[repeated[0]]} messages to rank {dst} with the same tag "
            f"{tag}: two ranks now exchange messages of several chunks and kinds, and one rank "
            "sends them in an order the other does not receive them in; give every message its "
            "own tag (from its kind, virtual stage and micro-batch) and receive with that tag"
        )
    assert sent.keys() == received.keys(), (
        f"{where}: sends (src, dst, tag) {sorted(set(sent) - set(received))[:3]} have no recv, "
        f"recvs {sorted(set(received) - set(sent))[:3]} no send: a recv names its sender (rank "
        "of virtual stage s -+ 1, a global rank) and the tag the sender gave"
    )


def _count_peak(actions) -> int:
    split = {(c, i) for k, c, i in actions if k == "W"}
    held, peak = 0, 0
    for k, c, i in actions:
        if k == "F":
            held += 1
            peak = max(peak, held)
        elif (k == "B" and (c, i) not in split) or k == "W":
            held -= 1
    return peak


CASES = [
    pytest.param("interleaved", 2, 2, 4, id="p2-v2-m4"),
    pytest.param("interleaved", 4, 2, 4, id="p4-v2-m4"),
    pytest.param("interleaved", 2, 3, 2, id="p2-v3-m2"),
]


_cached_run = shared_run(_run)  # several tests look at one run


@pytest.mark.step(4)
@pytest.mark.parametrize(("kind", "p", "v", "m"), CASES)
def test_pipeline_gradients_equal_one_process(kata, kind, p, v, m):
    where, results = _cached_run(kind, p, v, m)
    check_messages(where, results, p, v, m)
    check_gradients(where, results, p * v, m)


@pytest.mark.step(4)
@pytest.mark.parametrize(("kind", "p", "v", "m"), CASES)
def test_activations_held_at_once(kata, kind, p, v, m):
    where, results = _cached_run(kind, p, v, m)
    for r, got in enumerate(results):
        expected = _count_peak(SCHEDULE_FUNCTIONS[kind](p, v, m, r))
        assert got["peak"] == expected, (
            f"{where}: rank {r} reports {got['peak']} (chunk, micro-batch) activations held at "
            f"once, expected {expected}: count those whose F has run and whose backward has not "
            "finished (its B, or its W when the schedule has one), after each F; free them then"
        )


@pytest.mark.step(4)
def test_a_subgroup_runs_its_own_pipeline(kata):
    where, results = _run("interleaved", 2, 2, 2, group_ranks=[1, 2], world_size=3)
    check_messages(where, results, 2, 2, 2, members=[1, 2])
    check_gradients(where, results, 4, 2)


def _torch_rank(rank, world_size, name, kind, v, m):
    from torch.distributed import pipelining

    kata = load_kata(KATA)
    p = world_size
    chunks = kata.split_chunks(make_transformer(0, p * v), p, v, rank)
    stages = [
        pipelining.PipelineStage(chunk, c * p + rank, p * v, torch.device("cpu"))
        for c, chunk in enumerate(chunks)
    ]
    batches = _micro_batches(m)
    tokens = torch.cat([t for t, _ in batches])
    targets = torch.cat([t for _, t in batches])
    schedule = getattr(pipelining, name)(stages, m, loss_fn=transformer_loss)
    if rank == 0:
        schedule.step(tokens)
    elif rank == p - 1:
        schedule.step(target=targets)
    else:
        schedule.step()
    theirs = {n: q.grad.clone() for chunk in chunks for n, q in chunk.named_parameters()}
    mine = kata.split_chunks(make_transformer(0, p * v), p, v, rank)
    kata.run_schedule(mine, SCHEDULE_FUNCTIONS[kind](p, v, m, rank), batches)
    return theirs, {n: q.grad for chunk in mine for n, q in chunk.named_parameters()}


def _against_torch(name, kind, p, v, m):
    pytest.importorskip("torch.distributed.pipelining", reason="no torch.distributed.pipelining")
    where = f"run_schedule({kind}, p={p}, v={v}, m={m})"
    try:
        results = run_world(_torch_rank, p, name, kind, v, m, deadline=40)
    except WorldDeadlock as deadlock:
        raise AssertionError(
            f"{where} next to torch's {name}: the ranks waited for each other for ever "
            "(see test_pipeline_gradients_equal_one_process)\n" + str(deadlock)
        ) from None
    for r, (theirs, mine) in enumerate(results):
        for key, grad in theirs.items():
            assert mine[key] is not None and torch.allclose(mine[key], grad, **TORCH), (
                f"rank {r}'s {key}.grad from {where} differs from torch.distributed.pipelining's "
                f"{name} on the same chunks and micro-batches"
                + ("" if mine[key] is None else f" by up to {(mine[key] - grad).abs().max():.3g}")
            )


@pytest.mark.step(4)
def test_against_torchs_interleaved_1f1b(kata):
    _against_torch("ScheduleInterleaved1F1B", "interleaved", 2, 2, 4)


@pytest.mark.step(4)
def test_program_draws_and_runs_the_schedule(kata):
    out = run_module_ok(KATA, "--world-size", "2", "--chunks", "2", "--micro-batches", "4").stdout
    assert "rank 0: F0.0 F0.1 F1.0 F1.1 F0.2   .  B1.0 ---- F0.3" in out, out
    assert "rank 1 idle 3 of 27 ticks: bubble 0.125 of its work; formula 0.125" in out, out
    assert "largest difference" in out, out


# --------------------------------------------------------------------------- step 5


class _Products(TorchDispatchMode):
    """Counts the matrix products torch runs (mm, addmm, bmm) while inside."""

    NAMES = ("mm", "addmm", "bmm", "baddbmm")

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in self.NAMES:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _stage_case(kata, which: str):
    model = make_transformer(0, 4)
    chunks = [c for r in range(2) for c in kata.split_chunks(model, 2, 2, r)]  # by virtual stage
    order = {0: chunks[0], 1: chunks[2], 2: chunks[1], 3: chunks[3]}  # r0c0 r1c0 r0c1 r1c1
    tokens, targets = make_tokens(2, 3)
    x = torch.randn(2, tokens.shape[1], 16, generator=torch.Generator().manual_seed(4))
    stage = {"first": order[0], "middle": order[1], "last": order[3]}[which]
    inputs = tokens if which == "first" else x.clone().requires_grad_()
    return stage, inputs, targets


@pytest.mark.step(5)
@pytest.mark.parametrize("which", ["middle", "first", "last"])
def test_backward_split_into_input_and_weights(kata, which):
    stage, inputs, targets = _stage_case(kata, which)
    # the whole backward, for reference
    out = stage(inputs)
    root = transformer_loss(out, targets) if which == "last" else out
    grad = (
        None
        if which == "last"
        else torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
    )
    with _Products() as whole_products:
        root.backward(grad)
    want_input = None if which == "first" else inputs.grad.clone()
    want = {n: q.grad.clone() for n, q in stage.named_parameters()}
    stage.zero_grad(set_to_none=True)
    if which != "first":
        inputs = inputs.detach().clone().requires_grad_()

    with kata.layer_outputs(stage) as layers:
        out = stage(inputs)
    root = transformer_loss(out, targets) if which == "last" else out
    where = f"on the {which} stage"
    with _Products() as b_products:
        input_grad, work = kata.backward_input(inputs, root, grad, layers)
    touched = [n for n, q in stage.named_parameters() if q.grad is not None]
    assert not touched, (
        f"backward_input {where} filled {touched[:3]}'s .grad: B computes only the input's "
        "gradient (torch.autograd.grad, not .backward(), which fills every weight's .grad)"
    )
    if which == "first":
        assert input_grad is None, (
            f"backward_input {where}: the tokens need no gradient: return None"
        )
    else:
        assert input_grad is not None and torch.allclose(
            input_grad, want_input, rtol=1e-6, atol=1e-8
        ), (
            f"backward_input {where} returned an input gradient that differs from the whole "
            "backward's: the gradient of the stage's input under the same output gradient"
        )
    with _Products() as w_products:
        kata.backward_weight(work)
    for name, q in stage.named_parameters():
        assert q.grad is not None, f"backward_weight {where} left {name} without a gradient"
        assert torch.allclose(q.grad, want[name], rtol=1e-6, atol=1e-8), (
            f"backward_weight {where}: {name}.grad differs from the whole backward's by up to "
            f"{(q.grad - want[name]).abs().max():.3g}"
        )
    total = b_products.count + w_products.count
    assert total == whole_products.count and w_products.count > 0, (
        f"{where}: B ran {b_products.count} matrix products and W {w_products.count}, "
        f"{total} together, where one whole backward runs {whole_products.count}: W must only "
        "turn the gradients B found at each weighted layer's output into that layer's weight "
        "gradients. Going back from the stage's output again repeats B's work, and W is then "
        "as dear as B and W together: no bubble is filled for free. Keep, in B, the gradient "
        "at every layer_outputs output (ask torch.autograd.grad for them too)"
    )


SHAPES_ZB = [(2, 1, 4), (4, 1, 8), (2, 1, 3), (2, 2, 4), (4, 2, 8), (3, 2, 6)]


@pytest.mark.step(5)
def test_zero_bubble_actions_as_data(kata):
    for p, v, m in SHAPES_ZB:
        for r in range(p):
            call = f"zero_bubble_actions(stages={p}, chunks={v}, micro_batches={m}, rank={r})"
            got = _as_actions(call, kata.zero_bubble_actions(p, v, m, r))
            want = zero_bubble(p, v, m, r)
            if got != want:
                raise AssertionError(_diagnose(call, got, want, p, v, m, r, "zb"))


@pytest.mark.step(5)
@pytest.mark.parametrize(("p", "v", "m", "r"), [(2, 2, 3, 0), (2, 1, 0, 0), (2, 1, 4, 2)])
def test_zero_bubble_actions_refuse_what_does_not_fit(kata, p, v, m, r):
    _refuses(
        f"zero_bubble_actions(stages={p}, chunks={v}, micro_batches={m}, rank={r})",
        kata.zero_bubble_actions,
        p,
        v,
        m,
        r,
        why="raise ValueError saying what to do (with chunks > 1, m a multiple of p; m at least "
        "1; a rank between 0 and p - 1)",
    )


@pytest.mark.step(5)
def test_zero_bubble_actions_are_torchs_order(kata):
    _against_torchs_order(
        kata, "zero_bubble_actions", "ScheduleInterleavedZeroBubble", [(2, 1, 4), (2, 2, 4)]
    )


@pytest.mark.step(5)
def test_zero_bubble_fills_a_third_of_the_bubble(kata):
    for p, v, m in [(2, 1, 4), (4, 1, 8), (2, 2, 4), (4, 2, 8)]:
        timeline = kata.simulate([kata.zero_bubble_actions(p, v, m, r) for r in range(p)])
        formula = (p - 1) / (3 * v * m)
        for r in range(p):
            assert abs(timeline.bubble[r] - formula) < 1e-12, (
                f"simulate(zero_bubble_actions(p={p}, v={v}, m={m})): rank {r}'s bubble "
                f"{timeline.bubble[r]:.4f}, expected (p-1)/(3*v*m) = {formula:.4f}, a third of "
                "1F1B's: each B one tick now, its W one tick filling an idle slot"
            )


ZB_CASES = [
    pytest.param("zb", 2, 1, 4, id="zb-h1-p2-m4"),
    pytest.param("zb", 4, 1, 4, id="zb-h1-p4-m4"),
    pytest.param("zb", 2, 2, 4, id="zb-p2-v2-m4"),
]


@pytest.mark.step(5)
@pytest.mark.parametrize(("kind", "p", "v", "m"), ZB_CASES)
def test_zero_bubble_gradients_equal_one_process(kata, kind, p, v, m):
    where, results = _cached_run(kind, p, v, m)
    check_messages(where, results, p, v, m)
    check_gradients(where, results, p * v, m)
    for r, got in enumerate(results):
        expected = _count_peak(zero_bubble(p, v, m, r))
        assert got["peak"] == expected, (
            f"{where}: rank {r} reports {got['peak']} activations held at once, expected "
            f"{expected}: a micro-batch's activations are held until its W has run"
        )


@pytest.mark.step(5)
def test_against_torchs_zero_bubble(kata):
    _against_torch("ScheduleInterleavedZeroBubble", "zb", 2, 2, 4)


# --------------------------------------------------------------------------- CUDA


def _on_cuda(rank, world_size):
    device = rank_gpu()
    kata = load_kata(KATA)
    chunks = [c.to(device) for c in kata.split_chunks(make_transformer(0, 2), 1, 1, 0)]
    kata.run_schedule(chunks, zero_bubble(1, 1, 4, 0), _micro_batches(4))
    return {n: q.grad.cpu() for chunk in chunks for n, q in chunk.named_parameters()}


@pytest.mark.step(5)
@pytest.mark.cuda
def test_zero_bubble_on_cuda_nccl_world_of_one(kata):
    results = run_world(_on_cuda, 1, **on_cuda(1, "nccl"))
    looped, _, _ = _reference(2, 4)
    for name, grad in results[0].items():
        assert torch.allclose(grad, looped[name], rtol=1e-4, atol=1e-5), (
            f"{name}.grad on CUDA (B and W split) differs from one process's"
        )
