"""k33 · The numbers that must be global: the loss over every valid token, the gradient norm
over every piece.

THE IDEA
    Two numbers of every training step belong to the whole run, not to a rank: the loss it
    reports and trains on, and the gradient norm it clips by. Each rank holds only a part of
    what they are made of: its micro-batches' tokens, its shards and slices of the gradients.
    Computed from a rank's part alone they are wrong, and wrong differently on every rank.

    The loss is a mean over every valid token of the global batch (padding, label -100, is no
    token). Ranks and micro-batches hold different numbers of valid tokens, and a mean of
    means is not the mean (torchtitan #1842):

        rank 0   micro-batch 0: 12 valid tokens, loss sum 30.0     its mean 2.50
                 micro-batch 1:  3 valid tokens, loss sum 12.0     its mean 4.00
        rank 1   micro-batch 0:  5 valid tokens, loss sum 10.0     its mean 2.00
                 micro-batch 1:  0 valid tokens (all padding)      its mean 0 / 0 = nan

        the mean of the means: nan (2.83 if the nan is skipped)
        the mean:              (30 + 12 + 10) / (12 + 3 + 5) = 2.60

    So: sum the token losses (``reduction="sum"``), count the valid tokens, all-reduce the sum
    and the count together (one all-reduce of two numbers), divide once. For the gradients the
    count must be known before the first backward: all-reduce it first, then every micro-batch's
    loss is its token sum over the GLOBAL count, and the accumulated gradient is the gradient of
    the mean. That scale is applied once (torchtitan #1732: a scale applied again at every
    accumulation round shrinks the early micro-batches): not divided again by the number of
    micro-batches, and not divided again by DDP, which averages the gradients over its N ranks:
    with DDP the loss is scaled by N / count (torchtitan #2318: gradient norms that differ
    between DDP and FSDP by a constant factor), with FSDP2 ``set_gradient_divide_factor(1.0)``
    makes its reduce-scatter a sum instead.

    Under pipeline parallelism only the last stage computes a loss; the others have none to
    report (torchtitan printed -1 there, and logs rank 0 by default: #550). The reported loss
    is the last stage's token sums and counts over its data-parallel replicas, the same number
    on every rank, and counted once: every stage reads the same labels, so counting them on
    every stage counts each token once per stage.

    The gradient norm is the norm of the whole model's gradient, every element counted once.
    On a mesh of ranks each mesh dimension does one of three things to a parameter:

                      what this rank holds of it        its p-th powers over the dimension
        sharded       a part (FSDP shard, TP slice)     summed: every part once
        replicated    a copy (DDP, a TP LayerNorm)      counted once: the first copy only
        stages        nothing, or all of it (PP)        summed: each stage its own parameters

        FSDP on dp x TP on tp, 2 x 2: a column-parallel weight W (16 rows), a LayerNorm's g (16)
                        tp 0               tp 1
            dp 0    W rows 0-3         W rows 4-7          W: each rank a different part
                    g 0-7              g 0-7 (a copy)      g: a part down dp, a copy across tp
            dp 1    W rows 8-11        W rows 12-15
                    g 8-15             g 8-15 (a copy)
        |W|^2 = the four parts' squares summed; |g|^2 = |g 0-7|^2 + |g 8-15|^2, each once, not
        once per tp rank (torchtitan #596: replicated parameters counted once per rank)

    Each rank sums the p-th powers it must count (a replicated piece only on the first rank of
    every dimension it is replicated on), then one all-reduce of that one number over every
    dimension of the mesh (stages included) gives the sum on every rank: the norm is its p-th
    root. The inf-norm is the largest entry: MAX instead of SUM, and copies do no harm there.
    Clipping then scales every piece by the same factor, min(1, max_norm / (norm + 1e-6)) as
    ``clip_grad_norm_`` does: a factor from a rank's own norm would differ from rank to rank,
    and the replicas of a parameter would drift apart.

    what torch offers for it, and when a practitioner chooses it (all of it costs a few bytes:
    a scalar per all-reduce; what matters is one latency per call, and getting it right):

        what                                  reduces, on which groups          chosen for
        F.cross_entropy(ignore_index=-100,    nothing: a sum and a count, then  every run with
          reduction="sum") + all_reduce       one all-reduce of the two         padding
        clip_grad_norm_(params)               nothing: this process's tensors   one process, DDP
                                                                                (replicas equal)
        clip_grad_norm_ on DTensor grads      one all-reduce per sharded mesh   FSDP2 and TP:
          (get_total_norm, full_tensor)       dimension (a partial norm)        DTensor params
        get_total_norm + all_reduce over the  the stages' group, then the       PP (torchtitan's
          stages + clip_grads_with_norm_      factor applied locally            clip_grad_norm_)
        Megatron's "not a TP duplicate"       the model-parallel group          Megatron-LM
          filter + all_reduce                 (replicas counted on tp rank 0)

STEPS
    1. ``token_loss`` (one micro-batch's token-loss sum and valid-token count) and
       ``global_mean`` (every rank's sum over every rank's count: one all-reduce, one division).
    2. ``accumulation_step``: one optimizer step of a DDP model over this rank's micro-batches,
       the global count first, each loss scaled once; returns the global mean loss.
    3. ``pipeline_mean``: the loss of a pipeline-parallel run on every rank, from the last
       stage's sums, each token counted once.
    4. ``global_grad_norm``: the norm of the whole model's gradient from this rank's pieces,
       sharded pieces summed, replicated ones counted once, stages summed; the inf-norm by max;
       unsupported norm types refused.
    5. ``clip_grad_norm``: every rank's pieces scaled by the same factor; returns the norm.
    The plumbing is yours to use: ``Piece`` (a part of one parameter's gradient and the mesh
    dimensions it is sharded on), ``make_mesh``, ``lay_out`` (this rank's pieces of a whole
    gradient under a layout such as ``{"dp": "fsdp", "tp": "tp"}``) and ``padded_batch``.

WHAT THE TESTS CHECK
    ``token_loss`` against cross-entropy's sum (padding masked, a micro-batch of padding only
    0 and 0, not nan) and labels of another shape refused; ``global_mean`` on 3 ranks with
    uneven counts (one rank padding only) equal to one process's mean over the whole batch on
    every rank, with one all-reduce, bad counts refused before anything is sent and a batch of
    padding only refused; ``accumulation_step`` under torch's DDP on 2 ranks x 3 micro-batches
    and 3 ranks x 2 (uneven tokens, one micro-batch padding only): two steps' weights and
    losses equal one process's on the whole batch, the usual scales named (DDP's average on
    top, the micro-batch count again, a rank's own count, the raw sums, the mean of means);
    ``pipeline_mean`` on 2 stages x 2 replicas, 2 replicas x 2 stages and 2 stages: one
    process's mean on every rank, bad input refused; ``global_grad_norm`` on hand-made pieces
    of 2 x 2 meshes (an empty shard, copies, stages) and on the TinyTransformer's gradient laid
    out as FSDP x TP, DDP x TP, PP x TP, PP x FSDP and FSDP over 4 ranks, for p = 2, 1, 3 and
    inf: one process's norm on every rank, the usual mistakes named, equal to torch's
    ``get_total_norm`` on the same gradients as DTensors (with torchtitan's all-reduce over the
    stages), unsupported norm types and pieces refused before anything is sent;
    ``clip_grad_norm`` on the five layouts (and the inf-norm on PP x TP): the clipped pieces
    equal one process's ``clip_grad_norm_`` laid out the same way, scaled in place by one
    factor on every rank, small gradients left alone, the norm before clipping returned, equal
    to torch's ``clip_grads_with_norm_`` on DTensors, a max_norm that is not positive refused;
    on a GPU, NCCL and gloo on CUDA; the program.

RUN IT
    .venv/bin/python -m katas.k33_global_numbers
    .venv/bin/python -m katas.k33_global_numbers --norm-type inf --max-norm 0.1
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.nn.parallel import DistributedDataParallel

from dojo.console import run_program, say, verdict
from dojo.devices import rank_device
from dojo.launch import add_launch_arguments, launch_world
from dojo.toy_models import BLOCKS, SEQUENCE, VOCABULARY, make_transformer

from .k28_fsdp_tp import TP_PLAN

IGNORE_INDEX = -100  # a label that is padding: cross_entropy's default ignore_index
CLIP_EPSILON = 1e-6  # clip_grad_norm_'s: the factor is max_norm / (norm + 1e-6)
KINDS = ("ddp", "fsdp", "tp", "pp")  # what a mesh dimension does to the parameters (lay_out)

# --------------------------------------------------------------------------- written for you


@dataclass
class Piece:
    """This rank's part of one parameter's gradient.

    ``sharded_on`` names the mesh dimensions over which the ranks hold DIFFERENT parts of it
    (an FSDP shard, a tensor-parallel slice: the parts together are the whole). On every other
    dimension but the stages, each rank of the group holds the same values (a copy: DDP, a
    LayerNorm under TP). The stages of a pipeline hold different parameters, so a piece never
    names them: ``global_grad_norm`` is told which dimension they are."""

    name: str
    grad: torch.Tensor
    sharded_on: tuple[str, ...] = ()


def make_mesh(shape: dict[str, int]) -> DeviceMesh:
    """A DeviceMesh of the whole world, its dimensions named and sized by ``shape`` in order
    (``{"dp": 2, "tp": 2}``: rank = dp_index * 2 + tp_index), on this rank's device type."""
    return init_device_mesh(rank_device().type, tuple(shape.values()), mesh_dim_names=tuple(shape))


def stage_of(name: str, stages: int) -> int:
    """The pipeline stage holding the TinyTransformer's parameter ``name``: the embedding on
    the first, the blocks spread in order, the final norm and the output on the last."""
    if name.startswith("blocks."):
        return int(name.split(".")[1]) * stages // BLOCKS
    return 0 if name.startswith("embedding.") else stages - 1


def _split_dim(name: str, kind: str) -> int | None:
    """The dimension of parameter ``name`` that a mesh dimension of ``kind`` splits (None:
    every rank of it holds a copy): FSDP shards dim 0 of everything, TP splits the planned
    linears (column: dim 0 of weight and bias; row: dim 1 of the weight, its bias a copy)."""
    if kind == "fsdp":
        return 0
    if kind != "tp":
        return None
    layer, _, what = name.rpartition(".")
    style = next((s for planned, s in TP_PLAN.items() if layer.endswith(planned)), None)
    if style == "column":
        return 0
    return 1 if style == "row" and what == "weight" else None


def lay_out(
    grads: dict[str, torch.Tensor], mesh: DeviceMesh, layout: dict[str, str]
) -> list[Piece]:
    """This rank's pieces of the whole gradient ``grads`` (the TinyTransformer's, by parameter
    name) when each mesh dimension does what ``layout`` says (one of KINDS):

        ddp   every rank a copy                  fsdp  dim 0 of every parameter sharded
        tp    TP_PLAN's linears sliced, the rest copies
        pp    stages: this rank keeps only its stage's parameters (stage_of)

    Shards are cut as DTensor's ``Shard`` cuts them (``torch.chunk``, the mesh's dimensions in
    order; a rank past the last chunk holds an empty piece), so a piece is the local tensor of
    a DTensor with the matching placements. Copies (clones), in ``grads``' order."""
    unknown = {d: k for d, k in layout.items() if k not in KINDS}
    if unknown or set(layout) != set(mesh.mesh_dim_names or ()):
        raise ValueError(
            f"layout {layout} must name every dimension of the mesh "
            f"{mesh.mesh_dim_names} once, each one of {', '.join(KINDS)}"
        )
    pieces = []
    for name, grad in grads.items():
        here, sharded = grad, []
        for dim in mesh.mesh_dim_names:
            kind = layout[dim]
            if kind == "pp" and stage_of(name, mesh[dim].size()) != mesh.get_local_rank(dim):
                here = None
                break
            split = _split_dim(name, kind)
            if split is None:
                continue
            chunks = torch.chunk(here, mesh[dim].size(), dim=split)
            index = mesh.get_local_rank(dim)
            here = chunks[index] if index < len(chunks) else here.narrow(split, 0, 0)
            sharded.append(dim)
        if here is not None:
            pieces.append(Piece(name, here.detach().clone(), tuple(sharded)))
    return pieces


def stages_of(layout: dict[str, str]) -> str | None:
    """The mesh dimension of ``layout`` whose ranks are pipeline stages (None: none)."""
    return next((dim for dim, kind in layout.items() if kind == "pp"), None)


def padded_batch(size: int, valid: Sequence[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens, labels)``: ``size`` sequences of SEQUENCE tokens drawn from ``seed``, sequence
    i with its first ``valid[i]`` labels real and the rest IGNORE_INDEX (padding)."""
    generator = torch.Generator().manual_seed(seed)
    stream = torch.randint(0, VOCABULARY, (size, SEQUENCE + 1), generator=generator)
    tokens, labels = stream[:, :-1], stream[:, 1:].clone()
    for row, keep in enumerate(valid):
        labels[row, keep:] = IGNORE_INDEX
    return tokens, labels


# --------------------------------------------------------------------------- step 1: the loss


def token_loss(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
    """One micro-batch's ``(loss_sum, count)``: the SUM of the cross-entropy over its valid
    tokens (labels that are not IGNORE_INDEX) as a 0-d tensor that backward can go through,
    and how many valid tokens there are. ``logits`` is ``(..., vocabulary)``, ``labels`` the
    same shape without the last dimension; a ``ValueError`` when they do not fit."""
    # BEGIN STEP 1: the mean over every valid token
    # TODO: this micro-batch's sum of the cross-entropy over its valid tokens (labels that are not
    # IGNORE_INDEX: padding), a 0-d tensor backward can go through, and how many valid tokens there
    # are, as an int; a ValueError when labels' shape is not logits' without the last dimension. The
    # tests compare with cross_entropy's sum, and hold a micro-batch of padding only to (0, 0).
    if logits.dim() < 1 or logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"logits of shape {tuple(logits.shape)} and labels of shape {tuple(labels.shape)} "
            "do not fit: logits are (..., vocabulary) and labels the same without the last "
            "dimension, one label a token"
        )
    loss_sum = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]),
        labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
    return loss_sum, int((labels != IGNORE_INDEX).sum())
    # END STEP 1


def global_mean(loss_sum: torch.Tensor | float, count: int, group=None) -> float:
    """The mean over every valid token of every rank of ``group`` (None: the world): the sum
    of every rank's ``loss_sum`` over the sum of every rank's ``count``, the same float on
    every rank. A ``ValueError`` for a count below 0 (before anything is sent) or when no
    rank has a valid token."""
    # BEGIN STEP 1: the mean over every valid token
    # TODO: every rank's loss sums over every rank's valid-token counts, as a float, the same on
    # every rank: one all-reduce carries the sum and the count together. A count that is not an int
    # of at least 0 is a ValueError before anything is sent; no valid token on any rank is a
    # ValueError too. The tests give 3 ranks uneven counts (one rank 0) and compare with one
    # process's mean over the whole batch; they record the all-reduces.
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(
            f"count is the number of valid tokens behind loss_sum, an int of at least 0, not "
            f"{count!r}"
        )
    if isinstance(loss_sum, torch.Tensor):
        device, value = loss_sum.device, loss_sum.detach().double().reshape(())
    else:
        device, value = rank_device(), torch.tensor(float(loss_sum), dtype=torch.float64)
    both = torch.stack([value.to(device), torch.tensor(float(count), device=device).double()])
    dist.all_reduce(both, group=group)  # the sum and the count travel together: one latency
    total, tokens = both.tolist()
    if tokens == 0:
        raise ValueError(
            "no rank has a valid token: a batch of padding only has no mean loss; skip it"
        )
    return total / tokens
    # END STEP 1


# --------------------------------------------------------------------------- step 2: accumulation


def accumulation_step(
    ddp: DistributedDataParallel,
    optimizer: torch.optim.Optimizer,
    micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
) -> float:
    """One optimizer step of ``ddp`` (torch's DDP over its ``process_group``, which AVERAGES
    the gradients over its ranks) on this rank's ``micro_batches`` of ``(tokens, labels)``.

    Afterwards the weights are those of one process stepping on the mean loss over every valid
    token of every rank's micro-batches; the gradients are zeroed after the step. Returns that
    mean loss (before the step), the same on every rank. A ``ValueError`` without micro-batches."""
    # BEGIN STEP 2: accumulation that scales once
    # TODO: one optimizer step whose gradient is the gradient of the mean loss over every valid
    # token of every rank's micro-batches, though DDP averages the gradients over its ranks and
    # micro-batches hold uneven numbers of valid tokens (one only padding); gradients zeroed
    # after the step; returns that mean loss (global_mean), the same on every rank; a ValueError
    # when there are no micro-batches. The tests train the TinyTransformer two steps under torch's
    # DDP on 2 and 3 ranks and compare the weights and the losses with one process on the whole
    # batch.
    if not micro_batches:
        raise ValueError("accumulation_step needs at least one micro-batch of (tokens, labels)")
    group = ddp.process_group
    mine = sum(int((labels != IGNORE_INDEX).sum()) for _, labels in micro_batches)
    counted = torch.tensor([mine], dtype=torch.float64, device=micro_batches[0][0].device)
    dist.all_reduce(counted, group=group)  # known before the first backward
    total = int(counted.item())
    if total == 0:
        raise ValueError("no rank has a valid token in this step: skip the batch")
    scale = dist.get_world_size(group) / total  # DDP divides by N: the loss multiplies it back
    loss_sum, last = 0.0, len(micro_batches) - 1
    for number, (tokens, labels) in enumerate(micro_batches):
        with ddp.no_sync() if number < last else contextlib.nullcontext():
            micro_sum, _ = token_loss(ddp(tokens), labels)
            (micro_sum * scale).backward()  # the one scale: the gradients just add up
        loss_sum += micro_sum.item()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return global_mean(loss_sum, mine, group)
    # END STEP 2


# --------------------------------------------------------------------------- step 3: pipeline


def pipeline_mean(
    loss_sum: torch.Tensor | None, count: int, mesh: DeviceMesh, stages: str = "pp"
) -> float:
    """The loss a pipeline-parallel run reports, on EVERY rank of ``mesh``: the mean over every
    valid token of the batch, from the last stage's sums.

    ``stages`` names the mesh dimension of the pipeline's stages; every other dimension of the
    mesh splits the batch (data parallel). Only the last stage computes a loss: there
    ``loss_sum`` is its micro-batches' token-loss sum; on every other stage it is None. Every
    stage reads the same labels, so every rank passes its ``count`` of valid tokens. A
    ``ValueError`` (before anything is sent) when ``stages`` is not a dimension of the mesh or
    ``loss_sum`` is None on the last stage, or given on another."""
    # BEGIN STEP 3: the loss under pipeline parallelism
    # TODO: on every rank of the mesh, the mean over every valid token of the batch, from the last
    # stage's loss sums, each token counted once though every stage reads (and counts) the same
    # labels; a float, the same on every rank. A ValueError before anything is sent when stages is
    # not a dimension of the mesh, the count is not an int of at least 0, or loss_sum is None on
    # the last stage (or given on another). The
    # tests run 2 stages x 2 data-parallel replicas and 2 stages alone, and compare every rank's
    # value with one process's mean over the whole batch.
    names = mesh.mesh_dim_names or ()
    if stages not in names:
        raise ValueError(
            f"stages={stages!r} is not a dimension of the mesh {names}: name the dimension "
            "whose ranks are the pipeline's stages"
        )
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(f"count is a number of valid tokens, an int of at least 0, not {count!r}")
    last = mesh.get_local_rank(stages) == mesh[stages].size() - 1
    if last != (loss_sum is not None):
        raise ValueError(
            "only the last stage computes a loss: pass its token-loss sum there, and None on "
            f"every other stage (this rank is stage {mesh.get_local_rank(stages)} of "
            f"{mesh[stages].size()} and was given {'None' if loss_sum is None else 'a sum'})"
        )
    both = torch.zeros(2, dtype=torch.float64, device=rank_device())
    if last:  # the other stages add nothing: their counts are the last stage's tokens again
        both[0], both[1] = float(loss_sum), float(count)
    for name in names:  # the sum over the whole mesh: the replicas and the stages
        dist.all_reduce(both, group=mesh.get_group(name))
    total, tokens = both.tolist()
    if tokens == 0:
        raise ValueError("no rank has a valid token: a batch of padding only has no mean loss")
    return total / tokens
    # END STEP 3


# --------------------------------------------------------------------------- step 4: the norm


def global_grad_norm(
    pieces: Sequence[Piece],
    mesh: DeviceMesh,
    norm_type: float = 2.0,
    stages: str | None = None,
) -> torch.Tensor:
    """The ``norm_type``-norm of the whole model's gradient (every element of every parameter
    once) from this rank's ``pieces``, as ``clip_grad_norm_`` on one process would compute it:
    a 0-d tensor, the same on every rank of ``mesh``.

    ``stages`` names the mesh dimension whose ranks are pipeline stages (None: no pipeline).
    ``norm_type`` is a positive number or ``inf`` (the largest absolute entry); anything else,
    or a piece sharded on a dimension the mesh lacks (or on the stages), is a ``ValueError``
    before anything is sent."""
    # BEGIN STEP 4: the global gradient norm
    # TODO: the norm of the whole model's gradient, every element counted once, the same 0-d tensor
    # on every rank: a piece's values are a part of its parameter on the dimensions it is sharded
    # on, a copy on the others, and the stages hold different parameters. norm_type is a positive
    # number or inf (the largest absolute entry); anything else (0, negative, nan, -inf, a string, a
    # bool), a piece sharded on a dimension the mesh lacks or on the stages, or stages not a
    # dimension, is a ValueError before anything is sent. The tests use hand-made pieces (an empty
    # one, a copy, a stage) on a 2 x 2 mesh and the TinyTransformer's gradient laid out in five
    # ways, for p = 2, 1, 3 and inf, against one process and torch's get_total_norm on DTensors.
    supported = (
        isinstance(norm_type, (int, float))
        and not isinstance(norm_type, bool)
        and float(norm_type) > 0  # nan and -inf fail this too
    )
    if not supported:
        raise ValueError(
            f"norm_type {norm_type!r} is not supported: pass a positive number (2.0, the "
            "Euclidean norm; 1.0; ...) or float('inf') (the largest absolute entry)"
        )
    order = float(norm_type)
    names = mesh.mesh_dim_names or ()
    if stages is not None and stages not in names:
        raise ValueError(
            f"stages={stages!r} is not a dimension of the mesh {names}: name the pipeline's "
            "dimension, or None when there is no pipeline"
        )
    for piece in pieces:
        wrong = [d for d in piece.sharded_on if d not in names or d == stages]
        if wrong:
            raise ValueError(
                f"piece {piece.name!r} is sharded on {wrong}, which "
                + ("are the stages" if wrong == [stages] else f"the mesh {names} lacks")
                + ": name only the mesh's dimensions whose ranks hold different parts of it"
            )
    device = pieces[0].grad.device if pieces else rank_device()
    counted = torch.zeros((), dtype=torch.float64, device=device)
    for piece in pieces:
        copy_here = any(
            mesh.get_local_rank(d) != 0 for d in names if d != stages and d not in piece.sharded_on
        )
        if copy_here or piece.grad.numel() == 0:  # another rank counts this copy
            continue
        values = piece.grad.detach().double()
        if math.isinf(order):
            counted = torch.maximum(counted, values.abs().max())
        else:
            counted += torch.linalg.vector_norm(values, order) ** order
    op = dist.ReduceOp.MAX if math.isinf(order) else dist.ReduceOp.SUM
    for name in names:  # every dimension: the shards, the first copies, the stages
        dist.all_reduce(counted, op=op, group=mesh.get_group(name))
    norm = counted if math.isinf(order) else counted ** (1.0 / order)
    dtype = pieces[0].grad.dtype if pieces else torch.float32
    return norm.to(dtype)
    # END STEP 4


# --------------------------------------------------------------------------- step 5: clipping


def clip_grad_norm(
    pieces: Sequence[Piece],
    max_norm: float,
    mesh: DeviceMesh,
    norm_type: float = 2.0,
    stages: str | None = None,
) -> torch.Tensor:
    """``clip_grad_norm_`` for a model spread over ``mesh``: every piece's gradient scaled in
    place by the one factor ``min(1, max_norm / (norm + 1e-6))`` of the global norm, the same on
    every rank. Returns the global norm before clipping. A ``ValueError`` (before anything is
    sent) when ``max_norm`` is not a positive number, and as ``global_grad_norm`` says."""
    # BEGIN STEP 5: clipping by one factor
    # TODO: every piece's gradient scaled in place by one factor, the same on every rank, as
    # clip_grad_norm_ scales on one process (only ever down); returns the global norm before
    # clipping. A max_norm that is not a positive number is a ValueError before anything is sent.
    # The tests compare the clipped pieces with one process's clip_grad_norm_ laid out the same
    # way, and with torch's clip_grads_with_norm_ on DTensors, and compare the factors between ranks.
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm > 0:
        raise ValueError(
            f"max_norm {max_norm!r} is not a positive number: the norm to clip the gradient to"
        )
    norm = global_grad_norm(pieces, mesh, norm_type, stages)
    factor = torch.clamp(max_norm / (norm + CLIP_EPSILON), max=1.0)  # never scale up
    for piece in pieces:
        piece.grad.mul_(factor.to(piece.grad.device))
    return norm
    # END STEP 5


# --------------------------------------------------------------------------- the program

LAYOUTS = {  # the ways the program lays the 2 x 2 mesh out: (mesh shape, layout)
    "FSDP x TP": ({"dp": 2, "tp": 2}, {"dp": "fsdp", "tp": "tp"}),
    "DDP x TP": ({"dp": 2, "tp": 2}, {"dp": "ddp", "tp": "tp"}),
    "PP x TP": ({"pp": 2, "tp": 2}, {"pp": "pp", "tp": "tp"}),
    "PP x FSDP": ({"pp": 2, "dp": 2}, {"pp": "pp", "dp": "fsdp"}),
}
VALID = (  # valid tokens of each sequence: rank -> micro-batch -> sequence (the rest padding)
    ((8, 4), (3, 0)),
    ((0, 0), (8, 8)),
    ((5, 1), (2, 7)),
    ((6, 6), (1, 0)),
)


def rank_batches(rank: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rank ``rank``'s micro-batches in the program: ``VALID[rank]``'s padded sequences."""
    return [padded_batch(len(v), v, seed + 10 * rank + i) for i, v in enumerate(VALID[rank])]


def whole_gradient(seed: int) -> dict[str, torch.Tensor]:
    """The TinyTransformer's gradient of the mean loss over every rank's micro-batches at once,
    in one process (every rank computes the same)."""
    model = make_transformer(seed).to(rank_device())
    every = [b for rank in range(len(VALID)) for b in rank_batches(rank, seed)]
    tokens = torch.cat([t for t, _ in every]).to(rank_device())
    labels = torch.cat([y for _, y in every]).to(rank_device())
    F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten()).backward()
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def clipped_alone(grads: dict, max_norm: float, norm_type: float) -> dict:
    """One process's ``clip_grad_norm_`` of the whole gradient ``grads`` (copies)."""
    params = []
    for grad in grads.values():
        param = nn.Parameter(torch.zeros_like(grad))
        param.grad = grad.clone()
        params.append(param)
    torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)
    return {name: p.grad for name, p in zip(grads, params)}


def show_rank(rank: int, world_size: int, args) -> dict:
    """One rank of the program: the loss (its own, the mean of its means, the global one), two
    DDP steps, the pipeline's loss, and the norm and clipping on each layout."""
    device = rank_device()
    model = make_transformer(args.seed).to(device)
    sums, counts = [], []  # every rank's, micro-batch by micro-batch: what each rank would see
    with torch.no_grad():
        for other in range(world_size):
            for tokens, labels in rank_batches(other, args.seed):
                loss_sum, count = token_loss(model(tokens.to(device)), labels.to(device))
                sums.append(loss_sum.item())
                counts.append(count)
    mine = slice(2 * rank, 2 * rank + 2)
    means = [s / c if c else float("nan") for s, c in zip(sums[mine], counts[mine])]
    out = {
        "counts": counts[mine],
        "mean of means": sum(means) / len(means),
        "global": global_mean(sum(sums[mine]), sum(counts[mine])),
    }
    ddp = DistributedDataParallel(copy.deepcopy(model))
    optimizer = torch.optim.SGD(ddp.parameters(), lr=args.lr)
    batches = [(t.to(device), y.to(device)) for t, y in rank_batches(rank, args.seed)]
    out["step losses"] = [accumulation_step(ddp, optimizer, batches) for _ in range(2)]
    out["weights"] = {n: p.detach().cpu() for n, p in ddp.module.named_parameters()}
    # 2 stages x 2 replicas: replica d reads ranks 2d and 2d + 1's micro-batches, on both stages
    pipeline = make_mesh({"pp": 2, "dp": world_size // 2})
    replica = slice(4 * pipeline.get_local_rank("dp"), 4 * pipeline.get_local_rank("dp") + 4)
    last = pipeline.get_local_rank("pp") == pipeline["pp"].size() - 1
    out["pipeline"] = pipeline_mean(
        sum(sums[replica]) if last else None, sum(counts[replica]), pipeline, "pp"
    )
    grads = whole_gradient(args.seed)
    clipped = clipped_alone(grads, args.max_norm, args.norm_type)
    meshes = {tuple(pipeline.mesh_dim_names): pipeline}  # one mesh a shape: groups cost time
    for label, (shape, layout) in LAYOUTS.items():
        if tuple(shape) not in meshes:
            meshes[tuple(shape)] = make_mesh(shape)
        mesh = meshes[tuple(shape)]
        pieces = lay_out(grads, mesh, layout)
        before = [piece.grad.clone() for piece in pieces]
        norm = clip_grad_norm(pieces, args.max_norm, mesh, args.norm_type, stages_of(layout))
        factors = {
            round((p.grad.double().norm() / b.double().norm()).item(), 5)
            for p, b in zip(pieces, before)
            if b.norm() > 0
        }
        flat = torch.cat([b.flatten() for b in before]) if before else torch.zeros(1)
        expected = lay_out(clipped, mesh, layout)
        gaps = [(p.grad - c.grad).abs().max().item() for p, c in zip(pieces, expected)]
        out[label] = {
            "own": torch.linalg.vector_norm(flat, args.norm_type).item(),
            "every copy": every_copy_counted(flat, args.norm_type),
            "norm": norm.item(),
            "factors": sorted(factors),
            "gap": max([g for g in gaps if g == g] or [0.0], default=0.0),
        }
    return out


def every_copy_counted(mine: torch.Tensor, norm_type: float) -> float:
    """What summing every rank's own p-th powers over the world gives: each copy counted once
    per rank that holds it (torchtitan #596), shown beside the right norm."""
    powers = torch.linalg.vector_norm(mine.double(), norm_type)
    if not math.isinf(norm_type):
        powers = powers**norm_type
    op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
    dist.all_reduce(powers, op=op)
    return (powers if math.isinf(norm_type) else powers ** (1 / norm_type)).item()


def one_process(args) -> dict:
    """What one process computes on every rank's micro-batches at once: the loss, two steps'
    losses and weights, the gradient's norm."""
    model = make_transformer(args.seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    every = [b for rank in range(len(VALID)) for b in rank_batches(rank, args.seed)]
    tokens, labels = torch.cat([t for t, _ in every]), torch.cat([y for _, y in every])
    losses = []
    for _ in range(2):
        loss = F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten())
        losses.append(loss.item())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    grads = whole_gradient(args.seed)
    return {
        "losses": losses,
        "weights": {n: p.detach() for n, p in model.named_parameters()},
        "norm": torch.nn.utils.get_total_norm(list(grads.values()), args.norm_type).item(),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description="The loss over every valid token and the gradient norm over every piece, "
        "on 4 ranks (a 2 x 2 mesh): each rank's own numbers against the global ones."
    )
    add_launch_arguments(parser, world_size=4)
    parser.add_argument("--max-norm", type=float, default=0.5, help="clip to this norm")
    parser.add_argument(
        "--norm-type", type=float, default=2.0, help="a positive number, or inf (default 2)"
    )
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.world_size != len(VALID):
        parser.error(f"the program lays out a 2 x 2 mesh: --world-size must be {len(VALID)}")
    if not args.max_norm > 0:
        parser.error("--max-norm must be a positive number")
    if not args.norm_type > 0:
        parser.error("--norm-type must be a positive number or inf")
    say(
        None,
        f"{args.world_size} ranks, each 2 micro-batches of padded sequences (label -100: "
        "padding), the TinyTransformer",
    )
    results = launch_world(
        show_rank, args.world_size, args, backend=args.backend, device=args.device
    )
    alone = one_process(args)
    loss, gaps = alone["losses"][0], []
    for rank, got in enumerate(results):
        say(
            rank,
            f"valid tokens per micro-batch {got['counts']}: the mean of its micro-batches' "
            f"means {got['mean of means']:.4f}; global_mean {got['global']:.4f}",
        )
        gaps.append(abs(got["global"] - loss))
    say(None, f"one process on the whole batch: {loss:.4f}")
    steps = results[0]["step losses"]
    weights = max(
        (w - alone["weights"][n]).abs().max().item() for n, w in results[0]["weights"].items()
    )
    gaps += [weights, *(abs(a - b) for a, b in zip(steps, alone["losses"]))]
    say(
        None,
        f"accumulation_step under DDP, 2 steps: losses {steps[0]:.4f} {steps[1]:.4f} (one "
        f"process {alone['losses'][0]:.4f} {alone['losses'][1]:.4f}), weights within "
        f"{weights:.1e} of one process's",
    )
    for rank, got in enumerate(results):
        stage = "stage 1, the last: its loss" if rank >= 2 else "stage 0: no loss of its own"
        say(rank, f"pipeline, 2 stages x 2 replicas, {stage}; pipeline_mean {got['pipeline']:.4f}")
        gaps.append(abs(got["pipeline"] - loss))
    say(
        None,
        f"the gradient's {args.norm_type:g}-norm in one process: {alone['norm']:.4f}; clipped "
        f"to max_norm {args.max_norm:g}",
    )
    for label in LAYOUTS:
        for rank, got in enumerate(results):
            row = got[label]
            factors = ", ".join(f"{f:.4f}" for f in row["factors"]) or "-"
            say(
                rank,
                f"{label:<10} its own pieces {row['own']:.4f}, every copy counted "
                f"{row['every copy']:.4f}, global_grad_norm {row['norm']:.4f}, clip factor "
                f"{factors}",
            )
            gaps += [abs(row["norm"] - alone["norm"]) / alone["norm"], row["gap"]]
    return verdict(
        max(gaps),
        "every rank's loss, weights, norm and clipped pieces equal one process's",
        "a global number differs from one process's",
    )


if __name__ == "__main__":
    run_program(main)
