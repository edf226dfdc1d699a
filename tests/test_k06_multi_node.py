"""k06 several machines: the rank arithmetic, the environment checks, joining a world at an
address, the all-reduce check, the node launcher, and two real "nodes" on this machine (started
by hand and by torchrun)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from datetime import timedelta

import pytest
import torch

from dojo.curriculum import ROOT
from dojo.harness import impl
from dojo.harness.world import WorldDeadlock, run_world
from dojo.lang import N_, t, tn
from dojo.spec.testing import fake_hosts_or_skip, free_port, is_port_clash, run_module
from dojo.todo import KataTodo, find_todo

KATA = "k06_multi_node"
ENV_NAMES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# What torchrun gives rank 3 of 2 nodes x 2 processes (measured), extra variables included.
TORCHRUN_RANK_3 = {
    "RANK": "3",
    "LOCAL_RANK": "1",
    "WORLD_SIZE": "4",
    "LOCAL_WORLD_SIZE": "2",
    "GROUP_RANK": "1",
    "GROUP_WORLD_SIZE": "2",
    "ROLE_RANK": "3",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29500",
    "TORCHELASTIC_RUN_ID": "none",
    "TORCHELASTIC_USE_AGENT_STORE": "True",
}


def _loopback() -> str:
    names = {name for _, name in socket.if_nameindex()}
    return "lo" if "lo" in names or "lo0" not in names else "lo0"


def _raised(call, *args):
    """``("ok", value)`` or ``("raised", error)``; a todo goes straight through to the test."""
    try:
        return "ok", call(*args)
    except KataTodo:
        raise
    except Exception as error:
        todo = find_todo(error)
        if todo is not None:
            raise todo from None
        return "raised", error


# --------------------------------------------------------------------------- step 1


@pytest.mark.step(1)
@pytest.mark.parametrize("node, local, rank", [(0, 0, 0), (0, 2, 2), (1, 0, 3), (1, 2, 5)])
def test_node_environment_for_the_tutorial_layout(kata, node, local, rank):
    env = kata.node_environment(2, node, 3, local, "10.0.0.1", 29500)
    call = (
        f"node_environment(nnodes=2, node_rank={node}, nproc_per_node=3, local_rank={local}, ...)"
    )
    assert isinstance(env, dict), t(
        "{call} returned {env!r}, expected a dict of environment variables",
        call=call,
        env=env,
    )
    missing = [name for name in ENV_NAMES if name not in env]
    assert not missing, t(
        "{call} left out {missing}: a process needs all of {ENV_NAMES}",
        call=call,
        missing=missing,
        ENV_NAMES=list(ENV_NAMES),
    )
    not_text = {k: v for k, v in env.items() if not isinstance(v, str)}
    assert not not_text, t(
        "{call} gave non-string values {not_text}: environment variables are strings, "
        "wrap them in str()",
        call=call,
        not_text=not_text,
    )
    expected = {
        "RANK": str(rank),
        "LOCAL_RANK": str(local),
        "WORLD_SIZE": "6",
        "LOCAL_WORLD_SIZE": "3",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29500",
    }
    wrong = {k: (env[k], v) for k, v in expected.items() if env[k] != v}
    if not wrong:
        return
    why = {
        "RANK": t(
            "rank = node_rank * nproc_per_node + local_rank = {node} * 3 + {local}: the "
            "{before} ranks of the nodes before node {node} come first",
            node=node,
            local=local,
            before=node * 3,
        )
        if node
        else t("on node 0 the rank is the local rank"),
        "LOCAL_RANK": t("the local rank is the process's number on its own node"),
        "WORLD_SIZE": t(
            "WORLD_SIZE counts the processes of every node, nnodes * nproc_per_node "
            "(nproc_per_node alone is LOCAL_WORLD_SIZE)"
        ),
        "LOCAL_WORLD_SIZE": t(
            "LOCAL_WORLD_SIZE is the number of processes on one node, nproc_per_node"
        ),
        "MASTER_ADDR": t(
            "MASTER_ADDR is the address given, node 0's, where rank 0 listens: the same on every "
            "host, never this host's own"
        ),
        "MASTER_PORT": t("MASTER_PORT is the port given, the same on every host"),
    }
    if wrong.get("RANK", (None,))[0] == str(node + local) and node:
        why["RANK"] = t(
            "{added} is node_rank + local_rank: multiply the node rank by nproc_per_node, rank = "
            "{node} * 3 + {local} = {rank}",
            added=node + local,
            node=node,
            local=local,
            rank=rank,
        )
    if wrong.get("RANK", (None,))[0] == str(local) and node:
        why["RANK"] = t(
            "{local} is the local rank: RANK is the rank in the whole world, {rank}",
            local=local,
            rank=rank,
        )
    raise AssertionError(
        f"{call}:\n"
        + "\n".join(
            t(
                "  {name}={got!r}, expected {want!r}: {why}",
                name=k,
                got=got,
                want=want,
                why=why[k],
            )
            for k, (got, want) in wrong.items()
        )
    )


@pytest.mark.step(1)
@pytest.mark.parametrize(
    "nnodes, node_rank, nproc, local, addr, port, names, what",
    [
        (
            2,
            2,
            2,
            0,
            "10.0.0.1",
            29500,
            r"node.rank",
            N_("node rank 2 with 2 nodes (nodes are 0 and 1)"),
        ),
        (2, -1, 2, 0, "10.0.0.1", 29500, r"node.rank", N_("a negative node rank")),
        (0, 0, 2, 0, "10.0.0.1", 29500, r"nnodes|nodes", N_("zero nodes")),
        (2, 0, 0, 0, "10.0.0.1", 29500, r"nproc|per.node", N_("zero processes per node")),
        (2, 0, 2, 2, "10.0.0.1", 29500, r"local", N_("local rank 2 with 2 processes per node")),
        (2, 0, 2, 0, " ", 29500, r"addr", N_("an empty master address")),
        (2, 0, 2, 0, "10.0.0.1", 0, r"port", N_("port 0")),
        (2, 0, 2, 0, "10.0.0.1", 70000, r"port", N_("port 70000 (ports end at 65535)")),
    ],
)
def test_node_environment_rejects_bad_options(
    kata, nnodes, node_rank, nproc, local, addr, port, names, what
):
    outcome = _raised(kata.node_environment, nnodes, node_rank, nproc, local, addr, port)
    what = t(what)  # the parameter is English (and the test's id)
    call = f"node_environment({nnodes}, {node_rank}, {nproc}, {local}, {addr!r}, {port})"
    assert outcome[0] == "raised", t(
        "{call} ({what}) returned {outcome1!r}: it must raise LaunchConfigError",
        call=call,
        what=what,
        outcome1=outcome[1],
    )
    error = outcome[1]
    assert isinstance(error, kata.LaunchConfigError), t(
        "{call} ({what}) raised {type_name}: {error}; raise the kata's LaunchConfigError",
        call=call,
        what=what,
        type_name=type(error).__name__,
        error=error,
    )
    assert re.search(names, str(error), re.I), t(
        "{call} ({what}) raised LaunchConfigError({error!r}): the message must name the "
        "option that is wrong (matching {names!r}), so the user knows what to fix",
        call=call,
        what=what,
        error=str(error),
        names=names,
    )


# --------------------------------------------------------------------------- step 2


@pytest.mark.step(2)
def test_read_environment_as_torchrun_sets_it(kata):
    info = kata.read_environment(dict(TORCHRUN_RANK_3))
    expected = kata.RankInfo(
        rank=3,
        local_rank=1,
        world_size=4,
        local_world_size=2,
        master_addr="10.0.0.1",
        master_port=29500,
    )
    if info != expected:
        texts = [
            f"{field}={value!r}"
            for field, value in vars(info).items()
            if field != "master_addr" and isinstance(value, str)
        ]
        if texts:
            why = tn(
                "{fields} is a string: the environment holds only text, so convert every number "
                "with int()",
                "{fields} are strings: the environment holds only text, so convert every number "
                "with int()",
                len(texts),
                fields=", ".join(texts),
            )
        elif info.rank == 1:
            why = t(
                "rank=1 is LOCAL_RANK, the process's number on its node: RankInfo.rank is RANK, "
                "the rank in the whole world (3)"
            )
        elif info.world_size == 2:
            why = t(
                "world_size=2 is LOCAL_WORLD_SIZE, one node's processes: RankInfo.world_size is "
                "WORLD_SIZE, every node's (4)"
            )
        else:
            why = t("read each field from the variable of the same name")
        raise AssertionError(
            t(
                "read_environment(torchrun's environment for rank 3) returned {info!r}, "
                "expected {expected!r}: {why}",
                info=info,
                expected=expected,
                why=why,
            )
        )
    assert info.node_rank == 1


@pytest.mark.step(2)
def test_read_environment_reads_os_environ_by_default(kata, monkeypatch):
    for name, value in TORCHRUN_RANK_3.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    info = kata.read_environment()
    assert (info.rank, info.local_rank) == (2, 0), t(
        "with RANK=2 and LOCAL_RANK=0 in os.environ, read_environment() returned "
        "{info!r}: read os.environ when no mapping is given",
        info=info,
    )


@pytest.mark.step(2)
def test_node_environment_and_read_environment_agree(kata):
    for node in range(2):
        for local in range(3):
            env = kata.node_environment(2, node, 3, local, "host-a", 29500)
            info = kata.read_environment(env)
            assert (info.rank, info.local_rank, info.world_size, info.local_world_size) == (
                node * 3 + local,
                local,
                6,
                3,
            ), t(
                "node {node}, local rank {local} of 2 x 3: "
                "read_environment(node_environment(...)) gave {info!r}: what one "
                "launcher writes, the process must read back unchanged",
                node=node,
                local=local,
                info=info,
            )
            assert (info.master_addr, info.master_port) == ("host-a", 29500), t(
                "the master address came back as {info!r}",
                info=info,
            )


@pytest.mark.step(2)
@pytest.mark.parametrize(
    "environ, missing",
    [
        (
            {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"},
            ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"],
        ),
        ({**TORCHRUN_RANK_3, "MASTER_ADDR": ""}, ["MASTER_ADDR"]),
        (
            {k: v for k, v in TORCHRUN_RANK_3.items() if k not in ("MASTER_PORT", "WORLD_SIZE")},
            ["WORLD_SIZE", "MASTER_PORT"],
        ),
        ({}, list(ENV_NAMES)),
    ],
    ids=["only-master", "empty-addr", "no-port-no-size", "nothing"],
)
def test_read_environment_names_every_missing_variable(kata, environ, missing):
    outcome = _raised(kata.read_environment, dict(environ))
    assert outcome[0] == "raised", t(
        "read_environment with {missing} missing returned {outcome1!r}: it must raise "
        "LaunchConfigError",
        missing=missing,
        outcome1=outcome[1],
    )
    error = outcome[1]
    assert isinstance(error, kata.LaunchConfigError), t(
        "with {missing} missing, read_environment raised {type_name}: {error}; check for "
        "missing variables first and raise the kata's LaunchConfigError",
        missing=missing,
        type_name=type(error).__name__,
        error=error,
    )
    unnamed = [
        name for name in missing if not re.search(rf"(?<![A-Z_]){name}(?![A-Z_])", str(error))
    ]
    assert not unnamed, t(
        "with {missing} missing, the message {error!r} does not name {unnamed}: name "
        "every missing variable at once, so the user fixes them in one go",
        missing=missing,
        error=str(error),
        unnamed=unnamed,
    )
    assert "torchrun" in str(error), t(
        "the message {error!r} must say how to get these variables set: mention torchrun "
        "(and the manual launch options)",
        error=str(error),
    )


@pytest.mark.step(2)
@pytest.mark.parametrize(
    "change, names, what",
    [
        ({"WORLD_SIZE": "four"}, ["WORLD_SIZE"], N_("a world size that is not a number")),
        ({"RANK": "1.5"}, ["RANK"], N_("a rank that is not a whole number")),
        ({"RANK": "-1"}, ["RANK"], N_("a negative rank")),
        ({"RANK": "5", "LOCAL_RANK": "1"}, ["RANK", "WORLD_SIZE"], N_("rank 5 in a world of 4")),
        ({"WORLD_SIZE": "0"}, ["WORLD_SIZE"], N_("a world of 0")),
        (
            {"LOCAL_RANK": "2", "RANK": "2"},
            ["LOCAL_RANK"],
            N_("local rank 2 with 2 processes per node"),
        ),
        (
            {"LOCAL_WORLD_SIZE": "8"},
            ["LOCAL_WORLD_SIZE"],
            N_("8 processes per node in a world of 4"),
        ),
        (
            {"LOCAL_WORLD_SIZE": "3", "RANK": "1"},
            ["LOCAL_WORLD_SIZE"],
            N_("a world of 4 on nodes of 3"),
        ),
        (
            {"RANK": "2"},
            ["RANK", "LOCAL_RANK"],
            N_("rank 2 claiming local rank 1 on nodes of 2 (rank 2 is local rank 0)"),
        ),
        ({"MASTER_PORT": "http"}, ["MASTER_PORT"], N_("a port that is not a number")),
        ({"MASTER_PORT": "70000"}, ["MASTER_PORT"], N_("port 70000 (ports end at 65535)")),
    ],
    ids=[
        "size-not-a-number",
        "rank-not-whole",
        "negative-rank",
        "rank-beyond-world",
        "empty-world",
        "local-rank-beyond-node",
        "node-bigger-than-world",
        "world-not-whole-nodes",
        "rank-and-local-rank-disagree",
        "port-not-a-number",
        "port-too-big",
    ],
)
def test_read_environment_rejects_inconsistent_values(kata, change, names, what):
    environ = {**TORCHRUN_RANK_3, **change}
    shown = " ".join(f"{k}={v}" for k, v in change.items())
    outcome = _raised(kata.read_environment, environ)
    what = t(what)  # the parameter is English (and the test's id)
    assert outcome[0] == "raised", t(
        "read_environment with {shown} ({what}) returned {outcome1!r}: it must raise "
        "LaunchConfigError, or this process would wait for the timeout in a world that "
        "can never form",
        shown=shown,
        what=what,
        outcome1=outcome[1],
    )
    error = outcome[1]
    assert isinstance(error, kata.LaunchConfigError), t(
        "read_environment with {shown} ({what}) raised {type_name}: {error}; raise the "
        "kata's LaunchConfigError (catch int()'s ValueError and say which variable held "
        "what)",
        shown=shown,
        what=what,
        type_name=type(error).__name__,
        error=error,
    )
    unnamed = [name for name in names if not re.search(rf"(?<![A-Z_]){name}(?![A-Z_])", str(error))]
    assert not unnamed, t(
        "read_environment with {shown} ({what}) raised LaunchConfigError({error!r}): the "
        "message must name {unnamed}, so the user knows which variable to fix",
        shown=shown,
        what=what,
        error=str(error),
        unnamed=unnamed,
    )


# --------------------------------------------------------------------------- step 3


# Each rank notes the arguments join_world passes to init_process_group before the call runs, in
# a file: even when the world then fails to form (and the harness stops every rank), the test
# can say what each rank asked for.


class _InitRecorded:
    def __init__(self, folder: str, rank: int):
        self.path = os.path.join(folder, f"init-{rank}.json")

    def __enter__(self):
        import inspect

        import torch.distributed as dist

        self.original = original = dist.init_process_group
        path = self.path

        def init_process_group(*args, **kwargs):
            bound = inspect.signature(original).bind(*args, **kwargs).arguments
            timeout = bound.get("timeout")
            with open(path, "w") as f:
                json.dump(
                    {
                        "init_method": bound.get("init_method"),
                        "store": bound.get("store") is not None,
                        "rank": bound.get("rank", -1),
                        "world_size": bound.get("world_size", -1),
                        "timeout": None if timeout is None else timeout.total_seconds(),
                    },
                    f,
                )
            return original(*args, **kwargs)

        dist.init_process_group = init_process_group
        return self

    def __exit__(self, *exc):
        import torch.distributed as dist

        dist.init_process_group = self.original


def _init_calls(folder: str, world_size: int) -> list:
    calls = []
    for rank in range(world_size):
        try:
            with open(os.path.join(folder, f"init-{rank}.json")) as f:
                calls.append(json.load(f))
        except (OSError, ValueError):
            calls.append(None)
    return calls


def _init_problem(calls: list, port: int, complete: bool = True) -> str | None:
    """What the ranks' init_process_group calls got wrong, in the learner's terms (or None).
    ``complete``: every rank ran to its end (else a missing call may be a rank stopped early)."""
    world_size = len(calls)
    for rank, call in enumerate(calls):
        if call is None and not complete:
            continue
        if call is None:
            return t(
                "rank {rank}'s join_world never called dist.init_process_group: joining the "
                "world is that call",
                rank=rank,
            )
        where = f"tcp://127.0.0.1:{port}"
        if call["init_method"] != where and not call["store"]:
            return t(
                "rank {rank} called init_process_group with init_method={init_method!r}: the "
                "test gives join_world only a RankInfo (the environment holds no MASTER_ADDR or "
                "MASTER_PORT), so meet at the info's address: "
                'init_method=f"tcp://{{info.master_addr}}:{{info.master_port}}" (here {where!r})',
                rank=rank,
                init_method=call["init_method"],
                where=where,
            )
        if call["rank"] != rank:
            why = (
                t(
                    "0 is info.local_rank, its number on its own node (each node of this world "
                    "runs one process): pass rank=info.rank ({rank}), the rank in the whole world",
                    rank=rank,
                )
                if call["rank"] == 0
                else t("pass rank=info.rank ({rank})", rank=rank)
            )
            return t(
                "rank {rank} called init_process_group with rank={given}: {why}",
                rank=rank,
                given=call["rank"],
                why=why,
            )
        if call["world_size"] != world_size:
            why = (
                t(
                    "1 is info.local_world_size, one node's processes: pass "
                    "world_size=info.world_size ({world_size}), every node's together",
                    world_size=world_size,
                )
                if call["world_size"] == 1
                else t("pass world_size=info.world_size ({world_size})", world_size=world_size)
            )
            return t(
                "rank {rank} called init_process_group with world_size={given}: {why}",
                rank=rank,
                given=call["world_size"],
                why=why,
            )
    return None


def _join_and_report(rank, world_size, port, backend, device_type, folder):
    import torch.distributed as dist

    from dojo.harness.impl import load_kata

    for name in ENV_NAMES:  # join_world must use the info it is given, not the environment
        os.environ.pop(name, None)
    kata = load_kata(KATA)
    device = torch.device(device_type) if device_type == "cpu" else torch.device("cuda", 0)
    # Laid out as nodes of one process each: the local rank (0) is not the rank.
    info = kata.RankInfo(rank, 0, world_size, 1, "127.0.0.1", port)
    try:
        with _InitRecorded(folder, rank):
            kata.join_world(info, backend, device, timedelta(seconds=20))
        if not dist.is_initialized():
            return {"initialized": False}
        total = torch.tensor([rank + 1.0], device=device)
        dist.all_reduce(total)
        return {
            "initialized": True,
            "rank": dist.get_rank(),
            "world_size": dist.get_world_size(),
            "backend": dist.get_backend(),
            "sum": total.item(),
            "current_device": torch.cuda.current_device() if device.type == "cuda" else None,
        }
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _join_world(world_size, backend="gloo", device_type="cpu"):
    for attempt in range(2):
        port = free_port()
        with tempfile.TemporaryDirectory(prefix="k06-join-") as folder:
            try:
                results = run_world(
                    _join_and_report,
                    world_size,
                    port,
                    backend,
                    device_type,
                    folder,
                    init_group=False,
                    deadline=30,
                    env={"GLOO_SOCKET_IFNAME": _loopback()},
                )
            except AssertionError as failure:
                problem = _init_problem(_init_calls(folder, world_size), port, complete=False)
                if problem:
                    raise AssertionError(
                        t(
                            "join_world with {world_size} ranks, laid out as {world_size} "
                            "nodes of one process: {problem}\n"
                            "\n"
                            "{failure}",
                            world_size=world_size,
                            problem=problem,
                            failure=failure,
                        )
                    ) from None
                if attempt == 0 and is_port_clash(str(failure)):
                    continue
                raise
            problem = _init_problem(_init_calls(folder, world_size), port)
        assert not problem, t(
            "join_world with {world_size} ranks: {problem}",
            world_size=world_size,
            problem=problem,
        )
        return results


@pytest.mark.step(3)
def test_join_world_joins_at_the_given_address(kata):
    results = _join_world(2)
    for rank, result in enumerate(results):
        assert result["initialized"], t(
            "rank {rank}: after join_world, dist.is_initialized() is False",
            rank=rank,
        )
        assert (result["rank"], result["world_size"]) == (rank, 2), t(
            "rank {rank} joined as rank {rank2} of {world_size}: pass rank=info.rank and "
            "world_size=info.world_size to init_process_group",
            rank=rank,
            rank2=result["rank"],
            world_size=result["world_size"],
        )
        assert result["sum"] == 3.0, t(
            "rank {rank}: an all-reduce in the joined world gave {sum}, expected 3.0",
            rank=rank,
            sum=result["sum"],
        )


def _join_alone(rank, world_size, port, folder):
    from dojo.harness.impl import load_kata

    if rank != 0:
        return None  # the peer that never comes
    kata = load_kata(KATA)
    info = kata.RankInfo(0, 0, world_size, world_size, "127.0.0.1", port)
    start = time.monotonic()
    try:
        with _InitRecorded(folder, rank):
            kata.join_world(info, "gloo", torch.device("cpu"), timedelta(seconds=1.5))
    except KataTodo:
        raise
    except Exception as error:
        return "raised", f"{type(error).__name__}: {error}", time.monotonic() - start
    return "returned", None, time.monotonic() - start


@pytest.mark.step(3)
def test_join_world_gives_up_after_its_timeout(kata, tmp_path):
    try:
        [outcome, _] = run_world(
            _join_alone,
            2,
            free_port(),
            str(tmp_path),
            init_group=False,
            deadline=30,
            straggler=8,
            env={"GLOO_SOCKET_IFNAME": _loopback()},
        )
    except WorldDeadlock as failure:
        [call, _] = _init_calls(str(tmp_path), 2)
        if call is None:
            given = t("never called init_process_group, yet did not return")
        elif call["timeout"] is None:
            given = t(
                "called init_process_group without a timeout (its default is 30 minutes): pass "
                "timeout=timeout on"
            )
        else:
            given = t(
                "gave init_process_group timeout={seconds} s: pass timeout=timeout, the one "
                "join_world was given",
                seconds=f"{call['timeout']:g}",
            )
        raise AssertionError(
            t(
                "join_world(info, timeout=1.5 s) was still waiting 8 s later for a peer that "
                "never came: it {given}\n"
                "\n"
                "{failure}",
                given=given,
                failure=failure,
            )
        ) from None
    assert outcome[0] == "raised", t(
        "join_world returned although its only peer never came: it must wait for the whole world"
    )
    assert outcome[2] < 6, t(
        "join_world gave up after {outcome2:.1f} s, with timeout=1.5 s: pass the timeout on",
        outcome2=outcome[2],
    )


@pytest.mark.step(3)
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_join_world_nccl_on_one_gpu(kata):
    [result] = _join_world(1, "nccl", "cuda")
    assert result["backend"] == "nccl" and result["sum"] == 1.0, t(
        "NCCL world of 1 on cuda:0 gave {result}",
        result=result,
    )
    assert result["current_device"] == 0, t(
        "join_world must torch.cuda.set_device(device) for a CUDA device"
    )


@pytest.mark.step(3)
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_join_world_gloo_on_cuda_with_two_ranks(kata):
    results = _join_world(2, "gloo", "cuda")
    assert [r["sum"] for r in results] == [3.0, 3.0], t(
        "gloo with CUDA tensors on 2 ranks gave {results}",
        results=results,
    )


# --------------------------------------------------------------------------- step 4


def _sum_on_two_nodes_of_three(rank, world_size):
    from dojo.harness.impl import load_kata

    kata = load_kata(KATA)
    info = kata.RankInfo(rank, rank % 3, world_size, 3, "127.0.0.1", 1)
    total = kata.sum_of_ranks(info, torch.device("cpu"))
    return total.tolist() if isinstance(total, torch.Tensor) else total


@pytest.mark.step(4)
def test_sum_of_ranks_over_two_nodes_of_three(kata, world):
    totals = world.run(_sum_on_two_nodes_of_three, 6)
    for rank, total in enumerate(totals):
        if isinstance(total, list):
            raise AssertionError(
                t(
                    "rank {rank} returned a tensor {total}: return a Python number (.item())",
                    rank=rank,
                    total=total,
                )
            )
        assert isinstance(total, (int, float)), t(
            "rank {rank} returned {total!r}, expected a number",
            rank=rank,
            total=total,
        )
        if total == 21:
            continue
        if total == rank + 1:
            why = t(
                "that is its own contribution: did every rank call dist.all_reduce on its tensor?"
            )
        elif total == 15:
            why = t("15 is 0+1+...+5: contribute rank + 1, not rank")
        elif total == 12:
            why = t("12 is the sum of local_rank + 1: contribute the global rank + 1 (info.rank)")
        else:
            why = t("every rank contributes rank + 1 and all-reduces with SUM")
        raise AssertionError(
            t(
                "rank {rank} returned {total}, expected 1+2+...+6 = 21: {why}",
                rank=rank,
                total=total,
                why=why,
            )
        )


# --------------------------------------------------------------------------- step 5

# A stand-in for a rank process: cheap (no torch), it reports its environment to a file, then
# behaves as `mode` says. Every mode first waits (like init_process_group) until every process
# of the node is up, so that a launcher that starts them one at a time shows.
_STAND_IN = r"""
import json, os, sys, time
folder, mode, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
rank, local = os.environ.get("RANK", "unset"), os.environ.get("LOCAL_RANK")
names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "K06_KEPT")
with open(os.path.join(folder, f".rank-{rank}.json"), "w") as f:
    json.dump({"pid": os.getpid(), **{n: os.environ.get(n) for n in names}}, f)
os.replace(os.path.join(folder, f".rank-{rank}.json"), os.path.join(folder, f"rank-{rank}.json"))
end = time.monotonic() + ALONE_S
while len([n for n in os.listdir(folder) if n.startswith("rank-")]) < count:
    if time.monotonic() > end:
        open(os.path.join(folder, f"alone-{rank}"), "w").close()
        sys.exit(5)
    time.sleep(0.02)
if mode == "fail" and rank == "3":
    sys.exit(7)
if mode == "first-ends" and local == "0":
    sys.exit(0)
if mode == "together" and local == "0":  # ends last, so waiting on the first alone passes here
    for name in os.listdir(folder):
        if name.startswith("rank-") and name != f"rank-{rank}.json":
            with open(os.path.join(folder, name)) as f:
                pid = json.load(f)["pid"]
            end = time.monotonic() + ALONE_S
            while time.monotonic() < end:
                try:
                    with open(f"/proc/{pid}/stat") as f:
                        if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                            break
                except OSError:
                    break
                time.sleep(0.02)
if mode != "together":
    time.sleep(60)
""".replace("ALONE_S", "10")


def _children() -> dict[int, str]:
    """This process's children still running (not zombies): pid -> their RANK."""
    me, found = os.getpid(), {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[1]) != me or fields[0] == "Z":
                continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                names = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
        except (OSError, ValueError, IndexError):
            continue
        found[int(entry)] = names.get(b"RANK", b"?").decode()
    return found


# Stand-ins start in milliseconds (no torch) and end at once or at launch_node's 2 s timeout: a
# launch_node still waiting this long after never returns (the harness stretches it while they
# still use the CPU).
LAUNCH_DEADLINE_S = 8.0


def _launch_stand_ins(_rank, _world_size, folder, mode, nproc, timeout):
    """launch_node on stand-ins as node 1 of 2; right after it returns or raises, before anyone
    tears anything down, which of the processes it started are still running (then stopped)."""
    from dojo.harness.impl import load_kata

    kata = load_kata(KATA)
    os.environ["K06_KEPT"] = "from the launcher"
    command = [sys.executable, "-c", _STAND_IN, folder, mode, str(nproc)]
    before = set(_children())
    start = time.monotonic()
    try:
        kata.launch_node(command, 2, 1, nproc, "10.0.0.1", 29500, timeout=timeout)
        outcome = ("returned", None)
    except KataTodo:
        raise
    except Exception as error:
        outcome = ("raised", type(error).__name__, str(error))
    seconds = time.monotonic() - start
    leftovers = {pid: rank for pid, rank in _children().items() if pid not in before}
    for pid in leftovers:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except OSError:
            pass
    return outcome, seconds, sorted(leftovers.values())


def _ranks(numbers) -> str:
    """``rank 4``, ``ranks 4 and 5``, ``ranks 3, 4 and 5``."""
    numbers = [str(n) for n in numbers]
    if len(numbers) == 1:
        return t("rank {rank}", rank=numbers[0])
    return t("ranks {ranks} and {last}", ranks=", ".join(numbers[:-1]), last=numbers[-1])


def _were(numbers) -> str:
    return tn("{ranks} was", "{ranks} were", len(numbers), ranks=_ranks(numbers))


def _reports(folder):
    reports = {}
    for name in os.listdir(folder):
        if not name.startswith("rank-"):
            continue
        with open(os.path.join(folder, name)) as f:
            report = json.load(f)
        reports[report["RANK"]] = report
    return reports


def _still_running(pids):
    running = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    running.append(pid)
        except OSError:
            pass
    return running


@pytest.mark.step(5)
def test_launch_node_starts_every_local_rank_at_once(kata, tmp_path):
    [(outcome, _, leftovers)] = run_world(
        _launch_stand_ins, 1, str(tmp_path), "together", 3, 30.0, init_group=False, deadline=40
    )
    alone = sorted(p.name[len("alone-") :] for p in tmp_path.glob("alone-*"))
    assert not alone, t(
        "the process(es) with RANK {names} waited 10 s for the other processes of their "
        "node, which had not been started: start every process before waiting for any "
        "(in a real world each one waits in init_process_group for the others)",
        names=", ".join(alone),
    )
    reports = _reports(tmp_path)
    assert outcome[0] == "returned", t(
        "launch_node raised {outcome1}: {outcome2}",
        outcome1=outcome[1],
        outcome2=outcome[2],
    )
    assert not leftovers, t(
        "launch_node returned while {were} still running: wait until every process has exited",
        were=_were(leftovers),
    )
    assert sorted(reports) == ["3", "4", "5"], t(
        "node 1 of 2 with 3 processes each started processes with RANK {reports}, expected 3, 4, 5",
        reports=sorted(reports),
    )
    for rank, report in reports.items():
        expected = {
            "LOCAL_RANK": str(int(rank) - 3),
            "WORLD_SIZE": "6",
            "LOCAL_WORLD_SIZE": "3",
            "MASTER_ADDR": "10.0.0.1",
            "MASTER_PORT": "29500",
        }
        wrong = {k: report[k] for k, v in expected.items() if report[k] != v}
        assert not wrong, t(
            "the process with RANK={rank} got {wrong}, expected {expected}: use node_environment",
            rank=rank,
            wrong=wrong,
            expected=expected,
        )
        assert report["K06_KEPT"] == "from the launcher", t(
            "the process with RANK={rank} lost the launcher's own environment (PATH, "
            "PYTHONPATH, ...): pass env={{**os.environ, **node_environment(...)}}",
            rank=rank,
        )


@pytest.mark.step(5)
def test_launch_node_names_the_failed_rank_and_stops_the_others(kata, tmp_path):
    try:
        [(outcome, _, leftovers)] = run_world(
            _launch_stand_ins, 1, str(tmp_path), "fail", 2, None, init_group=False,
            deadline=LAUNCH_DEADLINE_S,
        )  # fmt: skip
    except WorldDeadlock as failure:
        raise AssertionError(
            t(
                "rank 3 exited with status 7 as soon as rank 2 was up, but launch_node was "
                "still waiting {LAUNCH_DEADLINE_S:g} s later (for rank 2, which runs for a "
                "minute): watch every process at once (poll() them in a loop) and stop the "
                "rest at the first failure\n"
                "\n"
                "{failure}",
                LAUNCH_DEADLINE_S=LAUNCH_DEADLINE_S,
                failure=failure,
            )
        ) from None
    assert outcome[0] == "raised", t(
        "rank 3 exited with status 7, but launch_node returned: it must raise NodeFailed"
    )
    assert outcome[1] == "NodeFailed", t(
        "launch_node raised {outcome1}: {outcome2}; raise the kata's NodeFailed",
        outcome1=outcome[1],
        outcome2=outcome[2],
    )
    assert re.search(r"rank 3\b", outcome[2]) and "7" in outcome[2], t(
        "NodeFailed({outcome2!r}) must name rank 3 and its exit status 7",
        outcome2=outcome[2],
    )
    assert not leftovers, t(
        "launch_node raised NodeFailed while {were} still running: stop the others "
        "(terminate, then kill) and wait for them before raising, or they run on with no "
        "one watching",
        were=_were(leftovers),
    )


@pytest.mark.step(5)
def test_launch_node_stops_everything_at_its_timeout(kata, tmp_path):
    # Rank 3 (local rank 0) ends at once with status 0; ranks 4 and 5 would run for a minute.
    try:
        [(outcome, _, leftovers)] = run_world(
            _launch_stand_ins, 1, str(tmp_path), "first-ends", 3, 2.0, init_group=False,
            deadline=LAUNCH_DEADLINE_S,
        )  # fmt: skip
    except WorldDeadlock as failure:
        raise AssertionError(
            t(
                "launch_node(timeout=2.0) was still waiting {LAUNCH_DEADLINE_S:g} s later: "
                "check the clock in the polling loop and raise NodeFailed once the timeout "
                "has passed\n"
                "\n"
                "{failure}",
                LAUNCH_DEADLINE_S=LAUNCH_DEADLINE_S,
                failure=failure,
            )
        ) from None
    if outcome[0] == "returned":
        raise AssertionError(
            t(
                "launch_node returned while {were} still running: rank 3 had ended, but the "
                "others had not. Wait for every process, not the first to end; here ranks 4 and 5 "
                "never end, so the 2 s timeout must raise NodeFailed",
                were=_were(leftovers),
            )
            if leftovers
            else t(
                "launch_node returned, but ranks 4 and 5 never end: raise NodeFailed at the timeout"
            )
        )
    assert outcome[1] == "NodeFailed", t(
        "launch_node(timeout=2.0) raised {outcome1}: {outcome2}; raise the kata's NodeFailed",
        outcome1=outcome[1],
        outcome2=outcome[2],
    )
    named = [r for r in ("4", "5") if re.search(rf"\b{r}\b", outcome[2])]
    assert named == ["4", "5"], t(
        "NodeFailed({outcome2!r}) at the timeout must name the ranks still running, 4 and 5",
        outcome2=outcome[2],
    )
    assert not leftovers, t(
        "launch_node raised NodeFailed at its timeout while {were} still running: stop "
        "them (terminate, then kill) and wait for them before raising",
        were=_were(leftovers),
    )


# --------------------------------------------------------------------------- the program


@pytest.mark.step(2)
def test_program_explains_an_incomplete_environment():
    done = run_module(KATA, timeout=60, env={"RANK": "0", "MASTER_ADDR": "127.0.0.1"})
    assert done.returncode not in (0, 3), t(
        "with only RANK set the program exited with {returncode}",
        returncode=done.returncode,
    )
    for name in ("LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_PORT"):
        assert name in done.stderr, t(
            "with only RANK and MASTER_ADDR set, the error must name {name}:\n{stderr}",
            name=name,
            stderr=done.stderr,
        )
    assert "Traceback" not in done.stderr, t(
        "a bad environment deserves a message, not a traceback:\n{stderr}",
        stderr=done.stderr,
    )


@pytest.mark.step(1)
def test_program_refuses_a_node_rank_beyond_the_nodes():
    done = run_module(
        KATA, "--nnodes", "2", "--node-rank", "2", "--master-port", "29500", timeout=60
    )
    assert done.returncode == 2 and re.search(r"node.rank", done.stderr), t(
        "--nnodes 2 --node-rank 2 must stop with a message about the node rank, got exit "
        "{returncode}:\n"
        "{stderr}",
        returncode=done.returncode,
        stderr=done.stderr,
    )


_RESULT = re.compile(r"^\[rank (\d+)\] result (\{.*\})$", re.M)


def _descendants(pid):
    """Every process below ``pid`` (torchrun starts its workers in sessions of their own)."""
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    children.setdefault(int(f.read().rsplit(")", 1)[1].split()[1]), []).append(
                        int(entry)
                    )
            except OSError:
                pass
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _kill_tree(process):
    for pid in _descendants(process.pid) + [process.pid]:
        for kill in (os.killpg, os.kill):
            try:
                kill(pid, signal.SIGKILL)
            except OSError:
                pass
    process.wait()


def _run_two_nodes(make_command, deadline=90.0):
    """Start node 0 and node 1 at once on loopback; return each node's (exit status, output)."""
    for attempt in range(2):
        port = free_port()
        env = {k: v for k, v in os.environ.items() if k not in ENV_NAMES}
        env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=_loopback())
        logs = []
        nodes = []
        try:
            for node in range(2):
                log = tempfile.TemporaryFile("w+")
                logs.append(log)
                nodes.append(
                    subprocess.Popen(
                        make_command(node, port),
                        cwd=ROOT,
                        env=env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,  # a group of its own: killed whole on failure
                    )
                )
            end = time.monotonic() + deadline
            for process in nodes:
                try:
                    process.wait(max(0.1, end - time.monotonic()))
                except subprocess.TimeoutExpired:
                    outputs = _read(logs)
                    raise AssertionError(
                        t(
                            "the two nodes did not finish within {seconds} s.",
                            seconds=f"{deadline:g}",
                        )
                        + "\n\n"
                        + _show(outputs)
                    ) from None
        finally:
            for process in nodes:
                _kill_tree(process)
        outputs = _read(logs)
        results = [(process.returncode, text) for process, text in zip(nodes, outputs)]
        if attempt == 0 and any(code for code, _ in results) and is_port_clash("".join(outputs)):
            continue
        if any(code for code, _ in results):
            todo = find_todo(AssertionError("\n".join(outputs)))
            if todo is not None:
                raise todo
            raise AssertionError(
                t("a node failed.") + "\n\n" + _show(outputs, [code for code, _ in results])
            )
        return results


def _read(logs):
    texts = []
    for log in logs:
        log.seek(0)
        texts.append(log.read())
        log.close()
    return texts


def _show(outputs, codes=None):
    return "\n\n".join(
        (
            t("node {node} printed:", node=n)
            if codes is None
            else t("node {node} (exit status {status}) printed:", node=n, status=codes[n])
        )
        + f"\n{text.strip()[-3000:]}"
        for n, text in enumerate(outputs)
    )


def _results_by_node(results):
    by_node = []
    for _, text in results:
        by_node.append({int(rank): json.loads(body) for rank, body in _RESULT.findall(text)})
    everything = {rank: r for found in by_node for rank, r in found.items()}
    assert sorted(everything) == [0, 1, 2, 3], (
        t(
            "2 nodes x 2 processes must report ranks 0-3 once each, got {ranks}.",
            ranks=sorted(everything),
        )
        + "\n\n"
        + _show([text for _, text in results])
    )
    for rank, result in everything.items():
        assert result["sum"] == 10.0 and result["world_size"] == 4, t(
            "rank {rank} reported sum {sum} in a world of {world_size}, expected 10.0 in "
            "a world of 4",
            rank=rank,
            sum=result["sum"],
            world_size=result["world_size"],
        )
        assert rank == result["node_rank"] * 2 + result["local_rank"], t(
            "rank {rank} says it is local rank {local_rank} of node {node_rank}: rank = "
            "node_rank * nproc_per_node + local_rank",
            rank=rank,
            local_rank=result["local_rank"],
            node_rank=result["node_rank"],
        )
    leftovers = _still_running(r["pid"] for r in everything.values())
    assert not leftovers, t(
        "rank processes {leftovers} were still running after their node exited",
        leftovers=leftovers,
    )
    return by_node


@pytest.mark.step(5)
@pytest.mark.slow  # four rank processes, each importing torch: ~8 s of CPU
def test_two_nodes_started_by_hand():
    def command(node, port):
        return [
            sys.executable,
            *("-m", f"{impl.current()}.{KATA}", "--nnodes", "2", "--node-rank", str(node)),
            *("--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(port)),
            *("--timeout", "30"),
        ]

    by_node = _results_by_node(_run_two_nodes(command))
    _check_ranks_of_each_node(by_node, ["the node", "the node"])


@pytest.mark.step(4)
@pytest.mark.slow  # two agents and four ranks, each importing torch: ~11 s of CPU
def test_two_nodes_started_by_torchrun():
    def command(node, port):
        return [
            sys.executable,
            *("-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node)),
            *("--nproc-per-node", "2", "--rdzv-backend", "c10d"),
            *("--rdzv-endpoint", f"127.0.0.1:{port}", "--max-restarts", "0"),
            *("-m", f"{impl.current()}.{KATA}", "--timeout", "30"),
        ]

    _check_one_node_each(_results_by_node(_run_two_nodes(command)))


def _check_ranks_of_each_node(by_node, names) -> None:
    """Node n (``names[n]``, started with --node-rank n) ran ranks 2n and 2n + 1."""
    for n, found in enumerate(by_node):
        assert sorted(found) == [2 * n, 2 * n + 1], t(
            "{node}, started with --node-rank {n}, ran ranks {found}, expected {first} and "
            "{second}: rank = node_rank * nproc_per_node + local_rank",
            node=names[n],
            n=n,
            found=sorted(found),
            first=2 * n,
            second=2 * n + 1,
        )


def _check_one_node_each(by_node) -> None:
    """Each torchrun ran one node's ranks. The c10d rendezvous numbers the nodes in the order
    they join, so either torchrun may be node 0."""
    assert sorted(sorted(found) for found in by_node) == [[0, 1], [2, 3]], t(
        "each torchrun must run one node's ranks, got {ranks}",
        ranks=[sorted(f) for f in by_node],
    )


# --------------------------------------------------------------------------- two real hosts
#
# Two fake hosts, host-a and host-b: network namespaces on this machine, each with its own lo and
# an eth0 on a private 192.168.X.0/24 (a home network, whose addresses sort above 127.x as
# gloo's pitfalls need), reaching each other and nothing else (dojo.spec.hosts). Linux and root only;
# elsewhere these tests skip, saying what is missing. Port 29500 is free on every fake host.

PORT = 29500
SHORT = 3  # --timeout for the tests that wait for a timeout: seconds, not minutes
STARTUP_S = 25  # a busy machine may take this long to start two ranks that import torch


@pytest.fixture
def two_hosts():
    """host-a (node 0) and host-b, removed with everything in them when the test ends."""
    with fake_hosts_or_skip(2, within="192.168.0.0/16") as hosts:
        yield hosts


class _Node:
    """One command started on one fake host, its output in a file."""

    def __init__(self, host, argv, **env):
        self.host = host
        self.log = tempfile.TemporaryFile("w+")
        environment = {
            k: v for k, v in os.environ.items() if k not in (*ENV_NAMES, "GLOO_SOCKET_IFNAME")
        }
        environment.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **env)
        self.started = time.monotonic()
        self.process = host.popen(
            argv, cwd=ROOT, env=environment, stdout=self.log, stderr=subprocess.STDOUT
        )
        self.seconds = None

    def wait(self, until: float) -> bool:
        try:
            self.process.wait(max(0.1, until - time.monotonic()))
        except subprocess.TimeoutExpired:
            return False
        self.seconds = time.monotonic() - self.started
        return True

    @property
    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def shown(self) -> str:
        code = self.process.poll()
        status = t("still running") if code is None else t("exit status {code}", code=code)
        said = t(
            "{host} ({address}, {status}) printed:",
            host=self.host.name,
            address=self.host.address,
            status=status,
        )
        return f"{said}\n{_plain(self.output)}"


def _plain(text: str) -> str:
    """A node's output without torch's C++ log lines and stack frames: what a learner reads."""
    noise = re.compile(r"^(\[[WE]\d{4} |frame #|Exception raised from|<omitting|\[/__w/)")
    kept = [line for line in text.splitlines() if not noise.match(line)]
    return "\n".join(kept).strip()[-3000:]


def _by_hand(node, master_addr, timeout=30):
    return [
        sys.executable,
        "-m",
        f"{impl.current()}.{KATA}",
        *("--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "2"),
        *("--master-addr", master_addr, "--master-port", str(PORT), "--timeout", str(timeout)),
    ]


def _wait(nodes, seconds, what):
    """Wait for every node to end; a todo in any output goes to the test; a node still running
    after ``seconds`` fails it."""
    until = time.monotonic() + seconds
    ended = [node.wait(until) for node in nodes]
    for node in nodes:
        todo = find_todo(AssertionError(node.output))
        if todo is not None:
            raise todo
    if not all(ended):
        raise AssertionError(
            t("{what}: still running after {seconds} s.", what=what, seconds=f"{seconds:g}")
            + "\n\n"
            + "\n\n".join(node.shown() for node in nodes)
        )


def _check_results(nodes):
    """Every rank's result line, each on the host it ran on, with that host's address."""
    for node in nodes:
        assert node.process.returncode == 0, (
            t("{host} failed.", host=node.host.name)
            + "\n\n"
            + "\n\n".join(n.shown() for n in nodes)
        )
    by_node = _results_by_node([(0, node.output) for node in nodes])
    for node, found in zip(nodes, by_node):
        for rank, result in sorted(found.items()):
            assert result["host"] == node.host.name, t(
                "rank {rank} was started on {name} but reports host {host!r}",
                rank=rank,
                name=node.host.name,
                host=result["host"],
            )
            assert result.get("address") == node.host.address, t(
                "rank {rank} on {name} reports address {result!r}, expected {address}: "
                "its result line shows the address this host reaches MASTER_ADDR from "
                "(_address_towards)",
                rank=rank,
                name=node.host.name,
                result=result.get("address"),
                address=node.host.address,
            )
    return by_node


@pytest.mark.step(5)
@pytest.mark.slow  # two hosts, four ranks importing torch: ~8 s of CPU
def test_two_hosts_started_by_hand(two_hosts):
    a, b = two_hosts
    nodes = [_Node(host, _by_hand(n, a.address)) for n, host in enumerate((a, b))]
    _wait(nodes, 90, t("the two hosts started by hand"))
    _check_ranks_of_each_node(_check_results(nodes), [node.host.name for node in nodes])


@pytest.mark.step(4)
@pytest.mark.slow  # two agents and four ranks, each importing torch: ~11 s of CPU
def test_two_hosts_started_by_torchrun(two_hosts):
    a, b = two_hosts
    command = [
        sys.executable,
        *("-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2"),
        *("--rdzv-backend", "c10d", "--rdzv-endpoint", f"{a.address}:29400"),
        *("--max-restarts", "0", "-m", f"{impl.current()}.{KATA}", "--timeout", "30"),
    ]
    nodes = [_Node(host, command) for host in (a, b)]
    _wait(nodes, 120, t("the two torchruns"))
    _check_one_node_each(_check_results(nodes))


def _failed_with(node, *texts, within):
    """The node failed, within ``within`` seconds, printing every one of ``texts``."""
    assert node.process.returncode not in (0, None), t(
        "{name} was expected to fail, but finished.\n\n{node}",
        name=node.host.name,
        node=node.shown(),
    )
    missing = [text for text in texts if text not in node.output]
    assert not missing, t(
        "{name} failed, but its message does not say {missing}: a learner needs to read "
        "what went wrong and what to set.\n"
        "\n"
        "{node}",
        name=node.host.name,
        missing=missing,
        node=node.shown(),
    )
    assert node.seconds < within, t(
        "{name} took {seconds:.0f} s to fail, more than {within:g} s.\n\n{node}",
        name=node.host.name,
        seconds=node.seconds,
        within=within,
        node=node.shown(),
    )


@pytest.mark.step(5)
@pytest.mark.slow  # two hosts start torch, host-a waits for gloo's timeout: ~20 s
@pytest.mark.parametrize("master", ["address", "name"], ids=["master-ip", "master-name"])
def test_host_name_on_loopback_is_explained(two_hosts, master):
    """Debian's /etc/hosts on host-a: `127.0.1.1 host-a`. Without GLOO_SOCKET_IFNAME gloo listens
    at 127.0.1.1 there, and host-b's ranks, told to connect to 127.0.1.1, reach their own
    loopback: they say so at once. host-a's ranks, whom no one reaches, say why at gloo's
    timeout. (On a 10.x network gloo would have host-a dial out instead, and it would work by
    luck: these hosts live on a 192.168.x network, as most home networks do.)"""
    a, b = two_hosts
    a.set_names({"host-a": "127.0.1.1", "host-b": b.address})
    master_addr = a.address if master == "address" else "host-a"
    nodes = [_Node(host, _by_hand(n, master_addr, SHORT)) for n, host in enumerate((a, b))]
    _wait([nodes[1]], STARTUP_S + 30, t("host-b, told to reach host-a's ranks at 127.0.1.1"))
    _failed_with(
        nodes[1], "127.0.1.1", "loopback", "GLOO_SOCKET_IFNAME=eth0", within=STARTUP_S + SHORT
    )
    if master == "address":  # once is enough: the other side, after gloo's own timeout
        _wait([nodes[0]], STARTUP_S + 60, t("host-a, whose gloo listens at 127.0.1.1"))
        _failed_with(
            nodes[0], "'host-a' resolves to 127.0.1.1", "GLOO_SOCKET_IFNAME=eth0", within=90
        )


@pytest.mark.step(5)
@pytest.mark.slow  # two hosts, four ranks importing torch: ~8 s of CPU
def test_gloo_socket_ifname_fixes_a_host_name_on_loopback(two_hosts):
    a, b = two_hosts
    a.set_names({"host-a": "127.0.1.1", "host-b": b.address})
    nodes = [
        _Node(host, _by_hand(n, a.address), GLOO_SOCKET_IFNAME="eth0")
        for n, host in enumerate((a, b))
    ]
    _wait(nodes, 90, t("two hosts with GLOO_SOCKET_IFNAME=eth0, host-a's name on 127.0.1.1"))
    _check_results(nodes)


@pytest.mark.step(5)
@pytest.mark.slow  # two hosts start torch, host-a waits its 3 s: ~8 s
def test_gloo_on_the_loopback_interface_is_refused(two_hosts):
    """GLOO_SOCKET_IFNAME=lo (right on one machine, as the loopback tests above use it) on real
    hosts: gloo would listen where no other host can reach it. host-b, whose rank 0 is surely
    elsewhere, says so before joining; host-a (MASTER_ADDR is its own: the others might have
    shared its machine) says so when its ranks give up waiting."""
    a, b = two_hosts
    nodes = [
        _Node(host, _by_hand(n, a.address, SHORT), GLOO_SOCKET_IFNAME="lo")
        for n, host in enumerate((a, b))
    ]
    _wait(nodes, STARTUP_S + 30, t("two hosts with GLOO_SOCKET_IFNAME=lo"))
    # host-b refuses before joining (its ranks say so, below), but a busy machine's start of
    # torch can take the start-up allowance and a little more
    _failed_with(
        nodes[1], "GLOO_SOCKET_IFNAME=lo", "GLOO_SOCKET_IFNAME=eth0", within=STARTUP_S + 2 * SHORT
    )
    assert "rank 2: GLOO_SOCKET_IFNAME=lo" in nodes[1].output or (
        "rank 3: GLOO_SOCKET_IFNAME=lo" in nodes[1].output
    ), t(
        "host-b's ranks must refuse before they join.\n\n{nodes}",
        nodes=nodes[1].shown(),
    )
    _failed_with(
        nodes[0],
        "GLOO_SOCKET_IFNAME=lo",
        "GLOO_SOCKET_IFNAME=eth0",
        within=STARTUP_S + 4 * SHORT,
    )


@pytest.mark.step(5)
@pytest.mark.slow  # two hosts start torch, one waits its 3 s: ~8 s
def test_a_closed_rendezvous_port_is_named(two_hosts):
    """A firewall on host-a drops TCP to port 29500 from other hosts: host-b's ranks wait in
    silence, then, at their --timeout, name the address and the port."""
    from dojo.spec.hosts import nft_availability

    reason = nft_availability()
    if reason:
        pytest.skip(reason)
    a, b = two_hosts
    a.drop_incoming_tcp(PORT)
    nodes = [_Node(host, _by_hand(n, a.address, SHORT)) for n, host in enumerate((a, b))]
    _wait(nodes, STARTUP_S + 30, t("two hosts, port 29500 closed on host-a"))
    _failed_with(nodes[1], f"{a.address}:{PORT}", "firewall", within=STARTUP_S + 4 * SHORT)
    _failed_with(nodes[0], f"{a.address}:{PORT}", "of each other", within=STARTUP_S + 4 * SHORT)


@pytest.mark.step(5)
@pytest.mark.slow  # one host, then the other, each waiting its 3 s: ~12 s
def test_a_host_started_late_meets_the_timeout(two_hosts):
    """host-a starts alone and gives up at its --timeout; host-b, started after that, finds no
    one at host-a's address and gives up at its own. Each says what it waited for."""
    a, b = two_hosts
    first = _Node(a, _by_hand(0, a.address, SHORT))
    _wait([first], STARTUP_S + 30, t("host-a, alone"))
    _failed_with(first, f"{a.address}:{PORT}", "of each other", within=STARTUP_S + 4 * SHORT)
    late = _Node(b, _by_hand(1, a.address, SHORT))
    _wait([late], STARTUP_S + 30, t("host-b, started after host-a gave up"))
    _failed_with(
        late, f"could not reach rank 0 at {a.address}:{PORT}", within=STARTUP_S + 4 * SHORT
    )
