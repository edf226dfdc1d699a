"""k19 · FSDP of your own (ZeRO-3): every unit's weights sharded, gathered only while in use.

THE IDEA
    ZeRO-1 (k18) split the optimizer state; every rank still held every parameter and every
    gradient. ZeRO-3, which torch calls Fully Sharded Data Parallel, splits those too: each rank
    keeps 1/N of every UNIT's weights (a SHARD), and a unit's full weights exist only while
    that unit runs. A unit is a module and every parameter beneath it (its own and its
    children's, except those of a deeper unit): they are laid end to end in one flat vector,
    padded with zeros to a multiple of N, and cut into N equal pieces: rank r keeps piece r, in
    fp32, and that is what the optimizer updates.

        Linear(4 -> 2) as a unit: weight 8 + bias 2 = 10 elements, N = 3: padded to 12
            flat     w w w w | w w w w | b b 0 0
            shards   rank 0    rank 1    rank 2      (rank 2's piece: the bias and 2 zeros)

        forward, unit by unit:     all-gather the shards -> full weights -> compute -> free
        backward, unit by unit:    all-gather again -> compute gradients -> free the weights;
                                   reduce-scatter the full gradient: each rank gets the mean of
                                   its own piece, the shard's .grad
        step:                      an ordinary optimizer on the shards (and the rest)

    Why units, and how big? Every collective pays a fixed cost (gloo: a few hundred
    microseconds, whatever the size), so a unit per Linear pays it three times per layer and
    step. torch's ``fully_shard`` is called on every block and on the model: a block is one
    all-gather and one reduce-scatter, and the model's own unit takes what is left (the
    embedding, the last norm, the output). ``shard_types`` says which modules are units:
    ``(nn.Linear, nn.Embedding)`` is one unit per layer (the LayerNorms, in no unit, stay whole
    on every rank with their gradients averaged as in DDP); ``(Block, TinyTransformer)`` is
    ``fully_shard``'s way:

        TinyTransformer        shard_types=(Block, TinyTransformer): 3 units, 3 flat vectors
            embedding          -> unit ""          (the model's own: embedding, norm, output)
            blocks.0 (Block)   -> unit "blocks.0"  (its 2 LayerNorms, attention and MLP)
            blocks.1 (Block)   -> unit "blocks.1"
            norm               -> unit ""
            output             -> unit ""

    How does backward get the weights back? Autograd keeps what forward saved for backward: a
    linear layer saves its weight, so the full weight would stay alive until backward. A
    saved-tensor hook changes that: while the wrapped model runs forward, every tensor autograd
    saves passes through ``pack``; a view of a gathered unit becomes a note (which unit, and
    the view's size, stride and offset), and when backward needs it, ``unpack`` gathers that
    unit again (once: its other notes reuse the vector until the unit's gradient is done) and
    returns the same view. (An embedding's backward needs only the token ids: it gathers
    nothing.) The gather is an autograd function whose backward is the reduce-scatter: autograd
    sends the full vector's gradient there, and the mean of this rank's piece comes out as the
    shard's gradient.

        shard --AllGatherShard--> full (flat) --view--> each parameter --> the unit's forward
        shard.grad <--reduce-scatter, / N-- full's grad <--view-- each gradient <-- backward

    PREFETCH. Gathering a unit when it starts leaves the rank idle while the bytes travel.
    With ``prefetch`` the next unit's all-gather is launched asynchronously (``async_op=True``,
    a work handle) as soon as this unit has its own, and travels while this unit computes; the
    next unit waits on the handle (``work.wait()``) before it uses the vector. Backward runs
    the units in the other order, so "next" there is the unit before. Which unit comes next is
    the order the last step ran them in (the first step prefetches nothing):

        forward    gather 0 | compute 0            | compute 1            | compute 2
                            | gather 1 (async) ... | gather 2 (async) ... |
        backward   compute 2 (the model's, kept)   | compute 1            | compute 0
                   gather 1 (async) .............. | gather 0 (async) ... |

    The price: two units' full weights alive at once instead of one.

    RESHARD AFTER FORWARD, OR KEEP. ``reshard_after_forward=True`` (the default) frees a unit's
    full weights after its forward and gathers them again in backward: the least memory, one
    more all-gather per unit. ``False`` keeps them from forward to backward: no gather in
    backward, every unit's full weights alive at the end of forward (DDP's memory, ZeRO-3's
    sharded gradients and optimizer state). The model's own unit is always kept, as
    ``fully_shard`` keeps the root's: its forward ends last and backward starts with it.

    ``compute_dtype`` (float16, bfloat16) casts each shard before the gather: half the bytes on
    the wire and in memory, and the unit computes in that dtype (its inputs are cast too, its
    output cast back to fp32); the gradient is reduce-scattered in that dtype and lands in the
    fp32 shard. The master shards the optimizer updates stay fp32, so small updates are not
    lost to rounding.

    Exact? In fp32 every rank computes its micro-batch's gradient as one process would, and on
    2 ranks each mean is (a + b) / 2, whatever the order of the two: training is bitwise one
    process that averages the two micro-batches' gradients, and bitwise ``fully_shard`` (which
    on gloo divides by 2 before the reduce-scatter: a / 2 + b / 2 is (a + b) / 2 exactly, but
    for gradients below 2^-125, none here). On 3 ranks gloo adds three numbers in an order of
    its own, so the tests allow a few ulps there.

STEPS
    1. ``shard_of(flat, rank, world_size)``: pad to a multiple of ``world_size``, keep piece
       ``rank``.
    2. ``FullyShardedModule._shard_units``: for each unit of ``shard_types``, the parameters
       beneath it (no deeper unit's) flattened into one shard (a parameter of the wrapper) and
       removed from their modules.
    3. ``gather_shard`` and ``AllGatherShard``: all-gather the shards into the full flat vector
       (cast first); backward: reduce-scatter the gradient and average it.
    4. The hooks: ``_before_forward`` gathers (``_unshard``) and sets the unit's parameters,
       ``_after_forward`` frees them; ``_pack`` and ``_unpack`` save a note instead of a full
       weight and gather again in backward, once per unit.
    5. ``finish_gradient_synchronization`` (the replicated parameters' mean) and
       ``gather_full_params`` (every full fp32 parameter, keyed by the model's own names).
    6. Prefetch and keep: ``_next_unit``, ``_prefetch`` and ``_wait`` launch the next unit's
       gather ahead and wait for it; ``_keep`` is the forward hook when
       ``reshard_after_forward`` is off.

WHAT THE TESTS CHECK
    ``shard_of`` on sizes that divide and do not divide, and bad input; on 2 and 3 ranks and in
    the subgroup [1, 2] of 3 ranks: which tensors the wrapper and the modules hold after
    sharding, and their values, a unit per layer and a unit per block; the gather's output and
    the reduce-scattered mean (recorded calls); forward outputs and the shards' gradients equal
    to the unsharded model's; by recording the calls, one all-gather per unit in forward, one
    per unit whose backward needs its weights, one reduce-scatter per unit; the full weights
    alive at once, measured at every unit's forward and every gather (their storages watched);
    float16 gathers with fp32 master shards and gradients; several SGD and AdamW steps on
    TinyTransformer equal to one process (bitwise on 2 ranks) and the full parameters under the
    model's own names; with prefetch, every gather after the first launched ahead and waited
    for before its unit runs, at most two units alive at once, in a subgroup too; with
    ``reshard_after_forward=False`` no gather in backward; bitwise torch's ``fully_shard``
    on the same model, units and data; and the program.

RUN IT
    .venv/bin/python -m katas.k19_fsdp --world-size 2 --steps 3
    .venv/bin/python -m katas.k19_fsdp --units layers --no-prefetch     # or --keep
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
from dojo.toy_models import (
    Block,
    TinyTransformer,
    make_tokens,
    make_transformer,
    transformer_loss,
)


def all_gather_flat(output: torch.Tensor, piece: torch.Tensor, group=None, async_op=False):
    """Every rank's ``piece`` end to end into ``output`` (``len(piece) * group size``), in rank
    order; with ``async_op=True`` it returns at once with a work handle: ``output`` is ready once
    ``work.wait()`` has returned. torch 2.14 renamed ``all_gather_into_tensor`` to
    ``all_gather_single``; older versions have only the old name."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, piece, group=group, async_op=async_op)


def reduce_scatter_flat(output: torch.Tensor, full: torch.Tensor, group=None) -> None:
    """The sum over the ranks of piece ``rank`` of ``full`` into ``output`` (1/N of ``full``).
    ``reduce_scatter_single`` where torch has it, else ``reduce_scatter_tensor``."""
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    scatter(output, full, group=group)


def shard_of(flat: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Piece ``rank`` of ``flat`` padded with zeros to a multiple of ``world_size``: a new
    tensor of ``ceil(len(flat) / world_size)`` elements, the same dtype and device."""
    # BEGIN STEP 1: shard_of: pad, then keep one piece
    # TODO: piece `rank` of flat after padding it with zeros to a multiple of world_size: a
    # new tensor (not a view of flat) of ceil(len(flat) / world_size) elements, flat's dtype
    # and device; rank r's piece holds elements [r * chunk, (r + 1) * chunk) of the padded
    # vector. A world_size that is not a positive int, a rank outside 0..world_size-1 or a
    # flat that is not 1-D is a ValueError saying so. The tests check 10 elements on 3 ranks,
    # 8 on 2, 3 on 4 and 5 on 1, float64, and that changing the piece leaves flat alone.
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of {world_size} (0 to {world_size - 1})")
    if flat.dim() != 1:
        raise ValueError(f"flat must be one-dimensional, got shape {tuple(flat.shape)}: flatten it")
    chunk = -(-flat.numel() // world_size)
    padded = torch.zeros(chunk * world_size, dtype=flat.dtype, device=flat.device)
    padded[: flat.numel()] = flat
    return padded[rank * chunk : (rank + 1) * chunk].clone()
    # END STEP 1


def gather_shard(
    shard: torch.Tensor, group=None, compute_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """The full flat vector (padded) from every rank's shard, in ``compute_dtype`` (None: the
    shard's dtype), cast before the all-gather; no autograd."""
    # BEGIN STEP 3: gather_shard and AllGatherShard: all-gather forward, reduce-scatter backward
    # TODO: the full flat vector (padding included, len(shard) * the group's size) made of
    # every rank's shard in rank order, with one all-gather on group (all_gather_flat); the
    # shard is cast to compute_dtype before the gather when one is given, so the result has
    # that dtype. No autograd: the shard is detached. The tests gather 10 elements on 3 ranks
    # in fp32 and float16.
    piece = shard.detach() if compute_dtype is None else shard.detach().to(compute_dtype)
    full = torch.empty(
        piece.numel() * dist.get_world_size(group), dtype=piece.dtype, device=piece.device
    )
    all_gather_flat(full, piece.contiguous(), group)
    return full
    # END STEP 3


class AllGatherShard(torch.autograd.Function):
    """Forward: every rank's shard gathered into the full flat vector (or ``gathered``, that
    vector gathered already: a prefetch). Backward: the full vector's gradient reduce-scattered,
    divided by the group's size: the mean over the ranks of this rank's piece, in the shard's
    dtype."""

    @staticmethod
    def forward(
        ctx,
        shard: torch.Tensor,
        group,
        compute_dtype: torch.dtype | None,
        gathered: torch.Tensor | None = None,
    ):
        # BEGIN STEP 3: gather_shard and AllGatherShard: all-gather forward, reduce-scatter backward
        # TODO: the full vector: `gathered` when it is given (a prefetch gathered it already: no
        # collective here), else gather_shard's; keep on ctx what backward needs (the group, the
        # shard's dtype).
        ctx.group, ctx.dtype = group, shard.dtype
        return gather_shard(shard, group, compute_dtype) if gathered is None else gathered
        # END STEP 3

    @staticmethod
    def backward(ctx, grad_full: torch.Tensor):
        # BEGIN STEP 3: gather_shard and AllGatherShard: all-gather forward, reduce-scatter backward
        # TODO: the shard's gradient: the mean over the group's ranks of this rank's piece of
        # grad_full (one reduce-scatter, reduce_scatter_flat, then divided by the group's size),
        # in the shard's dtype; None for group, compute_dtype and gathered. The tests record one
        # reduce-scatter (no all-reduce) and check the mean, in fp32 and with float16.
        size = dist.get_world_size(ctx.group)
        grad = torch.empty(
            grad_full.numel() // size, dtype=grad_full.dtype, device=grad_full.device
        )
        reduce_scatter_flat(grad, grad_full.contiguous(), ctx.group)
        return (grad / size).to(ctx.dtype), None, None, None
        # END STEP 3


def owner_of(module: nn.Module, name: str) -> tuple[nn.Module, str]:
    """The submodule a dotted parameter name lives in, and the attribute's own name:
    ``owner_of(block, "attention.query.weight")`` is ``(block.attention.query, "weight")``."""
    path, _, attribute = name.rpartition(".")
    return module.get_submodule(path), attribute


@dataclass(eq=False)
class ShardedUnit:
    """One unit: a module whose parameters (every one beneath it that no deeper unit took) are
    gathered and reduce-scattered together, as one flat vector."""

    module: nn.Module
    prefix: str  # the unit's name in the model ("blocks.0", "blocks.0.mlp.up"; "" for the model)
    names: list[str]  # its parameters' names under the unit's module ("mlp.up.weight"), in order
    shapes: list[torch.Size]
    numel: int  # its parameters' elements together, before padding
    shard: nn.Parameter  # this rank's piece of them, flat, padded, fp32: what the optimizer sees
    full: torch.Tensor | None = None  # the full flat vector while gathered (no autograd)
    pending: tuple | None = None  # (work, the vector it fills): a gather launched ahead


class FullyShardedModule(nn.Module):
    """ZeRO-3: the parameters of every unit (a module of ``shard_types``) sharded over the
    group's ranks.

    ``FullyShardedModule(module, compute_dtype=None, shard_types=(nn.Linear, nn.Embedding),
    process_group=None, prefetch=True, reshard_after_forward=True)``. A unit is a module of
    ``shard_types`` with every parameter beneath it that no deeper unit took: ``(Block,
    TinyTransformer)`` makes each block a unit and the model the unit of the rest, as
    ``fully_shard`` on every block and on the root does; the default makes every Linear and
    Embedding one. Parameters of no unit stay replicated (averaged as in DDP). ``prefetch``:
    the next unit's all-gather launched while this one computes, in forward and in backward;
    ``reshard_after_forward=False``: a unit's full parameters kept from its forward to its
    backward (no gather in backward, more memory). Every rank must build the same model (the
    same seed), as with torch's ``fully_shard``. Train ``wrapper.parameters()`` (the shards
    and the replicated parameters) with any optimizer; call
    ``finish_gradient_synchronization()`` after backward and before the optimizer's step.
    ``gather_full_params()`` returns every full parameter.
    """

    def __init__(
        self,
        module: nn.Module,
        compute_dtype: torch.dtype | None = None,
        shard_types: tuple[type[nn.Module], ...] = (nn.Linear, nn.Embedding),
        process_group: dist.ProcessGroup | None = None,
        prefetch: bool = True,
        reshard_after_forward: bool = True,
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
        for option, value in (
            ("prefetch", prefetch),
            ("reshard_after_forward", reshard_after_forward),
        ):
            if not isinstance(value, bool):
                raise ValueError(f"{option} must be True or False, got {value!r}")
        self.module = module
        self.compute_dtype = compute_dtype
        self.shard_types = shard_types
        self.process_group = process_group
        self.prefetch = prefetch
        self.reshard_after_forward = reshard_after_forward
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        self.names = [name for name, _ in module.named_parameters()]  # the model's own, in order
        self.units: list[ShardedUnit] = []
        self.shards = nn.ParameterList()
        self._live: dict[int, ShardedUnit] = {}  # a gathered vector's storage -> its unit
        # The order the units were gathered in, per phase: as seen in this step, and in the last
        # one (which prefetch follows: a step runs the units in the order the one before did).
        self._phase = "forward"
        self._seen: dict[str, list[ShardedUnit]] = {"forward": [], "backward": []}
        self._order: dict[str, list[ShardedUnit]] = {"forward": [], "backward": []}
        self._shard_units()
        for unit in self.units:
            unit.module.register_forward_pre_hook(functools.partial(self._before_forward, unit))
            unit.module.register_forward_hook(functools.partial(self._forward_hook, unit))

    def forward(self, *args, **kwargs):
        for phase, seen in self._seen.items():  # the last step's order, for prefetch
            if seen:
                self._order[phase] = seen
        self._seen = {"forward": [], "backward": []}
        for unit in self.units:  # what an earlier step left (a forward with no backward)
            if unit.pending is not None:
                self._wait(unit)
            self._reshard(unit)
        self._phase = "forward"
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                return self.module(*args, **kwargs)
        finally:
            self._phase = "backward"

    def _shard_units(self) -> None:
        """``self.units`` and ``self.shards``: every unit's parameters, flat and sharded; the
        modules keep none of them."""
        # BEGIN STEP 2: _shard_units: one flat shard per unit
        # TODO: one ShardedUnit in self.units per module of self.module that is one of
        # self.shard_types (in named_modules() order) and has parameters to take: every parameter
        # beneath it (named_parameters() order) except those beneath a deeper unit, which that unit
        # takes. The unit records its module, its name in the model as prefix ("" for the model
        # itself), its parameters' names relative to the unit's module ("mlp.up.weight") and shapes,
        # their elements together, and as shard this rank's piece (shard_of, with the rank in
        # self.process_group) of those parameters laid end to end, a new fp32 nn.Parameter also
        # appended to self.shards. The modules keep none of these parameters (each attribute left as
        # None until forward sets it: owner_of finds where a name lives). Parameters of no unit stay
        # where they are. The tests check every Linear and Embedding of TinyTransformer on 2 and 3
        # ranks and in the group [1, 2] of 3, and units of (Block, TinyTransformer): the modules' own
        # parameters, each shard's size and values, and wrapper.parameters().
        units = {p: m for p, m in self.module.named_modules() if isinstance(m, self.shard_types)}
        taken: dict[str, list[tuple[str, nn.Parameter]]] = {prefix: [] for prefix in units}
        for name, param in self.module.named_parameters():
            path = name.rpartition(".")[0]
            above = [p for p in units if p == "" or path == p or path.startswith(p + ".")]
            if above:  # the deepest unit above the parameter takes it
                taken[max(above, key=len)].append((name, param))
        for prefix, module in units.items():
            own = taken[prefix]
            if not own:
                continue
            names = [name[len(prefix) + 1 :] if prefix else name for name, _ in own]
            flat = torch.cat([p.detach().reshape(-1) for _, p in own])
            shard = nn.Parameter(shard_of(flat, self.rank, self.world_size))
            unit = ShardedUnit(
                module, prefix, names, [p.shape for _, p in own], flat.numel(), shard
            )
            for name in names:
                owner, attribute = owner_of(module, name)
                delattr(owner, attribute)
                setattr(owner, attribute, None)
            self.units.append(unit)
            self.shards.append(shard)
        # END STEP 2

    def _unshard(self, unit: ShardedUnit) -> torch.Tensor:
        """The unit's full flat vector (no autograd), kept in ``unit.full`` until ``_reshard``:
        the one it has, else the one a prefetch launched (waited for), else gathered now. At a
        unit's first use in a phase (forward, backward), with ``prefetch`` on, the gather of the
        unit that comes next is launched."""
        if unit.full is None:
            if unit.pending is not None:
                unit.full = self._wait(unit)
            else:
                unit.full = gather_shard(unit.shard, self.process_group, self.compute_dtype)
        if unit not in self._seen[self._phase]:
            self._seen[self._phase].append(unit)
            if self.prefetch:
                self._prefetch(self._next_unit(unit))
        return unit.full

    def _reshard(self, unit: ShardedUnit) -> None:
        """The unit's full vector let go (``_pack`` no longer knows its storage): only the
        shard stays. Not the model's own unit after its forward: it is kept, as ``fully_shard``
        keeps the root's (its forward ends last, and backward starts with it)."""
        if self._phase == "forward" and unit.module is self.module:
            return
        unit.full = None
        self._live = {ptr: u for ptr, u in self._live.items() if u is not unit}

    def _before_forward(self, unit: ShardedUnit, module: nn.Module, args: tuple):
        """The unit's forward pre-hook: its full parameters, gathered, as its modules'
        attributes; its vector freed once its gradient is done."""
        # BEGIN STEP 4: the hooks: gather before each unit, free after, gather again in backward
        # TODO: the unit's forward pre-hook: its parameters (unit.names) set on their modules as
        # views, in their shapes, of the full vector AllGatherShard.apply gives for the vector
        # self._unshard(unit) gathered (so autograd carries their gradients to the shard), that
        # vector's storage remembered in self._live for _pack, and self._after_backward(unit, grad)
        # called once the whole vector's gradient is done (a hook on it, when it requires grad).
        # With a compute_dtype, return the args with floating tensors cast to it (else None).
        full = AllGatherShard.apply(
            unit.shard, self.process_group, self.compute_dtype, self._unshard(unit)
        )
        self._live[full.untyped_storage().data_ptr()] = unit
        if full.requires_grad:
            full.register_hook(functools.partial(self._after_backward, unit))
        offset = 0
        for name, shape in zip(unit.names, unit.shapes):
            owner, attribute = owner_of(module, name)
            setattr(owner, attribute, full[offset : offset + shape.numel()].view(shape))
            offset += shape.numel()
        if self.compute_dtype is None:
            return None
        return tuple(
            a.to(self.compute_dtype) if torch.is_tensor(a) and a.is_floating_point() else a
            for a in args
        )
        # END STEP 4

    def _forward_hook(self, unit: ShardedUnit, module: nn.Module, args: tuple, output):
        """After a unit's forward: freed (``reshard_after_forward``), or kept for backward."""
        if self.reshard_after_forward:
            return self._after_forward(unit, module, args, output)
        return self._keep(unit, module, args, output)

    def _after_forward(self, unit: ShardedUnit, module: nn.Module, args: tuple, output):
        """The unit's forward hook: its full parameters freed (the shard stays)."""
        # BEGIN STEP 4: the hooks: gather before each unit, free after, gather again in backward
        # TODO: the unit's forward hook: nothing of its full weights left (its parameters'
        # attributes back to None, the unit resharded: self._reshard); with a compute_dtype a
        # floating output comes back cast to the shard's dtype (else return None). The tests watch
        # every gathered storage and measure the full weights alive at each unit's forward and each
        # all-gather: at most the largest layer's (a unit per layer), the model's unit and a block's
        # (a unit per block).
        for name in unit.names:
            owner, attribute = owner_of(module, name)
            setattr(owner, attribute, None)
        self._reshard(unit)
        if self.compute_dtype is not None and torch.is_tensor(output):
            return output.to(unit.shard.dtype) if output.is_floating_point() else output
        return None
        # END STEP 4

    def _pack(self, tensor: torch.Tensor):
        """Autograd saves ``tensor`` for backward: a view of a gathered unit becomes a note."""
        # BEGIN STEP 4: the hooks: gather before each unit, free after, gather again in backward
        # TODO: a tensor autograd saves while the wrapper runs forward: a view of a gathered
        # unit's vector (its storage in self._live) becomes a note saying which unit and the view's
        # size, stride and storage offset; anything else is kept as it is.
        unit = self._live.get(tensor.untyped_storage().data_ptr())
        if unit is None:
            return tensor
        return (unit, tensor.size(), tensor.stride(), tensor.storage_offset())
        # END STEP 4

    def _unpack(self, saved):
        """Backward needs a saved tensor: for a note, the same view of the unit's vector (gathered
        again at the unit's first note, kept for its others: one gather per unit)."""
        # BEGIN STEP 4: the hooks: gather before each unit, free after, gather again in backward
        # TODO: what backward gets back: a kept tensor as it is; for a note, the same view
        # (as_strided) of the unit's full vector, gathered again for the unit's first note and
        # reused for its others (self._unshard: one gather per unit in backward). The tests count the
        # all-gathers in forward (one per unit) and in backward (one per unit whose backward needs
        # its weights), and compare the output and the shards' gradients with the unsharded model on
        # 2 and 3 ranks.
        if torch.is_tensor(saved):
            return saved
        unit, size, stride, offset = saved
        return self._unshard(unit).as_strided(size, stride, offset)
        # END STEP 4

    def _after_backward(self, unit: ShardedUnit, grad: torch.Tensor) -> None:
        """The gradient of the unit's whole vector is done (its reduce-scatter comes next): the
        vector gathered for backward, or kept from forward, is let go."""
        self._reshard(unit)

    def _keep(self, unit: ShardedUnit, module: nn.Module, args: tuple, output):
        """``reshard_after_forward=False``: the unit's forward hook. Its modules' attributes let
        go, but its full vector stays gathered for backward (no gather there); freed once its
        gradient is done."""
        # BEGIN STEP 6: prefetch and keep: the next unit gathered ahead, or every unit kept
        # TODO: the forward hook when reshard_after_forward is off: as _after_forward (the
        # attributes back to None, the output cast), but the unit's full vector stays gathered for
        # backward (its notes use it: no gather in backward); _after_backward frees it once the
        # unit's gradient is done. The tests count no all-gather in backward and every unit's full
        # weights alive at the end of forward.
        for name in unit.names:
            owner, attribute = owner_of(module, name)
            setattr(owner, attribute, None)
        if self.compute_dtype is not None and torch.is_tensor(output):
            return output.to(unit.shard.dtype) if output.is_floating_point() else output
        return None
        # END STEP 6

    def _next_unit(self, unit: ShardedUnit) -> ShardedUnit | None:
        """The unit gathered after ``unit`` in this phase, by the order of the last step's."""
        # BEGIN STEP 6: prefetch and keep: the next unit gathered ahead, or every unit kept
        # TODO: the unit that will be gathered right after `unit` in this phase (self._phase,
        # "forward" or "backward"), by the order the last step gathered them in (self._order[phase];
        # in backward the units run the other way round), or None: the last one, or one that order
        # does not hold (the first step has no order yet).
        order = self._order[self._phase]
        for index, known in enumerate(order[:-1]):
            if known is unit:
                return order[index + 1]
        return None
        # END STEP 6

    def _prefetch(self, unit: ShardedUnit | None) -> None:
        """The unit's all-gather launched now, asynchronously (``unit.pending``): it travels while
        this unit computes. Nothing for None, nor for a unit gathered or launched already."""
        # BEGIN STEP 6: prefetch and keep: the next unit gathered ahead, or every unit kept
        # TODO: the unit's all-gather launched without waiting for it (all_gather_flat with
        # async_op=True; on the wrapper's group, cast to compute_dtype as gather_shard does), the
        # work handle and the vector it fills kept in unit.pending for _unshard; nothing for None
        # or for a unit that is gathered already (unit.full) or has a gather pending. The tests
        # record, from the second step on, every all-gather after a phase's first launched async
        # and waited for before its unit runs, and at most two units' full weights alive at once.
        if unit is None or unit.full is not None or unit.pending is not None:
            return
        piece = unit.shard.detach()
        if self.compute_dtype is not None:
            piece = piece.to(self.compute_dtype)
        full = torch.empty(piece.numel() * self.world_size, dtype=piece.dtype, device=piece.device)
        work = all_gather_flat(full, piece.contiguous(), self.process_group, async_op=True)
        unit.pending = (work, full)
        # END STEP 6

    def _wait(self, unit: ShardedUnit) -> torch.Tensor:
        """The vector a prefetch launched, once its gather is done (``unit.pending`` cleared)."""
        # BEGIN STEP 6: prefetch and keep: the next unit gathered ahead, or every unit kept
        # TODO: the vector unit.pending's gather fills, once that gather is done (the vector is
        # not filled before), with unit.pending cleared.
        work, full = unit.pending
        unit.pending = None
        work.wait()
        return full
        # END STEP 6

    def finish_gradient_synchronization(self) -> None:
        """After backward: every replicated parameter's gradient is its mean over the ranks (the
        shards' gradients are already the means of their pieces)."""
        # BEGIN STEP 5: finish_gradient_synchronization and gather_full_params
        # TODO: afterwards every parameter still in self.module (the replicated ones) that has a
        # gradient holds its mean over the group's ranks, every rank calling the same collectives
        # in the same order; the shards' gradients are left alone. The tests train 3 SGD and AdamW
        # steps on 2 and 3 ranks and in a subgroup and compare with one process (bitwise on 2
        # ranks).
        with torch.no_grad():
            for param in self.module.parameters():
                if param.grad is not None:
                    dist.all_reduce(param.grad, group=self.process_group)
                    param.grad /= self.world_size
        # END STEP 5

    def gather_full_params(self) -> dict[str, torch.Tensor]:
        """Every parameter of the model, full and fp32, keyed by the model's own names, in its
        order (a collective: every rank of the group must call it)."""
        # BEGIN STEP 5: finish_gradient_synchronization and gather_full_params
        # TODO: every parameter of the model, full, fp32 (no compute_dtype here), padding dropped,
        # keyed by the model's own names (self.names, in that order: 'blocks.0.mlp.up.weight', no
        # wrapper prefix). A collective: every rank calls it.
        found = {}
        for unit in self.units:
            full = gather_shard(unit.shard, self.process_group)
            offset = 0
            for name, shape in zip(unit.names, unit.shapes):
                key = f"{unit.prefix}.{name}" if unit.prefix else name
                found[key] = full[offset : offset + shape.numel()].view(shape).clone()
                offset += shape.numel()
        for name, param in self.module.named_parameters():
            found[name] = param.detach().clone()
        return {name: found[name] for name in self.names}
        # END STEP 5


# --------------------------------------------------------------------------- the program


def _counting(counts: dict, phase: list):
    """Wrap the all-gathers (flat, or into a list) and reduce-scatters, counting them per phase."""
    originals = {}
    for name in (
        "all_gather_single",
        "all_gather_into_tensor",
        "all_gather",
        "reduce_scatter_single",
    ):
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


def counted_step(wrapper, tokens: torch.Tensor, targets: torch.Tensor, counts: dict) -> None:
    """Forward, backward and the gradients' synchronization of one step, adding the all-gathers
    and reduce-scatters each phase launched to ``counts[(kind, phase)]``."""
    phase = ["forward"]
    originals = _counting(counts, phase)
    try:
        loss = transformer_loss(wrapper(tokens), targets)
        phase[0] = "backward"
        loss.backward()
    finally:
        for name, original in originals.items():
            if original is not None:
                setattr(dist, name, original)
    wrapper.finish_gradient_synchronization()


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


UNITS = {  # --units: what a unit is
    "blocks": (Block, TinyTransformer),  # fully_shard's way: a block each, the model the rest
    "layers": (nn.Linear, nn.Embedding),  # every Linear and Embedding on its own
}


def show_fsdp(
    rank: int,
    world_size: int,
    steps: int,
    lr: float,
    seed: int,
    units: str = "blocks",
    prefetch: bool = True,
    reshard_after_forward: bool = True,
) -> float:
    """Train TinyTransformer wrapped in FullyShardedModule (SGD); rank 0 tells what it holds."""
    device = rank_device()
    model = make_transformer(seed).to(device)  # the same model on every rank, as fully_shard wants
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    wrapper = FullyShardedModule(
        model,
        shard_types=UNITS[units],
        prefetch=prefetch,
        reshard_after_forward=reshard_after_forward,
    )
    optimizer = torch.optim.SGD(wrapper.parameters(), lr=lr, momentum=0.9)
    if rank == 0:
        say(rank, f"{len(wrapper.units)} units, e.g.:")
        for unit in wrapper.units[:3]:
            say(
                rank,
                f"  {unit.prefix or '(the model)'}: {len(unit.names)} parameters, {unit.numel} "
                f"elements -> a shard of {unit.shard.numel()} "
                f"({unit.shard.numel() * world_size - unit.numel} padding)",
            )
    counts: dict = {}
    for step in range(steps):
        tokens, targets = (t.to(device) for t in make_tokens(4, 1000 * seed + 10 * step + rank))
        optimizer.zero_grad()
        counted_step(wrapper, tokens, targets, counts)
        optimizer.step()
    held = sum(p.numel() * p.element_size() for p in wrapper.parameters())
    if rank == 0:
        per_step = {key: value // steps for key, value in counts.items()}
        say(
            rank,
            f"per step: {per_step.get(('all-gather', 'forward'), 0)} all-gathers in forward, "
            f"{per_step.get(('all-gather', 'backward'), 0)} in backward, "
            f"{per_step.get(('reduce-scatter', 'backward'), 0)} reduce-scatters (prefetch "
            f"{'on' if prefetch else 'off'}, reshard_after_forward "
            f"{'on' if reshard_after_forward else 'off'})",
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
    parser.add_argument(
        "--units",
        choices=UNITS,
        default="blocks",
        help="blocks: a unit per block and the model's own (fully_shard's way, the default); "
        "layers: every Linear and Embedding",
    )
    parser.add_argument("--no-prefetch", action="store_true", help="gather each unit when needed")
    parser.add_argument(
        "--keep", action="store_true", help="reshard_after_forward=False: no gather in backward"
    )
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
        args.units,
        not args.no_prefetch,
        not args.keep,
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
