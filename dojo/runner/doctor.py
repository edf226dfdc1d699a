"""``dojo doctor``: what this machine offers the katas, and what will not work, in plain words.

Each check gives ``ok``, ``note`` (works, with a limit worth knowing) or ``FAIL`` (something the
katas need is broken), with a sentence that says what it means for the learner.
"""

from __future__ import annotations

import importlib.metadata
import json
import multiprocessing
import os
import platform
import shutil
import socket
import subprocess
import sys
import textwrap
from dataclasses import asdict, dataclass

from dojo import curriculum
from dojo.runner.term import paint

GIB = 1024**3
WORLD = 4  # the katas' usual world size
RANK_MEMORY_GIB = 0.7  # one rank with torch imported (measured ~650 MB)


@dataclass
class Finding:
    status: str  # "ok" | "note" | "FAIL"
    topic: str
    text: str


def _python() -> Finding:
    version = platform.python_version()
    if sys.version_info < (3, 10):  # noqa: UP036 - doctor explains an old Python instead of failing
        return Finding("FAIL", "Python", f"{version}: the katas need Python 3.10 or newer")
    return Finding(
        "ok",
        "Python",
        f"{version} ({platform.python_implementation()}, {platform.system()} {platform.machine()})",
    )


def _how_to_get_in() -> str:
    from dojo.commands import environment_problem

    problem = environment_problem(["doctor"])
    return problem.split(": ", 1)[1] if problem else "install the project with `make learn`"


def _torch() -> list[Finding]:
    try:
        import torch
        import torch.distributed as dist
    except Exception as error:
        return [
            Finding(
                "FAIL",
                "torch",
                f"cannot be imported ({error}): {_how_to_get_in()}",
            )
        ]
    found = []
    if torch.version.cuda:
        build = f"built for CUDA {torch.version.cuda}"
    elif getattr(torch.version, "hip", None):
        build = f"built for ROCm {torch.version.hip}"
    else:
        build = "CPU-only build"
    found.append(Finding("ok", "torch", f"{torch.__version__}, {build}"))
    found.append(_torch_release(torch.__version__))
    if not dist.is_available():
        return found + [
            Finding(
                "FAIL",
                "torch.distributed",
                "this torch build has no torch.distributed: no kata can run",
            )
        ]
    found.append(
        Finding("ok", "gloo", "available: the backend every kata and test uses on CPU")
        if dist.is_gloo_available()
        else Finding("FAIL", "gloo", "missing from this torch build: the katas' tests cannot run")
    )
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if dist.is_nccl_available():
        found.append(
            Finding(
                "ok",
                "NCCL",
                f"available ({_nccl_version(torch)}): the GPU backend, one GPU per rank",
            )
        )
    else:
        found.append(
            Finding(
                "note",
                "NCCL",
                "not in this build: everything runs on gloo/CPU; the NCCL paths of the solutions are skipped",
            )
        )
    if gpus == 0:
        found.append(
            Finding(
                "note",
                "GPUs",
                "none visible: every kata runs on the CPU (that is the default); tests marked cuda are skipped",
            )
        )
        if torch.version.cuda and platform.system() == "Linux":
            found.append(_cpu_build_advice())
    else:
        names = ", ".join(sorted({torch.cuda.get_device_name(i) for i in range(gpus)}))
        if gpus >= WORLD:
            found.append(
                Finding(
                    "ok",
                    "GPUs",
                    f"{gpus} ({names}): {WORLD}-rank worlds can run on NCCL, one GPU per rank",
                )
            )
        else:
            found.append(
                Finding(
                    "note",
                    "GPUs",
                    (
                        f"{gpus} ({names}): fewer than the {WORLD} ranks of a usual world, and NCCL cannot put two "
                        f"ranks on one GPU, so {WORLD}-rank worlds use gloo (which can share a GPU); "
                        f"NCCL works with --world-size {gpus} or fewer"
                    ),
                )
            )
    return found


def _cpu_build_advice() -> Finding:
    """The CUDA build on a machine without a GPU: the CPU-only one saves GBs, but only where its
    index answers (``make learn TORCH=cpu`` stops where it does not): ask it before advising."""
    from dojo.runner.torch_index import CPU_INDEX, unreachable

    index = os.environ.get("TORCH_CPU_INDEX") or CPU_INDEX
    text = "the CUDA build, with some GB of CUDA libraries no GPU here uses"
    why = unreachable(index)
    if why is None:
        return Finding(
            "note",
            "torch build",
            f"{text}: `make clean-venv && make learn TORCH=cpu` installs the CPU-only build "
            f"(about 1.3 GB in all) from {index}, which answers from here",
        )
    return Finding(
        "note",
        "torch build",
        f"{text}. The CPU-only build's index ({index}) cannot be reached from here: {why}. "
        "So `make learn TORCH=cpu` would stop, saying so; this build runs on the CPU all the "
        "same: keep it, or point TORCH_CPU_INDEX at a mirror of that index that answers (`make "
        "clean-venv && make learn TORCH=cpu TORCH_CPU_INDEX=URL`)",
    )


def _torch_release(version: str) -> Finding:
    """This torch against the ones the suite was run on: pyproject.toml's floor, the pin in
    constraints.txt, and what some tests need beyond the floor (``NEWER_TORCH``)."""
    from dojo.spec.testing import NEWER_TORCH, torch_older_than

    floor, pinned = _declared_torch()
    again = "`make clean-venv && make learn` installs " + (f"torch {pinned}" if pinned else "it")
    if floor and torch_older_than(floor, version):
        return Finding(
            "FAIL",
            "torch version",
            f"{version} is older than {floor}, the oldest torch the suite was run on "
            f"(pyproject.toml): some katas' tests fail there for torch's reasons, not yours. {again}",
        )
    skipped = [
        f"{kata}'s tests of {what} need torch {needed} and skip here, saying so"
        for needed, kata, what in NEWER_TORCH.values()
        if torch_older_than(needed, version)
    ]
    if pinned and version.split("+")[0] == pinned:
        return Finding("ok", "torch version", f"{pinned}, the torch the suite was run on")
    text = f"{version}, not {pinned}, the torch the suite was run on (constraints.txt)"
    if skipped:
        text += ": " + "; ".join(skipped)
    elif floor:
        text += f"; the suite was also run on {floor} (README: which torch)"
    return Finding("note", "torch version", f"{text}. {again}")


def _declared_torch() -> tuple[str | None, str | None]:
    """(pyproject.toml's floor for torch, constraints.txt's pin), None where not found."""
    import re

    from dojo.curriculum import tomllib

    floor = pinned = None
    try:
        project = tomllib.loads((curriculum.ROOT / "pyproject.toml").read_text(encoding="utf-8"))
        for requirement in project["project"]["dependencies"]:
            found = re.match(r"torch\s*>=\s*([\d.]+)", requirement)
            floor = found.group(1) if found else floor
        for line in (curriculum.ROOT / "constraints.txt").read_text(encoding="utf-8").splitlines():
            found = re.match(r"torch==([\d.]+)\s*$", line.split(";")[0].strip())
            pinned = found.group(1) if found else pinned
    except (OSError, KeyError, ValueError):
        pass
    return floor, pinned


def _nccl_version(torch) -> str:
    try:
        version = torch.cuda.nccl.version()
        return (
            "NCCL " + ".".join(str(v) for v in version)
            if isinstance(version, tuple)
            else f"NCCL {version}"
        )
    except Exception:
        return "version unknown"


def _shared_memory() -> Finding:
    if not os.path.isdir("/dev/shm"):
        if sys.platform == "darwin":
            return Finding(
                "ok", "shared memory", "macOS shares tensors between processes without /dev/shm"
            )
        return Finding(
            "note",
            "shared memory",
            "no /dev/shm here: tensors sent between processes may be slow or fail",
        )
    usage = shutil.disk_usage("/dev/shm")
    text = f"/dev/shm {usage.total / GIB:.1f} GiB, {usage.free / GIB:.1f} GiB free"
    if usage.free < 0.5 * GIB:
        return Finding(
            "FAIL",
            "shared memory",
            (
                f"{text}: too small; tensors passed between processes (queues, DataLoader workers) fail with "
                "'bus error' or 'no space left'. In Docker, run with --shm-size=2g (or --ipc=host)"
            ),
        )
    return Finding("ok", "shared memory", text)


def _loopback() -> list[Finding]:
    found = []
    try:
        with socket.create_server(("127.0.0.1", 0)) as server:
            port = server.getsockname()[1]
            with socket.create_connection(("127.0.0.1", port), timeout=2):
                pass
        found.append(
            Finding(
                "ok", "loopback", f"127.0.0.1 accepts connections (the OS gave free port {port})"
            )
        )
    except OSError as error:
        found.append(
            Finding(
                "FAIL",
                "loopback",
                f"cannot connect to 127.0.0.1 ({error}): ranks on this machine cannot rendezvous",
            )
        )
    try:
        with socket.create_server(("127.0.0.1", 29500)):
            pass
        found.append(Finding("ok", "port 29500", "free (torchrun's default MASTER_PORT)"))
    except OSError:
        found.append(
            Finding(
                "note",
                "port 29500",
                "in use: torchrun's default MASTER_PORT; pass --master-port with another",
            )
        )
    host = socket.gethostname()
    try:
        address = socket.gethostbyname(host)
        found.append(Finding("ok", "host name", f"{host} resolves to {address}"))
    except OSError:
        found.append(
            Finding(
                "note",
                "host name",
                (
                    f"{host} does not resolve: gloo picks its network interface from the host name, so set "
                    "GLOO_SOCKET_IFNAME=lo (Linux) or lo0 (macOS) for worlds on one machine (the tests do this)"
                ),
            )
        )
    return found


def _multi_host() -> Finding:
    """Whether the tests across fake hosts (network namespaces) can run here, and why not."""
    from dojo.spec.hosts import availability, nft_availability

    reason = availability()
    if reason:
        return Finding(
            "note",
            "multi-host tests",
            f"cannot run here: {reason}. The tests across two fake hosts (k06's launches and "
            "pitfalls, k16's host restart) are skipped; everything else runs",
        )
    text = (
        "can run here: network namespaces work, so k06 and k16 are also tested across fake "
        "hosts, each with its own address"
    )
    firewall = nft_availability()
    if firewall:
        return Finding(
            "note", "multi-host tests", f"{text}; the closed-port test is skipped: {firewall}"
        )
    return Finding("ok", "multi-host tests", text)


def _start_methods() -> Finding:
    methods = multiprocessing.get_all_start_methods()
    if "forkserver" not in methods:
        return Finding(
            "FAIL",
            "start methods",
            (
                f"{', '.join(methods)}: the test harness needs forkserver, which native Windows lacks; "
                "use WSL2 (the katas' own programs use spawn and would run)"
            ),
        )
    return Finding(
        "ok",
        "start methods",
        f"{', '.join(methods)} (programs spawn; the test harness uses forkserver)",
    )


def _machine() -> list[Finding]:
    found = []
    cpus = os.cpu_count() or 1
    found.append(
        Finding(
            "ok" if cpus >= 2 else "note",
            "CPUs",
            f"{cpus}"
            + (f": a {WORLD}-rank world shares them, slower but correct" if cpus < WORLD else ""),
        )
    )
    available = _available_memory()
    if available is not None:
        need = WORLD * RANK_MEMORY_GIB + 1
        status = "ok" if available >= need else "note"
        text = f"{available / GIB:.1f} GiB available"
        if status == "note":
            text += f": a {WORLD}-rank world needs about {need:.0f} GiB; close other programs if tests are killed"
        found.append(Finding(status, "memory", text))
    return found


def _available_memory() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _packages() -> Finding:
    missing, versions = [], []
    for name in ("pytest", "pytest-timeout", "pytest-xdist"):
        try:
            versions.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            missing.append(name)
    if missing:
        return Finding(
            "FAIL",
            "test tools",
            f"missing {', '.join(missing)}: {_how_to_get_in()}",
        )
    return Finding("ok", "test tools", ", ".join(versions))


def _environment() -> list[Finding]:
    leftovers = [
        v
        for v in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "DOJO_IMPL")
        if v in os.environ
    ]
    if leftovers:
        return [
            Finding(
                "note",
                "environment",
                (
                    f"{', '.join(leftovers)} set in this shell: the katas' programs and tests set their own; a "
                    "leftover value can make a world wait for ranks that never come. `unset` them unless you mean it"
                ),
            )
        ]
    return []


_GLOO_WORLDS = """
import datetime, json, os, sys, threading, torch, torch.distributed as dist
from dojo.harness.loopback import loopback_store

def world(interface):
    # Two gloo ranks (threads of one process) all-reduce over this machine's TCP stack.
    os.environ.pop("GLOO_SOCKET_IFNAME", None)
    if interface:
        os.environ["GLOO_SOCKET_IFNAME"] = interface
    store = loopback_store(world_size=2, wait_for_workers=False)  # nothing beyond the machine
    results = {}
    def rank(r):
        try:
            peer = store if r == 0 else dist.TCPStore("127.0.0.1", store.port, 2, is_master=False)
            group = dist.ProcessGroupGloo(peer, r, 2, datetime.timedelta(seconds=10))
            tensor = torch.tensor([float(r + 1)])
            group.allreduce([tensor]).wait()
            results[r] = tensor.item()
        except Exception as error:
            results[r] = str(error).strip().splitlines()[-1] if str(error).strip() else repr(error)
    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(2)]
    [t.start() for t in threads]
    [t.join(30) for t in threads]
    return [results.get(r, "no answer within 30 s") for r in range(2)]

for interface in sys.argv[1:]:
    print(json.dumps([interface, world(interface if interface != "-" else None)]), flush=True)
"""


def _start_gloo_worlds() -> subprocess.Popen:
    """Runs while the other checks do: it pays for its own ``import torch``."""
    loopback = "lo0" if sys.platform == "darwin" else "lo"
    return subprocess.Popen(
        [sys.executable, "-c", _GLOO_WORLDS, loopback, "-"],
        cwd=curriculum.ROOT,  # where it imports dojo from
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _gloo_worlds(process: subprocess.Popen) -> list[Finding]:
    try:
        out, err = process.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = process.communicate()
    answers = {}
    for line in out.splitlines():
        try:
            interface, results = json.loads(line)
        except ValueError:  # gloo's own words (torch 2.10: "[Gloo] Rank 0 is connected to ...")
            continue
        answers[interface] = results
    found = []
    for interface, topic, must in (
        (next(iter(answers), "lo"), "gloo world (loopback)", True),
        ("-", "gloo world (default interface)", False),
    ):
        results = answers.get(interface)
        if results == [3.0, 3.0]:
            found.append(Finding("ok", topic, "two ranks all-reduced 1 + 2 = 3.0 over TCP"))
            continue
        why = (
            ", ".join(str(r) for r in results)
            if results
            else (err.strip().splitlines() or ["no answer"])[-1]
        )
        if must:
            found.append(
                Finding(
                    "FAIL",
                    topic,
                    f"two ranks could not all-reduce over 127.0.0.1 ({why}): no world can run here",
                )
            )
        else:
            found.append(
                Finding(
                    "note",
                    topic,
                    (
                        f"two ranks could not all-reduce on the interface gloo picks from the host name ({why}): "
                        "in your own scripts set GLOO_SOCKET_IFNAME=lo (lo0 on macOS); the tests and launcher already do"
                    ),
                )
            )
    return found


def examine() -> list[Finding]:
    worlds = _start_gloo_worlds()
    try:
        findings = [
            _python(),
            *_torch(),
            _packages(),
            _shared_memory(),
            *_loopback(),
            _start_methods(),
            _multi_host(),
            *_machine(),
        ]
    except BaseException:
        worlds.kill()
        worlds.wait()
        raise
    if all(
        f.status != "FAIL" for f in findings if f.topic in ("torch", "gloo", "torch.distributed")
    ):
        findings += _gloo_worlds(worlds)
    else:
        worlds.kill()
        worlds.wait()
    return findings + _environment()


def doctor(as_json: bool = False) -> int:
    if not as_json:
        print(
            paint("dojo doctor", "bold")
            + f": what this machine offers torch-dist-katas ({curriculum.ROOT})\n",
            flush=True,
        )
    findings = examine()
    failed = [f for f in findings if f.status == "FAIL"]
    if as_json:
        print(json.dumps([asdict(f) for f in findings], indent=2))
        return 1 if failed else 0
    style = {"ok": ("green",), "note": ("yellow",), "FAIL": ("bold", "red")}
    width = max(60, min(shutil.get_terminal_size().columns, 110))
    for finding in findings:
        lead = f"  {finding.status:<5} {finding.topic}: "
        body = textwrap.fill(
            finding.text, width=width, initial_indent=" " * len(lead), subsequent_indent="        "
        )
        print(paint(lead, *style[finding.status]) + body.lstrip())
    if failed:
        print(
            paint(
                f"\n{len(failed)} thing(s) above will not work: {', '.join(f.topic for f in failed)}.",
                "red",
            )
        )
        return 1
    print(paint("\nEverything the katas need works here.", "green"))
    return 0
