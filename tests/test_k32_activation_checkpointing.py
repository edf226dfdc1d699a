"""k32 activation checkpointing: what a block keeps, full and selective recomputation, the RNG
trap, and checkpointed blocks inside k19's FSDP units."""

from __future__ import annotations

import functools
import gc
import inspect
import weakref

import pytest
import torch
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from dojo.harness.calls import recording
from dojo.harness.impl import load_kata
from dojo.harness.world import RankFailed, run_world
from dojo.spec.testing import needs_torch, refusal, require_gpus, run_module, shared_run
from dojo.todo import KataTodo
from dojo.toy_models import Block, make_tokens, make_transformer, transformer_loss

KATA = "k32_activation_checkpointing"
aten = torch.ops.aten
HEADS = 4  # the toy Block's attention heads, whatever its width
SHAPES = [(2, 8, 16), (3, 12, 32)]  # batch, sequence, width
LINEAR = (aten.mm.default, aten.addmm.default)  # the linear layers' products
MATMULS = (*LINEAR, aten.bmm.default)  # and the attention's two batched products
POLICIES = {"linear layers": LINEAR, "every matmul": MATMULS}


def _failure(error: BaseException) -> str:
    return f"{type(error).__name__}: {str(error).strip().splitlines()[0][:300]}"


def _block(dim: int = 16, seed: int = 0) -> Block:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Block(dim)


def _input(batch: int, sequence: int, dim: int, seed: int = 1, grad: bool = True):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(batch, sequence, dim, generator=generator).requires_grad_(grad)


# --------------------------------------------------------------------------- instruments


def _saved_bytes(run, module) -> tuple[object, int]:
    """``run()``'s result and the bytes of the distinct storages autograd saved meanwhile (what
    saved-tensor hooks see), ``module``'s parameters aside."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        result = run()
    return result, sum(saved.values())


class _Outputs(TorchDispatchMode):
    """Weak references to the storage of every ATen op's output, as the ops run."""

    def __init__(self, storages: list):
        super().__init__()
        self.storages = storages

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        output = func(*args, **(kwargs or {}))
        for tensor in output if isinstance(output, (tuple, list)) else [output]:
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                self.storages.append((weakref.ref(storage), storage.nbytes(), storage.data_ptr()))
        return output


class Watched:
    """A module called through a checkpoint: its calls counted (forward, then each recompute),
    and what its first call (forward) made watched, to see what of it is still alive later."""

    def __init__(self, module):
        self.module = module
        self.calls = 0
        self.storages: list = []

    def __call__(self, *args):
        self.calls += 1
        if self.calls > 1:
            return self.module(*args)
        with _Outputs(self.storages):
            return self.module(*args)

    def alive(self, *tensors) -> int:
        """Bytes of what forward made that is alive now: ``tensors`` (the input, the output)
        and the module's parameters (views of them) aside."""
        gc.collect()  # what waits only for the cycle collector is not kept
        aside = {t.untyped_storage().data_ptr() for t in tensors}
        aside |= {p.untyped_storage().data_ptr() for p in self.module.parameters()}
        found = {ptr: n for ref, n, ptr in self.storages if n and ref() is not None}
        return sum(n for ptr, n in found.items() if ptr not in aside)


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts: dict = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func] = self.counts.get(func, 0) + 1
        return func(*args, **(kwargs or {}))


# --------------------------------------------------------------------------- torch's own ways


def _sac_respects_hooks() -> bool:
    from torch.utils.checkpoint import checkpoint

    return "respect_saved_tensors_hooks" in inspect.signature(checkpoint).parameters


def _torch_way(save=None, preserve: bool = False):
    """torch.utils.checkpoint's way of running ``function(*args)``: full (save None) or
    selective, keeping ``save``'s outputs (seen by saved-tensor hooks where torch can)."""
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    def run(function, *args):
        options = {"use_reentrant": False, "preserve_rng_state": preserve}
        if save is not None:
            options["context_fn"] = functools.partial(
                create_selective_checkpoint_contexts, list(save)
            )
            if _sac_respects_hooks():  # from torch 2.14 on (NEWER_TORCH says so)
                options["respect_saved_tensors_hooks"] = True
        return checkpoint(function, *args, **options)

    return run


def _kata_way(kata, save=(), preserve: bool = False):
    def run(function, *args):
        return kata.checkpoint(function, *args, preserve_rng_state=preserve, save=save)

    return run


def _plain(function, *args):
    return function(*args)


def _expected_bytes(batch, sequence, dim, keep) -> int:
    """What torch's ways keep for one Block, counted tensor by tensor (fp32; bytes)."""
    tokens = batch * sequence
    if keep == "input":
        return 4 * tokens * dim
    if keep == "matmuls":
        return 4 * 10 * tokens * dim
    return 4 * (12 * tokens * dim + HEADS * batch * sequence**2 + 4 * tokens) + sequence**2


# --------------------------------------------------------------------------- step 1


def _measured(keep: str, shape) -> int:
    batch, sequence, dim = shape
    block = _block(dim)
    x = _input(*shape)
    way = {"everything": _plain, "input": _torch_way(), "matmuls": _torch_way(LINEAR)}[keep]
    _, saved = _saved_bytes(lambda: way(block, x), block)
    return saved


def _why(got: int, batch: int, sequence: int, dim: int, keep: str) -> str:
    """A likely mistake, only where the figure given points at one."""
    b, s, h, a = batch, sequence, dim, HEADS
    right = _expected_bytes(b, s, h, keep)
    if keep == "input":
        return (
            "a checkpointed block keeps its input and nothing else: b * s * h floats"
            if got != 0
            else "0: but a checkpoint keeps its input to run the block again from it"
        )
    if keep == "matmuls":
        if got == right - 4 * b * s * h:
            return "the input is missing: the recompute starts from it"
        if got == right + 4 * a * b * s * s + 4 * b * s * h:
            return "the attention's two bmm are not linear layers: LINEAR_MATMULS is mm and addmm"
        return "the input, q, k, v, the attention's out, up (4 h wide) and down: 10 b s h floats"
    misses = {
        right - s * s: "the causal mask (s * s bools, one byte each) is missing",
        right - 16 * b * s: "the LayerNorms' means and 1/std (2 x b * s floats each) are missing",
        right - 4 * (a - 1) * b * s * s: "the softmax keeps a b s s floats: one s x s per head",
        right - 4 * a * b * s * s: "the softmax's output (a b s s floats) is missing",
        (right - s * s) // 2 + s * s: "fp32 is 4 bytes an element, not 2",
    }
    return misses.get(
        got,
        "count what autograd saves: the LayerNorms' inputs and outputs, q, k, v and the "
        "attention's output, the ReLU's output (4 h wide), the softmax, the LayerNorms' "
        "means and 1/std, the causal mask",
    )


@pytest.mark.step(1)
@pytest.mark.parametrize(
    "keep",
    [
        "everything",
        "input",
        pytest.param("matmuls", marks=needs_torch("selective checkpoint seen by hooks")),
    ],
)
def test_activation_bytes_is_what_torchs_ways_keep(kata, keep):
    way = {
        "everything": "the Block without checkpointing",
        "input": "the Block under torch.utils.checkpoint(use_reentrant=False)",
        "matmuls": "the Block under torch's selective checkpoint keeping aten.mm and aten.addmm",
    }[keep]
    for shape in SHAPES:
        measured = _measured(keep, shape)
        got = kata.activation_bytes(*shape, HEADS, keep)
        call = f"activation_bytes({', '.join(map(str, shape))}, {HEADS}, keep={keep!r})"
        assert isinstance(got, int) and not isinstance(got, bool), (
            f"{call} returned a {type(got).__name__}: return the bytes as an int"
        )
        assert got == measured, (
            f"{call} is {got:,}, but {way} kept {measured:,} bytes for backward (measured with "
            f"saved_tensors_hooks: every distinct storage, the parameters aside): "
            f"{_why(got, *shape, keep)}"
        )


@pytest.mark.step(1)
def test_activation_bytes_refuses_what_it_cannot_count(kata):
    cases = {
        "keep='some'": lambda: kata.activation_bytes(2, 8, 16, HEADS, "some"),
        "dim 18 in 4 heads": lambda: kata.activation_bytes(2, 8, 18, HEADS, "everything"),
        "batch 0": lambda: kata.activation_bytes(0, 8, 16, HEADS, "input"),
        "sequence 2.5": lambda: kata.activation_bytes(2, 2.5, 16, HEADS, "everything"),
    }
    for what, call in cases.items():
        outcome = refusal(call)
        assert outcome is None, (
            f"activation_bytes with {what} {outcome}: raise ValueError saying what is wrong "
            "(the ways are 'everything', 'input' and 'matmuls'; sizes are positive ints; the "
            "heads must divide the width)"
        )


# --------------------------------------------------------------------------- step 2


def _backward(loss: torch.Tensor, what: str) -> None:
    """``loss.backward()``, its failure said in a learner's words."""
    try:
        loss.backward()
    except KataTodo:
        raise
    except IndexError as error:
        raise AssertionError(
            f"{what}: backward raised {_failure(error)} in your unpack hook: the recompute "
            "saved fewer tensors than forward did. Backward runs with grad off: run the "
            "function again inside torch.enable_grad(), under a pack hook that keeps every "
            "tensor it saves, in order"
        ) from None
    except RuntimeError as error:
        if "does not require grad" in str(error):
            raise AssertionError(
                f"{what}: the loss does not require grad ({_failure(error)}): when no input of "
                "the checkpointed function needs a gradient, its output must still carry the "
                "parameters' ones. An autograd.Function's output needs a grad only if one of "
                "its inputs does (torch's reentrant checkpoint has that limit); run the "
                "function with grad on under saved_tensors_hooks, or give the Function an "
                "input that requires grad"
            ) from None
        raise AssertionError(f"{what}: backward raised {_failure(error)}") from None


def _model_run(way, blocks_grad: bool = True, seed: int = 3) -> dict:
    """TinyTransformer's loss with every block run through ``way(block, x)`` (``_scaled`` in
    between: a non-tensor argument too), its outputs and every gradient."""
    model = make_transformer(seed)
    tokens, targets = make_tokens(4, 11)
    x = model.embedding(tokens)
    if not blocks_grad:
        x = x.detach()
    watched = []
    for block in model.blocks:
        watch = Watched(block)
        watched.append(watch)
        x = way(_scaled, watch, x, 0.5)
    logits = model.output(model.norm(x))
    loss = transformer_loss(logits, targets)
    return {"model": model, "logits": logits, "loss": loss, "watched": watched}


def _scaled(block, x: torch.Tensor, scale: float) -> torch.Tensor:
    return block(x) * scale


def _grads(model) -> dict:
    return {
        name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None
    }


def _first_difference(ours: dict, theirs: dict) -> str | None:
    for name, value in theirs.items():
        if name not in ours:
            return f"{name!r} got no gradient"
        if not torch.equal(ours[name], value):
            gap = (ours[name].double() - value.double()).abs().max().item()
            return f"{name!r}'s gradient differs by up to {gap:.3g}"
    return None


def _bitwise(kata, way, torchs, what: str) -> None:
    plain = _model_run(_plain)
    plain["loss"].backward()
    ours = _model_run(way)
    if not torch.equal(ours["logits"], plain["logits"]):
        raise AssertionError(
            f"{what}: the logits differ from the model's without checkpointing: a checkpoint "
            "returns exactly what function(*args) returns"
        )
    _backward(ours["loss"], what)
    theirs = _model_run(torchs)
    theirs["loss"].backward()
    expected = _grads(plain["model"])
    for other, name in ((expected, "no checkpointing"), (_grads(theirs["model"]), "torch's")):
        difference = _first_difference(_grads(ours["model"]), other)
        assert difference is None, (
            f"{what}: after backward {difference} from {name}: the recompute must run the "
            "same function on the same inputs (detached copies of the kept ones, requiring "
            "grad as they did), and every saved tensor must come from it, in the order "
            "forward saved them"
        )


@pytest.mark.step(2)
def test_checkpoint_refuses_what_it_cannot_call(kata):
    for thing in (None, 3, "block"):
        outcome = refusal(lambda t=thing: kata.checkpoint(t, _input(2, 8, 16)))
        assert outcome is None, (
            f"checkpoint({thing!r}, x) {outcome}: checkpoint runs function(*args) twice; "
            "check that it is callable and raise ValueError saying what to pass"
        )


@pytest.mark.step(2)
def test_checkpoint_gives_the_same_outputs_and_gradients_bitwise(kata):
    _bitwise(
        kata,
        _kata_way(kata),
        _torch_way(),
        "the TinyTransformer with each block through checkpoint(_scaled, block, x, 0.5)",
    )


@pytest.mark.step(2)
def test_checkpoint_keeps_only_its_inputs(kata):
    block, shape = _block(), (2, 8, 16)
    x = _input(*shape)
    watch = Watched(block)
    y, saved = _saved_bytes(lambda: kata.checkpoint(watch, x, preserve_rng_state=False), block)
    left = watch.alive(x, y)
    assert left == 0, (
        f"checkpoint(block, x): after forward {left:,} bytes of what the block computed are "
        "still alive (without checkpointing it keeps "
        f"{_expected_bytes(*shape, 'everything') - 4 * x.numel():,} besides its input): your "
        "pack hook must keep nothing of the tensor it gets (return where it is in the order of "
        "saving, not the tensor), and nothing else may hold the block's results"
    )
    expected = 4 * x.numel()
    assert saved == expected, (
        f"checkpoint(block, x) with x of {expected:,} bytes: saved-tensor hooks around it saw "
        f"{saved:,} bytes kept for backward, expected the input's {expected:,}: "
        + (
            "keep the inputs through autograd, Kept(tensors) (as torch's checkpoint does: then "
            "an input changed in place is caught, and offloading hooks see it), not in a closure"
            if saved == 0
            else "keep the tensors among the inputs, once each, and nothing else"
        )
    )


@pytest.mark.step(2)
def test_checkpoint_runs_the_function_again_once_in_backward(kata):
    run = _model_run(_kata_way(kata))
    after_forward = [w.calls for w in run["watched"]]
    _backward(run["loss"], "the checkpointed TinyTransformer")
    after_backward = [w.calls for w in run["watched"]]
    assert after_forward == [1, 1], (
        f"the TinyTransformer's 2 checkpointed blocks ran {after_forward} times in forward, "
        "expected once each: forward runs the function once; the second run belongs to backward"
    )
    assert after_backward == [2, 2], (
        f"the TinyTransformer's 2 checkpointed blocks ran {after_backward} times after backward, "
        "expected twice each (forward, then once in backward): "
        + (
            "the recompute never ran: is everything forward saved still kept?"
            if after_backward == after_forward
            else "run the function again at the first saved tensor backward asks for, keep "
            "what that run saves and hand out every later one from there"
        )
    )


@pytest.mark.step(2)
def test_checkpoint_gives_parameters_gradients_when_no_input_needs_one(kata):
    # a block whose input needs no gradient (token embeddings that do not train, data)
    plain = _model_run(_plain, blocks_grad=False)
    plain["loss"].backward()
    ours = _model_run(_kata_way(kata), blocks_grad=False)
    what = "the TinyTransformer's blocks checkpointed, their input detached"
    _backward(ours["loss"], what)
    expected = {k: v for k, v in _grads(plain["model"]).items() if k.startswith("blocks")}
    difference = _first_difference(_grads(ours["model"]), expected)
    if difference is not None and "got no gradient" in difference:
        raise AssertionError(
            f"{what}: {difference}: when no input of the checkpointed function needs a "
            "gradient, its output must still carry the parameters' ones. An autograd.Function's "
            "output needs a grad only if one of its inputs does (torch's reentrant checkpoint "
            "has that limit): run the function with grad on under saved_tensors_hooks, or give "
            "the Function an input that requires grad"
        )
    assert difference is None, f"{what}: {difference} from no checkpointing's"


@pytest.mark.step(2)
def test_checkpoint_catches_an_input_changed_in_place(kata):
    block = _block()
    x = _input(2, 8, 16)
    h = x * 1.0
    y = kata.checkpoint(block, h, preserve_rng_state=False)
    h.mul_(2)  # after forward, before backward: the recompute would start from other numbers
    try:
        y.sum().backward()
    except KataTodo:
        raise
    except RuntimeError as error:
        if "inplace" in str(error) or "in-place" in str(error):
            return
        raise AssertionError(
            f"checkpoint(block, h), then h changed in place: backward raised {_failure(error)}, "
            "expected autograd's own error about a tensor modified by an inplace operation"
        ) from None
    raise AssertionError(
        "checkpoint(block, h), then h.mul_(2) before backward: backward ran the block again "
        "from the changed h and gave wrong gradients without a word. Keep the inputs through "
        "autograd (Kept(tensors); tensors() gives them back in backward, checked): then "
        "autograd raises, as it does for its own saved tensors"
    )


@pytest.mark.step(2)
def test_checkpoint_under_no_grad_just_runs_the_function(kata):
    block = _block()
    watch = Watched(block)
    x = _input(2, 8, 16)
    with torch.no_grad():
        try:
            y = kata.checkpoint(watch, x, preserve_rng_state=False)
        except KataTodo:
            raise
        except Exception as error:
            raise AssertionError(
                f"checkpoint(block, x) under torch.no_grad() raised {_failure(error)}: without "
                "grad nothing is saved and nothing will be recomputed; just run the function"
            ) from None
        expected = block(x)
    assert torch.equal(y, expected) and y.grad_fn is None and watch.calls == 1, (
        f"checkpoint(block, x) under torch.no_grad() ran the block {watch.calls} time(s) and "
        f"returned {'a tensor with a grad_fn' if y.grad_fn is not None else 'other numbers'}: "
        "without grad, return function(*args), run once"
    )


# --------------------------------------------------------------------------- step 3


def _dropped(block, x: torch.Tensor) -> torch.Tensor:
    """A block between two dropouts, as a transformer's embeddings and residuals have them."""
    return F.dropout(block(F.dropout(x, 0.25, training=True)), 0.25, training=True)


def _dropout_run(way, draw_between: bool = False) -> dict:
    block = _block()
    x = _input(2, 8, 16)
    torch.manual_seed(7)
    torch.rand(3)  # what the layers before draw
    y = way(_dropped, block, x)
    between = torch.rand(4) if draw_between else None  # what the rest of the model draws
    y.square().sum().backward()
    return {
        "grads": {n: p.grad.clone() for n, p in block.named_parameters()} | {"x": x.grad},
        "between": between,
        "state": torch.get_rng_state(),
    }


@pytest.mark.step(3)
def test_recomputed_dropout_draws_the_same_masks(kata):
    plain = _dropout_run(_plain)
    ours = _dropout_run(_kata_way(kata, preserve=True))
    theirs = _dropout_run(_torch_way(preserve=True))
    for name, expected in (("no checkpointing", plain), ("torch's", theirs)):
        difference = _first_difference(ours["grads"], expected["grads"])
        assert difference is None, (
            f"a block between two dropouts (p=0.25), checkpointed with preserve_rng_state=True: "
            f"{difference} from {name}. The recompute drew other dropout masks than forward: "
            "its gradients are those of another network. Take rng_snapshot(args) before "
            "forward runs, and run the recompute inside replayed_rng(snapshot)"
        )


@pytest.mark.step(3)
def test_the_generator_after_backward_is_as_without_checkpointing(kata):
    plain = _dropout_run(_plain, draw_between=True)
    ours = _dropout_run(_kata_way(kata, preserve=True), draw_between=True)
    assert torch.equal(ours["between"], plain["between"]), (
        "a dropout block checkpointed: what the model drew after it, before backward, differs "
        "from without checkpointing: forward must draw exactly what it draws without (take the "
        "snapshot, do not reseed)"
    )
    assert torch.equal(ours["state"], plain["state"]), (
        "a dropout block checkpointed, 4 numbers drawn after it, then backward: the CPU "
        "generator's state after backward differs from without checkpointing. The recompute "
        "must leave the generator where the rest of training left it: set the snapshot's "
        "state inside torch.random.fork_rng(devices=...), which puts the state back on exit"
    )


@pytest.mark.step(3)
@pytest.mark.cuda
def test_recomputed_dropout_on_cuda_draws_the_same_masks(kata):
    require_gpus(1)
    device = torch.device("cuda", 0)
    grads = []
    for way in (_plain, _kata_way(kata, preserve=True)):
        block = _block().to(device)
        x = _input(2, 8, 16).detach().to(device).requires_grad_()
        torch.manual_seed(7)
        way(_dropped, block, x).square().sum().backward()
        grads.append({n: p.grad for n, p in block.named_parameters()})
    difference = _first_difference(grads[1], grads[0])
    assert difference is None, (
        f"a dropout block on CUDA, checkpointed: {difference} from no checkpointing: the masks "
        "are drawn by the CUDA device's generator: snapshot and replay each device's state "
        "(torch.cuda.get_rng_state(device)) of the tensors among the inputs"
    )


# --------------------------------------------------------------------------- step 4


@pytest.mark.step(4)
def test_selective_checkpoint_refuses_what_is_not_an_op(kata):
    cases = {
        "torch.ops.aten.mm (the packet, no overload)": [aten.mm],
        "torch.matmul (a Python function)": [torch.matmul],
        "'mm' (a name)": ["mm"],
    }
    for what, save in cases.items():
        watch = Watched(_block())
        outcome = refusal(lambda s=save, w=watch: kata.checkpoint(w, _input(2, 8, 16), save=s))
        assert outcome is None and watch.calls == 0, (
            f"checkpoint(block, x, save=[{what}]) "
            + (
                f"{outcome}"
                if outcome is not None
                else f"refused only after running the block {watch.calls} time(s)"
            )
            + ": the dispatcher sees ATen op overloads (torch.ops.aten.mm.default); anything "
            "else would never match and silently keep nothing. Raise ValueError before "
            "anything runs"
        )


@pytest.mark.step(4)
@pytest.mark.parametrize("policy", list(POLICIES))
def test_selective_checkpoint_equals_torchs_bitwise(kata, policy):
    save = POLICIES[policy]
    _bitwise(
        kata,
        _kata_way(kata, save),
        _torch_way(save),
        f"the TinyTransformer with each block through checkpoint(..., save=<{policy}>)",
    )


@pytest.mark.step(4)
def test_selective_checkpoint_keeps_the_chosen_outputs(kata):
    shape = (2, 8, 16)
    block, x = _block(), _input(*shape)
    watch = Watched(block)
    run = functools.partial(kata.checkpoint, watch, x, preserve_rng_state=False, save=LINEAR)
    y, saved = _saved_bytes(run, block)
    expected = _expected_bytes(*shape, "matmuls")
    alive = watch.alive(x, y) + 4 * x.numel()
    assert alive == expected, (
        f"checkpoint(block, x, save=(mm, addmm)): after forward {alive:,} bytes of the input "
        f"and what the block made are alive, expected {expected:,}: the input and the six "
        "linear layers' outputs (q, k, v, out, up and down: 10 b s h floats). "
        + (
            "More: keep the outputs of the ops in save only"
            if alive > expected
            else "Keep each kept op's output (detached) until the recompute"
        )
    )
    assert saved == expected, (
        f"checkpoint(block, x, save=(mm, addmm)) keeps {alive:,} bytes, but saved-tensor hooks "
        f"saw {saved:,}: keep the ops' outputs with the inputs through Kept, as autograd keeps "
        "its own (torch's selective checkpoint does, with respect_saved_tensors_hooks=True), so "
        "that a meter or an offloading hook sees them"
    )
    if _sac_respects_hooks():
        torchs = _torch_way(LINEAR)
        _, theirs = _saved_bytes(lambda: torchs(block, x), block)
        assert saved == theirs, f"torch's selective checkpoint keeps {theirs:,}, yours {saved:,}"


def _recomputed_ops(way) -> dict:
    run = _model_run(way)
    with _CountOps() as counter:
        _backward(run["loss"], "the checkpointed TinyTransformer")
    return counter.counts


@pytest.mark.step(4)
def test_selective_recompute_runs_none_of_the_kept_ops(kata):
    backward = _recomputed_ops(_plain)  # backward's own ops: its gradients' matmuls
    ours = _recomputed_ops(_kata_way(kata, LINEAR))
    again = {
        op: ours.get(op, 0) - backward.get(op, 0)
        for op in (*LINEAR, aten.native_layer_norm.default)
    }
    kept = again[aten.mm.default] + again[aten.addmm.default]
    assert kept == 0, (
        f"the TinyTransformer's 2 blocks checkpointed with save=(mm, addmm): backward ran "
        f"{kept} more mm and addmm than without checkpointing: the recompute ran the linear "
        "layers again. ReplayOutputs must hand their kept outputs back instead of running them"
    )
    norms = again[aten.native_layer_norm.default]
    assert norms == 4, (
        f"the TinyTransformer's 2 blocks checkpointed with save=(mm, addmm): the recompute ran "
        f"{norms} LayerNorms, expected 4 (2 a block): what is not kept runs again"
    )


@pytest.mark.step(4)
def test_a_recompute_that_runs_other_ops_is_an_error(kata):
    generator = torch.Generator().manual_seed(5)
    a, w, bias = (torch.randn(8, 8, generator=generator) for _ in range(3))
    a.requires_grad_(), w.requires_grad_()
    calls = []

    def changing(a):  # the same two products, in the other order the second time
        calls.append(1)
        if len(calls) == 1:
            plain, biased = torch.mm(a, w), torch.addmm(bias, a, w)
        else:
            biased, plain = torch.addmm(bias, a, w), torch.mm(a, w)
        return plain.relu() * biased.relu()

    y = kata.checkpoint(changing, a, preserve_rng_state=False, save=LINEAR)
    try:
        y.sum().backward()
    except KataTodo:
        raise
    except RuntimeError:
        return
    raise AssertionError(
        "a function that ran torch.mm then torch.addmm in forward, and the two the other way "
        "round in the recompute, checkpointed with save=(mm, addmm): backward handed mm's "
        "output to addmm without a word, and the gradients belong to other numbers than the "
        "function computes. When the recompute asks for another op than forward kept at that "
        "place, raise RuntimeError saying so"
    )


# --------------------------------------------------------------------------- step 5


@pytest.mark.step(5)
def test_checkpoint_blocks_refuses_what_it_cannot_wrap(kata):
    cases = {
        "a model without .blocks (nn.Linear)": lambda: kata.checkpoint_blocks(
            torch.nn.Linear(2, 2)
        ),
        "block 5 of 2": lambda: kata.checkpoint_blocks(make_transformer(0), blocks=[5]),
        "blocks checkpointed twice": lambda: kata.checkpoint_blocks(
            kata.checkpoint_blocks(make_transformer(0))
        ),
    }
    for what, call in cases.items():
        outcome = refusal(call)
        assert outcome is None, (
            f"checkpoint_blocks with {what} {outcome}: raise ValueError saying what is wrong "
            "(a block twice would run its forward three times a step)"
        )


def _forward_counter(blocks) -> list[int]:
    """How many times each block's forward has run (its pre-hooks: a recompute's too)."""
    runs = [0] * len(blocks)
    for index, block in enumerate(blocks):
        block.register_forward_pre_hook(functools.partial(_count, runs, index))
    return runs


def _count(runs: list[int], index: int, *_) -> None:
    runs[index] += 1


def _blocks_run(kata, blocks, save=()) -> dict:
    model = make_transformer(3)
    params = {id(p) for p in model.parameters()}
    runs = _forward_counter(model.blocks)
    if blocks != "none":
        returned = kata.checkpoint_blocks(model, blocks, save)
        assert returned is model, "checkpoint_blocks returns the model it changed, in place"
    tokens, targets = make_tokens(4, 11)
    loss, saved = _saved_bytes(lambda: transformer_loss(model(tokens), targets), model)
    _backward(loss, f"checkpoint_blocks(model, {blocks}, {save})")
    return {
        "same params": {id(p) for p in model.parameters()} == params,
        "runs": runs,
        "saved": saved,
        "grads": {n.replace(".module.", "."): p.grad.clone() for n, p in model.named_parameters()},
    }


@pytest.mark.step(5)
def test_checkpoint_blocks_checkpoints_the_models_own_blocks(kata):
    plain = _blocks_run(kata, "none")
    for blocks, save, runs in ((None, (), [2, 2]), ([1], (), [1, 2]), (None, LINEAR, [2, 2])):
        what = f"checkpoint_blocks(TinyTransformer, blocks={blocks}, save={'(mm, addmm)' if save else '()'})"
        got = _blocks_run(kata, blocks, save)
        assert got["same params"], (
            f"{what}: the model's parameters are not the same tensors any more: wrap the blocks "
            "themselves (no copies), so that an optimizer made before still trains them"
        )
        if got["runs"] == [1, 1] and blocks is None:
            raise AssertionError(
                f"{what}: the blocks' forward hooks ran once each in a step, expected twice: "
                "the recompute ran the blocks' forward without their hooks. Checkpoint each "
                "block's whole call, module(*args), not module.forward: k19's FSDP gathers a "
                "unit's weights in its forward pre-hook, and the recompute needs them again"
            )
        assert got["runs"] == runs, (
            f"{what}: the blocks' forwards ran {got['runs']} times in a step, expected {runs}: "
            "checkpoint exactly the blocks asked for (None: every one), each once"
        )
        difference = _first_difference(got["grads"], plain["grads"])
        assert difference is None, f"{what}: {difference} from no checkpointing's"
        if save:  # each block keeps 9 b s h floats more: the linear layers' outputs
            full = _blocks_run(kata, None)["saved"]
            more = 2 * 4 * 9 * 4 * 8 * 16
            assert got["saved"] == full + more, (
                f"{what} kept {got['saved']:,} bytes for backward, with save=() {full:,}, "
                f"expected {more:,} more (the linear layers' outputs): Checkpointed passes its "
                "save on to checkpoint"
            )


# What k19's FSDP does in a step, with and without checkpointed blocks (2 ranks).
FSDP_STEPS = 2


def _fsdp_rank(rank, world_size, keep: bool) -> dict:
    from dojo.toy_models import TinyTransformer

    k19, kata = load_kata("k19_fsdp"), load_kata(KATA)
    out = {}
    for checkpointed in (False, True):
        model = make_transformer(5)
        runs = _forward_counter(model.blocks)
        wrapper = k19.FullyShardedModule(
            model,
            shard_types=(Block, TinyTransformer),
            prefetch=False,
            reshard_after_forward=not keep,
        )
        if checkpointed:
            kata.checkpoint_blocks(model)  # after the units: their hooks inside the checkpoint
        optimizer = torch.optim.SGD(wrapper.parameters(), lr=0.1)
        steps = []
        for step in range(FSDP_STEPS):
            tokens, targets = make_tokens(4, 100 * step + rank)
            optimizer.zero_grad()
            with recording() as forward:
                loss = transformer_loss(wrapper(tokens), targets)
            with recording() as backward:
                loss.backward()
            wrapper.finish_gradient_synchronization()
            steps.append(
                {
                    "forward": [c.name for c in forward],
                    "backward": [c.name for c in backward],
                    "grads": [s.grad.clone() for s in wrapper.shards],
                }
            )
            optimizer.step()
        out[checkpointed] = {"steps": steps, "runs": sum(runs)}
    return out


@shared_run
def _fsdp_world(keep: bool):
    return run_world(_fsdp_rank, 2, keep, deadline=60)


def _gathers(names: list[str]) -> int:
    return sum("all_gather" in name for name in names)


def _fsdp_results(keep: bool) -> list:
    try:
        return _fsdp_world(keep)
    except RankFailed as failure:
        if "NoneType" not in str(failure):
            raise
        raise AssertionError(
            "checkpointed blocks inside k19's FSDP units: the recompute ran a block whose "
            "weights were gone (a Linear got None for its weight). k19 frees a unit's weights "
            "after its forward and gathers them in its forward pre-hook: the recompute must "
            "run the unit's whole call, hooks included, module(*args), not module.forward(*args)"
            "\n" + str(failure)
        ) from None


def _check_fsdp(keep: bool) -> list:
    results = _fsdp_results(keep)
    mode = "reshard_after_forward=False" if keep else "resharded after forward"
    for rank, got in enumerate(results):
        plain, ours = got[False]["steps"], got[True]["steps"]
        for step, (a, b) in enumerate(zip(plain, ours)):
            for i, (x, y) in enumerate(zip(a["grads"], b["grads"])):
                assert torch.equal(x, y), (
                    f"k19's FSDP ({mode}), 2 ranks, its blocks checkpointed: after step "
                    f"{step + 1} rank {rank}'s shard {i} has another gradient than without "
                    f"checkpointing (by up to {(x - y).abs().max().item():.3g})"
                )
        runs = got[True]["runs"]
        assert runs == 2 * 2 * FSDP_STEPS, (
            f"k19's FSDP ({mode}), its 2 blocks checkpointed: rank {rank}'s blocks ran {runs} "
            f"forwards in {FSDP_STEPS} steps, expected {4 * FSDP_STEPS} (each block twice a step)"
        )
    return results


@pytest.mark.step(5)
def test_inside_fsdp_units_the_recompute_gathers_the_weights_again(kata):
    results = _check_fsdp(keep=False)
    for rank, got in enumerate(results):
        for step, (plain, ours) in enumerate(zip(got[False]["steps"], got[True]["steps"])):
            counts = [_gathers(ours["forward"]), _gathers(ours["backward"])]
            assert counts == [3, 2], (
                f"k19's FSDP, a unit a block and the model's own, its 2 blocks checkpointed: "
                f"rank {rank}'s step {step + 1} made {counts[0]} all-gathers in forward and "
                f"{counts[1]} in backward, expected 3 and 2: one a unit in forward, one a block "
                "in backward, made by the recompute (the one backward makes anyway without "
                f"checkpointing: {_gathers(plain['backward'])})"
            )
            names = [n for n in ours["backward"] if "gather" in n or "scatter" in n]
            assert names[:2] in (
                ["all_gather_single", "reduce_scatter_single"],
                ["all_gather_into_tensor", "reduce_scatter_tensor"],
            ), (
                f"rank {rank}'s backward, step {step + 1}: {names}: the last block's gather "
                "(its recompute) comes before its reduce-scatter"
            )


@pytest.mark.step(5)
def test_kept_fsdp_units_serve_the_recompute(kata):
    results = _check_fsdp(keep=True)
    for rank, got in enumerate(results):
        for step, ours in enumerate(got[True]["steps"]):
            counts = [_gathers(ours["forward"]), _gathers(ours["backward"])]
            assert counts == [3, 0], (
                f"k19's FSDP with reshard_after_forward=False, its 2 blocks checkpointed: rank "
                f"{rank}'s step {step + 1} made {counts[0]} all-gathers in forward and "
                f"{counts[1]} in backward, expected 3 and 0: the weights kept from forward serve "
                "the recompute"
            )


@pytest.mark.step(5)
def test_program_shows_what_each_way_keeps(kata):
    done = run_module(
        KATA, "--world-size", "2", "--steps", "1", "--sequence", "16", "--dim", "16",
        timeout=180,
    )  # fmt: skip
    out = done.stdout
    assert done.returncode == 0, f"the program exited with {done.returncode}:\n{out}\n{done.stderr}"
    rows = {line.split()[1]: line.split()[2:] for line in out.splitlines() if " B " in line}
    for way in ("none", "full", "selective"):
        assert way in rows, f"the program shows no row for {way}:\n{out}"
        assert rows[way][0] == rows[way][2], f"{way}: measured and formula differ:\n{out}"
    assert "gradients equal" in out.splitlines()[-1], out
