"""Benchmark: a training step of each Part IV, VI and VII kata against torch's own, on one world.

    python -m benchmarks.parallel                      # katas/ (yours), 2 ranks, gloo on CPU
    python -m benchmarks.parallel --impl solutions     # the reference implementations
    python -m benchmarks.parallel --only zero,tp --steps 40

Each row puts a kata's way next to torch's counterpart on the same world, the same model, the
same data and the same seeds:

    zero   k18's ShardedOptimizer(AdamW)       torch's ZeroRedundancyOptimizer(AdamW)
    fsdp   k19's FullyShardedModule + AdamW    torch's fully_shard (FSDP2) + AdamW
           (units as fully_shard's: each block one, the model the rest; prefetch on)
    tp     k20's ParallelMLP + SGD             parallelize_module(Colwise up, Rowwise down) + SGD
    pp     k21's 1F1B schedule + SGD           torch.distributed.pipelining's Schedule1F1B + SGD
           (at the toy model's own width: k21's stages send activations of that width)
    ipp    k27's interleaved 1F1B, 2 chunks    pipelining's ScheduleInterleaved1F1B + SGD
           a rank + SGD (the toy width)
    zbpp   k27's zero-bubble schedule + SGD    pipelining's ScheduleInterleavedZeroBubble + SGD
    sp     k25's SequenceParallelBlock + SGD   parallelize_module(SequenceParallel norms,
           (one block, 64 positions split       Colwise q, k, v and up, Rowwise out and down
           along the sequence)                  on Shard(1)) + SGD
    cp     k26's ring_attention, forward and   torch's own ring inside context_parallel (its
           backward, causal, 2048 tokens        private _templated_ring_attention, the CPU
           split head-tail                      kernel, all-to-all rotation, head-tail split)
    fp16   DDP with k30's fp16_hook + SGD      DDP with torch's fp16_compress_hook + SGD
    powersgd DDP with k30's powersgd_hook      DDP with torch's powerSGD_hook (rank 1, after
           (rank 1, after 2 plain steps)        2 plain steps; each all-reduce waited for before
                                                it chains: on gloo's CPU thread it deadlocks)
    fsdptp k28's FsdpTpTransformer on a        fully_shard(mesh["dp"]) over parallelize_module
           (world / 2) x 2 mesh + SGD           (mesh["tp"]) of one init_device_mesh + SGD
           (4 ranks or more: --world-size 4)
    vocab  k34's VocabParallelLM + SGD (the     parallelize_module(RowwiseParallel embedding,
           TinyTransformer, a vocabulary of     ColwiseParallel output on Shard(-1)) +
           16 384 split over the ranks)         F.cross_entropy under loss_parallel + SGD
    ckpt   DDP, every block through k32's      DDP, every block through torch.utils.checkpoint
           checkpoint + SGD                     (use_reentrant=False) + SGD; beside the times
                                                the activation bytes each way keeps (measured
                                                in an untimed step, saved_tensors_hooks)
    hsdp   k36's HsdpTransformer + AdamW on     fully_shard on init_device_mesh((replicate,
           a replicate x shard mesh (2 x N/2     shard), mesh_dim_names=("replicate", "shard"))
           from 4 ranks on, 1 x 2 on 2)         + AdamW: the same units, a block each and the
                                                model the rest
    mp     k31's MixedPrecisionFSDP + AdamW     fully_shard(mp_policy=MixedPrecisionPolicy(
           (bf16 gathers, fp32 reduce-scatters,  param_dtype=bf16, reduce_dtype=fp32)) + AdamW,
           a unit per block and the model's)     the same units, reshard_after_forward=False
    ulysses k35's ulysses_attention, forward   k26's ring_attention on the same inputs (torch
           and backward, causal, 2048 tokens,   has no Ulysses in core), head-tail split; both
           4 heads (all-to-all by heads)        held to one process's attention
    localsgd k37's local_sgd_step after SGD  PostLocalSGDOptimizer(SGD with momentum 0.9,
           (momentum 0.9): the parameters       PeriodicModelAverager(period=4)): the same
           averaged every 4 steps; this row's   averaging, torch's own; its step is the same
           step is a whole period (4 optimizer  period, and every period counts its average
           steps, then the average)

A step is everything one optimizer step needs (zero_grad, forward, backward, the
synchronisation, ``optimizer.step()``); its time is the slowest rank's, between two barriers. The
two ways take turns step by step, so a busy machine slows both alike; the table shows the median
step time of each and ``torch's time / yours`` (above 1: yours is faster), and beside them the
collectives each way calls in one step (sends and receives included; counted in an untimed
step after the timed ones, at the dispatcher, so DTensor's functional collectives count too: the
fixed cost of a call is what a small model's step mostly pays). Both ways must end with
the same weights (to a small tolerance: they add in different orders): a row that does not says
WRONG and the run fails. A kata not written yet is listed as such; a torch without the
counterpart skips that row, saying why.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import statistics
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks._timing import timed
from dojo.console import run_program, say
from dojo.devices import rank_device
from dojo.harness import impl
from dojo.launch import launch_world
from dojo.todo import KataTodo
from dojo.toy_models import (
    MLP,
    MODEL_DIM,
    Block,
    TinyTransformer,
    make_tokens,
    transformer_loss,
)

KATAS = {
    "zero": ("k18_zero", "ShardedOptimizer", "ZeroRedundancyOptimizer"),
    "fsdp": ("k19_fsdp", "FullyShardedModule", "fully_shard"),
    "tp": ("k20_tensor_parallel", "ParallelMLP", "parallelize_module"),
    "pp": ("k21_pipeline", "1F1B schedule", "pipelining Schedule1F1B"),
    "ipp": ("k27_interleaved_pipeline", "interleaved 1F1B", "ScheduleInterleaved1F1B"),
    "zbpp": ("k27_interleaved_pipeline", "zero bubble", "ScheduleInterleavedZeroBubble"),
    "sp": ("k25_sequence_parallel", "SequenceParallelBlock", "parallelize_module SP"),
    "cp": ("k26_ring_attention", "ring_attention", "context parallel's ring"),
    "fp16": ("k30_compressed_gradients", "fp16_hook", "fp16_compress_hook"),
    "powersgd": ("k30_compressed_gradients", "powersgd_hook", "powerSGD_hook"),
    "fsdptp": ("k28_fsdp_tp", "FsdpTpTransformer", "fully_shard x parallelize"),
    "vocab": ("k34_vocab_parallel", "VocabParallelLM", "loss_parallel"),
    "ckpt": ("k32_activation_checkpointing", "checkpoint", "torch.utils.checkpoint"),
    "mp": ("k31_mixed_precision", "MixedPrecisionFSDP", "fully_shard MixedPrecisionPolicy"),
    "hsdp": ("k36_hsdp_zero2", "HsdpTransformer", "fully_shard HSDP"),
    "ulysses": ("k35_ulysses", "ulysses_attention", "k26's ring_attention"),
    "localsgd": ("k37_fault_tolerance", "local_sgd_step", "PostLocalSGDOptimizer"),
}
TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}  # the ways add partial sums in different orders
LR = 1e-3


class Skip(Exception):
    """This torch lacks the counterpart: the row says why."""


def _model(args: argparse.Namespace, dim: int | None = None) -> TinyTransformer:
    torch.manual_seed(args.seed)  # the same start on every rank and for both ways
    return TinyTransformer(blocks=args.blocks, dim=dim or args.dim).to(rank_device())


def _batch(args: argparse.Namespace, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, targets = make_tokens(args.batch, seed=10_000 * step + rank)
    return tokens.to(rank_device()), targets.to(rank_device())


def _training_step(
    args: argparse.Namespace, model: nn.Module, optimizer: torch.optim.Optimizer
) -> Way:
    """One way's step: a fresh batch, forward, backward and the optimizer's step (what a row
    times for each side)."""
    rank = dist.get_rank()

    def step(number: int) -> None:
        optimizer.zero_grad()
        tokens, targets = _batch(args, number, rank)
        transformer_loss(model(tokens), targets).backward()
        optimizer.step()

    return step


def _average_gradients(model: nn.Module) -> None:
    size = dist.get_world_size()
    for param in model.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad)
            param.grad /= size


# Each comparison builds both ways on this rank and returns (yours, torch's, same): a step is
# ``way(step_number)``, ``same()`` says whether the two ended with the same weights.
Way = Callable[[int], None]


def _zero(kata, args) -> tuple[Way, Way, Callable[[], bool]]:
    try:
        from torch.distributed.optim import ZeroRedundancyOptimizer
    except ImportError as error:
        raise Skip(f"this torch has no ZeroRedundancyOptimizer ({error})") from None
    rank = dist.get_rank()
    models = [_model(args), _model(args)]
    optimizers = [
        kata.ShardedOptimizer(models[0].parameters(), torch.optim.AdamW, lr=LR),
        ZeroRedundancyOptimizer(models[1].parameters(), optimizer_class=torch.optim.AdamW, lr=LR),
    ]

    def way(index: int) -> Way:
        def step(number: int) -> None:
            model, optimizer = models[index], optimizers[index]
            optimizer.zero_grad()
            tokens, targets = _batch(args, number, rank)
            transformer_loss(model(tokens), targets).backward()
            _average_gradients(model)  # the same data-parallel gradients for both optimizers
            optimizer.step()

        return step

    def same() -> bool:
        return all(
            torch.allclose(a, b, **TOLERANCE)
            for a, b in zip(models[0].parameters(), models[1].parameters())
        )

    return way(0), way(1), same


def _fsdp(kata, args) -> tuple[Way, Way, Callable[[], bool]]:
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
    except ImportError as error:
        raise Skip(f"this torch has no fully_shard ({error})") from None
    rank, device = dist.get_rank(), rank_device()
    # the same units as torch's below: a block each, the model the rest (embedding, norm, output)
    yours = kata.FullyShardedModule(_model(args), shard_types=(Block, TinyTransformer))
    theirs = _model(args)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for block in theirs.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(theirs, mesh=mesh)
    # eps well above the gradients' rounding: Adam divides by sqrt(v) + eps, so with the default
    # an element whose gradient is rounding noise moves by a whole lr in either direction, and
    # two correct ways that reduce in other orders part after a few steps on 4 ranks
    optimizers = [
        torch.optim.AdamW(yours.parameters(), lr=LR, eps=1e-3),
        torch.optim.AdamW(theirs.parameters(), lr=LR, eps=1e-3),
    ]

    def step_yours(number: int) -> None:
        optimizers[0].zero_grad()
        tokens, targets = _batch(args, number, rank)
        transformer_loss(yours(tokens), targets).backward()
        yours.finish_gradient_synchronization()
        optimizers[0].step()

    def step_theirs(number: int) -> None:
        optimizers[1].zero_grad()
        tokens, targets = _batch(args, number, rank)
        transformer_loss(theirs(tokens), targets).backward()
        optimizers[1].step()

    def same() -> bool:
        full = yours.gather_full_params()
        return all(
            torch.allclose(full[name], param.full_tensor(), **TOLERANCE)
            for name, param in theirs.named_parameters()
        )

    return step_yours, step_theirs, same


def _tp(kata, args) -> tuple[Way, Way, Callable[[], bool]]:
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )
    except ImportError as error:
        raise Skip(f"this torch has no parallelize_module ({error})") from None
    device = rank_device()

    def dense() -> MLP:
        torch.manual_seed(args.seed)
        return MLP(args.dim, 4 * args.dim).to(device)

    yours = kata.ParallelMLP(dense())
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    theirs = parallelize_module(dense(), mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    optimizers = [
        torch.optim.SGD(yours.parameters(), lr=LR),
        torch.optim.SGD(theirs.parameters(), lr=LR),
    ]

    def way(module: nn.Module, optimizer: torch.optim.Optimizer) -> Way:
        def step(number: int) -> None:
            optimizer.zero_grad()
            # tensor parallel: every rank of the group sees the same tokens
            generator = torch.Generator().manual_seed(number)
            x = torch.randn(args.batch, 8, args.dim, generator=generator).to(device)
            module(x).square().mean().backward()
            optimizer.step()

        return step

    def same() -> bool:
        def local(t):
            return t.to_local() if hasattr(t, "to_local") else t

        return all(
            torch.allclose(local(getattr(theirs, layer).weight), getattr(yours, layer).weight)
            and torch.allclose(local(getattr(theirs, layer).bias), getattr(yours, layer).bias)
            for layer in ("up", "down")
        )

    return way(yours, optimizers[0]), way(theirs, optimizers[1]), same


def _pp(kata, args) -> tuple[Way, Way, Callable[[], bool]]:
    try:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    except ImportError as error:
        raise Skip(f"this torch has no torch.distributed.pipelining ({error})") from None
    rank, size, device = dist.get_rank(), dist.get_world_size(), rank_device()
    # k21's stages pass activations of the toy model's own width (MODEL_DIM) between ranks
    stages = [kata.split_stages(_model(args, MODEL_DIM), size, rank) for _ in range(2)]
    actions = kata.one_f_one_b_actions(size, args.micro_batches, rank)
    schedule = Schedule1F1B(
        PipelineStage(stages[1], rank, size, device), args.micro_batches, loss_fn=transformer_loss
    )
    optimizers = [torch.optim.SGD(stage.parameters(), lr=LR) for stage in stages]

    def micro_batches(number: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        # a pipeline's ranks all see the same batch: the first reads tokens, the last targets
        size_each = max(1, args.batch // args.micro_batches)
        return [
            tuple(t.to(device) for t in make_tokens(size_each, seed=1000 * number + i))
            for i in range(args.micro_batches)
        ]

    def step_yours(number: int) -> None:
        optimizers[0].zero_grad()
        kata.run_schedule(stages[0], actions, micro_batches(number))
        optimizers[0].step()

    def step_theirs(number: int) -> None:
        optimizers[1].zero_grad()
        batches = micro_batches(number)
        if rank == 0:
            schedule.step(torch.cat([tokens for tokens, _ in batches]))
        elif rank == size - 1:
            schedule.step(target=torch.cat([targets for _, targets in batches]))
        else:
            schedule.step()
        optimizers[1].step()

    def same() -> bool:
        return all(
            torch.allclose(a, b, **TOLERANCE)
            for a, b in zip(stages[0].parameters(), stages[1].parameters())
        )

    return step_yours, step_theirs, same


PP_CHUNKS = 2  # model chunks per rank in both rows


def _k27(kata, args, schedule_name: str, actions_name: str):
    try:
        from torch.distributed import pipelining
    except ImportError as error:
        raise Skip(f"this torch has no torch.distributed.pipelining ({error})") from None
    rank, size, device = dist.get_rank(), dist.get_world_size(), rank_device()
    # two copies of the same model, each cut into size * PP_CHUNKS virtual stages, this rank's PP_CHUNKS
    chunks = [kata.split_chunks(_model(args, MODEL_DIM), size, PP_CHUNKS, rank) for _ in range(2)]
    actions = getattr(kata, actions_name)(size, PP_CHUNKS, args.micro_batches, rank)
    stages = [
        pipelining.PipelineStage(chunk, c * size + rank, size * PP_CHUNKS, device)
        for c, chunk in enumerate(chunks[1])
    ]
    schedule = getattr(pipelining, schedule_name)(
        stages, args.micro_batches, loss_fn=transformer_loss
    )
    optimizers = [
        torch.optim.SGD([q for chunk in mine for q in chunk.parameters()], lr=LR) for mine in chunks
    ]

    def micro_batches(number: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        size_each = max(1, args.batch // args.micro_batches)
        return [
            tuple(t.to(device) for t in make_tokens(size_each, seed=1000 * number + i))
            for i in range(args.micro_batches)
        ]

    def step_yours(number: int) -> None:
        optimizers[0].zero_grad()
        kata.run_schedule(chunks[0], actions, micro_batches(number))
        optimizers[0].step()

    def step_theirs(number: int) -> None:
        optimizers[1].zero_grad()
        batches = micro_batches(number)
        if rank == 0:  # virtual stage 0 (tokens) is rank 0's; the last (targets) rank size - 1's
            schedule.step(torch.cat([tokens for tokens, _ in batches]))
        elif rank == size - 1:
            schedule.step(target=torch.cat([targets for _, targets in batches]))
        else:
            schedule.step()
        optimizers[1].step()

    def same() -> bool:
        return all(
            torch.allclose(a, b, **TOLERANCE)
            for mine, theirs in zip(chunks[0], chunks[1])
            for a, b in zip(mine.parameters(), theirs.parameters())
        )

    return step_yours, step_theirs, same


def _ipp(kata, args) -> tuple[Way, Way, Callable[[], bool]]:
    return _k27(kata, args, "ScheduleInterleaved1F1B", "interleaved_actions")


def _zbpp(kata, args) -> tuple[Way, Way, Callable[[], bool]]:
    return _k27(kata, args, "ScheduleInterleavedZeroBubble", "zero_bubble_actions")


SP_LENGTH = 64  # positions per sequence: 32 per rank on 2 ranks


def _sp(kata, args) -> tuple[Way, Way, Callable[[], bool]]:
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            PrepareModuleInput,
            RowwiseParallel,
            SequenceParallel,
            parallelize_module,
        )
    except ImportError as error:
        raise Skip(f"this torch has no SequenceParallel ({error})") from None
    rank, size, device = dist.get_rank(), dist.get_world_size(), rank_device()
    length = SP_LENGTH

    def dense() -> Block:
        torch.manual_seed(args.seed)
        return Block(args.dim).to(device)

    yours = kata.SequenceParallelBlock(dense())
    mesh = init_device_mesh(device.type, (size,))
    plan = {  # torchtitan's plan for a Llama block, on this block's names
        "attention_norm": SequenceParallel(),
        "attention": PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
        ),
        "attention.query": ColwiseParallel(),
        "attention.key": ColwiseParallel(),
        "attention.value": ColwiseParallel(),
        "attention.out": RowwiseParallel(output_layouts=Shard(1)),
        "mlp_norm": SequenceParallel(),
        "mlp.up": ColwiseParallel(input_layouts=Shard(1)),
        "mlp.down": RowwiseParallel(output_layouts=Shard(1)),
    }
    theirs = parallelize_module(dense(), mesh, plan)
    optimizers = [
        torch.optim.SGD(yours.parameters(), lr=LR),
        torch.optim.SGD(theirs.parameters(), lr=LR),
    ]
    share = length // size

    def positions(number: int) -> torch.Tensor:
        # sequence parallel: every rank reads the same sequences, its own positions of them
        generator = torch.Generator().manual_seed(number)
        x = torch.randn(args.batch, length, args.dim, generator=generator)
        return x[:, rank * share : (rank + 1) * share].contiguous().to(device)

    def step_yours(number: int) -> None:
        optimizers[0].zero_grad()
        yours(positions(number)).square().mean().backward()
        kata.sync_sequence_parallel_grads(yours)  # the LayerNorms' and row biases' partial sums
        optimizers[0].step()

    def step_theirs(number: int) -> None:
        optimizers[1].zero_grad()
        y = theirs(positions(number))
        (y.to_local() if hasattr(y, "to_local") else y).square().mean().backward()
        optimizers[1].step()  # DTensor sums the Partial(sum) LayerNorm gradients here

    def same() -> bool:
        def local(t):
            return t.to_local() if hasattr(t, "to_local") else t

        mine = dict(yours.named_parameters())
        return all(
            torch.allclose(mine[name], local(param), **TOLERANCE)
            for name, param in theirs.named_parameters()
        )

    return step_yours, step_theirs, same


CP_LENGTH = 2048  # tokens of the whole sequence (each rank holds LENGTH / world_size)


def _cp(kata, args: argparse.Namespace) -> tuple[Way, Way, Callable[[], bool]]:
    try:
        from torch.distributed.tensor.experimental._context_parallel import _attention as cp
    except ImportError as error:
        raise Skip(f"this torch has no context-parallel ring ({error})") from None
    if not all(
        hasattr(cp, name)
        for name in ("_templated_ring_attention", "_templated_ring_attention_backward")
    ) or not hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"):
        raise Skip("this torch's context-parallel ring or CPU attention kernel has moved")
    rank, size, device = dist.get_rank(), dist.get_world_size(), rank_device()
    if device.type != "cpu":
        raise Skip("the row runs torch's ring with its CPU kernel: run it on the CPU")
    cp.set_rotate_method("alltoall")  # the ring (context_parallel's default is an all-gather)
    cp._cp_options.enable_load_balance = True  # head-tail: chunks r and 2N - 1 - r
    heads = 4
    generator = torch.Generator().manual_seed(args.seed)
    whole = [
        torch.randn(1, heads, CP_LENGTH, args.dim // heads, generator=generator) for _ in range(4)
    ]
    layout = kata.chunk_layout(size, balanced=True)
    q, k, v, grad = (kata.shard_sequence(t, layout, rank).to(device) for t in whole)
    results: dict[str, list[torch.Tensor]] = {}
    aten = torch.ops.aten

    def step_yours(number: int) -> None:
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = kata.ring_attention(*leaves, layout, True)
        out.backward(grad)
        results["yours"] = [out.detach(), *(t.grad for t in leaves)]

    def step_theirs(number: int) -> None:
        group = dist.group.WORLD
        out, lse = cp._templated_ring_attention(
            group, 2, aten._scaled_dot_product_flash_attention_for_cpu, q, k, v,
            is_causal=True, dropout_p=0.0,
        )  # fmt: skip
        dq, dk, dv = cp._templated_ring_attention_backward(
            group, 2, aten._scaled_dot_product_flash_attention_for_cpu_backward.default, grad,
            "grad_out", q, k, v, out, lse, is_causal=True, dropout_p=0.0,
        )[:3]  # fmt: skip
        results["theirs"] = [out, dq, dk, dv]

    def same() -> bool:
        return all(
            torch.allclose(a, b, rtol=1e-4, atol=1e-5)
            for a, b in zip(results["yours"], results["theirs"])
        )

    return step_yours, step_theirs, same


def _ulysses(kata, args: argparse.Namespace) -> tuple[Way, Way, Callable[[], bool]]:
    """Ulysses against k26's ring (the same implementation package) on the same whole sequence,
    each held to one process's attention: torch has no Ulysses to compare with."""
    ring = importlib.import_module(kata.__name__.rpartition(".")[0] + ".k26_ring_attention")
    rank, size, device = dist.get_rank(), dist.get_world_size(), rank_device()
    heads = 4
    if heads % size:
        raise Skip(f"{heads} heads do not split over {size} ranks")
    generator = torch.Generator().manual_seed(args.seed)
    whole = [
        torch.randn(1, heads, CP_LENGTH, args.dim // heads, generator=generator) for _ in range(4)
    ]
    leaves = [t.clone().requires_grad_() for t in whole[:3]]
    expected = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=True)
    expected.backward(whole[3])
    wanted = [expected.detach(), *(t.grad for t in leaves)]
    mine = [kata.sequence_slice(t, rank, size).to(device) for t in whole]
    layout = ring.chunk_layout(size, balanced=True)
    ring_shards = [ring.shard_sequence(t, layout, rank).to(device) for t in whole]
    results: dict[str, list[torch.Tensor]] = {}

    def step_yours(number: int) -> None:
        q, k, v = (t.clone().requires_grad_() for t in mine[:3])
        out = kata.ulysses_attention(q, k, v, True)
        out.backward(mine[3])
        results["yours"] = [out.detach(), q.grad, k.grad, v.grad]

    def step_theirs(number: int) -> None:
        q, k, v = (t.clone().requires_grad_() for t in ring_shards[:3])
        out = ring.ring_attention(q, k, v, layout, True)
        out.backward(ring_shards[3])
        results["theirs"] = [out.detach(), q.grad, k.grad, v.grad]

    def same() -> bool:
        ulysses_wanted = [kata.sequence_slice(t, rank, size) for t in wanted]
        ring_wanted = [ring.shard_sequence(t, layout, rank) for t in wanted]
        return all(
            torch.allclose(a.cpu(), b, rtol=1e-4, atol=1e-5)
            for got, want in ((results["yours"], ulysses_wanted), (results["theirs"], ring_wanted))
            for a, b in zip(got, want)
        )

    return step_yours, step_theirs, same


@contextlib.contextmanager
def _finished():
    """Each async all-reduce waits before it returns (torch's powerSGD_hook on gloo CPU)."""
    original = dist.all_reduce

    def finished(*args, **kwargs):
        work = original(*args, **kwargs)
        if kwargs.get("async_op") and work is not None:
            work.wait()
        return work

    dist.all_reduce = finished
    try:
        yield
    finally:
        dist.all_reduce = original


def _torch_powersgd(state, bucket):
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import powerSGD_hook

    with _finished():
        return powerSGD_hook(state, bucket)


def _powersgd(kata, args) -> tuple[Way, Way, Callable[[], bool]]:
    try:
        from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState
        from torch.nn.parallel import DistributedDataParallel
    except ImportError as error:
        raise Skip(f"this torch has no PowerSGD hook ({error})") from None
    models = [_model(args), _model(args)]
    wrapped = []
    for model, hook in zip(models, (kata.powersgd_hook, _torch_powersgd)):
        ddp = DistributedDataParallel(model)
        state = PowerSGDState(
            ddp.process_group, matrix_approximation_rank=1, start_powerSGD_iter=2, random_seed=0
        )
        ddp.register_comm_hook(state, hook)
        wrapped.append(ddp)
    optimizers = [torch.optim.SGD(ddp.parameters(), lr=LR) for ddp in wrapped]

    def way(index: int) -> Way:
        return _training_step(args, wrapped[index], optimizers[index])

    def same() -> bool:
        return all(
            torch.allclose(a, b, **TOLERANCE)
            for a, b in zip(models[0].parameters(), models[1].parameters())
        )

    return way(0), way(1), same


def _fp16(kata, args) -> tuple[Way, Way, Callable[[], bool]]:
    """A second row, if wanted: KATAS["fp16"] = ("k30_compressed_gradients", "fp16_hook",
    "fp16_compress_hook"); bitwise the same weights, half plain DDP's bytes."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
    from torch.nn.parallel import DistributedDataParallel

    models = [_model(args), _model(args)]
    wrapped = []
    for model, hook in zip(models, (kata.fp16_hook, fp16_compress_hook)):
        ddp = DistributedDataParallel(model)
        ddp.register_comm_hook(ddp.process_group, hook)
        wrapped.append(ddp)
    optimizers = [torch.optim.SGD(ddp.parameters(), lr=LR) for ddp in wrapped]

    def way(index: int) -> Way:
        return _training_step(args, wrapped[index], optimizers[index])

    def same() -> bool:
        return all(
            torch.equal(a, b) for a, b in zip(models[0].parameters(), models[1].parameters())
        )

    return way(0), way(1), same


def _fsdptp(kata, args) -> tuple[Way, Way, Callable[[], bool]]:
    size = dist.get_world_size()
    if size < 4 or size % 2:
        raise Skip(
            f"a 2-D mesh needs rows of 2 ranks, 2 rows at least: --world-size 4 (not {size})"
        )
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )
    except ImportError as error:
        raise Skip(f"this torch has no fully_shard or parallelize_module ({error})") from None
    dp, tp = size // 2, 2
    mesh = kata.make_mesh(dp, tp)
    yours = kata.FsdpTpTransformer(_model(args), mesh)  # it copies the model
    theirs = _model(args)
    device_mesh = init_device_mesh(rank_device().type, (dp, tp), mesh_dim_names=("dp", "tp"))
    plan = {
        name: ColwiseParallel() if style == "column" else RowwiseParallel()
        for name, style in kata.TP_PLAN.items()
    }
    for block in theirs.blocks:
        parallelize_module(block, device_mesh["tp"], plan)
        fully_shard(block, mesh=device_mesh["dp"])
    fully_shard(theirs, mesh=device_mesh["dp"])
    optimizers = [torch.optim.SGD(m.parameters(), lr=LR) for m in (yours, theirs)]

    def tokens_of(number: int) -> tuple[torch.Tensor, torch.Tensor]:
        # the global batch, the same on every rank: a row of the mesh reads its part of it
        tokens, targets = make_tokens(args.batch * dp, seed=10_000 * number)
        return tokens.to(rank_device()), targets.to(rank_device())

    def step_yours(number: int) -> None:
        kata.train_step(yours, optimizers[0], *tokens_of(number), mesh)

    def step_theirs(number: int) -> None:
        tokens, targets = tokens_of(number)
        part = slice(mesh.dp_index * args.batch, (mesh.dp_index + 1) * args.batch)
        optimizers[1].zero_grad()
        transformer_loss(theirs(tokens[part]), targets[part]).backward()
        optimizers[1].step()

    def same() -> bool:
        full = kata.full_state(yours, mesh)
        # full_tensor() of a 2-D sharding warns that it gathers twice: it is what a check needs
        logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
        return all(
            torch.allclose(full[name], param.full_tensor(), **TOLERANCE)
            for name, param in theirs.named_parameters()
        )

    return step_yours, step_theirs, same


VP_VOCAB = 16_384  # the vocab row's words: 8 192 a rank on 2 ranks


def _vocab(kata, args) -> tuple[Way, Way, Callable[[], bool]]:
    size = dist.get_world_size()
    if VP_VOCAB % size:
        raise Skip(f"{VP_VOCAB} words do not split over {size} ranks")
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            loss_parallel,
            parallelize_module,
        )
    except ImportError as error:
        raise Skip(f"this torch has no loss_parallel ({error})") from None
    device = rank_device()

    def dense() -> TinyTransformer:
        torch.manual_seed(args.seed)
        return TinyTransformer(args.blocks, args.dim, VP_VOCAB).to(device)

    yours = kata.VocabParallelLM(dense())
    mesh = init_device_mesh(device.type, (size,))
    plan = {
        "embedding": RowwiseParallel(input_layouts=Replicate()),
        "output": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    }
    theirs = parallelize_module(dense(), mesh, plan)
    optimizers = [
        torch.optim.SGD(yours.parameters(), lr=LR),
        torch.optim.SGD(theirs.parameters(), lr=LR),
    ]

    def tokens(number: int) -> tuple[torch.Tensor, torch.Tensor]:
        # tensor parallel: every rank reads the same tokens
        generator = torch.Generator().manual_seed(number)
        stream = torch.randint(0, VP_VOCAB, (args.batch, 9), generator=generator).to(device)
        return stream[:, :-1], stream[:, 1:]

    def step_yours(number: int) -> None:
        optimizers[0].zero_grad()
        yours(*tokens(number)).backward()
        optimizers[0].step()

    def step_theirs(number: int) -> None:
        optimizers[1].zero_grad()
        inputs, targets = tokens(number)
        logits = theirs(inputs)
        with loss_parallel():  # backward must run inside it too
            nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
        optimizers[1].step()

    def same() -> bool:
        def local(t):
            return t.to_local() if hasattr(t, "to_local") else t

        mine = dict(yours.named_parameters())
        return all(
            torch.allclose(mine[name], local(param), **TOLERANCE)
            for name, param in theirs.named_parameters()
        )

    return step_yours, step_theirs, same


class _Through(nn.Module):
    """``block`` run as ``checkpoint(block, x)`` says: a way of checkpointing, one block."""

    def __init__(self, block: nn.Module, checkpoint: Callable):
        super().__init__()
        self.block = block
        self.checkpoint = checkpoint

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.checkpoint(self.block, x)


def _ckpt(kata, args) -> tuple[Way, Way, Callable[[], bool]]:
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.checkpoint import checkpoint

    def torchs(block, x):
        return checkpoint(block, x, use_reentrant=False)

    models = [_model(args), _model(args)]
    for model, way in zip(models, (kata.checkpoint, torchs)):
        for index, block in enumerate(model.blocks):
            model.blocks[index] = _Through(block, way)
    wrapped = [DistributedDataParallel(model) for model in models]
    optimizers = [torch.optim.SGD(ddp.parameters(), lr=LR) for ddp in wrapped]

    def way(index: int) -> Way:
        step = _training_step(args, wrapped[index], optimizers[index])
        step.model = models[index]  # for _saved_bytes
        return step

    def same() -> bool:
        return all(
            torch.equal(a, b) for a, b in zip(models[0].parameters(), models[1].parameters())
        )

    return way(0), way(1), same


def _mp(kata, args) -> tuple[Way, Way, Callable[[], bool]]:
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError as error:
        raise Skip(f"this torch has no fully_shard or MixedPrecisionPolicy ({error})") from None
    device = rank_device()
    yours = kata.MixedPrecisionFSDP(_model(args), torch.bfloat16, torch.float32)
    theirs = _model(args)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    # the same policy, units and memory habit: bf16 weights gathered once a step and kept until
    # backward, fp32 gradients reduce-scattered into fp32 shards
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in theirs.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    fully_shard(theirs, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    models = (yours, theirs)
    optimizers = [torch.optim.AdamW(model.parameters(), lr=LR) for model in models]

    def way(index: int) -> Way:
        return _training_step(args, models[index], optimizers[index])

    def same() -> bool:
        full = yours.gather_full_params()
        return all(
            torch.allclose(full[name], param.full_tensor(), **TOLERANCE)
            for name, param in theirs.named_parameters()
        )

    return way(0), way(1), same


def _hsdp(kata, args) -> tuple[Way, Way, Callable[[], bool]]:
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
    except ImportError as error:
        raise Skip(f"this torch has no fully_shard ({error})") from None
    size, rank = dist.get_world_size(), dist.get_rank()
    replicate = 2 if size >= 4 and size % 2 == 0 else 1  # 2 copies from 4 ranks on
    shard = size // replicate
    mesh = kata.make_mesh(replicate, shard)
    yours = kata.HsdpTransformer(_model(args), mesh)  # it copies the model
    theirs = _model(args)
    device_mesh = init_device_mesh(
        rank_device().type, (replicate, shard), mesh_dim_names=("replicate", "shard")
    )
    for block in theirs.blocks:  # the same units: a block each, the model the rest
        fully_shard(block, mesh=device_mesh)
    fully_shard(theirs, mesh=device_mesh)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=LR) for m in (yours, theirs)]

    def step(model, optimizer, number: int) -> None:
        optimizer.zero_grad()
        tokens, targets = _batch(args, number, rank)
        transformer_loss(model(tokens), targets).backward()
        optimizer.step()

    def same() -> bool:
        full = kata.full_state(yours)
        return all(
            torch.allclose(full[name], param.full_tensor(), **TOLERANCE)
            for name, param in theirs.named_parameters()
        )

    return (
        lambda number: step(yours, optimizers[0], number),
        lambda number: step(theirs, optimizers[1], number),
        same,
    )


LOCALSGD_PERIOD = 4  # the localsgd row's H: steps between two averages of the parameters


def _localsgd(kata, args) -> tuple[Way, Way, Callable[[], bool]]:
    try:
        from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
        from torch.distributed.optim import PostLocalSGDOptimizer
    except ImportError as error:
        raise Skip(f"this torch has no PostLocalSGDOptimizer ({error})") from None
    models = [_model(args), _model(args)]
    yours = torch.optim.SGD(models[0].parameters(), lr=LR, momentum=0.9)
    theirs = PostLocalSGDOptimizer(
        torch.optim.SGD(models[1].parameters(), lr=LR, momentum=0.9),
        PeriodicModelAverager(period=LOCALSGD_PERIOD),
    )
    params, rank = list(models[0].parameters()), dist.get_rank()

    # A row's step is a period: its last optimizer step averages, so every timed step pays for
    # one average (a median over single steps would mostly time plain SGD). The optimizer
    # steps run 0, 1, ... on both sides: torch's averager counts its own calls.
    def period_yours(number: int) -> None:
        for step in range(number * LOCALSGD_PERIOD, (number + 1) * LOCALSGD_PERIOD):
            yours.zero_grad()
            tokens, targets = _batch(args, step, rank)
            transformer_loss(models[0](tokens), targets).backward()
            kata.local_sgd_step(yours, params, step, LOCALSGD_PERIOD)

    inner = _training_step(args, models[1], theirs)

    def period_theirs(number: int) -> None:
        for step in range(number * LOCALSGD_PERIOD, (number + 1) * LOCALSGD_PERIOD):
            inner(step)

    def same() -> bool:
        return all(
            torch.allclose(a, b, **TOLERANCE)
            for a, b in zip(models[0].parameters(), models[1].parameters())
        )

    return period_yours, period_theirs, same


SAVED = ("ckpt",)  # rows that show the activation bytes each way keeps for backward


def _saved_bytes(way: Way, number: int) -> int:
    """The bytes of the distinct storages autograd saves in one step of ``way`` (what
    saved-tensor hooks see), its model's parameters aside: what forward keeps for backward."""
    params = {p.untyped_storage().data_ptr() for p in way.model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        way(number)
    return sum(saved.values())


COMPARISONS = {
    "zero": _zero,
    "fsdp": _fsdp,
    "tp": _tp,
    "pp": _pp,
    "ipp": _ipp,
    "zbpp": _zbpp,
    "sp": _sp,
    "cp": _cp,
    "fp16": _fp16,
    "powersgd": _powersgd,
    "fsdptp": _fsdptp,
    "vocab": _vocab,
    "ckpt": _ckpt,
    "mp": _mp,
    "hsdp": _hsdp,
    "ulysses": _ulysses,
    "localsgd": _localsgd,
}


def _bench_rank(rank: int, world_size: int, impl_name: str, names: list[str], args) -> dict:
    # FSDP2 warns that a module returns a view (the logits' reshape): no in-place op follows here.
    warnings.filterwarnings("ignore", message=".*returned a view tensor")
    rows = {}
    for name in names:
        module, _, _ = KATAS[name]
        try:
            kata = importlib.import_module(f"{impl_name}.{module}")
            yours, theirs, same = COMPARISONS[name](kata, args)
            times = ([], [])
            for number in range(args.warmup + args.steps):
                for way, spent in zip((yours, theirs), times):  # take turns: noise hits both
                    seconds = timed(way, number)
                    if number >= args.warmup:
                        spent.append(seconds)
            calls = [_collectives(way, args.warmup + args.steps) for way in (yours, theirs)]
            rows[name] = {
                "yours": statistics.median(times[0]),
                "theirs": statistics.median(times[1]),
                "runs": len(times[0]),
                "calls": calls,
                "same": same(),
            }
            if name in SAVED:
                number = args.warmup + args.steps + 1
                rows[name]["saved"] = [_saved_bytes(way, number) for way in (yours, theirs)]
        except KataTodo as todo:  # every rank reaches the same unwritten step
            rows[name] = {"todo": str(todo)}
        except Skip as skip:
            rows[name] = {"skip": str(skip)}
    return rows


# What a step asks of the process group, counted where both ways meet it: the dispatcher's c10d
# ops (torch.distributed's calls, send and recv included) and the functional collectives that
# DTensor calls without going through torch.distributed (waits and wrappers are not calls).
_NOT_CALLS = ("barrier", "monitored_barrier", "wait_tensor", "_wrap_tensor_autograd")


class _CountCollectives(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        namespace, name = func.namespace, func.__name__.split(".")[0]
        if namespace in ("c10d", "_c10d_functional") and name not in _NOT_CALLS:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _collectives(way: Way, number: int) -> int:
    """The collectives (and sends, receives) one step of ``way`` makes on this rank."""
    with _CountCollectives() as counter:
        way(number)
    return counter.count


def _format_row(name: str, row: dict) -> str:
    module, yours, theirs = KATAS[name]
    label = f"{module[:3]} {yours} vs {theirs}"
    if "todo" in row:
        return f"{label:<58} {row['todo']}"
    if "skip" in row:
        return f"{label:<58} skipped: {row['skip']}"
    ratio = row["theirs"] / row["yours"]
    verdict = "same weights" if row["same"] else "WRONG: the weights differ"
    calls = f"{row['calls'][0]:>5} {row['calls'][1]:>5}"
    saved = ""
    if "saved" in row:
        saved = f"; activations kept {row['saved'][0]:,} B and {row['saved'][1]:,} B"
    return (
        f"{label:<58} {row['yours'] * 1e3:8.2f} ms {row['theirs'] * 1e3:8.2f} ms "
        f"{ratio:6.2f}x {calls}  {verdict} (median of {row['runs']} steps){saved}"
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--impl",
        choices=impl.PACKAGES,
        default=impl.current(),
        help="whose katas: katas (yours) or solutions (default: $DOJO_IMPL, else katas)",
    )
    parser.add_argument("--world-size", type=int, default=2, help="ranks (default 2)")
    parser.add_argument(
        "--only",
        default=",".join(COMPARISONS),
        help=f"comma-separated rows among {', '.join(COMPARISONS)} (default: all)",
    )
    parser.add_argument("--dim", type=int, default=128, help="the model's width (default 128)")
    parser.add_argument("--blocks", type=int, default=4, help="its blocks (default 4)")
    parser.add_argument("--batch", type=int, default=16, help="sequences per rank (default 16)")
    parser.add_argument(
        "--micro-batches", type=int, default=4, help="the pp row's micro-batches (default 4)"
    )
    parser.add_argument("--steps", type=int, default=20, help="timed steps per way (default 20)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in COMPARISONS]
    if unknown or not names:
        parser.error(
            f"--only: {', '.join(unknown) or 'nothing'}: choose among {', '.join(COMPARISONS)}"
        )
    for option, value, least in (
        ("--world-size", args.world_size, 1),
        ("--dim", args.dim, 1),
        ("--blocks", args.blocks, 1),
        ("--batch", args.batch, 1),
        ("--micro-batches", args.micro_batches, 1),
        ("--steps", args.steps, 1),
        ("--warmup", args.warmup, 0),
    ):
        if value < least:
            parser.error(f"{option} must be at least {least}")
    if "pp" in names and args.blocks < args.world_size:
        parser.error(f"--blocks {args.blocks}: the pp row needs a block per rank at least")
    if {"ipp", "zbpp"} & set(names) and (
        args.blocks % (PP_CHUNKS * args.world_size) or args.micro_batches % args.world_size
    ):
        parser.error(
            f"the ipp and zbpp rows put {PP_CHUNKS} chunks on each rank, micro-batches in rounds "
            f"of the ranks: --blocks must divide by {PP_CHUNKS * args.world_size} and "
            f"--micro-batches by {args.world_size}"
        )
    if "cp" in names and CP_LENGTH % (2 * args.world_size):
        parser.error(
            f"the cp row cuts {CP_LENGTH} tokens into 2 chunks a rank: --world-size must divide {CP_LENGTH // 2}"
        )
    if "sp" in names and SP_LENGTH % args.world_size:
        parser.error(f"the sp row splits {SP_LENGTH} positions: --world-size must divide it")
    if args.dim % (4 * args.world_size):
        parser.error(f"--dim {args.dim} must divide by 4 heads x {args.world_size} ranks")
    say(
        None,
        f"one training step, Part IV, VI and VII katas from {args.impl}/ against torch's own, "
        f"{args.world_size} ranks, gloo on cpu; a TinyTransformer of {args.blocks} blocks of width "
        f"{args.dim} (tp: its MLP alone; pp: the toy width {MODEL_DIM}, {args.micro_batches} micro-batches; sp: one block, {SP_LENGTH} positions; cp: attention over {CP_LENGTH} tokens), {args.batch} sequences per rank; each time the median "
        f"of {args.steps} steps (x: torch's time / yours), collectives per step counted",
    )
    say(None, f"{'':<58} {'':>11} {'':>11} {'':>7} {'collectives':>11}")
    say(None, f"{'':<58} {'yours':>11} {'torch':>11} {'x':>7} {'yours':>5} {'torch':>5}")
    rows = launch_world(
        _bench_rank, args.world_size, args.impl, names, args, backend="gloo", device="cpu"
    )[0]
    for name in names:
        say(None, _format_row(name, rows[name]))
    wrong = [name for name in names if rows[name].get("same") is False]
    if wrong:
        say(None, f"weights differ from torch's: {', '.join(wrong)} (see those katas' tests)")
        return 1
    return 0


if __name__ == "__main__":
    run_program(main)
