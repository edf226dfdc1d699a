"""Fake hosts: several "machines" on this one, each with its own address, for tests across hosts.

A test of "several machines" on loopback never meets what goes wrong between real hosts: every
rank reaches every other at 127.0.0.1. Here each host is a Linux network namespace with its own
``lo`` and an ``eth0`` on a private subnet (10.X.Y.0/24, chosen per run), joined to the others
by a virtual ethernet pair (two hosts) or a small switch namespace with a bridge (one host, or
three and more).
The hosts reach each other and nothing else: no route leaves the subnet, and 127.0.0.1 inside a
host is that host's own loopback. Every process started in a host also gets the host's name
(``unshare --uts``) and the host's own ``/etc/hosts`` (``/etc/netns/<namespace>/hosts``, which
``ip netns exec`` mounts over ``/etc/hosts`` for it)::

    from dojo.spec.hosts import FakeHosts, availability

    if availability() is None:
        with FakeHosts(2) as (a, b):                 # host-a at 10.X.Y.1, host-b at 10.X.Y.2
            server = a.popen(["python3", "-m", "http.server", "8000"])
            b.run(["curl", f"http://{a.address}:8000"], timeout=10)

Leaving the ``with`` (normally, by an exception or Ctrl-C) kills every process inside each
namespace, deletes the namespaces (and with them their interfaces and firewall rules) and their
``/etc/netns`` folders. Two backstops: ``atexit``, and a small reaper process that does the same
clean-up once this process is gone, however it ended (``kill -9`` included). Namespace names carry
this process's id and a counter, so parallel test workers never collide.

Needs Linux, root, iproute2's ``ip`` and util-linux's ``unshare``; ``availability()`` says
what is missing. (Tests use ``dojo.spec.testing.fake_hosts_or_skip``, which skips with that reason.)
"""

from __future__ import annotations

import atexit
import functools
import ipaddress
import itertools
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
import weakref
from collections.abc import Mapping, Sequence

PREFIX = "dojoh"  # every namespace made here is named dojoh-<pid>-<serial>-<host>
NETNS_ETC = "/etc/netns"
INTERFACE = "eth0"
_serial = itertools.count(1)
_live: weakref.WeakSet[FakeHosts] = weakref.WeakSet()


class HostsUnavailable(RuntimeError):
    """Fake hosts cannot be made on this machine; the message says why."""


# --------------------------------------------------------------------------- can it work here?


@functools.lru_cache(maxsize=1)
def availability() -> str | None:
    """None when fake hosts work here, else the reason they cannot (what is missing)."""
    if not sys.platform.startswith("linux"):
        return f"fake hosts need Linux network namespaces; this is {sys.platform}"
    if os.geteuid() != 0:
        return (
            f"fake hosts need root to make network namespaces (this runs as uid {os.geteuid()}); "
            "run the tests as root, e.g. in a container"
        )
    for tool, package in (("ip", "iproute2"), ("unshare", "util-linux"), ("hostname", "hostname")):
        if shutil.which(tool) is None:
            return (
                f"fake hosts need the `{tool}` command (Debian/Ubuntu: apt-get install {package})"
            )
    _sweep_orphans()
    probe = f"{PREFIX}-{os.getpid()}-probe"
    try:
        done = _ip("netns", "add", probe)
        if done.returncode != 0:
            return f"`ip netns add` was refused here: {_said(done)}"
        done = _ip(
            *("link", "add", "a0", "netns", probe, "type", "veth"),
            *("peer", "name", "b0", "netns", probe),
        )
        if done.returncode != 0:
            return f"`ip link add ... type veth` (a virtual ethernet pair) was refused here: {_said(done)}"
        done = subprocess.run(
            ["ip", "netns", "exec", probe, "unshare", "--uts", "--", "hostname", "probe"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        if done.returncode != 0:
            return f"`ip netns exec ... unshare --uts` was refused here: {_said(done)}"
    except (OSError, subprocess.SubprocessError) as error:
        return f"`ip netns` does not work here: {error}"
    finally:
        _ip("netns", "delete", probe)
    return None


def nft_availability() -> str | None:
    """None when firewall rules can be set inside a fake host (``nft``), else why not."""
    if shutil.which("nft") is None:
        return "the firewall tests need nftables' `nft` command (Debian/Ubuntu: apt-get install nftables)"
    return None


def _ip(*args: str, namespace: str | None = None) -> subprocess.CompletedProcess:
    command = ["ip", *(("-n", namespace) if namespace else ()), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=30)


def _said(done: subprocess.CompletedProcess) -> str:
    text = (done.stderr or done.stdout or "").strip()
    return text or f"exit status {done.returncode}"


def _die_with_parent() -> None:
    """In a started process, before it runs: SIGKILL when the test process dies (Linux)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # the reaper still kills it with its namespace


# --------------------------------------------------------------------------- one host


class Host:
    """One fake host: a network namespace with ``lo`` and ``eth0`` at ``address``."""

    def __init__(self, name: str, address: str, namespace: str, network: str):
        self.name = name  # its host name, as its processes see it (socket.gethostname())
        self.address = address  # eth0's address on the private subnet
        self.namespace = namespace  # the network namespace (`ip netns list`)
        self.network = network  # the subnet, "10.X.Y.0/24"
        self.interface = INTERFACE

    def __repr__(self) -> str:
        return f"Host({self.name!r}, {self.address}, namespace {self.namespace!r})"

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` as a command line that runs it inside this host, under this host's name."""
        return [
            *("ip", "netns", "exec", self.namespace),
            *("unshare", "--uts", "--"),
            *("sh", "-c", 'hostname "$0" && exec "$@"', self.name),
            *argv,
        ]

    def popen(self, argv: Sequence[str], **options) -> subprocess.Popen:
        """Start ``argv`` inside this host, in a session of its own (``subprocess.Popen`` options
        pass on). It dies with the process that started it, and with the hosts."""
        options.setdefault("start_new_session", True)
        options.setdefault("preexec_fn", _die_with_parent)
        return subprocess.Popen(self.command(argv), **options)

    def run(
        self, argv: Sequence[str], timeout: float, check: bool = False, **options
    ) -> subprocess.CompletedProcess:
        """Run ``argv`` inside this host to its end (output captured as text unless told
        otherwise); past ``timeout`` seconds, everything it started is killed and
        ``subprocess.TimeoutExpired`` raised."""
        if "stdout" not in options and "stderr" not in options:
            options["capture_output"] = True
        options.setdefault("text", True)
        capture = options.pop("capture_output", False)
        if capture:
            options["stdout"] = options["stderr"] = subprocess.PIPE
        process = self.popen(argv, **options)
        try:
            out, err = process.communicate(timeout=timeout)
        finally:
            if process.poll() is None:  # a timeout, Ctrl-C: its whole session goes
                _kill_session(process.pid)
                process.communicate()
        done = subprocess.CompletedProcess(process.args, process.returncode, out, err)
        if check:
            done.check_returncode()
        return done

    def python(self, code: str, *args: str, timeout: float = 30.0) -> subprocess.CompletedProcess:
        """Run a piece of Python (this interpreter) inside this host."""
        return self.run([sys.executable, "-c", code, *args], timeout=timeout)

    def pids(self) -> list[int]:
        """Every process inside this host's namespace now."""
        return _pids(self.namespace)

    def set_names(self, names: Mapping[str, str]) -> None:
        """This host's ``/etc/hosts``: ``localhost`` and the names given (name -> address), for
        processes started from now on. ``{"host-a": "127.0.1.1"}`` is Debian's habit."""
        lines = ["127.0.0.1\tlocalhost", *(f"{addr}\t{name}" for name, addr in names.items())]
        folder = os.path.join(NETNS_ETC, self.namespace)
        _make_folder(folder)
        with open(os.path.join(folder, "hosts"), "w", encoding="ascii") as f:
            f.write("\n".join(lines) + "\n")
        # No name server: a name not listed above fails at once, instead of asking this
        # machine's DNS (which a fake host cannot reach) and waiting for its timeout.
        with open(os.path.join(folder, "resolv.conf"), "w", encoding="ascii") as f:
            f.write("# fake host: no name server, only /etc/hosts\noptions timeout:1 attempts:1\n")

    def drop_incoming_tcp(self, port: int) -> None:
        """A firewall rule inside this host: TCP packets from other hosts to ``port`` are
        silently dropped (as a closed port on a real firewall looks from outside); this host's
        own connections (on ``lo``) pass. Needs ``nft``."""
        reason = nft_availability()
        if reason:
            raise HostsUnavailable(reason)
        rules = (
            "table inet dojo {\n"
            "  chain input {\n"
            "    type filter hook input priority 0; policy accept;\n"
            '    iifname "lo" accept\n'
            f"    tcp dport {int(port)} drop\n"
            "  }\n"
            "}\n"
        )
        done = subprocess.run(
            ["ip", "netns", "exec", self.namespace, "nft", "-f", "-"],
            input=rules,
            capture_output=True,
            text=True,
            timeout=30,
        )
        if done.returncode != 0:
            raise HostsUnavailable(f"`nft` refused a rule inside {self.name}: {_said(done)}")


# --------------------------------------------------------------------------- the hosts together


class FakeHosts:
    """``count`` fake hosts (``host-a``, ``host-b``, ...) on one private subnet, while in ``with``.

    The subnet is a /24 inside ``within`` (10.0.0.0/8 unless told: "192.168.0.0/16" makes a home
    network, whose addresses sort above 127.x, as some tests need) that no interface of this
    machine is on.

    Iterating gives the hosts; ``hosts[0]`` is the first. Each knows the others by name (its
    ``/etc/hosts``); ``Host.set_names`` changes that. ``close()`` (the end of ``with``) removes
    everything and may be called more than once.
    """

    def __init__(
        self, count: int = 2, names: Sequence[str] | None = None, within: str = "10.0.0.0/8"
    ):
        if count < 1:
            raise ValueError(f"FakeHosts({count}): at least one host")
        if names is not None and len(names) != count:
            raise ValueError(f"FakeHosts({count}) given {len(names)} names")
        self.names = list(names or (f"host-{chr(ord('a') + i)}" for i in range(count)))
        self.run_id = f"{PREFIX}-{os.getpid()}-{next(_serial)}"
        self.network = _pick_subnet(within)
        addresses = list(ipaddress.ip_network(self.network).hosts())
        self.hosts = [
            Host(name, str(addresses[i]), f"{self.run_id}-{chr(ord('a') + i)}", self.network)
            for i, name in enumerate(self.names)
        ]
        self.switch = None if count == 2 else f"{self.run_id}-sw"
        self._reaper: subprocess.Popen | None = None
        self._closed = False

    @property
    def namespaces(self) -> list[str]:
        return [h.namespace for h in self.hosts] + ([self.switch] if self.switch else [])

    def __iter__(self):
        return iter(self.hosts)

    def __getitem__(self, index: int) -> Host:
        return self.hosts[index]

    def __len__(self) -> int:
        return len(self.hosts)

    def __enter__(self) -> FakeHosts:
        reason = availability()
        if reason:
            raise HostsUnavailable(reason)
        _live.add(self)
        self._reaper = _start_reaper(self.namespaces)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _build(self) -> None:
        def ip(*args: str, namespace: str | None = None) -> None:
            done = _ip(*args, namespace=namespace)
            if done.returncode != 0:
                shown = " ".join(["ip", *(("-n", namespace) if namespace else ()), *args])
                raise HostsUnavailable(f"`{shown}` failed: {_said(done)}")

        for namespace in self.namespaces:
            ip("netns", "add", namespace)
            ip("link", "set", "lo", "up", namespace=namespace)
        if self.switch is None:  # two hosts: one cable between them
            a, b = self.hosts
            ip(
                *("link", "add", INTERFACE, "netns", a.namespace, "type", "veth"),
                *("peer", "name", INTERFACE, "netns", b.namespace),
            )
        else:  # one host, or three and more: each plugged into a switch
            ip("link", "add", "br0", "type", "bridge", namespace=self.switch)
            ip("link", "set", "br0", "up", namespace=self.switch)
            for i, host in enumerate(self.hosts):
                port = f"port{i}"
                ip(
                    *("link", "add", INTERFACE, "netns", host.namespace, "type", "veth"),
                    *("peer", "name", port, "netns", self.switch),
                )
                ip("link", "set", port, "master", "br0", "up", namespace=self.switch)
        prefix = ipaddress.ip_network(self.network).prefixlen
        for host in self.hosts:
            ip(
                "addr",
                "add",
                f"{host.address}/{prefix}",
                "dev",
                INTERFACE,
                namespace=host.namespace,
            )
            ip("link", "set", INTERFACE, "up", namespace=host.namespace)
        names = {h.name: h.address for h in self.hosts}
        for host in self.hosts:
            host.set_names(names)

    def close(self) -> None:
        """Kill every process inside the hosts, delete their namespaces and /etc/netns folders."""
        if self._closed:
            return
        self._closed = True
        _live.discard(self)
        _remove(self.namespaces)
        if self._reaper is not None:
            try:
                self._reaper.stdin.write(b"done\n")
                self._reaper.stdin.close()
                self._reaper.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                self._reaper.kill()
                self._reaper.wait()


def _pick_subnet(within: str) -> str:
    """A /24 inside ``within`` that no interface of this machine's own network is on."""
    used = []
    try:
        done = subprocess.run(
            ["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True, timeout=30
        )
        shown = done.stdout
    except (OSError, subprocess.SubprocessError):
        shown = ""  # no `ip` here: __enter__ says so
    for found in re.findall(r"inet (\d+\.\d+\.\d+\.\d+/\d+)", shown):
        used.append(ipaddress.ip_interface(found).network)
    chooser = random.Random(f"{os.getpid()}-{time.monotonic_ns()}")
    base = ipaddress.ip_network(within)
    for _ in range(1000):
        index = chooser.randrange(2 ** max(0, 24 - base.prefixlen))
        network = ipaddress.ip_network((int(base.network_address) + 256 * index, 24))
        if not any(network.overlaps(u) for u in used):
            return str(network)
    raise HostsUnavailable(f"no free /24 inside {within} on this machine")


# --------------------------------------------------------------------------- clean-up


def _pids(namespace: str) -> list[int]:
    done = _ip("netns", "pids", namespace)
    return [int(p) for p in done.stdout.split() if p.isdigit()]


def _kill_session(session: int) -> None:
    """SIGKILL every process of a session (a started command and whatever it started)."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[3]) != session:
                        continue
                os.kill(int(entry), signal.SIGKILL)
            except (OSError, ValueError, IndexError):
                pass


def _make_folder(folder: str) -> None:
    for _ in range(5):  # another run may remove an empty /etc/netns between our two mkdirs
        try:
            os.makedirs(folder, exist_ok=True)
            return
        except FileNotFoundError:
            time.sleep(0.01)
    os.makedirs(folder, exist_ok=True)


def _remove(namespaces: Sequence[str], grace: float = 10.0) -> list[str]:
    """Kill everything inside ``namespaces``, then delete them and their /etc/netns folders.
    Returns what could not be removed (empty when all went)."""
    left = []
    end = time.monotonic() + grace
    for namespace in namespaces:
        while True:
            pids = _pids(namespace)
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            if not pids:
                break
            if time.monotonic() > end:
                left.append(f"{namespace}: processes {pids}")
                break
            time.sleep(0.02)
    for namespace in namespaces:
        if os.path.exists(os.path.join("/run/netns", namespace)):
            done = _ip("netns", "delete", namespace)
            if done.returncode != 0:
                left.append(f"{namespace}: {_said(done)}")
        shutil.rmtree(os.path.join(NETNS_ETC, namespace), ignore_errors=True)
    try:
        os.rmdir(NETNS_ETC)  # only when empty: nothing of anyone else's goes
    except OSError:
        pass
    return left


def _sweep_orphans() -> None:
    """Namespaces left by a run whose process is gone (and whose reaper was killed too)."""
    done = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30)
    orphans = []
    for line in done.stdout.splitlines():
        match = re.match(rf"({PREFIX}-(\d+)-\S+)", line)
        if match and not os.path.exists(f"/proc/{match.group(2)}"):
            orphans.append(match.group(1))
    if orphans:
        _remove(orphans)


_REAPER = """
import sys
sys.path.insert(0, sys.argv[1])
names = sys.argv[2:]
said = sys.stdin.readline()  # "done" once the owner cleaned up; "" when the owner died first
if said.strip() != "done":
    from dojo.spec.hosts import _remove
    _remove(names)
"""


def _start_reaper(namespaces: Sequence[str]) -> subprocess.Popen:
    """A process that removes ``namespaces`` once this one is gone without removing them."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return subprocess.Popen(
        [sys.executable, "-c", _REAPER, root, *namespaces],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # Ctrl-C in a terminal (the foreground group) must not stop it
    )


@atexit.register
def _close_every_live() -> None:
    for hosts in list(_live):
        hosts.close()
