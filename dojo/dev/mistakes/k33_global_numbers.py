"""k33's mistakes catalogue: real mistakes in the numbers a run must compute over every rank (the
loss over valid tokens, accumulation's one scale, the pipeline's loss, the gradient norm over
shards, copies and stages, clipping by one factor), and right answers written another way. See
``dojo/dev/mistakes/__init__.py`` for what each list promises."""

from __future__ import annotations

import contextlib
import itertools
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dojo.dev.mistakes import Mistake, RightAnswer
from solutions import k33_global_numbers as reference

IGNORE = reference.IGNORE_INDEX


def _k33():
    """The reference module, with this entry swapped in (what every test and rank sees)."""
    from dojo.harness import impl

    return impl.load_kata("k33_global_numbers")


def _valid(labels: torch.Tensor) -> int:
    return int((labels != IGNORE).sum())


# --------------------------------------------------------------------------- token_loss


def _token_loss(logits, labels, *, reduction="sum", count_padding=False, check=True, graph=True):
    if check and logits.shape[:-1] != labels.shape:
        raise ValueError(f"labels {tuple(labels.shape)} do not fit logits {tuple(logits.shape)}")
    flat = logits.reshape(-1, logits.shape[-1])
    loss = F.cross_entropy(flat, labels.reshape(-1), reduction=reduction)
    count = labels.numel() if count_padding else _valid(labels)
    return (loss if graph else loss.item()), count


def token_loss_returns_the_mean(logits, labels):
    return _token_loss(logits, labels, reduction="mean")


def token_loss_counts_padding(logits, labels):
    return _token_loss(logits, labels, count_padding=True)


def token_loss_without_a_check(logits, labels):
    return _token_loss(logits, labels, check=False)


def token_loss_as_a_number(logits, labels):
    return _token_loss(logits, labels, graph=False)  # .item(): a float, off the graph


# --------------------------------------------------------------------------- global_mean


def _checked(count):
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(f"count must be an int of at least 0, not {count!r}")


def global_mean_of_rank_means(loss_sum, count, group=None):
    _checked(count)
    mean = torch.tensor(float(loss_sum) / count if count else float("nan"), dtype=torch.float64)
    dist.all_reduce(mean, op=dist.ReduceOp.AVG, group=group)
    return mean.item()


def global_mean_over_own_count(loss_sum, count, group=None):
    _checked(count)
    total = torch.tensor(float(loss_sum), dtype=torch.float64)
    dist.all_reduce(total, group=group)
    return total.item() / count if count else float("nan")


def global_mean_assumes_equal_counts(loss_sum, count, group=None):
    _checked(count)
    total = torch.tensor(float(loss_sum), dtype=torch.float64)
    dist.all_reduce(total, group=group)
    size = dist.get_world_size(group)
    return total.item() / (count * size) if count else float("nan")


def global_mean_in_two_all_reduces(loss_sum, count, group=None):
    _checked(count)
    total = torch.tensor(float(loss_sum), dtype=torch.float64)
    tokens = torch.tensor(float(count), dtype=torch.float64)
    dist.all_reduce(total, group=group)
    dist.all_reduce(tokens, group=group)
    if tokens.item() == 0:
        raise ValueError("no valid token on any rank")
    return total.item() / tokens.item()


def global_mean_without_a_check(loss_sum, count, group=None):
    both = torch.tensor([float(loss_sum), float(count)], dtype=torch.float64)
    dist.all_reduce(both, group=group)
    if both[1] == 0:
        raise ValueError("no valid token on any rank")
    return (both[0] / both[1]).item()


def global_mean_nan_for_padding_only(loss_sum, count, group=None):
    _checked(count)
    both = torch.tensor([float(loss_sum), float(count)], dtype=torch.float64)
    dist.all_reduce(both, group=group)
    return (both[0] / both[1]).item()  # 0 / 0: nan, said as a loss


def global_mean_as_a_float32_pair(loss_sum, count, group=None):
    """Right: the pair as float32 (counts are exact up to 2**24), divided as tensors."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(f"a count of valid tokens is an int >= 0, not {count!r}")
    value = loss_sum.detach().float() if isinstance(loss_sum, torch.Tensor) else loss_sum
    pair = torch.stack([torch.as_tensor(value, dtype=torch.float32), torch.tensor(float(count))])
    dist.all_reduce(pair, op=dist.ReduceOp.SUM, group=group)
    if pair[1].item() == 0:
        raise ValueError("every rank's batch is padding only: there is no mean to report")
    return (pair[0] / pair[1]).item()


# --------------------------------------------------------------------------- accumulation_step


def _accumulate(ddp, optimizer, micro_batches, *, scale="once", count="global", zero=True,
                loss="global", rescale_rounds=False):  # fmt: skip
    if not micro_batches:
        raise ValueError("no micro-batches")
    group = ddp.process_group
    mine = sum(_valid(labels) for _, labels in micro_batches)
    total = torch.tensor([mine], dtype=torch.float64)
    if count == "global":
        dist.all_reduce(total, group=group)
    total = int(total.item())
    size, k = dist.get_world_size(group), len(micro_batches)
    factor = {
        "once": size / total,
        "count only": 1 / total,  # DDP's average on top
        "micro again": size / total / k,  # torchtitan #1732's kind: divided once more
        "raw": 1.0,  # torchtitan #2972: backward of the raw sums, divided for the log only
        "rounds": size / total * k,  # divided by k again at each of the k rounds below
        "means": None,  # below
    }[scale]
    loss_sum = 0.0
    for number, (tokens, labels) in enumerate(micro_batches):
        with ddp.no_sync() if number < k - 1 else contextlib.nullcontext():
            if scale == "means":  # k11's recipe: each micro-batch's mean over k
                micro = F.cross_entropy(ddp(tokens).flatten(0, 1), labels.flatten())
                (micro / k).backward()
                micro_sum = micro * _valid(labels)
            else:
                micro_sum, _ = reference.token_loss(ddp(tokens), labels)
                (micro_sum * factor).backward()
        if rescale_rounds:  # every gradient so far scaled again, the early ones k times
            for param in ddp.parameters():
                if param.grad is not None:
                    param.grad.div_(k)
        loss_sum += micro_sum.item()
    optimizer.step()
    if zero:
        optimizer.zero_grad()
    if loss == "own":
        return loss_sum / mine if mine else float("nan")
    return reference.global_mean(loss_sum, mine, group)


def accumulation_over_the_count_only(ddp, optimizer, micro_batches):
    return _accumulate(ddp, optimizer, micro_batches, scale="count only")


def accumulation_divides_by_micro_batches_again(ddp, optimizer, micro_batches):
    return _accumulate(ddp, optimizer, micro_batches, scale="micro again")


def accumulation_with_own_count(ddp, optimizer, micro_batches):
    return _accumulate(ddp, optimizer, micro_batches, count="own")


def accumulation_mean_of_means(ddp, optimizer, micro_batches):
    return _accumulate(ddp, optimizer, micro_batches, scale="means")


def accumulation_raw_sums(ddp, optimizer, micro_batches):
    return _accumulate(ddp, optimizer, micro_batches, scale="raw")


def accumulation_rescales_every_round(ddp, optimizer, micro_batches):
    return _accumulate(ddp, optimizer, micro_batches, scale="rounds", rescale_rounds=True)


def accumulation_returns_own_loss(ddp, optimizer, micro_batches):
    return _accumulate(ddp, optimizer, micro_batches, loss="own")


def accumulation_without_zero_grad(ddp, optimizer, micro_batches):
    return _accumulate(ddp, optimizer, micro_batches, zero=False)


def accumulation_scales_the_gradients_after(ddp, optimizer, micro_batches):
    """Right: backward of the raw token sums, then every gradient scaled once by N / count
    after DDP's average (torchtune's way), the loss summed as a tensor."""
    if len(micro_batches) == 0:
        raise ValueError("accumulation_step takes at least one micro-batch")
    group = ddp.process_group
    tokens_here = torch.tensor(float(sum(_valid(y) for _, y in micro_batches)))
    counted = tokens_here.clone()
    dist.all_reduce(counted, group=group)
    sums = []
    for number, (tokens, labels) in enumerate(micro_batches):
        last = number == len(micro_batches) - 1
        with contextlib.nullcontext() if last else ddp.no_sync():
            micro_sum = F.cross_entropy(
                ddp(tokens).flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction="sum"
            )
            micro_sum.backward()
        sums.append(micro_sum.detach())
    for param in ddp.parameters():
        if param.grad is not None:
            param.grad.mul_(dist.get_world_size(group) / counted.item())
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)
    return reference.global_mean(torch.stack(sums).sum(), int(tokens_here.item()), group)


# --------------------------------------------------------------------------- pipeline_mean


def _pipeline(loss_sum, count, mesh, stages="pp", *, off_last=None, every_count=False,
              over=None, check=True):  # fmt: skip
    names = mesh.mesh_dim_names
    if check:
        if stages not in names:
            raise ValueError(f"no dimension {stages!r}")
        _checked(count)
        if (mesh.get_local_rank(stages) == mesh[stages].size() - 1) != (loss_sum is not None):
            raise ValueError("only the last stage has a loss sum")
    last = loss_sum is not None
    if off_last is not None:  # torchtitan before #550: the last stage's replicas, a placeholder
        if not last:
            return off_last
        over = "replicas"
    both = torch.zeros(2, dtype=torch.float64)
    if last:
        both[0] = float(loss_sum)
    if last or every_count:
        both[1] = float(count)
    for name in names if over is None else [n for n in names if n != stages]:
        dist.all_reduce(both, group=mesh.get_group(name))
    return (both[0] / both[1]).item()


def pipeline_minus_one_off_the_last_stage(loss_sum, count, mesh, stages="pp"):
    return _pipeline(loss_sum, count, mesh, stages, off_last=-1.0)  # torchtitan's placeholder


def pipeline_counts_every_stage(loss_sum, count, mesh, stages="pp"):
    return _pipeline(loss_sum, count, mesh, stages, every_count=True)


def pipeline_over_the_replicas_only(loss_sum, count, mesh, stages="pp"):
    return _pipeline(loss_sum, count, mesh, stages, over="replicas")


def pipeline_without_checks(loss_sum, count, mesh, stages="pp"):
    return _pipeline(loss_sum, count, mesh, stages, check=False)


def pipeline_broadcast_from_the_last_stage(loss_sum, count, mesh, stages="pp"):
    """Right: the last stage sums over its replicas, then broadcasts to the other stages."""
    names = mesh.mesh_dim_names
    if stages not in names:
        raise ValueError(f"the mesh {names} has no dimension {stages!r}")
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(f"count must be an int >= 0, not {count!r}")
    final = mesh[stages].size() - 1
    last = mesh.get_local_rank(stages) == final
    if last is (loss_sum is None):
        raise ValueError("a loss sum is given on the last stage, and only there")
    pair = torch.zeros(2, dtype=torch.float64)
    if last:
        pair[0], pair[1] = float(loss_sum), count
        for name in names:
            if name != stages:  # the last stage's replicas: only the last stage calls these
                dist.all_reduce(pair, group=mesh.get_group(name))
    dist.broadcast(pair, group=mesh.get_group(stages), group_src=final)
    return pair[0].item() / pair[1].item()


# --------------------------------------------------------------------------- global_grad_norm


def _order(norm_type):
    if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)):
        raise ValueError(f"norm_type must be a positive number or inf, not {norm_type!r}")
    if not norm_type > 0:
        raise ValueError(f"norm_type must be a positive number or inf, not {norm_type!r}")
    return float(norm_type)


def _norm(pieces, mesh, norm_type=2.0, stages=None, *, copies="once", reduce="every",
          combine="powers", inf_op="max", power=None, check=True, skip_empty=True):  # fmt: skip
    p = _order(norm_type) if check else float(norm_type)
    names = list(mesh.mesh_dim_names)
    if check and stages is not None and stages not in names:
        raise ValueError(f"no dimension {stages!r}")
    if check and any(d not in names or d == stages for piece in pieces for d in piece.sharded_on):
        raise ValueError("a piece sharded on a dimension the mesh lacks, or on the stages")
    q = p if power is None else power
    local = torch.zeros((), dtype=torch.float64)
    for piece in pieces:
        if piece.grad.numel() == 0 and skip_empty:
            continue
        copy_dims = [
            d for d in names if d not in piece.sharded_on and (d != stages or copies == "stages")
        ]
        if copies != "every" and any(mesh.get_local_rank(d) != 0 for d in copy_dims):
            continue
        values = piece.grad.double()
        if math.isinf(q):
            local = torch.maximum(local, values.abs().max())
        else:
            local += (values.abs() ** q).sum()
    if combine == "norms" and not math.isinf(q):
        local = local ** (1 / q)
    op = dist.ReduceOp.MAX if math.isinf(q) and inf_op == "max" else dist.ReduceOp.SUM
    dims = {
        "every": names,
        "none": [],
        "first": names[:1],
        "no stages": [d for d in names if d != stages],
    }[reduce]
    for name in dims:
        dist.all_reduce(local, op=op, group=mesh.get_group(name))
    if math.isinf(q) or combine == "norms":
        return local.float()
    return (local ** (1 / q)).float()


def norm_counts_every_copy(pieces, mesh, norm_type=2.0, stages=None):
    return _norm(pieces, mesh, norm_type, stages, copies="every")  # torchtitan #596


def norm_of_own_pieces(pieces, mesh, norm_type=2.0, stages=None):
    return _norm(pieces, mesh, norm_type, stages, copies="every", reduce="none")


def norm_forgets_the_stages(pieces, mesh, norm_type=2.0, stages=None):
    return _norm(pieces, mesh, norm_type, stages, reduce="no stages")


def norm_stages_as_copies(pieces, mesh, norm_type=2.0, stages=None):
    return _norm(pieces, mesh, norm_type, stages, copies="stages")


def norm_adds_the_ranks_norms(pieces, mesh, norm_type=2.0, stages=None):
    return _norm(pieces, mesh, norm_type, stages, combine="norms")


def norm_inf_summed(pieces, mesh, norm_type=2.0, stages=None):
    return _norm(pieces, mesh, norm_type, stages, inf_op="sum")


def norm_always_two(pieces, mesh, norm_type=2.0, stages=None):
    _order(norm_type)
    return _norm(pieces, mesh, 2.0, stages)


def norm_over_the_first_dimension_only(pieces, mesh, norm_type=2.0, stages=None):
    return _norm(pieces, mesh, norm_type, stages, reduce="first")


def norm_inf_of_empty_pieces(pieces, mesh, norm_type=2.0, stages=None):
    return _norm(pieces, mesh, norm_type, stages, skip_empty=False)


def norm_without_checks(pieces, mesh, norm_type=2.0, stages=None):
    return _norm(pieces, mesh, norm_type, stages, check=False)


def norm_weights_every_copy(pieces, mesh, norm_type=2.0, stages=None):
    """Right: every copy weighted by 1 / (how many ranks hold it), one sum over the mesh (exact
    on 2 x 2: the weights are powers of two); the inf-norm needs no weights."""
    p = _order(norm_type)
    names = list(mesh.mesh_dim_names)
    if stages is not None and stages not in names:
        raise ValueError(f"stages {stages!r} is not one of {names}")
    for piece in pieces:
        if not set(piece.sharded_on) <= set(names) - {stages}:
            raise ValueError(f"{piece.name} is sharded on {piece.sharded_on}: not the mesh's")
    total = torch.zeros((), dtype=torch.float64)
    for piece in pieces:
        if piece.grad.numel() == 0:
            continue
        if math.isinf(p):
            total = torch.maximum(total, piece.grad.double().abs().max())
            continue
        holders = math.prod(
            mesh[d].size() for d in names if d != stages and d not in piece.sharded_on
        )
        total += torch.linalg.vector_norm(piece.grad.double(), p) ** p / holders
    for name in names:
        op = dist.ReduceOp.MAX if math.isinf(p) else dist.ReduceOp.SUM
        dist.all_reduce(total, op=op, group=mesh.get_group(name))
    return (total if math.isinf(p) else total ** (1 / p)).to(torch.float32)


def norm_on_each_pieces_groups(pieces, mesh, norm_type=2.0, stages=None):
    """Right: DTensor's way. Pieces grouped by the dimensions they are sharded on; each group's
    sum reduced over those dimensions only (a copy is the same on every rank already), every
    group in one order on every rank; then over the stages."""
    p = _order(norm_type)
    names = list(mesh.mesh_dim_names)
    if stages is not None and stages not in names:
        raise ValueError(f"stages {stages!r} is not one of {names}")
    inner = [d for d in names if d != stages]
    for piece in pieces:
        if not set(piece.sharded_on) <= set(inner):
            raise ValueError(f"{piece.name} is sharded on {piece.sharded_on}: not the mesh's")
    op = dist.ReduceOp.MAX if math.isinf(p) else dist.ReduceOp.SUM
    total = torch.zeros((), dtype=torch.float64)
    for size in range(len(inner) + 1):
        for split in itertools.combinations(inner, size):  # the same order on every rank
            part = torch.zeros((), dtype=torch.float64)
            for piece in pieces:
                if set(piece.sharded_on) == set(split) and piece.grad.numel():
                    values = piece.grad.double().abs()
                    part = (
                        torch.maximum(part, values.max())
                        if math.isinf(p)
                        else part + (values**p).sum()
                    )
            for name in split:
                dist.all_reduce(part, op=op, group=mesh.get_group(name))
            total = torch.maximum(total, part) if math.isinf(p) else total + part
    if stages is not None:
        dist.all_reduce(total, op=op, group=mesh.get_group(stages))
    return (total if math.isinf(p) else total ** (1 / p)).float()


# --------------------------------------------------------------------------- clip_grad_norm


def _clip(pieces, max_norm, mesh, norm_type=2.0, stages=None, *, own=False, clamp=True,
          after=False, copies=True, in_place=True, check=True):  # fmt: skip
    if check and (isinstance(max_norm, bool) or not isinstance(max_norm, (int, float))
                  or not max_norm > 0):  # fmt: skip
        raise ValueError(f"max_norm must be a positive number, not {max_norm!r}")
    if own:  # this rank's pieces only
        p = _order(norm_type)
        grads = [piece.grad for piece in pieces if piece.grad.numel()]
        norm = torch.nn.utils.get_total_norm(grads, p) if grads else torch.zeros(())
    else:
        norm = _k33().global_grad_norm(pieces, mesh, norm_type, stages)
    factor = max_norm / (norm + reference.CLIP_EPSILON)
    if clamp:
        factor = torch.clamp(factor, max=1.0)
    names = mesh.mesh_dim_names
    for piece in pieces:
        copy_here = any(
            mesh.get_local_rank(d) != 0 for d in names if d != stages and d not in piece.sharded_on
        )
        if not copies and copy_here:  # "another rank holds the copy that counts"
            continue
        if in_place:
            piece.grad.mul_(factor)
        else:
            piece.grad = piece.grad * factor
    return norm * factor if after else norm


def clip_by_own_norm(pieces, max_norm, mesh, norm_type=2.0, stages=None):
    return _clip(pieces, max_norm, mesh, norm_type, stages, own=True)


def clip_scales_up(pieces, max_norm, mesh, norm_type=2.0, stages=None):
    return _clip(pieces, max_norm, mesh, norm_type, stages, clamp=False)


def clip_returns_the_clipped_norm(pieces, max_norm, mesh, norm_type=2.0, stages=None):
    return _clip(pieces, max_norm, mesh, norm_type, stages, after=True)


def clip_skips_the_copies(pieces, max_norm, mesh, norm_type=2.0, stages=None):
    return _clip(pieces, max_norm, mesh, norm_type, stages, copies=False)


def clip_not_in_place(pieces, max_norm, mesh, norm_type=2.0, stages=None):
    return _clip(pieces, max_norm, mesh, norm_type, stages, in_place=False)


def clip_without_a_check(pieces, max_norm, mesh, norm_type=2.0, stages=None):
    return _clip(pieces, max_norm, mesh, norm_type, stages, check=False)


def clip_with_torchs_clip_grads_with_norm_(pieces, max_norm, mesh, norm_type=2.0, stages=None):
    """Right: the global norm, then torch's own clip_grads_with_norm_ on holders of the pieces'
    gradients (it scales each .grad in place by the same clamped factor)."""
    if type(max_norm) not in (int, float) or math.isnan(max_norm) or max_norm <= 0:
        raise ValueError(f"max_norm is the norm to clip to, a positive number: {max_norm!r}")
    norm = _k33().global_grad_norm(pieces, mesh, norm_type, stages)
    holders = []
    for piece in pieces:
        holder = torch.empty_like(piece.grad)
        holder.grad = piece.grad
        holders.append(holder)
    torch.nn.utils.clip_grads_with_norm_(holders, max_norm, norm)
    return norm


# --------------------------------------------------------------------------- the lists

_TOKEN = "test_token_loss_sums_the_valid_tokens"
_SHAPES = "test_token_loss_refuses_labels_that_do_not_fit"
_MEAN = "test_global_mean_is_the_mean_over_every_valid_token"
_TOGETHER = "test_global_mean_sends_the_sum_and_the_count_together"
_COUNTS = "test_global_mean_refuses_bad_counts"
_TRAINS = "test_accumulation_step_trains_like_one_process"
_RETURNS = "test_accumulation_step_returns_the_global_loss"
_PIPELINE = "test_pipeline_mean_reports_the_loss_on_every_rank"
_PIPELINE_NO = "test_pipeline_mean_refuses_what_does_not_fit"
_ONCE = "test_global_grad_norm_counts_every_element_once"
_NORM_NO = "test_global_grad_norm_refuses_what_it_cannot_compute"
_CLIP = "test_clip_grad_norm_clips_every_rank_by_one_factor"
_SMALL = "test_clip_grad_norm_leaves_small_gradients_alone"
_CLIP_NO = "test_clip_grad_norm_refuses_a_max_norm_that_is_not_positive"
_TWO = "2 ranks, 3 micro-batches"

MISTAKES = [
    Mistake(
        "token_loss_returns_the_mean",
        replaces="token_loss",
        fails=[_TOKEN],
        says=["the MEAN over its", "return their SUM"],
    ),
    Mistake(
        "token_loss_counts_padding",
        replaces="token_loss",
        fails=[_TOKEN],
        says=["every label: the padding (label -100) is no token"],
    ),
    Mistake(
        "token_loss_without_a_check",
        replaces="token_loss",
        fails=[_SHAPES],
        says=["did not refuse", "labels' shape is not logits' without the last dimension"],
    ),
    Mistake(
        "token_loss_as_a_number",
        replaces="token_loss",
        fails=[_TOKEN],
        says=["not a 0-d tensor: backward must go through it"],
    ),
    Mistake(
        "global_mean_of_rank_means",
        replaces="global_mean",
        fails=[_MEAN],
        says=["got nan", "a mean per rank, averaged over the ranks, is not the mean"],
    ),
    Mistake(
        "global_mean_over_own_count",
        replaces="global_mean",
        fails=[_MEAN],
        says=["every rank's sum over this rank's own count"],
    ),
    Mistake(
        "global_mean_assumes_equal_counts",
        replaces="global_mean",
        fails=[_MEAN],
        says=["as if every rank held as many valid tokens as this one"],
    ),
    Mistake(
        "global_mean_in_two_all_reduces",
        replaces="global_mean",
        fails=[_TOGETHER],
        says=["made 2 collectives", "one all-reduce carries the sum and the count together"],
    ),
    Mistake(
        "global_mean_without_a_check",
        replaces="global_mean",
        fails=[_COUNTS],
        says=["tried to all-reduce before refusing"],
    ),
    Mistake(
        "global_mean_nan_for_padding_only",
        replaces="global_mean",
        fails=[_COUNTS],
        says=["a batch of padding only", "raise ValueError saying so"],
    ),
    Mistake(
        "accumulation_over_the_count_only",
        replaces="accumulation_step",
        fails=[_TRAINS],
        says=["DDP averages the gradients", "a scale applied twice"],
    ),
    Mistake(
        "accumulation_divides_by_micro_batches_again",
        replaces="accumulation_step",
        fails=[_TRAINS],
        says=["divided again by the number of micro-batches"],
    ),
    Mistake(
        "accumulation_with_own_count",
        replaces="accumulation_step",
        fails=[_TRAINS],
        says=["that rank's own count of valid tokens", "all-reduce the counts"],
    ),
    Mistake(
        "accumulation_mean_of_means",
        replaces="accumulation_step",
        fails=[_TRAINS],
        says=["the mean of every micro-batch's own mean", "k11's recipe"],
    ),
    Mistake(
        "accumulation_raw_sums",
        replaces="accumulation_step",
        fails=[_TRAINS],
        says=["backward went through the raw token sums"],
    ),
    Mistake(
        "accumulation_rescales_every_round",
        replaces="accumulation_step",
        fails=[_TRAINS],
        says=["applied once, not again per micro-batch nor on the gradients accumulated"],
    ),
    Mistake(
        "accumulation_returns_own_loss",
        replaces="accumulation_step",
        fails=[_RETURNS],
        says=["this rank's own mean", "global_mean of this rank's sum and count"],
    ),
    Mistake(
        "accumulation_without_zero_grad",
        replaces="accumulation_step",
        fails=[_TRAINS],
        says=["gradients are not zero: zero them after the optimizer's step"],
    ),
    Mistake(
        "pipeline_minus_one_off_the_last_stage",
        replaces="pipeline_mean",
        fails=[_PIPELINE],
        says=["returned -1.0", "Only the last stage computes a loss", "#550"],
    ),
    Mistake(
        "pipeline_counts_every_stage",
        replaces="pipeline_mean",
        fails=[_PIPELINE],
        says=["counts each token once per stage"],
    ),
    Mistake(
        "pipeline_over_the_replicas_only",
        replaces="pipeline_mean",
        fails=[_PIPELINE],
        says=["returned nan", "Every rank reports the run's loss"],
    ),
    Mistake(
        "pipeline_without_checks",
        replaces="pipeline_mean",
        fails=[_PIPELINE_NO],
        says=["raise ValueError saying what is wrong"],
    ),
    Mistake(
        "norm_counts_every_copy",
        replaces="global_grad_norm",
        fails=[_ONCE],
        says=["every copy counted", "torchtitan #596"],
    ),
    Mistake(
        "norm_of_own_pieces",
        replaces="global_grad_norm",
        fails=[_ONCE],
        says=["this rank's own pieces only"],
    ),
    Mistake(
        "norm_forgets_the_stages",
        replaces="global_grad_norm",
        fails=[_ONCE],
        says=["its stage's norm only", "the stages hold different parameters"],
    ),
    Mistake(
        "norm_stages_as_copies",
        replaces="global_grad_norm",
        fails=[_ONCE],
        says=["only the first stage's pieces"],
    ),
    Mistake(
        "norm_adds_the_ranks_norms",
        replaces="global_grad_norm",
        fails=[_ONCE],
        says=["norms do not add up, p-th powers do"],
    ),
    Mistake(
        "norm_inf_summed",
        replaces="global_grad_norm",
        fails=[_ONCE],
        says=["reduce with ReduceOp.MAX"],
    ),
    Mistake(
        "norm_always_two",
        replaces="global_grad_norm",
        fails=[_ONCE],
        says=["the 2-norm, not the 1-norm"],
    ),
    Mistake(
        "norm_over_the_first_dimension_only",
        replaces="global_grad_norm",
        fails=[_ONCE],
        says=["dimension only: every dimension holds other parts of the model"],
    ),
    Mistake(
        "norm_inf_of_empty_pieces",
        replaces="global_grad_norm",
        fails=[_ONCE],
        says=["an empty piece has no largest entry"],
    ),
    Mistake(
        "norm_without_checks",
        replaces="global_grad_norm",
        fails=[_NORM_NO],
        says=["raise ValueError saying what is supported"],
    ),
    Mistake(
        "clip_by_own_norm",
        replaces="clip_grad_norm",
        fails=[_CLIP],
        says=["each rank clipped by a norm of its own"],
    ),
    Mistake(
        "clip_scales_up",
        replaces="clip_grad_norm",
        fails=[_SMALL],
        says=["clipping never scales up"],
    ),
    Mistake(
        "clip_returns_the_clipped_norm",
        replaces="clip_grad_norm",
        fails=[_CLIP],
        says=["the norm after clipping", "as clip_grad_norm_ does"],
    ),
    Mistake(
        "clip_skips_the_copies",
        replaces="clip_grad_norm",
        fails=[_CLIP],
        says=["scaled its pieces by different factors", "the copies too"],
    ),
    Mistake(
        "clip_not_in_place",
        replaces="clip_grad_norm",
        fails=[_CLIP],
        says=["is a new tensor", "in place (mul_)"],
    ),
    Mistake(
        "clip_without_a_check",
        replaces="clip_grad_norm",
        fails=[_CLIP_NO],
        says=["max_norm must be a positive number"],
    ),
]

RIGHT_ANSWERS = [
    RightAnswer("global_mean_as_a_float32_pair", replaces="global_mean"),
    RightAnswer("accumulation_scales_the_gradients_after", replaces="accumulation_step"),
    RightAnswer("pipeline_broadcast_from_the_last_stage", replaces="pipeline_mean"),
    RightAnswer("norm_weights_every_copy", replaces="global_grad_norm", steps=(4, 5)),
    RightAnswer("norm_on_each_pieces_groups", replaces="global_grad_norm", steps=(4,)),
    RightAnswer("clip_with_torchs_clip_grads_with_norm_", replaces="clip_grad_norm"),
]
