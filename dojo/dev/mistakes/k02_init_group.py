"""k02's mistakes catalogue: real mistakes in pointing env:// at rank 0, joining the group with a
timeout, and leaving it, and right answers written another way. See ``dojo/dev/mistakes/__init__.py``
for what each list promises."""

from __future__ import annotations

import os
from datetime import timedelta

import torch.distributed as dist

from dojo.dev.mistakes import Mistake, RightAnswer

# --------------------------------------------------------------------------- set_master


def port_as_int(addr, port):
    if not isinstance(port, int) or not 1 <= port <= 65535:
        raise ValueError(f"MASTER_PORT must be a port number from 1 to 65535, got {port!r}")
    os.environ["MASTER_ADDR"] = addr
    os.environ["MASTER_PORT"] = port  # os.environ takes strings only


def tutorials_port(addr, port):
    if not isinstance(port, int) or not 1 <= port <= 65535:
        raise ValueError(f"MASTER_PORT must be a port number from 1 to 65535, got {port!r}")
    os.environ["MASTER_ADDR"] = str(addr)
    os.environ["MASTER_PORT"] = "29500"  # copied from the tutorial


def no_port_check(addr, port):
    os.environ["MASTER_ADDR"] = str(addr)
    os.environ["MASTER_PORT"] = str(port)


def range_check_only(addr, port):
    if not 1 <= port <= 65535:  # a str port fails the comparison with a TypeError
        raise ValueError(f"MASTER_PORT must be a port number from 1 to 65535, got {port!r}")
    os.environ["MASTER_ADDR"] = str(addr)
    os.environ["MASTER_PORT"] = str(port)


def allows_port_zero(addr, port):
    if not isinstance(port, int) or not 0 <= port <= 65535:  # "0 is a valid port number"
        raise ValueError(f"MASTER_PORT must be a port number from 0 to 65535, got {port!r}")
    os.environ["MASTER_ADDR"] = str(addr)
    os.environ["MASTER_PORT"] = str(port)


def vague_port_error(addr, port):
    if not isinstance(port, int) or not 1 <= port <= 65535:
        raise ValueError("invalid port")
    os.environ["MASTER_ADDR"] = str(addr)
    os.environ["MASTER_PORT"] = str(port)


def sets_before_checking(addr, port):
    os.environ["MASTER_ADDR"] = str(addr)
    os.environ["MASTER_PORT"] = str(port)  # already changed when the check below refuses it
    if not isinstance(port, int) or not 1 <= port <= 65535:
        raise ValueError(f"MASTER_PORT must be a port number from 1 to 65535, got {port!r}")


# --------------------------------------------------------------------------- init_process


def _run_and_leave(rank, world_size, fn):
    try:
        result = fn(rank, world_size)
        dist.barrier()
        return result
    finally:
        dist.destroy_process_group()


def timeout_as_number(rank, world_size, fn, backend="gloo", timeout_s=30.0):
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout_s)
    return _run_and_leave(rank, world_size, fn)


def timeout_in_days(rank, world_size, fn, backend="gloo", timeout_s=30.0):
    timeout = timedelta(timeout_s)  # timedelta's first argument is days
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout)
    return _run_and_leave(rank, world_size, fn)


def no_timeout(rank, world_size, fn, backend="gloo", timeout_s=30.0):
    dist.init_process_group(backend, rank=rank, world_size=world_size)  # 30 minutes by default
    return _run_and_leave(rank, world_size, fn)


def rank_and_size_from_the_environment(rank, world_size, fn, backend="gloo", timeout_s=30.0):
    # "env:// knows who I am": only where a launcher (torchrun) set RANK and WORLD_SIZE
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return _run_and_leave(rank, world_size, fn)


def result_dropped(rank, world_size, fn, backend="gloo", timeout_s=30.0):
    dist.init_process_group(
        backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s)
    )
    try:
        fn(rank, world_size)  # as the tutorial's run(), whose result nobody needed
        dist.barrier()
    finally:
        dist.destroy_process_group()


def no_barrier(rank, world_size, fn, backend="gloo", timeout_s=30.0):
    dist.init_process_group(
        backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s)
    )
    try:
        return fn(rank, world_size)
    finally:
        dist.destroy_process_group()


def barrier_before_fn(rank, world_size, fn, backend="gloo", timeout_s=30.0):
    dist.init_process_group(
        backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s)
    )
    try:
        dist.barrier()  # "wait until everyone has joined"
        return fn(rank, world_size)
    finally:
        dist.destroy_process_group()


def no_finally(rank, world_size, fn, backend="gloo", timeout_s=30.0):
    dist.init_process_group(
        backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s)
    )
    result = fn(rank, world_size)
    dist.barrier()
    dist.destroy_process_group()  # skipped when fn raises
    return result


def swallows_the_error(rank, world_size, fn, backend="gloo", timeout_s=30.0):
    dist.init_process_group(
        backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s)
    )
    result = None
    try:
        result = fn(rank, world_size)
        dist.barrier()
    except Exception as error:
        print(f"rank {rank}: fn failed: {error}")  # reported, and forgotten
    finally:
        dist.destroy_process_group()
    return result


def init_inside_the_try(rank, world_size, fn, backend="gloo", timeout_s=30.0):
    try:
        dist.init_process_group(
            backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s)
        )
        result = fn(rank, world_size)
        dist.barrier()
        return result
    finally:
        dist.destroy_process_group()  # also when there is no group: its error hides the real one


# Right answers written differently: the checks must accept every one.


def set_master_with_update(addr, port):
    if type(port) is not int or not 0 < port < 65536:
        raise ValueError(f"port {port!r} is not a TCP port (an int from 1 to 65535)")
    os.environ.update(MASTER_ADDR=str(addr), MASTER_PORT=f"{port}")


def with_tcp_init_method(rank, world_size, fn, backend="gloo", timeout_s=30.0):
    """The same rendezvous spelled as a URL: tcp://MASTER_ADDR:MASTER_PORT."""
    address = f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    dist.init_process_group(
        backend=backend,
        init_method=address,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    try:
        result = fn(rank, world_size)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return result


def cleanup_on_both_paths(rank, world_size, fn, backend="gloo", timeout_s=30.0):
    """No finally: the group is destroyed in the except branch and after the barrier."""
    dist.init_process_group(
        backend,
        init_method="env://",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    try:
        result = fn(rank, world_size)
    except BaseException:
        dist.destroy_process_group()
        raise
    dist.barrier()
    dist.destroy_process_group()
    return result


# --------------------------------------------------------------------------- the catalogue

_JOIN = "test_four_ranks_join_with_their_rank_a_world_of_four_and_a_timeout"
_BAD_PORT = "test_set_master_refuses_a_bad_port"
_BARRIER = "test_barrier_keeps_every_rank_until_the_slowest_has_finished"
_DESTROYED = "test_group_is_destroyed_even_when_fn_raises"

# Each mistake must fail the named tests with a message that says all of `says`.
MISTAKES = [
    Mistake(
        "port_as_int",
        replaces="set_master",
        fails=["test_set_master_writes_the_environment"],
        says=["raised TypeError", "os.environ holds strings only", "str(port)"],
    ),
    Mistake(
        "tutorials_port",
        replaces="set_master",
        fails=["test_set_master_writes_the_environment"],
        says=["the tutorial's port", "use the port set_master was given"],
    ),
    Mistake(
        "no_port_check",
        replaces="set_master",
        fails=[_BAD_PORT],
        says=["returned without an error", "expected a ValueError that names the port"],
    ),
    Mistake(
        "range_check_only",
        replaces="set_master",
        fails=[f"{_BAD_PORT}[str-'29500']"],
        says=["raised TypeError", "must be an int from 1 to 65535", "os.environ holds strings"],
    ),
    Mistake(
        "allows_port_zero",
        replaces="set_master",
        fails=[f"{_BAD_PORT}[int-0]"],
        says=["returned without an error", "port 0 asks the system for any free port"],
    ),
    Mistake(
        "vague_port_error",
        replaces="set_master",
        fails=[_BAD_PORT],
        says=["ValueError('invalid port')", "which port it was"],
    ),
    Mistake(
        "sets_before_checking",
        replaces="set_master",
        fails=[_BAD_PORT],
        says=["but left MASTER_PORT=", "check the port first"],
    ),
    Mistake(
        "timeout_as_number",
        replaces="init_process",
        fails=[_JOIN],
        says=["timeout=12.5, a float", "Pass timeout=timedelta(seconds=timeout_s)"],
    ),
    Mistake(
        "timeout_in_days",
        replaces="init_process",
        fails=[_JOIN],
        says=["12.5 days", "timedelta's first argument is days"],
    ),
    Mistake(
        "no_timeout",
        replaces="init_process",
        fails=[_JOIN],
        says=["without a timeout", "30 minutes"],
    ),
    Mistake(
        "rank_and_size_from_the_environment",
        replaces="init_process",
        fails=[_JOIN],
        says=["without rank= and world_size=", "Pass rank=rank and world_size=world_size"],
    ),
    Mistake(
        "result_dropped",
        replaces="init_process",
        fails=[_JOIN],
        says=["init_process returned None", "return fn's result"],
    ),
    Mistake(
        "no_barrier",
        replaces="init_process",
        fails=[_BARRIER],
        says=["called no dist.barrier()", "Call dist.barrier() after fn"],
    ),
    Mistake(
        "barrier_before_fn",
        replaces="init_process",
        fails=[_BARRIER],
        says=["called dist.barrier() before fn, not after it", "Call dist.barrier() after fn"],
    ),
    Mistake(
        "no_finally",
        replaces="init_process",
        fails=[_DESTROYED],
        says=["the group was left behind", "in a finally block"],
    ),
    Mistake(
        "swallows_the_error",
        replaces="init_process",
        fails=[_DESTROYED],
        says=["init_process returned as if all was well", "let fn's error through"],
    ),
    Mistake(
        "init_inside_the_try",
        replaces="init_process",
        fails=["test_a_failed_init_is_reported_as_itself"],
        says=["its own error hid the real one", "Call init_process_group before the try"],
    ),
]

# Each right answer must pass every test of its step.
RIGHT_ANSWERS = [
    RightAnswer("set_master_with_update", replaces="set_master"),
    RightAnswer("with_tcp_init_method", replaces="init_process", steps=(2, 3)),
    RightAnswer("cleanup_on_both_paths", replaces="init_process", steps=(2, 3)),
]
