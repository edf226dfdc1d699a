"""k24 overlap, measured: merge_intervals, overlap_fraction, watch_all_reduces, record_step."""

from __future__ import annotations

import random
import re
import time
from fractions import Fraction

import pytest
import torch
import torch.distributed as dist

from dojo.harness.calls import recording
from dojo.harness.impl import load_kata
from dojo.harness.world import run_world
from dojo.spec.cuda import on_cuda, rank_gpu
from dojo.spec.testing import (
    DidNotReturn,
    returns_within,
    run_module_ok,
    shared_run,
    streams,
)
from dojo.todo import KataTodo
from dojo.toy_models import make_tokens, make_transformer

KATA = "k24_overlap"
PER_RANK = 4  # sequences per rank
LATE = 0.3  # seconds rank 1 waits before it joins rank 0's all-reduce
SPLIT_MB = 0.01  # k13's cap for the tests: several buckets of the TinyTransformer


def _call(function, *args):
    try:
        return returns_within(f"{function.__name__}{_args(args)}", function, *args), None
    except (KataTodo, DidNotReturn):
        raise
    except Exception as error:
        return None, error


def _args(args) -> str:
    return "(" + ", ".join(_shown(a) if isinstance(a, list) else repr(a) for a in args) + ")"


def _shown(intervals) -> str:
    return "[" + ", ".join(f"({a:g}, {b:g})" for a, b in intervals) + "]"


# --------------------------------------------------------------------------- step 1: merge_intervals

MERGES = [
    ("empty", [], [], "no intervals have an empty union: return []"),
    ("one", [(1, 3)], [(1, 3)], "one interval is its own union"),
    (
        "unsorted-disjoint",
        [(5, 6), (1, 2)],
        [(1, 2), (5, 6)],
        "the intervals come in any order: sort them by start first (sorted(...)), and return them "
        "sorted",
    ),
    (
        "unsorted-overlapping",
        [(3, 5), (1, 4)],
        [(1, 5)],
        "the intervals come in any order: sort them by start first, then merge each one into the "
        "last merged interval when it starts before that one ends",
    ),
    (
        "nested",
        [(0, 10), (2, 3), (4, 5)],
        [(0, 10)],
        "an interval nested inside another ends before the one that holds it: the merged end is "
        "the larger of the two ends (max), not the later interval's end",
    ),
    (
        "touching",
        [(0, 2), (2, 3)],
        [(0, 3)],
        "intervals that touch (one ends where the next starts) are one stretch of time: merge "
        "when start <= the last end, not only when start < the last end",
    ),
    (
        "lesson-example",
        [(0, 2), (1, 3), (3, 4)],
        [(0, 4)],
        "overlapping and touching intervals become one",
    ),
    (
        "points",
        [(1, 3), (2, 2), (4, 4)],
        [(1, 3), (4, 4)],
        "an interval with start == end is a point: inside another it disappears, apart it stays",
    ),
]


@pytest.mark.step(1)
@pytest.mark.parametrize(
    "given, expected, why", [m[1:] for m in MERGES], ids=[m[0] for m in MERGES]
)
def test_merge_intervals_hand_made(kata, given, expected, why):
    got, error = _call(kata.merge_intervals, list(given))
    assert error is None, f"merge_intervals({_shown(given)}) raised {error!r}: {why}"
    got_list = [tuple(pair) for pair in got]
    assert got_list == expected, (
        f"merge_intervals({_shown(given)}) returned {_shown(got_list)}, expected "
        f"{_shown(expected)}: {why}"
    )


@pytest.mark.step(1)
def test_merge_intervals_leaves_its_input_and_takes_any_iterable(kata):
    given = [[4.0, 6.0], [1.0, 2.0], [5.0, 8.0]]
    copy = [list(pair) for pair in given]
    got = kata.merge_intervals(given)
    assert given == copy, (
        f"merge_intervals changed the list it was given, to {given}: sort a copy (sorted(...)), "
        "never the caller's list"
    )
    assert [tuple(p) for p in got] == [(1.0, 2.0), (4.0, 8.0)], got
    assert all(isinstance(p, tuple) for p in got), (
        f"merge_intervals returned {got}: return (start, end) tuples"
    )
    from_generator = kata.merge_intervals(pair for pair in [(2.0, 3.0), (0.0, 1.0)])
    assert [tuple(p) for p in from_generator] == [(0.0, 1.0), (2.0, 3.0)], (
        f"merge_intervals of a generator returned {from_generator}: it takes any iterable of "
        "pairs; go through it once"
    )


def _cells(intervals) -> set[int]:
    """The unit cells [k, k + 1) that integer intervals cover."""
    return {k for a, b in intervals for k in range(a, b)}


@pytest.mark.step(1)
def test_merge_intervals_against_a_grid(kata):
    generator = random.Random(24)
    for _ in range(200):
        given = []
        for _ in range(generator.randint(1, 8)):
            start = generator.randint(0, 40)
            given.append((start, start + generator.randint(1, 10)))
        got = [
            tuple(p)
            for p in returns_within(f"merge_intervals({given})", kata.merge_intervals, given)
        ]
        assert _cells(got) == _cells(given), (
            f"merge_intervals({given}) returned {got}, which does not cover the same time: "
            "every moment inside some interval must be inside the union, and nothing else"
        )
        for (_, end), (start, _) in zip(got, got[1:]):
            assert end < start, (
                f"merge_intervals({given}) returned {got}: its intervals must be sorted and "
                "disjoint, with a gap between neighbours (touching ones merged)"
            )


@pytest.mark.step(1)
def test_merge_intervals_rejects_an_interval_that_ends_before_it_starts(kata):
    got, error = _call(kata.merge_intervals, [(0.0, 1.0), (5.0, 3.0)])
    assert isinstance(error, ValueError), (
        f"merge_intervals([(0, 1), (5, 3)]) {'raised ' + repr(error) if error else 'returned ' + str(got)}"
        ": (5, 3) ends before it starts, which is no interval. Raise a ValueError that names it"
    )
    assert "5" in str(error) and "3" in str(error), (
        f"the ValueError says {str(error)!r}: name the interval, (5.0, 3.0), so the caller can "
        "find it"
    )


# --------------------------------------------------------------------------- step 2: overlap_fraction

FRACTIONS = [
    ("after-backward", [(0, 4)], [(6, 8)], 0.0, "all communication ran after backward: 0.0"),
    (
        "before-backward",
        [(4, 8)],
        [(0, 2)],
        0.0,
        "communication that ended before backward began is not hidden: an interval's hidden time "
        "is max(0, min(ends) - max(starts)), never negative",
    ),
    ("full", [(0, 10)], [(2, 4)], 1.0, "communication entirely inside backward: 1.0"),
    (
        "partial",
        [(0, 8)],
        [(6, 10)],
        0.5,
        "2 of the all-reduce's 4 time units run while backward runs: 0.5. Divide the hidden time "
        "by the communication's time, not by the backward's",
    ),
    (
        "starts-before-backward",
        [(4, 8)],
        [(2, 6)],
        0.5,
        "the all-reduce runs from 2 to 6, backward from 4: only (4, 6) is hidden. Clip the "
        "communication interval at both ends of backward: max of the starts, min of the ends",
    ),
    (
        "several-overlapping-comms",
        [(0, 8)],
        [(2, 4), (3, 6), (7, 10)],
        5 / 7,
        "all-reduces in flight at the same time were counted twice: their union, (2, 6) and "
        "(7, 10), is 7 units long, 5 of them hidden. Merge the communication intervals "
        "(merge_intervals) before measuring",
    ),
    (
        "the-same-all-reduce-twice",
        [(0, 8)],
        [(2, 4), (2, 4), (6, 10)],
        2 / 3,
        "two all-reduces over the same time were counted twice: the union is (2, 4) and "
        "(6, 10), 6 units, 4 hidden. Merge the communication intervals (merge_intervals) "
        "before measuring",
    ),
    (
        "backward-overlapping-pieces",
        [(0, 4), (2, 6)],
        [(0, 8)],
        0.75,
        "backward's pieces overlap one another, and their shared time (2, 4) was counted twice: "
        "merge the backward intervals too (merge_intervals), then 6 of 8 units are hidden",
    ),
    (
        "backward-separate-pieces",
        [(0, 2), (4, 6)],
        [(1, 5)],
        0.5,
        "backward ran in two pieces: the all-reduce (1, 5) is hidden during (1, 2) and (4, 5), "
        "2 of its 4 units. Add the hidden time over every pair of pieces",
    ),
    ("no-backward", [], [(1, 3)], 0.0, "with no backward nothing is hidden: 0.0"),
]


def _union(intervals) -> list:
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def _fraction_mistake(backward, comms, got) -> str:
    """Which likely mistake returns ``got`` here (compared with what each would return)."""
    busy, computing = _union(comms), _union(backward)
    total = sum(e - s for s, e in busy)
    spent = sum(f - b for b, f in computing)

    def hidden(clip):
        return sum(clip(s, e, b, f) for s, e in busy for b, f in computing)

    both = hidden(lambda s, e, b, f: max(0, min(e, f) - max(s, b)))
    end_only = hidden(lambda s, e, b, f: max(0, min(e, f) - s))
    if got < 0:
        return (
            ". A fraction of time is never negative: an interval's hidden time is "
            "max(0, min(ends) - max(starts)), so communication outside backward adds 0"
        )
    if spent and got == pytest.approx(both / spent) and both / spent != both / total:
        return (
            f". {got!r} is the hidden time over the backward's time ({both:g} / {spent:g}): "
            "Divide the hidden time by the communication's time"
        )
    if total and got == pytest.approx(end_only / total) and end_only != both:
        return (
            ". That is what clipping the communication at backward's end only gives: clip "
            "each communication interval at both ends of backward (max of the starts, min of "
            "the ends)"
        )
    return ""


@pytest.mark.step(2)
@pytest.mark.parametrize(
    "backward, comms, expected, why", [f[1:] for f in FRACTIONS], ids=[f[0] for f in FRACTIONS]
)
def test_overlap_fraction_hand_made(kata, backward, comms, expected, why):
    got, error = _call(kata.overlap_fraction, list(backward), list(comms))
    call = f"overlap_fraction(backward={_shown(backward)}, communication={_shown(comms)})"
    assert error is None, f"{call} raised {error!r}: {why}"
    # Exact: the hand-made times are whole numbers, so the hidden and total times are exact and
    # one division rounds the same way in any correct implementation.
    assert got == expected, (
        f"{call} returned {got!r}, expected {expected!r}: {why}"
        + _fraction_mistake(backward, comms, got)
    )


def _grid_fraction(backward, comms) -> Fraction:
    busy = _cells(comms)
    return Fraction(len(busy & _cells(backward)), len(busy))


@pytest.mark.step(2)
def test_overlap_fraction_against_a_grid(kata):
    generator = random.Random(2024)

    def intervals(count):
        chosen = []
        for _ in range(count):
            start = generator.randint(0, 50)
            chosen.append((start, start + generator.randint(1, 12)))
        return chosen

    for _ in range(200):
        backward, comms = intervals(generator.randint(0, 3)), intervals(generator.randint(1, 6))
        expected = _grid_fraction(backward, comms)
        got = returns_within(
            f"overlap_fraction({backward}, {comms})", kata.overlap_fraction, backward, comms
        )
        # Whole-number times: exact sums, one rounding in the division (hence the tolerance).
        assert got == pytest.approx(float(expected), rel=1e-12, abs=1e-15), (
            f"overlap_fraction(backward={backward}, communication={comms}) returned {got}, "
            f"expected {expected} = {float(expected)} (each moment of communication counted "
            "once, hidden when backward runs at that moment too)"
        )


@pytest.mark.step(2)
@pytest.mark.parametrize(
    "comms, what",
    [([], "no communication intervals"), ([(3.0, 3.0)], "only an empty communication interval")],
    ids=["none", "empty"],
)
def test_overlap_fraction_with_nothing_to_measure_is_a_value_error(kata, comms, what):
    got, error = _call(kata.overlap_fraction, [(0.0, 5.0)], comms)
    assert isinstance(error, ValueError), (
        f"overlap_fraction(backward=[(0, 5)], communication={comms}) "
        f"{'raised ' + repr(error) if error else 'returned ' + repr(got)}: with {what} there is "
        "no communication time to measure, and a fraction of nothing means nothing. Check the "
        "total communication time first and raise a ValueError that says so"
    )


@pytest.mark.step(2)
def test_overlap_fraction_rejects_a_reversed_interval(kata):
    got, error = _call(kata.overlap_fraction, [(0.0, 5.0)], [(4.0, 2.0)])
    assert isinstance(error, ValueError), (
        f"overlap_fraction(backward=[(0, 5)], communication=[(4, 2)]) "
        f"{'raised ' + repr(error) if error else 'returned ' + repr(got)}: (4, 2) ends before it "
        "starts; a ValueError (merge_intervals raises one) tells the caller"
    )


# --------------------------------------------------------------------------- step 3: watch_all_reduces


def _comm(comm) -> dict:
    return {
        "launched": comm.launched,
        "completed": comm.completed,
        "nbytes": comm.nbytes,
        "is_async": comm.is_async,
    }


def _watch(rank, world_size):
    kata = load_kata(KATA)
    out = {}
    plain = dist.all_reduce(torch.zeros(1), async_op=True)  # what torch returns, unwatched
    work_type = type(plain).__name__
    plain.wait()
    dist.barrier()

    # A blocking all-reduce with a positional op (MAX).
    tensor = torch.full((4,), float(rank + 1))
    before = time.perf_counter()
    with kata.watch_all_reduces() as comms:
        returned = dist.all_reduce(tensor, dist.ReduceOp.MAX)
    after = time.perf_counter()
    out["blocking"] = {
        "before": before,
        "after": after,
        "returned": repr(returned),
        "values": tensor.tolist(),
        "comms": [_comm(c) for c in comms],
    }
    dist.barrier()

    # An async all-reduce whose peer (rank 1) joins LATE seconds after rank 0 launched it.
    tensor = torch.ones(1 << 16)
    if rank == 1:
        time.sleep(LATE)
        joined = time.perf_counter()
        dist.all_reduce(tensor)
        out["late"] = {"joined": joined}
    else:
        with kata.watch_all_reduces() as comms:
            launched_at = time.perf_counter()
            work = dist.all_reduce(tensor, async_op=True)
            returned_at = time.perf_counter()
        kind = type(work).__name__
        if work is not None:  # None: the watch lost the handle (the test says so); gloo
            work.wait()  # runs the next collective after this one anyway
        out["late"] = {
            "launched_at": launched_at,
            "returned_at": returned_at,
            "type": kind,
            "expected_type": work_type,
            "sum": tensor[0].item(),
            "comms": [_comm(c) for c in comms],
        }
    dist.barrier()

    # An async all-reduce that has finished (is_completed() says so) well before wait() is called.
    tensor = torch.ones(1 << 10)
    with kata.watch_all_reduces() as comms:
        work = dist.all_reduce(tensor, async_op=True)
        deadline = time.perf_counter() + 10
        while work is not None and not work.is_completed() and time.perf_counter() < deadline:
            time.sleep(0.001)
        polled = time.perf_counter()
        seen_then = comms[0].completed if comms else None
        time.sleep(0.05)
        if work is not None:
            work.wait()
    out["early"] = {
        "type": type(work).__name__,
        "polled": polled,
        "seen_then": seen_then,
        "comms": [_comm(c) for c in comms],
    }

    # The original dist.all_reduce is back after the block, after an error too.
    original = dist.all_reduce
    with kata.watch_all_reduces() as comms:
        pass
    dist.all_reduce(torch.ones(2))
    out["restored"] = dist.all_reduce is original
    out["recorded_after"] = len(comms)
    try:
        with kata.watch_all_reduces():
            raise KeyError("inside the block")
    except KeyError:
        pass
    out["restored_after_error"] = dist.all_reduce is original
    dist.all_reduce = original  # whatever happened, the next tests get the real one
    return out


_watched = shared_run(lambda: run_world(_watch, 2))


def _only_comm(rank, where, comms) -> dict:
    assert len(comms) == 1, (
        f"rank {rank}: one dist.all_reduce inside the block ({where}), {len(comms)} Comm(s) "
        "recorded: append one Comm per call"
    )
    return comms[0]


@pytest.mark.step(3)
def test_a_blocking_all_reduce_runs_from_its_call_to_its_return(kata):
    for rank, result in enumerate(_watched()):
        got = result["blocking"]
        assert got["values"] == [2.0] * 4, (
            f"rank {rank}: dist.all_reduce(tensor, dist.ReduceOp.MAX) inside the block left "
            f"{got['values']}, expected [2.0] * 4 (the max of 1 and 2): pass every argument on "
            "to the original all_reduce, unchanged (*args, **kwargs)"
        )
        assert got["returned"] == "None", (
            f"rank {rank}: the blocking all_reduce returned {got['returned']} inside the block: "
            "return what the original returned"
        )
        comm = _only_comm(rank, "a blocking one", got["comms"])
        assert comm["completed"] is not None, (
            f"rank {rank}: the blocking all-reduce's Comm has completed=None: a blocking call "
            "has finished when it returns (the original returns None): set completed then"
        )
        assert got["before"] <= comm["launched"] <= comm["completed"] <= got["after"], (
            f"rank {rank}: the blocking all-reduce was called and returned within "
            f"({got['before']:.6f}, {got['after']:.6f}) by time.perf_counter(), but its Comm says "
            f"launched {comm['launched']:.6f}, completed {comm['completed']:.6f}: take both from "
            "time.perf_counter(), launched before calling the original, completed after it returns"
        )
        assert comm["nbytes"] == 16 and comm["is_async"] is False, (
            f"rank {rank}: a blocking all-reduce of 4 float32 recorded nbytes={comm['nbytes']}, "
            f"is_async={comm['is_async']}, expected 16 and False"
        )


@pytest.mark.step(3)
def test_an_async_all_reduce_completes_only_once_its_late_peer_arrived(kata):
    results = _watched()
    got, joined = results[0]["late"], results[1]["late"]["joined"]
    assert got["type"] != "NoneType", (
        "rank 0: dist.all_reduce(..., async_op=True) inside the block returned None, not the "
        f"{got['expected_type']} torch returns: the caller's work.wait() would fail with "
        "'NoneType' object has no attribute 'wait' (k12's hooks call it): return the "
        "original's work handle, untouched"
    )
    waited = got["returned_at"] - got["launched_at"]
    assert got["returned_at"] < joined, (
        f"rank 0: dist.all_reduce(..., async_op=True) inside the block returned only after "
        f"{1000 * waited:.0f} ms, once rank 1 had joined it {LATE} s late: your watch waited "
        "for the work (work.wait()) before returning it, which makes every async_op=True call "
        "blocking. k12's and k13's hooks would then stall backward on each all-reduce, and the "
        "overlap you set out to measure is gone. Return the work at once and record its "
        "completion from the backend's side: work.get_future().add_done_callback(...)"
    )
    assert got["type"] == got["expected_type"], (
        f"rank 0: dist.all_reduce(..., async_op=True) inside the block returned a "
        f"{got['type']}, not torch's own {got['expected_type']}: return the original's result "
        "untouched: record its completion without wrapping it (a callback on "
        "work.get_future().add_done_callback, not a wrapper whose wait() notes the time)"
    )
    assert got["sum"] == 2.0, f"rank 0's async all-reduce left {got['sum']}, expected 2.0"
    comm = _only_comm(0, "an async one", got["comms"])
    assert comm["is_async"] is True, "rank 0: an async_op=True all-reduce recorded is_async=False"
    assert comm["completed"] is not None, (
        "rank 0: after wait() the async all-reduce's Comm still has completed=None: record when "
        "its work finished (work.get_future().add_done_callback(...)), even after the block"
    )
    late_by = joined - comm["completed"]
    assert comm["completed"] >= joined, (
        f"rank 0 launched an async all-reduce; rank 1 joined it {LATE} s later, so it cannot "
        f"have finished before then, yet its Comm says completed {1000 * late_by:.1f} ms before "
        "rank 1 even called all_reduce. An async call returns at once: neither the launch nor "
        "the return is its completion. Record the time when the work itself finishes: "
        "work.get_future().add_done_callback(lambda _: ...)"
    )


@pytest.mark.step(3)
def test_an_async_all_reduce_completes_when_it_finished_not_at_wait(kata):
    for rank, result in enumerate(_watched()):
        got = result["early"]
        assert got["type"] != "NoneType", (
            f"rank {rank}: dist.all_reduce(..., async_op=True) inside the block returned None: "
            "return the original's work handle, the caller waits on it"
        )
        comm = _only_comm(rank, "an async one", got["comms"])
        assert got["seen_then"] is not None and comm["completed"] is not None, (
            f"rank {rank}: work.is_completed() said True, yet the Comm had completed=None until "
            "wait() was called (50 ms later): the work had finished, so its completion time was "
            "known. Take it from the work's own future (work.get_future().add_done_callback), "
            "not from wait(), which returns when someone calls it"
        )
        assert comm["completed"] <= got["polled"], (
            f"rank {rank}: the all-reduce had finished by {got['polled']:.6f} (is_completed() "
            f"said so), but its Comm says completed {comm['completed']:.6f}: completion recorded "
            "at wait() is when someone asked, not when the work finished. Use the work's future "
            "(work.get_future().add_done_callback)"
        )


@pytest.mark.step(3)
def test_dist_all_reduce_is_itself_again_after_the_block(kata):
    for rank, result in enumerate(_watched()):
        assert result["restored"] and result["recorded_after"] == 0, (
            f"rank {rank}: after the `with watch_all_reduces():` block, dist.all_reduce was not "
            "the original again (later all-reduces still recorded): put the original back when "
            "the block ends"
        )
        assert result["restored_after_error"], (
            f"rank {rank}: after an exception inside `with watch_all_reduces():`, dist.all_reduce "
            "stayed replaced: restore it in a finally (try: yield ... finally: ...)"
        )


# --------------------------------------------------------------------------- step 4: record_step

WAYS = ("k04", "k12", "k13")


def _fraction(backward, comms) -> float:
    """The overlap fraction, computed here (not by the kata's function)."""
    busy = sorted(comms)
    merged = []
    for start, end in busy:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    total = sum(e - s for s, e in merged)
    b0, b1 = backward
    return sum(max(0.0, min(e, b1) - max(s, b0)) for s, e in merged) / total


def _grads(model) -> dict:
    return {n: p.grad.detach().cpu().clone() for n, p in model.named_parameters()}


def _one_way(kata, way, rank):
    from dojo.devices import rank_device

    device = rank_device()
    model = make_transformer(seed=7).to(device)
    local = make_transformer(seed=7).to(device)
    batch = tuple(t.to(device) for t in make_tokens(PER_RANK, seed=100 + rank))
    from dojo.toy_models import transformer_loss

    transformer_loss(local(batch[0]), batch[1]).backward()
    moments = {"forward": [], "gradients": []}
    model.register_forward_hook(lambda *_: moments["forward"].append(time.perf_counter()))
    for param in model.parameters():  # registered first: they fire before a wrapper's own
        param.register_post_accumulate_grad_hook(
            lambda _: moments["gradients"].append(time.perf_counter())
        )
    if way == "k04":
        wrapped, synchronize, expected = model, lambda: kata.average_gradients(model), None
    elif way == "k12":
        wrapped = kata.OverlappingDDP(model)
        synchronize = wrapped.finish_gradient_synchronization
    else:
        wrapped = kata.BucketedDDP(model, bucket_cap_mb=SPLIT_MB)
        synchronize = wrapped.finish_gradient_synchronization
    expected = len(wrapped.buckets) if way == "k13" else len(list(model.parameters()))
    synchronized = []

    def counted_synchronize():  # whether it was called at all, whatever the timing shows
        synchronized.append(time.perf_counter())
        return synchronize()

    with recording(("all_reduce",)) as calls:
        record = kata.record_step(wrapped, batch, counted_synchronize)
    return {
        "synchronized": len(synchronized),
        "began": record.began,
        "backward": tuple(record.backward),
        "ended": record.ended,
        "comms": [(c.launched, c.completed) for c in record.communication],
        "called": len(calls),
        "expected": expected,
        "forward": moments["forward"],
        "gradients": moments["gradients"],
        "grads": _grads(model),
        "local": _grads(local),
    }


def _steps(rank, world_size):
    kata = load_kata(KATA)
    return {way: _one_way(kata, way, rank) for way in WAYS}


_stepped = shared_run(lambda: run_world(_steps, 2, deadline=60))


def _timeline(got) -> str:
    events = [(got["began"], "record_step began"), (got["ended"], "record_step ended")]
    events += [(got["backward"][0], "backward began"), (got["backward"][1], "backward returned")]
    events += [(t, "forward returned") for t in got["forward"]]
    if got["gradients"]:
        events += [(max(got["gradients"]), "the last gradient hook ran")]
    for number, (launched, completed) in enumerate(got["comms"][:3]):
        events.append((launched, f"all-reduce {number} launched"))
        if completed is not None:
            events.append((completed, f"all-reduce {number} completed"))
    start = min(t for t, _ in events)
    return "\n".join(f"  {1000 * (t - start):9.3f} ms  {what}" for t, what in sorted(events))


def _check_counts(rank, way, got, what):
    if way.startswith("k04") and not got["called"] and got["expected"]:
        raise AssertionError(
            f"rank {rank}, {way}: no all-reduce was called during record_step, though "
            f"{got['expected']} were expected ({what}): record_step must call synchronize() "
            "after loss.backward() (here k04's average_gradients, which all-reduces every "
            f"gradient). What happened:\n{_timeline(got)}"
        )
    if got["called"] and not got["comms"]:
        raise AssertionError(
            f"rank {rank}, {way}: record_step recorded no all-reduce, yet {got['called']} were "
            "called during the step: the recording began too late. The hooks launch "
            "all-reduces during loss.backward(), so watch from before backward until "
            "synchronize() returns"
        )
    assert len(got["comms"]) == got["called"] == got["expected"], (
        f"rank {rank}, {way}: record_step recorded {len(got['comms'])} all-reduce(s); "
        f"{got['called']} were called during the step and {got['expected']} expected ({what}). "
        "If fewer were recorded than called, the recording began too late: the hooks launch "
        "all-reduces during loss.backward(), so watch from before backward until synchronize() "
        f"returns. What happened:\n{_timeline(got)}"
    )


@pytest.mark.step(4)
def test_k04_average_after_backward_hides_nothing(kata):
    for rank, result in enumerate(_stepped()):
        got = result["k04"]
        _check_counts(rank, "k04's average_gradients", got, "one per parameter")
        inside = [c for c in got["comms"] if c[0] < got["backward"][1]]
        assert not inside, (
            f"rank {rank}, k04: average_gradients runs after loss.backward() has returned, yet "
            f"{len(inside)} of its all-reduces were launched before the recorded backward ended "
            f"({got['backward']}). Take the backward's end when loss.backward() returns, before "
            f"synchronize() runs. What happened:\n{_timeline(got)}"
        )
        fraction = _fraction(got["backward"], got["comms"])
        assert fraction == 0.0, f"rank {rank}, k04: overlap {fraction}, expected exactly 0.0"


@pytest.mark.step(4)
@pytest.mark.parametrize(
    "way, what",
    [("k12", "one per trainable parameter"), ("k13", "one per bucket")],
    ids=["k12", "k13"],
)
def test_hooks_launch_the_first_all_reduce_before_backward_returns(kata, way, what):
    for rank, result in enumerate(_stepped()):
        got = result[way]
        _check_counts(rank, way, got, what)
        assert got["synchronized"], (
            f"rank {rank}, {way}: record_step never called synchronize(): it must call "
            "synchronize() after loss.backward() (it waits for every all-reduce the hooks "
            "launched), and return after it"
        )
        first = min(launched for launched, _ in got["comms"])
        assert first < got["backward"][1], (
            f"rank {rank}, {way}: the first all-reduce was launched after the recorded backward "
            f"had ended, though {way}'s hooks launch it during loss.backward(). Take the "
            "backward's start just before loss.backward() and its end just after it returns. "
            f"What happened:\n{_timeline(got)}"
        )
        assert all(completed is not None for _, completed in got["comms"]), (
            f"rank {rank}, {way}: some all-reduces had not completed when record_step returned: "
            "record_step must call synchronize() after loss.backward() (it waits for every "
            "all-reduce the hooks launched), and return after it. What happened:\n"
            f"{_timeline(got)}"
        )
        fraction = _fraction(got["backward"], got["comms"])
        assert fraction > 0.0, f"rank {rank}, {way}: overlap fraction {fraction}, expected > 0"


@pytest.mark.step(4)
@pytest.mark.parametrize("way", WAYS)
def test_every_all_reduce_lies_inside_the_step(kata, way):
    for rank, result in enumerate(_stepped()):
        got = result[way]
        began, ended = got["began"], got["ended"]
        b0, b1 = got["backward"]
        assert began <= b0 <= b1 <= ended, (
            f"rank {rank}, {way}: the step ran from {began:.6f} to {ended:.6f} but its backward "
            f"from {b0:.6f} to {b1:.6f}: began comes before the forward, ended after "
            f"synchronize(), and backward between them. What happened:\n{_timeline(got)}"
        )
        for launched, completed in got["comms"]:
            assert completed is not None and began <= launched <= completed <= ended, (
                f"rank {rank}, {way}: an all-reduce ran from {launched:.6f} to {completed} "
                f"outside the recorded step ({began:.6f}, {ended:.6f}): ended is when "
                "synchronize() has returned (every all-reduce finished), so take it after "
                f"synchronize(). What happened:\n{_timeline(got)}"
            )


@pytest.mark.step(4)
@pytest.mark.parametrize("way", WAYS)
def test_the_backward_interval_is_the_backward_alone(kata, way):
    for rank, result in enumerate(_stepped()):
        got = result[way]
        b0, b1 = got["backward"]
        assert got["forward"] and b0 >= max(got["forward"]), (
            f"rank {rank}, {way}: the recorded backward began before the forward had returned: "
            "the forward is not backward, and counting it hides communication that nothing "
            "hid. Take the backward's start just before loss.backward(). What happened:\n"
            f"{_timeline(got)}"
        )
        assert got["gradients"] and b1 >= max(got["gradients"]), (
            f"rank {rank}, {way}: a gradient hook ran after the recorded backward had ended: "
            f"take the end after loss.backward() returns. What happened:\n{_timeline(got)}"
        )


@pytest.mark.step(4)
@pytest.mark.parametrize("way", WAYS)
def test_the_step_leaves_averaged_gradients(kata, way):
    results = _stepped()
    for rank, result in enumerate(results):
        grads = result[way]["grads"]
        for name, local in results[0][way]["local"].items():
            # Bitwise: (a + b) / 2 and a / 2 + b / 2 are the same fp32 number on 2 ranks.
            expected = (local + results[1][way]["local"][name]) / 2
            assert torch.equal(grads[name], expected), (
                f"rank {rank}, {way}: after record_step {name}.grad is not the mean over the 2 "
                "ranks: record_step must call synchronize() after backward (it averages the "
                "gradients)"
            )


@pytest.mark.step(4)
def test_record_step_rejects_bad_arguments(kata):
    model = make_transformer(seed=7)
    batch = make_tokens(PER_RANK, seed=0)
    got, error = _call(kata.record_step, model, batch, None)
    assert isinstance(error, ValueError), (
        f"record_step(model, batch, None) {'raised ' + repr(error) if error else 'returned'}: "
        "synchronize must be callable; raise a ValueError saying what to pass "
        "(ddp.finish_gradient_synchronization)"
    )
    got, error = _call(kata.record_step, model, batch[0], lambda: None)
    assert isinstance(error, ValueError), (
        f"record_step(model, tokens, ...) {'raised ' + repr(error) if error else 'returned'}: "
        "batch must be the pair (tokens, targets); raise a ValueError saying so"
    )


@pytest.mark.step(4)
def test_program_prints_the_three_ways(kata):
    done = run_module_ok(KATA, "--world-size", "2", "--steps", "2", "--blocks", "2", "--dim", "32")
    shown = streams(done)
    rows = {}
    for line in done.stdout.splitlines():
        match = re.match(
            r"\[main\]\s+(.+?\(k\d\d\))\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)%", line
        )
        if match:
            rows[match.group(1)] = match.groups()[1:]
    assert set(rows) == {"no overlap (k04)", "per-parameter (k12)", "bucketed (k13)"}, shown
    assert rows["no overlap (k04)"][4] == "0.0", f"k04 must hide nothing\n{shown}"
    assert rows["per-parameter (k12)"][0] == rows["no overlap (k04)"][0], shown
    assert "the three ways end with the same weights: True" in done.stdout, shown
    assert "all-reduces |" in done.stdout and "backward    |" in done.stdout, shown


# --------------------------------------------------------------------------- CUDA


def _on_cuda(rank, world_size):
    rank_gpu()
    kata = load_kata(KATA)
    return {way: _one_way(kata, way, rank) for way in ("k04", "k12")}


def _check_cuda(results):
    for rank, result in enumerate(results):
        for way in ("k04", "k12"):
            got = result[way]
            assert len(got["comms"]) == got["called"] == got["expected"], (
                f"rank {rank}, {way} on CUDA: {len(got['comms'])} recorded, {got['called']} "
                f"called, {got['expected']} expected"
            )
            assert all(c is not None for _, c in got["comms"]), f"rank {rank}, {way}: incomplete"
        assert _fraction(result["k04"]["backward"], result["k04"]["comms"]) == 0.0


@pytest.mark.step(4)
@pytest.mark.cuda
def test_nccl_world_of_one(kata):
    _check_cuda(run_world(_on_cuda, 1, **on_cuda(1, "nccl")))


@pytest.mark.step(4)
@pytest.mark.cuda
def test_gloo_on_cuda_several_ranks(kata):
    _check_cuda(run_world(_on_cuda, 2, **on_cuda(2, "gloo")))
