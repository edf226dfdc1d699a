"""k39 · The capstone: every dimension in one trainer.

THE IDEA
    Every kata so far cut one thing: the batch (k05, DDP), the weights inside a layer (k20,
    TP), the layers themselves (k21, PP), the numbers every rank must agree on (k33). A real
    run (Megatron-LM, torchtitan, picotron) does all of it at once, on ONE mesh of ranks. Here
    the tiny transformer (4 blocks, width 16, sequences of 8 tokens, 32 words) trains on 8
    ranks, ``pp 2 x dp 2 x tp 2``, built from your own pieces: k21's ``split_stages`` and
    ``run_schedule``, k28's ``TensorParallelBlock``, k32's ``checkpoint`` (every block
    recomputed in backward), k33's ``pipeline_mean`` and ``clip_grad_norm``, k34's
    ``vocab_shard``, ``CopyToVocabParallelRegion`` and ``vocab_parallel_cross_entropy`` (the
    output layer and the loss split by vocabulary), and in bf16 k31's ``MasterWeights``. So
    finish k21 (steps 1-3), k28 (step 2), k31 (steps 2-3), k32 (steps 2-3), k33 (steps 3-5)
    and k34 (steps 1 and 3-5) first: this kata runs your
    versions, and one not written yet stops it with that kata's step.

    The mesh: rank ``= (pp_index * dp + dp_index) * tp + tp_index`` (torch's
    ``init_device_mesh(("pp", "dp", "tp"))`` lays it out so): tp innermost, because its
    all-reduces run inside every layer and want the fastest links (one machine's GPUs).

                        stage 0 (embedding, blocks 0-1)    stage 1 (blocks 2-3, norm, output)
                        tp 0        tp 1                    tp 0        tp 1
            dp 0      rank 0  --  rank 1                  rank 4  --  rank 5
                        |  tp: f, g every block              |  tp: f, g every block
                        |  each block keeps its input only   |  (recomputed in backward);
                        |                                    |  output: words 0-15 | 16-31,
                        |                                    |  the loss from 3 numbers a token
            dp 1      rank 2  --  rank 3                  rank 6  --  rank 7
                      |___________________ pp: send/recv ___|
                rank 0 -> rank 4, rank 1 -> rank 5, ...: the same tp slice, the same data

        tp group  [0, 1] [2, 3] [4, 5] [6, 7]   slices of one layer, the same micro-batch
        dp group  [0, 2] [1, 3] [4, 6] [5, 7]   the same slice, different halves of the batch
        pp group  [0, 4] [1, 5] [2, 6] [3, 7]   consecutive stages, the same slice and data

    Every rank makes all 12 groups once, in the same order (``dist.new_group`` is a collective
    of the whole world), and never makes one again: a group made every step costs a rendezvous
    each time and, made by some ranks only, hangs them.

    Which collective on which group, in which order, for one step of rank 0 (stage 0) and of
    rank 4 (stage 1, the last):

        forward    rank 0: tp: all-reduce (g) x 2 per block    pp: send activations, per
                                                                   micro-batch (GPipe)
                   rank 4: pp: recv them; tp: all-reduce (g) x 2 per block; the output layer
                   gives this tp rank's 16 of the 32 words' logits, no call
        backward   rank 4, per micro-batch: the loss, tp: all-reduce MAX, SUM, SUM (k34: the
                   max, the sum of exponentials and the target's logit, per token); the output
                   layer's f, tp: all-reduce x 1 (the hidden state's gradient, summed over the
                   vocabulary's halves); per block, last first: tp: all-reduce (g) x 2 (the
                   recompute), then (f) x 2; pp: send the input's gradient
                   rank 0, per micro-batch: pp: recv the output's gradient; per block, last
                   first: tp: all-reduce (g) x 2 (its forward again: the recompute), then (f) x 2
        gradients  dp: one all-reduce of the stage's flat gradients (the mean of 2 replicas)
        loss       pp, dp, tp: all-reduce of (the last stage's token-loss sum, its count)
        norm       pp, dp, tp: all-reduce of the sum of squares each rank must count
        clip       nothing: every rank scales by the same factor

    The three global numbers of k33, on three dimensions at once:
    - the loss exists on the last stage only; it is the token-weighted mean over the dp
      replicas, and every stage reports the same number (``pipeline_mean``);
    - the gradient norm counts each element once: a TP slice's squares are summed over tp (the
      output layer's vocabulary rows are slices too), a replicated parameter (a LayerNorm, a
      row-parallel bias, the embedding, the final norm) is
      counted on tp rank 0 only and on dp rank 0 only (after the dp all-reduce every replica
      holds the same gradient), and the stages' sums are added over pp;
    - every rank clips by ``min(1, max_norm / (norm + 1e-6))`` of that one norm, so the copies
      of a parameter stay equal.
    Held against one process on the same global batch: after 3 steps the loss, the norm and
    every weight equal it, to rounding.

    Activation checkpointing (k32) on every block: a block keeps only its input, and its
    forward runs again in backward, when backward reaches it. With tensor parallelism the
    recompute is a forward like any other, its two g all-reduces with it, made by every tp rank
    at the same point of backward (they all run the same blocks in the same order), so a step
    makes 6 tp all-reduces per block and micro-batch instead of 4. The gradients are the same
    numbers: the same operations on the same input. Megatron-LM recomputes so
    (``--recompute-granularity full``); its selective granularity redoes only the attention's
    core, which holds no all-reduce. Pipelines make it pay twice: GPipe holds every
    micro-batch's activations until its backward (k21's peak), and each now holds one tensor
    per block.

    The vocabulary split (k34) on the last stage. Its output layer holds this tp rank's rows
    (``vocab_shard`` on the tp group: words [r V/tp, (r+1) V/tp)), so its forward gives this
    rank's columns of the logits only, (batch, 8, 16) of 32 words; its input goes through k34's
    f (``CopyToVocabParallelRegion``), whose backward sums over tp the hidden state's gradient
    that each half of the vocabulary sends back. The loss is then k34's
    ``vocab_parallel_cross_entropy`` on the tp group: k21's ``run_schedule`` takes it as its
    ``loss_fn`` (as torch's ``ScheduleGPipe(stage, n, loss_fn=...)`` does), so no rank ever
    gathers the logits: 3 floats a token over tp instead of V. The rows must be the ones the
    loss takes each rank's columns for (contiguous, in the tp group's order), and the norm
    counts them as the slices they are. At V = 32 this saves nothing; at Llama's 128 256 words
    the logits are the largest tensor a stage holds (k34's lesson).

    Mixed precision (k31) on the same mesh: ``--precision bf16``, the trainer given k31's
    ``MasterWeights`` of the stage (``mixed``). The stages compute in bf16, so what crosses pp
    is bf16, half the bytes of fp32 (k21's ``run_schedule`` receives into torch's default
    dtype: ``receiving_in`` makes it bf16); the loss is taken of the logits in fp32; the dp
    mean is k31's ``reduce_gradients`` in fp32 on the dp group, landing in the fp32 masters,
    which ``clip_gradients`` measures and scales (``Masters``: the masters under the stage's
    names) and the optimizer steps, its state fp32 too; k31's ``masters_to_model`` then rounds
    them into the bf16 stage. tp's all-reduces stay bf16: each rank's partial sum is rounded
    before they are added, where one process rounds its whole product once. So the run equals
    one process in the same policy only to bf16's rounding (epsilon 2^-8): after 3 steps the
    losses within 4e-3 (measured 1.5e-4), the norms within 2% (0.7%), the masters within a
    fifth of how far training moved them (measured: at most 0.043 of it; masters kept in bf16
    miss by 1.7 times it). That check is loose: one process in fp32 is as close (2.7e-4, the
    run 1.9e-4), and a dp mean in bf16 stays within it (0.033). What bf16 changes the tests
    hold by the dtypes: the masters and the optimizer's state fp32, the pp sends bf16 (2 bytes
    a value), the dp mean fp32. Masters kept in bf16, or an optimizer stepping the bf16 copy, lose the
    updates below half a bf16 weight's ulp; a dp mean in bf16 rounds every partial sum.

    Context parallelism (k26) is a fourth dimension for long sequences; at 8 tokens there is
    nothing to split, and picotron folds it into dp the same way: the cp ranks of a dp replica
    read different parts of the sequence and their gradients are averaged with dp's, over one
    group of dp x cp ranks.

    what torch offers for it, and when a practitioner chooses which dimension (P parameters,
    A activations of a micro-batch per layer, fp32, one step):

        dimension  torch                               bytes a rank sends      chosen when
        tp         parallelize_module(mesh["tp"])      4 all-reduces of A a    a layer is too big;
                                                       block, fwd and bwd      fast links only
        pp         torch.distributed.pipelining        A per micro-batch, to   the model is too
                   (PipelineStage, ScheduleGPipe)      one neighbour           deep; slow links ok
        dp         DDP, or fully_shard(mesh["dp"])     ~2 x 4P / (tp x pp)     always: more data
        cp         context_parallel(mesh["cp"])        K and V round the ring  sequences too long

    On a real cluster with torchrun, the same trainer runs unchanged but for three lines:
    ``torchrun --nnodes 2 --nproc-per-node 4 -m ...`` starts the ranks (k06), the process group
    is NCCL on ``cuda:LOCAL_RANK``, and the mesh keeps tp inside a node (tp <= GPUs per node)
    and pp or dp across nodes. torch builds the same groups with ``init_device_mesh("cuda",
    (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))`` and ``mesh["tp"].get_group()``.

STEPS
    1. ``make_mesh(dp, tp, pp)``: the 3-D mesh, every tp, dp and pp group made once by every
       rank in the same order; a ``ValueError`` when the mesh does not fit the world.
    2. ``build_stage(model, mesh, recompute)``: this rank's pipeline stage (k21's
       ``split_stages``) with every block split over the tp group (k28's
       ``TensorParallelBlock``), and with ``recompute`` a ``RecomputedBlock``: its forward
       through k32's ``checkpoint``; the last stage's output layer a ``VocabParallelOutput``
       (its vocabulary rows over tp, k34's pieces).
    3. ``forward_backward``: this dp replica's part of the global batch through the pipeline
       (k21's ``run_schedule``, GPipe, on the pp group, its loss k34's vocab-parallel
       cross-entropy on the tp group), the gradients averaged over dp, and
       the global loss on every rank (k33's ``pipeline_mean``); given ``mixed`` (k31's
       ``MasterWeights``), bf16 between the stages and the dp mean in fp32 into the masters.
    4. ``clip_gradients``: the global gradient norm (each parameter's squares once) and every
       rank clipping by the same factor (k33's ``clip_grad_norm``). ``train_step`` (written)
       is forward_backward, clip_gradients and the optimizer's step.

WHAT THE TESTS CHECK
    The groups of 2x2x1, 1x2x2 and 2x1x2 meshes on 4 ranks (indices, members, an all-reduce
    over each), the same as torch's ``init_device_mesh`` makes on the same world, and a
    ``ValueError`` naming the world size, before any group is made, for meshes that do not fit; each stage's parameters (names, tp slices, values) and its forward
    against the dense model on 4 ranks (tp 2 x pp 2), its calls on the tp group only, and the
    same stage recomputed: its names the model's, its gradients the same, each block's
    forward once in forward and once more in backward, the last stage's output layer holding
    its tp rank's vocabulary rows (k34's order) and its logits the matching columns; on 8
    ranks (dp 2 x tp 2 x pp 2), every block recomputed: one step's gradients and loss equal
    one process's on the same global batch, the last stage's logits its vocabulary columns
    only and never gathered, sends on the pp group carrying a dp replica's share, the
    gradients' mean on
    the dp group, no group made while training, a batch that does not split refused before
    anything is sent; 3 clipped SGD steps: every step's loss and
    norm and the weights after them equal one process's (with ``clip_grad_norm_``), every rank
    the same norm; the same trainer in bf16 on the same ranks (k31's masters, SGD with
    momentum): the stage bf16, the masters and the momentum fp32, the pp sends bf16 (2 bytes
    a value), the dp mean fp32, and 3 steps' losses, norms and masters equal one process's in
    the same policy to bf16's rounding; on 8 GPUs (NCCL, a GPU per rank), one clipped step's loss, norm and weights
    equal one process's; and the program, in fp32 and in bf16.

RUN IT
    .venv/bin/python -m katas.k39_capstone
    .venv/bin/python -m katas.k39_capstone --recompute    (every block recomputed in backward)
    .venv/bin/python -m katas.k39_capstone --trace traces    (the run's timeline: traces/*.png)
    .venv/bin/python -m katas.k39_capstone --precision bf16    (bf16, fp32 masters: k31)
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import inspect
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from dojo.console import run_program, say, verdict
from dojo.devices import rank_device
from dojo.launch import add_launch_arguments, launch_world
from dojo.toy_models import make_tokens, make_transformer, transformer_loss

from .k21_pipeline import Stage, gpipe_actions, run_schedule, split_stages
from .k28_fsdp_tp import TP_PLAN, TensorParallelBlock
from .k31_mixed_precision import MasterWeights
from .k32_activation_checkpointing import checkpoint
from .k33_global_numbers import Piece, clip_grad_norm, pipeline_mean
from .k34_vocab_parallel import CopyToVocabParallelRegion, vocab_parallel_cross_entropy, vocab_shard

BLOCKS = 4  # two a stage at pp = 2
MICRO_BATCHES = 2  # per dp replica and step
MAX_NORM = 0.5  # below the tiny transformer's gradient norms (~0.9): clipping bites
LR = 0.1
PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16}  # what the stages compute in
BF16_DRIFT = 0.2  # bf16: the masters' largest gap to one process over their largest movement

# --------------------------------------------------------------------------- written for you


@dataclass
class Mesh3D:
    """This rank's place in a ``pp x dp x tp`` grid: rank ``= (pp_index * dp + dp_index) * tp
    + tp_index``.

    ``tp_group``: the ranks that differ only in tp_index (slices of the same layers, the same
    data); ``dp_group``: only in dp_index (the same slice, other data); ``pp_group``: only in
    pp_index (the stages, in order). ``*_ranks`` list their members (global ranks, in order).

    It answers the questions k33's functions ask of torch's DeviceMesh (``mesh_dim_names``,
    ``get_group``, ``get_local_rank``, ``mesh[name].size()``), and k28's ``TensorParallelBlock``
    reads its ``tp``, ``tp_index`` and ``tp_group``."""

    dp: int
    tp: int
    pp: int
    dp_index: int
    tp_index: int
    pp_index: int
    dp_group: object = None
    tp_group: object = None
    pp_group: object = None
    dp_ranks: list[int] = field(default_factory=list)
    tp_ranks: list[int] = field(default_factory=list)
    pp_ranks: list[int] = field(default_factory=list)

    mesh_dim_names = ("pp", "dp", "tp")  # outermost first, as the ranks are laid out

    def get_group(self, name: str):
        return getattr(self, f"{name}_group")

    def get_local_rank(self, name: str) -> int:
        return getattr(self, f"{name}_index")

    def __getitem__(self, name: str) -> _Dimension:
        return _Dimension(getattr(self, name))


@dataclass
class _Dimension:
    length: int

    def size(self) -> int:
        return self.length


# --------------------------------------------------------------------------- step 1: the mesh


def make_mesh(dp: int, tp: int, pp: int) -> Mesh3D:
    """This rank's ``Mesh3D`` of a ``pp x dp x tp`` grid over the whole world.

    Every rank creates every tp group, every dp group and every pp group, in the same order,
    once; it keeps its own three. A ``ValueError`` saying what to do when ``dp``, ``tp`` or
    ``pp`` is not a positive int or their product is not the world size."""
    # BEGIN STEP 1: the 3-D mesh, each group made once
    # TODO: every rank creates the groups of every tp line, every dp line and every pp line of the
    # grid (rank = (pp_index * dp + dp_index) * tp + tp_index), the same groups in the same order on
    # every rank, and returns a Mesh3D with its three indices, its own three groups and their
    # members. A ValueError naming the world size when dp, tp or pp is not a positive int or dp x
    # tp x pp is not the world size, before any group is made. The tests all-reduce over the groups
    # of 2x2x1, 1x2x2 and 2x1x2 meshes on 4 ranks and check the members and indices, against
    # torch's init_device_mesh too.
    world = dist.get_world_size()
    for name, value in (("dp", dp), ("tp", tp), ("pp", pp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if dp * tp * pp != world:
        raise ValueError(
            f"a dp {dp} x tp {tp} x pp {pp} mesh needs {dp * tp * pp} ranks, but the world has "
            f"{world}: choose dp x tp x pp = {world} (or start {dp * tp * pp} ranks)"
        )
    rank = dist.get_rank()
    pp_index, rest = divmod(rank, dp * tp)
    dp_index, tp_index = divmod(rest, tp)

    def at(p: int, d: int, t: int) -> int:
        return (p * dp + d) * tp + t

    lines = {
        "tp": [[at(p, d, t) for t in range(tp)] for p in range(pp) for d in range(dp)],
        "dp": [[at(p, d, t) for d in range(dp)] for p in range(pp) for t in range(tp)],
        "pp": [[at(p, d, t) for p in range(pp)] for d in range(dp) for t in range(tp)],
    }
    mine = {}
    for name, members in lines.items():  # tp, dp, pp: the same order on every rank
        groups = [dist.new_group(ranks) for ranks in members]
        index = next(i for i, ranks in enumerate(members) if rank in ranks)
        mine[name] = (groups[index], members[index])
    return Mesh3D(
        dp=dp,
        tp=tp,
        pp=pp,
        dp_index=dp_index,
        tp_index=tp_index,
        pp_index=pp_index,
        dp_group=mine["dp"][0],
        tp_group=mine["tp"][0],
        pp_group=mine["pp"][0],
        dp_ranks=mine["dp"][1],
        tp_ranks=mine["tp"][1],
        pp_ranks=mine["pp"][1],
    )
    # END STEP 1


# --------------------------------------------------------------------------- step 2: the stage


class VocabParallelOutput(nn.Module):
    """The last stage's output layer with its rows split over the tp group by vocabulary, as
    k34 splits it: this tp rank's rows of the weight and the bias (``weight``, ``bias``: the
    model's names), so its forward gives this rank's columns of the logits only."""

    def __init__(self, output: nn.Linear, group: dist.ProcessGroup):
        super().__init__()
        self.group = group
        # BEGIN STEP 2: the stage: pipeline blocks split over tp
        # TODO: self.weight and self.bias, parameters holding this tp rank's rows of output's weight
        # and bias: the rows whose logits k34's vocab_parallel_cross_entropy on the group takes for
        # this rank's columns. The tests compare them with the dense model's rows.
        self.weight = nn.Parameter(vocab_shard(output.weight, group))
        self.bias = nn.Parameter(vocab_shard(output.bias, group))
        # END STEP 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # BEGIN STEP 2: the stage: pipeline blocks split over tp
        # TODO: this rank's columns of the logits of x (the same x on every tp rank), never the
        # whole logits; in backward, x's gradient is the sum of what every tp rank's columns send
        # back. The tests compare the logits with the dense model's columns and the gradients with
        # the same stage's recomputed.
        return nn.functional.linear(
            CopyToVocabParallelRegion.apply(x, self.group), self.weight, self.bias
        )
        # END STEP 2


class RecomputedBlock(TensorParallelBlock):
    """k28's ``TensorParallelBlock`` that keeps only its input for backward: its forward runs
    again there (k32's ``checkpoint``), the tp all-reduces of that forward with it. The same
    parameters under the same names (k32's ``Checkpointed`` would add ``module.`` to them)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # BEGIN STEP 2: the stage: pipeline blocks split over tp
        # TODO: the TensorParallelBlock's output for x, keeping nothing of its forward but x: the
        # forward runs again in backward, through k32's checkpoint. The tests count each block's
        # forwards (once in forward, once more in backward) and compare the gradients with a stage
        # that keeps everything.
        return checkpoint(super().forward, x)
        # END STEP 2


def build_stage(model: nn.Module, mesh: Mesh3D, recompute: bool = False) -> Stage:
    """This rank's stage of ``model`` (a TinyTransformer): k21's ``Stage`` of its pp index,
    each of its blocks a k28 ``TensorParallelBlock`` on the tp group (this tp rank's slices),
    a ``RecomputedBlock`` when ``recompute``; on the last stage the output layer a
    ``VocabParallelOutput`` (its vocabulary rows split over tp, k34); the embedding and the
    final norm whole (replicated over tp). Parameter names are the model's
    (``blocks.2.mlp.up.weight``, ``output.weight``)."""
    # BEGIN STEP 2: the stage: pipeline blocks split over tp
    # TODO: this rank's pipeline stage of the model (pp_index of pp consecutive stages), whose
    # every block is split over this rank's tp group (its tp_index's slices), and recomputed in
    # backward when recompute is true, and whose output layer (the last stage's) is split over the
    # tp group by vocabulary rows; parameter names the model's. The tests compare every
    # parameter with the dense model's slice, run each stage's forward against the dense model's on
    # 4 ranks (tp 2 x pp 2) and record its calls: all on the tp group; and run a recomputed stage's
    # forward and backward against the same stage's without recompute.
    split = RecomputedBlock if recompute else TensorParallelBlock
    stage = split_stages(model, mesh.pp, mesh.pp_index)
    for index, block in stage.blocks.items():
        stage.blocks[index] = split(block, mesh)
    if stage.output is not None:  # the last stage: its logits stay split by vocabulary
        stage.output = VocabParallelOutput(stage.output, mesh.tp_group)
    return stage
    # END STEP 2


# --------------------------------------------------------------------------- step 3: one step


@contextlib.contextmanager
def receiving_in(dtype: torch.dtype):
    """k21's ``run_schedule`` makes the buffers it receives activations into with
    ``torch.empty`` (torch's default dtype): within this block they are ``dtype``, the dtype
    the stages compute in, so a bf16 stage receives bf16 (a buffer of fp32 would be twice the
    bytes sent, and the send fails)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def forward_backward(
    stage: nn.Module,
    tokens: torch.Tensor,
    targets: torch.Tensor,
    mesh: Mesh3D,
    micro_batches: int = MICRO_BATCHES,
    mixed: MasterWeights | None = None,
) -> float:
    """Forward and backward of the GLOBAL batch ``(tokens, targets)`` (every rank is given
    all of it): this dp replica's part, rows ``[dp_index * b, (dp_index + 1) * b)`` with ``b =
    batch / dp``, cut into ``micro_batches`` and run through the pipeline (GPipe on the pp
    group); then every parameter's ``.grad`` is the mean over the dp replicas, the gradient of
    one process's loss on the whole batch. Returns that loss (the mean over every token of the
    batch), the same float on every rank. A ``ValueError`` when the batch does not split into
    dp x micro_batches equal parts.

    ``mixed``: k31's ``MasterWeights`` of a stage computing in bf16. The pipeline then carries
    bf16 (``receiving_in``), the loss is computed on the logits in fp32, and the dp mean is
    ``mixed.reduce_gradients`` in fp32: it lands in the fp32 masters' ``.grad``."""
    # BEGIN STEP 3: one step through the pipeline, averaged over dp, the loss everywhere
    # TODO: this dp replica's rows of the global batch (the same rows on every tp rank and stage),
    # in micro_batches micro-batches through the pipeline on the pp group, the last stage's loss the
    # cross-entropy of its vocabulary columns with no rank gathering the logits; afterwards every
    # .grad is the mean of the dp replicas' gradients (the gradient of the whole batch's mean loss),
    # and the return is the whole batch's mean token loss, the same float on every rank though only
    # the last stage computes one. A ValueError when the batch does not split into dp x
    # micro_batches equal parts. The tests run dp 2 x tp 2 x pp 2 on 8 ranks and compare the
    # gradients and the loss with one process on the global batch, record the sends on the pp group
    # (a replica's share of the batch), the logits' shape and no gather, the gradients' mean on the
    # dp group, and no group made. With mixed (k31's MasterWeights, the stage in bf16): the
    # activations received in bf16 (receiving_in), the loss of the logits in fp32, the dp mean k31's
    # reduce_gradients in fp32 on the dp group; the tests train 3 such steps on the same 8 ranks.
    rows = tokens.shape[0]
    if micro_batches < 1 or rows % (mesh.dp * micro_batches):
        raise ValueError(
            f"a batch of {rows} sequences does not split over dp = {mesh.dp} replicas x "
            f"{micro_batches} micro-batches: use a batch that is a multiple of "
            f"{mesh.dp * max(micro_batches, 1)}"
        )
    share = rows // mesh.dp
    mine = slice(mesh.dp_index * share, (mesh.dp_index + 1) * share)
    batches = list(zip(tokens[mine].chunk(micro_batches), targets[mine].chunk(micro_batches)))
    actions = gpipe_actions(mesh.pp, micro_batches, mesh.pp_index)
    # the last stage holds its columns of the logits: k34's loss of them, on the tp group
    loss_fn = functools.partial(vocab_parallel_cross_entropy, group=mesh.tp_group)
    if mixed is None:
        run = run_schedule(stage, actions, batches, mesh.pp_group, loss_fn=loss_fn)
    else:  # bf16 between the stages, the loss (a sum over the vocabulary) in fp32
        with receiving_in(mixed.compute_dtype):
            run = run_schedule(
                stage, actions, batches, mesh.pp_group, lambda y, t: loss_fn(y.float(), t)
            )
    grads = [p.grad for p in stage.parameters() if p.grad is not None]
    if mixed is not None:
        with torch.profiler.record_function("dp mean"):  # k31: summed in fp32, into the masters
            mixed.reduce_gradients(torch.float32, mesh.dp_group)
    else:
        with torch.profiler.record_function("dp mean"):  # one call for the whole stage
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=mesh.dp_group)
            flat /= mesh.dp
            start = 0
            for g in grads:
                g.copy_(flat[start : start + g.numel()].view_as(g))
                start += g.numel()
    count = targets[mine].numel()  # every token of the replica's share is a valid one
    loss_sum = None if run.loss is None else run.loss * count
    return pipeline_mean(loss_sum, count, mesh, "pp")
    # END STEP 3


# --------------------------------------------------------------------------- step 4: the norm


def clip_gradients(stage: nn.Module, mesh: Mesh3D, max_norm: float = MAX_NORM) -> float:
    """``clip_grad_norm_`` for the whole model spread over the mesh: the 2-norm of the whole
    model's gradient (every element once), the same on every rank, and every gradient of the
    stage scaled in place by ``min(1, max_norm / (norm + 1e-6))``. Returns the norm before
    clipping."""
    # BEGIN STEP 4: the global norm, one clipping factor
    # TODO: the norm of the whole model's gradient, each element counted once though tp ranks hold
    # slices of the split linears (the output layer's vocabulary rows among them) and copies of
    # everything else, the dp replicas hold copies and the stages hold different parameters; every
    # gradient of the stage scaled in place by the factor of that one norm, the same on every rank;
    # returns the norm (a float). The tests train 3 steps on 8 ranks and compare every step's norm
    # and the weights with one process's clip_grad_norm_, and the norms of all 8 ranks with each
    # other.
    pieces = []
    for name, parameter in stage.named_parameters():
        layer, _, kind = name.rpartition(".")
        style = next((s for planned, s in TP_PLAN.items() if layer.endswith(planned)), None)
        sliced = style == "column" or (style == "row" and kind == "weight") or layer == "output"
        pieces.append(Piece(name, parameter.grad, ("tp",) if sliced else ()))
    return clip_grad_norm(pieces, max_norm, mesh, 2.0, stages="pp").item()
    # END STEP 4


class Masters(nn.Module):
    """k31's fp32 masters of a bf16 stage under the stage's parameter names: what
    ``clip_gradients`` measures and scales, and the weights a run is compared by."""

    def __init__(self, stage: nn.Module, mixed: MasterWeights):
        super().__init__()
        self.named = list(zip([name for name, _ in stage.named_parameters()], mixed.masters))

    def named_parameters(self, *_, **__):
        return iter(self.named)

    def parameters(self, *_, **__):
        return (master for _, master in self.named)


def train_step(
    stage: nn.Module,
    optimizer: torch.optim.Optimizer,
    tokens: torch.Tensor,
    targets: torch.Tensor,
    mesh: Mesh3D,
    max_norm: float = MAX_NORM,
    mixed: MasterWeights | None = None,
) -> tuple[float, float]:
    """One training step on the global batch: ``(loss, norm before clipping)``. With
    ``mixed`` (k31's ``MasterWeights`` of the bf16 stage; ``optimizer`` steps its fp32
    masters): the norm and the clipping on the masters' fp32 gradients, and the stage's bf16
    weights the masters rounded afterwards (k31's ``masters_to_model``)."""
    loss = forward_backward(stage, tokens, targets, mesh, mixed=mixed)
    with torch.profiler.record_function("clip"):
        norm = clip_gradients(stage if mixed is None else Masters(stage, mixed), mesh, max_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if mixed is not None:
        mixed.masters_to_model()
    return loss, norm


# --------------------------------------------------------------------------- the program


def global_batch(dp: int, step: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s global batch: 2 sequences per micro-batch of every dp replica."""
    return make_tokens(2 * MICRO_BATCHES * dp, seed + 1 + step)


def one_process(dp: int, steps: int, seed: int, precision: str = "fp32") -> dict:
    """The same training on one process: losses, norms and the weights after ``steps``; in
    bf16, the same policy (k31's MasterWeights, the loss in fp32) and the masters' weights."""
    model = make_transformer(seed, blocks=BLOCKS)
    names = [name for name, _ in model.named_parameters()]
    mixed = None if precision == "fp32" else MasterWeights(model, PRECISIONS[precision])
    weights = model.parameters() if mixed is None else mixed.masters
    weights = list(weights)
    optimizer = torch.optim.SGD(weights, lr=LR)
    losses, norms = [], []
    for step in range(steps):
        tokens, targets = global_batch(dp, step, seed)
        loss = transformer_loss(model(tokens).float(), targets)
        loss.backward()
        if mixed is not None:
            mixed.gradients_to_masters()
        norms.append(torch.nn.utils.clip_grad_norm_(weights, MAX_NORM).item())
        losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if mixed is not None:
            mixed.masters_to_model()
    weights = {n: p.detach().clone() for n, p in zip(names, weights)}
    return {"losses": losses, "norms": norms, "weights": weights}


@contextlib.contextmanager
def _watched(mesh: Mesh3D, seen: list[str]):
    """Note every collective and send of the block as "group: call", in order."""
    originals = {}

    def which(group) -> str:
        named = {id(mesh.get_group(d)): d for d in mesh.mesh_dim_names}
        return named.get(id(group), "world")

    for name in ("all_reduce", "isend", "send", "recv", "irecv"):
        original = getattr(dist, name)
        originals[name] = original

        def watched(*args, _original=original, _name=name, **kwargs):
            arguments = inspect.signature(_original).bind_partial(*args, **kwargs).arguments
            seen.append(f"{which(arguments.get('group'))}: {_name.replace('_', '-')}")
            return _original(*args, **kwargs)

        setattr(dist, name, watched)
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def train_rank(
    rank: int,
    world_size: int,
    dp: int,
    tp: int,
    pp: int,
    steps: int,
    seed: int,
    recompute: bool,
    precision: str = "fp32",
):
    """Train ``steps`` steps on this rank's stage (its blocks recomputed in backward when
    ``recompute``; in bf16 with fp32 masters when ``precision`` is "bf16"); the losses, norms,
    the first step's calls in order, and this rank's parameters (its slices; in bf16 the
    masters) after training."""
    device = rank_device()
    mesh = make_mesh(dp, tp, pp)
    stage = build_stage(make_transformer(seed, blocks=BLOCKS).to(device), mesh, recompute)
    mixed = None if precision == "fp32" else MasterWeights(stage, PRECISIONS[precision])
    kept = stage if mixed is None else Masters(stage, mixed)  # what the optimizer steps
    optimizer = torch.optim.SGD(kept.parameters(), lr=LR)
    losses, norms, calls = [], [], []
    for step in range(steps):
        tokens, targets = (t.to(device) for t in global_batch(dp, step, seed))
        with _watched(mesh, calls) if step == 0 else contextlib.nullcontext():
            loss, norm = train_step(stage, optimizer, tokens, targets, mesh, mixed=mixed)
        losses.append(loss)
        norms.append(norm)
    weights = {n: p.detach().cpu().clone() for n, p in kept.named_parameters()}
    where = (mesh.pp_index, mesh.dp_index, mesh.tp_index)
    return {"mesh": where, "losses": losses, "norms": norms, "calls": calls, "weights": weights}


def _slice_of(name: str, whole: torch.Tensor, tp: int, tp_index: int) -> torch.Tensor:
    """The tp rank's slice of one process's parameter ``name`` (TP_PLAN's split; the output
    layer's vocabulary rows)."""
    layer, _, kind = name.rpartition(".")
    style = next((s for planned, s in TP_PLAN.items() if layer.endswith(planned)), None)
    if style == "column" or layer == "output":
        return whole.chunk(tp, dim=0)[tp_index]
    if style == "row" and kind == "weight":
        return whole.chunk(tp, dim=1)[tp_index]
    return whole


def _runs(calls: list[str]) -> str:
    """``pp: isend x2, tp: all-reduce x4, ...``: consecutive equal calls counted."""
    runs: list[list] = []
    for call in calls:
        if runs and runs[-1][0] == call:
            runs[-1][1] += 1
        else:
            runs.append([call, 1])
    return ", ".join(f"{call} x{n}" if n > 1 else call for call, n in runs)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description="The capstone: a tiny transformer trained on a pp x dp x tp mesh (the world "
        "is dp x tp x pp ranks: --world-size is not used), against one process."
    )
    add_launch_arguments(parser, world_size=8)
    parser.add_argument("--dp", type=int, default=2, help="data-parallel replicas")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks (1, 2 or 4)")
    parser.add_argument("--pp", type=int, default=2, help="pipeline stages (1, 2 or 4)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--recompute",
        action="store_true",
        help="keep only each block's input and run its forward again in backward (k32)",
    )
    parser.add_argument(
        "--precision",
        choices=tuple(PRECISIONS),
        default="fp32",
        help="bf16: compute in bf16 with fp32 master weights, the dp mean in fp32 (k31)",
    )
    args = parser.parse_args(argv)
    if args.dp < 1 or args.tp not in (1, 2, 4) or args.pp not in (1, 2, 4) or args.steps < 1:
        parser.error(
            "--dp and --steps must be at least 1, --tp must divide the 4 heads (1, 2 or 4) and "
            "--pp the 4 blocks (1, 2 or 4)"
        )
    world_size = args.dp * args.tp * args.pp
    say(
        None,
        f"pp {args.pp} x dp {args.dp} x tp {args.tp} on {world_size} ranks: stages on pp, "
        "replicas on dp, slices on tp; against one process on the same global batch"
        + ("; every block recomputed in backward" if args.recompute else "")
        + ("; in bf16, fp32 masters, the dp mean in fp32" if args.precision == "bf16" else ""),
    )
    results = launch_world(
        train_rank,
        world_size,
        args.dp,
        args.tp,
        args.pp,
        args.steps,
        args.seed,
        args.recompute,
        args.precision,
        backend=args.backend,
        device=args.device,
    )
    alone = one_process(args.dp, args.steps, args.seed, args.precision)
    for step in range(args.steps):
        say(
            None,
            f"step {step + 1}: loss {results[0]['losses'][step]:.6f} (one process "
            f"{alone['losses'][step]:.6f}), grad norm {results[0]['norms'][step]:.6f} (one "
            f"process {alone['norms'][step]:.6f}, clipped to {MAX_NORM})",
        )
    for rank in sorted({0, world_size - 1}):
        pp_index, dp_index, tp_index = results[rank]["mesh"]
        say(
            rank,
            f"(pp {pp_index}, dp {dp_index}, tp {tp_index}) one step's calls in order: "
            f"{_runs(results[rank]['calls'])}",
        )
    if not args.trace:
        say(None, "its timeline, a lane per rank: add --trace traces (then open traces/*.png)")
    gap = moved = 0.0
    first = dict(make_transformer(args.seed, blocks=BLOCKS).named_parameters())
    for result in results:
        _, _, tp_index = result["mesh"]
        for name, mine in result["weights"].items():
            want = _slice_of(name, alone["weights"][name], args.tp, tp_index)
            gap = max(gap, (mine - want).abs().max().item())
            was = _slice_of(name, first[name].detach(), args.tp, tp_index)
            moved = max(moved, (want - was).abs().max().item())
        if args.precision == "fp32":
            gap = max(gap, max(abs(a - b) for a, b in zip(result["losses"], alone["losses"])))
            gap = max(gap, max(abs(a - b) for a, b in zip(result["norms"], alone["norms"])))
    if args.precision == "fp32":
        return verdict(
            gap,
            f"after {args.steps} steps every rank's loss, grad norm and weights equal one "
            "process's",
            "the 3-D run differs from one process",
        )
    # bf16 rounds tp's partial sums and the activations sent otherwise than one process: the
    # masters are held to a fraction of how far training moved them, not to fp32's rounding
    return verdict(
        gap / moved,
        f"after {args.steps} steps every rank's fp32 masters are one process's in the same policy "
        f"to bf16's rounding: their gap over the weights' movement ({moved:.1e})",
        f"the bf16 run's masters differ from one process's by more than bf16's rounding (the "
        f"weights moved {moved:.1e}); their gap over that movement",
        tolerance=BF16_DRIFT,
    )


if __name__ == "__main__":
    run_program(main)
