"""k23's mistakes catalogue: real mistakes in turning hangs into errors (StoreBarrier.wait,
fingerprint, describe_mismatch, checked, torch_checked_group), and right answers written another
way. See ``dojo/dev/mistakes/__init__.py`` for what each list promises.

Each StoreBarrier entry is a subclass of the reference with ``wait`` done the way a learner might
(the catalogue swaps whole classes).
"""

from __future__ import annotations

import collections
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from dojo.dev.mistakes import Mistake, RightAnswer
from solutions import k23_hangs as reference

_Reference = reference.StoreBarrier
BarrierTimeout = reference.BarrierTimeout
CollectiveMismatch = reference.CollectiveMismatch
ranks_text = reference.ranks_text
fingerprint_ = reference.fingerprint
describe_mismatch_ = reference.describe_mismatch
POLL_S = reference.POLL_S


# --------------------------------------------------------------------------- StoreBarrier.wait


class NamesWhoArrived(_Reference):
    """Collects the ranks whose key is there, and names those."""

    def wait(self) -> None:
        self.generation += 1
        self.store.set(self.key(self.generation, self.rank), "here")
        give_up = time.monotonic() + self.timeout_s
        while True:
            here = [
                r
                for r in range(self.world_size)
                if self.store.check([self.key(self.generation, r)])
            ]
            if len(here) == self.world_size:
                return
            if time.monotonic() >= give_up:
                raise BarrierTimeout(
                    f"barrier {self.name!r}: {ranks_text(here)} did not arrive", here
                )
            time.sleep(POLL_S)


class ReusesKeys(_Reference):
    """Counts the calls but keys every call the same: the second call finds the first's keys."""

    def wait(self) -> None:
        self.generation += 1
        self.store.set(self.key(1, self.rank), "here")
        give_up = time.monotonic() + self.timeout_s
        while True:
            missing = [r for r in range(self.world_size) if not self.store.check([self.key(1, r)])]
            if not missing:
                return
            if time.monotonic() >= give_up:
                raise BarrierTimeout(f"{ranks_text(missing)} did not arrive", missing)
            time.sleep(POLL_S)


class NeverGivesUp(_Reference):
    """Waits for every key with no deadline: the hang, rebuilt."""

    def wait(self) -> None:
        self.generation += 1
        self.store.set(self.key(self.generation, self.rank), "here")
        while not all(
            self.store.check([self.key(self.generation, r)]) for r in range(self.world_size)
        ):
            time.sleep(POLL_S)


class OnlyRankZeroWaits(_Reference):
    """ "Rank 0 is the coordinator": the others check in and go on."""

    def wait(self) -> None:
        self.generation += 1
        self.store.set(self.key(self.generation, self.rank), "here")
        if self.rank != 0:
            return
        give_up = time.monotonic() + self.timeout_s
        while True:
            keys = [self.key(self.generation, r) for r in range(self.world_size)]
            missing = [r for r, k in enumerate(keys) if not self.store.check([k])]
            if not missing:
                return
            if time.monotonic() >= give_up:
                raise BarrierTimeout(f"{ranks_text(missing)} did not arrive", missing)
            time.sleep(POLL_S)


class LooksOnce(_Reference):
    """Looks once and raises at once: a barrier without the waiting."""

    def wait(self) -> None:
        self.generation += 1
        self.store.set(self.key(self.generation, self.rank), "here")
        keys = [self.key(self.generation, r) for r in range(self.world_size)]
        missing = [r for r, k in enumerate(keys) if not self.store.check([k])]
        if missing:
            raise BarrierTimeout(f"{ranks_text(missing)} did not arrive", missing)


# Right answer: let the store wait (with a timeout), and only then look who is missing.


class WaitsThenLooks(_Reference):
    def wait(self) -> None:
        self.generation += 1
        self.store.set(self.key(self.generation, self.rank), "here")
        keys = [self.key(self.generation, r) for r in range(self.world_size)]
        try:
            self.store.wait(keys, timedelta(seconds=self.timeout_s))
        except RuntimeError:  # torch's DistStoreError: the wait timed out
            missing = [r for r, k in enumerate(keys) if not self.store.check([k])]
            if not missing:  # they came in just as the wait gave up
                return
            raise BarrierTimeout(
                f"rank {self.rank}: {ranks_text(missing)} did not arrive within "
                f"{self.timeout_s:g} s",
                missing,
            ) from None


# --------------------------------------------------------------------------- fingerprints


def shape_only(op_name, tensor):
    if not isinstance(op_name, str) or not op_name:
        raise ValueError("op_name must be a collective's name")
    if not isinstance(tensor, torch.Tensor):
        raise ValueError("tensor must be a torch.Tensor")
    return f"{op_name}([{', '.join(map(str, tensor.shape))}])"


def torch_dtype_text(op_name, tensor):
    if not isinstance(op_name, str) or not op_name:
        raise ValueError("op_name must be a collective's name")
    if not isinstance(tensor, torch.Tensor):
        raise ValueError("tensor must be a torch.Tensor")
    return f"{op_name}({tensor.dtype}[{', '.join(map(str, tensor.shape))}])"


def compares_with_rank_zero(prints):
    """Rank 0 is the reference: whoever differs from it is to blame."""
    differ = [r for r, p in enumerate(prints) if p != prints[0]]
    if not differ:
        return None
    same = [r for r, p in enumerate(prints) if p == prints[0]]
    odd = f"{ranks_text(differ)} call{'s' if len(differ) == 1 else ''} {prints[differ[0]]}"
    return f"{odd}; {ranks_text(same)} call{'s' if len(same) == 1 else ''} {prints[0]}"


def largest_group_first(prints):
    groups = {}
    for rank, text in enumerate(prints):
        groups.setdefault(text, []).append(rank)
    if len(groups) <= 1:
        return None
    ordered = sorted(groups.items(), key=lambda item: (-len(item[1]), item[1][0]))
    return "; ".join(f"{ranks_text(r)} call{'s' if len(r) == 1 else ''} {t}" for t, r in ordered)


# Right answer: count with a Counter, then list.


def with_a_counter(prints):
    counts = collections.Counter(prints)
    if len(counts) < 2:
        return None

    def first_rank(text):
        return prints.index(text)

    parts = []
    for text in sorted(counts, key=lambda t: (counts[t], first_rank(t))):
        ranks = [r for r, p in enumerate(prints) if p == text]
        verb = "calls" if len(ranks) == 1 else "call"
        parts.append(f"{ranks_text(ranks)} {verb} {text}")
    return "; ".join(parts)


# --------------------------------------------------------------------------- checked


def raises_on_the_odd_rank_only(collective, tensor, /, *args, group=None, **kwargs):
    """ "Whoever is not with the majority raises": the majority walk into the collective."""
    mine = fingerprint_(collective.__name__, tensor)
    prints = [None] * dist.get_world_size(group)
    dist.all_gather_object(prints, mine, group=group)
    if prints.count(mine) <= len(prints) // 2:
        raise CollectiveMismatch(f"collective mismatch: {describe_mismatch_(prints)}")
    return collective(tensor, *args, group=group, **kwargs)


def drops_keyword_arguments(collective, tensor, /, *args, group=None, **kwargs):
    mine = fingerprint_(collective.__name__, tensor)
    prints = [None] * dist.get_world_size(group)
    dist.all_gather_object(prints, mine, group=group)
    problem = describe_mismatch_(prints)
    if problem is not None:
        raise CollectiveMismatch(f"collective mismatch: {problem}")
    return collective(tensor, *args, group=group)


def returns_nothing(collective, tensor, /, *args, group=None, **kwargs):
    mine = fingerprint_(collective.__name__, tensor)
    prints = [None] * dist.get_world_size(group)
    dist.all_gather_object(prints, mine, group=group)
    problem = describe_mismatch_(prints)
    if problem is not None:
        raise CollectiveMismatch(f"collective mismatch: {problem}")
    collective(tensor, *args, group=group, **kwargs)


def exchanges_on_the_world(collective, tensor, /, *args, group=None, **kwargs):
    """The collective on the group, but the fingerprints exchanged on the whole world."""
    mine = fingerprint_(collective.__name__, tensor)
    prints = [None] * dist.get_world_size()
    dist.all_gather_object(prints, mine)
    problem = describe_mismatch_(prints)
    if problem is not None:
        raise CollectiveMismatch(f"collective mismatch: {problem}")
    return collective(tensor, *args, group=group, **kwargs)


def collective_on_the_world(collective, tensor, /, *args, group=None, **kwargs):
    """The fingerprints exchanged on the group, but the collective itself run on the world."""
    mine = fingerprint_(collective.__name__, tensor)
    prints = [None] * dist.get_world_size(group)
    dist.all_gather_object(prints, mine, group=group)
    problem = describe_mismatch_(prints)
    if problem is not None:
        raise CollectiveMismatch(f"rank {dist.get_rank(group)}: collective mismatch: {problem}")
    return collective(tensor, *args, **kwargs)  # "group is checked()'s own business"


# Right answer: every rank broadcasts its fingerprint in turn.


def by_broadcasts(collective, tensor, /, *args, group=None, **kwargs):
    size = dist.get_world_size(group)
    prints = []
    for source in range(size):
        box = [fingerprint_(collective.__name__, tensor)]
        src = source if group is None else dist.get_global_rank(group, source)
        dist.broadcast_object_list(box, src=src, group=group)
        prints.append(box[0])
    problem = describe_mismatch_(prints)
    if problem:
        raise CollectiveMismatch(f"rank {dist.get_rank(group)}: {problem}")
    return collective(tensor, *args, group=group, **kwargs)


# --------------------------------------------------------------------------- torch_checked_group


def _valid(timeout_s):
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")


def sets_the_environment_variable(timeout_s):
    """The documented switch, set too late: torch read it when it started."""
    _valid(timeout_s)
    os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    try:
        return dist.new_group(timeout=timedelta(seconds=timeout_s))
    finally:
        del os.environ["TORCH_DISTRIBUTED_DEBUG"]


def leaves_detail_on(timeout_s):
    _valid(timeout_s)
    dist.set_debug_level(dist.DebugLevel.DETAIL)
    return dist.new_group(timeout=timedelta(seconds=timeout_s))


def no_timeout(timeout_s):
    """DETAIL, but the group keeps torch's default timeout (minutes)."""
    _valid(timeout_s)
    before = dist.get_debug_level()
    dist.set_debug_level(dist.DebugLevel.DETAIL)
    try:
        return dist.new_group()
    finally:
        dist.set_debug_level(before)


def timeout_in_milliseconds(timeout_s):
    _valid(timeout_s)
    before = dist.get_debug_level()
    dist.set_debug_level(dist.DebugLevel.DETAIL)
    try:
        return dist.new_group(timeout=timedelta(milliseconds=timeout_s))
    finally:
        dist.set_debug_level(before)


# Right answer: the environment variable, then ask torch to read it again.


def from_the_environment(timeout_s):
    _valid(timeout_s)
    before_env = os.environ.get("TORCH_DISTRIBUTED_DEBUG")
    before = dist.get_debug_level()
    os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    dist.set_debug_level_from_env()
    try:
        return dist.new_group(timeout=timedelta(seconds=timeout_s))
    finally:
        if before_env is None:
            del os.environ["TORCH_DISTRIBUTED_DEBUG"]
        else:
            os.environ["TORCH_DISTRIBUTED_DEBUG"] = before_env
        dist.set_debug_level(before)


_NAMED = "test_barrier_names_the_ranks_that_did_not_arrive"
_RAISES = "test_checked_raises_on_every_rank_naming_the_rank_that_differs"
_DESCRIBE = "test_describe_mismatch_names_the_odd_ranks_first"
_FINGERPRINT = "test_fingerprint_names_the_collective_dtype_and_shape"

MISTAKES = [
    Mistake(
        "NamesWhoArrived",
        replaces="StoreBarrier",
        fails=[f"{_NAMED}[rank3]", f"{_NAMED}[ranks1and3]"],
        says=["those are the ranks that arrived", "NOT in the store"],
    ),
    Mistake(
        "ReusesKeys",
        replaces="StoreBarrier",
        fails=["test_repeated_barriers_do_not_confuse_each_other"],
        says=["passed at once", "put the count in the key"],
    ),
    Mistake(
        "NeverGivesUp",
        replaces="StoreBarrier",
        fails=[f"{_NAMED}[rank3]"],
        says=["still waiting long after the timeout", "give up once timeout_s"],
    ),
    Mistake(
        "OnlyRankZeroWaits",
        replaces="StoreBarrier",
        fails=["test_barrier_waits_for_a_late_rank"],
        says=["before rank 3 had arrived", "or only rank 0?"],
    ),
    Mistake(
        "LooksOnce",
        replaces="StoreBarrier",
        fails=["test_barrier_waits_for_a_late_rank"],
        says=["raised BarrierTimeout after", "keep looking until every rank has arrived"],
    ),
    Mistake(
        "shape_only",
        replaces="fingerprint",
        fails=[f"{_FINGERPRINT}[vector]", f"{_FINGERPRINT}[matrix-float64]"],
        says=["it leaves out the dtype"],
    ),
    Mistake(
        "torch_dtype_text",
        replaces="fingerprint",
        fails=[f"{_FINGERPRINT}[vector]"],
        says=["dtype without 'torch.'"],
    ),
    Mistake(
        "compares_with_rank_zero",
        replaces="describe_mismatch",
        fails=[f"{_DESCRIBE}[rank0-odd]"],
        says=["rank 0 alone differs", "Comparing with rank 0 blames the wrong ranks"],
    ),
    Mistake(
        "largest_group_first",
        replaces="describe_mismatch",
        fails=[f"{_DESCRIBE}[rank2-odd]"],
        says=["smallest group first"],
    ),
    Mistake(
        "raises_on_the_odd_rank_only",
        replaces="checked",
        fails=[f"{_RAISES}[shape]"],
        says=["not only the one that differs"],
    ),
    Mistake(
        "drops_keyword_arguments",
        replaces="checked",
        fails=["test_checked_runs_the_collective_once_when_all_agree"],
        says=["ReduceOp.MAX", "pass the collective's keyword arguments on"],
    ),
    Mistake(
        "returns_nothing",
        replaces="checked",
        fails=["test_checked_runs_the_collective_once_when_all_agree"],
        says=["async_op=True) returned None", "return what the collective returned"],
    ),
    Mistake(
        "exchanges_on_the_world",
        replaces="checked",
        fails=["test_checked_in_a_subgroup_names_the_groups_ranks"],
        says=["rank 0, outside their group, never calls", "pass group=group to the exchange"],
    ),
    Mistake(
        "collective_on_the_world",
        replaces="checked",
        fails=["test_checked_in_a_subgroup_names_the_groups_ranks"],
        says=["ran the collective itself on the world", "Pass group=group to the collective too"],
    ),
    Mistake(
        "sets_the_environment_variable",
        replaces="torch_checked_group",
        fails=["test_torch_checked_group_catches_a_shape_mismatch"],
        says=["torch checked nothing", "read only when torch starts"],
    ),
    Mistake(
        "leaves_detail_on",
        replaces="torch_checked_group",
        fails=["test_torch_checked_group_catches_a_shape_mismatch"],
        says=["left the debug level at", "restore what was there"],
    ),
    Mistake(
        "no_timeout",
        replaces="torch_checked_group",
        fails=["test_torch_checked_group_gives_up_after_its_timeout"],
        says=["waited for ever", "dist.new_group(timeout=timedelta(seconds=timeout_s))"],
    ),
    Mistake(
        "timeout_in_milliseconds",
        replaces="torch_checked_group",
        fails=[
            "test_torch_checked_group_catches_a_shape_mismatch",
            "test_torch_checked_group_gives_up_after_its_timeout",
        ],
        says=["the timeout is in seconds"],
    ),
]

RIGHT_ANSWERS = [
    RightAnswer("WaitsThenLooks", replaces="StoreBarrier", steps=(1,)),
    RightAnswer("with_a_counter", replaces="describe_mismatch"),
    RightAnswer("by_broadcasts", replaces="checked"),
    RightAnswer("from_the_environment", replaces="torch_checked_group"),
]
