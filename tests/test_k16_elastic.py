"""k16 elastic training: atomic snapshots from rank 0, loading them everywhere, and a group that
a killed worker's restart brings back to exactly where an uninterrupted run would be."""

from __future__ import annotations

import contextlib
import functools
import io
import os
import re
import socket
import tempfile

import pytest
import torch

from dojo.devices import rank_device
from dojo.harness import impl
from dojo.harness.impl import load_kata
from dojo.harness.world import RankCrashed, RankFailed, WorldDeadlock, run_world
from dojo.spec import checkpoints
from dojo.spec.cuda import on_cuda
from dojo.spec.states import same, to_cpu
from dojo.spec.testing import (
    run_module_ok,
    shared_run,
    streams,
)
from dojo.toy_models import loss, make_model

KATA = "k16_elastic"


def _optimizer(kata, model):
    """The kata's optimizer: Adam."""
    return torch.optim.Adam(model.parameters(), lr=kata.LR)


def _epochs(count: int) -> str:
    return f"{count} epoch" if count == 1 else f"{count} epochs"


def _target(f) -> str | None:
    """The file ``torch.save`` wrote to (a path, or an open file's path), or None if unknown."""
    if isinstance(f, (str, os.PathLike)):
        return os.path.realpath(os.fspath(f))
    name = getattr(f, "name", None)
    if isinstance(name, str):
        return os.path.realpath(name)
    try:  # os.fdopen(descriptor) names the file by its number: ask the kernel for its path
        return os.path.realpath(os.readlink(f"/proc/self/fd/{f.fileno()}"))
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
        return None


def _inode(f) -> int | None:
    try:
        if isinstance(f, (str, os.PathLike)):
            return os.stat(f).st_ino
        f.flush()
        return os.fstat(f.fileno()).st_ino
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
        return None


@contextlib.contextmanager
def _watching_files():
    """Record every ``torch.save`` (where, and the inode of what it wrote) and ``torch.load``
    (with which ``map_location``) of this rank."""
    import torch.serialization as serialization

    saves, loads = [], []
    originals = (serialization.save, serialization.load, torch.save, torch.load)

    def save(obj, f, *args, **kwargs):
        result = originals[0](obj, f, *args, **kwargs)
        saves.append({"target": _target(f), "inode": _inode(f)})
        return result

    def load(f, *args, **kwargs):
        where = kwargs.get("map_location", args[0] if args else None)
        loads.append({"target": _target(f), "given": where is not None})
        return originals[1](f, *args, **kwargs)

    serialization.save, torch.save = save, save
    serialization.load, torch.load = load, load
    try:
        yield saves, loads
    finally:
        serialization.save, serialization.load, torch.save, torch.load = originals


_FILE_CALLS = ("remove", "unlink", "rename", "replace")  # pathlib and shutil.move use these


def _basename(argument) -> str:
    if isinstance(argument, (str, bytes, os.PathLike)):
        return repr(os.path.basename(os.fspath(argument)))
    return repr(argument)


@contextlib.contextmanager
def _watching_the_snapshot(path: str):
    """After every os.remove, os.unlink, os.rename and os.replace of this rank, look whether a
    snapshot is at ``path``: a worker killed at any such moment must leave one. Yields the
    moments it was gone: ``(the call that took it away, the call that brought it back or None)``."""
    gaps: list[list] = []
    originals = {name: getattr(os, name) for name in _FILE_CALLS}

    def watched(name):
        def call(*args, **kwargs):
            result = originals[name](*args, **kwargs)
            shown = f"os.{name}({', '.join(_basename(a) for a in args)})"
            there = os.path.exists(path)
            if not there and (not gaps or gaps[-1][1] is not None):
                gaps.append([shown, None])
            elif there and gaps and gaps[-1][1] is None:
                gaps[-1][1] = shown
            return result

        return call

    for name in _FILE_CALLS:
        setattr(os, name, watched(name))
    try:
        yield gaps
    finally:
        for name, original in originals.items():
            setattr(os, name, original)


def _hang(what: str, failure: WorldDeadlock) -> AssertionError:
    return AssertionError(
        f"{what} hung: a collective that only some ranks call (inside `if rank == 0:`?). Writing "
        "and loading a snapshot need no collective at all.\n\nThe harness's report:\n"
        f"{failure}"
    )


WORDS = checkpoints.Words(
    file="snapshot", writer="write_snapshot", loader="load_snapshot", unit="epoch"
)


def _train_one_step(kata, model, optimizer, rank, world_size) -> None:
    inputs, targets = kata.batch_for("frozen", 0, 0, rank, world_size)
    optimizer.zero_grad()
    loss(model, (inputs.to(rank_device()), targets.to(rank_device()))).backward()
    optimizer.step()  # Adam now holds moments and a step count: state a snapshot must keep


# --------------------------------------------------------------------------- step 1: write

EPOCHS_DONE = 2
SNAPSHOT = "snapshot.pt"


def _write_on_two_nodes(rank, world_size, folder):
    # 4 ranks laid out as 2 nodes x 2, as torchrun would set them: LOCAL_RANK is 0 twice.
    os.environ.update(LOCAL_RANK=str(rank % 2), LOCAL_WORLD_SIZE="2", GROUP_RANK=str(rank // 2))
    kata = load_kata(KATA)
    # built apart: DDP makes them rank 0's
    model, ddp, optimizer = checkpoints.wrapped_model(kata, 100 + rank, _optimizer)
    _train_one_step(kata, ddp, optimizer, rank, world_size)
    path = os.path.join(folder, SNAPSHOT)
    with _watching_files() as (saves, _), _watching_the_snapshot(path) as gaps:
        kata.write_snapshot(path, ddp, optimizer, EPOCHS_DONE)
    return {
        "saves": saves,
        "gaps": gaps,
        "path": os.path.realpath(path),
        "inode": _inode(path) if os.path.exists(path) else None,
        "listing": sorted(os.listdir(folder)),
        "state": to_cpu(model.state_dict()),
        "optimizer": to_cpu(optimizer.state_dict()),
    }


@shared_run
def _written():
    with tempfile.TemporaryDirectory(prefix="k16-write-") as folder:
        # The snapshot of an earlier epoch is there already: write_snapshot replaces it.
        torch.save(
            {"model": {}, "optimizer": {}, "epoch": EPOCHS_DONE - 1}, os.path.join(folder, SNAPSHOT)
        )
        hang = functools.partial(_hang, "write_snapshot")
        options = {"words": WORDS, "hang": hang, "written_by_the_test": False, "deadline": 30}
        results = checkpoints.run_checked(_write_on_two_nodes, 4, folder, **options)
        return results, checkpoints.read_file(os.path.join(folder, SNAPSHOT))


@pytest.mark.step(1)
def test_only_global_rank_0_writes_the_snapshot(kata):
    results, _ = _written()
    checkpoints.check_one_writer(results, WORDS)


@pytest.mark.step(1)
def test_the_snapshot_is_written_beside_it_then_renamed_into_place(kata):
    results, on_disk = _written()
    rank_0 = results[0]
    saves, path = rank_0["saves"], rank_0["path"]
    assert saves, "rank 0 never called torch.save in write_snapshot"
    in_place = [s for s in saves if s["target"] == path]
    if in_place:
        raise AssertionError(
            f"torch.save wrote straight to the snapshot's path ({os.path.basename(path)}), in "
            "place: a worker killed in the middle of it leaves half a file where the last good "
            "snapshot was, and "
            "the restart cannot load anything. Write to a temporary file in the same folder, then "
            "os.replace it over the snapshot (one step: the old file or the new one)."
        )
    folder = os.path.dirname(path)
    elsewhere = [s for s in saves if s["target"] and os.path.dirname(s["target"]) != folder]
    if elsewhere:
        raise AssertionError(
            f"rank 0 wrote the snapshot to {elsewhere[0]['target']}, outside the snapshot's folder: "
            "a rename is atomic only within one file system, and a temporary folder is often "
            "another one (where a move is a copy, or os.replace fails with EXDEV). Make the "
            "temporary file in the snapshot's own folder."
        )
    assert on_disk is not None and rank_0["inode"] is not None, (
        f"after write_snapshot there is no file at the snapshot's path: rank 0 wrote "
        f"{saves[-1]['target']}; os.replace it over {os.path.basename(path)}"
    )
    if rank_0["inode"] != saves[-1]["inode"]:
        raise AssertionError(
            "the snapshot is not the file torch.save wrote (another inode): it was copied over, "
            "and a copy is written piece by piece, so a crash during it tears the snapshot just "
            "the same. Rename the temporary file over the snapshot: os.replace(temporary, path)."
        )
    leftovers = [name for name in rank_0["listing"] if name != SNAPSHOT]
    assert not leftovers, (
        f"write_snapshot left {leftovers} beside the snapshot: one temporary file, renamed over "
        "the snapshot, is all it takes. os.replace replaces the old snapshot in the same step: no "
        "backup to keep, and no moment without a snapshot."
    )


@pytest.mark.step(1)
def test_there_is_a_snapshot_at_every_moment_of_a_write(kata):
    results, _ = _written()
    gaps = results[0]["gaps"]
    if not gaps:
        return
    gone, back = gaps[0]
    raise AssertionError(
        f"while write_snapshot replaced the snapshot of epoch {EPOCHS_DONE - 1}, its "
        f"{gone} left no snapshot at all"
        + (f" until {back}" if back else ", and none was there when it returned")
        + ": a worker killed in that window (a kill can land anywhere) leaves nothing to "
        "restart from. os.replace(temporary, path) replaces the old snapshot in one step, even "
        "when it exists: do not remove it (or move it aside) first."
    )


@pytest.mark.step(1)
def test_the_snapshot_holds_the_unwrapped_model_the_optimizer_and_the_epoch(kata):
    results, on_disk = _written()
    why = (
        "Adam's moments and step count are state too, and a restarted run without them steps "
        "differently"
    )
    checkpoints.check_holds_the_parts(on_disk, kata.SNAPSHOT_KEYS, WORDS, why)
    assert same(on_disk["model"], results[0]["state"]), (
        "the snapshot's model differs from rank 0's: save the model's own state_dict"
    )
    assert same(on_disk["optimizer"], results[0]["optimizer"]), (
        "the snapshot's 'optimizer' is not rank 0's optimizer.state_dict()"
    )
    assert on_disk["epoch"] == EPOCHS_DONE, (
        f"the snapshot says epoch {on_disk['epoch']!r}; write_snapshot was given epoch={EPOCHS_DONE}"
    )


class _Killed(BaseException):
    """The stand-in for SIGKILL during a write: no `except Exception` stops it."""


def _killed_halfway(rank, world_size, folder):
    kata = load_kata(KATA)
    model = make_model("frozen", 0)
    ddp = kata.wrap(model)
    optimizer = _optimizer(kata, model)
    path = os.path.join(folder, SNAPSHOT)
    kata.write_snapshot(path, ddp, optimizer, 1)
    _train_one_step(kata, ddp, optimizer, rank, world_size)
    import torch.serialization as serialization

    originals = (serialization.save, torch.save)

    def dying_save(obj, f, *args, **kwargs):
        buffer = io.BytesIO()
        originals[0](obj, buffer)
        half = buffer.getvalue()[: len(buffer.getvalue()) // 2]
        if isinstance(f, (str, os.PathLike)):
            with open(f, "wb") as file:
                file.write(half)
        else:
            f.write(half)
            f.flush()
        raise _Killed()

    serialization.save, torch.save = dying_save, dying_save
    try:
        kata.write_snapshot(path, ddp, optimizer, 2)
        died = False
    except _Killed:
        died = True
    finally:
        serialization.save, torch.save = originals
    try:
        snapshot = torch.load(path, map_location="cpu", weights_only=False)
        return died, None, snapshot.get("epoch") if isinstance(snapshot, dict) else None
    except Exception as error:
        return died, f"{type(error).__name__}: {str(error).strip().splitlines()[0][:160]}", None


@pytest.mark.step(1)
def test_a_write_killed_halfway_leaves_the_last_snapshot_whole(kata, tmp_path):
    [(died, unreadable, epoch)] = run_world(_killed_halfway, 1, str(tmp_path))
    assert died, (
        "the test made torch.save die halfway through the second write_snapshot, but "
        "write_snapshot did not go down with it: let the failure through"
    )
    if unreadable:
        raise AssertionError(
            "write_snapshot died halfway through writing the snapshot of epoch 2 and left the "
            f"snapshot unreadable ({unreadable}): it was written in place, so the good snapshot of "
            "epoch 1 is gone and a restart has nothing to load. Write to a temporary file in the "
            "same folder, then os.replace it over the snapshot."
        )
    assert epoch == 1, (
        f"after a write that died halfway the snapshot says epoch {epoch!r}; it must still be the "
        "whole snapshot of epoch 1"
    )


# --------------------------------------------------------------------------- step 2: load

SNAPSHOT_EPOCH = 2


def _write_a_snapshot(path, kata, device="cpu") -> dict:
    """A real snapshot, made without the learner's code: a model and Adam's state after 2 steps."""
    model = make_model("frozen", 7).to(device)
    optimizer = _optimizer(kata, model)
    batches = [kata.batch_for("frozen", 0, step, 0, 1) for step in range(2)]
    return checkpoints.trained_file(path, model, optimizer, batches, epoch=SNAPSHOT_EPOCH)


def _load_everywhere(rank, world_size, path):
    kata = load_kata(KATA)
    model, ddp, optimizer = checkpoints.wrapped_model(kata, 100 + rank, _optimizer)
    before = to_cpu(model.state_dict())
    with _watching_files() as (_, loads):
        epoch = kata.load_snapshot(path, ddp, optimizer)
    after = checkpoints.states_after(model, optimizer)
    return {"epoch": epoch, "loads": loads, "before": before, **after}


def _run_loads(path, world_size=2, **options):
    options = {"words": WORDS, "written_by_the_test": True, **options}
    hang = functools.partial(_hang, "load_snapshot")
    return checkpoints.run_checked(_load_everywhere, world_size, str(path), hang=hang, **options)


@shared_run
def _loaded():
    kata = load_kata(KATA)
    with tempfile.TemporaryDirectory(prefix="k16-load-") as folder:
        path = os.path.join(folder, SNAPSHOT)
        snapshot = _write_a_snapshot(path, kata)
        return _run_loads(path), snapshot


def _check_loaded(results, snapshot) -> None:
    for rank, result in enumerate(results):
        if result["epoch"] != SNAPSHOT_EPOCH or isinstance(result["epoch"], bool):
            raise AssertionError(
                f"rank {rank}'s load_snapshot returned {result['epoch']!r}, but the snapshot holds "
                f"{_epochs(SNAPSHOT_EPOCH)}: return its 'epoch' as an int, as it is (the loop "
                "goes on from there)"
            )
        checkpoints.check_loaded_weights(results, rank, snapshot["model"], WORDS)
        if not result["optimizer"].get("state"):
            raise AssertionError(
                f"after load_snapshot rank {rank}'s optimizer holds no state (Adam's moments and "
                "step count), while the snapshot does: optimizer.load_state_dict(snapshot"
                "['optimizer']), or the restarted run steps differently"
            )
        assert same(result["optimizer"]["state"], snapshot["optimizer"]["state"]), (
            f"rank {rank}'s optimizer state differs from the snapshot's after load_snapshot"
        )


@pytest.mark.step(2)
def test_every_rank_loads_the_snapshot_into_its_model_and_optimizer(kata):
    _check_loaded(*_loaded())


@pytest.mark.step(2)
def test_every_rank_loads_onto_its_own_device(kata):
    checkpoints.check_loaded_onto_own_device(_loaded()[0], WORDS)


@pytest.mark.step(2)
def test_a_first_start_finds_no_snapshot_and_starts_at_0(kata, tmp_path):
    try:
        results = _run_loads(tmp_path / "no_snapshot_yet.pt")
    except RankFailed as failure:
        if "FileNotFoundError" in str(failure) or "No such file" in str(failure):
            raise AssertionError(
                "load_snapshot raised FileNotFoundError on a first start: the very first run of a "
                "job has no snapshot yet, which is normal. Return 0 (no epoch done) and leave the "
                f"model and optimizer as they are.\n\n{failure}"
            ) from None
        raise
    for rank, result in enumerate(results):
        assert result["epoch"] == 0 and not isinstance(result["epoch"], bool), (
            f"with no snapshot yet rank {rank}'s load_snapshot returned {result['epoch']!r}: a first "
            "start has done 0 epochs, return 0"
        )
        assert same(result["state"], result["before"]) and not result["optimizer"].get("state"), (
            f"with no snapshot yet load_snapshot changed rank {rank}'s model or optimizer: leave "
            "them as they are"
        )


@pytest.mark.step(2)
@pytest.mark.parametrize(
    "keep, lacking",
    [(None, ("model", "optimizer", "epoch")), (("model", "epoch"), ("optimizer",))],
    ids=["a_bare_state_dict", "no_optimizer"],
)
def test_a_file_that_is_not_a_snapshot_is_refused(kata, tmp_path, keep, lacking):
    path = tmp_path / "not_a_snapshot.pt"
    checkpoints.check_refuses(path, keep is None, lacking, WORDS, KATA, _optimizer)


# --------------------------------------------------------------------------- step 3: the loop

EPOCHS = 3
FAULT = "1:1:2"  # rank 1 dies in epoch 1 at step 2: the snapshot of 1 epoch is on disk
# 2 ranks, and bitwise equality (why not more: k15's lesson, "Exactness").


def _train_noting(rank, world_size, snapshot, model_name, fault, folder):
    """The kata's train, with every epoch, write and load noted in a file as it happens (a
    killed rank loses its return value, not its notes)."""
    kata = load_kata(KATA)

    def train():
        parsed = kata.Fault.parse(fault, f"{snapshot}.fault-fired") if fault else None
        return kata.train(rank, world_size, snapshot, EPOCHS, model_name, fault=parsed)

    return checkpoints.train_noting(kata, WORDS, folder, rank, train)


def _train_world(world_size, folder, snapshot, model_name, fault, **options):
    os.makedirs(folder, exist_ok=True)
    hang = functools.partial(_hang, "training")
    options = {"words": WORDS, "written_by_the_test": False, "deadline": 20, **options}
    args = (world_size, snapshot, model_name, fault, folder)
    return checkpoints.run_checked(_train_noting, *args, hang=hang, **options)


def _story(model_name: str, world_size: int = 2, fault: str = FAULT, **options) -> dict:
    """Three worlds: training never interrupted; training in which a rank kills itself
    mid-epoch (SIGKILL), as a worker under torchrun would die; and the new world a restart
    starts after it, from the same snapshot."""
    with tempfile.TemporaryDirectory(prefix="k16-train-") as folder:
        story = {}
        whole = os.path.join(folder, "whole")
        story["whole"] = {
            "results": _train_world(
                world_size, whole, os.path.join(folder, "whole.pt"), model_name, None, **options
            ),
            "events": [checkpoints.read_notes(whole, r) for r in range(world_size)],
        }
        snapshot = os.path.join(folder, "snapshot.pt")
        crashed = os.path.join(folder, "crashed")
        try:
            _train_world(world_size, crashed, snapshot, model_name, fault, **options)
            fired = False
        except (RankCrashed, RankFailed, AssertionError) as failure:
            fired = os.path.exists(f"{snapshot}.fault-fired")
            if not fired:  # a failure of its own, not the injected fault
                raise failure from None
        story["crashed"] = {
            "fired": fired,
            "events": [checkpoints.read_notes(crashed, r) for r in range(world_size)],
        }
        resumed = os.path.join(folder, "resumed")
        story["resumed"] = {
            "results": _train_world(world_size, resumed, snapshot, model_name, fault, **options),
            "events": [checkpoints.read_notes(resumed, r) for r in range(world_size)],
        }
        return story


_shared_story = shared_run(_story)


def _trained(events) -> list[int]:
    return [e["epoch"] for e in events if e["event"] == "epoch"]


def _check_resumed(story: dict, fault: str = FAULT) -> None:
    killed, dies_in = (int(part) for part in fault.split(":")[:2])
    crashed, resumed = story["crashed"], story["resumed"]
    assert crashed["fired"], (
        f"the injected fault (rank {killed} killing itself in epoch {dies_in}) never fired: train "
        "every epoch with run.epoch(ddp, optimizer, epoch), from epoch 0 on a first start"
    )
    for rank, events in enumerate(crashed["events"]):
        checkpoints.check_count(rank, events, WORDS, "the killed run")
    for rank, events in enumerate(resumed["events"]):
        trained = _trained(events)
        loads = [e for e in events if e["event"] == "load"]
        expected = list(range(dies_in, EPOCHS))
        if not loads:
            raise AssertionError(
                f"the restarted world never called load_snapshot on rank {rank}: it trained epochs "
                f"{trained} from scratch. Load the snapshot first (a first start gets 0)."
            )
        if loads[0]["epoch"] < dies_in:
            found = (
                f"a snapshot of {_epochs(loads[0]['epoch'])}"
                if loads[0]["found"]
                else "no snapshot"
            )
            raise AssertionError(
                f"the restarted world found {found} on rank {rank}, but the killed run had "
                f"finished {_epochs(dies_in)} before it died: the restart trains again everything "
                "after the last snapshot. Write a snapshot after every epoch."
            )
        if trained != expected:
            raise AssertionError(
                f"the restarted world loaded a snapshot of {_epochs(loads[0]['epoch'])} on rank "
                f"{rank}, then trained epochs {trained}, expected {expected}: go on from the "
                "epoch load_snapshot returns, and train each remaining epoch once"
            )
    checkpoints.check_same_run(
        story["whole"]["results"],
        resumed["results"],
        WORDS,
        optimizer_part=lambda state: state["state"],
        kept="its Adam state",
    )


@pytest.mark.step(3)
@pytest.mark.parametrize("model_name", ["frozen", "tied", "buffer"])
def test_a_killed_worker_and_its_restart_end_like_an_uninterrupted_run(kata, model_name):
    _check_resumed(_shared_story(model_name))


@pytest.mark.step(3)
def test_a_first_start_trains_every_epoch_and_snapshots_each(kata):
    story = _shared_story("buffer")
    expected = list(range(1, EPOCHS + 1))
    for rank, events in enumerate(story["whole"]["events"]):
        assert _trained(events) == list(range(EPOCHS)), (
            f"a first start (no snapshot) trained epochs {_trained(events)} on rank {rank}, "
            f"expected {list(range(EPOCHS))}"
        )
        checkpoints.check_count(rank, events, WORDS, "a first start")
        done = checkpoints.written_after(events)
        assert done == expected, (
            f"in {_epochs(EPOCHS)}, rank {rank} wrote snapshots after {done or 'no'} epochs, "
            f"expected after each one ({expected}): write a snapshot after every epoch (every "
            "epoch without one is an epoch a restart trains again)"
        )


_PID = re.compile(r"^\[rank (\d+)\] pid (\d+), restart (\d+)$", re.M)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _loopback() -> str:
    names = {name for _, name in socket.if_nameindex()}
    return "lo" if "lo" in names or "lo0" not in names else "lo0"


def _stop_workers(output: str) -> list[int]:
    """torchrun starts its workers in sessions of their own, which run_module cannot see: the
    workers that the output names and that still run, killed."""
    leftovers = [int(pid) for _, pid, _ in _PID.findall(output) if _alive(int(pid))]
    for pid in leftovers:
        with contextlib.suppress(OSError):
            os.kill(pid, 9)
    return leftovers


@pytest.mark.step(3)
@pytest.mark.slow  # torchrun for real: an agent and 2 x 2 workers, each importing torch (~10 s)
def test_torchrun_restarts_the_group_after_a_killed_worker(kata, tmp_path):
    reference = _shared_story("buffer")["whole"]["results"][0]  # the uninterrupted run (harness)
    out = tmp_path / "result.pt"
    try:
        done = run_module_ok(
            KATA,
            *("--epochs", str(EPOCHS), "--fault", FAULT, "--no-reference", "--out", str(out)),
            *("--snapshot-dir", str(tmp_path), "--timeout", "150"),
            *("--world-size", "2", "--backend", "gloo", "--device", "cpu"),
            timeout=180,
            env={"GLOO_SOCKET_IFNAME": _loopback()},  # on loopback, whatever the host name says
        )
    except BaseException as failure:  # its message holds the output: stop the workers it names
        _stop_workers(str(failure))
        raise
    leftovers = _stop_workers(done.stdout)
    shown = streams(done)
    assert not leftovers, (
        f"torchrun's workers {leftovers} were still running after it ended\n{shown}"
    )
    starts = {(int(rank), int(restart)) for rank, _, restart in _PID.findall(done.stdout)}
    assert starts == {(0, 0), (1, 0), (0, 1), (1, 1)}, (
        f"expected both workers to start twice (restart 0, then restart 1 after the fault), got "
        f"{sorted(starts)}\n{shown}"
    )
    assert "[rank 1] injected fault" in done.stdout, f"the fault never fired\n{shown}"
    result = torch.load(out, map_location="cpu", weights_only=False)
    assert result["trained"] == list(range(1, EPOCHS)), (
        f"after the restart the group trained epochs {result['trained']}, expected "
        f"{list(range(1, EPOCHS))} (the snapshot held 1 epoch)\n{shown}"
    )
    assert same(result["state"], reference["state"]) and same(
        result["optimizer"]["state"], reference["optimizer"]["state"]
    ), f"the group torchrun restarted does not end like the uninterrupted run\n{shown}"


# --------------------------------------------------------------------------- CUDA


@pytest.mark.step(2)
@pytest.mark.cuda
def test_load_onto_each_ranks_gpu(kata, tmp_path):
    cuda = on_cuda(2, "gloo")
    path = tmp_path / SNAPSHOT
    snapshot = _write_a_snapshot(path, kata, device="cuda:0")  # saved from rank 0's GPU
    results = _run_loads(path, **cuda)
    _check_loaded(results, snapshot)
    for rank, result in enumerate(results):
        cuda = [d for d in result["devices"] if d != "cpu"]  # Adam keeps its step count on the CPU
        assert cuda == [result["device"]], (
            f"rank {rank}'s model and optimizer hold tensors on {result['devices']} after "
            f"load_snapshot, expected {result['device']}: map_location"
        )


@pytest.mark.step(3)
@pytest.mark.cuda
@pytest.mark.parametrize("backend, world_size", [("nccl", 1), ("gloo", 2)])
def test_restart_on_cuda(kata, backend, world_size):
    cuda = on_cuda(world_size, backend)
    fault = f"{world_size - 1}:1:2"
    story = _story("buffer", world_size, fault, **cuda)
    _check_resumed(story, fault)


# --------------------------------------------------------------------------- a host lost and back
#
# Two fake hosts (dojo.spec.hosts: network namespaces with their own addresses; Linux and root only,
# elsewhere this skips saying what is missing), one worker each, torchrun's c10d rendezvous on
# host-a. The snapshot sits in a folder both hosts see, as a shared file system would be.

HOST_EPOCHS = 40  # ~50 ms each across the two hosts: time to kill host-b between two snapshots
# torch's agents share their rendezvous store with the workers by default, and a surviving agent
# never writes the store's address for the next round again, so a replaced agent waits for it
# until its timeout (torch 2.14; compare pytorch/pytorch#135712). A job whose hosts may be
# replaced turns the sharing off.
NO_SHARED_STORE = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def _train_whole(rank, world_size, snapshot, epochs):
    return load_kata(KATA).train_one_thread(rank, world_size, snapshot, epochs)


def _host_log(label: str, log) -> str:
    """What a host's torchrun printed, without torch's info and warning lines."""
    log.seek(0)
    text = log.read()
    noise = re.compile(r"^([WI]\d{4} |\[W\d{4} )")  # torch's info and warning lines
    traceback = re.compile(r"^\[rank\d+\]: (?!\w+(Error|Exception)\b)")  # all but its error
    kept = [line for line in text.splitlines() if not (noise.match(line) or traceback.match(line))]
    return f"{label} printed:\n" + "\n".join(kept)[-2500:]


def _restart_counts(group) -> dict[str, list[str]]:
    """Each host's workers (not its agent) and the TORCHELASTIC_RESTART_COUNT they were given."""
    counts = {}
    for host in group:
        found = []
        for pid in host.pids():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if b"torch.distributed.run" in f.read():
                        continue
                with open(f"/proc/{pid}/environ", "rb") as f:
                    names = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
            except OSError:
                continue
            if b"TORCHELASTIC_RESTART_COUNT" in names:
                found.append(names[b"TORCHELASTIC_RESTART_COUNT"].decode())
        counts[host.name] = found
    return counts


@pytest.mark.step(3)
@pytest.mark.slow  # two agents and three workers across two hosts, and a reference run: ~30 s
def test_a_host_killed_and_brought_back_resumes_from_the_snapshot(kata, tmp_path):
    """Mid-training, every process of host-b is killed (its agent and its worker). host-a's
    agent restarts its worker and waits at the rendezvous; host-b, started again, joins; the
    new group loads the last snapshot and ends exactly like a run that was never interrupted."""
    import signal
    import subprocess
    import sys
    import time

    from dojo.curriculum import ROOT
    from dojo.spec.testing import fake_hosts_or_skip
    from dojo.todo import find_todo

    snapshot, out = tmp_path / "snapshot.pt", tmp_path / "result.pt"
    with fake_hosts_or_skip(2) as group:
        a, b = group
        command = [
            sys.executable,
            *("-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1"),
            *("--rdzv-backend", "c10d", "--rdzv-endpoint", f"{a.address}:29400"),
            *("--max-restarts", "1", "--monitor-interval", "0.2"),
            *("-m", f"{impl.current()}.{KATA}", "--snapshot", str(snapshot)),
            *("--epochs", str(HOST_EPOCHS), "--out", str(out), "--backend", "gloo"),
            *("--device", "cpu"),
        ]
        launched = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR")
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in (*launched, "MASTER_PORT", "GLOO_SOCKET_IFNAME")
        }
        env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **NO_SHARED_STORE)
        labels = {"a": a.name, "b": f"{b.name} (first)", "b again": f"{b.name} (started again)"}
        logs = {name: tempfile.TemporaryFile("w+") for name in labels}

        def start(host, name):
            return host.popen(
                command, cwd=ROOT, env=env, stdout=logs[name], stderr=subprocess.STDOUT
            )

        def shown() -> str:
            return "\n\n".join(_host_log(labels[n], log) for n, log in logs.items())

        def todo_or(failure: str):
            for log in logs.values():
                log.seek(0)
                todo = find_todo(AssertionError(log.read()))
                if todo is not None:
                    raise todo
            raise AssertionError(f"{failure}\n\n{shown()}")

        agents = {"a": start(a, "a"), "b": start(b, "b")}
        deadline = time.monotonic() + 90
        while not snapshot.exists():
            if any(p.poll() is not None for p in agents.values()):
                todo_or("a torchrun ended before the first snapshot was written")
            if time.monotonic() > deadline:
                todo_or("no snapshot was written within 90 s of starting both hosts")
            time.sleep(0.005)
        while b.pids():  # host-b goes: its agent and its worker, at once
            for pid in b.pids():
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
        agents["b"].wait()
        assert not out.exists(), (
            "training had already finished when host-b was killed: nothing was tested (give it "
            "more epochs)"
        )
        agents["b again"] = start(b, "b again")
        deadline = time.monotonic() + 45  # it takes ~15 s: the rendezvous drops the dead host first
        for name in ("a", "b again"):
            try:
                agents[name].wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                todo_or(
                    f"host-{name[0]}'s torchrun was still running 45 s after host-b came back; "
                    f"the workers' restart counts: {_restart_counts(group)}"
                )
        if agents["a"].returncode or agents["b again"].returncode:
            todo_or("after host-b came back, a torchrun failed")
        assert out.exists(), f"no result was saved by the group that finished\n\n{shown()}"
    whole = run_world(_train_whole, 2, str(tmp_path / "whole.pt"), HOST_EPOCHS, deadline=60)
    result = torch.load(out, map_location="cpu", weights_only=False)
    assert 1 <= result["started_at"] < HOST_EPOCHS, (
        f"the group that finished started at epoch {result['started_at']}: after host-b came back "
        f"it must go on from the last snapshot\n\n{shown()}"
    )
    assert result["trained"] == list(range(result["started_at"], HOST_EPOCHS)), (
        f"the group that finished started at epoch {result['started_at']} and trained "
        f"{result['trained']}: each remaining epoch once"
    )
    assert same(result["state"], whole[0]["state"]) and same(
        result["optimizer"]["state"], whole[0]["optimizer"]["state"]
    ), (
        "after host-b was killed and brought back, the weights or Adam's state differ from the "
        f"uninterrupted run's\n\n{shown()}"
    )
