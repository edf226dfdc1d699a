"""k29's mistakes catalogue: real mistakes in laying out, saving, planning, reading and loading a
checkpoint that reshards, and right answers written another way. See ``dojo/dev/mistakes/__init__.py``
for what each list promises."""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from dojo.dev.mistakes import Mistake, RightAnswer
from dojo.harness import impl


def _k29():
    return impl.load_kata("k29_resharding_checkpoints")


def _range(numel, rank, world_size):
    return _k29().shard_range(numel, rank, world_size)


# --------------------------------------------------------------------------- shard_range


def floor_chunk(numel, rank, world_size):
    chunk = numel // world_size  # rounds down: the last elements belong to nobody
    return rank * chunk, chunk


def remainder_to_the_first_ranks(numel, rank, world_size):
    base, extra = divmod(numel, world_size)  # numpy's array_split: 3 3 2 2, not 3 3 3 1
    start = rank * base + min(rank, extra)
    return start, base + (rank < extra)


def unclipped_offset(numel, rank, world_size):
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError("rank outside the world")
    chunk = -(-numel // world_size)
    start = rank * chunk  # past the end for an empty slice
    return start, max(0, min(chunk, numel - start))


def no_range_check(numel, rank, world_size):
    chunk = -(-numel // world_size)
    start = min(rank * chunk, numel)
    return start, min(start + chunk, numel) - start


def python_range_slicing(numel, rank, world_size):
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not a rank of a world of {world_size}")
    chunk = -(-numel // world_size)
    mine = range(numel)[rank * chunk : (rank + 1) * chunk]
    return (mine.start if mine else min(rank * chunk, numel)), len(mine)


# --------------------------------------------------------------------------- make_metadata


def _metadata(tensors, world_size, step, piece_filter=lambda n: n > 0, dtype_name=None):
    k29 = _k29()
    entries = {}
    for name, (shape, dtype) in tensors.items():
        numel = math.prod(shape)
        pieces = []
        for rank in range(world_size):
            offset, length = k29.shard_range(numel, rank, world_size)
            if piece_filter(length):
                pieces.append(
                    {"file": k29.shard_file(rank, world_size), "offset": offset, "length": length}
                )
        entries[name] = {
            "shape": list(shape),
            "dtype": dtype_name(dtype) if dtype_name else str(dtype).removeprefix("torch."),
            "pieces": pieces,
        }
    return {"world_size": world_size, "step": step, "tensors": entries}


def empty_pieces_kept(tensors, world_size, step):
    return _metadata(tensors, world_size, step, piece_filter=lambda n: True)


def dtype_with_its_prefix(tensors, world_size, step):
    return _metadata(tensors, world_size, step, dtype_name=str)  # "torch.float32"


# --------------------------------------------------------------------------- save_shards


def _pieces(shards, metadata, clone=True):
    k29 = _k29()
    mine = k29.shard_file(dist.get_rank(), metadata["world_size"])
    pieces = {}
    for name, entry in metadata["tensors"].items():
        for piece in entry["pieces"]:
            if piece["file"] == mine:
                tensor = shards[name].detach().reshape(-1)
                pieces[name] = tensor.clone() if clone else tensor
    return mine, pieces


def _write_shard(folder, mine, pieces):
    temporary = Path(folder) / f".{mine}.tmp"
    torch.save(pieces, temporary)
    os.replace(temporary, Path(folder) / mine)


def _write_metadata(folder, metadata, temporary_name=None):
    k29 = _k29()
    temporary = Path(folder) / (temporary_name or f".{k29.METADATA_FILE}.tmp")
    temporary.write_text(json.dumps(metadata))
    os.replace(temporary, Path(folder) / k29.METADATA_FILE)


def views_saved(folder, shards, metadata):
    mine, pieces = _pieces(shards, metadata, clone=False)  # each a view of the whole tensor
    _write_shard(folder, mine, pieces)
    dist.barrier()
    if dist.get_rank() == 0:
        _write_metadata(folder, metadata)
    dist.barrier()


def shard_written_in_place(folder, shards, metadata):
    mine, pieces = _pieces(shards, metadata)
    torch.save(pieces, Path(folder) / mine)  # a crash halfway leaves half a file, named
    dist.barrier()
    if dist.get_rank() == 0:
        _write_metadata(folder, metadata)
    dist.barrier()


def metadata_written_in_place(folder, shards, metadata):
    mine, pieces = _pieces(shards, metadata)
    _write_shard(folder, mine, pieces)
    dist.barrier()
    if dist.get_rank() == 0:
        (Path(folder) / _k29().METADATA_FILE).write_text(json.dumps(metadata))
    dist.barrier()


def metadata_before_the_barrier(folder, shards, metadata):
    mine, pieces = _pieces(shards, metadata)
    _write_shard(folder, mine, pieces)
    if dist.get_rank() == 0:  # rank 0's own shard is done: "so the checkpoint is"
        _write_metadata(folder, metadata)
    dist.barrier()


def no_barrier_after_the_metadata(folder, shards, metadata):
    mine, pieces = _pieces(shards, metadata)
    _write_shard(folder, mine, pieces)
    dist.barrier()
    if dist.get_rank() == 0:
        _write_metadata(folder, metadata)  # the others have returned already


def every_rank_writes_the_metadata(folder, shards, metadata):
    mine, pieces = _pieces(shards, metadata)
    _write_shard(folder, mine, pieces)
    dist.barrier()
    _write_metadata(folder, metadata, f".meta-{dist.get_rank()}.tmp")  # "it is the same anyway"
    dist.barrier()


def through_a_named_temporary_file(folder, shards, metadata):
    k29 = _k29()
    mine, pieces = _pieces(shards, metadata)
    with tempfile.NamedTemporaryFile(
        dir=folder, prefix="shard-", suffix=".part", delete=False
    ) as f:
        torch.save(pieces, f)
    os.replace(f.name, Path(folder) / mine)
    dist.barrier()
    if dist.get_rank() == 0:
        with tempfile.NamedTemporaryFile("w", dir=folder, suffix=".part", delete=False) as f:
            json.dump(metadata, f)
        os.replace(f.name, Path(folder) / k29.METADATA_FILE)
    dist.barrier()


# --------------------------------------------------------------------------- plan_reads


def _plan(metadata, rank, world_size, into_global=False, start_global=False, world=None, keep=None):
    Read = _k29().Read
    reads = []
    for name, entry in metadata["tensors"].items():
        numel = math.prod(entry["shape"])
        offset, length = _range(numel, rank, world if world else world_size)
        for piece in entry["pieces"]:
            first = max(offset, piece["offset"])
            last = min(offset + length, piece["offset"] + piece["length"])
            if (keep or (lambda a, b: a < b))(first, last):
                start = first if start_global else first - piece["offset"]
                into = first if into_global else first - offset
                reads.append(Read(name, piece["file"], start, max(last - first, 0), into))
    return reads


def into_at_the_global_offset(metadata, rank, world_size):
    return _plan(metadata, rank, world_size, into_global=True)


def start_at_the_global_offset(metadata, rank, world_size):
    return _plan(metadata, rank, world_size, start_global=True)


def new_slice_of_the_old_world(metadata, rank, world_size):
    return _plan(metadata, rank, world_size, world=metadata["world_size"])


def touching_counts_as_overlap(metadata, rank, world_size):
    return _plan(metadata, rank, world_size, keep=lambda first, last: first <= last)


def every_piece_whole(metadata, rank, world_size):
    Read = _k29().Read
    return [  # "read everything, keep what you need"
        Read(name, piece["file"], 0, piece["length"], piece["offset"])
        for name, entry in metadata["tensors"].items()
        for piece in entry["pieces"]
    ]


# --------------------------------------------------------------------------- read_ranges


def _read(folder, metadata, reads, once=True, mmap=True, check=True, wrap=True, slice_named=True):
    k29 = _k29()
    folder = Path(folder)
    opened, out = {}, []
    for read in reads:
        entry = metadata["tensors"][read.name]
        piece = next(p for p in entry["pieces"] if p["file"] == read.file)
        where = read.file + (
            f", which holds {read.name}[{piece['offset']}:{piece['offset'] + piece['length']}]"
            if slice_named
            else ""
        )
        if read.file not in opened or not once:
            if wrap and not (folder / read.file).exists():
                raise k29.CheckpointError(f"{where} is missing")
            try:
                opened[read.file] = torch.load(
                    folder / read.file, map_location="cpu", mmap=mmap, weights_only=True
                )
            except Exception as error:
                if not wrap:
                    raise
                raise k29.CheckpointError(f"{where} is torn") from error
        stored = opened[read.file].get(read.name)
        if check and (stored is None or stored.numel() != piece["length"]):
            raise k29.CheckpointError(f"{where}: the file holds something else")
        out.append(stored.reshape(-1)[read.start : read.start + read.length].clone())
    return out


def a_load_per_read(folder, metadata, reads):
    return _read(folder, metadata, reads, once=False)


def read_whole(folder, metadata, reads):
    return _read(folder, metadata, reads, mmap=False)


def lengths_not_checked(folder, metadata, reads):
    return _read(folder, metadata, reads, check=False)


def torch_errors_passed_on(folder, metadata, reads):
    return _read(folder, metadata, reads, wrap=False)


def error_names_the_file_only(folder, metadata, reads):
    return _read(folder, metadata, reads, slice_named=False)


# --------------------------------------------------------------------------- load_shards


def _load(
    folder,
    expected,
    rank,
    world_size,
    check="all",
    plan_world=None,
    whole_files=False,
    concatenate=False,
):
    k29 = _k29()
    folder = Path(folder)
    path = folder / k29.METADATA_FILE
    if not path.exists():
        raise k29.CheckpointError(f"{path} is missing")
    metadata = json.loads(path.read_text())
    saved = metadata["tensors"]
    if check != "none":
        differences = [f"no {n!r} in the checkpoint" for n in expected if n not in saved]
        differences += [f"no {n!r} in the model" for n in saved if n not in expected]
        if check == "all":
            differences += [
                f"{n!r}: {list(s)} here, {saved[n]['shape']} there"
                for n, (s, _) in expected.items()
                if n in saved and list(s) != saved[n]["shape"]
            ]
        if differences:
            raise ValueError(f"another model's checkpoint: {'; '.join(differences)}")
    if whole_files:
        reads = every_piece_whole(metadata, rank, world_size)
    else:
        reads = k29.plan_reads(metadata, rank, plan_world or world_size)
    values = k29.read_ranges(folder, metadata, reads)
    shards = {}
    for name, (shape, dtype) in expected.items():
        offset, length = k29.shard_range(math.prod(shape), rank, world_size)
        if concatenate:  # the reads of a tensor come in order and tile its new slice
            mine = [v for r, v in zip(reads, values) if r.name == name]
            shards[name] = torch.cat(mine) if mine else torch.empty(0, dtype=dtype)
        elif whole_files:
            whole = torch.empty(math.prod(shape), dtype=dtype)
            for read, value in zip(reads, values):
                if read.name == name:
                    whole[read.into : read.into + read.length] = value
            shards[name] = whole[offset : offset + length].clone()
        else:
            shards[name] = torch.empty(length, dtype=dtype)
            for read, value in zip(reads, values):
                if read.name == name:
                    shards[name][read.into : read.into + read.length] = value
    return shards, int(metadata["step"])


def no_model_check(folder, expected, rank, world_size):
    return _load(folder, expected, rank, world_size, check="none")


def names_checked_not_shapes(folder, expected, rank, world_size):
    return _load(folder, expected, rank, world_size, check="names")


def planned_for_the_old_world(folder, expected, rank, world_size):
    metadata = json.loads((Path(folder) / _k29().METADATA_FILE).read_text())
    return _load(folder, expected, rank, world_size, plan_world=metadata["world_size"])


def every_file_read(folder, expected, rank, world_size):
    return _load(folder, expected, rank, world_size, whole_files=True)


def concatenated_reads(folder, expected, rank, world_size):
    return _load(folder, expected, rank, world_size, concatenate=True)


T = "test_shard_range_tiles_the_tensor_in_rank_order"
SAVE_FILES = "test_save_writes_one_file_per_rank_with_only_its_slices"
SAVE_RENAMES = "test_save_writes_each_file_under_a_temporary_name_then_renames_it"
SAVE_ORDER = "test_metadata_appears_only_after_every_shard_and_before_any_rank_returns"
PLAN = "test_plan_reads_every_element_once_from_the_right_place"
READ = "test_read_ranges_reads_only_the_planned_ranges_of_the_planned_files"
TORN = "test_a_torn_or_missing_shard_is_named_with_its_slice"
LOAD = "test_load_gives_each_new_rank_its_slices_of_model_and_adam_state"
OTHER = "test_a_checkpoint_of_another_model_is_refused_saying_what_differs"

MISTAKES = [
    Mistake("floor_chunk", replaces="shard_range", fails=[f"{T}[10]"], says=["ceil(10 / 3) = 4"]),
    Mistake(
        "remainder_to_the_first_ranks",
        replaces="shard_range",
        fails=[f"{T}[10]"],
        says=["ceil(10 / 3) = 4"],
    ),
    Mistake(
        "unclipped_offset",
        replaces="shard_range",
        fails=[f"{T}[1]"],
        says=["empty slice at offset 1"],
    ),
    Mistake(
        "no_range_check",
        replaces="shard_range",
        fails=["test_shard_range_refuses_a_rank_outside_the_world"],
        says=["expected a ValueError", "rank 4 is not a rank of a world of 4"],
    ),
    Mistake(
        "empty_pieces_kept",
        replaces="make_metadata",
        fails=["test_make_metadata_names_every_piece"],
        says=["one piece per rank whose slice is not empty"],
    ),
    Mistake(
        "dtype_with_its_prefix",
        replaces="make_metadata",
        fails=["test_make_metadata_names_every_piece"],
        says=["without 'torch.'"],
    ),
    Mistake(
        "views_saved",
        replaces="save_shards",
        fails=[SAVE_FILES],
        says=["writes the whole storage behind it", "save a clone of each slice"],
    ),
    Mistake(
        "shard_written_in_place",
        replaces="save_shards",
        fails=[SAVE_RENAMES],
        says=["under a temporary name, then os.replace"],
    ),
    Mistake(
        "metadata_written_in_place",
        replaces="save_shards",
        fails=[SAVE_RENAMES],
        says=["the metadata too is written under a temporary name"],
    ),
    Mistake(
        "every_rank_writes_the_metadata",
        replaces="save_shards",
        fails=[SAVE_RENAMES],
        says=["wrote the metadata too: rank 0 alone writes it"],
    ),
    Mistake(
        "metadata_before_the_barrier",
        replaces="save_shards",
        fails=[SAVE_ORDER],
        says=["the metadata appeared before the file of rank(s)", "(a barrier)"],
    ),
    Mistake(
        "no_barrier_after_the_metadata",
        replaces="save_shards",
        fails=[SAVE_ORDER],
        says=["returned from save_shards before the metadata was there"],
    ),
    Mistake(
        "into_at_the_global_offset",
        replaces="plan_reads",
        fails=[f"{PLAN}[4-2]"],
        says=["into from the new slice's"],
    ),
    Mistake(
        "start_at_the_global_offset",
        replaces="plan_reads",
        fails=[f"{PLAN}[4-2]"],
        says=["start counted from the piece's offset"],
    ),
    Mistake(
        "new_slice_of_the_old_world",
        replaces="plan_reads",
        fails=[f"{PLAN}[4-2]"],
        says=["4 -> 2 ranks, new rank 0", "the new slice is [0:5]"],
    ),
    Mistake(
        "touching_counts_as_overlap",
        replaces="plan_reads",
        fails=[f"{PLAN}[4-2]"],
        says=["none empty"],
    ),
    Mistake(
        "every_piece_whole",
        replaces="plan_reads",
        fails=[f"{PLAN}[4-2]"],
        says=["one read per saved piece that overlaps the new slice"],
    ),
    Mistake("a_load_per_read", replaces="read_ranges", fails=[READ], says=["open a file once"]),
    Mistake("read_whole", replaces="read_ranges", fails=[READ], says=["loaded a file whole"]),
    Mistake(
        "lengths_not_checked",
        replaces="read_ranges",
        fails=[f"{TORN}[another shard]"],
        says=["never become a silent wrong load"],
    ),
    Mistake(
        "torch_errors_passed_on",
        replaces="read_ranges",
        fails=[f"{TORN}[missing]", f"{TORN}[truncated]", f"{TORN}[empty]"],
        says=["turn it into a CheckpointError"],
    ),
    Mistake(
        "error_names_the_file_only",
        replaces="read_ranges",
        fails=[TORN],
        says=["name the file (shard-00001-of-00004.pt) and the slice"],
    ),
    Mistake(
        "planned_for_the_old_world",
        replaces="load_shards",
        fails=[f"{LOAD}[4->2]"],
        says=["expected its new slice"],
    ),
    Mistake(
        "every_file_read",
        replaces="load_shards",
        fails=[LOAD],
        says=["expected only the files its new slices overlap"],
    ),
    Mistake(
        "no_model_check",
        replaces="load_shards",
        fails=[OTHER],
        says=["without a ValueError", "compare the metadata's tensors with the expected ones"],
    ),
    Mistake(
        "names_checked_not_shapes",
        replaces="load_shards",
        fails=[OTHER],
        says=["here '[5]'"],
    ),
]

RIGHT_ANSWERS = [
    RightAnswer("python_range_slicing", replaces="shard_range"),
    RightAnswer("through_a_named_temporary_file", replaces="save_shards"),
    RightAnswer("concatenated_reads", replaces="load_shards"),
]
