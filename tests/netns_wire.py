"""A userspace wire between emulated hosts: delay, jitter, loss and reordering without netem.

This kernel has no netem (../shared/reference/link-emulation.md). Instead, for every pair of hosts
(network namespaces) one process holds two TUN devices (IFF_TUN | IFF_NO_PI), moved one into each
namespace, with a host route to the other host's address through it: traffic between the two hosts
leaves one namespace as IP packets this process reads, holds for the link's delay (plus a uniform
jitter of +-jitter; a packet is dropped with probability `loss`, and one in `reorder` is sent at once,
overtaking those held), then writes into the other namespace. Traffic to anything else (the
rendezvous store on the bridge) keeps its veth and is not delayed.

    wire = Wire(namespaces, addresses, delay_ms=1.0, jitter_ms=0.0, loss=0.0, reorder=0.0)
    wire.start(); ...; wire.stop()    # Cluster(..., delay_ms=...) does this

Its throughput is bounded by one Python thread (well under 1 Gbit/s): use it for latency-bound runs
and tbf (Cluster's rate_mbit) for rate-bound ones, and measure what it delivers in the same run.

The thread runs at real-time priority (SCHED_FIFO, when allowed: root): a real link does not wait
for its hosts' CPUs, but this one shares the cores with the emulated hosts' ranks, and at normal
priority a packet due while ranks compute left the wire a scheduler slice late (TP decoding on
2 hosts at 1 ms: 0.2 ms more per allreduce than the delay; stats["realtime"] says which it got).
"""
from __future__ import annotations

import fcntl
import heapq
import itertools
import os
import random
import select
import struct
import subprocess
import threading
import time
from typing import Dict, List, Optional, Sequence, Tuple

_TUNSETIFF = 0x400454CA
_IFF_TUN, _IFF_NO_PI = 0x0001, 0x1000
_MTU = 1500
_READ = 65536


def _run(*argv: str) -> None:
    proc = subprocess.run(list(argv), capture_output=True, text=True)
    if proc.returncode:
        raise OSError(f"`{' '.join(argv)}` failed: {proc.stderr.strip()}")


def _open_tun(name: str) -> int:
    """A non-blocking file descriptor of a new TUN device `name` (in this namespace)."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    try:
        fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH22x", name.encode(), _IFF_TUN | _IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    return fd


class Wire:
    """One thread moving packets between every pair of `namespaces` with the given impairments.

    delay_ms is one way; jitter_ms spreads each packet's delay uniformly over +-jitter_ms (packets
    then overtake one another, as on a real path with jitter); loss and reorder are probabilities
    (0..1) per packet. `seed` makes the impairments repeatable."""

    def __init__(self, namespaces: Sequence[str], addresses: Sequence[str], tag: str, delay_ms: float = 0.0,
                 jitter_ms: float = 0.0, loss: float = 0.0, reorder: float = 0.0, seed: int = 0) -> None:
        if delay_ms < 0 or jitter_ms < 0 or jitter_ms > delay_ms:
            raise ValueError(f"wire: need 0 <= jitter_ms <= delay_ms, got delay {delay_ms} jitter {jitter_ms}")
        if not (0 <= loss < 1 and 0 <= reorder < 1):
            raise ValueError(f"wire: loss and reorder are probabilities in [0, 1), got {loss}, {reorder}")
        self.namespaces, self.addresses, self.tag = list(namespaces), list(addresses), tag
        self.delay, self.jitter, self.loss, self.reorder = delay_ms / 1e3, jitter_ms / 1e3, loss, reorder
        self._rng = random.Random(seed)
        self._peer: Dict[int, int] = {}  # fd -> the fd its packets go out of
        self._fds: List[int] = []
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.stats = {"packets": 0, "bytes": 0, "dropped": 0, "reordered": 0, "write_errors": 0, "realtime": False}

    def start(self) -> None:
        """Create a TUN pair per pair of hosts, route each host's traffic to the other through it, and
        start moving packets."""
        try:
            for k, (i, j) in enumerate(itertools.combinations(range(len(self.namespaces)), 2)):
                a, b = f"pcw{self.tag}{k}a", f"pcw{self.tag}{k}b"
                fa, fb = _open_tun(a), _open_tun(b)
                self._fds += [fa, fb]
                self._peer[fa], self._peer[fb] = fb, fa
                for name, ns, me, other in ((a, self.namespaces[i], self.addresses[i], self.addresses[j]),
                                            (b, self.namespaces[j], self.addresses[j], self.addresses[i])):
                    _run("ip", "link", "set", name, "netns", ns)
                    # no IPv6 on the wire: its router solicitations would be packets nobody sent
                    subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-q", "-w",
                                    f"net.ipv6.conf.{name}.disable_ipv6=1"], capture_output=True)
                    _run("ip", "-n", ns, "link", "set", name, "mtu", str(_MTU), "up")
                    _run("ip", "-n", ns, "route", "add", f"{other}/32", "dev", name, "src", me)
        except BaseException:
            self.stop()
            raise
        self._thread = threading.Thread(target=self._loop, name="netns-wire", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread and close the devices (their routes go with them)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None
        for fd in self._fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds.clear()

    def _hold(self) -> float:
        d = self.delay
        if self.jitter:
            d += self._rng.uniform(-self.jitter, self.jitter)
        return d

    def _realtime(self) -> None:
        """Run this thread ahead of the emulated hosts' ranks (SCHED_FIFO), if the system lets us."""
        try:
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(50))  # 0: the calling thread
            self.stats["realtime"] = True
        except (AttributeError, OSError):  # not root, or no real-time scheduling here: normal priority
            pass

    def _loop(self) -> None:
        self._realtime()
        heap: List[Tuple[float, int, int, bytes]] = []  # (release time, order, out fd, packet)
        order = itertools.count()
        stats, rng, fds = self.stats, self._rng, self._fds
        while not self._stop.is_set():
            now = time.monotonic()
            while heap and heap[0][0] <= now:
                _, _, out, pkt = heapq.heappop(heap)
                self._write(out, pkt)
            # select() takes microseconds (poll() would round the hold to whole milliseconds)
            ready, _, _ = select.select(fds, [], [], 0.1 if not heap else max(0.0, heap[0][0] - time.monotonic()))
            for fd in ready:
                while True:
                    try:
                        pkt = os.read(fd, _READ)
                    except OSError:  # BlockingIOError: nothing more; anything else: the device went away
                        break
                    stats["packets"] += 1
                    stats["bytes"] += len(pkt)
                    if self.loss and rng.random() < self.loss:
                        stats["dropped"] += 1
                        continue
                    if self.reorder and rng.random() < self.reorder:
                        stats["reordered"] += 1
                        self._write(self._peer[fd], pkt)  # sent at once: overtakes the packets held
                        continue
                    hold = self._hold()
                    if hold <= 0:
                        self._write(self._peer[fd], pkt)
                    else:
                        heapq.heappush(heap, (time.monotonic() + hold, next(order), self._peer[fd], pkt))

    def _write(self, fd: int, pkt: bytes) -> None:
        try:
            os.write(fd, pkt)
        except OSError:  # the device is not up yet (EIO) or its queue is full: the packet is lost
            self.stats["write_errors"] += 1
