"""k19 · FSDP of your own (ZeRO-3): every layer's weights sharded, gathered only while in use.

THE IDEA
    ZeRO-1 (k18) split the optimizer state; every rank still held every parameter and every
    gradient. ZeRO-3, which torch calls Fully Sharded Data Parallel, splits those too: each rank
    keeps 1/N of every layer's weights (a SHARD), and a layer's full weights exist only while
    that layer runs. Each layer's parameters (weight and bias) are laid end to end in one flat
    vector, padded with zeros to a multiple of N, and cut into N equal pieces: rank r keeps
    piece r, in fp32, and that is what the optimizer updates.

        Linear(4 -> 2): weight 8 + bias 2 = 10 elements, N = 3: padded to 12, pieces of 4
            flat     w w w w | w w w w | b b 0 0
            shards   rank 0    rank 1    rank 2      (rank 2's piece: the bias and 2 zeros)

        forward, layer by layer:   all-gather the shards -> full weights -> compute -> free
        backward, layer by layer:  all-gather again -> compute gradients -> free the weights;
                                   reduce-scatter the full gradient: each rank gets the mean of
                                   its own piece, the shard's .grad
        step:                      an ordinary optimizer on the shards (and the rest)

    Between layers only shards are kept, so the full weights alive at once are at most one
    layer's. Layers of other types (the LayerNorms here) stay whole on every rank, with their
    gradients all-reduced and averaged, as in DDP.

    How does backward get the weights back? Autograd keeps what forward saved for backward: a
    linear layer saves its weight, so the full weight would stay alive until backward. A
    saved-tensor hook changes that: while the wrapped model runs forward, every tensor autograd
    saves passes through ``pack``; a view of a gathered layer becomes a note (which layer, and
    the view's size, stride and offset), and when backward needs it, ``unpack`` gathers that
    layer again and returns the same view of the new copy. (An embedding's backward needs only
    the token ids: it gathers nothing.) The gather is an autograd function whose backward is
    the reduce-scatter: autograd sends the full weight's gradient there, and the mean of this
    rank's piece comes out as the shard's gradient.

        shard --AllGatherShard--> full (flat) --view--> layer.weight, layer.bias --> layer(x)
        shard.grad <--reduce-scatter, / N-- full's grad <--view-- weight's grad <-- backward

    ``compute_dtype`` (float16, bfloat16) casts each shard before the gather: half the bytes on
    the wire and in memory, and the layer computes in that dtype (its inputs are cast too, its
    output cast back to fp32); the gradient is reduce-scattered in that dtype and lands in the
    fp32 shard. The master shards the optimizer updates stay fp32, so small updates are not
    lost to rounding.

    Exact? In fp32 every rank computes its micro-batch's gradient as one process would, and on
    2 ranks each mean is (a + b) / 2, whatever the order of the two: training is bitwise one
    process that averages the two micro-batches' gradients. On 3 ranks gloo adds three numbers
    in an order of its own, so the tests allow a few ulps there.

STEPS
    1. ``shard_of(flat, rank, world_size)``: pad to a multiple of ``world_size``, keep piece
       ``rank``.
    2. ``FullyShardedModule._shard_layers``: for each layer of ``shard_types``, its parameters
       flattened into one shard (a parameter of the wrapper) and removed from the layer.
    3. ``gather_shard`` and ``AllGatherShard``: all-gather the shards into the full flat vector
       (cast first); backward: reduce-scatter the gradient and average it.
    4. The hooks: ``_before_forward`` gathers and sets the layer's weights, ``_after_forward``
       frees them; ``_pack`` and ``_unpack`` save a note instead of a full weight and gather
       again in backward.
    5. ``finish_gradient_synchronization`` (the replicated parameters' mean) and
       ``gather_full_params`` (every full fp32 parameter, keyed by the model's own names).

WHAT THE TESTS CHECK
    ``shard_of`` on sizes that divide and do not divide, and bad input; on 2 and 3 ranks and in
    the subgroup [1, 2] of 3 ranks: which tensors the wrapper and the layers hold after
    sharding, and their values; the gather's output and the reduce-scattered mean (recorded
    calls); forward outputs and the shards' gradients equal to the unsharded model's; by
    recording the calls, one all-gather per layer in forward, one per layer whose backward
    needs its weights, one reduce-scatter per layer; the full weights alive at once, measured
    at every layer's forward and every gather (their storages watched), at most the largest
    layer's; float16 gathers with fp32 master shards and gradients; several SGD and AdamW steps
    on TinyTransformer equal to one process (bitwise on 2 ranks), the full parameters under the
    model's own names, and torch's ``fully_shard`` on the same model and data; and the program.

RUN IT
    python -m katas.k19_fsdp --world-size 2 --steps 3
"""

from __future__ import annotations

import argparse
import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from dojo.console import run_program, say
from dojo.devices import rank_device
from dojo.launch import add_launch_arguments, launch_world
from dojo.todo import KataTodo
from dojo.toy_models import make_tokens, make_transformer, transformer_loss


def all_gather_flat(output: torch.Tensor, piece: torch.Tensor, group=None) -> None:
    """Every rank's ``piece`` end to end into ``output`` (``len(piece) * group size``), in rank
    order. torch 2.14 renamed ``all_gather_into_tensor`` to ``all_gather_single``; older
    versions have only the old name."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, piece, group=group)


def reduce_scatter_flat(output: torch.Tensor, full: torch.Tensor, group=None) -> None:
    """The sum over the ranks of piece ``rank`` of ``full`` into ``output`` (1/N of ``full``).
    ``reduce_scatter_single`` where torch has it, else ``reduce_scatter_tensor``."""
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    scatter(output, full, group=group)


def shard_of(flat: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Piece ``rank`` of ``flat`` padded with zeros to a multiple of ``world_size``: a new
    tensor of ``ceil(len(flat) / world_size)`` elements, the same dtype and device."""
    # TODO: piece `rank` of flat after padding it with zeros to a multiple of world_size: a
    # new tensor (not a view of flat) of ceil(len(flat) / world_size) elements, flat's dtype
    # and device; rank r's piece holds elements [r * chunk, (r + 1) * chunk) of the padded
    # vector. A world_size that is not a positive int, a rank outside 0..world_size-1 or a
    # flat that is not 1-D is a ValueError saying so. The tests check 10 elements on 3 ranks,
    # 8 on 2, 3 on 4 and 5 on 1, float64, and that changing the piece leaves flat alone.
    raise KataTodo("k19", 1, "shard_of: pad, then keep one piece")


def gather_shard(
    shard: torch.Tensor, group=None, compute_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """The full flat vector (padded) from every rank's shard, in ``compute_dtype`` (None: the
    shard's dtype), cast before the all-gather; no autograd."""
    # TODO: the full flat vector (padding included, len(shard) * the group's size) made of
    # every rank's shard in rank order, with one all-gather on group (all_gather_flat); the
    # shard is cast to compute_dtype before the gather when one is given, so the result has
    # that dtype. No autograd: the shard is detached. The tests gather 10 elements on 3 ranks
    # in fp32 and float16.
    raise KataTodo(
        "k19", 3, "gather_shard and AllGatherShard: all-gather forward, reduce-scatter backward"
    )


class AllGatherShard(torch.autograd.Function):
    """Forward: every rank's shard gathered into the full flat vector. Backward: the full
    vector's gradient reduce-scattered, divided by the group's size: the mean over the ranks of
    this rank's piece, in the shard's dtype."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor, group, compute_dtype: torch.dtype | None):
        # TODO: the gathered full vector (gather_shard), keeping on ctx what backward needs (the
        # group, the shard's dtype).
        raise KataTodo(
            "k19", 3, "gather_shard and AllGatherShard: all-gather forward, reduce-scatter backward"
        )

    @staticmethod
    def backward(ctx, grad_full: torch.Tensor):
        # TODO: the shard's gradient: the mean over the group's ranks of this rank's piece of
        # grad_full (one reduce-scatter, reduce_scatter_flat, then divided by the group's size),
        # in the shard's dtype; None for group and compute_dtype. The tests record one reduce-
        # scatter (no all-reduce) and check the mean, in fp32 and with float16.
        raise KataTodo(
            "k19", 3, "gather_shard and AllGatherShard: all-gather forward, reduce-scatter backward"
        )


@dataclass(eq=False)
class ShardedLayer:
    """One sharded layer: where its parameters went."""

    layer: nn.Module
    prefix: str  # the layer's name in the model ("blocks.0.mlp.up")
    names: list[str]  # its parameters' own names, in order ("weight", "bias")
    shapes: list[torch.Size]
    numel: int  # its parameters' elements together, before padding
    shard: nn.Parameter  # this rank's piece of them, flat, padded, fp32: what the optimizer sees


class FullyShardedModule(nn.Module):
    """ZeRO-3: the weights of every ``shard_types`` layer sharded over the group's ranks.

    ``FullyShardedModule(module, compute_dtype=None, shard_types=(nn.Linear, nn.Embedding),
    process_group=None)``. Every rank must build the same model (the same seed), as with
    torch's ``fully_shard``. Train ``wrapper.parameters()`` (the shards and the replicated
    parameters) with any optimizer; call ``finish_gradient_synchronization()`` after backward
    and before the optimizer's step. ``gather_full_params()`` returns every full parameter.
    """

    def __init__(
        self,
        module: nn.Module,
        compute_dtype: torch.dtype | None = None,
        shard_types: tuple[type[nn.Module], ...] = (nn.Linear, nn.Embedding),
        process_group: dist.ProcessGroup | None = None,
    ):
        super().__init__()
        if compute_dtype is not None and (
            not isinstance(compute_dtype, torch.dtype) or not compute_dtype.is_floating_point
        ):
            raise ValueError(
                f"compute_dtype must be a floating-point torch.dtype (torch.float16, "
                f"torch.bfloat16) or None, got {compute_dtype!r}"
            )
        if not isinstance(shard_types, tuple) or not all(
            isinstance(t, type) and issubclass(t, nn.Module) for t in shard_types
        ):
            raise ValueError(
                f"shard_types must be a tuple of nn.Module classes, got {shard_types!r}"
            )
        self.module = module
        self.compute_dtype = compute_dtype
        self.shard_types = shard_types
        self.process_group = process_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        self.names = [name for name, _ in module.named_parameters()]  # the model's own, in order
        self.units: list[ShardedLayer] = []
        self.shards = nn.ParameterList()
        self._live: dict[int, ShardedLayer] = {}  # a gathered full vector's storage -> its layer
        self._shard_layers()
        for unit in self.units:
            unit.layer.register_forward_pre_hook(functools.partial(self._before_forward, unit))
            unit.layer.register_forward_hook(functools.partial(self._after_forward, unit))

    def forward(self, *args, **kwargs):
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            return self.module(*args, **kwargs)

    def _shard_layers(self) -> None:
        """``self.units`` and ``self.shards``: every ``shard_types`` layer's parameters, flat and
        sharded; the layers keep none of their own."""
        # TODO: for every layer of self.module that is one of self.shard_types and has parameters
        # of its own (recurse=False), in named_modules() order: one ShardedLayer in self.units
        # (the layer, its name in the model as prefix, its parameters' names and shapes in order,
        # their elements together) whose shard is this rank's piece (shard_of, with the rank in
        # self.process_group) of its parameters laid end to end, as a new fp32 nn.Parameter also
        # appended to self.shards; the layer keeps none of its parameters (each attribute left as
        # None until forward sets it). Other parameters stay where they are. The tests check every
        # Linear and Embedding of TinyTransformer on 2 and 3 ranks and in the group [1, 2] of 3:
        # the layers' own parameters, each shard's size and values, and wrapper.parameters().
        raise KataTodo("k19", 2, "_shard_layers: one flat shard per layer")

    def _before_forward(self, unit: ShardedLayer, layer: nn.Module, args: tuple):
        """The layer's forward pre-hook: its full weights, gathered, as the layer's attributes."""
        # TODO: the layer's forward pre-hook: its parameters (unit.names) set on the layer as
        # views, in their shapes, of the full vector AllGatherShard.apply gives (so autograd
        # carries their gradients to the shard), the vector's storage remembered in self._live for
        # _pack. With a compute_dtype, return the args with floating tensors cast to it (else
        # None).
        raise KataTodo(
            "k19", 4, "the hooks: gather before each layer, free after, gather again in backward"
        )

    def _after_forward(self, unit: ShardedLayer, layer: nn.Module, args: tuple, output):
        """The layer's forward hook: its full weights freed (the shard stays)."""
        # TODO: the layer's forward hook: nothing of the full weights left (the layer's attributes
        # back to None, the unit out of self._live); with a compute_dtype a floating output comes
        # back cast to the shard's dtype (else return None). The tests watch every gathered
        # storage and measure the full weights alive at each layer's forward and each all-gather:
        # at most the largest layer's.
        raise KataTodo(
            "k19", 4, "the hooks: gather before each layer, free after, gather again in backward"
        )

    def _pack(self, tensor: torch.Tensor):
        """Autograd saves ``tensor`` for backward: a view of a gathered layer becomes a note."""
        # TODO: a tensor autograd saves while the wrapper runs forward: a view of a gathered
        # layer's vector (its storage in self._live) becomes a note saying which layer and the
        # view's size, stride and storage offset; anything else is kept as it is.
        raise KataTodo(
            "k19", 4, "the hooks: gather before each layer, free after, gather again in backward"
        )

    def _unpack(self, saved):
        """Backward needs a saved tensor: for a note, the layer gathered again, the same view."""
        # TODO: what backward gets back: a kept tensor as it is; for a note, the layer gathered
        # again (gather_shard, in compute_dtype) and the same view of it (as_strided). The tests
        # count the all-gathers in forward (one per layer) and in backward (one per layer whose
        # backward needs its weights), and compare the output and the shards' gradients with the
        # unsharded model on 2 and 3 ranks.
        raise KataTodo(
            "k19", 4, "the hooks: gather before each layer, free after, gather again in backward"
        )

    def finish_gradient_synchronization(self) -> None:
        """After backward: every replicated parameter's gradient is its mean over the ranks (the
        shards' gradients are already the means of their pieces)."""
        # TODO: afterwards every parameter still in self.module (the replicated ones) that has a
        # gradient holds its mean over the group's ranks, every rank calling the same collectives
        # in the same order; the shards' gradients are left alone. The tests train 3 SGD and AdamW
        # steps on 2 and 3 ranks and in a subgroup and compare with one process (bitwise on 2
        # ranks) and with torch's fully_shard.
        raise KataTodo("k19", 5, "finish_gradient_synchronization and gather_full_params")

    def gather_full_params(self) -> dict[str, torch.Tensor]:
        """Every parameter of the model, full and fp32, keyed by the model's own names, in its
        order (a collective: every rank of the group must call it)."""
        # TODO: every parameter of the model, full, fp32 (no compute_dtype here), padding dropped,
        # keyed by the model's own names (self.names, in that order: 'blocks.0.mlp.up.weight', no
        # wrapper prefix). A collective: every rank calls it.
        raise KataTodo("k19", 5, "finish_gradient_synchronization and gather_full_params")


# --------------------------------------------------------------------------- the program


def _counting(counts: dict, phase: list):
    """Wrap the two flat collectives this module calls, counting them per phase."""
    originals = {}
    for name in ("all_gather_single", "all_gather_into_tensor", "reduce_scatter_single"):
        originals[name] = getattr(dist, name, None)
    originals["reduce_scatter_tensor"] = dist.reduce_scatter_tensor

    def wrap(name, kind):
        original = originals[name]

        def counted(*args, **kwargs):
            key = (kind, phase[0])
            counts[key] = counts.get(key, 0) + 1
            return original(*args, **kwargs)

        return counted

    for name, original in originals.items():
        if original is not None:
            kind = "all-gather" if "gather" in name else "reduce-scatter"
            setattr(dist, name, wrap(name, kind))
    return originals


def _one_process(steps: int, world_size: int, lr: float, seed: int) -> dict:
    """One process: each step, every rank's micro-batch's gradient, averaged, one SGD step."""
    model = make_transformer(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    for step in range(steps):
        grads = []
        for rank in range(world_size):
            model.zero_grad()
            tokens, targets = make_tokens(4, 1000 * seed + 10 * step + rank)
            transformer_loss(model(tokens), targets).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for param, *each in zip(model.parameters(), *grads):
            total = each[0]
            for grad in each[1:]:
                total = total + grad
            param.grad = total / world_size
        optimizer.step()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def show_fsdp(rank: int, world_size: int, steps: int, lr: float, seed: int) -> dict:
    """Train TinyTransformer wrapped in FullyShardedModule (SGD); rank 0 tells what it holds."""
    device = rank_device()
    model = make_transformer(seed).to(device)  # the same model on every rank, as fully_shard wants
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    wrapper = FullyShardedModule(model)
    optimizer = torch.optim.SGD(wrapper.parameters(), lr=lr, momentum=0.9)
    if rank == 0:
        say(rank, f"{len(wrapper.units)} sharded layers, e.g.:")
        for unit in wrapper.units[:3]:
            say(
                rank,
                f"  {unit.prefix}: {unit.numel} elements -> a shard of {unit.shard.numel()} "
                f"({unit.shard.numel() * world_size - unit.numel} padding)",
            )
    counts: dict = {}
    phase = ["forward"]
    for step in range(steps):
        tokens, targets = (t.to(device) for t in make_tokens(4, 1000 * seed + 10 * step + rank))
        optimizer.zero_grad()
        originals = _counting(counts, phase)
        try:
            phase[0] = "forward"
            loss = transformer_loss(wrapper(tokens), targets)
            phase[0] = "backward"
            loss.backward()
        finally:
            for name, original in originals.items():
                if original is not None:
                    setattr(dist, name, original)
        wrapper.finish_gradient_synchronization()
        optimizer.step()
    held = sum(p.numel() * p.element_size() for p in wrapper.parameters())
    if rank == 0:
        per_step = {key: value // steps for key, value in counts.items()}
        say(
            rank,
            f"per step: {per_step.get(('all-gather', 'forward'), 0)} all-gathers in forward, "
            f"{per_step.get(('all-gather', 'backward'), 0)} in backward (the embedding needs "
            f"none), {per_step.get(('reduce-scatter', 'backward'), 0)} reduce-scatters",
        )
    say(rank, f"parameters held: {held:,} bytes (the whole model: {full_bytes:,})")
    full = wrapper.gather_full_params()
    # one process, here in the rank (the same threads: a matmul's sums depend on their number)
    expected = _one_process(steps, world_size, lr, seed)
    return max(
        (full[k].cpu().double() - v.double()).abs().max().item() for k, v in expected.items()
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="FSDP (ZeRO-3): weights sharded over the ranks.")
    add_launch_arguments(parser, world_size=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    say(None, f"FullyShardedModule on {args.world_size} ranks, TinyTransformer, {args.steps} steps")
    results = launch_world(
        show_fsdp,
        args.world_size,
        args.steps,
        args.lr,
        args.seed,
        backend=args.backend,
        device=args.device,
    )
    gap = max(results)
    say(
        None,
        f"gather_full_params() on every rank against one process: largest difference {gap:g}"
        + (" (bitwise equal)" if gap == 0 else " (gloo adds 3 or more ranks in its own order)"),
    )
    return 0 if gap < 1e-5 else 1


if __name__ == "__main__":
    run_program(main)
