"""k05's mistakes catalogue: real mistakes in data-parallel training by hand (identical replicas,
shards, the step, the loop), and right answers written another way. See
``dojo/dev/mistakes/__init__.py`` for what each list promises."""

from __future__ import annotations

import math
import random

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, Subset

from dojo.dev.mistakes import Mistake, RightAnswer
from dojo.harness import impl

SUM = dist.ReduceOp.SUM


def _k05():
    """The reference module, with this entry swapped in (what every test and rank sees)."""
    return impl.load_kata("k05_data_parallel")


# --------------------------------------------------------------------------- broadcast_buffers


def buffers_via_state_dict(model):
    with torch.no_grad():
        for tensor in model.state_dict().values():  # parameters are in the state_dict too
            dist.broadcast(tensor, src=0)


def buffers_from_the_last_rank(model):
    with torch.no_grad():
        for buffer in model.buffers():
            dist.broadcast(buffer, src=dist.get_world_size() - 1)  # "the last rank is the root"


# --------------------------------------------------------------------------- make_replicas_identical


def parameters_never_broadcast(model):
    _k05().broadcast_buffers(model)  # "broadcast_buffers already does the model"


def buffers_forgotten(model):
    with torch.no_grad():
        for param in model.parameters():  # the BatchNorm statistics stay each rank's own
            dist.broadcast(param, src=0)


def broadcast_from_itself(model):
    with torch.no_grad():
        for param in model.parameters():
            dist.broadcast(param, src=dist.get_rank())  # every rank names itself: they all wait
    _k05().broadcast_buffers(model)


def only_rank_0_broadcasts(model):
    if dist.get_rank() == 0:  # "rank 0 sends its weights"; the receivers never call it
        with torch.no_grad():
            for param in model.parameters():
                dist.broadcast(param, src=0)
            for buffer in model.buffers():
                dist.broadcast(buffer, src=0)


def averaged_the_weights(model):
    size = dist.get_world_size()
    with torch.no_grad():
        for tensor in list(model.parameters()) + list(model.buffers()):
            if tensor.is_floating_point():
                dist.all_reduce(tensor, op=SUM)  # equal replicas, but nobody's weights
                tensor /= size


def broadcast_a_copy(model):
    with torch.no_grad():
        for param in model.parameters():
            dist.broadcast(param.detach().clone(), src=0)  # received into a copy, then dropped
    _k05().broadcast_buffers(model)


# Right answers written differently.


def one_flat_vector(model):
    """One broadcast for every parameter at once."""
    from torch.nn.utils import parameters_to_vector, vector_to_parameters

    with torch.no_grad():
        flat = parameters_to_vector(model.parameters())
        dist.broadcast(flat, src=0)
        vector_to_parameters(flat, model.parameters())
    _k05().broadcast_buffers(model)


def whole_state_dict(model):
    """The state_dict holds the parameters and the buffers, sharing their storage."""
    for tensor in model.state_dict().values():
        dist.broadcast(tensor, src=0)


# --------------------------------------------------------------------------- shard_indices


def _checked(num_samples, rank, world_size):
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of {world_size} (0..{world_size - 1})")
    if num_samples < world_size:
        raise ValueError(f"{num_samples} samples cannot give each of {world_size} ranks a shard")


def whole_data_for_every_rank(num_samples, rank, world_size):
    _checked(num_samples, rank, world_size)
    return list(range(num_samples))  # the tutorial's way: every rank does all the work


def same_block_for_every_rank(num_samples, rank, world_size):
    _checked(num_samples, rank, world_size)
    return list(range(num_samples // world_size))  # forgot to start at rank * per_rank


def strided_with_leftovers(num_samples, rank, world_size):
    _checked(num_samples, rank, world_size)
    return list(range(rank, num_samples, world_size))  # the first ranks get one sample more


def last_rank_takes_the_rest(num_samples, rank, world_size):
    _checked(num_samples, rank, world_size)
    per_rank = num_samples // world_size
    end = num_samples if rank == world_size - 1 else (rank + 1) * per_rank  # "waste nothing"
    return list(range(rank * per_rank, end))


def ceil_blocks(num_samples, rank, world_size):
    _checked(num_samples, rank, world_size)
    per_rank = math.ceil(num_samples / world_size)  # the last shard comes up short
    return list(range(rank * per_rank, min((rank + 1) * per_rank, num_samples)))


def shuffled_without_a_seed(num_samples, rank, world_size):
    _checked(num_samples, rank, world_size)
    order = random.sample(range(num_samples), num_samples)  # a different order on every rank
    per_rank = num_samples // world_size
    return order[rank * per_rank : (rank + 1) * per_rank]


def no_checks(num_samples, rank, world_size):
    per_rank = num_samples // max(world_size, 1)
    return list(range(rank * per_rank, (rank + 1) * per_rank))


def vague_value_error(num_samples, rank, world_size):
    if world_size < 1 or not 0 <= rank < world_size or num_samples < world_size:
        raise ValueError("invalid shard request")
    per_rank = num_samples // world_size
    return list(range(rank * per_rank, (rank + 1) * per_rank))


# Right answers written differently.


def strided_equal(num_samples, rank, world_size):
    """Every world_size-th sample, as DistributedSampler deals them, the leftovers cut first."""
    _checked(num_samples, rank, world_size)
    per_rank = num_samples // world_size
    return list(range(rank, per_rank * world_size, world_size))


def chunked(num_samples, rank, world_size):
    _checked(num_samples, rank, world_size)
    per_rank = num_samples // world_size
    return torch.arange(per_rank * world_size).chunk(world_size)[rank].tolist()


# --------------------------------------------------------------------------- train_step


def _average(model):
    return _k05().average_gradients(model)


def no_averaging(model, optimizer, images, labels):
    loss = F.cross_entropy(model(images), labels)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()  # the single-process step: each rank follows its own gradient
    return loss.item()


def loss_all_reduced(model, optimizer, images, labels):
    loss = F.cross_entropy(model(images), labels)
    optimizer.zero_grad()
    loss.backward()
    mean = loss.detach().clone()
    dist.all_reduce(mean, op=SUM)  # "average the loss over the ranks": the gradients stay apart
    optimizer.step()
    return (mean / dist.get_world_size()).item()


def zero_grad_forgotten(model, optimizer, images, labels):
    loss = F.cross_entropy(model(images), labels)
    loss.backward()  # on top of the last step's gradients
    _average(model)
    optimizer.step()
    return loss.item()


def zero_grad_after_backward(model, optimizer, images, labels):
    loss = F.cross_entropy(model(images), labels)
    loss.backward()
    _average(model)
    optimizer.zero_grad()  # wipes what backward just computed
    optimizer.step()
    return loss.item()


def averaged_after_step(model, optimizer, images, labels):
    loss = F.cross_entropy(model(images), labels)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    _average(model)  # too late: the step used this rank's own gradient
    return loss.item()


def summed_gradients(model, optimizer, images, labels):
    loss = F.cross_entropy(model(images), labels)
    optimizer.zero_grad()
    loss.backward()
    for param in model.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad, op=SUM)  # the sum: a step world_size times too long
    optimizer.step()
    return loss.item()


def returns_the_tensor(model, optimizer, images, labels):
    loss = F.cross_entropy(model(images), labels)
    optimizer.zero_grad()
    loss.backward()
    _average(model)
    optimizer.step()
    return loss  # a tensor with its graph, not a number


def summed_loss(model, optimizer, images, labels):
    loss = F.cross_entropy(model(images), labels, reduction="sum")  # scales with the batch
    optimizer.zero_grad()
    loss.backward()
    _average(model)
    optimizer.step()
    return loss.item()


# Right answers written differently.


def zero_grad_first(model, optimizer, images, labels):
    model.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(images), labels)
    loss.backward()
    _average(model)
    optimizer.step()
    return float(loss)


def zero_grad_after_step(model, optimizer, images, labels):
    loss = F.cross_entropy(model(images), labels)
    loss.backward()
    _average(model)
    optimizer.step()
    optimizer.zero_grad()  # ready for the next batch
    return loss.item()


# --------------------------------------------------------------------------- run_training


def _training(
    rank,
    world_size,
    epochs,
    batch_size,
    lr,
    seed,
    data,
    data_root,
    download,
    log_every,
    show_progress,
    limit,
    same_start=True,
    shard_of=None,
    whole_data=False,
    whole_batch=False,
    drop_last=True,
    buffers=True,
    buffers_after_accuracy=False,
    progress_everywhere=False,
    sampler=False,
):
    """The reference loop, with one thing done the way a learner might."""
    k05 = _k05()
    device = k05.rank_device()
    per_rank_batch = k05._per_rank_batch(batch_size, world_size)
    train_set = k05.datasets.load(data, "train", data_root, download)
    test_set = k05.datasets.load(data, "test", data_root, download)
    if limit is not None:
        train_set = Subset(train_set, range(min(limit, len(train_set))))
    torch.manual_seed(seed)
    model = k05.ConvNet().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=k05.MOMENTUM)

    if same_start:
        k05.make_replicas_identical(model)
    generator = torch.Generator().manual_seed(seed * 1000 + rank)
    if sampler:
        from torch.utils.data.distributed import DistributedSampler

        chooser = DistributedSampler(train_set, world_size, rank, seed=seed, drop_last=True)
        shard = list(chooser)
        loader = DataLoader(train_set, batch_size=per_rank_batch, sampler=chooser, drop_last=True)
    else:
        shard = k05.shard_indices(
            len(train_set), rank if shard_of is None else shard_of, world_size
        )
        loader = DataLoader(
            train_set if whole_data else Subset(train_set, shard),
            batch_size=batch_size if whole_batch else per_rank_batch,
            shuffle=True,
            drop_last=drop_last,
            generator=generator,
        )
    k05._check_steps(len(loader), len(shard), per_rank_batch)
    losses, epoch_losses, accuracies = [], [], []
    for epoch in range(1, epochs + 1):
        model.train()
        if sampler:
            chooser.set_epoch(epoch - 1)  # a new order each epoch (the shard of epoch 1 returned)
        for step, (images, labels) in enumerate(loader, start=1):
            losses.append(k05.train_step(model, optimizer, images.to(device), labels.to(device)))
            if (rank == 0 or progress_everywhere) and show_progress:
                k05.show_step(rank, epoch, epochs, step, len(loader), losses[-1], log_every)
        if buffers and not buffers_after_accuracy:
            k05.broadcast_buffers(model)
        accuracies.append(k05.accuracy(model, test_set, device=device))
        if buffers and buffers_after_accuracy:
            k05.broadcast_buffers(model)
        epoch_losses.append(sum(losses[-len(loader) :]) / len(loader))
        if rank == 0 or progress_everywhere:
            k05.show_epoch(rank, epoch, epochs, epoch_losses[-1], accuracies[-1])
    return {
        "losses": losses,
        "epoch_losses": epoch_losses,
        "accuracies": accuracies,
        "accuracy": accuracies[-1] if accuracies else float("nan"),
        "shard": shard,
        "state_dict": {name: t.detach().cpu().clone() for name, t in model.state_dict().items()},
    }


# Each has run_training's own signature; locals() at the top holds exactly its arguments.


def loop_without_broadcast(
    rank, world_size, epochs=1, batch_size=64, lr=0.01, seed=0, data="digits",
    data_root=None, download=False, log_every=10, show_progress=True, limit=None,
):  # fmt: skip
    # "torch.manual_seed(seed) makes every replica the same": only if each builds it the same way
    return _training(**locals(), same_start=False)


def whole_batch_per_rank(
    rank, world_size, epochs=1, batch_size=64, lr=0.01, seed=0, data="digits",
    data_root=None, download=False, log_every=10, show_progress=True, limit=None,
):  # fmt: skip
    # DataLoader(..., batch_size=batch_size): each rank takes the whole global batch
    return _training(**locals(), whole_batch=True)


def whole_data_per_rank(
    rank, world_size, epochs=1, batch_size=64, lr=0.01, seed=0, data="digits",
    data_root=None, download=False, log_every=10, show_progress=True, limit=None,
):  # fmt: skip
    # computes its shard, then hands the DataLoader the whole train_set
    return _training(**locals(), whole_data=True)


def rank_0s_shard_everywhere(
    rank, world_size, epochs=1, batch_size=64, lr=0.01, seed=0, data="digits",
    data_root=None, download=False, log_every=10, show_progress=True, limit=None,
):  # fmt: skip
    # shard_indices(len(train_set), 0, world_size): every rank trains on rank 0's shard
    return _training(**locals(), shard_of=0)


def partial_last_batch(
    rank, world_size, epochs=1, batch_size=64, lr=0.01, seed=0, data="digits",
    data_root=None, download=False, log_every=10, show_progress=True, limit=None,
):  # fmt: skip
    # DataLoader without drop_last=True: the last step of each epoch has a short batch
    return _training(**locals(), drop_last=False)


def buffers_never_broadcast(
    rank, world_size, epochs=1, batch_size=64, lr=0.01, seed=0, data="digits",
    data_root=None, download=False, log_every=10, show_progress=True, limit=None,
):  # fmt: skip
    # "the gradients are averaged, so the models are identical": not their BatchNorm statistics
    return _training(**locals(), buffers=False)


def accuracy_before_buffers(
    rank, world_size, epochs=1, batch_size=64, lr=0.01, seed=0, data="digits",
    data_root=None, download=False, log_every=10, show_progress=True, limit=None,
):  # fmt: skip
    # evaluates first, then broadcasts the buffers: each rank measured its own statistics
    return _training(**locals(), buffers_after_accuracy=True)


def progress_from_every_rank(
    rank, world_size, epochs=1, batch_size=64, lr=0.01, seed=0, data="digits",
    data_root=None, download=False, log_every=10, show_progress=True, limit=None,
):  # fmt: skip
    # no `if rank == 0` around the progress: N ranks print the same lines
    return _training(**locals(), progress_everywhere=True)


# Right answers written differently.


def with_distributed_sampler(
    rank, world_size, epochs=1, batch_size=64, lr=0.01, seed=0, data="digits",
    data_root=None, download=False, log_every=10, show_progress=True, limit=None,
):  # fmt: skip
    """What torch offers for the shards: DistributedSampler (strided, the leftovers dropped)."""
    return _training(**locals(), sampler=True)


# --------------------------------------------------------------------------- the catalogue

_STEP_TEST = "test_ranks_on_shards_step_like_one_process_on_the_whole_batch"
_SHARD_TEST = "test_shards_are_disjoint_equal_and_cover_the_data"

# Each mistake must fail the named tests with a message that says all of `says`.
MISTAKES = [
    Mistake(
        "buffers_via_state_dict",
        replaces="broadcast_buffers",
        fails=["test_broadcast_buffers_copies_rank_0s_statistics_only"],
        says=[
            "broadcast_buffers changed rank 1's parameter",
            "not model.parameters() or the state_dict",
        ],
    ),
    Mistake(
        "buffers_from_the_last_rank",
        replaces="broadcast_buffers",
        fails=["test_broadcast_buffers_copies_rank_0s_statistics_only"],
        says=["every rank broadcast from src=2", "rank 0's tensors, src=0"],
    ),
    Mistake(
        "parameters_never_broadcast",
        replaces="make_replicas_identical",
        fails=["test_make_replicas_identical_copies_rank_0"],
        says=["still holds its own random values", "broadcast every parameter from rank 0"],
    ),
    Mistake(
        "buffers_forgotten",
        replaces="make_replicas_identical",
        fails=["test_make_replicas_identical_copies_rank_0"],
        says=["BatchNorm buffer", "must call broadcast_buffers(model) too"],
    ),
    Mistake(
        "broadcast_from_itself",
        replaces="make_replicas_identical",
        fails=["test_make_replicas_identical_copies_rank_0"],
        says=[
            "rank 0 used src=0, rank 1 used src=1, rank 2 used src=2",
            "every rank must name the same one, rank 0 (src=0)",
            "the broadcasts never completed",
        ],
    ),
    Mistake(
        "only_rank_0_broadcasts",
        replaces="make_replicas_identical",
        fails=["test_make_replicas_identical_copies_rank_0"],
        says=["rank 0 called dist.broadcast", "ranks 1 and 2 never did", "`if rank == ...`"],
    ),
    Mistake(
        "averaged_the_weights",
        replaces="make_replicas_identical",
        fails=["test_make_replicas_identical_copies_rank_0"],
        says=["called dist.all_reduce", "Copy rank 0's tensors with dist.broadcast(tensor, src=0)"],
    ),
    Mistake(
        "broadcast_a_copy",
        replaces="make_replicas_identical",
        fails=["test_make_replicas_identical_copies_rank_0"],
        says=["still holds its own random values", "not a copy of it"],
    ),
    Mistake(
        "whole_data_for_every_rank",
        replaces="shard_indices",
        fails=[f"{_SHARD_TEST}[1438-4]"],
        says=["rank 0 got all 1438 samples", "only its own"],
    ),
    Mistake(
        "same_block_for_every_rank",
        replaces="shard_indices",
        fails=[f"{_SHARD_TEST}[1438-4]"],
        says=["every rank got the same shard", "rank * (num_samples // world_size)"],
    ),
    Mistake(
        "strided_with_leftovers",
        replaces="shard_indices",
        fails=[f"{_SHARD_TEST}[1438-4]"],
        says=["rank 0 got 360 samples, expected 1438 // 4 = 359", "drop the few left over"],
    ),
    Mistake(
        "last_rank_takes_the_rest",
        replaces="shard_indices",
        fails=[f"{_SHARD_TEST}[1438-4]"],
        says=["rank 3 got 361 samples", "drop the few left over"],
    ),
    Mistake(
        "ceil_blocks",
        replaces="shard_indices",
        fails=[f"{_SHARD_TEST}[1438-4]"],
        says=["rank 0 got 360 samples", "Every rank needs the same number"],
    ),
    Mistake(
        "shuffled_without_a_seed",
        replaces="shard_indices",
        fails=[f"{_SHARD_TEST}[1438-4]"],
        says=["gave two different answers"],
    ),
    Mistake(
        "no_checks",
        replaces="shard_indices",
        fails=["test_shards_refuse_impossible_requests"],
        says=["returned", "raise ValueError saying what is wrong"],
    ),
    Mistake(
        "vague_value_error",
        replaces="shard_indices",
        fails=["test_shards_refuse_impossible_requests"],
        says=["raised ValueError('invalid shard request')", "say which number is wrong"],
    ),
    Mistake(
        "no_averaging",
        replaces="train_step",
        fails=[_STEP_TEST],
        says=["made no all-reduce", "Call average_gradients(model)"],
    ),
    Mistake(
        "loss_all_reduced",
        replaces="train_step",
        fails=[_STEP_TEST],
        says=["all-reduced only a single number (the loss?), never a gradient"],
    ),
    Mistake(
        "zero_grad_forgotten",
        replaces="train_step",
        fails=[_STEP_TEST],
        says=["a process that never zeroes its gradients", "optimizer.zero_grad()"],
    ),
    Mistake(
        "zero_grad_after_backward",
        replaces="train_step",
        fails=[_STEP_TEST],
        says=["every gradient was zero", "zero them before loss.backward()"],
    ),
    Mistake(
        "averaged_after_step",
        replaces="train_step",
        fails=[_STEP_TEST],
        says=["all-reduced after optimizer.step()", "Average first"],
    ),
    Mistake(
        "summed_gradients",
        replaces="train_step",
        fails=[_STEP_TEST],
        says=["the sum over the 4 ranks instead of their mean", "Divide by the world size"],
    ),
    Mistake(
        "returns_the_tensor",
        replaces="train_step",
        fails=[_STEP_TEST],
        says=["returned a Tensor", "loss.item()"],
    ),
    Mistake(
        "summed_loss",
        replaces="train_step",
        fails=[_STEP_TEST],
        says=["the mean cross-entropy (F.cross_entropy)"],
    ),
    Mistake(
        "loop_without_broadcast",
        replaces="run_training",
        fails=["test_training_keeps_the_replicas_identical"],
        says=["made no broadcast before its first step", "make_replicas_identical(model)"],
    ),
    Mistake(
        "whole_batch_per_rank",
        replaces="run_training",
        fails=["test_training_gives_every_rank_its_own_shard"],
        says=["batches of 64 images, the whole global batch", "batch_size // world_size = 32"],
    ),
    Mistake(
        "whole_data_per_rank",
        replaces="run_training",
        fails=["test_training_gives_every_rank_its_own_shard"],
        says=["outside the shard it returned", "not on the whole train_set"],
    ),
    Mistake(
        "rank_0s_shard_everywhere",
        replaces="run_training",
        fails=["test_training_gives_every_rank_its_own_shard"],
        says=[
            "ranks 0 and 1 both trained on",
            "of the same samples",
            "give each rank its own shard",
        ],
    ),
    Mistake(
        "partial_last_batch",
        replaces="run_training",
        fails=["test_training_gives_every_rank_its_own_shard"],
        says=["last batch held 15 images", "drop_last=True"],
    ),
    Mistake(
        "buffers_never_broadcast",
        replaces="run_training",
        fails=["test_training_keeps_the_replicas_identical"],
        says=["BatchNorm buffer", "Call broadcast_buffers(model) after each epoch"],
    ),
    Mistake(
        "accuracy_before_buffers",
        replaces="run_training",
        fails=["test_training_learns_the_digits"],
        says=["with BatchNorm statistics", "that differ from rank 0's", "before accuracy(...)"],
    ),
    Mistake(
        "progress_from_every_rank",
        replaces="run_training",
        fails=["test_program_trains_reports_from_rank_0_and_plots"],
        says=["only rank 0 may print progress", "[rank 1] epoch 1/2"],
    ),
]

# Each right answer must pass every test of its step.
RIGHT_ANSWERS = [
    RightAnswer("one_flat_vector", replaces="make_replicas_identical"),
    RightAnswer("whole_state_dict", replaces="make_replicas_identical"),
    RightAnswer("strided_equal", replaces="shard_indices"),
    RightAnswer("chunked", replaces="shard_indices"),
    RightAnswer("zero_grad_first", replaces="train_step"),
    RightAnswer("zero_grad_after_step", replaces="train_step"),
    RightAnswer("with_distributed_sampler", replaces="run_training"),
]
