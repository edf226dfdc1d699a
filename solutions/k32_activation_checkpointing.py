"""k32 · Activation checkpointing: recompute a block's forward in backward instead of keeping it.

THE IDEA
    Backward needs what forward computed: a linear layer's gradient needs its input, a ReLU's
    its output, a softmax its output. Autograd keeps those SAVED TENSORS from forward until the
    node that needs them has run in backward, and for a transformer they, not the weights, fill
    the device: k25 counted them for one TinyTransformer block in fp32 (b batch, s sequence,
    h width, a heads):

        4 (12 b s h + a b s s + 4 b s) + s s bytes    (LayerNorms' inputs and outputs, q, k,
                                                        v, the attention's output, the ReLU's
                                                        output, the softmax, the causal mask)

    Checkpointing a block keeps only its INPUT and throws the rest away; in backward, when the
    first node of the block asks for a saved tensor, the block's forward runs again from that
    input and every saved tensor comes from the second run:

        forward    x --[block: nothing kept but x]--> y --> ... --> loss
        backward   loss --> ... --> y.grad --+-- the block's first saved tensor is asked for:
                                             |   forward again from x (with grad on), keep
                                             |   what autograd saves, in the same order
                                             +-> the block's backward on those --> x.grad

    The gradients are the same numbers, bitwise: the same operations run on the same inputs.
    The price is one more forward of the block in backward (a forward is about a third of a
    step's compute: a step with every block checkpointed does about 4/3 of the work). Chen et
    al. (2016) checkpoint every sqrt(n)-th layer of n for O(sqrt(n)) memory; transformers
    checkpoint each block.

    How do you keep nothing? ``torch.autograd.graph.saved_tensors_hooks(pack, unpack)``: while
    it is active, every tensor autograd saves goes through ``pack`` and what ``pack`` returns is
    stored instead; backward gives that to ``unpack`` and uses what ``unpack`` returns. A
    checkpoint's ``pack`` returns a number (the tensor's place in the order of saving); its
    ``unpack`` runs the block again at the first call and returns the recomputed tensor at that
    place. The inputs are kept as autograd keeps its own (``Kept`` below: an in-place change to
    one before backward is then an error instead of silently wrong gradients, and a meter, or
    ``save_on_cpu``, sees them).

    THE RNG TRAP. A block with dropout draws a random mask in forward; the recompute draws
    again. Unless the random state is put back as it was, the recompute uses another mask and
    the gradients belong to a different network than the loss. ``preserve_rng_state``: take a
    snapshot of the generator (the CPU's, and each CUDA device's of the inputs) before forward,
    and run the recompute from it, inside ``torch.random.fork_rng`` so that the generator
    afterwards is where the rest of training left it.

    SELECTIVE. Recomputing the whole block repeats its matmuls, the expensive part. Korthikanti
    et al. (2022) keep the linear layers' outputs and recompute only what is cheap to redo but
    big to keep: the pointwise ops, the norms, the attention's core (QK^T, the softmax, the
    masks, attention times V), whose a b s s grows with the square of the sequence. In their
    accounting (fp16, with dropout) a GPT layer keeps s b h (34 + 5 a s / h) bytes; for GPT-3
    (a = 96, s = 2048, h = 12288) 5 a s / h is 80 of the 114: recomputing the core drops 70% of
    the activations, for s / 6h (3%) of the forward's flops (the core's 4 b s s h against the
    linear layers' 24 b s h h). How? Below autograd a ``TorchDispatchMode`` sees every ATen op a
    block runs: in forward it keeps the outputs of the ops chosen (``aten.mm``, ``aten.addmm``:
    the linear layers); in the recompute it hands those back instead of running the op. What
    one TinyTransformer block keeps (fp32 floats, in units of b s h):

        what                                           none       full      selective
        its input                                      1          1         1
        the residual after the attention               1
        the LayerNorms' outputs                        2
        q, k and v, as the attention's bmm reads them  3
        the attention's output (out's input)           1
        the ReLU's output (up's, 4 h wide)             4                    4
        the outputs of q, k, v, out and down                                5
        the softmax's output                           a s / h
        the LayerNorms' means and 1/std                4 / h
        the causal mask                                s s bytes
        b = 1, s = 2048, h = 64, a = 4                 74 MiB     0.5 MiB   5 MiB

    A ReLU block keeps little that selective drops but the softmax: it pays as the sequence
    grows (15x less here); a GeLU block, or one with dropout, keeps more pointwise outputs.

    What torch offers, and when a practitioner chooses it (one block of width h, b s tokens):

        torch.utils.checkpoint.checkpoint      keeps the input: 4 b s h     one more forward
          (fn, *args, use_reentrant=False)                                   of the block
        + context_fn=partial(create_selective_ the input and the chosen      the pointwise ops
          checkpoint_contexts, [aten.mm, ...]) ops' outputs (MUST_SAVE;     and the attention's
                                               PREFER_RECOMPUTE the rest)    core again
        checkpoint_wrapper / apply_activation_ the same, module by module;  as above
          checkpointing (distributed)          names gain a prefix
        torch.autograd.graph.save_on_cpu()     every saved tensor, on the   copies to the host
                                               host (pinned)                and back (PCIe)
        use_reentrant=True (the old default)   the input                    no autograd.grad, no
                                                                             gradient for
                                                                             parameters alone

        Choose none while activations fit; selective first (most of the memory, little
        compute); full where it still does not fit; offload where the host is idle and PCIe
        fast. Checkpointing trades compute for memory, never bytes on the wire.

    INSIDE FSDP. k19's FullyShardedModule frees a unit's weights after its forward and gathers
    them again in backward. Checkpoint the unit's whole call (``Checkpointed(block)``, made
    after the units are): the recompute then runs the unit's hooks too, and gathers its
    weights before the block runs again; checkpointing the block's forward alone would run it
    without them. That gather is the one backward makes anyway (k19 gathers a unit again for
    its saved views): the all-gathers per step stay one per unit forward and one per
    checkpointed unit backward, now made at the recompute. With ``reshard_after_forward=False``
    the kept weights serve the recompute: no gather in backward, as without checkpointing.

STEPS
    1. ``activation_bytes``: what one block keeps for backward, by formula, with no
       checkpointing, with a full one and with a selective one.
    2. ``checkpoint``: full recomputation, with saved-tensor hooks: the inputs kept (``Kept``),
       the function run again at backward's first saved tensor, once.
    3. ``rng_snapshot`` and ``replayed_rng``: the recompute draws the same random numbers, and
       leaves the generator as it found it.
    4. ``SaveOutputs`` and ``ReplayOutputs``: selective recomputation, the chosen ops' outputs
       kept in forward and handed back in the recompute.
    5. ``Checkpointed`` and ``checkpoint_blocks``: a model's blocks checkpointed, inside k19's
       FSDP units.
    ``Kept`` (tensors kept as autograd keeps its own) is written for you.

WHAT THE TESTS CHECK
    ``activation_bytes`` against what torch's own ways keep, measured with
    ``saved_tensors_hooks`` on a Block at two shapes (no checkpointing, ``torch.utils.checkpoint``
    and ``create_selective_checkpoint_contexts``), and bad input refused; ``checkpoint`` on the
    TinyTransformer bitwise equal to no checkpointing and to ``checkpoint(use_reentrant=False)``
    (outputs, every gradient), keeping only its inputs (measured, and nothing else of forward
    left alive), running the function again once in backward, giving parameters their
    gradients when no input needs one, catching an input changed in place, just running under
    ``no_grad``, refusing what it cannot call; dropout recomputed with the same masks (bitwise
    equal to no checkpointing) and the generator afterwards as without checkpointing, on CUDA
    too; selective recomputation bitwise equal to torch's with the same ops, keeping their
    outputs (measured), running none of them again (counted), refusing what is not an op, and
    an error where the recompute runs other ops; ``checkpoint_blocks`` on the model's own
    blocks; on 2 ranks inside k19's FSDP units (your k19: write it first), the shards'
    gradients bitwise equal to FSDP without checkpointing and the all-gathers counted per step;
    and the program.

RUN IT
    .venv/bin/python -m katas.k32_activation_checkpointing --world-size 2
"""

from __future__ import annotations

import argparse
import contextlib

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from dojo.console import run_program, say, verdict
from dojo.devices import rank_device
from dojo.launch import add_launch_arguments, launch_world
from dojo.toy_models import VOCABULARY, Block, TinyTransformer

from .k19_fsdp import FullyShardedModule, counted_step
from .k25_sequence_parallel import saved_activation_bytes

aten = torch.ops.aten
LINEAR_MATMULS = (aten.mm.default, aten.addmm.default)  # what a linear layer's product runs as
KEEPS = ("everything", "input", "matmuls")  # activation_bytes: no, full, selective checkpointing


def activation_bytes(
    batch: int, sequence: int, dim: int, heads: int, keep: str = "everything"
) -> int:
    """The bytes one TinyTransformer ``Block`` keeps for backward in fp32, its parameters aside:
    ``keep="everything"`` without checkpointing, ``"input"`` checkpointed, ``"matmuls"``
    checkpointed keeping the outputs of ``LINEAR_MATMULS`` (its six linear layers)."""
    # BEGIN STEP 1: what a block keeps: without, with full and with selective checkpointing
    # TODO: the bytes one Block (batch x sequence tokens of width dim, heads heads, fp32) keeps for
    # backward, its parameters aside, as an int from the shape alone: keep="everything" with no
    # checkpointing, "input" when the block is checkpointed, "matmuls" when it is checkpointed
    # keeping its linear layers' outputs. Another keep, a size below 1 or a dim that heads do not
    # divide is a ValueError. The tests measure torch's own three ways on a Block at two shapes
    # (saved_tensors_hooks: every distinct storage) and compare exactly.
    if keep not in KEEPS:
        raise ValueError(f"keep={keep!r}: choose one of {', '.join(map(repr, KEEPS))}")
    sizes = {"batch": batch, "sequence": sequence, "dim": dim, "heads": heads}
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if dim % heads:
        raise ValueError(f"dim {dim} does not divide into {heads} heads: give a multiple of heads")
    tokens = batch * sequence
    if keep == "input":
        return 4 * tokens * dim
    if keep == "matmuls":  # the input, q, k, v and out, up (4 dim), down
        return 4 * (1 + 4 + 4 + 1) * tokens * dim
    floats = 12 * tokens * dim + heads * batch * sequence * sequence + 4 * tokens
    return 4 * floats + sequence * sequence  # the causal mask: one bool per pair
    # END STEP 1


# --------------------------------------------------------------------------- written for you


class _KeepForBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, anchor: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(*tensors)
        return anchor.new_empty(0)

    @staticmethod
    def backward(ctx, *grads):  # nothing flows through it: its output is used by nothing
        raise RuntimeError("Kept's node is never part of a backward")


class Kept:
    """``tensors`` kept for backward as autograd keeps its own saved tensors (torch's
    checkpoint keeps its inputs so): saved-tensor hooks see them, a tensor changed in place
    before ``tensors()`` gives it back is an error there, and they go when the graph that
    needs them does."""

    def __init__(self, tensors):
        with torch.enable_grad():
            anchor = torch.empty(0, requires_grad=True)  # a node, whatever the tensors need
            self._node = _KeepForBackward.apply(anchor, *tensors).grad_fn

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self._node.saved_tensors


# --------------------------------------------------------------------------- the checkpoint


def checkpoint(function, *args, preserve_rng_state: bool = True, save=()):
    """``function(*args)``, keeping for backward only the tensors among ``args`` (and, when
    ``save`` names ATen ops, those ops' outputs): the function runs again in backward, once,
    when the first tensor it saved is needed. The gradients equal those without checkpointing,
    bitwise. ``preserve_rng_state``: the recompute draws the random numbers forward drew."""
    # BEGIN STEP 2: full recomputation with saved-tensor hooks
    # TODO: function(*args)'s output, keeping nothing autograd saves inside it: the tensors among
    # args are kept through Kept (nothing else of forward stays alive). In backward, at the first
    # saved tensor a node asks for, function runs again (once; with grad on, from the kept inputs)
    # and every saved tensor comes from that run, in the order forward saved them; parameters get
    # their gradients even when no input needs one. Under torch.no_grad() it just runs function. A
    # function that is not callable is a ValueError before anything runs. With preserve_rng_state
    # the recompute runs inside replayed_rng(rng_snapshot(args)) (step 3); with a save, forward
    # runs under SaveOutputs(save) and the recompute under ReplayOutputs (step 4): the step 2 tests
    # pass preserve_rng_state=False and no save. They hold the TinyTransformer's outputs and
    # gradients bitwise against no checkpointing and torch's checkpoint(use_reentrant=False),
    # measure what forward keeps and count the function's runs.
    if not callable(function):
        raise ValueError(
            f"checkpoint runs function(*args) again in backward: give a callable (a module or "
            f"a function), not a {type(function).__name__}"
        )
    if not torch.is_grad_enabled():  # no graph: nothing would be saved, nothing recomputed
        return function(*args)
    snapshot = rng_snapshot(args) if preserve_rng_state else None
    saving = SaveOutputs(save) if save else contextlib.nullcontext()
    where = [i for i, arg in enumerate(args) if torch.is_tensor(arg)]
    others = [None if torch.is_tensor(arg) else arg for arg in args]  # kept as they are
    packed = [0]  # how many tensors forward saved: each is known by its place
    recomputed: list[torch.Tensor] = []
    state: dict = {}

    def pack(tensor: torch.Tensor) -> int:
        packed[0] += 1
        return packed[0] - 1

    def unpack(index: int) -> torch.Tensor:
        if not recomputed:  # the first saved tensor backward needs: run the function again
            tensors = state["kept"].tensors()
            inputs = list(others)
            for i, tensor in zip(where, tensors):
                inputs[i] = tensor.detach().requires_grad_(tensor.requires_grad)
            outputs = list(zip(state["ops"], tensors[len(where) :]))
            replaying = ReplayOutputs(outputs) if save else contextlib.nullcontext()

            def keep(tensor: torch.Tensor) -> torch.Tensor:
                recomputed.append(tensor)
                return tensor

            with torch.enable_grad(), replayed_rng(snapshot), replaying:
                with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
                    function(*inputs)
        return recomputed[index]

    with saving, torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        output = function(*args)
    kept = saving.kept if save else []
    state["ops"] = [op for op, _ in kept]
    state["kept"] = Kept([args[i] for i in where] + [tensor for _, tensor in kept])
    return output
    # END STEP 2


def rng_snapshot(tensors) -> tuple:
    """The random state a recompute must start from: the CPU generator's, and that of each
    CUDA device that holds one of ``tensors`` (a dropout on a GPU draws there)."""
    # BEGIN STEP 3: the RNG trap: the same random numbers in the recompute
    # TODO: what replayed_rng needs to make the recompute draw the numbers forward draws from here
    # on: the CPU generator's state and the state of every CUDA device that holds one of the
    # tensors (others are ignored). The tests recompute blocks with dropout and compare the
    # gradients bitwise with no checkpointing, on the CPU and on CUDA.
    devices = sorted(
        {t.device.index for t in tensors if torch.is_tensor(t) and t.device.type == "cuda"}
    )
    return torch.get_rng_state(), [(d, torch.cuda.get_rng_state(d)) for d in devices]
    # END STEP 3


@contextlib.contextmanager
def replayed_rng(snapshot: tuple | None):
    """Inside: the generators as ``snapshot`` found them; after: as they were before entering
    (the recompute's draws leave no trace). ``None``: the generators untouched."""
    # BEGIN STEP 3: the RNG trap: the same random numbers in the recompute
    # TODO: inside the with block every generator of the snapshot (None: nothing happens) draws from
    # the state rng_snapshot took; after it, every generator is where it was when the block began.
    # The tests draw between forward and backward, as the rest of a model does, and compare the
    # CPU generator's state after backward with a run without checkpointing.
    if snapshot is None:
        yield
        return
    cpu, cuda = snapshot
    with torch.random.fork_rng(devices=[d for d, _ in cuda]):
        torch.set_rng_state(cpu)
        for device, state in cuda:
            torch.cuda.set_rng_state(state, device)
        yield
    # END STEP 3


class SaveOutputs(TorchDispatchMode):
    """Forward, selectively: every ATen op runs; the outputs of the ops in ``save`` are kept,
    in order, as ``self.kept``: ``(op, output)`` pairs."""

    def __init__(self, save):
        super().__init__()
        # BEGIN STEP 4: selective: the chosen ops' outputs kept, handed back in the recompute
        # TODO: the ops to keep, as self.save: every one of save must be an ATen op overload
        # (torch.ops.aten.mm.default), else a ValueError saying which and what to pass, raised here,
        # before anything runs; self.kept starts empty.
        if isinstance(save, torch._ops.OpOverload):
            save = (save,)
        for op in save:
            if not isinstance(op, torch._ops.OpOverload):
                hint = f"{op}.default" if isinstance(op, torch._ops.OpOverloadPacket) else None
                raise ValueError(
                    f"save holds {op!r}, which is not an ATen op overload: name the op as the "
                    f"dispatcher sees it, {hint or 'torch.ops.aten.mm.default'}"
                )
        self.save = frozenset(save)
        self.kept: list[tuple] = []
        # END STEP 4

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # BEGIN STEP 4: selective: the chosen ops' outputs kept, handed back in the recompute
        # TODO: run every op; an op in self.save has its output kept (detached) in self.kept, with
        # the op, in the order they ran. The tests measure what the checkpoint keeps and compare the
        # gradients bitwise with torch's create_selective_checkpoint_contexts on the same ops.
        output = func(*args, **(kwargs or {}))
        if func in self.save:
            self.kept.append((func, output.detach()))
        return output
        # END STEP 4


class ReplayOutputs(TorchDispatchMode):
    """The recompute, selectively: an op whose output forward kept hands that back instead of
    running; every other op runs."""

    def __init__(self, kept):
        super().__init__()
        self.kept = list(kept)  # (op, output) in the order forward ran them
        self.ops = {op for op, _ in self.kept}
        self.next = 0  # the place in self.kept of the next output to hand back

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # BEGIN STEP 4: selective: the chosen ops' outputs kept, handed back in the recompute
        # TODO: an op that forward kept, met in the same order, returns that output (detached)
        # without running; every other op runs. If the recompute asks for another op than forward
        # kept at that point, raise RuntimeError (the function did not run the same ops again). The
        # tests count the matmuls the recompute runs: none of those kept.
        if func not in self.ops:
            return func(*args, **(kwargs or {}))
        if self.next >= len(self.kept) or self.kept[self.next][0] is not func:
            expected = self.kept[self.next][0] if self.next < len(self.kept) else "nothing more"
            raise RuntimeError(
                f"the recompute ran {func} where forward kept {expected}: the function did not "
                "run the same ops again (does it depend on something that changed since "
                "forward?)"
            )
        op, output = self.kept[self.next]
        self.next += 1
        return output.detach()
        # END STEP 4


# --------------------------------------------------------------------------- a model's blocks


class Checkpointed(nn.Module):
    """``module``'s whole call (its hooks included) run through ``checkpoint``."""

    def __init__(self, module: nn.Module, save=(), preserve_rng_state: bool = True):
        super().__init__()
        self.module = module
        self.save = tuple(save)
        self.preserve_rng_state = preserve_rng_state

    def forward(self, *args):
        # BEGIN STEP 5: a model's blocks checkpointed, inside FSDP units
        # TODO: the wrapped module's output for args, through checkpoint with this wrapper's save
        # and preserve_rng_state: the module's whole call, hooks included, so that a unit of k19's
        # FSDP gathers its weights again for the recompute.
        return checkpoint(
            self.module, *args, preserve_rng_state=self.preserve_rng_state, save=self.save
        )
        # END STEP 5


def checkpoint_blocks(model: nn.Module, blocks=None, save=()) -> nn.Module:
    """``model`` with ``model.blocks[i]`` replaced by ``Checkpointed(model.blocks[i], save)``
    for each ``i`` of ``blocks`` (None: every block); the same parameters, in place."""
    # BEGIN STEP 5: a model's blocks checkpointed, inside FSDP units
    # TODO: the model itself, each chosen block (None: every one) replaced in model.blocks by a
    # Checkpointed of it with save: the same modules and parameters, no copies. A model without
    # an nn.ModuleList model.blocks, an index that is not one of its blocks, or a block that is
    # checkpointed already, is a ValueError before anything changes. The tests checkpoint the
    # TinyTransformer (every block, block 1 alone) and, on 2 ranks, a FullyShardedModule's blocks
    # after it made its units: the shards' gradients bitwise against FSDP without checkpointing,
    # the all-gathers counted in forward and in backward.
    chain = getattr(model, "blocks", None)
    if not isinstance(chain, nn.ModuleList):
        raise ValueError(
            f"checkpoint_blocks needs a model with an nn.ModuleList model.blocks (as "
            f"TinyTransformer), got a {type(model).__name__} without one"
        )
    chosen = range(len(chain)) if blocks is None else list(blocks)
    for index in chosen:
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(chain):
            raise ValueError(f"block {index!r} is not one of the model's {len(chain)} blocks")
        if isinstance(chain[index], Checkpointed):
            raise ValueError(f"block {index} is checkpointed already: each block once")
    for index in chosen:
        chain[index] = Checkpointed(chain[index], save)
    return model
    # END STEP 5


# --------------------------------------------------------------------------- the program

WAYS = {  # the program's ways of running a block: what checkpoint keeps (None: no checkpoint)
    "none": None,
    "full": (),
    "selective": LINEAR_MATMULS,
}


def _model(seed: int, blocks: int, dim: int) -> TinyTransformer:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return TinyTransformer(blocks=blocks, dim=dim).to(rank_device())


def _tokens(batch: int, sequence: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    stream = torch.randint(0, VOCABULARY, (batch, sequence + 1), generator=generator)
    return stream[:, :-1].to(rank_device()), stream[:, 1:].to(rank_device())


def _activations(args) -> torch.Tensor:
    """A block's input: the same for every way."""
    generator = torch.Generator().manual_seed(args.seed + 1)
    shape = (args.batch, args.sequence, args.dim)
    return torch.randn(*shape, generator=generator).to(rank_device())


def _counted_forwards(model: nn.Module) -> list[int]:
    """A counter of the blocks' forward runs (the recomputes included)."""
    runs = [0]

    def count(*_):
        runs[0] += 1

    for module in model.modules():
        if isinstance(module, Block):
            module.register_forward_pre_hook(count)
    return runs


def _one_block(args, way: str) -> dict:
    """One block alone: what it keeps for backward (measured), its forwards, its gradients."""
    model = _model(args.seed, 1, args.dim)
    block = model.blocks[0]
    runs = _counted_forwards(block)
    x = _activations(args).requires_grad_()
    save = WAYS[way]

    def run():
        return block(x) if save is None else checkpoint(block, x, save=save)

    y, saved = saved_activation_bytes(run, block)
    after_forward = runs[0]
    y.square().sum().backward()
    return {
        "saved": saved,
        "runs": (after_forward, runs[0] - after_forward),
        "grads": [p.grad.clone() for p in block.parameters()] + [x.grad.clone()],
    }


def _dropout_gap(args, preserve: bool) -> float:
    """A block behind a dropout, checkpointed, against the same without checkpointing."""
    model = _model(args.seed, 1, args.dim)
    block = model.blocks[0]
    x = _activations(args)

    def dropped(h):
        return block(F.dropout(h, 0.1, training=True))

    grads = []
    for recompute in (False, True):
        block.zero_grad()
        torch.manual_seed(args.seed)
        y = checkpoint(dropped, x, preserve_rng_state=preserve) if recompute else dropped(x)
        y.square().sum().backward()
        grads.append([p.grad.clone() for p in block.parameters()])
    return max((a - b).abs().max().item() for a, b in zip(*grads))


def _fsdp_steps(rank: int, args, way: str, keep: bool) -> dict:
    """k19's FSDP (a unit per block, the model the rest), every block checkpointed as ``way``
    says: the all-gathers of each phase per step, the full parameters after the steps."""
    model = _model(args.seed, args.blocks, args.dim)
    wrapper = FullyShardedModule(
        model, shard_types=(Block, TinyTransformer), reshard_after_forward=not keep
    )
    if WAYS[way] is not None:
        checkpoint_blocks(model, save=WAYS[way])  # after the units: their hooks run inside
    optimizer = torch.optim.SGD(wrapper.parameters(), lr=0.1)
    counts: dict = {}
    for step in range(args.steps):
        tokens, targets = _tokens(args.batch, args.sequence, 1000 * step + rank)
        optimizer.zero_grad()
        counted_step(wrapper, tokens, targets, counts)
        optimizer.step()
    gathers = {p: counts.get(("all-gather", p), 0) // args.steps for p in ("forward", "backward")}
    return {"gathers": gathers, "params": wrapper.gather_full_params()}


def show_rank(rank: int, world_size: int, args) -> dict:
    torch.manual_seed(args.seed)
    blocks = {way: _one_block(args, way) for way in WAYS}
    fsdp = {
        (way, keep): _fsdp_steps(rank, args, way, keep) for way in WAYS for keep in (False, True)
    }
    plain = blocks["none"]["grads"]
    gaps = {way: max((a - b).abs().max().item() for a, b in zip(got["grads"], plain))
            for way, got in blocks.items()}  # fmt: skip
    for (way, keep), got in fsdp.items():
        base = fsdp[("none", keep)]["params"]
        gaps[f"fsdp {way}"] = max(
            (got["params"][k] - v).abs().max().item() for k, v in base.items()
        )
    return {
        "blocks": {
            way: {k: v for k, v in got.items() if k != "grads"} for way, got in blocks.items()
        },
        "fsdp": {key: got["gathers"] for key, got in fsdp.items()},
        "gaps": gaps,
        "dropout": {preserve: _dropout_gap(args, preserve) for preserve in (True, False)},
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description="Activation checkpointing: full and selective recomputation, alone and "
        "inside FSDP units."
    )
    add_launch_arguments(parser, world_size=2)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--dim", type=int, default=32, help="the model's width (4 heads)")
    parser.add_argument("--sequence", type=int, default=64, help="tokens a sequence")
    parser.add_argument("--batch", type=int, default=4, help="sequences a rank")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for option in ("steps", "blocks", "sequence", "batch"):
        if getattr(args, option) < 1:
            parser.error(f"--{option} must be at least 1")
    if args.dim < 4 or args.dim % 4:
        parser.error("--dim must be a positive multiple of 4 (the attention's 4 heads)")
    say(
        None,
        f"a TinyTransformer block of width {args.dim} (4 heads), {args.batch} x {args.sequence} "
        f"tokens, fp32; then {args.blocks} blocks under k19's FSDP on {args.world_size} ranks, "
        f"{args.steps} steps",
    )
    results = launch_world(
        show_rank, args.world_size, args, backend=args.backend, device=args.device
    )
    mine = results[0]
    shape = (args.batch, args.sequence, args.dim, 4)
    say(
        None,
        f"  {'way':<10}{'kept (measured)':>17}{'formula':>12}{'forwards':>10}{'recomputes':>12}",
    )
    for way, keep in zip(WAYS, KEEPS):
        got = mine["blocks"][way]
        say(
            None,
            f"  {way:<10}{got['saved']:>15,} B{activation_bytes(*shape, keep):>10,} B"
            f"{got['runs'][0]:>10}{got['runs'][1]:>12}",
        )
    say(None, "  inside k19's FSDP units, all-gathers per step (forward, backward):")
    for (way, keep), gathers in mine["fsdp"].items():
        kept = "reshard_after_forward=False" if keep else "resharded after forward"
        say(None, f"    {way:<10}{kept:<28}{gathers['forward']:>3}, {gathers['backward']}")
    dropout = mine["dropout"]
    say(
        None,
        f"  dropout before the block, recomputed: preserve_rng_state=True differs from no "
        f"checkpointing by {dropout[True]:.1e}, False by {dropout[False]:.1e} (other masks)",
    )
    worst = max(gap for r in results for gap in r["gaps"].values())
    return verdict(
        worst,
        "every way's gradients equal no checkpointing's, alone and inside FSDP",
        "a checkpointed way's gradients differ from no checkpointing's",
        tolerance=1e-12,
    )


if __name__ == "__main__":
    run_program(main)
