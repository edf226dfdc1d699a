"""k37 fault tolerance: the quorum, a step among it, a newcomer's state, LocalSGD and DiLoCo."""

from __future__ import annotations

import functools
import time
from datetime import timedelta

import pytest
import torch

from dojo.harness.calls import recording
from dojo.harness.impl import load_kata
from dojo.harness.loopback import loopback_store
from dojo.harness.world import WorldDeadlock, run_world
from dojo.spec.cuda import on_cuda, rank_gpu
from dojo.spec.testing import run_module_ok, shared_run
from dojo.toy_models import loss, make_batch, make_model

KATA = "k37_fault_tolerance"
TIMEOUT = 1.0  # the quorum's deadline in these tests: a missing replica costs this once
MODEL = "buffer"


def _difference(a: dict, b: dict) -> tuple[float, str]:
    return max(((a[k].double() - b[k].double()).abs().max().item(), k) for k in b)


def _state(model) -> dict:
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


# Fault injection: each replica runs in a process of its own (the kata's run_in_child, forked
# from a rank of the harness), so that a replica killed with SIGKILL takes only itself down;
# the rank reports it and every child is killed when the rank ends (the rank's process group
# is killed with it by the harness on a failure, a deadline or Ctrl-C): nothing is left running.


def _connect(port: int):
    return load_kata(KATA).connect(port)


# --------------------------------------------------------------------------- step 1: quorum


def _quorum_rank(rank, world_size, port, previous, delays, min_replicas, timeout):
    kata = load_kata(KATA)
    if delays[rank] is None:
        return None  # this replica is dead: it never registers
    store = _connect(port)
    if delays[rank] == LATE:  # it comes once the others have closed the quorum, however busy
        try:
            store.wait(["quorum/0/members"], timedelta(seconds=TIMEOUT * 4))
        except RuntimeError:  # a quorum never written where the kata says: it comes anyway
            pass
    else:
        time.sleep(delays[rank])
    began = time.time()  # the wall clock: the ranks' times are compared with each other
    members = kata.join_quorum(store, 0, rank, previous, min_replicas=min_replicas, timeout=timeout)
    ended = time.time()
    return {"members": members, "seconds": ended - began, "began": began, "ended": ended}


def _quorum(previous, delays, min_replicas=1, timeout=TIMEOUT):
    store = loopback_store()
    args = (store.port, list(previous), delays, min_replicas, timeout)
    return run_world(_quorum_rank, 3, *args, init_group=False, stall=None, deadline=20)


_shared_quorum = shared_run(_quorum)


def _check_members(results, expected, where):
    for rank, got in enumerate(results):
        if got is None:
            continue
        assert isinstance(got["members"], list), (
            f"{where}: replica {rank}'s join_quorum returned {got['members']!r}, not a list of "
            "replica numbers"
        )
        assert got["members"] == expected, (
            f"{where}: replica {rank} got the quorum {got['members']}, expected {expected}. "
            + (
                "The replicas disagree: every replica must return the one list the first closer "
                "wrote (store.compare_set(key, '', proposal) writes it only if nobody has, and "
                "returns what is there)"
                if len({tuple(g["members"]) for g in results if g}) > 1
                else "The quorum is who had registered when the first replica closed it"
            )
        )


LATE = "late"  # a replica's delay: until the others have closed the quorum
STAGGER = (0, 0.15, 0.3)  # seconds: the replicas of the last quorum come one after another
# A deadline far above what a busy machine adds to a store's round trips: a quorum closed at once
# and one closed at the deadline stay apart however late the ranks start
PATIENT = 6.0


@pytest.mark.step(1)
def test_every_replica_gets_the_same_quorum(kata):
    results = _shared_quorum((0, 1, 2), STAGGER, timeout=PATIENT)
    where = "3 replicas of the last quorum, coming 0.15 s apart"
    got = {tuple(g["members"]) for g in results if isinstance(g["members"], list)}
    if len(got) == 1 and set(next(iter(got))) < {0, 1, 2}:
        raise AssertionError(
            f"{where}: every replica got the quorum {list(next(iter(got)))}, expected [0, 1, 2]: "
            "the quorum was closed before every member of previous had registered. Close it "
            "once all of previous are there, or at the deadline, not as soon as min_replicas are"
        )
    _check_members(results, [0, 1, 2], where)
    last = max(got["began"] for got in results)  # the last member of previous came then
    for rank, got in enumerate(results):
        assert got["ended"] - last < PATIENT * 0.5, (
            f"{where}: replica {rank} returned {got['ended'] - last:.2f} s after the last of them "
            f"had registered (the deadline is {PATIENT:g} s): when every member of the last "
            "quorum has registered, close the quorum at once"
        )


@pytest.mark.step(1)
def test_a_replica_that_never_comes_is_left_out_after_the_deadline(kata):
    results = _shared_quorum((0, 1, 2), (0, 0, None))
    where = "replica 2 never registers (it died)"
    waited = max(results[rank]["seconds"] for rank in (0, 1))  # the closer waited longest
    assert waited >= TIMEOUT * 0.9, (
        f"{where}: replicas 0 and 1 closed the quorum after {waited:.2f} s, before the "
        f"deadline ({TIMEOUT:g} s): replica 2 was in the last quorum and may still come; "
        "wait for every member of previous, or for the deadline"
    )
    _check_members(results, [0, 1], where)


@pytest.mark.step(1)
def test_a_late_replica_is_left_out_and_told(kata):
    results = _shared_quorum((0, 1), (0, 0, LATE))
    _check_members(results, [0, 1], "replica 2 registers after 0 and 1 closed the quorum")


@pytest.mark.step(1)
def test_a_quorum_of_zero_is_refused(kata):
    store = loopback_store()
    try:
        kata.join_quorum(store, 0, 0, [0], min_replicas=0, timeout=TIMEOUT)
    except ValueError as error:
        message = str(error)
    else:
        raise AssertionError(
            "join_quorum(..., min_replicas=0) returned: a quorum of zero replicas would let a "
            "step count with nobody's gradient in it; raise ValueError saying so"
        )
    assert "min_replicas" in message and "0" in message, (
        f"join_quorum(..., min_replicas=0) raised ValueError({message!r}): name what was wrong "
        "(min_replicas=0) and what to pass instead"
    )
    assert not store.check(["quorum/0/registered"]) and store.num_keys() <= 1, (
        "join_quorum(..., min_replicas=0) registered in the store before refusing: check the "
        "arguments before anything is written"
    )


@pytest.mark.step(1)
def test_too_few_replicas_at_the_deadline_is_a_timeout(kata):
    store = loopback_store()
    began = time.monotonic()
    try:
        got = kata.join_quorum(store, 0, 0, [0, 1], min_replicas=2, timeout=0.3)
    except TimeoutError:
        pass
    else:
        raise AssertionError(
            f"join_quorum alone with min_replicas=2 returned {got!r}: with fewer than "
            "min_replicas registered at the deadline, raise TimeoutError"
        )
    assert time.monotonic() - began < 5, "join_quorum waited far past its deadline"


# --------------------------------------------------------------------------- step 2: a step


def _step_rank(rank, world_size, members):
    import torch.distributed as dist

    kata = load_kata(KATA)
    group = dist.new_group(members)
    if rank not in members:
        return None
    model = make_model(MODEL, 0)
    optimizer = torch.optim.SGD(model.parameters(), lr=kata.LR, momentum=kata.MOMENTUM)
    with recording(("all_reduce",)) as calls:
        kata.train_step(model, optimizer, make_batch(MODEL, 8, seed=rank), group)
    return {"state": _state(model), "calls": len(calls)}


def _expected_step(members, divisor=None) -> dict:
    kata = load_kata(KATA)
    model = make_model(MODEL, 0)
    optimizer = torch.optim.SGD(model.parameters(), lr=kata.LR, momentum=kata.MOMENTUM)
    for member in members:
        (loss(model, make_batch(MODEL, 8, seed=member)) / (divisor or len(members))).backward()
    optimizer.step()
    return _state(model)


@pytest.mark.step(2)
@pytest.mark.parametrize("members", [[0, 1, 2], [0, 1]], ids=["three", "two"])
def test_a_step_takes_the_mean_over_the_quorum(kata, members):
    results = run_world(_step_rank, 3, members)
    expected = _expected_step(members)
    over_three = _expected_step(members, divisor=3)  # the sum over the run's 3 first replicas
    for rank in members:
        got = results[rank]
        gap, name = _difference(got["state"], expected)
        if gap > 1e-6:
            hint = ""
            if len(members) == 2 and _difference(got["state"], over_three)[0] <= 1e-6:
                hint = (
                    ": the sum was divided by 3, the replicas the run started with; the "
                    "mean is over the quorum's 2 members (group.size())"
                )
            elif _difference(got["state"], _expected_step(members, divisor=1))[0] <= 1e-6:
                hint = ": it took the members' summed gradient; divide the sum by group.size()"
            elif _difference(got["state"], _expected_step(members, len(members) ** 2))[0] <= 1e-6:
                hint = (
                    f": the sum was divided by {len(members)} twice (before and after the "
                    "all-reduce); divide once"
                )
            raise AssertionError(
                f"a step among the quorum {members}: replica {rank}'s {name} is {gap:.2e} away "
                f"from one optimizer step with the members' mean gradient{hint}"
            )


def _fault(replace, store, replica, step, previous):
    """The test's faults: replica 2 killed before step 2; with a replacement (which joins at
    step 4: the survivors wait there until it has registered, whatever the machine's speed),
    replica 1 is also slow for step 5's quorum (it comes once the others have closed it at the
    deadline, and is left out),
    and the others wait at step 6 until it has registered again."""
    if (replica, step) == (VICTIM, KILLED_AT):
        load_kata(KATA).kill_at(VICTIM, KILLED_AT)(store, replica, step, previous)
    if not replace:
        return
    if (replica, step) == (SLOW, SLOW_AT):  # late: it comes once the others have closed it
        store.wait([f"quorum/{step}/members"], timedelta(seconds=60))
    waits = (replica in (0, 1) and step == JOINS_AT) or (
        replica in (0, REPLACEMENT) and step == SLOW_AT + 1
    )
    if waits:  # the replica that joins here registers first
        while store.add(f"quorum/{step}/registered", 0) < 1:
            time.sleep(0.005)


VICTIM, KILLED_AT, JOINS_AT, STEPS = 2, 2, 4, 7
REPLACEMENT = VICTIM + 3  # a new replica: a new number
SLOW, SLOW_AT = 1, 5  # replica 1 is late for step 5's quorum


def _replica_process(port, replica, joining, replace):
    kata = load_kata(KATA)
    store = _connect(port)
    if joining:
        store.wait([f"quorum/{JOINS_AT - 1}/members"])
    return kata.run_replica(
        store,
        replica,
        STEPS,
        [0, 1, 2],
        joining=joining,
        fault=functools.partial(_fault, replace),
        timeout=TIMEOUT,
    )


def _fault_rank(rank, world_size, port, replace):
    kata = load_kata(KATA)
    done = [kata.run_in_child(_replica_process, port, rank, False, replace, deadline=30)]
    if done[0] is None and replace:
        done.append(
            kata.run_in_child(_replica_process, port, REPLACEMENT, True, replace, deadline=30)
        )
    return done


def _faulty_run(replace: bool) -> dict:
    store = loopback_store()
    try:
        ranks = run_world(_fault_rank, 3, store.port, replace, init_group=False, stall=None,
                          deadline=40)  # fmt: skip
    except WorldDeadlock as deadlock:
        raise AssertionError(
            f"replica {VICTIM} killed before step {KILLED_AT}: the survivors never finished "
            f"{STEPS} steps. Does join_quorum close at the deadline without the dead replica, "
            "and does every survivor agree on the same members?\n" + str(deadlock)
        ) from None
    results = [r for done in ranks for r in done if r is not None]
    return {"results": results, "replay": load_kata(KATA).replay(results, STEPS)}


_shared_faulty_run = shared_run(_faulty_run)


def _check_survivors(run: dict, finishers: list[int]) -> None:
    by_replica = {r["replica"]: r for r in run["results"]}
    for replica in finishers:
        assert replica in by_replica, f"replica {replica} did not finish its run"
        result = by_replica[replica]
        steps = [s for s, _ in result["trained"]]
        assert len(steps) == len(set(steps)), (
            f"replica {replica} trained steps {steps}: a step counted twice"
        )
        gap, name = _difference(result["state"], run["replay"])
        assert gap <= 1e-5, (
            f"replica {replica} ends {gap:.2e} away (its {name}) from a replay of the agreed "
            f"quorums {sorted(set((s, tuple(m)) for s, m in result['trained']))}: each step "
            "must be the mean over that step's members only (the dead replica's never counted)"
        )


@pytest.mark.step(2)
def test_the_survivors_of_a_killed_replica_go_on(kata):
    run = _shared_faulty_run(False)
    by_replica = {r["replica"]: r for r in run["results"]}
    assert VICTIM not in by_replica, f"replica {VICTIM} should have been killed at step 2"
    for replica in (0, 1):
        trained = by_replica[replica]["trained"]
        assert [s for s, _ in trained] == list(range(STEPS)), (
            f"replica {replica} trained steps {[s for s, _ in trained]}, expected 0 to "
            f"{STEPS - 1}: a survivor goes on at the next step"
        )
        after = [m for s, m in trained if s >= KILLED_AT]
        assert all(m == [0, 1] for m in after), (
            f"replica {replica}'s quorums from step {KILLED_AT} on were {after}: the dead "
            f"replica {VICTIM} must be left out"
        )
    _check_survivors(run, [0, 1])


# --------------------------------------------------------------------------- step 3: newcomer


def _sync_rank(rank, world_size, members, previous):
    import torch.distributed as dist

    kata = load_kata(KATA)
    newcomer = members[rank] not in previous
    model = make_model(MODEL, 7 if newcomer else 0)
    optimizer = torch.optim.SGD(model.parameters(), lr=kata.LR, momentum=kata.MOMENTUM)
    if not newcomer:  # the old members trained a step alike: momentum to give
        optimizer.zero_grad()
        loss(model, make_batch(MODEL, 8, seed=0)).backward()
        optimizer.step()
    before = _state(model)
    momentum_before = [optimizer.state[p].get("momentum_buffer") for p in model.parameters()]
    donor = kata.sync_from_peer(model, optimizer, dist.group.WORLD, members, previous)
    return {
        "donor": donor,
        "before": before,
        "after": _state(model),
        "momentum": [
            None if optimizer.state[p].get("momentum_buffer") is None
            else optimizer.state[p]["momentum_buffer"].clone()
            for p in model.parameters()
        ],
        "momentum_before": [None if m is None else m.clone() for m in momentum_before],
    }  # fmt: skip


@pytest.mark.step(3)
def test_a_newcomer_takes_the_state_of_a_live_member(kata):
    members, previous = [1, 4, 6], [4, 6]
    results = run_world(_sync_rank, 3, members, previous)
    donor_rank = 1  # replica 4: the lowest member that was in the last quorum
    for rank, got in enumerate(results):
        assert got["donor"] == 4, (
            f"members {members}, last quorum {previous}: replica {members[rank]} named "
            f"{got['donor']!r} as the donor, expected 4, the lowest member that lived through the "
            "last step (replica 1 is the newcomer: its state is not the run's)"
        )
        gap, name = _difference(got["after"], results[donor_rank]["before"])
        assert gap == 0, (
            f"after sync_from_peer, replica {members[rank]}'s {name} differs by {gap:.2e} from "
            "the donor's: every parameter and buffer comes from the donor"
        )
        for i, (mine, theirs) in enumerate(
            zip(got["momentum"], results[donor_rank]["momentum_before"])
        ):
            assert mine is not None and torch.equal(mine, theirs), (
                f"after sync_from_peer, replica {members[rank]}'s momentum of parameter {i} is "
                f"{'missing' if mine is None else 'not the donor’s'}: the optimizer's state "
                "travels too, or the newcomer's next step differs"
            )


@pytest.mark.step(3)
def test_a_replacement_joins_and_ends_like_the_others(kata):
    run = _shared_faulty_run(True)
    by_replica = {r["replica"]: r for r in run["results"]}
    assert REPLACEMENT in by_replica, f"the replacement replica {REPLACEMENT} never finished"
    joined = by_replica[REPLACEMENT]
    assert [s for s, _ in joined["trained"]] == list(range(JOINS_AT, STEPS)), (
        f"the replacement trained steps {[s for s, _ in joined['trained']]}, expected "
        f"{list(range(JOINS_AT, STEPS))}: it joins at the first open quorum"
    )
    assert joined["donors"] and joined["donors"][0] in (0, 1), (
        f"the replacement took its state from {joined['donors']}: a live member of the last "
        "quorum (0 or 1) gives it"
    )
    _check_survivors(run, [0, 1, REPLACEMENT])


@pytest.mark.step(3)
def test_a_slow_replica_is_left_out_then_takes_the_state_again(kata):
    run = _shared_faulty_run(True)
    by_replica = {r["replica"]: r for r in run["results"]}
    where = (
        f"replica {SLOW} came to step {SLOW_AT}'s quorum only after the others had closed it "
        f"(at its deadline, {TIMEOUT:g} s)"
    )
    assert SLOW in by_replica, f"{where}: it never finished its run"
    quorums = dict(by_replica[0]["trained"])
    assert quorums.get(SLOW_AT) == [0, REPLACEMENT], (
        f"{where}: replica 0 trained step {SLOW_AT} with {quorums.get(SLOW_AT)}, expected "
        f"{[0, REPLACEMENT]}: the others close the quorum at the deadline without it"
    )
    slow = by_replica[SLOW]
    expected = [s for s in range(STEPS) if s != SLOW_AT]
    assert [s for s, _ in slow["trained"]] == expected, (
        f"{where}: it trained steps {[s for s, _ in slow['trained']]}, expected {expected}: "
        "left out of that step, it joins the next quorum as a newcomer"
    )
    assert slow["donors"] and slow["donors"][-1] == 0, (
        f"{where}: back at step {SLOW_AT + 1} it took its state from {slow['donors'][-1:]}, "
        f"expected replica 0: the lowest member of that quorum that trained step {SLOW_AT}"
    )
    _check_survivors(run, [SLOW])


# --------------------------------------------------------------------------- step 4: LocalSGD


def _local_sgd_rank(rank, world_size, period, warmup, steps, cuda=False):
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    from torch.distributed.optim import PostLocalSGDOptimizer

    kata = load_kata(KATA)
    device = rank_gpu() if cuda else torch.device("cpu")
    mine, theirs = make_model(MODEL, 0).to(device), make_model(MODEL, 0).to(device)
    optimizer = torch.optim.SGD(mine.parameters(), lr=0.05, momentum=0.9)
    torch_optimizer = PostLocalSGDOptimizer(
        torch.optim.SGD(theirs.parameters(), lr=0.05, momentum=0.9),
        PeriodicModelAverager(period=period, warmup_steps=warmup),
    )
    averaged, after = [], []
    for step in range(steps):
        batch = tuple(t.to(device) for t in make_batch(MODEL, 8, seed=100 * step + rank))
        for model, opt in ((mine, optimizer), (theirs, torch_optimizer)):
            opt.zero_grad()
            loss(model, batch).backward()
        with recording(("all_reduce",)) as calls:
            said = kata.local_sgd_step(optimizer, list(mine.parameters()), step, period, warmup)
        averaged.append((said, len(calls)))
        after.append([p.detach().cpu().clone() for p in mine.parameters()])
        torch_optimizer.step()
    return {"mine": _state(mine), "torch": _state(theirs), "averaged": averaged, "after": after}


def _check_local_sgd(results, period, warmup, steps, where=""):
    """Every rank averaged when torch's averager does, left an averaging step like rank 0, and
    ends bitwise like torch's PostLocalSGDOptimizer (the same steps, the same all-reduce)."""
    expected = [s >= warmup and (s - warmup) % period == 0 for s in range(steps)]
    for rank, got in enumerate(results):
        when = [s for s, (said, calls) in enumerate(got["averaged"]) if calls]
        assert when == [s for s in range(steps) if expected[s]], (
            f"{where}period {period}, {warmup} warm-up steps: rank {rank} all-reduced at steps "
            f"{when}, expected {[s for s in range(steps) if expected[s]]} (torch's "
            "PeriodicModelAverager: from step warmup_steps on, every period steps)"
        )
    for step in when:
        for rank, got in enumerate(results[1:], 1):
            if any(
                not torch.equal(a, b) for a, b in zip(got["after"][step], results[0]["after"][step])
            ):
                raise AssertionError(
                    f"{where}period {period}, {warmup} warm-up steps: after step {step}, which "
                    f"averaged, rank {rank}'s parameters differ from rank 0's: they were "
                    "averaged before the optimizer's step, which then moved each rank its own "
                    "way. Step first, then average: every rank leaves an averaging step alike"
                )
    size = len(results)
    rounds = size & (size - 1) != 0  # dividing by a power of 2 before or after the sum rounds alike
    for rank, got in enumerate(results):
        gap, name = _difference(got["mine"], got["torch"])
        assert gap == 0, (
            f"{where}period {period}, {warmup} warm-up steps: rank {rank}'s {name} differs by "
            f"{gap:.2e} from torch's PostLocalSGDOptimizer after {steps} steps"
            + (
                ": torch divides the flat parameters by the group's size before the all-reduce"
                if gap < 1e-5 and rounds
                else ""
            )
        )


@pytest.mark.step(4)
@pytest.mark.parametrize("period, warmup", [(2, 0), (3, 2)], ids=["H2", "H3-warmup2"])
def test_local_sgd_equals_post_local_sgd_optimizer(kata, period, warmup):
    steps = 6  # on 3 ranks: dividing by 2 before or after the sum rounds alike, by 3 not
    _check_local_sgd(run_world(_local_sgd_rank, 3, period, warmup, steps), period, warmup, steps)


def _ddp_rank(rank, world_size, steps):
    from torch.nn.parallel import DistributedDataParallel

    kata = load_kata(KATA)
    mine, theirs = make_model(MODEL, 0), make_model(MODEL, 0)
    ddp = DistributedDataParallel(theirs)
    optimizer = torch.optim.SGD(mine.parameters(), lr=0.05)
    ddp_optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    for step in range(steps):
        batch = make_batch(MODEL, 8, seed=100 * step + rank)
        optimizer.zero_grad()
        loss(mine, batch).backward()
        kata.local_sgd_step(optimizer, list(mine.parameters()), step, 1)
        ddp_optimizer.zero_grad()
        loss(ddp, batch).backward()
        ddp_optimizer.step()
    return {"mine": _state(mine), "torch": _state(theirs)}


@pytest.mark.step(4)
def test_local_sgd_with_period_1_is_ddp(kata):
    for rank, got in enumerate(run_world(_ddp_rank, 2, 4)):
        gap, name = _difference(got["mine"], got["torch"])
        assert gap <= 1e-6, (
            f"LocalSGD with period 1 (plain SGD): rank {rank}'s {name} is {gap:.2e} from DDP's "
            "after 4 steps: the mean of p - lr g_i is p - lr mean(g_i), equal up to rounding"
        )


@pytest.mark.step(4)
def test_a_period_of_zero_is_refused(kata):
    model = make_model(MODEL, 0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    with pytest.raises(ValueError, match="period"):
        kata.local_sgd_step(optimizer, list(model.parameters()), 0, 0)


# --------------------------------------------------------------------------- step 5: DiLoCo


def _diloco_rank(rank, world_size, rounds, inner, lr, momentum, nesterov):
    kata = load_kata(KATA)
    model = make_model(MODEL, 0)
    params = [p for p in model.parameters() if p.requires_grad]
    inner_opt = torch.optim.SGD(params, lr=0.05)
    outer_opt = torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=nesterov)
    anchors = [p.detach().clone() for p in params]
    seen = []
    for r in range(rounds):
        for i in range(inner):
            inner_opt.zero_grad()
            loss(model, make_batch(MODEL, 8, seed=100 * (r * inner + i) + rank)).backward()
            inner_opt.step()
        before = [p.detach().clone() for p in params]
        kata.diloco_outer_step(params, anchors, outer_opt, None)
        seen.append({"before": before, "after": [p.detach().clone() for p in params],
                     "anchors": [a.clone() for a in anchors]})  # fmt: skip
    return seen


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a - b).abs().max().item() <= 1e-5


def _diloco(lr=0.7, momentum=0.9, nesterov=True, rounds=3, inner=2):
    return run_world(_diloco_rank, 2, rounds, inner, lr, momentum, nesterov)


_shared_diloco = shared_run(_diloco)


@pytest.mark.step(5)
def test_diloco_outer_step_is_nesterov_on_the_averaged_delta(kata):
    results = _shared_diloco()
    lr, mu = 0.7, 0.9
    anchors = [p.detach().clone() for p in make_model(MODEL, 0).parameters() if p.requires_grad]
    velocity = [torch.zeros_like(a) for a in anchors]
    for r in range(3):
        mean = [sum(rank[r]["before"][i] for rank in results) / 2 for i in range(len(anchors))]
        steps = []  # each parameter's outer step this round, for the diagnosis
        for i, anchor in enumerate(anchors):
            grad = anchor - mean[i]  # DiLoCo's outer gradient
            velocity[i] = grad.clone() if r == 0 else mu * velocity[i] + grad
            anchors[i] = anchor - lr * (grad + mu * velocity[i])
            steps.append((anchor, grad, anchors[i] - anchor))
        for rank, seen in enumerate(results):
            for i, anchor in enumerate(anchors):
                got = seen[r]["after"][i]
                gap = (got - anchor).abs().max().item()
                if gap > 1e-5:
                    old, grad, step = steps[i]
                    before = seen[r]["before"][i]
                    hint = ""
                    if r == 0 and _close(got, old + lr * (1 + mu) * grad):
                        hint = (
                            ": it moved away from the averaged parameters; the outer gradient "
                            "is anchor - mean, so that SGD's minus moves towards the mean"
                        )
                    elif r == 0 and _close(got, old - 2 * lr * (1 + mu) * grad):
                        hint = (
                            ": its outer gradient was the sum of the ranks' deltas, twice the "
                            "mean; divide by the group's size"
                        )
                    elif _close(got, before + step):
                        hint = (
                            ": the outer step was taken from this rank's own parameters after "
                            "the inner steps; put each parameter back to its anchor first, then "
                            "step"
                        )
                    raise AssertionError(
                        f"DiLoCo round {r}: rank {rank}'s parameter {i} is {gap:.2e} from the "
                        "outer Nesterov step (lr 0.7, momentum 0.9) taken from the anchor with "
                        f"the outer gradient anchor - mean(params){hint}"
                    )
                assert torch.equal(seen[r]["anchors"][i], got), (
                    f"DiLoCo round {r}: rank {rank}'s anchor {i} is not the new parameter: the "
                    "next round's delta is measured from where this outer step ended"
                )


@pytest.mark.step(5)
def test_diloco_with_plain_outer_sgd_is_local_sgd(kata):
    results = _diloco(lr=1.0, momentum=0.0, nesterov=False, rounds=2, inner=2)
    for rank, seen in enumerate(results):
        for r in range(2):
            mean = [sum(other[r]["before"][i] for other in results) / 2
                    for i in range(len(seen[r]["before"]))]  # fmt: skip
            for i, m in enumerate(mean):
                gap = (seen[r]["after"][i] - m).abs().max().item()
                assert gap <= 1e-6, (
                    f"DiLoCo with outer SGD lr 1 and no momentum: rank {rank}'s parameter {i} "
                    f"after round {r} is {gap:.2e} from the average of the ranks' parameters "
                    "(LocalSGD): anchor - (anchor - mean) is the mean"
                )


# --------------------------------------------------------------------------- the program


@pytest.mark.step(3)
def test_program_survives_a_killed_replica(kata):
    out = run_module_ok(KATA, "--steps", "6", "--kill-at", "2", timeout=120).stdout
    assert "step 2: quorum {0,1}" in out, f"the program should leave the killed replica out:\n{out}"
    assert "none lost, none twice" in out, f"the program's verdict is not agreement:\n{out}"


# --------------------------------------------------------------------------- CUDA


@pytest.mark.step(4)
@pytest.mark.cuda
def test_local_sgd_on_nccl_equals_post_local_sgd_optimizer(kata):
    """LocalSGD on 2 GPUs over NCCL against torch's PostLocalSGDOptimizer, bitwise as on the CPU
    (the same kernels on the same inputs, the same all-reduce of the same flat vector). Only the
    average runs on NCCL: the quorum is CPU-side by design. It is text in a TCPStore, with no
    tensor to put on a GPU; each era's group is a gloo group made afresh, because an NCCL group
    cannot lose a member (its peers hang until its timeout); and the replicas that the faults
    kill are forked processes (run_in_child), which a CUDA context does not survive."""
    period, warmup, steps = 3, 2, 6
    results = run_world(
        _local_sgd_rank, 2, period, warmup, steps, True, **on_cuda(2, "nccl", deadline=90)
    )
    _check_local_sgd(results, period, warmup, steps, where="NCCL on 2 GPUs: ")
