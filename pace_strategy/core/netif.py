"""Which network interface the gloo side group uses: the one the job's own traffic goes through.

gloo picks its interface from ``GLOO_SOCKET_IFNAME`` or else from the host name, which on common
images resolves to 127.0.1.1 or to an address the other nodes cannot reach, while NCCL (which picks
its own interfaces) works: the side group would then hang at start or never connect. When the
variable is unset, the interface that routes to ``MASTER_ADDR`` is the one the job's rendezvous
already uses. Linux, IPv4; anywhere else the choice is left to gloo.
"""

from __future__ import annotations

import fcntl
import os
import socket
import struct

__all__ = ["GLOO_IFNAME_VARIABLE", "gloo_interface", "interface_with_address", "route_source_address"]

GLOO_IFNAME_VARIABLE = "GLOO_SOCKET_IFNAME"
_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address


def route_source_address(address: str, port: int = 29500) -> str | None:
    """The local IPv4 address the kernel would send from to reach ``address`` (no packet is sent: a
    UDP ``connect`` only picks the route), or ``None`` when there is no route or name."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((address, port))
            return str(s.getsockname()[0])
    except OSError:
        return None


def interface_with_address(address: str) -> str | None:
    """The name of the local interface that holds IPv4 ``address``, or ``None``."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for name in names:
            try:
                packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
            except OSError:  # no IPv4 address on it
                continue
            if socket.inet_ntoa(packed[20:24]) == address:
                return name
    return None


def gloo_interface() -> tuple[str | None, str]:
    """The interface for gloo and where the choice came from: ``GLOO_SOCKET_IFNAME`` when set, else
    the interface that routes to ``MASTER_ADDR``; ``(None, why)`` when neither is known."""
    chosen = os.environ.get(GLOO_IFNAME_VARIABLE)
    if chosen:
        return chosen, GLOO_IFNAME_VARIABLE
    master = os.environ.get("MASTER_ADDR")
    if not master:
        return None, "MASTER_ADDR is not set: gloo picks an interface from the host name"
    try:
        port = int(os.environ.get("MASTER_PORT", "29500"))
    except ValueError:
        port = 29500
    source = route_source_address(master, port)
    name = interface_with_address(source) if source is not None else None
    if name is None:
        return None, f"no local interface routes to MASTER_ADDR={master}: gloo picks one from the host name"
    if source is not None and source.startswith("127.") and _spans_nodes():
        # MASTER_ADDR resolves to this host's loopback (a 127.0.1.1 /etc/hosts entry on node 0): the
        # other nodes cannot reach that; leave the choice to gloo and say what to set.
        return None, (
            f"MASTER_ADDR={master} routes over loopback here but the job spans several nodes: set "
            f"{GLOO_IFNAME_VARIABLE}"
        )
    return name, f"the route to MASTER_ADDR={master} (from {source})"


def _spans_nodes() -> bool:
    """Whether the launcher says the job has ranks on other nodes (``WORLD_SIZE`` > ``LOCAL_WORLD_SIZE``)."""
    try:
        return int(os.environ["WORLD_SIZE"]) > int(os.environ["LOCAL_WORLD_SIZE"])
    except (KeyError, ValueError):
        return False
