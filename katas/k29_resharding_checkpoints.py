"""k29 · Checkpoints that reshard: every rank writes its own slices, any world reads them back.

THE IDEA
    k15 had one writer: every replica was the same, so rank 0 saved the whole state. Once the
    state is sharded (k18's optimizer state, k19's flat parameters) no rank holds it all, and
    gathering it on rank 0 to write one file costs rank 0 the memory of the whole model and
    the job the time of one writer. So every rank writes ONLY THE SLICES IT OWNS, and a small
    metadata file says, for every tensor, where each slice of it lives. A job restarted on a
    different number of ranks (4 nodes become 2, 2 become 3) then reads, on each new rank,
    only the ranges of the files that overlap the slice it now owns:

        a tensor of 10 elements, flattened; saved by 4 ranks (ceil(10/4) = 3 each, the last
        one short: k19's layout, the padding never written)

        saved   | rank 0: 0 1 2 | rank 1: 3 4 5 | rank 2: 6 7 8 | rank 3: 9 |
                   shard-0.pt      shard-1.pt      shard-2.pt     shard-3.pt
        loaded  | new rank 0: 0 1 2 3 4 | new rank 1: 5 6 7 8 9 |       (2 ranks, 5 each)
        reads     new rank 0: shard-0.pt[0:3] -> [0:3], shard-1.pt[0:2] -> [3:5]
                  new rank 1: shard-1.pt[2:3] -> [0:1], shard-2.pt[0:3] -> [1:4],
                              shard-3.pt[0:1] -> [4:5]
                  (never shard-2.pt or shard-3.pt on new rank 0: it owns nothing there)

    The metadata (``metadata.json``) holds, for every tensor: its global name, shape and
    dtype, and its PIECES: which file holds each slice and where it sits in the flat tensor
    (offset, length). With it a loader plans its reads before it opens a file; without it a
    folder of shard files is not a checkpoint. So the metadata is written LAST, by rank 0,
    after every rank's file is complete (a barrier): a crash in the middle leaves a folder
    without metadata, which a loader refuses, never a checkpoint that names files that are not
    there yet. Each file is written atomically (a temporary name, then ``os.replace``, as k15).

    A rank reads a file in part: ``torch.save`` writes a zip of one record per tensor storage,
    and ``torch.load(path, mmap=True, weights_only=True)`` maps it instead of reading it, so
    slicing a tensor touches only the pages of that slice, read once when it is copied into
    the new slice. (Save each slice as its own tensor, a clone: ``torch.save`` of a view
    writes the WHOLE storage it views.) Measured on a busy 2-core machine, 64 and 256 MiB
    saved on 4 ranks and loaded into 2: within about 1.5x of dcp.save and dcp.load either
    way, often faster (DCP writes each tensor with torch.save too; it adds a planner).

    The state here is the model's (its state_dict, flattened) and Adam's (exp_avg and
    exp_avg_sq of every parameter), each split over the ranks; Adam's step count and the
    training step are one number for all, kept in the metadata. Every rank computes the whole
    batch's gradient (the same bits on any number of ranks, so a resumed run can be compared
    with one that never stopped, bit for bit), updates only its slices, and all-gathers the
    parameters: the point is the checkpoint, not the training.

    What a torn or missing file must never become is a silent wrong load: a missing file, a
    file cut short (its zip's directory is at the end: ``torch.load`` refuses it), a file
    that lacks a piece or holds one of the wrong length: each is an error that names the file
    and the slice it was to hold. A checkpoint of ANOTHER model (names or shapes that differ)
    is a ValueError that says what differs, before anything is read.

    What torch offers, and when a practitioner would choose it (P parameters' bytes, N ranks):

        one file, rank 0 (k15)     rank 0 writes P (after gathering it: P of memory on
          torch.save(state_dict)   rank 0); any world loads it, each rank reading all P;
                                   pays for replicated state (DDP) and small models
        a file per rank, no        each rank writes P/N; loads only into the same N ranks
          metadata (FSDP's         and the same layout; pays when the world never changes
          SHARDED_STATE_DICT by
          hand)
        a file per rank +          each rank writes P/N and reads about P/N (only the
          metadata (this kata)     overlaps); any world loads it; pays when jobs restart
                                   on other world sizes (preemption, elastic jobs, k16)
        torch.distributed.         the same idea as torch ships it: DTensors or sharded
          checkpoint (DCP):        tensors in, ``__{rank}_0.distcp`` files plus ``.metadata``
          dcp.save / dcp.load      out, a planner that reshards, async saves
                                   (``dcp.async_save``), any storage; what to use in practice

STEPS
    1. The layout: ``shard_range`` (this rank's contiguous slice of a flat tensor, k19's:
       ceil(numel / N) elements each, the last ones short or empty) and ``make_metadata``
       (every tensor's name, shape, dtype and pieces: file, offset, length).
    2. ``save_shards``: every rank writes its own file with only its slices, atomically; then,
       once every file is complete, rank 0 writes the metadata, atomically, and every rank
       returns after it.
    3. ``plan_reads``: for a new rank of a new world, the ranges it must read: the overlaps of
       its new slice with the old pieces (file, where in the piece, where in the new slice).
    4. ``read_ranges``: open each file the plan names once (mmap), take only the planned
       ranges; a missing or torn file, or a piece missing or short, raises
       ``CheckpointError`` naming the file and the slice.
    5. ``load_shards``: the metadata checked against the model (a ValueError saying what
       differs), the plan, the reads, the new slices put together; training resumed on the
       new world equals training that never stopped, and equals ``dcp.load`` of the same
       state saved with ``dcp.save``.

WHAT THE TESTS CHECK
    Slices of 10, 4 and 1 elements over 1 to 4 ranks tile the tensor in order (empty slices
    included) and the metadata names every piece's file, offset and length. A save on 4 ranks
    writes one file per rank holding only its slices (its bytes are counted: no whole storage
    behind a view), through a temporary file and ``os.replace``, and the metadata appears only
    after every shard (rank 0's metadata write is watched while another rank's file is slowed).
    A plan for 4 -> 2 and 2 -> 3 reads every element of each new slice exactly once, only from
    the files that overlap it (the reads are counted). Reads touch only the files in the plan;
    a deleted, truncated or altered shard is an error naming the file and the slice. Loading
    4 -> 2 and 2 -> 3 gives each new rank exactly its slices of the saved values, model and
    Adam's state; a checkpoint of another model is refused saying what differs; training
    3 steps on 4 ranks, then 3 on 2 (and 2 then 3) ends with the same bits as 6 steps in one
    process; and ``dcp.save`` on the same world of the same state, ``dcp.load`` on the new
    one, gives the same values. On a GPU machine, slices saved from cuda:0 load on the CPU.

RUN IT
    .venv/bin/python -m katas.k29_resharding_checkpoints                 (save on 4 ranks, resume on 2)
    .venv/bin/python -m katas.k29_resharding_checkpoints --save-world 2 --load-world 3
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from dojo.console import run_program, say
from dojo.launch import add_launch_arguments, launch_world
from dojo.todo import KataTodo
from dojo.toy_models import MODELS, loss, make_batch, make_model

METADATA_FILE = "metadata.json"
LR, BETAS, EPS = 0.01, (0.9, 0.999), 1e-8
BATCH = 16


class CheckpointError(Exception):
    """A checkpoint that cannot be read as it claims: a file missing, torn or not what the
    metadata says. Its message names the file and the slice."""


class Read(NamedTuple):
    """One range a rank reads: ``length`` elements of tensor ``name`` from ``file``, starting
    at ``start`` inside the piece that file holds, into this rank's new slice at ``into``."""

    name: str
    file: str
    start: int
    length: int
    into: int


def shard_file(rank: int, world_size: int) -> str:
    """The name of the file rank ``rank`` of ``world_size`` writes."""
    return f"shard-{rank:05d}-of-{world_size:05d}.pt"


# --------------------------------------------------------------------------- step 1: the layout


def shard_range(numel: int, rank: int, world_size: int) -> tuple[int, int]:
    """``(offset, length)`` of rank ``rank``'s contiguous slice of a flat tensor of ``numel``
    elements split over ``world_size`` ranks: ceil(numel / world_size) elements each, in rank
    order, the last slices short or empty (k19's layout; the padding is never stored)."""
    # TODO: this rank's (offset, length) in the flat tensor: every rank but the last ones gets
    # ceil(numel / world_size) elements, in rank order; the ones past the end get a short or an
    # empty slice (offset numel, length 0). A ValueError for a rank outside the world. The tests
    # tile 10, 4 and 1 elements over 1 to 4 ranks and want every element once, in order.
    raise KataTodo("k29", 1, "the layout: contiguous slices and the metadata")


def make_metadata(
    tensors: dict[str, tuple[tuple[int, ...], torch.dtype]], world_size: int, step: int
) -> dict:
    """The checkpoint's metadata, a dict that ``json`` can write: ``{"world_size", "step",
    "tensors": {name: {"shape": [...], "dtype": "float32", "pieces": [{"file", "offset",
    "length"}, ...]}}}``, the pieces in rank order, one per rank whose slice is not empty, each
    naming the file ``shard_file(rank, world_size)`` that holds it."""
    # TODO: one entry per tensor, in the order given: its shape (a list), its dtype's name
    # ("float32") and its pieces, one per rank whose slice (shard_range) is not empty, each with
    # the file shard_file(rank, world_size), the offset and the length. The tests read every
    # field, and json.dumps must take it.
    raise KataTodo("k29", 1, "the layout: contiguous slices and the metadata")


# --------------------------------------------------------------------------- step 2: save


def save_shards(folder: str | os.PathLike, shards: dict[str, torch.Tensor], metadata: dict) -> None:
    """Write this rank's slices (``shards``: name -> its flat slice, as ``make_metadata``
    places them) to its own file in ``folder``, atomically; once every rank's file is
    complete, rank 0 writes ``metadata`` to ``METADATA_FILE``, atomically; return on every
    rank after that. Every rank must call it."""
    # TODO: this rank's file shard_file(rank, metadata["world_size"]) in folder, holding only
    # its slices, each a tensor of its own (the tests count the file's bytes: a view saves the
    # whole storage behind it); written under a temporary name, then os.replace. Then, once
    # every rank's file is complete, rank 0 alone writes the metadata (json) to METADATA_FILE
    # the same way; every rank returns only once it is there. A ValueError when a slice's
    # length is not the metadata's. The tests watch every write and rename, slow one rank's,
    # and look for the metadata before every shard is complete.
    raise KataTodo("k29", 2, "save: a file per rank, then the metadata")


# --------------------------------------------------------------------------- step 3: plan a load


def plan_reads(metadata: dict, rank: int, world_size: int) -> list[Read]:
    """The ranges rank ``rank`` of a world of ``world_size`` must read to build its slice of
    every tensor of the checkpoint: the overlaps of its new slice with the saved pieces, in
    the metadata's order of tensors, then of pieces. Nothing else."""
    # TODO: for every tensor (metadata order) and every saved piece (its order) that overlaps
    # this rank's new slice (shard_range over the new world), one Read: the piece's file,
    # where the overlap starts inside the piece, its length, and where it goes in the new
    # slice. No empty reads, no file that holds nothing of the new slice. The tests plan
    # 4 -> 2, 2 -> 3 and 3 -> 3 and check every element is read once, from the right place.
    raise KataTodo("k29", 3, "plan a load into another world")


# --------------------------------------------------------------------------- step 4: read


def read_ranges(folder: str | os.PathLike, metadata: dict, reads: list[Read]) -> list[torch.Tensor]:
    """The planned ranges, in the plan's order, each ``length`` elements of the metadata's
    dtype (a view of the mapped file will do: ``load_shards`` copies it where it goes). Opens
    each file the plan names once, and no other (mapped, not read whole); a file missing or
    torn, or a piece it lacks or holds with another length or dtype, raises
    ``CheckpointError`` naming the file and the slice."""
    # TODO: the planned ranges' values, in the plan's order (views are fine). Open
    # each file named in the plan once and no other, without reading it whole (torch.load can
    # map a file). A missing file, one torch.load refuses (torn), or a piece absent, of
    # another length or dtype: CheckpointError naming the file and the slice (the tensor's
    # name and its [offset:offset+length] in the flat tensor). The tests count the loads and
    # delete, truncate and replace shards.
    raise KataTodo("k29", 4, "read only the planned ranges, refuse torn files")


# --------------------------------------------------------------------------- step 5: load


def load_shards(
    folder: str | os.PathLike,
    expected: dict[str, tuple[tuple[int, ...], torch.dtype]],
    rank: int,
    world_size: int,
) -> tuple[dict[str, torch.Tensor], int]:
    """This rank's slices (name -> flat slice, as ``shard_range(numel, rank, world_size)``
    places it) of every tensor in ``expected``, read from the checkpoint in ``folder``, and
    the checkpoint's step. A folder without metadata raises ``CheckpointError``; a checkpoint
    whose tensors differ from ``expected`` (names, shapes, dtypes) raises ``ValueError``
    saying what differs, before any shard is read."""
    # TODO: read the metadata (missing: CheckpointError naming it); compare its tensors with
    # expected (a ValueError listing the names missing or extra, the shapes and dtypes that
    # differ, and what to do) before any shard is read; then plan, read, and put together this
    # rank's new slice of every tensor; return them with the step. The tests load 4 -> 2 and
    # 2 -> 3, compare with dcp.load of the same state, and resume training.
    raise KataTodo("k29", 5, "load into the new world, and resume")


# --------------------------------------------------------------------------- the training


def state_names(model: nn.Module) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every tensor a checkpoint of ``model`` and its Adam holds: ``name -> (shape, dtype)``;
    the model's parameters and buffers under ``model/``, Adam's moments under ``adam/exp_avg/`` and
    ``adam/exp_avg_sq/`` (trained parameters only)."""
    tensors = [*model.named_parameters(), *model.named_buffers()]  # a tied weight once
    names = {f"model/{k}": (tuple(v.shape), v.dtype) for k, v in tensors}
    for key, parameter in model.named_parameters():
        if parameter.requires_grad:
            for moment in ("exp_avg", "exp_avg_sq"):
                names[f"adam/{moment}/{key}"] = (tuple(parameter.shape), parameter.dtype)
    return names


class ShardedAdam:
    """One rank's share of a model and its Adam: the model whole (every rank computes the whole
    batch's gradient), each tensor's state a flat slice (``shard_range``) that this rank
    updates and then all-gathers; ``shards`` is what a checkpoint holds."""

    def __init__(self, model: nn.Module, rank: int, world_size: int, model_name: str):
        self.model, self.rank, self.world_size = model, rank, world_size
        self.model_name = model_name
        self.names = state_names(model)
        self.step = 0
        state = dict([*model.named_parameters(), *model.named_buffers()])
        self.shards = {}
        for name, (shape, dtype) in self.names.items():
            offset, length = shard_range(math.prod(shape), rank, world_size)
            if name.startswith("model/"):
                self.shards[name] = (
                    state[name[6:]].detach().reshape(-1)[offset : offset + length].clone()
                )
            else:
                self.shards[name] = torch.zeros(length, dtype=dtype)

    def load(self, shards: dict[str, torch.Tensor], step: int) -> None:
        """Take these slices (as ``load_shards`` returns them) and put the model together."""
        self.shards = {name: shards[name].clone() for name in self.names}
        self.step = step
        self._gather()

    def train_step(self, step: int) -> float:
        """One Adam step on step ``step``'s batch (the same data whenever that step runs)."""
        inputs, targets = make_batch(self.model_name, BATCH, seed=1000 + step)
        self.model.zero_grad()
        value = loss(self.model, (inputs, targets))
        value.backward()
        self.step += 1
        beta1, beta2 = BETAS
        bias1, bias2 = 1 - beta1**self.step, 1 - beta2**self.step
        for key, parameter in self.model.named_parameters():
            if not parameter.requires_grad:
                continue
            offset, length = shard_range(parameter.numel(), self.rank, self.world_size)
            grad = parameter.grad.reshape(-1)[offset : offset + length]
            exp_avg = self.shards[f"adam/exp_avg/{key}"]
            exp_avg_sq = self.shards[f"adam/exp_avg_sq/{key}"]
            # Plain elementwise arithmetic (no fused multiply-add): a slice gives the same bits
            # wherever it starts, so any world size steps exactly like one process.
            exp_avg.mul_(beta1).add_(grad * (1 - beta1))
            exp_avg_sq.mul_(beta2).add_(grad * grad * (1 - beta2))
            denom = exp_avg_sq.sqrt() / math.sqrt(bias2) + EPS
            self.shards[f"model/{key}"].sub_(exp_avg / denom * (LR / bias1))
        self._gather()
        return value.item()

    def _gather(self) -> None:
        """Every tensor of the model, whole again from every rank's slice."""
        state = dict([*self.model.named_parameters(), *self.model.named_buffers()])
        for name, (shape, _) in self.names.items():
            if not name.startswith("model/"):
                continue
            numel = math.prod(shape)
            chunk = -(-numel // self.world_size)
            mine = self.shards[name]
            padded = torch.zeros(chunk, dtype=mine.dtype)
            padded[: mine.numel()] = mine
            if self.world_size > 1:
                parts = [torch.empty_like(padded) for _ in range(self.world_size)]
                dist.all_gather(parts, padded)
                whole = torch.cat(parts)[:numel]
            else:
                whole = padded[:numel]
            with torch.no_grad():
                state[name[6:]].copy_(whole.reshape(shape))


def train(
    rank: int,
    world_size: int,
    folder: str,
    steps: int,
    resume: bool = False,
    save: bool = True,
    model_name: str = "buffer",
) -> dict:
    """Train until step ``steps`` on this world, from the checkpoint in ``folder`` when
    ``resume``, and save to ``folder`` at the end when ``save``. Returns this rank's slices,
    the model's whole state, the steps trained and their losses."""
    model = make_model(model_name, 0)
    run = ShardedAdam(model, rank, world_size, model_name)
    if resume:
        run.load(*load_shards(folder, run.names, rank, world_size))
    started, losses = run.step, []
    for step in range(run.step, steps):
        losses.append(run.train_step(step))
    if save:
        metadata = make_metadata(run.names, world_size, run.step)
        save_shards(folder, run.shards, metadata)
    return {
        "shards": {k: v.clone() for k, v in run.shards.items()},
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "started": started,
        "losses": losses,
    }


def gather_state(results: list[dict]) -> dict[str, torch.Tensor]:
    """Every tensor whole, put together from every rank's slices (results in rank order)."""
    return {
        name: torch.cat([result["shards"][name] for result in results])
        for name in results[0]["shards"]
    }


def _differ(a: dict, b: dict) -> list[str]:
    return [name for name in a if not torch.equal(a[name], b[name])]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description="A sharded checkpoint saved on one number of ranks, resumed on another: "
        "the same bits as a run that never stopped."
    )
    add_launch_arguments(parser, world_size=4)
    parser.add_argument(
        "--save-world", type=int, default=None, help="ranks that save (default --world-size)"
    )
    parser.add_argument("--load-world", type=int, default=2, help="ranks that resume (default 2)")
    parser.add_argument("--steps", type=int, default=3, help="steps before and after the save")
    parser.add_argument("--model", choices=sorted(MODELS), default="buffer")
    args = parser.parse_args(argv)
    before = args.save_world or args.world_size
    if before < 1 or args.load_world < 1 or args.steps < 1:
        parser.error("--save-world, --load-world and --steps must be at least 1")
    world = {"backend": args.backend, "device": "cpu"}
    with tempfile.TemporaryDirectory(prefix="k29-") as scratch:
        folder = Path(scratch) / "checkpoint"
        folder.mkdir()
        began = time.perf_counter()
        launch_world(train, before, str(folder), args.steps, model_name=args.model, **world)
        say(
            None,
            f"{args.model} model: {args.steps} steps on {before} ranks, saved in "
            f"{time.perf_counter() - began:.1f} s (with the start of the world)",
        )
        for name in sorted(os.listdir(folder)):
            say(None, f"  {name:28} {os.path.getsize(folder / name):7} bytes")
        resumed = launch_world(
            train,
            args.load_world,
            str(folder),
            2 * args.steps,
            resume=True,
            save=False,
            model_name=args.model,
            **world,
        )
        say(
            None,
            f"resumed on {args.load_world} ranks at step {resumed[0]['started']}, "
            f"losses {' '.join(f'{x:.4f}' for x in resumed[0]['losses'])}",
        )
        whole = launch_world(
            train, 1, str(folder), 2 * args.steps, save=False, model_name=args.model, **world
        )
        different = _differ(gather_state(whole), gather_state(resumed))
        if different:
            say(
                None,
                f"DIFFERENT from {2 * args.steps} steps in one process: {', '.join(different)}",
            )
            return 1
        say(None, f"the same bits as {2 * args.steps} steps in one process, model and Adam's state")
    return 0


if __name__ == "__main__":
    run_program(main)
