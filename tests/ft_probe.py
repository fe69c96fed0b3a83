"""Fault-tolerance figures (not a test; issue 22's measurements). `python tests/ft_probe.py revoke
[TRANSPORT ...] [--reps N] [--ranks N] [--count N] [--load K] [--show S]` runs N revocations per
transport in one job each: rank 0 revokes while the others are blocked in an allreduce of COUNT
float32 it never joins (each time on a fresh dup, so a small one runs on the shm board); a rank's
latency is from the revoke (or its entry into the call, if later) to its RevokedError. With
--load K, K busy-loop processes run meanwhile. Prints a markdown table."""
import argparse
import os
import statistics
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from multiproc import run_ranks  # noqa: E402


def _revokes(comm, reps, count):
    """`reps` rounds (at most 14: each takes a board lane) of: a fresh dup (with a board of its own,
    on shm: the path a small allreduce takes until a failed call drops it), one warm-up allreduce on
    it, a barrier; rank 0 revokes after 0.2 s; the others block until they raise; agree restores it.
    Rank 0 returns its revoke times, the others (raised, entered)."""
    import pycoll
    out = []
    x = np.ones(count, np.float32)
    for _ in range(reps):
        sub = comm.dup()
        sub.allreduce(x)  # a first call's one-time work (imports, set-up) is not revocation latency
        sub.barrier()
        if sub.rank == 0:
            time.sleep(0.2)
            out.append(time.monotonic())
            sub.revoke()
        else:
            entered = time.monotonic()
            try:
                sub.allreduce(x)
                raise AssertionError("the allreduce completed without rank 0")
            except pycoll.RevokedError:
                out.append((time.monotonic(), entered))
        sub.agree(sub.rank != 0)
        sub.close()
    return out


def revoke_latencies(transport, reps, ranks, count, show=0.0):
    """Every (rank, repetition) latency of one job, in seconds; those over `show` s printed (if > 0)."""
    env = {"PYCOLL_TRANSPORT": transport, "PYCOLL_TIMEOUT": "30"}
    results = run_ranks(_revokes, ranks, reps, count, env=env, timeout=60 + 5 * reps)
    out = []
    for rank, per_rank in enumerate(results[1:], 1):
        for rep, (at, (raised, entered)) in enumerate(zip(results[0], per_rank)):
            out.append(raised - max(at, entered))
            if show and out[-1] > show:
                print(f"  {transport}: rank {rank} round {rep}: {out[-1]:.3f} s (entered the call "
                      f"{entered - at:+.3f} s from the revoke)")
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["revoke"])
    ap.add_argument("transports", nargs="*", default=["tcp", "shm", "auto"])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--count", type=int, default=8)
    ap.add_argument("--load", type=int, default=0)
    ap.add_argument("--show", type=float, default=0.0, help="print each latency over this many seconds")
    args = ap.parse_args()
    load = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
    try:
        print(f"| transport | samples | median s | p90 s | max s | > 1 s |  ({args.ranks} ranks, {args.count} "
              f"float32, load {args.load})")
        print("|---|---|---|---|---|---|")
        for t in args.transports:
            lat = sorted(revoke_latencies(t, args.reps, args.ranks, args.count, args.show))
            p90 = lat[int(0.9 * (len(lat) - 1))]
            print(f"| {t} | {len(lat)} | {statistics.median(lat):.3f} | {p90:.3f} | {lat[-1]:.3f} | "
                  f"{sum(v > 1.0 for v in lat)} |", flush=True)
    finally:
        for p in load:
            p.kill()
            p.wait()


if __name__ == "__main__":
    main()
