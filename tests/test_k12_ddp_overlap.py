"""k12 a DDP of your own: construction, hooks that launch async all-reduces, the finish, no_sync."""

from __future__ import annotations

import re
import sys
import time

import pytest
import torch
import torch.distributed as dist

from dojo.harness.calls import recording
from dojo.harness.impl import load_kata
from dojo.harness.world import run_world
from dojo.spec import wrappers
from dojo.spec.cuda import on_cuda
from dojo.spec.testing import run_module_ok, shared_run, streams
from dojo.todo import KataTodo
from dojo.toy_models import loss as toy_loss
from dojo.toy_models import make_batch, make_model

KATA = "k12_ddp_overlap"
MODEL_NAMES = ("frozen", "tied", "buffer")
HEAVY = ("torchvision", "sklearn")  # rank processes import the kata: it must stay cheap
PER_RANK, STEPS, LR = 4, 3, 0.1
UNIQUE_TRAINABLE = {"frozen": 4, "tied": 3, "buffer": 4}
UNIQUE_NAMES = {
    "frozen": ["first.weight", "first.bias", "last.weight", "last.bias"],
    "tied": ["embedding.weight", "hidden.weight", "hidden.bias"],
    "buffer": ["first.weight", "first.bias", "last.weight", "last.bias"],
}


def _device() -> torch.device:
    from dojo.devices import rank_device

    return rank_device()


def _state(module) -> dict:
    return {name: t.detach().cpu().clone() for name, t in module.state_dict().items()}


def _grads(module) -> dict:
    return {
        name: None if p.grad is None else p.grad.detach().cpu().clone()
        for name, p in module.named_parameters()
    }


def _error(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0][:300] if lines else ''}"


def _shard(model_name: str, rank: int, world_size: int, step: int, per_rank: int = PER_RANK):
    """Rank ``rank``'s slice of step ``step``'s global batch (``per_rank * world_size`` samples)."""
    inputs, targets = make_batch(model_name, per_rank * world_size, seed=step)
    part = slice(rank * per_rank, (rank + 1) * per_rank)
    return inputs[part].to(_device()), targets[part].to(_device())


def _local_gradients(model_name: str, seed: int, batch) -> dict:
    """What one rank's backward alone leaves in .grad (a fresh copy of the model, no wrapper)."""
    model = make_model(model_name, seed=seed).to(_device())
    toy_loss(model, batch).backward()
    return _grads(model)


def _one_process(model_name: str, world_size: int, grad_scale: float = 1.0) -> dict:
    """STEPS steps of one process on the whole batches (rank 0's initial weights): the truth.
    ``grad_scale`` makes it the process a mistake would be (gradients that many times too large)."""
    model = make_model(model_name, seed=100)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        toy_loss(model, make_batch(model_name, PER_RANK * world_size, seed=step)).backward()
        with torch.no_grad():
            for param in model.parameters():
                if param.grad is not None:
                    param.grad *= grad_scale
        optimizer.step()
        optimizer.zero_grad()
    return _state(model)


def _gap(a: dict, b: dict) -> tuple[float, str]:
    """The largest difference between two states, and where."""
    name = max(a, key=lambda n: (a[n].double() - b[n].double()).abs().max().item())
    return (a[name].double() - b[name].double()).abs().max().item(), name


# fp32 sums in another order round differently: N ranks' means of their shards versus one mean
# over the whole batch, or torch's DDP (which divides each gradient before summing) versus a sum
# divided afterwards. Those are held to this tolerance; the same operations in the same order
# are held to bitwise equality.
TOLERANCE = dict(rtol=1e-5, atol=1e-6)


def _close(a: dict, b: dict) -> bool:
    return all(torch.allclose(a[n], b[n], **TOLERANCE) for n in b)


def _equal(a: dict, b: dict) -> bool:
    return all(torch.equal(a[n], b[n]) for n in b)


# --------------------------------------------------------------------------- step 1: construction


def _without_hooks(kata):
    """The learner's wrapper with step 2 switched off: the construction tests look at the state
    it leaves, and the hooks are step 2's business."""

    class ConstructionOnly(kata.OverlappingDDP):
        def _register_hooks(self, *args, **kwargs):  # whatever its signature: no hooks yet
            pass

    return ConstructionOnly


def _construct(rank, world_size, model_name):
    heavy_before = {name for name in HEAVY if name in sys.modules}
    kata = load_kata(KATA)
    heavy = sorted(name for name in HEAVY if name in sys.modules and name not in heavy_before)
    model = make_model(model_name, seed=100 + rank).to(_device())  # every rank built apart
    before = _state(model)
    pointers = {name: t.data_ptr() for name, t in model.state_dict().items()}
    ddp, failure = None, None
    with recording() as calls:
        try:
            ddp = _without_hooks(kata)(model)
        except KataTodo:
            raise
        except Exception as error:
            failure = _error(error)
    result = {
        "heavy": heavy,
        "before": before,
        "after": _state(model),
        "failure": failure,
        "calls": [(c.name, dict(c.peers)) for c in calls],
        "moved": sorted(n for n, t in model.state_dict().items() if t.data_ptr() != pointers[n]),
        "frozen": sorted(n for n, p in model.named_parameters() if not p.requires_grad),
        "buffers": sorted(n for n, _ in model.named_buffers()),
        "expected_parameters": [f"module.{n}" for n, _ in model.named_parameters()],
        "expected_buffers": [f"module.{n}" for n, _ in model.named_buffers()],
        "expected_keys": [f"module.{n}" for n in model.state_dict()],
    }
    if ddp is not None:
        inputs, _ = make_batch(model_name, 4, seed=0)
        inputs = inputs.to(_device())
        with torch.no_grad():
            result["forward_equal"] = torch.equal(ddp(inputs), model(inputs))
        result["keyword"], result["forward_keywords"] = wrappers.forward_keywords(
            ddp, model, inputs
        )
        result["module_is_model"] = ddp.module is model
        result["parameters"] = [n for n, _ in ddp.named_parameters()]
        result["buffers_seen"] = [n for n, _ in ddp.named_buffers()]
        result["keys"] = list(ddp.state_dict())
    return result


def _sources(calls) -> list:
    return [peers.get("src", f"group_src={peers.get('group_src')}") for _, peers in calls]


def _check_construction(results, model_name: str) -> None:
    for rank, result in enumerate(results):
        if result["failure"]:
            raise AssertionError(
                f"rank {rank}: OverlappingDDP(<{model_name} model>) raised {result['failure']}"
            )
        others = sorted({name for name, _ in result["calls"] if name != "broadcast"})
        if others:
            raise AssertionError(
                f"rank {rank}'s construction called {', '.join(others)}: averaging the replicas "
                "makes them equal, but not equal to the first rank's, which is what every rank must "
                "start from. Copy the first rank's tensors with dist.broadcast, in place."
            )
        if result["heavy"]:
            raise AssertionError(
                f"importing the kata imported {', '.join(result['heavy'])}: every rank process "
                "imports it, so keep such imports inside the functions that need them"
            )
    first = results[0]
    source = first["before"]
    for rank, result in enumerate(results):
        sources = _sources(result["calls"])
        for name, expected in source.items():
            got = result["after"][name]
            if torch.equal(got, expected):
                continue
            if rank == 0:
                raise AssertionError(
                    f"construction changed rank 0's own {name!r}: rank 0, the group's first rank, "
                    "is the source every rank copies"
                )
            own = torch.equal(got, result["before"][name])
            if own and name in result["frozen"]:
                raise AssertionError(
                    f"rank {rank}'s frozen parameter {name!r} still holds its own random values "
                    "after construction: broadcast every parameter, frozen ones too (requires_grad="
                    "False only means nothing trains it: a rank built with another seed still "
                    "computes other outputs with it)"
                )
            if own and name in result["buffers"]:
                raise AssertionError(
                    f"rank {rank}'s buffer {name!r} still holds its own values after construction: "
                    "broadcast every buffer too (module.buffers()), not only the parameters"
                )
            if own and any(s != 0 for s in sources):
                raise AssertionError(
                    f"rank {rank}'s {name!r} still holds its own values: its broadcasts named "
                    f"src={sorted(set(map(str, sources)))}; the source is the group's first rank "
                    "(rank 0 of the world here), whatever this rank's own rank"
                )
            if own:
                raise AssertionError(
                    f"rank {rank}'s parameter {name!r} still holds its own random values after "
                    f"construction ({len(result['calls'])} broadcasts made): broadcast every "
                    "parameter from the group's first rank, into the parameter itself (in place), "
                    "not into a copy of it"
                )
            raise AssertionError(
                f"after construction rank {rank}'s {name!r} holds {got.flatten()[:3].tolist()}..., "
                f"neither its own values nor rank 0's {expected.flatten()[:3].tolist()}...: copy "
                "rank 0's, in place"
            )
        if result["moved"]:
            raise AssertionError(
                f"rank {rank}'s construction replaced the tensors of {result['moved'][:3]} with new "
                "ones instead of copying into them: broadcast into each parameter and buffer in "
                "place (whoever holds them, an optimizer made before the wrapper, keeps the old ones)"
            )
    if not first.get("module_is_model", False):
        raise AssertionError(
            "OverlappingDDP(model).module is not the model itself: keep it as self.module (as "
            "torch's DDP does), not a copy"
        )
    assert first["parameters"] == first["expected_parameters"], (
        f"the wrapper's named_parameters() are {first['parameters']}, expected exactly the "
        f"model's under .module ({first['expected_parameters']}): the wrapper registers no "
        "parameter of its own (an optimizer built on ddp.parameters() would train it)"
    )
    assert first["buffers_seen"] == first["expected_buffers"], (
        f"the wrapper's named_buffers() are {first['buffers_seen']}, expected exactly the "
        f"model's under .module ({first['expected_buffers']}): the wrapper registers no buffer "
        "of its own"
    )
    assert first["keys"] == first["expected_keys"], (
        f"the wrapper's state_dict() holds {first['keys']}, expected exactly the model's under "
        f"'module.' ({first['expected_keys']}): keep the wrapper's own state in plain attributes"
    )
    assert first["forward_equal"], (
        "ddp(inputs) differs from model(inputs): forward delegates to the wrapped model"
    )
    wrappers.check_forward_keywords(first["keyword"], first["forward_keywords"])


@pytest.mark.step(1)
@pytest.mark.parametrize("model_name", MODEL_NAMES)
def test_construction_gives_every_rank_the_first_ranks_state(kata, model_name):
    _check_construction(run_world(_construct, 3, model_name), model_name)


def _construct_in_subgroups(rank, world_size):
    kata = load_kata(KATA)
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes every group
    model = make_model("frozen", seed=100 + rank)
    before = _state(model)
    failure = None
    with recording(("broadcast", "all_reduce")) as calls:
        try:
            _without_hooks(kata)(model, groups[rank // 2])
        except KataTodo:
            raise
        except Exception as error:
            failure = _error(error)
    return before, _state(model), [(c.name, dict(c.peers)) for c in calls], failure


@pytest.mark.step(1)
def test_construction_inside_subgroups_copies_the_groups_first_rank(kata):
    results = run_world(_construct_in_subgroups, 4)
    for rank, (_, after, calls, failure) in enumerate(results):
        first = rank // 2 * 2
        sources = sorted(set(map(str, _sources(calls))))
        if failure:
            hint = (
                f" Its broadcasts named src={sources}: src is a global rank, and global rank 0 is "
                f"not in the group of ranks {first} and {first + 1}. The source is the group's "
                f"first rank, dist.get_global_rank(process_group, 0) (here {first})."
                if "0" in sources and first != 0
                else ""
            )
            raise AssertionError(
                f"rank {rank}, wrapping its model with the group of ranks {first} and {first + 1}, "
                f"failed: {failure}.{hint}"
            )
        expected = results[first][0]
        if not _equal(after, expected):
            raise AssertionError(
                f"rank {rank}, in the group of ranks {first} and {first + 1}, does not hold rank "
                f"{first}'s state after construction (its broadcasts named src={sources}): "
                f"broadcast from the group's first rank, dist.get_global_rank(process_group, 0), "
                "with group=process_group"
            )


def _bad_arguments(rank, world_size):
    kata = load_kata(KATA)
    only_rank_0 = dist.new_group([0])
    model = make_model("frozen", seed=100)
    wrapper = _without_hooks(kata)
    found = {"parameters": _refusal(lambda: wrapper(list(model.parameters())))}
    if rank == 0:
        wrapper(model, only_rank_0)  # a group of one is fine
    else:
        found["outsider"] = _refusal(lambda: wrapper(model, only_rank_0))
    return found


def _refusal(call) -> str | None:
    """None when ``call()`` raised ValueError; else what it did (a todo goes straight through)."""
    try:
        value = call()
    except ValueError:
        return None
    except KataTodo:
        raise
    except Exception as error:
        return f"raised {_error(error)}"
    return f"returned a {type(value).__name__}"


@pytest.mark.step(1)
def test_construction_refuses_bad_arguments(kata):
    results = run_world(_bad_arguments, 2)
    got = results[0]["parameters"]
    assert got is None, (
        f"OverlappingDDP(list(model.parameters())) {got}: it wraps a module; raise ValueError "
        "saying so when it is given anything else"
    )
    got = results[1]["outsider"]
    assert got is None, (
        f"rank 1 wrapped its model with a process group that holds rank 0 only, and "
        f"OverlappingDDP {got}. Collectives on a group a rank is not in do nothing (a warning at "
        "most), so this rank would train alone without a word: raise ValueError "
        "(dist.get_rank(process_group) is -1 outside the group)"
    )


# --------------------------------------------------------------------------- step 2: the hooks


def _backward_once(rank, world_size, model_name):
    kata = load_kata(KATA)
    model = make_model(model_name, seed=100).to(_device())
    batch = _shard(model_name, rank, world_size, step=0)
    ready = []
    for name, param in model.named_parameters():
        if param.requires_grad:  # registered first: they fire just before the wrapper's own
            param.register_post_accumulate_grad_hook(
                lambda _, name=name: ready.append((name, time.perf_counter()))
            )
    try:
        ddp = kata.OverlappingDDP(model)
    except KataTodo:
        raise
    except Exception as error:
        return {"failure": _error(error)}
    initial = _state(model)
    loss = toy_loss(ddp, batch)
    with recording() as calls:
        began = time.perf_counter()
        loss.backward()
        ended = time.perf_counter()
    # Compare the launches through the store first: where the ranks launched different
    # all-reduces, the barrier below would hang behind them, and the report would point here.
    launched = sum(1 for c in calls if c.name == "all_reduce")
    store = dist.distributed_c10d._get_default_store()
    store.set(f"k12-launched/{rank}", str(launched))
    counts = [int(store.get(f"k12-launched/{r}")) for r in range(world_size)]
    if len(set(counts)) > 1:
        return {"failure": None, "uneven": counts}
    dist.barrier()  # gloo's barrier returns once every operation launched before it has finished
    return {
        "uneven": None,
        "failure": None,
        "calls": [
            {"name": c.name, "op": c.op, "async": c.async_op, "shapes": c.shapes, "start": c.start}
            for c in calls
        ],
        "ready": ready,
        "began": began,
        "ended": ended,
        "grads": _grads(model),
        "local": _local_gradients(model_name, 100, batch),
        "weights_changed": sorted(
            n for n, t in _state(model).items() if not torch.equal(t, initial[n])
        ),
        "trainable": {n: tuple(p.shape) for n, p in model.named_parameters() if p.requires_grad},
    }


@shared_run
def _backward(model_name: str):
    """One backward on 2 ranks, shared by the step-2 tests (a failure too: a deadlock costs its
    deadline once)."""
    results = run_world(_backward_once, 2, model_name)
    uneven = results[0].get("uneven")
    if uneven:
        launches = ", ".join(f"rank {r} launched {n}" for r, n in enumerate(uneven))
        raise AssertionError(
            f"in one backward the ranks launched different numbers of all-reduces ({launches}): "
            "every rank must launch the same all-reduces in the same order (a collective "
            "completes only when every rank calls it), so no `if rank == ...` around the launch "
            "or the hook"
        )
    return results


def _reduces(result) -> list:
    if result["failure"]:
        detail = (
            ": frozen parameters (requires_grad=False) never get a gradient, so they get no hook. "
            "Register one only on each trainable parameter."
            if "require" in result["failure"] and "grad" in result["failure"]
            else ""
        )
        raise AssertionError(f"OverlappingDDP(model) raised {result['failure']}{detail}")
    return [c for c in result["calls"] if c["name"] == "all_reduce"]


def _nothing_launched(rank: int, result) -> str:
    return (
        f"rank {rank}'s backward launched no all-reduce (the model has {len(result['trainable'])} "
        "unique trainable parameters): register a hook on each trainable parameter "
        "(param.register_post_accumulate_grad_hook) that launches the all-reduce of param.grad the "
        "moment it is ready. Launching them later, in finish_gradient_synchronization, is k04's "
        "average after backward: no all-reduce while backward runs, nothing overlaps."
    )


@pytest.mark.step(2)
@pytest.mark.parametrize("model_name", MODEL_NAMES)
def test_backward_launches_one_async_sum_all_reduce_per_unique_trainable_parameter(
    kata, model_name
):
    results = _backward(model_name)
    for rank, result in enumerate(results):
        reduces = _reduces(result)
        trainable = result["trainable"]
        if not reduces:
            raise AssertionError(_nothing_launched(rank, result))
        if len(reduces) != len(trainable):
            tied = (
                " The tied weight (embedding.weight, also the output layer's weight) is one "
                "parameter: one hook, one all-reduce. module.parameters() lists it once; "
                "named_parameters(remove_duplicate=False) or a hook per layer lists it twice."
                if model_name == "tied" and len(reduces) > len(trainable)
                else ""
            )
            raise AssertionError(
                f"rank {rank}'s backward launched {len(reduces)} all-reduces, expected "
                f"{len(trainable)}: one per unique trainable parameter ({', '.join(trainable)})."
                + tied
            )
        blocking = [c for c in reduces if not c["async"]]
        if blocking:
            raise AssertionError(
                f"rank {rank} launched {len(blocking)} of its all-reduces blocking (without "
                "async_op=True): backward then waits for each one to finish before it computes the "
                "next gradient, so nothing overlaps. Launch with async_op=True, keep the handle, and "
                "wait for it in finish_gradient_synchronization."
            )
        ops = sorted({c["op"] or "SUM" for c in reduces})
        assert set(ops) <= {"SUM", "AVG"}, (
            f"rank {rank} launched all-reduces with op {ops}: the mean over the ranks is a SUM "
            "all-reduce divided by the group's size (before the launch, as torch's DDP does, or in "
            "finish_gradient_synchronization after the wait), or dist.ReduceOp.AVG"
        )
        shapes = sorted(tuple(c["shapes"][0]) for c in reduces if c["shapes"])
        assert shapes == sorted(trainable.values()), (
            f"rank {rank} all-reduced tensors of shapes {shapes}, expected the gradients of the "
            f"trainable parameters, {sorted(trainable.values())}"
        )
        assert not result["weights_changed"], (
            f"rank {rank}'s backward changed the weights {result['weights_changed']}: all-reduce "
            "the parameter's gradient (param.grad), not the parameter itself"
        )
    for rank, result in enumerate(results):
        for name in result["trainable"]:
            got = result["grads"][name]
            summed = results[0]["local"][name] + results[1]["local"][name]  # a + b: the same bits
            if torch.equal(got, summed) or torch.allclose(got, summed / 2, **TOLERANCE):
                continue  # the sum (divided in finish), or the mean already (divided first, AVG)
            if torch.equal(got, result["local"][name]):
                continue  # an all-reduce of a copy, copied back in finish: step 3 checks that
            raise AssertionError(
                f"once its all-reduces had finished, rank {rank}'s gradient of {name!r} was neither "
                "the sum of the 2 ranks' gradients nor their mean: launch one all-reduce of each "
                "param.grad (a SUM, divided by the group's size before the launch or after the "
                "wait in finish_gradient_synchronization)"
            )


@pytest.mark.step(2)
@pytest.mark.parametrize("model_name", MODEL_NAMES)
def test_the_first_all_reduce_starts_before_backward_has_finished(kata, model_name):
    for rank, result in enumerate(_backward(model_name)):
        reduces = _reduces(result)
        if not reduces:
            raise AssertionError(_nothing_launched(rank, result))
        first = min(c["start"] for c in reduces)
        last_ready = max(moment for _, moment in result["ready"])
        events = sorted(
            [(moment, f"gradient of {name} ready") for name, moment in result["ready"]]
            + [(c["start"], f"all-reduce of {tuple(c['shapes'][0])} launched") for c in reduces]
            + [(result["ended"], "loss.backward() returned")]
        )
        shown = "\n".join(
            f"  {1000 * (moment - result['began']):8.3f} ms  {what}" for moment, what in events
        )
        late = [c for c in reduces if c["start"] > result["ended"]]
        if late or first >= last_ready:
            raise AssertionError(
                f"rank {rank}'s first all-reduce started only after the last gradient was ready, so "
                "none of the communication overlapped with backward. Launch each one in its "
                "parameter's hook, the moment that gradient is ready, not all together at the end. "
                f"What happened, in order:\n{shown}"
            )


# --------------------------------------------------------------------------- step 3: the finish


def _finish(ddp) -> None:
    wrappers.finish(
        ddp,
        "dist.all_reduce returns a handle only with async_op=True (a blocking call returns None): "
        "launch with async_op=True in the hook and keep what it returns",
    )


def _one_step(rank, world_size, model_name):
    """One backward and finish on 2 ranks, every rank its own data: the gradients it leaves."""
    kata = load_kata(KATA)
    model = make_model(model_name, seed=100).to(_device())
    ddp = kata.OverlappingDDP(model)
    batch = _shard(model_name, rank, world_size, step=0)
    toy_loss(ddp, batch).backward()
    _finish(ddp)
    return {"grads": _grads(model), "local": _local_gradients(model_name, 100, batch)}


def _diagnose_mean(rank: int, name: str, got, local: list, size: int) -> str | None:
    """None when ``got`` is the mean of ``local`` (the ranks' own gradients); else what it is."""
    mean = sum(local[1:], local[0]) / size
    if got is None:
        return (
            f"rank {rank}'s gradient of {name!r} is None after finish_gradient_synchronization(): "
            "leave the mean in each parameter's .grad"
        )
    if torch.allclose(got, mean, **TOLERANCE):
        return None
    own = local[rank]
    if torch.equal(got, own) or torch.allclose(got, own / size, **TOLERANCE):
        divided = "" if torch.equal(got, own) else f" (divided by {size})"
        return (
            f"rank {rank}'s gradient of {name!r} still holds this rank's own gradient{divided} "
            "after finish_gradient_synchronization(): the all-reduce's result never reached .grad "
            "(did it sum a copy, param.grad.clone()?). All-reduce param.grad itself, or copy the "
            "reduced tensor back into .grad before the step"
        )
    if torch.allclose(got, mean * size, **TOLERANCE):
        return (
            f"rank {rank}'s gradient of {name!r} holds the sum of the {size} ranks' gradients, "
            f"not their mean: divide by the group's size (dist.get_world_size(self.process_group)), "
            "once, before the launch or after the wait"
        )
    if torch.allclose(got, mean / size, **TOLERANCE):
        return (
            f"rank {rank}'s gradient of {name!r} holds the mean divided by {size} once more: it "
            "was divided twice (before the launch and again after the wait, or an AVG all-reduce "
            "divided again). Divide once"
        )
    return (
        f"rank {rank}'s gradient of {name!r} is {_gap({'g': got}, {'g': mean})[0]:.3g} away from "
        f"the mean over the {size} ranks (neither its own gradient, the sum nor a mean divided "
        "twice)"
    )


@pytest.mark.step(3)
@pytest.mark.parametrize("model_name", MODEL_NAMES)
def test_finish_leaves_the_mean_gradient_on_every_rank(kata, model_name):
    results = run_world(_one_step, 2, model_name)
    for rank, result in enumerate(results):
        for name in UNIQUE_NAMES[model_name]:
            local = [r["local"][name] for r in results]
            wrong = _diagnose_mean(rank, name, result["grads"][name], local, len(results))
            if wrong:
                raise AssertionError(wrong)


def _train(rank, world_size, model_name):
    """STEPS steps with the learner's wrapper, with k04's average after backward (the same sums
    in the same order) and with torch's DDP, every model built apart on every rank."""
    from torch.nn.parallel import DistributedDataParallel

    kata = load_kata(KATA)
    device = _device()
    model = make_model(model_name, seed=100 + rank).to(device)
    ddp = kata.OverlappingDDP(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=LR)
    launched = []
    for step in range(STEPS):
        batch = _shard(model_name, rank, world_size, step)
        with recording(("all_reduce",)) as calls:
            toy_loss(ddp, batch).backward()
            _finish(ddp)
        launched.append(len(calls))
        optimizer.step()
        optimizer.zero_grad()
    by_hand = make_model(model_name, seed=100).to(device)
    optimizer = torch.optim.SGD(by_hand.parameters(), lr=LR)
    for step in range(STEPS):
        toy_loss(by_hand, _shard(model_name, rank, world_size, step)).backward()
        for param in by_hand.parameters():
            if param.grad is not None:
                dist.all_reduce(param.grad, op=dist.ReduceOp.SUM)
                param.grad.div_(world_size)
        optimizer.step()
        optimizer.zero_grad()
    theirs = DistributedDataParallel(make_model(model_name, seed=100 + rank).to(device))
    optimizer = torch.optim.SGD(theirs.parameters(), lr=LR)
    for step in range(STEPS):
        toy_loss(theirs, _shard(model_name, rank, world_size, step)).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {
        "mine": _state(model),
        "by_hand": _state(by_hand),
        "ddp": _state(theirs.module),
        "launched": launched,
        "device": str(next(model.parameters()).device.type),
        "buffers": [name for name, _ in model.named_buffers()],
    }


def _check_training(results, model_name: str) -> None:
    world_size = len(results)
    expected_launches = UNIQUE_TRAINABLE[model_name]
    for rank, result in enumerate(results):
        assert result["launched"] == [expected_launches] * STEPS, (
            f"rank {rank} launched {result['launched']} all-reduces in its {STEPS} steps, expected "
            f"{expected_launches} in every step, one per unique trainable parameter: each step's "
            "backward launches them again, with nothing to call at the start of a step"
        )
    mine = results[0]["mine"]
    for rank, result in enumerate(results[1:], start=1):
        if not _equal(result["mine"], mine):
            buffers = [n for n in result["buffers"] if not torch.equal(result["mine"][n], mine[n])]
            if buffers:
                raise AssertionError(
                    f"after {STEPS} steps rank {rank}'s buffer {buffers[0]!r} differs from rank "
                    "0's: no gradient ever touches a buffer, so it differs since construction. "
                    "Broadcast every buffer too (module.buffers()) from the group's first rank, "
                    "in place"
                )
            gap, name = _gap(result["mine"], mine)
            raise AssertionError(
                f"after {STEPS} steps rank {rank}'s weights differ from rank 0's (by {gap:.3g} in "
                f"{name!r}), though its buffers are rank 0's: every rank must step with the same "
                "averaged gradient"
            )
    truth = _one_process(model_name, world_size)
    if not _equal(mine, results[0]["by_hand"]):
        gap, name = _gap(mine, results[0]["by_hand"])
        if _close(mine, _one_process(model_name, world_size, grad_scale=world_size)):
            raise AssertionError(
                f"after {STEPS} steps the weights match a process whose gradients are {world_size} "
                f"times too large: the sum over the {world_size} ranks, not their mean. "
                "finish_gradient_synchronization divides each gradient by the group's size "
                "(dist.get_world_size(self.process_group)) once its all-reduce has finished."
            )
        if _close(mine, truth):
            raise AssertionError(
                f"after {STEPS} steps the weights equal one process on the whole batch up to rounding "
                f"({gap:.3g} in {name!r}), but not bitwise those of averaging after backward (k04). "
                "This kata holds a 2-rank mean to the bits: a SUM all-reduce divided by 2 after the "
                "wait, halves summed (divided before the launch) and AVG all give exactly "
                "(a + b) / 2, since halving is exact in floating point; other operations (partial "
                "sums added later, a scale that is not exactly 1 / 2) round differently."
            )
        raise AssertionError(
            f"after {STEPS} steps rank 0's weights are {gap:.3g} apart (in {name!r}) from those of "
            "averaging every gradient after backward (k04) on the same ranks: every trainable "
            ".grad must hold the mean over the ranks when finish_gradient_synchronization returns"
        )
    assert _close(mine, truth), (
        f"the weights are {_gap(mine, truth)[0]:.3g} apart from one process on the whole batch"
    )
    assert _close(mine, results[0]["ddp"]), (
        f"the weights are {_gap(mine, results[0]['ddp'])[0]:.3g} apart from torch's DDP's"
    )


@pytest.mark.step(3)
@pytest.mark.parametrize("model_name", MODEL_NAMES)
def test_training_equals_one_process_on_the_whole_batch(kata, model_name):
    _check_training(run_world(_train, 2, model_name, deadline=40), model_name)


def _finish_in_subgroups(rank, world_size):
    kata = load_kata(KATA)
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group = groups[rank // 2]
    seed = 100 + rank // 2
    model = make_model("frozen", seed=seed)
    ddp = kata.OverlappingDDP(model, group)
    batch = make_batch("frozen", PER_RANK, seed=rank)  # every rank its own data
    with recording(("all_reduce",)) as calls:
        toy_loss(ddp, batch).backward()
        ddp.finish_gradient_synchronization()
    return {
        "grads": _grads(model),
        "local": _local_gradients("frozen", seed, batch),
        "without_group": sum(1 for c in calls if c.group is None),
    }


@pytest.mark.step(3)
def test_finish_averages_over_the_process_group(kata):
    results = run_world(_finish_in_subgroups, 4)
    for rank, result in enumerate(results):
        pair = [rank // 2 * 2, rank // 2 * 2 + 1]
        names = [n for n, g in result["grads"].items() if g is not None]
        local = [results[r]["local"] for r in pair]
        if result["without_group"]:
            raise AssertionError(
                f"rank {rank} launched {result['without_group']} all-reduces without group=: they "
                f"summed over the whole world of 4 ranks, not over its process group (ranks "
                f"{pair[0]} and {pair[1]}). Pass group=self.process_group to every collective."
            )
        for name in names:
            got = result["grads"][name]
            mean = (local[0][name] + local[1][name]) / 2  # the same two operations: the same bits
            if torch.equal(got, mean):
                continue
            if torch.allclose(got, mean / 2, **TOLERANCE):
                raise AssertionError(
                    f"rank {rank}'s gradient of {name!r} was divided by 4, the size of the whole "
                    "world (the WORLD_SIZE variable, or dist.get_world_size() without a group), not "
                    f"by 2, the size of its process group (ranks {pair[0]} and {pair[1]}): divide "
                    "by dist.get_world_size(self.process_group)"
                )
            raise AssertionError(
                f"rank {rank}'s gradient of {name!r} is not the mean over its process group (ranks "
                f"{pair[0]} and {pair[1]})"
            )


def _finish_counted(ddp) -> tuple[str | None, int]:
    """``ddp.finish_gradient_synchronization()``: what it raised (None: nothing), and how many
    all-reduces it launched."""
    with recording(("all_reduce",)) as calls:
        try:
            ddp.finish_gradient_synchronization()
        except KataTodo:
            raise
        except Exception as error:
            return _error(error), len(calls)
    return None, len(calls)


def _finish_twice(rank, world_size):
    kata = load_kata(KATA)
    model = make_model("tied", seed=100)
    ddp = kata.OverlappingDDP(model)
    found = {}
    found["early"], found["early_calls"] = _finish_counted(ddp)
    found["early_grads"] = sorted(n for n, g in _grads(model).items() if g is not None)
    toy_loss(ddp, _shard("tied", rank, world_size, step=0)).backward()
    ddp.finish_gradient_synchronization()
    found["first"] = _grads(model)
    found["second_error"], found["second_calls"] = _finish_counted(ddp)
    found["second"] = _grads(model)
    return found


@pytest.mark.step(3)
def test_finish_is_harmless_with_nothing_launched_and_a_second_time(kata):
    for rank, found in enumerate(run_world(_finish_twice, 2)):
        assert found["early"] is None, (
            f"rank {rank}: finish_gradient_synchronization() before any backward raised "
            f"{found['early']}: with nothing launched it must do nothing (wait for and divide only "
            "what the hooks launched)"
        )
        assert not found["early_calls"] and not found["early_grads"], (
            f"rank {rank}: finish_gradient_synchronization() before any backward launched "
            f"{found['early_calls']} all-reduces or made gradients {found['early_grads']}: with "
            "nothing launched it must do nothing"
        )
        assert found["second_error"] is None, (
            f"rank {rank}: a second finish_gradient_synchronization() raised "
            f"{found['second_error']}: once the handles are waited for, forget them"
        )
        assert not found["second_calls"], (
            f"rank {rank}: a second finish_gradient_synchronization() launched "
            f"{found['second_calls']} all-reduces: it only waits for what the hooks launched"
        )
        for name, first in found["first"].items():
            second = found["second"][name]
            if first is None or torch.equal(second, first):
                continue
            ratio = (second.double().norm() / first.double().norm()).item()
            raise AssertionError(
                f"rank {rank}: a second finish_gradient_synchronization() changed the gradient of "
                f"{name!r} (to {ratio:.3g} times what the first call left: divided again?). Clear "
                "the handles once they are waited for and divided, so that a second call finds "
                "nothing to do"
            )


# --------------------------------------------------------------------------- step 4: no_sync


MICRO_BATCHES = 3


def _accumulate(rank, world_size, model_name):
    """STEPS steps of MICRO_BATCHES micro-batches each, the first ones inside no_sync(), with the
    learner's wrapper and with torch's DDP and its own no_sync()."""
    from torch.nn.parallel import DistributedDataParallel

    kata = load_kata(KATA)
    device = _device()
    micro = PER_RANK // 2
    per_rank = micro * MICRO_BATCHES

    def train(wrapped, finish) -> dict:
        optimizer = torch.optim.SGD(wrapped.parameters(), lr=LR)
        found = {"inside": [], "outside": [], "first_inside": None}
        for step in range(STEPS):
            inputs, targets = _shard(model_name, rank, world_size, step, per_rank)
            parts = [
                (inputs[i : i + micro], targets[i : i + micro]) for i in range(0, per_rank, micro)
            ]
            for part in parts[:-1]:
                with recording(("all_reduce",)) as calls, wrapped.no_sync():
                    (toy_loss(wrapped, part) / MICRO_BATCHES).backward()
                    finish()  # nothing was launched: harmless
                found["inside"].append(len(calls))
            if step == 0:
                found["first_inside"] = _grads(wrapped.module)
            with recording(("all_reduce",)) as calls:
                (toy_loss(wrapped, parts[-1]) / MICRO_BATCHES).backward()
                finish()
            found["outside"].append(len(calls))
            optimizer.step()
            optimizer.zero_grad()
        found["state"] = _state(wrapped.module)
        return found

    ddp = kata.OverlappingDDP(make_model(model_name, seed=100 + rank).to(device))
    mine = train(ddp, ddp.finish_gradient_synchronization)
    theirs = DistributedDataParallel(make_model(model_name, seed=100 + rank).to(device))
    reference = train(theirs, lambda: None)
    local = make_model(model_name, seed=100).to(device)  # the first step's no_sync part, alone
    inputs, targets = _shard(model_name, rank, world_size, 0, per_rank)
    for i in range(0, per_rank - micro, micro):
        (
            toy_loss(local, (inputs[i : i + micro], targets[i : i + micro])) / MICRO_BATCHES
        ).backward()
    return mine, reference, _grads(local)


@pytest.mark.step(4)
@pytest.mark.parametrize("model_name", ["frozen", "tied"])
def test_no_sync_accumulates_locally_and_matches_torchs_ddp(kata, model_name):
    results = run_world(_accumulate, 2, model_name, deadline=40)
    expected = UNIQUE_TRAINABLE[model_name]
    for rank, (mine, _, local) in enumerate(results):
        launched = sum(mine["inside"])
        assert not launched, (
            f"rank {rank} launched {launched} all-reduces inside no_sync() (over {STEPS} steps of "
            f"{MICRO_BATCHES} micro-batches): inside it the hooks launch nothing, and backward only "
            "accumulates into .grad"
        )
        for name, grad in mine["first_inside"].items():
            if grad is None or torch.equal(grad, local[name]):
                continue
            raise AssertionError(
                f"rank {rank}'s gradient of {name!r}, after {MICRO_BATCHES - 1} micro-batches "
                "inside no_sync() and a call of finish_gradient_synchronization(), is not its own "
                "accumulated gradient: with nothing launched, finish_gradient_synchronization has "
                "nothing to wait for and nothing to divide"
            )
        assert mine["outside"] == [expected] * STEPS, (
            f"rank {rank}'s backward of the last micro-batch, after no_sync(), launched "
            f"{mine['outside']} all-reduces in its {STEPS} steps, expected {expected} each: when "
            "the block ends the hooks launch again (restore what was there before it)"
        )
    mine = results[0][0]["state"]
    for rank, (other, _, _) in enumerate(results[1:], start=1):
        assert _equal(other["state"], mine), (
            f"after accumulating, rank {rank}'s weights differ from rank 0's"
        )
    theirs = results[0][1]["state"]
    assert _close(mine, theirs), (
        f"after {STEPS} steps of {MICRO_BATCHES} micro-batches the weights are "
        f"{_gap(mine, theirs)[0]:.3g} apart from torch's DDP with its own no_sync(), on the same "
        "ranks with the same data"
    )


class _Interrupted(Exception):
    pass


def _no_sync_after_an_error(rank, world_size):
    kata = load_kata(KATA)
    ddp = kata.OverlappingDDP(make_model("frozen", seed=100))
    try:
        with ddp.no_sync():
            raise _Interrupted("a micro-batch failed")
    except _Interrupted:
        pass
    with recording(("all_reduce",)) as calls:
        toy_loss(ddp, _shard("frozen", rank, world_size, step=0)).backward()
        ddp.finish_gradient_synchronization()
    return len(calls)


@pytest.mark.step(4)
def test_no_sync_switches_the_hooks_back_on_even_after_an_error(kata):
    for rank, launched in enumerate(run_world(_no_sync_after_an_error, 2)):
        assert launched == UNIQUE_TRAINABLE["frozen"], (
            f"rank {rank}: after an exception inside no_sync(), the next backward launched "
            f"{launched} all-reduces, expected {UNIQUE_TRAINABLE['frozen']}: the hooks launch "
            "again once the block ends, however it ends: restore them in a finally (try: yield / "
            "finally: ...)"
        )


def _nested_no_sync(rank, world_size):
    kata = load_kata(KATA)
    ddp = kata.OverlappingDDP(make_model("frozen", seed=100))
    batch = _shard("frozen", rank, world_size, step=0)
    with recording(("all_reduce",)) as calls:
        with ddp.no_sync():
            with ddp.no_sync():  # a helper that accumulates, called inside an accumulation loop
                pass
            toy_loss(ddp, batch).backward()  # still inside the outer no_sync
        inside = len(calls)
        ddp.finish_gradient_synchronization()
        toy_loss(ddp, batch).backward()  # outside both: syncs
        ddp.finish_gradient_synchronization()
    return inside, len(calls) - inside


@pytest.mark.step(4)
def test_nested_no_sync_restores_what_it_found(kata):
    for rank, (inside, after) in enumerate(run_world(_nested_no_sync, 2)):
        assert not inside, (
            f"rank {rank}: after a nested `with ddp.no_sync():` ended inside another one, backward "
            f"launched {inside} all-reduces though the outer no_sync() was still open: when the "
            "block ends, no_sync restores the value it found (still off inside the outer block), "
            "not True"
        )
        assert after == UNIQUE_TRAINABLE["frozen"], (
            f"rank {rank}: once both no_sync() blocks had ended, a backward launched {after} "
            f"all-reduces, expected {UNIQUE_TRAINABLE['frozen']}: the hooks launch again"
        )


@pytest.mark.step(4)
def test_program_shows_the_overlap_and_matches_one_process(kata):
    done = run_module_ok(
        KATA, "--world-size", "2", "--model", "tied", "--steps", "2", "--backend", "gloo",
        "--device", "cpu",
    )  # fmt: skip
    shown = streams(done)
    lines = done.stdout.splitlines()
    order = [m.group(1) for m in map(re.compile(r"^\[rank 0\]\s+[\d.]+\s+(.*)$").match, lines) if m]
    assert "backward ends" in order and any("launched" in what for what in order), (
        f"rank 0 must show the step's events in order\n{shown}"
    )
    first_launch = next(i for i, what in enumerate(order) if "launched" in what)
    assert first_launch < order.index("backward ends"), (
        f"the program's timeline shows no all-reduce launched before backward ended\n{shown}"
    )
    assert "[main] 3 all-reduces per step, one per unique trainable parameter (3)" in lines, shown
    assert "[main] every rank holds the same weights: True" in lines, shown
    gap = re.search(r"one process on the whole batch after 2 steps: (\S+)", done.stdout)
    assert gap and float(gap.group(1)) < 1e-5, shown


# --------------------------------------------------------------------------- CUDA


def _check_cuda_training(results) -> None:
    for rank, result in enumerate(results):
        assert result["device"] == "cuda", f"rank {rank} trained on {result['device']}"
        assert _close(result["mine"], result["ddp"]), (
            f"rank {rank}'s weights are {_gap(result['mine'], result['ddp'])[0]:.3g} apart from "
            "torch's DDP on the same GPUs"
        )
    truth = _one_process("tied", len(results))
    assert _close(results[0]["mine"], truth), (  # GPU kernels round differently from the CPU's
        f"the weights are {_gap(results[0]['mine'], truth)[0]:.3g} apart from one CPU process"
    )


@pytest.mark.step(3)
@pytest.mark.cuda
def test_nccl_world_of_one(kata):
    results = run_world(_train, 1, "tied", **on_cuda(1, "nccl", deadline=90))
    _check_cuda_training(results)


@pytest.mark.step(3)
@pytest.mark.cuda
def test_gloo_on_cuda_several_ranks(kata):
    results = run_world(_train, 2, "tied", **on_cuda(2, "gloo", deadline=90))
    _check_cuda_training(results)
