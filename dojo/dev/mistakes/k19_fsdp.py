"""k19's mistakes catalogue: real mistakes in sharding a model (shard_of, FullyShardedModule's
units, the gather and its backward, the hooks, finish and the full parameters, prefetch and
reshard_after_forward), and right answers written another way. See ``dojo/dev/mistakes/__init__.py`` for what each list promises.

Each FullyShardedModule entry is a subclass of the reference with one method done the way a
learner might (the catalogue swaps whole classes).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from dojo.dev.mistakes import Mistake, RightAnswer
from solutions import k19_fsdp as reference

_Reference = reference.FullyShardedModule
ShardedUnit = reference.ShardedUnit
owner_of = reference.owner_of


def _check(flat, rank, world_size):
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of {world_size}")
    if flat.dim() != 1:
        raise ValueError("flat must be one-dimensional")


# --------------------------------------------------------------------------- shard_of


def no_padding(flat, rank, world_size):
    _check(flat, rank, world_size)
    return flat.chunk(world_size)[rank].clone()  # "chunk splits it": the last piece is shorter


def floor_division(flat, rank, world_size):
    _check(flat, rank, world_size)
    chunk = flat.numel() // world_size  # the remainder is dropped
    return flat[rank * chunk : (rank + 1) * chunk].clone()


def a_view(flat, rank, world_size):
    _check(flat, rank, world_size)
    chunk = -(-flat.numel() // world_size)
    if chunk * world_size == flat.numel():
        return flat[rank * chunk : (rank + 1) * chunk]  # no copy where no padding is needed
    padded = torch.cat([flat, flat.new_zeros(chunk * world_size - flat.numel())])
    return padded[rank * chunk : (rank + 1) * chunk]


def padded_with_pad(flat, rank, world_size):
    """Right: torch.nn.functional.pad, then a chunk."""
    _check(flat, rank, world_size)
    chunk = -(-flat.numel() // world_size)
    padded = nn.functional.pad(flat, (0, chunk * world_size - flat.numel()))
    return padded.chunk(world_size)[rank].clone()


# --------------------------------------------------------------------------- _shard_units


class _Sharding(_Reference):
    def _rank_for_shard(self):
        return self.rank

    def _taken(self):
        """Unit prefix -> its (name, parameter) pairs: the deepest unit above takes each."""
        units = {p: m for p, m in self.module.named_modules() if isinstance(m, self.shard_types)}
        taken = {prefix: [] for prefix in units}
        for name, param in self.module.named_parameters():
            path = name.rpartition(".")[0]
            above = [p for p in units if p == "" or path == p or path.startswith(p + ".")]
            if above:
                taken[max(above, key=len)].append((name, param))
        return units, taken

    def _shard_units(self):
        units, taken = self._taken()
        for prefix, module in units.items():
            own = taken[prefix]
            if own:
                self._add(prefix, module, own)

    def _add(self, prefix, module, own):
        names = [name[len(prefix) + 1 :] if prefix else name for name, _ in own]
        flat = torch.cat([p.detach().reshape(-1) for _, p in own])
        shard = nn.Parameter(reference.shard_of(flat, self._rank_for_shard(), self.world_size))
        unit = ShardedUnit(module, prefix, names, [p.shape for _, p in own], flat.numel(), shard)
        self._remove(module, names)
        self.units.append(unit)
        self.shards.append(shard)

    def _remove(self, module, names):
        for name in names:
            owner, attribute = owner_of(module, name)
            delattr(owner, attribute)
            setattr(owner, attribute, None)


class GlobalRankShard(_Sharding):
    def _rank_for_shard(self):
        return dist.get_rank()  # the rank in the whole world


class LayersKeepTheirParameters(_Sharding):
    def _remove(self, module, names):
        pass  # "the layer still needs its weight": a full copy stays on every rank


class ShardsNotRegistered(_Sharding):
    def _shard_units(self):
        super()._shard_units()
        self.shards = nn.ParameterList()  # kept only in self.units: the optimizer never sees them
        self._kept = [u.shard for u in self.units]


class MasterShardsInComputeDtype(_Sharding):
    def _shard_units(self):
        super()._shard_units()
        if self.compute_dtype is not None:  # "keep them in the dtype we compute in"
            for unit in self.units:
                unit.shard.data = unit.shard.data.to(self.compute_dtype)


class OwnParametersOnly(_Sharding):
    def _shard_units(self):
        units, _ = self._taken()
        for prefix, module in units.items():
            own = [  # the per-layer habit: a block has no parameters of its own
                (f"{prefix}.{n}" if prefix else n, p)
                for n, p in module.named_parameters(recurse=False)
            ]
            if own:
                self._add(prefix, module, own)


class OutermostUnitTakesAll(_Sharding):
    def _shard_units(self):
        units, _ = self._taken()
        claimed = set()
        for prefix, module in units.items():  # named_modules() order: the model comes first
            own = [
                (f"{prefix}.{n}" if prefix else n, p)
                for n, p in module.named_parameters()
                if id(p) not in claimed
            ]
            claimed.update(id(p) for _, p in own)
            if own:
                self._add(prefix, module, own)


class ChunkedNoPadding(_Sharding):
    """A real course's FSDP (Stanford's systems course), in this kata's names: each unit's vector
    cut with torch.chunk, no padding, and gathered into a list of pieces of the chunks' sizes
    (where gloo refused: "ProcessGroupGloo::allgather: invalid tensor size (expected 170, got
    171)")."""

    def _add(self, prefix, module, own):
        names = [name[len(prefix) + 1 :] if prefix else name for name, _ in own]
        flat = torch.cat([p.detach().reshape(-1) for _, p in own])
        shard = nn.Parameter(flat.chunk(self.world_size)[self.rank].clone())
        unit = ShardedUnit(module, prefix, names, [p.shape for _, p in own], flat.numel(), shard)
        self._remove(module, names)
        self.units.append(unit)
        self.shards.append(shard)

    def _unshard(self, unit):
        if unit.full is None:
            piece = unit.shard.detach().to(self.compute_dtype or unit.shard.dtype)
            full = torch.empty(unit.numel, dtype=piece.dtype)
            dist.all_gather(list(full.chunk(self.world_size)), piece, group=self.process_group)
            unit.full = full
        return unit.full


class EveryUnitTakesAllBeneath(_Sharding):
    def _shard_units(self):
        units, _ = self._taken()
        every = {  # each unit's parameters, all of them, before any is removed
            prefix: [(f"{prefix}.{n}" if prefix else n, p) for n, p in m.named_parameters()]
            for prefix, m in units.items()
        }
        for prefix, module in units.items():  # the model's unit holds the blocks' ones too
            if every[prefix]:
                self._add(prefix, module, every[prefix])


class UnitPerParameter(_Sharding):
    def _add(self, prefix, module, own):
        for name, param in own:  # one vector, one all-gather, per parameter
            super()._add(prefix, module, [(name, param)])


# --------------------------------------------------------------------------- the gather


class AllReduceBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, shard, group, compute_dtype, gathered=None):
        ctx.group, ctx.dtype = group, shard.dtype
        return reference.gather_shard(shard, group, compute_dtype) if gathered is None else gathered

    @staticmethod
    def backward(ctx, grad_full):
        grad = grad_full.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)  # every rank gets the whole sum
        return (grad / dist.get_world_size(ctx.group)).to(ctx.dtype), None, None, None


class SumNotMean(torch.autograd.Function):
    @staticmethod
    def forward(ctx, shard, group, compute_dtype, gathered=None):
        ctx.group, ctx.dtype = group, shard.dtype
        return reference.gather_shard(shard, group, compute_dtype) if gathered is None else gathered

    @staticmethod
    def backward(ctx, grad_full):
        size = dist.get_world_size(ctx.group)
        grad = torch.empty(grad_full.numel() // size, dtype=grad_full.dtype)
        reference.reduce_scatter_flat(grad, grad_full.contiguous(), ctx.group)
        return grad.to(ctx.dtype), None, None, None  # the sum over the ranks


class BackwardDividesByTheWorld(reference.AllGatherShard):
    @staticmethod
    def backward(ctx, grad_full):
        size = dist.get_world_size(ctx.group)
        grad = torch.empty(grad_full.numel() // size, dtype=grad_full.dtype)
        reference.reduce_scatter_flat(grad, grad_full.contiguous(), ctx.group)
        return (grad / dist.get_world_size()).to(ctx.dtype), None, None, None  # the world's size


class DividedBeforeTheReduceScatter(reference.AllGatherShard):
    """Right: each rank's gradient divided by the group's size first, then summed: what
    fully_shard does (a / 2 + b / 2); in float16 it may round an ulp from the other order."""

    @staticmethod
    def backward(ctx, grad_full):
        size = dist.get_world_size(ctx.group)
        grad = torch.empty(grad_full.numel() // size, dtype=grad_full.dtype)
        reference.reduce_scatter_flat(grad, (grad_full / size).contiguous(), ctx.group)
        return grad.to(ctx.dtype), None, None, None


class GatheredIgnored(reference.AllGatherShard):
    @staticmethod
    def forward(ctx, shard, group, compute_dtype, gathered=None):
        ctx.group, ctx.dtype = group, shard.dtype
        return reference.gather_shard(shard, group, compute_dtype)  # a second all-gather


def cast_after_gather(shard, group=None, compute_dtype=None):
    full = torch.empty(shard.numel() * dist.get_world_size(group), dtype=shard.dtype)
    reference.all_gather_flat(full, shard.detach().contiguous(), group)
    return full if compute_dtype is None else full.to(compute_dtype)  # fp32 on the wire


def gathered_as_a_list(shard, group=None, compute_dtype=None):
    """Right: all_gather into a list of pieces, then one cat."""
    piece = shard.detach().to(compute_dtype or shard.dtype).contiguous()
    pieces = [torch.empty_like(piece) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, piece, group=group)
    return torch.cat(pieces)


# --------------------------------------------------------------------------- the hooks


def _release_attributes(unit, module):
    for name in unit.names:
        owner, attribute = owner_of(module, name)
        setattr(owner, attribute, None)


class NeverFreed(_Reference):
    def _after_forward(self, unit, module, args, output):
        if self.compute_dtype is not None and output.is_floating_point():
            return output.to(unit.shard.dtype)
        return None  # the unit keeps its full weights until the next forward


class GatheredOnlyInForward(_Reference):
    def _pack(self, tensor):
        return tensor  # autograd keeps the full weights until backward

    def _unpack(self, saved):
        return saved


class GatheredAtEveryNote(_Reference):
    def _unpack(self, saved):
        if torch.is_tensor(saved):
            return saved
        unit, size, stride, offset = saved  # a gather per note: a block has dozens
        full = reference.gather_shard(unit.shard, self.process_group, self.compute_dtype)
        return full.as_strided(size, stride, offset)


class NeverLetGoAfterBackward(_Reference):
    def _before_forward(self, unit, module, args):
        full = reference.AllGatherShard.apply(
            unit.shard, self.process_group, self.compute_dtype, self._unshard(unit)
        )
        self._live[full.untyped_storage().data_ptr()] = unit  # no hook: unit.full stays
        offset = 0
        for name, shape in zip(unit.names, unit.shapes):
            owner, attribute = owner_of(module, name)
            setattr(owner, attribute, full[offset : offset + shape.numel()].view(shape))
            offset += shape.numel()
        return None


class OutputLeftInComputeDtype(_Reference):
    def _after_forward(self, unit, module, args, output):
        super()._after_forward(unit, module, args, output)
        return None  # float16 flows on into the LayerNorms and the loss


class NoteAsADict(_Reference):
    """Right: the note is the unit alone; unpack views by the saved geometry."""

    def _pack(self, tensor):
        unit = self._live.get(tensor.untyped_storage().data_ptr())
        if unit is None:
            return tensor
        return {"unit": unit, "geometry": (tensor.size(), tensor.stride(), tensor.storage_offset())}

    def _unpack(self, saved):
        if isinstance(saved, dict):
            return torch.as_strided(self._unshard(saved["unit"]), *saved["geometry"])
        return saved


# --------------------------------------------------------------------------- prefetch and keep


class NextInForwardOrderAlways(_Reference):
    def _next_unit(self, unit):
        order = self._order["forward"]  # in backward too: the unit that just finished
        for index, known in enumerate(order[:-1]):
            if known is unit:
                return order[index + 1]
        return None


class NextIsItself(_Reference):
    def _next_unit(self, unit):
        return unit  # "prefetch this unit": it is gathered already, nothing is launched


class PrefetchBlocks(_Reference):
    def _prefetch(self, unit):
        if unit is None or unit.full is not None or unit.pending is not None:
            return
        full = reference.gather_shard(unit.shard, self.process_group, self.compute_dtype)
        unit.pending = (None, full)  # gathered now, while nothing else happens

    def _wait(self, unit):
        work, full = unit.pending
        unit.pending = None
        return full


class PrefetchWaitsAtOnce(_Reference):
    def _prefetch(self, unit):
        super()._prefetch(unit)
        if unit is not None and unit.pending is not None:
            unit.pending[0].wait()  # "to be safe": launched ahead, then waited for on the spot


class NeverWaited(_Reference):
    def _wait(self, unit):
        work, full = unit.pending  # "the gather was launched long ago": maybe not filled yet
        unit.pending = None
        return full


class WaitLeavesPending(_Reference):
    def _wait(self, unit):
        work, full = unit.pending  # not cleared: backward takes this vector again
        work.wait()
        return full


class PrefetchOnTheWorld(_Reference):
    def _prefetch(self, unit):
        if unit is None or unit.full is not None or unit.pending is not None:
            return
        piece = unit.shard.detach().contiguous()
        full = torch.empty(piece.numel() * dist.get_world_size(), dtype=piece.dtype)
        unit.pending = (reference.all_gather_flat(full, piece, async_op=True), full)  # no group


class PrefetchIgnoresKept(_Reference):
    def _prefetch(self, unit):
        if unit is None or unit.pending is not None:  # a kept unit is gathered again
            return
        piece = unit.shard.detach().contiguous()
        full = torch.empty(piece.numel() * self.world_size, dtype=piece.dtype)
        work = reference.all_gather_flat(full, piece, self.process_group, async_op=True)
        unit.pending = (work, full)


class KeepFrees(_Reference):
    def _keep(self, unit, module, args, output):
        return self._after_forward(unit, module, args, output)  # freed: gathered in backward


class KeepLeavesAttributes(_Reference):
    def _keep(self, unit, module, args, output):
        return None  # the modules' attributes still hold views of the vector after backward


class NextByIndex(_Reference):
    """Right: the position found through ids, the next one by index."""

    def _next_unit(self, unit):
        ids = [id(u) for u in self._order[self._phase]]
        if id(unit) not in ids or ids.index(id(unit)) + 1 == len(ids):
            return None
        return self._order[self._phase][ids.index(id(unit)) + 1]


class PrefetchAsAList(_Reference):
    """Right: the prefetch as an async all_gather into a list: the pieces of one vector."""

    def _prefetch(self, unit):
        if unit is None or unit.full is not None or unit.pending is not None:
            return
        piece = unit.shard.detach().to(self.compute_dtype or unit.shard.dtype).contiguous()
        full = torch.empty(piece.numel() * self.world_size, dtype=piece.dtype)
        pieces = list(full.chunk(self.world_size))  # views: the gather fills full itself
        unit.pending = (dist.all_gather(pieces, piece, self.process_group, async_op=True), full)


# --------------------------------------------------------------------------- finish, full params


class ReplicatedNotAveraged(_Reference):
    def finish_gradient_synchronization(self):
        with torch.no_grad():
            for param in self.module.parameters():
                if param.grad is not None:
                    dist.all_reduce(param.grad, group=self.process_group)  # the sum, not the mean


class ReplicatedForgotten(_Reference):
    def finish_gradient_synchronization(self):
        pass  # "the hooks did the gradients already": only the shards'


class NamesWithThePrefix(_Reference):
    def gather_full_params(self):
        full = super().gather_full_params()
        return {f"module.{name}": value for name, value in full.items()}  # the wrapper's names


class FullParamsUnitsFirst(_Reference):
    def gather_full_params(self):
        found = {}
        for unit in self.units:  # the units' parameters first, then the replicated ones
            full = reference.gather_shard(unit.shard, self.process_group)
            offset = 0
            for name, shape in zip(unit.names, unit.shapes):
                key = f"{unit.prefix}.{name}" if unit.prefix else name
                found[key] = full[offset : offset + shape.numel()].view(shape).clone()
                offset += shape.numel()
        for name, param in self.module.named_parameters():
            found[name] = param.detach().clone()
        return found


class PaddingKept(_Reference):
    def gather_full_params(self):
        found = {}
        for unit in self.units:
            full = reference.gather_shard(unit.shard, self.process_group)
            offset = 0
            for name, shape in zip(unit.names, unit.shapes):
                found[f"{unit.prefix}.{name}"] = full[offset : offset + shape.numel()].view(shape)
                offset += shape.numel()
            if len(unit.names) > 1:  # the last one takes the rest: padding included
                last = unit.names[-1]
                found[f"{unit.prefix}.{last}"] = full[offset - unit.shapes[-1].numel() :].clone()
        for name, param in self.module.named_parameters():
            found[name] = param.detach().clone()
        return {name: found[name] for name in self.names}


class FlatAveraged(_Reference):
    """Right: the replicated gradients in one flat buffer, one all-reduce with AVG-like divide."""

    def finish_gradient_synchronization(self):
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.process_group)
        flat /= self.world_size
        offset = 0
        for grad in grads:
            grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()


_SHARD = "test_shard_of_pads_and_keeps_one_piece"
_SHARDED = "test_every_linear_and_embedding_is_sharded"
_BLOCKS = "test_a_block_unit_takes_every_parameter_beneath_it"
_GATHER = "test_the_gather_and_its_backward"
_COUNT = "test_one_gather_per_unit_in_forward_and_again_in_backward"
_ALIVE = "test_full_weights_alive_at_once_are_one_units"
_TRAIN = "test_training_equals_one_process"
_AHEAD = "test_prefetch_launches_each_next_gather_ahead"
_KEEP = "test_reshard_after_forward_off_keeps_every_unit_until_backward"

MISTAKES = [
    Mistake(
        "no_padding",
        replaces="shard_of",
        fails=[f"{_SHARD}[ten-on-3]", f"{_SHARDED}[3]"],
        says=["pad the flat vector"],
    ),
    Mistake(
        "floor_division",
        replaces="shard_of",
        fails=[f"{_SHARD}[ten-on-3]", f"{_SHARD}[three-on-4]"],
        says=["pad the flat vector", "ceil("],
    ),
    Mistake(
        "a_view",
        replaces="shard_of",
        fails=[f"{_SHARD}[eight-on-2]"],
        says=["return a new tensor (.clone())"],
    ),
    Mistake(
        "GlobalRankShard",
        replaces="FullyShardedModule",
        fails=["test_a_subgroup_shards_by_its_own_ranks"],
        says=["not the rank in the whole world"],
    ),
    Mistake(
        "LayersKeepTheirParameters",
        replaces="FullyShardedModule",
        fails=[_SHARDED, "test_a_subgroup_shards_by_its_own_ranks"],
        says=["still have parameters of their own", "delattr"],
    ),
    Mistake(
        "ShardsNotRegistered",
        replaces="FullyShardedModule",
        fails=[_SHARDED, "test_a_subgroup_shards_by_its_own_ranks"],
        says=["Register each shard as a parameter of the wrapper"],
    ),
    Mistake(
        "OwnParametersOnly",
        replaces="FullyShardedModule",
        fails=[_BLOCKS],
        says=["A unit takes every parameter beneath it"],
    ),
    Mistake(
        "OutermostUnitTakesAll",
        replaces="FullyShardedModule",
        fails=[_BLOCKS],
        says=["except those beneath a deeper unit"],
    ),
    Mistake(
        "ChunkedNoPadding",
        replaces="FullyShardedModule",
        fails=[f"{_SHARDED}[3]"],
        says=["pad the flat vector", "torch.chunk's last piece is shorter"],
    ),
    Mistake(
        "EveryUnitTakesAllBeneath",
        replaces="FullyShardedModule",
        fails=[_BLOCKS],
        says=["the deeper units' too", "the deepest unit above it"],
    ),
    Mistake(
        "UnitPerParameter",
        replaces="FullyShardedModule",
        fails=[_SHARDED, "test_a_subgroup_shards_by_its_own_ranks"],
        says=["not one per parameter"],
    ),
    Mistake(
        "MasterShardsInComputeDtype",
        replaces="FullyShardedModule",
        fails=["test_compute_dtype_gathers_float16_and_keeps_fp32_masters"],
        says=["the master shards stay fp32"],
    ),
    Mistake(
        "AllReduceBackward",
        replaces="AllGatherShard",
        fails=[_GATHER],
        says=["reduce-scatter the full gradient", "not all-reduce it"],
    ),
    Mistake(
        "SumNotMean",
        replaces="AllGatherShard",
        fails=[f"{_GATHER}[fp32]"],
        says=["the sum over the 3 ranks", "divide by the group's size"],
    ),
    Mistake(
        "BackwardDividesByTheWorld",
        replaces="AllGatherShard",
        fails=["test_training_in_a_subgroup"],
        says=["gradient of the shard of", "divided by 3, the whole world's size"],
    ),
    Mistake(
        "GatheredIgnored",
        replaces="AllGatherShard",
        fails=["test_a_vector_gathered_ahead_is_used_as_it_is"],
        says=["calls no collective"],
    ),
    Mistake(
        "cast_after_gather",
        replaces="gather_shard",
        fails=["test_compute_dtype_gathers_float16_and_keeps_fp32_masters"],
        says=["cast each shard to compute_dtype before the all-gather"],
    ),
    Mistake(
        "NeverFreed",
        replaces="FullyShardedModule",
        fails=[_COUNT, _ALIVE],
        says=["self._reshard(unit)"],
    ),
    Mistake(
        "GatheredOnlyInForward",
        replaces="FullyShardedModule",
        fails=[_COUNT, _ALIVE],
        says=["_pack"],
    ),
    Mistake(
        "GatheredAtEveryNote",
        replaces="FullyShardedModule",
        fails=[f"{_COUNT}[blocks]"],
        says=["gathered once in backward, at its first note", "self._unshard(unit)"],
    ),
    Mistake(
        "NeverLetGoAfterBackward",
        replaces="FullyShardedModule",
        fails=[_ALIVE],
        says=["once the unit's gradient is done", "self._after_backward"],
    ),
    Mistake(
        "OutputLeftInComputeDtype",
        replaces="FullyShardedModule",
        fails=["test_compute_dtype_gathers_float16_and_keeps_fp32_masters"],
        says=["output cast to fp32"],
    ),
    Mistake(
        "ReplicatedNotAveraged",
        replaces="FullyShardedModule",
        fails=[f"{_TRAIN}[2-sgd]", f"{_TRAIN}[2-adamw]"],
        says=["a replicated parameter", "divide by the group's size"],
    ),
    Mistake(
        "ReplicatedForgotten",
        replaces="FullyShardedModule",
        fails=[_TRAIN, "test_training_in_a_subgroup"],
        says=["finish_gradient_synchronization() must all-reduce its gradient"],
    ),
    Mistake(
        "NamesWithThePrefix",
        replaces="FullyShardedModule",
        fails=[_TRAIN],
        says=["no wrapper prefix"],
    ),
    Mistake(
        "FullParamsUnitsFirst",
        replaces="FullyShardedModule",
        fails=[f"{_TRAIN}[2-sgd]"],
        says=["in another order", "the model's own order", "your order would do"],
    ),
    Mistake(
        "PaddingKept",
        replaces="FullyShardedModule",
        fails=[f"{_TRAIN}[3-sgd]"],
        says=["padding dropped"],
    ),
    Mistake(
        "NextInForwardOrderAlways",
        replaces="FullyShardedModule",
        fails=[_AHEAD],
        says=["self._order['backward']", "not the forward's"],
    ),
    Mistake(
        "NextIsItself",
        replaces="FullyShardedModule",
        fails=[_AHEAD],
        says=["not launched ahead", "_next_unit"],
    ),
    Mistake(
        "PrefetchBlocks",
        replaces="FullyShardedModule",
        fails=[_AHEAD],
        says=["not launched ahead", "async_op=True"],
    ),
    Mistake(
        "PrefetchWaitsAtOnce",
        replaces="FullyShardedModule",
        fails=[_AHEAD],
        says=["waited for it at once", "nothing overlapped"],
    ),
    Mistake(
        "NeverWaited",
        replaces="FullyShardedModule",
        # fails as the gather is seen unfinished or, if it lands mid-forward, through autograd
        fails=[_AHEAD],
        says=["never waited for it", "work.wait()"],
    ),
    Mistake(
        "WaitLeavesPending",
        replaces="FullyShardedModule",
        fails=[_AHEAD],
        says=["_wait must clear it"],
    ),
    Mistake(
        "PrefetchOnTheWorld",
        replaces="FullyShardedModule",
        fails=["test_prefetch_in_a_subgroup"],
        says=["the prefetched gathers too"],
    ),
    Mistake(
        "PrefetchIgnoresKept",
        replaces="FullyShardedModule",
        fails=[_KEEP],
        says=["_prefetch launches nothing for a unit gathered already"],
    ),
    Mistake(
        "KeepFrees",
        replaces="FullyShardedModule",
        fails=[_KEEP],
        says=["_keep leaves each unit's full vector gathered"],
    ),
    Mistake(
        "KeepLeavesAttributes",
        replaces="FullyShardedModule",
        fails=[_KEEP],
        says=["_keep sets the modules' attributes back to None"],
    ),
]

RIGHT_ANSWERS = [
    RightAnswer("padded_with_pad", replaces="shard_of"),
    RightAnswer("gathered_as_a_list", replaces="gather_shard"),
    RightAnswer("DividedBeforeTheReduceScatter", replaces="AllGatherShard", steps=(3, 4, 5, 6)),
    RightAnswer("NoteAsADict", replaces="FullyShardedModule", steps=(4, 5, 6)),
    RightAnswer("FlatAveraged", replaces="FullyShardedModule", steps=(5,)),
    RightAnswer("NextByIndex", replaces="FullyShardedModule", steps=(6,)),
    RightAnswer("PrefetchAsAList", replaces="FullyShardedModule", steps=(6,)),
]
