"""k38 · The planner: memory, bytes and time of every layout, before anything runs.

THE IDEA
    Parts III-VII cut a model up in many ways: ZeRO shards the optimizer state (k18), the
    gradients and the parameters (k19); tensor parallelism splits each layer (k20, with the
    sequence along the activations: k25); a pipeline gives each rank some layers (k21);
    checkpointing keeps only a block's input (k32); mixed precision halves what travels (k31).
    A real run combines them, and before renting 8 GPUs for a week you want to know which
    combination fits in a GPU's memory and which is fastest. Everything that decides it is
    arithmetic on the model's shape: no GPU needed, and no guess either, because every number
    below is what the earlier katas' references hold and send (the tests measure them).

        a layout: dp x tp x pp = the world's GPUs, a ZeRO stage, recomputation, a precision

            model (layers, dim h, heads a, vocab V, sequence s; a step's batch of B
                   sequences, micro-batches of b: m = B / (dp b) per data-parallel rank)
              |
              +-- memory per rank = parameters + gradients + optimizer state + activations
              +-- bytes per step, per group (dp, tp, pp): what each collective carries
              +-- time = compute (6 N per token, at an MFU) and communication (at a bandwidth)
              |
            plan(model, world, hardware): every layout that fits, fastest first

    The parameters of a GPT of TinyTransformer's shape (Part IV's: untied, biases everywhere):
    a block holds 12 h^2 + 13 h (q, k, v, out: 4 h^2 + 4 h; up, down: 8 h^2 + 5 h; two
    LayerNorms: 4 h); the model adds the embedding (V h) and the norm and output (2 h + h V + V).
    Tensor parallelism splits 12 h^2 + 7 h of a block over tp ranks and keeps 6 h whole on each
    (the norms and the two row-parallel biases, k20 and k25); a pipeline gives the first stages
    one block more where the blocks do not divide (k21), the embedding to the first stage, the
    norm and output to the last.

    Bytes per parameter (the Ultra-Scale Playbook's "2 + 2 + 12" in mixed precision, Hugging
    Face, 2025; Adam's two moments):

        precision   parameter   gradient   optimizer state           collectives, activations
        fp32        4           4          8 (exp_avg, exp_avg_sq)   4
        bf16        2           2          12 (+ an fp32 master)     2

    ZeRO divides by dp what it shards, rounded up (a flat shard is padded, k19):

        stage   optimizer   gradients   parameters   dp's collectives a step (payload)
        0       whole       whole       whole        all-reduce the gradients (P)
        1       / dp        whole       whole        reduce-scatter (P), all-gather (P)
        2       / dp        / dp        whole        the same
        3       / dp        / dp        / dp         per micro-batch: all-gather the blocks
                                                      forward and again backward, the rest once
                                                      (the root stays gathered, as fully_shard's
                                                      does), reduce-scatter (P)

    Exact where the shards are: a flat shard (k19) or fully_shard's per-parameter rows split
    evenly when dp divides them; k18's ZeRO-1 gives whole parameters to owners, so a rank holds
    N / dp only where the owners balance (TinyTransformer's do on 2 ranks), else within the
    largest parameter of it.

    Activations per block and micro-batch, kept for backward (k32's formula, measured there):
    e (12 b s h + a b s^2 + 4 b s) bytes + s^2 for the causal mask (one bool a pair); with
    recomputation only the input, e b s h. Tensor and sequence parallelism divide the floats
    (not the mask) by tp (k25). A 1F1B pipeline's stage i keeps min(pp - i, m) micro-batches in
    flight. What travels, per layer and micro-batch under tp (k25's Megatron block): 6
    all-gathers and 4 reduce-scatters of b s h elements (two inputs are gathered again in
    backward), and once a step the 6 h whole parameters' gradients all-reduced; under pp, each
    micro-batch's activation forward and its gradient backward, b s h elements each.

    What a collective costs each rank in bytes sent, for a payload of B bytes over n ranks
    (a ring): all-reduce 2 (n - 1) / n B, all-gather and reduce-scatter (n - 1) / n B, a send B.

    Time. A step's compute is 6 N FLOPs per token (forward 2 N, backward 4 N; 8 N when the
    blocks are recomputed), spread over the world at a fraction of the peak (the MFU the kernels
    reach), stretched by the pipeline's bubble, (pp - 1) / m. Communication is bytes over the
    group's bandwidth. The kata models dp's traffic as overlapped with compute (DDP's buckets,
    FSDP's prefetch: k12, k19) and tp's and pp's as on the critical path (a layer waits for
    its all-gather; a stage for its input):

        step = max(compute, dp) + tp + pp          MFU = 6 N tokens / (step x world x peak)

    What it leaves out, on purpose: context and expert parallelism (k26, k22), the vocabulary
    split (k34), the activations of the logits and the loss, what a step holds for a moment (a
    ZeRO-3 unit's gathered weights, the block recomputed in backward) and the allocator's
    fragmentation: plan with a margin under the GPU's memory.

    What torch offers, and when a practitioner picks it (per rank, N parameters, fp32):

        torch's                memory                 sent a step (wire)      choose it when
        --------------------   --------------------   ---------------------   ------------------
        DDP (zero 0)           16 N                   ~2 x 4 N (all-reduce)   it fits
        ZeroRedundancy-        8 N + 8 N / dp         ~2 x 4 N (scatter,      the optimizer
        Optimizer (zero 1)                            gather)                 state does not fit
        fully_shard (zero 3)   16 N / dp              ~3 x 4 N (gathered      the parameters do
                                                      twice, scattered once)  not fit either
        parallelize_module     16 N / tp (nearly),    activations, 10 per     a layer's matmuls
        (tp, sequence split)   activations / tp       layer and micro-batch   are big; NVLink
        pipelining (pp)        16 N / pp (nearly)     activations, p2p only   slow links between
                                                                             nodes; many layers
        checkpoint             activations: inputs    nothing (33 % more      activations do not
                                                      FLOPs)                  fit

STEPS
    1. ``parameters_per_rank``: the parameters each pipeline stage's rank holds under tp and
       pp (a list, stage 0 first).
    2. ``memory_per_rank``: the busiest rank's parameters, gradients, optimizer state and
       activations under a layout (ZeRO stage, recomputation, precision).
    3. ``wire_bytes`` and ``step_traffic``: what one step puts into each group's collectives,
       and what each rank sends for it.
    4. ``step_time``: compute at an MFU and communication at a bandwidth, the bubble, the step's
       time and its MFU.
    5. ``plan``: every layout that fits a budget, fastest first (equal times: less memory
       first, then the order of the layouts given; ``every_layout``'s: tp, pp, ZeRO stage,
       recomputation, precision, each ascending), and bad layouts or budgets refused.
    The plumbing around them is yours to use: ``micro_batches`` (a data-parallel rank's
    micro-batches a step), ``_layers_of_stages`` (k21's cut), ``_check_layout`` (a layout's
    fields refused with a ValueError) and ``every_layout``.

WHAT THE TESTS CHECK
    Against the references, on TinyTransformer, measured on 2 ranks (numels and bytes counted,
    not trusted): the parameters k21's stages and k25's tensor-parallel block hold, and the
    micro-batches k21's 1F1B pipeline keeps in flight; what k19's FSDP (every block and the root
    a unit) and torch's ``fully_shard`` (the same units) hold of parameters, gradients and
    AdamW's moments, and what k18's ZeRO-1 holds of AdamW's moments; the bytes autograd saves in
    a block, plain, checkpointed (torch's checkpoint) and in k25's sequence-parallel block; the
    payloads of k19's and ``fully_shard``'s all-gathers and reduce-scatters (also gathering and
    reducing in bf16, ``MixedPrecisionPolicy``), k18's broadcasts, k25's collectives and k21's
    sends, recorded; each equal to the planner to the byte. By arithmetic: precisions, ZeRO
    stages, micro-batches in a pipeline, rounding up, the ring's factors, the bubble,
    recomputation's FLOPs, overlap, MFU, the plan's order and its budget; bad input (a tp that
    does not divide the heads, a layout whose product is not the world, a budget nothing fits)
    refused with a ValueError that says what to do; the program; on GPUs, ``fully_shard``'s bf16
    traffic over NCCL.

RUN IT
    .venv/bin/python -m katas.k38_planner
    .venv/bin/python -m katas.k38_planner --gpus 8 --memory-gib 40 --top 12
"""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from dojo.console import run_program, say, verdict
from dojo.launch import add_launch_arguments, launch_world
from dojo.todo import KataTodo
from dojo.toy_models import (
    HEADS,
    MODEL_DIM,
    SEQUENCE,
    VOCABULARY,
    make_tokens,
    make_transformer,
    transformer_loss,
)

PRECISIONS = ("fp32", "bf16")
# bytes of one parameter's: weight, gradient, optimizer state; and of an element that travels
# or is kept for backward (an activation)
BYTES = {"fp32": (4, 4, 8, 4), "bf16": (2, 2, 12, 2)}
ZERO_STAGES = (0, 1, 2, 3)
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "send")
GROUPS = ("dp", "tp", "pp")


@dataclass(frozen=True)
class Model:
    """A GPT of TinyTransformer's shape, and how it is fed: ``batch`` sequences of
    ``sequence`` tokens a step (the whole world's), in micro-batches of ``micro_batch``."""

    layers: int
    dim: int
    heads: int
    vocab: int
    sequence: int
    batch: int = 1
    micro_batch: int = 1


@dataclass(frozen=True)
class Layout:
    """How a world of ``dp * tp * pp`` GPUs runs the model."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 0  # ZeRO stage: 0 (DDP) to 3 (FSDP)
    recompute: bool = False  # every block checkpointed: only its input kept
    precision: str = "fp32"  # or "bf16": bf16 weights, gradients and traffic, fp32 master

    def __str__(self) -> str:
        extras = ["recompute"] if self.recompute else []
        return " ".join(
            [f"dp{self.dp}", f"tp{self.tp}", f"pp{self.pp}", f"zero{self.zero}", *extras,
             self.precision]
        )  # fmt: skip


@dataclass(frozen=True)
class Memory:
    """Bytes one rank holds."""

    parameters: int
    gradients: int
    optimizer: int
    activations: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer + self.activations


@dataclass(frozen=True)
class Hardware:
    """One GPU's peak ``flops`` (FLOP/s) and the fraction ``mfu`` its kernels reach, its
    ``memory`` (bytes), and the bytes per second each rank sends in each group."""

    flops: float
    mfu: float
    memory: int
    bandwidth: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Timing:
    """Seconds of one step: ``compute`` (the bubble included), ``communication`` per group
    (the slowest stage's), ``step``; and the ``mfu`` the step achieves."""

    compute: float
    communication: dict[str, float]
    step: float
    mfu: float


@dataclass(frozen=True)
class Plan:
    layout: Layout
    memory: Memory
    timing: Timing


def _positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def parameters_per_rank(model: Model, tp: int = 1, pp: int = 1) -> list[int]:
    """The parameters (elements) each rank of pipeline stage 0, 1, ... holds, ``model`` split
    over ``tp`` tensor-parallel ranks and ``pp`` stages."""
    # TODO: one int per pipeline stage, stage 0 first: the elements of the parameters a rank of
    # that stage holds, exactly as k25's tensor-parallel block (tp ranks) and k21's stages (pp)
    # hold them: blocks spread as k21 spreads them, the embedding on the first stage, the final
    # norm and output on the last, the vocabulary never split. A tp that does not divide the heads
    # or a pp above the layers (or anything not a positive int) is a ValueError saying what fits.
    # The tests count k21's and k25's parameters on 2 ranks and try 1 to 5 stages and tp up to 8.
    raise KataTodo("k38", 1, "the parameters each rank holds")


def _check_layout(layout: Layout) -> None:
    for name in ("dp", "tp", "pp"):
        _positive(f"layout.{name}", getattr(layout, name))
    if layout.zero not in ZERO_STAGES or isinstance(layout.zero, bool):
        raise ValueError(f"layout.zero={layout.zero!r}: a ZeRO stage is 0, 1, 2 or 3")
    if layout.precision not in PRECISIONS:
        raise ValueError(f"layout.precision={layout.precision!r}: choose 'fp32' or 'bf16'")
    if not isinstance(layout.recompute, bool):
        raise ValueError(f"layout.recompute={layout.recompute!r}: say True or False")


def micro_batches(model: Model, dp: int) -> int:
    """How many micro-batches each data-parallel rank runs a step: the batch split over dp
    ranks in micro-batches of ``model.micro_batch``; a ValueError where it does not divide."""
    for name in ("sequence", "batch", "micro_batch"):
        _positive(f"model.{name}", getattr(model, name))
    _positive("dp", dp)
    if model.batch % (dp * model.micro_batch):
        raise ValueError(
            f"a batch of {model.batch} sequences does not split into dp={dp} ranks x micro-"
            f"batches of {model.micro_batch}: choose a dp and micro-batch whose product divides "
            "the batch"
        )
    return model.batch // (dp * model.micro_batch)


def _layers_of_stages(model: Model, pp: int) -> list[int]:
    """The layers of each stage, as k21 cuts them (the first stages one more)."""
    size, extra = divmod(model.layers, pp)
    return [size + (stage < extra) for stage in range(pp)]


def memory_per_rank(model: Model, layout: Layout) -> Memory:
    """The bytes the busiest rank holds under ``layout``: the stage whose total is largest
    (ties: the first)."""
    # TODO: the Memory (parameters, gradients, optimizer, activations: bytes) of the pipeline stage
    # whose total is largest (ties: the earliest), from parameters_per_rank and the lesson's
    # tables: bytes per parameter by precision, what each ZeRO stage divides by dp (rounded up),
    # each block's activations per micro-batch (recomputed: the input only; tp divides the floats,
    # not the mask), stage i keeping min(pp - i, m) micro-batches. A ZeRO stage, precision or
    # recompute that is not one of the lesson's is a ValueError. The tests measure k19's FSDP,
    # torch's fully_shard, k18's ZeRO-1, a block's saved tensors and k21's micro-batches in flight
    # on 2 ranks, then check every term by arithmetic.
    raise KataTodo("k38", 2, "memory per rank under a layout")


def wire_bytes(collective: str, payload: int, ranks: int) -> int:
    """The bytes each of ``ranks`` ranks sends for one ``collective`` whose payload (the whole
    buffer: an all-reduce's tensor, an all-gather's output, a reduce-scatter's input) is
    ``payload`` bytes, in a ring; a ``send`` is its payload."""
    # TODO: what each rank sends for one collective of payload bytes over ranks ranks, in a ring,
    # as an int (rounded down): the lesson's factors for all_reduce, all_gather, reduce_scatter and
    # send. Another collective, a negative payload or fewer than 1 rank is a ValueError. The tests
    # hold it to the factors on 1 to 8 ranks.
    raise KataTodo("k38", 3, "the bytes of each group's collectives")


def step_traffic(model: Model, layout: Layout, stage: int = 0) -> dict[str, dict[str, int]]:
    """The payload bytes one step puts into each collective, per group ("dp", "tp", "pp"), on
    a rank of pipeline stage ``stage``: ``{"dp": {"all_reduce": 30592}, ...}``; a group of one
    rank moves nothing and is left out."""
    # TODO: for each group of more than one rank ("dp", "tp", "pp"), the payload bytes (whole
    # buffers) a rank of that pipeline stage puts into each kind of collective (COLLECTIVES) in one
    # step: dp's by ZeRO stage (ZeRO-3: per micro-batch, blocks gathered twice, the rest once), tp's
    # per layer and micro-batch as k25's block makes them plus its whole parameters' gradients once,
    # pp's sends (forward, backward), each in the precision's element size. A stage outside the
    # pipeline is a ValueError. The tests record k19's, fully_shard's (fp32 and bf16), k18's, k25's
    # and k21's collectives and sends on 2 ranks, then check the rest by arithmetic.
    raise KataTodo("k38", 3, "the bytes of each group's collectives")


def step_time(model: Model, layout: Layout, hardware: Hardware) -> Timing:
    """The seconds of one step under ``layout`` on ``hardware``, and the MFU it achieves."""
    # TODO: a Timing: compute = the step's FLOPs (6 N per token, 8 N recomputing; N every parameter
    # of the model, the tokens of every data-parallel rank's m micro-batches) over the world's GPUs
    # at hardware.flops x hardware.mfu, times the bubble (1 + (pp - 1) / m); communication per group
    # = the slowest stage's wire bytes over hardware.bandwidth[group]; step = max(compute, dp) + tp
    # + pp; mfu = 6 N tokens / (step x world x peak). A group without a bandwidth is a ValueError
    # naming it. The tests check each term by arithmetic.
    raise KataTodo("k38", 4, "time at a FLOP rate and a bandwidth")


def every_layout(model: Model, world: int) -> list[Layout]:
    """Every layout of ``world`` GPUs the model allows: tp dividing the heads, pp at most the
    layers, ZeRO only with dp > 1; in order of tp, pp, ZeRO stage, recomputation, precision."""
    _positive("world", world)
    layouts = []
    for tp in range(1, world + 1):
        for pp in range(1, world // tp + 1):
            if world % (tp * pp) or model.heads % tp or pp > model.layers:
                continue
            dp = world // (tp * pp)
            if model.batch % (dp * model.micro_batch):
                continue
            for zero in ZERO_STAGES if dp > 1 else (0,):
                for recompute in (False, True):
                    for precision in PRECISIONS:
                        layouts.append(Layout(dp, tp, pp, zero, recompute, precision))
    return layouts


def plan(
    model: Model,
    world: int,
    hardware: Hardware,
    budget: int | None = None,
    layouts: Sequence[Layout] | None = None,
) -> list[Plan]:
    """Every layout of ``layouts`` (None: ``every_layout``) whose busiest rank fits ``budget``
    bytes (None: the GPU's memory), fastest first."""
    # TODO: a Plan (layout, memory_per_rank, step_time) for each layout (None: every_layout(model,
    # world)) whose memory total is at most budget (None: hardware.memory), fastest step first;
    # equal steps: less memory first, then the order the layouts came in. A layout whose dp x tp x
    # pp is not world, or a budget that no layout fits, is a ValueError saying what to do (the
    # second naming the least memory a layout needs). The tests hold the order, the ties, the
    # budget's edge and the refusals.
    raise KataTodo("k38", 5, "the planner: what fits, fastest first")


# --------------------------------------------------------------------------- the program

GIB = 2**30
# A small GPT (~1.3 B parameters, GPT-2 XL's shape with a 2048-token context)
SMALL_GPT = Model(layers=24, dim=2048, heads=16, vocab=50304, sequence=2048, batch=64,
                  micro_batch=2)  # fmt: skip
# One node of H100s: bf16 dense peak, an MFU a tuned run reaches, NVLink for every group
H100_NODE = Hardware(flops=989e12, mfu=0.5, memory=80 * GIB,
                     bandwidth={"dp": 200e9, "tp": 200e9, "pp": 200e9})  # fmt: skip


def measure_fsdp(rank: int, world_size: int, seed: int) -> dict:
    """What torch's fully_shard (every block and the root) holds on this rank after one AdamW
    step of TinyTransformer: parameters, gradients and optimizer moments, in bytes."""
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")  # its output is a view
    model = make_transformer(seed)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens, targets = make_tokens(2, seed + rank)
    transformer_loss(model(tokens), targets).backward()
    optimizer.step()

    def local(tensor) -> int:
        tensor = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        return tensor.numel() * tensor.element_size()

    params = list(model.parameters())
    moments = [s[k] for s in optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")]
    held = {
        "parameters": sum(local(p) for p in params),
        "gradients": sum(local(p.grad) for p in params),
        "optimizer": sum(local(t) for t in moments),
    }
    dist.barrier()
    return held


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description="Plan a small GPT's layouts on one node: memory, bytes, time, the pick."
    )
    add_launch_arguments(parser, world_size=2)
    parser.add_argument("--gpus", type=int, default=8, help="GPUs to plan for (default 8)")
    parser.add_argument("--memory-gib", type=float, default=80.0, help="memory per GPU, GiB")
    parser.add_argument("--top", type=int, default=10, help="rows of the table (default 10)")
    args = parser.parse_args(argv)
    if args.gpus < 1 or args.memory_gib <= 0 or args.top < 1:
        parser.error("--gpus and --top must be at least 1 and --memory-gib above 0")
    if args.world_size < 1 or MODEL_DIM % args.world_size:
        parser.error(
            f"--world-size must divide {MODEL_DIM}, TinyTransformer's width, so that fully_shard "
            "splits every parameter evenly (1, 2, 4, 8 or 16)"
        )
    model = SMALL_GPT
    hardware = Hardware(H100_NODE.flops, H100_NODE.mfu, int(args.memory_gib * GIB),
                        H100_NODE.bandwidth)  # fmt: skip
    whole = sum(parameters_per_rank(model))
    say(
        None,
        f"a GPT of {whole / 1e9:.2f} B parameters ({model.layers} layers, dim {model.dim}, "
        f"{model.heads} heads, vocab {model.vocab}), {model.batch} sequences of {model.sequence} "
        f"tokens a step in micro-batches of {model.micro_batch}, on {args.gpus} "
        f"GPUs of {args.memory_gib:g} GiB, {hardware.flops / 1e12:.0f} TFLOP/s at MFU "
        f"{hardware.mfu:.0%}, {hardware.bandwidth['dp'] / 1e9:.0f} GB/s",
    )
    try:
        plans = plan(model, args.gpus, hardware)
    except ValueError as error:
        say(None, f"nothing fits: {error}")
        return 1
    total = len(every_layout(model, args.gpus))
    say(None, f"{len(plans)} of {total} layouts fit; the fastest {min(args.top, len(plans))}:")
    say(None, f"  {'layout':<34}{'GiB':>7}{'params':>8}{'optim':>7}{'activ':>7}"
        f"{'step s':>8}{'comm s':>8}{'MFU':>6}")  # fmt: skip
    for p in plans[: args.top]:
        m = p.memory
        say(
            None,
            f"  {str(p.layout):<34}{m.total / GIB:>7.1f}{m.parameters / GIB:>8.1f}"
            f"{m.optimizer / GIB:>7.1f}{m.activations / GIB:>7.1f}{p.timing.step:>8.3f}"
            f"{sum(p.timing.communication.values()):>8.3f}{p.timing.mfu:>6.0%}",
        )
    say(None, f"the pick: {plans[0].layout}")
    # the planner against what torch's fully_shard holds, measured on a small world
    tiny = Model(layers=2, dim=MODEL_DIM, heads=HEADS, vocab=VOCABULARY, sequence=SEQUENCE,
                 batch=2 * args.world_size)  # fmt: skip
    held = launch_world(measure_fsdp, args.world_size, 0, backend=args.backend, device=args.device)
    planned = memory_per_rank(tiny, Layout(dp=args.world_size, zero=3))
    gap = max(
        abs(rank[kind] - getattr(planned, kind))
        for rank in held
        for kind in ("parameters", "gradients", "optimizer")
    )
    say(
        None,
        f"TinyTransformer under fully_shard on {args.world_size} ranks: rank 0 holds "
        f"{held[0]['parameters']:,} + {held[0]['gradients']:,} + {held[0]['optimizer']:,} bytes "
        f"(parameters, gradients, moments); the planner says {planned.parameters:,} + "
        f"{planned.gradients:,} + {planned.optimizer:,}",
    )
    return verdict(
        gap,
        "the planner holds what fully_shard holds, to the byte",
        "the planner differs from what fully_shard holds",
        tolerance=0.5,
    )


if __name__ == "__main__":
    run_program(main)
