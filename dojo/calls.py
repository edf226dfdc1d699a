"""What a rank asked of ``torch.distributed``, recorded: proof by what happened, not by the code.

    with recording() as calls:          # inside a rank
        kata.average_gradients(model)
    [c.name for c in calls]             # ["all_reduce", "all_reduce", ...]

Every call of a collective or point-to-point function through ``torch.distributed`` (as
``dist.all_reduce`` or ``torch.distributed.distributed_c10d.all_reduce``) is recorded with its
source, destination or peer, its reduce op, the shapes of its tensors and when it started and
ended; the call itself runs untouched. Tests use it to count collectives, to tell which source a
rank broadcast from, or in which order sends went out.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

CALLS = (
    "send", "recv", "isend", "irecv", "batch_isend_irecv", "broadcast", "reduce", "all_reduce",
    "all_gather", "all_gather_into_tensor", "gather", "scatter", "reduce_scatter",
    "reduce_scatter_tensor", "all_gather_single", "reduce_scatter_single", "all_to_all",
    "all_to_all_single", "barrier", "monitored_barrier", "new_group",
)  # fmt: skip
_PEERS = ("src", "dst", "group_src", "group_dst", "tag")


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

    def __str__(self) -> str:
        details = [f"{k}={v}" for k, v in self.peers.items()] + (
            [f"op={self.op}"] if self.op else []
        )
        return f"{self.name}({', '.join(details)})"


def _describe(name: str, args: tuple, kwargs: dict) -> Call:
    import inspect

    import torch
    import torch.distributed.distributed_c10d as c10d

    call = Call(name, start=time.perf_counter())
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
            call.shapes.append(tuple(value.shape))
        elif isinstance(value, (list, tuple)):
            call.shapes += [tuple(t.shape) for t in value if isinstance(t, torch.Tensor)]
    return call


@contextlib.contextmanager
def recording(names: tuple[str, ...] = CALLS) -> Iterator[list[Call]]:
    """Record every call of ``names`` in this process while the block runs."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    calls: list[Call] = []
    originals = {}
    inside = threading.local()  # torch's own calls made inside a recorded one are not the rank's
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
                result = _original(*args, **kwargs)
            finally:
                inside.call = False
            call.end = time.perf_counter()
            return result

        functools.update_wrapper(recorded, original)
        for module in (c10d, dist):
            setattr(module, name, recorded)
    try:
        yield calls
    finally:
        for name, original in originals.items():
            for module in (c10d, dist):
                setattr(module, name, original)
