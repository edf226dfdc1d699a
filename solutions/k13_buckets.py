"""k13 · Buckets: fewer, bigger all-reduces, launched while backward still runs.

THE IDEA
    k12's wrapper launches one all-reduce per gradient. Each collective has a fixed cost (a
    round trip between the ranks, a launch) on top of its bytes, so a model with hundreds of
    small tensors pays that cost hundreds of times. DistributedDataParallel groups gradients
    into buckets of about ``bucket_cap_mb`` MiB (25 by default) and all-reduces one flat buffer
    per bucket: few collectives, each big enough to run at full bandwidth.

    Which gradients share a bucket? Backward computes them from the last layer to the first, so
    buckets are filled in reverse parameter order: the first bucket is complete early in
    backward and its all-reduce runs while autograd computes the rest.

        parameters (forward order):   p0  p1  p2  p3  p4  p5
        gradients become ready:       p5  p4  p3  p2  p1  p0      (backward: last layer first)
        buckets, cap = 2 tensors:     [p5 p4] [p3 p2] [p1 p0]
                                       flat 0  flat 1  flat 2     (one buffer each, made once)

        backward:    |--p5--p4--|--p3--p2--|--p1--p0--|
        all-reduce:             [== flat 0 ==]
                                           [== flat 1 ==]
                                                      [== flat 2 ==]
        finish:                                                      wait, copy back

    The rule for a bucket: add tensors (in reverse order) while the bucket stays within the
    cap; close it before a tensor would push it over. A tensor larger than the cap sits in a
    bucket of its own; no cap (None) means one bucket for everything.

        cap 1000 bytes, sizes p0..p4 = 400 300 600 200 1200 bytes:
            p4 (1200) alone: [4]; then p3 + p2 = 800, + p1 would be 1100: [3, 2]; [1, 0]

    Each bucket owns one flat buffer, allocated once at construction; every gradient has a
    fixed slot in it (a view: same memory, the gradient's shape). When a gradient is ready,
    its hook copies it into its slot, divided by the group's size on the way (one pass over
    the memory instead of two; torch's DDP does the same, which also keeps half-precision sums
    from overflowing); when the bucket's last gradient arrives, the hook launches one
    asynchronous SUM all-reduce of the whole buffer (a sum of gradients / N: their mean) and
    backward goes on. ``finish_gradient_synchronization()`` launches any bucket still waiting
    (a parameter that got no gradient this step leaves its bucket incomplete: its slot counts
    as zero), in bucket order on every rank, since collectives must meet in the same order
    everywhere; then it waits for each, copies the means back into each ``.grad``, and forgets
    the step, so the next one starts clean.

    Exact? On 2 ranks every averaged element is a/2 + b/2 whatever the bucket: halving is
    exact and adding two numbers does not depend on their order, so the weights are bitwise
    those of all-reducing each gradient on its own (k04). On 3 ranks gloo adds three numbers
    in an order that depends on where they sit in the buffer it is given, and in floating point
    (a + b) + c is not always a + (b + c): a bucket's sums may differ from a lone tensor's in
    the last bits, so the tests allow a few ulps there.

    ``bucket_cap_mb`` is in MiB (2**20 bytes), as in torch's DDP. (Torch also caps the first
    bucket at 1 MiB, to start communicating sooner, and keeps one dtype and device per bucket;
    the models here are all float32 on one device.)

STEPS
    1. ``assign_buckets(params, cap_bytes)``: the buckets as lists of indices into ``params``,
       filled in reverse order; ``ValueError`` for a cap that is not positive.
    2. ``BucketedDDP._broadcast_state``: every parameter (frozen ones too) and every buffer
       from the group's first rank, in place, in module order.
    3. ``BucketedDDP._build_buckets``: the unique trainable parameters into buckets (the cap
       in MiB), one preallocated flat buffer per bucket with a view per gradient, and one hook
       per trainable parameter that calls ``_on_gradient_ready``.
    4. ``BucketedDDP._on_gradient_ready``: copy the gradient into its slot (divided by the
       group's size); launch the bucket's asynchronous all-reduce when its last gradient
       arrives (never inside ``no_sync``).
    5. ``BucketedDDP.finish_gradient_synchronization``: launch what is left, wait, copy the
       means back, reset.
    6. ``BucketedDDP.no_sync``: a context manager inside which the hooks launch nothing.

WHAT THE TESTS CHECK
    ``assign_buckets`` on sizes where the order, the cap's edge, bytes against elements and
    tensors larger than the cap all matter; that ranks built from different seeds start from
    the group's first rank's parameters and buffers (a subgroup too); forward with keyword
    arguments, and a cap of None; the buckets, their flat buffers and views (the one test of
    the layout this kata asks for: every other test judges what the wrapper does, through its
    public face); one hook per trainable parameter; by recording every rank's calls: one
    asynchronous all-reduce per bucket, each launched as soon as its last gradient arrived
    (before backward returned), also in a model whose layers run in another order than they
    are registered, none inside ``no_sync``; that several steps on 2 and 3
    ranks equal one process on the whole batch on every rank (bitwise equal, on 2 ranks, to
    all-reducing each gradient on its own), for a frozen layer, tied weights and a buffer, at
    caps of 25 MiB, below every tensor and None; incomplete buckets, repeated calls, nested and
    interrupted ``no_sync``; and the program.

RUN IT
    .venv/bin/python -m katas.k13_buckets --world-size 2 --cap-mb 0.3 --steps 3
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from dojo.console import run_program, say
from dojo.devices import rank_device
from dojo.launch import add_launch_arguments, launch_world

MIB = 1 << 20  # bytes in a MiB: bucket_cap_mb counts these, as torch's DDP does


def assign_buckets(params: Sequence[torch.Tensor], cap_bytes: float | None) -> list[list[int]]:
    """Group ``params`` into buckets of at most ``cap_bytes`` bytes each (None: one bucket).

    Returns lists of indices into ``params``, filled in reverse order (the order gradients
    become ready): the first bucket starts with the last parameter. A bucket closes before a
    tensor would push it over the cap; a tensor larger than the cap sits in a bucket of its own.
    """
    # BEGIN STEP 1: assign_buckets: which gradients share an all-reduce
    # TODO: the buckets as lists of indices into params (their sizes in bytes, whatever the dtype),
    # in the order gradients become ready: the first bucket starts with the last index. A bucket
    # never grows past cap_bytes (it may hold exactly that much), except a tensor larger than the
    # cap, which sits in a bucket of its own; no bucket is empty; None means one bucket. A cap that
    # is not positive is a ValueError naming it. The tests check the lesson's example, a bucket
    # filled exactly to the cap, float64 and float16 tensors, tensors larger than the cap, None and
    # an empty list.
    if cap_bytes is not None and not cap_bytes > 0:
        raise ValueError(
            f"cap_bytes must be a positive number of bytes (or None for one bucket), got {cap_bytes!r}"
        )
    buckets: list[list[int]] = []
    current: list[int] = []
    size = 0
    for index in reversed(range(len(params))):
        nbytes = params[index].numel() * params[index].element_size()
        if current and cap_bytes is not None and size + nbytes > cap_bytes:
            buckets.append(current)  # full: this tensor would push it over the cap
            current, size = [], 0
        current.append(index)
        size += nbytes
    if current:
        buckets.append(current)
    return buckets
    # END STEP 1


@dataclass(eq=False)
class Bucket:
    """One bucket: its parameters, in the order their gradients fill it, and one flat buffer."""

    params: list[nn.Parameter]
    flat: torch.Tensor  # every gradient of the bucket end to end, allocated once
    views: list[torch.Tensor]  # views[i]: params[i]'s slot in flat (same memory, its shape)
    arrived: list[bool] = field(default_factory=list)  # arrived[i]: params[i]'s gradient is in
    handle: dist.Work | None = None  # the all-reduce of flat, once launched this step


class BucketedDDP(nn.Module):
    """DistributedDataParallel's bucketed all-reduce, overlapped with backward.

    ``BucketedDDP(module, bucket_cap_mb=25.0, process_group=None)``: the cap in MiB as in
    torch's DDP (None: one bucket), the group None for the whole world. Call
    ``finish_gradient_synchronization()`` after ``backward()`` and before the optimizer's
    step; ``with ddp.no_sync():`` accumulates gradients locally.
    """

    def __init__(
        self,
        module: nn.Module,
        bucket_cap_mb: float | None = 25.0,
        process_group: dist.ProcessGroup | None = None,
    ):
        super().__init__()
        if bucket_cap_mb is not None and (isinstance(bucket_cap_mb, bool) or not bucket_cap_mb > 0):
            raise ValueError(
                f"bucket_cap_mb must be a positive number of MiB (or None for one bucket), got "
                f"{bucket_cap_mb!r}"
            )
        self.module = module
        self.process_group = process_group
        self.sync_gradients = True  # False inside no_sync(): the hooks launch nothing
        self.buckets: list[Bucket] = []
        self._broadcast_state()
        self._build_buckets(bucket_cap_mb)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _broadcast_state(self) -> None:
        """Give this rank the group's first rank's parameters (frozen ones too) and buffers."""
        # BEGIN STEP 2: the same start: the group's first rank's parameters and buffers
        # TODO: afterwards every rank of self.process_group (None: the whole world) holds, in place,
        # the group's first rank's values of every parameter (frozen ones too) and every buffer of
        # self.module; the first rank's own are unchanged. Only broadcasts, the same tensors in the
        # same order on every rank, on the group. The tests build each rank's model from its own
        # seed, record every rank's calls (and which source each named), and run it in a subgroup
        # [1, 2] of 3 ranks.
        group = self.process_group if self.process_group is not None else dist.group.WORLD
        first = dist.get_global_rank(group, 0)  # broadcast's src is a global rank
        with torch.no_grad():  # a copy of weights, not a step autograd should record
            for tensor in [*self.module.parameters(), *self.module.buffers()]:
                dist.broadcast(tensor, src=first, group=self.process_group)
        # END STEP 2

    def _build_buckets(self, bucket_cap_mb: float | None) -> None:
        """``self.buckets``: the trainable parameters' buckets, flat buffers, views and hooks."""
        # BEGIN STEP 3: the buckets: flat buffers, views, hooks
        # TODO: self.buckets, one Bucket per list that your assign_buckets returns for the module's
        # unique trainable parameters (frozen ones have no gradient; a tied weight is one
        # parameter), with bucket_cap_mb in MiB (None: one bucket). Each Bucket's flat buffer is
        # allocated here, once, on the parameters' device and dtype, and each parameter's slot is a
        # view of it (its shape, right after the previous slot); arrived starts all False. Register
        # one post-accumulate-grad hook per trainable parameter that calls
        # self._on_gradient_ready(bucket_index, position, param). Nothing is registered as a
        # parameter or buffer of the wrapper. The tests inspect self.buckets for three models and
        # four caps (None too), count the hooks torch holds on each parameter, and call forward
        # with a keyword argument.
        params = [p for p in self.module.parameters() if p.requires_grad]  # tied: listed once
        cap = None if bucket_cap_mb is None else bucket_cap_mb * MIB
        for number, indices in enumerate(assign_buckets(params, cap)):
            members = [params[i] for i in indices]
            flat = torch.zeros(
                sum(p.numel() for p in members), dtype=members[0].dtype, device=members[0].device
            )
            views, offset = [], 0
            for param in members:
                views.append(flat[offset : offset + param.numel()].view_as(param))
                offset += param.numel()
            self.buckets.append(Bucket(members, flat, views, [False] * len(members)))
            for position, param in enumerate(members):
                param.register_post_accumulate_grad_hook(
                    functools.partial(self._on_gradient_ready, number, position)
                )
        # END STEP 3

    def _on_gradient_ready(self, index: int, position: int, param: nn.Parameter) -> None:
        """The hook: ``param`` (``self.buckets[index].params[position]``) has its gradient."""
        # BEGIN STEP 4: the hook: fill the slot, launch a full bucket
        # TODO: param's gradient is ready (it is self.buckets[index].params[position]). Unless
        # syncing is off (inside no_sync), its gradient goes into its slot, divided by the group's
        # size (so that the sum over the ranks is the mean; dividing the sum in finish instead also
        # passes), and when it is the last of its bucket to arrive, the bucket's flat buffer is
        # all-reduced (a sum, on self.process_group) without waiting: backward goes on while it
        # runs; keep the handle in the bucket. The tests record when every gradient arrived and when
        # every collective started: exactly one asynchronous all-reduce of a flat buffer per bucket,
        # each launched after its bucket's last gradient and before the next gradient (or the end of
        # backward), also in a model whose gradients do not arrive in slot order.
        if not self.sync_gradients:
            return  # no_sync: the gradient stays in .grad, to accumulate
        bucket = self.buckets[index]
        size = dist.get_world_size(self.process_group)
        torch.mul(param.grad, 1.0 / size, out=bucket.views[position])  # copied and divided at once
        bucket.arrived[position] = True
        if all(bucket.arrived):  # its last gradient: launch now, while backward goes on
            bucket.handle = dist.all_reduce(
                bucket.flat, op=dist.ReduceOp.SUM, group=self.process_group, async_op=True
            )
        # END STEP 4

    def finish_gradient_synchronization(self) -> None:
        """Wait for every bucket's all-reduce; afterwards each ``.grad`` holds the mean over ranks."""
        # BEGIN STEP 5: finish: launch the rest, wait, copy the means back, reset
        # TODO: afterwards every trainable parameter's .grad holds the mean of its gradient over the
        # group's ranks, on every rank, and the wrapper is ready for the next step (nothing to call
        # at its start). Buckets still waiting for a gradient that never came are launched here, in
        # bucket order on every rank, a missing gradient counting as zero. With no gradient arrived
        # this step (no backward yet, inside no_sync, a second call) it makes no collective. The
        # tests train 3 steps on 2 and 3 ranks (and a subgroup) and compare each step's gradients
        # and the final weights with all-reducing each gradient alone and with one process on the
        # whole batch; they count the collectives of every step.
        if not any(any(bucket.arrived) for bucket in self.buckets):
            return  # nothing this step (no backward, inside no_sync, or called twice)
        for bucket in self.buckets:  # the same order on every rank
            if bucket.handle is None:  # a gradient never came: its slot counts as zero
                for position, arrived in enumerate(bucket.arrived):
                    if not arrived:
                        bucket.views[position].zero_()
                bucket.handle = dist.all_reduce(
                    bucket.flat, op=dist.ReduceOp.SUM, group=self.process_group, async_op=True
                )
        for bucket in self.buckets:
            bucket.handle.wait()  # the sum of the divided gradients: the mean
            for param, view in zip(bucket.params, bucket.views):
                if param.grad is not None:
                    param.grad.copy_(view)
            bucket.handle = None
            bucket.arrived = [False] * len(bucket.params)
        # END STEP 5

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Inside: backward only accumulates into ``.grad``; the first backward after it syncs."""
        # BEGIN STEP 6: no_sync: accumulate without communicating
        # TODO: a context manager inside which backward launches nothing (gradients accumulate in
        # .grad); the first backward after it syncs them all. Afterwards syncing is as it was before
        # the block, even when the block raised, and when no_sync is nested in no_sync. The tests
        # run 1, 2 and 4 micro-batches per step, nested blocks and a block that raises.
        before = self.sync_gradients
        self.sync_gradients = False
        try:
            yield
        finally:
            self.sync_gradients = before
        # END STEP 6


# --------------------------------------------------------------------------- the program


class DemoModel(nn.Module):
    """A small MLP: tensors of very different sizes, as in a real model."""

    def __init__(self, width: int = 256, depth: int = 3):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(64 if i == 0 else width, width) for i in range(depth))
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x)


def _mib(nbytes: float) -> str:
    return f"{nbytes / MIB:.3f} MiB"


@contextlib.contextmanager
def _watching_all_reduces(events: list) -> Iterator[None]:
    """Note every ``dist.all_reduce`` this rank launches: when, of which memory, async or not."""
    original = dist.all_reduce

    def watched(tensor, *args, **kwargs):
        is_async = kwargs.get("async_op", args[2] if len(args) > 2 else False)
        events.append((time.perf_counter(), "all-reduce", tensor.numel(), bool(is_async)))
        return original(tensor, *args, **kwargs)

    dist.all_reduce = watched
    try:
        yield
    finally:
        dist.all_reduce = original


def show_buckets(
    rank: int, world_size: int, bucket_cap_mb: float | None, steps: int, seed: int = 0
) -> dict:
    """Train ``DemoModel`` with ``BucketedDDP`` for ``steps`` steps; rank 0 tells what happened."""
    device = rank_device()
    torch.manual_seed(seed + rank)  # different weights on every rank: the wrapper makes them one
    model = DemoModel().to(device)
    names = {id(p): name for name, p in model.named_parameters()}
    events: list[tuple] = []
    for param in model.parameters():  # registered first, so they fire before the wrapper's
        param.register_post_accumulate_grad_hook(
            lambda p: events.append((time.perf_counter(), "gradient", names[id(p)]))
        )
    ddp = BucketedDDP(model, bucket_cap_mb=bucket_cap_mb)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    # The buckets as the rule makes them (whatever the wrapper keeps inside): their parameters,
    # and each bucket known by its size, the numel of the flat buffer its all-reduce sends.
    params = [p for p in model.parameters() if p.requires_grad]
    plan = [
        [params[i] for i in indices]
        for indices in assign_buckets(
            params, None if bucket_cap_mb is None else bucket_cap_mb * MIB
        )
    ]
    if rank == 0:
        cap = "none (one bucket)" if bucket_cap_mb is None else f"{bucket_cap_mb:g} MiB"
        say(rank, f"{len(plan)} bucket(s), cap {cap}, filled in reverse parameter order:")
        for number, bucket in enumerate(plan):
            members = ", ".join(names[id(p)] for p in bucket)
            nbytes = sum(p.numel() * p.element_size() for p in bucket)
            say(rank, f"  bucket {number}: {_mib(nbytes)}  {members}")
    generator = torch.Generator().manual_seed(1000 * seed + rank)
    counts = []
    for step in range(1, steps + 1):
        inputs = torch.randn(32, 64, generator=generator).to(device)
        targets = torch.randint(0, 10, (32,), generator=generator).to(device)
        events.clear()
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(ddp(inputs), targets)
        with _watching_all_reduces(events):
            loss.backward()
            events.append((time.perf_counter(), "backward returned"))
            ddp.finish_gradient_synchronization()
        optimizer.step()
        launched = [e for e in events if e[1] == "all-reduce"]
        counts.append(len(launched))
        if rank == 0 and step == 1:
            flats = {sum(p.numel() for p in b): n for n, b in reversed(list(enumerate(plan)))}
            say(rank, "step 1, in the order it happened:")
            for event in sorted(events):
                if event[1] == "gradient":
                    say(rank, f"  gradient ready      {event[2]}")
                elif event[1] == "all-reduce":
                    how = "async" if event[3] else "blocking"
                    say(rank, f"  all-reduce launched bucket {flats.get(event[2], '?')} ({how})")
                else:
                    say(rank, "  backward returned; finish_gradient_synchronization() waits")
        if rank == 0:
            say(rank, f"step {step}: {len(launched)} all-reduce(s), {len(plan)} bucket(s)")
    return {
        "counts": counts,
        "buckets": len(plan),
        "state": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description="Bucketed gradient all-reduce, overlapped with backward."
    )
    add_launch_arguments(parser, world_size=2)
    parser.add_argument(
        "--cap-mb",
        type=float,
        default=0.3,
        help="bucket cap in MiB (default 0.3; 0 means no cap: one bucket)",
    )
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    if args.cap_mb < 0:
        parser.error("--cap-mb must be positive (0: no cap)")
    cap = args.cap_mb or None
    say(None, f"BucketedDDP on {args.world_size} ranks, DemoModel, {args.steps} steps")
    results = launch_world(
        show_buckets,
        args.world_size,
        cap,
        args.steps,
        args.seed,
        backend=args.backend,
        device=args.device,
    )
    first = results[0]["state"]
    largest = max(
        (r["state"][k].double() - first[k].double()).abs().max().item()
        for r in results
        for k in first
    )
    say(
        None,
        f"after {args.steps} steps every rank holds the same parameters (largest difference "
        f"from rank 0's: {largest:g})"
        if largest == 0
        else f"the ranks' parameters differ by up to {largest:g} after {args.steps} steps",
    )
    return 0 if largest == 0 else 1


if __name__ == "__main__":
    run_program(main)
