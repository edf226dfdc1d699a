"""k16's mistakes catalogue: real mistakes in writing, loading and resuming from snapshots under
torchrun, and right answers written another way. See ``dojo/dev/mistakes/__init__.py`` for what
each list promises."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from dojo.dev.mistakes import Mistake, RightAnswer
from dojo.harness import impl


def _k16():
    """The reference module, with this entry swapped in. Under torchrun (or in a rank of the
    kata's program) that is the program's own module, not a second copy of it."""
    for name in ("__mp_main__", "__main__"):
        module = sys.modules.get(name)
        if module is not None and impl.kata_name_of(module) == "k16_elastic":
            return module
    return impl.load_kata("k16_elastic")


def _inner(model):
    return model.module if isinstance(model, DistributedDataParallel) else model


def _snapshot(model, optimizer, epoch) -> dict:
    return {
        "model": _inner(model).state_dict(),
        "optimizer": optimizer.state_dict(),
        "epoch": epoch,
    }


# --------------------------------------------------------------------------- write_snapshot


def written_in_place(path, model, optimizer, epoch):
    if dist.get_rank() == 0:  # torch.save is "one call": but a kill can land in the middle of it
        torch.save(_snapshot(model, optimizer, epoch), path)


def temporary_file_in_tmp(path, model, optimizer, epoch):
    if dist.get_rank() == 0:  # the system's temporary folder: often another file system
        with tempfile.NamedTemporaryFile(delete=False, suffix=".pt") as file:
            torch.save(_snapshot(model, optimizer, epoch), file)
        shutil.move(file.name, path)  # across file systems a move is a copy


def copied_not_renamed(path, model, optimizer, epoch):
    if dist.get_rank() == 0:
        temporary = f"{path}.tmp"
        torch.save(_snapshot(model, optimizer, epoch), temporary)
        shutil.copyfile(temporary, path)  # rewrites the snapshot piece by piece
        os.remove(temporary)


def old_one_moved_aside(path, model, optimizer, epoch):
    if dist.get_rank() == 0:
        temporary = f"{path}.tmp"
        torch.save(_snapshot(model, optimizer, epoch), temporary)
        if os.path.exists(path):  # "keep a backup": between the renames there is no snapshot
            os.replace(path, f"{path}.old")
        os.replace(temporary, path)


def removed_then_renamed(path, model, optimizer, epoch):
    if dist.get_rank() == 0:
        temporary = f"{path}.tmp"
        torch.save(_snapshot(model, optimizer, epoch), temporary)
        if os.path.exists(path):  # "a rename onto an existing file fails" (on Windows it does)
            os.remove(path)  # a kill here leaves no snapshot at all
        os.rename(temporary, path)


def named_parameters_saved(path, model, optimizer, epoch):
    if dist.get_rank() == 0:  # "the weights are the parameters": a tied one once, no buffer
        weights = {name: p.detach() for name, p in _inner(model).named_parameters()}
        snapshot = {"model": weights, "optimizer": optimizer.state_dict(), "epoch": epoch}
        torch.save(snapshot, f"{path}.tmp")
        os.replace(f"{path}.tmp", path)


def every_rank_writes(path, model, optimizer, epoch):
    temporary = f"{path}.{dist.get_rank()}.tmp"  # atomic, and N writers of one file
    torch.save(_snapshot(model, optimizer, epoch), temporary)
    os.replace(temporary, path)


def local_rank_0_writes(path, model, optimizer, epoch):
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:  # torchrun's LOCAL_RANK: once per node
        temporary = f"{path}.{os.environ.get('GROUP_RANK', '0')}.tmp"
        torch.save(_snapshot(model, optimizer, epoch), temporary)
        os.replace(temporary, path)


def wrapper_state_dict(path, model, optimizer, epoch):
    if dist.get_rank() == 0:  # DDP's own keys: "module.first.weight", ...
        snapshot = {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "epoch": epoch,
        }
        torch.save(snapshot, f"{path}.tmp")
        os.replace(f"{path}.tmp", path)


def model_only(path, model, optimizer, epoch):
    if dist.get_rank() == 0:  # "the weights are the model"
        torch.save({"model": _inner(model).state_dict(), "epoch": epoch}, f"{path}.tmp")
        os.replace(f"{path}.tmp", path)


# Right answers written differently.


def unique_temporary_and_fsync(path, model, optimizer, epoch):
    """mkstemp in the snapshot's folder, fsync before the rename, clean up after a failure."""
    if dist.get_rank() != 0:
        return
    descriptor, temporary = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)))
    try:
        with os.fdopen(descriptor, "wb") as file:
            torch.save(_snapshot(getattr(model, "module", model), optimizer, epoch), file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise


def with_pathlib(path, model, optimizer, epoch):
    """pathlib's replace is os.replace."""
    if dist.get_rank() == 0:
        target = Path(path)
        partial = target.with_name(target.name + ".partial")
        torch.save(_snapshot(model, optimizer, epoch), partial)
        partial.replace(target)


# --------------------------------------------------------------------------- load_snapshot


def _checked(snapshot: dict, path) -> dict:
    missing = [key for key in ("model", "optimizer", "epoch") if key not in snapshot]
    if missing:
        raise ValueError(f"{path} lacks {missing}")
    return snapshot


def no_first_start(path, model, optimizer):
    snapshot = _checked(torch.load(path, map_location="cpu"), path)  # a first start has none
    _inner(model).load_state_dict(snapshot["model"])
    optimizer.load_state_dict(snapshot["optimizer"])
    return int(snapshot["epoch"])


def no_map_location(path, model, optimizer):
    if not os.path.exists(path):
        return 0
    snapshot = _checked(torch.load(path), path)  # onto the devices it was saved from
    _inner(model).load_state_dict(snapshot["model"])
    optimizer.load_state_dict(snapshot["optimizer"])
    return int(snapshot["epoch"])


def loaded_on_rank_0_only(path, model, optimizer):
    if not os.path.exists(path):
        return 0
    snapshot = _checked(torch.load(path, map_location="cpu"), path)
    if dist.get_rank() == 0:  # "rank 0 holds the truth"
        _inner(model).load_state_dict(snapshot["model"])
        optimizer.load_state_dict(snapshot["optimizer"])
    return int(snapshot["epoch"])


def optimizer_not_loaded(path, model, optimizer):
    if not os.path.exists(path):
        return 0
    snapshot = _checked(torch.load(path, map_location="cpu"), path)
    _inner(model).load_state_dict(snapshot["model"])  # Adam starts again from zero moments
    return int(snapshot["epoch"])


def keys_unchecked(path, model, optimizer):
    if not os.path.exists(path):
        return 0
    snapshot = torch.load(path, map_location="cpu")
    _inner(model).load_state_dict(snapshot["model"])  # KeyError: 'model'
    optimizer.load_state_dict(snapshot["optimizer"])
    return int(snapshot["epoch"])


def loaded_into_the_wrapper(path, model, optimizer):
    if not os.path.exists(path):
        return 0
    snapshot = _checked(torch.load(path, map_location="cpu"), path)
    model.load_state_dict(snapshot["model"])  # DDP expects "module." keys
    optimizer.load_state_dict(snapshot["optimizer"])
    return int(snapshot["epoch"])


# Right answers written differently.


def ask_forgiveness(path, model, optimizer):
    """Try to load, and take a missing file for a first start; load to the CPU."""
    try:
        snapshot = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        return 0
    lacking = sorted({"model", "optimizer", "epoch"} - set(snapshot))
    if lacking:
        raise ValueError(f"not a k16 snapshot, no {' or '.join(lacking)}: {path}")
    getattr(model, "module", model).load_state_dict(snapshot["model"])
    optimizer.load_state_dict(snapshot["optimizer"])
    return snapshot["epoch"]


# --------------------------------------------------------------------------- train


def _setup(rank, world_size, model_name, seed, fault):
    k16 = _k16()
    model = k16.make_model(model_name, seed).to(k16.rank_device())
    ddp = k16.wrap(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=k16.LR)
    return k16, ddp, optimizer, k16.Run(rank, world_size, model_name, fault)


def _loop(
    rank, world_size, snapshot, epochs, model_name, seed, fault,
    load=True, from_zero=False, write_index=False, only_at_the_end=False,
):  # fmt: skip
    k16, ddp, optimizer, run = _setup(rank, world_size, model_name, seed, fault)
    start = k16.load_snapshot(snapshot, ddp, optimizer) if load else 0
    for epoch in range(0 if from_zero else start, epochs):
        run.epoch(ddp, optimizer, epoch)
        if not only_at_the_end:
            k16.write_snapshot(snapshot, ddp, optimizer, epoch if write_index else epoch + 1)
    if only_at_the_end:
        k16.write_snapshot(snapshot, ddp, optimizer, epochs)
    return run.result(ddp, optimizer, start)


def never_loads(rank, world_size, snapshot, epochs, model_name="buffer", seed=0, fault=None):
    # writes faithfully, never reads: every restart starts from scratch
    return _loop(**locals(), load=False)


def restarts_from_zero(rank, world_size, snapshot, epochs, model_name="buffer", seed=0, fault=None):
    # loads the snapshot, then runs every epoch again on top of it
    return _loop(**locals(), from_zero=True)


def writes_the_index(rank, world_size, snapshot, epochs, model_name="buffer", seed=0, fault=None):
    # write_snapshot(..., epoch): the index of the epoch just done, one less than the count
    return _loop(**locals(), write_index=True)


def snapshot_at_the_end_only(
    rank, world_size, snapshot, epochs, model_name="buffer", seed=0, fault=None
):
    # "a snapshot of the finished model": nothing for a restart to go on from
    return _loop(**locals(), only_at_the_end=True)


# Right answers written differently.


def counting_epochs_done(
    rank, world_size, snapshot, epochs, model_name="buffer", seed=0, fault=None
):
    """A while loop over the count of epochs done."""
    k16, ddp, optimizer, run = _setup(rank, world_size, model_name, seed, fault)
    done = start = k16.load_snapshot(snapshot, ddp, optimizer)
    while done < epochs:
        run.epoch(ddp, optimizer, done)
        done += 1
        k16.write_snapshot(snapshot, ddp, optimizer, done)
    return run.result(ddp, optimizer, start)


# --------------------------------------------------------------------------- the catalogue

_ONLY_RANK_0 = "test_only_global_rank_0_writes_the_snapshot"
_RENAMED = "test_the_snapshot_is_written_beside_it_then_renamed_into_place"
_EVERY_MOMENT = "test_there_is_a_snapshot_at_every_moment_of_a_write"
_HOLDS = "test_the_snapshot_holds_the_unwrapped_model_the_optimizer_and_the_epoch"
_TORN = "test_a_write_killed_halfway_leaves_the_last_snapshot_whole"
_LOADS = "test_every_rank_loads_the_snapshot_into_its_model_and_optimizer"
_DEVICE = "test_every_rank_loads_onto_its_own_device"
_FIRST = "test_a_first_start_finds_no_snapshot_and_starts_at_0"
_REFUSED = "test_a_file_that_is_not_a_snapshot_is_refused"
_RESTART = "test_a_killed_worker_and_its_restart_end_like_an_uninterrupted_run"
_EVERY_EPOCH = "test_a_first_start_trains_every_epoch_and_snapshots_each"

# Each mistake must fail the named tests with a message that says all of `says`.
MISTAKES = [
    Mistake(
        "written_in_place",
        replaces="write_snapshot",
        fails=[_RENAMED, _TORN],
        says=["in place", "os.replace it over the snapshot"],
    ),
    Mistake(
        "temporary_file_in_tmp",
        replaces="write_snapshot",
        fails=[_RENAMED],
        says=["outside the snapshot's folder", "in the snapshot's own folder"],
    ),
    Mistake(
        "copied_not_renamed",
        replaces="write_snapshot",
        fails=[_RENAMED],
        says=["it was copied over", "os.replace(temporary, path)"],
    ),
    Mistake(
        "old_one_moved_aside",
        replaces="write_snapshot",
        fails=[_RENAMED],
        says=["left ['snapshot.pt.old']", "no moment without a snapshot"],
    ),
    Mistake(
        "removed_then_renamed",
        replaces="write_snapshot",
        fails=[_EVERY_MOMENT],
        says=[
            "its os.remove('snapshot.pt') left no snapshot at all",
            "until os.rename('snapshot.pt.tmp', 'snapshot.pt')",
            "do not remove it",
        ],
    ),
    Mistake(
        "named_parameters_saved",
        replaces="write_snapshot",
        fails=[f"{_RESTART}[tied]"],
        says=["the snapshot lacks ['output.weight']", "named_parameters() lists a shared"],
    ),
    Mistake(
        "every_rank_writes",
        replaces="write_snapshot",
        fails=[_ONLY_RANK_0],
        says=["ranks 0, 1, 2 and 3 wrote the snapshot", "only global rank 0 may"],
    ),
    Mistake(
        "local_rank_0_writes",
        replaces="write_snapshot",
        fails=[_ONLY_RANK_0],
        says=["ranks 0 and 2 both wrote", "LOCAL_RANK 0", "dist.get_rank() == 0"],
    ),
    Mistake(
        "wrapper_state_dict",
        replaces="write_snapshot",
        fails=[_HOLDS],
        says=["start with 'module.'", "model.module.state_dict()"],
    ),
    Mistake(
        "model_only",
        replaces="write_snapshot",
        fails=[_HOLDS],
        says=["holds the model but not the optimizer", "optimizer.state_dict()"],
    ),
    Mistake(
        "no_first_start",
        replaces="load_snapshot",
        fails=[_FIRST],
        says=["FileNotFoundError on a first start", "Return 0"],
    ),
    Mistake(
        "no_map_location",
        replaces="load_snapshot",
        fails=[_DEVICE],
        says=["without map_location", "GPU 0"],
    ),
    Mistake(
        "loaded_on_rank_0_only",
        replaces="load_snapshot",
        fails=[_LOADS],
        says=["rank 1's weights are not the snapshot's", "(rank 0 did)", "not rank 0 alone"],
    ),
    Mistake(
        "optimizer_not_loaded",
        replaces="load_snapshot",
        fails=[_LOADS],
        says=["optimizer holds no state", "optimizer.load_state_dict"],
    ),
    Mistake(
        "keys_unchecked",
        replaces="load_snapshot",
        fails=[_REFUSED],
        says=["raised KeyError", "Raise ValueError naming the keys it lacks"],
    ),
    Mistake(
        "loaded_into_the_wrapper",
        replaces="load_snapshot",
        fails=[_LOADS, _DEVICE],
        says=["into the DDP wrapper", "(model.module)"],
    ),
    Mistake(
        "never_loads",
        replaces="train",
        fails=[_RESTART],
        says=["never called load_snapshot", "Load the snapshot first"],
    ),
    Mistake(
        "restarts_from_zero",
        replaces="train",
        fails=[_RESTART],
        says=["then trained epochs [0, 1, 2], expected [1, 2]", "go on from the epoch"],
    ),
    Mistake(
        "writes_the_index",
        replaces="train",
        fails=[_RESTART, _EVERY_EPOCH],
        says=["after 1 epoch with epoch=0", "(epoch + 1)"],
    ),
    Mistake(
        "snapshot_at_the_end_only",
        replaces="train",
        fails=[_RESTART, _EVERY_EPOCH],
        says=["a snapshot after every epoch"],
    ),
]

# Each right answer must pass every test of its step.
RIGHT_ANSWERS = [
    RightAnswer("unique_temporary_and_fsync", replaces="write_snapshot"),
    RightAnswer("with_pathlib", replaces="write_snapshot"),
    RightAnswer("ask_forgiveness", replaces="load_snapshot"),
    RightAnswer("counting_epochs_done", replaces="train"),
]
