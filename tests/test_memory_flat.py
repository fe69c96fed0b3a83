"""Memory as the user sees it (issue 39 item 4): 4 ranks over tcp doing the issue's mix of calls with
glibc's default allocator (no MALLOC_* variable, no mallopt) keep their RSS flat.

The mix, drawn alike on every rank: blocking allreduce of 8 B .. 4 MiB (log-uniform), async allreduce
(up to IN_FLIGHT outstanding), broadcast from a rotating root, and small allgathers; every result is
checked. VmRSS is read at call START and at the end (all async work waited for, gc run, every rank at
a barrier): it must grow by less than RSS_GROWTH_MIB per rank. The user's arrays are made fresh per
call (np.full), as a script that builds its tensors each step does.

Before, two things grew the heap (at load 1.4: +15..44 MiB per rank over these 5,000 calls; at load
12: +12..25): every large allreduce made fresh receive buffers (now lent by the transport's scratch
pool, pycoll/scratch.py), and, worse, a bulk payload announced before its receive was posted kept
that receive, and so the user's array, in a reference cycle (tcp's _Parked <-> bulk's Incoming) until
the garbage collector ran, hundreds of calls later; glibc's heap, which serves arrays up to the
largest freed one (4 MiB) once its dynamic mmap threshold has risen, fragmented around those
stragglers. Each call's page faults and the pool's size are printed with the figures.
"""
from __future__ import annotations

import collections
import gc
import os
import random
import re
import resource
import time
from typing import Any, Deque, Dict, Tuple

import numpy as np
import pytest

from multiproc import run_ranks

CALLS, START = 6_000, 1_000  # ~12 s at load 1.5, ~40 s at load 20 (2 cores): the default run takes it
RSS_GROWTH_MIB = 16
IN_FLIGHT = 4
MIX = (("allreduce", 40), ("async_allreduce", 25), ("broadcast", 25), ("allgather", 10))  # %
MAX_BYTES = 4 << 20
DTYPES = (np.float32, np.float64, np.int32)


def _rss_kib() -> int:
    with open("/proc/self/status") as fh:
        return int(re.search(r"VmRSS:\s+(\d+) kB", fh.read()).group(1))


def _plan(rng: random.Random) -> Tuple[str, int, Any, int]:
    """The next call, alike on every rank: (kind, element count, dtype, root)."""
    kind = rng.choices([k for k, _ in MIX], [w for _, w in MIX])[0]
    dtype = np.dtype(rng.choice(DTYPES))
    if kind == "allgather":
        nbytes = rng.randint(8, 4 << 10)
    else:
        nbytes = int(8 * (MAX_BYTES / 8) ** rng.random())  # log-uniform 8 B .. 4 MiB
    return kind, max(1, nbytes // dtype.itemsize), dtype, rng.randrange(1 << 16)


def _tri(n: int) -> int:
    return n * (n + 1) // 2


def _mix(comm, calls: int, start: int, seed: int) -> Dict[str, Any]:
    """Run `calls` calls of the mix; RSS at call `start` and at the end in MiB, page faults per call
    after `start`, and what the transport's scratch pool holds at the end."""
    rng = random.Random(seed)
    pending: Deque[Tuple[Any, str]] = collections.deque()
    figures: Dict[str, Any] = {}
    total = _tri(comm.size)

    def settle(limit: int) -> None:
        while len(pending) > limit:
            work, what = pending.popleft()
            got = work.wait(timeout=60) and work.result()
            assert np.all(got == total), f"rank {comm.rank}: wrong result of {what}"

    def snapshot(tag: str) -> None:
        settle(0)
        comm.barrier()
        gc.collect()
        figures[f"rss_{tag}_mib"] = round(_rss_kib() / 1024, 1)
        comm.barrier()

    t0 = time.monotonic()
    for step in range(calls):
        if step == start:
            snapshot("start")
            t_start, faults = time.monotonic(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        kind, count, dtype, root = _plan(rng)
        root %= comm.size
        what = f"{kind} #{step} ({count} x {dtype}, root {root})"
        x = np.full(count, comm.rank + 1, dtype)
        if kind == "allreduce":
            assert np.all(comm.allreduce(x) == total), f"wrong result of {what}"
        elif kind == "async_allreduce":
            pending.append((comm.allreduce(x, async_op=True), what))
        elif kind == "broadcast":
            assert np.all(comm.broadcast(x, root=root) == root + 1), f"wrong result of {what}"
        else:
            got = comm.allgather(x)
            assert np.all(got == np.arange(1, comm.size + 1)[:, None]), f"wrong result of {what}"
            assert got.flags.owndata, f"the result of {what} views memory it does not own (scratch?)"
        settle(IN_FLIGHT)
    snapshot("end")
    figures["seconds"] = round(time.monotonic() - t0, 1)
    figures["ms_per_call"] = round((time.monotonic() - t_start) * 1e3 / (calls - start), 2)
    figures["minflt_per_call"] = round((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)
                                       / (calls - start), 1)
    figures["growth_mib"] = round(figures["rss_end_mib"] - figures["rss_start_mib"], 1)
    figures["pool"] = comm.transport.scratch.stats()
    return figures


def _default_allocator(monkeypatch) -> None:
    """The ranks run with glibc as it comes: no MALLOC_* tunable inherited from this environment."""
    for name in list(os.environ):
        if name.startswith("MALLOC_") or name == "GLIBC_TUNABLES":
            monkeypatch.delenv(name)


def _check(results: list) -> None:
    for rank, f in enumerate(results):
        print(f"rank {rank}: {f}")
    for rank, f in enumerate(results):
        assert f["growth_mib"] < RSS_GROWTH_MIB, (rank, f)


@pytest.mark.timeout(240)
def test_rss_flat_over_6000_mixed_calls(monkeypatch):
    _default_allocator(monkeypatch)
    _check(run_ranks(_mix, 4, CALLS, START, 39, timeout=220, env={"PYCOLL_TRANSPORT": "tcp"}))
