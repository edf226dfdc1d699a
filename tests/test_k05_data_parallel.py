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
from dojo.lang import t, tn
from dojo.models import ConvNet
from dojo.spec.cuda import on_cuda, rank_gpu
from dojo.spec.testing import (
    check_refuses_naming,
    ranks_phrase,
    run_module_ok,
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
    return t("once") if count == 1 else t("{count} times", count=count)


def _check_broadcasts(results: list, function: str) -> None:
    """Name what the ranks' calls show: other collectives, skipped or mismatched broadcasts."""
    made = [result[2] for result in results]
    failures = [result[3] for result in results]
    ended = ""
    if any(failures):
        rank = next(r for r, failure in enumerate(failures) if failure)
        ended = "\n" + t(
            "(the broadcasts never completed: rank {rank}'s ended in {failure}; here the group "
            "gives up after {seconds} s, a real one waits for ever)",
            rank=rank,
            failure=failures[rank],
            seconds=f"{GROUP_TIMEOUT_S:g}",
        )
    for rank, calls in enumerate(made):
        others = sorted({name for name, _, _ in calls if name != "broadcast"})
        if "all_reduce" in others:
            raise AssertionError(
                t(
                    "rank {rank}'s {function} called dist.all_reduce: averaging the replicas "
                    "makes them equal, but not equal to rank 0's, and it is not what the "
                    "lesson asks. Copy rank 0's tensors with dist.broadcast(tensor, src=0) "
                    "instead.{ended}",
                    rank=rank,
                    function=function,
                    ended=ended,
                )
            )
        if others:
            raise AssertionError(
                t(
                    "rank {rank}'s {function} called {names}: copying rank 0's tensors takes "
                    "only dist.broadcast(tensor, src=0), on every rank.{ended}",
                    rank=rank,
                    function=function,
                    names=", ".join(others),
                    ended=ended,
                )
            )
    counts = [len(calls) for calls in made]
    if any(counts) and not all(counts):
        did = [r for r, count in enumerate(counts) if count]
        skipped = [r for r, count in enumerate(counts) if not count]
        by = ", ".join(
            t("rank {rank} called dist.broadcast {times}", rank=r, times=_times(counts[r]))
            for r in did
        )
        raise AssertionError(
            t(
                "{function}: {by}, {skipped} never did. A broadcast is a collective: "
                "every rank calls it for the same tensors, rank 0 to send them and the "
                "others to receive them into their own. Do not put the broadcasts under an "
                "`if rank == ...`.{ended}",
                function=function,
                by=by,
                skipped=ranks_phrase(skipped),
                ended=ended,
            )
        )
    for index in range(min(counts, default=0)):
        sources = [calls[index][1] for calls in made]
        if len(set(sources)) > 1:
            used = ", ".join(
                t("rank {rank} used src={src}", rank=r, src=src) for r, src in enumerate(sources)
            )
            raise AssertionError(
                t(
                    "{function}: the ranks named different sources in broadcast number "
                    "{number}: {used}. The source is the rank whose tensor everyone gets, so "
                    "every rank must name the same one, rank 0 (src=0), whatever its own "
                    "rank; with different sources the ranks wait for each other for "
                    "ever.{ended}",
                    function=function,
                    number=index + 1,
                    used=used,
                    ended=ended,
                )
            )
    if len(set(counts)) > 1:
        by = ", ".join(
            t("rank {rank} called it {times}", rank=r, times=_times(count))
            for r, count in enumerate(counts)
        )
        raise AssertionError(
            t(
                "{function}: the ranks made different numbers of broadcasts ({by}): every "
                "rank must broadcast the same tensors, in the same order.{ended}",
                function=function,
                by=by,
                ended=ended,
            )
        )
    sources = {src for calls in made for _, src, _ in calls}
    if sources and sources != {0}:
        raise AssertionError(
            t(
                "{function}: every rank broadcast from src={source}: the replicas must all "
                "take rank 0's tensors, src=0.{ended}",
                function=function,
                source=sorted(sources)[0],
                ended=ended,
            )
        )
    if any(failures):
        rank = next(r for r, failure in enumerate(failures) if failure)
        raise AssertionError(
            t(
                "rank {rank}'s {function} raised {failures}",
                rank=rank,
                function=function,
                failures=failures[rank],
            )
        )


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
                        t(
                            "rank {rank} called dist.broadcast(src=0) {times}, but its "
                            "buffer {name!r} still holds its own values: broadcast each "
                            "buffer itself (it is filled in place), not a copy of it, and "
                            "every buffer of model.buffers()",
                            rank=rank,
                            times=_times(len(calls)),
                            name=name,
                        )
                    )
                raise AssertionError(
                    t(
                        "after broadcast_buffers rank {rank}'s {name!r} holds {tensor}..., "
                        "not rank 0's {source}...: dist.broadcast(buffer, src=0) for every "
                        "buffer in model.buffers()",
                        rank=rank,
                        name=name,
                        tensor=tensor.flatten()[:3].tolist(),
                        source=source[name].flatten()[:3].tolist(),
                    )
                )
            assert torch.equal(tensor, before[name]), t(
                "broadcast_buffers changed rank {rank}'s parameter {name!r}: it copies "
                "the buffers only (model.buffers(), not model.parameters() or the "
                "state_dict; averaged gradients keep the parameters identical)",
                rank=rank,
                name=name,
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
                    t(
                        "make_replicas_identical changed rank 0's own {name!r}: rank 0 is "
                        "the source that every rank copies (dist.broadcast(tensor, src=0))",
                        name=name,
                    )
                )
            if name in buffers and torch.equal(after[name], before[name]):
                raise AssertionError(
                    t(
                        "rank {rank}'s BatchNorm buffer {name!r} (a running statistic) still "
                        "holds its own values: make_replicas_identical must call "
                        "broadcast_buffers(model) too. Buffers are not parameters and no "
                        "gradient averages them, yet evaluation uses them.",
                        rank=rank,
                        name=name,
                    )
                )
            if torch.equal(after[name], before[name]):
                if tuple(expected.shape) in _broadcast_shapes(calls):
                    raise AssertionError(
                        t(
                            "rank {rank} broadcast a tensor shaped like its parameter "
                            "{name!r} {shape}, yet {name!r} still holds its own random "
                            "values: broadcast the parameter itself, which dist.broadcast "
                            "fills in place, not a copy of it (param.clone(), "
                            "param.detach().clone(), torch.tensor(param))",
                            rank=rank,
                            name=name,
                            shape=tuple(expected.shape),
                        )
                    )
                raise AssertionError(
                    t(
                        "rank {rank}'s parameter {name!r} still holds its own random values: "
                        "broadcast every parameter from rank 0 (dist.broadcast(param, "
                        "src=0), inside torch.no_grad())",
                        rank=rank,
                        name=name,
                    )
                )
            raise AssertionError(
                t(
                    "rank {rank}'s {name!r} differs from rank 0's by up to "
                    "{max_difference:.3g}: copy rank 0's values exactly",
                    rank=rank,
                    name=name,
                    max_difference=_max_difference(after[name], expected),
                )
            )


# --------------------------------------------------------------------------- step 2: shards


def _shards(kata, num_samples, world_size):
    shards = []
    for rank in range(world_size):
        shard = kata.shard_indices(num_samples, rank, world_size)
        again = kata.shard_indices(num_samples, rank, world_size)
        shard, again = [int(i) for i in shard], [int(i) for i in again]
        assert shard == again, t(
            "shard_indices({num_samples}, {rank}, {world_size}) gave two different "
            "answers: every rank computes the shards on its own, so they must come out "
            "the same every time",
            num_samples=num_samples,
            rank=rank,
            world_size=world_size,
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
        assert not outside, t(
            "rank {rank}'s shard holds indices {outside}, outside 0..{num_samples}",
            rank=rank,
            outside=outside[:5],
            num_samples=num_samples - 1,
        )
        assert len(set(shard)) == len(shard), t(
            "rank {rank}'s shard holds an index twice: {shard}",
            rank=rank,
            shard=shard[:20],
        )
        if world_size > 1 and len(shard) == num_samples:
            raise AssertionError(
                t(
                    "rank {rank} got all {num_samples} samples, the whole data set, as in "
                    "the tutorial: then {world_size} ranks do the same work {world_size} "
                    "times. Each rank takes only its own {num_samples} // {world_size} = "
                    "{per_rank}",
                    rank=rank,
                    num_samples=num_samples,
                    world_size=world_size,
                    per_rank=per_rank,
                )
            )
        assert len(shard) == per_rank, t(
            "with {num_samples} samples and {world_size} ranks, rank {rank} got {count} "
            "samples, expected {num_samples} // {world_size} = {per_rank}. Every rank "
            "needs the same number, or the ranks take different numbers of steps and the "
            "last all_reduce waits for ever: drop the few left over",
            num_samples=num_samples,
            world_size=world_size,
            rank=rank,
            count=len(shard),
            per_rank=per_rank,
        )
    if world_size > 1 and all(shard == shards[0] for shard in shards):
        raise AssertionError(
            t(
                "with {num_samples} samples and {world_size} ranks, every rank got the same "
                "shard {span}: each rank must take its own block, starting at rank * "
                "(num_samples // world_size), or all ranks train on the same samples",
                num_samples=num_samples,
                world_size=world_size,
                span=_span(shards[0]),
            )
        )
    seen = {}
    for rank, shard in enumerate(shards):
        for index in shard:
            assert index not in seen, t(
                "sample {index} is in the shards of rank {seen} and rank {rank}: shards "
                "must be disjoint (ranks that train on the same samples do the same work "
                "twice)",
                index=index,
                seen=seen[index],
                rank=rank,
            )
            seen[index] = rank
    covered = len(seen)
    assert covered == per_rank * world_size, t(
        "the shards cover {covered} of {num_samples} samples, expected {per_rank}",
        covered=covered,
        num_samples=num_samples,
        per_rank=per_rank * world_size,
    )


@pytest.mark.step(2)
@pytest.mark.parametrize(
    "num_samples, rank, world_size, wrong, why",
    [
        (10, 3, 3, "3", lambda: t("rank 3 is not in a world of 3 ranks (0, 1, 2)")),
        (10, -1, 3, "-1", lambda: t("rank -1 is not a rank (ranks count from 0)")),
        (2, 0, 3, "2", lambda: t("2 samples cannot give each of 3 ranks one")),
        (10, 0, 0, "0", lambda: t("a world of 0 ranks has no rank 0")),
    ],
    ids=["rank-past-the-world", "negative-rank", "too-few-samples", "no-ranks"],
)
def test_shards_refuse_impossible_requests(kata, num_samples, rank, world_size, wrong, why):
    why = why()  # in the learner's language

    def returned(got) -> str:
        return t(
            "returned {got}: {why}. Check the request first and raise ValueError saying what is "
            "wrong, or a rank launched with a bad number trains on someone else's samples (or "
            "none)",
            got=list(got)[:10],
            why=why,
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
            this = t("rank {rank}'s train_step number {number}", rank=rank, number=number)
            stepped = step["optimizer_steps"]
            reduces = [(shapes, at) for name, shapes, at in step["calls"] if name == "all_reduce"]
            if not stepped:
                raise AssertionError(
                    t(
                        "{this} never called optimizer.step(): without it the weights never "
                        "change. Call it after averaging the gradients.",
                        this=this,
                    )
                )
            if len(stepped) > 1:
                raise AssertionError(
                    t(
                        "{this} called optimizer.step() {count} times: one step per batch",
                        this=this,
                        count=len(stepped),
                    )
                )
            moment, gradient = stepped[0]
            if gradient == 0:
                raise AssertionError(
                    t(
                        "{this}: every gradient was zero (or None) when optimizer.step() "
                        "ran, so the weights never moved. zero_grad() between backward() and "
                        "step() wipes the gradients backward just computed: zero them before "
                        "loss.backward() (or after optimizer.step()).",
                        this=this,
                    )
                )
            if not reduces:
                raise AssertionError(
                    t(
                        "{this} made no all-reduce: each rank stepped with the gradient of "
                        "its own images only, and the replicas drift apart. Call "
                        "average_gradients(model) (your k04) after loss.backward() and "
                        "before optimizer.step().",
                        this=this,
                    )
                )
            if all(all(s in ((), (1,)) for s in shapes) for shapes, _ in reduces):
                raise AssertionError(
                    t(
                        "{this} all-reduced only a single number (the loss?), never a "
                        "gradient: averaging the loss does not change the gradients each "
                        "rank steps with. Call average_gradients(model) after "
                        "loss.backward(), and return this rank's own loss.",
                        this=this,
                    )
                )
            late = [at for _, at in reduces if at > moment]
            if late:
                raise AssertionError(
                    t(
                        "{this} all-reduced after optimizer.step() ({late} of its {reduces} "
                        "all-reduces came after the step): the step had already used this "
                        "rank's own gradient. Average first (after backward), then step.",
                        this=this,
                        late=len(late),
                        reduces=len(reduces),
                    )
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
        assert isinstance(losses[0], float), t(
            "rank {rank}'s train_step returned {loss}: return this rank's loss as a "
            "float, loss.item()",
            rank=rank,
            loss=losses[0],
        )
    _check_the_step_calls(results)
    initial, expected = _one_process_on_the_whole_batch()
    with torch.no_grad():
        model = _fresh_model()
        for rank, (losses, _, _) in enumerate(results):
            part = slice(rank * per_rank, (rank + 1) * per_rank)
            own = F.cross_entropy(model(images[part]), labels[part]).item()
            assert abs(losses[0] - own) <= 1e-4 * abs(own), t(
                "rank {rank}'s first train_step returned {loss:.5f}, expected "
                "{own:.5f}: the mean cross-entropy (F.cross_entropy) of its own "
                "{per_rank} images, before the step",
                rank=rank,
                loss=losses[0],
                own=own,
                per_rank=per_rank,
            )
    names = list(expected)
    for rank, (_, params, _) in enumerate(results):
        if all(torch.equal(params[n], initial[n]) for n in names):
            raise AssertionError(
                t(
                    "after {STEPS} calls of train_step rank {rank}'s weights have not "
                    "changed: call optimizer.step() after loss.backward()",
                    STEPS=STEPS,
                    rank=rank,
                )
            )
    for rank, (_, params, _) in enumerate(results[1:], start=1):
        name = max(names, key=lambda n: _max_difference(params[n], results[0][1][n]))
        gap = _max_difference(params[name], results[0][1][name])
        assert gap <= 1e-6, t(
            "after {STEPS} steps rank {rank}'s weights differ from rank 0's (by up to "
            "{gap:.3g} in {name!r}): each rank stepped with its own gradient. Call "
            "average_gradients(model) (your k04) after loss.backward() and before "
            "optimizer.step().",
            STEPS=STEPS,
            rank=rank,
            gap=gap,
            name=name,
        )
    got = results[0][1]
    if _same_weights(got, expected):
        return
    name = max(names, key=lambda n: _max_difference(got[n], expected[n]))
    gap = _max_difference(got[name], expected[name])
    head = t(
        "the {world_size} replicas agree with each other, but not with one process that took the "
        "same {steps} steps on the whole batches of {batch} (up to {gap:.3g} apart in {name!r})",
        world_size=world_size,
        steps=STEPS,
        batch=GLOBAL_BATCH,
        gap=gap,
        name=name,
    )
    if _same_weights(got, _one_process_on_the_whole_batch(zero_grad=False)[1]):
        raise AssertionError(
            t(
                "{head}: they match a process that never zeroes its gradients, so each "
                "step's gradients piled onto the last ones. Call optimizer.zero_grad() in "
                "every train_step, before loss.backward().",
                head=head,
            )
        )
    if _same_weights(got, _one_process_on_the_whole_batch(grad_scale=world_size)[1]):
        raise AssertionError(
            t(
                "{head}: they match a process whose gradients are {world_size} times too "
                "large, the sum over the {world_size} ranks instead of their mean. Divide by "
                "the world size (average_gradients does).",
                head=head,
                world_size=world_size,
            )
        )
    raise AssertionError(
        t(
            "{head}. Zero the gradients every step (optimizer.zero_grad() before backward, "
            "or they pile up), use the mean cross-entropy (F.cross_entropy's default), and "
            "average, not sum, the gradients.",
            head=head,
        )
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
        assert key in results[0], t(
            "run_training returned the keys {keys}; it must return {key!r} too",
            keys=sorted(results[0]),
            key=key,
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
                    t(
                        "after training, rank {rank}'s BatchNorm buffer {name!r} differs "
                        "from rank 0's: each rank's running statistics come from its own "
                        "shard. Call broadcast_buffers(model) after each epoch, before "
                        "evaluating (the lesson's BatchNorm note).",
                        rank=rank,
                        name=name,
                    )
                )
            if result["broadcasts_before_training"] == 0:
                raise AssertionError(
                    t(
                        "after training, rank {rank}'s parameter {name!r} differs from rank "
                        "0's: the test has each rank build its model with its own random "
                        "weights, and rank {rank} made no broadcast before its first step. "
                        "Call make_replicas_identical(model) before the loop: a shared seed "
                        "is no guarantee.",
                        rank=rank,
                        name=name,
                    )
                )
            raise AssertionError(
                t(
                    "after training, rank {rank}'s parameter {name!r} differs from rank 0's "
                    "by up to {max_difference:.3g}: did every rank start from rank 0's "
                    "weights (make_replicas_identical before the loop) and average its "
                    "gradients every step?",
                    rank=rank,
                    name=name,
                    max_difference=_max_difference(tensor, source[name]),
                )
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
        assert batches, t(
            "rank {rank}'s run_training never called train_step: train every batch with "
            "train_step(model, optimizer, images, labels)",
            rank=rank,
        )
        sizes = sorted({len(batch) for batch in batches})
        if sizes != [per_rank_batch]:
            if sizes[-1] == BATCH:
                raise AssertionError(
                    t(
                        "rank {rank} trained on batches of {BATCH} images, the whole global "
                        "batch: each rank takes its part of it, batch_size // world_size = "
                        "{per_rank_batch} images (per_rank_batch), so that the {world_size} "
                        "ranks together take {BATCH} per step",
                        rank=rank,
                        BATCH=BATCH,
                        per_rank_batch=per_rank_batch,
                        world_size=world_size,
                    )
                )
            if len(batches[-1]) < per_rank_batch and all(
                len(b) == per_rank_batch for b in batches[:-1]
            ):
                raise AssertionError(
                    t(
                        "rank {rank}'s last batch held {count} images, the rest "
                        "{per_rank_batch}: drop the last partial batch (drop_last=True), so "
                        "that every step averages gradients over batches of the same size",
                        rank=rank,
                        count=len(batches[-1]),
                        per_rank_batch=per_rank_batch,
                    )
                )
            raise AssertionError(
                t(
                    "rank {rank} trained on batches of {names} images, expected "
                    "{per_rank_batch} (batch_size // world_size, per_rank_batch) in every "
                    "step",
                    rank=rank,
                    names=", ".join(map(str, sizes)),
                    per_rank_batch=per_rank_batch,
                )
            )
        samples = [index for batch in batches for index in batch]
        outside = sorted(set(samples) - shard)
        if outside:
            raise AssertionError(
                t(
                    "rank {rank} trained on {count} different samples, {outside} of them "
                    "outside the shard it returned ({shard} samples; for example "
                    "{example}): train on Subset(train_set, shard) only, not on the whole "
                    "train_set",
                    rank=rank,
                    count=len(set(samples)),
                    outside=len(outside),
                    shard=len(shard),
                    example=outside[:3],
                )
            )
        assert len(samples) == len(set(samples)), t(
            "rank {rank} trained on some samples twice in one epoch: load "
            "Subset(train_set, shard) once, and let the DataLoader go through it once "
            "per epoch",
            rank=rank,
        )
        seen.append(set(samples))
    shared = seen[0] & seen[1]
    assert not shared, t(
        "ranks 0 and 1 both trained on {count} of the same samples: give each rank its "
        "own shard (shard_indices(len(train_set), rank, world_size), with this rank's "
        "rank)",
        count=len(shared),
    )
    for rank, result in enumerate(results):
        assert len(result["shard"]) == per_rank, t(
            "rank {rank} trained on {count} samples, expected its shard of {per_rank}",
            rank=rank,
            count=len(result["shard"]),
            per_rank=per_rank,
        )
        assert len(result["losses"]) == EPOCHS * steps, t(
            "rank {rank} recorded {count} losses in {epochs}, expected one per step: "
            "{steps} ({per_rank} samples in batches of {BATCH} // {world_size}, the last "
            "partial batch dropped)",
            rank=rank,
            count=len(result["losses"]),
            epochs=_epochs(EPOCHS),
            steps=steps,
            per_rank=per_rank,
            BATCH=BATCH,
            world_size=world_size,
        )


def _epochs(count: int) -> str:
    return tn("{count} epoch", "{count} epochs", count)


@pytest.mark.step(4)
def test_training_learns_the_digits(kata):
    results = _trained()
    _returned(results)
    losses = results[0]["losses"]
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.5 * first, t(
        "rank 0's loss went from {first:.3f} (mean of the first 5 steps) to {last:.3f} "
        "(the last 5): it should at least halve in one epoch",
        first=first,
        last=last,
    )
    for rank, result in enumerate(results):
        assert len(result["accuracies"]) == EPOCHS, t(
            "rank {rank} returned {count} held-out accuracies for {epochs}: measure it "
            "once after every epoch",
            rank=rank,
            count=len(result["accuracies"]),
            epochs=_epochs(EPOCHS),
        )
        assert result["accuracy"] >= ACCURACY_BAR, t(
            "rank {rank}'s held-out accuracy after {epochs} is {accuracy:.1%}, expected "
            "at least {ACCURACY_BAR:.0%}",
            rank=rank,
            epochs=_epochs(EPOCHS),
            accuracy=result["accuracy"],
            ACCURACY_BAR=ACCURACY_BAR,
        )
    for rank, result in enumerate(results[1:], start=1):
        for epoch, (own, rank_0s) in enumerate(
            zip(result["evaluated_with"], results[0]["evaluated_with"]), start=1
        ):
            assert own == rank_0s, t(
                "rank {rank} measured the held-out accuracy of epoch {epoch} with "
                "BatchNorm statistics (running mean and variance) that differ from rank "
                "0's: each rank's come from its own shard. Call broadcast_buffers(model) "
                "after the epoch, before accuracy(...), so that every rank evaluates the "
                "same model.",
                rank=rank,
                epoch=epoch,
            )
    if results[0]["accuracy"] != results[1]["accuracy"]:
        same = all(
            torch.equal(tensor, results[1]["state_dict"][n])
            for n, tensor in results[0]["state_dict"].items()
        )
        values = {"first": results[0]["accuracy"], "second": results[1]["accuracy"]}
        if same:
            said = t(
                "rank 0 measured {first:.2%} and rank 1 {second:.2%} on the same held-out digits, "
                "although they end with identical weights and buffers: each measured with its own "
                "BatchNorm statistics. Call broadcast_buffers(model) after the epoch, before "
                "accuracy(...).",
                **values,
            )
        else:
            said = t(
                "rank 0 measured {first:.2%} and rank 1 {second:.2%} on the same held-out digits: "
                "identical replicas must agree",
                **values,
            )
        raise AssertionError(said)


def _plotted(plot) -> dict:
    from PIL import Image

    with Image.open(plot) as image:
        text = getattr(image, "text", {}).get("Description")
    assert text, t(
        "{plot} does not say what it plots (no Description text in the PNG)",
        plot=plot,
    )
    return json.loads(text)


@pytest.mark.step(4)
def test_program_trains_reports_from_rank_0_and_plots(kata, tmp_path):
    plot = tmp_path / "curve.png"
    world_size, limit, epochs = 2, 384, 2
    done = run_module_ok(
        KATA,
        *("--world-size", str(world_size), "--epochs", str(epochs), "--limit", str(limit)),
        *("--log-every", "2", "--plot", str(plot), "--backend", "gloo", "--device", "cpu"),
    )
    shown = streams(done)
    lines = done.stdout.splitlines()
    progress = [line for line in lines if "loss" in line]
    assert any(line.startswith(f"[rank 0] epoch 1/{epochs} [") for line in progress), t(
        "no progress bar from rank 0\n{shown}",
        shown=shown,
    )
    assert any(
        line.startswith(f"[rank 0] epoch {epochs}/{epochs}: mean loss")
        and "held-out accuracy" in line
        for line in lines
    ), t(
        "rank 0 must report each epoch's loss and held-out accuracy\n{shown}",
        shown=shown,
    )
    others = [line for line in progress if not line.startswith(("[rank 0]", "[main]"))]
    assert not others, t(
        "only rank 0 may print progress; these came from other ranks:\n{lines}",
        lines="\n".join(others),
    )
    assert f"loss curve saved to {plot.resolve()}" in done.stdout, t(
        "the program must say where the plot is\n{shown}",
        shown=shown,
    )
    assert plot.exists() and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", t(
        "{plot} is not a PNG",
        plot=plot,
    )
    figure = _plotted(plot)
    assert "digits" in figure["title"], t(
        "the plot's title {title!r} must name the data set (digits)",
        title=figure["title"],
    )
    steps = (limit // world_size) // (BATCH // world_size)
    loss_panel, accuracy_panel = figure["panels"]
    labels = [line["label"] for line in loss_panel["lines"]]
    assert labels == [f"rank {rank}" for rank in range(world_size)], t(
        "the loss panel shows the lines {labels}: one line per rank, each rank's own loss",
        labels=labels,
    )
    ys = [line["y"] for line in loss_panel["lines"]]
    for rank, y in enumerate(ys):
        assert len(y) == epochs * steps, t(
            "rank {rank}'s loss line has {count} points, expected one per step: {epochs}",
            rank=rank,
            count=len(y),
            epochs=epochs * steps,
        )
    assert ys[0] != ys[1], t(
        "rank 0's and rank 1's loss lines are the same: each has its own shard"
    )
    [accuracy] = accuracy_panel["lines"]
    assert len(accuracy["y"]) == epochs and all(0 < y <= 100 for y in accuracy["y"]), t(
        "the accuracy panel shows {y}: one held-out accuracy (in %) per epoch",
        y=accuracy["y"],
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
        assert result["cuda_bytes"] > 0, t(
            "rank {rank} trained without touching its GPU: use rank_device()",
            rank=rank,
        )
        assert result["accuracy"] >= ACCURACY_BAR, t(
            "rank {rank}: held-out accuracy {accuracy:.1%}",
            rank=rank,
            accuracy=result["accuracy"],
        )
    for name, tensor in results[0]["state_dict"].items():
        for rank, result in enumerate(results[1:], start=1):
            assert torch.equal(result["state_dict"][name], tensor), t(
                "rank {rank}'s {name!r} differs from rank 0's",
                rank=rank,
                name=name,
            )


@pytest.mark.step(4)
@pytest.mark.cuda
def test_nccl_world_of_one(kata):
    _check_cuda_training(run_world(_train_on_cuda, 1, **on_cuda(1, "nccl", deadline=120)))


@pytest.mark.step(4)
@pytest.mark.cuda
def test_gloo_on_cuda_several_ranks(kata):
    _check_cuda_training(run_world(_train_on_cuda, 2, **on_cuda(2, "gloo", deadline=120)))
