"""k13's mistakes catalogue: real mistakes in bucketing gradients (assign_buckets, and
BucketedDDP's start, buckets, hook, finish and no_sync), and right answers written another way.
See ``dojo/dev/mistakes/__init__.py`` for what each list promises.

Each BucketedDDP entry is a subclass of the reference with one method done the way a learner
might (the catalogue swaps whole classes).
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist

from dojo.dev.mistakes import Mistake, RightAnswer
from solutions import k13_buckets as reference

_Reference = reference.BucketedDDP
Bucket = reference.Bucket
MIB = reference.MIB


# --------------------------------------------------------------------------- assign_buckets


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _walk(params, cap_bytes, order, size_of, closes):
    buckets, current, size = [], [], 0
    for index in order:
        n = size_of(params[index])
        if closes(current, size, n, cap_bytes):
            buckets.append(current)
            current, size = [], 0
        current.append(index)
        size += n
    return buckets + ([current] if current else [])


def _over(current, size, n, cap):
    return bool(current) and cap is not None and size + n > cap


def forward_order(params, cap_bytes):
    # "walk the parameters and cut": the order of model.parameters(), the first layer first
    return _walk(params, cap_bytes, range(len(params)), _nbytes, _over)


def reversed_forward_buckets(params, cap_bytes):
    # forward buckets, then "reverse order": the boundaries are still the forward walk's
    forward = _walk(params, cap_bytes, range(len(params)), _nbytes, _over)
    return [list(reversed(bucket)) for bucket in reversed(forward)]


def closes_after_reaching_the_cap(params, cap_bytes):
    # torch's own rule: add first, close once the bucket has reached the cap (it may exceed it)
    return _walk(
        params,
        cap_bytes,
        reversed(range(len(params))),
        _nbytes,
        lambda current, size, n, cap: bool(current) and cap is not None and size >= cap,
    )


def counts_elements(params, cap_bytes):
    return _walk(params, cap_bytes, reversed(range(len(params))), lambda t: t.numel(), _over)


def assumes_four_bytes(params, cap_bytes):
    # "gradients are float32"
    return _walk(params, cap_bytes, reversed(range(len(params))), lambda t: 4 * t.numel(), _over)


def closes_at_the_cap(params, cap_bytes):
    # >= where > belongs: a bucket that would hold exactly the cap is closed early
    return _walk(
        params,
        cap_bytes,
        reversed(range(len(params))),
        _nbytes,
        lambda current, size, n, cap: bool(current) and cap is not None and size + n >= cap,
    )


def empty_first_bucket(params, cap_bytes):
    # closes the current bucket without checking that it holds anything
    return _walk(
        params,
        cap_bytes,
        reversed(range(len(params))),
        _nbytes,
        lambda current, size, n, cap: cap is not None and size + n > cap,
    )


def none_compared(params, cap_bytes):
    buckets, current, size = [], [], 0
    for index in reversed(range(len(params))):
        n = _nbytes(params[index])
        if current and size + n > cap_bytes:  # TypeError when cap_bytes is None
            buckets.append(current)
            current, size = [], 0
        current.append(index)
        size += n
    return buckets + ([current] if current else [])


def no_cap_check(params, cap_bytes):
    return _walk(params, cap_bytes, reversed(range(len(params))), _nbytes, _over)


# Right answers written another way.


def from_the_end_with_sums(params, cap_bytes):
    """Cut where a running sum would pass the cap, then read the cuts off."""
    if cap_bytes is not None and cap_bytes <= 0:
        raise ValueError(f"cap_bytes={cap_bytes} is not a positive number of bytes")
    order = list(range(len(params) - 1, -1, -1))
    sizes = [params[i].numel() * params[i].element_size() for i in order]
    starts, total = [0], 0
    for position, size in enumerate(sizes):
        if position > starts[-1] and cap_bytes is not None and total + size > cap_bytes:
            starts.append(position)
            total = 0
        total += size
    ends = starts[1:] + [len(order)]
    return [order[a:b] for a, b in zip(starts, ends) if b > a]


def with_a_generator(params, cap_bytes):
    """The same rule, yielded bucket by bucket."""
    if cap_bytes is not None and not cap_bytes > 0:
        raise ValueError(f"cap_bytes must be positive, got {cap_bytes}")

    def buckets():
        current, size = [], 0
        for index in reversed(range(len(params))):
            nbytes = params[index].nelement() * params[index].element_size()
            if current and cap_bytes is not None and size + nbytes > cap_bytes:
                yield current
                current, size = [], 0
            current.append(index)
            size += nbytes
        if current:
            yield current

    return list(buckets())


# --------------------------------------------------------------------------- _broadcast_state


class BroadcastFromGlobalRank0(_Reference):
    def _broadcast_state(self):
        with torch.no_grad():  # "rank 0 is the first rank": not in a group [1, 2]
            for tensor in [*self.module.parameters(), *self.module.buffers()]:
                dist.broadcast(tensor, src=0, group=self.process_group)


class FrozenNotBroadcast(_Reference):
    def _broadcast_state(self):
        group = self.process_group or dist.group.WORLD
        first = dist.get_global_rank(group, 0)
        with torch.no_grad():  # "only trained parameters matter"
            for tensor in [p for p in self.module.parameters() if p.requires_grad]:
                dist.broadcast(tensor, src=first, group=self.process_group)
            for tensor in self.module.buffers():
                dist.broadcast(tensor, src=first, group=self.process_group)


class BuffersForgotten(_Reference):
    def _broadcast_state(self):
        group = self.process_group or dist.group.WORLD
        first = dist.get_global_rank(group, 0)
        with torch.no_grad():
            for tensor in self.module.parameters():
                dist.broadcast(tensor, src=first, group=self.process_group)


class BroadcastOnTheWorld(_Reference):
    def _broadcast_state(self):
        group = self.process_group or dist.group.WORLD
        first = dist.get_global_rank(group, 0)
        with torch.no_grad():
            for tensor in [*self.module.parameters(), *self.module.buffers()]:
                dist.broadcast(tensor, src=first)  # no group=: the whole world


# --------------------------------------------------------------------------- _build_buckets


class _Builder(_Reference):
    """_build_buckets with its pieces open to change."""

    def _trainable(self):
        return [p for p in self.module.parameters() if p.requires_grad]

    def _cap_bytes(self, bucket_cap_mb):
        return None if bucket_cap_mb is None else bucket_cap_mb * MIB

    def _slots_of(self, flat, members):
        views, offset = [], 0
        for param in members:
            views.append(flat[offset : offset + param.numel()].view_as(param))
            offset += param.numel()
        return views

    def _make_hook(self, number, position):
        return functools.partial(self._on_gradient_ready, number, position)

    def _build_buckets(self, bucket_cap_mb):
        params = self._trainable()
        for number, indices in enumerate(
            reference.assign_buckets(params, self._cap_bytes(bucket_cap_mb))
        ):
            members = [params[i] for i in indices]
            flat = torch.zeros(
                sum(p.numel() for p in members), dtype=members[0].dtype, device=members[0].device
            )
            self.buckets.append(
                Bucket(members, flat, self._slots_of(flat, members), [False] * len(members))
            )
            for position, param in enumerate(members):
                param.register_post_accumulate_grad_hook(self._make_hook(number, position))


class HooksOnFrozen(_Builder):
    def _trainable(self):
        return list(self.module.parameters())  # frozen ones too


class TiedTwice(_Builder):
    def _trainable(self):
        return [  # each module's own parameters: a tied weight comes once per module using it
            p
            for module in self.module.modules()
            for p in module.parameters(recurse=False)
            if p.requires_grad
        ]


class CapInMegabytes(_Builder):
    def _cap_bytes(self, bucket_cap_mb):
        return None if bucket_cap_mb is None else bucket_cap_mb * 10**6


class CapNoneMultiplied(_Builder):
    def _cap_bytes(self, bucket_cap_mb):
        return bucket_cap_mb * MIB  # TypeError for None, which means "no cap, one bucket"


class ForwardDropsKeywords(_Reference):
    def forward(self, *args, **kwargs):  # "the models here take one tensor"
        return self.module(*args)


class FlatBuffersRegistered(_Builder):
    def _build_buckets(self, bucket_cap_mb):
        super()._build_buckets(bucket_cap_mb)
        for number, bucket in enumerate(self.buckets):  # "keep them with the module"
            self.register_buffer(f"flat_{number}", bucket.flat)


class LateBindingLambda(_Builder):
    def _build_buckets(self, bucket_cap_mb):
        params = self._trainable()
        for number, indices in enumerate(
            reference.assign_buckets(params, self._cap_bytes(bucket_cap_mb))
        ):
            members = [params[i] for i in indices]
            flat = torch.zeros(sum(p.numel() for p in members))
            self.buckets.append(
                Bucket(members, flat, self._slots_of(flat, members), [False] * len(members))
            )
            for position, param in enumerate(members):
                param.register_post_accumulate_grad_hook(
                    lambda p: self._on_gradient_ready(number, position, p)  # noqa: B023
                )


class SeparateSlots(_Builder):
    def _slots_of(self, flat, members):
        return [torch.zeros_like(p) for p in members]  # a slot per gradient, but not in flat


# Right answers written another way.


class SplitViews(_Builder):
    """The slots from torch.split: views of flat, one per parameter."""

    def _slots_of(self, flat, members):
        pieces = torch.split(flat, [p.numel() for p in members])
        return [piece.view(p.shape) for piece, p in zip(pieces, members)]


class DefaultArgumentHooks(_Builder):
    """Hooks as closures that bind the bucket and position through default arguments."""

    def _make_hook(self, number, position):
        def hook(param, number=number, position=position):
            self._on_gradient_ready(number, position, param)

        return hook


# --------------------------------------------------------------------------- _on_gradient_ready


def _fill(ddp, index, position, param):
    """The reference's first half: the gradient / N into its slot, marked arrived."""
    bucket = ddp.buckets[index]
    size = dist.get_world_size(ddp.process_group)
    torch.mul(param.grad, 1.0 / size, out=bucket.views[position])
    bucket.arrived[position] = True
    return bucket


class LaunchEveryGradient(_Reference):
    def _on_gradient_ready(self, index, position, param):
        if not self.sync_gradients:
            return
        bucket = _fill(self, index, position, param)
        # one all-reduce per gradient, of its slot: k12 again
        handle = dist.all_reduce(bucket.views[position], group=self.process_group, async_op=True)
        if all(bucket.arrived):
            bucket.handle = handle


class BlockingAllReduce(_Reference):
    def _on_gradient_ready(self, index, position, param):
        if not self.sync_gradients:
            return
        bucket = _fill(self, index, position, param)
        if all(bucket.arrived):
            dist.all_reduce(bucket.flat, group=self.process_group)  # waits right here
            bucket.handle = _Done()


class _Done:
    def wait(self):
        return True


class LaunchAtFirstGradient(_Reference):
    def _on_gradient_ready(self, index, position, param):
        if not self.sync_gradients:
            return
        bucket = _fill(self, index, position, param)
        if bucket.handle is None:  # "start as early as possible"
            bucket.handle = dist.all_reduce(bucket.flat, group=self.process_group, async_op=True)


class LaunchAtLastSlot(_Reference):
    def _on_gradient_ready(self, index, position, param):
        if not self.sync_gradients:
            return
        bucket = _fill(self, index, position, param)
        if position == len(bucket.params) - 1:  # "slots fill in order, so the last one is last"
            bucket.handle = dist.all_reduce(bucket.flat, group=self.process_group, async_op=True)


class IgnoresNoSync(_Reference):
    def _on_gradient_ready(self, index, position, param):
        bucket = _fill(self, index, position, param)  # no check of sync_gradients
        if all(bucket.arrived):
            bucket.handle = dist.all_reduce(bucket.flat, group=self.process_group, async_op=True)


class AllReduceOnTheWorld(_Reference):
    def _on_gradient_ready(self, index, position, param):
        if not self.sync_gradients:
            return
        bucket = _fill(self, index, position, param)
        if all(bucket.arrived):
            bucket.handle = dist.all_reduce(bucket.flat, async_op=True)  # no group=


# --------------------------------------------------------------------------- finish


class DividedAfterTheSum(_Reference):
    """Right: the hook copies the gradient as it is; finish divides the sum by the group's size."""

    def _on_gradient_ready(self, index, position, param):
        if not self.sync_gradients:
            return
        bucket = self.buckets[index]
        bucket.views[position].copy_(param.grad)
        bucket.arrived[position] = True
        if all(bucket.arrived):
            bucket.handle = dist.all_reduce(bucket.flat, group=self.process_group, async_op=True)

    def finish_gradient_synchronization(self):
        if not any(any(b.arrived) for b in self.buckets):
            return
        for bucket in self.buckets:
            if bucket.handle is None:
                for position, arrived in enumerate(bucket.arrived):
                    if not arrived:
                        bucket.views[position].zero_()
                bucket.handle = dist.all_reduce(
                    bucket.flat, group=self.process_group, async_op=True
                )
        size = dist.get_world_size(self.process_group)
        for bucket in self.buckets:
            bucket.handle.wait()
            bucket.flat.div_(size)
            for param, view in zip(bucket.params, bucket.views):
                if param.grad is not None:
                    param.grad.copy_(view)
            bucket.handle, bucket.arrived = None, [False] * len(bucket.params)


class _Finisher(DividedAfterTheSum):
    """Dividing after the sum (as many learners do), with one piece open to change."""

    divide_by_world = False
    divide = True
    copy_back = True
    reset = True
    launch_incomplete = True
    only_when_started = True

    def finish_gradient_synchronization(self):
        if self.only_when_started and not any(any(b.arrived) for b in self.buckets):
            return
        for bucket in self.buckets:
            if bucket.handle is None and self.launch_incomplete:
                for position, arrived in enumerate(bucket.arrived):
                    if not arrived:
                        bucket.views[position].zero_()
                bucket.handle = dist.all_reduce(
                    bucket.flat, group=self.process_group, async_op=True
                )
        group = None if self.divide_by_world else self.process_group
        size = dist.get_world_size(group)
        for bucket in self.buckets:
            if bucket.handle is None:
                continue
            bucket.handle.wait()
            if self.divide:
                bucket.flat.div_(size)
            if self.copy_back:
                for param, view in zip(bucket.params, bucket.views):
                    if param.grad is not None:
                        param.grad.copy_(view)
            if self.reset:
                bucket.handle = None
                bucket.arrived = [False] * len(bucket.params)


class NeverDivides(_Finisher):
    divide = False  # "all_reduce averages"


class DividesByWorldSize(_Finisher):
    divide_by_world = True  # dist.get_world_size(): the world's, not the group's


class NoCopyBack(_Finisher):
    copy_back = False  # "the views are the gradients"


class NeverResets(_Finisher):
    reset = False


class ForgetsIncompleteBuckets(_Finisher):
    launch_incomplete = False  # waits only for what the hooks launched


class SecondCallSyncsAgain(_Finisher):
    only_when_started = False


class DividesTwice(_Reference):
    def finish_gradient_synchronization(self):
        pending = [b for b in self.buckets if b.handle is not None]
        super().finish_gradient_synchronization()
        size = dist.get_world_size(self.process_group)
        for bucket in pending:  # the hook divided already: "finish averages"
            for param in bucket.params:
                if param.grad is not None:
                    param.grad.div_(size)


class WaitsInLaunchOrder(_Reference):
    """Right: waits for the buckets as they were launched, a list of (bucket, handle)."""

    def finish_gradient_synchronization(self):
        launched = [b for b in self.buckets if b.handle is not None]
        if not launched and not any(any(b.arrived) for b in self.buckets):
            return
        for bucket in self.buckets:
            if bucket.handle is None:
                for position, arrived in enumerate(bucket.arrived):
                    if not arrived:
                        bucket.views[position].zero_()
                bucket.handle = dist.all_reduce(
                    bucket.flat, group=self.process_group, async_op=True
                )
                launched.append(bucket)
        for bucket in launched:
            bucket.handle.wait()
            for param, view in zip(bucket.params, bucket.views):
                if param.grad is not None:
                    param.grad.copy_(view)
        for bucket in self.buckets:
            bucket.handle = None
            bucket.arrived[:] = [False] * len(bucket.arrived)


# --------------------------------------------------------------------------- no_sync


class NoSyncWithoutFinally(_Reference):
    @contextlib.contextmanager
    def no_sync(self):
        before = self.sync_gradients
        self.sync_gradients = False
        yield  # an exception in the block never comes back here
        self.sync_gradients = before


class NoSyncSwitchesBackOn(_Reference):
    @contextlib.contextmanager
    def no_sync(self):
        self.sync_gradients = False
        try:
            yield
        finally:
            self.sync_gradients = True  # also when an outer no_sync is still open


class NoSyncAsAClass(_Reference):
    """Right: a context manager written as a class, nesting through a counter."""

    def no_sync(self):
        return _Paused(self)


class _Paused:
    def __init__(self, ddp):
        self.ddp = ddp

    def __enter__(self):
        self.before = self.ddp.sync_gradients
        self.ddp.sync_gradients = False

    def __exit__(self, *exc):
        self.ddp.sync_gradients = self.before
        return False


class CountdownBuckets(torch.nn.Module):
    """Right, in another layout entirely (as many learners write it): no Bucket objects, no
    _on_gradient_ready; each bucket is a dict with its flat buffer and the gradients seen, the
    hooks are closures, the sum is divided in the finish, and no_sync counts its depth."""

    def __init__(self, module, bucket_cap_mb=25.0, process_group=None):
        super().__init__()
        if bucket_cap_mb is not None and not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be positive or None, got {bucket_cap_mb}")
        self.module = module
        self.process_group = process_group
        self._quiet = 0
        group = process_group or dist.group.WORLD
        with torch.no_grad():
            for tensor in [*module.parameters(), *module.buffers()]:
                dist.broadcast(tensor, src=dist.get_global_rank(group, 0), group=process_group)
        params = [p for p in module.parameters() if p.requires_grad]
        cap = None if bucket_cap_mb is None else bucket_cap_mb * MIB
        self._plan = []
        for indices in reference.assign_buckets(params, cap):
            members = [params[i] for i in indices]
            entry = {
                "params": members,
                "flat": torch.zeros(sum(p.numel() for p in members), device=members[0].device),
                "seen": set(),
                "work": None,
            }
            self._plan.append(entry)
            start = 0
            for param in members:
                param.register_post_accumulate_grad_hook(self._hook(entry, start))
                start += param.numel()

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _hook(self, entry, start):
        def hook(param):
            if self._quiet:
                return
            entry["flat"][start : start + param.numel()].copy_(param.grad.reshape(-1))
            entry["seen"].add(id(param))
            if len(entry["seen"]) == len(entry["params"]):
                entry["work"] = dist.all_reduce(
                    entry["flat"], group=self.process_group, async_op=True
                )

        return hook

    def _slots(self, entry):
        start = 0
        for param in entry["params"]:
            yield param, entry["flat"][start : start + param.numel()]
            start += param.numel()

    def finish_gradient_synchronization(self):
        if not any(entry["seen"] for entry in self._plan):
            return
        for entry in self._plan:
            if entry["work"] is None:
                for param, slot in self._slots(entry):
                    if id(param) not in entry["seen"]:
                        slot.zero_()
                entry["work"] = dist.all_reduce(
                    entry["flat"], group=self.process_group, async_op=True
                )
        size = dist.get_world_size(self.process_group)
        for entry in self._plan:
            entry["work"].wait()
            entry["flat"].div_(size)
            for param, slot in self._slots(entry):
                if param.grad is not None:
                    param.grad.copy_(slot.view_as(param))
            entry["work"], entry["seen"] = None, set()

    @contextlib.contextmanager
    def no_sync(self):
        self._quiet += 1
        try:
            yield
        finally:
            self._quiet -= 1


# --------------------------------------------------------------------------- the catalogue

_ASSIGN = "test_assign_buckets_fills_in_reverse_order_under_the_cap"
_START = "test_every_rank_starts_from_the_first_ranks_state"
_LAYOUT = "test_buckets_hold_the_trainable_parameters_in_reverse_order"
_FACADE = "test_the_wrapper_is_its_module_and_passes_every_argument_on"
_HOOKS = "test_one_hook_per_trainable_parameter"
_LAUNCH = "test_each_bucket_is_launched_when_its_last_gradient_arrives"
_TRAIN = "test_training_equals_one_process_on_the_whole_batch"
_SUBGROUP = "test_a_subgroup_averages_over_its_own_ranks"

MISTAKES = [
    Mistake(
        "forward_order",
        replaces="assign_buckets",
        fails=[f"{_ASSIGN}[lesson]"],
        says=["filled the buckets in forward parameter order", "fill them in reverse order"],
    ),
    Mistake(
        "reversed_forward_buckets",
        replaces="assign_buckets",
        fails=[f"{_ASSIGN}[four-equal]", f"{_ASSIGN}[float64]"],
        says=["built the buckets in forward order and then reversed the list"],
    ),
    Mistake(
        "closes_after_reaching_the_cap",
        replaces="assign_buckets",
        fails=[f"{_ASSIGN}[lesson]"],
        says=[
            "let a bucket grow past the cap",
            "close a bucket before a tensor would push it over",
        ],
    ),
    Mistake(
        "counts_elements",
        replaces="assign_buckets",
        fails=[f"{_ASSIGN}[lesson]", f"{_ASSIGN}[float64]", f"{_ASSIGN}[float16]"],
        says=["compared element counts (numel()) with a cap in bytes", "element_size()"],
    ),
    Mistake(
        "assumes_four_bytes",
        replaces="assign_buckets",
        fails=[f"{_ASSIGN}[float64]", f"{_ASSIGN}[float16]"],
        says=["assumed 4 bytes per element", "element_size()"],
    ),
    Mistake(
        "closes_at_the_cap",
        replaces="assign_buckets",
        fails=[f"{_ASSIGN}[exactly-the-cap]"],
        says=["a bucket may hold exactly cap_bytes"],
    ),
    Mistake(
        "empty_first_bucket",
        replaces="assign_buckets",
        fails=[f"{_ASSIGN}[lesson]", "test_assign_buckets_cap_smaller_than_every_tensor"],
        says=["with an empty bucket", "check that the current bucket is not empty"],
    ),
    Mistake(
        "none_compared",
        replaces="assign_buckets",
        fails=["test_assign_buckets_none_means_one_bucket"],
        says=["raised TypeError", "None means no cap, one bucket"],
    ),
    Mistake(
        "no_cap_check",
        replaces="assign_buckets",
        fails=["test_assign_buckets_refuses_a_cap_that_is_not_positive"],
        says=["holds nothing; raise ValueError"],
    ),
    Mistake(
        "BroadcastFromGlobalRank0",
        replaces="BucketedDDP",
        fails=["test_a_subgroup_starts_from_its_own_first_rank"],
        says=["broadcast from src=0", "here global rank 1", "dist.get_global_rank(group, 0)"],
    ),
    Mistake(
        "FrozenNotBroadcast",
        replaces="BucketedDDP",
        fails=[f"{_START}[frozen]"],
        says=["'frozen.weight'", "a frozen parameter", "frozen ones too"],
    ),
    Mistake(
        "BuffersForgotten",
        replaces="BucketedDDP",
        fails=[f"{_START}[buffer]"],
        says=["'scale'", "Broadcast every buffer too"],
    ),
    Mistake(
        "BroadcastOnTheWorld",
        replaces="BucketedDDP",
        fails=["test_a_subgroup_starts_from_its_own_first_rank"],
        says=["outside the group, never call", "group=self.process_group"],
    ),
    Mistake(
        "HooksOnFrozen",
        replaces="BucketedDDP",
        fails=[
            f"{_START}[frozen]",
            f"{_FACADE}[frozen]",
            f"{_LAYOUT}[frozen]",
            f"{_HOOKS}[frozen]",
        ],
        says=["a hook went on a frozen parameter", "trainable parameters only"],
    ),
    Mistake(
        "TiedTwice",
        replaces="BucketedDDP",
        fails=[f"{_LAYOUT}[tied]"],
        says=["sits in 2 slots", "Tied weights are one parameter"],
    ),
    Mistake(
        "CapInMegabytes",
        replaces="BucketedDDP",
        fails=[f"{_LAYOUT}[frozen]"],
        says=["bucket_cap_mb is in MiB", "not MB (10**6 bytes)"],
    ),
    Mistake(
        "CapNoneMultiplied",
        replaces="BucketedDDP",
        fails=[_FACADE],
        says=["bucket_cap_mb=None means no cap, one bucket", "never multiply or compare it"],
    ),
    Mistake(
        "ForwardDropsKeywords",
        replaces="BucketedDDP",
        fails=[_FACADE],
        says=["=inputs) raised TypeError", "keyword arguments too", "self.module(*args, **kwargs)"],
    ),
    Mistake(
        "FlatBuffersRegistered",
        replaces="BucketedDDP",
        fails=[_FACADE],
        says=["['flat_0'] as parameters or buffers of its own", "not register_buffer"],
    ),
    Mistake(
        "LateBindingLambda",
        replaces="BucketedDDP",
        fails=[f"{_LAUNCH}[frozen]"],
        says=["every hook reported the same slot", "functools.partial"],
    ),
    Mistake(
        "SeparateSlots",
        replaces="BucketedDDP",
        fails=[_LAYOUT],
        says=["is not a view of the flat buffer", "the same memory"],
    ),
    Mistake(
        "LaunchEveryGradient",
        replaces="BucketedDDP",
        fails=[f"{_LAUNCH}[frozen]"],
        says=["launched 4 all-reduces for 1 bucket(s)", "not one per gradient"],
    ),
    Mistake(
        "BlockingAllReduce",
        replaces="BucketedDDP",
        fails=[_LAUNCH],
        says=["was blocking (async_op=False)", "async_op=True"],
    ),
    Mistake(
        "LaunchAtFirstGradient",
        replaces="BucketedDDP",
        fails=[_LAUNCH],
        says=["started after 1 of its", "when its last gradient is in"],
    ),
    Mistake(
        "LaunchAtLastSlot",
        replaces="BucketedDDP",
        fails=[f"{_LAUNCH}[reordered]"],
        says=["once the gradient of its last slot", "not always arrive in slot order"],
    ),
    Mistake(
        "IgnoresNoSync",
        replaces="BucketedDDP",
        fails=["test_no_sync_accumulates_and_syncs_once[2]"],
        says=["backward inside no_sync() made", "the hooks launch nothing"],
    ),
    Mistake(
        "AllReduceOnTheWorld",
        replaces="BucketedDDP",
        fails=[_SUBGROUP],
        says=["rank 0, outside their group, never calls", "group=self.process_group"],
    ),
    Mistake(
        "NeverDivides",
        replaces="BucketedDDP",
        fails=[f"{_TRAIN}[frozen-2]", f"{_TRAIN}[tied-3]"],
        says=["holds the sum over the", "divide by the group's size"],
    ),
    Mistake(
        "DividesByWorldSize",
        replaces="BucketedDDP",
        fails=[_SUBGROUP],
        says=["divided by 3, the whole world's size", "dist.get_world_size(self.process_group)"],
    ),
    Mistake(
        "NoCopyBack",
        replaces="BucketedDDP",
        fails=[f"{_TRAIN}[frozen-2]", f"{_TRAIN}[buffer-2]"],
        says=["still holds this rank's own gradient", "copy its slot back into .grad"],
    ),
    Mistake(
        "NeverResets",
        replaces="BucketedDDP",
        fails=[f"{_TRAIN}[frozen-2]"],
        says=["divided by 2 once more", "must reset the step's state"],
    ),
    Mistake(
        "DividesTwice",
        replaces="BucketedDDP",
        fails=[f"{_TRAIN}[frozen-2]", f"{_TRAIN}[buffer-2]"],
        says=["divided by 2 once more", "divide once"],
    ),
    Mistake(
        "ForgetsIncompleteBuckets",
        replaces="BucketedDDP",
        fails=["test_finish_launches_buckets_that_never_filled"],
        says=["was never launched", "must launch every bucket still waiting"],
    ),
    Mistake(
        "SecondCallSyncsAgain",
        replaces="BucketedDDP",
        fails=[
            f"{_TRAIN}[frozen-2]",
            f"{_TRAIN}[tied-2]",
            "test_finish_with_nothing_launched_is_harmless",
        ],
        says=["finish_gradient_synchronization()", "does nothing"],
    ),
    Mistake(
        "NoSyncWithoutFinally",
        replaces="BucketedDDP",
        fails=["test_no_sync_restores_what_was_there"],
        says=["after an exception inside", "restore syncing in a finally"],
    ),
    Mistake(
        "NoSyncSwitchesBackOn",
        replaces="BucketedDDP",
        fails=["test_no_sync_restores_what_was_there"],
        says=["nested", "must restore the value it found"],
    ),
]

RIGHT_ANSWERS = [
    RightAnswer("from_the_end_with_sums", replaces="assign_buckets"),
    RightAnswer("with_a_generator", replaces="assign_buckets"),
    RightAnswer("SplitViews", replaces="BucketedDDP", steps=(3, 5)),
    RightAnswer("DefaultArgumentHooks", replaces="BucketedDDP", steps=(3, 4)),
    RightAnswer("DividedAfterTheSum", replaces="BucketedDDP", steps=(4, 5, 6)),
    RightAnswer("WaitsInLaunchOrder", replaces="BucketedDDP", steps=(5,)),
    RightAnswer("NoSyncAsAClass", replaces="BucketedDDP", steps=(6,)),
    # Every test but the one of the kata's own layout (step 3's) judges behaviour only:
    RightAnswer("CountdownBuckets", replaces="BucketedDDP", steps=(2, 4, 5, 6)),
]
