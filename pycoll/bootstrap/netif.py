"""Network interface listing and NCCL_SOCKET_IFNAME-style selection (`eth`, `^docker`, `=eth0`)."""
from __future__ import annotations

import fcntl
import socket
import struct
from typing import List, Optional, Tuple

from .. import config

_SIOCGIFADDR = 0x8915


def list_interfaces() -> List[Tuple[str, str]]:
    """(name, IPv4 address) of every interface that is up and has an address."""
    out = []
    for _, name in socket.if_nameindex():
        try:
            with open(f"/sys/class/net/{name}/operstate") as fh:
                state = fh.read().strip()
        except OSError:
            state = "unknown"
        if state == "down":
            continue
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            out.append((name, socket.inet_ntoa(packed[20:24])))
        except OSError:
            pass
        finally:
            s.close()
    return out


def _matches(name: str, spec: str) -> bool:
    exclude = spec.startswith("^")
    body = spec[1:] if exclude else spec
    exact = body.startswith("=")
    pats = [p for p in (body[1:] if exact else body).split(",") if p]
    hit = any(name == p if exact else name.startswith(p) for p in pats)
    return hit != exclude


def select_address(spec: Optional[str] = None) -> Tuple[str, str]:
    """Pick the (interface, address) this rank listens on.

    With `spec` (PYCOLL_SOCKET_IFNAME syntax) the first matching interface wins; without it
    NCCL's order applies: ib*, then anything but docker/lo/virbr, then docker, then lo.
    """
    spec = spec if spec is not None else config.get("PYCOLL_SOCKET_IFNAME")
    ifaces = list_interfaces()
    if spec:
        for name, addr in ifaces:
            if _matches(name, spec):
                return name, addr
        raise ValueError(f"PYCOLL_SOCKET_IFNAME={spec!r} matches none of the interfaces "
                         f"{[n for n, _ in ifaces]}")
    order = [lambda n: n.startswith("ib"),
             lambda n: not n.startswith(("docker", "lo", "virbr")),
             lambda n: n.startswith("docker"),
             lambda n: n.startswith("lo")]
    for pred in order:
        for name, addr in ifaces:
            if pred(name):
                return name, addr
    return "lo", "127.0.0.1"
