"""k14 against torch's DDP: torch_ddp, the shared loop, the side-by-side run, SyncBatchNorm."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dojo.harness.calls import recording
from dojo.harness.impl import load_kata
from dojo.harness.world import WorldDeadlock, run_world
from dojo.models import ConvNet
from dojo.spec.cuda import on_cuda, rank_gpu
from dojo.spec.testing import refusal, run_module_ok
from dojo.todo import KataTodo
from dojo.toy_models import loss, make_model

KATA = "k14_against_ddp"
MIB = 1 << 20
SEED = 7
LR, MOMENTUM = 0.1, 0.9
TINY, SPLIT = 1e-6, 280 / MIB  # below every toy tensor; 280 bytes

# Exactness. On 2 ranks each averaged gradient element is (a + b) / 2 in both wrappers: fp32
# addition of two numbers is commutative and halving is exact, so BucketedDDP and torch's DDP
# must agree bitwise. On 3 ranks the three terms may be added in another order (other buckets;
# torch scales by 1/N before summing), and one process on the whole batch sums its loss's terms
# in yet another order: those comparisons allow a few ulps.
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


def _device():
    from dojo.devices import rank_device

    return rank_device()


def _state(model: nn.Module) -> dict:
    return {name: t.detach().cpu().clone() for name, t in model.state_dict().items()}


def _difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def _largest(a: dict, b: dict) -> tuple[float, str]:
    return max((_difference(a[k], b[k]), k) for k in b)


def _close(a: dict, b: dict, **tolerance) -> bool:
    return all(torch.allclose(a[k], b[k], **(tolerance or TOLERANCE)) for k in b)


def _equal(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in b)


def _cap_text(cap) -> str:
    return "None" if cap is None else f"{cap:g} MiB"


def _group(group_ranks):
    import torch.distributed as dist

    return dist.new_group(group_ranks) if group_ranks else None


def _failure(error: BaseException) -> str:
    return f"{type(error).__name__}: {str(error).strip().splitlines()[0][:300]}"


# --------------------------------------------------------------------------- step 1: torch_ddp


class Big(nn.Module):
    """More than torch's default 25 MiB of parameters: the default cap would split it."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(2600, 2600))

    def forward(self, x):
        return x @ self.weight


def _wrap(rank, world_size, cases, group_ranks=None):
    from torch.nn.parallel import DistributedDataParallel

    kata = load_kata(KATA)
    group = _group(group_ranks)
    if group_ranks and rank not in group_ranks:
        return None
    out = []
    for name, cap in cases:
        model = Big().to(_device()) if name == "big" else make_model(name, 100 + rank)
        model = model.to(_device())
        try:
            ddp = kata.torch_ddp(model, cap, group)
        except KataTodo:
            raise
        except Exception as error:
            out.append({"failure": _failure(error)})
            continue
        is_ddp = isinstance(ddp, DistributedDataParallel)
        out.append(
            {
                "failure": None,
                "type": type(ddp).__name__,
                "is_ddp": is_ddp,
                "module_is_model": getattr(ddp, "module", None) is model,
                "cap": getattr(ddp, "bucket_bytes_cap", None),
                "total": sum(p.numel() * p.element_size() for p in model.parameters()),
                "device_ids": getattr(ddp, "device_ids", None),
                "group": (ddp.process_group is group) if is_ddp and group is not None else None,
                "state": None if name == "big" else _state(model),
            }
        )
    return out


def check_wrapped(cases, got: dict, rank: int, cuda: bool = False) -> None:
    for (name, cap), result in zip(cases, got):
        call = f"torch_ddp({name} model, bucket_cap_mb={_cap_text(cap)})"
        if result["failure"]:
            if "device_ids" in result["failure"]:
                raise AssertionError(
                    f"rank {rank}: {call} raised {result['failure']}: device_ids names the GPU of "
                    "a CUDA module ([device.index]); for a module on the CPU pass device_ids=None"
                )
            raise AssertionError(f"rank {rank}: {call} raised {result['failure']}")
        assert result["is_ddp"], (
            f"rank {rank}: {call} returned a {result['type']}: return torch's "
            "torch.nn.parallel.DistributedDataParallel around the module"
        )
        assert result["module_is_model"], f"rank {rank}: {call}: .module must be the module itself"
        if cap is None:
            assert result["cap"] >= result["total"], (
                f"rank {rank}: {call} gave torch's DDP a cap of {result['cap']} bytes for a model "
                f"of {result['total']}: None means one bucket for everything, as in BucketedDDP, "
                "but torch's DDP reads bucket_cap_mb=None as its default, 25 MiB. Give it a cap "
                "larger than the whole model (its bytes / 2**20, plus a little)"
            )
        else:
            assert result["cap"] == int(cap * MIB), (
                f"rank {rank}: {call} made a DDP whose bucket_bytes_cap is {result['cap']} bytes, "
                f"expected {int(cap * MIB)}: pass bucket_cap_mb on to DistributedDataParallel "
                "(the same MiB as BucketedDDP's)"
            )
        if cuda:
            index = _device().index
            assert result["device_ids"] == [index], (
                f"rank {rank}: {call} on cuda:{index} made a DDP with device_ids "
                f"{result['device_ids']}: a CUDA module's DDP takes device_ids=[device.index]"
            )
        else:
            assert not result["device_ids"], (
                f"rank {rank}: {call} on the CPU made a DDP with device_ids "
                f"{result['device_ids']}: on the CPU pass device_ids=None"
            )


@pytest.mark.step(1)
def test_torch_ddp_wraps_the_module_as_asked(kata):
    cases = [("frozen", 25.0), ("tied", 0.5), ("buffer", TINY), ("big", None)]
    results = run_world(_wrap, 2, cases, deadline=40)
    for rank, got in enumerate(results):
        check_wrapped(cases, got, rank)
    for (name, _), first, second in zip(cases, results[0], results[1]):
        if first["state"] is not None:
            assert _equal(second["state"], first["state"]), (
                f"after torch_ddp({name} model) rank 1's parameters differ from rank 0's: torch's "
                "DDP copies rank 0's at construction, if it gets the module itself"
            )


@pytest.mark.step(1)
def test_torch_ddp_on_a_subgroup(kata):
    cases = [("buffer", 25.0)]
    try:
        results = run_world(_wrap, 3, cases, [1, 2], deadline=20)
    except WorldDeadlock as deadlock:
        raise AssertionError(
            "torch_ddp(model, process_group=<the group [1, 2]>) on a world of 3: ranks 1 and 2 "
            "waited in a collective that rank 0, outside their group, never calls: pass "
            "process_group=process_group on to DistributedDataParallel\n" + str(deadlock)
        ) from None
    for rank in (1, 2):
        check_wrapped(cases, results[rank], rank)
        assert results[rank][0]["group"], (
            f"rank {rank}: torch_ddp(..., process_group=group) made a DDP on another group: "
            "pass process_group on"
        )
    assert _equal(results[2][0]["state"], results[1][0]["state"]), (
        "on the group [1, 2] rank 2's parameters differ from rank 1's (the group's first rank)"
    )


# --------------------------------------------------------------------------- step 2: train


def _bucket_count(model, cap) -> int:
    """How many buckets k13's rule makes of ``model``'s trainable parameters (reverse order, a
    bucket closes before a tensor would push it over the cap in MiB; None: one bucket): counted
    here, never read from the wrapper, whose layout is the learner's own."""
    count, size = 0, 0
    for param in reversed([p for p in model.parameters() if p.requires_grad]):
        nbytes = param.numel() * param.element_size()
        if count and cap is not None and size + nbytes > cap * MIB:
            count, size = count + 1, 0
        elif not count:
            count = 1
        size += nbytes
    return count


def _train(rank, world_size, name, cap, steps, micro_batches):
    """Both wrappers through kata.train on the same data; ours' collectives recorded."""
    from torch.nn.parallel import DistributedDataParallel

    kata = load_kata(KATA)
    data = kata.rank_batches(name, steps, micro_batches, SEED, rank)
    out = {}
    for which in ("ours", "torch"):
        model = make_model(name, 100 + rank)
        if which == "ours":
            wrapper = kata.BucketedDDP(model, bucket_cap_mb=cap)
        else:
            wrapper = DistributedDataParallel(model, bucket_cap_mb=cap or 100.0)
        optimizer = torch.optim.SGD(wrapper.parameters(), lr=LR, momentum=MOMENTUM)
        with recording(("all_reduce",)) as calls:
            losses = kata.train(wrapper, optimizer, data)
        out[which] = {
            "state": _state(model),
            "losses": losses
            if not isinstance(losses, list) or all(isinstance(x, float) for x in losses)
            else [type(x).__name__ for x in losses],
            "loss_type": type(losses).__name__,
            "calls": len(calls),
            "buckets": _bucket_count(model, cap) if which == "ours" else None,
        }
    return out


def _whole(name, steps, micro_batches, shards, model_seed=100, **mistake):
    """One process on the whole batch (the first rank's model), or with a known mistake."""
    kata = load_kata(KATA)
    model = make_model(name, model_seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    data = [kata.rank_batches(name, steps, micro_batches, SEED, shard) for shard in shards]
    for step in range(steps):
        if not mistake.get("never_zeroed"):
            optimizer.zero_grad()
        first = micro_batches - 1 if mistake.get("last_only") else 0
        micro = range(first, micro_batches)
        parts = [data[s][step][m] for s in range(len(shards)) for m in micro]
        whole = (torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]))
        scale = micro_batches if mistake.get("undivided") else 1.0
        scale /= micro_batches if mistake.get("last_only") else 1.0
        (loss(model, whole) * scale).backward()
        optimizer.step()
    return _state(model)


def check_train(name, cap, micro_batches, results, steps):
    world_size = len(results)
    where = (
        f"train(..., {steps} steps of {micro_batches} micro-batch(es)) on {world_size} ranks, "
        f"{name} model"
    )
    whole = _whole(name, steps, micro_batches, range(world_size))
    for which, label in (("ours", "BucketedDDP"), ("torch", "torch's DDP")):
        first = results[0][which]
        assert first["loss_type"] == "list" and len(first["losses"]) == steps, (
            f"{where}: with {label} it returned a {first['loss_type']} "
            f"{first['losses']!r}: return a list with each step's loss"
        )
        assert all(isinstance(x, float) for x in first["losses"]), (
            f"{where}: with {label} it returned losses of types {first['losses']}: return each "
            "step's loss as a float (loss.item()), not a tensor that keeps its graph alive"
        )
    ours = results[0]["ours"]
    expected = ours["buckets"] * steps
    if micro_batches > 1 and ours["calls"] > expected:
        raise AssertionError(
            f"{where}: BucketedDDP made {ours['calls']} all-reduces where {expected} (one per "
            "bucket per step) do: the micro-batches synchronised, up to "
            f"{micro_batches} times the traffic, for (at best) the same result. Run all but the "
            "last micro-batch inside wrapper.no_sync()"
        )
    agree = {
        which: all(_equal(r[which]["state"], results[0][which]["state"]) for r in results)
        for which in ("ours", "torch")
    }
    if not agree["ours"] and not agree["torch"]:
        raise AssertionError(
            f"{where}: the ranks ended with different parameters under both wrappers: no "
            "gradient was ever averaged. Run the last micro-batch's backward outside no_sync() "
            "(it is the one that synchronises), all the others inside"
        )
    if not agree["ours"]:
        raise AssertionError(
            f"{where}: under torch's DDP the ranks agree, under BucketedDDP they do not: call "
            "wrapper.finish_gradient_synchronization() after the last backward and before "
            "optimizer.step() (torch's DDP finishes inside backward; yours needs the call)"
        )
    for which, label in (("ours", "BucketedDDP"), ("torch", "torch's DDP")):
        mine = results[0][which]["state"]
        if _close(mine, whole):
            continue
        known = [
            (
                {"undivided": True},
                f"the gradients are {micro_batches} times too large: divide each micro-batch's "
                f"loss by their number ({micro_batches}), so that the accumulated gradient is the "
                "mean's",
            ),
            (
                {"last_only": True},
                "only the last micro-batch's gradient was left: zero the gradients once per step, "
                "before the first micro-batch, not between micro-batches (accumulation is the point)",
            ),
            (
                {"never_zeroed": True},
                "each step kept the gradients of all the steps before it: zero them at the start "
                "of every step (optimizer.zero_grad())",
            ),
        ]
        for mistake, why in known:
            if _close(mine, _whole(name, steps, micro_batches, range(world_size), **mistake)):
                raise AssertionError(f"{where}: under {label} {why}")
        difference, key = _largest(mine, whole)
        raise AssertionError(
            f"{where}: under {label} rank 0's {key!r} differs by up to {difference:.3g} from one "
            f"process trained on the whole batch ({world_size} ranks x {micro_batches} "
            "micro-batches)"
        )
    ours = results[0]["ours"]
    expected = ours["buckets"] * steps
    assert ours["calls"] == expected, (
        f"{where}: BucketedDDP made {ours['calls']} all-reduces, expected {expected} (one per "
        "bucket per step)"
    )
    if world_size == 2:
        for rank, result in enumerate(results):
            assert _equal(result["ours"]["state"], result["torch"]["state"]), (
                f"{where}: rank {rank}'s BucketedDDP and torch's DDP differ by up to "
                f"{_largest(result['ours']['state'], result['torch']['state'])[0]:.3g}; on 2 "
                "ranks they must agree bitwise"
            )


@pytest.mark.step(2)
@pytest.mark.parametrize("micro_batches", [1, 2, 4])
def test_train_drives_both_wrappers_like_one_process(kata, micro_batches):
    results = run_world(_train, 2, "tied", SPLIT, 3, micro_batches)
    check_train("tied", SPLIT, micro_batches, results, 3)


@pytest.mark.step(2)
def test_train_refuses_a_step_without_micro_batches(kata):
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    did = refusal(lambda: kata.train(model, optimizer, [[]]))
    assert did is None, (
        f"train(wrapper, optimizer, [[]]) {did}: a step without micro-batches has no loss and no "
        "gradient, so it must raise ValueError saying so, before anything runs"
    )


# --------------------------------------------------------------------------- step 3: side by side


def _against(rank, world_size, name, steps, micro_batches, cap, group_ranks=None):
    kata = load_kata(KATA)
    group = _group(group_ranks)
    if group_ranks and rank not in group_ranks:
        return None
    result = kata.against_torch_ddp(
        name, steps, micro_batches, cap, lr=LR, seed=SEED, process_group=group
    )
    return result


def check_against(name, steps, micro_batches, cap, results, group_ranks=None):
    members = group_ranks or list(range(len(results)))
    where = f"against_torch_ddp({name!r}, {steps} steps, {micro_batches} micro-batch(es), cap " + (
        f"{_cap_text(cap)}) on "
        + (f"the group {group_ranks}" if group_ranks else f"{len(results)} ranks")
    )
    exact = len(members) == 2  # see TOLERANCE
    whole = _whole(name, steps, micro_batches, range(len(members)), model_seed=SEED + members[0])
    for rank in members:
        got = results[rank]
        missing = [k for k in ("ours", "torch", "ours_losses", "torch_losses") if k not in got]
        assert not missing, f"{where}: rank {rank}'s result lacks {missing}"
        ours, theirs = got["ours"], got["torch"]
        assert sorted(ours) == sorted(whole) and sorted(theirs) == sorted(whole), (
            f"{where}: rank {rank} returned states with the keys {sorted(ours)} and "
            f"{sorted(theirs)}: each is the wrapped model's state_dict ({sorted(whole)})"
        )
        same = _equal(ours, theirs) if exact else _close(ours, theirs)
        right = {"ours": _close(ours, whole), "torch": _close(theirs, whole)}
        if same and not any(right.values()):
            if group_ranks:
                shifted = _whole(name, steps, micro_batches, members, model_seed=SEED + members[0])
                if _close(ours, shifted):
                    raise AssertionError(
                        f"{where}: rank {rank} trained on shard {rank}, its rank in the world: "
                        "the shard is the rank in the group, dist.get_rank(process_group), "
                        f"0..{len(members) - 1}"
                    )
            if _equal(ours, theirs):
                raise AssertionError(
                    f"{where}: rank {rank}'s two wrappers ended on the very same weights, but "
                    "not those of one process on the whole batch: did both wrap one model? "
                    "Each wrapper then trains it (with its hooks, and both optimizers step it). "
                    "Build a model for each, both from make_model(model_name, seed + rank)"
                )
            raise AssertionError(
                f"{where}: both wrappers agree on rank {rank}, but differ by up to "
                f"{_largest(ours, whole)[0]:.3g} from one process on the whole batch: both "
                "train on rank_batches(model_name, steps, micro_batches, seed, shard) with "
                "SGD(lr, momentum=MOMENTUM)"
            )
        if not same:
            wrong = [
                label
                for which, label in (("ours", "BucketedDDP"), ("torch", "torch's DDP"))
                if not right[which]
            ]
            raise AssertionError(
                f"{where}: rank {rank}'s BucketedDDP and torch's DDP differ by up to "
                f"{_largest(ours, theirs)[0]:.3g}"
                + ("" if not exact else " (on 2 ranks they must agree bitwise)")
                + (
                    f"; {' and '.join(wrong)} differ(s) from one process on the whole batch: give "
                    "both the same model (make_model(model_name, seed + rank)), the same data "
                    "(rank_batches(...)) and the same optimizer (SGD(lr, momentum=MOMENTUM))"
                    if wrong
                    else ""
                )
            )
        for which in ("ours", "torch"):
            assert right[which], (
                f"{where}: rank {rank}'s {which} differs by up to "
                f"{_largest(got[which], whole)[0]:.3g} from one process on the whole batch"
            )
        assert len(got["ours_losses"]) == steps == len(got["torch_losses"]), (
            f"{where}: rank {rank} returned {len(got['ours_losses'])} and "
            f"{len(got['torch_losses'])} losses for {steps} steps"
        )


AGAINST = {
    "frozen": (25.0, 1),
    "tied": (TINY, 2),
    "buffer": (None, 1),
}


@pytest.mark.step(3)
@pytest.mark.parametrize("name", list(AGAINST))
def test_bucketed_ddp_equals_torchs_bitwise_on_two_ranks(kata, name):
    cap, micro = AGAINST[name]
    results = run_world(_against, 2, name, 3, micro, cap)
    check_against(name, 3, micro, cap, results)


@pytest.mark.step(3)
def test_bucketed_ddp_near_torchs_on_three_ranks(kata):
    results = run_world(_against, 3, "tied", 3, 2, SPLIT)
    check_against("tied", 3, 2, SPLIT, results)


@pytest.mark.step(3)
def test_bucketed_ddp_against_torchs_on_a_subgroup(kata):
    results = run_world(_against, 3, "frozen", 2, 1, SPLIT, [1, 2], deadline=30)
    check_against("frozen", 2, 1, SPLIT, results, [1, 2])


# --------------------------------------------------------------------------- step 4: SumOverRanks


def _summed(rank, world_size, group_ranks=None):
    kata = load_kata(KATA)
    group = _group(group_ranks)
    if group_ranks and rank not in group_ranks:
        return None
    x = torch.tensor([rank + 1.0, 2.0 * rank, -1.0 * rank], requires_grad=True)
    before = x.detach().clone()
    upstream = torch.tensor([1.0, rank + 1.0, 10.0**rank])
    with recording() as calls:
        y = kata.SumOverRanks.apply(x, group)
        forward_calls = len(calls)
        (y * upstream).sum().backward()
    return {
        "y": y.detach().clone(),
        "grad": None if x.grad is None else x.grad.clone(),
        "changed": not torch.equal(x.detach(), before),
        "forward_calls": forward_calls,
        "calls": len(calls),
    }


def check_sum(results, group_ranks=None):
    members = group_ranks or list(range(len(results)))
    where = "SumOverRanks.apply(x, group)" + (f" on the group {group_ranks}" if group_ranks else "")
    xs = {r: torch.tensor([r + 1.0, 2.0 * r, -1.0 * r]) for r in members}
    ups = {r: torch.tensor([1.0, r + 1.0, 10.0**r]) for r in members}
    total = sum(xs.values())
    upstream_total = sum(ups.values())
    for rank in members:
        got = results[rank]
        assert not got["changed"], (
            f"{where} changed rank {rank}'s input x in place: all_reduce works in place, so "
            "all-reduce a copy (tensor.clone()) and return that; autograd's inputs must stay as "
            "they were"
        )
        assert torch.equal(got["y"], total), (
            f"{where}: rank {rank} got {got['y'].tolist()}, expected the sum over the ranks "
            f"{total.tolist()}"
        )
        grad = got["grad"]
        assert grad is not None, (
            f"{where}: after backward rank {rank}'s x.grad is None: backward must return the "
            "gradient for tensor (and None for group)"
        )
        if torch.equal(grad, ups[rank]) and not torch.equal(ups[rank], upstream_total):
            raise AssertionError(
                f"{where}: rank {rank}'s x.grad is {grad.tolist()}, its own output's gradient: "
                "every rank's output holds x, so the gradient reaching x is the sum over the "
                f"ranks of their outputs' gradients, {upstream_total.tolist()}: all-reduce "
                "grad_output (a copy of it) in backward"
            )
        if torch.allclose(grad * len(members), upstream_total):
            raise AssertionError(
                f"{where}: rank {rank}'s x.grad is the mean over the ranks of the outputs' "
                f"gradients, {grad.tolist()}: the forward is a sum, so its backward is a sum too, "
                f"{upstream_total.tolist()}"
            )
        assert torch.equal(grad, upstream_total), (
            f"{where}: rank {rank}'s x.grad is {grad.tolist()}, expected {upstream_total.tolist()}"
        )
        assert got["forward_calls"] == 1 and got["calls"] == 2, (
            f"{where}: rank {rank} made {got['forward_calls']} collective(s) in forward and "
            f"{got['calls'] - got['forward_calls']} in backward: one all-reduce each"
        )


@pytest.mark.step(4)
def test_sum_over_ranks_forward_and_backward(kata):
    check_sum(run_world(_summed, 3))


@pytest.mark.step(4)
def test_sum_over_ranks_on_a_subgroup(kata):
    try:
        results = run_world(_summed, 3, [1, 2], deadline=20)
    except WorldDeadlock as deadlock:
        raise AssertionError(
            "SumOverRanks.apply(x, group) on the group [1, 2] of a world of 3: ranks 1 and 2 "
            "waited in a collective that rank 0, outside their group, never calls. Both "
            "all-reduces take group=...: forward's argument, and in backward the group forward "
            "kept (ctx.group = group)\n" + str(deadlock)
        ) from None
    check_sum(results, [1, 2])


# --------------------------------------------------------------------------- step 5: SyncBatchNorm2d

CHANNELS = 3


def _bn_inputs(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank r's images at step s: 2 + r of them (batches of different sizes), and weights for
    their outputs (so each output's gradient differs)."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    count = 2 + rank
    x = torch.randn(count, CHANNELS, 4, 4, generator=generator) * 2 + rank
    return x, torch.randn(count, CHANNELS, 4, 4, generator=generator)


def _affine(layer: nn.BatchNorm2d) -> None:
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([1.5, -0.5, 2.0]))
        layer.bias.copy_(torch.tensor([0.1, 0.2, -0.3]))


def _sync_bn(rank, world_size, passes, momentum):
    kata = load_kata(KATA)
    device = _device()
    layer = kata.SyncBatchNorm2d(CHANNELS, momentum=momentum).to(device)
    _affine(layer)
    outputs, grads, calls_per_pass = [], [], []
    for step in range(passes):
        x, w = (t.to(device) for t in _bn_inputs(rank, step))
        x.requires_grad_(True)
        with recording() as calls:
            y = layer(x)
            (y * w).sum().backward()
        outputs.append(y.detach().cpu())
        grads.append(None if x.grad is None else x.grad.cpu())
        calls_per_pass.append(len(calls))
    stats = {
        "running_mean": layer.running_mean.cpu().clone(),
        "running_var": layer.running_var.cpu().clone(),
        "num_batches_tracked": int(layer.num_batches_tracked),
        "weight_grad": layer.weight.grad.cpu().clone() if layer.weight.grad is not None else None,
        "bias_grad": layer.bias.grad.cpu().clone() if layer.bias.grad is not None else None,
    }
    layer.eval()
    x, _ = (t.to(device) for t in _bn_inputs(rank, 99))
    with recording() as calls:
        y = layer(x)
    plain = nn.BatchNorm2d(CHANNELS).to(device)
    plain.load_state_dict(layer.state_dict())
    plain.eval()
    evaluated = {"calls": [c.name for c in calls], "same": torch.equal(y, plain(x))}
    return {
        "outputs": outputs,
        "grads": grads,
        "calls": calls_per_pass,
        "stats": stats,
        "eval": evaluated,
    }


def _one_batchnorm(world_size, passes, momentum, stats=None):
    """One BatchNorm2d on every rank's images together; ``stats`` replaces how each step's mean
    and variance are found (the test's stand-ins for known mistakes)."""
    layer = nn.BatchNorm2d(CHANNELS, momentum=momentum)
    _affine(layer)
    outputs, grads = [], []
    for step in range(passes):
        parts = [_bn_inputs(r, step) for r in range(world_size)]
        x = torch.cat([p[0] for p in parts]).requires_grad_(True)
        w = torch.cat([p[1] for p in parts])
        if stats is None:
            y = layer(x)
        else:
            mean, var = stats([p[0] for p in parts])
            y = (x - mean.view(1, -1, 1, 1)) / torch.sqrt(var.view(1, -1, 1, 1) + layer.eps)
            y = y * layer.weight.view(1, -1, 1, 1) + layer.bias.view(1, -1, 1, 1)
        (y * w).sum().backward()
        sizes = [p[0].shape[0] for p in parts]
        outputs.append(list(torch.split(y.detach(), sizes)))
        grads.append(list(torch.split(x.grad, sizes)))
    return layer, outputs, grads


def _mean_of_means(parts):
    means = torch.stack([p.mean(dim=(0, 2, 3)) for p in parts])
    variances = torch.stack([p.var(dim=(0, 2, 3), unbiased=False) for p in parts])
    return means.mean(0), variances.mean(0)


def _local(parts, rank):
    part = parts[rank]
    return part.mean(dim=(0, 2, 3)), part.var(dim=(0, 2, 3), unbiased=False)


BN_TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}  # BatchNorm's statistics may be summed any way


def check_sync_bn(results, passes, momentum):
    world_size = len(results)
    where = f"SyncBatchNorm2d on {world_size} ranks with {', '.join(str(2 + r) for r in range(world_size))} images"
    layer, outputs, grads = _one_batchnorm(world_size, passes, momentum)
    for rank, got in enumerate(results):
        for step in range(passes):
            mine, expected = got["outputs"][step], outputs[step][rank]
            if torch.allclose(mine, expected, **BN_TOLERANCE):
                continue
            x, _ = _bn_inputs(rank, step)
            alone = F.batch_norm(x, None, None, layer.weight.detach(), layer.bias.detach(), True)
            if step == 0 and torch.allclose(mine, alone, **BN_TOLERANCE):
                raise AssertionError(
                    f"{where}: rank {rank} normalised with its own batch's statistics, as "
                    "BatchNorm2d does: sum each channel's values, their squares and the count on "
                    "this rank, add those up over every rank (one all-reduce), and take the mean "
                    "and variance of the whole batch"
                )
            _, averaged, _ = _one_batchnorm(world_size, passes, momentum, _mean_of_means)
            if step == 0 and torch.allclose(mine, averaged[0][rank], **BN_TOLERANCE):
                raise AssertionError(
                    f"{where}: rank {rank} used the mean of the ranks' means and variances: with "
                    "batches of different sizes that is not the whole batch's, and the spread "
                    "between the ranks' means is lost. All-reduce sums (values, squares, count) "
                    "and divide at the end"
                )
            raise AssertionError(
                f"{where}: rank {rank}'s output in pass {step + 1} differs by up to "
                f"{_difference(mine, expected):.3g} from one BatchNorm2d on every rank's images"
            )
        for step in range(passes):
            mine, expected = got["grads"][step], grads[step][rank]
            assert mine is not None, f"{where}: rank {rank}'s input got no gradient"
            if not torch.allclose(mine, expected, **BN_TOLERANCE):
                raise AssertionError(
                    f"{where}: rank {rank}'s outputs are right, but its input's gradient differs "
                    f"by up to {_difference(mine, expected):.3g} from one BatchNorm2d's: the "
                    "statistics came from every rank, so the gradient must go back through "
                    "every rank too. A plain dist.all_reduce is invisible to autograd; sum with "
                    "SumOverRanks.apply(local, self.process_group)"
                )
    for name in ("weight", "bias"):
        total = sum(r["stats"][f"{name}_grad"] for r in results)
        expected = getattr(layer, name).grad
        assert torch.allclose(total, expected, **BN_TOLERANCE), (
            f"{where}: the ranks' {name}.grad add up to {total.tolist()}, one BatchNorm2d's is "
            f"{expected.tolist()}"
        )
    for rank, got in enumerate(results):
        stats = got["stats"]
        assert stats["num_batches_tracked"] == passes, (
            f"{where}: after {passes} training passes rank {rank}'s num_batches_tracked is "
            f"{stats['num_batches_tracked']}: count every training forward, as BatchNorm2d does"
        )
        assert torch.allclose(stats["running_mean"], layer.running_mean, **BN_TOLERANCE), (
            f"{where}: rank {rank}'s running_mean is {stats['running_mean'].tolist()}, one "
            f"BatchNorm2d's {layer.running_mean.tolist()}: running = (1 - momentum) * running + "
            "momentum * the whole batch's mean"
        )
        if not torch.allclose(stats["running_var"], layer.running_var, **BN_TOLERANCE):
            biased = _biased_running_var(world_size, passes, momentum)
            if torch.allclose(stats["running_var"], biased, **BN_TOLERANCE):
                raise AssertionError(
                    f"{where}: rank {rank}'s running_var holds the biased variance (divided by "
                    "n): BatchNorm normalises with the biased one but keeps the unbiased one, "
                    "var * n / (n - 1), with n the whole batch's count per channel"
                )
            raise AssertionError(
                f"{where}: rank {rank}'s running_var is {stats['running_var'].tolist()}, one "
                f"BatchNorm2d's {layer.running_var.tolist()}"
            )


def _biased_running_var(world_size, passes, momentum):
    running = torch.ones(CHANNELS)
    for step in range(passes):
        x = torch.cat([_bn_inputs(r, step)[0] for r in range(world_size)])
        running = (1 - momentum) * running + momentum * x.var(dim=(0, 2, 3), unbiased=False)
    return running


@pytest.mark.step(5)
@pytest.mark.parametrize("world_size", [2, 3])
def test_sync_batchnorm_equals_one_batchnorm_on_the_whole_batch(kata, world_size):
    check_sync_bn(run_world(_sync_bn, world_size, 2, 0.3), 2, 0.3)


@pytest.mark.step(5)
def test_sync_batchnorm_in_eval_uses_running_statistics_without_communicating(kata):
    for rank, got in enumerate(run_world(_sync_bn, 2, 1, 0.1)):
        assert not got["eval"]["calls"], (
            f"rank {rank}: SyncBatchNorm2d in eval mode called {got['eval']['calls']}: in eval "
            "BatchNorm uses its running statistics, the same on every rank, and needs no "
            "communication (check self.training)"
        )
        assert got["eval"]["same"], (
            f"rank {rank}: SyncBatchNorm2d in eval mode differs from BatchNorm2d in eval mode "
            "with the same state: normalise with the running statistics"
        )


# --------------------------------------------------------------------------- step 6: convert


def _convnet() -> ConvNet:
    torch.manual_seed(SEED)
    model = ConvNet()
    with torch.no_grad():  # running statistics a fresh layer does not have
        for name, buffer in model.named_buffers():
            if "running" in name:
                buffer.uniform_(0.5, 1.5)
            elif "num_batches" in name:
                buffer.fill_(3)
    model.layer2.eval()  # a mode to keep
    return model


@pytest.mark.step(6)
def test_convert_replaces_every_batchnorm_like_torchs(kata):
    model = _convnet()
    theirs = nn.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(model))
    before = {name: p for name, p in model.named_parameters()}
    buffers = {name: b.data_ptr() for name, b in model.named_buffers()}
    group = object()  # stands for a process group: converting communicates nothing
    converted = kata.convert_sync_batchnorm(model, process_group=group)
    assert converted is model, (
        "convert_sync_batchnorm(model) must return the model it converted (in place), as "
        "torch's does"
    )
    kinds = {name: type(m) for name, m in model.named_modules()}
    expected = {
        name: kata.SyncBatchNorm2d if isinstance(m, nn.SyncBatchNorm) else type(m)
        for name, m in theirs.named_modules()
    }
    for name, kind in expected.items():
        if kinds.get(name) is not kind:
            raise AssertionError(
                f"after convert_sync_batchnorm the ConvNet's {name!r} is a "
                f"{getattr(kinds.get(name), '__name__', 'missing module')}, expected "
                f"{kind.__name__}: the BatchNorm2d layers sit inside the blocks (layer1[1], "
                "layer2[1]); walk every child, at every depth, and replace each BatchNorm2d"
            )
    for name, module in model.named_modules():
        if isinstance(module, kata.SyncBatchNorm2d):
            assert module.process_group is group, (
                f"{name!r}: the new layer's process_group is {module.process_group!r}, not the "
                "one given"
            )
            assert module.training == theirs.get_submodule(name).training, (
                f"{name!r} was in {'eval' if not theirs.get_submodule(name).training else 'train'} "
                "mode, but its SyncBatchNorm2d is not: keep the layer's mode"
            )
    state, expected_state = model.state_dict(), theirs.state_dict()
    assert sorted(state) == sorted(expected_state), (
        f"the converted model's state_dict holds {sorted(state)}, torch's conversion "
        f"{sorted(expected_state)}"
    )
    for key, value in expected_state.items():
        assert torch.equal(state[key], value), (
            f"the converted model's {key!r} is not the original's: the new layer takes the old "
            "one's weight, bias, running_mean, running_var and num_batches_tracked"
        )
    for name, param in model.named_parameters():
        assert param is before[name], (
            f"the converted model's {name!r} is a new tensor, not the original parameter: give "
            "the new layer the very same parameters (layer.weight = old.weight), as torch does, "
            "so that an optimizer made before the conversion still trains them"
        )
    for name, buffer in model.named_buffers():
        assert buffer.data_ptr() == buffers[name], (
            f"the converted model's buffer {name!r} is a copy: keep the original tensor"
        )
    layer = nn.BatchNorm2d(4, eps=1e-3, momentum=None, affine=False)
    alone = kata.convert_sync_batchnorm(layer)
    assert isinstance(alone, kata.SyncBatchNorm2d), (
        f"convert_sync_batchnorm(a BatchNorm2d) returned a {type(alone).__name__}: a BatchNorm2d "
        "itself comes back as a SyncBatchNorm2d"
    )
    settings = ("num_features", "eps", "momentum", "affine", "track_running_stats")
    for setting in settings:
        assert getattr(alone, setting) == getattr(layer, setting), (
            f"convert_sync_batchnorm(BatchNorm2d(4, eps=1e-3, momentum=None, affine=False)) "
            f"made a layer with {setting}={getattr(alone, setting)!r}: keep the layer's "
            f"{', '.join(settings)}"
        )


def _convnet_step(rank, world_size, steps, convert):
    from torch.nn.parallel import DistributedDataParallel

    kata = load_kata(KATA)
    torch.manual_seed(SEED)
    model = ConvNet()
    if convert:
        model = kata.convert_sync_batchnorm(model)
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=LR)
    for step in range(steps):
        images, labels = _images(step, rank, 3 + rank)
        optimizer.zero_grad()
        F.cross_entropy(ddp(images), labels).backward()
        optimizer.step()
    return _state(model)


def _images(step: int, rank: int, count: int):
    generator = torch.Generator().manual_seed(100 * step + rank)
    images = torch.randn(count, 1, 28, 28, generator=generator) + 0.5 * rank
    return images, torch.randint(0, 10, (count,), generator=generator)


def _convnet_whole(world_size, steps):
    torch.manual_seed(SEED)
    model = ConvNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(steps):
        parts = [_images(step, r, 3 + r) for r in range(world_size)]
        images, labels = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        optimizer.zero_grad()
        # DDP averages the ranks' mean losses: weight each rank's part by 1 / (its count * N)
        outputs = model(images)
        losses = F.cross_entropy(outputs, labels, reduction="none")
        weights = torch.cat(
            [torch.full((3 + r,), 1.0 / ((3 + r) * world_size)) for r in range(world_size)]
        )
        (losses * weights).sum().backward()
        optimizer.step()
    return _state(model)


@pytest.mark.step(6)
def test_converted_convnet_trains_like_one_process_on_the_whole_batch(kata):
    whole = _convnet_whole(2, 2)
    plain = run_world(_convnet_step, 2, 2, False)
    assert not _close(plain[0], whole, **BN_TOLERANCE), (
        "maintainers: plain BatchNorm matched one process here, so this test proves nothing"
    )
    converted = run_world(_convnet_step, 2, 2, True, deadline=40)
    for rank, state in enumerate(converted):
        for key, expected in whole.items():
            assert torch.allclose(state[key], expected, **BN_TOLERANCE), (
                f"the ConvNet converted with convert_sync_batchnorm, under torch's DDP on 2 ranks: "
                f"after 2 steps rank {rank}'s {key!r} differs by up to "
                f"{_difference(state[key], expected):.3g} from one process on the whole batch"
            )


@pytest.mark.step(6)
def test_program_compares_and_shows_batchnorm(kata):
    out = run_module_ok(
        KATA, "--world-size", "2", "--steps", "2", "--images", "4", timeout=180
    ).stdout
    assert out.count("bitwise equal on every rank") == 3, out
    lines = {
        line.split(":")[0].strip(): line
        for line in out.splitlines()
        if "largest difference from one process" in line
    }
    plain = float(lines["[main]   BatchNorm2d"].rsplit(" ", 1)[1])
    sync = float(lines["[main]   SyncBatchNorm2d"].rsplit(" ", 1)[1])
    assert plain > 1e-4 and sync < 1e-5, (
        f"the program should show plain BatchNorm's statistics off and SyncBatchNorm2d's equal "
        f"to one process:\n{out}"
    )


# --------------------------------------------------------------------------- CUDA


def _against_on_cuda(rank, world_size):
    rank_gpu()
    kata = load_kata(KATA)
    return kata.against_torch_ddp("tied", 2, 2, SPLIT, lr=LR, seed=SEED)


@pytest.mark.step(3)
@pytest.mark.cuda
def test_against_torch_ddp_nccl_world_of_one(kata):
    results = run_world(_against_on_cuda, 1, **on_cuda(1, "nccl", deadline=90))
    for got in results:
        assert _close(got["ours"], got["torch"]), "on NCCL BucketedDDP and torch's DDP differ"


@pytest.mark.step(3)
@pytest.mark.cuda
def test_against_torch_ddp_gloo_on_cuda(kata):
    results = run_world(_against_on_cuda, 2, **on_cuda(2, "gloo", deadline=90))
    for got in results:
        assert _close(got["ours"], got["torch"]), "on CUDA BucketedDDP and torch's DDP differ"


def _against_torch_sync_bn(rank, world_size):
    """Yours, then torch's nn.SyncBatchNorm, on the same inputs; None where torch refuses."""
    device = _device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    kata = load_kata(KATA)
    out = {}
    for name, kind in (("mine", kata.SyncBatchNorm2d), ("torch", nn.SyncBatchNorm)):
        layer = kind(CHANNELS, momentum=0.3).to(device)
        _affine(layer)
        x, w = (t.to(device) for t in _bn_inputs(rank, 0))
        x.requires_grad_(True)
        try:
            y = layer(x)
        except ValueError as error:
            if name == "torch" and "GPU" in str(error):  # torch's runs on GPUs only
                return {"refused": str(error)}
            raise
        (y * w).sum().backward()
        out[name] = [
            y.detach().cpu(),
            x.grad.cpu(),
            layer.running_mean.cpu(),
            layer.running_var.cpu(),
        ]
    return out


def check_against_torch_sync_bn(results) -> None:
    for rank, got in enumerate(results):
        if "refused" in got:
            pytest.skip(
                f"torch {torch.__version__}'s nn.SyncBatchNorm refuses CPU tensors "
                f"({got['refused']!r}): on the CPU, SyncBatchNorm2d is held against one "
                "BatchNorm2d on the whole batch instead (and against torch's on GPUs)"
            )
        names = ("output", "input gradient", "running_mean", "running_var")
        for what, mine, theirs in zip(names, got["mine"], got["torch"]):
            assert torch.allclose(mine, theirs, **BN_TOLERANCE), (
                f"rank {rank}: SyncBatchNorm2d's {what} differs from torch's nn.SyncBatchNorm "
                f"by up to {_difference(mine, theirs):.3g}"
            )


@pytest.mark.step(5)
def test_sync_batchnorm_against_torchs_where_torch_runs_it(kata):
    check_against_torch_sync_bn(run_world(_against_torch_sync_bn, 2))


@pytest.mark.step(5)
@pytest.mark.cuda
def test_sync_batchnorm_against_torchs_on_cuda(kata):
    check_against_torch_sync_bn(
        run_world(_against_torch_sync_bn, 2, **on_cuda(2, "gloo", deadline=90))
    )
