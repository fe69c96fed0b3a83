"""Where a rank's memory goes, every EVERY calls: `PYCOLL_TRANSPORT=tcp pycoll run -n 4 python
tests/soak_probe.py MODE CALLS [EVERY]` (not a test; issue 17's measurements).

MODE: allreduce (8 B..4 MiB in turn), bcast_rot (the same, root rotating), bcast0 (root 0),
allreduce1m (1 MiB only), soak (test_soak's plan: three communicators, async, all collectives).
Per rank: VmRSS; glibc's heap in use, free and mmapped (mallinfo2); with PROBE_TRACE=1
tracemalloc's current/peak; over tcp the unexpected table now (entries, zmq bytes, parked bulk
payloads) and its high-water mark since the last line, and the credit window's counters. With
PROBE_TRIM=1 also RSS after malloc_trim(0): what glibc held free. Run with MALLOC_MMAP_THRESHOLD_=131072
to see RSS without glibc's dynamic threshold.
"""
import collections
import ctypes
import functools
import gc
import os
import random
import re
import sys
import time
import tracemalloc

import numpy as np

import pycoll

TRACE = os.environ.get("PROBE_TRACE") == "1"
TRIM = os.environ.get("PROBE_TRIM") == "1"
SIZES = [8 << k for k in range(20)]  # 8 B .. 4 MiB


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]


_libc = ctypes.CDLL("libc.so.6")
_libc.mallinfo2.restype = _Mallinfo2
HIGH = {"zmq": 0, "n": 0, "parked": 0}  # high-water marks of the unexpected table since the last line


def _rss_mib() -> float:
    with open("/proc/self/status") as fh:
        return int(re.search(r"VmRSS:\s+(\d+) kB", fh.read()).group(1)) / 1024


def _table(tcp):
    """(entries, bytes of zmq messages, bytes of bulk payloads read aside) in the unexpected table."""
    n = zmq_bytes = parked = 0
    for queue in list(tcp._unexpected.values()):
        for header, frame in list(queue):
            n += 1
            if type(frame).__name__ == "_Parked":
                parked += header.nbytes if frame.buffer is not None else 0
            else:
                zmq_bytes += header.nbytes
    return n, zmq_bytes, parked


def _watch_unexpected():
    """Track the unexpected table's high-water mark wherever messages enter it."""
    from pycoll.transports import tcp as tcpmod
    cls = tcpmod.TcpTransport

    def mark(self):
        n, zmq_bytes, parked = _table(self)
        HIGH.update(n=max(HIGH["n"], n), zmq=max(HIGH["zmq"], zmq_bytes), parked=max(HIGH["parked"], parked))

    def wrap(fn):
        @functools.wraps(fn)
        def inner(self, *args):
            out = fn(self, *args)
            mark(self)
            return out
        return inner
    cls._deliver, cls._park_stalled = wrap(cls._deliver), wrap(cls._park_stalled)


def _tcp_of(transport):
    tcp = getattr(transport, "_tcp", None) or transport
    return tcp if tcp.name == "tcp" else None


def report(comm, step: int, t0: float) -> None:
    gc.collect()
    mi = _libc.mallinfo2()
    line = (f"rank {comm.rank} call {step:6d} t={time.monotonic() - t0:6.1f}s rss={_rss_mib():6.1f}"
            f" heap(used={mi.uordblks / 2**20:.1f} free={mi.fordblks / 2**20:.1f} mmap={mi.hblkhd / 2**20:.1f})")
    if TRACE:
        cur, peak = tracemalloc.get_traced_memory()
        line += f" tracemalloc={cur / 2**20:.1f}/{peak / 2**20:.1f}"
        tracemalloc.reset_peak()
    tcp = _tcp_of(comm.transport)
    if tcp is not None:
        n, zmq_bytes, parked = _table(tcp)
        line += (f" unexpected={n}/{zmq_bytes / 2**20:.1f}/{parked / 2**20:.1f}"
                 f" high={HIGH['n']}/{HIGH['zmq'] / 2**20:.1f}/{HIGH['parked'] / 2**20:.1f}")
        HIGH.update(n=0, zmq=0, parked=0)
        flow = getattr(tcp, "_flow", None)
        if flow is not None:
            stats = flow.stats()
            line += f" held_back={stats['held_back']} asks={stats['asks']}"
    if TRIM:
        _libc.malloc_trim(0)
        line += f" rss_after_trim={_rss_mib():.1f}"
    print(line, flush=True)


def soak(comm, calls: int, every: int) -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import test_soak as ts
    comms = [comm, comm.dup(), comm.split(comm.rank % 2)]
    rng = random.Random(7)
    pending = collections.deque()

    def settle(limit):
        while len(pending) > limit:
            work, check, what = pending.popleft()
            work.wait(timeout=60)
            assert check(work.result()), f"wrong result of async {what}"
    t0 = time.monotonic()
    for step in range(calls):
        if step and step % every == 0:
            settle(0)
            comm.barrier()
            report(comm, step, t0)
            comm.barrier()
        name, nbytes, dtype, root, async_op, which = ts._plan(rng)
        if step < len(ts.COLLECTIVES) * len(comms):
            name, nbytes, which = list(ts.COLLECTIVES)[step // len(comms)], ts.MAX_BYTES, step % len(comms)
        c, root = comms[which], root % comms[which].size
        count = nbytes // np.dtype(dtype).itemsize // c.size * c.size
        x = np.full(count, c.rank + 1, dtype)
        call, check = ts.COLLECTIVES[name]
        got = call(c, x, root, async_op)
        if async_op:
            pending.append((got, functools.partial(check, c, x, root), f"{name} #{step}"))
        else:
            assert check(c, x, root, got), f"wrong result of {name} #{step}"
        settle(ts.IN_FLIGHT)
    settle(0)
    comm.barrier()
    report(comm, calls, t0)
    for c in comms[1:]:
        c.close()


def main() -> None:
    mode, calls = sys.argv[1], int(sys.argv[2])
    every = int(sys.argv[3]) if len(sys.argv) > 3 else 1000
    if TRACE:
        tracemalloc.start(1)
    _watch_unexpected()
    with pycoll.init() as comm:
        if mode == "soak":
            soak(comm, calls, every)
            return
        t0 = time.monotonic()
        for step in range(1, calls + 1):
            nbytes = (1 << 20) if mode == "allreduce1m" else SIZES[step % len(SIZES)]
            x = np.full(nbytes // 4, comm.rank + 1, np.float32)
            if mode in ("allreduce", "allreduce1m"):
                comm.allreduce(x)
            elif mode in ("bcast_rot", "bcast0"):
                comm.broadcast(x, root=step % comm.size if mode == "bcast_rot" else 0)
            else:
                raise SystemExit(f"unknown mode {mode}")
            if step % every == 0:
                report(comm, step, t0)
        comm.barrier()


if __name__ == "__main__":
    main()
