"""The device side of the verbs transport: loading pyverbs, picking a device, port and GID,
registered memory (slot pools and a cache of user-buffer registrations) and the completion
channel's file descriptor. Nothing here knows about messages."""
from __future__ import annotations

import fcntl
import ipaddress
import mmap
import os
import socket
import struct
import threading
import weakref
from collections import deque
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Deque, Dict, List, Optional, Tuple

import numpy as np

from .. import config
from ..bootstrap.netif import list_interfaces
from ..errors import EnvError
from .routes import Advert, none

INSTALL_HINT = ("install it with `pip install 'pycoll[rdma]'` (builds rdma-core: needs cmake, "
                "libnl-3-dev, libnl-route-3-dev, pkg-config, ninja and Cython<3.1) or, for the system "
                "Python, `apt-get install python3-pyverbs`")
NO_DEVICE_HINT = ("no RDMA device is visible (/sys/class/infiniband is empty). Without an RDMA NIC, "
                  "soft-RoCE gives one: `modprobe rdma_rxe && rdma link add rxe0 type rxe netdev eth0`; "
                  "or choose PYCOLL_TRANSPORT=tcp")
SYS_IB = "/sys/class/infiniband"
_SIOCGIFNETMASK = 0x891B
_WHOLE_BUFFER_MAX = 1 << 30  # register a view's whole numpy base up to this size (later views hit)


def load_pyverbs() -> SimpleNamespace:
    """The pyverbs modules the transport uses, or EnvError saying how to install them."""
    try:
        import pyverbs.addr as addr
        import pyverbs.cq as cq
        import pyverbs.device as device
        import pyverbs.enums as enums
        import pyverbs.mr as mr
        import pyverbs.pd as pd
        import pyverbs.qp as qp
        import pyverbs.wr as wr
        from pyverbs.pyverbs_error import PyverbsError
    except ImportError as e:
        if "IBVERBS_PRIVATE" in str(e):  # PyPI's pyverbs N links the system's libibverbs, which must be rdma-core N
            raise EnvError(f"PYCOLL_TRANSPORT=verbs: pyverbs was built for a newer rdma-core than this system's "
                           f"libibverbs ({e}); install that rdma-core's libibverbs1 (PyPI's pyverbs 57/59 need "
                           "rdma-core >= 57, Debian 12 has 44), or use the system Python's python3-pyverbs") from e
        raise EnvError(f"PYCOLL_TRANSPORT=verbs needs pyverbs, which does not import here ({e}); "
                       f"{INSTALL_HINT}") from e
    return SimpleNamespace(addr=addr, cq=cq, device=device, e=enums, mr=mr, pd=pd, qp=qp, wr=wr,
                           Error=PyverbsError)


def rdma_present() -> bool:
    """Whether any RDMA device exists (sysfs only: no import, microseconds), so that hosts without
    one never load pyverbs."""
    try:
        return bool(os.listdir(SYS_IB))
    except OSError:
        return False


def unavailable_reason() -> Optional[str]:
    """Why the verbs transport cannot run here (no pyverbs, no device, no active port), or None."""
    try:
        pv = load_pyverbs()
        ctx, port = open_port(pv, config.get("PYCOLL_IB_DEV") or "")
    except EnvError as e:
        return str(e)
    ctx.close()
    return None


def local_advert() -> Advert:
    """The RDMA port `auto` would advertise from this process (or none, saying why), without setting
    up a transport: for `pycoll info`."""
    if config.get("PYCOLL_IB_DISABLE"):
        return none("PYCOLL_IB_DISABLE=1")
    if not rdma_present():
        return none(f"no RDMA device: {SYS_IB} is empty")
    try:
        pv = load_pyverbs()
        ctx, port = open_port(pv, config.get("PYCOLL_IB_DEV") or "")
    except EnvError as e:
        return none(str(e))
    ctx.close()
    return port.advert()


@dataclass(frozen=True)
class Port:
    """The device port this rank uses and what a peer needs to reach it."""

    device: str
    port: int
    gid_index: int
    gid: str
    lid: int
    mtu: int        # ibv_mtu enum value of the active MTU
    ethernet: bool  # RoCE (routed by GID) rather than InfiniBand (by LID)
    max_msg: int

    @property
    def link(self) -> str:
        """"InfiniBand", or the RoCE version of the GID in use ("RoCE v2", "RoCE v1")."""
        if not self.ethernet:
            return "InfiniBand"
        kind = _read(f"{SYS_IB}/{self.device}/ports/{self.port}/gid_attrs/types/{self.gid_index}")
        return "RoCE v2" if kind and "v2" in kind else "RoCE v1" if kind else "RoCE"

    def advert(self) -> Advert:
        """What `auto` tells the peers about this port: the network its GID lies on (routes.py)."""
        link = self.link
        network, why = gid_network(self.gid, link)
        addr = ipaddress.IPv6Address(self.gid)
        shown = f"::ffff:{addr.ipv4_mapped}" if addr.ipv4_mapped is not None else str(addr)
        return Advert(self.device, self.port, shown, self.gid_index, link, network, why)


def _read(path: str) -> Optional[str]:
    try:
        with open(path) as fh:
            return fh.read().strip()
    except OSError:
        return None


def gid_network(gid: str, link: str) -> Tuple[str, str]:
    """(network, why not) of a GID: InfiniBand, its 64-bit subnet prefix; RoCE, the IP network of the
    address the GID carries (an IPv4-mapped GID: the netmask of the interface with that address; an
    IPv6 one: its prefix length in /proc/net/if_inet6). A link-local RoCE GID names no network that
    two hosts could be seen to share: ("", why)."""
    addr = ipaddress.IPv6Address(gid)
    if link == "InfiniBand":
        return "ib " + ":".join(addr.exploded.split(":")[:4]), ""
    kind = link.lower().replace(" ", "-")
    if addr.ipv4_mapped is not None:
        ip4 = str(addr.ipv4_mapped)
        mask = _ipv4_netmask(ip4)
        if mask is None:
            return "", f"its address {ip4} is on no interface here"
        return f"{kind} {ipaddress.IPv4Network(f'{ip4}/{mask}', strict=False)}", ""
    if addr.is_link_local:
        return "", ("a link-local GID names no network; set PYCOLL_IB_GID_INDEX to a GID that carries "
                    "the interface's IP address")
    plen = _ipv6_prefix(addr)
    if plen is None:
        return "", f"its address {addr} is on no interface here"
    return f"{kind} {ipaddress.IPv6Network(f'{addr}/{plen}', strict=False)}", ""


def _ipv4_netmask(ip4: str) -> Optional[str]:
    for name, addr in list_interfaces():
        if addr == ip4:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                try:
                    packed = fcntl.ioctl(s.fileno(), _SIOCGIFNETMASK, struct.pack("256s", name.encode()[:15]))
                except OSError:
                    return None
            return socket.inet_ntoa(packed[20:24])
    return None


def _ipv6_prefix(addr: ipaddress.IPv6Address) -> Optional[int]:
    want = addr.exploded.replace(":", "")
    for line in (_read("/proc/net/if_inet6") or "").splitlines():
        fields = line.split()
        if len(fields) >= 3 and fields[0] == want:
            return int(fields[2], 16)
    return None


def open_port(pv: SimpleNamespace, spec: str = "") -> Tuple[Any, Port]:
    """Open the device and active port named by `spec` (PYCOLL_IB_DEV: `dev` or `dev:port`), or the
    first active one; EnvError naming what was found otherwise."""
    try:
        names = sorted(d.name.decode() for d in pv.device.get_device_list())
    except pv.Error as e:
        raise EnvError(f"cannot list RDMA devices: {e}; {NO_DEVICE_HINT}") from e
    if not names:
        raise EnvError(NO_DEVICE_HINT)
    want_dev, _, want_port = spec.partition(":")
    if want_dev and want_dev not in names:
        raise EnvError(f"PYCOLL_IB_DEV={spec!r}: no RDMA device {want_dev!r}; found {names}")
    if want_port and not want_port.isdigit():
        raise EnvError(f"PYCOLL_IB_DEV={spec!r}: the port after ':' must be a number")
    seen: List[str] = []
    for name in [want_dev] if want_dev else names:
        ctx = pv.device.Context(name=name)
        ports = [int(want_port)] if want_port else range(1, ctx.query_device().phys_port_cnt + 1)
        for port in ports:
            try:
                attr = ctx.query_port(port)
            except pv.Error as e:
                seen.append(f"{name}:{port} ({e})")
                continue
            if attr.state != pv.e.IBV_PORT_ACTIVE:
                seen.append(f"{name}:{port} (state {attr.state}, not active)")
                continue
            ethernet = attr.link_layer == pv.e.IBV_LINK_LAYER_ETHERNET
            gid_index, gid = _pick_gid(pv, ctx, port, attr.gid_tbl_len, ethernet)
            if gid is None:
                seen.append(f"{name}:{port} (no usable GID)")
                continue
            return ctx, Port(name, port, gid_index, gid, attr.lid, attr.active_mtu, ethernet, attr.max_msg_sz)
        ctx.close()
    raise EnvError(f"no active RDMA port to use: {', '.join(seen)}; bring a port up or set PYCOLL_IB_DEV")


def _pick_gid(pv: SimpleNamespace, ctx: Any, port: int, table_len: int, ethernet: bool
              ) -> Tuple[int, Optional[str]]:
    """(index, gid): PYCOLL_IB_GID_INDEX, else on RoCE the best of v2 IPv4-mapped > v2 > v1, on IB index 0."""
    forced = config.get("PYCOLL_IB_GID_INDEX")
    if forced is not None or not ethernet:
        index = forced if forced is not None else 0
        return index, ctx.query_gid(port, index).gid
    best: Tuple[int, int, Optional[str]] = (-1, 0, None)
    for entry in ctx.query_gid_table(max(table_len, 1)):
        gid = entry.gid_str()
        if entry.port_num != port or not gid.strip("0:"):
            continue
        v2 = entry.gid_type == pv.e.IBV_GID_TYPE_ROCE_V2  # (gid_str() is the 8-word form: parse it)
        score = 2 * v2 + (ipaddress.IPv6Address(gid).ipv4_mapped is not None)
        if score > best[0]:
            best = (score, entry.gid_index, gid)
    if best[2] is None:
        return 0, None
    return best[1], ctx.query_gid(port, best[1]).gid  # the 8-word form that GID() parses back


def address_of(view: memoryview) -> int:
    """The address of a contiguous buffer's first byte (read-only buffers too)."""
    return int(np.frombuffer(view, np.uint8).ctypes.data)


class SlotPool:
    """`count` registered slots of `size` bytes in one page-aligned memory region."""

    def __init__(self, pv: SimpleNamespace, pd: Any, count: int, size: int, access: int) -> None:
        self.count, self.size = count, size
        self._mem = mmap.mmap(-1, count * size)
        self.view = memoryview(self._mem)
        self.base = address_of(self.view)
        self.mr = pv.mr.MR(pd, count * size, access, address=self.base)

    def slot(self, index: int) -> memoryview:
        return self.view[index * self.size:(index + 1) * self.size]

    def addr(self, index: int) -> int:
        return self.base + index * self.size

    def close(self) -> None:
        self.mr.close()
        self.view.release()
        self._mem.close()


class LandingPool:
    """Registered buffers, reused by size class (powers of two), that large messages land in when
    a receive's sink consumes them."""

    def __init__(self, pv: SimpleNamespace, pd: Any, keep_bytes: int) -> None:
        self._pv, self._pd, self._keep = pv, pd, keep_bytes
        self._free: Dict[int, List[SlotPool]] = {}
        self._idle = 0

    def take(self, nbytes: int) -> SlotPool:
        size = 1 << max(12, (nbytes - 1).bit_length())
        free = self._free.get(size)
        if free:
            self._idle -= size
            return free.pop()
        e = self._pv.e
        return SlotPool(self._pv, self._pd, 1, size, e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE)

    def give(self, buf: SlotPool) -> None:
        if self._idle + buf.size > self._keep:
            buf.close()
            return
        self._free.setdefault(buf.size, []).append(buf)
        self._idle += buf.size

    def close(self) -> None:
        for bufs in self._free.values():
            for buf in bufs:
                buf.close()
        self._free.clear()


class Registration:
    """One registered range of a user buffer; alive while that buffer lives, busy while in use."""

    __slots__ = ("mr", "start", "end", "writable", "alive", "users", "ref", "__weakref__")

    def __init__(self, mr: Any, start: int, end: int, writable: bool) -> None:
        self.mr, self.start, self.end, self.writable = mr, start, end, writable
        self.alive, self.users = True, 0
        self.ref: Optional[weakref.ref] = None


class MrCache:
    """Memory registrations of user buffers, reused across calls (ring chunks of one array share one).

    A registration watches its buffer's numpy base with a weak reference: when the array is freed,
    the entry is dropped before its address can be reused by another array (no stale hit), and its
    MR is deregistered once no transfer uses it. At most `capacity` idle entries are kept (LRU).
    """

    def __init__(self, pv: SimpleNamespace, pd: Any, capacity: int) -> None:
        self._pv, self._pd, self.capacity = pv, pd, capacity
        self._entries: List[Registration] = []  # least recently used first
        self._dead: Deque[Registration] = deque()  # filled by weakref callbacks, in any thread
        self._lock = threading.Lock()
        self.registrations = 0  # how many MRs were created (tests look at reuse)

    def acquire(self, view: memoryview) -> Tuple[Registration, int]:
        """A registration covering `view` (writable views get remote-write access) and its address."""
        addr, writable = address_of(view), not view.readonly
        with self._lock:
            self._reap()
            for i in range(len(self._entries) - 1, -1, -1):
                reg = self._entries[i]
                if reg.alive and reg.start <= addr and addr + view.nbytes <= reg.end and \
                        (reg.writable or not writable):
                    self._entries.append(self._entries.pop(i))
                    reg.users += 1
                    return reg, addr
            owner, start, length = _extent(view, addr)
            e = self._pv.e
            access = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE if writable else 0
            try:
                mr = self._pv.mr.MR(self._pd, length, access, address=start)
            except self._pv.Error as err:
                raise EnvError(f"cannot register {length} bytes of memory for RDMA ({err}); raise the "
                               "locked-memory limit (`ulimit -l unlimited`, or memlock in "
                               "/etc/security/limits.conf) or lower PYCOLL_VERBS_MR_CACHE") from err
            self.registrations += 1
            reg = Registration(mr, start, start + length, writable)
            reg.ref = weakref.ref(owner, self._on_freed(reg))
            reg.users = 1
            self._entries.append(reg)
            self._evict()
            return reg, addr

    def release(self, reg: Registration) -> None:
        """A transfer that used `reg` finished (successfully or not)."""
        with self._lock:
            reg.users -= 1
            self._reap()
            self._evict()

    def _on_freed(self, reg: Registration):
        ref = weakref.ref(reg)
        dead = self._dead

        def freed(_: weakref.ref) -> None:  # runs inside the array's deallocation: no locks here
            target = ref()
            if target is not None:
                target.alive = False
                dead.append(target)
        return freed

    def _reap(self) -> None:
        for _ in range(len(self._dead)):
            reg = self._dead.popleft()
            if reg.users:
                self._dead.append(reg)  # still being written or read: deregister after release
            elif reg in self._entries:
                self._entries.remove(reg)
                reg.mr.close()

    def _evict(self) -> None:
        idle = [r for r in self._entries if not r.users]
        for reg in idle[:max(0, len(self._entries) - self.capacity)]:
            self._entries.remove(reg)
            reg.mr.close()

    def close(self) -> None:
        with self._lock:
            for reg in self._entries:
                reg.mr.close()
            self._entries.clear()
            self._dead.clear()


def _extent(view: memoryview, addr: int) -> Tuple[Any, int, int]:
    """(object to watch, start, length) to register for `view`: its whole numpy base where that is
    contiguous and not huge (so later slices of it hit the cache), else the view itself."""
    obj = view.obj
    if isinstance(obj, np.ndarray):
        top = obj
        while isinstance(top.base, np.ndarray):
            top = top.base
        start = int(top.ctypes.data)
        if top.flags.c_contiguous and top.nbytes <= _WHOLE_BUFFER_MAX and start <= addr and \
                addr + view.nbytes <= start + top.nbytes and (top.flags.writeable or view.readonly):
            return top, start, top.nbytes
        return obj, addr, view.nbytes
    return np.frombuffer(view, np.uint8), addr, view.nbytes  # nothing to watch: used once


_EVENT_FD_LINK = "anon_inode:[infinibandevent]"
_channel_lock = threading.Lock()


def _event_fds() -> set:
    fds = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}") == _EVENT_FD_LINK:
                fds.add(int(name))
        except OSError:
            pass
    return fds


def open_channel(pv: SimpleNamespace, ctx: Any) -> Tuple[Any, int]:
    """A completion channel and its file descriptor, set non-blocking so select() can wait on it.

    pyverbs exposes the descriptor as CompChannel.fd from rdma-core 57 on; older ones (Debian
    bookworm's 44) do not, so it is found as the one new completion-event descriptor.
    """
    with _channel_lock:
        before = _event_fds()
        channel = pv.cq.CompChannel(ctx)
        fd = getattr(channel, "fd", None)
        if fd is None:
            new = _event_fds() - before
            if len(new) != 1:
                channel.close()
                raise EnvError(f"cannot find the completion channel's file descriptor ({len(new)} new "
                               f"{_EVENT_FD_LINK} descriptors); use a pyverbs from rdma-core 57 or later")
            fd = new.pop()
    os.set_blocking(fd, False)
    return channel, fd
