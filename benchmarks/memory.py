"""Benchmark: bytes per rank of parameters, gradients and optimizer state: DDP, ZeRO-1, FSDP.

    dojo bench memory                              # or: python -m benchmarks.memory
    python -m benchmarks.memory --ranks 2,4,8      # more world sizes
    python -m benchmarks.memory --impl katas       # your k18 and k19 instead of the reference

One model (a TinyTransformer made larger through its constructor: ``--blocks`` 4 of ``--dim``
128, about 0.8 million parameters in 69 tensors, so that padding is negligible), one AdamW step
(fp32) on each of N ranks (gloo on the CPU), three ways: replicated as in DDP (every rank holds
every parameter, gradient and optimizer state; the gradients all-reduced), ZeRO-1 (k18's
``ShardedOptimizer``: the optimizer state split) and ZeRO-3 (k19's ``FullyShardedModule``: the
parameters, gradients and state split). After the step each rank MEASURES what it holds: the
bytes of its parameter tensors, of their ``.grad`` tensors and of its optimizer's state tensors
(AdamW's exp_avg and exp_avg_sq, and a 4-byte step per tensor). The table shows the heaviest
rank's bytes next to the ZeRO paper's formulas for fp32 Adam with P parameters on N ranks
(Rajbhandari et al. 2020, without their fp16 copies): DDP 4P + 4P + 8P, ZeRO-1 4P + 4P + 8P/N,
ZeRO-3 (4P + 4P + 8P)/N, and measured / formula (1.00: the formula holds; a little above: the
step counters, the padding and the LayerNorms that FSDP keeps whole on every rank).

A second table measures what ZeRO-3 gathers: the bytes of full (all-gathered) parameters alive at
once on a rank during a training step (its second: prefetch follows the first one's order),
with k19's units as ``fully_shard``'s (a block each; the model's own unit the embedding, the last
norm and the output), three ways: one unit at a time (``prefetch=False``), the next unit's gather
launched ahead (``prefetch=True``: two blocks at once), and ``reshard_after_forward=False``
(every unit kept from its forward to its backward). Measured by watching the storage of every
all-gather's output (a storage is alive while any tensor uses it: a parameter's view, a tensor
autograd saved, a pending gather's buffer) at every all-gather and at the start of every
block's forward; beside it what it should be: the model's unit (alive from the first forward to
the last backward) plus one block, plus two, or every unit.

A third table measures sequence parallelism (k25): the bytes of activations autograd saves for
backward in one transformer block on each rank (``saved_tensors_hooks``: every distinct storage,
the parameters aside), k20's tensor-parallel layout (LayerNorms and residual whole on every
rank) against k25's (split along the sequence too), each beside its formula (k25's own
``activation_bytes``).

A fourth measures activation checkpointing (k32) the same way, on one process: what one block
keeps for backward without checkpointing, checkpointed (k32's ``checkpoint`` and
``torch.utils.checkpoint``) and selectively (the linear layers' outputs kept: k32's and torch's
``create_selective_checkpoint_contexts``), each beside k32's ``activation_bytes``.
"""

from __future__ import annotations

import argparse
import copy
import functools
import importlib
import time
import weakref

import torch
import torch.distributed as dist
from torch import nn

from dojo.console import run_program, say
from dojo.harness import impl
from dojo.launch import launch_world
from dojo.toy_models import Block, TinyTransformer, make_tokens, transformer_loss

WAYS = ("DDP", "ZeRO-1 (k18)", "ZeRO-3 (k19)")
KIB = 1024


def make_model(blocks: int, dim: int, seed: int) -> TinyTransformer:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return TinyTransformer(blocks=blocks, dim=dim)


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return _bytes(
        t for state in optimizer.state.values() for t in state.values() if torch.is_tensor(t)
    )


def _held(params, optimizer) -> dict:
    params = list(params)
    return {
        "params": _bytes(params),
        "grads": _bytes(p.grad for p in params),
        "state": _state_bytes(optimizer),
    }


def _one_step(model, optimizer, rank: int, seed: int, finish) -> None:
    tokens, targets = make_tokens(8, 1000 * seed + rank)
    optimizer.zero_grad(set_to_none=False)
    transformer_loss(model(tokens), targets).backward()
    finish()
    optimizer.step()


def _measure_rank(
    rank: int, world_size: int, impl_name: str, blocks: int, dim: int, seed: int
) -> dict:
    k18 = importlib.import_module(f"{impl_name}.k18_zero")
    k19 = importlib.import_module(f"{impl_name}.k19_fsdp")
    found = {}

    model = make_model(blocks, dim, seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def all_reduce_gradients():
        for param in model.parameters():
            dist.all_reduce(param.grad)
            param.grad /= world_size

    _one_step(model, optimizer, rank, seed, all_reduce_gradients)
    found[WAYS[0]] = _held(model.parameters(), optimizer)

    model = make_model(blocks, dim, seed)
    optimizer = k18.ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
    _one_step(model, optimizer, rank, seed, all_reduce_gradients)
    found[WAYS[1]] = {
        **_held(model.parameters(), optimizer),
        "state": _state_bytes(optimizer.inner),
    }

    wrapper = k19.FullyShardedModule(make_model(blocks, dim, seed))
    optimizer = torch.optim.AdamW(wrapper.parameters(), lr=1e-3)
    _one_step(wrapper, optimizer, rank, seed, wrapper.finish_gradient_synchronization)
    found[WAYS[2]] = _held(wrapper.parameters(), optimizer)
    return found


GATHERED = {  # (prefetch, reshard_after_forward) -> what it should keep alive at once
    "one unit at a time (prefetch off)": (False, True),
    "prefetch (the next unit ahead)": (True, True),
    "reshard_after_forward off (kept)": (True, False),
}
_GATHERS = ("all_gather_single", "all_gather_into_tensor", "all_gather")


class _Storages:
    """The gathered vectors alive at once, watched through weak references to their storages.
    Gloo's worker thread lets go of a collective's tensors a moment after the call returns: while
    more than one is alive a measure waits a little (0.5 s in all) for such stragglers to go."""

    def __init__(self):
        self.watched: dict[int, tuple] = {}
        self.peak = 0
        self.patience = 0.5

    def track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        known = self.watched.get(storage.data_ptr())
        if known is None or known[0]() is None:
            self.watched[storage.data_ptr()] = (weakref.ref(storage), storage.nbytes())

    def _alive(self) -> list[int]:
        return [n for ref, n in self.watched.values() if ref() is not None]

    def measure(self, *_) -> None:
        alive = self._alive()
        while len(alive) > 1 and self.patience > 0:
            time.sleep(0.005)
            self.patience -= 0.005
            alive = self._alive()
        self.peak = max(self.peak, sum(alive))


def _watched(original, watch: _Storages):
    def gather(output, *args, **kwargs):
        result = original(output, *args, **kwargs)
        for tensor in output if isinstance(output, (list, tuple)) else [output]:
            watch.track(tensor)
        watch.measure()
        return result

    return functools.update_wrapper(gather, original)


def _gathered_peak(k19, rank, blocks, dim, seed, prefetch, reshard) -> int:
    """The peak of gathered bytes alive at once during the second training step of one way."""
    import torch.distributed.distributed_c10d as c10d

    model = make_model(blocks, dim, seed)
    wrapper = k19.FullyShardedModule(
        model,
        shard_types=(Block, TinyTransformer),
        prefetch=prefetch,
        reshard_after_forward=reshard,
    )
    optimizer = torch.optim.AdamW(wrapper.parameters(), lr=1e-3)
    _one_step(wrapper, optimizer, rank, seed, wrapper.finish_gradient_synchronization)
    watch = _Storages()
    originals = {name: getattr(c10d, name) for name in _GATHERS if hasattr(c10d, name)}
    hooks = [block.register_forward_pre_hook(watch.measure) for block in model.blocks]
    try:
        for name, original in originals.items():
            for module in (c10d, dist):
                setattr(module, name, _watched(original, watch))
        _one_step(wrapper, optimizer, rank, seed + 1, wrapper.finish_gradient_synchronization)
    finally:
        for name, original in originals.items():
            for module in (c10d, dist):
                setattr(module, name, original)
        for hook in hooks:
            hook.remove()
    return watch.peak


def _gathered_rank(
    rank: int, world_size: int, impl_name: str, blocks: int, dim: int, seed: int
) -> dict:
    """Each way's peak of gathered bytes alive at once, during the second training step."""
    k19 = importlib.import_module(f"{impl_name}.k19_fsdp")
    return {
        way: _gathered_peak(k19, rank, blocks, dim, seed, prefetch, reshard)
        for way, (prefetch, reshard) in GATHERED.items()
    }


def gathered_formulas(model: TinyTransformer, world_size: int) -> dict:
    """What each way should keep alive at once: bytes of fp32 vectors padded to N."""

    def vector(params) -> int:
        return 4 * (-(-sum(p.numel() for p in params) // world_size) * world_size)

    block = max(vector(b.parameters()) for b in model.blocks)
    in_blocks = {id(p) for b in model.blocks for p in b.parameters()}
    own = vector(p for p in model.parameters() if id(p) not in in_blocks)
    every = own + sum(vector(b.parameters()) for b in model.blocks)
    ways = list(GATHERED)
    return {
        ways[0]: (own + block, "the model's unit + 1 block"),
        ways[1]: (own + min(2, len(model.blocks)) * block, "the model's unit + 2 blocks"),
        ways[2]: (every, "every unit"),
    }


def formulas(parameters: int, world_size: int) -> dict:
    """The ZeRO paper's bytes per rank for fp32 Adam: (params, grads, optimizer state)."""
    p, n = parameters, world_size
    return {
        WAYS[0]: (4 * p, 4 * p, 8 * p),
        WAYS[1]: (4 * p, 4 * p, 8 * p / n),
        WAYS[2]: (4 * p / n, 4 * p / n, 8 * p / n),
    }


def rows(parameters: int, world_size: int, results: list[dict]) -> list[dict]:
    """One row per way: the heaviest rank's measured bytes beside the formula's."""
    expected = formulas(parameters, world_size)
    table = []
    for way in WAYS:
        heaviest = max(results, key=lambda r: sum(r[way].values()))[way]
        total = sum(heaviest.values())
        formula = sum(expected[way])
        table.append(
            {
                "ranks": world_size,
                "way": way,
                **heaviest,
                "total": total,
                "formula": formula,
                "ratio": total / formula,
            }
        )
    return table


def _header() -> str:
    return (
        f"{'ranks':>5} | {'way':<13} | {'params':>12} | {'grads':>12} | {'opt. state':>12} | "
        f"{'total':>12} | {'formula':>12} | {'measured/formula':>16}"
    )


def _kib(nbytes: float) -> str:
    return f"{nbytes / KIB:,.1f} KiB"


def _format_row(row: dict) -> str:
    return (
        f"{row['ranks']:>5} | {row['way']:<13} | {_kib(row['params']):>12} | "
        f"{_kib(row['grads']):>12} | {_kib(row['state']):>12} | {_kib(row['total']):>12} | "
        f"{_kib(row['formula']):>12} | {row['ratio']:>16.3f}"
    )


# Sequence parallel (k25): what one block keeps for backward, k20's layout against k25's.
SP_BATCH, SP_LENGTH, SP_HEADS = 8, 64, 4


def _tp_block(k20, block: nn.Module, group=None) -> nn.Module:
    class TensorParallelBlock(nn.Module):  # k20's layout: everything between the regions whole
        def __init__(self):
            super().__init__()
            self.attention_norm = block.attention_norm
            self.attention = k20.ParallelAttention(block.attention, group)
            self.mlp_norm = block.mlp_norm
            self.mlp = k20.ParallelMLP(block.mlp, group)

        def forward(self, x):
            x = x + self.attention(self.attention_norm(x))
            return x + self.mlp(self.mlp_norm(x))

    return TensorParallelBlock()


def _activations_rank(rank, world_size, impl_name, batch, length, dim, heads, seed):
    k25 = importlib.import_module(f"{impl_name}.k25_sequence_parallel")
    k20 = importlib.import_module(f"{impl_name}.k20_tensor_parallel")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        dense = Block(dim)
    if dense.attention.query.out_features // dense.attention.head_dim != heads:
        raise ValueError(f"the toy Block has {dim // dense.attention.head_dim} heads, not {heads}")
    x = torch.randn(batch, length, dim, generator=torch.Generator().manual_seed(seed + 1))
    tp = _tp_block(k20, copy.deepcopy(dense))
    _, tp_saved = k25.saved_activation_bytes(lambda: tp(x.clone().requires_grad_()), tp)
    sp = k25.SequenceParallelBlock(copy.deepcopy(dense))
    mine = k25.sequence_shard(x).requires_grad_()
    _, sp_saved = k25.saved_activation_bytes(lambda: sp(mine), sp)
    return {"tp": tp_saved, "sp": sp_saved}


def tp_formula(batch, length, dim, heads, ranks) -> int:
    """What k20's block keeps for backward: its LayerNorms' tensors and the residual whole."""
    b, s, h, a, n = batch, length, dim, heads, ranks
    return 4 * (4 * b * s * h + 4 * b * s + (8 * b * s * h + a * b * s * s) // n) + s * s


# Activation checkpointing (k32): what one block keeps for backward, each way beside k32's formula.
CHECKPOINTING = {  # way: (what k32's formula calls it, whose checkpoint, which outputs it keeps)
    "no checkpointing": ("everything", None, None),
    "checkpoint (k32)": ("input", "k32", ()),
    "torch.utils.checkpoint": ("input", "torch", ()),
    "selective, mm and addmm (k32)": ("matmuls", "k32", "linear"),
    "selective, mm and addmm (torch's)": ("matmuls", "torch", "linear"),
}


def checkpointing_rows(impl_name: str, batch: int, length: int, dim: int, seed: int) -> list:
    """(way, measured bytes or None where this torch cannot show them, formula) per way."""
    import inspect

    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    k32 = importlib.import_module(f"{impl_name}.k32_activation_checkpointing")
    k25 = importlib.import_module(f"{impl_name}.k25_sequence_parallel")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        block = Block(dim)
    x = torch.randn(batch, length, dim, generator=torch.Generator().manual_seed(seed + 1))
    x.requires_grad_()
    respects = "respect_saved_tensors_hooks" in inspect.signature(checkpoint).parameters
    found = []
    for way, (keep, whose, save) in CHECKPOINTING.items():
        ops = list(k32.LINEAR_MATMULS) if save == "linear" else []
        formula = k32.activation_bytes(batch, length, dim, 4, keep)
        if whose is None:
            run = functools.partial(block, x)
        elif whose == "k32":
            run = functools.partial(k32.checkpoint, block, x, save=tuple(ops))
        elif ops and not respects:  # this torch keeps its selected outputs out of the hooks' sight
            found.append((way, None, formula))
            continue
        else:
            options = {"use_reentrant": False}
            if ops:
                options["context_fn"] = functools.partial(create_selective_checkpoint_contexts, ops)
                options["respect_saved_tensors_hooks"] = True
            run = functools.partial(checkpoint, block, x, **options)
        _, saved = k25.saved_activation_bytes(run, block)
        found.append((way, saved, formula))
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--ranks", default="2,4", help="comma-separated world sizes, one run each (default 2,4)"
    )
    parser.add_argument(
        "--impl",
        choices=impl.PACKAGES,
        default="solutions",
        help="whose k18 and k19: solutions (the reference, the default) or katas (yours)",
    )
    parser.add_argument("--blocks", type=int, default=4, help="transformer blocks (default 4)")
    parser.add_argument("--dim", type=int, default=128, help="model width (default 128)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        world_sizes = [int(n) for n in args.ranks.split(",")]
    except ValueError:
        parser.error(f"--ranks: {args.ranks!r} is not a list like 2,4")
    if any(n < 1 for n in world_sizes):
        parser.error("--ranks: every world needs at least one rank")
    if args.blocks < 1:
        parser.error("--blocks must be at least 1")
    if args.dim < 4 or args.dim % 4:
        parser.error("--dim must be a positive multiple of 4 (the attention's 4 heads)")
    model = make_model(args.blocks, args.dim, args.seed)
    parameters = sum(p.numel() for p in model.parameters())
    say(
        None,
        f"TinyTransformer(blocks={args.blocks}, dim={args.dim}): {parameters:,} parameters in "
        f"{len(list(model.parameters()))} tensors, one fp32 AdamW step, gloo on cpu; k18 and k19 "
        f"from {args.impl}/; bytes held by the heaviest rank, measured after the step",
    )
    say(None, _header())
    for world_size in world_sizes:
        results = launch_world(
            _measure_rank,
            world_size,
            args.impl,
            args.blocks,
            args.dim,
            args.seed,
            backend="gloo",
            device="cpu",
        )
        for row in rows(parameters, world_size, results):
            say(None, _format_row(row))
    say(
        None,
        "formula (ZeRO paper, fp32 Adam, P parameters, N ranks): DDP 4P + 4P + 8P; ZeRO-1 "
        "4P + 4P + 8P/N; ZeRO-3 (4P + 4P + 8P)/N",
    )
    say(
        None,
        f"ZeRO-3 (k19 from {args.impl}/, a unit per block and the model's own, as fully_shard): "
        "full parameters alive at once during a step, the heaviest rank, measured",
    )
    say(None, f"{'ranks':>5} | {'way':<34} | {'measured':>12} | {'should be':>12} | which")
    for world_size in world_sizes:
        peaks = launch_world(
            _gathered_rank,
            world_size,
            args.impl,
            args.blocks,
            args.dim,
            args.seed,
            backend="gloo",
            device="cpu",
        )
        for way, (expected, which) in gathered_formulas(model, world_size).items():
            measured = max(peak[way] for peak in peaks)
            say(
                None,
                f"{world_size:>5} | {way:<34} | {_kib(measured):>12} | {_kib(expected):>12} | "
                f"{which}",
            )
    say(
        None,
        f"sequence parallel (k25 from {args.impl}/ against k20's layout): the activations one "
        f"block (width {args.dim}, {SP_HEADS} heads) keeps for backward, {SP_BATCH} sequences "
        f"of {SP_LENGTH} positions, fp32, the heaviest rank, measured (autograd's saved "
        "tensors) and by formula",
    )
    say(None, f"{'ranks':>5} | {'way':<34} | {'measured':>12} | {'formula':>12} | measured/formula")
    k25 = importlib.import_module(f"{args.impl}.k25_sequence_parallel")
    for world_size in world_sizes:
        if SP_LENGTH % world_size or SP_HEADS % world_size:
            say(
                None,
                f"{world_size:>5} | skipped: {SP_HEADS} heads and {SP_LENGTH} positions do not divide",
            )
            continue
        saved = launch_world(
            _activations_rank, world_size, args.impl, SP_BATCH, SP_LENGTH, args.dim, SP_HEADS,
            args.seed, backend="gloo", device="cpu",
        )  # fmt: skip
        sizes = (SP_BATCH, SP_LENGTH, args.dim, SP_HEADS, world_size)
        for way, key, formula in (
            ("tensor parallel (k20's layout)", "tp", tp_formula(*sizes)),
            ("+ sequence parallel (k25)", "sp", k25.activation_bytes(*sizes)),
        ):
            measured = max(r[key] for r in saved)
            say(
                None,
                f"{world_size:>5} | {way:<34} | {_kib(measured):>12} | {_kib(formula):>12} | "
                f"{measured / formula:.3f}",
            )
    say(
        None,
        f"activation checkpointing (k32 from {args.impl}/): the activations one block (width "
        f"{args.dim}, 4 heads) keeps for backward, {SP_BATCH} sequences of {SP_LENGTH} positions, "
        "fp32, one process, measured (autograd's saved tensors) and by k32's formula",
    )
    say(None, f"{'':>5} | {'way':<34} | {'measured':>12} | {'formula':>12} | measured/formula")
    for way, measured, formula in checkpointing_rows(
        args.impl, SP_BATCH, SP_LENGTH, args.dim, args.seed
    ):
        if measured is None:
            say(None, f"{'':>5} | {way:<34} | {'torch 2.14+':>12} | {_kib(formula):>12} |")
            continue
        say(
            None,
            f"{'':>5} | {way:<34} | {_kib(measured):>12} | {_kib(formula):>12} | "
            f"{measured / formula:.3f}",
        )
    return 0


if __name__ == "__main__":
    run_program(main)
