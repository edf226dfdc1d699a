"""k12's mistakes catalogue: real mistakes in a DDP of one's own (the construction, the hooks, the
finish, no_sync), and right answers written another way. See ``dojo/dev/mistakes/__init__.py`` for
what each list promises. Each entry stands in for the whole ``OverlappingDDP`` class."""

from __future__ import annotations

import contextlib
import functools
import os

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from dojo.dev.mistakes import Mistake, RightAnswer

SUM = dist.ReduceOp.SUM


class _Wrapper(nn.Module):
    """The reference, cut into the pieces the mistakes below get wrong, one at a time."""

    def __init__(self, module, process_group=None):
        super().__init__()
        self.check(module, process_group)
        self.module = module
        self.process_group = process_group
        self._pending = []
        self._syncing = True
        with torch.no_grad():
            self.broadcast_state()
        self._register_hooks()

    def check(self, module, process_group):
        if not isinstance(module, nn.Module):
            raise ValueError(f"OverlappingDDP wraps an nn.Module, got {type(module).__name__}")
        if process_group is not None and dist.get_rank(process_group) < 0:
            raise ValueError(f"rank {dist.get_rank()} is not a member of the process_group")

    def source(self):
        return dist.get_global_rank(self.process_group or dist.group.WORLD, 0)

    def state_tensors(self):
        return [*self.module.parameters(), *self.module.buffers()]

    def broadcast_state(self):
        for tensor in self.state_tensors():
            dist.broadcast(tensor, src=self.source(), group=self.process_group)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def hooked(self):
        return [p for p in self.module.parameters() if p.requires_grad]

    def _register_hooks(self):
        for param in self.hooked():
            param.register_post_accumulate_grad_hook(self._on_gradient_ready)

    def _on_gradient_ready(self, param):
        if not self._syncing:
            return
        self._pending.append((self.launch(param.grad), param.grad))

    def launch(self, grad):
        return dist.all_reduce(grad, op=SUM, group=self.process_group, async_op=True)

    def size(self):
        return dist.get_world_size(self.process_group)

    def finish_gradient_synchronization(self):
        size = self.size()
        for work, grad in self._pending:
            work.wait()
            grad.div_(size)
        self._pending.clear()

    @contextlib.contextmanager
    def no_sync(self):
        before = self._syncing
        self._syncing = False
        try:
            yield
        finally:
            self._syncing = before


# --------------------------------------------------------------------------- construction


class TrainableOnlyBroadcast(_Wrapper):
    def state_tensors(self):  # "frozen parameters never change, so they need no copy"
        trainable = [p for p in self.module.parameters() if p.requires_grad]
        return [*trainable, *self.module.buffers()]


class BuffersForgotten(_Wrapper):
    def state_tensors(self):  # the weights are the model, aren't they?
        return list(self.module.parameters())


class AveragedTheStates(_Wrapper):
    def broadcast_state(self):  # equal replicas, but nobody's weights
        size = dist.get_world_size(self.process_group)
        for tensor in self.state_tensors():
            dist.all_reduce(tensor, op=SUM, group=self.process_group)
            tensor /= size


class ReceivedIntoFreshTensors(_Wrapper):
    def broadcast_state(self):
        for tensor in self.state_tensors():
            received = tensor.detach().clone()
            dist.broadcast(received, src=self.source(), group=self.process_group)
            tensor.data = received  # a new tensor: whoever held the old one keeps stale values


class SourceIsGlobalRankZero(_Wrapper):
    def source(self):  # rank 0 of the world, in a group that may not hold it
        return 0


class NoArgumentChecks(_Wrapper):
    def check(self, module, process_group):
        pass


class ForwardDropsKeywords(_Wrapper):
    def forward(self, *args, **kwargs):  # "the models here take one tensor"
        return self.module(*args)


# --------------------------------------------------------------------------- hooks


class HookOnEveryParameter(_Wrapper):
    def hooked(self):  # frozen parameters too: torch refuses a hook where no gradient comes
        return list(self.module.parameters())


class TiedWeightHookedTwice(_Wrapper):
    def hooked(self):  # every module's own weights: the tied one is reached from two layers
        return [
            p for _, p in self.module.named_parameters(remove_duplicate=False) if p.requires_grad
        ]


class BlockingAllReduce(_Wrapper):
    def launch(self, grad):
        dist.all_reduce(grad, op=SUM, group=self.process_group)  # backward waits for each one
        return _Done()


class _Done:
    def wait(self):
        return True


class OnlyRankZeroLaunches(_Wrapper):
    """Rank 0 coordinates: the hooks launch only there, so its all-reduces wait forever."""

    def _on_gradient_ready(self, param):
        if dist.get_rank() == 0:
            super()._on_gradient_ready(param)


class AllReduceInFinish(_Wrapper):
    """The hooks only note what is ready; the all-reduces go out after backward (no overlap)."""

    def _on_gradient_ready(self, param):
        if self._syncing:
            self._pending.append((None, param.grad))

    def finish_gradient_synchronization(self):
        size = self.size()
        for _, grad in self._pending:
            dist.all_reduce(grad, op=SUM, group=self.process_group)
            grad.div_(size)
        self._pending.clear()


class ReducedACopy(_Wrapper):
    def launch(self, grad):
        return dist.all_reduce(grad.clone(), op=SUM, group=self.process_group, async_op=True)


class ReducedTheWeights(_Wrapper):
    def _on_gradient_ready(self, param):
        if self._syncing:  # param, not param.grad: the weights get summed
            work = dist.all_reduce(param.data, op=SUM, group=self.process_group, async_op=True)
            self._pending.append((work, param.data))


# --------------------------------------------------------------------------- finish


class NotDivided(_Wrapper):
    def size(self):  # "all-reduce averages": only with op=AVG, which gloo lacks
        return 1


class WorldSizeFromTheEnvironment(_Wrapper):
    def size(self):  # the launcher's world, not this group
        return int(os.environ["WORLD_SIZE"])


class WorldSizeWithoutTheGroup(_Wrapper):
    def size(self):
        return dist.get_world_size()


class AllReduceWithoutTheGroup(_Wrapper):
    def launch(self, grad):
        return dist.all_reduce(grad, op=SUM, async_op=True)  # the whole world


class HandlesNeverCleared(_Wrapper):
    def finish_gradient_synchronization(self):
        size = self.size()
        for work, grad in self._pending:  # a second call divides them all again
            work.wait()
            grad.div_(size)


class DividesEveryGradient(_Wrapper):
    def finish_gradient_synchronization(self):
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()
        for param in self.module.parameters():  # "every gradient was summed, surely"
            if param.requires_grad:
                param.grad.div_(self.size())


class DividedTwice(_Wrapper):
    def launch(self, grad):  # divides first, as torch's DDP does...
        grad.div_(self.size())
        return super().launch(grad)  # ...and the finish still divides the sum


# --------------------------------------------------------------------------- no_sync


class NoSyncIgnored(_Wrapper):
    @contextlib.contextmanager
    def no_sync(self):  # "DDP's no_sync is an optimisation; skipping it is only slower"
        yield


class NoSyncNeverRestored(_Wrapper):
    @contextlib.contextmanager
    def no_sync(self):
        self._syncing = False
        yield


class NoSyncWithoutFinally(_Wrapper):
    @contextlib.contextmanager
    def no_sync(self):
        self._syncing = False
        yield
        self._syncing = True  # never reached when the block raises


class NoSyncSwitchesBackOn(_Wrapper):
    @contextlib.contextmanager
    def no_sync(self):
        self._syncing = False
        try:
            yield
        finally:
            self._syncing = True  # also when an outer no_sync is still open


# --------------------------------------------------------------------------- right answers


class DividedBeforeTheSum(_Wrapper):
    """As torch's DDP: each gradient is divided by the group's size before its SUM all-reduce
    (a sum of gradients / N is their mean); the finish only waits."""

    def launch(self, grad):
        grad.div_(self.size())
        return dist.all_reduce(grad, op=SUM, group=self.process_group, async_op=True)

    def finish_gradient_synchronization(self):
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()


class AveragedByTheBackend(_Wrapper):
    """ReduceOp.AVG: the backend divides; nothing is left to divide after the wait."""

    def launch(self, grad):
        return dist.all_reduce(grad, op=dist.ReduceOp.AVG, group=self.process_group, async_op=True)

    def finish_gradient_synchronization(self):
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()


class ReducedACopyAndCopiedBack(_Wrapper):
    """All-reduces a copy of each gradient and copies the mean back into .grad in the finish."""

    def _on_gradient_ready(self, param):
        if self._syncing:
            copy = param.grad.detach().clone()
            work = dist.all_reduce(copy, op=SUM, group=self.process_group, async_op=True)
            self._pending.append((work, (param, copy)))

    def finish_gradient_synchronization(self):
        size = self.size()
        for work, (param, copy) in self._pending:
            work.wait()
            param.grad.copy_(copy.div_(size))
        self._pending.clear()


class CoalescedDDP(nn.Module):
    """Broadcasts the state in one flat tensor per dtype (as torch's DDP does), keeps each
    parameter's handle in a dict, and counts no_sync's depth."""

    def __init__(self, module, process_group=None):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise ValueError("OverlappingDDP wraps an nn.Module")
        if process_group is not None and process_group == dist.GroupMember.NON_GROUP_MEMBER:
            raise ValueError("this rank is not in the process group")
        self.module = module
        self.process_group = process_group
        self._handles = {}
        self._quiet = 0
        group = process_group or dist.group.WORLD
        tensors = [*module.parameters(), *module.buffers()]
        with torch.no_grad():
            for dtype in sorted({t.dtype for t in tensors}, key=str):
                same = [t for t in tensors if t.dtype == dtype]
                flat = _flatten_dense_tensors(same)
                dist.broadcast(flat, src=dist.get_global_rank(group, 0), group=process_group)
                for tensor, value in zip(same, _unflatten_dense_tensors(flat, same)):
                    tensor.copy_(value)
        self._register_hooks()

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _register_hooks(self):
        for param in {id(p): p for p in self.module.parameters() if p.requires_grad}.values():
            param.register_post_accumulate_grad_hook(self._on_gradient_ready)

    def _on_gradient_ready(self, param):
        if self._quiet == 0:
            self._handles[param] = dist.all_reduce(
                param.grad, group=self.process_group, async_op=True
            )

    def finish_gradient_synchronization(self):
        handles, self._handles = self._handles, {}
        for param, handle in handles.items():
            handle.wait()
            param.grad /= dist.get_world_size(self.process_group)

    @contextlib.contextmanager
    def no_sync(self):
        self._quiet += 1
        try:
            yield
        finally:
            self._quiet -= 1


class ClosureDDP(nn.Module):
    """One closure per parameter, named; the finish waits on every future at once and divides
    with one foreach call. no_sync keeps a stack of flags (nesting works)."""

    def __init__(self, module, process_group=None):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise ValueError(f"expected an nn.Module, got {type(module).__name__}")
        if process_group is not None and dist.get_rank(process_group) == -1:
            raise ValueError(f"rank {dist.get_rank()} is outside process_group")
        self.module = module
        self.process_group = process_group
        self._works = {}
        self._enabled = [True]
        first = dist.get_process_group_ranks(process_group or dist.group.WORLD)[0]
        with torch.no_grad():
            for _, tensor in [*module.named_parameters(), *module.named_buffers()]:
                dist.broadcast(tensor, src=first, group=process_group)
        self._register_hooks()

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _register_hooks(self):
        for name, param in self.module.named_parameters():
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(functools.partial(self._ready, name))

    def _ready(self, name, param):
        if self._enabled[-1]:
            work = dist.all_reduce(param.grad, op=SUM, group=self.process_group, async_op=True)
            self._works[name] = (work, param.grad)

    def finish_gradient_synchronization(self):
        works, self._works = self._works, {}
        if works:
            torch.futures.wait_all([work.get_future() for work, _ in works.values()])
            grads = [grad for _, grad in works.values()]
            torch._foreach_div_(grads, dist.get_world_size(self.process_group))

    @contextlib.contextmanager
    def no_sync(self):
        self._enabled.append(False)
        try:
            yield
        finally:
            self._enabled.pop()


# --------------------------------------------------------------------------- the catalogue

_BUILD = "test_construction_gives_every_rank_the_first_ranks_state"
_LAUNCH = "test_backward_launches_one_async_sum_all_reduce_per_unique_trainable_parameter"
_OVERLAP = "test_the_first_all_reduce_starts_before_backward_has_finished"
_TRAIN = "test_training_equals_one_process_on_the_whole_batch"
_NO_SYNC = "test_no_sync_accumulates_locally_and_matches_torchs_ddp"
_MEAN = "test_finish_leaves_the_mean_gradient_on_every_rank"

MISTAKES = [
    Mistake(
        "TrainableOnlyBroadcast",
        replaces="OverlappingDDP",
        fails=[f"{_BUILD}[frozen]"],
        says=["frozen parameter 'frozen.weight' still holds its own", "frozen ones too"],
    ),
    Mistake(
        "BuffersForgotten",
        replaces="OverlappingDDP",
        fails=[f"{_BUILD}[buffer]"],
        says=["buffer 'scale' still holds its own values", "module.buffers()"],
    ),
    Mistake(
        "ForwardDropsKeywords",
        replaces="OverlappingDDP",
        fails=[_BUILD],
        says=["keyword arguments too", "self.module(*args, **kwargs)"],
    ),
    Mistake(
        "AveragedTheStates",
        replaces="OverlappingDDP",
        fails=[_BUILD],
        says=[
            "construction called all_reduce",
            "Copy the first rank's tensors with dist.broadcast",
        ],
    ),
    Mistake(
        "ReceivedIntoFreshTensors",
        replaces="OverlappingDDP",
        fails=[_BUILD],
        says=["replaced the tensors", "in place"],
    ),
    Mistake(
        "SourceIsGlobalRankZero",
        replaces="OverlappingDDP",
        fails=["test_construction_inside_subgroups_copies_the_groups_first_rank"],
        says=["global rank 0 is not in the group of ranks 2 and 3", "get_global_rank"],
    ),
    Mistake(
        "NoArgumentChecks",
        replaces="OverlappingDDP",
        fails=["test_construction_refuses_bad_arguments"],
        says=["raise ValueError"],
    ),
    Mistake(
        "HookOnEveryParameter",
        replaces="OverlappingDDP",
        fails=[f"{_LAUNCH}[frozen]", f"{_OVERLAP}[frozen]"],
        says=["frozen parameters (requires_grad=False)", "only on each trainable parameter"],
    ),
    Mistake(
        "TiedWeightHookedTwice",
        replaces="OverlappingDDP",
        fails=[f"{_LAUNCH}[tied]"],
        says=["launched 4 all-reduces, expected 3", "one hook, one all-reduce"],
    ),
    Mistake(
        "BlockingAllReduce",
        replaces="OverlappingDDP",
        fails=[_LAUNCH],
        says=["blocking", "async_op=True"],
    ),
    Mistake(
        "OnlyRankZeroLaunches",
        replaces="OverlappingDDP",
        fails=[_LAUNCH],
        says=["rank 1 launched 0", "no `if rank == ...`"],
    ),
    Mistake(
        "AllReduceInFinish",
        replaces="OverlappingDDP",
        fails=[_LAUNCH, _OVERLAP],
        says=["launched no all-reduce", "nothing overlaps"],
    ),
    Mistake(
        "ReducedACopy",
        replaces="OverlappingDDP",
        fails=[_MEAN],
        says=["still holds this rank's own gradient", "never reached .grad"],
    ),
    Mistake(
        "ReducedTheWeights",
        replaces="OverlappingDDP",
        fails=[_LAUNCH],
        says=["changed the weights", "not the parameter itself"],
    ),
    Mistake(
        "NotDivided",
        replaces="OverlappingDDP",
        fails=[_MEAN],
        says=["holds the sum of the 2 ranks' gradients", "divide by the group's size"],
    ),
    Mistake(
        "DividedTwice",
        replaces="OverlappingDDP",
        fails=[_MEAN],
        says=["the mean divided by 2 once more", "Divide once"],
    ),
    Mistake(
        "WorldSizeFromTheEnvironment",
        replaces="OverlappingDDP",
        fails=["test_finish_averages_over_the_process_group"],
        says=["divided by 4", "dist.get_world_size(self.process_group)"],
    ),
    Mistake(
        "WorldSizeWithoutTheGroup",
        replaces="OverlappingDDP",
        fails=["test_finish_averages_over_the_process_group"],
        says=["divided by 4", "dist.get_world_size(self.process_group)"],
    ),
    Mistake(
        "AllReduceWithoutTheGroup",
        replaces="OverlappingDDP",
        fails=["test_finish_averages_over_the_process_group"],
        says=["without group=", "group=self.process_group"],
    ),
    Mistake(
        "HandlesNeverCleared",
        replaces="OverlappingDDP",
        fails=["test_finish_is_harmless_with_nothing_launched_and_a_second_time"],
        says=["a second finish_gradient_synchronization() changed", "Clear the handles"],
    ),
    Mistake(
        "DividesEveryGradient",
        replaces="OverlappingDDP",
        fails=[
            "test_finish_is_harmless_with_nothing_launched_and_a_second_time",
            _NO_SYNC,
        ],
        says=["nothing launched"],
    ),
    Mistake(
        "NoSyncIgnored",
        replaces="OverlappingDDP",
        fails=[_NO_SYNC],
        says=["all-reduces inside no_sync()", "the hooks launch nothing"],
    ),
    Mistake(
        "NoSyncNeverRestored",
        replaces="OverlappingDDP",
        fails=[_NO_SYNC, "test_no_sync_switches_the_hooks_back_on_even_after_an_error"],
        says=["the hooks launch again", "restore"],
    ),
    Mistake(
        "NoSyncWithoutFinally",
        replaces="OverlappingDDP",
        fails=["test_no_sync_switches_the_hooks_back_on_even_after_an_error"],
        says=["after an exception inside no_sync()", "finally"],
    ),
    Mistake(
        "NoSyncSwitchesBackOn",
        replaces="OverlappingDDP",
        fails=["test_nested_no_sync_restores_what_it_found"],
        says=["nested", "restores the value it found"],
    ),
]

# Each right answer must pass every test of the steps it names.
RIGHT_ANSWERS = [
    RightAnswer("CoalescedDDP", replaces="OverlappingDDP", steps=(1, 2, 3, 4)),
    RightAnswer("ClosureDDP", replaces="OverlappingDDP", steps=(1, 2, 3, 4)),
    RightAnswer("DividedBeforeTheSum", replaces="OverlappingDDP", steps=(2, 3, 4)),
    RightAnswer("AveragedByTheBackend", replaces="OverlappingDDP", steps=(2, 3, 4)),
    RightAnswer("ReducedACopyAndCopiedBack", replaces="OverlappingDDP", steps=(2, 3, 4)),
]
