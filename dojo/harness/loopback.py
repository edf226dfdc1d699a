"""Worlds on one machine listen on loopback only: nothing outside the machine can reach them.

torch's ``TCPStore`` server listens on every interface, whatever host name it is given
(``TCPStore("127.0.0.1", 0, is_master=True)`` shows as ``*:PORT`` in ``ss -ltn``), and gloo
listens on the address its host name resolves to unless ``GLOO_SOCKET_IFNAME`` names an
interface. On a shared network (a cafe's, a conference's) either is a door into the machine for
as long as the world lives, and what comes through it is unpickled (``all_gather_object``). So the
harness's store listens on a socket bound to 127.0.0.1 and handed to torch (``master_listen_fd``),
and its ranks' gloo uses the loopback interface.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

LOOPBACK = "127.0.0.1"


def loopback_store(port: int = 0, world_size: int | None = None, **options):
    """A ``TCPStore`` server listening on 127.0.0.1 only, at ``port`` (0: one the OS picks; the
    store's ``port`` says which). ``options``: ``TCPStore``'s own (``timeout``,
    ``wait_for_workers``). Raises ``OSError`` ("Address already in use") where ``port`` is taken.
    """
    import torch.distributed as dist

    listening = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        # as torch's own server does: a port whose last connections linger in TIME_WAIT is free
        listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listening.bind((LOOPBACK, port))
        # listening already: a second socket can no longer bind the port (two bound, neither
        # listening, can on Linux), so a port taken meanwhile fails here, "Address already in use"
        listening.listen(128)
        port = listening.getsockname()[1]
    except BaseException:
        listening.close()
        raise
    options.setdefault("timeout", timedelta(seconds=300))
    return dist.TCPStore(
        LOOPBACK,
        port,
        world_size,
        is_master=True,
        master_listen_fd=listening.detach(),  # the store owns it from here on
        **options,
    )


def loopback_interface() -> str:
    """The loopback interface's name, for ``GLOO_SOCKET_IFNAME``: ``lo`` (Linux), ``lo0`` (macOS)."""
    names = {name for _, name in socket.if_nameindex()}
    return "lo" if "lo" in names or "lo0" not in names else "lo0"


def keep_gloo_on_loopback(environment: os._Environ | dict) -> None:
    """Name the loopback interface for gloo in ``environment`` unless it names one already."""
    if not environment.get("GLOO_SOCKET_IFNAME"):
        environment["GLOO_SOCKET_IFNAME"] = loopback_interface()
