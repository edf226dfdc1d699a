"""k20 · Tensor parallel: one layer's weights split over ranks, Megatron-LM's f and g.

THE IDEA
    Data parallelism copies the whole model to every rank. When one layer is too big, or too
    slow, for one device, split the layer itself: each rank keeps a slice of its weight matrix
    and computes a slice of the work. A linear layer ``y = x @ W.T + b`` (``W`` is
    ``out_features x in_features``) splits two ways:

        column parallel: each rank keeps some ROWS of W (some output features)
            x (full, the same on every rank)  ->  y[..., my features] = x @ W[mine].T + b[mine]
            the output stays split: each rank holds its own features

        row parallel: each rank keeps some COLUMNS of W (some input features)
            x[..., my features]  ->  partial = x[..., mine] @ W[:, mine].T
            y = sum of every rank's partial (an all-reduce) + b   (the bias once, after the sum)

    Megatron-LM puts them back to back in the MLP: ``up`` column-parallel, ``relu`` on each
    rank's own features (elementwise: no communication), ``down`` row-parallel. The split
    output of the first is exactly the split input of the second, so the whole MLP needs ONE
    all-reduce forward (after ``down``), and ONE backward (the gradient of ``x``, which every
    rank's slice contributed to):

        x --f--> [ up: my columns ] -> relu -> [ down: my rows ] --g--> y
                  (2 ranks: rank 0 features 0..31, rank 1 features 32..63 of 64)

        f: forward identity,   backward all-reduce (sum)   entering the parallel region
        g: forward all-reduce, backward identity           leaving it

    f and g are conjugate: each is the other's transpose. ``x`` feeds every rank's slice, so its
    gradient is the SUM of what every slice sends back (f's backward); the output is the SUM of
    every rank's partial product (g's forward), and that sum's gradient reaches every partial
    unchanged (g's backward). They are sums, not means: dividing by the world size is a
    mistake. As autograd functions, forward and backward are written side by side.

    Attention splits the same way, by whole heads: ``query``, ``key`` and ``value`` are
    column-parallel (each rank keeps the output features of its heads: with 4 heads of 4
    features on 2 ranks, rank 0 features 0..7 = heads 0 and 1), each rank attends with its own
    heads only (heads never mix until ``out``), and ``out`` is row-parallel. The number of heads
    must divide by the group's size. One f for the three projections (they read the same ``x``)
    and one g: again one all-reduce forward and one backward.

    Exact? A column-parallel output is the same dot products as the dense layer's slice, but
    the row-parallel sum adds two partial sums of 32 products where the dense layer adds 64 in
    one go, and floating-point addition depends on the order: the tests compare with the dense
    layer to a close tolerance, not bit for bit.

STEPS
    1. ``CopyToParallelRegion`` (f) and ``ReduceFromParallelRegion`` (g): autograd functions,
       forward and backward, on the given group (None: the world).
    2. ``shard_range`` (this rank's share of some features, by its rank in the group; a
       ``ValueError`` when they do not divide) and ``ColumnParallelLinear``: ``_shard`` (this
       rank's output features of the weight and bias, copies) and ``forward``.
    3. ``RowParallelLinear``: ``_shard`` (this rank's input features of the weight, the whole
       bias) and ``forward`` (the bias added once, after the sum).
    4. ``ParallelMLP``: built from ``dojo.toy_models.MLP``, up column-parallel, down
       row-parallel: one all-reduce forward and one backward.
    5. ``ParallelAttention``: built from ``dojo.toy_models.Attention``, split by whole heads
       (a ``ValueError`` when the heads do not divide), one f and one g.

WHAT THE TESTS CHECK
    By recording every rank's calls: f makes no call forward and one all-reduce (a sum, on the
    group) backward, g the reverse, on 2 ranks and in two subgroups of 4 ranks, and neither
    changes its input; each layer's slice of the dense weight (which rows, which columns, which
    rank's, and a copy that does not keep the full matrix alive); outputs equal to the dense
    layer and gradients (of the input and of each rank's weight and bias) equal to the matching
    slice of the dense gradients, on 2 and 4 ranks and in subgroups; one all-reduce forward and
    one backward for the MLP and for attention; a ``ValueError`` for sizes that do not divide;
    the same outputs and local weight gradients as torch's ``parallelize_module`` with
    ``ColwiseParallel`` and ``RowwiseParallel`` on an ``init_device_mesh("cpu", (world,))``
    mesh; and the program.

RUN IT
    .venv/bin/python -m katas.k20_tensor_parallel --world-size 2
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from dojo.console import run_program, say, verdict
from dojo.devices import rank_device
from dojo.launch import add_launch_arguments, launch_world
from dojo.todo import KataTodo
from dojo.toy_models import MLP, Attention, make_tokens, make_transformer


class CopyToParallelRegion(torch.autograd.Function):
    """Megatron-LM's f: forward the input unchanged; backward, the gradient's sum over the group."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        # TODO: f's forward: x's values unchanged (no communication), and whatever backward needs
        # kept in ctx. The tests record every call: none in forward, and x itself unchanged.
        raise KataTodo("k20", 1, "f and g: the conjugate operators")

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # TODO: f's backward: the gradient's SUM over the group (the group forward was given; None
        # is the world) without changing the tensor autograd passed in, and None for the group
        # argument. The tests record exactly one all-reduce (a sum, on the group) on 2 ranks and in
        # two subgroups of 4, and compare the gradient exactly.
        raise KataTodo("k20", 1, "f and g: the conjugate operators")


class ReduceFromParallelRegion(torch.autograd.Function):
    """Megatron-LM's g: forward, the input's sum over the group; backward, the gradient unchanged."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        # TODO: g's forward: a new tensor holding the SUM of x over the group (None: the world); x
        # itself stays as it was. The tests record exactly one all-reduce (a sum, on the group) and
        # compare the values exactly, on 2 ranks and in two subgroups of 4.
        raise KataTodo("k20", 1, "f and g: the conjugate operators")

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # TODO: g's backward: the gradient as it came (no communication), and None for the group.
        # The tests record that backward calls nothing.
        raise KataTodo("k20", 1, "f and g: the conjugate operators")


def copy_to_parallel_region(x: torch.Tensor, group: dist.ProcessGroup | None = None):
    """f: identity forward, all-reduce backward."""
    return CopyToParallelRegion.apply(x, group)


def reduce_from_parallel_region(x: torch.Tensor, group: dist.ProcessGroup | None = None):
    """g: all-reduce forward, identity backward."""
    return ReduceFromParallelRegion.apply(x, group)


def shard_range(features: int, group: dist.ProcessGroup | None, what: str) -> tuple[int, int]:
    """``(start, end)`` of this rank's share of ``features``; ValueError when they do not divide."""
    # TODO: (start, end) of this rank's equal share of `features`, in order of the ranks IN THE
    # GROUP (None: the world), so that the group's ranks cover 0..features - 1 once. Features that
    # do not divide by the group's size are a ValueError naming both numbers and what to do. The
    # tests run in the world and in subgroups [0, 1] and [2, 3], and try 64 features on 3 ranks.
    raise KataTodo("k20", 2, "ColumnParallelLinear: my output features")


class _ShardedLinear(nn.Module):
    """This rank's slice of ``linear``, as parameters of its own: the subclass's ``_shard`` says
    which slice (``weight``, ``bias``; a bias may be None) of the layer split over the group."""

    def __init__(self, linear: nn.Linear, process_group: dist.ProcessGroup | None = None):
        super().__init__()
        self.process_group = process_group
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight, bias = self._shard(linear)
        self.weight = nn.Parameter(weight)
        self.bias = nn.Parameter(bias) if bias is not None else None


class ColumnParallelLinear(_ShardedLinear):
    """``linear`` split by output features: this rank computes its slice of the output.

    ``ColumnParallelLinear(linear, process_group=None)``: input the full ``x`` (the same on
    every rank of the group), output ``linear(x)[..., this rank's features]``.
    """

    def _shard(self, linear: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This rank's rows of ``linear.weight`` and entries of its bias (copies), or ValueError."""
        # TODO: (weight, bias): copies of this rank's output features of linear (its slice of
        # linear.weight's rows, the same entries of linear.bias; None without a bias), not views
        # that keep the full matrix alive. The tests compare them with the dense layer's slices, on
        # 2 and 4 ranks and in subgroups, and measure the bytes behind the weight.
        raise KataTodo("k20", 2, "ColumnParallelLinear: my output features")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # TODO: this rank's slice of the dense layer's output, from the full x; x's gradient must
        # come out as the dense layer's (every rank's slice contributed to it). The tests record the
        # calls (none forward, one all-reduce backward) and compare the output, x's gradient and
        # this rank's weight and bias gradients with the dense layer's slices.
        raise KataTodo("k20", 2, "ColumnParallelLinear: my output features")


class RowParallelLinear(_ShardedLinear):
    """``linear`` split by input features: partial products summed over the group, bias once.

    ``RowParallelLinear(linear, process_group=None)``: input ``x[..., this rank's features]``
    (a column-parallel layer's output), output the full ``linear(x)`` on every rank.
    """

    def _shard(self, linear: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This rank's columns of ``linear.weight`` and the whole bias (copies), or ValueError."""
        # TODO: (weight, bias): a copy of this rank's input features of linear (its slice of
        # linear.weight's columns) and a copy of the whole bias (None without one). The tests
        # compare them with the dense layer's, on 2 and 4 ranks and in subgroups, and measure the
        # bytes behind the weight.
        raise KataTodo("k20", 3, "RowParallelLinear: my input features, summed, the bias once")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # TODO: the dense layer's whole output on every rank, from this rank's slice of the input
        # features, the bias counted once. The tests record the calls (one all-reduce forward, none
        # backward) and compare the output, the input slice's gradient, this rank's weight gradient
        # and the bias gradient (on every rank) with the dense layer's.
        raise KataTodo("k20", 3, "RowParallelLinear: my input features, summed, the bias once")


class ParallelMLP(nn.Module):
    """``dojo.toy_models.MLP`` split over the group: up column-parallel, down row-parallel."""

    def __init__(self, mlp: MLP, process_group: dist.ProcessGroup | None = None):
        # TODO: self.up and self.down: mlp's up and down layers split over process_group (None: the
        # world), up by its output features and down by its input features; no other parameters. The
        # tests read the parameters' names (up.weight, up.bias, down.weight, down.bias).
        raise KataTodo("k20", 4, "ParallelMLP: one all-reduce forward, one backward")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # TODO: the dense MLP's output (down(relu(up(x)))) on every rank. The tests record exactly
        # one all-reduce forward and one backward, and compare the output and every gradient with
        # the dense MLP's on 2 and 4 ranks and in subgroups, and with torch's parallelize_module.
        raise KataTodo("k20", 4, "ParallelMLP: one all-reduce forward, one backward")


class ParallelAttention(nn.Module):
    """``dojo.toy_models.Attention`` split by whole heads: q, k, v column-, out row-parallel."""

    def __init__(self, attention: Attention, process_group: dist.ProcessGroup | None = None):
        # TODO: query, key and value split by output features and out by input features over
        # process_group (None: the world), so each rank holds whole heads; self.head_dim and
        # self.local_heads (the heads this rank holds) for forward. A group size that does not
        # divide the number of heads is a ValueError naming both. The tests try 2 heads on 4 ranks.
        raise KataTodo("k20", 5, "ParallelAttention: whole heads per rank")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # TODO: the dense attention's output on every rank: causal attention over this rank's own
        # heads, then out. The tests record exactly one all-reduce forward and one backward (the
        # three projections read the same x), and compare the output and every gradient with the
        # dense attention's on 2 and 4 ranks and in subgroups, and with torch's parallelize_module.
        raise KataTodo("k20", 5, "ParallelAttention: whole heads per rank")


# --------------------------------------------------------------------------- the program


def _count_all_reduces(run) -> tuple[object, int]:
    """``run()``'s result and how many all-reduces this rank made meanwhile."""
    calls = []
    original = dist.all_reduce

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    dist.all_reduce = counted
    try:
        return run(), len(calls)
    finally:
        dist.all_reduce = original


def show_block(rank: int, world_size: int, seed: int) -> dict:
    """Split the tiny transformer's first block's MLP and attention; compare with the dense ones."""
    device = rank_device()
    block = make_transformer(seed).blocks[0].to(device)
    tokens, _ = make_tokens(4, seed)
    with torch.no_grad():
        x = make_transformer(seed).embedding(tokens).to(device)
    out = {"shapes": {}, "counts": {}, "gaps": {}}
    for name, dense, parallel_cls in (
        ("mlp", block.mlp, ParallelMLP),
        ("attention", block.attention, ParallelAttention),
    ):
        parallel = parallel_cls(dense, None)
        out["shapes"][name] = {n: tuple(p.shape) for n, p in parallel.named_parameters()}
        mine = x.clone().requires_grad_()
        y, forward = _count_all_reduces(lambda p=parallel, m=mine: p(m))
        _, backward = _count_all_reduces(lambda y=y: y.square().sum().backward())
        reference = x.clone().requires_grad_()
        dense(reference).square().sum().backward()
        out["counts"][name] = (forward, backward)
        out["gaps"][name] = {
            "output": (y.detach() - dense(x).detach()).abs().max().item(),
            "input grad": (mine.grad - reference.grad).abs().max().item(),
        }
        dense.zero_grad()
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description="Tensor parallel: the MLP and attention of a transformer block split over ranks."
    )
    add_launch_arguments(parser, world_size=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.world_size not in (1, 2, 4):
        parser.error("--world-size must divide the 4 heads and 64 hidden features: 1, 2 or 4")
    say(None, f"a TinyTransformer block's MLP and attention split over {args.world_size} ranks")
    results = launch_world(
        show_block, args.world_size, args.seed, backend=args.backend, device=args.device
    )
    for name in ("mlp", "attention"):
        shapes = results[0]["shapes"][name]
        say(None, f"{name}: each rank keeps " + ", ".join(f"{n} {s}" for n, s in shapes.items()))
        for rank, result in enumerate(results):
            forward, backward = result["counts"][name]
            gaps = result["gaps"][name]
            say(
                rank,
                f"{name}: {forward} all-reduce forward, {backward} backward; largest gap to the "
                f"dense layer: output {gaps['output']:.1e}, input gradient {gaps['input grad']:.1e}",
            )
    worst = max(g for r in results for gaps in r["gaps"].values() for g in gaps.values())
    return verdict(
        worst,
        "every rank's output and input gradient equal the dense block's",
        "the split layers differ from the dense ones",
    )


if __name__ == "__main__":
    run_program(main)
