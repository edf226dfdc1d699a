"""k37's mistakes catalogue: real mistakes in a quorum agreed through the store, a step among its
members, a newcomer's state from a live peer, LocalSGD's period and DiLoCo's outer step, and
right answers written another way. See ``dojo/dev/mistakes/__init__.py`` for what each list
promises."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from dojo.dev.mistakes import Mistake, RightAnswer
from dojo.toy_models import loss
from solutions import k37_fault_tolerance as reference

POLL_S = reference.POLL_S
QUORUM_TIMEOUT_S = reference.QUORUM_TIMEOUT_S


# --------------------------------------------------------------------------- step 1: quorum


def _quorum(store, step, replica, previous, min_replicas, timeout, *, check=True,
            check_first=True, wait_for_previous=True, close_early=True, agreed=True,
            enough=True):  # fmt: skip
    """The reference's quorum with one piece done the way a learner might."""
    if check and check_first and min_replicas < 1:
        raise ValueError(f"min_replicas={min_replicas}: pass min_replicas=1 or more")
    prefix = f"quorum/{step}/"
    number = store.add(prefix + "registered", 1)
    store.set(f"{prefix}replica/{number}", str(replica))
    if check and not check_first and min_replicas < 1:
        raise ValueError(f"min_replicas={min_replicas}: pass min_replicas=1 or more")
    deadline = time.monotonic() + timeout
    while agreed is False or not store.check([prefix + "members"]):
        count = store.add(prefix + "registered", 0)
        here = {int(store.get(f"{prefix}replica/{n}")) for n in range(1, count + 1)}
        everyone = set(previous) <= here if wait_for_previous else True
        late = time.monotonic() >= deadline
        if (len(here) >= min_replicas or not enough) and ((everyone and close_early) or late):
            proposal = ",".join(str(r) for r in sorted(here))
            if not agreed:  # each replica writes and keeps its own view
                store.set(prefix + "members", proposal)
                return sorted(here)
            store.compare_set(prefix + "members", "", proposal)
            break
        if late:
            raise TimeoutError(f"step {step}: fewer than min_replicas={min_replicas} registered")
        time.sleep(POLL_S)
    return [int(r) for r in store.get(prefix + "members").decode().split(",")]


def quorum_without_waiting_for_previous(
    store, step, replica, previous, min_replicas=1, timeout=QUORUM_TIMEOUT_S
):
    # closes as soon as min_replicas have registered: the last quorum's members not waited for
    return _quorum(store, step, replica, previous, min_replicas, timeout, wait_for_previous=False)


def quorum_always_waits_for_the_deadline(
    store, step, replica, previous, min_replicas=1, timeout=QUORUM_TIMEOUT_S
):
    # every step costs the whole deadline, even with everyone there
    return _quorum(store, step, replica, previous, min_replicas, timeout, close_early=False)


def quorum_each_returns_its_own_view(
    store, step, replica, previous, min_replicas=1, timeout=QUORUM_TIMEOUT_S
):
    # store.set instead of compare_set, and its own proposal returned: the last writer wins
    return _quorum(store, step, replica, previous, min_replicas, timeout, agreed=False)


def quorum_of_zero_accepted(
    store, step, replica, previous, min_replicas=1, timeout=QUORUM_TIMEOUT_S
):
    return _quorum(store, step, replica, previous, min_replicas, timeout, check=False)


def quorum_refuses_after_registering(
    store, step, replica, previous, min_replicas=1, timeout=QUORUM_TIMEOUT_S
):
    return _quorum(store, step, replica, previous, min_replicas, timeout, check_first=False)


def quorum_ignores_min_replicas(
    store, step, replica, previous, min_replicas=1, timeout=QUORUM_TIMEOUT_S
):
    # at the deadline it closes with whoever came, however few
    return _quorum(store, step, replica, previous, min_replicas, timeout, enough=False)


def quorum_with_a_key_per_replica(
    store, step, replica, previous, min_replicas=1, timeout=QUORUM_TIMEOUT_S
):
    """Right: each replica appends its number to one key (store.append), the count read from
    it; the members agreed through compare_set as well."""
    if min_replicas < 1:
        raise ValueError(
            f"min_replicas={min_replicas}: a quorum needs a replica at least; pass 1 or more"
        )
    prefix = f"quorum/{step}/"
    store.append(prefix + "who", f"{replica};")
    began = time.monotonic()
    while not store.check([prefix + "members"]):
        here = {int(r) for r in store.get(prefix + "who").decode().split(";") if r}
        past = time.monotonic() - began >= timeout
        if len(here) >= min_replicas and (past or all(r in here for r in previous)):
            store.compare_set(prefix + "members", "", ",".join(map(str, sorted(here))))
            continue  # read what was agreed, whoever wrote it
        if past:
            raise TimeoutError(
                f"step {step}: {len(here)} registered in {timeout} s, min_replicas={min_replicas}"
            )
        time.sleep(POLL_S)
    return sorted(int(r) for r in store.get(prefix + "members").decode().split(","))


# --------------------------------------------------------------------------- step 2: a step


def _step(model, optimizer, batch, group, *, before=None, after=None, world=False):
    optimizer.zero_grad()
    value = loss(model, batch)
    value.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    size = dist.get_world_size() if world else group.size()
    if before:
        flat /= size
    dist.all_reduce(flat, group=group)
    if after:
        flat /= size
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
        offset += grad.numel()
    optimizer.step()
    return value.item()


def step_summed_not_divided(model, optimizer, batch, group):
    return _step(model, optimizer, batch, group)


def step_divided_twice(model, optimizer, batch, group):
    return _step(model, optimizer, batch, group, before=True, after=True)


def step_divided_by_the_first_replicas(model, optimizer, batch, group):
    # dist.get_world_size(): the run's replicas (the default group), not this quorum's
    return _step(model, optimizer, batch, group, before=True, world=True)


def step_parameter_by_parameter(model, optimizer, batch, group):
    """Right: an all-reduce per gradient, divided after it."""
    optimizer.zero_grad()
    value = loss(model, batch)
    value.backward()
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)
            p.grad.div_(group.size())
    optimizer.step()
    return float(value)


# --------------------------------------------------------------------------- step 3: newcomer


def _sync(model, optimizer, group, members, previous, *, donor_at=None, momentum=True,
          buffers=True, average=False):  # fmt: skip
    donors = [m for m in members if m in previous]
    if not donors:
        raise ValueError(f"no member of {members} was in the last quorum {previous}")
    donor = members[donor_at] if donor_at is not None else donors[0]
    tensors = [p.data for p in model.parameters()]
    if buffers:
        tensors += list(model.buffers())
    if momentum:
        for p in model.parameters():
            state = optimizer.state[p]
            if state.get("momentum_buffer") is None:
                state["momentum_buffer"] = torch.zeros_like(p)
            tensors.append(state["momentum_buffer"])
    flat = torch.cat([t.reshape(-1).float() for t in tensors])
    if average:
        flat /= group.size()  # every member's state averaged, not the donor's taken
    elif members.index(donor) != group.rank():
        flat.zero_()
    dist.all_reduce(flat, group=group)
    offset = 0
    for tensor in tensors:
        tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
        offset += tensor.numel()
    return donor


def sync_from_group_rank_0(model, optimizer, group, members, previous):
    # the group's first member gives: it may be the newcomer itself
    return _sync(model, optimizer, group, members, previous, donor_at=0)


def sync_from_the_last_member(model, optimizer, group, members, previous):
    # the highest member gives: a newcomer with a high number gives its fresh weights
    return _sync(model, optimizer, group, members, previous, donor_at=-1)


def sync_without_momentum(model, optimizer, group, members, previous):
    return _sync(model, optimizer, group, members, previous, momentum=False)


def sync_parameters_only(model, optimizer, group, members, previous):
    # model.parameters() and the momentum, but not model.buffers()
    return _sync(model, optimizer, group, members, previous, buffers=False)


def sync_averages_the_members(model, optimizer, group, members, previous):
    # "the replicas agree": the mean of everyone's state, the newcomer's fresh weights in it
    return _sync(model, optimizer, group, members, previous, average=True)


def sync_by_broadcast(model, optimizer, group, members, previous):
    """Right: the group's own broadcast from the donor's group rank, tensor by tensor, the
    momentum buffers made first where missing."""
    donor = next((m for m in members if m in previous), None)
    if donor is None:
        raise ValueError(f"none of {members} was in the last quorum {previous}: no donor")
    root = members.index(donor)
    for p in model.parameters():
        if optimizer.state[p].get("momentum_buffer") is None:
            optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p)
    tensors = [p.data for p in model.parameters()] + list(model.buffers())
    tensors += [optimizer.state[p]["momentum_buffer"] for p in model.parameters()]
    for tensor in tensors:
        group.broadcast(tensor, root).wait()
    return donor


# --------------------------------------------------------------------------- step 4: LocalSGD


def _local(optimizer, params, step, period, warmup_steps, group, *, check=True, warmup=True,
           shift=0, divide_after=False, average_first=False):  # fmt: skip
    if check and period < 1:
        raise ValueError(f"period={period}: average every 1 step or more")
    if not average_first:
        optimizer.step()
    first = warmup_steps if warmup else 0
    due = step >= first and (step + shift - first) % period == 0
    if due:
        group = group if group is not None else dist.group.WORLD
        flat = torch.cat([p.data.reshape(-1) for p in params])
        if not divide_after:
            flat /= dist.get_world_size(group)
        dist.all_reduce(flat, group=group)
        if divide_after:
            flat /= dist.get_world_size(group)
        offset = 0
        for p in params:
            p.data.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
    if average_first:
        optimizer.step()
    return due


def local_sgd_from_step_0(optimizer, params, step, period, warmup_steps=0, group=None):
    # the warm-up ignored: averages at 0, period, 2 period, ...
    return _local(optimizer, params, step, period, warmup_steps, group, warmup=False)


def local_sgd_at_the_end_of_each_period(optimizer, params, step, period, warmup_steps=0,
                                        group=None):  # fmt: skip
    # (step + 1) % period: after period steps, where torch averages at the period's first
    return _local(optimizer, params, step, period, warmup_steps, group, shift=1)


def local_sgd_divides_after(optimizer, params, step, period, warmup_steps=0, group=None):
    return _local(optimizer, params, step, period, warmup_steps, group, divide_after=True)


def local_sgd_averages_before_stepping(optimizer, params, step, period, warmup_steps=0,
                                       group=None):  # fmt: skip
    return _local(optimizer, params, step, period, warmup_steps, group, average_first=True)


def local_sgd_with_torchs_average(optimizer, params, step, period, warmup_steps=0, group=None):
    """Right: torch's own model_averaging.utils.average_parameters does the averaging."""
    from torch.distributed.algorithms.model_averaging.utils import average_parameters

    if period < 1:
        raise ValueError(f"period must be 1 or more (1 is DDP), not {period}")
    optimizer.step()
    if step >= warmup_steps and (step - warmup_steps) % period == 0:
        average_parameters(iter(params), group if group is not None else dist.group.WORLD)
        return True
    return False


# --------------------------------------------------------------------------- step 5: DiLoCo


def _outer(params, anchors, outer_optimizer, group, *, sign=1.0, reset=True, refresh=True,
           divide=True):  # fmt: skip
    group = group if group is not None else dist.group.WORLD
    deltas = torch.cat([(a - p.data).reshape(-1) for p, a in zip(params, anchors)]) * sign
    if divide:
        deltas /= dist.get_world_size(group)
    dist.all_reduce(deltas, group=group)
    offset = 0
    for p, anchor in zip(params, anchors):
        if reset:
            p.data.copy_(anchor)
        p.grad = deltas[offset : offset + p.numel()].view_as(p).clone()
        offset += p.numel()
    outer_optimizer.step()
    if refresh:
        for p, anchor in zip(params, anchors):
            anchor.copy_(p.data)


def diloco_sign_flipped(params, anchors, outer_optimizer, group=None):
    # mean - anchor: the outer step walks away from where the replicas went
    _outer(params, anchors, outer_optimizer, group, sign=-1.0)


def diloco_not_reset_to_the_anchors(params, anchors, outer_optimizer, group=None):
    # the outer step taken from this replica's own inner result, not from the anchor
    _outer(params, anchors, outer_optimizer, group, reset=False)


def diloco_anchors_not_refreshed(params, anchors, outer_optimizer, group=None):
    _outer(params, anchors, outer_optimizer, group, refresh=False)


def diloco_summed_deltas(params, anchors, outer_optimizer, group=None):
    _outer(params, anchors, outer_optimizer, group, divide=False)


def diloco_per_parameter(params, anchors, outer_optimizer, group=None):
    """Right: the mean of the parameters all-reduced one by one, the outer gradient taken from
    it, the anchors refreshed in place."""
    group = group if group is not None else dist.group.WORLD
    for p, anchor in zip(params, anchors):
        mean = p.detach().clone()
        dist.all_reduce(mean, group=group)
        mean /= dist.get_world_size(group)
        p.grad = anchor - mean
        with torch.no_grad():
            p.copy_(anchor)
    outer_optimizer.step()
    with torch.no_grad():
        for p, anchor in zip(params, anchors):
            anchor.copy_(p)


# --------------------------------------------------------------------------- the lists

_SAME = "test_every_replica_gets_the_same_quorum"
_NEVER = "test_a_replica_that_never_comes_is_left_out_after_the_deadline"
_LATE = "test_a_late_replica_is_left_out_and_told"
_ZERO = "test_a_quorum_of_zero_is_refused"
_FEW = "test_too_few_replicas_at_the_deadline_is_a_timeout"
_MEAN = "test_a_step_takes_the_mean_over_the_quorum"
_NEWCOMER = "test_a_newcomer_takes_the_state_of_a_live_member"
_TORCH = "test_local_sgd_equals_post_local_sgd_optimizer"
_NESTEROV = "test_diloco_outer_step_is_nesterov_on_the_averaged_delta"

MISTAKES = [
    Mistake(
        "quorum_without_waiting_for_previous",
        replaces="join_quorum",
        fails=[_SAME],
        says=["closed before every member of previous had registered"],
    ),
    Mistake(
        "quorum_always_waits_for_the_deadline",
        replaces="join_quorum",
        fails=[_SAME],
        says=["after the last of them had registered", "close the quorum at once"],
    ),
    Mistake(
        "quorum_each_returns_its_own_view",
        replaces="join_quorum",
        fails=[_LATE],
        says=["The replicas disagree", "compare_set"],
    ),
    Mistake(
        "quorum_of_zero_accepted",
        replaces="join_quorum",
        fails=[_ZERO],
        says=["min_replicas=0) returned", "raise ValueError"],
    ),
    Mistake(
        "quorum_refuses_after_registering",
        replaces="join_quorum",
        fails=[_ZERO],
        says=["registered in the store before refusing"],
    ),
    Mistake(
        "quorum_ignores_min_replicas",
        replaces="join_quorum",
        fails=[_FEW],
        says=["with min_replicas=2 returned [0]", "raise TimeoutError"],
    ),
    Mistake(
        "step_summed_not_divided",
        replaces="train_step",
        fails=[f"{_MEAN}[three]"],
        says=["the members' summed gradient", "divide the sum by group.size()"],
    ),
    Mistake(
        "step_divided_twice",
        replaces="train_step",
        fails=[f"{_MEAN}[three]"],
        says=["divided by 3 twice", "divide once"],
    ),
    Mistake(
        "step_divided_by_the_first_replicas",
        replaces="train_step",
        fails=[f"{_MEAN}[two]"],
        says=["divided by 3, the replicas the run started with", "group.size()"],
    ),
    Mistake(
        "sync_from_group_rank_0",
        replaces="sync_from_peer",
        fails=[_NEWCOMER],
        says=["named 1 as the donor, expected 4", "replica 1 is the newcomer"],
    ),
    Mistake(
        "sync_from_the_last_member",
        replaces="sync_from_peer",
        fails=[_NEWCOMER],
        says=["named 6 as the donor, expected 4", "the lowest member"],
    ),
    Mistake(
        "sync_without_momentum",
        replaces="sync_from_peer",
        fails=[_NEWCOMER],
        says=["momentum of parameter 0", "the optimizer's state travels too"],
    ),
    Mistake(
        "sync_parameters_only",
        replaces="sync_from_peer",
        fails=[_NEWCOMER],
        says=["every parameter and buffer comes from the donor"],
    ),
    Mistake(
        "sync_averages_the_members",
        replaces="sync_from_peer",
        fails=[_NEWCOMER],
        says=["from the donor's: every parameter and buffer comes from the donor"],
    ),
    Mistake(
        "local_sgd_from_step_0",
        replaces="local_sgd_step",
        fails=[f"{_TORCH}[H3-warmup2]"],
        says=["all-reduced at steps [0, 3], expected [2, 5]", "from step warmup_steps on"],
    ),
    Mistake(
        "local_sgd_at_the_end_of_each_period",
        replaces="local_sgd_step",
        fails=[f"{_TORCH}[H2]"],
        says=["all-reduced at steps [1, 3, 5], expected [0, 2, 4]"],
    ),
    Mistake(
        "local_sgd_divides_after",
        replaces="local_sgd_step",
        fails=[f"{_TORCH}[H2]"],
        says=["divides the flat parameters by the group's size before the all-reduce"],
    ),
    Mistake(
        "local_sgd_averages_before_stepping",
        replaces="local_sgd_step",
        fails=[f"{_TORCH}[H2]"],
        says=["averaged before the optimizer's step"],
    ),
    Mistake(
        "diloco_sign_flipped",
        replaces="diloco_outer_step",
        fails=[_NESTEROV],
        says=["moved away from the averaged parameters", "anchor - mean"],
    ),
    Mistake(
        "diloco_not_reset_to_the_anchors",
        replaces="diloco_outer_step",
        fails=[_NESTEROV],
        says=["taken from this rank's own parameters", "back to its anchor"],
    ),
    Mistake(
        "diloco_anchors_not_refreshed",
        replaces="diloco_outer_step",
        fails=[_NESTEROV],
        says=["is not the new parameter"],
    ),
    Mistake(
        "diloco_summed_deltas",
        replaces="diloco_outer_step",
        fails=[_NESTEROV],
        says=["the sum of the ranks' deltas", "divide by the group's size"],
    ),
]

RIGHT_ANSWERS = [
    RightAnswer("quorum_with_a_key_per_replica", replaces="join_quorum"),
    RightAnswer("step_parameter_by_parameter", replaces="train_step"),
    RightAnswer("sync_by_broadcast", replaces="sync_from_peer"),
    RightAnswer("local_sgd_with_torchs_average", replaces="local_sgd_step"),
    RightAnswer("diloco_per_parameter", replaces="diloco_outer_step"),
]
