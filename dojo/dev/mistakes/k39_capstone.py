"""k39's mistakes catalogue: real mistakes in composing a 3-D mesh, a stage of tensor-parallel
blocks recomputed in backward, one step through the pipeline averaged over dp with the global
loss, and the global gradient norm; and right answers written another way. See ``dojo/dev/mistakes/__init__.py``
for what each list promises."""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch import nn

from dojo.dev.mistakes import Mistake, RightAnswer
from solutions import k39_capstone as reference
from solutions.k32_activation_checkpointing import Checkpointed

Mesh3D = reference.Mesh3D
Piece = reference.Piece
Stage = reference.Stage
TP_PLAN = reference.TP_PLAN
TensorParallelBlock = reference.TensorParallelBlock
RecomputedBlock = reference.RecomputedBlock
VocabParallelOutput = reference.VocabParallelOutput
vocab_parallel_cross_entropy = reference.vocab_parallel_cross_entropy
checkpoint = reference.checkpoint
clip_grad_norm = reference.clip_grad_norm
gpipe_actions = reference.gpipe_actions
pipeline_mean = reference.pipeline_mean
run_schedule = reference.run_schedule
split_stages = reference.split_stages

# --------------------------------------------------------------------------- step 1: the mesh


def _checked(dp, tp, pp):
    world = dist.get_world_size()
    if min(dp, tp, pp) < 1 or dp * tp * pp != world:
        raise ValueError(f"a {dp} x {tp} x {pp} mesh does not fit a world of {world}")


def _lines(dp, tp, pp, at):
    return {
        "tp": [[at(p, d, t) for t in range(tp)] for p in range(pp) for d in range(dp)],
        "dp": [[at(p, d, t) for d in range(dp)] for p in range(pp) for t in range(tp)],
        "pp": [[at(p, d, t) for p in range(pp)] for d in range(dp) for t in range(tp)],
    }


def _mesh(dp, tp, pp, indices, lines, order=("tp", "dp", "pp"), swap=None):
    rank = dist.get_rank()
    mine = {}
    for name in order:
        groups = [dist.new_group(ranks) for ranks in lines[name]]
        index = next(i for i, ranks in enumerate(lines[name]) if rank in ranks)
        mine[name] = (groups[index], lines[name][index])
    if swap:
        a, b = swap
        mine[a], mine[b] = mine[b], mine[a]
    pp_index, dp_index, tp_index = indices
    return Mesh3D(
        dp, tp, pp, dp_index, tp_index, pp_index,
        mine["dp"][0], mine["tp"][0], mine["pp"][0],
        mine["dp"][1], mine["tp"][1], mine["pp"][1],
    )  # fmt: skip


def _right_indices(dp, tp):
    pp_index, rest = divmod(dist.get_rank(), dp * tp)
    return (pp_index, *divmod(rest, tp))


def _right_at(dp, tp):
    return lambda p, d, t: (p * dp + d) * tp + t


def mesh_dp_innermost(dp, tp, pp):
    """dp innermost: rank = (pp_index * tp + tp_index) * dp + dp_index."""
    _checked(dp, tp, pp)
    pp_index, rest = divmod(dist.get_rank(), dp * tp)
    tp_index, dp_index = divmod(rest, dp)
    lines = _lines(dp, tp, pp, lambda p, d, t: (p * tp + t) * dp + d)
    return _mesh(dp, tp, pp, (pp_index, dp_index, tp_index), lines)


def mesh_tp_and_dp_swapped(dp, tp, pp):
    """The tp line's group kept as dp_group and the dp line's as tp_group."""
    _checked(dp, tp, pp)
    lines = _lines(dp, tp, pp, _right_at(dp, tp))
    return _mesh(dp, tp, pp, _right_indices(dp, tp), lines, swap=("tp", "dp"))


def mesh_pp_lines_consecutive(dp, tp, pp):
    """The stages taken as consecutive ranks, like the tp lines."""
    _checked(dp, tp, pp)
    lines = _lines(dp, tp, pp, _right_at(dp, tp))
    world = dist.get_world_size()
    lines["pp"] = [list(range(s, s + pp)) for s in range(0, world, pp)]
    return _mesh(dp, tp, pp, _right_indices(dp, tp), lines)


def mesh_vague_error(dp, tp, pp):
    """Refuses, but without saying what the mesh must be."""
    if min(dp, tp, pp) < 1 or dp * tp * pp != dist.get_world_size():
        raise ValueError("this mesh does not fit")
    return _mesh(dp, tp, pp, _right_indices(dp, tp), _lines(dp, tp, pp, _right_at(dp, tp)))


def mesh_checked_after_a_group(dp, tp, pp):
    """Makes a group of the whole world first (for the checks), then checks."""
    dist.new_group(list(range(dist.get_world_size())))
    _checked(dp, tp, pp)
    return _mesh(dp, tp, pp, _right_indices(dp, tp), _lines(dp, tp, pp, _right_at(dp, tp)))


def mesh_pp_lines_first(dp, tp, pp):
    """Right: the pp groups first, then dp, then tp: another order, the same on every rank."""
    _checked(dp, tp, pp)
    lines = _lines(dp, tp, pp, _right_at(dp, tp))
    return _mesh(dp, tp, pp, _right_indices(dp, tp), lines, order=("pp", "dp", "tp"))


# --------------------------------------------------------------------------- step 2: the stage


def _vocab_split(stage, mesh):
    """The last stage's output layer split by vocabulary, as the reference splits it."""
    if stage.output is not None:
        stage.output = VocabParallelOutput(stage.output, mesh.tp_group)
    return stage


def stage_not_split(model, mesh, recompute=False):
    """k21's stage, its blocks whole on every tp rank."""
    return split_stages(model, mesh.pp, mesh.pp_index)


def stage_by_dp_index(model, mesh, recompute=False):
    """The stage of the dp index."""
    stage = split_stages(model, mesh.pp, mesh.dp_index)
    for index, block in stage.blocks.items():
        stage.blocks[index] = TensorParallelBlock(block, mesh)
    return _vocab_split(stage, mesh)


def stage_split_over_the_world(model, mesh, recompute=False):
    """The blocks split by tp_index, but their sums taken over the whole world."""
    stage = split_stages(model, mesh.pp, mesh.pp_index)
    world = dataclasses.replace(mesh, tp_group=None)
    for index, block in stage.blocks.items():
        stage.blocks[index] = TensorParallelBlock(block, world)
    return _vocab_split(stage, mesh)


def stage_recompute_ignored(model, mesh, recompute=False):
    """The recompute flag taken and dropped: every block keeps its activations."""
    stage = split_stages(model, mesh.pp, mesh.pp_index)
    for index, block in stage.blocks.items():
        stage.blocks[index] = TensorParallelBlock(block, mesh)
    return _vocab_split(stage, mesh)


def stage_checkpointed_wrapper(model, mesh, recompute=False):
    """k32's Checkpointed around each TensorParallelBlock: the names gain .module."""
    stage = split_stages(model, mesh.pp, mesh.pp_index)
    for index, block in stage.blocks.items():
        split = TensorParallelBlock(block, mesh)
        stage.blocks[index] = Checkpointed(split) if recompute else split
    return _vocab_split(stage, mesh)


class RecomputedFromADetachedInput(TensorParallelBlock):
    """The block checkpointed from its input detached: no gradient flows back out of it."""

    def forward(self, x):
        return checkpoint(super().forward, x.detach())


class RecomputedReentrant(TensorParallelBlock):
    """torch's reentrant checkpoint: its parameters get no gradient where the input needs
    none."""

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(super().forward, x, use_reentrant=True)


class RecomputedByTorch(TensorParallelBlock):
    """Right: torch's own checkpoint (use_reentrant=False) around the block's forward."""

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(super().forward, x, use_reentrant=False)


def stage_by_hand(model, mesh, recompute=False):
    """Right: the Stage built directly, two blocks a stage, each split over tp."""
    per = len(model.blocks) // mesh.pp
    first, last = mesh.pp_index == 0, mesh.pp_index == mesh.pp - 1
    blocks = range(mesh.pp_index * per, (mesh.pp_index + 1) * per)
    split = RecomputedBlock if recompute else TensorParallelBlock
    return Stage(
        {i: split(model.blocks[i], mesh) for i in blocks},
        embedding=model.embedding if first else None,
        norm=model.norm if last else None,
        output=VocabParallelOutput(model.output, mesh.tp_group) if last else None,
    )


class OutputRowsInterleaved(VocabParallelOutput):
    """The vocabulary dealt out round the tp ranks (rank r: words r, r + tp, ...): an even split,
    but not the contiguous rows k34's loss takes rank r's columns for."""

    def __init__(self, output, group):
        nn.Module.__init__(self)
        self.group = group
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        self.weight = nn.Parameter(output.weight.detach()[rank::size].clone())
        self.bias = nn.Parameter(output.bias.detach()[rank::size].clone())


class OutputByHand(VocabParallelOutput):
    """Right: the rows cut with chunk (vocab_shard's rows, found another way)."""

    def __init__(self, output, group):
        nn.Module.__init__(self)
        self.group = group
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        self.weight = nn.Parameter(output.weight.detach().chunk(size)[rank].clone())
        self.bias = nn.Parameter(output.bias.detach().chunk(size)[rank].clone())


# --------------------------------------------------------------------------- step 3: one step


def _pipeline(stage, tokens, targets, mesh, micro_batches, rows=None, mixed=None):
    share = tokens.shape[0] // mesh.dp
    index = mesh.dp_index if rows is None else rows
    mine = slice(index * share, (index + 1) * share)
    batches = list(zip(tokens[mine].chunk(micro_batches), targets[mine].chunk(micro_batches)))
    actions = gpipe_actions(mesh.pp, micro_batches, mesh.pp_index)
    loss_fn = functools.partial(vocab_parallel_cross_entropy, group=mesh.tp_group)
    if mixed is None:
        run = run_schedule(stage, actions, batches, mesh.pp_group, loss_fn=loss_fn)
    else:
        with reference.receiving_in(mixed.compute_dtype):
            run = run_schedule(
                stage, actions, batches, mesh.pp_group, lambda y, t: loss_fn(y.float(), t)
            )
    return run, targets[mine].numel()


def _check_batch(tokens, mesh, micro_batches):
    if tokens.shape[0] % (mesh.dp * micro_batches):
        raise ValueError(
            f"a batch of {tokens.shape[0]} does not split into dp x micro_batches: use a "
            f"multiple of {mesh.dp * micro_batches}"
        )


def _mean(stage, group, divide, mixed=None, dtype=torch.float32):
    if mixed is not None:  # k31: the mean lands in the fp32 masters
        mixed.reduce_gradients(dtype, group)
        return
    for p in stage.parameters():
        dist.all_reduce(p.grad, group=group)
        p.grad /= divide


def _loss(run, count, mesh):
    return pipeline_mean(None if run.loss is None else run.loss * count, count, mesh, "pp")


def step_not_averaged(stage, tokens, targets, mesh, micro_batches=2):
    """Each replica keeps its own gradient."""
    run, count = _pipeline(stage, tokens, targets, mesh, micro_batches)
    return _loss(run, count, mesh)


def step_summed_over_dp(stage, tokens, targets, mesh, micro_batches=2):
    """The replicas' gradients all-reduced, never divided."""
    run, count = _pipeline(stage, tokens, targets, mesh, micro_batches)
    _mean(stage, mesh.dp_group, 1)
    return _loss(run, count, mesh)


def step_mean_on_the_tp_group(stage, tokens, targets, mesh, micro_batches=2):
    """The gradients' mean taken over the tp group."""
    run, count = _pipeline(stage, tokens, targets, mesh, micro_batches)
    _mean(stage, mesh.tp_group, mesh.dp)
    return _loss(run, count, mesh)


def step_whole_batch_on_every_replica(stage, tokens, targets, mesh, micro_batches=2):
    """Every replica runs the whole global batch (the mean is then the same)."""
    batches = list(zip(tokens.chunk(micro_batches), targets.chunk(micro_batches)))
    actions = gpipe_actions(mesh.pp, micro_batches, mesh.pp_index)
    loss_fn = functools.partial(vocab_parallel_cross_entropy, group=mesh.tp_group)
    run = run_schedule(stage, actions, batches, mesh.pp_group, loss_fn=loss_fn)
    _mean(stage, mesh.dp_group, mesh.dp)
    return _loss(run, targets.numel(), mesh)


def step_rows_by_tp_index(stage, tokens, targets, mesh, micro_batches=2):
    """The replica's rows picked by the tp index."""
    run, count = _pipeline(stage, tokens, targets, mesh, micro_batches, rows=mesh.tp_index)
    _mean(stage, mesh.dp_group, mesh.dp)
    return _loss(run, count, mesh)


def step_loss_of_its_replica(stage, tokens, targets, mesh, micro_batches=2):
    """The last stage's loss shared down the pipeline only."""
    run, _ = _pipeline(stage, tokens, targets, mesh, micro_batches)
    _mean(stage, mesh.dp_group, mesh.dp)
    loss = torch.tensor([run.loss if run.loss is not None else 0.0], dtype=torch.float64)
    dist.all_reduce(loss, group=mesh.pp_group)
    return loss.item()


def step_loss_on_the_last_stage_only(stage, tokens, targets, mesh, micro_batches=2):
    """The loss averaged over dp, returned where it was computed."""
    run, _ = _pipeline(stage, tokens, targets, mesh, micro_batches)
    _mean(stage, mesh.dp_group, mesh.dp)
    if run.loss is None:
        return None
    loss = torch.tensor([run.loss], dtype=torch.float64)
    dist.all_reduce(loss, group=mesh.dp_group)
    return loss.item() / mesh.dp


def step_loss_summed_over_dp(stage, tokens, targets, mesh, micro_batches=2):
    """The replicas' losses added, shared over dp and down the pipeline."""
    run, _ = _pipeline(stage, tokens, targets, mesh, micro_batches)
    _mean(stage, mesh.dp_group, mesh.dp)
    loss = torch.tensor([run.loss if run.loss is not None else 0.0], dtype=torch.float64)
    dist.all_reduce(loss, group=mesh.dp_group)
    dist.all_reduce(loss, group=mesh.pp_group)
    return loss.item()


def step_makes_the_dp_groups(stage, tokens, targets, mesh, micro_batches=2):
    """The dp groups made afresh every step (the same groups, on every rank)."""
    run, count = _pipeline(stage, tokens, targets, mesh, micro_batches)
    group = None
    for d in range(mesh.pp):
        for t in range(mesh.tp):
            ranks = [(d * mesh.dp + r) * mesh.tp + t for r in range(mesh.dp)]
            made = dist.new_group(ranks)
            group = made if dist.get_rank() in ranks else group
    _mean(stage, group, mesh.dp)
    return _loss(run, count, mesh)


def step_unchecked(stage, tokens, targets, mesh, micro_batches=2):
    """No check of the batch: an uneven one runs uneven micro-batches."""
    run, count = _pipeline(stage, tokens, targets, mesh, micro_batches)
    _mean(stage, mesh.dp_group, mesh.dp)
    return _loss(run, count, mesh)


def step_checked_after_the_pipeline(stage, tokens, targets, mesh, micro_batches=2):
    """The batch checked once the pipeline has run."""
    run, count = _pipeline(stage, tokens, targets, mesh, micro_batches)
    _check_batch(tokens, mesh, micro_batches)
    _mean(stage, mesh.dp_group, mesh.dp)
    return _loss(run, count, mesh)


class _Gathered(torch.autograd.Function):
    """Every tp rank's columns side by side (all_gather); backward, this rank's columns."""

    @staticmethod
    def forward(ctx, logits, group):
        parts = [torch.empty_like(logits) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, logits.contiguous(), group=group)
        ctx.rank, ctx.size = dist.get_rank(group), len(parts)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(ctx.size, dim=-1)[ctx.rank].contiguous(), None


def step_loss_gathers_the_logits(stage, tokens, targets, mesh, micro_batches=2):
    """The last stage's loss of the logits gathered over tp: the right numbers, V per token."""
    _check_batch(tokens, mesh, micro_batches)
    share = tokens.shape[0] // mesh.dp
    mine = slice(mesh.dp_index * share, (mesh.dp_index + 1) * share)
    batches = list(zip(tokens[mine].chunk(micro_batches), targets[mine].chunk(micro_batches)))
    actions = gpipe_actions(mesh.pp, micro_batches, mesh.pp_index)

    def gathered(logits, targets):
        return reference.transformer_loss(_Gathered.apply(logits, mesh.tp_group), targets)

    run = run_schedule(stage, actions, batches, mesh.pp_group, loss_fn=gathered)
    _mean(stage, mesh.dp_group, mesh.dp)
    return _loss(run, targets[mine].numel(), mesh)


def step_dp_mean_in_bf16(stage, tokens, targets, mesh, micro_batches=2, mixed=None):
    """bf16: the gradients' mean over dp summed in bf16 (k31's reduce_gradients told so)."""
    _check_batch(tokens, mesh, micro_batches)
    run, count = _pipeline(stage, tokens, targets, mesh, micro_batches, mixed=mixed)
    if mixed is None:
        _mean(stage, mesh.dp_group, mesh.dp)
    else:
        _mean(stage, mesh.dp_group, mesh.dp, mixed, dtype=mixed.compute_dtype)
    return _loss(run, count, mesh)


def step_per_parameter_mean(stage, tokens, targets, mesh, micro_batches=2, mixed=None):
    """Right: one all-reduce per parameter, each divided."""
    _check_batch(tokens, mesh, micro_batches)
    run, count = _pipeline(stage, tokens, targets, mesh, micro_batches, mixed=mixed)
    _mean(stage, mesh.dp_group, mesh.dp, mixed)
    return _loss(run, count, mesh)


def step_loss_by_hand(stage, tokens, targets, mesh, micro_batches=2, mixed=None):
    """Right: the loss's sum and count all-reduced over dp and pp only (not tp)."""
    _check_batch(tokens, mesh, micro_batches)
    run, count = _pipeline(stage, tokens, targets, mesh, micro_batches, mixed=mixed)
    _mean(stage, mesh.dp_group, mesh.dp, mixed)
    both = torch.zeros(2, dtype=torch.float64)
    if run.loss is not None:
        both[0], both[1] = run.loss * count, count
    dist.all_reduce(both, group=mesh.dp_group)
    dist.all_reduce(both, group=mesh.pp_group)
    return (both[0] / both[1]).item()


# --------------------------------------------------------------------------- bf16: k31's masters


class MastersInBF16(reference.MasterWeights):
    """bf16: the masters kept in bf16, copies of their own (the gradients rounded into them)."""

    def __init__(self, model, compute_dtype=torch.bfloat16):
        super().__init__(model, compute_dtype)
        self.masters = [nn.Parameter(m.detach().to(compute_dtype)) for m in self.masters]

    def reduce_gradients(self, reduce_dtype=torch.float32, process_group=None):
        for master, param in zip(self.masters, self.model.parameters()):
            mean = param.grad.float()
            dist.all_reduce(mean, group=process_group)
            master.grad = (mean / dist.get_world_size(process_group)).to(master.dtype)
            param.grad = None


class MastersAreTheBF16Copy(reference.MasterWeights):
    """bf16: the masters handed to the optimizer are the model's own bf16 parameters."""

    def __init__(self, model, compute_dtype=torch.bfloat16):
        super().__init__(model, compute_dtype)
        self.masters = list(model.parameters())

    def reduce_gradients(self, reduce_dtype=torch.float32, process_group=None):
        for param in self.model.parameters():
            mean = param.grad.float()
            dist.all_reduce(mean, group=process_group)
            param.grad = (mean / dist.get_world_size(process_group)).to(param.dtype)

    def masters_to_model(self):
        pass  # the model was stepped itself


# --------------------------------------------------------------------------- step 4: the norm


def _sliced(name, output=True):
    layer, _, kind = name.rpartition(".")
    style = next((s for planned, s in TP_PLAN.items() if layer.endswith(planned)), None)
    split = style == "column" or (style == "row" and kind == "weight")
    return split or (output and layer == "output")


def _clip(stage, mesh, max_norm, sharded, stages="pp"):
    pieces = [Piece(n, p.grad, sharded(n)) for n, p in stage.named_parameters()]
    return clip_grad_norm(pieces, max_norm, mesh, 2.0, stages=stages).item()


def clip_on_the_rank_alone(stage, mesh, max_norm=0.5):
    """torch's clip_grad_norm_ on the stage's own gradients."""
    return torch.nn.utils.clip_grad_norm_(stage.parameters(), max_norm).item()


def clip_everything_as_tp_slices(stage, mesh, max_norm=0.5):
    """Every parameter said to be sliced over tp: the copies counted on every tp rank."""
    return _clip(stage, mesh, max_norm, lambda n: ("tp",))


def clip_everything_as_copies(stage, mesh, max_norm=0.5):
    """Every parameter said to be a copy: only tp rank 0's slices counted."""
    return _clip(stage, mesh, max_norm, lambda n: ())


def clip_without_the_stages(stage, mesh, max_norm=0.5):
    """No pipeline named: the pp ranks taken for copies."""
    return _clip(stage, mesh, max_norm, lambda n: ("tp",) if _sliced(n) else (), stages=None)


def clip_counting_every_replica(stage, mesh, max_norm=0.5):
    """The dp replicas' (equal) gradients counted as parts: every copy once per replica."""
    return _clip(stage, mesh, max_norm, lambda n: ("dp", "tp") if _sliced(n) else ("dp",))


def clip_output_as_a_copy(stage, mesh, max_norm=0.5):
    """k28's plan alone read for the slices: the output layer's vocabulary rows taken for a
    copy, so only tp rank 0's rows are counted."""
    return _clip(stage, mesh, max_norm, lambda n: ("tp",) if _sliced(n, output=False) else ())


def clip_norm_only(stage, mesh, max_norm=0.5):
    """The global norm, the gradients never scaled."""
    pieces = [
        Piece(n, p.grad.clone(), ("tp",) if _sliced(n) else ()) for n, p in stage.named_parameters()
    ]
    return clip_grad_norm(pieces, max_norm, mesh, 2.0, stages="pp").item()


def clip_by_hand(stage, mesh, max_norm=0.5):
    """Right: the squares each rank must count, one all-reduce over the whole world, and the
    factor applied by hand."""
    counted = torch.zeros((), dtype=torch.float64)
    for name, p in stage.named_parameters():
        if _sliced(name) or mesh.tp_index == 0:
            if mesh.dp_index == 0:
                counted += p.grad.double().square().sum()
    dist.all_reduce(counted)
    norm = counted.sqrt().item()
    factor = min(1.0, max_norm / (norm + 1e-6))
    for p in stage.parameters():
        p.grad.mul_(factor)
    return norm


# --------------------------------------------------------------------------- the lists

_LINES = "test_mesh_groups_are_the_grid_s_lines"
_REFUSED = "test_a_mesh_that_does_not_fit_is_refused"
_SLICES = "test_each_stage_holds_its_blocks_tp_slices"
_FORWARD = "test_each_stage_s_forward_is_the_dense_model_s"
_RECOMPUTED = "test_a_recomputed_stage_runs_each_block_again_with_the_same_gradients"
_GRADS = "test_one_step_s_gradients_equal_one_process_s"
_LOSS = "test_the_loss_is_the_global_batch_s_on_every_rank"
_SHARE = "test_the_pipeline_carries_a_replica_s_share_on_the_pp_group"
_GATHER = "test_the_last_stage_holds_its_vocabulary_columns_and_never_gathers_them"
_GROUPS = "test_gradients_are_averaged_on_the_dp_group_and_no_group_is_made"
_BATCH = "test_a_batch_that_does_not_split_is_refused"
_SAME = "test_every_rank_clips_by_the_same_norm"
_NORM = "test_the_norm_equals_one_process_s"
_TRAINED = "test_three_steps_equal_one_process_s_loss_and_weights"
_BF16_DTYPES = "test_bf16_keeps_fp32_masters_sends_bf16_and_reduces_in_fp32"

MISTAKES = [
    Mistake(
        "mesh_dp_innermost",
        replaces="make_mesh",
        fails=[f"{_LINES}[2-2-1]"],
        says=["(pp_index, dp_index, tp_index) =", "tp innermost"],
    ),
    Mistake(
        "mesh_tp_and_dp_swapped",
        replaces="make_mesh",
        fails=[f"{_LINES}[2-2-1]"],
        says=["its tp_group holds ranks", "tp_group and dp_group swapped?"],
    ),
    Mistake(
        "mesh_pp_lines_consecutive",
        replaces="make_mesh",
        fails=[f"{_LINES}[1-2-2]"],
        says=["its pp_group holds ranks", "differ from it only in pp_index"],
    ),
    Mistake(
        "mesh_vague_error", replaces="make_mesh", fails=[_REFUSED], says=["name the world size"]
    ),
    Mistake(
        "mesh_checked_after_a_group",
        replaces="make_mesh",
        fails=[_REFUSED],
        says=["before its ValueError", "check the mesh first"],
    ),
    Mistake(
        "stage_not_split",
        replaces="build_stage",
        fails=[_SLICES],
        says=["holds the whole", "k28's TensorParallelBlock"],
    ),
    Mistake(
        "stage_by_dp_index",
        replaces="build_stage",
        fails=[_SLICES],
        says=["it should not and lacks", "k21's split_stages of the pp index"],
    ),
    Mistake(
        "OutputRowsInterleaved",
        replaces="VocabParallelOutput",
        fails=[_SLICES],
        says=["but not tp rank 0's", "words [r V/tp, (r+1) V/tp)", "k34's vocab_shard"],
    ),
    Mistake(
        "stage_split_over_the_world",
        replaces="build_stage",
        fails=[_FORWARD],
        says=["the stage's forward differs from the dense model's"],
    ),
    Mistake(
        "stage_recompute_ignored",
        replaces="build_stage",
        fails=[_RECOMPUTED],
        says=["did not run again in backward", "k32's checkpoint"],
    ),
    Mistake(
        "stage_checkpointed_wrapper",
        replaces="build_stage",
        fails=[_RECOMPUTED],
        says=["the names stay the model's", "Checkpointed puts the block under .module"],
    ),
    Mistake(
        "RecomputedFromADetachedInput",
        replaces="RecomputedBlock",
        fails=[_RECOMPUTED],
        says=["has no gradient after backward", "not detached"],
    ),
    Mistake(
        "RecomputedReentrant",
        replaces="RecomputedBlock",
        fails=[_RECOMPUTED],
        says=["has no gradient after backward", "use_reentrant=True"],
    ),
    Mistake(
        "step_not_averaged",
        replaces="forward_backward",
        fails=[_GRADS],
        says=["this replica's own gradient", "over the dp group"],
    ),
    Mistake(
        "step_summed_over_dp",
        replaces="forward_backward",
        fails=[_GRADS],
        says=["the SUM of the 2 replicas' gradients", "divides by dp"],
    ),
    Mistake(
        "step_mean_on_the_tp_group",
        replaces="forward_backward",
        fails=[_GRADS],
        says=["differs from one process's on the global batch"],
    ),
    Mistake(
        "step_rows_by_tp_index",
        replaces="forward_backward",
        fails=[_GRADS],
        says=["differs from one process's on the global batch"],
    ),
    Mistake(
        "step_loss_of_its_replica",
        replaces="forward_backward",
        fails=[_LOSS],
        says=["its own replica's loss", "every replica's tokens"],
    ),
    Mistake(
        "step_loss_on_the_last_stage_only",
        replaces="forward_backward",
        fails=[_LOSS],
        says=["returned None", "the first stage's too"],
    ),
    Mistake(
        "step_loss_summed_over_dp",
        replaces="forward_backward",
        fails=[_LOSS],
        says=["the sum of the 2 replicas' losses"],
    ),
    Mistake(
        "step_loss_gathers_the_logits",
        replaces="forward_backward",
        fails=[_GATHER],
        says=["gathered", "three numbers per token", "never the logits themselves"],
    ),
    Mistake(
        "step_whole_batch_on_every_replica",
        replaces="forward_backward",
        fails=[_SHARE],
        says=["sent the activations of 8 sequences", "every replica ran the whole batch"],
    ),
    Mistake(
        "step_makes_the_dp_groups",
        replaces="forward_backward",
        fails=[_GROUPS],
        says=["made 4 process group(s)", "made once, by make_mesh"],
    ),
    Mistake(
        "step_unchecked",
        replaces="forward_backward",
        fails=[_BATCH],
        says=["returned: raise ValueError", "a multiple of dp x micro_batches (4)"],
    ),
    Mistake(
        "step_checked_after_the_pipeline",
        replaces="forward_backward",
        fails=[_BATCH],
        says=["before its ValueError", "check first"],
    ),
    Mistake(
        "clip_on_the_rank_alone",
        replaces="clip_gradients",
        fails=[_SAME],
        says=["the same on every rank", "a rank's own pieces alone"],
    ),
    Mistake(
        "clip_everything_as_tp_slices",
        replaces="clip_gradients",
        fails=[_NORM],
        says=["step 1:", "counted once per tp rank"],
    ),
    Mistake(
        "clip_everything_as_copies",
        replaces="clip_gradients",
        fails=[_NORM],
        says=["step 1:", "only tp rank 0's slices counted"],
    ),
    Mistake(
        "clip_without_the_stages",
        replaces="clip_gradients",
        fails=[_NORM],
        says=["step 1:", "only the first stage's parameters counted"],
    ),
    Mistake(
        "clip_counting_every_replica",
        replaces="clip_gradients",
        fails=[_NORM],
        says=["step 1:", "the squares summed on every dp replica"],
    ),
    Mistake(
        "clip_output_as_a_copy",
        replaces="clip_gradients",
        fails=[_NORM],
        says=["step 1:", "the output layer's vocabulary rows counted as a copy"],
    ),
    Mistake(
        "clip_norm_only",
        replaces="clip_gradients",
        fails=[_NORM],
        says=["trained WITHOUT clipping"],
    ),
    Mistake(
        "step_dp_mean_in_bf16",
        replaces="forward_backward",
        fails=[_BF16_DTYPES],
        says=["dp replicas was all-reduced in [['bfloat16']]", "reduce in fp32"],
    ),
    Mistake(
        "MastersInBF16",
        replaces="MasterWeights",
        fails=[_BF16_DTYPES],
        says=["the master weights are ['torch.bfloat16']", "keep them fp32"],
    ),
    Mistake(
        "MastersAreTheBF16Copy",
        replaces="MasterWeights",
        fails=[_BF16_DTYPES],
        says=["are the stage's own bf16 parameters", "the optimizer steps the bf16 copy"],
    ),
]

RIGHT_ANSWERS = [
    RightAnswer("mesh_pp_lines_first", replaces="make_mesh"),
    RightAnswer("stage_by_hand", replaces="build_stage"),
    RightAnswer("RecomputedByTorch", replaces="RecomputedBlock"),
    RightAnswer("OutputByHand", replaces="VocabParallelOutput"),
    RightAnswer("step_per_parameter_mean", replaces="forward_backward"),
    RightAnswer("step_loss_by_hand", replaces="forward_backward"),
    RightAnswer("clip_by_hand", replaces="clip_gradients"),
]
