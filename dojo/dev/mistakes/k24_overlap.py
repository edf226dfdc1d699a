"""k24's mistakes catalogue: real mistakes in measuring overlap (merge_intervals,
overlap_fraction, watch_all_reduces, record_step), and right answers written another way.
See ``dojo/dev/mistakes/__init__.py`` for what each list promises.
"""

from __future__ import annotations

import contextlib
import time

import torch.distributed as dist

from dojo.dev.mistakes import Mistake, RightAnswer
from solutions import k24_overlap as reference

Comm = reference.Comm
StepRecord = reference.StepRecord
merge = reference.merge_intervals


# --------------------------------------------------------------------------- merge_intervals


def _checked(intervals):
    pairs = [(start, end) for start, end in intervals]
    for start, end in pairs:
        if end < start:
            raise ValueError(f"the interval ({start}, {end}) ends before it starts")
    return pairs


def assumes_sorted(intervals):
    # "the recorder appends them in time order": launch order, yes; but not in every caller
    merged = []
    for start, end in _checked(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def later_end_wins(intervals):
    merged = []
    for start, end in sorted(_checked(intervals)):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], end)  # a nested interval shrinks the one holding it
        else:
            merged.append((start, end))
    return merged


def touching_kept_apart(intervals):
    merged = []
    for start, end in sorted(_checked(intervals)):
        if merged and start < merged[-1][1]:  # < where <= belongs
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def index_not_moved_on(intervals):
    pairs, merged, i = sorted(_checked(intervals)), [], 0
    while i < len(pairs):
        start, end = pairs[i]
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
            continue  # merged, "so nothing else to do": i never moves on
        merged.append((start, end))
        i += 1
    return merged


def no_check(intervals):
    merged = []
    for start, end in sorted((s, e) for s, e in intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def sorts_in_place(intervals):
    intervals.sort()  # the caller's list, reordered
    merged = []
    for start, end in _checked(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


# Right answer: a stack of [start, end] lists, sorted by start with a key.


def merge_with_a_stack(intervals):
    stack = []
    for start, end in sorted(_checked(intervals), key=lambda pair: pair[0]):
        if stack and start <= stack[-1][1]:
            stack[-1][1] = max(stack[-1][1], end)
        else:
            stack.append([start, end])
    return [tuple(pair) for pair in stack]


# --------------------------------------------------------------------------- overlap_fraction


def _pairs_hidden(busy, computing, clip):
    return sum(clip(s, e, b, f) for s, e in busy for b, f in computing)


def _both_ends(s, e, b, f):
    return max(0.0, min(e, f) - max(s, b))


def _fraction(backward, communication, *, merge_comms=True, merge_backward=True, clip=_both_ends):
    busy = merge(communication) if merge_comms else _checked(communication)
    total = sum(e - s for s, e in busy)
    if not total > 0:
        raise ValueError("no communication time to measure")
    computing = merge(backward) if merge_backward else _checked(backward)
    return _pairs_hidden(busy, computing, clip) / total


def union_not_taken(backward, communication):
    return _fraction(backward, communication, merge_comms=False)


def backward_not_merged(backward, communication):
    return _fraction(backward, communication, merge_backward=False)


def over_backward_time(backward, communication):
    busy, computing = merge(communication), merge(backward)
    if not sum(e - s for s, e in busy) > 0:
        raise ValueError("no communication time to measure")
    spent = sum(f - b for b, f in computing)
    hidden = _pairs_hidden(busy, computing, _both_ends)
    return hidden / spent if spent else 0.0  # "the share of backward that communicated"


def negative_when_apart(backward, communication):
    return _fraction(backward, communication, clip=lambda s, e, b, f: min(e, f) - max(s, b))


def clipped_at_the_end_only(backward, communication):
    # "communication starts inside backward anyway": only the end is clipped
    return _fraction(backward, communication, clip=lambda s, e, b, f: max(0.0, min(e, f) - s))


def divides_by_zero(backward, communication):
    busy, computing = merge(communication), merge(backward)
    total = sum(e - s for s, e in busy)
    return _pairs_hidden(busy, computing, _both_ends) / total


def nothing_gives_zero(backward, communication):
    busy, computing = merge(communication), merge(backward)
    total = sum(e - s for s, e in busy)
    if not total:
        return 0.0
    return _pairs_hidden(busy, computing, _both_ends) / total


# Right answer: a sweep over the start and end events, counting what runs at each moment.


def overlap_by_sweeping(backward, communication):
    events = []
    for start, end in _checked(communication):
        events += [(start, 0, 1), (end, 0, -1)]
    for start, end in _checked(backward):
        events += [(start, 1, 1), (end, 1, -1)]
    running = [0, 0]  # communication, backward
    total = hidden = 0.0
    last = None
    for moment, kind, change in sorted(events):
        if last is not None and running[0] > 0:
            total += moment - last
            if running[1] > 0:
                hidden += moment - last
        running[kind] += change
        last = moment
    if not total > 0:
        raise ValueError("no communication time to measure: nothing to hide")
    return hidden / total


# --------------------------------------------------------------------------- watch_all_reduces


def _watcher(make):
    """A watch_all_reduces whose replacement for dist.all_reduce is ``make(original, comms)``."""

    @contextlib.contextmanager
    def watch():
        comms = []
        original = dist.all_reduce
        dist.all_reduce = make(original, comms)
        try:
            yield comms
        finally:
            dist.all_reduce = original

    return watch


def _launch_only(original, comms):
    def all_reduce(tensor, *args, **kwargs):
        now = time.perf_counter()
        work = original(tensor, *args, **kwargs)
        comms.append(Comm(now, tensor.numel() * tensor.element_size(), work is not None, now))
        return work

    return all_reduce


launch_only = _watcher(_launch_only)


def _at_return(original, comms):
    def all_reduce(tensor, *args, **kwargs):
        comm = Comm(time.perf_counter(), tensor.numel() * tensor.element_size(), False)
        comms.append(comm)
        work = original(tensor, *args, **kwargs)
        comm.is_async = work is not None
        comm.completed = time.perf_counter()  # an async call returns at once
        return work

    return all_reduce


completed_at_return = _watcher(_at_return)


class _Timed:
    """The work, wrapped so that wait() notes the time."""

    def __init__(self, work, comm):
        self._work, self._comm = work, comm

    def wait(self, *args, **kwargs):
        result = self._work.wait(*args, **kwargs)
        if self._comm.completed is None:
            self._comm.completed = time.perf_counter()
        return result

    def __getattr__(self, name):
        return getattr(self._work, name)


def _at_wait(original, comms):
    def all_reduce(tensor, *args, **kwargs):
        comm = Comm(time.perf_counter(), tensor.numel() * tensor.element_size(), False)
        comms.append(comm)
        work = original(tensor, *args, **kwargs)
        if work is None:
            comm.completed = time.perf_counter()
            return None
        comm.is_async = True
        return _Timed(work, comm)

    return all_reduce


completed_at_wait = _watcher(_at_wait)


def _waits_itself(original, comms):
    def all_reduce(tensor, *args, **kwargs):
        comm = Comm(time.perf_counter(), tensor.numel() * tensor.element_size(), False)
        comms.append(comm)
        work = original(tensor, *args, **kwargs)
        if work is not None:
            comm.is_async = True
            work.wait()  # "then I know when it finished": every async call becomes blocking
        comm.completed = time.perf_counter()
        return work

    return all_reduce


waits_for_the_work = _watcher(_waits_itself)


def _loses_the_work(original, comms):
    def all_reduce(tensor, *args, **kwargs):
        comm = Comm(time.perf_counter(), tensor.numel() * tensor.element_size(), False)
        comms.append(comm)
        work = original(tensor, *args, **kwargs)
        if work is None:
            comm.completed = time.perf_counter()
        else:
            comm.is_async = True
            work.get_future().add_done_callback(
                lambda _: setattr(comm, "completed", time.perf_counter())
            )
        # no return: the caller's work.wait() meets None

    return all_reduce


loses_the_work = _watcher(_loses_the_work)


def _future_only(original, comms):
    def all_reduce(tensor, *args, **kwargs):
        comm = Comm(time.perf_counter(), tensor.numel() * tensor.element_size(), False)
        comms.append(comm)
        work = original(tensor, *args, **kwargs)
        if work is not None:
            comm.is_async = True
            work.get_future().add_done_callback(
                lambda _: setattr(comm, "completed", time.perf_counter())
            )
        return work  # a blocking call: never completed

    return all_reduce


blocking_never_completed = _watcher(_future_only)


def _drops_the_op(original, comms):
    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        comm = Comm(time.perf_counter(), tensor.numel() * tensor.element_size(), async_op)
        comms.append(comm)
        work = original(tensor, group=group, async_op=async_op)  # op forgotten: always SUM
        if work is None:
            comm.completed = time.perf_counter()
        else:
            work.get_future().add_done_callback(
                lambda _: setattr(comm, "completed", time.perf_counter())
            )
        return work

    return all_reduce


drops_the_op = _watcher(_drops_the_op)


def _wall_clock(original, comms):
    def all_reduce(tensor, *args, **kwargs):
        comm = Comm(time.time(), tensor.numel() * tensor.element_size(), False)
        comms.append(comm)
        work = original(tensor, *args, **kwargs)
        if work is None:
            comm.completed = time.time()
        else:
            comm.is_async = True
            work.get_future().add_done_callback(lambda _: setattr(comm, "completed", time.time()))
        return work

    return all_reduce


wall_clock = _watcher(_wall_clock)


@contextlib.contextmanager
def not_restored_after_error():
    comms = []
    original = dist.all_reduce

    def all_reduce(tensor, *args, **kwargs):
        comm = Comm(time.perf_counter(), tensor.numel() * tensor.element_size(), False)
        comms.append(comm)
        work = original(tensor, *args, **kwargs)
        if work is None:
            comm.completed = time.perf_counter()
        else:
            comm.is_async = True
            work.get_future().add_done_callback(
                lambda _: setattr(comm, "completed", time.perf_counter())
            )
        return work

    dist.all_reduce = all_reduce
    yield comms  # no finally: an exception in the block leaves it replaced
    dist.all_reduce = original


# Right answer: the future's then() instead of add_done_callback, async_op read from the call.


@contextlib.contextmanager
def watch_with_then():
    comms = []
    original = dist.all_reduce

    def all_reduce(tensor, *args, **kwargs):
        is_async = bool(kwargs.get("async_op", args[2] if len(args) > 2 else False))
        comm = Comm(time.perf_counter(), tensor.nelement() * tensor.element_size(), is_async)
        comms.append(comm)
        work = original(tensor, *args, **kwargs)
        if is_async:

            def done(future):
                comm.completed = time.perf_counter()
                return future.value()

            work.get_future().then(done)
        else:
            comm.completed = time.perf_counter()
        return work

    try:
        dist.all_reduce = all_reduce
        yield comms
    finally:
        dist.all_reduce = original


# --------------------------------------------------------------------------- record_step


def _step(model, batch, synchronize, order):
    tokens, targets = batch
    if not callable(synchronize) or len(batch) != 2:
        raise ValueError("synchronize must be callable and batch a pair (tokens, targets)")
    return order(model, tokens, targets, synchronize)


def backward_end_after_synchronize(model, batch, synchronize):
    def order(model, tokens, targets, synchronize):
        began = time.perf_counter()
        loss = reference.transformer_loss(model(tokens), targets)
        with reference.watch_all_reduces() as comms:
            b0 = time.perf_counter()
            loss.backward()
            synchronize()  # "backward is over once its gradients are averaged"
            b1 = time.perf_counter()
        return StepRecord(began, (b0, b1), comms, time.perf_counter())

    return _step(model, batch, synchronize, order)


def watches_only_synchronize(model, batch, synchronize):
    def order(model, tokens, targets, synchronize):
        began = time.perf_counter()
        loss = reference.transformer_loss(model(tokens), targets)
        b0 = time.perf_counter()
        loss.backward()
        b1 = time.perf_counter()
        with reference.watch_all_reduces() as comms:  # "communication happens in synchronize"
            synchronize()
        return StepRecord(began, (b0, b1), comms, time.perf_counter())

    return _step(model, batch, synchronize, order)


def ended_before_synchronize(model, batch, synchronize):
    def order(model, tokens, targets, synchronize):
        began = time.perf_counter()
        loss = reference.transformer_loss(model(tokens), targets)
        with reference.watch_all_reduces() as comms:
            b0 = time.perf_counter()
            loss.backward()
            b1 = ended = time.perf_counter()  # the step "is" forward and backward
            synchronize()
        return StepRecord(began, (b0, b1), comms, ended)

    return _step(model, batch, synchronize, order)


def backward_includes_forward(model, batch, synchronize):
    def order(model, tokens, targets, synchronize):
        with reference.watch_all_reduces() as comms:
            began = time.perf_counter()
            loss = reference.transformer_loss(model(tokens), targets)
            loss.backward()
            b1 = time.perf_counter()
            synchronize()
        return StepRecord(began, (began, b1), comms, time.perf_counter())

    return _step(model, batch, synchronize, order)


def forgets_synchronize(model, batch, synchronize):
    def order(model, tokens, targets, synchronize):
        began = time.perf_counter()
        loss = reference.transformer_loss(model(tokens), targets)
        with reference.watch_all_reduces() as comms:
            b0 = time.perf_counter()
            loss.backward()
            b1 = time.perf_counter()
        return StepRecord(began, (b0, b1), comms, time.perf_counter())

    return _step(model, batch, synchronize, order)


def no_argument_checks(model, batch, synchronize):
    tokens, targets = batch
    began = time.perf_counter()
    loss = reference.transformer_loss(model(tokens), targets)
    with reference.watch_all_reduces() as comms:
        b0 = time.perf_counter()
        loss.backward()
        b1 = time.perf_counter()
        synchronize()
        ended = time.perf_counter()
    return StepRecord(began, (b0, b1), comms, ended)


MISTAKES = [
    Mistake(
        "assumes_sorted",
        replaces="merge_intervals",
        fails=[
            "test_merge_intervals_hand_made[unsorted-disjoint]",
            "test_merge_intervals_hand_made[unsorted-overlapping]",
        ],
        says=["come in any order", "sort them by start first"],
    ),
    Mistake(
        "later_end_wins",
        replaces="merge_intervals",
        fails=["test_merge_intervals_hand_made[nested]"],
        says=["nested inside another", "the larger of the two ends (max)"],
    ),
    Mistake(
        "touching_kept_apart",
        replaces="merge_intervals",
        fails=["test_merge_intervals_hand_made[touching]", "test_merge_intervals_against_a_grid"],
        says=["touch"],
    ),
    Mistake(
        "index_not_moved_on",
        replaces="merge_intervals",
        fails=["test_merge_intervals_hand_made[unsorted-overlapping]"],
        says=["did not return within", "an index that moves on"],
    ),
    Mistake(
        "no_check",
        replaces="merge_intervals",
        fails=["test_merge_intervals_rejects_an_interval_that_ends_before_it_starts"],
        says=["ends before it starts", "Raise a ValueError that names it"],
    ),
    Mistake(
        "sorts_in_place",
        replaces="merge_intervals",
        fails=["test_merge_intervals_leaves_its_input_and_takes_any_iterable"],
        says=["changed the list it was given", "never the caller's list"],
    ),
    Mistake(
        "union_not_taken",
        replaces="overlap_fraction",
        fails=[
            "test_overlap_fraction_hand_made[several-overlapping-comms]",
            "test_overlap_fraction_hand_made[the-same-all-reduce-twice]",
        ],
        says=["counted twice", "Merge the communication intervals (merge_intervals)"],
    ),
    Mistake(
        "backward_not_merged",
        replaces="overlap_fraction",
        fails=["test_overlap_fraction_hand_made[backward-overlapping-pieces]"],
        says=["counted twice", "merge the backward intervals too"],
    ),
    Mistake(
        "over_backward_time",
        replaces="overlap_fraction",
        fails=[
            "test_overlap_fraction_hand_made[full]",
            "test_overlap_fraction_hand_made[partial]",
        ],
        says=["over the backward's time", "Divide the hidden time by the communication's time"],
    ),
    Mistake(
        "negative_when_apart",
        replaces="overlap_fraction",
        fails=[
            "test_overlap_fraction_hand_made[after-backward]",
            "test_overlap_fraction_hand_made[before-backward]",
        ],
        says=["returned -", "never negative"],
    ),
    Mistake(
        "clipped_at_the_end_only",
        replaces="overlap_fraction",
        fails=[
            "test_overlap_fraction_hand_made[before-backward]",
            "test_overlap_fraction_hand_made[starts-before-backward]",
        ],
        says=["clipping the communication at backward's end only", "at both ends of backward"],
    ),
    Mistake(
        "divides_by_zero",
        replaces="overlap_fraction",
        fails=["test_overlap_fraction_with_nothing_to_measure_is_a_value_error"],
        says=["ZeroDivisionError", "raise a ValueError"],
    ),
    Mistake(
        "nothing_gives_zero",
        replaces="overlap_fraction",
        fails=["test_overlap_fraction_with_nothing_to_measure_is_a_value_error"],
        says=["returned 0.0", "a fraction of nothing means nothing"],
    ),
    Mistake(
        "launch_only",
        replaces="watch_all_reduces",
        fails=["test_an_async_all_reduce_completes_only_once_its_late_peer_arrived"],
        says=["before rank 1 even called all_reduce", "neither the launch nor the return"],
    ),
    Mistake(
        "completed_at_return",
        replaces="watch_all_reduces",
        fails=["test_an_async_all_reduce_completes_only_once_its_late_peer_arrived"],
        says=["before rank 1 even called all_reduce", "An async call returns at once"],
    ),
    Mistake(
        "completed_at_wait",
        replaces="watch_all_reduces",
        fails=[
            "test_an_async_all_reduce_completes_when_it_finished_not_at_wait",
            "test_an_async_all_reduce_completes_only_once_its_late_peer_arrived",
        ],
        says=["wait()", "work.get_future().add_done_callback"],
    ),
    Mistake(
        "waits_for_the_work",
        replaces="watch_all_reduces",
        fails=["test_an_async_all_reduce_completes_only_once_its_late_peer_arrived"],
        says=["your watch waited for the work", "makes every async_op=True call blocking"],
    ),
    Mistake(
        "loses_the_work",
        replaces="watch_all_reduces",
        fails=[
            "test_an_async_all_reduce_completes_only_once_its_late_peer_arrived",
            "test_an_async_all_reduce_completes_when_it_finished_not_at_wait",
        ],
        says=["returned None", "return the original's work handle"],
    ),
    Mistake(
        "blocking_never_completed",
        replaces="watch_all_reduces",
        fails=["test_a_blocking_all_reduce_runs_from_its_call_to_its_return"],
        says=["completed=None", "a blocking call has finished when it returns"],
    ),
    Mistake(
        "drops_the_op",
        replaces="watch_all_reduces",
        fails=["test_a_blocking_all_reduce_runs_from_its_call_to_its_return"],
        says=["ReduceOp.MAX", "pass every argument on"],
    ),
    Mistake(
        "wall_clock",
        replaces="watch_all_reduces",
        fails=["test_a_blocking_all_reduce_runs_from_its_call_to_its_return"],
        says=["take both from time.perf_counter()"],
    ),
    Mistake(
        "not_restored_after_error",
        replaces="watch_all_reduces",
        fails=["test_dist_all_reduce_is_itself_again_after_the_block"],
        says=["after an exception", "restore it in a finally"],
    ),
    Mistake(
        "backward_end_after_synchronize",
        replaces="record_step",
        fails=["test_k04_average_after_backward_hides_nothing"],
        says=["launched before the recorded backward ended", "before synchronize() runs"],
    ),
    Mistake(
        "watches_only_synchronize",
        replaces="record_step",
        fails=["test_hooks_launch_the_first_all_reduce_before_backward_returns"],
        says=["the recording began too late", "watch from before backward"],
    ),
    Mistake(
        "ended_before_synchronize",
        replaces="record_step",
        fails=["test_every_all_reduce_lies_inside_the_step[k04]"],
        says=["outside the recorded step", "take it after synchronize()"],
    ),
    Mistake(
        "backward_includes_forward",
        replaces="record_step",
        fails=["test_the_backward_interval_is_the_backward_alone"],
        says=["began before the forward had returned", "the forward is not backward"],
    ),
    Mistake(
        "forgets_synchronize",
        replaces="record_step",
        fails=[
            "test_k04_average_after_backward_hides_nothing",
            "test_hooks_launch_the_first_all_reduce_before_backward_returns",
            "test_the_step_leaves_averaged_gradients",
        ],
        says=["must call synchronize()"],
    ),
    Mistake(
        "no_argument_checks",
        replaces="record_step",
        fails=["test_record_step_rejects_bad_arguments"],
        says=["synchronize must be callable", "raise a ValueError"],
    ),
]

RIGHT_ANSWERS = [
    RightAnswer("merge_with_a_stack", replaces="merge_intervals"),
    RightAnswer("overlap_by_sweeping", replaces="overlap_fraction"),
    RightAnswer("watch_with_then", replaces="watch_all_reduces"),
]
