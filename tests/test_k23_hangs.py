"""k23 hangs: StoreBarrier, fingerprint and describe_mismatch, checked, torch_checked_group."""

from __future__ import annotations

import re
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from dojo.harness.calls import recording
from dojo.harness.impl import load_kata
from dojo.harness.world import MAX_STRETCH, WorldDeadlock, WorldFailure, run_world
from dojo.spec.cuda import on_cuda, rank_gpu
from dojo.spec.testing import refusal, run_module_ok
from dojo.todo import KataTodo

KATA = "k23_hangs"
TIMEOUT_S = 1.5  # every barrier and group here gives up after this: a hang costs seconds
DEADLINE_S = 10.0  # the harness's, well past every timeout even on a loaded machine
STRAGGLER_S = 4.0  # once a rank has returned, how long the others may still take


def _text(ranks) -> str:
    ranks = list(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _store():
    return dist.distributed_c10d._get_default_store()


def _stay(tag: str, world_size: int, missing) -> None:
    """A rank that skips the barrier stays alive (as a real straggler does) until the ranks
    that called it have each set ``tag/<rank>``; it gives up only past the harness's deadline,
    stretched as far as it goes (ranks that poll the store look busy), so that a barrier that
    never gives up ends as the harness's report, not as this wait's timeout."""
    keys = [f"{tag}/{r}" for r in range(world_size) if r not in missing]
    _store().wait(keys, timedelta(seconds=DEADLINE_S * MAX_STRETCH + 10))


def _done(tag: str, rank: int) -> None:
    _store().set(f"{tag}/{rank}", "done")


# What torch's store and sockets print when a wait gives up (in the rank's error or its log).
_GAVE_UP_AFTER_MS = re.compile(r"(?:timed out after|wait timeout after) (\d+) ?ms")


def _world(fn, world_size, *args, what: str, group_timeout_s: float | None = None):
    """run_world, where a deadlock becomes a message about ``what`` hung, and a world that broke
    down after torch's waits gave up far sooner than the group's ``group_timeout_s`` says so."""
    try:
        # stall=None: these ranks wait on purpose inside calls that time out by themselves
        # (monitored_barrier, store waits, groups given a timeout): only the deadline ends them.
        return run_world(
            fn, world_size, *args, deadline=DEADLINE_S, straggler=STRAGGLER_S, stall=None
        )
    except WorldFailure as failure:
        waits = [int(ms) for ms in _GAVE_UP_AFTER_MS.findall(str(failure))]
        if group_timeout_s is not None and waits and min(waits) < 500 * group_timeout_s:
            raise AssertionError(
                f"torch's waits gave up after {min(waits)} ms, though the group was given "
                f"{group_timeout_s:g} s: the timeout is in seconds where you gave another unit: "
                "dist.new_group(timeout=timedelta(seconds=timeout_s))\n\nThe harness's report:\n"
                f"{failure}"
            ) from None
        if isinstance(failure, WorldDeadlock):
            raise AssertionError(f"{what}\n\nThe harness's report:\n{failure}") from None
        raise


# --------------------------------------------------------------------------- step 1: StoreBarrier


def _late_rank(rank, world_size):
    kata = load_kata(KATA)
    barrier = kata.StoreBarrier("late", timeout_s=20.0)
    if rank == world_size - 1:
        time.sleep(0.5)
        _store().set("test/late-arrived", "yes")  # before this rank checks in
    saw_late = None
    for call in range(1, 5):  # the first call, then three more: each call passes
        start = time.monotonic()
        try:
            barrier.wait()
        except kata.BarrierTimeout as error:
            return "raised", call, time.monotonic() - start, str(error)
        if call == 1:
            saw_late = _store().check(["test/late-arrived"])
    return saw_late, barrier.generation


@pytest.mark.step(1)
def test_barrier_waits_for_a_late_rank(kata):
    last = 3
    results = _world(
        _late_rank,
        4,
        what=(
            "StoreBarrier(timeout_s=20).wait() on 4 ranks, every rank calling it (rank 3 half a "
            "second late), then three more times: the ranks never got through. wait() must "
            "return once every rank's key for this call is in the store"
        ),
    )
    for rank, got in enumerate(results):
        if got[0] == "raised":
            raise AssertionError(
                f"rank {rank}'s call {got[1]} of StoreBarrier(timeout_s=20).wait() raised "
                f"BarrierTimeout after {got[2]:.2f} s of its 20 s ({got[3]!r}), every rank "
                f"calling it (rank {last} half a second late the first time): keep looking "
                "until every rank has arrived or timeout_s has passed"
            )
        saw_late, generation = got
        assert saw_late, (
            f"rank {rank} passed the barrier before rank {last} had arrived (rank {last} checked "
            "in half a second late): wait() must return only once every rank's key for this "
            "call is in the store, its own included; does every rank look for all keys, or only "
            "rank 0?"
        )
        assert generation == 4, (
            f"rank {rank}: after 4 calls of wait() barrier.generation is {generation}: count "
            "the calls in self.generation (each call is one generation: it is what tells the "
            "calls' keys apart)"
        )


def _skipping(rank, world_size, missing, calls_of_missing):
    """Ranks in ``missing`` call wait() only ``calls_of_missing`` times, the others once more."""
    kata = load_kata(KATA)
    barrier = kata.StoreBarrier("skip", timeout_s=TIMEOUT_S)
    for _ in range(calls_of_missing):
        barrier.wait()
    if rank in missing:
        _stay("test/skip-done", world_size, missing)
        return None
    start = time.monotonic()
    try:
        barrier.wait()
        outcome = ("passed", None, "")
    except kata.BarrierTimeout as error:
        outcome = ("raised", error.missing, str(error))
    finally:
        _done("test/skip-done", rank)
    return (*outcome, time.monotonic() - start)


def check_named(results, missing, where: str) -> None:
    expected = list(missing)
    for rank, got in enumerate(results):
        if rank in missing:
            continue
        outcome, named, message, took = got
        assert outcome == "raised", (
            f"{where}: rank {rank}'s wait() returned, although {_text(expected)} never called "
            "it: a barrier passes only when every rank's key for this very call is in the "
            "store. Is the key the same for every call (give each call its own generation)?"
        )
        arrived = [r for r in range(len(results)) if r not in missing]
        if named == arrived:
            raise AssertionError(
                f"{where}: rank {rank}'s BarrierTimeout names {named} as missing, but those are "
                f"the ranks that arrived; {_text(expected)} never came: name the ranks whose key "
                "is NOT in the store"
            )
        assert named == expected, (
            f"{where}: rank {rank}'s BarrierTimeout has missing={named}, expected {expected} "
            f"(the ranks that never called wait(), in rank order)"
        )
        assert _text(expected) in message, (
            f"{where}: rank {rank}'s BarrierTimeout says {message!r}: it should name "
            f"{_text(expected)!r}, as the lesson writes ranks"
        )
        assert took >= 0.8 * TIMEOUT_S, (
            f"{where}: rank {rank} gave up after {took:.2f} s, the timeout was {TIMEOUT_S:g} s: "
            "wait for every rank until timeout_s has passed, then raise"
        )


@pytest.mark.step(1)
@pytest.mark.parametrize("missing", [(3,), (1, 3), (0,)], ids=["rank3", "ranks1and3", "rank0"])
def test_barrier_names_the_ranks_that_did_not_arrive(kata, missing):
    where = f"StoreBarrier(timeout_s={TIMEOUT_S:g}) with {_text(missing)} never calling wait()"
    results = _world(
        _skipping,
        4,
        missing,
        0,
        what=(
            f"{where}: the other ranks were still waiting long after the timeout. wait() must "
            "give up once timeout_s seconds have passed and raise BarrierTimeout (a store lookup "
            "that does not block, store.check, cannot itself hang; store.get waits for ever)"
        ),
    )
    check_named(results, missing, where)


@pytest.mark.step(1)
def test_repeated_barriers_do_not_confuse_each_other(kata):
    where = (
        "StoreBarrier: all 4 ranks called wait() once, then ranks 0, 1, 2 called it again and "
        "rank 3 did not"
    )
    results = _world(
        _skipping,
        4,
        (3,),
        1,
        what=f"{where}: the second call hung. Give up after timeout_s and raise BarrierTimeout",
    )
    for rank, got in enumerate(results[:3]):
        assert got[0] == "raised", (
            f"{where}: rank {rank}'s second wait() passed at once: it found the first call's "
            "keys. Every call needs its own keys: count the calls (self.generation) and put the "
            "count in the key, self.key(generation, rank)"
        )
    check_named(results, (3,), where)


_MONITORED = re.compile(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier")


def _against_torch(rank, world_size, missing):
    kata = load_kata(KATA)
    barrier = kata.StoreBarrier("torch", timeout_s=TIMEOUT_S)
    if rank in missing:
        _stay("test/torch-done", world_size, missing)
        return None
    mine = torch_said = None
    try:
        barrier.wait()
    except kata.BarrierTimeout as error:
        mine = error.missing
    try:
        dist.monitored_barrier(timeout=timedelta(seconds=TIMEOUT_S), wait_all_ranks=True)
    except RuntimeError as error:
        found = _MONITORED.search(str(error))
        torch_said = [int(n) for n in found.group(1).split(",")] if found else str(error)
    _done("test/torch-done", rank)
    return mine, torch_said


@pytest.mark.step(1)
def test_barrier_names_the_same_ranks_as_torchs_monitored_barrier(kata):
    missing = (1, 3)
    where = f"on 4 ranks with {_text(missing)} never arriving"
    results = _world(
        _against_torch,
        4,
        missing,
        what=f"StoreBarrier {where}: the waiting ranks never gave up",
    )
    mine, torch_said = results[0]
    assert torch_said == list(missing), (
        f"dist.monitored_barrier {where} said {torch_said!r} on rank 0 (expected the ranks "
        f"{list(missing)}): this torch reports otherwise; tell the maintainers"
    )
    assert mine == torch_said, (
        f"{where}: torch's dist.monitored_barrier names {torch_said} on rank 0, your "
        f"StoreBarrier's BarrierTimeout named {mine}: name the ranks whose key is missing"
    )


# --------------------------------------------------------------------------- step 2: fingerprints


@pytest.mark.step(2)
@pytest.mark.parametrize(
    "op, tensor, expected",
    [
        ("all_reduce", torch.zeros(3), "all_reduce(float32[3])"),
        ("broadcast", torch.zeros(2, 3, dtype=torch.float64), "broadcast(float64[2, 3])"),
        ("all_reduce", torch.tensor(1.5), "all_reduce(float32[])"),
        ("reduce_scatter_tensor", torch.zeros(4, 1, dtype=torch.bfloat16), None),
        (
            "all_gather_into_tensor",
            torch.zeros(8, dtype=torch.int64),
            "all_gather_into_tensor(int64[8])",
        ),
    ],
    ids=["vector", "matrix-float64", "scalar", "bfloat16", "int64"],
)
def test_fingerprint_names_the_collective_dtype_and_shape(kata, op, tensor, expected):
    expected = expected or "reduce_scatter_tensor(bfloat16[4, 1])"
    got = kata.fingerprint(op, tensor)
    dtype = str(tensor.dtype).removeprefix("torch.")
    assert got == expected or dtype in str(got), (
        f"fingerprint({op!r}, a {tensor.dtype} tensor of shape {list(tensor.shape)}) is {got!r}: "
        "it leaves out the dtype, so ranks calling with float32 and float64 would pass the "
        f"check and meet in a collective that mixes them. Expected {expected!r}"
    )
    assert got == expected, (
        f"fingerprint({op!r}, a {tensor.dtype} tensor of shape {list(tensor.shape)}) is {got!r}, "
        f"expected {expected!r}: the name, then (dtype without 'torch.'[sizes joined by ', '])"
    )


@pytest.mark.step(2)
@pytest.mark.parametrize(
    "args",
    [("", torch.zeros(2)), (None, torch.zeros(2)), ("all_reduce", [1.0, 2.0])],
    ids=["empty-name", "no-name", "a-list"],
)
def test_fingerprint_refuses_bad_input(kata, args):
    outcome = refusal(lambda: kata.fingerprint(*args))
    assert outcome is None, (
        f"fingerprint{args!r} {outcome}: refuse it with a ValueError saying what was wrong "
        "(op_name must be a collective's name, tensor a torch.Tensor)"
    )


A, B, C = "all_reduce(float32[4])", "all_reduce(float32[3])", "broadcast(float32[4])"


@pytest.mark.step(2)
@pytest.mark.parametrize(
    "prints, expected",
    [
        ([A, A, A, A], None),
        ([A], None),
        ([A, A, B, A], f"rank 2 calls {B}; ranks 0, 1, 3 call {A}"),
        ([B, A, A, A], f"rank 0 calls {B}; ranks 1, 2, 3 call {A}"),
        ([A, B, B, A], f"ranks 0, 3 call {A}; ranks 1, 2 call {B}"),
        ([A, B, C, A], f"rank 1 calls {B}; rank 2 calls {C}; ranks 0, 3 call {A}"),
        ([B, A], f"rank 0 calls {B}; rank 1 calls {A}"),
    ],
    ids=["agree", "one-rank", "rank2-odd", "rank0-odd", "tie", "three-kinds", "two-ranks"],
)
def test_describe_mismatch_names_the_odd_ranks_first(kata, prints, expected):
    got = kata.describe_mismatch(prints)
    shown = f"describe_mismatch({prints})"
    if expected is None:
        assert got is None, f"{shown} is {got!r}: every rank calls the same, so it is None"
        return
    assert isinstance(got, str), f"{shown} is {got!r}: the ranks differ, so it is a sentence"
    if (
        prints[0] != prints[1]
        and prints[1:].count(prints[1]) == len(prints) - 1
        and len(prints) > 2
    ):
        others = _text(range(1, len(prints)))
        if got.startswith(others):
            raise AssertionError(
                f"{shown} is {got!r}: it names {others} as the odd ones out, but those "
                f"{len(prints) - 1} ranks agree and rank 0 alone differs. Comparing with rank 0 "
                "blames the wrong ranks whenever rank 0 is the one that differs: group the ranks "
                "by what they call and list the smaller groups first"
            )
    assert got == expected, (
        f"{shown} is {got!r}, expected {expected!r}: group the ranks by fingerprint, smallest "
        "group first (a tie: the group holding the lowest rank first), 'rank N calls X' or "
        "'ranks N, M call X', joined by '; '"
    )


# --------------------------------------------------------------------------- step 3: checked

# What each rank calls in a mismatch: (op name, dtype, size) per rank, and the odd rank.
CASES = {
    "shape": ([("all_reduce", "float32", 6)] * 2 + [("all_reduce", "float32", 5)] + [("all_reduce", "float32", 6)], 2),
    "dtype": ([("all_reduce", "float64", 6)] + [("all_reduce", "float32", 6)] * 3, 0),
    "operation": ([("all_reduce", "float32", 6)] * 3 + [("broadcast", "float32", 6)], 3),
}  # fmt: skip


def _call(kata, op_name, dtype, size, rank):
    tensor = torch.full((size,), float(rank + 1), dtype=getattr(torch, dtype))
    if op_name == "broadcast":
        return kata.checked(dist.broadcast, tensor, 0)
    return kata.checked(dist.all_reduce, tensor)


def _mismatch(rank, world_size, case):
    kata = load_kata(KATA)
    op_name, dtype, size = CASES[case][0][rank]
    with recording() as calls:
        try:
            _call(kata, op_name, dtype, size, rank)
            outcome = ("returned", "", "")
        except RuntimeError as error:
            outcome = ("raised", type(error).__name__, str(error))
    ran = sum(c.name == op_name and c.shapes == [(size,)] for c in calls)
    return (*outcome, ran, [c.name for c in calls])


def _expected_sentence(case: str) -> str:
    calls, _ = CASES[case]
    prints = [f"{op}({dtype}[{size}])" for op, dtype, size in calls]
    groups: dict[str, list[int]] = {}
    for rank, text in enumerate(prints):
        groups.setdefault(text, []).append(rank)
    ordered = sorted(groups.items(), key=lambda item: (len(item[1]), item[1][0]))
    return "; ".join(f"{_text(r)} call{'s' if len(r) == 1 else ''} {t}" for t, r in ordered)


@pytest.mark.step(3)
@pytest.mark.parametrize("case", list(CASES))
def test_checked_raises_on_every_rank_naming_the_rank_that_differs(kata, case):
    calls, odd = CASES[case]
    sentence = _expected_sentence(case)
    where = f"checked() on 4 ranks where rank {odd} differs in its {case} ({sentence})"
    results = _world(
        _mismatch,
        4,
        case,
        what=(
            f"{where}: some ranks went on into the collective and waited there for ever. Every "
            "rank must raise CollectiveMismatch, not only the one that differs: all ranks "
            "exchanged the same fingerprints, so all can see the mismatch"
        ),
    )
    raised = [r for r, got in enumerate(results) if got[1] == "CollectiveMismatch"]
    for rank, (outcome, kind, message, ran, recorded) in enumerate(results):
        op_name = calls[rank][0]
        if ran and raised:
            raise AssertionError(
                f"{where}: {_text(raised)} raised CollectiveMismatch, but rank {rank} went on into "
                f"{op_name} ({recorded} recorded). Every rank must raise CollectiveMismatch, not "
                "only the one that differs: all ranks got the same fingerprints, so all can see "
                "the mismatch (the others would wait in the collective for ever)"
            )
        assert outcome == "raised", (
            f"{where}: rank {rank}'s checked() returned ({recorded} recorded) instead of "
            "raising CollectiveMismatch: exchange every rank's fingerprint first and raise when "
            "they differ"
            + (
                "; a fingerprint without the dtype lets float64 and float32 meet"
                if case == "dtype"
                else ""
            )
        )
        assert not ran, (
            f"{where}: rank {rank} called {op_name} although the ranks disagree ({message!r}): "
            "the collective runs only when every rank's fingerprint is the same"
        )
        assert kind == "CollectiveMismatch", (
            f"{where}: rank {rank} raised {kind}: {message}; raise CollectiveMismatch"
        )
        assert sentence in message, (
            f"{where}: rank {rank}'s CollectiveMismatch says {message!r}; it should hold "
            f"{sentence!r}, describe_mismatch's sentence for the ranks' fingerprints (every "
            "rank the same)"
        )


def _agreeing(rank, world_size):
    kata = load_kata(KATA)
    out = {}
    with recording() as calls:
        mine = torch.arange(6, dtype=torch.float32) * (rank + 1)
        returned = kata.checked(dist.all_reduce, mine)
        out["all_reduce"] = (mine, returned is None, [c.name for c in calls])
    reference = torch.arange(6, dtype=torch.float32) * (rank + 1)
    dist.all_reduce(reference)
    out["all_reduce expected"] = reference
    largest = torch.full((3,), float(rank))
    kata.checked(dist.all_reduce, largest, op=dist.ReduceOp.MAX)
    out["max"] = largest
    sent = torch.full((2, 2), float(rank))
    kata.checked(dist.broadcast, sent, 1)
    out["broadcast"] = sent
    pending = torch.ones(5, dtype=torch.float64)
    work = kata.checked(dist.all_reduce, pending, async_op=True)
    if work is None:
        out["async"] = None
        dist.barrier()  # the all_reduce may still run: let it finish before the rank ends
    else:
        work.wait()
        out["async"] = pending
    return out


@pytest.mark.step(3)
def test_checked_runs_the_collective_once_when_all_agree(kata):
    where = "checked() on 4 ranks that all call the same collective"
    results = _world(_agreeing, 4, what=f"{where}: the ranks hung")
    for rank, got in enumerate(results):
        mine, returned_none, names = got["all_reduce"]
        after = names[names.index("all_reduce") + 1 :] if "all_reduce" in names else []
        assert names.count("all_reduce") == 1 and not after, (
            f"{where}: rank {rank} recorded {names} for checked(dist.all_reduce, t): the "
            "fingerprints are exchanged first and then the collective runs once, last"
        )
        assert torch.equal(mine, got["all_reduce expected"]), (
            f"rank {rank}: checked(dist.all_reduce, t) left {mine.tolist()}, dist.all_reduce "
            f"gives {got['all_reduce expected'].tolist()}: run collective(tensor, *args, "
            "group=group, **kwargs) on the tensor itself"
        )
        assert returned_none, (
            f"rank {rank}: checked() must return what the collective returned (None here)"
        )
        assert torch.equal(got["max"], torch.full((3,), 3.0)), (
            f"rank {rank}: checked(dist.all_reduce, t, op=dist.ReduceOp.MAX) gave "
            f"{got['max'].tolist()}, expected [3.0, 3.0, 3.0]: pass the collective's keyword arguments on"
        )
        assert torch.equal(got["broadcast"], torch.full((2, 2), 1.0)), (
            f"rank {rank}: checked(dist.broadcast, t, 1) gave {got['broadcast'].tolist()}, "
            "expected rank 1's 1.0 everywhere: pass the collective's positional arguments on"
        )
        assert got["async"] is not None, (
            f"rank {rank}: checked(dist.all_reduce, t, async_op=True) returned None: return what "
            "the collective returned (its Work handle here, for .wait())"
        )
        assert torch.equal(got["async"], torch.full((5,), 4.0, dtype=torch.float64)), (
            f"rank {rank}: checked(dist.all_reduce, t, async_op=True) and .wait() on what it "
            f"returned gave {got['async'].tolist()}: return the collective's own result (its "
            "Work handle here)"
        )


class _NotOnTheGroup(Exception):
    """The collective checked() called was given another group than checked() was."""


def _on_the_group(group):
    """dist.all_reduce, refusing (at once, instead of hanging) to run on another group."""

    def all_reduce(tensor, *args, **kwargs):
        given = kwargs.get("group", args[1] if len(args) > 1 else None)
        if given is not group:
            raise _NotOnTheGroup("the world" if given is None else repr(given))
        return dist.all_reduce(tensor, *args, **kwargs)

    return all_reduce


def _in_a_subgroup(rank, world_size):
    kata = load_kata(KATA)
    group = dist.new_group([1, 2])
    if rank == 0:  # outside the group: it calls nothing of the group's
        return None
    all_reduce = _on_the_group(group)
    agreed = torch.full((3,), float(rank))
    try:
        kata.checked(all_reduce, agreed, group=group)
        kata.checked(all_reduce, torch.ones(2 if rank == 2 else 3), group=group)
        said = "returned"
    except _NotOnTheGroup as error:
        return "elsewhere", str(error)
    except RuntimeError as error:
        said = str(error)
    return agreed, said


@pytest.mark.step(3)
def test_checked_in_a_subgroup_names_the_groups_ranks(kata):
    where = "checked(..., group=the group [1, 2]) on 3 ranks"
    results = _world(
        _in_a_subgroup,
        3,
        what=(
            f"{where}: ranks 1 and 2 waited for ever, in a collective that rank 0, outside their "
            "group, never calls: pass group=group to the exchange of fingerprints too"
        ),
    )
    for rank in (1, 2):
        agreed, said = results[rank]
        if isinstance(agreed, str):  # "elsewhere": the collective was about to run off the group
            raise AssertionError(
                f"{where}: rank {rank}'s checked() exchanged the fingerprints, then ran the "
                f"collective itself on {said}, not on the group it was given: ranks 1 and 2 "
                "would wait there for rank 0, which is outside their group (the test stopped "
                "the call before it could hang). Pass group=group to the collective too: "
                "collective(tensor, *args, group=group, **kwargs)"
            )
        assert torch.equal(agreed, torch.full((3,), 3.0)), (
            f"{where}: rank {rank}'s all_reduce gave {agreed.tolist()}, expected 3.0 (ranks 1 "
            "and 2 summed): run the collective on the group"
        )
        sentence = "rank 0 calls all_reduce(float32[3]); rank 1 calls all_reduce(float32[2])"
        assert sentence in said, (
            f"{where}, global rank 2 calling float32[2]: rank {rank} said {said!r}, expected "
            f"{sentence!r}: the ranks are the group's own (0 and 1 in a group of 2), as "
            "dist.get_world_size(group) and dist.get_rank(group) count them"
        )


_TORCH_ODD = re.compile(r"but Rank (\d+) is running collective")


def _against_detail(rank, world_size):
    kata = load_kata(KATA)
    size = 3 if rank == 2 else 4
    try:
        kata.checked(dist.all_reduce, torch.ones(size))
        mine = "returned"
    except RuntimeError as error:
        mine = str(error)
    before = dist.get_debug_level()
    dist.set_debug_level(dist.DebugLevel.DETAIL)  # what TORCH_DISTRIBUTED_DEBUG=DETAIL sets
    group = dist.new_group(timeout=timedelta(seconds=5))
    dist.set_debug_level(before)
    try:
        dist.all_reduce(torch.ones(size), group=group)
        torch_said = "returned"
    except RuntimeError as error:
        torch_said = str(error)
    return mine, torch_said


@pytest.mark.step(3)
def test_checked_blames_the_rank_that_torchs_detail_mode_blames(kata):
    results = _world(
        _against_detail, 4, what="checked() with rank 2 calling float32[3]: the ranks hung"
    )
    for rank, (mine, torch_said) in enumerate(results):
        assert "Detected mismatch between collectives" in torch_said, (
            f"rank {rank}: torch's DETAIL mode said {torch_said[:300]!r}: this torch reports "
            "otherwise; tell the maintainers"
        )
        if rank != 2:
            found = _TORCH_ODD.search(torch_said)
            assert found and found.group(1) == "2", torch_said[:300]
        assert (
            "rank 2 calls all_reduce(float32[3]); ranks 0, 1, 3 call all_reduce(float32[4])" in mine
        ), (
            f"rank {rank}: torch's DETAIL mode blames rank 2 ({torch_said[:160]}...), your "
            f"checked() said {mine!r}"
        )


# --------------------------------------------------------------------------- step 4: torch's own


_TIMEOUT_SIGNS = ("timeout", "timed out", "monitoredbarrier")
# What a rank raises when the group gave up on it, or a peer's group gave up and left it.
_HASTY_SIGNS = (*_TIMEOUT_SIGNS, "connection reset", "connection closed")


def _torch_group_mismatch(rank, world_size):
    kata = load_kata(KATA)
    before = dist.get_debug_level()
    start = time.monotonic()
    try:
        group = kata.torch_checked_group(3.0)
        after = dist.get_debug_level()
        agreed = torch.full((4,), float(rank))
        dist.all_reduce(agreed, group=group)  # the same on every rank: it runs
    except KataTodo:
        raise
    except Exception as error:  # the group gave up (or was never made): say how soon
        lines = str(error).strip().splitlines()
        text = f"{type(error).__name__}: {lines[0][:200] if lines else ''}"
        return "gave up", text, time.monotonic() - start, None
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(3 if rank == 2 else 4), group=group)
        said = "returned"
    except RuntimeError as error:
        said = str(error)
    return str(before), str(after), agreed, said, time.monotonic() - start


@pytest.mark.step(4)
def test_torch_checked_group_catches_a_shape_mismatch(kata):
    where = "torch_checked_group(3.0) on 4 ranks, rank 2 calling all_reduce with float32[3]"
    results = _world(
        _torch_group_mismatch,
        4,
        group_timeout_s=3.0,
        what=(
            f"{where}: the ranks waited for ever: torch checked nothing. Set the debug level to "
            "DETAIL (dist.set_debug_level) before dist.new_group, and give the group its timeout: "
            "the environment variable TORCH_DISTRIBUTED_DEBUG is read only when torch starts"
        ),
    )
    gave_up = [rank for rank, result in enumerate(results) if result[0] == "gave up"]
    # The rank whose own error says why: one that timed out, not a peer it left (on a busy
    # machine a peer can see "Connection closed by peer" first).
    timed_out = [
        rank for rank in gave_up if any(sign in results[rank][1].lower() for sign in _TIMEOUT_SIGNS)
    ]
    if gave_up:
        rank = (timed_out or gave_up)[0]
        text, seconds = results[rank][1], results[rank][2]
        early = seconds < 3.0 and rank in timed_out
        raise AssertionError(
            f"{where}: on rank {rank} making the group or its first all_reduce (every rank "
            f"alike) raised {text} after {1000 * seconds:.0f} ms"
            + (
                ": the group timed out long before its 3 s, so the timeout is in seconds "
                "where you gave another unit: dist.new_group(timeout=timedelta(seconds="
                "timeout_s))"
                if early
                else ": torch_checked_group(timeout_s) makes a group of every rank with "
                "dist.new_group(timeout=timedelta(seconds=timeout_s))"
            )
        )
    # A group given 3 ms instead of 3 s can also be made in time on a quiet machine, and give up
    # only in the mismatched all_reduce: a rank timed out there (its peers then see their
    # connection reset) long before the 3 s.
    hasty = [
        rank
        for rank, result in enumerate(results)
        if result[4] < 3.0 and any(sign in result[3].lower() for sign in _HASTY_SIGNS)
    ]
    if hasty:
        rank = hasty[0]
        raise AssertionError(
            f"{where}: rank {rank}'s all_reduce with the mismatched shape raised "
            f"{results[rank][3][:200]!r} after {1000 * results[rank][4]:.0f} ms: the group timed "
            "out long before its 3 s, so the timeout is in seconds where you gave another unit: "
            "dist.new_group(timeout=timedelta(seconds=timeout_s))"
        )
    for rank, (before, after, agreed, said, _) in enumerate(results):
        assert after == before, (
            f"rank {rank}: torch_checked_group left the debug level at {after} (it was "
            f"{before}): every group made afterwards would pay for the checks. Set DETAIL only "
            "while the group is made and restore what was there (in a finally)"
        )
        assert torch.equal(agreed, torch.full((4,), 6.0)), (
            f"rank {rank}: an all_reduce that every rank calls alike gave {agreed.tolist()} on "
            "the group, expected 6.0 everywhere: return a group of every rank"
        )
        assert "Detected mismatch between collectives" in said, (
            f"{where}: rank {rank}'s all_reduce "
            + ("returned without an error" if said == "returned" else f"raised {said[:200]!r}")
            + ": torch checked nothing. Set the debug level to DETAIL "
            "(dist.set_debug_level(dist.DebugLevel.DETAIL)) before dist.new_group: the "
            "environment variable TORCH_DISTRIBUTED_DEBUG is read only when torch starts"
        )


def _torch_group_skip(rank, world_size):
    kata = load_kata(KATA)
    start = time.monotonic()
    try:
        group = kata.torch_checked_group(TIMEOUT_S)
    except RuntimeError as error:
        if rank != 3:
            _done("test/group-done", rank)
        return f"making the group raised {error}", time.monotonic() - start
    if rank == 3:
        _stay("test/group-done", world_size, (3,))
        return None
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(4), group=group)
        said = "returned"
    except RuntimeError as error:
        said = str(error)
    _done("test/group-done", rank)
    return said, time.monotonic() - start


@pytest.mark.step(4)
def test_torch_checked_group_gives_up_after_its_timeout(kata):
    where = f"torch_checked_group({TIMEOUT_S:g}) on 4 ranks, rank 3 never calling all_reduce"
    results = _world(
        _torch_group_skip,
        4,
        group_timeout_s=TIMEOUT_S,
        what=(
            f"{where}: ranks 0, 1, 2 waited for ever. Give the group its own timeout: "
            "dist.new_group(timeout=timedelta(seconds=timeout_s))"
        ),
    )
    for rank, got in enumerate(results):
        if got and got[0].startswith("making the group raised"):
            raise AssertionError(
                f"{where}: on rank {rank} {got[0][:200]!r} after {got[1]:.3f} s: a group that "
                "times out before its ranks have even met has a timeout far too short: "
                "timedelta(seconds=timeout_s), the timeout is in seconds"
            )
    for rank, (said, took) in enumerate(results[:3]):
        assert said != "returned", f"{where}: rank {rank}'s all_reduce returned"
        assert took >= 0.8 * TIMEOUT_S, (
            f"{where}: rank {rank} gave up after {took:.3f} s, the timeout was {TIMEOUT_S:g} s "
            f"({said[:120]!r}): timedelta(seconds=timeout_s), the timeout is in seconds"
        )
    assert re.search(r"Ranks? 3 failed to pass monitoredBarrier", results[0][0]), (
        f"{where}: rank 0 said {results[0][0][:300]!r}; torch's DETAIL group names the missing "
        "rank ('Ranks 3 failed to pass monitoredBarrier'): set DETAIL while the group is made"
    )


def _bad_timeouts(rank, world_size):
    kata = load_kata(KATA)
    return {
        repr(value): refusal(lambda value=value: kata.torch_checked_group(value))
        for value in (0, -1.0, True, "3")
    }


@pytest.mark.step(4)
def test_torch_checked_group_refuses_bad_timeouts(kata):
    for value, outcome in run_world(_bad_timeouts, 1)[0].items():
        assert outcome is None, (
            f"torch_checked_group({value}) {outcome}: refuse a timeout that is not a positive "
            "number of seconds with a ValueError saying so, before making any group"
        )


@pytest.mark.step(4)
def test_program_names_the_ranks_of_every_hang(kata):
    args = ("--world-size", "3", "--skip-rank", "1", "--mismatch-rank", "0", "--timeout", "1.5")
    args += ("--unchecked",)
    # Started with DETAIL set, as a learner would: torch then checks the world group too.
    out = run_module_ok(KATA, *args, env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}).stdout
    shown = f"`TORCH_DISTRIBUTED_DEBUG=DETAIL python -m {KATA} {' '.join(args)}`"
    for rank in (0, 2):
        assert re.search(rf"\[rank {rank}\] caught BarrierTimeout: .*rank 1 did not arrive", out), (
            f"{shown}: rank {rank} should name rank 1 in its BarrierTimeout:\n{out}"
        )
    expected = [
        "rank 0 calls all_reduce(float32[3]); ranks 1, 2 call all_reduce(float32[4])",
        "with the same shapes it runs: the sum of the ranks' numbers [3.0, 3.0, 3.0, 3.0]",
        "[rank 0] 3. torch (DETAIL): Detected mismatch between collectives on ranks: rank 0 runs "
        "ALLREDUCE(Float[3]), but rank 1 runs ALLREDUCE(Float[4])",
        "[rank 2] 4. unchecked all_reduce (debug level DETAIL): Detected mismatch between "
        "collectives on ranks: rank 2 runs ALLREDUCE(Float[4]), but rank 0 runs "
        "ALLREDUCE(Float[3])",
    ]
    for line in expected:
        assert line in out, f"{shown} should print {line!r}:\n{out}"
    assert re.search(r"Ranks? 1 failed to pass monitoredBarrier", out), out


# --------------------------------------------------------------------------- CUDA


def _on_cuda(rank, world_size):
    device = rank_gpu()
    kata = load_kata(KATA)
    agreed = torch.full((4,), float(rank + 1), device=device)
    kata.checked(dist.all_reduce, agreed)
    said = None
    if world_size > 1:
        try:
            kata.checked(dist.all_reduce, torch.ones(3 if rank == 1 else 4, device=device))
            said = "returned"
        except RuntimeError as error:
            said = str(error)
    return agreed.cpu(), said


def check_on_cuda(results) -> None:
    world_size = len(results)
    total = float(sum(range(1, world_size + 1)))
    for rank, (agreed, said) in enumerate(results):
        assert torch.equal(agreed, torch.full((4,), total)), (
            f"rank {rank}: checked(dist.all_reduce, t) on CUDA gave {agreed.tolist()}, expected "
            f"{total} everywhere"
        )
        if world_size > 1:
            assert said and "rank 1 calls all_reduce(float32[3])" in said, (
                f"rank {rank}: checked() on CUDA with rank 1 calling float32[3] said {said!r}"
            )


@pytest.mark.step(3)
@pytest.mark.cuda
def test_checked_on_nccl_world_of_one(kata):
    check_on_cuda(run_world(_on_cuda, 1, **on_cuda(1, "nccl")))


@pytest.mark.step(3)
@pytest.mark.cuda
def test_checked_gloo_on_cuda_several_ranks(kata):
    check_on_cuda(run_world(_on_cuda, 2, **on_cuda(2, "gloo")))
