"""A timeline of every rank: each torch.distributed call recorded, then drawn.

    DOJO_TRACE_DIR=/tmp/t python -m katas.k09_ring_allreduce     # or: --trace /tmp/t, dojo trace k09

While ``DOJO_TRACE_DIR`` is set, ``run_world`` runs each rank's function under ``Recorder`` (a
``dojo.harness.calls`` observer): every collective and point-to-point call (operation, peer or group,
bytes, start and end on ``time.monotonic``, an async call's completion when its work's ``wait()``
returns) is appended, one JSON line per change, to ``DIR/.worlds/WORLD/rankN.jsonl``, so a world
that hangs or crashes still leaves its calls so far. ``write_pending(DIR)`` then turns each world
into ``DIR/NAME.json`` (Chrome's Trace Event Format: one track per rank, flow arrows from each send
to its recv; open it in https://ui.perfetto.dev or chrome://tracing) and ``DIR/NAME.png`` (one lane
per rank, one bar per call coloured by operation, arrows from sends to their recvs, gaps = idle).

A kata names a part of its program (a phase, a pipeline's F, B and W) with torch's own span,
which needs no import from ``dojo`` and shows in ``torch.profiler``'s traces too::

    with torch.profiler.record_function("reduce-scatter"):
        owned = ring_reduce_scatter(tensor)

While tracing, every such span opened outside torch (torch's own, ``Optimizer.step#SGD.step``,
are left out) is written to ``rankN.spans.jsonl`` (``read_spans``) and drawn as a labelled strip
above the rank's calls, and as a "parts" track in the JSON; untraced it is torch's alone.

The recorder also catches mismatched collectives early: each rank's k-th collective on a group
is published in the world's store as its operation, shapes, dtypes and source; a rank that finds
a peer's k-th differs raises ``CollectiveMismatch`` at once, naming both calls, instead of waiting
for the deadline. Point-to-point calls are not compared; a correct run is never stopped, and no
call's arguments or results are touched.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import sys
from collections import defaultdict
from typing import Any

from dojo.harness.calls import Call, Observer, clock, recording
from dojo.harness.stacks import Frame

ENV_VAR = "DOJO_TRACE_DIR"
_WORLDS = ".worlds"
# A rank deletes its own published collective this many calls later: a peer so far behind only
# misses the comparison (never a false alarm), and the store stays small in long runs.
_STORE_WINDOW = 512
_STRICT = (  # collectives whose tensors must have the same shape and dtype on every rank
    "all_reduce", "broadcast", "reduce", "all_gather_into_tensor", "reduce_scatter_tensor",
    "all_gather_single", "reduce_scatter_single", "barrier", "monitored_barrier",
)  # fmt: skip


class CollectiveMismatch(RuntimeError):
    """The ranks of a group called different collectives at the same point: they would hang."""


def directory() -> str | None:
    """Where traces go, when tracing is on (``DOJO_TRACE_DIR``)."""
    return os.environ.get(ENV_VAR) or None


# --------------------------------------------------------------------------- in the parent


class TracedRank:
    """``fn`` run under the recorder: what ``run_world`` starts on each rank while tracing.

    Picklable (the function travels by reference); ``__globals__`` is the function's, so a
    catalogue's swaps reach a program's own functions as they do untraced.
    """

    def __init__(self, fn, folder: str, world_id: str, world_size: int):
        self.fn, self.world_id = fn, world_id
        self.folder = os.path.join(os.path.abspath(folder), _WORLDS, world_id)
        os.makedirs(self.folder, exist_ok=True)
        meta = {
            "label": _label(fn),
            "name": _name(fn),
            "world_size": world_size,
            "started": clock(),
        }
        with open(os.path.join(self.folder, "world.json"), "w") as f:
            json.dump(meta, f)

    @property
    def __globals__(self) -> dict:
        return getattr(self.fn, "__globals__", {})

    def __call__(self, rank: int, world_size: int, *args: Any, **kwargs: Any) -> Any:
        with Recorder(os.path.join(self.folder, f"rank{rank}.jsonl"), rank) as recorder:
            with recording(observer=recorder), _named_spans(recorder):
                return self.fn(rank, world_size, *args, **kwargs)


def _program() -> str | None:
    """``katas.k09_ring_allreduce`` when this process runs a kata's program, else None."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    name = spec.name if spec else ""
    return name if name.split(".")[0] in ("katas", "solutions", "benchmarks") else None


def _label(fn) -> str:
    program = _program()  # first: a test's program inherits PYTEST_CURRENT_TEST
    if program:
        return " ".join(["python -m", program, *_without_trace(sys.argv[1:])])
    test = os.environ.get("PYTEST_CURRENT_TEST")
    if test:
        return test.rsplit(" (", 1)[0]
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', '?')}"


def _without_trace(argv: list[str]) -> list[str]:
    kept, skip = [], False
    for arg in argv:
        if not skip and arg != "--trace" and not arg.startswith("--trace="):
            kept.append(arg)
        skip = arg == "--trace"
    return kept


def _name(fn) -> str:
    program = _program()
    if program:
        return program.rsplit(".", 1)[-1]
    test = os.environ.get("PYTEST_CURRENT_TEST")
    if test:
        nodeid = test.rsplit(" (", 1)[0].split("/")[-1].replace(".py::", "-")
        return re.sub(r"[^A-Za-z0-9_.-]+", "-", nodeid).strip("-")
    return getattr(fn, "__name__", "world")


# --------------------------------------------------------------------------- in each rank


class Recorder(Observer):
    """Writes this rank's calls as JSON lines (a call again when it ends or its work is done)
    and compares its collectives with its peers' through the world's store."""

    def __init__(self, path: str, rank: int):
        self.path, self.rank = path, rank
        self.file = None
        self.index: dict[int, int] = {}  # id(call) -> its number on this rank
        self.collectives: dict[str, int] = defaultdict(int)  # group name -> collectives so far
        self.members: dict[int, tuple[str, list[int]]] = {}  # id(group) -> (name, global ranks)
        self.keys: dict[int, str] = {}  # id(group) -> the group's name in torch (same on all ranks)
        self.store = None
        self.store_failed = False

    def __enter__(self) -> Recorder:
        self.file = open(self.path, "a", buffering=1)
        self.spans = open(_spans_path(self.path), "a", buffering=1)
        self.opened: dict[int, list[int]] = defaultdict(list)  # thread -> its open spans
        return self

    def __exit__(self, *exc) -> None:
        self.file.close()
        self.spans.close()

    # named spans (torch.profiler.record_function)

    def span_started(self, name: str) -> int:
        import threading

        number = getattr(self, "_spans_so_far", 0)
        self._spans_so_far = number + 1
        stack = self.opened[threading.get_ident()]
        line = {"s": number, "name": str(name), "start": clock(), "depth": len(stack)}
        stack.append(number)
        self.spans.write(json.dumps(line) + "\n")
        return number

    def span_ended(self, number: int) -> None:
        import threading

        stack = self.opened[threading.get_ident()]
        if number in stack:
            stack.remove(number)
        self.spans.write(json.dumps({"s": number, "end": clock()}) + "\n")

    # the observer

    def started(self, call: Call) -> None:
        self.index[id(call)] = len(self.index)
        facts = self._facts(call)
        self._write(call, facts)
        if not call.point_to_point and call.name != "new_group":
            self._compare(call, facts)

    def ended(self, call: Call) -> None:
        if id(call) in self.index:
            self._write(call, {})

    def done(self, call: Call) -> None:
        if id(call) in self.index:
            self._write(call, {})

    # writing

    def _write(self, call: Call, facts: dict) -> None:
        line = {"i": self.index[id(call)], "end": call.end, "done": call.done}
        if facts:
            line.update(facts)
        elif call.name == "recv" and isinstance(call.result, int) and call.result >= 0:
            line["peer"] = call.result  # a recv from any source: the sender it got
        self.file.write(json.dumps(line) + "\n")

    def _facts(self, call: Call) -> dict:
        group, members = self._group(call.group)
        facts = {
            "name": call.name,
            "start": call.start,
            "bytes": call.bytes,
            "shapes": [list(s) for s in call.shapes],
            "dtypes": call.dtypes,
            "group": group,
            "members": members,
            "async": call.async_op,
            "what": str(call),
        }
        if call.op:
            facts["op"] = call.op
        peer = self._peer(call, members)
        if peer is not None:
            facts["peer"] = peer
        if call.point_to_point:
            facts["tag"] = call.peers.get("tag", 0)
        if call.parts:
            facts["parts"] = [
                [kind, peer, tag, size]
                for kind, peer, tag, size in call.parts  # global ranks
            ]
        return facts

    def _group(self, group) -> tuple[str, list[int]]:
        import torch.distributed as dist

        known = self.members.get(id(group))
        if known is not None:
            return known
        try:
            world = dist.group.WORLD
            actual = world if group is None else group
            members = list(dist.get_process_group_ranks(actual))
            name = "world" if actual is world else f"group{members}"
            key = getattr(actual, "group_name", None) or name
        except Exception:  # no group yet (katas 01-03 before they init one)
            return "world", []
        self.members[id(group)] = (name, members)
        self.keys[id(group)] = key
        return name, members

    def _peer(self, call: Call, members: list[int]) -> int | None:
        for key in ("dst", "src"):
            if key in call.peers:
                return call.peers[key]
        for key in ("group_dst", "group_src"):
            if key in call.peers and 0 <= call.peers[key] < len(members):
                return members[call.peers[key]]
        return None

    # early mismatch

    def _compare(self, call: Call, facts: dict) -> None:
        members = facts["members"]
        if self.rank not in members or len(members) < 2 or self.store_failed:
            return
        store = self._store()
        if store is None:
            return
        group_key = self.keys.get(id(call.group), facts["group"])
        number = self.collectives[group_key]
        self.collectives[group_key] += 1
        mine = _signature(call, facts)
        where = _caller()
        prefix = f"dojo-trace/{group_key}/"
        try:
            store.set(f"{prefix}{number}/{self.rank}", f"{mine}\n{where}")
            theirs = None
            for peer in members:
                key = f"{prefix}{number}/{peer}"
                if peer != self.rank and store.check([key]):
                    value = store.get(key).decode()
                    if value.split("\n")[0] != mine:
                        theirs = (peer, value)
                        break
            if number >= _STORE_WINDOW:
                store.delete_key(f"{prefix}{number - _STORE_WINDOW}/{self.rank}")
        except Exception:  # the store is gone (a rank of a failed world): stop comparing
            self.store_failed = True
            return
        if theirs is not None:
            peer, value = theirs
            their_call, _, their_where = value.partition("\n")
            on = "the world" if facts["group"] == "world" else f"the group of ranks {members}"
            raise CollectiveMismatch(
                f"the ranks called different collectives: rank {self.rank}'s {_ordinal(number + 1)} "
                f"collective on {on} is {mine} ({where}); rank {peer}'s is {their_call} "
                f"({their_where}). Every rank of a group must call the same collectives in the "
                "same order, with tensors of the same shape and dtype (and the same src): "
                "they would wait for each other for ever."
            )

    def _store(self):
        if self.store is None:
            try:
                import torch.distributed.distributed_c10d as c10d

                self.store = c10d._get_default_store()
            except Exception:
                self.store_failed = True
        return self.store


def _signature(call: Call, facts: dict) -> str:
    """``broadcast(float32[4], src=0)``: what every member of the group must agree on."""
    details = []
    if call.name in _STRICT:
        details += [
            f"{dtype}[{', '.join(str(n) for n in shape)}]"
            for dtype, shape in zip(call.dtypes, call.shapes)
        ]
    if call.name in ("broadcast", "reduce", "gather", "scatter") and "peer" in facts:
        details.append(
            f"{'src' if call.name in ('broadcast', 'scatter') else 'dst'}={facts['peer']}"
        )
    if call.op:
        details.append(f"op={call.op}")
    return f"{call.name}({', '.join(details)})"


def _caller() -> str:
    """The innermost frame outside torch and this recorder: ``katas/k04_allreduce.py:72, f``."""
    frame = sys._getframe(2)
    while frame is not None:
        here = Frame(frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name)
        if not here.file.endswith(_RECORDERS) and not here.in_torch:
            return f"{here.shown_path}:{here.line}, {here.function}"
        frame = frame.f_back
    return "?"


_RECORDERS = (
    os.path.join("dojo", "harness", "calls.py"),
    os.path.join("dojo", "harness", "timeline.py"),
)


def _spans_path(calls_path: str) -> str:
    return calls_path.removesuffix(".jsonl") + ".spans.jsonl"


@contextlib.contextmanager
def _named_spans(recorder: Recorder):
    """While inside: every ``torch.profiler.record_function`` opened outside torch is also
    recorded as a named span (torch's own spans run as they would, and are not recorded)."""
    import torch

    cls = torch.autograd.profiler.record_function
    enter, leave = cls.__enter__, cls.__exit__

    def traced_enter(self):
        entered = enter(self)
        if not _opened_in_torch():
            self._dojo_span = recorder.span_started(self.name)
        return entered

    def traced_exit(self, *exc):
        try:
            return leave(self, *exc)
        finally:
            number = self.__dict__.pop("_dojo_span", None)
            if number is not None and not recorder.spans.closed:
                recorder.span_ended(number)

    cls.__enter__, cls.__exit__ = traced_enter, traced_exit
    try:
        yield
    finally:
        cls.__enter__, cls.__exit__ = enter, leave


def _opened_in_torch() -> bool:
    """Whether the ``with`` (or decorated function) that opens a span is torch's own code."""
    frame = sys._getframe(2)
    while frame is not None:
        here = Frame(frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name)
        if not here.file.endswith(("contextlib.py", _RECORDERS[1])):
            return here.in_torch
        frame = frame.f_back
    return False


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


# --------------------------------------------------------------------------- reading a world


def read_world(folder: str) -> tuple[dict, dict[int, list[dict]]]:
    """A world's meta data and each rank's calls in order (``end``/``done`` None: never came)."""
    with open(os.path.join(folder, "world.json")) as f:
        meta = json.load(f)
    ranks: dict[int, list[dict]] = {}
    for rank in range(meta["world_size"]):
        calls: dict[int, dict] = {}
        try:
            with open(os.path.join(folder, f"rank{rank}.jsonl")) as f:
                for text in f:
                    try:
                        line = json.loads(text)
                    except ValueError:  # the last line of a rank killed mid-write
                        continue
                    calls.setdefault(line["i"], {}).update(line)
        except OSError:
            pass
        ranks[rank] = [calls[i] for i in sorted(calls) if "name" in calls[i]]
    return meta, ranks


def read_spans(folder: str) -> dict[int, list[dict]]:
    """Each rank's named spans (``torch.profiler.record_function`` in a kata) in the order they
    opened: ``name``, ``start``, ``end`` (None: still open when the trace ended), ``depth``."""
    with open(os.path.join(folder, "world.json")) as f:
        world_size = json.load(f)["world_size"]
    spans: dict[int, list[dict]] = {}
    for rank in range(world_size):
        found: dict[int, dict] = {}
        try:
            with open(_spans_path(os.path.join(folder, f"rank{rank}.jsonl"))) as f:
                for text in f:
                    try:
                        line = json.loads(text)
                    except ValueError:  # the last line of a rank killed mid-write
                        continue
                    found.setdefault(line["s"], {"end": None}).update(line)
        except OSError:
            pass
        spans[rank] = [
            {k: v for k, v in found[i].items() if k != "s"}
            for i in sorted(found)
            if "name" in found[i]
        ]
    return spans


def _endpoints(rank: int, call: dict):
    """(kind, src, dst, tag) of each message this call sends or receives."""
    name = call["name"]
    if name in ("send", "isend") and call.get("peer") is not None:
        yield "send", rank, call["peer"], call.get("tag", 0)
    elif name in ("recv", "irecv") and call.get("peer") is not None:
        yield "recv", call["peer"], rank, call.get("tag", 0)
    for kind, peer, tag, _ in call.get("parts", []):
        if peer is None:
            continue
        if kind == "isend":
            yield "send", rank, peer, tag
        elif kind == "irecv":
            yield "recv", peer, rank, tag


def messages(ranks: dict[int, list[dict]]) -> list[tuple[int, dict, int, dict]]:
    """Every send paired with its recv: (src, send call, dst, recv call), matched by (src, dst,
    tag) and order. A message whose other end was never called is left out."""
    sends, recvs = defaultdict(list), defaultdict(list)
    for rank, calls in ranks.items():
        for call in calls:
            for kind, src, dst, tag in _endpoints(rank, call):
                (sends if kind == "send" else recvs)[(src, dst, tag)].append(call)
    pairs = []
    for key, sent in sends.items():
        for send, recv in zip(sent, recvs.get(key, [])):
            pairs.append((key[0], send, key[1], recv))
    return pairs


# --------------------------------------------------------------------------- Chrome trace


def chrome_trace(
    meta: dict, ranks: dict[int, list[dict]], spans: dict[int, list[dict]] | None = None
) -> dict:
    """Trace Event Format: one process (track) per rank, "X" slices, "s"/"f" flows per message,
    and the program's named parts (``spans``) on a track of their own ("parts", thread 2)."""
    spans = spans or {}
    origin, finish = _span(ranks, spans)

    def us(t: float) -> float:
        return round((t - origin) * 1e6, 3)

    events: list[dict] = []
    for rank in ranks:
        events.append(
            {"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank}"}}
        )
        events.append(
            {"ph": "M", "name": "process_sort_index", "pid": rank, "args": {"sort_index": rank}}
        )
        events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": 0, "args": {"name": "calls"}})  # fmt: skip
        for call in ranks[rank]:
            end = call.get("end")
            args = {
                k: call[k]
                for k in ("what", "bytes", "shapes", "dtypes", "group", "members", "op", "peer", "tag")
                if k in call
            }  # fmt: skip
            if end is None:
                args["returned"] = "never (still inside when the trace ended)"
            start = us(call["start"])
            events.append(
                {
                    "ph": "X",
                    "name": call["name"],
                    "cat": "p2p"
                    if call.get("tag") is not None or call.get("parts")
                    else "collective",
                    "pid": rank,
                    "tid": 0,
                    "ts": start,
                    "dur": max(round(us(end if end is not None else finish) - start, 3), 0.001),
                    "args": args,
                }
            )
            if call.get("async") and call.get("done") is not None and end is not None:
                events.append(
                    {
                        "ph": "X",
                        "name": f"{call['name']} in flight",
                        "cat": "async",
                        "pid": rank,
                        "tid": 1,
                        "ts": start,
                        "dur": max(round(us(call["done"]) - start, 3), 0.001),
                        "args": {"what": call.get("what"), "until": "its work's wait() returned"},
                    }
                )
    for rank, found in spans.items():
        if found:
            events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": 2, "args": {"name": "parts"}})  # fmt: skip
        for part in found:
            end = part["end"] if part.get("end") is not None else finish
            events.append(
                {
                    "ph": "X",
                    "name": part["name"],
                    "cat": "part",
                    "pid": rank,
                    "tid": 2,
                    "ts": us(part["start"]),
                    "dur": max(round(us(end) - us(part["start"]), 3), 0.001),
                    "args": {"depth": part.get("depth", 0)}
                    | ({} if part.get("end") is not None else {"ended": "never"}),
                }
            )
    for number, (src, send, dst, recv) in enumerate(messages(ranks)):
        common = {"name": "message", "cat": "p2p", "id": number}
        events.append({**common, "ph": "s", "pid": src, "tid": 0, "ts": us(send["start"])})
        # inside the slice where the data has arrived (an irecv's: its "in flight" one), so
        # that the arrow binds to it
        tid = 1 if _arrived(recv, finish) != (recv.get("end") or finish) else 0
        land = max(us(recv["start"]), us(_arrived(recv, finish)) - 0.001)
        events.append({**common, "ph": "f", "bp": "e", "pid": dst, "tid": tid, "ts": land})
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"title": meta.get("label", ""), "world_size": meta["world_size"]},
    }


def _arrived(recv: dict, finish: float) -> float:
    """When a recv's data was there: an async one's wait, a blocking one's return."""
    if recv.get("async") and recv.get("done") is not None and recv.get("end") is not None:
        return max(recv["done"], recv["end"])
    return recv["end"] if recv.get("end") is not None else finish


def _span(ranks: dict[int, list[dict]], spans: dict | None = None) -> tuple[float, float]:
    times = [
        t
        for records in (*ranks.values(), *(spans or {}).values())
        for c in records
        for t in (c.get("start"), c.get("end"), c.get("done"))
        if t is not None
    ]
    if not times:
        return 0.0, 0.0
    return min(times), max(times)


# --------------------------------------------------------------------------- PNG


_COLOURS = {
    "send": "#1f77b4", "isend": "#6baed6", "recv": "#ff7f0e", "irecv": "#fdae6b",
    "batch_isend_irecv": "#9467bd", "all_reduce": "#2ca02c", "broadcast": "#d62728",
    "reduce": "#8c564b", "all_gather": "#e377c2", "all_gather_into_tensor": "#e377c2",
    "reduce_scatter": "#17becf", "reduce_scatter_tensor": "#17becf", "gather": "#bcbd22",
    "scatter": "#7f7f7f", "all_to_all": "#393b79", "all_to_all_single": "#393b79",
    "barrier": "#555555", "monitored_barrier": "#555555",
}  # fmt: skip


# Light colours for the named parts of a program, a colour per name (its trailing numbers aside:
# "F0.0" and "F1.3" share one), behind the calls' strong ones.
_PART_COLOURS = (
    "#efe3c2", "#ddd3f0", "#cde8e2", "#f3d3de", "#e2e2e2", "#e6efc4", "#d6e0f0", "#f0dcc8",
)  # fmt: skip


def _part_key(name: str) -> str:
    """A part's family: its name less the numbers that say which one ("F0.3" -> "F")."""
    return re.sub(r"[\s#_.-]*\d+(?:[.:]\d+)*$", "", name) or name


def _part_label(family: str, example: str) -> str:
    return f"part: {family}" if example == family else f"part: {family} ({example}, ...)"


def draw(
    meta: dict,
    ranks: dict[int, list[dict]],
    path: str,
    title: str | None = None,
    spans: dict[int, list[dict]] | None = None,
) -> None:
    """The PNG timeline: a lane per rank, a bar per call, arrows from sends to their recvs, and
    the program's named parts (``spans``, from ``read_spans``) as labelled strips above."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    spans = {rank: found for rank, found in (spans or {}).items() if found}
    origin, finish = _span(ranks, spans)
    span_ms = max((finish - origin) * 1e3, 1e-3)
    least = span_ms * 0.002  # a call of a microsecond still shows as a sliver
    count = len(ranks)
    # With named parts the calls move down a little, the parts' strip above them.
    low, high = (-0.14, 0.3) if spans else (-0.3, 0.3)
    used: dict[str, str] = {}
    in_flight: dict[str, str] = {}
    parts: dict[str, str] = {}
    examples: dict[str, str] = {}  # a part's family -> the first name of it seen ("F0.0")
    hung = False
    figure, axes = plt.subplots(figsize=(13, 1.6 + 0.75 * count), dpi=110)
    ms_per_point = span_ms * 1.13 / (13 * 0.85 * 72)  # for "does a label fit in its strip"
    for rank, found in spans.items():
        deepest = max(s.get("depth", 0) for s in found) + 1
        row = (0.3 - 0.04) / deepest
        for part in found:
            start = (part["start"] - origin) * 1e3
            end = part.get("end")
            stop = ((end if end is not None else finish) - origin) * 1e3
            key = _part_key(part["name"])
            colour = parts.setdefault(key, _PART_COLOURS[len(parts) % len(_PART_COLOURS)])
            examples.setdefault(key, part["name"])
            top = rank - 0.46 + row * part.get("depth", 0)
            axes.broken_barh(
                [(start, max(stop - start, least))],
                (top, row - 0.02),
                facecolors=colour,
                edgecolor="#777777",
                linewidth=0.5,
            )
            # the largest font (7, else 5) whose label fits the strip: a short span ("F3")
            # still says which micro-batch it is
            width = (stop - start) / ms_per_point
            fits = [f for f in (7, 5) if width > len(part["name"]) * f * 0.55 + 1.5]
            if fits:
                fontsize = fits[0]
                axes.text(
                    (start + stop) / 2,
                    top + (row - 0.02) / 2,
                    part["name"],
                    ha="center",
                    va="center",
                    fontsize=fontsize,
                    color="#333333",
                )
    for rank, calls in ranks.items():
        busy = 0.0
        for call in calls:
            start = (call["start"] - origin) * 1e3
            end = call.get("end")
            stop = ((end if end is not None else finish) - origin) * 1e3
            busy += stop - start
            colour = _COLOURS.get(call["name"], "#aaaaaa")
            used.setdefault(call["name"], colour)
            axes.broken_barh(
                [(start, max(stop - start, least))],
                (rank + low, high - low),
                facecolors=colour,
                edgecolor="red" if end is None else "white",  # white: calls side by side apart
                hatch="//" if end is None else None,
                linewidth=1.5 if end is None else 0.6,
            )
            hung = hung or end is None
            done = call.get("done")
            if call.get("async") and done is not None and end is not None and done > end:
                in_flight.setdefault(call["name"], colour)
                axes.broken_barh(
                    [(stop, (done - end) * 1e3)],
                    (rank + 0.22, 0.08),
                    facecolors=colour,
                    alpha=0.5,
                )
        share = 100 * busy / span_ms if span_ms else 0
        axes.text(
            span_ms * 1.01,
            rank,
            f"{share:.0f}% inside calls",
            va="center",
            fontsize=8,
            color="#555",
        )
    for src, send, dst, recv in messages(ranks):
        begin = (send["start"] - origin) * 1e3
        land = (_arrived(recv, finish) - origin) * 1e3
        axes.annotate(
            "",
            xy=(land, dst + (low if dst > src else high)),
            xytext=(begin, src + (high if dst > src else low)),
            arrowprops={"arrowstyle": "->", "color": "#333333", "alpha": 0.45, "lw": 0.7},
        )
    axes.set_yticks(list(ranks))
    axes.set_yticklabels([f"rank {r}" for r in ranks])
    axes.set_ylim(count - 0.5, -0.5)  # rank 0 on top
    axes.set_xlim(-span_ms * 0.01, span_ms * 1.12)
    axes.set_xlabel("ms since the first call (white = the rank computes or waits outside torch.distributed)")  # fmt: skip
    axes.grid(axis="x", alpha=0.3)
    calls_total = sum(len(c) for c in ranks.values())
    heading = title or meta.get("label", "")
    detail = f"{count} ranks, {calls_total} calls, {span_ms:.1f} ms"
    if hung:
        detail += "; hatched red: a call that never returned"
    if spans:
        detail += "; the strips above the calls: the program's named parts"
    axes.set_title(f"{heading}\n{detail}", fontsize=10)
    entries = [Patch(facecolor=c, label=n) for n, c in used.items()]
    entries += [
        Patch(facecolor=c, alpha=0.5, label=f"{n} in flight (thin: until its wait())")
        for n, c in in_flight.items()
    ]
    entries += [
        Patch(facecolor=c, edgecolor="#777777", linewidth=0.5, label=_part_label(n, examples[n]))
        for n, c in parts.items()
    ]
    columns = min(len(entries), 6) or 1
    rows = -(-len(entries) // columns)
    if entries:
        figure.legend(handles=entries, loc="lower center", ncol=columns, fontsize=8, frameon=False)
    height = figure.get_size_inches()[1]
    figure.set_size_inches(13, height + 0.22 * max(rows - 1, 0))
    figure.tight_layout(rect=(0, (0.12 + 0.22 * rows) / (height + 0.22 * max(rows - 1, 0)), 1, 1))
    figure.savefig(path)
    plt.close(figure)


# --------------------------------------------------------------------------- writing


_names_used: dict[str, int] = {}  # the names this process wrote, for a second world's "-2"


def pending(folder: str, mine: bool = False) -> list[str]:
    """The recorded worlds in ``folder`` not yet written, oldest first (``mine``: only those this
    process started: a program a test runs must not take the test's worlds)."""
    root = os.path.join(folder, _WORLDS)
    try:
        worlds = [os.path.join(root, w) for w in os.listdir(root)]
    except OSError:
        return []
    if mine:
        worlds = [w for w in worlds if os.path.basename(w).startswith(f"{os.getpid()}-")]
    worlds = [w for w in worlds if os.path.exists(os.path.join(w, "world.json"))]
    return sorted(worlds, key=os.path.getmtime)


def write_world(world: str, folder: str, name: str | None = None) -> tuple[str, str]:
    """One recorded world as ``folder/NAME.json`` and ``folder/NAME.png``; its records go."""
    meta, ranks = read_world(world)
    spans = read_spans(world)
    stem = name or meta.get("name") or "world"
    _names_used[stem] = _names_used.get(stem, 0) + 1
    if _names_used[stem] > 1:
        stem = f"{stem}-world{_names_used[stem]}"
    json_path = os.path.join(folder, f"{stem}.json")
    png_path = os.path.join(folder, f"{stem}.png")
    with open(json_path, "w") as f:
        json.dump(chrome_trace(meta, ranks, spans), f)
    draw(meta, ranks, png_path, spans=spans)
    shutil.rmtree(world, ignore_errors=True)
    return json_path, png_path


def write_pending(folder: str, mine: bool = False) -> list[tuple[str, str]]:
    """Every recorded world in ``folder`` written out (JSON and PNG), oldest first."""
    written = [write_world(world, folder) for world in pending(folder, mine)]
    _tidy(folder)
    return written


def discard_pending(folder: str, mine: bool = False) -> None:
    for world in pending(folder, mine):
        shutil.rmtree(world, ignore_errors=True)
    _tidy(folder)


def _tidy(folder: str) -> None:
    try:
        os.rmdir(os.path.join(folder, _WORLDS))  # only when empty: another run may be recording
    except OSError:
        pass


def how_to_open(written: list[tuple[str, str]]) -> str:
    """Where the files are and how to look at them (for a terminal)."""
    lines = []
    for json_path, png_path in written:
        lines.append(f"trace: {_shown(png_path)} (the timeline, a picture)")
        lines.append(f"       {_shown(json_path)} (open it in https://ui.perfetto.dev or chrome://tracing)")  # fmt: skip
    return "\n".join(lines)


def summary(written: list[tuple[str, str]], folder: str) -> str:
    """One line for many worlds (a test run)."""
    return (
        f"{len(written)} worlds traced into {_shown(folder)}/: TEST.png a timeline per world, "
        "TEST.json for https://ui.perfetto.dev or chrome://tracing"
    )


def _shown(path: str) -> str:
    relative = os.path.relpath(path)
    return relative if not relative.startswith("..") else path
