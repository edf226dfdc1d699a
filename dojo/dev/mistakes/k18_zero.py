"""k18's mistakes catalogue: real mistakes in sharding an optimizer (assign_owners, and
ShardedOptimizer's construction, step and add_param_group), and right answers written another
way. See ``dojo/dev/mistakes/__init__.py`` for what each list promises.

Each ShardedOptimizer entry is a subclass of the reference with one method done the way a learner
might (the catalogue swaps whole classes).
"""

from __future__ import annotations

import heapq

import torch
import torch.distributed as dist

from dojo.dev.mistakes import Mistake, RightAnswer
from solutions import k18_zero as reference

_Reference = reference.ShardedOptimizer


def _check(world_size, loads):
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    loads = [0] * world_size if loads is None else list(loads)
    if len(loads) != world_size:
        raise ValueError(f"loads has {len(loads)} entries for {world_size} ranks")
    return loads


# --------------------------------------------------------------------------- assign_owners


def round_robin(sizes, world_size, loads=None):
    _check(world_size, loads)
    return [index % world_size for index in range(len(sizes))]  # "spread them evenly"


def in_the_order_given(sizes, world_size, loads=None):
    loads = _check(world_size, loads)
    owners = []
    for size in sizes:  # least loaded, but not the largest first
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        owners.append(rank)
        loads[rank] += size
    return owners


def shuffled_first(sizes, world_size, loads=None):
    loads = _check(world_size, loads)
    order = torch.randperm(len(sizes)).tolist()  # "break ties at random": the RNG moves
    owners = [0] * len(sizes)
    for index in sorted(order, key=lambda i: -sizes[i]):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        owners[index] = rank
        loads[rank] += sizes[index]
    return owners


def loads_ignored(sizes, world_size, loads=None):
    _check(world_size, loads)
    loads = [0] * world_size  # starts from zero every time
    owners = [0] * len(sizes)
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        owners[index] = rank
        loads[rank] += sizes[index]
    return owners


def loads_changed_in_place(sizes, world_size, loads=None):
    loads = _check(world_size, None) if loads is None else loads  # the caller's list, updated
    if len(loads) != world_size:
        raise ValueError("loads: one per rank")
    owners = [0] * len(sizes)
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        owners[index] = rank
        loads[rank] += sizes[index]
    return owners


def heap_of_loads(sizes, world_size, loads=None):
    """Right: a min-heap of (load, rank) pops the least-loaded rank (ties: the lower rank)."""
    heap = [(load, rank) for rank, load in enumerate(_check(world_size, loads))]
    heapq.heapify(heap)
    owners = [0] * len(sizes)
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        load, rank = heapq.heappop(heap)
        owners[index] = rank
        heapq.heappush(heap, (load + sizes[index], rank))
    return owners


# --------------------------------------------------------------------------- __init__


class InnerGetsEverything(_Reference):
    def _owned_part(self, group):
        super()._owned_part(group)  # owners assigned...
        return dict(group)  # ...but the inner optimizer updates every parameter


class DefaultsPopped(_Reference):
    def __init__(self, params, optimizer_cls, process_group=None, **defaults):
        lr = defaults.pop("lr", 1e-3)  # "lr goes into the groups"
        self._lr = lr
        super().__init__(params, optimizer_cls, process_group, lr=lr, **defaults)
        self.inner = optimizer_cls(
            [{**self._owned_part(g), "lr": g["lr"]} for g in self.param_groups], **defaults
        )


class PlainListsToTheInner(_Reference):
    def __init__(self, params, optimizer_cls, process_group=None, **defaults):
        super().__init__(params, optimizer_cls, process_group, **defaults)
        owned = [p for g in self.param_groups for p in g["params"] if self.owners[p] == self.rank]
        self.inner = optimizer_cls(owned, **defaults)  # one group: each group's own lr is lost

    def step(self, closure=None):
        self.inner.step()
        group = self.process_group if self.process_group is not None else dist.group.WORLD
        with torch.no_grad():
            for outer in self.param_groups:
                for param in outer["params"]:
                    source = dist.get_global_rank(group, self.owners[param])
                    dist.broadcast(param, src=source, group=self.process_group)


class GeneratorReadTwice(_Reference):
    def __init__(self, params, optimizer_cls, process_group=None, **defaults):
        self.total = sum(p.numel() for p in params)  # reads the generator to the end
        super().__init__(params, optimizer_cls, process_group, **defaults)


class RankOfTheWorld(_Reference):
    def __init__(self, params, optimizer_cls, process_group=None, **defaults):
        super().__init__(params, optimizer_cls, process_group, **defaults)

    def _owned_part(self, group):
        self.rank = dist.get_rank()  # the rank in the whole world, not in the group
        return super()._owned_part(group)


class ZeroGradOwnedOnly(_Reference):
    def zero_grad(self, set_to_none=True):
        self.inner.zero_grad(set_to_none)  # "the inner optimizer has the parameters"


class LrOnlyToTheInner(_Reference):
    def _owned_part(self, group):
        part = super()._owned_part(group)
        return {"params": part["params"], "lr": group["lr"]}  # "lr is what a group changes"


class EmptyDefaultsOuter(_Reference):
    """Right: the outer Optimizer made with defaults={} (its groups hold only what they bring);
    the inner one gets the keyword arguments, and step() passes on whatever the groups hold."""

    def __init__(self, params, optimizer_cls, process_group=None, **defaults):
        self.process_group = process_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        self.optimizer_cls = optimizer_cls
        self.owners, self.loads, self.inner = {}, [0] * self.world_size, None
        torch.optim.Optimizer.__init__(self, params, {})
        self.inner = optimizer_cls([self._owned_part(g) for g in self.param_groups], **defaults)


class ListedFirst(_Reference):
    """Right: the parameters into a list first (read once), groups made by hand."""

    def __init__(self, params, optimizer_cls, process_group=None, **defaults):
        params = list(params)
        if params and not isinstance(params[0], dict):
            params = [{"params": params}]
        super().__init__(params, optimizer_cls, process_group, **defaults)


class FlatSlices(torch.optim.Optimizer):
    """A real course's ZeRO-1 (DeepSpeed's way): every parameter end to end in one flat buffer,
    padded, cut into equal slices; each rank's inner optimizer updates its slice, then an
    all-gather puts the buffer back together. Right elsewhere; this kata shards whole
    parameters (the spec once crashed on it, indexing its own dict by the slice)."""

    def __init__(self, params, optimizer_cls, process_group=None, **defaults):
        super().__init__(params, defaults)
        self.process_group = process_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        self.all = [p for g in self.param_groups for p in g["params"]]
        self.size = -(-sum(p.numel() for p in self.all) // self.world_size)
        self.flat = self._flat([p.detach() for p in self.all])
        self.slice = self.flat[self.rank * self.size : (self.rank + 1) * self.size]  # a view
        self.inner = optimizer_cls([self.slice], **defaults)

    def _flat(self, tensors):
        flat = torch.cat([t.reshape(-1) for t in tensors])
        return torch.cat([flat, flat.new_zeros(self.size * self.world_size - flat.numel())])

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in self.all]
        self.slice.grad = self._flat(grads)[self.rank * self.size : (self.rank + 1) * self.size]
        self.inner.step()
        full = torch.empty_like(self.flat)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(full, self.slice.clone(), group=self.process_group)
        offset = 0
        for param in self.all:
            param.copy_(full[offset : offset + param.numel()].view_as(param))
            offset += param.numel()
        return loss


# --------------------------------------------------------------------------- step


def _broadcast_all(optimizer, order, source_of):
    with torch.no_grad():
        for param in order:
            dist.broadcast(param, src=source_of(param), group=optimizer.process_group)


def _global(optimizer, param):
    group = optimizer.process_group if optimizer.process_group is not None else dist.group.WORLD
    return dist.get_global_rank(group, optimizer.owners[param])


def _all(optimizer):
    return [p for g in optimizer.param_groups for p in g["params"]]


class NoBroadcast(_Reference):
    def step(self, closure=None):
        self.inner.step()  # "each rank updated its own part": the others never hear of it


class BroadcastFromTheGroupRank(_Reference):
    def step(self, closure=None):
        self.inner.step()
        _broadcast_all(self, _all(self), lambda p: self.owners[p])  # a group rank as src


class OwnedFirst(_Reference):
    def step(self, closure=None):
        self.inner.step()
        mine = [p for p in _all(self) if self.owners[p] == self.rank]
        others = [p for p in _all(self) if self.owners[p] != self.rank]
        _broadcast_all(self, mine + others, lambda p: _global(self, p))  # rank-dependent order


class BroadcastOnTheWorld(_Reference):
    def step(self, closure=None):
        self.inner.step()
        with torch.no_grad():
            for param in _all(self):
                dist.broadcast(param, src=_global(self, param))  # no group=


class OptionsNeverPassedOn(_Reference):
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.inner.step()  # with the options it was built with, whatever a scheduler set since
        _broadcast_all(self, _all(self), lambda p: _global(self, p))
        return loss


class LrOnlyPassedOn(_Reference):
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for outer, inner in zip(self.param_groups, self.inner.param_groups):
            inner["lr"] = outer["lr"]  # "the scheduler changes the lr": the other options stay
        self.inner.step()
        _broadcast_all(self, _all(self), lambda p: _global(self, p))
        return loss


class ClosureLossLost(_Reference):
    def step(self, closure=None):
        super().step(closure)  # the closure runs, its loss is dropped


class ClosureUnderNoGrad(_Reference):
    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None  # still inside no_grad: no graph
        for outer, inner in zip(self.param_groups, self.inner.param_groups):
            inner.update({k: v for k, v in outer.items() if k != "params"})
        self.inner.step()
        _broadcast_all(self, _all(self), lambda p: _global(self, p))
        return loss


class ByOwnerThenOrder(_Reference):
    """Right: rank 0's parameters first, then rank 1's...: an order every rank computes alike."""

    def step(self, closure=None):
        loss = closure() if closure is not None else None  # grad is on here: no decorator
        for outer, inner in zip(self.param_groups, self.inner.param_groups):
            inner.update({k: v for k, v in outer.items() if k != "params"})
        self.inner.step()
        order = sorted(_all(self), key=lambda p: self.owners[p])  # stable: param order inside
        with torch.no_grad():
            for param in order:
                dist.broadcast(param.data, src=_global(self, param), group=self.process_group)
        return loss


# --------------------------------------------------------------------------- add_param_group


class RebuiltOnAdd(_Reference):
    def _shard_new_group(self, group):
        everything = _all(self)  # owners again from scratch, and a fresh inner optimizer
        self.owners, self.loads = {}, [0] * self.world_size
        owners = reference.assign_owners([p.numel() for p in everything], self.world_size)
        self.owners = dict(zip(everything, owners))
        self.inner = self.optimizer_cls(
            [
                {**g, "params": [p for p in g["params"] if self.owners[p] == self.rank]}
                for g in self.param_groups
            ],
            lr=self.defaults["lr"],
        )


class AddedGroupNotSharded(_Reference):
    def _shard_new_group(self, group):
        self.inner.add_param_group(dict(group))  # every rank updates the whole new group...
        for param in group["params"]:
            self.owners[param] = 0  # ...and rank 0 broadcasts its copy


_ASSIGN = "test_assign_owners_gives_the_largest_first_to_the_least_loaded"
_OWNERS = "test_every_parameter_has_one_owner_and_the_inner_optimizer_only_its_own"
_CHANGED = "test_options_changed_after_construction_reach_the_inner_optimizer"
_CLOSURE = "test_step_with_a_closure_calls_it_and_returns_its_loss"

MISTAKES = [
    Mistake(
        "round_robin",
        replaces="assign_owners",
        fails=[
            f"{_ASSIGN}[lesson]",
            f"{_ASSIGN}[alternating]",
            "test_state_bytes_per_rank_are_about_one_nth",
        ],
        says=["round robin"],
    ),
    Mistake(
        "in_the_order_given",
        replaces="assign_owners",
        fails=[f"{_ASSIGN}[alternating]", f"{_ASSIGN}[three-ranks]"],
        says=["take the largest first"],
    ),
    Mistake(
        "shuffled_first",
        replaces="assign_owners",
        fails=[f"{_ASSIGN}[lesson]", f"{_OWNERS}[2]"],
        says=["random number generator"],
    ),
    Mistake(
        "loads_ignored",
        replaces="assign_owners",
        fails=[f"{_ASSIGN}[loads-carried]"],
        says=["ignored the loads it was given"],
    ),
    Mistake(
        "loads_changed_in_place",
        replaces="assign_owners",
        fails=[f"{_ASSIGN}[loads-carried]"],
        says=["changed the loads list it was given"],
    ),
    Mistake(
        "InnerGetsEverything",
        replaces="ShardedOptimizer",
        fails=[_OWNERS, "test_state_bytes_per_rank_are_about_one_nth"],
        says=["every parameter", "only the"],
    ),
    Mistake(
        "DefaultsPopped",
        replaces="ShardedOptimizer",
        fails=[_OWNERS],
        says=["pass **defaults on untouched"],
    ),
    Mistake(
        "PlainListsToTheInner",
        replaces="ShardedOptimizer",
        fails=[
            "test_groups_keep_their_own_options",
            "test_groups_with_their_own_lr_train_as_unsharded",
        ],
        says=["one group per group of self.param_groups"],
    ),
    Mistake(
        "GeneratorReadTwice",
        replaces="ShardedOptimizer",
        fails=[_OWNERS],
        says=["was a generator and it was read twice"],
    ),
    Mistake(
        "RankOfTheWorld",
        replaces="ShardedOptimizer",
        fails=["test_subgroups_of_a_grid_each_shard_over_their_own_ranks"],
        says=["exactly one owner", "by the group's rank and size"],
    ),
    Mistake(
        "FlatSlices",
        replaces="ShardedOptimizer",
        fails=[_OWNERS],
        says=["none of the model's parameters", "shards by whole parameters", "right elsewhere"],
    ),
    Mistake(
        "ZeroGradOwnedOnly",
        replaces="ShardedOptimizer",
        fails=["test_zero_grad_clears_every_parameter"],
        says=["still hold a gradient", "owned or not"],
    ),
    Mistake(
        "NoBroadcast",
        replaces="ShardedOptimizer",
        fails=["test_adamw_steps_equal_unsharded_adamw_bitwise"],
        says=["one per parameter, each from its owner"],
    ),
    Mistake(
        "BroadcastFromTheGroupRank",
        replaces="ShardedOptimizer",
        fails=["test_subgroups_of_a_grid_each_shard_over_their_own_ranks"],
        says=["dist.get_global_rank(group, owner)"],
    ),
    Mistake(
        "OwnedFirst",
        replaces="ShardedOptimizer",
        fails=["test_adamw_steps_equal_unsharded_adamw_bitwise[2]"],
        says=["the same collectives in the same order", "not the owned ones first"],
    ),
    Mistake(
        "BroadcastOnTheWorld",
        replaces="ShardedOptimizer",
        fails=["test_subgroups_of_a_grid_each_shard_over_their_own_ranks"],
        says=["on the optimizer's process group"],
    ),
    Mistake(
        "LrOnlyToTheInner",
        replaces="ShardedOptimizer",
        fails=["test_groups_keep_their_own_options"],
        says=["group 0 has weight_decay=0.01", "every option of its group"],
    ),
    Mistake(
        "OptionsNeverPassedOn",
        replaces="ShardedOptimizer",
        fails=[_CHANGED],
        says=["stepped its group 0 with lr=", "pass every option of each of self.param_groups"],
    ),
    Mistake(
        "LrOnlyPassedOn",
        replaces="ShardedOptimizer",
        fails=[f"{_CHANGED}[assignment]"],
        says=["group 1 with weight_decay=0.0", "pass every option of each of self.param_groups"],
    ),
    Mistake(
        "ClosureLossLost",
        replaces="ShardedOptimizer",
        fails=[_CLOSURE],
        says=["returned None", "return the closure's loss"],
    ),
    Mistake(
        "ClosureUnderNoGrad",
        replaces="ShardedOptimizer",
        fails=[_CLOSURE],
        says=["found no graph", "torch.enable_grad()"],
    ),
    Mistake(
        "RebuiltOnAdd",
        replaces="ShardedOptimizer",
        fails=["test_add_param_group_after_construction"],
        says=["keep their owner"],
    ),
    Mistake(
        "AddedGroupNotSharded",
        replaces="ShardedOptimizer",
        fails=["test_add_param_group_after_construction"],
        says=["exactly one owner"],
    ),
]

RIGHT_ANSWERS = [
    RightAnswer("heap_of_loads", replaces="assign_owners"),
    RightAnswer("ListedFirst", replaces="ShardedOptimizer", steps=(2, 3, 4)),
    RightAnswer("EmptyDefaultsOuter", replaces="ShardedOptimizer", steps=(2, 3, 4)),
    RightAnswer("ByOwnerThenOrder", replaces="ShardedOptimizer", steps=(3,)),
]
