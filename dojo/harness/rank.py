"""The rank side of the harness: what each process of a world runs (see ``dojo.harness.world``).

A rank runs its function, sends its result (or its error) to the parent, then waits until the
parent releases the whole world before it tears down: a rank that returned early must not
destroy the group under a peer that is still inside a collective with it.

A rank whose world ended cleanly may serve the next world of the same parent instead of exiting
(``dojo.harness.world`` asks): forking a process with torch loaded and ending it again costs ~0.1 s of
CPU per rank, often more than the test itself. It does so only as it was when it was forked:
after its teardown it puts back the environment, the working directory and the random states,
drops the kata's, the catalogue's and the tests' modules (the next world imports them afresh),
and it serves again only when nothing else the world could have changed shows (a thread or a
process left running, DTensor plans cached under the world's meshes, torch's global modes,
hooks or patched ``torch.distributed`` functions); otherwise it exits as a one-use rank does.
"""

from __future__ import annotations

import faulthandler
import gc
import os
import pickle
import queue
import random
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from dojo.harness import culprit
from dojo.harness.culprit import Culprit
from dojo.harness.loopback import keep_gloo_on_loopback

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
    output: Any = None  # with capture_output False: the parent's stdout and stderr (LauncherOutput)
    threads: int = 1  # torch threads; ranks share few cores, more threads only contend
    reusable: bool = False  # the parent may ask this rank to serve further worlds


@dataclass
class RankError:
    """A rank's exception, in a form that always unpickles in the parent."""

    rank: int
    type_name: str
    message: str
    traceback: str
    error: BaseException | None  # the exception itself, when it pickles
    culprit: Culprit | None = None  # whose code raised it, called how (dojo.harness.culprit)


def main(spec: RankSpec, results, lifeline) -> None:
    """Entry point of a rank process (the ``target`` of its ``Process``): serve ``spec``, then
    further worlds' specs for as long as the parent asks and the rank stays as it was forked."""
    if hasattr(os, "setpgrp"):  # own group: the parent can kill this rank and all it started
        os.setpgrp()
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=_watch_parent, args=(lifeline, inbox), daemon=True).start()
    fresh = _Fresh() if spec.reusable else None
    while True:
        keep = _serve(spec, results, inbox, fresh)
        # The world's function holds its modules, which the next world imports afresh: held
        # here, they would outlive it (and be frozen for good, by _settle).
        del spec
        if not keep:
            break
        results.send(("idle", None))
        _settle()
        message = inbox.get()
        if message[0] != "task":
            break
        spec = message[1]
        del message
    _exit(0)


def _serve(spec: RankSpec, results, inbox: queue.SimpleQueue, fresh: _Fresh | None) -> bool:
    """Run one world's function and tear its group down; True when the rank may serve again."""
    if spec.capture_output:
        _redirect_output(spec.log_path)
    else:
        if spec.output is not None:
            spec.output.attach()
        faulthandler.enable(all_threads=True)
    _answer_stack_requests(stack_path(spec.log_path))
    os.environ.update(spec.env)
    keep_gloo_on_loopback(os.environ)  # a world of one machine: its groups too (katas 01-03's)
    from dojo.harness import impl

    impl.on_rank_function(spec.fn)  # a program's own functions, when a catalogue swaps them

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
    del spec
    results.send(message)
    del message
    stale = _caches_hold_groups(dist)  # read before the teardown forgets the world's groups
    keep = inbox.get() == ("release", True)
    if not _teardown(dist):
        _exit(1)
    return keep and not stale and fresh is not None and fresh.restore()


def _redirect_output(log_path: str) -> None:
    """Send fds 1 and 2 to a log the parent reads: Python prints, C++ aborts and stack dumps."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()  # a rank serving another world: the last world's lines go to its log
    with open(log_path, "a") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
    faulthandler.enable(file=sys.stderr, all_threads=True)  # segfaults and aborts


class LauncherOutput:
    """The launching process's stdout and stderr, handed to a rank as it starts (a program's
    ranks print where the program prints, even when the forkserver that forked them was started
    by another process with other output: a program under test, ``dojo.spec.testing.run_module``)."""

    def __init__(self, fds: tuple[int, int] = (1, 2)):
        self.fds = fds

    def __reduce__(self):
        # Only while multiprocessing starts the rank: its DupFd sends the descriptors along.
        from multiprocessing.reduction import DupFd

        return (_received_output, tuple(DupFd(fd) for fd in self.fds))

    def attach(self) -> None:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        for mine, theirs in zip((1, 2), self.fds):
            if mine != theirs:
                os.dup2(theirs, mine)
                os.close(theirs)
        self.fds = (1, 2)
        sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
        sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)


def _received_output(*duplicates) -> LauncherOutput:
    return LauncherOutput(tuple(d.detach() for d in duplicates))


def stack_path(log_path: str) -> str:
    """Where a rank writes its stacks when the parent asks (beside its log)."""
    return log_path + ".stacks"


_stack_file = None


def _answer_stack_requests(path: str) -> None:
    """SIGUSR1 from the parent (a stuck rank, Ctrl-C) makes faulthandler write every thread's
    stack to ``path``, even while the rank is blocked inside gloo."""
    global _stack_file
    if hasattr(signal, "SIGUSR1"):
        before, _stack_file = _stack_file, open(path, "a", buffering=1)
        faulthandler.register(signal.SIGUSR1, file=_stack_file, all_threads=True)
        if before is not None:  # the last world's (faulthandler writes to the new one now)
            before.close()


def _watch_parent(lifeline, inbox: queue.SimpleQueue) -> None:
    """Pass the parent's messages on (a release, the next world's task); if the parent dies
    instead, take this rank down with it."""
    try:
        while True:
            inbox.put(lifeline.recv())
    except (EOFError, OSError):
        os.killpg(0, signal.SIGKILL) if hasattr(os, "killpg") else os._exit(EXIT_ORPHANED)


def _init_group(spec: RankSpec, dist) -> None:
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
    store = _client(dist, spec.store_port, timeout)
    store = dist.PrefixStore(f"world-{spec.world_id}/", store)
    dist.init_process_group(
        spec.backend, store=store, rank=spec.rank, world_size=spec.world_size, timeout=timeout
    )


_clients: dict = {}  # port -> this process's connection to the parent's store


def _client(dist, port: int, timeout: timedelta):
    """One connection to the parent's store for every world this rank serves."""
    client = _clients.get(port)
    if client is None:
        client = _clients[port] = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
    else:
        client.set_timeout(timeout)
    return client


def _pickle_error(rank: int, error: BaseException) -> RankError:
    text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    found = culprit.find(error.__traceback__)  # while its frames, and their arguments, live
    try:
        pickle.loads(pickle.dumps(error))
        payload = error
    except Exception:
        payload = None
    error.__traceback__ = None
    return RankError(rank, type(error).__name__, str(error), text, payload, found)


def _teardown(dist) -> bool:
    """Free everything, then destroy the group; False when that failed (said in the log).

    Destroying a gloo group while tensors that took part in collectives are still alive, then
    exiting normally, aborts a few percent of runs ("terminate called without an active
    exception"); collecting first, and leaving with os._exit, avoids it.
    """
    try:
        gc.collect()
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        return True
    except BaseException:
        traceback.print_exc()
        return False


def _settle() -> None:
    """Between worlds: what is still alive now lives on (modules a world imported, torch's
    caches); freezing it keeps every later teardown's gc.collect() to that world's own objects,
    instead of the whole heap, which grows with every world (a collection cost more than the
    rest of a rank's work in a catalogue's run)."""
    gc.collect()
    gc.freeze()


def _exit(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class _Fresh:
    """What a rank was when it was forked, taken before its first world: ``restore()`` puts back
    what a world may change and the next one must not see (the environment, the working
    directory, the random states, the catalogue's swaps, the kata's and the test's modules) and
    says whether the rank is as it was in everything else that can be seen cheaply."""

    def __init__(self):
        import torch
        import torch.distributed as dist

        self.environ = dict(os.environ)
        self.cwd = os.getcwd()
        self.threads = {t.ident for t in threading.enumerate()}
        self.torch_rng = torch.get_rng_state()
        numpy = sys.modules.get("numpy")
        self.numpy_rng = numpy.random.get_state() if numpy is not None else None
        self.modes = _torch_modes()
        self.dist_functions = _functions(dist)
        self.signals = _signal_handlers()

    def restore(self) -> bool:
        import torch
        import torch.distributed as dist

        from dojo.harness import impl

        impl.reset()
        _forget_kata_modules()
        os.environ.clear()
        os.environ.update(self.environ)
        torch.set_rng_state(self.torch_rng)
        random.seed()  # as a fork does (the random module reseeds in every child)
        if self.numpy_rng is not None:
            sys.modules["numpy"].random.set_state(self.numpy_rng)
        try:
            os.chdir(self.cwd)
        except OSError:
            return False
        return (
            not dist.is_initialized()
            and {t.ident for t in threading.enumerate() if t.is_alive()} <= self.threads
            and not _children()
            and _torch_modes() == self.modes
            and _functions(dist, self.dist_functions) == self.dist_functions
            and _signal_handlers() == self.signals
            and not _global_module_hooks()
            and not _meshes_entered()
        )


# Modules a world's code lives in: the next world imports them afresh (~10 ms), so that nothing
# a world kept in them (a global, a cache, a swap) reaches the next.
_KATA_CODE = (
    "katas.",
    "solutions.",
    "dojo.dev.shipped.",
    "dojo.dev.mistakes.k",
    "tests.",
    "dojo.tests.",
)


def _forget_kata_modules() -> None:
    for name in [n for n in sys.modules if n.startswith(_KATA_CODE)]:
        del sys.modules[name]


def _caches_hold_groups(dist) -> bool:
    """Whether torch may keep this world's groups where a later world would find them: DTensor
    caches its sharding plans under device meshes, and a later world's mesh compares equal to
    this one's while its groups differ (seen: "Could not resolve the process group")."""
    try:
        from torch.distributed.tensor import DTensor, _redistribute

        caches = (
            DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache,
            _redistribute._gen_transform_infos,
        )
        return any(cache.cache_info().currsize for cache in caches)
    except (ImportError, AttributeError):  # another torch: a world of one group cannot be wrong
        return len(getattr(dist.distributed_c10d._world, "pg_names", (0, 0))) > 1


def _torch_modes() -> tuple:
    import torch

    return (
        torch.get_default_dtype(),
        str(torch.get_default_device()),
        torch.is_grad_enabled(),
        torch.is_inference_mode_enabled(),
        torch.is_anomaly_enabled(),
        torch.are_deterministic_algorithms_enabled(),
        torch.get_num_interop_threads(),
    )


def _functions(module, names=None) -> dict[str, int]:
    """The identities of a module's functions (of those ``names``): a patched one differs."""
    found = vars(module)
    return {
        name: id(found.get(name))
        for name in (names if names is not None else found)
        if names is not None or callable(found[name])
    }


def _signal_handlers() -> dict:
    names = ("SIGINT", "SIGTERM", "SIGCHLD", "SIGALRM", "SIGUSR2", "SIGPIPE", "SIGHUP")
    return {n: signal.getsignal(getattr(signal, n)) for n in names if hasattr(signal, n)}


def _children() -> bool:
    """Whether this process still has a child (running, or ended and never waited for)."""
    try:
        for task in os.listdir("/proc/self/task"):  # a thread's children are listed under it
            with open(f"/proc/self/task/{task}/children") as f:
                if f.read().split():
                    return True
    except OSError:
        return True  # cannot tell: do not serve again
    return False


def _global_module_hooks() -> bool:
    from torch.nn.modules import module

    return any(
        getattr(module, name)
        for name in dir(module)
        if name.startswith("_global_") and name.endswith("hooks")
    )


def _meshes_entered() -> bool:
    device_mesh = sys.modules.get("torch.distributed.device_mesh")
    resources = getattr(device_mesh, "_mesh_resources", None)
    return bool(getattr(resources, "mesh_stack", None))
