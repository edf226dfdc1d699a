"""k31 · Mixed precision across ranks: bf16 and fp16 compute, fp32 masters, the reduction's dtype.

THE IDEA
    A matrix product in bf16 or fp16 moves half the bytes of fp32 and, on a GPU's tensor cores,
    runs several times faster. But 16 bits keep few digits: bf16 has fp32's range and 8 bits of
    mantissa (2-3 decimal digits), fp16 has 11 bits (3 digits) and stops at 65504. Training
    entirely in 16 bits loses small updates (w - lr * g rounds back to w) and, in fp16, small
    gradients underflow to zero. Mixed precision keeps each thing in the dtype it needs:

        what                         dtype          why
        weights used by forward      bf16 / fp16    the compute, the bytes gathered
        activations, their grads     bf16 / fp16    the memory that grows with the batch
        master weights (the step)    fp32           lr * g is far below a 16-bit weight's ulp
        optimizer state (m, v)       fp32           the same, and v is a square: fp16 overflows
        the gradients' reduction     fp32           a sum over N ranks rounds at every add

          forward and backward in bf16             the step in fp32
        +------------------------------+       +-------------------------------------------+
        | bf16 weights --> loss         |  -->  | grads cast to fp32 (reduced in fp32)      |
        | bf16 grads  <--  backward     |       | master (fp32) -= lr * update(m, v, grad)  |
        +------------------------------+       +-------------------------------------------+
                      ^                                              |
                      +------------ the masters rounded to bf16 <----+

    fp16 needs one thing more: a LOSS SCALE. A gradient of 1e-8 is 0 in fp16 (its smallest
    number is 6e-8); multiply the loss by S and every gradient is S times larger, inside fp16's
    range. Before the step, divide them by S again (in fp32, on the masters). Too large an S
    overflows: some gradient becomes inf (or nan). Then the step is SKIPPED (the weights stay),
    S is halved (backoff_factor 0.5), and after growth_interval steps in a row without an
    overflow S doubles (growth_factor 2): the scale finds the largest value that does not
    overflow, and keeps probing above it. The program, fp16 on 2 ranks, growth_interval 2:

        step   scale      what happened
        1      1048576    inf in a gradient: skipped, the scale halved
        2      524288     inf again: skipped, halved
        3      262144     stepped (1 good step)
        4      262144     stepped (2 good steps = growth_interval: the scale doubles)
        5      524288     inf: skipped, halved

    bf16 has fp32's range: it needs no scale.

    ACROSS RANKS each of these has a collective to get right:
      * the inf check. Under ZeRO or FSDP each rank unscales only its shard of the gradients:
        one rank may see an inf that the others do not. If it alone skipped, the ranks' weights
        would part for ever. So the verdict is all-reduced over the group (MAX; torch's
        ShardedGradScaler sums the flags): one rank's overflow skips every rank's step.
      * the reduction's dtype. All-reducing bf16 gradients rounds every partial sum to 8 bits
        of mantissa, and the error grows with the ranks. Reducing in fp32 costs twice bf16's
        bytes (plain fp32 training's bytes) and loses nothing measurable: 2 ranks' bf16 values
        add exactly in fp32. The program, the TinyTransformer's gradients: bf16's mean is off
        by 3.2e-3 (2 ranks) and 3.7e-3 (4 ranks) of the largest gradient, fp32's by 0.
      * FSDP. What travels is a unit's weights (all-gather) and its gradient (reduce-scatter).
        Cast the fp32 shard to bf16 BEFORE the all-gather (half the bytes), and the bf16
        gradient to fp32 BEFORE the reduce-scatter; the mean lands in the fp32 shard, which is
        the master: FSDP needs no master copy of its own, the shard is one.

        shard (fp32, 1/N) --cast--> bf16 --all-gather--> full bf16 --> forward, backward
        shard.grad (fp32) <--/ N-- reduce-scatter in fp32 <--cast-- full gradient (bf16)

    fully_shard shards each parameter on its first dimension, padded to a multiple of N; one
    flat vector a unit pads once. On 2 ranks the bytes are the same; on 3 the program measures
    16,602 bytes gathered a step by fully_shard and 15,306 by MixedPrecisionFSDP, and the same
    weights after training, bitwise.

    Memory per parameter (the ZeRO paper's count, Adam): bf16 weights 2 + bf16 gradients 2 +
    fp32 master, m and v 12 = 16 bytes, as many as fp32 training's (4 + 4 + 8): mixed precision
    saves activations, compute and bytes on the wire, not the weights' memory. Sharding does:

        what torch offers                kept a parameter    travels a parameter  chosen when
                                         (Adam, N ranks)     and step
        -------------------------------  ------------------  -------------------  -------------
        fp32 DDP                         16                  all-reduce 4 B       small models
        torch.autocast(bf16) + DDP       16 (fp32 weights,   all-reduce 4 B       the easy
                                         each op casts)                           first step
        autocast(fp16) + amp.GradScaler  16, and a scale     all-reduce 4 B       GPUs without
                                                                                  bf16 (V100)
        16-bit weights + fp32 masters    16 (2 + 2 + 12)     all-reduce 2 or 4 B  Megatron,
        (MasterWeights, steps 2-3)                           (the reduce dtype)   DeepSpeed
        fully_shard(mp_policy=Mixed-     16 / N (+ 2 for a   gather 2 B, reduce-  models that
        PrecisionPolicy(bf16, fp32))     gathered unit)      scatter 4 B          fit no device
        + ShardedGradScaler for fp16     the same            + one all-reduce     fp16 FSDP
                                                             of the inf flag

    Speed: on a GPU, tensor cores run 16-bit products several times faster than fp32's. On
    this machine's CPU (one thread, the TinyTransformer at width 128, a step's forward and
    backward) fp32 took 35 ms, bf16 30 ms, fp16 49 ms: measure where you train.

STEPS
    1. ``LossScaler``: ``scale`` the loss; ``unscale_`` the gradients (divide by the scale,
       look for inf and nan, the verdict agreed over the group); ``step`` (or skip it);
       ``update`` (back off, or grow after ``growth_interval`` good steps), as
       ``torch.amp.GradScaler`` does.
    2. ``cast_inputs`` and ``MasterWeights``: fp32 masters of a model that computes in bf16 or
       fp16 (its forward casts the inputs), ``gradients_to_masters`` and ``masters_to_model``
       around the optimizer's step.
    3. ``MasterWeights.reduce_gradients``: the model's gradients averaged over the group in
       ``reduce_dtype``, landing in the fp32 masters; a dtype the backend cannot sum refused.
    4. ``gather_in`` and ``reduce_scatter_in``: FSDP's two collectives in their policy's
       dtypes. ``MixedPrecisionFSDP`` below them is k19's FSDP, written for you, made to use
       them (a unit per block and the model's own, no prefetch, each unit's gathered weights
       kept until its backward).

WHAT THE TESTS CHECK
    ``scale`` keeps the loss's dtype; ``LossScaler`` against ``torch.amp.GradScaler`` on one
    rank (two settings, inf, -inf and nan gradients, ``unscale_`` before ``step`` or not) and
    against ``ShardedGradScaler`` on 2 ranks where one rank alone overflows, and on a group
    [1, 2] of 3 ranks while rank 0 overflows on a group of its own: the scale after every step,
    the verdict, the skipped steps, the gradients and the weights, bitwise. ``cast_inputs``
    casts floating tensors only; ``MasterWeights``: the model bf16 (fp16), the masters fp32
    copies with memory of their own, the gradients moved to fp32, the model's tensors kept by
    ``masters_to_model``, updates too small for bf16 kept, and 3 AdamW steps (the optimizer's
    state fp32) bitwise ``fully_shard`` with ``MixedPrecisionPolicy`` on one rank.
    ``reduce_gradients``: the all-reduces' dtypes and bytes, the masters' gradients bitwise
    those of ``fully_shard`` (fp32) and of DDP on the bf16 model (bf16) on 2 ranks, the mean
    over a subgroup, bf16's error measured against the exact mean on 4 ranks, float8 and int32
    refused before anything is sent. ``gather_in`` and ``reduce_scatter_in`` on 3 ranks: the
    dtypes carried, the values, the mean. ``MixedPrecisionFSDP``: the bytes and dtypes of every
    collective equal to ``fully_shard``'s, shards, gradients and Adam state fp32, 3 AdamW steps
    bitwise ``fully_shard(mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
    reduce_dtype=torch.float32))`` on the same 2 ranks; in fp16 with your ``LossScaler``,
    bitwise ``fully_shard`` with ``ShardedGradScaler`` (skipped steps included); on a GPU: NCCL;
    the program.

RUN IT
    .venv/bin/python -m katas.k31_mixed_precision --world-size 2 --steps 8
    .venv/bin/python -m katas.k31_mixed_precision --world-size 4 --init-scale 65536
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import math

import torch
import torch.distributed as dist
from torch import nn

from dojo.console import run_program, say, verdict
from dojo.devices import rank_device
from dojo.launch import add_launch_arguments, launch_world
from dojo.toy_models import Block, TinyTransformer, make_tokens, make_transformer, transformer_loss

from .k19_fsdp import all_gather_flat, owner_of, reduce_scatter_flat

HALF_DTYPES = (torch.float16, torch.bfloat16)  # what a model computes in here
# What gloo and NCCL both sum (gloo refuses float8 with "Invalid scalar type"; an integer sum of
# gradients is no mean)
REDUCE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_reduce_dtype(reduce_dtype: object, group=None) -> None:
    """A ValueError unless the group's backend can sum gradients in ``reduce_dtype``."""
    if reduce_dtype not in REDUCE_DTYPES:
        backend = dist.get_backend(group) if dist.is_initialized() else "the backend"
        raise ValueError(
            f"cannot reduce gradients in {reduce_dtype}: reduce_dtype must be one of "
            f"{', '.join(map(str, REDUCE_DTYPES))}, the floating dtypes {backend} sums (float8 "
            "it refuses; an integer sum would truncate the gradients). Reduce in torch.float32 "
            "(exact for two ranks' 16-bit gradients, 4 bytes a value) or torch.bfloat16 (2 "
            "bytes, rounded)"
        )


# --------------------------------------------------------------------------- step 1: the loss scale


class LossScaler:
    """fp16's loss scale, kept as ``torch.amp.GradScaler`` keeps it, agreed over a group.

    ``scaler.scale(loss).backward(); scaler.unscale_(optimizer)`` (optional: to clip);
    ``scaler.step(optimizer)`` (skipped on inf or nan anywhere in the group);
    ``scaler.update()``. ``loss_scale`` is the scale, ``growth_tracker`` the good steps in a
    row since it last changed, ``found_inf`` this step's verdict (None before ``unscale_``)."""

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        process_group: dist.ProcessGroup | None = None,
    ):
        for name, value, good, rule in (
            ("init_scale", init_scale, lambda v: v > 0 and math.isfinite(v), "above 0"),
            ("growth_factor", growth_factor, lambda v: v > 1 and math.isfinite(v), "above 1"),
            ("backoff_factor", backoff_factor, lambda v: 0 < v < 1, "between 0 and 1"),
        ):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not good(value):
                raise ValueError(
                    f"LossScaler's {name} must be a number {rule}, got {value!r} (torch's "
                    "GradScaler defaults: init_scale 65536, growth_factor 2, backoff_factor 0.5)"
                )
        if isinstance(growth_interval, bool) or not isinstance(growth_interval, int):
            raise ValueError(
                f"growth_interval must be an int of at least 1, got {growth_interval!r}"
            )
        if growth_interval < 1:
            raise ValueError(f"growth_interval must be at least 1, got {growth_interval}")
        self.loss_scale = float(init_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = growth_interval
        self.process_group = process_group
        self.growth_tracker = 0
        self.found_inf: bool | None = None

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` multiplied by the scale (its dtype kept): what backward starts from."""
        # BEGIN STEP 1: the loss scale: scale, unscale, skip, back off, grow
        # TODO: loss times the current scale (self.loss_scale), in loss's own dtype.
        return loss * self.loss_scale
        # END STEP 1

    def unscale_(self, optimizer: torch.optim.Optimizer) -> bool:
        """Divide every gradient of ``optimizer``'s parameters by the scale, in place, and say
        whether any rank of the group found an inf or a nan in its own (``self.found_inf``)."""
        if self.found_inf is not None:
            raise RuntimeError(
                "unscale_() was called while this step already has its verdict (self.found_inf "
                "is not None): call it at most once a step, before step(); update() ends each "
                "step by setting self.found_inf to None"
            )
        # BEGIN STEP 1: the loss scale: scale, unscale, skip, back off, grow
        # TODO: every gradient of the optimizer's parameters (param_groups) divided by the scale
        # in place, as torch's GradScaler does (times 1 / scale: exact for its powers of two);
        # self.found_inf set, and returned: True when any rank of self.process_group found an inf
        # or a nan in any of its gradients, on every rank alike. The tests give one rank of two an
        # inf that the other does not see, and a rank outside a group [1, 2] infs of its own, and
        # hold the verdict, the gradients and the weights to torch's ShardedGradScaler's.
        found = torch.zeros(1, device=_device_of(optimizer))
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    param.grad.mul_(1.0 / self.loss_scale)
                    found = torch.maximum(found, (~param.grad.isfinite()).any().float())
        dist.all_reduce(found, op=dist.ReduceOp.MAX, group=self.process_group)  # one rank's inf
        self.found_inf = bool(found.item())
        return self.found_inf
        # END STEP 1

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """``optimizer.step()`` on unscaled gradients, unless an inf or a nan was found: then
        nothing changes. Returns whether the step was taken."""
        # BEGIN STEP 1: the loss scale: scale, unscale, skip, back off, grow
        # TODO: unscale_ first if this step has not (self.found_inf is None), then the optimizer's
        # step only when no rank found an inf or a nan; True when it stepped, False when skipped.
        if self.found_inf is None:
            self.unscale_(optimizer)
        if self.found_inf:
            return False
        optimizer.step()
        return True
        # END STEP 1

    def update(self) -> None:
        """The scale for the next step: times ``backoff_factor`` after an overflow, times
        ``growth_factor`` after ``growth_interval`` good steps in a row."""
        if self.found_inf is None:
            raise RuntimeError("update() comes after step(optimizer) (or unscale_), once a step")
        # BEGIN STEP 1: the loss scale: scale, unscale, skip, back off, grow
        # TODO: after an overflow the scale times backoff_factor and the count of good steps back
        # to 0; after a good step that count one more, and when it reaches growth_interval the scale
        # times growth_factor and the count back to 0. Then the next step starts (found_inf None).
        # The tests compare the scale after every step with torch's GradScaler's.
        if self.found_inf:
            self.loss_scale *= self.backoff_factor
            self.growth_tracker = 0
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.growth_interval:
                self.loss_scale *= self.growth_factor
                self.growth_tracker = 0
        self.found_inf = None
        # END STEP 1


def _device_of(optimizer: torch.optim.Optimizer) -> torch.device:
    """Where the optimizer's parameters live (the inf flag goes there: NCCL sends CUDA only)."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            return param.device
    return torch.device("cpu")


# --------------------------------------------------------------------------- steps 2-3: masters


def cast_inputs(inputs: tuple, dtype: torch.dtype) -> tuple:
    """``inputs`` with every floating-point tensor cast to ``dtype``, the rest as they are."""
    # BEGIN STEP 2: fp32 masters, a 16-bit model
    # TODO: the same tuple, each floating-point tensor cast to dtype (a new tensor, the input
    # left alone), everything else (token ids, None, numbers) as it is: fully_shard's
    # cast_forward_inputs. MasterWeights' forward and every unit of MixedPrecisionFSDP use it;
    # the tests give it fp32, fp16, long and bool tensors, None and numbers.
    return tuple(x.to(dtype) if torch.is_tensor(x) and x.is_floating_point() else x for x in inputs)
    # END STEP 2


class MasterWeights:
    """``model`` computing in ``compute_dtype`` (bfloat16 or float16), with an fp32 master copy
    of its parameters: give ``masters`` to the optimizer.

    ``loss_fn(mixed(inputs)).backward()``; ``mixed.gradients_to_masters()`` (one process) or
    ``mixed.reduce_gradients(reduce_dtype, group)`` (a group of ranks); ``optimizer.step()``;
    ``mixed.masters_to_model()``."""

    def __init__(self, model: nn.Module, compute_dtype: torch.dtype = torch.bfloat16):
        if compute_dtype not in HALF_DTYPES:
            raise ValueError(
                f"MasterWeights computes in torch.bfloat16 or torch.float16, not "
                f"{compute_dtype!r}: in float32 there is nothing to keep a master copy of"
            )
        wrong = [name for name, p in model.named_parameters() if p.dtype != torch.float32]
        if wrong:
            raise ValueError(
                f"MasterWeights takes a float32 model (its weights become the fp32 masters); "
                f"{wrong[0]!r} is {dict(model.named_parameters())[wrong[0]].dtype}: build the "
                "model in float32"
            )
        self.model = model
        self.compute_dtype = compute_dtype
        # BEGIN STEP 2: fp32 masters, a 16-bit model
        # TODO: self.masters: one fp32 nn.Parameter per parameter of the model (parameters()
        # order, requires_grad as the parameter's), holding its fp32 values in memory of its own;
        # the model then computes in compute_dtype (its parameters and floating buffers cast in
        # place). The tests check every dtype and value, that the masters share no memory with the
        # model, and that updates too small for bf16 are kept.
        self.masters = [
            nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad)
            for p in model.parameters()
        ]
        model.to(compute_dtype)
        # END STEP 2

    def __call__(self, *inputs):
        """The model on ``inputs``, its floating ones cast to the compute dtype first (an fp32
        input would meet 16-bit weights: torch refuses to mix them)."""
        return self.model(*cast_inputs(inputs, self.compute_dtype))

    def gradients_to_masters(self) -> None:
        """One process: each master's ``.grad`` is its model parameter's gradient in fp32; the
        model's gradients are dropped."""
        # BEGIN STEP 2: fp32 masters, a 16-bit model
        # TODO: every master's .grad the fp32 value of its model parameter's .grad (None where it
        # has none), and the model's .grad set to None (the next backward starts from nothing).
        for master, param in zip(self.masters, self.model.parameters()):
            master.grad = None if param.grad is None else param.grad.float()
            param.grad = None
        # END STEP 2

    def masters_to_model(self) -> None:
        """After the optimizer's step: the model's weights are the masters, rounded to the
        compute dtype."""
        # BEGIN STEP 2: fp32 masters, a 16-bit model
        # TODO: every model parameter holds its master's value in the compute dtype (copied in
        # place: the model's parameters stay the same tensors). The tests train 3 AdamW steps and
        # compare with fully_shard's MixedPrecisionPolicy on one rank, bitwise.
        with torch.no_grad():
            for master, param in zip(self.masters, self.model.parameters()):
                param.copy_(master)
        # END STEP 2

    def reduce_gradients(
        self,
        reduce_dtype: torch.dtype = torch.float32,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        """Each master's ``.grad`` is the mean over the group of its model parameter's gradient,
        summed in ``reduce_dtype``; the model's gradients are dropped."""
        # BEGIN STEP 3: the reduction's dtype
        # TODO: every master's .grad (fp32) the mean over process_group's ranks of its model
        # parameter's gradient, the values travelling and summed in reduce_dtype; the model's grads
        # then None. A reduce_dtype the backend cannot sum (float8, an integer: check_reduce_dtype
        # says) is a ValueError before anything is sent. The tests record the all-reduces' dtypes
        # and bytes, compare the masters' grads bitwise with fully_shard's (float32) and DDP's on
        # the bf16 model (bfloat16) on 2 ranks, and measure bf16's error on 4.
        check_reduce_dtype(reduce_dtype, process_group)
        params = [p for p in self.model.parameters() if p.grad is not None]
        flat = torch.cat([p.grad.reshape(-1).to(reduce_dtype) for p in params])
        dist.all_reduce(flat, group=process_group)  # one call: every collective costs a latency
        flat = flat.float().div_(dist.get_world_size(process_group))
        offset = 0
        for master, param in zip(self.masters, self.model.parameters()):
            if param.grad is None:
                master.grad = None
                continue
            master.grad = flat[offset : offset + param.numel()].view_as(master).clone()
            offset += param.numel()
            param.grad = None
        # END STEP 3


# --------------------------------------------------------------------------- step 4: FSDP


def gather_in(shard: torch.Tensor, param_dtype: torch.dtype, group=None) -> torch.Tensor:
    """A unit's full flat vector in ``param_dtype``: every rank's shard, in rank order, cast
    BEFORE the all-gather (what travels is ``param_dtype``); no autograd."""
    # BEGIN STEP 4: FSDP's collectives in the policy's dtypes
    # TODO: the full vector (len(shard) * the group's size, rank order) in param_dtype, from
    # one all-gather (all_gather_flat) of this rank's shard cast to param_dtype first: the
    # bytes that travel are param_dtype's. The shard (an fp32 nn.Parameter) is left as it is.
    # The tests record the all-gathers' dtypes and bytes against fully_shard's.
    piece = shard.detach().to(param_dtype)
    full = torch.empty(
        piece.numel() * dist.get_world_size(group), dtype=param_dtype, device=piece.device
    )
    all_gather_flat(full, piece, group)
    return full
    # END STEP 4


def reduce_scatter_in(
    grad_full: torch.Tensor, reduce_dtype: torch.dtype, shard_dtype: torch.dtype, group=None
) -> torch.Tensor:
    """This rank's piece of the mean over the group of ``grad_full`` (a unit's full gradient,
    in the compute dtype), cast to ``reduce_dtype`` BEFORE the reduce-scatter, returned in
    ``shard_dtype`` (the master's)."""
    # BEGIN STEP 4: FSDP's collectives in the policy's dtypes
    # TODO: piece `rank` (len(grad_full) / the group's size) of the mean over the group's ranks
    # of grad_full, from one reduce-scatter (reduce_scatter_flat) of grad_full cast to
    # reduce_dtype first, divided by the group's size, returned in shard_dtype. The tests record
    # float32 reduce-scatters under a bfloat16 compute dtype and compare the shards' gradients
    # and 3 AdamW steps with fully_shard's.
    size = dist.get_world_size(group)
    full = grad_full.to(reduce_dtype).contiguous()
    piece = torch.empty(full.numel() // size, dtype=reduce_dtype, device=full.device)
    reduce_scatter_flat(piece, full, group)
    return piece.div_(size).to(shard_dtype)
    # END STEP 4


class GatherUnit(torch.autograd.Function):
    """Forward: ``gather_in``. Backward: ``reduce_scatter_in``, into the shard's gradient."""

    @staticmethod
    def forward(ctx, shard, param_dtype, reduce_dtype, group):
        ctx.reduce_dtype, ctx.shard_dtype, ctx.group = reduce_dtype, shard.dtype, group
        return gather_in(shard, param_dtype, group)

    @staticmethod
    def backward(ctx, grad_full):
        grad = reduce_scatter_in(grad_full, ctx.reduce_dtype, ctx.shard_dtype, ctx.group)
        return grad, None, None, None


class MixedPrecisionFSDP(nn.Module):
    """k19's FSDP with a precision policy, as ``fully_shard(mp_policy=MixedPrecisionPolicy(
    param_dtype, reduce_dtype))`` does it: each unit's parameters one flat fp32 shard per rank
    (the master: train ``wrapper.parameters()``), gathered in ``param_dtype`` before the unit
    runs, its gradient reduce-scattered in ``reduce_dtype`` into the shard's ``.grad``. A unit is
    a module of ``unit_types`` and every parameter beneath it that no deeper unit took (the
    default: a unit per block, the model the rest, as ``fully_shard`` on every block and on
    the model). Every unit's floating inputs are cast to ``param_dtype``; its outputs are not
    (``output_dtype=None``). Unlike k19 there is no prefetch, and a unit's gathered weights
    live until its backward (``reshard_after_forward=False``)."""

    def __init__(
        self,
        module: nn.Module,
        param_dtype: torch.dtype = torch.bfloat16,
        reduce_dtype: torch.dtype = torch.float32,
        unit_types: tuple[type[nn.Module], ...] = (Block, TinyTransformer),
        process_group: dist.ProcessGroup | None = None,
    ):
        super().__init__()
        if param_dtype not in (*HALF_DTYPES, torch.float32):
            raise ValueError(
                f"param_dtype must be torch.bfloat16, torch.float16 or torch.float32, not "
                f"{param_dtype!r}: the dtype the gathered weights compute in"
            )
        check_reduce_dtype(reduce_dtype, process_group)
        self.module, self.param_dtype, self.reduce_dtype = module, param_dtype, reduce_dtype
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        rank = dist.get_rank(process_group)
        self.names = [name for name, _ in module.named_parameters()]
        units = {p: m for p, m in module.named_modules() if isinstance(m, unit_types)}
        taken: dict[str, list[tuple[str, nn.Parameter]]] = {prefix: [] for prefix in units}
        for name, param in module.named_parameters():
            path = name.rpartition(".")[0]
            above = [p for p in units if p == "" or path == p or path.startswith(p + ".")]
            if above:  # the deepest unit above the parameter takes it
                taken[max(above, key=len)].append((name, param))
        self.units: list[dict] = []
        self.shards = nn.ParameterList()
        for prefix, unit in units.items():
            if not taken[prefix]:
                continue
            names = [name[len(prefix) + 1 :] if prefix else name for name, _ in taken[prefix]]
            flat = torch.cat([p.detach().float().reshape(-1) for _, p in taken[prefix]])
            chunk = -(-flat.numel() // self.world_size)
            padded = torch.zeros(chunk * self.world_size, dtype=flat.dtype, device=flat.device)
            padded[: flat.numel()] = flat
            shard = nn.Parameter(padded[rank * chunk : (rank + 1) * chunk].clone())
            shapes = [p.shape for _, p in taken[prefix]]
            for name in names:  # the shard holds them now
                owner, attribute = owner_of(unit, name)
                delattr(owner, attribute)
                setattr(owner, attribute, None)
            record = {"prefix": prefix, "names": names, "shapes": shapes, "shard": shard}
            self.units.append(record)
            self.shards.append(shard)
            unit.register_forward_pre_hook(functools.partial(self._before, record))
            unit.register_forward_hook(functools.partial(self._after, record))

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _before(self, unit: dict, module: nn.Module, args: tuple):
        """A unit's weights gathered (autograd: their gradient is reduce-scattered into the
        shard) and set on its modules as views; its floating inputs cast."""
        full = GatherUnit.apply(
            unit["shard"], self.param_dtype, self.reduce_dtype, self.process_group
        )
        offset = 0
        for name, shape in zip(unit["names"], unit["shapes"]):
            owner, attribute = owner_of(module, name)
            setattr(owner, attribute, full[offset : offset + shape.numel()].view(shape))
            offset += shape.numel()
        return cast_inputs(args, self.param_dtype)

    def _after(self, unit: dict, module: nn.Module, args: tuple, output) -> None:
        """The modules let go of the gathered weights (autograd keeps what backward needs)."""
        for name in unit["names"]:
            owner, attribute = owner_of(module, name)
            setattr(owner, attribute, None)

    def gather_full_params(self) -> dict[str, torch.Tensor]:
        """Every parameter, full, fp32 (the masters), keyed by the model's own names (a
        collective: every rank of the group calls it)."""
        found = {}
        for unit in self.units:
            shard = unit["shard"].detach()
            full = torch.empty(
                shard.numel() * self.world_size, dtype=shard.dtype, device=shard.device
            )
            all_gather_flat(full, shard, self.process_group)
            offset = 0
            for name, shape in zip(unit["names"], unit["shapes"]):
                key = f"{unit['prefix']}.{name}" if unit["prefix"] else name
                found[key] = full[offset : offset + shape.numel()].view(shape).clone()
                offset += shape.numel()
        return {name: found[name] for name in self.names}


# --------------------------------------------------------------------------- the program


GATHERS = ("all_gather_single", "all_gather_into_tensor", "all_gather")
SCATTERS = ("reduce_scatter_single", "reduce_scatter_tensor", "reduce_scatter")


@contextlib.contextmanager
def _watching(names: tuple[str, ...]):
    """Every call of ``torch.distributed``'s ``names`` while the block runs (fully_shard's
    too: it calls them through the module), as (name, dtype, the bytes of its largest tensor:
    an all-gather's output, a reduce-scatter's input, an all-reduce's tensor)."""
    seen, originals = [], {name: getattr(dist, name, None) for name in names}

    def watch(name, original):
        @functools.wraps(original)
        def watched(*args, **kwargs):
            tensors = [a for a in (*args, *kwargs.values()) if torch.is_tensor(a)]
            tensors += [t for a in args if isinstance(a, list) for t in a if torch.is_tensor(t)]
            biggest = max(t.numel() * t.element_size() for t in tensors)
            seen.append((name, str(tensors[0].dtype).removeprefix("torch."), biggest))
            return original(*args, **kwargs)

        return watched

    for name, original in originals.items():
        if original is not None:
            setattr(dist, name, watch(name, original))
    try:
        yield seen
    finally:
        for name, original in originals.items():
            if original is not None:
                setattr(dist, name, original)


def _moved(seen, names: tuple[str, ...]) -> tuple[list[str], int]:
    """The dtypes and the bytes that ``names``' watched calls moved."""
    calls = [(dtype, size) for name, dtype, size in seen if name in names]
    return sorted({dtype for dtype, _ in calls}), sum(size for _, size in calls)


def _fully_shard(model: nn.Module, param_dtype: torch.dtype, reduce_dtype: torch.dtype):
    """torch's own: ``fully_shard`` on every block and on the model with the same policy (and
    the same memory habit as ``MixedPrecisionFSDP``: no reshard after forward)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for block in model.blocks:
        fully_shard(block, mp_policy=policy, reshard_after_forward=False)
    return fully_shard(model, mp_policy=policy, reshard_after_forward=False)


def show_loss_scale(rank: int, world_size: int, args) -> tuple[float, list]:
    """fp16 on every rank: MasterWeights, a LossScaler, the gradients reduced in fp32. A loss of
    1.0 scaled in fp16, and each step's (scale, stepped, loss)."""
    device = rank_device()
    scaler = LossScaler(init_scale=args.init_scale, growth_interval=args.growth_interval)
    in_fp16 = scaler.scale(torch.ones((), dtype=torch.float16, device=device)).item()
    mixed = MasterWeights(make_transformer(args.seed).to(device), torch.float16)
    optimizer = torch.optim.AdamW(mixed.masters, lr=args.lr)
    log = []
    for step in range(args.steps):
        tokens, targets = (t.to(device) for t in make_tokens(4, 1000 * step + rank))
        loss = transformer_loss(mixed(tokens).float(), targets)  # the loss itself in fp32
        scale = scaler.loss_scale
        scaler.scale(loss).backward()
        mixed.reduce_gradients(torch.float32)
        stepped = scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        mixed.masters_to_model()
        log.append((scale, stepped, loss.item()))
    return in_fp16, log


def show_reduction(rank: int, world_size: int, args) -> dict:
    """The same bf16 gradients reduced in fp32 and in bf16, each held against the exact mean."""
    device = rank_device()
    mixed = MasterWeights(make_transformer(args.seed).to(device), torch.bfloat16)
    tokens, targets = (t.to(device) for t in make_tokens(4, rank))
    transformer_loss(mixed(tokens), targets).backward()
    grads = [p.grad.clone() for p in mixed.model.parameters()]
    exact = torch.cat([g.double().reshape(-1) for g in grads])
    dist.all_reduce(exact)  # float64: the sum of a few bf16 values, exactly
    exact /= world_size
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        for param, grad in zip(mixed.model.parameters(), grads):
            param.grad = grad.clone()
        with _watching(("all_reduce",)) as calls:
            mixed.reduce_gradients(dtype)
        got = torch.cat([m.grad.double().reshape(-1) for m in mixed.masters])
        error = (got - exact).abs().max().item() / exact.abs().max().item()
        out[str(dtype).removeprefix("torch.")] = (error, _moved(calls, ("all_reduce",))[1])
    return out


def show_fsdp(rank: int, world_size: int, args) -> dict:
    """MixedPrecisionFSDP and fully_shard with the same policy, trained side by side: the bytes
    each step gathers and reduce-scatters, what each rank keeps, and the largest gap."""
    import warnings

    warnings.filterwarnings("ignore", message=".*returned a view tensor")  # the logits' reshape
    device = rank_device()
    mine = MixedPrecisionFSDP(make_transformer(args.seed).to(device))
    theirs = _fully_shard(make_transformer(args.seed).to(device), torch.bfloat16, torch.float32)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=args.lr) for m in (mine, theirs)]
    sent = {}
    for step in range(args.steps):
        tokens, targets = (t.to(device) for t in make_tokens(4, 1000 * step + rank))
        for who, model, optimizer in zip(("yours", "torch"), (mine, theirs), optimizers):
            with _watching(GATHERS + SCATTERS) as calls:
                transformer_loss(model(tokens), targets).backward()
            optimizer.step()
            optimizer.zero_grad()
            sent[who] = (_moved(calls, GATHERS), _moved(calls, SCATTERS))  # the last step's
    kept = sum(
        t.numel() * t.element_size()
        for t in [
            *mine.parameters(),
            *(v for s in optimizers[0].state.values() for v in s.values()),
        ]
        if torch.is_tensor(t) and t.dim() > 0
    )
    full = mine.gather_full_params()
    gap = max(
        (full[name] - param.full_tensor()).abs().max().item()
        for name, param in theirs.named_parameters()
    )
    return {"sent": sent, "kept": kept, "gap": gap}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description="Mixed precision across ranks: the loss scale, the reduction's dtype, FSDP."
    )
    add_launch_arguments(parser, world_size=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--init-scale", type=float, default=2.0**20, help="fp16's first loss scale (2^20)"
    )
    parser.add_argument(
        "--growth-interval", type=int, default=2, help="good steps before the scale grows (2)"
    )
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    if not args.init_scale > 0 or args.growth_interval < 1:
        parser.error("--init-scale must be above 0 and --growth-interval at least 1")
    launch = functools.partial(launch_world, backend=args.backend, device=args.device)
    size = args.world_size
    say(None, f"1. fp16 on {size} ranks: MasterWeights, LossScaler, gradients reduced in fp32")
    in_fp16, log = launch(show_loss_scale, size, args)[0]
    say(
        None,
        f"  an fp16 loss of 1.0 times the scale {args.init_scale:,.0f} is {in_fp16:g} (fp16 stops "
        "at 65504): the loss is taken in fp32, the model's output cast up",
    )
    say(None, f"  {'step':>4} {'scale':>10} {'loss':>7}  what happened")
    for step, (scale, stepped, loss) in enumerate(log):
        what = "stepped" if stepped else "inf or nan in a gradient: step skipped, scale halved"
        say(None, f"  {step + 1:>4} {scale:>10,.0f} {loss:>7.3f}  {what}")
    say(None, f"2. the same bf16 gradients of {size} ranks, reduced in fp32 and in bf16")
    reduced = launch(show_reduction, size, args)[0]
    for dtype, (error, sent) in reduced.items():
        say(
            None,
            f"  {dtype:<9} {sent:>7,} bytes all-reduced, largest error {error:.1e} of the "
            "largest gradient (against the exact mean)",
        )
    say(None, "3. MixedPrecisionFSDP against fully_shard(mp_policy=bf16 params, fp32 reduce)")
    results = launch(show_fsdp, size, args)
    params = sum(p.numel() for p in make_transformer(args.seed).parameters())
    for who, ((gathered, gathered_bytes), (scattered, scattered_bytes)) in results[0][
        "sent"
    ].items():
        say(
            None,
            f"  {who:<6} a step gathers {gathered_bytes:,} bytes of {'/'.join(gathered)} "
            f"weights, reduce-scatters {scattered_bytes:,} bytes of {'/'.join(scattered)} "
            "gradients",
        )
    kept = results[0]["kept"]
    say(
        None,
        f"  rank 0 keeps {kept:,} bytes of fp32 shards and Adam state: {kept / params:.1f} bytes "
        f"a parameter of {params:,} (12 / {size} ranks, and the padding)",
    )
    return verdict(
        max(r["gap"] for r in results),
        "MixedPrecisionFSDP trained like fully_shard with the same MixedPrecisionPolicy",
        "MixedPrecisionFSDP's weights differ from fully_shard's",
        tolerance=1e-6,
    )


if __name__ == "__main__":
    run_program(main)
