"""k15 checkpoints: rank 0 writes, every rank waits and loads, a resumed run is the same run."""

from __future__ import annotations

import contextlib
import functools
import os
import tempfile
import time

import pytest
import torch

from dojo.devices import rank_device
from dojo.harness.calls import recording
from dojo.harness.impl import load_kata
from dojo.harness.world import WorldDeadlock
from dojo.spec import checkpoints
from dojo.spec.cuda import on_cuda
from dojo.spec.states import to_cpu
from dojo.spec.testing import (
    ranks_phrase,
    run_module_ok,
    shared_run,
    streams,
)
from dojo.toy_models import loss, make_model

KATA = "k15_checkpoints"


def _optimizer(kata, model):
    """The kata's optimizer: SGD with momentum."""
    return torch.optim.SGD(model.parameters(), lr=kata.LR, momentum=kata.MOMENTUM)


def _momentum(optimizer_state: dict) -> dict:
    """``{parameter index: momentum buffer}`` of an SGD state_dict."""
    return {
        index: state["momentum_buffer"]
        for index, state in optimizer_state.get("state", {}).items()
        if isinstance(state, dict) and state.get("momentum_buffer") is not None
    }


# --------------------------------------------------------------------------- files, recorded


class _Files:
    def __init__(self):
        self.saves: list[dict] = []
        self.loads: list[dict] = []


def _target(f) -> str:
    return os.fspath(f) if isinstance(f, (str, os.PathLike)) else getattr(f, "name", repr(f))


@contextlib.contextmanager
def _watching_files(slow_write_s: float = 0.0):
    """Record every ``torch.save`` and ``torch.load`` of this rank (when, where, with which
    ``map_location``); each save first waits ``slow_write_s``, like a large file would."""
    import torch.serialization as serialization

    files = _Files()
    originals = (serialization.save, serialization.load, torch.save, torch.load)

    def save(obj, f, *args, **kwargs):
        entry = {
            "target": _target(f),
            "start": time.time(),
            "start_counter": time.perf_counter(),
        }
        files.saves.append(entry)
        time.sleep(slow_write_s)
        try:
            return originals[0](obj, f, *args, **kwargs)
        finally:
            entry["end"] = time.time()

    def load(f, *args, **kwargs):
        where = kwargs.get("map_location", args[0] if args else None)
        files.loads.append({"target": _target(f), "map_location": repr(where), "given": where})
        return originals[1](f, *args, **kwargs)

    serialization.save, torch.save = save, save
    serialization.load, torch.load = load, load
    try:
        yield files
    finally:
        serialization.save, serialization.load, torch.save, torch.load = originals
        for entry in files.loads:
            entry["given"] = entry["given"] is not None


# --------------------------------------------------------------------------- the classic hang

CLASSIC_HANG = (
    "This is the classic hang: a collective that only some ranks call, like a barrier inside "
    "`if rank == 0:`: rank 0 waits in it for ranks that never come."
)


def _hang(what: str, failure: WorldDeadlock) -> AssertionError:
    report = str(failure)
    if "waits in barrier" in report:
        cure = (
            "Call dist.barrier() on every rank, after the if, at the function's own indentation: "
            "only the torch.save goes under `if rank == 0:`."
        )
    else:
        cure = "Every rank must make the same collective calls, in the same order."
    return AssertionError(f"{what} hung. {CLASSIC_HANG} {cure}\n\nThe harness's report:\n{report}")


WORDS = checkpoints.Words(
    file="checkpoint", writer="save_checkpoint", loader="load_checkpoint", unit="step"
)


# --------------------------------------------------------------------------- step 1: save

SAVED_STEP = 7
SLOW_WRITE_S = 1.0  # rank 0's write is slowed by this much: a rank that does not wait is caught


def _save_on_two_nodes(rank, world_size, folder):
    # 4 ranks laid out as 2 nodes x 2, as torchrun would set them: LOCAL_RANK is 0 twice.
    os.environ.update(
        LOCAL_RANK=str(rank % 2),
        LOCAL_WORLD_SIZE="2",
        GROUP_RANK=str(rank // 2),
        NODE_RANK=str(rank // 2),
    )
    kata = load_kata(KATA)
    # built apart: DDP makes them rank 0's
    model, ddp, optimizer = checkpoints.wrapped_model(kata, 100 + rank, _optimizer)
    inputs, targets = kata.batch_for("frozen", 0, rank, world_size)
    optimizer.zero_grad()
    loss(ddp, (inputs.to(rank_device()), targets.to(rank_device()))).backward()
    optimizer.step()  # the optimizer now holds momentum: state a checkpoint must keep
    path = os.path.join(folder, "checkpoint.pt")
    with _watching_files(SLOW_WRITE_S if rank == 0 else 0.0) as files, recording() as calls:
        kata.save_checkpoint(path, ddp, optimizer, SAVED_STEP)
    returned = time.time()
    try:
        checkpoints.read_file(path)
        readable = None
    except Exception as error:
        readable = f"{type(error).__name__}: {str(error).strip().splitlines()[0][:160]}"
    return {
        "saves": files.saves,
        "returned": returned,
        "calls": [(c.name, c.start) for c in calls],
        "unreadable": readable,
        "state": to_cpu(model.state_dict()),
        "optimizer": to_cpu(optimizer.state_dict()),
    }


@shared_run
def _saved():
    with tempfile.TemporaryDirectory(prefix="k15-save-") as folder:
        hang = functools.partial(_hang, "save_checkpoint")
        options = {"words": WORDS, "hang": hang, "written_by_the_test": False, "deadline": 30}
        results = checkpoints.run_checked(_save_on_two_nodes, 4, folder, **options)
        return results, checkpoints.read_file(os.path.join(folder, "checkpoint.pt"))


@pytest.mark.step(1)
def test_only_global_rank_0_writes_the_checkpoint(kata):
    results, on_disk = _saved()
    checkpoints.check_one_writer(results, WORDS)
    assert len(results[0]["saves"]) == 1, (
        f"rank 0 called torch.save {len(results[0]['saves'])} times: one checkpoint, one file"
    )
    assert on_disk is not None, (
        f"rank 0 called torch.save for {results[0]['saves'][0]['target']!r}, but no checkpoint "
        "exists at the path save_checkpoint was given: write to that path"
    )


@pytest.mark.step(1)
def test_the_checkpoint_holds_the_unwrapped_model_the_optimizer_and_the_step(kata):
    results, on_disk = _saved()
    why = "SGD's momentum is state too, and a run that resumes without it steps differently"
    checkpoints.check_holds_the_parts(on_disk, kata.CHECKPOINT_KEYS, WORDS, why)
    saved, source = on_disk["model"], results[0]["state"]
    assert sorted(saved) == sorted(source), (
        f"the checkpoint's model holds {sorted(saved)}, the model {sorted(source)}: save the "
        "whole state_dict (frozen parameters and buffers included)"
    )
    for name, tensor in source.items():
        assert torch.equal(saved[name], tensor), (
            f"the checkpoint's {name!r} differs from rank 0's model: save the model's own "
            "state_dict at the moment of the call"
        )
    momentum = _momentum(on_disk["optimizer"]) if isinstance(on_disk["optimizer"], dict) else {}
    expected = _momentum(results[0]["optimizer"])
    assert momentum.keys() == expected.keys() and all(
        torch.equal(momentum[i], expected[i]) for i in expected
    ), (
        "the checkpoint's 'optimizer' does not hold rank 0's momentum buffers: save "
        "optimizer.state_dict() (its 'state' holds them)"
    )
    assert on_disk["step"] == SAVED_STEP, (
        f"the checkpoint says step {on_disk['step']!r}; save_checkpoint was given step={SAVED_STEP}"
    )


@pytest.mark.step(1)
def test_every_rank_waits_until_the_checkpoint_is_complete(kata):
    results, _ = _saved()
    writes = results[0]["saves"]
    assert writes, "rank 0 never called torch.save: global rank 0 writes the checkpoint"
    written = writes[-1]["end"]
    for rank, result in enumerate(results[1:], start=1):
        collectives = [name for name, _ in result["calls"]]
        early = written - result["returned"]
        if not collectives:
            raise AssertionError(
                f"rank {rank}'s save_checkpoint made no collective call, so nothing made it wait "
                f"for rank 0's write (it returned {max(early, 0):.2f} s before rank 0's slowed "
                "write had finished: a rank that goes on may read a file that does not exist "
                "yet, or exit while it is half written). Every rank calls dist.barrier() after "
                "rank 0's torch.save."
            )
        if early > 0 or result["unreadable"]:
            barrier = next((at for name, at in results[0]["calls"] if name == "barrier"), None)
            order = ""
            if barrier is not None and barrier < writes[-1]["start_counter"]:
                order = (
                    " Rank 0 called dist.barrier() before its torch.save: the barrier only lets "
                    "the ranks go on together; it must come after the write."
                )
            raise AssertionError(
                f"rank {rank} returned from save_checkpoint {early:.2f} s before rank 0 had "
                "finished writing the checkpoint"
                + (
                    f", and could not load it: {result['unreadable']}"
                    if result["unreadable"]
                    else ""
                )
                + f".{order} Every rank must wait (dist.barrier()) until rank 0's write is complete."
            )


@pytest.mark.step(1)
@pytest.mark.slow  # the program, and 5 s of a deliberate hang before its report
def test_the_program_shows_the_classic_hang_and_its_report(kata):
    done = run_module_ok(KATA, "--show-the-hang", "--backend", "gloo", "--device", "cpu")
    shown = streams(done)
    assert "rank 0 waits in barrier" in done.stdout and "save_checkpoint" in done.stdout, (
        "with save_checkpoint called on rank 0 only, rank 0 should wait in save_checkpoint's "
        f"barrier and the report say so\n{shown}"
    )


# --------------------------------------------------------------------------- step 2: load

CHECKPOINT_STEP = 5


def _write_checkpoint(path, kata, device="cpu") -> dict:
    """A real checkpoint, made without the learner's code: a model and momentum after 2 steps."""
    model = make_model("frozen", 7).to(device)
    optimizer = _optimizer(kata, model)
    batches = [kata.batch_for("frozen", step, 0, 1) for step in range(2)]
    return checkpoints.trained_file(path, model, optimizer, batches, step=CHECKPOINT_STEP)


def _load_everywhere(rank, world_size, path):
    kata = load_kata(KATA)
    model, ddp, optimizer = checkpoints.wrapped_model(kata, 100 + rank, _optimizer)
    with _watching_files() as files:
        step = kata.load_checkpoint(path, ddp, optimizer)
    return {"step": step, "loads": files.loads, **checkpoints.states_after(model, optimizer)}


def _run_loads(path, world_size=2, **options):
    hang = functools.partial(_hang, "load_checkpoint")
    return checkpoints.run_checked(
        _load_everywhere, world_size, str(path), words=WORDS, hang=hang, written_by_the_test=True,
        **options,
    )  # fmt: skip


@shared_run
def _loaded():
    kata = load_kata(KATA)
    with tempfile.TemporaryDirectory(prefix="k15-load-") as folder:
        path = os.path.join(folder, "checkpoint.pt")
        checkpoint = _write_checkpoint(path, kata)
        return _run_loads(path), checkpoint


def _check_loaded(results, checkpoint) -> None:
    for rank, result in enumerate(results):
        if not isinstance(result["step"], int) or isinstance(result["step"], bool):
            raise AssertionError(
                f"rank {rank}'s load_checkpoint returned {result['step']!r}: return the "
                f"checkpoint's step as an int ({CHECKPOINT_STEP} here)"
            )
        if result["step"] != CHECKPOINT_STEP:
            raise AssertionError(
                f"rank {rank}'s load_checkpoint returned {result['step']}, but the checkpoint says "
                f"step {CHECKPOINT_STEP}: return its 'step' as it is (the loop goes on from there)"
            )
        checkpoints.check_loaded_weights(results, rank, checkpoint["model"], WORDS)
        momentum, expected = _momentum(result["optimizer"]), _momentum(checkpoint["optimizer"])
        if not momentum:
            raise AssertionError(
                f"after load_checkpoint rank {rank}'s optimizer holds no momentum, while the "
                "checkpoint does: load it too, optimizer.load_state_dict(checkpoint['optimizer']), "
                "or the resumed run steps differently"
            )
        assert momentum.keys() == expected.keys() and all(
            torch.equal(momentum[i], expected[i]) for i in expected
        ), f"rank {rank}'s optimizer state differs from the checkpoint's after load_checkpoint"


@pytest.mark.step(2)
def test_every_rank_loads_the_checkpoint_into_its_model_and_optimizer(kata):
    _check_loaded(*_loaded())


@pytest.mark.step(2)
def test_every_rank_loads_onto_its_own_device(kata):
    checkpoints.check_loaded_onto_own_device(_loaded()[0], WORDS)


@pytest.mark.step(2)
@pytest.mark.parametrize(
    "keep, lacking",
    [(None, ("model", "optimizer", "step")), (("model", "step"), ("optimizer",))],
    ids=["a_bare_state_dict", "no_optimizer"],
)
def test_a_file_that_is_not_a_checkpoint_is_refused(kata, tmp_path, keep, lacking):
    path = tmp_path / "not_a_checkpoint.pt"
    checkpoints.check_refuses(path, keep is None, lacking, WORDS, KATA, _optimizer)


# --------------------------------------------------------------------------- step 3: the loop

STEPS, SAVE_EVERY, INTERRUPT_AT = 8, 3, 5  # saves after 3 and 6 steps; the crash after 5
# 2 ranks, and bitwise equality: the same operations in the same order give the same bits. (With 3
# or more, the first step of a freshly made DDP rounds differently from its later ones, so a
# resumed run would end about 1e-8 away: the lesson's "Exactness".)
LAST_SAVED = INTERRUPT_AT // SAVE_EVERY * SAVE_EVERY


def _train_noting(rank, world_size, checkpoint, model_name, interrupt_at, folder):
    """The kata's train, with every step, save and load noted in a file as it happens (a hang
    loses the rank's return value, not its notes)."""
    kata = load_kata(KATA)

    def train():
        args = (rank, world_size, checkpoint, STEPS, SAVE_EVERY, model_name)
        try:
            return kata.train(*args, interrupt_at=interrupt_at)
        except kata.Interrupted:
            return {"interrupted": True}

    return checkpoints.train_noting(kata, WORDS, folder, rank, train)


def _uneven_saves(folder: str, world_size: int) -> str | None:
    saves = {
        r: [e["step"] for e in checkpoints.read_notes(folder, r) if e["event"] == "write"]
        for r in range(world_size)
    }
    if len({tuple(s) for s in saves.values()}) == 1:
        return None
    did = [r for r, s in saves.items() if s]
    never = [r for r, s in saves.items() if not s]
    if never:
        return (
            f"{ranks_phrase(did)} called save_checkpoint (after {saves[did[0]][0]} steps), "
            f"{ranks_phrase(never)} never did"
        )
    return "the ranks called save_checkpoint at different steps: " + ", ".join(
        f"rank {r} at {s}" for r, s in saves.items()
    )


def _train_world(world_size, folder, checkpoint, model_name, interrupt_at, **options):
    os.makedirs(folder, exist_ok=True)

    def hang(failure: WorldDeadlock) -> AssertionError:
        uneven = _uneven_saves(folder, world_size)
        if not uneven:
            return _hang("training", failure)
        return AssertionError(
            f"training hung: {uneven}. {CLASSIC_HANG} save_checkpoint makes a collective call "
            "(its barrier), so every rank must call it: call it on every rank, and let it "
            "decide inside that only rank 0 writes. Never call it under `if rank == 0:`."
            f"\n\nThe harness's report:\n{failure}"
        )

    options = {
        "words": WORDS,
        "hang": hang,
        "written_by_the_test": False,
        "deadline": 12,
        **options,
    }
    return checkpoints.run_checked(
        _train_noting, world_size, checkpoint, model_name, interrupt_at, folder, **options
    )


def _story(model_name: str, world_size: int = 2, **options) -> dict:
    """Three worlds: training that is never interrupted, training that crashes after
    INTERRUPT_AT steps, and its restart from the checkpoint that crash left."""
    with tempfile.TemporaryDirectory(prefix="k15-train-") as folder:
        story = {}
        for run, checkpoint, interrupt_at in (
            ("whole", "whole.pt", None),
            ("crashed", "crashed.pt", INTERRUPT_AT),
            ("resumed", "crashed.pt", None),
        ):
            notes = os.path.join(folder, run)
            results = _train_world(
                world_size,
                notes,
                os.path.join(folder, checkpoint),
                model_name,
                interrupt_at,
                **options,
            )
            story[run] = {
                "results": results,
                "events": [checkpoints.read_notes(notes, r) for r in range(world_size)],
            }
        return story


_shared_story = shared_run(_story)


def _trained(events) -> list[int]:
    return [e["step"] for e in events if e["event"] == "step"]


def _check_resumed(story: dict) -> None:
    whole, crashed, resumed = story["whole"], story["crashed"], story["resumed"]
    for rank, events in enumerate(crashed["events"]):
        checkpoints.check_count(rank, events, WORDS, "the crashed run")
    for rank, events in enumerate(resumed["events"]):
        trained = _trained(events)
        loads = [e["step"] for e in events if e["event"] == "load"]
        if not loads:
            raise AssertionError(
                f"the restarted run never called load_checkpoint on rank {rank} although the crashed "
                f"run had left a checkpoint of step {LAST_SAVED}: it trained steps "
                f"{trained[:1] + ['...'] + trained[-1:] if trained else 'none'} from scratch. Start "
                "from the checkpoint when the file exists."
            )
        if trained and trained[0] < LAST_SAVED:
            raise AssertionError(
                f"the restarted run loaded the checkpoint of step {loads[0]} on rank {rank}, then "
                f"trained from step {trained[0] + 1} (index {trained[0]}): steps 1-{LAST_SAVED} are "
                "already in the checkpoint. Go on from the step load_checkpoint returns."
            )
        expected = list(range(LAST_SAVED, STEPS))
        if trained != expected:
            skipped = sorted(set(expected) - set(trained))
            raise AssertionError(
                f"after loading the checkpoint of step {LAST_SAVED}, rank {rank} trained the steps "
                f"with indices {trained}, expected {expected}"
                + (f": it skipped {skipped}" if skipped else "")
                + ". The checkpoint's step counts the steps done, so the next index is that count."
            )
    checkpoints.check_same_run(
        whole["results"], resumed["results"], WORDS, _momentum, "its optimizer's momentum"
    )


@pytest.mark.step(3)
@pytest.mark.parametrize("model_name", ["frozen", "tied", "buffer"])
def test_a_resumed_run_ends_exactly_like_an_uninterrupted_one(kata, model_name):
    story = _shared_story(model_name)
    for rank, events in enumerate(story["crashed"]["events"]):
        assert _trained(events) == list(range(INTERRUPT_AT)), (
            f"the run that crashed after {INTERRUPT_AT} steps trained {_trained(events)} on rank "
            f"{rank}: train each step with run.step(ddp, optimizer, step), from 0 on a fresh start"
        )
    _check_resumed(story)


@pytest.mark.step(3)
def test_every_rank_saves_every_save_every_steps(kata):
    story = _shared_story("buffer")
    expected = list(range(SAVE_EVERY, STEPS + 1, SAVE_EVERY))
    for rank, events in enumerate(story["whole"]["events"]):
        checkpoints.check_count(rank, events, WORDS, "the uninterrupted run")
        done = checkpoints.written_after(events)
        assert done == expected, (
            f"in {STEPS} steps with save_every={SAVE_EVERY}, rank {rank} saved after "
            f"{done or 'no'} steps, expected after {expected}: save whenever the steps done are a "
            "multiple of save_every, on every rank"
        )
    assert all(r["started_at"] == 0 for r in story["whole"]["results"]), (
        "a fresh run (no checkpoint yet) must start at step 0"
    )


@pytest.mark.step(3)
def test_program_crashes_resumes_and_matches(kata, tmp_path):
    done = run_module_ok(
        KATA,
        *("--steps", "8", "--save-every", "3", "--interrupt-at", "5"),
        *("--checkpoint-dir", str(tmp_path), "--backend", "gloo", "--device", "cpu"),
    )
    shown = streams(done)
    assert "resumed at 3" in done.stdout, f"the restart should resume at step 3\n{shown}"
    for rank in range(2):
        assert f"rank {rank} after resuming: the very same weights and momentum" in done.stdout, (
            f"rank {rank} should end the resumed run with the uninterrupted run's weights\n{shown}"
        )
    assert (tmp_path / "interrupted.pt").exists(), (
        f"--checkpoint-dir keeps the checkpoints\n{shown}"
    )


# --------------------------------------------------------------------------- CUDA


@pytest.mark.step(2)
@pytest.mark.cuda
def test_load_onto_each_ranks_gpu(kata, tmp_path):
    cuda = on_cuda(2, "gloo")
    path = tmp_path / "checkpoint.pt"
    checkpoint = _write_checkpoint(path, kata, device="cuda:0")  # saved from rank 0's GPU
    results = _run_loads(path, **cuda)
    _check_loaded(results, checkpoint)
    for rank, result in enumerate(results):
        assert result["devices"] == [result["device"]], (
            f"rank {rank}'s model and optimizer hold tensors on {result['devices']} after "
            f"load_checkpoint, expected {result['device']}: map_location"
        )


@pytest.mark.step(3)
@pytest.mark.cuda
@pytest.mark.parametrize("backend, world_size", [("nccl", 1), ("gloo", 2)])
def test_resume_on_cuda(kata, backend, world_size):
    story = _story("buffer", world_size, **on_cuda(world_size, backend))
    _check_resumed(story)
