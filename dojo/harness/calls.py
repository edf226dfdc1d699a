"""What a rank asked of ``torch.distributed``, recorded: proof by what happened, not by the code.

    with recording() as calls:          # inside a rank
        kata.average_gradients(model)
    [c.name for c in calls]             # ["all_reduce", "all_reduce", ...]

Every call of a collective or point-to-point function through ``torch.distributed`` (as
``dist.all_reduce`` or ``torch.distributed.distributed_c10d.all_reduce``) is recorded with its
source, destination or peer, its reduce op, the shapes, dtypes and bytes of its tensors and when
it started and ended (``time.monotonic``: one clock for every process of a machine); an async
call (``isend``, ``async_op=True``) also gets ``done``, when its work's ``wait()`` returned. The
call itself runs untouched and its result is returned as it came. Tests use it to count
collectives, to tell which source a rank broadcast from, or in which order sends went out;
``dojo.harness.timeline`` uses it (with an ``observer``) to draw every rank's timeline.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

CALLS = (
    "send", "recv", "isend", "irecv", "batch_isend_irecv", "broadcast", "reduce", "all_reduce",
    "all_gather", "all_gather_into_tensor", "gather", "scatter", "reduce_scatter",
    "reduce_scatter_tensor", "all_gather_single", "reduce_scatter_single", "all_to_all",
    "all_to_all_single", "barrier", "monitored_barrier", "new_group",
)  # fmt: skip
POINT_TO_POINT = ("send", "recv", "isend", "irecv", "batch_isend_irecv")
_PEERS = ("src", "dst", "group_src", "group_dst", "tag")
clock = time.monotonic  # CLOCK_MONOTONIC: the same clock in every process of a machine


@dataclass
class Call:
    name: str
    peers: dict[str, int] = field(default_factory=dict)  # src, dst, tag, as given
    op: str | None = None  # the reduce op's name (SUM, AVG, ...)
    shapes: list[tuple[int, ...]] = field(default_factory=list)  # every tensor argument's shape
    group: object = None  # the process group given (None: the world)
    start: float = 0.0
    end: float | None = None  # None while the call has not returned (or raised)
    async_op: bool = False
    dtypes: list[str] = field(default_factory=list)  # every tensor argument's dtype, as shapes
    bytes: int = 0  # the bytes of every tensor argument together
    done: float | None = None  # an async call: when its work's wait() returned
    # batch_isend_irecv: one (isend or irecv, peer, tag, bytes) per P2POp in the list
    parts: list[tuple[str, int | None, int, int]] = field(default_factory=list)
    result: Any = field(default=None, repr=False)  # what the call returned (recv: the sender)

    def __str__(self) -> str:
        details = [f"{k}={v}" for k, v in self.peers.items()] + (
            [f"op={self.op}"] if self.op else []
        )
        return f"{self.name}({', '.join(details)})"

    @property
    def point_to_point(self) -> bool:
        return self.name in POINT_TO_POINT


def _tensor_facts(call: Call, value) -> None:
    call.shapes.append(tuple(value.shape))
    call.dtypes.append(str(value.dtype).removeprefix("torch."))
    call.bytes += value.numel() * value.element_size()


def _describe(name: str, args: tuple, kwargs: dict) -> Call:
    import inspect

    import torch
    import torch.distributed.distributed_c10d as c10d

    call = Call(name, start=clock())
    try:
        bound = inspect.signature(getattr(c10d, name)).bind_partial(*args, **kwargs).arguments
    except (TypeError, ValueError):
        bound = dict(kwargs)
    for key, value in bound.items():
        if key in _PEERS and isinstance(value, int):
            call.peers[key] = value
        elif key == "op" and value is not None:
            call.op = getattr(value, "name", None) or str(value).rsplit(".", 1)[-1]
        elif key == "group":
            call.group = value
        elif key == "async_op":
            call.async_op = bool(value)
        elif isinstance(value, torch.Tensor):
            _tensor_facts(call, value)
        elif isinstance(value, (list, tuple)):
            for item in value:
                if isinstance(item, torch.Tensor):
                    _tensor_facts(call, item)
                elif isinstance(item, c10d.P2POp) and isinstance(item.tensor, torch.Tensor):
                    kind = getattr(item.op, "__name__", str(item.op))
                    size = item.tensor.numel() * item.tensor.element_size()
                    call.parts.append((kind, item.peer, item.tag, size))
                    _tensor_facts(call, item.tensor)
    if name in ("isend", "irecv", "batch_isend_irecv"):
        call.async_op = True
    return call


class Observer:
    """What ``recording(observer=...)`` tells as calls happen (``dojo.harness.timeline`` is one)."""

    def started(self, call: Call) -> None:
        """Before the call runs; raising here stops it (the call is then never made)."""

    def ended(self, call: Call) -> None:
        """After the call returned (``call.end`` set) or raised (``call.end`` None)."""

    def done(self, call: Call) -> None:
        """An async call's work finished waiting (``call.done`` set)."""


@contextlib.contextmanager
def recording(
    names: tuple[str, ...] = CALLS, observer: Observer | None = None
) -> Iterator[list[Call]]:
    """Record every call of ``names`` in this process while the block runs."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    calls: list[Call] = []
    originals = {}
    inside = threading.local()  # torch's own calls made inside a recorded one are not the rank's
    pending: dict[int, tuple[Any, Call]] = {}  # id(work) -> (work, its call), until it waited
    for name in names:
        original = getattr(c10d, name, None)
        if original is None:
            continue
        originals[name] = original

        def recorded(*args, _name=name, _original=original, **kwargs):
            if getattr(inside, "call", False):
                return _original(*args, **kwargs)
            call = _describe(_name, args, kwargs)
            calls.append(call)
            inside.call = True
            try:
                if observer is not None:
                    observer.started(call)
                result = _original(*args, **kwargs)
            except BaseException:
                inside.call = False
                if observer is not None:
                    observer.ended(call)  # it raised: no end
                raise
            inside.call = False
            call.end = clock()
            if call.async_op and result is not None:
                for work in result if isinstance(result, list) else [result]:
                    pending[id(work)] = (work, call)
            elif _name == "recv":
                call.result = result
            if observer is not None:
                observer.ended(call)
            return result

        functools.update_wrapper(recorded, original)
        for module in (c10d, dist):
            setattr(module, name, recorded)
    work_class = getattr(c10d, "Work", None)
    original_wait = getattr(work_class, "wait", None)
    if original_wait is not None:

        def wait(work, *args, **kwargs):
            result = original_wait(work, *args, **kwargs)
            waited = pending.pop(id(work), None)
            if waited is not None:  # batch_isend_irecv's works: the last wait is when all are done
                waited[1].done = clock()
                if observer is not None:
                    observer.done(waited[1])
            return result

        functools.update_wrapper(wait, original_wait)
        try:
            work_class.wait = wait
        except (AttributeError, TypeError):  # a torch whose Work does not take it: no `done`
            original_wait = None
    try:
        yield calls
    finally:
        for name, original in originals.items():
            for module in (c10d, dist):
                setattr(module, name, original)
        if original_wait is not None:
            work_class.wait = original_wait
        pending.clear()
