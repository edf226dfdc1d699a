"""k32's mistakes catalogue: real mistakes in checkpointing activations (counting what a block
keeps, the recompute, the RNG trap, selective recomputation, a model's blocks inside FSDP
units), and right answers written another way. See ``dojo/dev/mistakes/__init__.py`` for what
each list promises."""

from __future__ import annotations

import contextlib
import copy
import functools

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from dojo.dev.mistakes import Mistake, RightAnswer
from solutions import k32_activation_checkpointing as reference


def _k32():
    """The reference module, with this entry swapped in (what every test and rank sees)."""
    from dojo.harness import impl

    return impl.load_kata("k32_activation_checkpointing")


# --------------------------------------------------------------------------- activation_bytes


def _bytes(batch, sequence, dim, heads, keep="everything", *, mask=True, per_head=True,
           width=4, input_kept=True, with_bmm=False, check=True):  # fmt: skip
    if check:
        if keep not in reference.KEEPS:
            raise ValueError(f"keep={keep!r}: one of {reference.KEEPS}")
        if min(batch, sequence, dim, heads) < 1 or dim % heads:
            raise ValueError("sizes must be positive and the heads must divide the width")
        if not all(isinstance(v, int) for v in (batch, sequence, dim, heads)):
            raise ValueError("sizes are ints")
    tokens = batch * sequence
    if keep == "input":
        return width * tokens * dim if input_kept else 0
    if keep == "matmuls":
        floats = (10 if input_kept else 9) * tokens * dim
        if with_bmm:  # the scores (a b s s) and the attention's output (b s h) too
            floats += heads * batch * sequence * sequence + tokens * dim
        return width * floats
    scores = (heads if per_head else 1) * batch * sequence * sequence
    total = width * (12 * tokens * dim + scores + 4 * tokens)
    return int(total + (sequence * sequence if mask else 0))


def bytes_without_the_mask(batch, sequence, dim, heads, keep="everything"):
    return _bytes(batch, sequence, dim, heads, keep, mask=False)


def bytes_softmax_of_one_head(batch, sequence, dim, heads, keep="everything"):
    return _bytes(batch, sequence, dim, heads, keep, per_head=False)


def bytes_in_half_precision(batch, sequence, dim, heads, keep="everything"):
    return _bytes(batch, sequence, dim, heads, keep, width=2)


def bytes_a_checkpoint_keeps_nothing(batch, sequence, dim, heads, keep="everything"):
    return _bytes(batch, sequence, dim, heads, keep, input_kept=keep != "input")


def bytes_matmuls_without_the_input(batch, sequence, dim, heads, keep="everything"):
    return _bytes(batch, sequence, dim, heads, keep, input_kept=keep != "matmuls")


def bytes_matmuls_with_the_bmms(batch, sequence, dim, heads, keep="everything"):
    return _bytes(batch, sequence, dim, heads, keep, with_bmm=True)


def bytes_without_checks(batch, sequence, dim, heads, keep="everything"):
    return _bytes(batch, sequence, dim, heads, keep, check=False)


def bytes_term_by_term(batch, sequence, dim, heads, keep="everything"):
    """Right: a table of what each tensor holds, summed; the checks first."""
    for name, value in (("batch", batch), ("sequence", sequence), ("dim", dim), ("heads", heads)):
        if type(value) is not int or value < 1:
            raise ValueError(f"{name} must be a positive int, not {value!r}")
    if dim % heads:
        raise ValueError(f"{heads} heads do not divide a width of {dim}")
    b, s, h, a = batch, sequence, dim, heads
    terms = {  # (elements, bytes each)
        "the input": (b * s * h, 4),
        "the first LayerNorm's output": (b * s * h, 4),
        "the first LayerNorm's mean and 1/std": (2 * b * s, 4),
        "q, k, v, as the attention's bmm reads them": (3 * b * s * h, 4),
        "the softmax's output": (a * b * s * s, 4),
        "the causal mask": (s * s, 1),
        "the attention's output, into out": (b * s * h, 4),
        "the residual after the attention": (b * s * h, 4),
        "the second LayerNorm's output": (b * s * h, 4),
        "the second LayerNorm's mean and 1/std": (2 * b * s, 4),
        "the ReLU's output": (4 * b * s * h, 4),
    }
    kept = {
        "everything": list(terms),
        "input": ["the input"],
        "matmuls": ["the input"],
    }
    if keep not in kept:
        raise ValueError(f"keep must be 'everything', 'input' or 'matmuls', not {keep!r}")
    total = sum(terms[name][0] * terms[name][1] for name in kept[keep])
    if keep == "matmuls":  # q, k, v, out (h each), up (4 h), down (h)
        total += 4 * b * s * (4 * h + 4 * h + h)
    return total


# --------------------------------------------------------------------------- checkpoint


def _checkpoint(function, *args, preserve_rng_state=True, save=(), callable_check=True,
                no_grad=True, keep_everything=False, cache=True, kept=True, enable_grad=True,
                version_check=True, force_grad=False, snapshot_after=False,
                outputs_kept=True):  # fmt: skip
    """The reference's checkpoint, with one thing done as a mistake would do it."""
    k32 = _k32()
    if callable_check and not callable(function):
        raise ValueError("checkpoint needs a callable")
    if no_grad and not torch.is_grad_enabled() and not force_grad:
        return function(*args)
    snapshot = k32.rng_snapshot(args) if preserve_rng_state and not snapshot_after else None
    saving = k32.SaveOutputs(save) if save else contextlib.nullcontext()
    where = [i for i, arg in enumerate(args) if torch.is_tensor(arg)]
    others = [None if torch.is_tensor(arg) else arg for arg in args]
    packed, recomputed, state = [0], [], {}

    def pack(tensor):
        if keep_everything:
            return tensor
        packed[0] += 1
        return packed[0] - 1

    def unpack(index):
        if keep_everything:
            return index
        if not recomputed or not cache:
            recomputed.clear()
            if kept and version_check:
                tensors = state["kept"].tensors()
            else:  # the arguments themselves, from the closure
                tensors = [args[i] for i in where] + [t for _, t in state["outputs"]]
            inputs = list(others)
            for i, tensor in zip(where, tensors):
                inputs[i] = tensor.detach().requires_grad_(tensor.requires_grad)
            outputs = list(zip(state["ops"], tensors[len(where) :]))
            replaying = k32.ReplayOutputs(outputs) if save else contextlib.nullcontext()

            def keep(tensor):
                recomputed.append(tensor)
                return tensor

            grad = torch.enable_grad() if enable_grad else contextlib.nullcontext()
            with grad, k32.replayed_rng(snapshot), replaying:
                with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
                    function(*inputs)
        return recomputed[index]

    grad = torch.enable_grad() if force_grad else contextlib.nullcontext()
    with grad, saving, torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        output = function(*args)
    if preserve_rng_state and snapshot_after:
        snapshot = k32.rng_snapshot(args)
    outputs = saving.kept if save else []
    state["ops"] = [op for op, _ in outputs]
    state["outputs"] = outputs
    if kept:
        tensors = [args[i] for i in where]
        if outputs_kept:
            tensors += [t for _, t in outputs]
        state["kept"] = reference.Kept(tensors)
    return output


def checkpoint_keeps_everything(function, *args, preserve_rng_state=True, save=()):
    # "the hooks are how a checkpoint works": pack hands the tensor back, nothing recomputed
    return _checkpoint(function, *args, preserve_rng_state=preserve_rng_state, save=save,
                       keep_everything=True)  # fmt: skip


def checkpoint_recomputes_for_every_tensor(function, *args, preserve_rng_state=True, save=()):
    return _checkpoint(function, *args, preserve_rng_state=preserve_rng_state, save=save,
                       cache=False)  # fmt: skip


def checkpoint_keeps_inputs_in_a_closure(function, *args, preserve_rng_state=True, save=()):
    return _checkpoint(function, *args, preserve_rng_state=preserve_rng_state, save=save,
                       kept=False)  # fmt: skip


def checkpoint_recomputes_without_grad(function, *args, preserve_rng_state=True, save=()):
    # backward runs with grad off: the recompute then saves nothing
    return _checkpoint(function, *args, preserve_rng_state=preserve_rng_state, save=save,
                       enable_grad=False)  # fmt: skip


def checkpoint_without_a_callable_check(function, *args, preserve_rng_state=True, save=()):
    return _checkpoint(function, *args, preserve_rng_state=preserve_rng_state, save=save,
                       callable_check=False)  # fmt: skip


def checkpoint_forces_grad_on(function, *args, preserve_rng_state=True, save=()):
    # "backward needs a graph": grad forced on, even for inference under no_grad
    return _checkpoint(function, *args, preserve_rng_state=preserve_rng_state, save=save,
                       force_grad=True)  # fmt: skip


def checkpoint_recomputes_from_the_arguments(function, *args, preserve_rng_state=True, save=()):
    # the inputs kept through autograd (the meter sees them), but the recompute reads the
    # arguments from the closure: autograd never checks them
    return _checkpoint(function, *args, preserve_rng_state=preserve_rng_state, save=save,
                       version_check=False)  # fmt: skip


def checkpoint_snapshots_after_forward(function, *args, preserve_rng_state=True, save=()):
    return _checkpoint(function, *args, preserve_rng_state=preserve_rng_state, save=save,
                       snapshot_after=True)  # fmt: skip


def checkpoint_keeps_outputs_out_of_sight(function, *args, preserve_rng_state=True, save=()):
    # the selected outputs held in a closure: saved-tensor hooks (a meter, save_on_cpu) miss them
    return _checkpoint(function, *args, preserve_rng_state=preserve_rng_state, save=save,
                       outputs_kept=False)  # fmt: skip


class _Recompute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, plan, anchor, *args):
        ctx.plan = plan
        ctx.save_for_backward(*[a for a in args if torch.is_tensor(a)])
        with torch.no_grad():
            return plan["function"](*args)

    @staticmethod
    def backward(ctx, *grads):
        plan = ctx.plan
        tensors = iter(ctx.saved_tensors)
        inputs = [
            next(tensors).detach().requires_grad_(a.requires_grad) if torch.is_tensor(a) else a
            for a in plan["args"]
        ]
        with torch.enable_grad(), _k32().replayed_rng(plan["snapshot"]):
            outputs = plan["function"](*inputs)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grads) if o.requires_grad and g is not None]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None, *[i.grad if torch.is_tensor(i) else None for i in inputs])


def _as_a_function(function, args, preserve_rng_state, anchor):
    if not callable(function):
        raise ValueError("checkpoint needs a callable")
    if not torch.is_grad_enabled():
        return function(*args)
    snapshot = _k32().rng_snapshot(args) if preserve_rng_state else None
    plan = {
        "function": function,
        "args": [a.detach() if torch.is_tensor(a) else a for a in args],  # shapes, grads only
        "snapshot": snapshot,
    }
    for placeholder, arg in zip(plan["args"], args):
        if torch.is_tensor(arg):
            placeholder.requires_grad_(arg.requires_grad)
    handle = torch.empty(0, requires_grad=anchor)
    return _Recompute.apply(plan, handle, *args)


def checkpoint_as_a_function_without_an_anchor(function, *args, preserve_rng_state=True, save=()):
    # torch's reentrant checkpoint, written again: an autograd.Function recomputes in backward;
    # its output needs a gradient only if one of its inputs does
    return _as_a_function(function, args, preserve_rng_state, anchor=False)


def checkpoint_as_a_function(function, *args, preserve_rng_state=True, save=()):
    """Right: an autograd.Function that saves the inputs, runs the function under no_grad and
    recomputes in its backward, given an input that requires grad so that parameters get
    their gradients whatever the inputs need (save: full recomputation only)."""
    return _as_a_function(function, args, preserve_rng_state, anchor=True)


# --------------------------------------------------------------------------- the RNG


def _replay(snapshot, *, fork=True, restore=True):
    if snapshot is None:
        yield
        return
    cpu, cuda = snapshot
    if not fork:
        if restore:
            torch.set_rng_state(cpu)
        yield
        return
    with torch.random.fork_rng(devices=[d for d, _ in cuda]):
        if restore:
            torch.set_rng_state(cpu)
        yield


@contextlib.contextmanager
def replay_nothing(snapshot):
    yield from _replay(snapshot, restore=False)


@contextlib.contextmanager
def replay_without_fork(snapshot):
    yield from _replay(snapshot, fork=False)


def snapshot_of_the_seed(tensors):
    return torch.initial_seed()


@contextlib.contextmanager
def replay_the_seed(snapshot):
    # "the same seed gives the same masks": only from where the seed started
    if snapshot is None:
        yield
        return
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(snapshot)
        yield


@contextlib.contextmanager
def replay_by_hand(snapshot):
    """Right: the states now kept, the snapshot's set, and put back in a finally."""
    if snapshot is None:
        yield
        return
    cpu, cuda = snapshot
    now = torch.get_rng_state(), [(d, torch.cuda.get_rng_state(d)) for d, _ in cuda]
    torch.set_rng_state(cpu)
    for device, state in cuda:
        torch.cuda.set_rng_state(state, device)
    try:
        yield
    finally:
        torch.set_rng_state(now[0])
        for device, state in now[1]:
            torch.cuda.set_rng_state(state, device)


# --------------------------------------------------------------------------- selective


def _check_ops(save):
    for op in save:
        if not isinstance(op, torch._ops.OpOverload):
            raise ValueError(f"{op!r} is not an ATen op overload (torch.ops.aten.mm.default)")


class SaveEveryOutput(TorchDispatchMode):
    def __init__(self, save):
        super().__init__()
        _check_ops(save)
        self.save = frozenset(save)
        self.kept = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        output = func(*args, **(kwargs or {}))
        if isinstance(output, torch.Tensor):  # "keep what forward made": every op's
            self.kept.append((func, output.detach()))
        return output


class SaveUnchecked(TorchDispatchMode):
    def __init__(self, save):
        super().__init__()
        self.save = frozenset(save)  # aten.mm, torch.matmul: they never match an op overload
        self.kept = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        output = func(*args, **(kwargs or {}))
        if func in self.save:
            self.kept.append((func, output.detach()))
        return output


class ReplayRunsThemAgain(reference.ReplayOutputs):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))  # kept, and computed again all the same


class ReplayInTurn(reference.ReplayOutputs):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func not in self.ops:
            return func(*args, **(kwargs or {}))
        output = self.kept[self.next][1]  # whichever op forward kept at this place
        self.next += 1
        return output.detach()


class SaveOutputsByOp(TorchDispatchMode):
    """Right: torch's layout, a list of outputs per op."""

    def __init__(self, save):
        super().__init__()
        _check_ops(save)
        self.by_op = {op: [] for op in save}
        self.kept = []  # (op, output) for checkpoint: filled as the ops run

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        output = func(*args, **(kwargs or {}))
        if func in self.by_op:
            self.by_op[func].append(output.detach())
            self.kept.append((func, self.by_op[func][-1]))
        return output


class ReplayOutputsByOp(TorchDispatchMode):
    """Right: each op's outputs handed back in its own order, counted per op."""

    def __init__(self, kept):
        super().__init__()
        self.by_op: dict = {}
        for op, output in kept:
            self.by_op.setdefault(op, []).append(output)
        self.order = [op for op, _ in kept]
        self.done = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func not in self.by_op:
            return func(*args, **(kwargs or {}))
        if self.done >= len(self.order) or self.order[self.done] != func:
            raise RuntimeError(f"the recompute ran {func}, not what forward kept at its place")
        self.done += 1
        return self.by_op[func].pop(0).detach()


# --------------------------------------------------------------------------- a model's blocks


def _blocks(model, blocks=None, save=(), *, checks=True, copy_them=False, which=True,
            call=True):  # fmt: skip
    k32 = _k32()
    chain = getattr(model, "blocks", None)
    if checks:
        if not isinstance(chain, nn.ModuleList):
            raise ValueError("the model has no nn.ModuleList .blocks")
        for index in range(len(chain)) if blocks is None else blocks:
            done = isinstance(chain[index], k32.Checkpointed) if 0 <= index < len(chain) else 1
            if done or getattr(chain[index], "checkpointed", False):
                raise ValueError(f"block {index} cannot be checkpointed")
    chosen = range(len(chain)) if blocks is None or not which else blocks
    for index in chosen:
        block = copy.deepcopy(chain[index]) if copy_them else chain[index]
        if call:
            chain[index] = k32.Checkpointed(block, save)
        else:  # the forward alone, the module's hooks outside the checkpoint
            block.forward = functools.partial(k32.checkpoint, block.forward, save=save)
            block.checkpointed = True
    return model


def blocks_forward_checkpointed(model, blocks=None, save=()):
    return _blocks(model, blocks, save, call=False)


def blocks_copied(model, blocks=None, save=()):
    return _blocks(model, blocks, save, copy_them=True)


def blocks_every_one(model, blocks=None, save=()):
    return _blocks(model, blocks, save, which=False)


def blocks_without_checks(model, blocks=None, save=()):
    return _blocks(model, blocks, save, checks=False)


def blocks_in_a_new_list(model, blocks=None, save=()):
    """Right: a new ModuleList put in place of the old, the chosen blocks wrapped."""
    k32 = _k32()
    if not isinstance(getattr(model, "blocks", None), nn.ModuleList):
        raise ValueError("checkpoint_blocks needs model.blocks, an nn.ModuleList")
    count = len(model.blocks)
    chosen = set(range(count) if blocks is None else blocks)
    if not chosen <= set(range(count)):
        raise ValueError(f"blocks {sorted(chosen - set(range(count)))} are not among {count}")
    if any(isinstance(model.blocks[i], k32.Checkpointed) for i in chosen):
        raise ValueError("a block is checkpointed already")
    model.blocks = nn.ModuleList(
        k32.Checkpointed(block, save) if i in chosen else block
        for i, block in enumerate(model.blocks)
    )
    return model


class CheckpointedWithoutSave(reference.Checkpointed):
    def forward(self, *args):
        return _k32().checkpoint(self.module, *args, preserve_rng_state=self.preserve_rng_state)


_BYTES = "test_activation_bytes_is_what_torchs_ways_keep"
_REFUSE_BYTES = "test_activation_bytes_refuses_what_it_cannot_count"
_REFUSE_CALL = "test_checkpoint_refuses_what_it_cannot_call"
_BITWISE = "test_checkpoint_gives_the_same_outputs_and_gradients_bitwise"
_ONLY_INPUTS = "test_checkpoint_keeps_only_its_inputs"
_ONCE = "test_checkpoint_runs_the_function_again_once_in_backward"
_PARAMS = "test_checkpoint_gives_parameters_gradients_when_no_input_needs_one"
_IN_PLACE = "test_checkpoint_catches_an_input_changed_in_place"
_NO_GRAD = "test_checkpoint_under_no_grad_just_runs_the_function"
_MASKS = "test_recomputed_dropout_draws_the_same_masks"
_GENERATOR = "test_the_generator_after_backward_is_as_without_checkpointing"
_REFUSE_OPS = "test_selective_checkpoint_refuses_what_is_not_an_op"
_SELECTIVE_KEEPS = "test_selective_checkpoint_keeps_the_chosen_outputs"
_RUNS_NONE = "test_selective_recompute_runs_none_of_the_kept_ops"
_OTHER_OPS = "test_a_recompute_that_runs_other_ops_is_an_error"
_REFUSE_BLOCKS = "test_checkpoint_blocks_refuses_what_it_cannot_wrap"
_BLOCKS = "test_checkpoint_blocks_checkpoints_the_models_own_blocks"

MISTAKES = [
    Mistake(
        "bytes_without_the_mask",
        replaces="activation_bytes",
        fails=[f"{_BYTES}[everything]"],
        says=["the causal mask (s * s bools, one byte each) is missing"],
    ),
    Mistake(
        "bytes_softmax_of_one_head",
        replaces="activation_bytes",
        fails=[f"{_BYTES}[everything]"],
        says=["one s x s per head"],
    ),
    Mistake(
        "bytes_in_half_precision",
        replaces="activation_bytes",
        fails=[f"{_BYTES}[everything]"],
        says=["fp32 is 4 bytes an element, not 2"],
    ),
    Mistake(
        "bytes_a_checkpoint_keeps_nothing",
        replaces="activation_bytes",
        fails=[f"{_BYTES}[input]"],
        says=["a checkpoint keeps its input to run the block again from it"],
    ),
    Mistake(
        "bytes_matmuls_without_the_input",
        replaces="activation_bytes",
        fails=[f"{_BYTES}[matmuls]"],
        says=["the input is missing: the recompute starts from it"],
    ),
    Mistake(
        "bytes_matmuls_with_the_bmms",
        replaces="activation_bytes",
        fails=[f"{_BYTES}[matmuls]"],
        says=["the attention's two bmm are not linear layers"],
    ),
    Mistake(
        "bytes_without_checks",
        replaces="activation_bytes",
        fails=[_REFUSE_BYTES],
        says=["raise ValueError saying what is wrong"],
    ),
    Mistake(
        "checkpoint_without_a_callable_check",
        replaces="checkpoint",
        fails=[_REFUSE_CALL],
        says=["check that it is callable and raise ValueError"],
    ),
    Mistake(
        "checkpoint_recomputes_without_grad",
        replaces="checkpoint",
        fails=[_BITWISE],
        says=["the recompute saved fewer tensors than forward did", "torch.enable_grad()"],
    ),
    Mistake(
        "checkpoint_keeps_everything",
        replaces="checkpoint",
        fails=[_ONLY_INPUTS],
        says=["are still alive", "your pack hook must keep nothing of the tensor it gets"],
    ),
    Mistake(
        "checkpoint_keeps_inputs_in_a_closure",
        replaces="checkpoint",
        fails=[_ONLY_INPUTS],
        says=["saw 0 bytes kept for backward", "keep the inputs through autograd, Kept(tensors)"],
    ),
    Mistake(
        "checkpoint_recomputes_for_every_tensor",
        replaces="checkpoint",
        fails=[_ONCE],
        says=["expected twice each", "run the function again at the first saved tensor"],
    ),
    Mistake(
        "checkpoint_as_a_function_without_an_anchor",
        replaces="checkpoint",
        fails=[_PARAMS],
        says=["got no gradient", "give the Function an input that requires grad"],
    ),
    Mistake(
        "checkpoint_recomputes_from_the_arguments",
        replaces="checkpoint",
        fails=[_IN_PLACE],
        says=["gave wrong gradients without a word", "Keep the inputs through autograd"],
    ),
    Mistake(
        "checkpoint_forces_grad_on",
        replaces="checkpoint",
        fails=[_NO_GRAD],
        says=["under torch.no_grad()", "a tensor with a grad_fn"],
    ),
    Mistake(
        "checkpoint_snapshots_after_forward",
        replaces="checkpoint",
        fails=[_MASKS],
        says=["The recompute drew other dropout masks than forward"],
    ),
    Mistake(
        "checkpoint_keeps_outputs_out_of_sight",
        replaces="checkpoint",
        fails=[_SELECTIVE_KEEPS],
        says=["keep the ops' outputs with the inputs through Kept"],
    ),
    Mistake(
        "replay_nothing",
        replaces="replayed_rng",
        fails=[_MASKS],
        says=["The recompute drew other dropout masks than forward", "replayed_rng(snapshot)"],
    ),
    Mistake(
        "replay_without_fork",
        replaces="replayed_rng",
        fails=[_GENERATOR],
        says=["the CPU generator's state after backward differs", "torch.random.fork_rng"],
    ),
    Mistake(
        "snapshot_of_the_seed",
        replaces="rng_snapshot",
        also={"replayed_rng": "replay_the_seed"},
        fails=[_MASKS],
        says=["The recompute drew other dropout masks than forward"],
    ),
    Mistake(
        "SaveUnchecked",
        replaces="SaveOutputs",
        fails=[_REFUSE_OPS],
        says=["the dispatcher sees ATen op overloads", "Raise ValueError before anything runs"],
    ),
    Mistake(
        "SaveEveryOutput",
        replaces="SaveOutputs",
        fails=[_SELECTIVE_KEEPS],
        says=["More: keep the outputs of the ops in save only"],
    ),
    Mistake(
        "ReplayRunsThemAgain",
        replaces="ReplayOutputs",
        fails=[_RUNS_NONE],
        says=["the recompute ran the linear layers again"],
    ),
    Mistake(
        "ReplayInTurn",
        replaces="ReplayOutputs",
        fails=[_OTHER_OPS],
        says=["handed mm's output to addmm without a word"],
    ),
    Mistake(
        "blocks_without_checks",
        replaces="checkpoint_blocks",
        fails=[_REFUSE_BLOCKS],
        says=["raise ValueError saying what is wrong"],
    ),
    Mistake(
        "blocks_forward_checkpointed",
        replaces="checkpoint_blocks",
        fails=[_BLOCKS],
        says=["the recompute ran the blocks' forward without their hooks", "whole call"],
    ),
    Mistake(
        "blocks_copied",
        replaces="checkpoint_blocks",
        fails=[_BLOCKS],
        says=["are not the same tensors any more"],
    ),
    Mistake(
        "blocks_every_one",
        replaces="checkpoint_blocks",
        fails=[_BLOCKS],
        says=["ran [2, 2] times in a step, expected [1, 2]"],
    ),
    Mistake(
        "CheckpointedWithoutSave",
        replaces="Checkpointed",
        fails=[_BLOCKS],
        says=["Checkpointed passes its save on to checkpoint"],
    ),
]

RIGHT_ANSWERS = [
    RightAnswer("bytes_term_by_term", replaces="activation_bytes"),
    RightAnswer("checkpoint_as_a_function", replaces="checkpoint"),
    RightAnswer("replay_by_hand", replaces="replayed_rng"),
    RightAnswer(
        "SaveOutputsByOp", replaces="SaveOutputs", also={"ReplayOutputs": "ReplayOutputsByOp"}
    ),
    RightAnswer("blocks_in_a_new_list", replaces="checkpoint_blocks"),
]
