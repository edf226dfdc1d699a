"""k31's mistakes catalogue: real mistakes in mixed precision across ranks (the loss scale and its
verdict, the fp32 masters, the reduction's dtype, FSDP's gather and reduce-scatter), and right
answers written another way. See ``dojo/dev/mistakes/__init__.py`` for what each list promises."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from dojo.dev.mistakes import Mistake, RightAnswer
from solutions import k31_mixed_precision as reference

# --------------------------------------------------------------------------- LossScaler


def _grads(optimizer):
    return [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]


class ScalerWithoutAgreement(reference.LossScaler):
    """Each rank looks at its own gradients only: under FSDP their shards differ."""

    def unscale_(self, optimizer):
        found = False
        for grad in _grads(optimizer):
            grad.mul_(1.0 / self.loss_scale)
            found = found or not bool(grad.isfinite().all())
        self.found_inf = found
        return found


class ScalerAgreesOnlyWhenFound(reference.LossScaler):
    """Tells the others only when there is something to tell: a collective only some ranks make."""

    def unscale_(self, optimizer):
        found = torch.zeros(1)
        for grad in _grads(optimizer):
            grad.mul_(1.0 / self.loss_scale)
            found = torch.maximum(found, (~grad.isfinite()).any().float())
        if found.item():
            dist.all_reduce(found, op=dist.ReduceOp.MAX, group=self.process_group)
        self.found_inf = bool(found.item())
        return self.found_inf


class ScalerOnTheWorld(reference.LossScaler):
    """The verdict agreed over the world, whatever group the scaler was given."""

    def unscale_(self, optimizer):
        found = torch.zeros(1)
        for grad in _grads(optimizer):
            grad.mul_(1.0 / self.loss_scale)
            found = torch.maximum(found, (~grad.isfinite()).any().float())
        dist.all_reduce(found, op=dist.ReduceOp.MAX)
        self.found_inf = bool(found.item())
        return self.found_inf


class ScalerSeesOnlyInf(reference.LossScaler):
    """torch.isinf: a nan is not an inf, and slips through."""

    def unscale_(self, optimizer):
        found = torch.zeros(1)
        for grad in _grads(optimizer):
            grad.mul_(1.0 / self.loss_scale)
            found = torch.maximum(found, grad.isinf().any().float())
        dist.all_reduce(found, op=dist.ReduceOp.MAX, group=self.process_group)
        self.found_inf = bool(found.item())
        return self.found_inf


class ScalerNeverBacksOff(reference.LossScaler):
    def update(self):
        if not self.found_inf:
            self.growth_tracker += 1
            if self.growth_tracker == self.growth_interval:
                self.loss_scale *= self.growth_factor
                self.growth_tracker = 0
        self.found_inf = None


class ScalerGrowsLate(reference.LossScaler):
    """Counts to growth_interval, then grows on the step after."""

    def update(self):
        if self.found_inf:
            self.loss_scale *= self.backoff_factor
            self.growth_tracker = 0
        else:
            self.growth_tracker += 1
            if self.growth_tracker > self.growth_interval:
                self.loss_scale *= self.growth_factor
                self.growth_tracker = 0
        self.found_inf = None


class ScalerKeepsCounting(reference.LossScaler):
    """An overflow halves the scale but leaves the count of good steps as it was."""

    def update(self):
        if self.found_inf:
            self.loss_scale *= self.backoff_factor
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.growth_interval:
                self.loss_scale *= self.growth_factor
                self.growth_tracker = 0
        self.found_inf = None


class ScalerUnscalesInStep(reference.LossScaler):
    """step() unscales whatever happened before: twice after an explicit unscale_ (to clip)."""

    def step(self, optimizer):
        found = self.found_inf
        for grad in _grads(optimizer):
            grad.mul_(1.0 / self.loss_scale)
        if found is None:
            found = any(not bool(g.isfinite().all()) for g in _grads(optimizer))
            flag = torch.tensor([float(found)])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.process_group)
            self.found_inf = found = bool(flag.item())
        if found:
            return False
        optimizer.step()
        return True


class ScalerKeepsTheVerdict(reference.LossScaler):
    """update() moves the scale but the next step still carries this step's verdict."""

    def update(self):
        if self.found_inf:
            self.loss_scale *= self.backoff_factor
            self.growth_tracker = 0
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.growth_interval:
                self.loss_scale *= self.growth_factor
                self.growth_tracker = 0


class ScalerStepsWithoutUnscaling(reference.LossScaler):
    """step() trusts that unscale_ ran: without it, found_inf is None, falsy, and the step
    takes the scaled gradients."""

    def step(self, optimizer):
        if self.found_inf:
            return False
        optimizer.step()
        return True

    def update(self):
        if self.found_inf is None:
            self.found_inf = False
        super().update()


class ScalerScalesANumber(reference.LossScaler):
    def scale(self, loss):
        return loss.item() * self.loss_scale


class ScalerLikeTorchs(reference.LossScaler):
    """Right: the scale as a float32 tensor, torch's own unscaling kernel, the flags summed (as
    ShardedGradScaler does)."""

    def unscale_(self, optimizer):
        if self.found_inf is not None:
            raise RuntimeError("unscale_() was called twice in one step")
        found = torch.zeros(1)
        inverse = torch.full((1,), self.loss_scale, dtype=torch.float64).reciprocal().float()
        grads = _grads(optimizer)
        if grads:
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inverse)
        dist.all_reduce(found, group=self.process_group)  # SUM: how many ranks overflowed
        self.found_inf = found.item() > 0
        return self.found_inf


# --------------------------------------------------------------------------- masters


def cast_everything(inputs, dtype):
    return tuple(x.to(dtype) if torch.is_tensor(x) else x for x in inputs)


def cast_with_a_loop(inputs, dtype):
    """Right: a loop, torch.is_floating_point."""
    out = []
    for item in inputs:
        if isinstance(item, torch.Tensor) and torch.is_floating_point(item):
            item = item.to(dtype=dtype)
        out.append(item)
    return tuple(out)


class _Masters(reference.MasterWeights):
    """The reference's MasterWeights with one part written otherwise (the subclasses below)."""

    def _copy(self, model):
        return [
            nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad)
            for p in model.parameters()
        ]

    def __init__(self, model, compute_dtype=torch.bfloat16):
        if compute_dtype not in reference.HALF_DTYPES:
            raise ValueError(f"compute in bfloat16 or float16, not {compute_dtype}")
        self.model, self.compute_dtype = model, compute_dtype
        self.masters = self._copy(model)
        model.to(compute_dtype)


class MastersAfterTheCast(_Masters):
    def __init__(self, model, compute_dtype=torch.bfloat16):
        self.model, self.compute_dtype = model, compute_dtype
        model.to(compute_dtype)
        self.masters = [
            nn.Parameter(p.detach().float(), requires_grad=p.requires_grad)
            for p in model.parameters()
        ]


class MastersAreTheModel(_Masters):
    def _copy(self, model):
        return list(model.parameters())  # "the optimizer updates the model's own parameters"


class MastersAllTrainable(_Masters):
    def _copy(self, model):
        return [nn.Parameter(p.detach().clone()) for p in model.parameters()]


class GradientsStay16Bit(_Masters):
    def gradients_to_masters(self):
        for master, param in zip(self.masters, self.model.parameters()):
            master.grad = param.grad
            param.grad = None


class GradientsLeftOnTheModel(_Masters):
    def gradients_to_masters(self):
        for master, param in zip(self.masters, self.model.parameters()):
            master.grad = None if param.grad is None else param.grad.float()


class MastersRebindTheModel(_Masters):
    def masters_to_model(self):
        for master, param in zip(self.masters, self.model.parameters()):
            param.data = master.detach().to(self.compute_dtype)


class MastersRefreshedFromTheModel(_Masters):
    """Each step first "syncs" the masters with the model: its rounded weights."""

    def gradients_to_masters(self):
        with torch.no_grad():
            for master, param in zip(self.masters, self.model.parameters()):
                master.copy_(param)
        super().gradients_to_masters()


class MastersInOneBuffer(_Masters):
    """Right: every master a view of one flat fp32 buffer, the gradients copied with torch's
    foreach ops."""

    def _copy(self, model):
        params = list(model.parameters())
        flat = torch.cat([p.detach().reshape(-1) for p in params]).float()
        masters, offset = [], 0
        for param in params:
            view = flat[offset : offset + param.numel()].view_as(param)
            masters.append(nn.Parameter(view, requires_grad=param.requires_grad))
            offset += param.numel()
        return masters

    def masters_to_model(self):
        with torch.no_grad():
            torch._foreach_copy_(list(self.model.parameters()), self.masters)


# --------------------------------------------------------------------------- reduce_gradients


class _Reduce(_Masters):
    def _reduce(self, reduce_dtype, group, *, cast=True, divide=True, world=False,
                worlds_size=False, back=False, check=True, drop=True):  # fmt: skip
        if check:
            reference.check_reduce_dtype(reduce_dtype, group)
        params = [p for p in self.model.parameters() if p.grad is not None]
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        if cast:
            flat = flat.to(reduce_dtype)
        dist.all_reduce(flat, group=None if world else group)
        flat = flat.float()
        if divide:
            flat /= dist.get_world_size(None if worlds_size else group)
        if back:
            flat = flat.to(self.compute_dtype).float()
        offset = 0
        for master, param in zip(self.masters, self.model.parameters()):
            if param.grad is None:
                master.grad = None
                continue
            master.grad = flat[offset : offset + param.numel()].view_as(master).clone()
            offset += param.numel()
            if drop:
                param.grad = None


class ReducedInTheModelsDtype(_Reduce):
    def reduce_gradients(self, reduce_dtype=torch.float32, process_group=None):
        self._reduce(reduce_dtype, process_group, cast=False)


class ReducedNotDivided(_Reduce):
    def reduce_gradients(self, reduce_dtype=torch.float32, process_group=None):
        self._reduce(reduce_dtype, process_group, divide=False)


class ReducedAndRoundedBack(_Reduce):
    """The mean cast back to the model's dtype "to match the gradients"."""

    def reduce_gradients(self, reduce_dtype=torch.float32, process_group=None):
        self._reduce(reduce_dtype, process_group, back=True)


class ReducedByTheWorldsSize(_Reduce):
    def reduce_gradients(self, reduce_dtype=torch.float32, process_group=None):
        self._reduce(reduce_dtype, process_group, worlds_size=True)


class ReducedOnTheWorld(_Reduce):
    def reduce_gradients(self, reduce_dtype=torch.float32, process_group=None):
        self._reduce(reduce_dtype, process_group, world=True)


class ReducedWithoutACheck(_Reduce):
    def reduce_gradients(self, reduce_dtype=torch.float32, process_group=None):
        self._reduce(reduce_dtype, process_group, check=False)


class ReducedKeepingTheModelsGrads(_Reduce):
    def reduce_gradients(self, reduce_dtype=torch.float32, process_group=None):
        self._reduce(reduce_dtype, process_group, drop=False)


class ReducedTensorByTensor(_Masters):
    """Right: one all-reduce a gradient, each divided first (as DDP does: halving is exact)."""

    def reduce_gradients(self, reduce_dtype=torch.float32, process_group=None):
        reference.check_reduce_dtype(reduce_dtype, process_group)
        size = dist.get_world_size(process_group)
        for master, param in zip(self.masters, self.model.parameters()):
            if param.grad is None:
                master.grad = None
                continue
            travelling = param.grad.to(reduce_dtype) / size
            dist.all_reduce(travelling, group=process_group)
            master.grad = travelling.float()
            param.grad = None


# --------------------------------------------------------------------------- gather_in


def gather_then_cast(shard, param_dtype, group=None):
    piece = shard.detach()
    full = torch.empty(piece.numel() * dist.get_world_size(group), dtype=piece.dtype)
    reference.all_gather_flat(full, piece, group)
    return full.to(param_dtype)


def gather_casting_the_shard(shard, param_dtype, group=None):
    """Casts the shard itself, "to save memory": the fp32 master is gone."""
    shard.data = shard.data.to(param_dtype)
    full = torch.empty(shard.numel() * dist.get_world_size(group), dtype=param_dtype)
    reference.all_gather_flat(full, shard.detach(), group)
    return full


def gather_into_a_list(shard, param_dtype, group=None):
    """Right: dist.all_gather into a list, then one cat."""
    piece = shard.detach().to(param_dtype)
    pieces = [torch.empty_like(piece) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, piece, group=group)
    return torch.cat(pieces)


# --------------------------------------------------------------------------- reduce_scatter_in


def _scatter(grad_full, reduce_dtype, shard_dtype, group=None, *, cast=True, divide=True,
             back=True, first=False):  # fmt: skip
    size = dist.get_world_size(group)
    full = grad_full / size if first else grad_full
    full = (full.to(reduce_dtype) if cast else full).contiguous()
    piece = torch.empty(full.numel() // size, dtype=full.dtype)
    reference.reduce_scatter_flat(piece, full, group)
    if divide and not first:
        piece /= size
    return piece.to(shard_dtype) if back else piece


def scatter_in_16_bits(grad_full, reduce_dtype, shard_dtype, group=None):
    return _scatter(grad_full, reduce_dtype, shard_dtype, group, cast=False)


def scatter_not_divided(grad_full, reduce_dtype, shard_dtype, group=None):
    return _scatter(grad_full, reduce_dtype, shard_dtype, group, divide=False)


def scatter_in_the_reduce_dtype(grad_full, reduce_dtype, shard_dtype, group=None):
    return _scatter(grad_full, reduce_dtype, shard_dtype, group, back=False)


def scatter_divided_first_in_16_bits(grad_full, reduce_dtype, shard_dtype, group=None):
    """k30's habit (divide before the sum), but here the division rounds in bf16."""
    return _scatter(grad_full, reduce_dtype, shard_dtype, group, first=True)


def scatter_with_avg(grad_full, reduce_dtype, shard_dtype, group=None):
    """Right: the collective averages (ReduceOp.AVG), as fully_shard asks it to."""
    size = dist.get_world_size(group)
    full = grad_full.to(reduce_dtype)
    piece = torch.empty(full.numel() // size, dtype=reduce_dtype)
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    scatter(piece, full, op=dist.ReduceOp.AVG, group=group)
    return piece.to(shard_dtype)


_SCALE = "test_loss_scaler_against_torchs_grad_scaler"
_HALVE = f"{_SCALE}[halve and double]"
_SHARDED = "test_one_ranks_overflow_skips_every_ranks_step"
_GROUP = "test_the_verdict_is_agreed_over_the_scalers_group_only"
_COPIES = "test_master_weights_are_fp32_copies_of_a_16_bit_model"
_GRADS = "test_gradients_go_to_the_masters_and_the_step_comes_back"
_SMALL = "test_masters_keep_updates_too_small_for_bf16"
_FP32 = "test_reduce_gradients_in_fp32_like_fully_shard"
_SUBGROUP = "test_reduce_gradients_on_a_subgroup"
_REFUSE = "test_reduce_gradients_refuses_dtypes_the_backend_cannot_sum"
_GATHER = "test_gather_in_casts_the_shard_before_the_all_gather"
_SCATTER = "test_reduce_scatter_in_sums_in_the_reduce_dtype"

MISTAKES = [
    Mistake(
        "ScalerScalesANumber",
        replaces="LossScaler",
        fails=["test_scale_multiplies_the_loss_in_its_own_dtype"],
        says=["returned a float", "return a tensor"],
    ),
    Mistake(
        "ScalerSeesOnlyInf",
        replaces="LossScaler",
        fails=[_HALVE],
        says=["a gradient was nan, and your step() still stepped", "a nan counts too"],
    ),
    Mistake(
        "ScalerNeverBacksOff",
        replaces="LossScaler",
        fails=[_SCALE],
        says=["your scale is 16, torch's GradScaler's 8", "multiplied by backoff_factor"],
    ),
    Mistake(
        "ScalerGrowsLate",
        replaces="LossScaler",
        fails=[_HALVE],
        says=["after growth_interval (2) good steps in a row"],
    ),
    Mistake(
        "ScalerKeepsCounting",
        replaces="LossScaler",
        fails=[_HALVE],
        says=["the count of good steps starts again from 0"],
    ),
    Mistake(
        "ScalerUnscalesInStep",
        replaces="LossScaler",
        fails=[_HALVE],
        says=["divided by the scale twice", "self.found_inf is None"],
    ),
    Mistake(
        "ScalerKeepsTheVerdict",
        replaces="LossScaler",
        fails=[_HALVE],
        says=["self.found_inf is not None", "update() ends each step"],
    ),
    Mistake(
        "ScalerStepsWithoutUnscaling",
        replaces="LossScaler",
        fails=[_HALVE],
        says=["still times the scale 16", "left the gradients scaled"],
    ),
    Mistake(
        "ScalerWithoutAgreement",
        replaces="LossScaler",
        fails=[_SHARDED],
        says=["your rank 0 stepped, though rank 1 of its group found inf", "All-reduce the found"],
    ),
    Mistake(
        "ScalerAgreesOnlyWhenFound",
        replaces="LossScaler",
        fails=[_SHARDED],
        says=["All-reduce the found flag", "in every unscale_, found or not"],
    ),
    Mistake(
        "ScalerOnTheWorld",
        replaces="LossScaler",
        fails=[_GROUP],
        says=["verdict came from a rank outside its group", "not the world"],
    ),
    Mistake(
        "cast_everything",
        replaces="cast_inputs",
        fails=["test_cast_inputs_casts_floating_tensors_only"],
        says=["item 2 is torch.bfloat16, expected int64", "only floating-point tensors are cast"],
    ),
    Mistake(
        "MastersAfterTheCast",
        replaces="MasterWeights",
        fails=[_COPIES],
        says=["holds the weights rounded to", "copy the masters before casting the model"],
    ),
    Mistake(
        "MastersAreTheModel",
        replaces="MasterWeights",
        fails=[_COPIES],
        says=["masters are fp32", "into memory of their own"],
    ),
    Mistake(
        "MastersAllTrainable",
        replaces="MasterWeights",
        fails=[_COPIES],
        says=["has requires_grad=True", "a frozen layer stays frozen"],
    ),
    Mistake(
        "GradientsStay16Bit",
        replaces="MasterWeights",
        fails=[_GRADS],
        says=["a master's .grad must be fp32", "param.grad.float()"],
    ),
    Mistake(
        "GradientsLeftOnTheModel",
        replaces="MasterWeights",
        fails=[_GRADS],
        says=["still has its gradient", "set it to None"],
    ),
    Mistake(
        "MastersRebindTheModel",
        replaces="MasterWeights",
        fails=[_GRADS],
        says=["is another tensor now", "copy into the parameter in place"],
    ),
    Mistake(
        "MastersRefreshedFromTheModel",
        replaces="MasterWeights",
        fails=[_SMALL],
        says=["must accumulate in the fp32 master", "refreshed from the model's rounded weights"],
    ),
    Mistake(
        "ReducedInTheModelsDtype",
        replaces="MasterWeights",
        fails=[_FP32],
        says=["carried ['bfloat16'], expected float32 only", "cast the gradients to reduce_dtype"],
    ),
    Mistake(
        "ReducedNotDivided",
        replaces="MasterWeights",
        fails=[_FP32],
        says=["got the sum of the 2 ranks' gradients", "divides it by the group's size"],
    ),
    Mistake(
        "ReducedAndRoundedBack",
        replaces="MasterWeights",
        fails=[_FP32],
        says=["the fp32 mean rounded to bfloat16"],
    ),
    Mistake(
        "ReducedByTheWorldsSize",
        replaces="MasterWeights",
        fails=[_SUBGROUP],
        says=["divided the sum by 3, the world's size"],
    ),
    Mistake(
        "ReducedOnTheWorld",
        replaces="MasterWeights",
        fails=[_SUBGROUP],
        says=["outside their group, never makes", "all-reduce on process_group"],
    ),
    Mistake(
        "ReducedWithoutACheck",
        replaces="MasterWeights",
        fails=[_REFUSE],
        says=["tried to all-reduce before refusing", "Check reduce_dtype first"],
    ),
    Mistake(
        "ReducedKeepingTheModelsGrads",
        replaces="MasterWeights",
        fails=[_FP32],
        says=["model still has", "set them to None"],
    ),
    Mistake(
        "gather_then_cast",
        replaces="gather_in",
        fails=[_GATHER],
        says=["all-gather carried ['float32']", "BEFORE the all-gather"],
    ),
    Mistake(
        "gather_casting_the_shard",
        replaces="gather_in",
        fails=[_GATHER],
        says=["shard changed: it is the fp32 master", "cast a copy"],
    ),
    Mistake(
        "scatter_in_16_bits",
        replaces="reduce_scatter_in",
        fails=[_SCATTER],
        says=["carried ['bfloat16'], expected float32", "BEFORE the reduce-scatter"],
    ),
    Mistake(
        "scatter_not_divided",
        replaces="reduce_scatter_in",
        fails=[_SCATTER],
        says=["returned the sum over the 3 ranks", "divided by the group's size"],
    ),
    Mistake(
        "scatter_in_the_reduce_dtype",
        replaces="reduce_scatter_in",
        fails=[_SCATTER],
        says=["returned a bfloat16 piece", "expected float32 (shard_dtype)"],
    ),
    Mistake(
        "scatter_divided_first_in_16_bits",
        replaces="reduce_scatter_in",
        fails=[_SCATTER],
        says=["expected the fp32 mean of its piece"],
    ),
]

RIGHT_ANSWERS = [
    RightAnswer("ScalerLikeTorchs", replaces="LossScaler"),
    RightAnswer("cast_with_a_loop", replaces="cast_inputs"),
    RightAnswer("MastersInOneBuffer", replaces="MasterWeights", steps=(2, 3)),
    RightAnswer("ReducedTensorByTensor", replaces="MasterWeights", steps=(3,)),
    RightAnswer("gather_into_a_list", replaces="gather_in"),
    RightAnswer("scatter_with_avg", replaces="reduce_scatter_in"),
]
