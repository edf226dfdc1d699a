"""Worlds whose ranks keep a trace of their own calls in a file as they go (k07, k08): the test
reads the traces back, to check what the ranks did or, when the world fails, to say why in front
of the harness's report. Each spec writes its own traces (``trace_dir`` reaches every rank).

RankTrace(folder)                        in a rank: hooks torch.distributed, writes what it saw
run_traced(fn, world_size, *args, ...)   run_world with a fresh trace folder: (results, traces)
read_trace(folder, rank)                 a rank's trace (None where it wrote none)
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time

import pytest

from dojo.harness.calls import recording
from dojo.harness.world import WorldDeadlock, WorldFailure, run_world


class RankTrace:
    """``with Trace(trace_dir) as trace:`` in a rank: for as long as the block runs, the
    torch.distributed functions named in ``HOOKED`` go through ``hook(name, original)``, every
    call is recorded (``self.calls``, ``dojo.harness.calls.recording``, which wraps the hooks)
    and ``flush()`` writes ``data()`` to ``<folder>/rank<N>.json`` in one step, so that the test
    reads what a rank stuck inside a call had done. A spec's trace says what to hook and write."""

    HOOKED: tuple[str, ...] = ()

    def __init__(self, folder: str):
        import torch.distributed as dist

        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.path = os.path.join(folder, f"rank{self.rank}.json")
        self.calls: list = []
        self.marks: dict[str, float] = {}
        self._stack = contextlib.ExitStack()

    def hook(self, name: str, original):
        """What runs instead of torch.distributed's ``name`` (calling ``original``)."""
        raise NotImplementedError

    def data(self) -> dict:
        """What the trace file holds (plain JSON)."""
        raise NotImplementedError

    def __enter__(self):
        for name in self.HOOKED:
            original = getattr(_c10d(), name, None)
            if original is None:
                continue
            hooked = self.hook(name, original)
            hooked.__wrapped__ = original
            hooked.__name__ = original.__name__
            _set(name, hooked)
            self._stack.callback(_set, name, original)
        self.calls = self._stack.enter_context(recording())
        self.flush()
        return self

    def __exit__(self, *exc_info) -> None:
        try:
            self.flush()
        finally:
            self._stack.close()

    def mark(self, name: str) -> None:
        """Note when the rank got to ``name`` (``trace["marks"]``)."""
        self.marks[name] = time.perf_counter()
        self.flush()

    def flush(self) -> None:
        with open(self.path + ".tmp", "w", encoding="utf-8") as f:
            json.dump(self.data(), f)
        os.replace(self.path + ".tmp", self.path)


def _c10d():
    import torch.distributed.distributed_c10d as c10d

    return c10d


def _set(name: str, function) -> None:
    """``torch.distributed.<name>`` is ``function``, under both of its names."""
    import torch.distributed as dist

    for module in (_c10d(), dist):
        setattr(module, name, function)


def read_trace(folder: str, rank: int) -> dict | None:
    try:
        with open(os.path.join(folder, f"rank{rank}.json"), encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def read_traces(folder: str, world_size: int, empty: dict) -> dict[int, dict]:
    """Every rank's trace; ``empty`` for a rank that wrote none."""
    return {rank: read_trace(folder, rank) or empty for rank in range(world_size)}


def run_traced(fn, world_size: int, *args, explain, deadline: float, empty: dict):
    """``run_world(fn, world_size, *args, trace_dir=a fresh folder)``: ``(results, traces)``.
    When the world fails, the test fails with what ``explain(traces, report)`` says (a list of
    paragraphs; None for one that has nothing to say) in front of the harness's report. The
    first paragraph is the spec's own diagnosis: where there is one, it stands alone (a
    deadlock's report follows without the harness's general advice). The folder goes
    afterwards."""
    folder = tempfile.mkdtemp(prefix="dojo-trace-")
    try:
        try:
            results = run_world(fn, world_size, *args, deadline=deadline, trace_dir=folder)
            return results, read_traces(folder, world_size, empty)
        except WorldFailure as failure:
            traces = read_traces(folder, world_size, empty)
            report = str(failure)
            plain = failure.without_advice() if isinstance(failure, WorldDeadlock) else report
        why = explain(traces, report)
        if why and why[0]:
            report = plain
        pytest.fail("\n\n".join([*(p for p in why if p), report]), pytrace=False)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
