"""k29 resharding checkpoints: the layout, a file per rank then the metadata, the plan of a load
into another world, partial reads that refuse torn files, the load, resuming, against DCP."""

from __future__ import annotations

import json
import math
import os
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch

from dojo.harness.impl import load_kata
from dojo.harness.world import run_world
from dojo.spec.testing import require_gpus, run_module_ok, shared_run, streams
from dojo.todo import KataTodo

KATA = "k29_resharding_checkpoints"
DEADLINE = 60
STEPS = 3  # before the save, and again after it
RESHARDS = [pytest.param(4, 2, id="4->2"), pytest.param(2, 3, id="2->3")]

# Tensors small enough to read, with sizes that leave ranks short or empty: 10 on 4 ranks is
# 3 3 3 1, 4 on 3 ranks is 2 2 0, 1 on 2 ranks is 1 0.
TENSORS = {
    "model/w": ((2, 5), torch.float32),
    "model/b": ((4,), torch.float32),
    "adam/exp_avg/w": ((2, 5), torch.float32),
    "model/one": ((1,), torch.float32),
}


def _expected_range(numel: int, rank: int, world_size: int) -> tuple[int, int]:
    chunk = -(-numel // world_size)
    start = min(rank * chunk, numel)
    return start, min(start + chunk, numel) - start


def _values(name: str, shape) -> torch.Tensor:
    """A tensor whose every element says where it is: 1000 * (which tensor) + its index."""
    which = sorted(TENSORS).index(name) if name in TENSORS else len(name)
    return torch.arange(math.prod(shape), dtype=torch.float32) + 1000 * (which + 1)


def _slices_of(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    """This rank's slices, as views of the whole tensors (as a training's slices may be)."""
    out = {}
    for name, (shape, _) in TENSORS.items():
        offset, length = _expected_range(math.prod(shape), rank, world_size)
        out[name] = _values(name, shape)[offset : offset + length]
    return out


# --------------------------------------------------------------------------- step 1: the layout


@pytest.mark.step(1)
@pytest.mark.parametrize("numel", [10, 4, 1, 0])
def test_shard_range_tiles_the_tensor_in_rank_order(kata, numel):
    for world_size in (1, 2, 3, 4):
        for rank in range(world_size):
            got = tuple(kata.shard_range(numel, rank, world_size))
            want = _expected_range(numel, rank, world_size)
            assert got == want, (
                f"shard_range({numel}, {rank}, {world_size}) is {got}, expected (offset, length) "
                f"{want}: every rank gets ceil({numel} / {world_size}) = "
                f"{-(-numel // world_size)} elements in rank order, the last ones what is left "
                f"(a short or an empty slice at offset {numel}), as k19's flat shards"
            )


@pytest.mark.step(1)
def test_shard_range_refuses_a_rank_outside_the_world(kata):
    for numel, rank, world_size in ((10, 4, 4), (10, -1, 2), (10, 0, 0)):
        try:
            got = f"returned {kata.shard_range(numel, rank, world_size)}"
        except ValueError:
            continue
        except KataTodo:
            raise
        except Exception as error:
            got = f"raised {type(error).__name__}: {error}"
        raise AssertionError(
            f"shard_range({numel}, {rank}, {world_size}) {got}: expected a ValueError saying "
            f"that rank {rank} is not a rank of a world of {world_size}"
        )


@pytest.mark.step(1)
def test_make_metadata_names_every_piece(kata):
    metadata = kata.make_metadata(TENSORS, 3, 7)
    json.dumps(metadata)  # it is written as json
    assert metadata["world_size"] == 3 and metadata["step"] == 7, (
        f"make_metadata(..., 3, 7) holds world_size {metadata.get('world_size')} and step "
        f"{metadata.get('step')}: expected 3 and 7"
    )
    assert list(metadata["tensors"]) == list(TENSORS), (
        f"the metadata's tensors are {list(metadata['tensors'])}, expected {list(TENSORS)}, in "
        f"that order"
    )
    for name, (shape, _) in TENSORS.items():
        entry = metadata["tensors"][name]
        assert entry["shape"] == list(shape) and entry["dtype"] == "float32", (
            f"{name}: shape {entry.get('shape')} and dtype {entry.get('dtype')!r}, expected "
            f"{list(shape)} and 'float32' (the dtype's name without 'torch.')"
        )
        numel = math.prod(shape)
        want = [
            {"file": kata.shard_file(rank, 3), "offset": o, "length": n}
            for rank in range(3)
            for o, n in [_expected_range(numel, rank, 3)]
            if n
        ]
        got = [{k: p.get(k) for k in ("file", "offset", "length")} for p in entry["pieces"]]
        assert got == want, (
            f"{name} ({numel} elements on 3 ranks): pieces {got}, expected {want}: one piece per "
            f"rank whose slice is not empty, in rank order, naming shard_file(rank, 3)"
        )


# --------------------------------------------------------------------------- step 2: save

SLOW_RANK, SLOW_S = 3, 1.0


def _save_on(rank, world_size, folder):
    kata = load_kata(KATA)
    import torch.serialization as serialization

    saves, replaces = [], []
    original_save, original_replace = serialization.save, os.replace

    def save(obj, f, *args, **kwargs):
        target = os.fspath(f) if isinstance(f, (str, os.PathLike)) else getattr(f, "name", "?")
        saves.append(os.path.basename(target))
        if rank == SLOW_RANK:
            time.sleep(SLOW_S)  # a large shard: the others are done long before
        return original_save(obj, f, *args, **kwargs)

    def replace(src, dst, *args, **kwargs):
        replaces.append((os.path.basename(os.fspath(src)), os.path.basename(os.fspath(dst))))
        if os.path.basename(os.fspath(dst)) == kata.METADATA_FILE:
            time.sleep(0.5)  # a slow metadata write: a rank that does not wait for it is caught
        return original_replace(src, dst, *args, **kwargs)

    serialization.save = torch.save = save
    os.replace = replace
    try:
        kata.save_shards(
            folder, _slices_of(rank, world_size), kata.make_metadata(TENSORS, world_size, 5)
        )
    finally:
        serialization.save = torch.save = original_save
        os.replace = original_replace
    return {
        "saves": saves,
        "replaces": replaces,
        "metadata_there": os.path.exists(os.path.join(folder, kata.METADATA_FILE)),
    }


def _watch(folder: str, seen: dict, stop: threading.Event) -> None:
    """Note when each file first appears in ``folder`` (every 5 ms)."""
    while not stop.is_set():
        for name in os.listdir(folder):
            seen.setdefault(name, time.monotonic())
        time.sleep(0.005)


def _save_world(world_size: int):
    folder = tempfile.mkdtemp(prefix="k29-save-")
    seen: dict = {}
    stop = threading.Event()
    watcher = threading.Thread(target=_watch, args=(folder, seen, stop), daemon=True)
    watcher.start()
    try:
        results = run_world(_save_on, world_size, folder, deadline=DEADLINE)
    finally:
        stop.set()
        watcher.join()
    return folder, results, seen


_saved = shared_run(_save_world)


@pytest.mark.step(2)
def test_save_writes_one_file_per_rank_with_only_its_slices(kata):
    folder, _, _ = _saved(4)
    files = sorted(name for name in os.listdir(folder) if not name.startswith("."))
    want = sorted([kata.shard_file(rank, 4) for rank in range(4)] + [kata.METADATA_FILE])
    assert files == want, (
        f"after save_shards on 4 ranks the folder holds {files}, expected {want} (one file per "
        f"rank, named shard_file(rank, world_size), and the metadata; no temporary file left)"
    )
    for rank in range(4):
        path = os.path.join(folder, kata.shard_file(rank, 4))
        held = torch.load(path, map_location="cpu", weights_only=True)
        want_slices = {k: v for k, v in _slices_of(rank, 4).items() if v.numel()}
        assert isinstance(held, dict) and sorted(held) == sorted(want_slices), (
            f"rank {rank}'s file holds {sorted(held) if isinstance(held, dict) else type(held)}, "
            f"expected a dict of its non-empty slices {sorted(want_slices)}"
        )
        for name, value in want_slices.items():
            assert torch.equal(held[name].reshape(-1), value), (
                f"rank {rank}'s file holds {held[name].tolist()} for {name}, expected its slice "
                f"{value.tolist()}"
            )
        stored = sum(
            {
                t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in held.values()
            }.values()
        )
        needed = sum(v.numel() * v.element_size() for v in want_slices.values())
        assert stored <= needed, (
            f"rank {rank}'s file stores {stored} bytes of tensor data, but its slices take "
            f"{needed}: torch.save of a view (a slice of a bigger tensor) writes the whole "
            f"storage behind it; save a clone of each slice"
        )


@pytest.mark.step(2)
def test_save_writes_each_file_under_a_temporary_name_then_renames_it(kata):
    _, results, _ = _saved(4)
    for rank, result in enumerate(results):
        mine = kata.shard_file(rank, 4)
        renamed = [src for src, dst in result["replaces"] if dst == mine]
        assert renamed and renamed[0] != mine and renamed[0] in result["saves"], (
            f"rank {rank} saved to {result['saves']} and renamed {result['replaces']}: write "
            f"{mine} under a temporary name, then os.replace it onto {mine}, so that a crash "
            f"never leaves half a file under the real name"
        )
    for rank, result in enumerate(results[1:], 1):
        assert not any(dst == kata.METADATA_FILE for _, dst in result["replaces"]), (
            f"rank {rank} wrote the metadata too: rank 0 alone writes it (every rank writing "
            f"the same file races, and a slow rank's rename can replace a newer checkpoint's)"
        )
    assert any(dst == kata.METADATA_FILE for _, dst in results[0]["replaces"]), (
        f"rank 0 renamed {results[0]['replaces']}: the metadata too is written under a "
        f"temporary name, then os.replace'd onto {kata.METADATA_FILE}"
    )


@pytest.mark.step(2)
def test_metadata_appears_only_after_every_shard_and_before_any_rank_returns(kata):
    folder, results, seen = _saved(4)
    metadata_at = seen.get(kata.METADATA_FILE)
    assert metadata_at is not None, "no metadata was written"
    late = [
        rank
        for rank in range(4)
        if seen.get(kata.shard_file(rank, 4), math.inf) > metadata_at + 0.005
    ]
    assert not late, (
        f"the metadata appeared before the file of rank(s) {late} (rank {SLOW_RANK}'s write was "
        f"slowed by {SLOW_S} s): a checkpoint whose metadata names files not yet complete is a "
        f"torn checkpoint. Wait for every rank's file (a barrier) before rank 0 writes the "
        f"metadata"
    )
    early = [rank for rank, result in enumerate(results) if not result["metadata_there"]]
    assert not early, (
        f"rank(s) {early} returned from save_shards before the metadata was there: wait for "
        f"rank 0's write (a barrier after it) so that nobody reads the checkpoint, or exits, "
        f"too soon"
    )
    with open(os.path.join(folder, kata.METADATA_FILE)) as file:
        written = json.load(file)
    assert written == json.loads(json.dumps(kata.make_metadata(TENSORS, 4, 5))), (
        "the metadata file does not hold the metadata save_shards was given: write it as json"
    )


# --------------------------------------------------------------------------- step 3: plan a load


@pytest.mark.step(3)
@pytest.mark.parametrize("old, new", [(4, 2), (2, 3), (3, 3), (1, 4)])
def test_plan_reads_every_element_once_from_the_right_place(kata, old, new):
    metadata = kata.make_metadata(TENSORS, old, 0)
    for rank in range(new):
        reads = list(kata.plan_reads(metadata, rank, new))
        for name, (shape, _) in TENSORS.items():
            numel = math.prod(shape)
            offset, length = _expected_range(numel, rank, new)
            mine = [r for r in reads if r.name == name]
            want = []
            for saved_rank in range(old):
                o, n = _expected_range(numel, saved_rank, old)
                first, last = max(offset, o), min(offset + length, o + n)
                if first < last:
                    want.append(
                        (kata.shard_file(saved_rank, old), first - o, last - first, first - offset)
                    )
            got = [(r.file, r.start, r.length, r.into) for r in mine]
            assert got == want, (
                f"{old} -> {new} ranks, new rank {rank}, {name} ({numel} elements; the new slice "
                f"is [{offset}:{offset + length}]): reads (file, start in the piece, length, into "
                f"the new slice) {got}, expected {want}: one read per saved piece that overlaps "
                f"the new slice, start counted from the piece's offset, into from the new "
                f"slice's, none empty"
            )
        names = [r.name for r in reads]
        assert names == sorted(names, key=list(TENSORS).index), (
            f"new rank {rank}'s reads come in the order {names}: keep the metadata's order"
        )


# --------------------------------------------------------------------------- step 4: read


def _write_checkpoint(folder: Path, world_size: int) -> dict:
    """A checkpoint of TENSORS saved on ``world_size`` ranks, written as the lesson says."""
    kata = load_kata(KATA)
    metadata = kata.make_metadata(TENSORS, world_size, 5)
    for rank in range(world_size):
        slices = {k: v for k, v in _slices_of(rank, world_size).items() if v.numel()}
        torch.save(slices, folder / kata.shard_file(rank, world_size))
    (folder / kata.METADATA_FILE).write_text(json.dumps(metadata))
    return metadata


class _Loads:
    def __enter__(self):
        import torch.serialization as serialization

        self.calls = []
        self.original = serialization.load

        def load(f, *args, **kwargs):
            self.calls.append((os.path.basename(os.fspath(f)), kwargs.get("mmap", False)))
            return self.original(f, *args, **kwargs)

        serialization.load = torch.load = load
        return self

    def __exit__(self, *_):
        import torch.serialization as serialization

        serialization.load = torch.load = self.original


@pytest.mark.step(4)
def test_read_ranges_reads_only_the_planned_ranges_of_the_planned_files(kata, tmp_path):
    metadata = _write_checkpoint(tmp_path, 4)
    reads = [
        kata.Read("model/w", kata.shard_file(1, 4), 1, 2, 0),
        kata.Read("model/w", kata.shard_file(2, 4), 0, 3, 2),
        kata.Read("model/b", kata.shard_file(1, 4), 0, 1, 0),
    ]
    with _Loads() as loads:
        values = kata.read_ranges(tmp_path, metadata, reads)
    w, b = _values("model/w", (2, 5)), _values("model/b", (4,))
    want = [w[4:6], w[6:9], b[1:2]]
    for read, got, expected in zip(reads, values, want):
        assert torch.equal(got.reshape(-1), expected), (
            f"{read}: read {got.tolist()}, expected {expected.tolist()} (elements start to "
            f"start + length of the piece {read.file} holds)"
        )
    files = [name for name, _ in loads.calls]
    assert sorted(files) == sorted({r.file for r in reads}), (
        f"read_ranges loaded {files}, expected each file of the plan once "
        f"({sorted({r.file for r in reads})}) and no other: open a file once for all its reads"
    )
    assert all(mmap for _, mmap in loads.calls), (
        "read_ranges loaded a file whole: torch.load(..., mmap=True, weights_only=True) maps it, "
        "and only the pages of the slices read are touched"
    )


def _refusal(kata, folder, metadata, damage) -> tuple[str, str]:
    """``(how read_ranges ended, its message)`` for new rank 0 of 2 after ``damage``."""
    damage(folder)
    reads = kata.plan_reads(metadata, 0, 2)
    try:
        kata.read_ranges(folder, metadata, reads)
    except kata.CheckpointError as error:
        return "CheckpointError", str(error)
    except KataTodo:
        raise
    except Exception as error:
        return type(error).__name__, str(error)
    return "", ""


@pytest.mark.step(4)
@pytest.mark.parametrize("how", ["missing", "truncated", "another shard", "empty"])
def test_a_torn_or_missing_shard_is_named_with_its_slice(kata, tmp_path, how):
    metadata = _write_checkpoint(tmp_path, 4)
    path = tmp_path / kata.shard_file(1, 4)  # 4 -> 2: new rank 0 reads shard 1's model/w [3:6]

    def damage(folder):
        if how == "missing":
            path.unlink()
        elif how == "truncated":
            path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
        elif how == "empty":
            path.write_bytes(b"")
        else:  # shard 2's file under shard 1's name: right format, wrong contents
            path.write_bytes((folder / kata.shard_file(3, 4)).read_bytes())

    ended, text = _refusal(kata, tmp_path, metadata, damage)
    assert ended, (
        f"read_ranges read a checkpoint whose shard {path.name} is {how} without a "
        f"CheckpointError: a damaged shard must never become a silent wrong load (check that "
        f"each piece a file holds has the metadata's length and dtype)"
    )
    assert ended == "CheckpointError", (
        f"read_ranges raised {ended} for a {how} shard ({text[:200]!r}): turn it into a "
        f"CheckpointError naming the file ({path.name}) and the slice (model/w[3:6])"
    )
    assert path.name in text and "model/w[3:6]" in text, (
        f"the error for a {how} shard says {text!r}: name the file ({path.name}) and the slice "
        f"it was to hold (model/w[3:6]: the tensor's name and [offset:offset + length])"
    )


# --------------------------------------------------------------------------- step 5: load


def _train_and_save(rank, world_size, folder, steps):
    kata = load_kata(KATA)
    return kata.train(rank, world_size, folder, steps)


def _dcp_save(rank, world_size, folder, shards):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    kata = load_kata(KATA)
    mesh = init_device_mesh("cpu", (world_size,))
    names = kata.state_names(kata.make_model("buffer", 0))
    state = {
        name: DTensor.from_local(
            shards[rank][name],
            mesh,
            [Shard(0)],
            run_check=False,
            shape=torch.Size([math.prod(shape)]),
            stride=(1,),
        )
        for name, (shape, _) in names.items()
    }
    began = time.perf_counter()
    dcp.save(state, checkpoint_id=folder)
    return time.perf_counter() - began


def _checkpoints(world_size: int):
    """One training of STEPS steps on ``world_size`` ranks saved by the kata, and the same state
    saved by dcp.save."""
    kata = load_kata(KATA)
    folder = tempfile.mkdtemp(prefix="k29-")
    ours, theirs = os.path.join(folder, "ours"), os.path.join(folder, "dcp")
    os.makedirs(ours)
    results = run_world(_train_and_save, world_size, ours, STEPS, deadline=DEADLINE)
    shards = [r["shards"] for r in results]
    run_world(_dcp_save, world_size, theirs, shards, deadline=DEADLINE)
    return ours, theirs, kata.gather_state(results)


_checkpoint = shared_run(_checkpoints)


def _load_both(rank, world_size, ours, theirs):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    kata = load_kata(KATA)
    names = kata.state_names(kata.make_model("buffer", 0))
    with _Loads() as loads:
        shards, step = kata.load_shards(ours, names, rank, world_size)
    mesh = init_device_mesh("cpu", (world_size,))
    state = {
        name: distribute_tensor(torch.zeros(math.prod(shape)), mesh, [Shard(0)])
        for name, (shape, _) in names.items()
    }
    dcp.load(state, checkpoint_id=theirs)
    return {
        "ours": {k: v.clone() for k, v in shards.items()},
        "dcp": {k: v.to_local().clone() for k, v in state.items()},
        "step": step,
        "loads": [name for name, _ in loads.calls],
    }


_loaded = shared_run(
    lambda old, new: run_world(_load_both, new, *_checkpoint(old)[:2], deadline=DEADLINE)
)


@pytest.mark.step(5)
@pytest.mark.parametrize("old, new", RESHARDS)
def test_load_gives_each_new_rank_its_slices_of_model_and_adam_state(kata, old, new):
    _, _, whole = _checkpoint(old)
    for rank, result in enumerate(_loaded(old, new)):
        assert result["step"] == STEPS, (
            f"new rank {rank}: load_shards returned step {result['step']}, expected {STEPS} "
            f"(the metadata's)"
        )
        for name, value in whole.items():
            offset, length = _expected_range(value.numel(), rank, new)
            got = result["ours"].get(name)
            want = value[offset : offset + length]
            assert got is not None and torch.equal(got, want), (
                f"{old} -> {new} ranks: new rank {rank}'s {name} is "
                f"{None if got is None else got.tolist()[:6]}, expected its new slice "
                f"[{offset}:{offset + length}] of the saved tensor, {want.tolist()[:6]}"
            )
        needed = sorted(
            {
                r.file
                for r in kata.plan_reads(
                    json.loads((Path(_checkpoint(old)[0]) / kata.METADATA_FILE).read_text()),
                    rank,
                    new,
                )
            }
        )
        assert sorted(result["loads"]) == needed, (
            f"new rank {rank} loaded {sorted(result['loads'])}, expected only the files its new "
            f"slices overlap, once each: {needed}"
        )


@pytest.mark.step(5)
@pytest.mark.parametrize("old, new", RESHARDS)
def test_load_equals_dcp_load_of_the_same_state(kata, old, new):
    for rank, result in enumerate(_loaded(old, new)):
        for name, theirs in result["dcp"].items():
            ours = result["ours"][name]
            assert torch.equal(ours, theirs), (
                f"{old} -> {new} ranks: new rank {rank}'s {name} is {ours.tolist()[:6]}, "
                f"dcp.load of the same state gives {theirs.tolist()[:6]}"
            )


@pytest.mark.step(5)
def test_a_checkpoint_of_another_model_is_refused_saying_what_differs(kata, tmp_path):
    _write_checkpoint(tmp_path, 2)
    other = dict(TENSORS)
    other.pop("model/one")
    other["model/b"] = ((5,), torch.float32)
    other["model/extra"] = ((3,), torch.float32)
    with _Loads() as loads:
        try:
            kata.load_shards(tmp_path, other, 0, 2)
            text = None
        except ValueError as error:
            text = str(error)
    assert text is not None, (
        "load_shards loaded a checkpoint of another model (names and shapes that differ) "
        "without a ValueError: compare the metadata's tensors with the expected ones first"
    )
    for what in ("model/one", "model/extra", "[5]", "[4]", "model/b"):
        assert what in text, (
            f"loading a checkpoint of another model says {text!r}: say what differs (the "
            f"names missing on either side and the shapes, here {what!r}) and what to do"
        )
    assert not loads.calls, f"load_shards read {loads.calls} before refusing: check first"


@pytest.mark.step(5)
def test_a_folder_without_metadata_is_not_a_checkpoint(kata, tmp_path):
    _write_checkpoint(tmp_path, 2)
    (tmp_path / kata.METADATA_FILE).unlink()
    with pytest.raises(kata.CheckpointError) as refused:
        kata.load_shards(tmp_path, TENSORS, 0, 2)
    assert kata.METADATA_FILE in str(refused.value), (
        f"the error says {str(refused.value)!r}: name the missing {kata.METADATA_FILE}"
    )


def _resume(rank, world_size, folder, steps):
    kata = load_kata(KATA)
    return kata.train(rank, world_size, folder, steps, resume=True, save=False)


def _never_stopped(rank, world_size, steps):
    kata = load_kata(KATA)
    return kata.train(rank, world_size, "unused", steps, save=False)


@pytest.mark.step(5)
@pytest.mark.parametrize("old, new", RESHARDS)
def test_resuming_on_another_world_equals_never_stopping(kata, old, new):
    ours, _, _ = _checkpoint(old)
    resumed = run_world(_resume, new, ours, 2 * STEPS, deadline=DEADLINE)
    whole = run_world(_never_stopped, 1, 2 * STEPS, deadline=DEADLINE)
    assert resumed[0]["started"] == STEPS, f"the resumed run started at {resumed[0]['started']}"
    got, want = kata.gather_state(resumed), kata.gather_state(whole)
    different = [name for name in want if not torch.equal(got[name], want[name])]
    assert not different, (
        f"{STEPS} steps on {old} ranks, saved, then {STEPS} on {new} ranks differ from "
        f"{2 * STEPS} steps in one process in {different}"
    )


def _save_from_the_gpu(rank, world_size, folder):
    kata = load_kata(KATA)
    slices = {name: value.to("cuda:0") for name, value in _slices_of(rank, world_size).items()}
    kata.save_shards(folder, slices, kata.make_metadata(TENSORS, world_size, 5))


@pytest.mark.step(5)
@pytest.mark.cuda
def test_slices_saved_from_a_gpu_load_on_a_machine_without_one(kata, tmp_path):
    require_gpus(1)
    run_world(_save_from_the_gpu, 2, str(tmp_path), deadline=DEADLINE)  # gloo: a barrier only
    for rank in range(3):
        shards, step = kata.load_shards(tmp_path, TENSORS, rank, 3)
        for name, (shape, _) in TENSORS.items():
            offset, length = _expected_range(math.prod(shape), rank, 3)
            want = _values(name, shape)[offset : offset + length]
            got = shards[name]
            assert got.device.type == "cpu" and torch.equal(got, want), (
                f"2 -> 3 ranks, slices saved from cuda:0: new rank {rank}'s {name} is "
                f"{got.tolist()} on {got.device}, expected {want.tolist()} on the CPU (read the "
                f"shards with map_location='cpu': a checkpoint must load where there is no GPU)"
            )
    assert step == 5


@pytest.mark.step(5)
def test_the_program_saves_on_four_ranks_and_resumes_on_two(kata):
    done = run_module_ok(KATA)
    assert "the same bits as 6 steps in one process" in done.stdout, (
        f"the program should end with 'the same bits as 6 steps in one process'\n{streams(done)}"
    )
