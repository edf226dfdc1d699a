"""k06's mistakes catalogue: real mistakes in the rank arithmetic, the environment, joining a world
at an address, and a node's launcher, and right answers written another way. See
``dojo/dev/mistakes/__init__.py`` for what each list promises."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from datetime import timedelta

from dojo.dev.mistakes import Mistake, RightAnswer
from dojo.harness import impl

ENV_NAMES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _k06():
    """The reference module, with this entry swapped in: the running program itself when it is
    k06 (its LaunchConfigError is the one its main catches), else the imported module."""
    main = sys.modules.get("__main__")
    if impl.kata_name_of(main) == "k06_multi_node":
        return main
    return impl.load_kata("k06_multi_node")


def _checked_options(nnodes, node_rank, nproc_per_node, local_rank, master_addr, master_port):
    """The reference's option checks: the mistakes below differ elsewhere."""
    error = _k06().LaunchConfigError
    if nnodes < 1 or nproc_per_node < 1:
        raise error(f"--nnodes {nnodes} --nproc-per-node {nproc_per_node}: at least one of each")
    if not 0 <= node_rank < nnodes:
        raise error(f"--node-rank {node_rank} does not fit --nnodes {nnodes}")
    if not 0 <= local_rank < nproc_per_node:
        raise error(f"local rank {local_rank} does not fit --nproc-per-node {nproc_per_node}")
    if not str(master_addr).strip():
        raise error("--master-addr is empty: give node 0's address")
    if not 1 <= master_port <= 65535:
        raise error(f"--master-port {master_port} is not a port (1-65535)")


def _environment(rank, local_rank, world_size, local_world_size, master_addr, master_port):
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(local_world_size),
        "MASTER_ADDR": str(master_addr),
        "MASTER_PORT": str(master_port),
    }


# --------------------------------------------------------------------------- node_environment


def rank_is_node_plus_local(
    nnodes, node_rank, nproc_per_node, local_rank, master_addr, master_port
):
    _checked_options(nnodes, node_rank, nproc_per_node, local_rank, master_addr, master_port)
    return _environment(  # node_rank + local_rank: node 1's local rank 0 becomes rank 1
        node_rank + local_rank,
        local_rank,
        nnodes * nproc_per_node,
        nproc_per_node,
        master_addr,
        master_port,
    )


def world_size_is_nproc(nnodes, node_rank, nproc_per_node, local_rank, master_addr, master_port):
    _checked_options(nnodes, node_rank, nproc_per_node, local_rank, master_addr, master_port)
    return _environment(  # WORLD_SIZE = this node's processes only
        node_rank * nproc_per_node + local_rank,
        local_rank,
        nproc_per_node,
        nproc_per_node,
        master_addr,
        master_port,
    )


def master_addr_of_this_host(
    nnodes, node_rank, nproc_per_node, local_rank, master_addr, master_port
):
    _checked_options(nnodes, node_rank, nproc_per_node, local_rank, master_addr, master_port)
    return _environment(  # "the master is on this machine": true on node 0 only
        node_rank * nproc_per_node + local_rank,
        local_rank,
        nnodes * nproc_per_node,
        nproc_per_node,
        "localhost",
        master_port,
    )


def ints_not_strings(nnodes, node_rank, nproc_per_node, local_rank, master_addr, master_port):
    _checked_options(nnodes, node_rank, nproc_per_node, local_rank, master_addr, master_port)
    return {  # os.environ and subprocess take strings only
        "RANK": node_rank * nproc_per_node + local_rank,
        "LOCAL_RANK": local_rank,
        "WORLD_SIZE": nnodes * nproc_per_node,
        "LOCAL_WORLD_SIZE": nproc_per_node,
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": master_port,
    }


def no_option_checks(nnodes, node_rank, nproc_per_node, local_rank, master_addr, master_port):
    return _environment(  # a bad --node-rank starts a world that can never form
        node_rank * nproc_per_node + local_rank,
        local_rank,
        nnodes * nproc_per_node,
        nproc_per_node,
        master_addr,
        master_port,
    )


def plain_value_error(nnodes, node_rank, nproc_per_node, local_rank, master_addr, master_port):
    try:  # the right checks, the wrong exception: "a bad value is a ValueError"
        _checked_options(nnodes, node_rank, nproc_per_node, local_rank, master_addr, master_port)
    except ValueError as error:
        raise ValueError(str(error)) from None
    return _environment(
        node_rank * nproc_per_node + local_rank,
        local_rank,
        nnodes * nproc_per_node,
        nproc_per_node,
        master_addr,
        master_port,
    )


# Right answers written differently.


def from_zip(nnodes, node_rank, nproc_per_node, local_rank, master_addr, master_port):
    _checked_options(nnodes, node_rank, nproc_per_node, local_rank, master_addr, master_port)
    values = (
        node_rank * nproc_per_node + local_rank,
        local_rank,
        nnodes * nproc_per_node,
        nproc_per_node,
        master_addr,
        master_port,
    )
    return {name: f"{value}" for name, value in zip(ENV_NAMES, values)}


# --------------------------------------------------------------------------- read_environment


def _reference_read(env):
    """Every check right (the kata's own read_environment is the entry swapped in)."""
    return checked_by_a_helper(env)


def local_rank_as_rank(environ=None):
    env = os.environ if environ is None else environ
    info = _reference_read(env)  # every check right, then
    return type(info)(
        info.local_rank,
        info.local_rank,
        info.world_size,
        info.local_world_size,
        info.master_addr,
        info.master_port,
    )


def strings_not_ints(environ=None):
    env = os.environ if environ is None else environ
    _reference_read(env)  # every check right, then the strings as they came
    return _k06().RankInfo(*(env[name].strip() for name in ENV_NAMES))


def first_missing_only(environ=None):
    env = os.environ if environ is None else environ
    for name in ENV_NAMES:
        if not env.get(name, "").strip():  # one at a time: the user fixes one, runs, fails again
            raise _k06().LaunchConfigError(f"{name} is not set: {_k06().HOW_TO_START}")
    return _reference_read(env)


def bare_key_error(environ=None):
    env = os.environ if environ is None else environ
    values = [env[name] for name in ENV_NAMES]  # a KeyError: one name, and no word on fixing it
    del values
    return _reference_read(env)


def int_error_escapes(environ=None):
    env = os.environ if environ is None else environ
    for name in ENV_NAMES:
        if name != "MASTER_ADDR" and env.get(name, "").strip():
            int(env[name])  # int("four") raises its own ValueError, naming no variable
    return _reference_read(env)


def no_consistency_checks(environ=None):
    env = os.environ if environ is None else environ
    missing = [name for name in ENV_NAMES if not env.get(name, "").strip()]
    if missing:
        raise _k06().LaunchConfigError(f"{', '.join(missing)} not set: {_k06().HOW_TO_START}")
    numbers = []
    for name in (n for n in ENV_NAMES if n != "MASTER_ADDR"):
        try:
            numbers.append(int(env[name]))
        except ValueError:
            raise _k06().LaunchConfigError(f"{name}={env[name]!r} is not a number") from None
    rank, local, size, local_size, port = numbers  # trusted as they are
    return _k06().RankInfo(rank, local, size, local_size, env["MASTER_ADDR"], port)


# Right answers written differently.


def checked_by_a_helper(environ=None):
    """The same checks, through a small helper per variable."""
    env = os.environ if environ is None else environ
    error = _k06().LaunchConfigError
    missing = [name for name in ENV_NAMES if not str(env.get(name, "")).strip()]
    if missing:
        raise error(f"not set: {' '.join(missing)}. {_k06().HOW_TO_START}")

    def number(name: str, low: int) -> int:
        try:
            value = int(env[name])
        except ValueError:
            raise error(f"{name}={env[name]!r}: expected a whole number") from None
        if value < low:
            raise error(f"{name}={value}: expected at least {low}")
        return value

    rank, local = number("RANK", 0), number("LOCAL_RANK", 0)
    size, local_size = number("WORLD_SIZE", 1), number("LOCAL_WORLD_SIZE", 1)
    port = number("MASTER_PORT", 1)
    if rank >= size:
        raise error(f"RANK={rank} is not below WORLD_SIZE={size}")
    if size % local_size:
        raise error(f"WORLD_SIZE={size} is not a multiple of LOCAL_WORLD_SIZE={local_size}")
    if local >= local_size:
        raise error(f"LOCAL_RANK={local} is not below LOCAL_WORLD_SIZE={local_size}")
    if rank % local_size != local:
        raise error(f"RANK={rank} and LOCAL_RANK={local} disagree (LOCAL_WORLD_SIZE={local_size})")
    if port > 65535:
        raise error(f"MASTER_PORT={port} is above 65535")
    return _k06().RankInfo(rank, local, size, local_size, env["MASTER_ADDR"].strip(), port)


# --------------------------------------------------------------------------- join_world


def env_init(info, backend="gloo", device=None, timeout=timedelta(minutes=5)):
    import torch.distributed as dist

    dist.init_process_group(  # the default env:// reads MASTER_ADDR/PORT, RANK, WORLD_SIZE
        backend, init_method="env://", timeout=timeout
    )


def join_as_local_rank(info, backend="gloo", device=None, timeout=timedelta(minutes=5)):
    import torch.distributed as dist

    dist.init_process_group(
        backend,
        init_method=f"tcp://{info.master_addr}:{info.master_port}",
        rank=info.local_rank,  # every node's local rank 0 claims to be rank 0
        world_size=info.world_size,
        timeout=timeout,
    )


def join_this_node_only(info, backend="gloo", device=None, timeout=timedelta(minutes=5)):
    import torch.distributed as dist

    dist.init_process_group(
        backend,
        init_method=f"tcp://{info.master_addr}:{info.master_port}",
        rank=info.rank,
        world_size=info.local_world_size,  # one node's processes, not the world
        timeout=timeout,
    )


def timeout_ignored(info, backend="gloo", device=None, timeout=timedelta(minutes=5)):
    import torch.distributed as dist

    dist.init_process_group(  # no timeout=: a host that never comes costs 30 minutes
        backend,
        init_method=f"tcp://{info.master_addr}:{info.master_port}",
        rank=info.rank,
        world_size=info.world_size,
    )


# Right answers written differently.


def through_a_store(info, backend="gloo", device=None, timeout=timedelta(minutes=5)):
    """A TCPStore made by hand: rank 0 serves it at MASTER_ADDR:MASTER_PORT."""
    import torch
    import torch.distributed as dist

    if device is not None and device.type == "cuda":
        torch.cuda.set_device(device)
    store = dist.TCPStore(
        info.master_addr, info.master_port, info.world_size, info.rank == 0, timeout=timeout
    )
    dist.init_process_group(
        backend, store=store, rank=info.rank, world_size=info.world_size, timeout=timeout
    )


# --------------------------------------------------------------------------- sum_of_ranks


def local_rank_plus_one(info, device):
    import torch
    import torch.distributed as dist

    total = torch.tensor([info.local_rank + 1.0], device=device)  # this node's number
    dist.all_reduce(total)
    return total.item()


def rank_not_plus_one(info, device):
    import torch
    import torch.distributed as dist

    total = torch.tensor([float(info.rank)], device=device)  # rank 0 adds nothing
    dist.all_reduce(total)
    return total.item()


# Right answers written differently.


def in_integers(info, device):
    import torch
    import torch.distributed as dist

    total = torch.tensor(info.rank + 1, device=device)
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return int(total)


# --------------------------------------------------------------------------- launch_node


def _environments(nnodes, node_rank, nproc_per_node, master_addr, master_port):
    k06 = _k06()
    return [
        {
            **os.environ,
            **k06.node_environment(
                nnodes, node_rank, nproc_per_node, local, master_addr, master_port
            ),
        }
        for local in range(nproc_per_node)
    ]


def one_at_a_time(
    command, nnodes, node_rank, nproc_per_node, master_addr, master_port, timeout=None
):
    for env in _environments(nnodes, node_rank, nproc_per_node, master_addr, master_port):
        code = subprocess.run(list(command), env=env).returncode  # waits before starting the next
        if code:
            raise _k06().NodeFailed(f"rank {env['RANK']} exited with status {code}")


def environment_alone(
    command, nnodes, node_rank, nproc_per_node, master_addr, master_port, timeout=None
):
    k06 = _k06()
    processes = [
        subprocess.Popen(  # only the six variables: PATH, PYTHONPATH, ... are gone
            list(command),
            env=k06.node_environment(
                nnodes, node_rank, nproc_per_node, local, master_addr, master_port
            ),
        )
        for local in range(nproc_per_node)
    ]
    for process in processes:
        process.wait()


def returns_after_the_first(
    command, nnodes, node_rank, nproc_per_node, master_addr, master_port, timeout=None
):
    envs = _environments(nnodes, node_rank, nproc_per_node, master_addr, master_port)
    processes = [subprocess.Popen(list(command), env=env) for env in envs]
    code = processes[0].wait()  # "they all end together"
    if code:
        raise _k06().NodeFailed(f"rank {envs[0]['RANK']} exited with status {code}")


def never_stops_the_others(
    command, nnodes, node_rank, nproc_per_node, master_addr, master_port, timeout=None
):
    envs = _environments(nnodes, node_rank, nproc_per_node, master_addr, master_port)
    processes = [subprocess.Popen(list(command), env=env) for env in envs]
    give_up = None if timeout is None else time.monotonic() + timeout
    while True:
        codes = [p.poll() for p in processes]
        for env, code in zip(envs, codes):
            if code not in (None, 0):  # raises, leaving the rest running
                raise _k06().NodeFailed(f"rank {env['RANK']} exited with status {code}")
        if all(code == 0 for code in codes):
            return
        if give_up is not None and time.monotonic() > give_up:
            running = [env["RANK"] for env, code in zip(envs, codes) if code is None]
            raise _k06().NodeFailed(f"ranks {', '.join(running)} still running at the timeout")
        time.sleep(0.05)


def waits_in_order(
    command, nnodes, node_rank, nproc_per_node, master_addr, master_port, timeout=None
):
    envs = _environments(nnodes, node_rank, nproc_per_node, master_addr, master_port)
    processes = [subprocess.Popen(list(command), env=env) for env in envs]
    try:
        for env, process in zip(envs, processes):
            code = process.wait(timeout)  # blocks on rank 2 while rank 3 has already failed
            if code:
                raise _k06().NodeFailed(f"rank {env['RANK']} exited with status {code}")
    finally:
        _k06()._stop(processes)


def ignores_its_timeout(
    command, nnodes, node_rank, nproc_per_node, master_addr, master_port, timeout=None
):
    envs = _environments(nnodes, node_rank, nproc_per_node, master_addr, master_port)
    processes = [subprocess.Popen(list(command), env=env) for env in envs]
    try:
        while True:  # polls well, but never looks at the clock
            codes = [p.poll() for p in processes]
            for env, code in zip(envs, codes):
                if code not in (None, 0):
                    raise _k06().NodeFailed(f"rank {env['RANK']} exited with status {code}")
            if all(code == 0 for code in codes):
                return
            time.sleep(0.05)
    finally:
        _k06()._stop(processes)


def _reference_loop(command, envs, timeout, failed):
    processes = [subprocess.Popen(list(command), env=env) for env in envs]
    give_up = None if timeout is None else time.monotonic() + timeout
    try:
        while True:
            codes = [p.poll() for p in processes]
            for env, code in zip(envs, codes):
                if code not in (None, 0):
                    raise _k06().NodeFailed(failed(env, code))
            if all(code == 0 for code in codes):
                return
            if give_up is not None and time.monotonic() > give_up:
                running = [env["RANK"] for env, code in zip(envs, codes) if code is None]
                raise _k06().NodeFailed(f"ranks {', '.join(running)} still running at the timeout")
            time.sleep(0.05)
    finally:
        _k06()._stop(processes)


def failure_without_a_rank(
    command, nnodes, node_rank, nproc_per_node, master_addr, master_port, timeout=None
):
    envs = _environments(nnodes, node_rank, nproc_per_node, master_addr, master_port)
    _reference_loop(command, envs, timeout, lambda env, code: "a process failed")


def names_the_local_rank(
    command, nnodes, node_rank, nproc_per_node, master_addr, master_port, timeout=None
):
    envs = _environments(nnodes, node_rank, nproc_per_node, master_addr, master_port)
    _reference_loop(  # the number on this node, not the rank the user sees in the logs
        command, envs, timeout, lambda env, code: f"rank {env['LOCAL_RANK']} exited with {code}"
    )


# Right answers written differently.


def waits_with_a_short_timeout(
    command, nnodes, node_rank, nproc_per_node, master_addr, master_port, timeout=None
):
    """Popen.wait(timeout=...) on each in turn, instead of poll() and sleep."""
    envs = _environments(nnodes, node_rank, nproc_per_node, master_addr, master_port)
    processes = [subprocess.Popen(list(command), env=env) for env in envs]
    start = time.monotonic()
    try:
        running = dict(zip([env["RANK"] for env in envs], processes))
        while running:
            for rank, process in list(running.items()):
                try:
                    code = process.wait(timeout=0.02)
                except subprocess.TimeoutExpired:
                    continue
                if code != 0:
                    raise _k06().NodeFailed(f"rank {rank} {_k06()._how_it_ended(code)}")
                del running[rank]
            if running and timeout is not None and time.monotonic() - start > timeout:
                raise _k06().NodeFailed(
                    f"ranks {', '.join(running)} outlived the {timeout} s timeout"
                )
    finally:
        _k06()._stop(processes)


# --------------------------------------------------------------------------- the catalogue

_LAYOUT = "test_node_environment_for_the_tutorial_layout"
_BAD_OPTIONS = "test_node_environment_rejects_bad_options"
_INCONSISTENT = "test_read_environment_rejects_inconsistent_values"

# Each mistake must fail the named tests with a message that says all of `says`.
MISTAKES = [
    Mistake(
        "rank_is_node_plus_local",
        replaces="node_environment",
        fails=[f"{_LAYOUT}[1-0-3]", f"{_LAYOUT}[1-2-5]"],
        says=["is node_rank + local_rank", "multiply the node rank by nproc_per_node"],
    ),
    Mistake(
        "world_size_is_nproc",
        replaces="node_environment",
        fails=[_LAYOUT],
        says=["WORLD_SIZE='3', expected '6'", "nnodes * nproc_per_node"],
    ),
    Mistake(
        "master_addr_of_this_host",
        replaces="node_environment",
        fails=[_LAYOUT],
        says=["MASTER_ADDR='localhost'", "never this host's own"],
    ),
    Mistake(
        "ints_not_strings",
        replaces="node_environment",
        fails=[_LAYOUT],
        says=["non-string values", "wrap them in str()"],
    ),
    Mistake(
        "no_option_checks",
        replaces="node_environment",
        fails=[_BAD_OPTIONS],
        says=["it must raise LaunchConfigError"],
    ),
    Mistake(
        "plain_value_error",
        replaces="node_environment",
        fails=[_BAD_OPTIONS],
        says=["raised ValueError", "raise the kata's LaunchConfigError"],
    ),
    Mistake(
        "local_rank_as_rank",
        replaces="read_environment",
        fails=["test_read_environment_as_torchrun_sets_it"],
        says=["rank=1 is LOCAL_RANK", "the rank in the whole world (3)"],
    ),
    Mistake(
        "strings_not_ints",
        replaces="read_environment",
        fails=["test_read_environment_as_torchrun_sets_it"],
        says=["rank='3'", "convert every number with int()"],
    ),
    Mistake(
        "first_missing_only",
        replaces="read_environment",
        fails=[
            "test_read_environment_names_every_missing_variable[only-master]",
            "test_read_environment_names_every_missing_variable[no-port-no-size]",
        ],
        says=["does not name", "name every missing variable at once"],
    ),
    Mistake(
        "bare_key_error",
        replaces="read_environment",
        fails=["test_read_environment_names_every_missing_variable[only-master]"],
        says=["raised KeyError", "check for missing variables first"],
    ),
    Mistake(
        "int_error_escapes",
        replaces="read_environment",
        fails=[f"{_INCONSISTENT}[size-not-a-number]", f"{_INCONSISTENT}[port-not-a-number]"],
        says=["raised ValueError", "catch int()'s ValueError"],
    ),
    Mistake(
        "no_consistency_checks",
        replaces="read_environment",
        fails=[
            f"{_INCONSISTENT}[negative-rank]",
            f"{_INCONSISTENT}[rank-beyond-world]",
            f"{_INCONSISTENT}[world-not-whole-nodes]",
            f"{_INCONSISTENT}[rank-and-local-rank-disagree]",
            f"{_INCONSISTENT}[port-too-big]",
        ],
        says=["it must raise LaunchConfigError", "a world that can never form"],
    ),
    Mistake(
        "env_init",
        replaces="join_world",
        fails=["test_join_world_joins_at_the_given_address"],
        says=["init_method='env://'", "meet at the info's address"],
    ),
    Mistake(
        "join_as_local_rank",
        replaces="join_world",
        fails=["test_join_world_joins_at_the_given_address"],
        says=["rank 1 called init_process_group with rank=0", "0 is info.local_rank"],
    ),
    Mistake(
        "join_this_node_only",
        replaces="join_world",
        fails=["test_join_world_joins_at_the_given_address"],
        says=["with world_size=1", "1 is info.local_world_size"],
    ),
    Mistake(
        "timeout_ignored",
        replaces="join_world",
        fails=["test_join_world_gives_up_after_its_timeout"],
        says=["without a timeout", "pass timeout=timeout on"],
    ),
    Mistake(
        "local_rank_plus_one",
        replaces="sum_of_ranks",
        fails=["test_sum_of_ranks_over_two_nodes_of_three"],
        says=["12 is the sum of local_rank + 1", "the global rank + 1 (info.rank)"],
    ),
    Mistake(
        "rank_not_plus_one",
        replaces="sum_of_ranks",
        fails=["test_sum_of_ranks_over_two_nodes_of_three"],
        says=["contribute rank + 1, not rank"],
    ),
    Mistake(
        "one_at_a_time",
        replaces="launch_node",
        fails=["test_launch_node_starts_every_local_rank_at_once"],
        says=["which had not been started", "start every process before waiting for any"],
    ),
    Mistake(
        "environment_alone",
        replaces="launch_node",
        fails=["test_launch_node_starts_every_local_rank_at_once"],
        says=["lost the launcher's own environment", "env={**os.environ"],
    ),
    Mistake(
        "returns_after_the_first",
        replaces="launch_node",
        # a learner meets it first as a launcher that waits on one rank while another failed
        # (in the test before, local rank 0 is the last of the node to end)
        fails=["test_launch_node_names_the_failed_rank_and_stops_the_others"],
        says=["was still waiting", "watch every process at once"],
    ),
    Mistake(
        "never_stops_the_others",
        replaces="launch_node",
        fails=[
            "test_launch_node_names_the_failed_rank_and_stops_the_others",
            "test_launch_node_stops_everything_at_its_timeout",
        ],
        says=["still running: stop", "(terminate, then kill)"],
    ),
    Mistake(
        "waits_in_order",
        replaces="launch_node",
        fails=["test_launch_node_names_the_failed_rank_and_stops_the_others"],
        says=["launch_node was still waiting 8 s later", "watch every process at once"],
    ),
    Mistake(
        "ignores_its_timeout",
        replaces="launch_node",
        fails=["test_launch_node_stops_everything_at_its_timeout"],
        says=["launch_node(timeout=2.0) was still waiting 8 s later", "check the clock"],
    ),
    Mistake(
        "failure_without_a_rank",
        replaces="launch_node",
        fails=["test_launch_node_names_the_failed_rank_and_stops_the_others"],
        says=["must name rank 3 and its exit status 7"],
    ),
    Mistake(
        "names_the_local_rank",
        replaces="launch_node",
        fails=["test_launch_node_names_the_failed_rank_and_stops_the_others"],
        says=["NodeFailed('rank 1 exited with 7')", "must name rank 3"],
    ),
]

# Each right answer must pass every test of its step.
RIGHT_ANSWERS = [
    RightAnswer("from_zip", replaces="node_environment"),
    RightAnswer("checked_by_a_helper", replaces="read_environment"),
    RightAnswer("through_a_store", replaces="join_world"),
    RightAnswer("in_integers", replaces="sum_of_ranks"),
    RightAnswer("waits_with_a_short_timeout", replaces="launch_node"),
]
