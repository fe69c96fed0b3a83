"""`pycoll bench allreduce --np N --compare mpi,mpi-tcp,gloo`: pycoll and each peer library in jobs of
their own, launched and bound alike, timed in interleaved rounds.

Every library runs as its own `mpirun --oversubscribe --bind-to BIND -np N` job of bench_worker.py
(Gloo through torch.distributed with its own TCP store; mpi-tcp is Open MPI with `--mca btl tcp,self`).
Ranks wait on the driver's socket between turns, and during one job's turn every other job's ranks
are stopped (SIGSTOP, SIGCONT after it): an idle Gloo rank still wakes about 100 times a second, and
those wake-ups would land in another library's timing. So a job's timing shares the cores only with
the machine's other load. Each round visits every size, and at each size every library in turn (the
order rotating); per library and size the figure is the median over rounds of the slowest rank's
mean call, its spread the min-max over rounds, and CPU per call the ranks' mean user+sys seconds.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Tuple

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_worker.py")
SOURCE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(WORKER)))
# (the last two: pycoll through torch, Python's floor)
PEERS = ("mpi", "mpi-tcp", "gloo", "torch-pycoll", "python-shm")
PERSISTENT = "-persistent"  # a pycoll job's name ending in it calls persistent handles


@dataclass
class Job:
    """One library's mpirun job: its process, and one control connection per rank."""

    name: str
    lib: str
    proc: subprocess.Popen
    log: Any
    listener: socket.socket
    conns: List[socket.socket] = field(default_factory=list)
    readers: List[Any] = field(default_factory=list)
    via: str = ""
    pids: List[int] = field(default_factory=list)
    session_dir: str = ""  # this job's own Open MPI session folder

    def fail(self, what: str) -> RuntimeError:
        """An error naming this job and what went wrong, with the head and tail of its mpirun output."""
        self.log.flush()
        self.log.seek(0)
        text = self.log.read()
        text = text if len(text) < 4000 else f"{text[:2000]}\n...\n{text[-2000:]}"
        return RuntimeError(f"pycoll bench: {self.name} job {what} (mpirun exit {self.proc.poll()}); its output:\n{text}")


def job_names(transports: List[str], peers: List[str], persistent: bool = False) -> List[str]:
    """'pycoll' (auto transport) or 'pycoll-<transport>' per transport (and with `persistent` the same
    with '-persistent': allreduce_init handles), then the peers."""
    ours = [("pycoll" if t in ("", "auto") else f"pycoll-{t}") for t in transports]
    return ours + ([name + PERSISTENT for name in ours] if persistent else []) + peers


def mpirun_prefix(lib: str, n: int, bind: str) -> List[str]:
    """The same launch for every library; Open MPI over TCP only differs in its MCA selection."""
    cmd = [shutil.which("mpirun") or "mpirun", "--oversubscribe", "--bind-to", bind, "-np", str(n)]
    return cmd + (["--mca", "pml", "ob1", "--mca", "btl", "tcp,self"] if lib == "mpi-tcp" else [])


def job_env() -> Dict[str, str]:
    """The environment of every job: loopback only, this pycoll on the path, no launcher variables."""
    env = dict(os.environ, OMPI_MCA_btl_tcp_if_include="lo", OMPI_MCA_oob_tcp_if_include="lo",
               PYTHONPATH=os.pathsep.join([SOURCE_ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    if os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "PYCOLL_STORE_HOSTED",
                "PYCOLL_STORE_PORT", "PYCOLL_JOB_TOKEN"):
        env.pop(var, None)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(name: str, n: int, bind: str) -> Job:
    """Start one library's job; its ranks connect to a listener of its own."""
    persistent = name.startswith("pycoll") and name.endswith(PERSISTENT)
    plain = name[:-len(PERSISTENT)] if persistent else name
    lib, _, transport = plain.partition("-") if name.startswith("pycoll") else (name, "", "")
    listener = socket.create_server(("127.0.0.1", 0), backlog=n)
    log = tempfile.TemporaryFile("w+")
    cmd = mpirun_prefix(lib, n, bind) + [sys.executable, WORKER, lib, str(listener.getsockname()[1]),
                                         "--transport", transport, "--store-port", str(free_port())]
    cmd += ["--persistent"] if persistent else []
    # each job its own Open MPI session folder: mpiruns started together race to create the shared
    # /tmp/ompi.<host>.<uid>, and the loser ends with "mkdir ... File exists"
    session = tempfile.mkdtemp(prefix="pycoll-bench-ompi-")
    try:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True,
                                env=dict(job_env(), OMPI_MCA_orte_tmpdir_base=session))
    except BaseException:  # no job to end later: its folder, listener and log go now
        shutil.rmtree(session, ignore_errors=True)
        listener.close()
        log.close()
        raise
    return Job(name, lib, proc, log, listener, session_dir=session)


def connect(job: Job, n: int, deadline: float) -> None:
    """Wait for every rank's hello; a job that dies or stays silent is an error naming it."""
    by_rank: Dict[int, socket.socket] = {}
    job.listener.settimeout(1.0)
    while len(by_rank) < n:
        if job.proc.poll() is not None:
            raise job.fail(f"exited before all {n} ranks connected ({sorted(by_rank)} did)")
        if time.monotonic() > deadline:
            raise job.fail(f"ranks {sorted(set(range(n)) - set(by_rank))} did not connect in time")
        try:
            conn, _ = job.listener.accept()
        except socket.timeout:
            continue
        conn.settimeout(max(1.0, deadline - time.monotonic()))
        hello = json.loads(conn.makefile("r").readline())
        by_rank[hello["rank"]] = conn
        job.via = hello["via"]
        job.pids.append(hello["pid"])
    job.listener.close()
    job.conns = [by_rank[r] for r in range(n)]
    job.readers = [c.makefile("r") for c in job.conns]


def command(job: Job, nbytes: int, warmup: int, iters: int, timeout: float) -> List[Dict[str, Any]]:
    """One turn of one job: every rank runs warmup + iters calls; their replies, by rank."""
    line = (json.dumps({"op": "run", "nbytes": nbytes, "warmup": warmup, "iters": iters}) + "\n").encode()
    for conn in job.conns:
        conn.sendall(line)
    replies = []
    for rank, (conn, reader) in enumerate(zip(job.conns, job.readers)):
        conn.settimeout(timeout)
        try:
            text = reader.readline()
        except socket.timeout:
            raise job.fail(f"rank {rank}: no answer to {iters} allreduce calls of {nbytes} B in {timeout:.0f} s")
        if not text:
            raise job.fail(f"rank {rank} hung up during allreduce of {nbytes} B")
        replies.append(json.loads(text))
    return replies


def summarize(replies: List[Dict[str, Any]], iters: int) -> Dict[str, Any]:
    """A turn's slowest rank's mean call, and the ranks' mean (and largest) CPU seconds per call."""
    cpu = [r["cpu"] / iters for r in replies]
    return {"time": max(r["seconds"] for r in replies) / iters, "cpu": statistics.mean(cpu), "cpu_max": max(cpu)}


def cpu_of(pids: List[int]) -> float:
    """User+system CPU seconds these processes have used so far (/proc; 0 for one that is gone)."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return total / os.sysconf("SC_CLK_TCK")


def _exit_on(signum: int, _: Any) -> None:
    """A signal that would end the driver raises SystemExit instead, so its clean-up runs."""
    raise SystemExit(128 + signum)


@contextmanager
def stopped(pids: List[int]) -> Iterator[None]:
    """The processes `pids` (other jobs' ranks, idle between their turns) stopped while the block runs."""
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass


def measure(jobs: List[Job], sizes: List[int], rounds: int, round_seconds: float, warmup: int,
            log: Any = None) -> Tuple[Dict[int, Dict[str, Any]], Dict[str, float]]:
    """Calibrate iterations per (library, size) to about round_seconds a turn, then the rounds. Also
    returns how much CPU the waiting jobs (workers and their mpirun) used during the timed turns:
    it should be ~0, or the jobs disturbed each other."""
    idle = {"waiting_cpu_s": 0.0, "turns_s": 0.0}
    out: Dict[int, Dict[str, Any]] = {s: {} for s in sizes}
    iters: Dict[Any, int] = {}
    est: Dict[Any, float] = {}
    for nbytes in sizes:
        for job in jobs:
            first = command(job, nbytes, 2, 3, 600)
            est[job.name, nbytes] = summarize(first, 3)["time"]
            iters[job.name, nbytes] = max(2, min(20000, math.ceil(round_seconds / max(est[job.name, nbytes], 1e-7))))
            out[nbytes][job.name] = {"wrong": sum(r["wrong"] for r in first), "offset": first[0]["offset"],
                                     "algo": first[0]["algo"], "iters": iters[job.name, nbytes], "rounds": []}
    for r in range(rounds):
        for k, nbytes in enumerate(sizes):
            turn = (r + k) % len(jobs)
            for job in jobs[turn:] + jobs[:turn]:
                count = iters[job.name, nbytes]
                limit = max(120.0, 50 * (count + warmup) * est[job.name, nbytes])
                others = [pid for j in jobs if j is not job for pid in j.pids + [j.proc.pid]]
                cpu0, t0 = cpu_of(others), time.monotonic()
                with stopped([pid for j in jobs if j is not job for pid in j.pids]):
                    got = summarize(command(job, nbytes, warmup, count, limit), count)
                idle["waiting_cpu_s"] += cpu_of(others) - cpu0
                idle["turns_s"] += time.monotonic() - t0
                out[nbytes][job.name]["rounds"].append(got)
        if log is not None:
            print(f"# round {r + 1}/{rounds} done, load average {os.getloadavg()[0]:.2f}", file=log, flush=True)
    return out, idle


def stats(cell: Dict[str, Any]) -> Dict[str, float]:
    """Median, min, max time and median CPU per call over rounds, in microseconds."""
    times = [r["time"] for r in cell["rounds"]]
    return {"time_us": statistics.median(times) * 1e6, "min_us": min(times) * 1e6, "max_us": max(times) * 1e6,
            "cpu_us": statistics.median(r["cpu"] for r in cell["rounds"]) * 1e6,
            "cpu_max_us": statistics.median(r["cpu_max"] for r in cell["rounds"]) * 1e6}


def rows_of(measured: Dict[int, Dict[str, Any]], names: List[str], n: int) -> List[Dict[str, Any]]:
    """One row per (size, library), with time / every pycoll job's time (above 1: pycoll faster), as a
    ratio of medians and round by round."""
    ours = [name for name in names if name.startswith("pycoll")]
    rows = []
    for nbytes, cells in measured.items():
        base = {name: stats(cells[name]) for name in names}
        for name in names:
            row = {"size": nbytes, "library": name, "ranks": n, **base[name],
                   **{k: cells[name][k] for k in ("wrong", "offset", "algo", "iters")},
                   "rounds": len(cells[name]["rounds"]), "round_us": [r["time"] * 1e6 for r in cells[name]["rounds"]],
                   "busbw": nbytes / (base[name]["time_us"] * 1e-6) / 1e9 * 2 * (n - 1) / n}
            row["ratio"] = {p: base[name]["time_us"] / base[p]["time_us"] for p in ours}
            row["round_ratios"] = {p: [a["time"] / b["time"] for a, b in zip(cells[name]["rounds"], cells[p]["rounds"])]
                                   for p in ours}  # turns of the same round ran close together in time
            rows.append(row)
    return rows


def format_table(rows: List[Dict[str, Any]], names: List[str]) -> str:
    ours = [name for name in names if name.startswith("pycoll")]
    w = max([11] + [len(name) for name in names])
    head = (f"# {'size(B)':>10} {'library':<{w}} {'time(us)':>10} {'min(us)':>10} {'max(us)':>10} "
            f"{'cpu/call(us)':>12} {'busbw(GB/s)':>11} " + " ".join(f"{'x' + p:>12}" for p in ours)
            + f" {'wrong':>5} {'offset':>6}  algorithm")
    lines = [head]
    for row in rows:
        ratios = " ".join(f"{row['ratio'][p]:>{max(11, len(p))}.2f}x" for p in ours)
        lines.append(f"  {row['size']:>10} {row['library']:<{w}} {row['time_us']:>10.1f} {row['min_us']:>10.1f} "
                     f"{row['max_us']:>10.1f} {row['cpu_us']:>12.1f} {row['busbw']:>11.3f} {ratios} "
                     f"{row['wrong']:>5} {row['offset']:>6}  {row['algo'] or '-'}")
    return "\n".join(lines)


def run(n: int, sizes: List[int], transports: List[str], peers: List[str], rounds: int, round_seconds: float,
        warmup: int, bind: str, json_path: Optional[str] = None, persistent: bool = False) -> List[Dict[str, Any]]:
    """Launch every job, measure, print the table (and write rows to json_path); always end the jobs."""
    names = job_names(transports, peers, persistent)
    load = [os.getloadavg()]
    jobs: List[Job] = []
    # SIGTERM / SIGHUP end the driver through the finally below: it continues the jobs stopped for a
    # turn and ends them (killed outright, they would stay stopped, holding their ports, for good)
    previous = {sig: signal.signal(sig, _exit_on) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        for name in names:
            jobs.append(launch(name, n, bind))
        deadline = time.monotonic() + 300
        for job in jobs:
            connect(job, n, deadline)
        measured, idle = measure(jobs, sizes, rounds, round_seconds, warmup, sys.stdout)
    finally:
        for job in jobs:  # quit, or hang up: a rank still waiting to be accepted or told reads an end
            job.listener.close()
            for conn in job.conns:
                try:
                    conn.sendall(b'{"op": "quit"}\n')
                except OSError:
                    pass
                conn.close()
        for job in jobs:
            try:
                job.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                job.proc.kill()
                job.proc.wait()
            job.log.close()
            shutil.rmtree(job.session_dir, ignore_errors=True)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    load.append(os.getloadavg())
    rows = rows_of(measured, names, n)
    via = ", ".join(f"{job.name}: {job.via}" for job in jobs)
    print(f"# pycoll bench allreduce --np {n}: float32 SUM in place on np.ones buffers, {rounds} rounds, "
          f"each library in its own `mpirun --oversubscribe --bind-to {bind} -np {n}` job ({via})")
    print("# time = median over rounds of the slowest rank's mean call (min/max: over rounds); cpu/call = the "
          "ranks' mean user+sys per call; xLIB = this library's time / LIB's time (above 1: LIB faster)")
    print(f"# {os.cpu_count()} cores; load average (1 min) {load[0][0]:.2f} at the start, {load[1][0]:.2f} at the end; "
          f"waiting jobs used {idle['waiting_cpu_s']:.2f} CPU s during {idle['turns_s']:.1f} s of timed turns")
    print(format_table(rows, names), flush=True)
    if json_path:
        meta = {"ranks": n, "rounds": rounds, "bind": bind, "via": {job.name: job.via for job in jobs},
                "load_start": load[0], "load_end": load[1], "cores": os.cpu_count(),
                "pids": {job.name: sorted(job.pids) for job in jobs}, "driver_pid": os.getpid(), **idle}
        with open(json_path, "w") as fh:
            json.dump({"meta": meta, "rows": rows}, fh, indent=1)
    return rows
