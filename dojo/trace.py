"""A timeline of every rank: each torch.distributed call recorded, then drawn.

    DOJO_TRACE_DIR=/tmp/t python -m katas.k09_ring_allreduce     # or: --trace /tmp/t, dojo trace k09

While ``DOJO_TRACE_DIR`` is set, ``run_world`` runs each rank's function under ``Recorder`` (a
``dojo.calls`` observer): every collective and point-to-point call (operation, peer or group,
bytes, start and end on ``time.monotonic``, an async call's completion when its work's ``wait()``
returns) is appended, one JSON line per change, to ``DIR/.worlds/WORLD/rankN.jsonl``, so a world
that hangs or crashes still leaves its calls so far. ``write_pending(DIR)`` then turns each world
into ``DIR/NAME.json`` (Chrome's Trace Event Format: one track per rank, flow arrows from each send
to its recv; open it in https://ui.perfetto.dev or chrome://tracing) and ``DIR/NAME.png`` (one lane
per rank, one bar per call coloured by operation, arrows from sends to their recvs, gaps = idle).

The recorder also catches mismatched collectives early: each rank's k-th collective on a group
is published in the world's store as its operation, shapes, dtypes and source; a rank that finds
a peer's k-th differs raises ``CollectiveMismatch`` at once, naming both calls, instead of waiting
for the deadline. Point-to-point calls are not compared; a correct run is never stopped, and no
call's arguments or results are touched.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from collections import defaultdict
from typing import Any

from dojo.calls import Call, Observer, clock, recording
from dojo.stacks import Frame

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
            with recording(observer=recorder):
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
        return self

    def __exit__(self, *exc) -> None:
        self.file.close()

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


_RECORDERS = (os.path.join("dojo", "calls.py"), os.path.join("dojo", "trace.py"))


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


def chrome_trace(meta: dict, ranks: dict[int, list[dict]]) -> dict:
    """Trace Event Format: one process (track) per rank, "X" slices, "s"/"f" flows per message."""
    origin, finish = _span(ranks)

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


def _span(ranks: dict[int, list[dict]]) -> tuple[float, float]:
    times = [
        t
        for calls in ranks.values()
        for c in calls
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


def draw(meta: dict, ranks: dict[int, list[dict]], path: str, title: str | None = None) -> None:
    """The PNG timeline: a lane per rank, a bar per call, arrows from sends to their recvs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    origin, finish = _span(ranks)
    span_ms = max((finish - origin) * 1e3, 1e-3)
    least = span_ms * 0.002  # a call of a microsecond still shows as a sliver
    count = len(ranks)
    figure, axes = plt.subplots(figsize=(13, 1.6 + 0.75 * count), dpi=110)
    used: dict[str, str] = {}
    hung = False
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
                (rank - 0.3, 0.6),
                facecolors=colour,
                edgecolor="red" if end is None else "white",  # white: calls side by side apart
                hatch="//" if end is None else None,
                linewidth=1.5 if end is None else 0.6,
            )
            hung = hung or end is None
            done = call.get("done")
            if call.get("async") and done is not None and end is not None and done > end:
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
            xy=(land, dst + (-0.3 if dst > src else 0.3)),
            xytext=(begin, src + (0.3 if dst > src else -0.3)),
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
    axes.set_title(f"{heading}\n{detail}", fontsize=10)
    handles = [Patch(facecolor=c, label=n) for n, c in used.items()]
    if handles:
        figure.legend(
            handles=handles,
            loc="lower center",
            ncol=min(len(handles), 8),
            fontsize=8,
            frameon=False,
        )
    figure.tight_layout(rect=(0, 0.05 + 0.1 / (count + 2), 1, 1))
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
    stem = name or meta.get("name") or "world"
    _names_used[stem] = _names_used.get(stem, 0) + 1
    if _names_used[stem] > 1:
        stem = f"{stem}-world{_names_used[stem]}"
    json_path = os.path.join(folder, f"{stem}.json")
    png_path = os.path.join(folder, f"{stem}.png")
    with open(json_path, "w") as f:
        json.dump(chrome_trace(meta, ranks), f)
    draw(meta, ranks, png_path)
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
