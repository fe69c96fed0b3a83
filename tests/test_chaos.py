"""Chaos on the emulated cluster (tests/netns_cluster.py): 3 hosts x 2 ranks of the elastic trainer
(`pycoll run --elastic --max-restarts 2 ... -m pycoll.trainer --elastic`) while every link between hosts
drops 1% of packets, delays them 5 ms +- 2 ms and reorders 1% (the userspace wire, tests/netns_wire.py:
this kernel has no netem), and a rank is SIGKILLed from outside, by the pid of its process inside its
host's namespace, at random steps (the seed is printed) and restarted by its node's launcher.

The run must end by itself (`pycoll run --timeout`, --hang-timeout: no wait is left to the test's
timeout), on all 6 ranks, replicas bit-identical (rank 0 compares every rank's parameter digest), and its
log must tell what happened when: the kill, the survivors' detection and shrink, the restart, the grow and
heal, the first step on 6 ranks again. Times are CLOCK_MONOTONIC, shared by the namespaces of one machine.
The same job under the bad network alone must show no error at all; its slowdown against a clean network
is printed."""
from __future__ import annotations

import os
import random
import re
import secrets
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import List, Optional, Sequence

import pytest

from netns_cluster import Cluster, unavailable

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=f"emulated cluster: {unavailable()}")

HOSTS, PPN = 3, 2
BAD = dict(delay_ms=5.0, jitter_ms=2.0, loss=0.01, reorder=0.01)
STEP = re.compile(r"\[rank 0\] epoch \d+/\d+ step (\d+)/(\d+):")


@dataclass
class Job:
    """A multi-node `pycoll run` on the cluster: one launcher per host, each logging to a file."""
    cluster: Cluster
    procs: List[subprocess.Popen]
    logs: List[str]
    ppn: int
    started: float = field(default_factory=time.monotonic)

    def text(self, node: int = 0) -> str:
        with open(self.logs[node], errors="replace") as fh:
            return fh.read()

    def step(self) -> int:
        """The last step rank 0 logged (0 before the first)."""
        found = STEP.findall(self.text(0))
        return int(found[-1][0]) if found else 0

    def ended(self) -> bool:
        return all(p.poll() is not None for p in self.procs)

    def wait_for(self, what, limit: float) -> bool:
        """Poll `what()` until true, the job ends, or `limit` s pass (the job's own timeout is shorter)."""
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            if what():
                return True
            if self.ended():
                return bool(what())
            time.sleep(0.05)
        return False

    def finish(self, limit: float) -> List[int]:
        for p in self.procs:
            try:
                p.wait(max(0.1, self.started + limit - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        codes = []
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            codes.append(p.returncode)
        return codes


def _start(c: Cluster, trainer: Sequence[str], launcher: Sequence[str], timeout: float, ppn: int = PPN) -> Job:
    """`pycoll run -n PPN --nnodes HOSTS --node-rank i <launcher> --timeout T --hang-timeout ... -m pycoll.trainer
    <trainer>` in every host, the store on host 0."""
    port = 21000 + secrets.randbelow(20000)
    env = dict(os.environ, PYCOLL_JOB_TOKEN=secrets.token_hex(16))
    logs = [os.path.join(c.workdir, f"node{i}.log") for i in range(c.nhosts)]
    procs = [c.popen(i, [sys.executable, "-m", "pycoll", "run", "-n", str(ppn), "--nnodes", str(c.nhosts),
                         "--node-rank", str(i), "--master-addr", c.addresses[0], "--master-port", str(port),
                         "--timeout", f"{timeout:g}", "--hang-timeout", "60", *launcher,
                         "-m", "pycoll.trainer", *trainer], env, logs[i])
             for i in range(c.nhosts)]
    return Job(c, procs, logs, ppn)


def _rank_pid(c: Cluster, slot: int, ppn: int) -> Optional[int]:
    """The pid of the live trainer process of `slot` (its RANK), found inside its host's namespace."""
    host = slot // ppn
    pids = subprocess.run(["ip", "netns", "pids", c.namespaces[host]], capture_output=True, text=True).stdout.split()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                argv = fh.read().split(b"\0")
            with open(f"/proc/{pid}/environ", "rb") as fh:
                env = fh.read().split(b"\0")
        except OSError:
            continue
        if argv[1:3] == [b"-m", b"pycoll.trainer"] and f"RANK={slot}".encode() in env:
            return int(pid)
    return None


def _trainer_args(epochs: int) -> List[str]:
    return ["--elastic", "--epochs", str(epochs), "--batch-size", "60", "--log-every", "1"]


def _all_text(job: Job) -> str:
    return "\n".join(job.text(i) for i in range(len(job.logs)))


def _check_finished(text: str, codes: List[int], ranks: int) -> str:
    assert codes == [0] * len(codes), f"exit codes {codes}\n{text[-12000:]}"
    assert f"replicas bit-identical across {ranks} rank(s): yes" in text, text[-6000:]
    return text


def _step_times(text: str) -> List[float]:
    """Rank 0's measured step times (ms) from its per-step lines."""
    return [float(m) for m in re.findall(r"\[rank 0\] epoch \d+/\d+ step \d+/\d+: .*?step ([\d.]+) ms", text)]


@dataclass
class Kill:
    slot: int
    pid: int
    step: int
    at: float


def _chaos(epochs: int, kills: int, limit: float, hosts: int = HOSTS, ppn: int = PPN, first: int = 3,
           span: float = 0.7) -> None:
    """`epochs` of the elastic trainer on `hosts` x `ppn` ranks over the bad network, `kills` ranks SIGKILLed
    at random steps (from step `first`, spread over the run's first `span`: the rest leaves a restarted
    rank time to start and join) and restarted; checks and prints what happened when."""
    seed = secrets.randbelow(1 << 30)
    rng = random.Random(seed)
    print(f"\nchaos seed {seed}")
    n = hosts * ppn
    whole = f"first step on {n} ranks done"
    with Cluster(hosts, wire_seed=seed, **BAD) as c:
        job = _start(c, _trainer_args(epochs), ["--elastic", "--max-restarts", str(kills)], limit, ppn)
        done: List[Kill] = []
        try:
            assert job.wait_for(lambda: job.step() > 0, limit / 2), _all_text(job)[-8000:]
            total = int(STEP.findall(job.text(0))[0][1])
            for k in range(kills):
                # a random step in the k-th share of the run's first `span`, and not before the last kill's heal
                lo, hi = int(total * span * k / kills) + first, int(total * span * (k + 1) / kills)
                at = max(rng.randint(lo, max(lo, hi)), job.step() + 2)
                slot = rng.randrange(1, n)  # rank 0 logs the run: any other rank may die
                assert job.wait_for(lambda: job.step() >= at, limit), _all_text(job)[-8000:]
                pid = _rank_pid(c, slot, ppn)
                assert pid is not None, f"no trainer process of rank {slot} in {c.namespaces[slot // ppn]}"
                os.kill(pid, 9)
                done.append(Kill(slot, pid, job.step(), time.monotonic()))
                print(f"kill {k + 1}: SIGKILL rank {slot} (pid {pid}) at step {done[-1].step} "
                      f"t={done[-1].at:.3f}", flush=True)
                # the next kill waits until the job is whole again
                back = job.text(0).count(whole)
                assert job.wait_for(lambda: job.text(0).count(whole) > back,
                                    limit), _all_text(job)[-12000:]
            codes = job.finish(limit + 30)
        finally:
            job.finish(0)
            text = _all_text(job)  # (the cluster's folder goes with it)
        stats = dict(c.wire.stats)
    _check_finished(text, codes, n)
    # what happened when, from the run's own log
    died = re.findall(r"\[rank 0\] pycoll\.trainer: \[t=([\d.]+)\] rank (\d+) died at step (\d+); continued on "
                      r"(\d+) ranks after ([\d.]+) s \(shrunk; met at t=([\d.]+)\)", text)
    joined = re.findall(r"\[rank 0\] pycoll\.trainer: \[t=([\d.]+)\] ranks? \[?([\d, ]+)\]? joined at step (\d+); "
                        r"continued on (\d+) ranks after ([\d.]+) s", text)
    firsts = [float(t) for t in re.findall(r"\[t=([\d.]+)\] " + whole, text)]
    restarted = re.findall(r"rank (\d+) \(pid (\d+)\) was killed by signal SIGKILL \[at [\d.]+ s\]; restarted it",
                           text)
    announced = re.findall(r"\[rank (\d+)\] pycoll\.trainer: \[t=([\d.]+)\] joined the run as rank (\d+) of (\d+) "
                           r"at step (\d+) \(slot \d+, restart (\d+), announced at t=([\d.]+)\)", text)
    assert len(died) == kills and all(int(m) == n - 1 for _, _, _, m, _, _ in died), text[-12000:]
    assert len(joined) == kills and all(int(m) == n for _, _, _, m, _ in joined), text[-12000:]
    assert sorted((int(s), int(p)) for s, p in restarted) == sorted((k.slot, k.pid) for k in done), (restarted, done)
    announced.sort(key=lambda a: float(a[6]))  # the nodes' logs follow one another: order by time
    assert len(announced) == kills and len(firsts) >= kills, text[-12000:]
    for k, kill in enumerate(done):
        t_died, _, step, _, _, met = died[k]
        t_join = float(joined[k][0])
        first = min(t for t in firsts if t >= t_join)
        came = float(announced[k][6])
        # kill, detection, shrink, restart, grow and heal, first whole step: in that order, before the next kill
        when = [kill.at - 0.05, float(met), float(t_died), first]
        assert when == sorted(when) and kill.at < came <= t_join <= first, (k, kill, died[k], announced[k], joined[k])
        assert k + 1 == len(done) or first < done[k + 1].at, (first, done)
        print(f"kill {k + 1}: rank {kill.slot} at step {kill.step} (t={kill.at:.3f}); rank 0 met the failure at "
              f"+{float(met) - kill.at:.2f} s and went on on {n - 1} ranks at +{float(t_died) - kill.at:.2f} s "
              f"(step {step}); restarted process announced itself at +{float(announced[k][6]) - kill.at:.2f} s; "
              f"grown and healed at +{t_join - kill.at:.2f} s (the grow and heal took {float(joined[k][4]):.2f} s); "
              f"first step on {n} ranks at +{first - kill.at:.2f} s")
    print(f"run: {time.monotonic() - job.started:.1f} s, {kills} kills and restarts, "
          f"wire {stats}, load average {os.getloadavg()}")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_minutes_of_kills_and_restarts_over_a_bad_network() -> None:
    """About 2 minutes of the elastic trainer, two ranks killed and restarted at random steps."""
    _chaos(epochs=14, kills=2, limit=420)


def _undisturbed(epochs: int, limit: float, **wire) -> tuple:
    """The trainer on the cluster without kills: (rank 0's step times in ms, the run's seconds, the log)."""
    with Cluster(HOSTS, **wire) as c:
        job = _start(c, _trainer_args(epochs), ["--elastic"], limit)
        codes = job.finish(limit + 30)
        took = time.monotonic() - job.started
        text = _check_finished(_all_text(job), codes, HOSTS * PPN)
    bad = [line for line in text.splitlines()
           if re.search(r"error|exception|traceback|died|killed|revoked|timed out|warn|shrunk|joined", line, re.I)]
    assert not bad, "\n".join(bad[:40])
    times = _step_times(text)
    assert len(times) == int(STEP.findall(text)[-1][1]), text[-4000:]
    return times, took, text


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_bad_network_alone_costs_time_not_errors() -> None:
    """The same job (same steps) on a clean network and on the bad one: no error at all on either; the
    slowdown (median step time, whole run) is printed."""
    clean, clean_s, _ = _undisturbed(4, 300)
    bad, bad_s, _ = _undisturbed(4, 300, wire_seed=secrets.randbelow(1 << 30), **BAD)
    a, b = statistics.median(clean), statistics.median(bad)
    print(f"\nclean network: median step {a:.1f} ms, run {clean_s:.1f} s; bad network (1% loss, 5+-2 ms, 1% "
          f"reorder): median step {b:.1f} ms, run {bad_s:.1f} s; slowdown {b / a:.2f}x per step, "
          f"{bad_s / clean_s:.2f}x in all; load average {os.getloadavg()}")
    assert len(clean) == len(bad)


@pytest.mark.timeout(240)
def test_a_rank_killed_and_restarted_over_a_bad_network() -> None:
    """The short variant: 2 hosts x 2 ranks, one rank killed at a random step and restarted."""
    _chaos(epochs=4, kills=1, limit=180, hosts=2, ppn=2, span=0.35)
