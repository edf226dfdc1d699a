"""k08 collectives and groups: exact results on every rank, for worlds of 2, 3 and 4.

Each test runs one world per world size and checks one step there: every rank returns what it
got, and the test compares it with what that rank should hold, naming the rank and the call.
Every rank also runs inside a ``_Trace``: dojo.harness.calls.recording() notes each torch.distributed call
(which collective, src/dst, group), filed under the kata call that made it, and the trace lands on
disk as it happens. So the test proves how the data moved ("rank 1 broadcast from src=1 while rank
0 used src=0"), and a world that deadlocks or raises is explained from what each rank had called.
Bad arguments are probed in a world of one rank, where no probe can leave a peer waiting.
"""

import inspect
import os
import re
import time

import pytest
import torch
import torch.distributed as dist

from dojo.harness.calls import CALLS
from dojo.harness.impl import load_kata
from dojo.harness.world import run_world
from dojo.lang import N_, t, tn
from dojo.spec.testing import needs_torch, refusal, run_module_ok
from dojo.spec.traces import RankTrace, run_traced
from dojo.todo import KataTodo

KATA = "k08_collectives"
DEADLINE_S = 10.0  # correct code finishes in well under a second; a deadlock ends here
SIZES = [2, 3, 4]

# ------------------------------------------------------------------------------ the trace (in a rank)


class _Trace(RankTrace):
    """What this rank asked of torch.distributed, filed under the kata call that asked it, written
    to ``<folder>/rank<N>.json`` before every call (so a rank stuck inside one still tells).

    ``label(text, names=..., **peers)`` starts a kata call: ``names`` are the collectives it may
    use, ``peers`` (src=, dst=) what they must be given; ``groups=`` the groups it must create.
    """

    HOOKED = CALLS

    def __init__(self, folder: str):
        super().__init__(folder)
        self.labels: list[dict] = []
        self._depth = 0

    def label(self, text: str, names: tuple[str, ...] = (), **expected) -> None:
        self.labels.append({"text": text, "names": list(names), "at": len(self.calls), **expected})
        self.flush()

    def data(self) -> dict:
        return {
            "calls": [_record(c) for c in self.calls],
            "labels": self.labels,
            "marks": self.marks,
        }

    def hook(self, name: str, original):
        signature = inspect.signature(original)

        def hooked(*args, **kwargs):
            if self._depth == 0 and self.calls:  # the rank's own call, just recorded
                call = self.calls[-1]
                call.group_ranks = _group_ranks(call.group)
                if call.name == "new_group":
                    ranks = signature.bind_partial(*args, **kwargs).arguments.get("ranks")
                    call.ranks = None if ranks is None else sorted(ranks)
                self.flush()
            self._depth += 1
            try:
                return original(*args, **kwargs)
            except BaseException:
                if self._depth == 1 and self.calls and self.calls[-1].end is None:
                    self.calls[-1].raised = True
                raise
            finally:
                self._depth -= 1

        return hooked


def _group_ranks(group):
    if group is None:
        return None
    if isinstance(group, int):
        return "not a member"  # dist.GroupMember.NON_GROUP_MEMBER, what non-members get back
    try:
        return dist.get_process_group_ranks(group)
    except (RuntimeError, ValueError):
        return "unknown"


def _record(call) -> dict:
    return {
        "name": call.name,
        "peers": call.peers,
        "op": call.op,
        "shapes": call.shapes,
        "group": getattr(call, "group_ranks", None),
        "ranks": getattr(call, "ranks", None),
        "done": call.end is not None,
        "raised": getattr(call, "raised", False),
    }


def _listed(value):
    """A returned tensor as a list (None stays None), so ranks send back plain values; a Python
    list of tensors is named as such."""
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
        return f"a Python {type(value).__name__} of {len(value)} tensors"
    return value


def _said_list(value):
    """``_listed``'s note of a Python list of tensors (English, made in a rank, compared here) as
    the learner reads it; any other value as it is."""
    found = (
        re.fullmatch(r"a Python (\w+) of (\d+) tensors", value) if isinstance(value, str) else None
    )
    if found is None:
        return value
    return t("a Python {type_name} of {count} tensors", type_name=found[1], count=found[2])


# ------------------------------------------------------------------------------ the trace (in the test)


EMPTY_TRACE = {"calls": [], "labels": [], "marks": {}}  # a rank that wrote none


def _run(fn, world_size, *args, explain=None):
    """run_world with every rank traced: (results, traces). A failure (a deadlock, a rank that
    raised) is explained from the traces in front of the harness's report."""

    def why(traces, report):
        return [
            (explain and explain(traces, world_size, report)) or _call_problem(traces, world_size)
        ]

    options = {"explain": why, "deadline": DEADLINE_S, "empty": EMPTY_TRACE}
    return run_traced(fn, world_size, *args, **options)


def _calls_in(trace: dict, index: int) -> list[dict] | None:
    """The calls a rank made inside its ``index``-th kata call (None: it never got there)."""
    labels = trace["labels"]
    if index >= len(labels):
        return None
    end = labels[index + 1]["at"] if index + 1 < len(labels) else len(trace["calls"])
    return trace["calls"][labels[index]["at"] : end]


def _said(call: dict) -> str:
    peers = ", ".join(f"{k}={v}" for k, v in call["peers"].items() if k != "tag")
    return f"dist.{call['name']}({peers})"


def _ranks(numbers) -> str:
    numbers = list(numbers)
    return tn("rank {ranks}", "ranks {ranks}", len(numbers), ranks=", ".join(map(str, numbers)))


_INSTEAD = {  # (what was called, what the kata call should use) -> why (translated when said)
    ("all_reduce", "reduce"): N_(
        "all_reduce gives the sum to every rank; dist.reduce gives it to dst only"
    ),
    ("all_reduce", "reduce_scatter"): N_(
        "all_reduce sends every row to every rank, while reduce_scatter gives each rank only the "
        "sum of its own row (a quarter of the traffic on 4 ranks)"
    ),
    ("all_gather", "all_to_all"): N_(
        "all_gather moves every row to every rank (N times the data); all_to_all sends each row only "
        "where it belongs"
    ),
}


def _call_problem(traces: dict[int, dict], world_size: int) -> str | None:
    """The first kata call in which the ranks' collectives went wrong, in words; None if none."""
    count = max(len(traces[r]["labels"]) for r in range(world_size))
    for index in range(count):
        label = next(
            traces[r]["labels"][index]
            for r in range(world_size)
            if _calls_in(traces[r], index) is not None
        )
        calls = {r: _calls_in(traces[r], index) for r in range(world_size)}
        calls = {r: c for r, c in calls.items() if c is not None}
        problem = (
            _group_problem(label, calls) if "groups" in label else _collective_problem(label, calls)
        )
        if problem:
            return problem
    return None


def _collective_problem(label: dict, calls: dict[int, list[dict]]) -> str | None:
    names, text = label["names"], label["text"]
    if not names:
        return None
    wanted = f"dist.{names[0]}"
    for rank, made in calls.items():
        for call in made:
            if call["name"] not in names:
                why = _INSTEAD.get((call["name"], names[0]))
                values = {"text": text, "rank": rank, "name": call["name"], "wanted": wanted}
                if why:
                    return t(
                        "{text} on rank {rank} called dist.{name}: use {wanted} ({why}).",
                        why=t(why),
                        **values,
                    )
                return t("{text} on rank {rank} called dist.{name}: use {wanted}.", **values)
    for key in ("src", "dst"):
        if key not in label:
            continue
        used = {
            rank: call["peers"].get(key)
            for rank, made in calls.items()
            for call in made
            if call["name"] in names
        }
        if len(set(used.values())) > 1:
            (first, first_value), *others = sorted(used.items())
            odd = next((r, v) for r, v in others if v != first_value)
            return t(
                "inside {text}, rank {odd} called {wanted}({key}={odd_value}) while rank {first} "
                "used {key}={first_value}: every rank must pass the same {key}, the {key} it was "
                "given ({key}={given}), not its own rank. A collective whose ranks disagree on its "
                "source or destination waits for ever, or mixes up the data.",
                text=text,
                odd=odd[0],
                wanted=wanted,
                key=key,
                odd_value=odd[1],
                first=first,
                first_value=first_value,
                given=label[key],
            )
        wrong = {rank: value for rank, value in used.items() if value != label[key]}
        if wrong:
            value = next(iter(wrong.values()))
            return t(
                "inside {text}, {ranks} called {wanted}({key}={value}): pass {key} on unchanged, "
                "{wanted}({key}={given}).",
                text=text,
                ranks=_ranks(wrong),
                wanted=wanted,
                key=key,
                value=value,
                given=label[key],
            )
    made = {rank for rank, c in calls.items() if any(call["name"] in names for call in c)}
    missing = [rank for rank, c in calls.items() if rank not in made and not _stuck(c)]
    if made and missing:
        return t(
            "inside {text}, only {made} called {wanted}; {missing} never did: a collective is "
            "called by every rank of the group, even the ones that only send or only receive, or "
            "the ones that did call it wait for ever.",
            text=text,
            made=_ranks(sorted(made)),
            wanted=wanted,
            missing=_ranks(missing),
        )
    return None


def _stuck(calls: list[dict]) -> bool:
    return any(not call["done"] and not call["raised"] for call in calls)


def _group_problem(label: dict, calls: dict[int, list[dict]]) -> str | None:
    text = label["text"]
    created = {
        rank: [tuple(c["ranks"] or []) for c in made if c["name"] == "new_group"]
        for rank, made in calls.items()
    }
    every = sorted({group for seq in created.values() for group in seq})
    for group in every:
        without = [
            rank
            for rank, seq in created.items()
            if group not in seq and all(c["done"] for c in calls[rank])  # it finished without
        ]
        if without:
            with_it = [rank for rank, seq in created.items() if group in seq]
            return t(
                "inside {text}, {without} never called dist.new_group({group}), which {with_it} "
                "called: dist.new_group is a collective of the whole world. Every rank calls it for "
                "every group, members or not, in the same order (a rank outside the group gets a "
                "placeholder back).",
                text=text,
                without=_ranks(without),
                group=list(group),
                with_it=_ranks(with_it),
            )
    for n in range(max(map(len, created.values()), default=0)):
        nth = {rank: seq[n] for rank, seq in created.items() if len(seq) > n}
        if len(set(nth.values())) > 1:
            (first, group), *others = sorted(nth.items())
            other, group_2 = next((r, g) for r, g in others if g != group)
            return t(
                "inside {text}, the ranks' dist.new_group calls do not pair up: call number "
                "{number} was for {group} on rank {first} but for {other_group} on rank {other}. "
                "dist.new_group is a collective of the whole world: every rank calls it for every "
                "group, members or not, in the same order (torch pairs up the n-th new_group call "
                "of each rank).",
                text=text,
                number=n + 1,
                group=list(group),
                first=first,
                other_group=list(group_2),
                other=other,
            )
    for rank, made in calls.items():
        for call in made:
            if call["name"] == "all_reduce" and call["group"] is None:
                return t(
                    "inside {text}, rank {rank} called dist.all_reduce on the whole world (no "
                    "group=): pass group=the group dist.new_group returned, so that only its "
                    "members take part and sum.",
                    text=text,
                    rank=rank,
                )
    return None


# ------------------------------------------------------------------------------ values


def _check(results, call, expected, why):
    """Compare what every rank got from ``call`` with ``expected(rank)``."""
    for rank, got in enumerate(results):
        want = expected(rank)
        if isinstance(got[call], str) and got[call].startswith("a Python"):
            pytest.fail(
                t(
                    "{call}: rank {rank} returned {got}, expected one tensor {want!r}: stack "
                    "the pieces into one tensor (torch.stack(pieces)) before returning.",
                    call=call,
                    rank=rank,
                    got=_said_list(got[call]),
                    want=want,
                ),
                pytrace=False,
            )
        assert got[call] == want, t(
            "{call}: rank {rank} got {got!r}, expected {want!r}: {why}",
            call=call,
            rank=rank,
            got=got[call],
            want=want,
            why=why,
        )


def _check_calls(traces, world_size):
    problem = _call_problem(traces, world_size)
    assert problem is None, problem


def _refusals(function):
    """Bad arguments, in a world of one rank (a probe that reaches a collective cannot hang)."""
    outcomes = run_world(_probe, 1, function, deadline=DEADLINE_S)[0]
    for call, outcome in outcomes.items():
        assert outcome is None, t(
            "{call} {outcome}, expected a ValueError that says what is wrong",
            call=call,
            outcome=outcome,
        )


def _probe(rank, world_size, function):
    kata = load_kata(KATA)
    one = torch.tensor([1, 2])
    if function == "broadcast_and_reduce":
        kata.broadcast_from(one.clone(), 0)  # the functions work ...
        kata.reduce_to(one.clone(), 0)
        return {  # ... and refuse what cannot work
            t("broadcast_from(tensor, src=1) in a world of one"): refusal(
                lambda: kata.broadcast_from(one.clone(), 1)
            ),
            "reduce_to(tensor, dst=-1)": refusal(lambda: kata.reduce_to(one.clone(), -1)),
        }
    if function == "scatter_rows":
        kata.scatter_rows(torch.tensor([[1, 2]]), 0, torch.zeros(2, dtype=torch.int64))
        return {
            t("scatter_rows(table=None) on src"): refusal(
                lambda: kata.scatter_rows(None, 0, torch.zeros(2, dtype=torch.int64))
            ),
            t("scatter_rows(a table with one row too many) on src"): refusal(
                lambda: kata.scatter_rows(
                    torch.tensor([[1, 2], [3, 4]]), 0, torch.zeros(2, dtype=torch.int64)
                )
            ),
            t("gather_rows(row, dst=1) in a world of one"): refusal(
                lambda: kata.gather_rows(one, 1)
            ),
        }
    if function == "reduce_scatter_rows":
        kata.reduce_scatter_rows(torch.tensor([[1, 2]]))
        return {
            t("reduce_scatter_rows(a table with one row too many)"): refusal(
                lambda: kata.reduce_scatter_rows(torch.tensor([[1, 2], [3, 4]]))
            ),
            t("reduce_scatter_rows(a 0-d tensor)"): refusal(
                lambda: kata.reduce_scatter_rows(torch.tensor(5))
            ),
        }
    if function == "all_to_all_rows":
        kata.all_to_all_rows(torch.tensor([[1, 2]]))
        return {
            t("all_to_all_rows(a table with one row too many)"): refusal(
                lambda: kata.all_to_all_rows(torch.zeros(2, 2))
            )
        }
    if function == "group_sum":
        kata.group_sum(one.clone(), [0])
        return {
            f"group_sum(tensor, members={bad})": refusal(
                lambda bad=bad: kata.group_sum(one.clone(), bad)
            )
            for bad in ([], [0, 0], [1], [-1])
        }
    raise AssertionError(
        t(
            "no probe for {function}",
            function=function,
        )
    )


# ------------------------------------------------------------------------------ step 1


def _broadcast_and_reduce(rank, world_size, trace_dir):
    kata, last = load_kata(KATA), world_size - 1

    def mine():
        return torch.tensor([10 * rank + 1, 10 * rank + 2])

    out = {}
    with _Trace(trace_dir) as trace:
        for src in (0, last):
            call = f"broadcast_from(tensor, src={src})"
            trace.label(call, ("broadcast",), src=src)
            out[call] = _listed(kata.broadcast_from(mine(), src))
        for dst in (0, last):
            call = f"reduce_to(tensor, dst={dst})"
            trace.label(call, ("reduce",), dst=dst)
            out[call] = _listed(kata.reduce_to(torch.tensor([rank + 1, 100]), dst))
    return out


@pytest.mark.step(1)
@pytest.mark.parametrize("world_size", SIZES)
def test_broadcast_and_reduce(world_size):
    results, traces = _run(_broadcast_and_reduce, world_size)
    _check_calls(traces, world_size)
    last = world_size - 1
    for src in (0, last):
        _check(
            results,
            f"broadcast_from(tensor, src={src})",
            lambda r: [10 * src + 1, 10 * src + 2],  # noqa: B023
            t(
                "every rank ends up with rank {src}'s tensor, in place: "
                "dist.broadcast(tensor, src={src}) on every rank",
                src=src,
            ),
        )
    total = [world_size * (world_size + 1) // 2, 100 * world_size]
    for dst in (0, last):
        _check(
            results,
            f"reduce_to(tensor, dst={dst})",
            lambda r: total if r == dst else None,  # noqa: B023
            t(
                "rank {dst} returns the sum of every rank's tensor; the other ranks return "
                "None, because after a reduce their tensors hold partial sums that mean "
                "nothing",
                dst=dst,
            ),
        )


@pytest.mark.step(1)
def test_broadcast_and_reduce_refuse_ranks_outside_the_world():
    _refusals("broadcast_and_reduce")


# ------------------------------------------------------------------------------ step 2

_OPS = ("sum", "max", "avg")


def _inputs(rank):
    return {
        "sum": torch.tensor([rank + 1, -rank]),
        "max": torch.tensor([(rank * 7) % 5, -rank]),
        "avg": torch.tensor([2.0 * rank, 6.0]),
    }


def _all_reduce_ops(rank, world_size, trace_dir):
    kata = load_kata(KATA)
    out = {}
    with _Trace(trace_dir) as trace:
        for op, tensor in _inputs(rank).items():
            trace.label(f"all_reduce_with(tensor, {op!r})", ("all_reduce",))
            returned = kata.all_reduce_with(tensor, op)
            out[op] = _listed(returned)
            out[f"{op} in place"] = (returned is tensor, tensor.tolist())
    try:
        kata.all_reduce_with(torch.ones(1), "median")
        out["median"] = t("returned without an error")
    except ValueError as error:
        out["median"] = ("ValueError", str(error))
    except KataTodo:
        raise
    except Exception as error:
        out["median"] = t(
            "raised {error_type}: {error}", error_type=type(error).__name__, error=error
        )
    return out


@pytest.mark.step(2)
@pytest.mark.parametrize("world_size", SIZES)
def test_all_reduce_with_sum_max_avg(world_size):
    results, traces = _run(_all_reduce_ops, world_size)
    _check_calls(traces, world_size)
    ranks = range(world_size)
    for op in _OPS:
        for rank, got in enumerate(results):
            same, tensor = got[f"{op} in place"]
            if not same and tensor == _inputs(rank)[op].tolist():
                pytest.fail(
                    t(
                        "all_reduce_with(tensor, {op!r}) left rank {rank}'s tensor as it was "
                        "and returned another one: reduce the caller's tensor in place "
                        "(dist.all_reduce changes the tensor it is given) and return that "
                        "same tensor.",
                        op=op,
                        rank=rank,
                    ),
                    pytrace=False,
                )
    _check(
        results,
        "sum",
        lambda r: [sum(q + 1 for q in ranks), -sum(ranks)],
        t("every rank holds the sum of every rank's tensor: ReduceOp.SUM"),
    )
    _check(
        results,
        "max",
        lambda r: [max((q * 7) % 5 for q in ranks), 0],
        t("every rank holds the element-wise largest: ReduceOp.MAX"),
    )
    mean = [float(world_size - 1), 6.0]
    for rank, got in enumerate(results):
        if got["avg"] == [2.0 * sum(ranks), 6.0 * world_size]:
            pytest.fail(
                t(
                    "'avg': rank {rank} got {avg}, the sum; expected the mean {mean}: use "
                    "ReduceOp.AVG (or divide the sum by the world size)",
                    rank=rank,
                    avg=got["avg"],
                    mean=mean,
                ),
                pytrace=False,
            )
    _check(
        results, "avg", lambda r: mean, t("every rank holds the element-wise mean: ReduceOp.AVG")
    )
    refused = results[0]["median"]
    assert isinstance(refused, tuple), t(
        "all_reduce_with(tensor, 'median') {refused}: an op it does not know must raise ValueError",
        refused=refused,
    )
    assert all(op in refused[1] for op in _OPS), t(
        "all_reduce_with(tensor, 'median') raised ValueError({said!r}): name the ops "
        "it knows ({names}) so that the caller can fix the call",
        said=refused[1],
        names=", ".join(_OPS),
    )


# ------------------------------------------------------------------------------ step 3


def _table(world_size, base=100):
    """One row per rank: row r is [base + 10 r, base + 10 r + 1, base + 10 r + 2]."""
    return torch.tensor([[base + 10 * r + i for i in range(3)] for r in range(world_size)])


def _scatter_and_gather(rank, world_size, trace_dir):
    kata, last = load_kata(KATA), world_size - 1
    out = {}
    with _Trace(trace_dir) as trace:
        for src in (0, last):
            table = _table(world_size) if rank == src else None  # only src has the table
            call = f"scatter_rows(table, src={src}, out)"
            trace.label(call, ("scatter",), src=src)
            out[call] = _listed(kata.scatter_rows(table, src, torch.zeros(3, dtype=torch.int64)))
        for dst in (0, last):
            call = f"gather_rows(row, dst={dst})"
            trace.label(call, ("gather",), dst=dst)
            out[call] = _listed(kata.gather_rows(torch.tensor([rank, rank * rank]), dst))
    return out


def _explain_scatter_and_gather(traces, world_size, report):
    if "needs one row per rank" in report and "got shape None" in report:
        return t(
            "a rank without the table checked it: only the source rank holds the table, and every "
            "other rank passes table=None. Check the table (_check_table) and split it into rows "
            "on src only."
        )
    for rank, trace in traces.items():
        for index, label in enumerate(trace["labels"]):
            for call in _calls_in(trace, index) or []:
                role = label.get("src", label.get("dst"))
                if (
                    call["name"] in ("scatter", "gather")
                    and rank != role
                    and len(call["shapes"]) > 1
                ):
                    what = "scatter_list" if call["name"] == "scatter" else "gather_list"
                    side = "src" if call["name"] == "scatter" else "dst"
                    return t(
                        "inside {text}, rank {rank} passed a {what} of {count} tensors, but it is "
                        "not {side}: only {side} (rank {role}) gives the list, every other rank "
                        "passes {what}=None.",
                        text=label["text"],
                        rank=rank,
                        what=what,
                        count=len(call["shapes"]) - 1,
                        side=side,
                        role=role,
                    )
    return None


@pytest.mark.step(3)
@pytest.mark.parametrize("world_size", SIZES)
def test_scatter_and_gather(world_size):
    results, traces = _run(_scatter_and_gather, world_size, explain=_explain_scatter_and_gather)
    _check_calls(traces, world_size)
    rows = _table(world_size).tolist()
    for src in (0, world_size - 1):
        _check(
            results,
            f"scatter_rows(table, src={src}, out)",
            lambda r: rows[r],
            t(
                "rank r gets row r of rank {src}'s table in its out: dist.scatter(out, "
                "scatter_list=a list of rows (on src only), src=src)",
                src=src,
            ),
        )
    for dst in (0, world_size - 1):
        _check(
            results,
            f"gather_rows(row, dst={dst})",
            lambda r: [[q, q * q] for q in range(world_size)] if r == dst else None,  # noqa: B023
            t(
                "rank {dst} gets every rank's row, in rank order; the others return None "
                "(gather_list is a list of empty rows on dst, None elsewhere)",
                dst=dst,
            ),
        )


@pytest.mark.step(3)
def test_scatter_rows_refuses_bad_tables():
    _refusals("scatter_rows")


# ------------------------------------------------------------------------------ step 4


def _pieces(rank, world_size):
    """Rank ``rank``'s table for reduce_scatter: row j is [100 rank + j, 1]."""
    return torch.tensor([[100 * rank + j, 1] for j in range(world_size)])


def _gather_and_reduce_scatter(rank, world_size, trace_dir):
    kata = load_kata(KATA)
    out = {}
    with _Trace(trace_dir) as trace:
        gather_names = ("all_gather", "all_gather_into_tensor")
        trace.label("all_gather_rows(row)", gather_names)
        out["all_gather_rows"] = _listed(kata.all_gather_rows(torch.tensor([rank, 10 + rank])))
        trace.label("reduce_scatter_rows(table)", ("reduce_scatter", "reduce_scatter_tensor"))
        summed = kata.reduce_scatter_rows(_pieces(rank, world_size))
        out["reduce_scatter_rows"] = _listed(summed)
        trace.label("all_gather_rows(reduce_scatter_rows(table))", gather_names)
        out["all_gather_rows(reduce_scatter_rows(table))"] = _listed(kata.all_gather_rows(summed))
    return out


def _explain_gather_and_reduce_scatter(traces, world_size, report):
    if "tensor_list" in report:
        return t(
            "dist.all_gather fills a list of tensors, one per rank, that you allocate first "
            "([torch.empty_like(row) for _ in range(world_size)]), not one big tensor: stack the "
            "list afterwards."
        )
    return _reduce_scatter_shapes(traces, world_size)


def _reduce_scatter_columns(results, world_size) -> str | None:
    """rank r got the sum of column r (a table split along dim 1, which fits on two ranks)."""
    columns = sum(_pieces(q, world_size) for q in range(world_size)).T.tolist()
    for rank, got in enumerate(results):
        if rank < len(columns) and got["reduce_scatter_rows"] == columns[rank]:
            return t(
                "reduce_scatter_rows: rank {rank} got {got}, the sum of column {rank} of the "
                "tables, expected the sum of their row {rank}: split the table into its rows "
                "(list(table.unbind(0)), dim 0), not its columns.",
                rank=rank,
                got=got["reduce_scatter_rows"],
            )
    return None


def _reduce_scatter_shapes(traces, world_size) -> str | None:
    row = (2,)
    for rank, trace in traces.items():
        for call in trace["calls"]:
            if call["name"] != "reduce_scatter":
                continue
            output, pieces = tuple(call["shapes"][0]), [tuple(s) for s in call["shapes"][1:]]
            if output != row or pieces != [row] * world_size:
                return t(
                    "rank {rank} gave dist.reduce_scatter {count} pieces of shape {shape} for an "
                    "output of shape {output}; expected {world_size} pieces, one row of the table "
                    "per rank, each of shape {row}: split the table into its rows "
                    "(list(table.unbind(0))) and receive into one row.",
                    rank=rank,
                    count=len(pieces),
                    shape=pieces[0] if pieces else None,
                    output=output,
                    world_size=world_size,
                    row=row,
                )
    return None


@pytest.mark.step(4)
@pytest.mark.parametrize("world_size", SIZES)
def test_all_gather_and_reduce_scatter(world_size):
    results, traces = _run(
        _gather_and_reduce_scatter, world_size, explain=_explain_gather_and_reduce_scatter
    )
    _check_calls(traces, world_size)
    shapes = _reduce_scatter_shapes(traces, world_size) or _reduce_scatter_columns(
        results, world_size
    )
    assert shapes is None, shapes
    ranks = range(world_size)
    _check(
        results,
        "all_gather_rows",
        lambda r: [[q, 10 + q] for q in ranks],
        t("every rank gets every rank's row, in rank order (allocate a list of empty rows first)"),
    )
    _check(
        results,
        "reduce_scatter_rows",
        lambda r: [100 * sum(ranks) + world_size * r, world_size],
        t("rank r gets the sum over all ranks of their row r"),
    )
    everything = sum(_pieces(q, world_size) for q in ranks).tolist()
    _check(
        results,
        "all_gather_rows(reduce_scatter_rows(table))",
        lambda r: everything,
        t(
            "reduce_scatter then all_gather is an all-reduce: every rank ends with the sum "
            "of all tables"
        ),
    )


@pytest.mark.step(4)
def test_reduce_scatter_rows_refuses_bad_tables():
    _refusals("reduce_scatter_rows")


# ------------------------------------------------------------------------------ step 5


def _all_to_all(rank, world_size, trace_dir):
    kata = load_kata(KATA)
    table = torch.tensor([[10 * rank + j, rank] for j in range(world_size)])
    before = table.tolist()
    with _Trace(trace_dir) as trace:
        trace.label("all_to_all_rows(table)", ("all_to_all", "all_to_all_single"))
        got = _listed(kata.all_to_all_rows(table))
    return {"all_to_all_rows": got, "table": table.tolist(), "before": before}


@pytest.mark.step(5)
@needs_torch("gloo all_to_all")
@pytest.mark.parametrize("world_size", SIZES)
def test_all_to_all(world_size):
    results, traces = _run(_all_to_all, world_size)
    _check_calls(traces, world_size)
    for rank, got in enumerate(results):
        if got["table"] != got["before"]:
            pytest.fail(
                t(
                    "rank {rank}'s table changed from {before} to {table}: "
                    "dist.all_to_all(output_list, input_list) writes into its first "
                    "argument, so the list of empty rows to receive into comes first, the "
                    "table's rows second.",
                    rank=rank,
                    before=got["before"],
                    table=got["table"],
                ),
                pytrace=False,
            )
        if got["all_to_all_rows"] == got["before"] and world_size > 1:
            pytest.fail(
                t(
                    "rank {rank} returned its own table unchanged, {before}: return what "
                    "arrived (the output list of dist.all_to_all, stacked), not the rows you "
                    "sent.",
                    rank=rank,
                    before=got["before"],
                ),
                pytrace=False,
            )
    _check(
        results,
        "all_to_all_rows",
        lambda r: [[10 * i + r, i] for i in range(world_size)],
        t(
            "row j of rank i becomes row i of rank j (a transpose): rank r collects row r of "
            "every rank, in rank order"
        ),
    )


@pytest.mark.step(5)
@needs_torch("gloo all_to_all")
def test_all_to_all_rows_refuses_bad_tables():
    _refusals("all_to_all_rows")


# ------------------------------------------------------------------------------ step 6

_LATE_S = 0.3  # rank 0 arrives this late, so a rank that does not wait finds no file
_WAIT_FOR_PEERS_S = 5.0


def _prepare_once(rank, world_size, path, trace_dir):
    calls = []
    arrived = [f"{path}.rank{r}-arrived" for r in range(1, world_size)]
    with _Trace(trace_dir) as trace:

        def prepare():
            calls.append(rank)
            trace.mark("prepared")
            return (
                "prepared by rank 0"
                if rank == 0
                else f"prepared by rank {rank}, which should not prepare"
            )

        if rank == 0:  # late for certain: only after every other rank has arrived, and then some
            give_up = time.monotonic() + _WAIT_FOR_PEERS_S
            while not all(map(os.path.exists, arrived)) and time.monotonic() < give_up:
                time.sleep(0.01)
            time.sleep(_LATE_S)
        else:
            open(arrived[rank - 1], "w").close()
        trace.label("prepare_once(path, prepare)", ("barrier", "monitored_barrier"))
        try:
            text = load_kata(KATA).prepare_once(path, prepare)
        except FileNotFoundError:
            text = FileNotFoundError
    barriers = [c.start for c in trace.calls if c.name in ("barrier", "monitored_barrier")]
    return {
        "text": text,
        "prepared": bool(calls),
        "prepared_before_barrier": bool(barriers)
        and trace.marks.get("prepared", 1e300) < barriers[0],
    }


@pytest.mark.step(6)
@pytest.mark.parametrize("world_size", SIZES)
def test_prepare_once_waits_at_a_barrier(world_size, tmp_path):
    path = str(tmp_path / "prepared.txt")
    results, traces = _run(_prepare_once, world_size, path)
    for rank, got in enumerate(results):
        assert got["prepared"] == (rank == 0), t(
            "rank {rank} {value} prepare(): only rank 0 prepares (think of a download: "
            "once is enough), the others wait for its file",
            rank=rank,
            value=t("called") if got["prepared"] else t("did not call"),
        )
    _check_calls(traces, world_size)
    waited = [r for r in range(world_size) if _calls_in(traces[r], 0)]
    assert waited == list(range(world_size)), t(
        "{ranks} never called dist.barrier() in prepare_once: without it, a rank reads "
        "the file whether or not rank 0 has written it. Call dist.barrier() on every "
        "rank between rank 0's write and the reads.",
        ranks=_ranks(sorted(set(range(world_size)) - set(waited))),
    )
    assert results[0]["prepared_before_barrier"], t(
        "rank 0 reached the barrier before it had prepared and written the file, so the "
        "barrier tells the others nothing: rank 0 writes first, then every rank calls "
        "dist.barrier(), then every rank reads."
    )
    for rank, got in enumerate(results):
        assert got["text"] is not FileNotFoundError, t(
            "rank {rank} looked for the file before rank 0 (which arrived {LATE_S:g} s "
            "late) had written it: call dist.barrier() on every rank between rank 0's "
            "write and the reads",
            rank=rank,
            LATE_S=_LATE_S,
        )
        assert got["text"] == "prepared by rank 0", t(
            "rank {rank} returned {text!r}, expected the text rank 0 prepared, 'prepared "
            "by rank 0'",
            rank=rank,
            text=got["text"],
        )
    assert os.path.exists(path), t("nothing was written to the path")


# ------------------------------------------------------------------------------ step 7

_MEMBER_SETS = {2: ([1], [0, 1]), 3: ([0, 2], [1, 2]), 4: ([0, 2], [1, 2, 3])}


def _groups(rank, world_size, trace_dir):
    kata = load_kata(KATA)
    out = {}
    with _Trace(trace_dir) as trace:
        for members in _MEMBER_SETS[world_size]:
            call = f"group_sum(tensor, members={members})"
            trace.label(call, groups=[members])
            out[call] = _listed(kata.group_sum(torch.tensor([rank + 1, 1]), members))
        parities = [list(range(p, world_size, 2)) for p in (0, 1)]
        trace.label("parity_sums(tensor)", groups=parities)
        out["parity_sums"] = _listed(kata.parity_sums(torch.tensor([rank + 1, 1])))
    return out


@pytest.mark.step(7)
@pytest.mark.parametrize("world_size", SIZES)
def test_subgroups_touch_only_their_members(world_size):
    results, traces = _run(_groups, world_size)
    _check_calls(traces, world_size)
    for members in _MEMBER_SETS[world_size]:
        inside = [sum(m + 1 for m in members), len(members)]
        _check(
            results,
            f"group_sum(tensor, members={members})",
            lambda r: inside if r in members else [r + 1, 1],  # noqa: B023
            t(
                "the members {members} hold their sum; every other rank keeps its own tensor "
                "untouched",
                members=members,
            ),
        )
    _check(
        results,
        "parity_sums",
        lambda r: [
            sum(q + 1 for q in range(r % 2, world_size, 2)),
            len(range(r % 2, world_size, 2)),
        ],
        t(
            "each rank holds the sum over the ranks of its own parity (evens with evens, "
            "odds with odds)"
        ),
    )


@pytest.mark.step(7)
def test_group_sum_refuses_bad_members():
    _refusals("group_sum")


# ------------------------------------------------------------------------------ the program


@pytest.mark.step(7)
@needs_torch("gloo all_to_all")
def test_program_shows_every_collective():
    out = run_module_ok(KATA, "--world-size", "4", timeout=120).stdout
    for lines in (
        ["[rank 0] --- reduce (sum) to rank 0", "[rank 0] 0 -> 6", "[rank 1] 1 -> None"],
        ["[rank 0] --- all_reduce avg", "[rank 0] 0.0 -> 1.5", "[rank 1] 1.0 -> 1.5"],
        ["[rank 0] --- all_to_all", "[rank 0] [0, 1, 2, 3] -> [0, 10, 20, 30]"],
        ["[rank 0] --- all_reduce in the group [0, 2]", "[rank 0] 0 -> 2", "[rank 1] 1 -> 1"],
        ["[main] 4 ranks ran every collective in the same order"],
    ):
        block = "\n".join(lines)
        assert block in out, t(
            "the program's output lacks these lines, in this order:\n{block}\n\nit printed:\n{out}",
            block=block,
            out=out,
        )
