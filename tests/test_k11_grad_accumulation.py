"""k11 gradient accumulation: micro-batches, one average per optimizer step, DDP's no_sync."""

from __future__ import annotations

import contextlib
import functools
import re
import time

import pytest
import torch

from dojo.harness.calls import recording
from dojo.harness.impl import load_kata
from dojo.harness.world import run_world
from dojo.spec.cuda import on_cuda
from dojo.spec.testing import check_refuses_naming, run_module_ok, shared_run, streams
from dojo.toy_models import loss as toy_loss
from dojo.toy_models import make_batch, make_model

KATA = "k11_grad_accumulation"
MICRO, STEPS, LR, WORLD = 3, 3, 0.1, 2  # samples per micro-batch and rank, steps, ranks
KS = (1, 2, 4)
MODEL_NAMES = ("frozen", "tied")

# fp32 sums in another order round differently: k micro-batch means added up and averaged over
# the ranks are not bitwise one mean over the whole batch, nor torch's DDP (which divides each
# gradient before summing). Those are held to this tolerance; ranks that all receive the same
# all-reduced bits are held to bitwise equality.
TOLERANCE = dict(rtol=1e-5, atol=1e-6)


def _device() -> torch.device:
    from dojo.devices import rank_device

    return rank_device()


def _state(module) -> dict:
    return {name: t.detach().cpu().clone() for name, t in module.state_dict().items()}


def _close(a: dict, b: dict) -> bool:
    return all(a[n] is not None and torch.allclose(a[n], b[n], **TOLERANCE) for n in b)


def _gap(a: dict, b: dict) -> tuple[float, str]:
    name = max(b, key=lambda n: (a[n].double() - b[n].double()).abs().max().item())
    return (a[name].double() - b[name].double()).abs().max().item(), name


def _global_batch(model_name: str, k: int, step: int, world_size: int):
    return make_batch(model_name, MICRO * k * world_size, seed=step)


def _shard(model_name: str, k: int, rank: int, step: int, world_size: int):
    """Rank ``rank``'s part of step ``step``'s global batch: ``MICRO * k`` samples."""
    inputs, targets = _global_batch(model_name, k, step, world_size)
    part = slice(rank * MICRO * k, (rank + 1) * MICRO * k)
    return inputs[part].to(_device()), targets[part].to(_device())


# --------------------------------------------------------------------------- step 1: micro-batches


def _describe(micro_batches) -> str:
    try:
        return ", ".join(str(len(pair[0])) for pair in micro_batches)
    except Exception:
        return repr(micro_batches)[:200]


@pytest.mark.step(1)
@pytest.mark.parametrize("model_name", ["frozen", "tied"])
def test_split_batch_cuts_equal_micro_batches_in_order(kata, model_name):
    inputs, targets = make_batch(model_name, 12, seed=0)
    for k in (1, 2, 3, 4, 6, 12):
        call = f"split_batch(a batch of 12, {k})"
        got = kata.split_batch((inputs, targets), k)
        assert isinstance(got, (list, tuple)), f"{call} returned a {type(got).__name__}, not a list"
        got = list(got)
        sizes = _describe(got)
        if len(got) == 12 // k and k != 12 // k:
            raise AssertionError(
                f"{call} returned {len(got)} micro-batches of {sizes} samples: accumulation_steps "
                f"is how many micro-batches there are ({k}), not how many samples each holds"
            )
        assert len(got) == k, f"{call} returned {len(got)} micro-batches ({sizes}), expected {k}"
        for index, pair in enumerate(got):
            assert isinstance(pair, (tuple, list)) and len(pair) == 2, (
                f"{call}: micro-batch {index} is {type(pair).__name__}, expected an "
                "(inputs, targets) pair that toy_loss(model, micro_batch) takes"
            )
            assert len(pair[0]) == len(pair[1]) == 12 // k, (
                f"{call}: micro-batch {index} holds {len(pair[0])} inputs and {len(pair[1])} "
                f"targets, expected {12 // k} of each"
            )
        joined = (torch.cat([p[0] for p in got]), torch.cat([p[1] for p in got]))
        assert torch.equal(joined[0], inputs), (
            f"{call}: the micro-batches' inputs, one after the other, are not the batch's inputs "
            "in order: micro-batch i holds samples i*m to (i+1)*m - 1"
        )
        assert torch.equal(joined[1], targets), (
            f"{call}: the micro-batches' targets are not the batch's targets in order: each "
            "micro-batch keeps its own samples' targets"
        )


@pytest.mark.step(1)
@pytest.mark.parametrize(
    "size, k, wrong, why",
    [
        (10, 4, "4", "10 samples do not split into 4 micro-batches of equal size"),
        (12, 0, "0", "0 micro-batches cannot hold a batch"),
        (12, -2, "-2", "-2 is not a number of micro-batches"),
        (3, 4, "4", "3 samples cannot fill 4 micro-batches"),
    ],
    ids=["10-by-4", "12-by-0", "12-by-minus-2", "3-by-4"],
)
def test_split_batch_refuses_what_does_not_split_evenly(kata, size, k, wrong, why):
    inputs, targets = make_batch("frozen", size, seed=0)

    def returned(got) -> str:
        got = list(got)
        taken = sum(len(pair[0]) for pair in got)
        detail = f"{len(got)} micro-batches of {_describe(got)} samples"
        if taken < size:
            detail += f", {size - taken} samples dropped"
        return (
            f"returned {detail}: {why}. Micro-batches of unequal size weigh their samples "
            "unequally once each loss is divided by k (and dropped samples are never learnt "
            "from): raise ValueError saying what is wrong"
        )

    call = f"split_batch(a batch of {size}, {k})"
    split = functools.partial(kata.split_batch, (inputs, targets), k)
    check_refuses_naming(split, call, wrong, why, returned)


# --------------------------------------------------------------------------- step 2: the step


class _WatchedSGD(torch.optim.SGD):
    """Plain SGD that notes, at each step, when it ran and the gradients it was given."""

    def __init__(self, params, lr):
        super().__init__(params, lr=lr)
        self.names = {}
        self.steps = []  # (time.perf_counter(), {name: grad})

    def step(self, closure=None):
        grads = {
            name: None if p.grad is None else p.grad.detach().cpu().clone()
            for p, name in self.names.items()
        }
        self.steps.append((time.perf_counter(), grads))
        return super().step(closure)


def _ddp_with_no_sync(model_name: str, rank: int, world_size: int, k: int) -> dict:
    """torch's DDP and its no_sync() on the same ranks, seeds and data: the reference."""
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(make_model(model_name, seed=0).to(_device()))
    optimizer = torch.optim.SGD(ddp.parameters(), lr=LR)
    for step in range(STEPS):
        inputs, targets = _shard(model_name, k, rank, step, world_size)
        optimizer.zero_grad()
        for i in range(k):
            part = (inputs[i * MICRO : (i + 1) * MICRO], targets[i * MICRO : (i + 1) * MICRO])
            with contextlib.nullcontext() if i == k - 1 else ddp.no_sync():
                (toy_loss(ddp, part) / k).backward()
        optimizer.step()
    return _state(ddp.module)


def _accumulate(rank, world_size, model_name, k):
    kata = load_kata(KATA)
    model = make_model(model_name, seed=0).to(_device())  # the same seed: the same replicas
    optimizer = _WatchedSGD(model.parameters(), lr=LR)
    optimizer.names = {p: name for name, p in model.named_parameters()}
    steps = []
    for step in range(STEPS):
        batch = _shard(model_name, k, rank, step, world_size)
        with torch.no_grad():
            own = toy_loss(model, batch).item()
        stepped = len(optimizer.steps)
        with recording() as calls:
            loss = kata.accumulation_step(model, optimizer, batch, k)
        steps.append(
            {
                "loss": loss if isinstance(loss, (float, int)) else f"a {type(loss).__name__}",
                "own": own,
                "calls": [(c.name, [tuple(s) for s in c.shapes], c.start) for c in calls],
                "optimizer": [moment for moment, _ in optimizer.steps[stepped:]],
            }
        )
    first = optimizer.steps[0][1] if optimizer.steps else {}
    return {
        "steps": steps,
        "first_grads": first,
        "state": _state(model),
        "ddp": _ddp_with_no_sync(model_name, rank, world_size, k),
    }


@shared_run
def _accumulated(model_name: str, k: int):
    """STEPS accumulation steps on 2 ranks, shared by the step-2 tests."""
    return run_world(_accumulate, WORLD, model_name, k, deadline=40)


def _one_process(
    model_name: str,
    k: int,
    zero_grad: bool = True,
    grad_scale: float = 1.0,
    world_size: int = WORLD,
):
    """STEPS steps of one process on the whole global batches: the truth (or, with the
    arguments, the process a mistake amounts to)."""
    model = make_model(model_name, seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        if zero_grad:
            optimizer.zero_grad()
        toy_loss(model, _global_batch(model_name, k, step, world_size)).backward()
        with torch.no_grad():
            saved = [p.grad.clone() for p in model.parameters() if p.grad is not None]
            for p in model.parameters():
                if p.grad is not None:
                    p.grad *= grad_scale
        optimizer.step()
        with torch.no_grad():  # what backward left, for a process that never zeroes
            for p, grad in zip([p for p in model.parameters() if p.grad is not None], saved):
                p.grad.copy_(grad)
    return _state(model)


def _first_gradients(model_name: str, k: int, last_only: bool = False) -> dict:
    """The gradient of step 0's whole batch, or (``last_only``) the mean over the ranks of each
    rank's last micro-batch's gradient (what survives a zero_grad between micro-batches)."""
    model = make_model(model_name, seed=0)
    if not last_only:
        toy_loss(model, _global_batch(model_name, k, 0, WORLD)).backward()
    else:
        inputs, targets = _global_batch(model_name, k, 0, WORLD)
        for rank in range(WORLD):
            last = slice((rank + 1) * MICRO * k - MICRO, (rank + 1) * MICRO * k)
            (toy_loss(model, (inputs[last], targets[last])) / WORLD).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _scaled(grads: dict, factor: float) -> dict:
    return {name: grad * factor for name, grad in grads.items()}


def _check_loss(results, k: int) -> None:
    for rank, result in enumerate(results):
        for number, step in enumerate(result["steps"], start=1):
            loss = step["loss"]
            assert isinstance(loss, (float, int)), (
                f"rank {rank}'s accumulation_step returned {loss}: return this rank's loss as a "
                "float (loss.item())"
            )
            if abs(loss - step["own"]) <= 1e-5 * max(1.0, abs(step["own"])):
                continue
            raise AssertionError(
                f"rank {rank}'s accumulation_step number {number} returned {loss:.6f}, expected "
                f"{step['own']:.6f}: this rank's loss on its whole batch before the step, the mean "
                f"of the micro-batches' losses (each micro-batch's loss / k, added up over the {k})"
            )


def _gradients_named(got: dict, model_name: str, k: int) -> str | None:
    """What the first step's gradients match, when they are wrong."""
    expected = _first_gradients(model_name, k)
    if _close(got, expected):
        return None
    if k > 1 and _close(got, _scaled(expected, k)):
        return (
            f"the gradients at the first optimizer.step() are {k} times too large: the loss was not "
            f"divided by k. Each micro-batch's loss is its own mean, so {k} of them add up to {k} "
            "times the batch's: divide each micro-batch's loss by accumulation_steps before "
            "backward()"
        )
    last = _first_gradients(model_name, k, last_only=True)
    if k > 1 and (_close(got, _scaled(last, 1 / k)) or _close(got, last)):
        return (
            "the gradients at the first optimizer.step() hold only the last micro-batch's "
            "gradient: zero_grad() between micro-batches wiped what the earlier ones added up. "
            "Zero the gradients once, before the first micro-batch (or after the step)"
        )
    if _close(got, _scaled(expected, WORLD)):
        return (
            f"the gradients at the first optimizer.step() are the sum over the {WORLD} ranks, not "
            "their mean: average them (k04's average_gradients divides by the world size)"
        )
    if _close(got, _scaled(expected, 1 / WORLD)):
        return (
            f"the gradients at the first optimizer.step() are {WORLD} times too small: "
            "average_gradients already divides by the world size, so divide each micro-batch's "
            "loss by accumulation_steps only"
        )
    name = max(
        expected,
        key=lambda n: (got[n] - expected[n]).abs().max().item() if got[n] is not None else 1e9,
    )
    return (
        f"the gradients at the first optimizer.step() are not the whole batch's gradient (in "
        f"{name!r}): the micro-batches' gradients added up, each loss divided by k, then averaged "
        "over the ranks once"
    )


# How often it steps and averages comes first: a step per micro-batch, or an average after
# the step, also changes the losses and weights, but only these counts name the mistake.
@pytest.mark.step(2)
@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("model_name", MODEL_NAMES)
def test_accumulation_step_averages_once_per_optimizer_step(kata, model_name, k):
    results = _accumulated(model_name, k)
    model = make_model(model_name, seed=0)
    trainable = [p for p in model.parameters() if p.requires_grad]
    tensors, elements = len(trainable), sum(p.numel() for p in trainable)
    for rank, result in enumerate(results):
        for number, step in enumerate(result["steps"], start=1):
            this = f"rank {rank}'s accumulation_step number {number} (k={k})"
            if not step["optimizer"]:
                raise AssertionError(
                    f"{this} never called optimizer.step(): step once, after the last micro-batch"
                )
            if len(step["optimizer"]) > 1:
                raise AssertionError(
                    f"{this} called optimizer.step() {len(step['optimizer'])} times: one step per "
                    "batch, after the last micro-batch's backward (a step per micro-batch is "
                    "training on micro-batches, not accumulating)"
                )
            reduces = [(shapes, at) for name, shapes, at in step["calls"] if name == "all_reduce"]
            if not reduces:
                raise AssertionError(
                    f"{this} made no all-reduce: each rank stepped with its own gradient. Average "
                    "once per optimizer step (k04's average_gradients(model)), after the last "
                    "micro-batch's backward"
                )
            sent = sum(int(torch.Size(shape).numel()) for shapes, _ in reduces for shape in shapes)
            if all(all(s in ((), (1,)) for s in shapes) for shapes, _ in reduces):
                raise AssertionError(
                    f"{this} all-reduced only single numbers (the loss?), never a gradient"
                )
            late = [at for _, at in reduces if at > step["optimizer"][0]]
            if late:
                raise AssertionError(
                    f"{this} all-reduced after optimizer.step() ({len(late)} of its "
                    f"{len(reduces)} all-reduces): the step had used this rank's own gradient. "
                    "Average after the last backward, then step."
                )
            if k > 1 and sent == k * elements:
                raise AssertionError(
                    f"{this} averaged at every micro-batch: {len(reduces)} all-reduces sending "
                    f"{sent} numbers per optimizer step instead of {tensors} sending {elements}. "
                    f"The result is the same (averaging is linear), but it is {k} times the "
                    "traffic: average once, after the last micro-batch's backward"
                )
            assert len(reduces) <= tensors and sent == elements, (
                f"{this} made {len(reduces)} all-reduces sending {sent} numbers, expected "
                f"{tensors} (one per gradient tensor) sending {elements}"
            )


@pytest.mark.step(2)
@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("model_name", MODEL_NAMES)
def test_accumulation_step_equals_one_step_on_the_whole_batch(kata, model_name, k):
    results = _accumulated(model_name, k)
    _check_loss(results, k)
    for rank, result in enumerate(results):
        if not result["first_grads"]:
            raise AssertionError(
                f"rank {rank}'s accumulation_step never called optimizer.step(): the weights never "
                "change. Step once, after the last micro-batch's backward and the averaging."
            )
    named = _gradients_named(results[0]["first_grads"], model_name, k)
    if named:
        raise AssertionError(f"rank 0, k={k}: {named}")
    mine = results[0]["state"]
    for rank, result in enumerate(results[1:], start=1):
        for name, tensor in result["state"].items():
            assert torch.equal(tensor, mine[name]), (
                f"after {STEPS} steps rank {rank}'s {name!r} differs from rank 0's: every rank must "
                "step with the same averaged gradient"
            )
    truth = _one_process(model_name, k)
    if not _close(mine, truth):
        gap, name = _gap(mine, truth)
        if _close(mine, _one_process(model_name, k, zero_grad=False)):
            raise AssertionError(
                f"after {STEPS} steps with k={k} the weights match a process that never zeroes its "
                "gradients: each step's sum piled onto the last step's. Zero them once per "
                "optimizer step, before the first micro-batch"
            )
        raise AssertionError(
            f"after {STEPS} steps with k={k} rank 0's weights are {gap:.3g} apart (in {name!r}) "
            f"from one process stepping on the whole batches of {MICRO * k * WORLD} samples"
        )
    theirs = results[0]["ddp"]
    assert _close(mine, theirs), (
        f"after {STEPS} steps with k={k} the weights are {_gap(mine, theirs)[0]:.3g} apart from "
        "torch's DDP with no_sync() on the same ranks and data"
    )


# --------------------------------------------------------------------------- step 3: with DDP


def _ddp_accumulate(rank, world_size, model_name, k):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    class WatchedDDP(DistributedDataParallel):
        """DDP that notes each forward (inside no_sync or not) and each no_sync block."""

        events: list

        @contextlib.contextmanager
        def no_sync(self):
            self.events.append("no_sync")
            with super().no_sync():
                yield

        def forward(self, *args, **kwargs):
            self.events.append("forward" if self.require_backward_grad_sync else "quiet forward")
            return super().forward(*args, **kwargs)

    kata = load_kata(KATA)

    def wrapped():
        ddp = WatchedDDP(make_model(model_name, seed=0).to(_device()))
        ddp.events = []
        # torch's default all-reduce, as a comm hook: its dist.all_reduce calls can be recorded
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
        return ddp

    probe = wrapped()  # how many all-reduces (buckets) one synchronised backward takes here
    with recording(("all_reduce",)) as calls:
        toy_loss(probe, _shard(model_name, 1, rank, 0, world_size)).backward()
    per_sync = len(calls)
    ddp = wrapped()
    optimizer = _WatchedSGD(ddp.parameters(), lr=LR)
    optimizer.names = {p: name for name, p in ddp.module.named_parameters()}
    steps = []
    for step in range(STEPS):
        batch = _shard(model_name, k, rank, step, world_size)
        with torch.no_grad():
            own = toy_loss(ddp.module, batch).item()
        ddp.events.clear()
        with recording(("all_reduce",)) as calls:
            loss = kata.ddp_accumulation_step(ddp, optimizer, batch, k)
        steps.append(
            {
                "loss": loss if isinstance(loss, (float, int)) else f"a {type(loss).__name__}",
                "own": own,
                "all_reduces": len(calls),
                "events": list(ddp.events),
            }
        )
    return {
        "steps": steps,
        "per_sync": per_sync,
        "first_grads": optimizer.steps[0][1] if optimizer.steps else {},
        "state": _state(ddp.module),
    }


@pytest.mark.step(3)
@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("model_name", MODEL_NAMES)
def test_ddp_accumulation_step_syncs_once_and_equals_one_step(kata, model_name, k):
    results = run_world(_ddp_accumulate, WORLD, model_name, k, deadline=40)
    for rank, result in enumerate(results):
        per_sync = result["per_sync"]
        for number, step in enumerate(result["steps"], start=1):
            this = f"rank {rank}'s ddp_accumulation_step number {number} (k={k})"
            events = step["events"]
            syncs = step["all_reduces"] // max(per_sync, 1)
            if syncs == 0:
                raise AssertionError(
                    f"{this} never synchronised: DDP all-reduced nothing, so each rank stepped with "
                    "its own gradient. Run the last micro-batch outside ddp_model.no_sync(): its "
                    "backward all-reduces what the others added up"
                )
            if k > 1 and syncs == k:
                quiet = events.count("quiet forward")
                detail = (
                    f" It entered no_sync() {events.count('no_sync')} times, but all {k} forwards "
                    "ran outside it: DDP decides at forward time whether the coming backward "
                    "all-reduces, so the forward belongs inside the block too"
                    if not quiet and "no_sync" in events
                    else " Run the forward and backward of every micro-batch but the last inside "
                    "ddp_model.no_sync()"
                )
                raise AssertionError(
                    f"{this}: DDP all-reduced the gradients at every micro-batch ({k} times per "
                    f"optimizer step): the result is the same, but it is {k} times the traffic."
                    + detail
                )
            assert syncs == 1, (
                f"{this}: DDP synchronised {syncs} times in one optimizer step, expected once"
            )
    _check_loss(results, k)
    for rank, result in enumerate(results):
        if not result["first_grads"]:
            raise AssertionError(
                f"rank {rank}'s ddp_accumulation_step never called optimizer.step()"
            )
    named = _gradients_named(results[0]["first_grads"], model_name, k)
    if named:
        raise AssertionError(f"rank 0, k={k}, with DDP: {named}")
    mine = results[0]["state"]
    for rank, result in enumerate(results[1:], start=1):
        assert all(torch.equal(t, mine[n]) for n, t in result["state"].items()), (
            f"after {STEPS} steps rank {rank}'s weights differ from rank 0's"
        )
    truth = _one_process(model_name, k)
    assert _close(mine, truth), (
        f"after {STEPS} steps with k={k} the weights are {_gap(mine, truth)[0]:.3g} apart from one "
        "process on the whole batches"
    )


@pytest.mark.step(3)
def test_program_compares_every_k_and_ddp(kata):
    done = run_module_ok(
        KATA, "--world-size", "2", "--steps", "2", "--k", "1", "2", "4", "--backend", "gloo",
        "--device", "cpu",
    )  # fmt: skip
    shown = streams(done)
    rows = re.findall(
        r"^\[main\]\s+(.+?): +(\d+) samples per backward, all-reduces per step: (\d+).*weights "
        r"(\S+) from k=1's$",
        done.stdout,
        re.MULTILINE,
    )
    assert [row[0] for row in rows] == ["k=1", "k=2", "k=4", "DDP + no_sync, k=4"], (
        f"the program must show one line for each k and one for DDP\n{shown}"
    )
    assert [int(row[1]) for row in rows] == [16, 8, 4, 4], shown
    assert [int(row[2]) for row in rows[:3]] == [4, 4, 4], (
        f"every k must take one all-reduce per gradient tensor per step\n{shown}"
    )
    assert all(float(row[3]) < 1e-5 for row in rows), (
        f"every k must end with k=1's weights (to rounding)\n{shown}"
    )
    assert "[main] every rank holds the same weights for each k: True" in done.stdout, shown


# --------------------------------------------------------------------------- CUDA


def _on_cuda(rank, world_size):
    result = _accumulate(rank, world_size, "tied", 2)
    result["device"] = str(_device().type)
    return result


def _check_cuda(results) -> None:
    for rank, result in enumerate(results):
        assert result["device"] == "cuda", f"rank {rank} ran on {result['device']}"
        # GPU kernels round differently from the CPU's: tolerance, as for another order
        assert _close(result["state"], result["ddp"]), (
            f"rank {rank}: {_gap(result['state'], result['ddp'])[0]:.3g} from torch's DDP"
        )
    truth = _one_process("tied", 2, world_size=len(results))
    assert _close(results[0]["state"], truth), (
        f"{_gap(results[0]['state'], truth)[0]:.3g} from one CPU process on the whole batches"
    )


@pytest.mark.step(2)
@pytest.mark.cuda
def test_nccl_world_of_one(kata):
    _check_cuda(run_world(_on_cuda, 1, **on_cuda(1, "nccl", deadline=90)))


@pytest.mark.step(2)
@pytest.mark.cuda
def test_gloo_on_cuda_several_ranks(kata):
    _check_cuda(run_world(_on_cuda, 2, **on_cuda(2, "gloo", deadline=90)))
