"""Nothing of a test world listens beyond loopback: not the harness's store, not gloo's pairs,
not a program's world (``dojo.harness.loopback`` says why it matters)."""

import ipaddress
import os
import sys

import pytest
import torch
import torch.distributed as dist

from dojo.harness import world
from dojo.harness.loopback import loopback_store
from dojo.harness.world import run_world
from dojo.launch import launch_world
from dojo.spec.testing import run_module

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads listening sockets from /proc (Linux)"
)


def listening(pid: int | str = "self") -> list[str]:
    """The addresses a process's TCP sockets listen on (``127.0.0.1:40213``, ``[::]:29500``)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    found = []
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                rows = f.read().splitlines()[1:]
        except OSError:  # no IPv6 here
            continue
        for row in rows:
            fields = row.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                found.append(_address(fields[1]))
    return found


def _address(hex_address: str) -> str:
    """``0100007F:9CF5`` (the kernel's little-endian words) -> ``127.0.0.1:40181``."""
    host, port = hex_address.split(":")
    words = [bytes.fromhex(host[i : i + 8])[::-1] for i in range(0, len(host), 8)]
    address = ipaddress.ip_address(b"".join(words))
    shown = f"[{address}]" if address.version == 6 else str(address)
    return f"{shown}:{int(port, 16)}"


def beyond_loopback(addresses: list[str]) -> list[str]:
    def loopback(text: str) -> bool:
        address = ipaddress.ip_address(text.rsplit(":", 1)[0].strip("[]"))
        mapped = getattr(address, "ipv4_mapped", None)
        return (mapped or address).is_loopback

    return [a for a in addresses if not loopback(a)]


def _listeners(rank, world_size):
    """A rank's sockets once its group has carried a collective, and the interface gloo uses."""
    value = torch.tensor([rank])
    dist.all_reduce(value)
    return {"listening": listening(), "interface": os.environ.get("GLOO_SOCKET_IFNAME")}


def _listeners_in_own_group(rank, world_size, path):
    """As katas 01-03 do: the world's function makes its group itself (a file store here, so that
    only gloo's own sockets listen)."""
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world_size)
    try:
        return _listeners(rank, world_size)
    finally:
        dist.destroy_process_group()


def _assert_on_loopback(results, where):
    for rank, result in enumerate(results):
        assert result["interface"] in ("lo", "lo0"), (
            f"{where}: rank {rank} runs with GLOO_SOCKET_IFNAME={result['interface']!r}: gloo then "
            "listens on the address the host name resolves to, maybe the machine's network one"
        )
        outside = beyond_loopback(result["listening"])
        assert not outside, f"{where}: rank {rank} listens on {outside}, beyond loopback"
    port = world._store_port()
    store = [a for a in listening() if a.endswith(f":{port}")]
    assert store == [f"127.0.0.1:{port}"], (
        f"{where}: the harness's store, in the test's own process, listens on {store} (torch's "
        "store binds every interface unless it is handed a socket bound to 127.0.0.1)"
    )


def test_a_world_in_the_harness_group_listens_on_loopback_only():
    _assert_on_loopback(run_world(_listeners, 2), "a world in the harness's group")


def test_a_world_that_makes_its_own_group_listens_on_loopback_only(tmp_path):
    results = run_world(
        _listeners_in_own_group, 2, str(tmp_path / "rendezvous"), init_group=False, deadline=60
    )
    _assert_on_loopback(results, "a world that makes its own group")


def test_a_program_world_listens_on_loopback_only():
    _assert_on_loopback(
        launch_world(_listeners, 2, backend="gloo", device="cpu"), "a program's world"
    )


def test_a_program_under_test_makes_its_own_groups_on_loopback():
    """A kata's program that starts its own ranks (k01-k03's, k06's) gets gloo on loopback."""
    done = run_module("dojo.tests.tiny_program", "interface", timeout=60)
    assert done.stdout.strip() in ("GLOO_SOCKET_IFNAME=lo", "GLOO_SOCKET_IFNAME=lo0"), (
        f"a program under test runs with {done.stdout.strip() or done.stderr}: its own groups' "
        "gloo then listens on the address the host name resolves to"
    )


def test_loopback_store_serves_clients_and_listens_on_loopback_only():
    store = loopback_store(wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", store.port, is_master=False)
    client.set("key", "value")
    assert store.get("key") == b"value"
    mine = [a for a in listening() if a.endswith(f":{store.port}")]
    assert mine == [f"127.0.0.1:{store.port}"], f"the store listens on {mine}"


def test_the_address_reader_sees_a_socket_open_to_every_interface():
    """The check above can fail: a server bound to every interface is seen as such."""
    import socket

    with socket.create_server(("", 0)) as server:
        port = server.getsockname()[1]
        assert beyond_loopback([a for a in listening() if a.endswith(f":{port}")])
