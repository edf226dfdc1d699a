"""k15 checkpoints: rank 0 writes, every rank waits and loads, a resumed run is the same run."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time

import pytest
import torch

from dojo.harness.calls import recording
from dojo.harness.impl import load_kata
from dojo.harness.world import RankFailed, WorldDeadlock, run_world
from dojo.spec.checkpoints import load_failure
from dojo.spec.cuda import on_cuda
from dojo.spec.states import devices_of, largest_gap, same, to_cpu
from dojo.spec.testing import (
    assert_refuses_missing_keys,
    ranks_phrase,
    run_program_ok,
    shared_run,
    streams,
)
from dojo.toy_models import loss, make_model

KATA = "k15_checkpoints"


def _device() -> torch.device:
    from dojo.devices import rank_device

    return rank_device()


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


def _load_file(path) -> object:
    return torch.load(path, map_location="cpu", weights_only=False)


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


# How a failed load_state_dict is told, in this kata's words (dojo.spec.checkpoints).
_WORDS = {"file": "checkpoint", "loader": "load_checkpoint", "writer": "save_checkpoint"}


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
    model = make_model("frozen", 100 + rank).to(_device())  # built apart: DDP makes them rank 0's
    ddp = kata.wrap(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=kata.LR, momentum=kata.MOMENTUM)
    inputs, targets = kata.batch_for("frozen", 0, rank, world_size)
    optimizer.zero_grad()
    loss(ddp, (inputs.to(_device()), targets.to(_device()))).backward()
    optimizer.step()  # the optimizer now holds momentum: state a checkpoint must keep
    path = os.path.join(folder, "checkpoint.pt")
    with _watching_files(SLOW_WRITE_S if rank == 0 else 0.0) as files, recording() as calls:
        kata.save_checkpoint(path, ddp, optimizer, SAVED_STEP)
    returned = time.time()
    try:
        _load_file(path)
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
        try:
            results = run_world(_save_on_two_nodes, 4, folder, deadline=30)
        except WorldDeadlock as failure:
            raise _hang("save_checkpoint", failure) from None
        path = os.path.join(folder, "checkpoint.pt")
        on_disk = _load_file(path) if os.path.exists(path) else None
        return results, on_disk


@pytest.mark.step(1)
def test_only_global_rank_0_writes_the_checkpoint(kata):
    results, on_disk = _saved()
    writers = [rank for rank, result in enumerate(results) if result["saves"]]
    assert writers, (
        "no rank called torch.save in save_checkpoint: global rank 0 must write the checkpoint"
    )
    if writers == [0, 2]:
        raise AssertionError(
            "ranks 0 and 2 both wrote the checkpoint. This world is 2 nodes x 2 ranks: ranks 0 and 2 "
            "are each LOCAL_RANK 0 of their node, and on a shared file system both write the same "
            "file. Decide by the global rank, dist.get_rank() == 0: one writer for the whole job."
        )
    if writers != [0]:
        raise AssertionError(
            f"{ranks_phrase(writers)} wrote the checkpoint: only global rank 0 may (dist.get_rank() == 0). "
            "The replicas are identical, so one copy is enough, and ranks that write one file at "
            "once can leave it torn."
        )
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
    assert on_disk is not None, "save_checkpoint left no file at the path it was given"
    assert isinstance(on_disk, dict), (
        f"the checkpoint holds a {type(on_disk).__name__}: save a dict with the keys "
        f"{kata.CHECKPOINT_KEYS}"
    )
    missing = [key for key in kata.CHECKPOINT_KEYS if key not in on_disk]
    if "optimizer" in missing and "model" in on_disk:
        raise AssertionError(
            "the checkpoint holds the model but not the optimizer: SGD's momentum is state too, "
            "and a run that resumes without it steps differently. Save optimizer.state_dict() "
            "under 'optimizer'."
        )
    assert not missing, (
        f"the checkpoint has the keys {sorted(on_disk)}; it lacks {missing}: save "
        "{'model': the model's state_dict, 'optimizer': the optimizer's, 'step': step}"
    )
    saved = on_disk["model"]
    wrapped = [name for name in saved if name.startswith("module.")]
    if wrapped:
        raise AssertionError(
            f"the checkpoint's model keys start with 'module.' ({wrapped[0]!r}): that is the state_dict "
            "of torch's DDP wrapper, which a plain model cannot load. Save the state_dict of the "
            "model inside it, model.module.state_dict()."
        )
    source = results[0]["state"]
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
    done = run_program_ok(KATA, "--show-the-hang", "--backend", "gloo", "--device", "cpu")
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
    optimizer = torch.optim.SGD(model.parameters(), lr=kata.LR, momentum=kata.MOMENTUM)
    for step in range(2):
        inputs, targets = kata.batch_for("frozen", step, 0, 1)
        optimizer.zero_grad()
        loss(model, (inputs.to(device), targets.to(device))).backward()
        optimizer.step()
    checkpoint = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "step": CHECKPOINT_STEP,
    }
    torch.save(checkpoint, path)
    return to_cpu(checkpoint)


def _load_everywhere(rank, world_size, path):
    kata = load_kata(KATA)
    model = make_model("frozen", 100 + rank).to(_device())
    ddp = kata.wrap(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=kata.LR, momentum=kata.MOMENTUM)
    with _watching_files() as files:
        step = kata.load_checkpoint(path, ddp, optimizer)
    return {
        "step": step,
        "loads": files.loads,
        "state": to_cpu(model.state_dict()),
        "optimizer": to_cpu(optimizer.state_dict()),
        "devices": sorted(devices_of(model.state_dict()) | devices_of(optimizer.state_dict())),
        "device": str(_device()),
    }


def _run_loads(path, world_size=2, **options):
    try:
        return run_world(_load_everywhere, world_size, str(path), **options)
    except WorldDeadlock as failure:
        raise _hang("load_checkpoint", failure) from None
    except RankFailed as failure:
        raise load_failure(failure, written_by_the_test=True, **_WORDS) or failure from None


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
        state = result["state"]
        if not all(torch.equal(state[name], t) for name, t in checkpoint["model"].items()):
            name, gap = largest_gap(state, checkpoint["model"])
            loaded = [
                r for r in range(len(results)) if same(results[r]["state"], checkpoint["model"])
            ]
            also = f" ({ranks_phrase(loaded)} did)" if loaded else ""
            raise AssertionError(
                f"after load_checkpoint rank {rank}'s weights are not the checkpoint's ({name!r} is "
                f"up to {gap:.3g} away){also}: every rank loads the checkpoint into its own model, "
                "not rank 0 alone (nothing copies rank 0's weights to the others afterwards)"
            )
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
    results, checkpoint = _loaded()
    _check_loaded(results, checkpoint)


@pytest.mark.step(2)
def test_every_rank_loads_onto_its_own_device(kata):
    results, _ = _loaded()
    for rank, result in enumerate(results):
        loads = result["loads"]
        assert loads, (
            f"rank {rank}'s load_checkpoint never called torch.load: read the file with "
            "torch.load(path, map_location=...)"
        )
        unmapped = [entry for entry in loads if not entry["given"]]
        if unmapped:
            raise AssertionError(
                f"rank {rank} called torch.load without map_location. torch.save remembered the "
                "device of every tensor (rank 0's cuda:0 on GPUs): without map_location every rank "
                "loads onto GPU 0, which then holds a copy per rank (or the load fails where there "
                "is no such GPU). Pass map_location=this rank's device (the device of the model's "
                "parameters) or 'cpu'."
            )
        stray = [d for d in result["devices"] if d != result["device"]]
        assert not stray, (
            f"after load_checkpoint rank {rank}'s model or optimizer holds tensors on {stray}, "
            f"expected {result['device']}"
        )


@pytest.mark.step(2)
@pytest.mark.parametrize(
    "keep, lacking",
    [(None, ("model", "optimizer", "step")), (("model", "step"), ("optimizer",))],
    ids=["a_bare_state_dict", "no_optimizer"],
)
def test_a_file_that_is_not_a_checkpoint_is_refused(kata, tmp_path, keep, lacking):
    path = tmp_path / "not_a_checkpoint.pt"
    weights = make_model("frozen", 0).state_dict()
    # torch.save(model.state_dict(), path), a common sight; or a checkpoint without its optimizer
    torch.save(weights if keep is None else {"model": weights, "step": 3}, path)
    [(outcome, message)] = run_world(_refusal, 1, str(path))
    assert_refuses_missing_keys("load_checkpoint", outcome, message, lacking)


def _refusal(rank, world_size, path):
    from dojo.todo import KataTodo

    kata = load_kata(KATA)
    model = make_model("frozen", 0)
    optimizer = torch.optim.SGD(model.parameters(), lr=kata.LR, momentum=kata.MOMENTUM)
    try:
        value = kata.load_checkpoint(path, kata.wrap(model), optimizer)
    except KataTodo:
        raise
    except Exception as error:
        return type(error).__name__, str(error)
    return "returned", repr(value)


# --------------------------------------------------------------------------- step 3: the loop

STEPS, SAVE_EVERY, INTERRUPT_AT = 8, 3, 5  # saves after 3 and 6 steps; the crash after 5
# 2 ranks, and bitwise equality: the same operations in the same order give the same bits. (With 3
# or more, the first step of a freshly made DDP rounds differently from its later ones, so a
# resumed run would end about 1e-8 away: the lesson's "Exactness".)
LAST_SAVED = INTERRUPT_AT // SAVE_EVERY * SAVE_EVERY


def _events(folder: str, rank: int) -> list[dict]:
    path = os.path.join(folder, f"rank{rank}.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as lines:
        return [json.loads(line) for line in lines if line.strip()]


def _train_noting(rank, world_size, checkpoint, model_name, interrupt_at, folder):
    """The kata's train, with every step, save and load noted in a file as it happens (a hang
    loses the rank's return value, not its notes)."""
    kata = load_kata(KATA)
    notes = open(os.path.join(folder, f"rank{rank}.jsonl"), "a", buffering=1)
    done = {"steps": 0}

    def note(**event):
        notes.write(json.dumps(event) + "\n")

    originals = {
        name: getattr(kata, name) for name in ("save_checkpoint", "load_checkpoint", "Run")
    }

    class Run(originals["Run"]):
        def step(self, model, optimizer, step):
            value = super().step(model, optimizer, step)
            done["steps"] += 1
            note(event="step", step=step)
            return value

    def save_checkpoint(path, model, optimizer, step):
        note(event="save", step=step, steps_done=done["steps"])
        originals["save_checkpoint"](path, model, optimizer, step)

    def load_checkpoint(path, model, optimizer):
        step = originals["load_checkpoint"](path, model, optimizer)
        note(event="load", step=step)
        return step

    kata.save_checkpoint, kata.load_checkpoint, kata.Run = save_checkpoint, load_checkpoint, Run
    try:
        return kata.train(
            rank, world_size, checkpoint, STEPS, SAVE_EVERY, model_name, interrupt_at=interrupt_at
        )
    except kata.Interrupted:
        return {"interrupted": True}
    finally:
        for name, original in originals.items():
            setattr(kata, name, original)
        notes.close()


def _uneven_saves(folder: str, world_size: int) -> str | None:
    saves = {
        r: [e["step"] for e in _events(folder, r) if e["event"] == "save"]
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
    try:
        return run_world(
            _train_noting,
            world_size,
            checkpoint,
            model_name,
            interrupt_at,
            folder,
            deadline=options.pop("deadline", 12),
            **options,
        )
    except WorldDeadlock as failure:
        uneven = _uneven_saves(folder, world_size)
        if uneven:
            raise AssertionError(
                f"training hung: {uneven}. {CLASSIC_HANG} save_checkpoint makes a collective call "
                "(its barrier), so every rank must call it: call it on every rank, and let it "
                "decide inside that only rank 0 writes. Never call it under `if rank == 0:`."
                f"\n\nThe harness's report:\n{failure}"
            ) from None
        raise _hang("training", failure) from None
    except RankFailed as failure:
        raise load_failure(failure, written_by_the_test=False, **_WORDS) or failure from None


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
                "events": [_events(notes, r) for r in range(world_size)],
            }
        return story


_shared_story = shared_run(_story)


def _trained(events) -> list[int]:
    return [e["step"] for e in events if e["event"] == "step"]


def _check_resumed(story: dict) -> None:
    whole, crashed, resumed = story["whole"], story["crashed"], story["resumed"]
    for rank, events in enumerate(crashed["events"]):
        wrong = next(
            (e for e in events if e["event"] == "save" and e["step"] != e["steps_done"]), None
        )
        if wrong is not None:
            raise AssertionError(
                f"the crashed run saved after {wrong['steps_done']} steps with step={wrong['step']} "
                f"on rank {rank}, so its restart goes on from the wrong place: save the count of "
                "steps done (step + 1), not the index of the last one"
            )
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
    for rank, (a, b) in enumerate(zip(whole["results"], resumed["results"])):
        if not same(a["state"], b["state"]):
            name, gap = largest_gap(b["state"], a["state"])
            raise AssertionError(
                f"after the restart rank {rank}'s weights differ from the uninterrupted run's "
                f"({name!r} by up to {gap:.3g}): a resumed run must be the same run, bit for bit"
            )
        if not same(_momentum(a["optimizer"]), _momentum(b["optimizer"])):
            raise AssertionError(
                f"after the restart rank {rank}'s weights equal the uninterrupted run's but its "
                "optimizer's momentum does not: save and load the optimizer's state too"
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
        saves = [e for e in events if e["event"] == "save"]
        wrong = next((e for e in saves if e["step"] != e["steps_done"]), None)
        if wrong is not None:
            raise AssertionError(
                f"rank {rank} called save_checkpoint after {wrong['steps_done']} steps with "
                f"step={wrong['step']}: pass the count of steps done (step + 1), which is where a "
                "restart goes on from, not the index of the last step"
            )
        done = [e["steps_done"] for e in saves]
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
    done = run_program_ok(
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
