"""k19's mistakes catalogue: real mistakes in sharding a model (shard_of, FullyShardedModule's
sharding, the gather and its backward, the hooks, finish and the full parameters), and right
answers written another way. See ``dojo/mistakes/__init__.py`` for what each list promises.

Each FullyShardedModule entry is a subclass of the reference with one method done the way a
learner might (the catalogue swaps whole classes).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from dojo.mistakes import Mistake, RightAnswer
from solutions import k19_fsdp as reference

_Reference = reference.FullyShardedModule
ShardedLayer = reference.ShardedLayer


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


# --------------------------------------------------------------------------- _shard_layers


class _Sharding(_Reference):
    def _rank_for_shard(self):
        return self.rank

    def _shard_layers(self):
        for prefix, layer in self.module.named_modules():
            if not isinstance(layer, self.shard_types):
                continue
            own = list(layer.named_parameters(recurse=False))
            if not own:
                continue
            flat = torch.cat([p.detach().reshape(-1) for _, p in own])
            shard = nn.Parameter(reference.shard_of(flat, self._rank_for_shard(), self.world_size))
            unit = ShardedLayer(
                layer, prefix, [n for n, _ in own], [p.shape for _, p in own], flat.numel(), shard
            )
            self._remove(layer, own)
            self.units.append(unit)
            self.shards.append(shard)

    def _remove(self, layer, own):
        for name, _ in own:
            delattr(layer, name)
            setattr(layer, name, None)


class GlobalRankShard(_Sharding):
    def _rank_for_shard(self):
        return dist.get_rank()  # the rank in the whole world


class LayersKeepTheirParameters(_Sharding):
    def _remove(self, layer, own):
        pass  # "the layer still needs its weight": a full copy stays on every rank


class ShardsNotRegistered(_Sharding):
    def _shard_layers(self):
        super()._shard_layers()
        self.shards = nn.ParameterList()  # kept only in self.units: the optimizer never sees them
        self._kept = [u.shard for u in self.units]


class MasterShardsInComputeDtype(_Sharding):
    def _shard_layers(self):
        super()._shard_layers()
        if self.compute_dtype is not None:  # "keep them in the dtype we compute in"
            for unit in self.units:
                unit.shard.data = unit.shard.data.to(self.compute_dtype)


# --------------------------------------------------------------------------- the gather


class AllReduceBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, shard, group, compute_dtype):
        ctx.group, ctx.dtype = group, shard.dtype
        return reference.gather_shard(shard, group, compute_dtype)

    @staticmethod
    def backward(ctx, grad_full):
        grad = grad_full.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)  # every rank gets the whole sum
        return (grad / dist.get_world_size(ctx.group)).to(ctx.dtype), None, None


class SumNotMean(torch.autograd.Function):
    @staticmethod
    def forward(ctx, shard, group, compute_dtype):
        ctx.group, ctx.dtype = group, shard.dtype
        return reference.gather_shard(shard, group, compute_dtype)

    @staticmethod
    def backward(ctx, grad_full):
        size = dist.get_world_size(ctx.group)
        grad = torch.empty(grad_full.numel() // size, dtype=grad_full.dtype)
        reference.reduce_scatter_flat(grad, grad_full.contiguous(), ctx.group)
        return grad.to(ctx.dtype), None, None  # the sum over the ranks


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


class NeverFreed(_Reference):
    def _after_forward(self, unit, layer, args, output):
        if self.compute_dtype is not None and output.is_floating_point():
            return output.to(unit.shard.dtype)
        return None  # the layer keeps its full weights until the next forward


class GatheredOnlyInForward(_Reference):
    def _pack(self, tensor):
        return tensor  # autograd keeps the full weights until backward

    def _unpack(self, saved):
        return saved


class OutputLeftInComputeDtype(_Reference):
    def _after_forward(self, unit, layer, args, output):
        super()._after_forward(unit, layer, args, output)
        return None  # float16 flows on into the LayerNorms and the loss


class NoteAsADict(_Reference):
    """Right: the note is the layer alone; unpack gathers and views by the saved geometry."""

    def _pack(self, tensor):
        unit = self._live.get(tensor.untyped_storage().data_ptr())
        if unit is None:
            return tensor
        return {"unit": unit, "geometry": (tensor.size(), tensor.stride(), tensor.storage_offset())}

    def _unpack(self, saved):
        if isinstance(saved, dict):
            full = reference.gather_shard(
                saved["unit"].shard, self.process_group, self.compute_dtype
            )
            return torch.as_strided(full, *saved["geometry"])
        return saved


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
_GATHER = "test_the_gather_and_its_backward"
_TRAIN = "test_training_equals_one_process"

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
        fails=[_SHARDED],
        says=["still have parameters of their own", "delattr"],
    ),
    Mistake(
        "ShardsNotRegistered",
        replaces="FullyShardedModule",
        fails=[_SHARDED],
        says=["Register each shard as a parameter of the wrapper"],
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
        "cast_after_gather",
        replaces="gather_shard",
        fails=["test_compute_dtype_gathers_float16_and_keeps_fp32_masters"],
        says=["cast each shard to compute_dtype before the all-gather"],
    ),
    Mistake(
        "NeverFreed",
        replaces="FullyShardedModule",
        fails=["test_full_weights_alive_at_once_are_one_layers"],
        says=["more than the largest layer's", "must be freed after use"],
    ),
    Mistake(
        "GatheredOnlyInForward",
        replaces="FullyShardedModule",
        fails=[
            "test_one_gather_per_layer_in_forward_and_again_in_backward",
            "test_full_weights_alive_at_once_are_one_layers",
        ],
        says=["_pack"],
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
        fails=[f"{_TRAIN}[2-sgd]"],
        says=["a replicated parameter", "divide by the group's size"],
    ),
    Mistake(
        "ReplicatedForgotten",
        replaces="FullyShardedModule",
        fails=[f"{_TRAIN}[2-sgd]", "test_training_in_a_subgroup"],
        says=["finish_gradient_synchronization() must all-reduce its gradient"],
    ),
    Mistake(
        "NamesWithThePrefix",
        replaces="FullyShardedModule",
        fails=[f"{_TRAIN}[2-sgd]"],
        says=["no wrapper prefix"],
    ),
    Mistake(
        "PaddingKept",
        replaces="FullyShardedModule",
        fails=[f"{_TRAIN}[3-sgd]"],
        says=["padding dropped"],
    ),
]

RIGHT_ANSWERS = [
    RightAnswer("padded_with_pad", replaces="shard_of"),
    RightAnswer("gathered_as_a_list", replaces="gather_shard"),
    RightAnswer("NoteAsADict", replaces="FullyShardedModule", steps=(4, 5)),
    RightAnswer("FlatAveraged", replaces="FullyShardedModule", steps=(5,)),
]
