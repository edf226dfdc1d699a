"""k11's mistakes catalogue: real mistakes in gradient accumulation (the micro-batches, the step
by hand, the step with torch's DDP), and right answers written another way. See
``dojo/dev/mistakes/__init__.py`` for what each list promises."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from dojo.dev.mistakes import Mistake, RightAnswer
from dojo.harness import impl
from dojo.toy_models import loss as toy_loss


def _k11():
    """The reference module, with this entry swapped in (what every test and rank sees)."""
    return impl.load_kata("k11_grad_accumulation")


def _check(size, k):
    if k < 1:
        raise ValueError(f"accumulation_steps must be at least 1, got {k}")
    if size % k:
        raise ValueError(f"a batch of {size} does not split into {k} equal micro-batches")


# --------------------------------------------------------------------------- split_batch


def micro_batch_size_confused(batch, accumulation_steps):
    inputs, targets = batch
    _check(len(inputs), accumulation_steps)
    # torch.split takes the size of each piece: k samples each, not k pieces
    return list(zip(inputs.split(accumulation_steps), targets.split(accumulation_steps)))


def chunked_unchecked(batch, accumulation_steps):
    inputs, targets = batch
    if accumulation_steps < 1:
        raise ValueError(f"accumulation_steps must be at least 1, got {accumulation_steps}")
    # "chunk handles the remainder": 10 into 4 gives 3, 3, 3 and 1
    return list(zip(inputs.chunk(accumulation_steps), targets.chunk(accumulation_steps)))


def remainder_dropped(batch, accumulation_steps):
    inputs, targets = batch
    if accumulation_steps < 1:
        raise ValueError(f"accumulation_steps must be at least 1, got {accumulation_steps}")
    micro = len(inputs) // accumulation_steps  # the last few samples are never trained on
    return [
        (inputs[i * micro : (i + 1) * micro], targets[i * micro : (i + 1) * micro])
        for i in range(accumulation_steps)
    ]


# Right answers written differently.


def with_chunk_after_the_check(batch, accumulation_steps):
    inputs, targets = batch
    _check(len(inputs), accumulation_steps)
    return list(zip(inputs.chunk(accumulation_steps), targets.chunk(accumulation_steps)))


def with_tensor_split(batch, accumulation_steps):
    inputs, targets = batch
    _check(len(inputs), accumulation_steps)
    pieces = zip(
        torch.tensor_split(inputs, accumulation_steps),
        torch.tensor_split(targets, accumulation_steps),
    )
    return [(x, y) for x, y in pieces]


# --------------------------------------------------------------------------- accumulation_step


def _average(model):
    return _k11().average_gradients(model)


def _micro_batches(batch, k):
    return _k11().split_batch(batch, k)


def loss_not_divided(model, optimizer, batch, accumulation_steps):
    optimizer.zero_grad()
    total = 0.0
    for micro_batch in _micro_batches(batch, accumulation_steps):
        loss = toy_loss(model, micro_batch)  # each micro-batch's mean: k of them add up to k x
        loss.backward()
        total += loss.item() / accumulation_steps
    _average(model)
    optimizer.step()
    return total


def zero_grad_every_micro_batch(model, optimizer, batch, accumulation_steps):
    total = 0.0
    for micro_batch in _micro_batches(batch, accumulation_steps):
        optimizer.zero_grad()  # the habit from the ordinary loop: wipes the micro-batches before
        loss = toy_loss(model, micro_batch) / accumulation_steps
        loss.backward()
        total += loss.item()
    _average(model)
    optimizer.step()
    return total


def averaged_every_micro_batch(model, optimizer, batch, accumulation_steps):
    optimizer.zero_grad()
    total = 0.0
    for micro_batch in _micro_batches(batch, accumulation_steps):
        loss = toy_loss(model, micro_batch) / accumulation_steps
        loss.backward()
        _average(model)  # right answer, k times the traffic
        total += loss.item()
    optimizer.step()
    return total


def step_every_micro_batch(model, optimizer, batch, accumulation_steps):
    total = 0.0
    for micro_batch in _micro_batches(batch, accumulation_steps):
        optimizer.zero_grad()
        loss = toy_loss(model, micro_batch) / accumulation_steps
        loss.backward()
        _average(model)
        optimizer.step()  # k small steps: training on micro-batches, not accumulating
        total += loss.item()
    return total


def never_zeroed(model, optimizer, batch, accumulation_steps):
    total = 0.0  # "accumulation means never zeroing": the last step's sums pile up too
    for micro_batch in _micro_batches(batch, accumulation_steps):
        loss = toy_loss(model, micro_batch) / accumulation_steps
        loss.backward()
        total += loss.item()
    _average(model)
    optimizer.step()
    return total


def averaged_after_step(model, optimizer, batch, accumulation_steps):
    optimizer.zero_grad()
    total = 0.0
    for micro_batch in _micro_batches(batch, accumulation_steps):
        loss = toy_loss(model, micro_batch) / accumulation_steps
        loss.backward()
        total += loss.item()
    optimizer.step()
    _average(model)  # too late: the step used this rank's own gradient
    return total


def divided_by_the_world_too(model, optimizer, batch, accumulation_steps):
    optimizer.zero_grad()
    total = 0.0
    for micro_batch in _micro_batches(batch, accumulation_steps):
        # "the global batch is k x world_size micro-batches", but the averaging divides too
        loss = toy_loss(model, micro_batch) / (accumulation_steps * dist.get_world_size())
        loss.backward()
        total += loss.item() * dist.get_world_size()
    _average(model)
    optimizer.step()
    return total


def returns_the_last_micro_batchs_loss(model, optimizer, batch, accumulation_steps):
    optimizer.zero_grad()
    for micro_batch in _micro_batches(batch, accumulation_steps):
        loss = toy_loss(model, micro_batch)
        (loss / accumulation_steps).backward()
    _average(model)
    optimizer.step()
    return loss.item()  # one micro-batch's loss, not the batch's


def returns_the_tensor(model, optimizer, batch, accumulation_steps):
    optimizer.zero_grad()
    total = 0.0
    for micro_batch in _micro_batches(batch, accumulation_steps):
        loss = toy_loss(model, micro_batch) / accumulation_steps
        loss.backward()
        total = total + loss.detach()
    _average(model)
    optimizer.step()
    return total


# Right answers written differently.


def gradients_divided_once(model, optimizer, batch, accumulation_steps):
    """Backward on the micro-batches' own losses, then divide the summed gradients by k."""
    optimizer.zero_grad()
    losses = []
    for micro_batch in _micro_batches(batch, accumulation_steps):
        loss = toy_loss(model, micro_batch)
        loss.backward()
        losses.append(loss.item())
    with torch.no_grad():
        for param in model.parameters():
            if param.grad is not None:
                param.grad /= accumulation_steps
    _average(model)
    optimizer.step()
    return sum(losses) / len(losses)


def one_flat_all_reduce(model, optimizer, batch, accumulation_steps):
    """Every gradient in one flat all-reduce (fewer calls, the same numbers sent)."""
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    optimizer.zero_grad()
    total = 0.0
    for micro_batch in _micro_batches(batch, accumulation_steps):
        loss = toy_loss(model, micro_batch) / accumulation_steps
        loss.backward()
        total += loss.item()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    for grad, mean in zip(grads, _unflatten_dense_tensors(flat, grads)):
        grad.copy_(mean)
    optimizer.step()
    return total


# --------------------------------------------------------------------------- ddp_accumulation_step


def ddp_without_no_sync(ddp_model, optimizer, batch, accumulation_steps):
    optimizer.zero_grad()
    total = 0.0
    for micro_batch in _micro_batches(batch, accumulation_steps):
        loss = toy_loss(ddp_model, micro_batch) / accumulation_steps
        loss.backward()  # DDP all-reduces in every backward
        total += loss.item()
    optimizer.step()
    return total


def ddp_backward_only_in_no_sync(ddp_model, optimizer, batch, accumulation_steps):
    micro_batches = _micro_batches(batch, accumulation_steps)
    optimizer.zero_grad()
    total = 0.0
    for index, micro_batch in enumerate(micro_batches):
        loss = toy_loss(ddp_model, micro_batch) / accumulation_steps  # forward outside: too late
        with contextlib.nullcontext() if index == len(micro_batches) - 1 else ddp_model.no_sync():
            loss.backward()
        total += loss.item()
    optimizer.step()
    return total


def ddp_everything_in_no_sync(ddp_model, optimizer, batch, accumulation_steps):
    optimizer.zero_grad()
    total = 0.0
    with ddp_model.no_sync():  # "no_sync around the accumulation loop": the last one never syncs
        for micro_batch in _micro_batches(batch, accumulation_steps):
            loss = toy_loss(ddp_model, micro_batch) / accumulation_steps
            loss.backward()
            total += loss.item()
    optimizer.step()
    return total


def ddp_loss_not_divided(ddp_model, optimizer, batch, accumulation_steps):
    micro_batches = _micro_batches(batch, accumulation_steps)
    optimizer.zero_grad()
    total = 0.0
    for index, micro_batch in enumerate(micro_batches):
        with contextlib.nullcontext() if index == len(micro_batches) - 1 else ddp_model.no_sync():
            loss = toy_loss(ddp_model, micro_batch)  # "DDP averages": over ranks, not micro-batches
            loss.backward()
        total += loss.item() / accumulation_steps
    optimizer.step()
    return total


# Right answers written differently.


def ddp_last_one_apart(ddp_model, optimizer, batch, accumulation_steps):
    """The quiet micro-batches in one no_sync block, the last one after it."""
    *quiet, last = _micro_batches(batch, accumulation_steps)
    optimizer.zero_grad()
    losses = []
    with ddp_model.no_sync():
        for micro_batch in quiet:
            loss = toy_loss(ddp_model, micro_batch) / accumulation_steps
            loss.backward()
            losses.append(loss.item())
    loss = toy_loss(ddp_model, last) / accumulation_steps
    loss.backward()
    losses.append(loss.item())
    optimizer.step()
    return sum(losses)


# --------------------------------------------------------------------------- the catalogue

_SPLIT = "test_split_batch_cuts_equal_micro_batches_in_order"
_REFUSE = "test_split_batch_refuses_what_does_not_split_evenly"
_EQUAL = "test_accumulation_step_equals_one_step_on_the_whole_batch"
_ONCE = "test_accumulation_step_averages_once_per_optimizer_step"
_DDP = "test_ddp_accumulation_step_syncs_once_and_equals_one_step"


def _with_k(test: str, *ks: int) -> list[str]:
    return [f"{test}[{model}-{k}]" for model in ("frozen", "tied") for k in ks]


MISTAKES = [
    Mistake(
        "micro_batch_size_confused",
        replaces="split_batch",
        fails=[_SPLIT],
        says=["is how many micro-batches there are", "not how many samples each holds"],
    ),
    Mistake(
        "chunked_unchecked",
        replaces="split_batch",
        fails=[f"{_REFUSE}[10-by-4]"],
        says=["returned 4 micro-batches of 3, 3, 3, 1 samples", "raise ValueError"],
    ),
    Mistake(
        "remainder_dropped",
        replaces="split_batch",
        fails=[f"{_REFUSE}[10-by-4]"],
        says=["2 samples dropped", "raise ValueError"],
    ),
    Mistake(
        "loss_not_divided",
        replaces="accumulation_step",
        fails=_with_k(_EQUAL, 2, 4),
        says=["times too large", "divide each micro-batch's loss by accumulation_steps"],
    ),
    Mistake(
        "zero_grad_every_micro_batch",
        replaces="accumulation_step",
        fails=_with_k(_EQUAL, 2, 4),
        says=["only the last micro-batch's gradient", "Zero the gradients once"],
    ),
    Mistake(
        "averaged_every_micro_batch",
        replaces="accumulation_step",
        fails=_with_k(_ONCE, 2, 4),
        says=["averaged at every micro-batch", "times the traffic", "average once"],
    ),
    Mistake(
        "step_every_micro_batch",
        replaces="accumulation_step",
        fails=_with_k(_ONCE, 2, 4),
        says=["called optimizer.step()", "one step per batch"],
    ),
    Mistake(
        "never_zeroed",
        replaces="accumulation_step",
        fails=[_EQUAL],
        says=["a process that never zeroes its gradients", "Zero them once per optimizer step"],
    ),
    Mistake(
        "averaged_after_step",
        replaces="accumulation_step",
        fails=[_ONCE],
        says=["all-reduced after optimizer.step()", "then step"],
    ),
    Mistake(
        "divided_by_the_world_too",
        replaces="accumulation_step",
        fails=[_EQUAL],
        says=["2 times too small", "average_gradients already divides by the world size"],
    ),
    Mistake(
        "returns_the_last_micro_batchs_loss",
        replaces="accumulation_step",
        fails=_with_k(_EQUAL, 2, 4),
        says=["its whole batch before the step", "the mean of the micro-batches' losses"],
    ),
    Mistake(
        "returns_the_tensor",
        replaces="accumulation_step",
        fails=[_EQUAL],
        says=["returned a Tensor", "loss.item()"],
    ),
    Mistake(
        "ddp_without_no_sync",
        replaces="ddp_accumulation_step",
        fails=_with_k(_DDP, 2, 4),
        says=["at every micro-batch", "times the traffic", "inside ddp_model.no_sync()"],
    ),
    Mistake(
        "ddp_backward_only_in_no_sync",
        replaces="ddp_accumulation_step",
        fails=_with_k(_DDP, 2, 4),
        says=["ran outside it", "DDP decides at forward time", "the forward belongs inside"],
    ),
    Mistake(
        "ddp_everything_in_no_sync",
        replaces="ddp_accumulation_step",
        fails=[_DDP],
        says=["never synchronised", "Run the last micro-batch outside ddp_model.no_sync()"],
    ),
    Mistake(
        "ddp_loss_not_divided",
        replaces="ddp_accumulation_step",
        fails=_with_k(_DDP, 2, 4),
        says=["times too large", "divide each micro-batch's loss by accumulation_steps"],
    ),
]

# Each right answer must pass every test of its step.
RIGHT_ANSWERS = [
    RightAnswer("with_chunk_after_the_check", replaces="split_batch"),
    RightAnswer("with_tensor_split", replaces="split_batch"),
    RightAnswer("gradients_divided_once", replaces="accumulation_step"),
    RightAnswer("one_flat_all_reduce", replaces="accumulation_step"),
    RightAnswer("ddp_last_one_apart", replaces="ddp_accumulation_step"),
]
