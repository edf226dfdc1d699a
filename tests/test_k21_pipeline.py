"""k21 pipeline: split_stages, the GPipe and 1F1B schedules as data, run_schedule, simulate."""

from __future__ import annotations

import functools

import pytest
import torch

from dojo.harness.calls import recording
from dojo.harness.impl import load_kata
from dojo.harness.world import RankFailed, WorldDeadlock, run_world
from dojo.spec import pipelines
from dojo.spec.cuda import on_cuda, rank_gpu
from dojo.spec.testing import refusal, run_module_ok, shared_run
from dojo.todo import KataTodo
from dojo.toy_models import make_tokens, make_transformer, transformer_loss

KATA = "k21_pipeline"
BLOCKS = 4  # the pipeline's model: a TinyTransformer of 4 blocks
PER_MICRO_BATCH = 2  # sequences per micro-batch
DEADLINE = 15  # a pipeline step takes well under a second; a deadlock is reported after this

# Exactness. Each micro-batch's forward and backward on a stage are the same operations as in one
# process running the whole model on that micro-batch, and every schedule here runs the backwards
# in micro-batch order, so the gradients accumulate in the same order as one process looping over
# the micro-batches (loss / m, backward, next): bitwise equal. One process on the whole batch at
# once takes the mean over all tokens in one sum instead of a mean of m means: close, not bitwise.
WHOLE = {"rtol": 1e-5, "atol": 1e-7}
# torch's schedules (scale_grads=True) add the micro-batches' gradients of the unscaled loss and
# divide by m at the end; with m a power of two that is exact, elsewhere it is rounded once more
# (and where a gradient is a small sum of larger terms, as a bias's, that rounding shows: 2e-8
# seen on a 0.006 with m = 3, on one CPU and not another).
TORCH = {"rtol": 1e-6, "atol": 1e-7}


def _names(model, blocks) -> set[str]:
    return {n for n, _ in model.named_parameters() if any(n.startswith(b) for b in blocks)}


def _expected_split(stages: int, rank: int) -> set[str]:
    size, extra = divmod(BLOCKS, stages)
    start = rank * size + min(rank, extra)
    prefixes = [f"blocks.{i}." for i in range(start, start + size + (rank < extra))]
    if rank == 0:
        prefixes.append("embedding.")
    if rank == stages - 1:
        prefixes += ["norm.", "output."]
    return _names(make_transformer(0, BLOCKS), prefixes)


def _blocks_of(names) -> list[int]:
    return sorted({int(n.split(".")[1]) for n in names if n.startswith("blocks.")})


# --------------------------------------------------------------------------- step 1: split_stages


@pytest.mark.step(1)
@pytest.mark.parametrize("stages", [1, 2, 3, 4])
def test_split_stages_gives_each_rank_its_own_modules(kata, stages):
    model = make_transformer(0, BLOCKS)
    own = {id(p): n for n, p in model.named_parameters()}
    seen: dict[str, int] = {}
    for rank in range(stages):
        stage = kata.split_stages(model, stages, rank)
        call = f"split_stages(<TinyTransformer of {BLOCKS} blocks>, {stages}, {rank})"
        assert isinstance(stage, torch.nn.Module), f"{call} returned {stage!r}: return a Stage"
        names = {n for n, _ in stage.named_parameters()}
        for name, param in stage.named_parameters():
            assert id(param) in own, (
                f"{call}: the stage's {name} is not one of the model's parameters: a stage holds "
                "the model's own modules (no copies), so that its gradients are the model's"
            )
            assert own[id(param)] == name, (
                f"{call}: the stage calls the model's {own[id(param)]} {name!r}: give Stage the "
                "blocks keyed by their index in the model, so that the names stay the model's"
            )
        expected = _expected_split(stages, rank)
        if names != expected:
            got, want = _blocks_of(names), _blocks_of(expected)
            extra = sorted({n.split(".")[0] for n in names - expected} - {"blocks"})
            missing = sorted({n.split(".")[0] for n in expected - names} - {"blocks"})
            why = []
            if got != want:
                why.append(
                    f"it holds the blocks {got}, expected {want}: spread {BLOCKS} blocks as evenly "
                    "as possible, consecutive, the extra ones (BLOCKS % stages) to the first stages"
                )
            if extra or missing:
                why.append(
                    f"it has {extra or 'nothing more'} and lacks {missing or 'nothing'}: only the "
                    "first stage has the embedding, only the last has the norm and the output"
                )
            raise AssertionError(f"{call}: " + "; ".join(why))
        for name in names:
            seen[name] = seen.get(name, 0) + 1
    everything = {n for n, _ in model.named_parameters()}
    missing = sorted(everything - set(seen))
    assert not missing, f"cut into {stages} stages, no stage holds {missing[:4]}"


@pytest.mark.step(1)
def test_a_stage_runs_its_part_of_the_model(kata):
    model = make_transformer(0, BLOCKS)
    tokens, _ = make_tokens(2, 0)
    x = tokens
    with torch.no_grad():
        for rank in range(2):
            x = kata.split_stages(model, 2, rank)(x)
        expected = model(tokens)
    assert torch.equal(x, expected), (
        "stage 1(stage 0(tokens)) differs from the model's logits: the stages must run the "
        "model's pieces in order (embedding, blocks in order, norm, output)"
    )


@pytest.mark.step(1)
@pytest.mark.parametrize(("stages", "rank"), [(0, 0), (5, 0), (2, 2), (4, -1), (3, 3)])
def test_split_stages_refuses_what_does_not_fit(kata, stages, rank):
    model = make_transformer(0, BLOCKS)
    call = f"split_stages(<TinyTransformer of {BLOCKS} blocks>, {stages}, {rank})"
    try:
        got = kata.split_stages(model, stages, rank)
    except ValueError as error:
        assert str(stages) in str(error) or str(rank) in str(error), (
            f"{call} raised ValueError({str(error)!r}): say which value does not fit and why"
        )
        return
    except KataTodo:
        raise
    except Exception as error:
        raise AssertionError(
            f"{call} raised {type(error).__name__}: {error}; raise a ValueError saying what does "
            "not fit (every stage needs a block; a rank is between 0 and stages - 1)"
        ) from None
    raise AssertionError(
        f"{call} returned {got!r}: raise ValueError: every stage needs at least one block (1 to "
        f"{BLOCKS} stages) and a rank is between 0 and stages - 1"
    )


# --------------------------------------------------------------------------- step 2: the schedules


def _gpipe(p, m, r):
    return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]


def _one_f_one_b(p, m, r):
    warm = min(p - 1 - r, m)
    actions = [("F", i) for i in range(warm)]
    for i in range(m - warm):
        actions += [("F", warm + i), ("B", i)]
    return actions + [("B", i) for i in range(m - warm, m)]


EXPECTED = {"gpipe": _gpipe, "1f1b": _one_f_one_b}
FUNCTIONS = {"gpipe": "gpipe_actions", "1f1b": "one_f_one_b_actions"}
SHAPES = [(1, 1), (1, 3), (2, 1), (2, 4), (3, 2), (4, 4), (4, 7), (4, 2)]


def _one_f_one_b_with(m, warm, backward_first=False):
    warm = max(0, min(warm, m))
    actions = [("F", i) for i in range(warm)]
    for i in range(m - warm):
        pair = [("F", warm + i), ("B", i)]
        actions += pair[::-1] if backward_first else pair
    return actions + [("B", i) for i in range(m - warm, m)]


def _known_mistakes(p, m, r):
    """What the usual 1F1B mistakes return here, and what to say when one shows."""
    warm = p - 1 - r
    return [
        (
            _one_f_one_b_with(m, warm + 1),
            f"its warm-up runs {min(warm + 1, m)} forwards, one too many: rank r of p warms up "
            "with p - 1 - r forwards (never more than m); one more holds an extra micro-batch's "
            "activations",
        ),
        (
            _one_f_one_b_with(m, warm - 1),
            f"its warm-up runs {max(warm - 1, 0)} forwards, one too few: rank r of p warms up "
            "with p - 1 - r forwards (never more than m); one fewer leaves the pipeline idle",
        ),
        (
            _one_f_one_b_with(m, warm, backward_first=True),
            "after the warm-up, alternate one forward and one backward (the forward first: "
            "the last rank runs F0 before B0)",
        ),
    ]


# Why the kata asks one order of GPipe's actions, where any order of the forwards, then any of
# the backwards, would be GPipe.
GPIPE_ORDER = (
    "this kata runs both in micro-batch order, as torch's ScheduleGPipe does, so that a stage's "
    "gradients add up in the order of one process looping over the micro-batches (the tests "
    "compare them bit for bit) and simulate's clock draws the lesson's picture"
)


def _order(actions, kind: str) -> list[int]:
    """The micro-batches of ``kind`` ("F" or "B") in the order the actions run them."""
    return [i for k, i in actions if k == kind]


def _in_flight(actions) -> int:
    """The most micro-batches whose forward ran and backward had not yet, at once."""
    held, most = 0, 0
    for k, _ in actions:
        held += 1 if k == "F" else -1
        most = max(most, held)
    return most


def _call_schedule(kata, kind, p, m, r):
    call = f"{FUNCTIONS[kind]}(stages={p}, micro_batches={m}, rank={r})"
    got = getattr(kata, FUNCTIONS[kind])(p, m, r)
    try:
        return call, [(str(k), int(i)) for k, i in got]
    except (TypeError, ValueError):
        raise AssertionError(
            f"{call} returned {got!r}: return a list of ('F', i) and ('B', i)"
        ) from None


@pytest.mark.step(2)
@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_schedules_as_data(kata, kind):
    for p, m in SHAPES:
        for r in range(p):
            call, got = _call_schedule(kata, kind, p, m, r)
            expected = EXPECTED[kind](p, m, r)
            if got == expected:
                continue
            once = sorted(got) == sorted(expected)
            if not once:
                raise AssertionError(
                    f"{call} returned {got}: every micro-batch 0..{m - 1} needs exactly one ('F', i) "
                    f"and one ('B', i), its forward first. Expected {expected}"
                )
            if kind == "gpipe":
                forwards_first = all(k == "F" for k, _ in got[:m])
                raise AssertionError(
                    f"{call} returned {got}, expected {expected}: "
                    + (
                        f"its forwards and backwards run in the orders {_order(got, 'F')} and "
                        f"{_order(got, 'B')}. Every forward, then every backward, is GPipe in any "
                        f"order, and right elsewhere; {GPIPE_ORDER}"
                        if forwards_first
                        else "GPipe runs every forward, then every backward; " + GPIPE_ORDER
                    )
                )
            for wrong, why in _known_mistakes(p, m, r):
                if got == wrong:
                    raise AssertionError(f"{call} returned {got}, expected {expected}: {why}")
            raise AssertionError(
                f"{call} returned {got}, expected {expected}: it holds up to {_in_flight(got)} "
                f"micro-batches' activations at once on this rank (1F1B: min(p - r, m) = "
                f"{min(p - r, m)}). After the warm-up of p - 1 - r "
                "forwards, alternate one forward and one backward (the forward first) while "
                "forwards are left, then run the backwards left (cool-down), in micro-batch "
                "order: the order of torch's Schedule1F1B, whose activations the tests count"
            )


@pytest.mark.step(2)
@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("p", "m", "r"), [(2, 0, 0), (0, 2, 0), (2, 2, 2), (2, 2, -1)])
def test_schedules_refuse_what_does_not_fit(kata, kind, p, m, r):
    call = f"{FUNCTIONS[kind]}(stages={p}, micro_batches={m}, rank={r})"
    did = refusal(lambda: getattr(kata, FUNCTIONS[kind])(p, m, r))
    assert did is None, (
        f"{call} {did}: raise ValueError (stages and micro_batches at least 1, a rank between 0 "
        "and stages - 1)"
    )


# --------------------------------------------------------------------------- step 3: run_schedule


def _micro_batches(m: int, seed: int = 1):
    return pipelines.micro_batches(m, PER_MICRO_BATCH, seed)


_MISSING = object()  # an attribute a kata's result lacks


def _pipeline_rank(rank, world_size, kind, m, group_ranks=None):
    kata = load_kata(KATA)
    placed = pipelines.stage_of(rank, world_size, group_ranks)
    if placed is None:
        return None
    group, p, me = placed
    model = make_transformer(0, BLOCKS)
    stage = kata.split_stages(model, p, me)
    actions = EXPECTED[kind](p, m, me)  # the test's schedule: step 2 is tested on its own
    with recording() as calls:
        run = kata.run_schedule(stage, actions, _micro_batches(m), process_group=group)
    loss, peak = (getattr(run, name, _MISSING) for name in ("loss", "peak_activations"))
    if loss is _MISSING or peak is _MISSING:
        raise AssertionError(
            f"run_schedule returned {run!r}: return PipelineRun(loss, peak_activations), the last "
            "stage's loss (None on the others) and the most micro-batches held at once"
        )
    grads = {n: None if q.grad is None else q.grad.clone() for n, q in stage.named_parameters()}
    return {
        "grads": grads,
        "loss": loss,
        "peak": peak,
        "calls": _messages(calls),
    }


def _messages(calls) -> list[tuple[str, dict, int]]:
    """Each message a rank posted: (send, isend, recv or irecv; its peer; its bytes), the parts
    of a batch_isend_irecv one by one."""
    out = []
    for call in calls:
        if call.name == "batch_isend_irecv":
            for kind, peer, _, size in call.parts:
                out.append((kind, {"dst" if kind == "isend" else "src": peer}, size))
        else:
            out.append((call.name, dict(call.peers), call.bytes))
    return out


def _one_process(m: int):
    """Gradients of one process: looping over the micro-batches, on the whole batch, per batch."""
    model = make_transformer(0, BLOCKS)
    batches = _micro_batches(m)
    each = []
    for tokens, targets in batches:
        before = {
            n: torch.zeros_like(q) if q.grad is None else q.grad.clone()
            for n, q in model.named_parameters()
        }
        (transformer_loss(model(tokens), targets) / m).backward()
        each.append({n: q.grad - before[n] for n, q in model.named_parameters()})
    looped = {n: q.grad.clone() for n, q in model.named_parameters()}
    model.zero_grad()
    tokens = torch.cat([t for t, _ in batches])
    targets = torch.cat([t for _, t in batches])
    loss = transformer_loss(model(tokens), targets)
    loss.backward()
    whole = {n: q.grad.clone() for n, q in model.named_parameters()}
    return looped, whole, each, loss.item()


def _run(kind, p, m, group_ranks=None, world_size=None):
    world = world_size or p
    where = f"run_schedule({kind}, p={p}, m={m})" + (
        f" on the group {group_ranks} of {world} ranks" if group_ranks else ""
    )
    try:
        results = run_world(_pipeline_rank, world, kind, m, group_ranks, deadline=DEADLINE)
    except WorldDeadlock as deadlock:
        if "in send" in str(deadlock):
            raise AssertionError(
                f"{where}: the ranks waited for each other for ever, some in dist.send. A "
                "blocking send waits until its peer calls recv, and in a pipeline two neighbours "
                "can both be sending to each other (activations forward, a gradient back): both "
                "wait for ever. Send with dist.isend (keep the handles, wait them at the end).\n"
                + str(deadlock)
            ) from None
        raise AssertionError(
            f"{where}: the ranks waited for each other for ever: every recv must have a matching "
            "send from the right peer (activations from rank - 1, their gradients from rank + 1, "
            "as global ranks of the group), in the same order.\n" + str(deadlock)
        ) from None
    except RankFailed as failure:
        text = str(failure)
        if "NoneType" in text or "Expected parameter `tensor`" in text:
            raise AssertionError(
                f"{where}: a rank sent None back: the received activations have no gradient. "
                "Call requires_grad_() on the tensor you recv before the stage runs on it, so "
                "that backward fills its .grad, the gradient to send to the previous rank.\n" + text
            ) from None
        # torch refuses a peer outside the group, or gloo finds no connection to it: which one
        # depends on how far the ranks got
        if "is not part of group" in text or "Pair is not connected" in text:
            raise AssertionError(
                f"{where}: a rank named a peer outside its group: send and recv take global "
                "ranks, so the stage before and after are dist.get_global_rank(group, rank - 1) "
                "and (group, rank + 1), global ranks of the group (group: process_group, or "
                "dist.group.WORLD for None).\n" + text
            ) from None
        raise
    members = group_ranks or list(range(p))
    return where, [results[r] for r in members]


@functools.cache
def _reference(m: int):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks run: a kernel's sums may split otherwise
    try:
        return _one_process(m)
    finally:
        torch.set_num_threads(threads)


def check_gradients(where, results, m):
    looped, whole, each, loss = _reference(m)
    for r, got in enumerate(results):
        for name, grad in got["grads"].items():
            if grad is None:
                raise AssertionError(f"{where}: stage {r}'s {name} got no gradient")
            if torch.equal(grad, looped[name]):
                continue
            if torch.allclose(grad, looped[name] * m, **WHOLE):
                raise AssertionError(
                    f"{where}: stage {r}'s {name}.grad is {m} times one process's: the loss of "
                    f"each micro-batch must be divided by the number of micro-batches ({m}), so "
                    "that the m backwards add up to the mean over the whole batch"
                )
            last = each[-1][name]
            if torch.allclose(grad, last, **WHOLE) and m > 1:
                raise AssertionError(
                    f"{where}: stage {r}'s {name}.grad holds only the last micro-batch's "
                    "gradient: the gradients were zeroed between micro-batches. Let them "
                    "accumulate over the whole step (zero once, before it, never inside)"
                )
            if torch.allclose(grad, whole[name], **WHOLE):
                raise AssertionError(
                    f"{where}: stage {r}'s {name}.grad is close to one process's but not "
                    "bitwise that of one process looping over the same micro-batches: run "
                    "the backwards in micro-batch order and divide each micro-batch's loss by m"
                )
            gap = (grad - looped[name]).abs().max().item()
            raise AssertionError(
                f"{where}: stage {r}'s {name}.grad differs from one process's by up to {gap:.3g}"
            )
    got = results[-1]["loss"]
    assert got is not None and abs(got - loss) <= 1e-5 * abs(loss), (
        f"{where}: the last stage returned the loss {got!r}, expected the mean over the whole "
        f"batch, {loss:.6f} (the sum of each micro-batch's loss / m)"
    )
    for r, got in enumerate(results[:-1]):
        assert got["loss"] is None, f"{where}: stage {r} returned a loss: only the last one has it"


# Why a tensor travels alone, where messages of its own (its shape first, say) would work too.
ONE_MESSAGE = (
    "This kata sends each tensor alone: every stage knows its shape already (tokens.shape + "
    "(MODEL_DIM,): the micro-batches are alike), and every message more is one more wait on the "
    "pipeline's critical path. Telling the peer a shape first is right elsewhere, where "
    "micro-batches differ in shape (torch's PipelineStage agrees on the shapes once, at its "
    "first step), but not here"
)


def _sizes(messages) -> list[int]:
    return sorted({size for _, _, size in messages})


def check_messages(where, results, m, members=None):
    p = len(results)
    members = members or list(range(p))
    for r, got in enumerate(results):
        sends = [c for c in got["calls"] if c[0] in ("send", "isend")]
        recvs = [c for c in got["calls"] if c[0] in ("recv", "irecv")]
        before = members[r - 1] if r > 0 else None
        after = members[r + 1] if r < p - 1 else None
        wanted_sends = m * ((before is not None) + (after is not None))
        if len(sends) > wanted_sends or len(recvs) > wanted_sends:
            raise AssertionError(
                f"{where}: stage {r} sent {len(sends)} messages (of {_sizes(sends)} bytes) and "
                f"received {len(recvs)} (of {_sizes(recvs)} bytes), expected {wanted_sends} of "
                "each: one activation per micro-batch to the next stage and one gradient to the "
                f"previous, and their recvs. {ONE_MESSAGE}"
            )
        assert len(sends) == wanted_sends and len(recvs) == wanted_sends, (
            f"{where}: stage {r} made {len(sends)} send(s) and {len(recvs)} recv(s), expected "
            f"{wanted_sends} of each: per micro-batch one activation to the next stage and one "
            "gradient to the previous (and their recvs), nothing else"
        )
        peers = {c[1].get("dst") for c in sends} | {c[1].get("src") for c in recvs}
        expected = {x for x in (before, after) if x is not None}
        assert peers <= expected, (
            f"{where}: stage {r} sent to or received from {sorted(peers - expected)}: its only "
            f"peers are the stages before and after it, global ranks {sorted(expected)}"
        )


CASES = [
    pytest.param("gpipe", 2, 4, id="gpipe-p2-m4"),
    pytest.param("1f1b", 2, 4, id="1f1b-p2-m4"),
    pytest.param("gpipe", 4, 3, id="gpipe-p4-m3"),
    pytest.param("1f1b", 4, 6, id="1f1b-p4-m6"),
]


_cached_run = shared_run(_run)  # two tests look at one run


@pytest.mark.step(3)
@pytest.mark.parametrize(("kind", "p", "m"), CASES)
def test_pipeline_gradients_equal_one_process(kata, kind, p, m):
    where, results = _cached_run(kind, p, m)
    check_gradients(where, results, m)
    check_messages(where, results, m)


@pytest.mark.step(3)
@pytest.mark.parametrize(("kind", "p", "m"), CASES)
def test_activations_held_at_once(kata, kind, p, m):
    where, results = _cached_run(kind, p, m)
    for r, got in enumerate(results):
        expected = m if kind == "gpipe" else min(p - r, m)
        if kind == "1f1b" and got["peak"] == m and m > expected:
            raise AssertionError(
                f"{where}: stage {r} held {m} micro-batches' activations at once, expected at "
                f"most {expected}: free a micro-batch's activations (its input and output) once "
                "its backward has run, so 1F1B holds at most p - r at a time"
            )
        assert got["peak"] == expected, (
            f"{where}: stage {r} reports {got['peak']} micro-batches' activations held at once, "
            f"expected {expected} (GPipe: all m before the first backward; 1F1B: p - r). Count "
            "the micro-batches whose forward has run and backward not yet, after each forward"
        )


@pytest.mark.step(3)
def test_a_subgroup_runs_its_own_pipeline(kata):
    where, results = _run("1f1b", 2, 3, group_ranks=[1, 2], world_size=3)
    check_gradients(where, results, 3)
    check_messages(where, results, 3, members=[1, 2])


def _torch_rank(rank, world_size, kind, m):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    kata = load_kata(KATA)
    stage = kata.split_stages(make_transformer(0, BLOCKS), world_size, rank)
    batches = _micro_batches(m)
    tokens = torch.cat([t for t, _ in batches])
    targets = torch.cat([t for _, t in batches])
    schedule = (ScheduleGPipe if kind == "gpipe" else Schedule1F1B)(
        PipelineStage(stage, rank, world_size, torch.device("cpu")), m, loss_fn=transformer_loss
    )
    if rank == 0:
        schedule.step(tokens)
    elif rank == world_size - 1:
        schedule.step(target=targets)
    else:
        schedule.step()
    theirs = {n: q.grad.clone() for n, q in stage.named_parameters()}
    mine = kata.split_stages(make_transformer(0, BLOCKS), world_size, rank)
    kata.run_schedule(mine, EXPECTED[kind](world_size, m, rank), batches)
    return theirs, {n: q.grad for n, q in mine.named_parameters()}


@pytest.mark.step(3)
@pytest.mark.parametrize(("kind", "p", "m"), [("gpipe", 2, 4), ("1f1b", 2, 3), ("1f1b", 4, 4)])
def test_against_torch_pipelining(kata, kind, p, m):
    pytest.importorskip(
        "torch.distributed.pipelining", reason="this torch has no torch.distributed.pipelining"
    )
    try:
        results = run_world(_torch_rank, p, kind, m, deadline=30)
    except WorldDeadlock as deadlock:
        raise AssertionError(
            f"run_schedule({kind}, p={p}, m={m}) next to torch's schedule: the ranks waited "
            "for each other for ever (see test_pipeline_gradients_equal_one_process)\n"
            + str(deadlock)
        ) from None
    name = "ScheduleGPipe" if kind == "gpipe" else "Schedule1F1B"
    for r, (theirs, mine) in enumerate(results):
        for key, grad in theirs.items():
            assert mine[key] is not None and torch.allclose(mine[key], grad, **TORCH), (
                f"stage {r}'s {key}.grad from run_schedule({kind}, p={p}, m={m}) differs from "
                f"torch.distributed.pipelining's {name} on the same stage and micro-batches"
                + ("" if mine[key] is None else f" by up to {(mine[key] - grad).abs().max():.3g}")
            )


def _smoothed_loss(outputs, targets):
    """Another micro-batch mean loss than transformer_loss: cross-entropy, labels smoothed."""
    logits = outputs.reshape(-1, outputs.shape[-1])
    return torch.nn.functional.cross_entropy(logits, targets.reshape(-1), label_smoothing=0.5)


def _loss_fn_rank(rank, world_size, m):
    kata = load_kata(KATA)
    stage = kata.split_stages(make_transformer(0, BLOCKS), world_size, rank)
    actions = EXPECTED["gpipe"](world_size, m, rank)
    run = kata.run_schedule(stage, actions, _micro_batches(m), loss_fn=_smoothed_loss)
    return getattr(run, "loss", None), {n: q.grad for n, q in stage.named_parameters()}


def _one_process_with(loss_fn, m: int):
    model = make_transformer(0, BLOCKS)
    total = 0.0
    for tokens, targets in _micro_batches(m):
        loss = loss_fn(model(tokens), targets) / m
        loss.backward()
        total += loss.item()
    return total, {n: q.grad for n, q in model.named_parameters()}


@pytest.mark.step(3)
def test_the_loss_fn_given_is_the_one_backpropagated(kata):
    m = 2
    (_, first), (loss, last) = run_world(_loss_fn_rank, 2, m, deadline=DEADLINE)
    expected, given = _one_process_with(_smoothed_loss, m)
    _, default = _one_process_with(transformer_loss, m)
    where = f"run_schedule(gpipe, p=2, m={m}, loss_fn=<cross-entropy, labels smoothed>)"
    for r, grads in enumerate((first, last)):
        for name, grad in grads.items():
            if grad is not None and torch.allclose(grad, given[name], **WHOLE):
                continue
            if grad is not None and torch.allclose(grad, default[name], **WHOLE):
                raise AssertionError(
                    f"{where}: stage {r}'s {name}.grad is that of transformer_loss, not of the "
                    "loss_fn given: the last stage backpropagates loss_fn(outputs, targets) / m, "
                    "the loss it was passed (a later kata passes one of its own)"
                )
            raise AssertionError(
                f"{where}: stage {r}'s {name}.grad differs from one process backpropagating "
                "loss_fn(outputs, targets) / m over the same micro-batches"
            )
    assert loss is not None and abs(loss - expected) <= 1e-5 * abs(expected), (
        f"{where}: the last stage returned the loss {loss!r}, expected {expected:.6f}, the sum "
        "of loss_fn(outputs, targets) / m over the micro-batches"
    )


# --------------------------------------------------------------------------- step 4: simulate


def _simulated(kata, schedules):
    """``kata.simulate(schedules)``, a Timeline (or what it returned, named)."""
    timeline = kata.simulate(schedules)
    if any(getattr(timeline, name, _MISSING) is _MISSING for name in ("ticks", "length", "idle")):
        raise AssertionError(
            f"simulate(...) returned {timeline!r}: return Timeline(ticks, length, idle), the "
            "start tick of each action per rank, the ticks until the last ends and each rank's "
            "idle fraction"
        )
    return timeline


def _ticks_for(kata, schedules):
    timeline = _simulated(kata, schedules)
    return timeline, [list(t) for t in timeline.ticks]


PICTURES = {
    # the lesson's pictures: p = 2, m = 4
    "gpipe": [[0, 1, 2, 3, 6, 7, 8, 9], [1, 2, 3, 4, 5, 6, 7, 8]],
    "1f1b": [[0, 1, 3, 4, 5, 6, 7, 9], [1, 2, 3, 4, 5, 6, 7, 8]],
}


@pytest.mark.step(4)
@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_simulate_places_each_action_on_the_clock(kata, kind):
    schedules = [EXPECTED[kind](2, 4, r) for r in range(2)]
    timeline, ticks = _ticks_for(kata, schedules)
    expected = PICTURES[kind]
    if ticks != expected:
        raise AssertionError(
            f"simulate({kind}, p=2, m=4) put the actions at ticks {ticks}, expected {expected} "
            "(the lesson's picture): an action starts when its rank is free and its input is "
            "there: a forward of i on rank r after rank r - 1's forward of i has ended, a "
            "backward of i after rank r + 1's backward of i (the last rank's: after its own "
            "forward of i); each takes one tick"
        )
    assert timeline.length == 10, (
        f"simulate({kind}, p=2, m=4): length {timeline.length}, expected 10 ticks (the tick at "
        "which the last action ends)"
    )


@pytest.mark.step(4)
@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_bubble_matches_the_formula(kata, kind):
    for p, m in [(1, 3), (2, 1), (2, 4), (3, 5), (4, 4), (4, 8)]:
        timeline = _simulated(kata, [EXPECTED[kind](p, m, r) for r in range(p)])
        formula = (p - 1) / (m + p - 1)
        for r, idle in enumerate(timeline.idle):
            assert abs(idle - formula) < 1e-12, (
                f"simulate({kind}, p={p}, m={m}): rank {r} idles {idle:.4f} of the run, expected "
                f"(p-1)/(m+p-1) = {formula:.4f}: a rank's idle fraction is (length - its number "
                "of actions) / length, over the whole run's length (the last action's end on "
                "any rank), not its own first to last action"
            )


@pytest.mark.step(4)
def test_simulate_refuses_a_schedule_that_waits_for_ever(kata):
    stuck = [[("B", 0), ("F", 0)], [("F", 0), ("B", 0)]]  # rank 0's backward before its forward
    why = (
        "no rank can ever start here: rank 0's backward of 0 waits for rank 1's, which waits for "
        "rank 1's forward of 0, which waits for rank 0's forward of 0, after the backward"
    )
    pipelines.check_refuses_for_ever(kata.simulate, stuck, why)


@pytest.mark.step(4)
def test_program_draws_the_schedule(kata):
    args = ("--world-size", "2", "--schedule", "gpipe", "--micro-batches", "4")
    out = run_module_ok(KATA, *args).stdout
    shown = f"`python -m katas.{KATA} {' '.join(args)}`"
    for line, why in (
        ("rank 0: F0 F1 F2 F3  .  . B0 B1 B2 B3", "the lesson's GPipe picture, rank 0"),
        ("rank 1:  . F0 F1 F2 F3 B0 B1 B2 B3", "the lesson's GPipe picture, rank 1"),
        ("rank 0 idle 0.200 of 10 ticks; (p-1)/(m+p-1) = 0.200", "the bubble, as the formula"),
        (
            "rank 0 held at most 4 micro-batches' activations at once",
            "GPipe holds every micro-batch before the first backward",
        ),
    ):
        assert line in out, f"{shown} should print {line!r} ({why}); it printed:\n{out}"


# --------------------------------------------------------------------------- CUDA


def _on_cuda(rank, world_size):
    device = rank_gpu()
    kata = load_kata(KATA)
    stage = kata.split_stages(make_transformer(0, BLOCKS), world_size, rank).to(device)
    m = 4
    kata.run_schedule(stage, _one_f_one_b(world_size, m, rank), _micro_batches(m))
    return {n: q.grad.cpu() for n, q in stage.named_parameters()}


def check_on_cuda(results) -> None:
    _, whole, _, _ = _reference(4)
    for r, grads in enumerate(results):
        for name, grad in grads.items():
            assert torch.allclose(grad, whole[name], rtol=1e-4, atol=1e-5), (
                f"stage {r}'s {name}.grad on CUDA differs from one process's"
            )


@pytest.mark.step(3)
@pytest.mark.cuda
def test_nccl_world_of_one(kata):
    check_on_cuda(run_world(_on_cuda, 1, **on_cuda(1, "nccl")))


# Several ranks on CUDA take NCCL here, the backend a GPU pipeline runs on (gloo's point-to-point
# calls are not relied on for CUDA tensors): two GPUs or more.
@pytest.mark.step(3)
@pytest.mark.cuda
def test_nccl_two_ranks(kata):
    check_on_cuda(run_world(_on_cuda, 2, **on_cuda(2, "nccl")))
