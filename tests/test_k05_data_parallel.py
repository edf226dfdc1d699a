"""k05 data-parallel training by hand: identical replicas, disjoint shards, the step, the loop."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from dojo import data
from dojo.impl import load_kata
from dojo.models import ConvNet
from dojo.testing import require_gpus, run_program
from dojo.world import run_world

KATA = "k05_data_parallel"


def _device() -> torch.device:
    from dojo.devices import rank_device

    return rank_device()


def _max_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


# --------------------------------------------------------------------------- step 1: same start


def _replicas(rank, world_size, function="make_replicas_identical"):
    torch.manual_seed(100 + rank)  # every rank builds different weights...
    model = ConvNet().to(_device())
    with torch.no_grad():  # ...and different BatchNorm statistics, as after training on a shard
        for name, buffer in model.named_buffers():
            buffer.fill_(rank + (1 if "var" in name else 0))
    before = {name: t.detach().cpu().clone() for name, t in model.state_dict().items()}
    getattr(load_kata(KATA), function)(model)
    after = {name: t.detach().cpu().clone() for name, t in model.state_dict().items()}
    return before, after


def _is_buffer(name: str) -> bool:
    return "running" in name or "num_batches" in name


@pytest.mark.step(1)
def test_broadcast_buffers_copies_rank_0s_statistics_only(kata):
    results = run_world(_replicas, 3, "broadcast_buffers")
    source = results[0][0]
    for rank, (before, after) in enumerate(results):
        for name, tensor in after.items():
            if _is_buffer(name):
                assert torch.equal(tensor, source[name]), (
                    f"after broadcast_buffers rank {rank}'s {name!r} holds {tensor.flatten()[:3].tolist()}..., "
                    f"not rank 0's {source[name].flatten()[:3].tolist()}...: dist.broadcast(buffer, src=0) "
                    "for every buffer in model.buffers()"
                )
            else:
                assert torch.equal(tensor, before[name]), (
                    f"broadcast_buffers changed rank {rank}'s parameter {name!r}: it copies the buffers "
                    "only (averaged gradients keep the parameters identical)"
                )


@pytest.mark.step(1)
def test_make_replicas_identical_copies_rank_0(kata):
    results = run_world(_replicas, 3)
    source = results[0][0]
    buffers = {name for name in source if _is_buffer(name)}
    for rank, (before, after) in enumerate(results):
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
        assert len(shard) == per_rank, (
            f"with {num_samples} samples and {world_size} ranks, rank {rank} got {len(shard)} samples, "
            f"expected {num_samples} // {world_size} = {per_rank}. Every rank needs the same number, "
            "or the ranks take different numbers of steps and the last all_reduce waits for ever: "
            "drop the few left over"
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
    "num_samples, rank, world_size", [(10, 3, 3), (10, -1, 3), (2, 0, 3), (10, 0, 0)]
)
def test_shards_refuse_impossible_requests(kata, num_samples, rank, world_size):
    with pytest.raises(ValueError) as caught:
        kata.shard_indices(num_samples, rank, world_size)
    assert str(caught.value), "say what is wrong with the request"


# --------------------------------------------------------------------------- step 3: the step

GLOBAL_BATCH, STEPS, LR = 8, 3, 0.1


def _batches():
    images, labels = data.load("digits", "train").tensors
    return images[: GLOBAL_BATCH * STEPS], labels[: GLOBAL_BATCH * STEPS]


def _fresh_model():
    torch.manual_seed(0)
    return ConvNet(batch_norm=False)


def _step_on_shards(rank, world_size):
    kata = load_kata(KATA)
    images, labels = _batches()
    model = _fresh_model().to(_device())  # the same seed: identical replicas without a broadcast
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    per_rank = GLOBAL_BATCH // world_size
    losses = []
    for step in range(STEPS):
        part = slice(
            step * GLOBAL_BATCH + rank * per_rank, step * GLOBAL_BATCH + (rank + 1) * per_rank
        )
        loss = kata.train_step(
            model, optimizer, images[part].to(_device()), labels[part].to(_device())
        )
        losses.append(loss if isinstance(loss, (float, int)) else f"a {type(loss).__name__}")
    return losses, {name: p.detach().cpu().clone() for name, p in model.named_parameters()}


def _one_process_on_the_whole_batch():
    images, labels = _batches()
    model = _fresh_model()
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        part = slice(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH)
        loss = F.cross_entropy(model(images[part]), labels[part])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return initial, {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.step(3)
def test_ranks_on_shards_step_like_one_process_on_the_whole_batch(kata):
    world_size = 4
    results = run_world(_step_on_shards, world_size)
    initial, expected = _one_process_on_the_whole_batch()
    images, labels = _batches()
    per_rank = GLOBAL_BATCH // world_size
    with torch.no_grad():
        model = _fresh_model()
        for rank, (losses, _) in enumerate(results):
            assert isinstance(losses[0], float), (
                f"train_step returned {losses[0]}: return this rank's loss as a float, loss.item()"
            )
            part = slice(rank * per_rank, (rank + 1) * per_rank)
            own = F.cross_entropy(model(images[part]), labels[part]).item()
            assert abs(losses[0] - own) <= 1e-4 * abs(own), (
                f"rank {rank}'s first train_step returned {losses[0]:.5f}, expected {own:.5f}: the "
                f"mean cross-entropy (F.cross_entropy) of its own {per_rank} images, before the step"
            )
    names = list(expected)
    for rank, (_, params) in enumerate(results):
        if all(torch.equal(params[n], initial[n]) for n in names):
            raise AssertionError(
                f"after {STEPS} calls of train_step rank {rank}'s weights have not changed: call "
                "optimizer.step() after loss.backward()"
            )
    for rank, (_, params) in enumerate(results[1:], start=1):
        name = max(names, key=lambda n: _max_difference(params[n], results[0][1][n]))
        gap = _max_difference(params[name], results[0][1][name])
        assert gap <= 1e-6, (
            f"after {STEPS} steps rank {rank}'s weights differ from rank 0's (by up to {gap:.3g} in "
            f"{name!r}): each rank stepped with its own gradient. Call average_gradients(model) "
            "(your k04) after loss.backward() and before optimizer.step()."
        )
    name = max(names, key=lambda n: _max_difference(results[0][1][n], expected[n]))
    gap = _max_difference(results[0][1][name], expected[name])
    assert torch.allclose(results[0][1][name], expected[name], rtol=1e-4, atol=1e-5), (
        f"the {world_size} replicas agree with each other, but not with one process that took the "
        f"same {STEPS} steps on the whole batches of {GLOBAL_BATCH} (up to {gap:.3g} apart in "
        f"{name!r}). Zero the gradients every step (optimizer.zero_grad() before backward, or they "
        "pile up), use the mean cross-entropy (F.cross_entropy's default), and average, not sum, "
        "the gradients."
    )


# --------------------------------------------------------------------------- step 4: the loop

EPOCHS, BATCH = 1, 64
ACCURACY_BAR = 0.85  # one epoch on 2 ranks reaches ~95 % on the held-out digits


def _train(rank, world_size):
    return load_kata(KATA).run_training(
        rank, world_size, epochs=EPOCHS, batch_size=BATCH, show_progress=False
    )


@functools.cache
def _trained(world_size: int = 2):
    """One training run on 2 ranks, shared by the tests below (a raised todo is not cached)."""
    return run_world(_train, world_size, deadline=60)


@pytest.mark.step(4)
def test_training_keeps_the_replicas_identical(kata):
    results = _trained()
    for key in ("losses", "accuracy", "state_dict", "shard"):
        assert key in results[0], (
            f"run_training returned the keys {sorted(results[0])}; it must return {key!r} too"
        )
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
            raise AssertionError(
                f"after training, rank {rank}'s parameter {name!r} differs from rank 0's by up to "
                f"{_max_difference(tensor, source[name]):.3g}: did every rank start from rank 0's "
                "weights (make_replicas_identical before the loop) and average its gradients every step?"
            )


@pytest.mark.step(4)
def test_training_gives_every_rank_its_own_shard(kata):
    results = _trained()
    train_size = len(data.load("digits", "train"))
    shards = [set(int(i) for i in r["shard"]) for r in results]
    assert not shards[0] & shards[1], (
        f"ranks 0 and 1 both trained on {len(shards[0] & shards[1])} of the same samples: give each "
        "rank its own shard (shard_indices(len(train_set), rank, world_size))"
    )
    per_rank = train_size // len(results)
    steps = per_rank // (BATCH // len(results))
    for rank, result in enumerate(results):
        assert len(result["shard"]) == per_rank, (
            f"rank {rank} trained on {len(result['shard'])} samples, expected its shard of {per_rank}"
        )
        assert len(result["losses"]) == EPOCHS * steps, (
            f"rank {rank} recorded {len(result['losses'])} losses in {EPOCHS} epoch(s), expected one "
            f"per step: {steps} ({per_rank} samples in batches of {BATCH} // {len(results)}, the last "
            "partial batch dropped)"
        )


@pytest.mark.step(4)
def test_training_learns_the_digits(kata):
    results = _trained()
    losses = results[0]["losses"]
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.5 * first, (
        f"rank 0's loss went from {first:.3f} (mean of the first 5 steps) to {last:.3f} (the last 5): "
        "it should at least halve in one epoch"
    )
    for rank, result in enumerate(results):
        assert result["accuracy"] >= ACCURACY_BAR, (
            f"rank {rank}'s held-out accuracy after {EPOCHS} epoch is {result['accuracy']:.1%}, "
            f"expected at least {ACCURACY_BAR:.0%}"
        )
    assert results[0]["accuracy"] == results[1]["accuracy"], (
        f"rank 0 measured {results[0]['accuracy']:.2%} and rank 1 {results[1]['accuracy']:.2%} on the "
        "same held-out digits: identical replicas must agree"
    )


@pytest.mark.step(4)
def test_program_trains_reports_from_rank_0_and_plots(kata, tmp_path):
    plot = tmp_path / "curve.png"
    done = run_program(
        KATA,
        "--world-size",
        "2",
        "--epochs",
        "1",
        "--limit",
        "384",
        "--log-every",
        "2",
        "--plot",
        str(plot),
        "--backend",
        "gloo",
        "--device",
        "cpu",
        timeout=120,
    )
    shown = f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    assert done.returncode == 0, f"the program exited with status {done.returncode}\n{shown}"
    lines = done.stdout.splitlines()
    progress = [line for line in lines if "loss" in line]
    assert any(line.startswith("[rank 0] epoch 1/1 [") for line in progress), (
        f"no progress bar from rank 0\n{shown}"
    )
    assert any(
        line.startswith("[rank 0] epoch 1/1: mean loss") and "held-out accuracy" in line
        for line in lines
    ), f"rank 0 must report the epoch's loss and held-out accuracy\n{shown}"
    others = [line for line in progress if not line.startswith(("[rank 0]", "[main]"))]
    assert not others, "only rank 0 may print progress; these came from other ranks:\n" + "\n".join(
        others
    )
    assert f"loss curve saved to {plot.resolve()}" in done.stdout, (
        f"the program must say where the plot is\n{shown}"
    )
    assert plot.exists() and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f"{plot} is not a PNG"


# --------------------------------------------------------------------------- CUDA


def _train_on_cuda(rank, world_size):
    # With fewer GPUs than ranks, gloo lets ranks share them (rank_device() hands them out).
    torch.cuda.set_device(_device())
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
    require_gpus(1)
    _check_cuda_training(
        run_world(_train_on_cuda, 1, backend="nccl", env={"DOJO_DEVICE": "cuda"}, deadline=120)
    )


@pytest.mark.step(4)
@pytest.mark.cuda
def test_gloo_on_cuda_several_ranks(kata):
    require_gpus(1)
    _check_cuda_training(
        run_world(_train_on_cuda, 2, backend="gloo", env={"DOJO_DEVICE": "cuda"}, deadline=120)
    )
