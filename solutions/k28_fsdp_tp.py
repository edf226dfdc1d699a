"""k28 · Two dimensions at once: FSDP x TP on a 2-D mesh.

THE IDEA
    Tensor parallelism (k20) splits each layer over a few ranks, but its all-reduces sit on the
    critical path of every layer: it pays only between ranks joined by a fast link (one
    machine's GPUs). FSDP (k19) shards the weights over many ranks and moves them only twice a
    step (a gather before use, a reduce-scatter of the gradients), so it crosses machines well.
    Large models use both: arrange the world as a grid (k17), ``dp`` rows of ``tp`` ranks, rank
    ``= dp_index * tp + tp_index``. A row is one tensor-parallel team: its ranks hold different
    slices of the same layers and read the same batch. A column holds the same slice on every
    rank, so the column shards that slice again, FSDP-style, and each of its ranks reads a
    different part of the batch.

                        tp_index 0        tp_index 1
                     +----------------+----------------+
        dp_index 0   |    rank 0      |    rank 1      |  row: tp group [0, 1]
                     |  slice 0, data |  slice 1, data |  TP all-reduce (f, g): every layer,
                     |  rows 0..b/2   |  rows 0..b/2   |  forward and backward
                     +----------------+----------------+
        dp_index 1   |    rank 2      |    rank 3      |  row: tp group [2, 3]
                     |  slice 0, data |  slice 1, data |
                     |  rows b/2..b   |  rows b/2..b   |
                     +----------------+----------------+
                       column: dp      column: dp
                       group [0, 2]    group [1, 3]
                       all-gather the unit's shard before use,
                       reduce-scatter (mean) its gradient after backward

    Which collective on which group, in which order, for one step on the 2x2 mesh:

        forward   dp: all-gather embedding | tp: g, g per block | dp: all-gather each block,
                  the head (each unit gathered just before it runs)
        backward  tp: f, f per block (the input's gradient summed over the row) | dp: each
                  unit's gradient reduce-scattered, head first, embedding last

    Why the TP all-reduce must stay inside the row: its sum adds the partial products of ONE
    layer's slices over ONE batch. The ranks of a column hold the same slice and read different
    batches: summing over the world would add rank 2's partial for batch rows b/2..b to rank 0's
    for rows 0..b/2, which is nothing at all. The dp reduce-scatter is a mean of whole
    gradients of the same slice: across a row it would average different slices. Each
    collective has one group where it means something.

    The replicated parameters (the LayerNorms, the row-parallel biases, the embedding and the
    head) need nothing over the row: f's backward has already summed their input's gradient
    over the row, so the ranks of a row compute the same gradient for them. They are averaged
    over the column with the rest of their unit.

    what torch offers, and when a practitioner chooses it (P parameters, N ranks, fp32):

        way         weights kept per rank     bytes a step per rank        pays when
        DP (DDP)    4P                        ~2 x 4P (all-reduce)         the model fits
        FSDP        4P / N                    ~3 x 4P (gather x2, r-s)     it does not, links ok
        TP          4P / tp                   4 all-reduces of activations a layer is too big,
                                              per block, every step        fast links (NVLink)
        FSDP x TP   4P / (dp x tp)            FSDP's over dp on P / tp,    many machines of
                                              TP's inside each machine     fast-linked GPUs

    torch: ``fully_shard(module, mesh=mesh["dp"])`` over ``parallelize_module(module,
    mesh["tp"], plan)`` of one ``init_device_mesh("cuda", (dp, tp), mesh_dim_names=("dp",
    "tp"))``: DTensors placed ``(Shard(0) over dp, Shard over tp)``. This kata writes the same
    by hand, with one flat shard per unit (k19) and k20's f and g (written for you below).
    Unlike torch (and k19) it keeps each unit's gathered weights until backward: nothing is
    freed after forward.

STEPS
    1. ``make_mesh(dp, tp)``: the grid's groups, a row's tp group and a column's dp group for
       this rank (every rank creates every group, in the same order); a ``ValueError`` when
       ``dp x tp`` is not the world size.
    2. Tensor parallel inside the row: ``tp_shard`` (this tp rank's rows or columns of a
       linear, a ``ValueError`` when they do not divide), ``RowParallelLinear.forward`` (g on
       the tp group, the bias once) and ``TensorParallelBlock.forward`` (f on the tp group
       before attention and before the MLP).
    3. FSDP down the column: ``shard_of`` (this dp rank's piece of a unit's flat vector) and
       ``GatherFromColumn`` (all-gather forward, reduce-scatter and mean backward, on the dp
       group).
    4. ``train_step``: this row's part of the batch, loss, backward, optimizer step; training
       equals one process.
    5. ``full_state``: the dense model's whole state back from the 2-D shards (gather down the
       column, then across the row), held against torch's ``fully_shard`` x
       ``parallelize_module`` trained on the same 4 ranks.

WHAT THE TESTS CHECK
    The groups of 2x2, 1x4 and 4x1 meshes on 4 ranks (members, sizes, this rank's indices,
    an all-reduce over each) and a ``ValueError`` naming the world size for meshes that do not
    fit (3x2, 2x1, 0x4, 4x0); each linear's slice, taken by the rank in the
    row; a TP block's output and gradients equal to the dense block's slices, with one
    all-reduce forward and one backward per half on the tp group and none elsewhere; shards
    padded and picked by the rank in the column; the gather and its reduce-scatter (a mean) on
    the dp group only; training on 2x2, 1x4 and 4x1 meshes equal to one process, with the
    recorded order of collectives per group; the full state equal to one process's and to
    torch's ``fully_shard(mesh["dp"])`` + ``parallelize_module(mesh["tp"])`` after the same
    steps on the same 4 ranks; and the program.

RUN IT
    .venv/bin/python -m katas.k28_fsdp_tp --dp 2 --tp 2
"""

from __future__ import annotations

import argparse
import copy
import inspect
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from dojo.console import run_program, say, verdict
from dojo.devices import rank_device
from dojo.launch import add_launch_arguments, launch_world
from dojo.toy_models import Block, make_tokens, make_transformer, transformer_loss

# --------------------------------------------------------------------------- written for you


@dataclass
class Mesh:
    """This rank's place in a ``dp x tp`` grid: rank ``= dp_index * tp + tp_index``.

    ``tp_group``: this rank's row (the ranks ``dp_index * tp .. dp_index * tp + tp - 1``, the
    same layers' slices, the same data); ``dp_group``: its column (the ranks ``tp_index,
    tp_index + tp, ...``, the same slice, different data). ``tp_ranks`` and ``dp_ranks`` list
    their members (global ranks, in order)."""

    dp: int
    tp: int
    dp_index: int
    tp_index: int
    tp_group: object = None
    dp_group: object = None
    tp_ranks: list[int] = field(default_factory=list)
    dp_ranks: list[int] = field(default_factory=list)


class CopyToParallelRegion(torch.autograd.Function):
    """k20's f: forward the input unchanged; backward, the gradient's sum over ``group``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad, None


class ReduceFromParallelRegion(torch.autograd.Function):
    """k20's g: forward, the input's sum over ``group``; backward, the gradient unchanged."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        total = x.clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def all_gather_flat(output: torch.Tensor, piece: torch.Tensor, group=None) -> None:
    """Every rank's ``piece`` end to end into ``output``, in rank order (torch 2.14 calls it
    ``all_gather_single``; older versions ``all_gather_into_tensor``)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, piece, group=group)


def reduce_scatter_flat(output: torch.Tensor, full: torch.Tensor, group=None) -> None:
    """The sum over the ranks of piece ``rank`` of ``full`` into ``output`` (a SUM)."""
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    scatter(output, full, group=group)


# Which linears of a block tensor parallelism splits, and how (the plan torch's
# parallelize_module gets too): column-parallel keeps output features (weight rows),
# row-parallel keeps input features (weight columns).
TP_PLAN = {
    "attention.query": "column",
    "attention.key": "column",
    "attention.value": "column",
    "attention.out": "row",
    "mlp.up": "column",
    "mlp.down": "row",
}


# --------------------------------------------------------------------------- step 1: the mesh


def make_mesh(dp: int, tp: int) -> Mesh:
    """This rank's ``Mesh`` of a ``dp x tp`` grid over the whole world.

    Every rank creates every row's group and every column's group, in the same order (rows
    first, then columns); this rank keeps its own row as ``tp_group`` and its own column as
    ``dp_group``. A ``ValueError`` saying what to do when ``dp`` or ``tp`` is below 1 or
    ``dp * tp`` is not the world size."""
    # BEGIN STEP 1: the 2-D mesh's groups
    # TODO: every rank creates the groups of every row (the tp groups) and every column (the dp
    # groups), the same groups in the same order on every rank, and returns its own row's and
    # column's groups, its dp_index and tp_index and the members of both. A ValueError that names
    # the world size when dp or tp is below 1 or dp x tp is not the world size. The tests all-reduce
    # over the groups of 2x2, 1x4 and 4x1 meshes on 4 ranks and check the members and indices.
    world = dist.get_world_size()
    for name, value in (("dp", dp), ("tp", tp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if dp * tp != world:
        fits = [t for t in range(1, world + 1) if world % t == 0]
        raise ValueError(
            f"a {dp} x {tp} mesh needs {dp * tp} ranks, but the world has {world}: choose dp "
            f"and tp whose product is {world} (tp one of {fits}, dp = {world} // tp)"
        )
    rank = dist.get_rank()
    dp_index, tp_index = divmod(rank, tp)
    rows = [list(range(d * tp, (d + 1) * tp)) for d in range(dp)]
    columns = [list(range(t, world, tp)) for t in range(tp)]
    row_groups = [dist.new_group(ranks) for ranks in rows]
    column_groups = [dist.new_group(ranks) for ranks in columns]
    return Mesh(
        dp=dp,
        tp=tp,
        dp_index=dp_index,
        tp_index=tp_index,
        tp_group=row_groups[dp_index],
        dp_group=column_groups[tp_index],
        tp_ranks=rows[dp_index],
        dp_ranks=columns[tp_index],
    )
    # END STEP 1


# --------------------------------------------------------------------------- step 2: TP in the row


def tp_shard(linear: nn.Linear, style: str, mesh: Mesh) -> tuple[torch.Tensor, torch.Tensor | None]:
    """This tp rank's share of ``linear``: ``(weight, bias)``, copies.

    ``style="column"``: the rows (output features) ``[tp_index * n, (tp_index + 1) * n)`` of the
    weight and the same entries of the bias, ``n = out_features / tp``. ``style="row"``: the
    columns (input features) of the weight the same way, and the whole bias. A ``ValueError``
    when the features do not divide by ``tp`` (or the style is neither)."""
    # BEGIN STEP 2: tensor parallel inside the row
    # TODO: copies of this rank's share of linear's weight and bias: the rows
    # (column style) or the columns (row style, with the whole bias) of mesh.tp_index's share,
    # out of tp equal shares; a ValueError when the features do not divide by tp. The tests compare
    # every rank's slice of a Linear(16, 64) on a 2x2 mesh exactly and name the slice taken.
    if style not in ("column", "row"):
        raise ValueError(f"style must be 'column' or 'row', got {style!r}")
    features = linear.out_features if style == "column" else linear.in_features
    if features % mesh.tp:
        raise ValueError(
            f"a {style}-parallel linear's {features} features do not split over tp = {mesh.tp} "
            "ranks: choose a tp that divides every split layer's features (and the heads)"
        )
    share = features // mesh.tp
    start, end = mesh.tp_index * share, (mesh.tp_index + 1) * share
    with torch.no_grad():
        if style == "column":
            weight = linear.weight[start:end].clone()
            bias = linear.bias[start:end].clone() if linear.bias is not None else None
        else:
            weight = linear.weight[:, start:end].clone()
            bias = linear.bias.clone() if linear.bias is not None else None
    return weight, bias
    # END STEP 2


class RowParallelLinear(nn.Module):
    """A row-parallel linear: this tp rank's columns of the weight and the whole bias; its
    output is the full ``linear(x)`` on every rank of the row."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, mesh: Mesh):
        super().__init__()
        self.mesh = mesh
        self.weight = nn.Parameter(weight)
        self.bias = nn.Parameter(bias) if bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial product summed over the ROW (g on ``mesh.tp_group``), then the
        bias, once."""
        # BEGIN STEP 2: tensor parallel inside the row
        # TODO: the full linear(x) on every rank of the row: this rank's
        # partial product summed over the row's ranks (g, written for you above, on the right group),
        # then the bias, once. The tests record the block's calls: all on the tp group.
        total = ReduceFromParallelRegion.apply(F.linear(x, self.weight), self.mesh.tp_group)
        return total + self.bias if self.bias is not None else total
        # END STEP 2


class TensorParallelBlock(nn.Module):
    """``dojo.toy_models.Block`` split over the row: q, k, v and up column-parallel (plain
    linears holding this rank's rows), out and down ``RowParallelLinear``; the LayerNorms
    replicated. Parameter names are the dense block's."""

    def __init__(self, block: Block, mesh: Mesh):
        super().__init__()
        self.mesh = mesh
        heads = block.attention.query.out_features // block.attention.head_dim
        if heads % mesh.tp:
            raise ValueError(
                f"{heads} heads do not split over tp = {mesh.tp} ranks: each rank holds whole "
                "heads, so tp must divide the number of heads"
            )
        split = copy.deepcopy(block)
        for name, style in TP_PLAN.items():
            parent, _, attribute = name.rpartition(".")
            weight, bias = tp_shard(block.get_submodule(name), style, mesh)
            if style == "row":
                layer = RowParallelLinear(weight, bias, mesh)
            else:
                layer = nn.Linear(
                    weight.shape[1],
                    weight.shape[0],
                    bias=bias is not None,
                    device=weight.device,
                    dtype=weight.dtype,
                )
                with torch.no_grad():
                    layer.weight.copy_(weight)
                    if bias is not None:
                        layer.bias.copy_(bias)
            setattr(split.get_submodule(parent), attribute, layer)
        self.attention_norm, self.attention = split.attention_norm, split.attention
        self.mlp_norm, self.mlp = split.mlp_norm, split.mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The dense block's output, the same on every rank of the row: f on ``mesh.tp_group``
        entering attention and entering the MLP (their input's gradient sums every slice's)."""
        # BEGIN STEP 2: tensor parallel inside the row
        # TODO: the dense block's output, the same on every rank of
        # the row: attention and the MLP each entered through f on the row's group, after their
        # LayerNorm. The tests record exactly two all-reduces on the tp group forward and two backward
        # (none on any other group), and compare the output, the input's gradient and every
        # parameter's gradient with the dense block's slice.
        group = self.mesh.tp_group
        x = x + self.attention(CopyToParallelRegion.apply(self.attention_norm(x), group))
        return x + self.mlp(CopyToParallelRegion.apply(self.mlp_norm(x), group))
        # END STEP 2


# --------------------------------------------------------------------------- step 3: FSDP down the column


def shard_of(flat: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    """This dp rank's piece of the 1-D ``flat``, padded with zeros to a multiple of ``mesh.dp``:
    a new tensor of ``ceil(len(flat) / dp)`` elements, piece ``mesh.dp_index``."""
    # BEGIN STEP 3: FSDP down the column
    # TODO: a new tensor: flat padded with zeros to a multiple of dp, piece dp_index
    # of dp equal pieces. The tests check the pieces (and the padding) on small meshes exactly.
    if flat.dim() != 1:
        raise ValueError(f"flat must be one-dimensional, got shape {tuple(flat.shape)}: flatten it")
    chunk = -(-flat.numel() // mesh.dp)
    padded = torch.zeros(chunk * mesh.dp, dtype=flat.dtype, device=flat.device)
    padded[: flat.numel()] = flat
    return padded[mesh.dp_index * chunk : (mesh.dp_index + 1) * chunk].clone()
    # END STEP 3


class GatherFromColumn(torch.autograd.Function):
    """Forward: every column rank's shard gathered into the unit's full (padded) flat vector, on
    ``mesh.dp_group``. Backward: that vector's gradient reduce-scattered on ``mesh.dp_group``
    and divided by ``mesh.dp``: the mean over the column of this rank's piece."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor, mesh: Mesh) -> torch.Tensor:
        # BEGIN STEP 3: FSDP down the column
        # TODO: the column's shards end to end (the unit's padded flat
        # vector), gathered on the column's group, in column order. The tests record exactly one
        # all-gather on the dp group and compare the values exactly.
        ctx.mesh = mesh
        full = torch.empty(shard.numel() * mesh.dp, dtype=shard.dtype, device=shard.device)
        all_gather_flat(full, shard.detach().contiguous(), mesh.dp_group)
        return full
        # END STEP 3

    @staticmethod
    def backward(ctx, grad_full: torch.Tensor):
        # BEGIN STEP 3: FSDP down the column
        # TODO: this rank's piece of the full vector's gradient, the MEAN
        # over the column's ranks (each read a different part of the batch), and None for the mesh.
        # The tests record exactly one reduce-scatter on the dp group and compare the values.
        mesh = ctx.mesh
        grad = torch.empty(
            grad_full.numel() // mesh.dp, dtype=grad_full.dtype, device=grad_full.device
        )
        reduce_scatter_flat(grad, grad_full.contiguous(), mesh.dp_group)
        return grad / mesh.dp, None
        # END STEP 3


class FlatUnit(nn.Module):
    """One unit: ``module``'s parameters flattened end to end, this rank's piece of them kept
    (``shard``, a Parameter); forward gathers them and runs ``module`` on them. A subclass says
    which piece (``piece``) and how it is gathered (``gather``, an autograd Function of the
    shard and the mesh). k36's HSDP units are the same, cut another way."""

    gather: type[torch.autograd.Function]

    def piece(self, flat: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("a FlatUnit's subclass says which piece of flat this rank keeps")

    def __init__(self, module: nn.Module, mesh):
        super().__init__()
        self.mesh = mesh
        self.names = [name for name, _ in module.named_parameters()]
        self.shapes = [p.shape for _, p in module.named_parameters()]
        with torch.no_grad():
            flat = torch.cat([p.detach().reshape(-1) for _, p in module.named_parameters()])
        self.numel = flat.numel()
        self.shard = nn.Parameter(self.piece(flat))
        for p in module.parameters():
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)  # the shard holds them now
            p.requires_grad_(False)
        object.__setattr__(self, "module", module)  # not a submodule: its weights are the shard's

    def unit_parameters(self, full: torch.Tensor) -> dict[str, torch.Tensor]:
        """The module's parameters as views of the unit's gathered flat vector."""
        out, start = {}, 0
        for name, shape in zip(self.names, self.shapes):
            end = start + shape.numel()
            out[name] = full[start:end].view(shape)
            start = end
        return out

    def forward(self, *args):
        full = self.gather.apply(self.shard, self.mesh)
        return torch.func.functional_call(self.module, self.unit_parameters(full), args)


class ShardedUnit(FlatUnit):
    """One FSDP unit down the column: ``module``'s (already tensor-parallel) parameters, sharded
    over the column (``shard_of``) and gathered from it."""

    gather = GatherFromColumn

    def piece(self, flat: torch.Tensor) -> torch.Tensor:
        return shard_of(flat, self.mesh)


class UnitTransformer(nn.Module):
    """A TinyTransformer (copied) cut in units of the subclass's kind (``unit``, a FlatUnit): the
    embedding, each block (as ``block`` makes it), the final norm with the output layer. k36's
    HsdpTransformer is one too."""

    unit: type[FlatUnit]

    def block(self, block: nn.Module, mesh) -> nn.Module:
        return block

    def __init__(self, model: nn.Module, mesh):
        super().__init__()
        model = copy.deepcopy(model)
        self.mesh = mesh
        self.embedding = self.unit(model.embedding, mesh)
        self.blocks = nn.ModuleList(self.unit(self.block(b, mesh), mesh) for b in model.blocks)
        self.head = self.unit(nn.Sequential(model.norm, model.output), mesh)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class FsdpTpTransformer(UnitTransformer):
    """A TinyTransformer on a 2-D mesh: each block tensor-parallel over the row, then every unit
    (the embedding, each block, the final norm with the output layer) sharded down the column."""

    unit = ShardedUnit

    def block(self, block: nn.Module, mesh: Mesh) -> nn.Module:
        return TensorParallelBlock(block, mesh)


# --------------------------------------------------------------------------- step 4: training


def train_step(
    model: FsdpTpTransformer,
    optimizer: torch.optim.Optimizer,
    tokens: torch.Tensor,
    targets: torch.Tensor,
    mesh: Mesh,
) -> float:
    """One step on the GLOBAL batch ``(tokens, targets)`` (every rank is given all of it): this
    rank's row reads its part, the rows ``[dp_index * b, (dp_index + 1) * b)`` with ``b =
    batch / dp`` (the ranks of a row the same part); loss, backward, the optimizer's step and
    zeroed gradients. Returns this row's loss. A ``ValueError`` when the batch does not
    divide by ``dp``."""
    # BEGIN STEP 4: training equal to one process
    # TODO: one optimizer step on this row's part of the global batch (the ranks of
    # a row the same part), gradients zeroed after it, the loss as a float; a ValueError when the
    # batch does not divide by dp. The tests compare every step's loss with one process's on that
    # part, the trained weights with one process's on 2x2, 1x4 and 4x1 meshes, and record the order
    # of one step's collectives on each group.
    if tokens.shape[0] % mesh.dp:
        raise ValueError(
            f"a batch of {tokens.shape[0]} does not split over dp = {mesh.dp} rows: use a "
            "batch that is a multiple of dp"
        )
    share = tokens.shape[0] // mesh.dp
    mine = slice(mesh.dp_index * share, (mesh.dp_index + 1) * share)
    loss = transformer_loss(model(tokens[mine]), targets[mine])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()
    # END STEP 4


# --------------------------------------------------------------------------- step 5: the whole state


def full_state(model: FsdpTpTransformer, mesh: Mesh) -> dict[str, torch.Tensor]:
    """The dense TinyTransformer's parameters (its ``named_parameters`` names) on every rank:
    each unit's shard gathered down the column (``mesh.dp_group``), then each tensor-parallel
    weight gathered across the row (``mesh.tp_group``) and joined along the dimension it was
    split (column-parallel: rows, dim 0; row-parallel: columns, dim 1; a column-parallel bias
    too); replicated ones as they are. New tensors, no autograd."""
    # BEGIN STEP 5: the whole state, against torch's
    # TODO: every dense parameter, whole, on every rank, under the dense model's
    # names: each unit gathered down the column (its padding dropped), then each tensor-parallel
    # slice gathered across the row and joined on the dimension it was split. The tests compare it
    # with one process's trained model and with torch's fully_shard x parallelize_module trained on
    # the same 4 ranks, and record only dp and tp group calls.
    units = [("embedding.", model.embedding)]
    units += [(f"blocks.{i}.", unit) for i, unit in enumerate(model.blocks)]
    units += [("", model.head)]
    out = {}
    with torch.no_grad():
        for prefix, unit in units:
            full = torch.empty(
                unit.shard.numel() * mesh.dp, dtype=unit.shard.dtype, device=unit.shard.device
            )
            all_gather_flat(full, unit.shard.detach().contiguous(), mesh.dp_group)
            for name, local in unit.unit_parameters(full[: unit.numel]).items():
                layer, _, kind = name.rpartition(".")
                style = TP_PLAN.get(layer) if prefix.startswith("blocks.") else None
                if unit is model.head:  # nn.Sequential(norm, output): 0. and 1.
                    name = name.replace("0.", "norm.", 1).replace("1.", "output.", 1)
                if style is None or (style == "row" and kind == "bias"):
                    out[prefix + name] = local.clone()
                    continue
                pieces = [torch.empty_like(local) for _ in range(mesh.tp)]
                dist.all_gather(pieces, local.contiguous(), group=mesh.tp_group)
                dim = 1 if style == "row" else 0
                out[prefix + name] = torch.cat(pieces, dim=dim)
    return out
    # END STEP 5


# --------------------------------------------------------------------------- the program


def _counted_step(model, optimizer, tokens, targets, mesh) -> tuple[float, dict[str, list[str]]]:
    """``train_step`` while every all-reduce, all-gather and reduce-scatter (into one tensor or a
    list alike) is noted by group, however the group was passed."""
    seen: dict[str, list[str]] = {"tp": [], "dp": [], "world": []}
    originals = {}

    def which(group) -> str:
        if group is mesh.tp_group:
            return "tp"
        return "dp" if group is mesh.dp_group else "world"

    for name, short in (
        ("all_reduce", "all-reduce"),
        ("all_gather", "all-gather"),
        ("all_gather_single", "all-gather"),
        ("all_gather_into_tensor", "all-gather"),
        ("reduce_scatter", "reduce-scatter"),
        ("reduce_scatter_single", "reduce-scatter"),
        ("reduce_scatter_tensor", "reduce-scatter"),
    ):
        original = getattr(dist, name, None)
        if original is None:
            continue
        originals[name] = original

        def counted(*args, _original=original, _short=short, **kwargs):
            try:
                group = inspect.signature(_original).bind_partial(*args, **kwargs).arguments
            except TypeError:  # torch's own call says what is wrong with them
                group = {}
            seen[which(group.get("group"))].append(_short)
            return _original(*args, **kwargs)

        setattr(dist, name, counted)
    try:
        return train_step(model, optimizer, tokens, targets, mesh), seen
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def train_on_mesh(rank: int, world_size: int, dp: int, tp: int, steps: int, seed: int) -> dict:
    """Train the tiny transformer ``steps`` steps on a ``dp x tp`` mesh; the first step's
    collectives by group, the losses, and the largest gap to one process's weights."""
    device = rank_device()
    mesh = make_mesh(dp, tp)
    dense = make_transformer(seed).to(device)
    model = FsdpTpTransformer(dense, mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    alone = copy.deepcopy(dense)
    alone_optimizer = torch.optim.SGD(alone.parameters(), lr=0.1)
    losses, calls = [], None
    for step in range(steps):
        tokens, targets = make_tokens(4 * dp, seed + 1 + step)
        tokens, targets = tokens.to(device), targets.to(device)
        loss, seen = _counted_step(model, optimizer, tokens, targets, mesh)
        calls = calls or seen
        losses.append(loss)
        transformer_loss(alone(tokens), targets).backward()
        alone_optimizer.step()
        alone_optimizer.zero_grad()
    state = full_state(model, mesh)
    gap = max((state[n] - p.detach()).abs().max().item() for n, p in alone.named_parameters())
    return {"mesh": (mesh.dp_index, mesh.tp_index), "losses": losses, "calls": calls, "gap": gap}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description="FSDP x TP: a tiny transformer trained on a dp x tp mesh of ranks (the "
        "world is dp x tp ranks: --world-size is not used)."
    )
    add_launch_arguments(parser, world_size=4)
    parser.add_argument("--dp", type=int, default=2, help="rows: sharded data parallel")
    parser.add_argument("--tp", type=int, default=2, help="ranks in a row: tensor parallel")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.dp < 1 or args.tp not in (1, 2, 4):
        parser.error("--dp must be at least 1 and --tp divide the 4 heads: 1, 2 or 4")
    world_size = args.dp * args.tp
    say(
        None, f"a {args.dp} x {args.tp} mesh on {world_size} ranks: TP in a row, FSDP down a column"
    )
    results = launch_world(
        train_on_mesh,
        world_size,
        args.dp,
        args.tp,
        args.steps,
        args.seed,
        backend=args.backend,
        device=args.device,
    )
    for rank, result in enumerate(results):
        dp_index, tp_index = result["mesh"]
        counts = "; ".join(
            f"{group}: "
            + (
                ", ".join(f"{kind} {calls.count(kind)}" for kind in dict.fromkeys(calls))
                or "nothing"
            )
            for group, calls in result["calls"].items()
        )
        losses = " ".join(f"{loss:.4f}" for loss in result["losses"])
        say(rank, f"dp {dp_index}, tp {tp_index}: losses {losses}; one step's calls: {counts}")
    worst = max(result["gap"] for result in results)
    return verdict(
        worst,
        f"after {args.steps} steps every rank's whole model equals one process's",
        "the trained model differs from one process's",
    )


if __name__ == "__main__":
    run_program(main)
