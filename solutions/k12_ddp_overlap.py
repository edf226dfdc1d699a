"""k12 · A DDP of your own that overlaps communication with backward.

THE IDEA
    k04 averaged the gradients after backward had finished: the network sat idle during
    backward, then backward's result sat idle while the network worked. But backward computes
    the gradients one layer at a time, last layer first, and a gradient never changes once its
    parameter's backward is done. So send it at once, while backward goes on with the layers
    below: that is what ``torch.nn.parallel.DistributedDataParallel`` does.

        k04: average after backward
        backward  [last][mid][first]
        network                     [l][m][f]
                                             ^ the step can start

        this kata: launch each all-reduce as soon as its gradient is ready
        backward  [last][mid][first]
        network         [l]   [m]   [f]
                                       ^ the step can start, while k04 would still be sending

    A wrapper around the model does it with three pieces:

    - at construction, every rank takes the group's first rank's parameters and buffers
      (``dist.broadcast``, in place, the same tensors in the same order on every rank). Frozen
      parameters too: nothing trains them, but a rank that built its model with another seed
      holds other values, and so computes other outputs;
    - a hook on each trainable parameter, called by autograd the moment that parameter's
      ``.grad`` is complete (``register_post_accumulate_grad_hook``), launches an all-reduce of
      that gradient *asynchronously* (``async_op=True``: the call returns a handle at once and
      the network does the work while backward continues). Tied weights (one parameter used
      twice) are one parameter: one hook, one all-reduce; frozen parameters get none;
    - ``finish_gradient_synchronization()``, called after ``loss.backward()`` and before
      ``optimizer.step()``, waits for every handle and divides the sums by the group's size.

    One step on each rank:

        loss = toy_loss(ddp, batch)
        loss.backward()          # hooks fire, last layer first: all_reduce(grad, async_op=True)
        ddp.finish_gradient_synchronization()   # wait for each, grad /= group size
        optimizer.step()         # every rank: the same mean gradient, the same new weights

    ``no_sync()`` switches the hooks off for gradient accumulation (k11): inside it backward
    only adds to ``.grad``; the backward of the last micro-batch, outside it, launches the
    all-reduces of the accumulated sums.

    The wrapper reads the rank and the group's size from the process group it is given (None:
    the whole world), never from environment variables: the same class then works inside a
    subgroup, such as one row of a 2-D grid of ranks, and under any launcher. Fixing the
    averaging's order makes it exact: the all-reduce sums each element in the same order as
    k04's did, so the weights are bitwise those of averaging after backward.

STEPS
    1. ``__init__``: keep the model as ``.module`` (no parameters or buffers of the wrapper's
       own), check the arguments, broadcast every parameter (frozen too) and buffer from the
       group's first rank, then call ``self._register_hooks()`` (step 2).
    2. ``_register_hooks``: one ``register_post_accumulate_grad_hook`` per unique trainable
       parameter; ``_on_gradient_ready``: launch an async SUM all-reduce of that gradient and
       keep its handle.
    3. ``finish_gradient_synchronization``: wait for every handle, divide by the group's size,
       forget the handles (a second call does nothing).
    4. ``no_sync``: a context manager inside which the hooks launch nothing.

WHAT THE TESTS CHECK
    On 3 ranks that build the frozen, tied and buffer toy models with different seeds, every
    rank holds the first rank's state after construction (recorded broadcasts, their sources),
    and forward passes keyword arguments on; inside subgroups of a 4-rank world, the group's
    first rank is the source and the mean is over the group. One backward launches one async
    all-reduce per unique trainable parameter (a SUM divided afterwards; dividing before it,
    as torch's DDP does, or ReduceOp.AVG pass too), the first before backward has finished
    (the order of recorded events). After the finish every gradient is the mean; several
    steps equal one process on the whole batch on every rank (bitwise equal to averaging after
    backward: on 2 ranks every correct order gives exactly (a + b) / 2; close to torch's DDP);
    ``finish_gradient_synchronization`` is harmless twice or with nothing launched; inside
    ``no_sync`` (nested in another too) nothing is launched, and accumulation equals torch's
    DDP with its own ``no_sync``. Bad arguments raise ValueError.

RUN IT
    .venv/bin/python -m katas.k12_ddp_overlap --world-size 2 --model tied
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from dojo.console import run_program, say
from dojo.devices import rank_device
from dojo.launch import add_launch_arguments, launch_world
from dojo.toy_models import MODELS, make_batch, make_model
from dojo.toy_models import loss as toy_loss


class OverlappingDDP(nn.Module):
    """``module`` replicated over ``process_group`` (None: the world), its gradients averaged
    while backward runs. Call ``finish_gradient_synchronization()`` before each optimizer step."""

    def __init__(self, module: nn.Module, process_group: dist.ProcessGroup | None = None):
        """Check the arguments, keep ``module``, give it the group's first rank's state, hook it."""
        # BEGIN STEP 1: construction: one state for every rank
        # TODO: construct the wrapper. What the tests hold it to:
        #   - a module that is not an nn.Module, or a process_group this rank is not in, is a
        #     ValueError saying so (collectives on a group a rank is not in silently do nothing);
        #   - self.module is the model itself, and the wrapper registers no parameter or buffer of
        #     its own (its named_parameters(), named_buffers() and state_dict() are the model's,
        #     under "module.");
        #   - afterwards every rank's parameters (frozen ones too) and buffers hold the group's
        #     first rank's values, copied into the very same tensors, every rank sending or
        #     receiving the same tensors in the same order. The tests build 3 replicas with
        #     different seeds and record each rank's broadcasts; inside subgroups of a 4-rank
        #     world the source is the group's first rank (a global rank), never one outside it;
        #   - rank and size come from process_group (None: the whole world), never from environment
        #     variables; set up whatever finish_gradient_synchronization and no_sync will need;
        #   - last, it calls self._register_hooks() (step 2).
        super().__init__()
        if not isinstance(module, nn.Module):
            raise ValueError(
                f"OverlappingDDP wraps an nn.Module, got {type(module).__name__}: pass the model "
                "itself, not its parameters"
            )
        if process_group is not None and dist.get_rank(process_group) < 0:
            raise ValueError(
                f"rank {dist.get_rank()} is not a member of the process_group it was given: each "
                "rank wraps its model with a group it belongs to"
            )
        self.module = module  # a submodule: its parameters are the wrapper's, none are added
        self.process_group = process_group
        self._pending: list[tuple[dist.Work, torch.Tensor]] = []  # launched this step
        self._syncing = True  # False inside no_sync()
        source = dist.get_global_rank(process_group or dist.group.WORLD, 0)
        with torch.no_grad():  # a copy of the first rank's state, not a step to differentiate
            for tensor in [*module.parameters(), *module.buffers()]:  # fixed order, no duplicates
                dist.broadcast(tensor, src=source, group=process_group)
        self._register_hooks()
        # END STEP 1

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _register_hooks(self) -> None:
        """One hook per unique trainable parameter: ``_on_gradient_ready`` once its .grad is."""
        # BEGIN STEP 2: a hook per unique trainable parameter
        # TODO: make autograd call self._on_gradient_ready(param) the moment each trainable
        # parameter's .grad is complete in a backward. One hook per unique parameter: the tied
        # weight (one parameter used by two layers) gets one, frozen parameters none. The tests
        # count the all-reduces one backward launches: one per unique trainable parameter.
        for param in self.module.parameters():  # tied weights appear once
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(self._on_gradient_ready)
        # END STEP 2

    def _on_gradient_ready(self, param: torch.Tensor) -> None:
        """Called by autograd once ``param.grad`` holds this backward's whole gradient."""
        # BEGIN STEP 2: launch the all-reduce of a ready gradient
        # TODO: outside no_sync(), start summing param.grad itself over the process group without
        # waiting for it (backward goes on meanwhile), and remember what
        # finish_gradient_synchronization will need. The tests record every launch: an
        # all-reduce (SUM, or AVG), asynchronous, the first one before backward has finished; once
        # they finish, each .grad holds the sum over the ranks (the division is step 3's), or their
        # mean if you divide before the launch as torch's DDP does.
        if not self._syncing:
            return
        work = dist.all_reduce(
            param.grad, op=dist.ReduceOp.SUM, group=self.process_group, async_op=True
        )
        self._pending.append((work, param.grad))
        # END STEP 2

    def finish_gradient_synchronization(self) -> None:
        """Wait for every all-reduce launched since the last call; leave the mean in each .grad."""
        # BEGIN STEP 3: wait, divide, forget
        # TODO: afterwards every gradient launched since the last call holds the mean over the
        # process group (the sum divided by the group's size, not the world's), on every rank. Then
        # nothing is pending: a second call, or a call when nothing was launched, changes nothing
        # and launches nothing. The tests train 3 steps and compare with one process on the whole
        # batch (bitwise with averaging after backward), and average inside subgroups.
        size = dist.get_world_size(self.process_group)
        for work, grad in self._pending:
            work.wait()
            grad.div_(size)
        self._pending.clear()
        # END STEP 3

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Inside it backward only accumulates: the hooks launch nothing."""
        # BEGIN STEP 4: no_sync: accumulate without launching
        # TODO: a context manager (the decorator is there): inside the block the hooks launch
        # nothing, so backward only accumulates into .grad; when the block ends, however it ends
        # (an exception too), the hooks launch as they did before it (still nothing, when this
        # no_sync was nested in another). The tests accumulate 3 micro-batches and compare with
        # torch's DDP and its own no_sync().
        before = self._syncing
        self._syncing = False
        try:
            yield
        finally:
            self._syncing = before
        # END STEP 4


# --------------------------------------------------------------------------- the program


@contextlib.contextmanager
def _watched(events: list, start: float):
    """Note each all-reduce launched (and its shape) in ``events`` while the block runs."""
    original = dist.all_reduce

    def all_reduce(tensor, *args, **kwargs):
        events.append(
            (time.perf_counter() - start, f"all-reduce of {tuple(tensor.shape)} launched")
        )
        return original(tensor, *args, **kwargs)

    dist.all_reduce = all_reduce
    try:
        yield
    finally:
        dist.all_reduce = original


def show_one_step(rank: int, world_size: int, model_name: str, steps: int, batch: int) -> dict:
    """Train ``steps`` steps with OverlappingDDP; rank 0 shows what one step does, in order."""
    device = rank_device()
    model = make_model(model_name, seed=100 + rank).to(device)  # built apart: construction fixes it
    names = {param: name for name, param in model.named_parameters()}
    events: list = []
    start = time.perf_counter()

    def ready(param):
        events.append((time.perf_counter() - start, f"gradient of {names[param]} ready"))

    for param in names:  # registered first, so they fire just before the wrapper's own hooks
        if param.requires_grad:
            param.register_post_accumulate_grad_hook(ready)
    ddp = OverlappingDDP(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    per_rank = batch // world_size
    losses = []
    for step in range(steps):
        inputs, targets = make_batch(model_name, batch, seed=step)
        part = slice(rank * per_rank, (rank + 1) * per_rank)
        mine = (inputs[part].to(device), targets[part].to(device))
        events.clear()
        start = time.perf_counter()
        with _watched(events, start):
            loss = toy_loss(ddp, mine)
            events.append((time.perf_counter() - start, "backward starts"))
            loss.backward()
            events.append((time.perf_counter() - start, "backward ends"))
            ddp.finish_gradient_synchronization()
            events.append((time.perf_counter() - start, "every gradient averaged"))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    if rank == 0:
        say(rank, f"the last step of {steps}, in order (ms since the forward began):")
        for moment, what in events:
            say(rank, f"  {1000 * moment:7.3f}  {what}")
    return {
        "losses": losses,
        "launched": sum(1 for _, what in events if what.startswith("all-reduce")),
        "state": {name: t.detach().cpu().clone() for name, t in model.state_dict().items()},
    }


def one_process(model_name: str, steps: int, batch: int) -> dict:
    """The same training in one process, on the whole batch (with rank 0's initial weights)."""
    model = make_model(model_name, seed=100)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        loss = toy_loss(model, make_batch(model_name, batch, seed=step))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description="A DDP of your own: gradients all-reduced while backward runs."
    )
    add_launch_arguments(parser, world_size=2)
    parser.add_argument("--model", choices=sorted(MODELS), default="tied")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=16, help="the global batch")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    if args.batch < args.world_size or args.batch % args.world_size:
        parser.error(f"--batch {args.batch} does not split into {args.world_size} equal parts")
    say(None, f"{MODELS[args.model].__name__} on {args.world_size} ranks, each built apart")
    results = launch_world(
        show_one_step,
        args.world_size,
        args.model,
        args.steps,
        args.batch,
        backend=args.backend,
        device=args.device,
    )
    trainable = sum(1 for p in make_model(args.model, 0).parameters() if p.requires_grad)
    say(
        None,
        f"{results[0]['launched']} all-reduces per step, one per unique trainable parameter "
        f"({trainable})",
    )
    same = all(
        torch.equal(result["state"][name], tensor)
        for result in results[1:]
        for name, tensor in results[0]["state"].items()
    )
    say(None, f"every rank holds the same weights: {same}")
    expected = one_process(args.model, args.steps, args.batch)
    gap = max((results[0]["state"][n] - t).abs().max().item() for n, t in expected.items())
    say(
        None,
        f"largest difference to one process on the whole batch after {args.steps} steps: {gap:.1e}",
    )
    return 0


if __name__ == "__main__":
    run_program(main)
