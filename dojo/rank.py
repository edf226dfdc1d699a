"""The rank side of the harness: what each process of a world runs (see ``dojo.world``).

A rank runs its function, sends its result (or its error) to the parent, then waits until the
parent releases the whole world before it tears down: a rank that returned early must not
destroy the group under a peer that is still inside a collective with it.
"""

from __future__ import annotations

import faulthandler
import gc
import os
import pickle
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

# Ways a rank ends, as exit codes the parent can tell apart from a crash.
EXIT_OK = 0
EXIT_ORPHANED = 70  # the parent went away (killed, Ctrl-C): this rank and its children go too


@dataclass
class RankSpec:
    """Everything one rank needs, sent from the parent when the rank starts."""

    fn: Callable[..., Any]
    args: tuple
    kwargs: dict
    rank: int
    world_size: int
    world_id: str
    log_path: str
    store_port: int | None  # None: no process group, the function sets up its own
    backend: str = "gloo"
    group_timeout_s: float = 60.0
    env: dict = field(default_factory=dict)
    capture_output: bool = True  # False: print straight to the parent's terminal (programs)
    threads: int = 1  # torch threads; ranks share few cores, more threads only contend


@dataclass
class RankError:
    """A rank's exception, in a form that always unpickles in the parent."""

    rank: int
    type_name: str
    message: str
    traceback: str
    error: BaseException | None  # the exception itself, when it pickles


def main(spec: RankSpec, results, lifeline) -> None:
    """Entry point of a rank process (the ``target`` of its ``Process``)."""
    if hasattr(os, "setpgrp"):  # own group: the parent can kill this rank and all it started
        os.setpgrp()
    if spec.capture_output:
        _redirect_output(spec.log_path)
    else:
        faulthandler.enable(all_threads=True)
    _answer_stack_requests(stack_path(spec.log_path))
    released = threading.Event()
    threading.Thread(target=_watch_parent, args=(lifeline, released), daemon=True).start()
    os.environ.update(spec.env)
    from dojo.impl import apply_substitutions_for

    apply_substitutions_for(spec.fn)  # a program's own functions, when a catalogue swaps them

    import torch
    import torch.distributed as dist

    torch.set_num_threads(spec.threads)
    if "TORCH_DISTRIBUTED_DEBUG" in spec.env:  # torch read it when the forkserver imported it
        dist.set_debug_level_from_env()
    try:
        if spec.store_port is not None:
            _init_group(spec, dist)
        value = spec.fn(spec.rank, spec.world_size, *spec.args, **spec.kwargs)
        message = ("ok", pickle.dumps(value))
        del value
    except BaseException as error:
        message = ("error", _pickle_error(spec.rank, error))
    results.send(message)
    released.wait()
    _end(dist)


def _redirect_output(log_path: str) -> None:
    """Send fds 1 and 2 to a log the parent reads: Python prints, C++ aborts and stack dumps."""
    log = open(log_path, "a", buffering=1)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
    faulthandler.enable(file=sys.stderr, all_threads=True)  # segfaults and aborts


def stack_path(log_path: str) -> str:
    """Where a rank writes its stacks when the parent asks (beside its log)."""
    return log_path + ".stacks"


_stack_file = None


def _answer_stack_requests(path: str) -> None:
    """SIGUSR1 from the parent (a stuck rank, Ctrl-C) makes faulthandler write every thread's
    stack to ``path``, even while the rank is blocked inside gloo."""
    global _stack_file
    if hasattr(signal, "SIGUSR1"):
        _stack_file = open(path, "a", buffering=1)
        faulthandler.register(signal.SIGUSR1, file=_stack_file, all_threads=True)


def _watch_parent(lifeline, released: threading.Event) -> None:
    """Wait for the parent's release; if the parent dies instead, take this rank down with it."""
    try:
        lifeline.recv()
        released.set()
    except (EOFError, OSError):
        os.killpg(0, signal.SIGKILL) if hasattr(os, "killpg") else os._exit(EXIT_ORPHANED)


def _init_group(spec: RankSpec, dist) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", _loopback_interface())
    for name, value in (
        ("RANK", spec.rank),
        ("WORLD_SIZE", spec.world_size),
        ("LOCAL_RANK", spec.rank),
    ):
        os.environ[name] = str(value)
    if os.environ.get("DOJO_DEVICE") == "cuda":
        import torch

        from dojo.devices import gpu_of

        torch.cuda.set_device(gpu_of(spec.rank))  # cuda:LOCAL_RANK (all ranks on one node here)
    timeout = timedelta(seconds=spec.group_timeout_s)
    # The parent owns the store (bound to port 0, never closed): no port can collide.
    store = dist.TCPStore("127.0.0.1", spec.store_port, is_master=False, timeout=timeout)
    store = dist.PrefixStore(f"world-{spec.world_id}/", store)
    dist.init_process_group(
        spec.backend, store=store, rank=spec.rank, world_size=spec.world_size, timeout=timeout
    )


def _loopback_interface() -> str:
    import socket

    names = {name for _, name in socket.if_nameindex()}
    return "lo" if "lo" in names or "lo0" not in names else "lo0"


def _pickle_error(rank: int, error: BaseException) -> RankError:
    text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    try:
        pickle.loads(pickle.dumps(error))
        payload = error
    except Exception:
        payload = None
    error.__traceback__ = None
    return RankError(rank, type(error).__name__, str(error), text, payload)


def _end(dist) -> None:
    """Free everything, then destroy the group and leave at once.

    Destroying a gloo group while tensors that took part in collectives are still alive, then
    exiting normally, aborts a few percent of runs ("terminate called without an active
    exception"); collecting first and leaving with os._exit avoids it.
    """
    code = EXIT_OK
    try:
        gc.collect()
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
