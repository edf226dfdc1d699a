"""k36's mistakes catalogue: real mistakes with a 2-D mesh's groups, HSDP's gather and its
reduce-scatter-then-all-reduce, ZeRO-2's sharded gradients and the bytes formula, and right
answers written another way. See ``dojo/dev/mistakes/__init__.py`` for what each list promises.

Method entries are subclasses of the reference with one method done the way a learner might
(the catalogue swaps whole classes)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from dojo.dev.mistakes import Mistake, RightAnswer
from solutions import k36_hsdp_zero2 as reference

HsdpMesh = reference.HsdpMesh
all_gather_flat = reference.all_gather_flat
reduce_scatter_flat = reference.reduce_scatter_flat
padded = reference.padded

# --------------------------------------------------------------------------- step 1: the mesh


def _checked(replicate, shard):
    world = dist.get_world_size()
    if replicate < 1 or shard < 1 or replicate * shard != world:
        raise ValueError(f"a {replicate} x {shard} mesh does not fit a world of {world}")


def _mesh(replicate, shard, replicate_index, shard_index, columns_first=False, swap=False):
    world = dist.get_world_size()
    rows = [list(range(r * shard, (r + 1) * shard)) for r in range(replicate)]
    columns = [list(range(s, world, shard)) for s in range(shard)]
    if columns_first:
        column_groups = [dist.new_group(c) for c in columns]
        row_groups = [dist.new_group(r) for r in rows]
    else:
        row_groups = [dist.new_group(r) for r in rows]
        column_groups = [dist.new_group(c) for c in columns]
    shard_group, replicate_group = row_groups[replicate_index], column_groups[shard_index]
    if swap:
        shard_group, replicate_group = replicate_group, shard_group
    return HsdpMesh(
        replicate,
        shard,
        replicate_index,
        shard_index,
        shard_group,
        replicate_group,
        rows[replicate_index],
        columns[shard_index],
    )


def mesh_transposed(replicate, shard):
    """The grid read down the columns: replicate_index = rank % replicate."""
    _checked(replicate, shard)
    rank = dist.get_rank()
    return _mesh(replicate, shard, rank % replicate, rank // replicate)


def mesh_groups_swapped(replicate, shard):
    """The row's group kept as replicate_group and the column's as shard_group."""
    _checked(replicate, shard)
    return _mesh(replicate, shard, *divmod(dist.get_rank(), shard), swap=True)


def mesh_checks_only_too_big(replicate, shard):
    """Refuses a mesh larger than the world, builds one that is too small."""
    world = dist.get_world_size()
    if replicate * shard > world:
        raise ValueError(f"a {replicate} x {shard} mesh needs more than the {world} ranks")
    rank = dist.get_rank()
    replicate_index, shard_index = divmod(rank, shard)
    return _mesh(replicate, shard, min(replicate_index, replicate - 1), shard_index)


def mesh_vague_error(replicate, shard):
    """Refuses, but without saying what the mesh must be."""
    if replicate < 1 or shard < 1 or replicate * shard != dist.get_world_size():
        raise ValueError("bad mesh")
    return _mesh(replicate, shard, *divmod(dist.get_rank(), shard))


def mesh_checked_after_a_barrier(replicate, shard):
    """Waits for every rank first, then checks: a rank that never comes leaves them waiting."""
    dist.barrier()
    _checked(replicate, shard)
    return _mesh(replicate, shard, *divmod(dist.get_rank(), shard))


def mesh_columns_first(replicate, shard):
    """Right: the columns' groups made before the rows' (the same order on every rank)."""
    _checked(replicate, shard)
    return _mesh(replicate, shard, *divmod(dist.get_rank(), shard), columns_first=True)


# --------------------------------------------------------------------------- step 2: HSDP


def gather_on_replicate_group(shard, mesh):
    """Gathers down the column: copies of its own piece."""
    full = torch.empty(shard.numel() * mesh.replicate, dtype=shard.dtype)
    all_gather_flat(full, shard.detach().contiguous(), mesh.replicate_group)
    return full


def gather_with_a_list(shard, mesh):
    """Right: all_gather into a list of pieces, joined."""
    pieces = [torch.empty_like(shard) for _ in range(mesh.shard)]
    dist.all_gather(pieces, shard.detach().contiguous(), group=mesh.shard_group)
    return torch.cat(pieces)


def _piece(full_grad, mesh):
    piece = torch.empty(full_grad.numel() // mesh.shard, dtype=full_grad.dtype)
    reduce_scatter_flat(piece, full_grad.contiguous(), mesh.shard_group)
    return piece


def reduce_not_divided(full_grad, mesh):
    """The sum over the world, never divided."""
    piece = _piece(full_grad, mesh)
    dist.all_reduce(piece, group=mesh.replicate_group)
    return piece


def reduce_divided_by_shard(full_grad, mesh):
    """Divided by the row's size only, as k19 divided by its group's."""
    piece = _piece(full_grad, mesh)
    dist.all_reduce(piece, group=mesh.replicate_group)
    return piece / mesh.shard


def reduce_row_only(full_grad, mesh):
    """k19's FSDP inside the row, the copies never averaged."""
    return _piece(full_grad, mesh) / mesh.shard


def reduce_all_reduce_first(full_grad, mesh):
    """Right values, but the whole gradient crosses the replicate link."""
    total = full_grad.clone()
    dist.all_reduce(total, group=mesh.replicate_group)
    return _piece(total, mesh) / (mesh.replicate * mesh.shard)


def reduce_on_the_world(full_grad, mesh):
    """DDP's all-reduce over the world, then this rank's piece cut out."""
    total = full_grad.clone()
    dist.all_reduce(total)
    share = total.numel() // mesh.shard
    return total[mesh.shard_index * share : (mesh.shard_index + 1) * share] / dist.get_world_size()


def reduce_in_place(full_grad, mesh):
    """Divides the gradient it was given in place first."""
    full_grad.div_(mesh.replicate * mesh.shard)
    piece = _piece(full_grad, mesh)
    dist.all_reduce(piece, group=mesh.replicate_group)
    return piece


def reduce_divided_first(full_grad, mesh):
    """Right: a divided copy reduced (torch's pre-divide), nothing left to divide after."""
    piece = _piece(full_grad / (mesh.replicate * mesh.shard), mesh)
    dist.all_reduce(piece, group=mesh.replicate_group)
    return piece


# --------------------------------------------------------------------------- step 3: ZeRO-2


class _Zero2(reference.Zero2Optimizer):
    def _flat(self):
        flat = torch.zeros(padded(self.numel, self.world_size), dtype=self.shard.dtype)
        flat[: self.numel] = torch.cat([p.grad.reshape(-1) for p in self.params])
        return flat

    def _put_back(self, full):
        start = 0
        for p in self.params:
            p.copy_(full[start : start + p.numel()].view_as(p))
            start += p.numel()

    def _gather(self):
        full = torch.empty(padded(self.numel, self.world_size), dtype=self.shard.dtype)
        all_gather_flat(full, self.shard.detach(), self.process_group)
        self._put_back(full)


class Zero2AllReduce(_Zero2):
    """ZeRO-1's all-reduce of the whole gradient, then its slice cut out."""

    @torch.no_grad()
    def step(self):
        flat = self._flat()
        dist.all_reduce(flat, group=self.process_group)
        share = self.shard.numel()
        self.shard.grad = flat[self.rank * share : (self.rank + 1) * share] / self.world_size
        for p in self.params:
            p.grad = None
        self.inner.step()
        self._gather()


class Zero2KeepsFullGrads(_Zero2):
    """Reduce-scatters, but leaves every parameter's whole gradient in place."""

    @torch.no_grad()
    def step(self):
        piece = torch.empty_like(self.shard)
        reduce_scatter_flat(piece, self._flat(), self.process_group)
        self.shard.grad = piece / self.world_size
        self.inner.step()
        self._gather()


class Zero2NotDivided(_Zero2):
    """The reduce-scatter's sum stepped as it is."""

    @torch.no_grad()
    def step(self):
        piece = torch.empty_like(self.shard)
        reduce_scatter_flat(piece, self._flat(), self.process_group)
        self.shard.grad = piece
        for p in self.params:
            p.grad = None
        self.inner.step()
        self._gather()


class Zero2NoGather(_Zero2):
    """Steps its slice and stops: the model's parameters never see the new values."""

    @torch.no_grad()
    def step(self):
        piece = torch.empty_like(self.shard)
        reduce_scatter_flat(piece, self._flat(), self.process_group)
        self.shard.grad = piece / self.world_size
        for p in self.params:
            p.grad = None
        self.inner.step()


class Zero2GathersBeforeTheStep(_Zero2):
    """All-gathers the slices before the inner step: the parameters lag a step behind."""

    @torch.no_grad()
    def step(self):
        piece = torch.empty_like(self.shard)
        reduce_scatter_flat(piece, self._flat(), self.process_group)
        self.shard.grad = piece / self.world_size
        for p in self.params:
            p.grad = None
        self._gather()
        self.inner.step()


class Zero2WithLists(_Zero2):
    """Right: reduce_scatter and all_gather on lists of pieces (views of the flat vectors)."""

    @torch.no_grad()
    def step(self):
        flat = self._flat() / self.world_size
        pieces = list(flat.chunk(self.world_size))
        piece = torch.empty_like(self.shard)
        dist.reduce_scatter(piece, pieces, group=self.process_group)
        self.shard.grad = piece
        for p in self.params:
            p.grad = None
        self.inner.step()
        full = torch.empty_like(flat)
        dist.all_gather(list(full.chunk(self.world_size)), self.shard.detach(), self.process_group)
        self._put_back(full)


# --------------------------------------------------------------------------- step 4: the bytes


def _checked_bytes(numel, world_size, stage, state_bytes):
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0-3, got {stage!r}")
    for value, least in ((numel, 0), (world_size, 1), (state_bytes, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{value!r} is not an int of at least {least}")


def bytes_grads_unsharded_at_stage_2(numel, world_size, stage, state_bytes=8):
    """Stage 2 read as 'the parameters' (ZeRO-3's), the gradients kept whole."""
    _checked_bytes(numel, world_size, stage, state_bytes)
    piece = -(-numel // world_size)
    return {
        "params": 4 * (piece if stage >= 2 else numel),
        "grads": 4 * (piece if stage >= 3 else numel),
        "optimizer": state_bytes * (piece if stage >= 1 else numel),
    }


def bytes_state_sharded_from_stage_2(numel, world_size, stage, state_bytes=8):
    """Stage 1 counted as DDP: the optimizer state sharded only from stage 2."""
    _checked_bytes(numel, world_size, stage, state_bytes)
    piece = -(-numel // world_size)
    return {
        "params": 4 * (piece if stage >= 3 else numel),
        "grads": 4 * (piece if stage >= 2 else numel),
        "optimizer": state_bytes * (piece if stage >= 2 else numel),
    }


def bytes_floored(numel, world_size, stage, state_bytes=8):
    """numel // world_size: the padding forgotten."""
    _checked_bytes(numel, world_size, stage, state_bytes)
    piece = numel // world_size
    return {
        "params": 4 * (piece if stage >= 3 else numel),
        "grads": 4 * (piece if stage >= 2 else numel),
        "optimizer": state_bytes * (piece if stage >= 1 else numel),
    }


def bytes_adam_state_always(numel, world_size, stage, state_bytes=8):
    """AdamW's 8 bytes a parameter whatever state_bytes says."""
    _checked_bytes(numel, world_size, stage, state_bytes)
    piece = -(-numel // world_size)
    return {
        "params": 4 * (piece if stage >= 3 else numel),
        "grads": 4 * (piece if stage >= 2 else numel),
        "optimizer": 8 * (piece if stage >= 1 else numel),
    }


def bytes_unchecked(numel, world_size, stage, state_bytes=8):
    """The formula, any input taken."""
    piece = -(-numel // world_size) if world_size else numel
    return {
        "params": 4 * (piece if stage >= 3 else numel),
        "grads": 4 * (piece if stage >= 2 else numel),
        "optimizer": state_bytes * (piece if stage >= 1 else numel),
    }


def bytes_by_table(numel, world_size, stage, state_bytes=8):
    """Right: which of the three each stage shards, from a table."""
    _checked_bytes(numel, world_size, stage, state_bytes)
    sharded = [set(), {"optimizer"}, {"optimizer", "grads"}, {"optimizer", "grads", "params"}]
    per = {"params": 4, "grads": 4, "optimizer": state_bytes}
    piece = (numel + world_size - 1) // world_size
    return {k: b * (piece if k in sharded[stage] else numel) for k, b in per.items()}


_MESH = "test_mesh_groups_are_rows_and_columns"
_REFUSED = "test_a_mesh_that_does_not_fit_is_refused"
_GATHER = "test_gather_params_gathers_this_rank_s_row"
_MEAN = "test_reduce_gradient_is_the_world_s_mean_of_this_piece"
_ORDER = "test_reduce_gradient_reduces_in_the_row_first"
_CALLS = "test_zero2_calls_one_reduce_scatter_and_one_all_gather_a_step"
_SLICE = "test_zero2_keeps_only_its_slice_of_the_gradient"
_TRAIN = "test_zero2_trains_like_unsharded_adamw"
_FORMULA = "test_zero_bytes_follows_the_formula"

MISTAKES = [
    Mistake(
        "mesh_transposed",
        replaces="make_mesh",
        fails=[f"{_MESH}[2-2]"],
        says=["(replicate_index, shard_index) =", "replicate_index = rank // shard"],
    ),
    Mistake(
        "mesh_groups_swapped",
        replaces="make_mesh",
        fails=[f"{_MESH}[2-2]"],
        says=["an all-reduce of the ranks over shard_group", "the groups do not hold those ranks"],
    ),
    Mistake(
        "mesh_checks_only_too_big",
        replaces="make_mesh",
        fails=[_REFUSED],
        says=["make_mesh(2, 1) on 4 ranks returned a mesh", "raise ValueError"],
    ),
    Mistake(
        "mesh_vague_error", replaces="make_mesh", fails=[_REFUSED], says=["name the world size"]
    ),
    Mistake(
        "mesh_checked_after_a_barrier",
        replaces="make_mesh",
        fails=[_REFUSED],
        says=["before its ValueError", "check the mesh first"],
    ),
    Mistake(
        "gather_on_replicate_group",
        replaces="gather_params",
        fails=[f"{_GATHER}[2-2]"],
        says=["expected one all-gather on mesh.shard_group"],
    ),
    Mistake(
        "reduce_not_divided",
        replaces="reduce_gradient",
        fails=[f"{_MEAN}[2-2]"],
        says=["the SUM over the world", "divide by the world size"],
    ),
    Mistake(
        "reduce_divided_by_shard",
        replaces="reduce_gradient",
        fails=[f"{_MEAN}[2-2]"],
        says=["divide by replicate x shard"],
    ),
    Mistake(
        "reduce_row_only",
        replaces="reduce_gradient",
        fails=[f"{_MEAN}[2-2]"],
        says=["the mean of this ROW only", "mesh.replicate_group"],
    ),
    Mistake(
        "reduce_all_reduce_first",
        replaces="reduce_gradient",
        fails=[f"{_ORDER}[2-2]"],
        says=["reduce-scatter on the shard group FIRST", "the slow one between machines"],
    ),
    Mistake(
        "reduce_on_the_world",
        replaces="reduce_gradient",
        fails=[f"{_ORDER}[2-2]"],
        says=["reduce_gradient called [('all-reduce', 'world')]"],
    ),
    Mistake(
        "reduce_in_place",
        replaces="reduce_gradient",
        fails=[f"{_MEAN}[2-2]"],
        says=["changed the full_grad it was given"],
    ),
    Mistake(
        "Zero2AllReduce",
        replaces="Zero2Optimizer",
        fails=[_CALLS],
        says=["no all-reduce", "called [('all-reduce', 'the group')"],
    ),
    Mistake(
        "Zero2KeepsFullGrads",
        replaces="Zero2Optimizer",
        fails=[_SLICE],
        says=["still hold their whole gradients", "set each p.grad to None"],
    ),
    Mistake(
        "Zero2NotDivided",
        replaces="Zero2Optimizer",
        fails=[_TRAIN],
        says=["differs from unsharded AdamW", "divide by the world size"],
    ),
    Mistake(
        "Zero2NoGather",
        replaces="Zero2Optimizer",
        fails=[_CALLS],
        says=["one all-gather of the new slices"],
    ),
    Mistake(
        "Zero2GathersBeforeTheStep",
        replaces="Zero2Optimizer",
        fails=[_TRAIN],
        says=["differs from unsharded AdamW", "all-gather the slices after the inner step"],
    ),
    Mistake(
        "bytes_grads_unsharded_at_stage_2",
        replaces="zero_bytes",
        fails=[_FORMULA],
        says=["stage 2 the gradients too"],
    ),
    Mistake(
        "bytes_state_sharded_from_stage_2",
        replaces="zero_bytes",
        fails=[_FORMULA],
        says=["stage 1 shards the optimizer state"],
    ),
    Mistake(
        "bytes_floored",
        replaces="zero_bytes",
        fails=[f"{_FORMULA}[1001-4-8]"],
        says=["ceil(1001 / 4)"],
    ),
    Mistake(
        "bytes_adam_state_always",
        replaces="zero_bytes",
        fails=[f"{_FORMULA}[7-3-4]"],
        says=["state_bytes=4"],
    ),
    Mistake(
        "bytes_unchecked",
        replaces="zero_bytes",
        fails=["test_zero_bytes_refuses_bad_input"],
        says=["raise ValueError"],
    ),
]

RIGHT_ANSWERS = [
    RightAnswer("mesh_columns_first", replaces="make_mesh"),
    RightAnswer("gather_with_a_list", replaces="gather_params"),
    RightAnswer("reduce_divided_first", replaces="reduce_gradient"),
    RightAnswer("Zero2WithLists", replaces="Zero2Optimizer"),
    RightAnswer("bytes_by_table", replaces="zero_bytes"),
]
