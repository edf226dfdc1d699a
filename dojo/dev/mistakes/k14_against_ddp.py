"""k14's mistakes catalogue: real mistakes in holding BucketedDDP against torch's DDP (the
wrapper, the shared loop, the side-by-side run) and in SyncBatchNorm (the differentiable sum,
the layer, the conversion), and right answers written another way. See
``dojo/dev/mistakes/__init__.py`` for what each list promises."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from dojo.dev.mistakes import Mistake, RightAnswer
from dojo.devices import rank_device
from dojo.toy_models import MODELS, loss, make_model
from solutions import k14_against_ddp as reference

MIB = reference.MIB
MOMENTUM = reference.MOMENTUM


def _k14():
    """The reference module, with this entry swapped in (what every test and rank sees)."""
    from dojo.harness import impl

    return impl.load_kata("k14_against_ddp")


# --------------------------------------------------------------------------- torch_ddp


def device_ids_on_cpu(module, bucket_cap_mb=25.0, process_group=None):
    # the GPU recipe everywhere: "device_ids=[rank]"
    cap = bucket_cap_mb if bucket_cap_mb is not None else 1e6
    return DistributedDataParallel(
        module, device_ids=[dist.get_rank()], bucket_cap_mb=cap, process_group=process_group
    )


def cap_not_passed(module, bucket_cap_mb=25.0, process_group=None):
    device = next(module.parameters()).device
    return DistributedDataParallel(
        module,
        device_ids=[device.index] if device.type == "cuda" else None,
        process_group=process_group,
    )


def none_passed_to_torch(module, bucket_cap_mb=25.0, process_group=None):
    device = next(module.parameters()).device
    return DistributedDataParallel(
        module,
        device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=bucket_cap_mb,  # None: torch's default, 25 MiB
        process_group=process_group,
    )


def group_not_passed(module, bucket_cap_mb=25.0, process_group=None):
    device = next(module.parameters()).device
    cap = bucket_cap_mb if bucket_cap_mb is not None else 1e6
    return DistributedDataParallel(
        module, device_ids=[device.index] if device.type == "cuda" else None, bucket_cap_mb=cap
    )


def torch_ddp_from_the_rank_device(module, bucket_cap_mb=25.0, process_group=None):
    """Right: the device from the launcher, the cap for None from the element count."""
    device = rank_device()
    if bucket_cap_mb is None:
        bucket_cap_mb = 4 * sum(p.numel() for p in module.parameters()) / MIB * 2
    return DistributedDataParallel(
        module,
        device_ids=None if device.type == "cpu" else [device],
        bucket_cap_mb=bucket_cap_mb,
        process_group=process_group,
    )


# --------------------------------------------------------------------------- train


def _train(
    wrapper,
    optimizer,
    steps,
    *,
    finish=True,
    finish_after_step=False,
    divide=True,
    zero_each_micro=False,
    zero=True,
    sync_every=False,
    sync_never=False,
    as_tensors=False,
    check=True,
):
    if check and any(len(m) == 0 for m in steps):
        raise ValueError("a step needs micro-batches")
    losses = []
    for micro_batches in steps:
        if zero:
            optimizer.zero_grad()
        total = 0.0
        for number, batch in enumerate(micro_batches, start=1):
            if zero_each_micro:
                optimizer.zero_grad()
            last = number == len(micro_batches)
            quiet = (not last or sync_never) and not sync_every
            with wrapper.no_sync() if quiet else contextlib.nullcontext():
                step_loss = loss(wrapper, batch) / (len(micro_batches) if divide else 1)
                step_loss.backward()
            total = total + (step_loss.detach() if as_tensors else step_loss.item())
        synced = isinstance(wrapper, DistributedDataParallel)
        if finish and not finish_after_step and not synced:
            wrapper.finish_gradient_synchronization()
        optimizer.step()
        if finish and finish_after_step and not synced:
            wrapper.finish_gradient_synchronization()
        losses.append(total)
    return losses


def no_finish(wrapper, optimizer, steps):
    # "DDP synchronises in backward": torch's does; BucketedDDP waits to be asked
    return _train(wrapper, optimizer, steps, finish=False)


def finish_after_step(wrapper, optimizer, steps):
    return _train(wrapper, optimizer, steps, finish_after_step=True)


def loss_not_divided(wrapper, optimizer, steps):
    return _train(wrapper, optimizer, steps, divide=False)


def zero_grad_between_micro_batches(wrapper, optimizer, steps):
    return _train(wrapper, optimizer, steps, zero=False, zero_each_micro=True)


def every_micro_batch_synced(wrapper, optimizer, steps):
    return _train(wrapper, optimizer, steps, sync_every=True)


def no_sync_on_every_micro_batch(wrapper, optimizer, steps):
    return _train(wrapper, optimizer, steps, sync_never=True)


def never_zeroes(wrapper, optimizer, steps):
    return _train(wrapper, optimizer, steps, zero=False)


def returns_tensors(wrapper, optimizer, steps):
    return _train(wrapper, optimizer, steps, as_tensors=True)


def no_empty_check(wrapper, optimizer, steps):
    return _train(wrapper, optimizer, steps, check=False)


def train_with_hasattr_and_scaled_gradients(wrapper, optimizer, steps):
    """Right: the mean over micro-batches taken on the gradients, the finish found by hasattr."""
    if not all(steps):
        raise ValueError("every step needs at least one micro-batch")
    losses = []
    for micro_batches in steps:
        optimizer.zero_grad(set_to_none=False)
        values = []
        with contextlib.ExitStack() as stack:
            stack.enter_context(wrapper.no_sync())
            for batch in micro_batches[:-1]:
                step_loss = loss(wrapper, batch)
                step_loss.backward()
                values.append(step_loss.item())
        step_loss = loss(wrapper, micro_batches[-1])
        step_loss.backward()
        values.append(step_loss.item())
        if hasattr(wrapper, "finish_gradient_synchronization"):
            wrapper.finish_gradient_synchronization()
        for param in wrapper.parameters():
            if param.grad is not None:
                param.grad /= len(micro_batches)  # exact for 1, 2 and 4 micro-batches
        optimizer.step()
        losses.append(sum(values) / len(values))
    return losses


# --------------------------------------------------------------------------- against_torch_ddp


def _against(model_name, steps, micro_batches, bucket_cap_mb, lr, seed, process_group, **how):
    k14 = _k14()
    device = rank_device()
    rank = dist.get_rank()
    shard = dist.get_rank() if how.get("world_shard") else dist.get_rank(process_group)
    data = k14.rank_batches(model_name, steps, micro_batches, seed, shard, device)
    if how.get("seeded_once"):
        torch.manual_seed(seed + rank)
        ours_model = MODELS[model_name]().to(device)
        torch_model = MODELS[model_name]().to(device)  # the generator has moved on
    else:
        ours_model = make_model(model_name, seed + rank).to(device)
        torch_model = (
            ours_model if how.get("one_model") else make_model(model_name, seed + rank).to(device)
        )
    ours = k14.BucketedDDP(ours_model, bucket_cap_mb=bucket_cap_mb, process_group=process_group)
    theirs = k14.torch_ddp(torch_model, bucket_cap_mb, process_group)
    torch_momentum = 0.0 if how.get("no_momentum") else MOMENTUM
    torch_losses = k14.train(
        theirs, torch.optim.SGD(theirs.parameters(), lr=lr, momentum=torch_momentum), data
    )
    ours_losses = k14.train(
        ours, torch.optim.SGD(ours.parameters(), lr=lr, momentum=MOMENTUM), data
    )
    return {
        "ours": k14.state_of(ours_model),
        "torch": k14.state_of(torch_model),
        "ours_losses": ours_losses,
        "torch_losses": torch_losses,
    }


def one_model_two_wrappers(
    model_name, steps=3, micro_batches=1, bucket_cap_mb=25.0, lr=0.1, seed=0, process_group=None
):
    return _against(**locals(), one_model=True)


def shard_from_world_rank(
    model_name, steps=3, micro_batches=1, bucket_cap_mb=25.0, lr=0.1, seed=0, process_group=None
):
    return _against(**locals(), world_shard=True)  # dist.get_rank(): the world's, not the group's


def torch_without_momentum(
    model_name, steps=3, micro_batches=1, bucket_cap_mb=25.0, lr=0.1, seed=0, process_group=None
):
    return _against(**locals(), no_momentum=True)  # "SGD(lr)" for the second optimizer


def seeded_once_built_twice(
    model_name, steps=3, micro_batches=1, bucket_cap_mb=25.0, lr=0.1, seed=0, process_group=None
):
    return _against(**locals(), seeded_once=True)


def torch_first(
    model_name, steps=3, micro_batches=1, bucket_cap_mb=25.0, lr=0.1, seed=0, process_group=None
):
    """Right: torch's run first, then ours (the order of the two runs does not matter)."""
    return _against(**locals())


# --------------------------------------------------------------------------- SumOverRanks


class IdentityBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, group=None):
        ctx.group = group
        total = tensor.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output, None  # "the sum's derivative is 1"


class MeanBackward(IdentityBackward):
    @staticmethod
    def backward(ctx, grad_output):
        grad = grad_output.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad / dist.get_world_size(ctx.group), None  # "average the gradients, as DDP does"


class InPlaceForward(IdentityBackward):
    @staticmethod
    def forward(ctx, tensor, group=None):
        ctx.group = group
        dist.all_reduce(tensor, group=group)  # the caller's tensor, summed in place
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad_output):
        grad = grad_output.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class BackwardOnTheWorld(IdentityBackward):
    @staticmethod
    def backward(ctx, grad_output):
        grad = grad_output.clone()
        dist.all_reduce(grad)  # the group was forward's business only
        return grad, None


class SumOverRanksTwice(torch.autograd.Function):
    """Right: a backward that is itself differentiable (it applies the same Function)."""

    @staticmethod
    def forward(ctx, tensor, group=None):
        ctx.group = group
        out = torch.empty_like(tensor).copy_(tensor)
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx, grad_output):
        return SumOverRanksTwice.apply(grad_output.contiguous(), ctx.group), None


# --------------------------------------------------------------------------- SyncBatchNorm2d


class _Norm(reference.SyncBatchNorm2d):
    """The reference forward with its pieces open to change."""

    def statistics(self, x):
        channels = x.shape[1]
        local = torch.cat(
            [
                x.sum(dim=(0, 2, 3)),
                (x * x).sum(dim=(0, 2, 3)),
                x.new_full((1,), x.numel() // channels),
            ]
        )
        total = _k14().SumOverRanks.apply(local, self.process_group)
        count = total[-1]
        mean = total[:channels] / count
        return mean, total[channels : 2 * channels] / count - mean * mean, count

    def unbiased(self, var, count):
        return var * count / (count - 1)

    def move(self, running, value, momentum):
        running.mul_(1 - momentum).add_(momentum * value)

    count_batches = True
    sync_in_eval = False

    def forward(self, x):
        if not self.training and not self.sync_in_eval:
            return F.batch_norm(
                x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps
            )
        mean, var, count = self.statistics(x)
        if self.training:
            with torch.no_grad():
                if self.count_batches:
                    self.num_batches_tracked.add_(1)
                self.move(self.running_mean, mean, self.momentum)
                self.move(self.running_var, self.unbiased(var, count), self.momentum)
        shape = (1, -1, 1, 1)
        out = (x - mean.view(shape)) / torch.sqrt(var.view(shape) + self.eps)
        return out * self.weight.view(shape) + self.bias.view(shape)


class LocalStatistics(_Norm):
    def statistics(self, x):  # BatchNorm2d's own: this rank's images only
        count = torch.tensor(float(x.numel() // x.shape[1]))
        return x.mean(dim=(0, 2, 3)), x.var(dim=(0, 2, 3), unbiased=False), count


class MeanOfMeans(_Norm):
    def statistics(self, x):
        size = dist.get_world_size(self.process_group)
        local = torch.cat([x.mean(dim=(0, 2, 3)), x.var(dim=(0, 2, 3), unbiased=False)])
        total = _k14().SumOverRanks.apply(local, self.process_group) / size  # "average them"
        channels = x.shape[1]
        count = torch.tensor(float(x.numel() // channels * size))
        return total[:channels], total[channels:], count


class NotDifferentiable(_Norm):
    def statistics(self, x):
        channels = x.shape[1]
        local = torch.cat(
            [
                x.sum(dim=(0, 2, 3)),
                (x * x).sum(dim=(0, 2, 3)),
                x.new_full((1,), x.numel() // channels),
            ]
        )
        total = local.detach().clone()
        dist.all_reduce(total, group=self.process_group)  # autograd never sees the other ranks
        total = local + (total - local.detach())  # local values keep their own gradient only
        count = total[-1]
        mean = total[:channels] / count
        return mean, total[channels : 2 * channels] / count - mean * mean, count


class BiasedRunningVar(_Norm):
    def unbiased(self, var, count):
        return var  # "the variance is the variance"


class SyncsInEval(_Norm):
    sync_in_eval = True  # eval uses the batch's statistics, over every rank


class ForgetsNumBatchesTracked(_Norm):
    count_batches = False


class MomentumBackwards(_Norm):
    def move(self, running, value, momentum):
        running.mul_(momentum).add_((1 - momentum) * value)  # "momentum keeps the old value"


class TwoPassVariance(reference.SyncBatchNorm2d):
    """Right: the mean first, then the squared deviations from it, two sums over ranks."""

    def forward(self, x):
        if not self.training:
            return F.batch_norm(
                x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps
            )
        summed = _k14().SumOverRanks
        channels = x.shape[1]
        first = summed.apply(
            torch.cat([x.sum(dim=(0, 2, 3)), x.new_full((1,), x.numel() // channels)]),
            self.process_group,
        )
        count = first[-1]
        mean = first[:channels] / count
        centred = x - mean.view(1, -1, 1, 1)
        var = summed.apply((centred * centred).sum(dim=(0, 2, 3)), self.process_group) / count
        with torch.no_grad():
            self.num_batches_tracked += 1
            m = (
                self.momentum
                if self.momentum is not None
                else 1.0 / float(self.num_batches_tracked)
            )
            self.running_mean.lerp_(mean, m)
            self.running_var.lerp_(var * count / (count - 1), m)
        out = centred / torch.sqrt(var.view(1, -1, 1, 1) + self.eps)
        return out * self.weight.view(1, -1, 1, 1) + self.bias.view(1, -1, 1, 1)


# --------------------------------------------------------------------------- convert_sync_batchnorm


def _layer(old, process_group, share=True, mode=True, settings=True, tensors=True):
    k14 = _k14()
    if settings:
        layer = k14.SyncBatchNorm2d(
            old.num_features,
            old.eps,
            old.momentum,
            old.affine,
            old.track_running_stats,
            process_group=process_group,
        )
    else:
        layer = k14.SyncBatchNorm2d(old.num_features, process_group=process_group)
    if tensors:
        if old.affine:
            if share:
                layer.weight, layer.bias = old.weight, old.bias
            else:
                layer.weight = nn.Parameter(old.weight.detach().clone())
                layer.bias = nn.Parameter(old.bias.detach().clone())
        layer.running_mean, layer.running_var = old.running_mean, old.running_var
        layer.num_batches_tracked = old.num_batches_tracked
    if mode:
        layer.train(old.training)
    return layer


def _convert(module, process_group, depth=True, **how):
    if isinstance(module, nn.BatchNorm2d) and not isinstance(module, _k14().SyncBatchNorm2d):
        return _layer(module, process_group, **how)
    for name, child in module.named_children():
        if isinstance(child, nn.BatchNorm2d) or depth:
            module.add_module(name, _convert(child, process_group, depth, **how))
    return module


def top_level_only(module, process_group=None):
    return _convert(module, process_group, depth=False)  # module.children(), one level


def fresh_layers(module, process_group=None):
    return _convert(module, process_group, tensors=False)  # "SyncBatchNorm2d(num_features)"


def copied_parameters(module, process_group=None):
    return _convert(module, process_group, share=False)


def mode_lost(module, process_group=None):
    return _convert(module, process_group, mode=False)  # a new module is in training mode


def settings_lost(module, process_group=None):
    return _convert(module, process_group, settings=False)


def convert_by_named_modules(module, process_group=None):
    """Right: find every BatchNorm2d by its dotted name and set it on its parent."""
    k14 = _k14()
    if isinstance(module, nn.BatchNorm2d) and not isinstance(module, k14.SyncBatchNorm2d):
        return _layer(module, process_group)
    targets = [
        name
        for name, m in module.named_modules()
        if isinstance(m, nn.BatchNorm2d) and not isinstance(m, k14.SyncBatchNorm2d)
    ]
    for name in targets:
        parent_name, _, child = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        setattr(parent, child, _layer(getattr(parent, child), process_group))
    return module


# --------------------------------------------------------------------------- the catalogue

_WRAP = "test_torch_ddp_wraps_the_module_as_asked"
_TRAIN = "test_train_drives_both_wrappers_like_one_process"
_AGAINST = "test_bucketed_ddp_equals_torchs_bitwise_on_two_ranks"
_BN = "test_sync_batchnorm_equals_one_batchnorm_on_the_whole_batch"
_CONVERT = "test_convert_replaces_every_batchnorm_like_torchs"

MISTAKES = [
    Mistake(
        "device_ids_on_cpu",
        replaces="torch_ddp",
        fails=[_WRAP],
        says=["device_ids names the GPU of a CUDA module", "pass device_ids=None"],
    ),
    Mistake(
        "cap_not_passed",
        replaces="torch_ddp",
        fails=[_WRAP],
        says=["expected 524288", "pass bucket_cap_mb on to DistributedDataParallel"],
    ),
    Mistake(
        "none_passed_to_torch",
        replaces="torch_ddp",
        fails=[_WRAP],
        says=["reads bucket_cap_mb=None as its default, 25 MiB", "larger than the whole model"],
    ),
    Mistake(
        "group_not_passed",
        replaces="torch_ddp",
        fails=["test_torch_ddp_on_a_subgroup"],
        says=["rank 0, outside their group, never calls", "pass process_group=process_group"],
    ),
    Mistake(
        "no_finish",
        replaces="train",
        fails=[_TRAIN],
        says=["under BucketedDDP they do not", "wrapper.finish_gradient_synchronization()"],
    ),
    Mistake(
        "finish_after_step",
        replaces="train",
        fails=[_TRAIN],
        says=["under BucketedDDP they do not", "before optimizer.step()"],
    ),
    Mistake(
        "loss_not_divided",
        replaces="train",
        fails=[f"{_TRAIN}[2]", f"{_TRAIN}[4]"],
        says=["times too large", "divide each micro-batch's loss by their number"],
    ),
    Mistake(
        "zero_grad_between_micro_batches",
        replaces="train",
        fails=[f"{_TRAIN}[2]"],
        says=["only the last micro-batch's gradient was left", "not between micro-batches"],
    ),
    Mistake(
        "every_micro_batch_synced",
        replaces="train",
        fails=[f"{_TRAIN}[2]", f"{_TRAIN}[4]"],
        says=["the micro-batches synchronised", "inside wrapper.no_sync()"],
    ),
    Mistake(
        "no_sync_on_every_micro_batch",
        replaces="train",
        fails=[_TRAIN],
        says=["no gradient was ever averaged", "outside no_sync()"],
    ),
    Mistake(
        "never_zeroes",
        replaces="train",
        fails=[f"{_TRAIN}[1]"],
        says=["kept the gradients of all the steps before it", "optimizer.zero_grad()"],
    ),
    Mistake(
        "returns_tensors",
        replaces="train",
        fails=[f"{_TRAIN}[1]"],
        says=["['Tensor', 'Tensor', 'Tensor']", "as a float"],
    ),
    Mistake(
        "no_empty_check",
        replaces="train",
        fails=["test_train_refuses_a_step_without_micro_batches"],
        says=["must raise ValueError"],
    ),
    Mistake(
        "one_model_two_wrappers",
        replaces="against_torch_ddp",
        fails=[f"{_AGAINST}[frozen]"],
        says=["did both wrap one model?", "Build a model for each"],
    ),
    Mistake(
        "shard_from_world_rank",
        replaces="against_torch_ddp",
        fails=["test_bucketed_ddp_against_torchs_on_a_subgroup"],
        says=["its rank in the world", "dist.get_rank(process_group)"],
    ),
    Mistake(
        "torch_without_momentum",
        replaces="against_torch_ddp",
        fails=[_AGAINST],
        says=["torch's DDP differ(s) from one process", "the same optimizer"],
    ),
    Mistake(
        "seeded_once_built_twice",
        replaces="against_torch_ddp",
        fails=[_AGAINST],
        says=["torch's DDP differ(s) from one process", "the same model"],
    ),
    Mistake(
        "IdentityBackward",
        replaces="SumOverRanks",
        fails=["test_sum_over_ranks_forward_and_backward"],
        says=["its own output's gradient", "all-reduce grad_output"],
    ),
    Mistake(
        "MeanBackward",
        replaces="SumOverRanks",
        fails=["test_sum_over_ranks_forward_and_backward"],
        says=["the mean over the ranks of the outputs' gradients", "its backward is a sum too"],
    ),
    Mistake(
        "InPlaceForward",
        replaces="SumOverRanks",
        fails=["test_sum_over_ranks_forward_and_backward"],
        says=["input x in place", "tensor.clone()"],
    ),
    Mistake(
        "BackwardOnTheWorld",
        replaces="SumOverRanks",
        fails=["test_sum_over_ranks_on_a_subgroup"],
        says=["rank 0, outside their group, never calls", "ctx.group = group"],
    ),
    Mistake(
        "LocalStatistics",
        replaces="SyncBatchNorm2d",
        fails=[_BN],
        says=["normalised with its own batch's statistics", "add those up over every rank"],
    ),
    Mistake(
        "MeanOfMeans",
        replaces="SyncBatchNorm2d",
        fails=[_BN],
        says=["the mean of the ranks' means and variances", "batches of different sizes"],
    ),
    Mistake(
        "NotDifferentiable",
        replaces="SyncBatchNorm2d",
        fails=[_BN],
        says=["its input's gradient differs", "A plain dist.all_reduce is invisible to autograd"],
    ),
    Mistake(
        "BiasedRunningVar",
        replaces="SyncBatchNorm2d",
        fails=[_BN],
        says=["running_var holds the biased variance", "var * n / (n - 1)"],
    ),
    Mistake(
        "SyncsInEval",
        replaces="SyncBatchNorm2d",
        fails=["test_sync_batchnorm_in_eval_uses_running_statistics_without_communicating"],
        says=["in eval mode called", "needs no communication"],
    ),
    Mistake(
        "ForgetsNumBatchesTracked",
        replaces="SyncBatchNorm2d",
        fails=[f"{_BN}[2]"],
        says=["num_batches_tracked is 0", "count every training forward"],
    ),
    Mistake(
        "MomentumBackwards",
        replaces="SyncBatchNorm2d",
        fails=[f"{_BN}[2]", f"{_BN}[3]"],
        says=["running_mean", "running = (1 - momentum) * running + momentum"],
    ),
    Mistake(
        "top_level_only",
        replaces="convert_sync_batchnorm",
        fails=[_CONVERT],
        says=["is a BatchNorm2d, expected SyncBatchNorm2d", "at every depth"],
    ),
    Mistake(
        "fresh_layers",
        replaces="convert_sync_batchnorm",
        fails=[_CONVERT],
        says=["is not the original's", "the new layer takes the old one's"],
    ),
    Mistake(
        "copied_parameters",
        replaces="convert_sync_batchnorm",
        fails=[_CONVERT],
        says=["is a new tensor, not the original parameter", "the very same parameters"],
    ),
    Mistake(
        "mode_lost",
        replaces="convert_sync_batchnorm",
        fails=[_CONVERT],
        says=["was in eval mode", "keep the layer's mode"],
    ),
    Mistake(
        "settings_lost",
        replaces="convert_sync_batchnorm",
        fails=[_CONVERT],
        says=["made a layer with eps=1e-05", "keep the layer's"],
    ),
]

RIGHT_ANSWERS = [
    RightAnswer("torch_ddp_from_the_rank_device", replaces="torch_ddp"),
    RightAnswer("train_with_hasattr_and_scaled_gradients", replaces="train"),
    RightAnswer("torch_first", replaces="against_torch_ddp"),
    RightAnswer("SumOverRanksTwice", replaces="SumOverRanks", steps=(4, 5)),
    RightAnswer("TwoPassVariance", replaces="SyncBatchNorm2d", steps=(5, 6)),
    RightAnswer("convert_by_named_modules", replaces="convert_sync_batchnorm"),
]
