"""k05 data-parallel training by hand: identical replicas, disjoint shards, the step, the loop."""

from __future__ import annotations

import functools
import json
import time
from datetime import timedelta

import pytest
import torch
import torch.nn.functional as F

from dojo import data
from dojo.harness.calls import recording
from dojo.harness.impl import load_kata
from dojo.harness.world import run_world
from dojo.models import ConvNet
from dojo.spec.cuda import on_cuda, rank_gpu
from dojo.spec.testing import (
    check_refuses_naming,
    ranks_phrase,
    run_program_ok,
    shared_run,
    streams,
)
from dojo.todo import KataTodo

KATA = "k05_data_parallel"


def _device() -> torch.device:
    from dojo.devices import rank_device

    return rank_device()


def _max_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


# --------------------------------------------------------------------------- step 1: same start
#
# The ranks of these tests join a group of their own whose collectives give up after
# GROUP_TIMEOUT_S (gloo's own timeout): a broadcast whose ranks name different sources, or that
# some ranks skip, then ends in an error inside each rank instead of a deadlock, and every rank
# still returns what it recorded. So the test can say which source each rank used.

GROUP_TIMEOUT_S = 10.0


def _join_own_group(rank: int, world_size: int, store_file: str) -> None:
    import torch.distributed as dist

    store = dist.FileStore(store_file, world_size)
    store.set_timeout(timedelta(seconds=60))  # meet first, however slowly the ranks start...
    store.set(f"arrived/{rank}", "1")
    store.wait([f"arrived/{r}" for r in range(world_size)])
    dist.init_process_group(  # ...then every collective gives up after GROUP_TIMEOUT_S
        "gloo",
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=GROUP_TIMEOUT_S),
    )


def _replicas(rank, world_size, store_file, function):
    import torch.distributed as dist

    torch.manual_seed(100 + rank)  # every rank builds different weights...
    model = ConvNet().to(_device())
    with torch.no_grad():  # ...and different BatchNorm statistics, as after training on a shard
        for name, buffer in model.named_buffers():
            buffer.fill_(rank + (1 if "var" in name else 0))
    before = {name: t.detach().cpu().clone() for name, t in model.state_dict().items()}
    _join_own_group(rank, world_size, store_file)
    failure = None
    try:
        with recording() as calls:
            try:
                getattr(load_kata(KATA), function)(model)
            except KataTodo:
                raise
            except Exception as error:  # a collective that timed out or lost its peers
                failure = f"{type(error).__name__}: {str(error).strip().splitlines()[0][:200]}"
    finally:
        dist.destroy_process_group()
    after = {name: t.detach().cpu().clone() for name, t in model.state_dict().items()}
    made = [(c.name, c.peers.get("src"), c.shapes[0] if c.shapes else ()) for c in calls]
    return before, after, made, failure


def _run_replicas(tmp_path, function: str) -> list:
    return run_world(
        _replicas,
        3,
        str(tmp_path / "store"),
        function,
        init_group=False,
        deadline=GROUP_TIMEOUT_S + 30,
    )


def _times(count: int) -> str:
    return "once" if count == 1 else f"{count} times"


def _check_broadcasts(results: list, function: str) -> None:
    """Name what the ranks' calls show: other collectives, skipped or mismatched broadcasts."""
    made = [result[2] for result in results]
    failures = [result[3] for result in results]
    ended = ""
    if any(failures):
        rank = next(r for r, failure in enumerate(failures) if failure)
        ended = (
            f"\n(the broadcasts never completed: rank {rank}'s ended in {failures[rank]}; "
            f"here the group gives up after {GROUP_TIMEOUT_S:g} s, a real one waits for ever)"
        )
    for rank, calls in enumerate(made):
        others = sorted({name for name, _, _ in calls if name != "broadcast"})
        if "all_reduce" in others:
            raise AssertionError(
                f"rank {rank}'s {function} called dist.all_reduce: averaging the replicas makes "
                "them equal, but not equal to rank 0's, and it is not what the lesson asks. Copy "
                f"rank 0's tensors with dist.broadcast(tensor, src=0) instead.{ended}"
            )
        if others:
            raise AssertionError(
                f"rank {rank}'s {function} called {', '.join(others)}: copying rank 0's tensors "
                f"takes only dist.broadcast(tensor, src=0), on every rank.{ended}"
            )
    counts = [len(calls) for calls in made]
    if any(counts) and not all(counts):
        did = [r for r, count in enumerate(counts) if count]
        skipped = [r for r, count in enumerate(counts) if not count]
        by = ", ".join(f"rank {r} called dist.broadcast {_times(counts[r])}" for r in did)
        raise AssertionError(
            f"{function}: {by}, {ranks_phrase(skipped)} never did. A broadcast "
            "is a collective: every rank calls it for the same tensors, rank 0 to send them and "
            "the others to receive them into their own. Do not put the broadcasts under an "
            f"`if rank == ...`.{ended}"
        )
    for index in range(min(counts, default=0)):
        sources = [calls[index][1] for calls in made]
        if len(set(sources)) > 1:
            used = ", ".join(f"rank {r} used src={src}" for r, src in enumerate(sources))
            raise AssertionError(
                f"{function}: the ranks named different sources in broadcast number {index + 1}: "
                f"{used}. The source is the rank whose tensor everyone gets, so every rank must "
                "name the same one, rank 0 (src=0), whatever its own rank; with different "
                f"sources the ranks wait for each other for ever.{ended}"
            )
    if len(set(counts)) > 1:
        by = ", ".join(f"rank {r} called it {_times(count)}" for r, count in enumerate(counts))
        raise AssertionError(
            f"{function}: the ranks made different numbers of broadcasts ({by}): every rank must "
            f"broadcast the same tensors, in the same order.{ended}"
        )
    sources = {src for calls in made for _, src, _ in calls}
    if sources and sources != {0}:
        raise AssertionError(
            f"{function}: every rank broadcast from src={sorted(sources)[0]}: the replicas must "
            f"all take rank 0's tensors, src=0.{ended}"
        )
    if any(failures):
        rank = next(r for r, failure in enumerate(failures) if failure)
        raise AssertionError(f"rank {rank}'s {function} raised {failures[rank]}")


def _is_buffer(name: str) -> bool:
    return "running" in name or "num_batches" in name


def _broadcast_shapes(calls) -> set:
    return {tuple(shape) for name, _, shape in calls if name == "broadcast"}


@pytest.mark.step(1)
def test_broadcast_buffers_copies_rank_0s_statistics_only(kata, tmp_path):
    results = _run_replicas(tmp_path, "broadcast_buffers")
    _check_broadcasts(results, "broadcast_buffers")
    source = results[0][0]
    for rank, (before, after, calls, _) in enumerate(results):
        for name, tensor in after.items():
            if _is_buffer(name):
                if torch.equal(tensor, source[name]):
                    continue
                if torch.equal(tensor, before[name]) and calls:
                    raise AssertionError(
                        f"rank {rank} called dist.broadcast(src=0) {_times(len(calls))}, but its "
                        f"buffer {name!r} still holds its own values: broadcast each buffer itself "
                        "(it is filled in place), not a copy of it, and every buffer of "
                        "model.buffers()"
                    )
                raise AssertionError(
                    f"after broadcast_buffers rank {rank}'s {name!r} holds "
                    f"{tensor.flatten()[:3].tolist()}..., not rank 0's "
                    f"{source[name].flatten()[:3].tolist()}...: dist.broadcast(buffer, src=0) "
                    "for every buffer in model.buffers()"
                )
            assert torch.equal(tensor, before[name]), (
                f"broadcast_buffers changed rank {rank}'s parameter {name!r}: it copies the buffers "
                "only (model.buffers(), not model.parameters() or the state_dict; averaged "
                "gradients keep the parameters identical)"
            )


@pytest.mark.step(1)
def test_make_replicas_identical_copies_rank_0(kata, tmp_path):
    results = _run_replicas(tmp_path, "make_replicas_identical")
    _check_broadcasts(results, "make_replicas_identical")
    source = results[0][0]
    buffers = {name for name in source if _is_buffer(name)}
    for rank, (before, after, calls, _) in enumerate(results):
        for name, expected in source.items():
            if torch.equal(after[name], expected):
                continue
            if rank == 0:
                raise AssertionError(
                    f"make_replicas_identical changed rank 0's own {name!r}: rank 0 is the source "
                    "that every rank copies (dist.broadcast(tensor, src=0))"
                )
            if name in buffers and torch.equal(after[name], before[name]):
                raise AssertionError(
                    f"rank {rank}'s BatchNorm buffer {name!r} (a running statistic) still holds its "
                    "own values: make_replicas_identical must call broadcast_buffers(model) too. "
                    "Buffers are not parameters and no gradient averages them, yet evaluation uses them."
                )
            if torch.equal(after[name], before[name]):
                if tuple(expected.shape) in _broadcast_shapes(calls):
                    raise AssertionError(
                        f"rank {rank} broadcast a tensor shaped like its parameter {name!r} "
                        f"{tuple(expected.shape)}, yet {name!r} still holds its own random values: "
                        "broadcast the parameter itself, which dist.broadcast fills in place, not "
                        "a copy of it (param.clone(), param.detach().clone(), torch.tensor(param))"
                    )
                raise AssertionError(
                    f"rank {rank}'s parameter {name!r} still holds its own random values: broadcast "
                    "every parameter from rank 0 (dist.broadcast(param, src=0), inside torch.no_grad())"
                )
            raise AssertionError(
                f"rank {rank}'s {name!r} differs from rank 0's by up to "
                f"{_max_difference(after[name], expected):.3g}: copy rank 0's values exactly"
            )


# --------------------------------------------------------------------------- step 2: shards


def _shards(kata, num_samples, world_size):
    shards = []
    for rank in range(world_size):
        shard = kata.shard_indices(num_samples, rank, world_size)
        again = kata.shard_indices(num_samples, rank, world_size)
        shard, again = [int(i) for i in shard], [int(i) for i in again]
        assert shard == again, (
            f"shard_indices({num_samples}, {rank}, {world_size}) gave two different answers: every "
            "rank computes the shards on its own, so they must come out the same every time"
        )
        shards.append(shard)
    return shards


def _span(indices: list[int]) -> str:
    if len(indices) > 6:
        return f"[{', '.join(map(str, indices[:3]))}, ..., {indices[-1]}]"
    return str(indices)


@pytest.mark.step(2)
@pytest.mark.parametrize(
    "num_samples, world_size", [(1438, 4), (1438, 2), (12, 4), (10, 3), (5, 1), (7, 7)]
)
def test_shards_are_disjoint_equal_and_cover_the_data(kata, num_samples, world_size):
    shards = _shards(kata, num_samples, world_size)
    per_rank = num_samples // world_size
    for rank, shard in enumerate(shards):
        outside = [i for i in shard if not 0 <= i < num_samples]
        assert not outside, (
            f"rank {rank}'s shard holds indices {outside[:5]}, outside 0..{num_samples - 1}"
        )
        assert len(set(shard)) == len(shard), (
            f"rank {rank}'s shard holds an index twice: {shard[:20]}"
        )
        if world_size > 1 and len(shard) == num_samples:
            raise AssertionError(
                f"rank {rank} got all {num_samples} samples, the whole data set, as in the "
                f"tutorial: then {world_size} ranks do the same work {world_size} times. Each rank "
                f"takes only its own {num_samples} // {world_size} = {per_rank}"
            )
        assert len(shard) == per_rank, (
            f"with {num_samples} samples and {world_size} ranks, rank {rank} got {len(shard)} samples, "
            f"expected {num_samples} // {world_size} = {per_rank}. Every rank needs the same number, "
            "or the ranks take different numbers of steps and the last all_reduce waits for ever: "
            "drop the few left over"
        )
    if world_size > 1 and all(shard == shards[0] for shard in shards):
        raise AssertionError(
            f"with {num_samples} samples and {world_size} ranks, every rank got the same shard "
            f"{_span(shards[0])}: each rank must take its own block, starting at "
            "rank * (num_samples // world_size), or all ranks train on the same samples"
        )
    seen = {}
    for rank, shard in enumerate(shards):
        for index in shard:
            assert index not in seen, (
                f"sample {index} is in the shards of rank {seen[index]} and rank {rank}: shards must "
                "be disjoint (ranks that train on the same samples do the same work twice)"
            )
            seen[index] = rank
    covered = len(seen)
    assert covered == per_rank * world_size, (
        f"the shards cover {covered} of {num_samples} samples, expected {per_rank * world_size}"
    )


@pytest.mark.step(2)
@pytest.mark.parametrize(
    "num_samples, rank, world_size, wrong, why",
    [
        (10, 3, 3, "3", "rank 3 is not in a world of 3 ranks (0, 1, 2)"),
        (10, -1, 3, "-1", "rank -1 is not a rank (ranks count from 0)"),
        (2, 0, 3, "2", "2 samples cannot give each of 3 ranks one"),
        (10, 0, 0, "0", "a world of 0 ranks has no rank 0"),
    ],
)
def test_shards_refuse_impossible_requests(kata, num_samples, rank, world_size, wrong, why):
    def returned(got) -> str:
        return (
            f"returned {list(got)[:10]}: {why}. Check the request first and raise ValueError "
            "saying what is wrong, or a rank launched with a bad number trains on someone else's "
            "samples (or none)"
        )

    call = f"shard_indices({num_samples}, rank={rank}, world_size={world_size})"
    shard = functools.partial(kata.shard_indices, num_samples, rank, world_size)
    check_refuses_naming(shard, call, wrong, why, returned)


# --------------------------------------------------------------------------- step 3: the step

GLOBAL_BATCH, STEPS, LR = 8, 3, 0.1


def _batches():
    images, labels = data.load("digits", "train").tensors
    return images[: GLOBAL_BATCH * STEPS], labels[: GLOBAL_BATCH * STEPS]


def _fresh_model():
    torch.manual_seed(0)
    return ConvNet(batch_norm=False)


class _WatchedSGD(torch.optim.SGD):
    """Plain SGD that notes, at each step, when it ran and how much gradient it was given."""

    def __init__(self, params, lr):
        super().__init__(params, lr=lr)
        self.steps = []  # (time.perf_counter(), the sum of |grad| over every parameter)

    def step(self, closure=None):
        grads = [p.grad for group in self.param_groups for p in group["params"]]
        size = sum(float(g.abs().sum()) for g in grads if g is not None)
        self.steps.append((time.perf_counter(), size))
        return super().step(closure)


def _step_on_shards(rank, world_size):
    kata = load_kata(KATA)
    images, labels = _batches()
    model = _fresh_model().to(_device())  # the same seed: identical replicas without a broadcast
    optimizer = _WatchedSGD(model.parameters(), lr=LR)
    per_rank = GLOBAL_BATCH // world_size
    losses, steps = [], []
    for step in range(STEPS):
        part = slice(
            step * GLOBAL_BATCH + rank * per_rank, step * GLOBAL_BATCH + (rank + 1) * per_rank
        )
        stepped = len(optimizer.steps)
        with recording() as calls:
            loss = kata.train_step(
                model, optimizer, images[part].to(_device()), labels[part].to(_device())
            )
        losses.append(loss if isinstance(loss, (float, int)) else f"a {type(loss).__name__}")
        steps.append(
            {
                "calls": [(c.name, [tuple(s) for s in c.shapes], c.start) for c in calls],
                "optimizer_steps": optimizer.steps[stepped:],
            }
        )
    params = {name: p.detach().cpu().clone() for name, p in model.named_parameters()}
    return losses, params, steps


def _one_process_on_the_whole_batch(zero_grad: bool = True, grad_scale: float = 1.0):
    """What one process stepping on the whole batches ends with (or one making a mistake)."""
    images, labels = _batches()
    model = _fresh_model()
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        part = slice(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH)
        loss = F.cross_entropy(model(images[part]), labels[part])
        if zero_grad:
            optimizer.zero_grad()
        loss.backward()
        with torch.no_grad():
            grads = [p.grad.clone() for p in model.parameters()]
            for p in model.parameters():
                p.grad *= grad_scale
        optimizer.step()
        with torch.no_grad():
            for p, grad in zip(model.parameters(), grads):
                p.grad.copy_(grad)  # what backward left, for the next step to pile onto
    return initial, {name: p.detach().clone() for name, p in model.named_parameters()}


def _check_the_step_calls(results) -> None:
    """What each rank's train_step did, in order: the averaging, then the optimizer's step."""
    for rank, (_, _, steps) in enumerate(results):
        for number, step in enumerate(steps, start=1):
            this = f"rank {rank}'s train_step number {number}"
            stepped = step["optimizer_steps"]
            reduces = [(shapes, at) for name, shapes, at in step["calls"] if name == "all_reduce"]
            if not stepped:
                raise AssertionError(
                    f"{this} never called optimizer.step(): without it the weights never change. "
                    "Call it after averaging the gradients."
                )
            if len(stepped) > 1:
                raise AssertionError(
                    f"{this} called optimizer.step() {len(stepped)} times: one step per batch"
                )
            moment, gradient = stepped[0]
            if gradient == 0:
                raise AssertionError(
                    f"{this}: every gradient was zero (or None) when optimizer.step() ran, so the "
                    "weights never moved. zero_grad() between backward() and step() wipes the "
                    "gradients backward just computed: zero them before loss.backward() (or after "
                    "optimizer.step())."
                )
            if not reduces:
                raise AssertionError(
                    f"{this} made no all-reduce: each rank stepped with the gradient of its own "
                    "images only, and the replicas drift apart. Call average_gradients(model) "
                    "(your k04) after loss.backward() and before optimizer.step()."
                )
            if all(all(s in ((), (1,)) for s in shapes) for shapes, _ in reduces):
                raise AssertionError(
                    f"{this} all-reduced only a single number (the loss?), never a gradient: "
                    "averaging the loss does not change the gradients each rank steps with. Call "
                    "average_gradients(model) after loss.backward(), and return this rank's own loss."
                )
            late = [at for _, at in reduces if at > moment]
            if late:
                raise AssertionError(
                    f"{this} all-reduced after optimizer.step() ({len(late)} of its {len(reduces)} "
                    "all-reduces came after the step): the step had already used this rank's own "
                    "gradient. Average first (after backward), then step."
                )


def _same_weights(got: dict, expected: dict) -> bool:
    return all(torch.allclose(got[name], expected[name], rtol=1e-4, atol=1e-5) for name in expected)


@pytest.mark.step(3)
def test_ranks_on_shards_step_like_one_process_on_the_whole_batch(kata):
    world_size = 4
    results = run_world(_step_on_shards, world_size)
    images, labels = _batches()
    per_rank = GLOBAL_BATCH // world_size
    for rank, (losses, _, _) in enumerate(results):
        assert isinstance(losses[0], float), (
            f"rank {rank}'s train_step returned {losses[0]}: return this rank's loss as a float, "
            "loss.item()"
        )
    _check_the_step_calls(results)
    initial, expected = _one_process_on_the_whole_batch()
    with torch.no_grad():
        model = _fresh_model()
        for rank, (losses, _, _) in enumerate(results):
            part = slice(rank * per_rank, (rank + 1) * per_rank)
            own = F.cross_entropy(model(images[part]), labels[part]).item()
            assert abs(losses[0] - own) <= 1e-4 * abs(own), (
                f"rank {rank}'s first train_step returned {losses[0]:.5f}, expected {own:.5f}: the "
                f"mean cross-entropy (F.cross_entropy) of its own {per_rank} images, before the step"
            )
    names = list(expected)
    for rank, (_, params, _) in enumerate(results):
        if all(torch.equal(params[n], initial[n]) for n in names):
            raise AssertionError(
                f"after {STEPS} calls of train_step rank {rank}'s weights have not changed: call "
                "optimizer.step() after loss.backward()"
            )
    for rank, (_, params, _) in enumerate(results[1:], start=1):
        name = max(names, key=lambda n: _max_difference(params[n], results[0][1][n]))
        gap = _max_difference(params[name], results[0][1][name])
        assert gap <= 1e-6, (
            f"after {STEPS} steps rank {rank}'s weights differ from rank 0's (by up to {gap:.3g} in "
            f"{name!r}): each rank stepped with its own gradient. Call average_gradients(model) "
            "(your k04) after loss.backward() and before optimizer.step()."
        )
    got = results[0][1]
    if _same_weights(got, expected):
        return
    name = max(names, key=lambda n: _max_difference(got[n], expected[n]))
    gap = _max_difference(got[name], expected[name])
    head = (
        f"the {world_size} replicas agree with each other, but not with one process that took the "
        f"same {STEPS} steps on the whole batches of {GLOBAL_BATCH} (up to {gap:.3g} apart in "
        f"{name!r})"
    )
    if _same_weights(got, _one_process_on_the_whole_batch(zero_grad=False)[1]):
        raise AssertionError(
            f"{head}: they match a process that never zeroes its gradients, so each step's "
            "gradients piled onto the last ones. Call optimizer.zero_grad() in every train_step, "
            "before loss.backward()."
        )
    if _same_weights(got, _one_process_on_the_whole_batch(grad_scale=world_size)[1]):
        raise AssertionError(
            f"{head}: they match a process whose gradients are {world_size} times too large, the "
            f"sum over the {world_size} ranks instead of their mean. Divide by the world size "
            "(average_gradients does)."
        )
    raise AssertionError(
        f"{head}. Zero the gradients every step (optimizer.zero_grad() before backward, or they "
        "pile up), use the mean cross-entropy (F.cross_entropy's default), and average, not sum, "
        "the gradients."
    )


# --------------------------------------------------------------------------- step 4: the loop

EPOCHS, BATCH = 1, 64
ACCURACY_BAR = 0.85  # one epoch on 2 ranks reaches ~95 % on the held-out digits


def _train(rank, world_size):
    """run_training with replicas built apart (each rank its own random weights), noting which
    training samples each train_step got, the broadcasts made before the first step, and the
    BatchNorm statistics each held-out accuracy was measured with."""
    kata = load_kata(KATA)
    images = data.load("digits", "train").tensors[0]
    where = {image.numpy().tobytes(): index for index, image in enumerate(images)}
    batches, broadcasts, statistics = [], [], []
    originals = {name: getattr(kata, name) for name in ("ConvNet", "train_step", "accuracy")}

    def built_apart(*args, **kwargs):
        torch.manual_seed(1000 + rank)  # as if each rank had built its model its own way
        return originals["ConvNet"](*args, **kwargs)

    def train_step(model, optimizer, images, labels):
        batches.append([where.get(image.cpu().numpy().tobytes(), -1) for image in images])
        broadcasts.append(sum(1 for c in calls if c.name == "broadcast"))
        return originals["train_step"](model, optimizer, images, labels)

    def accuracy(model, *args, **kwargs):
        statistics.append([float(b.double().sum()) for b in model.buffers()])
        return originals["accuracy"](model, *args, **kwargs)

    kata.ConvNet, kata.train_step, kata.accuracy = built_apart, train_step, accuracy
    try:
        with recording(("broadcast",)) as calls:
            result = kata.run_training(
                rank, world_size, epochs=EPOCHS, batch_size=BATCH, show_progress=False
            )
    finally:
        for name, original in originals.items():
            setattr(kata, name, original)
    result["trained_on"] = batches
    result["broadcasts_before_training"] = broadcasts[0] if broadcasts else None
    result["evaluated_with"] = statistics
    return result


@shared_run
def _trained(world_size: int = 2):
    """One training run on 2 ranks, shared by the tests below."""
    return run_world(_train, world_size, deadline=60)


def _returned(results) -> None:
    for key in ("losses", "accuracy", "accuracies", "state_dict", "shard"):
        assert key in results[0], (
            f"run_training returned the keys {sorted(results[0])}; it must return {key!r} too"
        )


@pytest.mark.step(4)
def test_training_keeps_the_replicas_identical(kata):
    results = _trained()
    _returned(results)
    source = results[0]["state_dict"]
    for rank, result in enumerate(results[1:], start=1):
        for name, tensor in result["state_dict"].items():
            if torch.equal(tensor, source[name]):
                continue
            if _is_buffer(name):
                raise AssertionError(
                    f"after training, rank {rank}'s BatchNorm buffer {name!r} differs from rank 0's: "
                    "each rank's running statistics come from its own shard. Call "
                    "broadcast_buffers(model) after each epoch, before evaluating (the lesson's "
                    "BatchNorm note)."
                )
            if result["broadcasts_before_training"] == 0:
                raise AssertionError(
                    f"after training, rank {rank}'s parameter {name!r} differs from rank 0's: the "
                    "test has each rank build its model with its own random weights, and "
                    f"rank {rank} made no broadcast before its first step. Call "
                    "make_replicas_identical(model) before the loop: a shared seed is no guarantee."
                )
            raise AssertionError(
                f"after training, rank {rank}'s parameter {name!r} differs from rank 0's by up to "
                f"{_max_difference(tensor, source[name]):.3g}: did every rank start from rank 0's "
                "weights (make_replicas_identical before the loop) and average its gradients every step?"
            )


@pytest.mark.step(4)
def test_training_gives_every_rank_its_own_shard(kata):
    results = _trained()
    _returned(results)
    world_size = len(results)
    train_size = len(data.load("digits", "train"))
    per_rank = train_size // world_size
    per_rank_batch = BATCH // world_size
    steps = per_rank // per_rank_batch
    seen = []
    for rank, result in enumerate(results):
        batches, shard = result["trained_on"], {int(i) for i in result["shard"]}
        assert batches, (
            f"rank {rank}'s run_training never called train_step: train every batch with "
            "train_step(model, optimizer, images, labels)"
        )
        sizes = sorted({len(batch) for batch in batches})
        if sizes != [per_rank_batch]:
            if sizes[-1] == BATCH:
                raise AssertionError(
                    f"rank {rank} trained on batches of {BATCH} images, the whole global batch: "
                    f"each rank takes its part of it, batch_size // world_size = {per_rank_batch} "
                    f"images (per_rank_batch), so that the {world_size} ranks together take {BATCH} "
                    "per step"
                )
            if len(batches[-1]) < per_rank_batch and all(
                len(b) == per_rank_batch for b in batches[:-1]
            ):
                raise AssertionError(
                    f"rank {rank}'s last batch held {len(batches[-1])} images, the rest "
                    f"{per_rank_batch}: drop the last partial batch (drop_last=True), so that every "
                    "step averages gradients over batches of the same size"
                )
            raise AssertionError(
                f"rank {rank} trained on batches of {', '.join(map(str, sizes))} images, expected "
                f"{per_rank_batch} (batch_size // world_size, per_rank_batch) in every step"
            )
        samples = [index for batch in batches for index in batch]
        outside = sorted(set(samples) - shard)
        if outside:
            raise AssertionError(
                f"rank {rank} trained on {len(set(samples))} different samples, {len(outside)} of "
                f"them outside the shard it returned ({len(shard)} samples; for example "
                f"{outside[:3]}): train on Subset(train_set, shard) only, not on the whole train_set"
            )
        assert len(samples) == len(set(samples)), (
            f"rank {rank} trained on some samples twice in one epoch: load Subset(train_set, "
            "shard) once, and let the DataLoader go through it once per epoch"
        )
        seen.append(set(samples))
    shared = seen[0] & seen[1]
    assert not shared, (
        f"ranks 0 and 1 both trained on {len(shared)} of the same samples: give each rank its own "
        "shard (shard_indices(len(train_set), rank, world_size), with this rank's rank)"
    )
    for rank, result in enumerate(results):
        assert len(result["shard"]) == per_rank, (
            f"rank {rank} trained on {len(result['shard'])} samples, expected its shard of {per_rank}"
        )
        assert len(result["losses"]) == EPOCHS * steps, (
            f"rank {rank} recorded {len(result['losses'])} losses in {_epochs(EPOCHS)}, expected one "
            f"per step: {steps} ({per_rank} samples in batches of {BATCH} // {world_size}, the last "
            "partial batch dropped)"
        )


def _epochs(count: int) -> str:
    return f"{count} epoch" if count == 1 else f"{count} epochs"


@pytest.mark.step(4)
def test_training_learns_the_digits(kata):
    results = _trained()
    _returned(results)
    losses = results[0]["losses"]
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.5 * first, (
        f"rank 0's loss went from {first:.3f} (mean of the first 5 steps) to {last:.3f} (the last 5): "
        "it should at least halve in one epoch"
    )
    for rank, result in enumerate(results):
        assert len(result["accuracies"]) == EPOCHS, (
            f"rank {rank} returned {len(result['accuracies'])} held-out accuracies for "
            f"{_epochs(EPOCHS)}: measure it once after every epoch"
        )
        assert result["accuracy"] >= ACCURACY_BAR, (
            f"rank {rank}'s held-out accuracy after {_epochs(EPOCHS)} is {result['accuracy']:.1%}, "
            f"expected at least {ACCURACY_BAR:.0%}"
        )
    for rank, result in enumerate(results[1:], start=1):
        for epoch, (own, rank_0s) in enumerate(
            zip(result["evaluated_with"], results[0]["evaluated_with"]), start=1
        ):
            assert own == rank_0s, (
                f"rank {rank} measured the held-out accuracy of epoch {epoch} with BatchNorm "
                "statistics (running mean and variance) that differ from rank 0's: each rank's "
                "come from its own shard. Call broadcast_buffers(model) after the epoch, before "
                "accuracy(...), so that every rank evaluates the same model."
            )
    if results[0]["accuracy"] != results[1]["accuracy"]:
        same = all(
            torch.equal(t, results[1]["state_dict"][n]) for n, t in results[0]["state_dict"].items()
        )
        raise AssertionError(
            f"rank 0 measured {results[0]['accuracy']:.2%} and rank 1 {results[1]['accuracy']:.2%} "
            "on the same held-out digits"
            + (
                ", although they end with identical weights and buffers: each measured with its "
                "own BatchNorm statistics. Call broadcast_buffers(model) after the epoch, before "
                "accuracy(...)."
                if same
                else ": identical replicas must agree"
            )
        )


def _plotted(plot) -> dict:
    from PIL import Image

    with Image.open(plot) as image:
        text = getattr(image, "text", {}).get("Description")
    assert text, f"{plot} does not say what it plots (no Description text in the PNG)"
    return json.loads(text)


@pytest.mark.step(4)
def test_program_trains_reports_from_rank_0_and_plots(kata, tmp_path):
    plot = tmp_path / "curve.png"
    world_size, limit, epochs = 2, 384, 2
    done = run_program_ok(
        KATA,
        *("--world-size", str(world_size), "--epochs", str(epochs), "--limit", str(limit)),
        *("--log-every", "2", "--plot", str(plot), "--backend", "gloo", "--device", "cpu"),
    )
    shown = streams(done)
    lines = done.stdout.splitlines()
    progress = [line for line in lines if "loss" in line]
    assert any(line.startswith(f"[rank 0] epoch 1/{epochs} [") for line in progress), (
        f"no progress bar from rank 0\n{shown}"
    )
    assert any(
        line.startswith(f"[rank 0] epoch {epochs}/{epochs}: mean loss")
        and "held-out accuracy" in line
        for line in lines
    ), f"rank 0 must report each epoch's loss and held-out accuracy\n{shown}"
    others = [line for line in progress if not line.startswith(("[rank 0]", "[main]"))]
    assert not others, "only rank 0 may print progress; these came from other ranks:\n" + "\n".join(
        others
    )
    assert f"loss curve saved to {plot.resolve()}" in done.stdout, (
        f"the program must say where the plot is\n{shown}"
    )
    assert plot.exists() and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f"{plot} is not a PNG"
    figure = _plotted(plot)
    assert "digits" in figure["title"], (
        f"the plot's title {figure['title']!r} must name the data set (digits)"
    )
    steps = (limit // world_size) // (BATCH // world_size)
    loss_panel, accuracy_panel = figure["panels"]
    labels = [line["label"] for line in loss_panel["lines"]]
    assert labels == [f"rank {rank}" for rank in range(world_size)], (
        f"the loss panel shows the lines {labels}: one line per rank, each rank's own loss"
    )
    ys = [line["y"] for line in loss_panel["lines"]]
    for rank, y in enumerate(ys):
        assert len(y) == epochs * steps, (
            f"rank {rank}'s loss line has {len(y)} points, expected one per step: {epochs * steps}"
        )
    assert ys[0] != ys[1], "rank 0's and rank 1's loss lines are the same: each has its own shard"
    [accuracy] = accuracy_panel["lines"]
    assert len(accuracy["y"]) == epochs and all(0 < y <= 100 for y in accuracy["y"]), (
        f"the accuracy panel shows {accuracy['y']}: one held-out accuracy (in %) per epoch"
    )


# --------------------------------------------------------------------------- CUDA


def _train_on_cuda(rank, world_size):
    rank_gpu()
    result = load_kata(KATA).run_training(
        rank, world_size, epochs=1, batch_size=BATCH, show_progress=False
    )
    result["cuda_bytes"] = torch.cuda.max_memory_allocated()
    return result


def _check_cuda_training(results):
    for rank, result in enumerate(results):
        assert result["cuda_bytes"] > 0, (
            f"rank {rank} trained without touching its GPU: use rank_device()"
        )
        assert result["accuracy"] >= ACCURACY_BAR, (
            f"rank {rank}: held-out accuracy {result['accuracy']:.1%}"
        )
    for name, tensor in results[0]["state_dict"].items():
        for rank, result in enumerate(results[1:], start=1):
            assert torch.equal(result["state_dict"][name], tensor), (
                f"rank {rank}'s {name!r} differs from rank 0's"
            )


@pytest.mark.step(4)
@pytest.mark.cuda
def test_nccl_world_of_one(kata):
    _check_cuda_training(run_world(_train_on_cuda, 1, **on_cuda(1, "nccl", deadline=120)))


@pytest.mark.step(4)
@pytest.mark.cuda
def test_gloo_on_cuda_several_ranks(kata):
    _check_cuda_training(run_world(_train_on_cuda, 2, **on_cuda(2, "gloo", deadline=120)))
