"""k06 · Several machines: one world across nodes, started by hand or by torchrun.

THE IDEA
    The tutorial ends with "run it on several machines". Nothing about the training changes:
    every process still needs its rank, the world size, and where rank 0 waits for the others.
    What changes is who starts the processes and how each one learns who it is.

        host A = node 0                       host B = node 1
        local rank  0    1                    local rank  0    1
        rank        0    1                    rank        2    3

        all four connect to MASTER_ADDR:MASTER_PORT, on host A, where rank 0 listens

        rank       = node_rank * nproc_per_node + local_rank
        world size = nnodes * nproc_per_node

    Each host runs a launcher that starts its ``nproc_per_node`` processes and gives each one
    this environment (torchrun uses exactly these names):

        RANK  LOCAL_RANK  WORLD_SIZE  LOCAL_WORLD_SIZE  MASTER_ADDR  MASTER_PORT

    So one script works under both launchers: it reads the environment, checks it, joins the
    world at ``tcp://MASTER_ADDR:MASTER_PORT`` and runs. LOCAL_RANK picks the GPU on its node
    (``cuda:LOCAL_RANK``); RANK is the rank in the whole world. A wrong or missing variable
    must stop the process at once with a message that says what to set: the alternative is
    every other host waiting for the timeout.

    Between real hosts, three more things must hold. Every host reaches MASTER_ADDR:MASTER_PORT
    (a firewall that drops the port looks exactly like a host that never came); every host
    starts within --timeout seconds of the others; and gloo listens where the other hosts can
    reach it: at the address of GLOO_SOCKET_IFNAME's interface, or else at the address this
    host's name resolves to, which many Debian/Ubuntu machines set to 127.0.1.1 (loopback: no
    other host can connect there). On every host, GLOO_SOCKET_IFNAME=eth0 (the interface facing
    the others, see ``ip -br addr``) settles it; NCCL reads NCCL_SOCKET_IFNAME. The program
    below checks what it can before joining and explains the rest when the timeout comes.

    What a world opens, for as long as it runs: the store at MASTER_ADDR:MASTER_PORT (or
    torchrun's rendezvous endpoint, HOST_A:29400) listens on every interface of host A, and
    gloo (or NCCL) listens on every host at random ports of its interface. Whoever reaches them
    can join or disturb the job, and what arrives is trusted (``all_gather_object`` unpickles
    it: code runs). So run it on a private network (a cluster's, a VPN), name that network's
    interface (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME), and let a firewall admit the other
    hosts' addresses (all TCP: the ports are random) and nobody else; never on a shared or
    public network with those ports open.

    Launching by hand (this module), on every host, with its own --node-rank:
        python -m katas.k06_multi_node --nnodes 2 --node-rank 0 --nproc-per-node 2 \\
            --master-addr HOST_A --master-port 29500
    Launching with torchrun, on every host (the same line on each: with the c10d rendezvous
    torchrun numbers the nodes itself in the order they join, and ignores --node-rank):
        torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d \\
            --rdzv-endpoint HOST_A:29400 -m katas.k06_multi_node

STEPS
    1. ``node_environment``: the environment a launcher gives one process: the rank
       arithmetic above, after checking the launch options (a clear ``LaunchConfigError``).
    2. ``read_environment``: the other side: read and check those six variables and return a
       ``RankInfo``; missing, non-numeric or inconsistent values raise ``LaunchConfigError``
       naming the variables and what to set.
    3. ``join_world``: pin the GPU (when the device is CUDA), then ``init_process_group`` at
       ``tcp://MASTER_ADDR:MASTER_PORT`` with the rank, world size and timeout from the info.
    4. ``sum_of_ranks``: the workload: every rank contributes ``rank + 1``; one all-reduce;
       every rank returns the total, ``world_size * (world_size + 1) / 2``.
    5. ``launch_node``: the manual launcher: start this node's processes with their
       environments, all at once; stop the others at the first failure (or the timeout) and
       raise ``NodeFailed`` naming the rank and its exit status.

WHAT THE TESTS CHECK
    The rank arithmetic and every kind of bad option or environment, in-process; a real world
    joined at the given address; the sum on a 6-rank world laid out as 2 nodes x 3; the
    launcher's environments, its failure handling and its timeout, with cheap stand-in
    processes; then the real thing on one machine: two "nodes" started by hand and two started
    by torchrun on loopback, every rank checking its sum. Where the machine allows (Linux, as
    root), two fake hosts with addresses of their own (network namespaces): both launches again,
    and each pitfall above (a host name on 127.0.1.1, gloo on lo, a closed port, a late host)
    with the message it ends in.

RUN IT
    .venv/bin/python -m katas.k06_multi_node --nproc-per-node 4         (one node, four processes)
    two terminals on one machine:
    .venv/bin/python -m katas.k06_multi_node --nnodes 2 --node-rank 0 --nproc-per-node 2 --master-port 29500
    .venv/bin/python -m katas.k06_multi_node --nnodes 2 --node-rank 1 --nproc-per-node 2 --master-port 29500
    two hosts, A at 192.168.1.10 and B (the same line on both, with its own --node-rank):
    GLOO_SOCKET_IFNAME=eth0 .venv/bin/python -m katas.k06_multi_node --nnodes 2 --node-rank 0 \\
        --nproc-per-node 2 --master-addr 192.168.1.10 --master-port 29500
    add --train to train kata k05's model across all the ranks after the check.
"""

from __future__ import annotations

# torch is imported inside the functions that use it: a node's launcher never needs it, and
# importing it costs every process ~1.5 s.
import argparse
import gc
import ipaddress
import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

from dojo.console import run_program, say

if TYPE_CHECKING:
    import torch

ENV_NAMES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
HOW_TO_START = (
    "start this script with torchrun (which sets them), or with --nnodes/--node-rank/"
    "--nproc-per-node/--master-addr/--master-port (which starts each process with them)"
)


class LaunchConfigError(ValueError):
    """The launch options or a process's environment are incomplete or inconsistent.

    The message says which option or variable is wrong and what to set instead.
    """


class NodeFailed(RuntimeError):
    """A process this node started failed, or the node ran past its timeout; the message
    names the rank and how it ended."""


class WorldNotFormed(RuntimeError):
    """The ranks did not all meet within the timeout; the message says what this rank saw
    (which address and port, how many ranks came) and the likely causes across hosts."""


@dataclass(frozen=True)
class RankInfo:
    """Who this process is, as its launcher told it."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    master_addr: str
    master_port: int

    @property
    def node_rank(self) -> int:
        return self.rank // self.local_world_size  # every node runs local_world_size processes


def node_environment(
    nnodes: int,
    node_rank: int,
    nproc_per_node: int,
    local_rank: int,
    master_addr: str,
    master_port: int,
) -> dict[str, str]:
    """The environment for process ``local_rank`` of node ``node_rank`` (all values strings)."""
    # BEGIN STEP 1: the environment of one process of one node
    # TODO: the six variables of ENV_NAMES, as strings, that process local_rank of node
    #   node_rank needs: its rank in the whole world and on its node, the size of the whole world
    #   and of one node, and node 0's address and port (the same on every host). Bad options (no
    #   node or no process, a node rank or local rank out of range, a blank address, a port
    #   outside 1-65535) raise LaunchConfigError naming the option and what to give instead.
    #   The tests check the 2 x 3 layout of the lesson and each kind of bad option.
    if nnodes < 1 or nproc_per_node < 1:
        raise LaunchConfigError(
            f"--nnodes {nnodes} --nproc-per-node {nproc_per_node}: a job needs at least one node "
            "and at least one process per node"
        )
    if not 0 <= node_rank < nnodes:
        numbering = (
            "with one node, its node rank is 0 (MASTER_ADDR's host)"
            if nnodes == 1
            else f"number the hosts {_numbers(0, nnodes - 1)}, each host its own number, "
            "MASTER_ADDR's host 0"
        )
        raise LaunchConfigError(
            f"--node-rank {node_rank} does not fit --nnodes {nnodes}: {numbering}"
        )
    if not 0 <= local_rank < nproc_per_node:
        numbering = (
            "the one process of a node is local rank 0"
            if nproc_per_node == 1
            else f"local ranks are {_numbers(0, nproc_per_node - 1)}"
        )
        raise LaunchConfigError(
            f"local rank {local_rank} does not fit --nproc-per-node {nproc_per_node}: {numbering}"
        )
    if not str(master_addr).strip():
        raise LaunchConfigError(
            "--master-addr is empty: give the address of node 0's host, the same on every host"
        )
    if not 1 <= master_port <= 65535:
        raise LaunchConfigError(
            f"--master-port {master_port} is not a port (1-65535): give a free port on node 0's "
            "host, the same on every host"
        )
    return {
        "RANK": str(node_rank * nproc_per_node + local_rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(nnodes * nproc_per_node),
        "LOCAL_WORLD_SIZE": str(nproc_per_node),
        "MASTER_ADDR": str(master_addr),
        "MASTER_PORT": str(master_port),
    }
    # END STEP 1


def read_environment(environ: Mapping[str, str] | None = None) -> RankInfo:
    """This process's ``RankInfo`` from its environment (``os.environ`` unless given one)."""
    env = os.environ if environ is None else environ
    # BEGIN STEP 2: read and check the environment
    # TODO: this process's RankInfo (numbers as int) from the six variables of ENV_NAMES. Anything
    #   wrong raises LaunchConfigError (never a bare KeyError or ValueError) whose message names
    #   the variables, their values and what to set: every missing or blank variable at once
    #   (and how to get them set, HOW_TO_START), a value that is not a whole number, a size
    #   below 1 or a negative rank, values that contradict each other (a rank outside the world,
    #   a world that is not a whole number of nodes, a local rank outside its node, a RANK that
    #   is not LOCAL_RANK on its node), a port outside 1-65535. The tests try each of these,
    #   and torchrun's own environment.
    missing = [name for name in ENV_NAMES if not env.get(name, "").strip()]
    if missing:
        verb = "is" if len(missing) == 1 else "are"
        raise LaunchConfigError(f"{', '.join(missing)} {verb} not set: {HOW_TO_START}")
    numbers = {}
    for name in ENV_NAMES:
        if name == "MASTER_ADDR":
            continue
        try:
            numbers[name] = int(env[name])
        except ValueError:
            raise LaunchConfigError(
                f"{name}={env[name]!r} is not a whole number: {HOW_TO_START}"
            ) from None
    rank, local_rank = numbers["RANK"], numbers["LOCAL_RANK"]
    world_size, local_world_size, port = (
        numbers["WORLD_SIZE"],
        numbers["LOCAL_WORLD_SIZE"],
        numbers["MASTER_PORT"],
    )
    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        if numbers[name] < 1:
            raise LaunchConfigError(
                f"{name}={numbers[name]}: a world and a node need at least one process"
            )
    for name in ("RANK", "LOCAL_RANK"):
        if numbers[name] < 0:
            raise LaunchConfigError(f"{name}={numbers[name]}: ranks count from 0")
    if rank >= world_size:
        numbering = (
            "a world of one process has rank 0 only"
            if world_size == 1
            else f"ranks are {_numbers(0, world_size - 1)}"
        )
        raise LaunchConfigError(
            f"RANK={rank} but WORLD_SIZE={world_size}: {numbering}. WORLD_SIZE counts the "
            "processes of every node together (nnodes x nproc_per_node)"
        )
    if local_world_size > world_size or world_size % local_world_size:
        raise LaunchConfigError(
            f"WORLD_SIZE={world_size} is not a whole number of nodes of LOCAL_WORLD_SIZE="
            f"{local_world_size} processes: set WORLD_SIZE = nnodes x LOCAL_WORLD_SIZE"
        )
    if local_rank >= local_world_size:
        numbering = (
            "a node of one process has local rank 0 only"
            if local_world_size == 1
            else f"local ranks are {_numbers(0, local_world_size - 1)} on every node"
        )
        raise LaunchConfigError(
            f"LOCAL_RANK={local_rank} but LOCAL_WORLD_SIZE={local_world_size}: {numbering}"
        )
    if rank % local_world_size != local_rank:
        raise LaunchConfigError(
            f"RANK={rank} does not match LOCAL_RANK={local_rank}: with LOCAL_WORLD_SIZE="
            f"{local_world_size}, rank = node_rank x {local_world_size} + local_rank, so RANK={rank} "
            f"is local rank {rank % local_world_size} of node {rank // local_world_size}"
        )
    if not 1 <= port <= 65535:
        raise LaunchConfigError(
            f"MASTER_PORT={port} is not a port (1-65535): set it to a free port on rank 0's host, "
            "the same on every node"
        )
    return RankInfo(
        rank, local_rank, world_size, local_world_size, env["MASTER_ADDR"].strip(), port
    )
    # END STEP 2


def join_world(
    info: RankInfo,
    backend: str = "gloo",
    device: torch.device | None = None,
    timeout: timedelta = timedelta(minutes=5),
) -> None:
    """Join the world ``info`` describes: every rank meets rank 0 at MASTER_ADDR:MASTER_PORT."""
    import torch
    import torch.distributed as dist

    # BEGIN STEP 3: join the world at MASTER_ADDR:MASTER_PORT
    # TODO: afterwards this process is rank info.rank of a world of info.world_size (the default
    #   process group), having met the others at MASTER_ADDR:MASTER_PORT as the info gives them
    #   (not the environment); a world that never forms ends in an error once `timeout` has
    #   passed. On a CUDA device, that device is this process's current one first. The tests
    #   join 2 ranks laid out as 2 nodes of 1, and one rank whose peer never comes.
    if device is not None and device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL and every new CUDA tensor use this rank's own GPU
    dist.init_process_group(
        backend,
        init_method=f"tcp://{info.master_addr}:{info.master_port}",
        rank=info.rank,
        world_size=info.world_size,
        timeout=timeout,  # a host that never comes ends in an error, not a 30-minute hang
    )
    # END STEP 3


def sum_of_ranks(info: RankInfo, device: torch.device) -> float:
    """Every rank contributes ``rank + 1``; every rank returns the total over the world."""
    import torch
    import torch.distributed as dist

    # BEGIN STEP 4: the all-reduce every rank checks
    # TODO: every rank contributes its global rank + 1, and every rank returns the total over
    #   the whole world as a Python number (2 nodes x 3 processes: 21).
    # END TODO
    # rank + 1, not rank: no rank contributes zero, so a rank left out shows in the total
    contribution = torch.tensor([info.rank + 1.0], device=device)
    dist.all_reduce(contribution, op=dist.ReduceOp.SUM)
    return contribution.item()
    # END STEP 4


def launch_node(
    command: Sequence[str],
    nnodes: int,
    node_rank: int,
    nproc_per_node: int,
    master_addr: str,
    master_port: int,
    timeout: float | None = None,
) -> None:
    """Run ``command`` once per local rank of this node, each with its environment; wait for all.

    Raises ``NodeFailed`` at the first process that exits with a non-zero status (or when
    ``timeout`` seconds pass), after stopping the others.
    """
    # BEGIN STEP 5: start this node's processes and watch them
    # TODO: run `command` once per local rank of this node, each process with the launcher's own
    #   environment plus its node_environment(...), all of them started before waiting for any
    #   (each waits in init_process_group for the others). Return once every one has exited
    #   with status 0. At the first non-zero exit raise NodeFailed naming the rank and how it
    #   ended (_how_it_ended words it); once `timeout` seconds have passed, NodeFailed naming
    #   the ranks still running. Returning or raising (Ctrl-C too), it leaves no process of
    #   this node running: the tests look for leftovers the moment launch_node is done.
    environments = [
        node_environment(nnodes, node_rank, nproc_per_node, local, master_addr, master_port)
        for local in range(nproc_per_node)
    ]
    processes = []
    give_up = None if timeout is None else time.monotonic() + timeout
    try:
        # All at once: each process waits in init_process_group for the others.
        for env in environments:
            processes.append(subprocess.Popen(list(command), env={**os.environ, **env}))
        while True:
            codes = [p.poll() for p in processes]
            for env, code in zip(environments, codes):
                if code not in (None, 0):
                    raise NodeFailed(
                        f"rank {env['RANK']} (local rank {env['LOCAL_RANK']}) {_how_it_ended(code)}"
                    )
            if all(code == 0 for code in codes):
                return
            if give_up is not None and time.monotonic() > give_up:
                running = [env["RANK"] for env, code in zip(environments, codes) if code is None]
                were = "was" if len(running) == 1 else "were"
                raise NodeFailed(
                    f"{_ranks(running)} {were} still running after the {timeout:g} s timeout"
                )
            time.sleep(0.05)
    finally:
        _stop(processes)  # on failure, timeout or Ctrl-C; a no-op when all have exited
    # END STEP 5


def _how_it_ended(code: int) -> str:
    if code < 0:
        return f"was killed by signal {signal.Signals(-code).name} (exit status {code})"
    return f"exited with status {code}"


def _numbers(first: int, last: int) -> str:
    """``3``, ``2 and 3``, ``0 to 5``: a run of numbers, said properly however long it is."""
    if first == last:
        return str(first)
    return f"{first} and {last}" if last == first + 1 else f"{first} to {last}"


def _ranks(numbers: Sequence) -> str:
    """``rank 4``, ``ranks 4 and 5``, ``ranks 3, 4 and 5``."""
    numbers = [str(n) for n in numbers]
    if len(numbers) == 1:
        return f"rank {numbers[0]}"
    return f"ranks {', '.join(numbers[:-1])} and {numbers[-1]}"


def _stop(processes: list[subprocess.Popen]) -> None:
    """Ask every running process to stop, then kill what is left; reap them all."""
    for process in processes:
        if process.poll() is None:
            process.terminate()
    end = time.monotonic() + 5.0
    for process in processes:
        try:
            process.wait(max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


# --------------------------------------------------------------------------- the program


def _free_port() -> int:
    # Only good enough for a job on this one machine: another program may take the port
    # between this check and rank 0 binding it. A job across hosts agrees on a fixed port.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_this_rank(args: argparse.Namespace) -> None:
    """What every process of the world does, however it was started."""
    info = read_environment()  # first: a bad environment stops the process before torch loads

    import torch.distributed as dist

    from dojo.devices import choose_for_this_machine, rank_device

    # Chosen per node: NCCL on cuda:LOCAL_RANK when this node has a GPU per local rank.
    backend, device_type = choose_for_this_machine(info.local_world_size, args.backend, args.device)
    os.environ["DOJO_DEVICE"] = device_type  # rank_device() and kata k05's training read it
    device = rank_device()
    problem = _gloo_address_problem(info, backend)
    if problem:  # a world across hosts that could only hang: say so now, not after the timeout
        raise LaunchConfigError(f"rank {info.rank}: {problem}")
    try:
        join_world(info, backend, device, timedelta(seconds=args.timeout))
    except Exception as error:  # a todo or a mistake of the learner's goes through unexplained
        why = _why_no_world(info, backend, args.timeout, error)
        if why is None:
            raise
        raise WorldNotFormed(f"rank {info.rank}: {why}") from None
    try:
        total = sum_of_ranks(info, device)
        expected = info.world_size * (info.world_size + 1) / 2
        say(
            info.rank,
            "result",
            json.dumps(
                {
                    "rank": info.rank,
                    "local_rank": info.local_rank,
                    "node_rank": info.node_rank,
                    "pid": os.getpid(),
                    "world_size": info.world_size,
                    "local_world_size": info.local_world_size,
                    "host": socket.gethostname(),
                    "address": _address_towards(info.master_addr),
                    "backend": backend,
                    "device": str(device),
                    "sum": total,
                    "expected": expected,
                    "ok": total == expected,
                }
            ),
        )
        if total != expected:
            raise RuntimeError(
                f"rank {info.rank}: the all-reduce gave {total}, expected {expected}"
            )
        if args.train:
            _train(info, args.epochs)
    finally:
        gc.collect()  # free tensors before the group goes (see the harness findings)
        dist.destroy_process_group()


# --------------------------------------------------------------------------- across real hosts
# What goes wrong between hosts, said before it turns into a wait (the gloo address), or after
# (the timeout). These read the network only: a todo or the learner's own bug goes through.


def _address_towards(host: str) -> str:
    """This host's own address on the way to ``host``: where the other hosts reach it."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))  # UDP: nothing is sent; the kernel only picks the route
            return probe.getsockname()[0]
    except OSError:
        return "unknown"


def _is_loopback(address: str | None) -> bool:
    try:
        return address is not None and ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def _resolve(name: str) -> str | None:
    try:
        return socket.gethostbyname(name)
    except OSError:
        return None


def _interface_addresses() -> dict[str, str]:
    """This host's network interfaces and their IPv4 addresses (Linux; empty elsewhere)."""
    found = {}
    try:
        import fcntl

        names = [name for _, name in socket.if_nameindex()]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            for name in names:
                try:
                    request = struct.pack("256s", name[:15].encode())
                    reply = fcntl.ioctl(probe.fileno(), 0x8915, request)  # SIOCGIFADDR
                    found[name] = socket.inet_ntoa(reply[20:24])
                except OSError:
                    pass  # an interface without an IPv4 address
    except (ImportError, OSError):
        return {}
    return found


def _facing(master_addr: str) -> tuple[str, str]:
    """The interface (and its address) this host reaches MASTER_ADDR through, or else its one
    interface that is not loopback; placeholders where that cannot be told."""
    towards = _address_towards(master_addr)
    outward = {n: a for n, a in _interface_addresses().items() if not _is_loopback(a)}
    facing = [n for n, a in outward.items() if a == towards] or list(outward)
    if len(facing) == 1:
        return facing[0], outward[facing[0]]
    return "<the interface facing the other hosts>", "<its address>"


def _ifname_fix(master_addr: str) -> str:
    """``GLOO_SOCKET_IFNAME=eth0``: what to set on every host."""
    return f"GLOO_SOCKET_IFNAME={_facing(master_addr)[0]}"


def _loopback_gloo(info: RankInfo, master: str) -> str | None:
    """Why gloo on this host would listen where no other host can reach it, or None.

    gloo listens at the address of GLOO_SOCKET_IFNAME's interface, or else at the one this
    host's name resolves to, and tells every other rank to connect there.
    """
    fix = _ifname_fix(master)
    chosen = os.environ.get("GLOO_SOCKET_IFNAME", "").strip()
    if chosen:
        interfaces = _interface_addresses()
        first = chosen.split(",")[0]
        if interfaces and first not in interfaces:
            return (
                f"GLOO_SOCKET_IFNAME={chosen}, but this host has no interface {first!r} (it has "
                f"{', '.join(sorted(interfaces))}): set {fix}, the interface that reaches "
                f"MASTER_ADDR {info.master_addr} (`ip -br addr` lists them)"
            )
        if _is_loopback(interfaces.get(first)):
            return (
                f"GLOO_SOCKET_IFNAME={chosen} is this host's loopback ({interfaces[first]}), but "
                f"the world spans hosts (MASTER_ADDR {info.master_addr}): gloo listens where no "
                f"other host can reach it, and the ranks wait for the timeout. Set {fix} on "
                "every host (the interface facing the others; lo is for a world on one machine)"
            )
        return None
    name = socket.gethostname()
    address = _resolve(name)
    if _is_loopback(address):
        return (
            f"this host's name {name!r} resolves to {address}, a loopback address (Debian and "
            f"Ubuntu put `127.0.1.1 {name}` in /etc/hosts), and without GLOO_SOCKET_IFNAME gloo "
            f"listens there: the ranks on other hosts are told to connect to {address}, their "
            f"own loopback, and wait for the timeout. Set {fix} on every host (the interface "
            f"facing the others, see `ip -br addr`), or map {name} to {_facing(master)[1]} "
            "in /etc/hosts"
        )
    return None


def _across_hosts(info: RankInfo, backend: str) -> str | None:
    """MASTER_ADDR's address when this is a gloo world of several nodes that is not all on
    loopback (so across hosts, or at least possibly), else None."""
    if backend != "gloo" or info.world_size == info.local_world_size:
        return None
    master = _resolve(info.master_addr)
    return None if master is None or _is_loopback(master) else master


def _gloo_address_problem(info: RankInfo, backend: str) -> str | None:
    """Before joining: gloo on this host would listen on a loopback address (or a missing
    interface) while rank 0 is surely on another host. None where that is not certain: where
    MASTER_ADDR is this host's own, the other nodes may share this machine, and the timeout
    explains it (``_why_no_world``)."""
    master = _across_hosts(info, backend)
    own = set(_interface_addresses().values())
    if master is None or not own or master in own:
        return None
    return _loopback_gloo(info, master)


def _why_no_world(info: RankInfo, backend: str, timeout: float, error: BaseException) -> str | None:
    """What a failed join means across hosts, in plain words; None when it is no network error."""
    text = str(error)
    said = (
        f"(torch: {text.strip().splitlines()[-1][:300] if text.strip() else type(error).__name__})"
    )
    where = f"{info.master_addr}:{info.master_port}"
    waited = f"the {timeout:g} s timeout (--timeout)"
    master = _across_hosts(info, backend)
    here = _loopback_gloo(info, master) if master else None  # this host's own gloo address
    if "connectFullMesh" in text:  # the ranks met at MASTER_ADDR, then could not connect
        if backend == "gloo" and info.world_size > info.local_world_size:
            here = _loopback_gloo(info, master or info.master_addr)  # even if rank 0 is local
        remote = re.search(r"remote=\[([^\]]+)\]:(\d+)", text)
        if remote and _is_loopback(remote.group(1)):
            return (
                f"it found the others at {where}, but another rank told it to connect to "
                f"{remote.group(1)}:{remote.group(2)}, a loopback address, which is this host's "
                "own: that rank's host lets gloo listen on its loopback, because its name "
                "resolves to 127.0.1.1 or similar in /etc/hosts, or GLOO_SOCKET_IFNAME=lo. Set "
                f"{_ifname_fix(info.master_addr)} on every host (the interface facing the "
                f"others, see `ip -br addr`) {said}"
            )
        if here:
            return (
                f"it found the others at {where}, but no rank of another host connected to it "
                f"within {waited}: {here} {said}"
            )
        return (
            f"it found the others at {where}, but gloo's direct connections between the ranks "
            f"did not form within {waited}: a firewall between the hosts (gloo uses other, "
            "random ports: allow all TCP between them), or gloo on an interface the other hosts "
            f"cannot reach (set {_ifname_fix(info.master_addr)} on every host) {said}"
        )
    reach = re.search(r"trying to connect to \(([^,]+), (\d+)\)", text)
    if reach or "Connection refused" in text:
        address, port = reach.groups() if reach else (info.master_addr, str(info.master_port))
        hint = ""
        if _is_loopback(_resolve(address)) and info.rank >= info.local_world_size:
            hint = (
                f" {address} is this host's own loopback: with several hosts, --master-addr is "
                "node 0's address as the other hosts reach it."
            )
        return (
            f"it could not reach rank 0 at {address}:{port} within {waited}: node 0 is not "
            f"running there (start every host within --timeout seconds of each other), TCP port "
            f"{port} is closed on that host (a firewall: open it to the other hosts), or "
            f"--master-addr is not node 0's address.{hint} {said}"
        )
    joined = re.search(r"(\d+)/(\d+) clients joined", text)
    if joined or isinstance(error, TimeoutError) or "wait timeout" in text or "Timed out" in text:
        came = (
            f"only {joined.group(1)} of the {joined.group(2)} ranks came"
            if joined
            else f"not all {info.world_size} ranks came"
        )
        return (
            f"it waited at {where} for {waited}, and {came}: start every host within --timeout "
            f"seconds of each other, with the same --nnodes, --nproc-per-node, --master-addr "
            f"and --master-port. If the others are running, they cannot reach {where} (a "
            f"firewall on port {info.master_port}, or the wrong --master-addr)."
            + (f" And on this host: {here}" if here else "")
            + f" {said}"
        )
    return None


def _train(info: RankInfo, epochs: int) -> None:
    import importlib

    try:
        k05 = importlib.import_module(f"{__package__}.k05_data_parallel")
    except ModuleNotFoundError as error:
        raise LaunchConfigError(
            f"--train needs kata k05 ({__package__}/k05_data_parallel.py): {error}"
        ) from None
    outcome = k05.run_training(info.rank, info.world_size, epochs=epochs)
    say(
        info.rank,
        "trained",
        json.dumps(
            {
                "rank": info.rank,
                "final_loss": outcome["losses"][-1],
                "accuracy": outcome["accuracy"],
            }
        ),
    )


def main(argv: Sequence[str] | None = None) -> int:
    from dojo.launch import add_launch_arguments

    parser = argparse.ArgumentParser(
        description="The tutorial's afterword: one world across several machines. Run it on every "
        "host with the same options and that host's --node-rank, or under torchrun.",
    )
    add_launch_arguments(parser)  # --world-size, --backend, --device
    parser.set_defaults(world_size=None)
    launch = parser.add_argument_group("manual launch (leave these out under torchrun)")
    launch.add_argument("--nnodes", type=int, help="how many hosts (default 1)")
    launch.add_argument(
        "--node-rank", type=int, help="this host's number, 0 on MASTER_ADDR's host (default 0)"
    )
    launch.add_argument(
        "--nproc-per-node",
        type=int,
        help="processes on each host (default: --world-size / --nnodes, or 4)",
    )
    launch.add_argument(
        "--master-addr",
        help="rank 0's host, reachable from every host (default $MASTER_ADDR or 127.0.0.1)",
    )
    launch.add_argument(
        "--master-port",
        type=int,
        help="a free port there (default $MASTER_PORT; a free one on a single host)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        help="seconds ranks wait for each other (default 300)",
    )
    parser.add_argument(
        "--train", action="store_true", help="then train kata k05's model across all ranks"
    )
    parser.add_argument("--epochs", type=int, default=1, help="epochs for --train (default 1)")
    args = parser.parse_args(argv)
    try:
        if _started_by_a_launcher(args):
            run_this_rank(args)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)  # the group is gone; skip interpreter teardown (see the harness findings)
        return _launch_this_node(args)
    except LaunchConfigError as error:
        print(f"k06: {error}", file=sys.stderr)
        return 2
    except NodeFailed as error:
        print(f"k06: this node failed: {error}", file=sys.stderr)
        return 1
    except WorldNotFormed as error:
        print(f"k06: {error}", file=sys.stderr)
        return 1


def _started_by_a_launcher(args: argparse.Namespace) -> bool:
    """A process that has a rank in its environment is a rank; otherwise it launches a node."""
    per_process = [
        name
        for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")
        if name in os.environ
    ]
    if not per_process:
        return False
    given = [
        f"--{name.replace('_', '-')}"
        for name in (
            "nnodes",
            "node_rank",
            "nproc_per_node",
            "master_addr",
            "master_port",
            "world_size",
        )
        if getattr(args, name) is not None
    ]
    if given:
        raise LaunchConfigError(
            f"{' '.join(given)} given, but {per_process[0]} is set, so a launcher already started this "
            "process: under torchrun, give those options to torchrun; by hand, unset RANK, "
            "LOCAL_RANK, WORLD_SIZE and LOCAL_WORLD_SIZE"
        )
    return True


def _launch_this_node(args: argparse.Namespace) -> int:
    nnodes = 1 if args.nnodes is None else args.nnodes
    node_rank = 0 if args.node_rank is None else args.node_rank
    nproc = args.nproc_per_node
    if nproc is None:
        world_size = 4 if args.world_size is None else args.world_size
        if nnodes < 1 or world_size % nnodes:
            raise LaunchConfigError(
                f"--world-size {world_size} does not split evenly over --nnodes {nnodes}: give --nproc-per-node"
            )
        nproc = world_size // nnodes
    elif args.world_size is not None and args.world_size != nnodes * nproc:
        raise LaunchConfigError(
            f"--world-size {args.world_size}, but --nnodes {nnodes} x --nproc-per-node {nproc} "
            f"= {nnodes * nproc}: give one or the other"
        )
    master_addr = args.master_addr or os.environ.get("MASTER_ADDR") or "127.0.0.1"
    master_port = args.master_port
    if master_port is None and os.environ.get("MASTER_PORT", "").strip():
        try:
            master_port = int(os.environ["MASTER_PORT"])
        except ValueError:
            raise LaunchConfigError(
                f"MASTER_PORT={os.environ['MASTER_PORT']!r} is not a port number"
            ) from None
    if master_port is None:
        if nnodes > 1:
            raise LaunchConfigError(
                "--master-port is needed with several nodes: the same free port on every host"
            )
        master_port = _free_port()
    node_environment(
        nnodes, node_rank, nproc, 0, master_addr, master_port
    )  # check the options first
    first, last = node_rank * nproc, node_rank * nproc + nproc - 1
    span = f"rank {first}" if first == last else f"ranks {_numbers(first, last)}"
    where = (
        "one node, the whole world: starting " + span
        if nnodes == 1
        else f"node {node_rank} of {nnodes}: starting {span} of {nnodes * nproc}"
    )
    say(None, f"{where}; rank 0 listens at {master_addr}:{master_port}")
    command = [sys.executable, "-m", __spec__.name, "--timeout", str(args.timeout)]
    command += [
        f"--{name}={value}"
        for name, value in (("backend", args.backend), ("device", args.device))
        if value
    ]
    command += ["--train", f"--epochs={args.epochs}"] if args.train else []
    # `kill` (SIGTERM) of this launcher must stop its ranks too, as it does under torchrun:
    # turned into SystemExit, it runs launch_node's clean-up on its way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    launch_node(command, nnodes, node_rank, nproc, master_addr, master_port)
    finished = "its process" if nproc == 1 else f"all {nproc} of its processes"
    say(None, f"node {node_rank}: {finished} finished")
    return 0


if __name__ == "__main__":
    run_program(main)
