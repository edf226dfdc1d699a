"""dojo.spec.hosts: fake hosts reach each other and nothing else, and leave nothing behind, however
the test that made them ends (success, failure, Ctrl-C, kill -9)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from dojo.curriculum import ROOT
from dojo.spec import hosts
from dojo.spec.testing import fake_hosts_or_skip

# --------------------------------------------------------------------------- where it can work


@pytest.fixture
def fresh_availability():
    hosts.availability.cache_clear()
    yield hosts.availability
    hosts.availability.cache_clear()


@pytest.mark.parametrize(
    "patch, says",
    [
        ({"platform": "darwin"}, "Linux"),
        ({"euid": 1000}, "root"),
        ({"missing": "ip"}, "iproute2"),
        ({"missing": "unshare"}, "util-linux"),
    ],
    ids=["not-linux", "not-root", "no-ip", "no-unshare"],
)
def test_availability_says_what_is_missing(fresh_availability, monkeypatch, patch, says):
    import shutil

    if "platform" in patch:
        monkeypatch.setattr(sys, "platform", patch["platform"])
    if "euid" in patch:
        monkeypatch.setattr(os, "geteuid", lambda: patch["euid"], raising=False)
    elif "missing" in patch:
        monkeypatch.setattr(os, "geteuid", lambda: 0, raising=False)
        real = shutil.which
        monkeypatch.setattr(
            shutil, "which", lambda name, *a, **k: None if name == patch["missing"] else real(name)
        )
    if "platform" not in patch:
        monkeypatch.setattr(sys, "platform", "linux")
    reason = fresh_availability()
    assert reason and says in reason, f"availability() said {reason!r}, expected it to name {says}"


def test_availability_is_none_or_a_sentence(fresh_availability):
    reason = fresh_availability()
    assert reason is None or (isinstance(reason, str) and len(reason) > 20), reason
    probe = f"{hosts.PREFIX}-{os.getpid()}-probe"
    assert probe not in _ours(), f"the probe left its namespace {probe} behind"


def test_unavailable_hosts_skip_with_the_reason(monkeypatch):
    monkeypatch.setattr(hosts, "availability", lambda: "fake hosts need a test reason")
    with pytest.raises(pytest.skip.Exception, match="fake hosts need a test reason"):
        fake_hosts_or_skip(2)
    with pytest.raises(hosts.HostsUnavailable, match="a test reason"):
        with hosts.FakeHosts(2):
            pass


# --------------------------------------------------------------------------- what a host is

_PROBE = r"""
import json, socket, sys
out = {"name": socket.gethostname(), "hosts": open("/etc/hosts").read()}
for target in sys.argv[1:]:
    address, port = target.rsplit(":", 1)
    try:
        socket.create_connection((address, int(port)), timeout=3).close()
        out[target] = "connected"
    except OSError as error:
        out[target] = error.strerror or str(error)
print(json.dumps(out))
"""

_SERVER = r"""
import socket, sys
server = socket.create_server(("0.0.0.0", int(sys.argv[1])))
print("listening", flush=True)
while True:
    server.accept()[0].close()
"""


def _probe(host, *targets):
    done = host.python(_PROBE, *targets, timeout=30)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _serve(host, port):
    server = host.popen(
        [sys.executable, "-c", _SERVER, str(port)], stdout=subprocess.PIPE, text=True
    )
    assert server.stdout.readline().strip() == "listening"
    return server


def _root_addresses():
    done = subprocess.run(["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True)
    return [a for a in re.findall(r"inet (\d+\.\d+\.\d+\.\d+)/", done.stdout) if a != "127.0.0.1"]


def test_two_hosts_reach_each_other_and_nothing_else():
    with fake_hosts_or_skip(2) as (a, b):
        assert a.address != b.address and a.network == b.network
        server = _serve(a, 7000)
        local = _serve(b, 7001)  # on b's own loopback too
        outside = [f"{address}:22" for address in _root_addresses()[:2]]
        seen = _probe(
            b, f"{a.address}:7000", "127.0.0.1:7000", "127.0.0.1:7001", "1.1.1.1:53", *outside
        )
        assert seen["name"] == "host-b", seen
        assert re.search(rf"^{re.escape(a.address)}\s+host-a$", seen["hosts"], re.M), seen
        assert seen[f"{a.address}:7000"] == "connected", seen
        assert seen["127.0.0.1:7000"] != "connected", (
            f"host-b reached host-a's server at 127.0.0.1: a host's loopback must be its own {seen}"
        )
        assert seen["127.0.0.1:7001"] == "connected", seen
        for target in ["1.1.1.1:53", *outside]:
            assert seen[target] == "Network is unreachable", (
                f"host-b reached {target} (or tried to): a fake host reaches its peers only. {seen}"
            )
        links = b.run(["ip", "-o", "link"], timeout=10).stdout
        assert sorted(re.findall(r"^\d+: ([^:@]+)", links, re.M)) == ["eth0", "lo"], links
        server.kill()
        local.kill()


def test_three_hosts_on_a_switch():
    with fake_hosts_or_skip(3) as group:
        servers = [_serve(host, 7000) for host in group]
        for host in group:
            others = [f"{o.address}:7000" for o in group if o is not host]
            seen = _probe(host, *others)
            assert all(seen[t] == "connected" for t in others), (host, seen)
            assert seen["name"] == host.name
        for server in servers:
            server.kill()


def test_names_and_firewall_rules_are_per_host():
    with fake_hosts_or_skip(2) as (a, b):
        a.set_names({"host-a": "127.0.1.1", "host-b": b.address})
        resolve = "import socket, sys; print(socket.gethostbyname(sys.argv[1]))"
        assert a.python(resolve, "host-a").stdout.strip() == "127.0.1.1"
        assert b.python(resolve, "host-a").stdout.strip() == a.address
        if hosts.nft_availability() is None:
            server = _serve(a, 7000)
            a.drop_incoming_tcp(7000)
            seen = _probe(b, f"{a.address}:7000")
            assert seen[f"{a.address}:7000"] == "timed out", seen  # dropped, not refused
            assert _probe(a, "127.0.0.1:7000")["127.0.0.1:7000"] == "connected"
            server.kill()


def test_run_kills_what_runs_past_its_timeout():
    with fake_hosts_or_skip(1) as (a,):
        start = time.monotonic()
        with pytest.raises(subprocess.TimeoutExpired):
            a.run(["sh", "-c", "sleep 60 & sleep 60"], timeout=1)
        assert time.monotonic() - start < 10
        deadline = time.monotonic() + 5
        while a.pids() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not a.pids(), f"processes still inside host-a: {a.pids()}"


# --------------------------------------------------------------------------- nothing left behind


def _ours(prefix: str = hosts.PREFIX) -> list[str]:
    done = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    return [line.split()[0] for line in done.stdout.splitlines() if line.startswith(prefix)]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _veths() -> set[str]:
    done = subprocess.run(["ip", "-o", "link", "show", "type", "veth"], capture_output=True)
    return set(re.findall(rb"^\d+: ([^:@]+)", done.stdout, re.M))


def _leftovers(namespaces, pids, grace: float = 0.0) -> list[str]:
    """What is left of some fake hosts, after up to ``grace`` seconds."""
    end = time.monotonic() + grace
    while True:
        present = set(_ours())
        left = [f"namespace {n}" for n in namespaces if n in present]
        left += [
            f"/etc/netns/{n}" for n in namespaces if os.path.exists(os.path.join("/etc/netns", n))
        ]
        left += [f"process {p}" for p in pids if _alive(p)]
        if not left or time.monotonic() > end:
            return left
        time.sleep(0.05)


def _sleepers(group):
    return [host.popen(["sleep", "300"]).pid for host in group]


@pytest.mark.parametrize("count", [2, 3])
def test_nothing_left_after_success(count):
    before = _veths()
    with fake_hosts_or_skip(count) as group:
        namespaces = group.namespaces
        pids = _sleepers(group)
        assert set(namespaces) <= set(_ours())
    assert not _leftovers(namespaces, pids), _leftovers(namespaces, pids)
    assert not _veths() - before, f"interfaces left in this machine's network: {_veths() - before}"


def test_nothing_left_after_a_failure():
    group = fake_hosts_or_skip(2)
    with pytest.raises(AssertionError, match="the test failed here"):
        with group:
            pids = _sleepers(group)
            raise AssertionError("the test failed here")
    assert not _leftovers(group.namespaces, pids), _leftovers(group.namespaces, pids)


_INNER_TEST = """
import json, os, sys, time
from dojo.spec.hosts import FakeHosts

def test_holds_hosts():
    with FakeHosts(2) as group:
        pids = [host.popen(["sleep", "300"]).pid for host in group]
        with open(os.environ["HOSTS_REPORT"], "w") as f:
            json.dump({"namespaces": group.namespaces, "pids": pids}, f)
        time.sleep(120)
"""

_INNER_SCRIPT = """
import json, os, sys
from dojo.spec.hosts import FakeHosts
group = FakeHosts(2).__enter__()  # never closed: atexit must do it
pids = [host.popen(["sleep", "300"]).pid for host in group]
with open(os.environ["HOSTS_REPORT"], "w") as f:
    json.dump({"namespaces": group.namespaces, "pids": pids}, f)
"""


@pytest.mark.parametrize("ending", ["ctrl-c", "kill-9", "sigterm", "interpreter-exit"])
def test_nothing_left_however_the_holder_ends(tmp_path, ending):
    """A pytest process holding fake hosts gets Ctrl-C (SIGINT), SIGTERM or SIGKILL; or a script
    exits without closing them. Everything goes: at once (Ctrl-C, exit) or via the reaper."""
    if hosts.availability():
        pytest.skip(hosts.availability())
    report = tmp_path / "report.json"
    env = {**os.environ, "HOSTS_REPORT": str(report), "PYTHONPATH": str(ROOT)}
    if ending == "interpreter-exit":
        command = [sys.executable, "-c", _INNER_SCRIPT]
    else:
        (tmp_path / "test_inner.py").write_text(textwrap.dedent(_INNER_TEST))
        (tmp_path / "pytest.ini").write_text("[pytest]\n")
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x"]
        command += ["-p", "no:xdist", "--timeout=150", str(tmp_path / "test_inner.py")]
    holder = subprocess.Popen(
        command,
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        # Ctrl-C as a terminal sends it, whatever started this pytest (a background job in a
        # script ignores SIGINT, and its children would inherit that).
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + 60
        while not report.exists():
            assert holder.poll() is None or ending == "interpreter-exit", holder.stdout.read()
            assert time.monotonic() < deadline, "the holder never made its hosts"
            time.sleep(0.05)
        time.sleep(0.1)  # the report is written in one go; let the file close
        made = json.loads(report.read_text())
        if ending != "interpreter-exit":
            os.kill(
                holder.pid,
                {"ctrl-c": signal.SIGINT, "kill-9": signal.SIGKILL}.get(ending, signal.SIGTERM),
            )
        holder.wait(30)
    finally:
        if holder.poll() is None:
            os.killpg(holder.pid, signal.SIGKILL)
            holder.wait()
    # Ctrl-C and a plain exit clean up before the process ends; SIGTERM and SIGKILL leave it to
    # the reaper, which needs a moment.
    grace = 0.0 if ending in ("ctrl-c", "interpreter-exit") else 10.0
    left = _leftovers(made["namespaces"], made["pids"], grace=grace)
    assert not left, f"after {ending} of the process holding fake hosts, left: {left}"


# --------------------------------------------------------------------------- dojo doctor


def test_doctor_says_whether_multi_host_tests_run(monkeypatch):
    from dojo.runner import doctor

    monkeypatch.setattr(hosts, "availability", lambda: "fake hosts need root (a test reason)")
    finding = doctor._multi_host()
    assert (finding.status, finding.topic) == ("note", "multi-host tests")
    assert "cannot run here: fake hosts need root (a test reason)" in finding.text
    monkeypatch.setattr(hosts, "availability", lambda: None)
    monkeypatch.setattr(hosts, "nft_availability", lambda: None)
    finding = doctor._multi_host()
    assert finding.status == "ok" and finding.text.startswith("can run here"), finding
    monkeypatch.setattr(hosts, "nft_availability", lambda: "no nft (a test reason)")
    finding = doctor._multi_host()
    assert finding.status == "note" and "no nft (a test reason)" in finding.text, finding
