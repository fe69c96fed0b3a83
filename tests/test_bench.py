"""`pycoll bench`: the nccl-tests table and its arithmetic, interleaved timing rounds, --json and --plot,
under `pycoll run` and mpirun; and `--np N --compare`: every library in mpirun jobs of its own, its
table's columns (time, spread, CPU per call, ratios, the tuner's algorithm) and their arithmetic."""
import json
import os
import re
import select
import shutil
import signal
import statistics
import subprocess
import sys
import time

import numpy as np
import pytest

from pycoll.cli import bench, bench_compare

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MPIRUN = shutil.which("mpirun")
ROW = re.compile(r"^(?:\[rank 0\] )?\s+(\d+)\s+(\d+)\s+(\w+)\s+(\w+)\s+(-?\d+)\s+(.*)$")


def test_sizes_and_nccl_tests_bus_factors():
    assert bench.parse_size("64M") == 64 << 20 and bench.parse_size("8") == 8 and bench.parse_size("1K") == 1024
    assert bench.sizes(8, 64 << 10, 8, 0) == [8, 64, 512, 4096, 32768]
    assert bench.sizes(1 << 20, 3 << 20, 1, 1 << 20) == [1 << 20, 2 << 20, 3 << 20]
    factors = {name: spec.factor(4) for name, spec in bench.SPECS.items()}
    assert factors == {"allreduce": 1.5, "reduce_scatter": 0.75, "allgather": 0.75, "alltoall": 0.75,
                       "broadcast": 1.0, "reduce": 1.0}


def test_count_wrong_counts_elements():
    want = np.arange(10, dtype=np.float32)
    got = want.copy()
    got[[2, 7]] = -1
    assert bench.count_wrong(got, want) == 2 and bench.count_wrong(want, want) == 0


def test_rounds_interleave_variants_and_report_the_median():
    """Every variant gets warmup + iters calls, in rounds whose order rotates; a stall in one round
    moves its mean but not the median."""
    order, calls = [], {"a": 0, "b": 0, "c": 0}

    def make(name):
        def call():
            calls[name] += 1
            order.append(name)
            stalled = name == "b" and calls[name] == 2 + 4 * 2 + 1  # first call of b's third round
            time.sleep(0.05 if stalled else 0.001)
        return call

    times = bench.time_rounds(lambda: order.append("|"), {k: make(k) for k in calls}, 20, 2, 5,
                              lambda a: np.asarray(a))
    assert calls == {"a": 22, "b": 22, "c": 22}
    turns = "".join(order[6:]).split("|")[1:]  # a barrier, then one variant's calls of one round
    assert [len(t) for t in turns] == [4] * 15 and [t[0] for t in turns] == list("abcbcacababcbca")
    assert all(0.0009 < t < 0.01 for t in times.values()), times  # the 50 ms stall is not the median


def run_bench(launcher, n, *args, timeout=150):
    """Run `pycoll bench ARGS` on n ranks with `launcher` ("pycoll" or "mpirun"); rank 0's rows."""
    env = {**os.environ, "PYTHONPATH": ROOT, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMPI_MCA_btl_tcp_if_include": "lo", "OMPI_MCA_oob_tcp_if_include": "lo"}
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "PYCOLL_STORE_HOSTED", "PYCOLL_JOB_TOKEN"):
        env.pop(var, None)
    prog = [sys.executable, "-m", "pycoll", "bench", *args]
    cmd = [sys.executable, "-m", "pycoll", "run", "-n", str(n), *prog] if launcher == "pycoll" else \
        [MPIRUN, "--oversubscribe", "-np", str(n), *prog]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [ROW.match(line).groups() for line in proc.stdout.splitlines() if ROW.match(line)]
    return proc.stdout, rows


@pytest.mark.timeout(180)
def test_allreduce_table_json_and_plot(tmp_path):
    """3 ranks over tcp: one row per size, nothing wrong, busbw = algbw * 2(n-1)/n, and --json/--plot
    write what the table shows."""
    out_json, out_png = tmp_path / "rows.json", tmp_path / "bw.png"
    text, rows = run_bench("pycoll", 3, "allreduce", "-b", "8", "-e", "64K", "-f", "8", "-n", "4", "-w", "1",
                           "--transport", "tcp", "--json", str(out_json), "--plot", str(out_png))
    assert "# Out of bounds values : 0 OK" in text and "# Avg bus bandwidth" in text
    assert [int(r[0]) for r in rows] == [8, 64, 512, 4096, 32768]
    saved = json.loads(out_json.read_text())
    assert [r["size"] for r in saved] == [8, 64, 512, 4096, 32768]
    for (size, count, dtype, redop, root, rest), row in zip(rows, saved):
        cells = rest.split()
        assert (int(count), dtype, redop, root) == (int(size) // 4, "float", "sum", "-1")
        t_out, algbw, busbw, wrong_out, t_in, _, _, wrong_in = (float(c) for c in cells[:8])
        assert len(cells) == 8 and wrong_out == 0 and wrong_in == 0 and t_out > 0 and t_in > 0
        assert row["out"]["busbw"] == pytest.approx(row["out"]["algbw"] * 4 / 3)
        assert row["out"]["algbw"] == pytest.approx(int(size) / (row["out"]["time_us"] * 1e-6) / 1e9)
        assert float(t_out) == pytest.approx(row["out"]["time_us"], abs=0.06)
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.mpi
@pytest.mark.timeout(180)
@pytest.mark.skipif(MPIRUN is None, reason="mpirun not installed (apt-get install openmpi-bin)")
@pytest.mark.parametrize("collective", ["reduce_scatter", "broadcast", "allgather"])
def test_under_mpirun_every_algorithm(collective):
    pytest.importorskip("mpi4py")
    text, rows = run_bench("mpirun", 2, collective, "-b", "1K", "-e", "1M", "-f", "32", "-n", "3", "-w", "1",
                           "--algo", "all")
    assert "# Out of bounds values : 0 OK" in text
    algos = re.findall(r"algorithm (\w+),", text)
    assert len(algos) >= 2 and len(rows) == 3 * len(algos)  # 1K, 32K and 1M for every algorithm
    for *_, rest in rows:
        cells = rest.split()
        assert cells[3] == "0" and cells[7] == "0"


def test_compare_needs_np_and_allreduce():
    """Peers in the ranks' own processes flattered pycoll: --compare alone is refused, as is --np with a
    collective, dtype or peer the compare mode does not measure."""
    assert bench.main(["allreduce", "--compare", "mpi"]) == 2
    assert bench.main(["broadcast", "--np", "2", "--compare", "mpi"]) == 2
    assert bench.main(["allreduce", "--np", "2", "--compare", "nccl"]) == 2
    assert bench.main(["allreduce", "--np", "2", "-d", "float64"]) == 2


def test_compare_rows_arithmetic():
    """Median, spread and CPU over rounds; a ratio is a library's median time over each pycoll job's."""
    measured = {1024: {
        "pycoll-shm": {"wrong": 0, "offset": 16, "algo": "ring", "iters": 5,
                       "rounds": [{"time": t, "cpu": c, "cpu_max": c * 1.5} for t, c in ((2e-6, 1e-6), (4e-6, 3e-6),
                                                                                         (9e-6, 2e-6))]},
        "mpi": {"wrong": 0, "offset": 16, "algo": "", "iters": 7,
                "rounds": [{"time": t, "cpu": t / 2, "cpu_max": t} for t in (8e-6, 1e-6, 6e-6)]}}}
    rows = bench_compare.rows_of(measured, ["pycoll-shm", "mpi"], 4)
    ours, mpi = rows
    assert (ours["time_us"], ours["min_us"], ours["max_us"], ours["cpu_us"]) == pytest.approx((4, 2, 9, 2))
    assert (mpi["time_us"], mpi["cpu_us"], mpi["cpu_max_us"]) == pytest.approx((6, 3, 6))
    assert mpi["ratio"] == {"pycoll-shm": pytest.approx(1.5)} and ours["ratio"] == {"pycoll-shm": 1.0}
    assert mpi["round_ratios"]["pycoll-shm"] == pytest.approx([4, 0.25, 6 / 9])
    assert mpi["round_us"] == pytest.approx([8, 1, 6]) and ours["round_us"] == pytest.approx([2, 4, 9])
    assert ours["busbw"] == pytest.approx(1024 / 4e-6 / 1e9 * 1.5)
    table = bench_compare.format_table(rows, ["pycoll-shm", "mpi"]).splitlines()
    assert table[1].split() == ["1024", "pycoll-shm", "4.0", "2.0", "9.0", "2.0", "0.384", "1.00x", "0", "16",
                                "ring"]
    assert table[2].split()[-4:] == ["1.50x", "0", "16", "-"]


def test_a_job_that_cannot_start_leaves_no_session_folder(tmp_path, monkeypatch):
    """A launch whose mpirun cannot be run raises, and takes its Open MPI session folder with it."""
    monkeypatch.setattr(bench_compare.tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(bench_compare, "mpirun_prefix", lambda lib, n, bind: [str(tmp_path / "no-mpirun")])
    with pytest.raises(FileNotFoundError):
        bench_compare.launch("mpi", 2, "core")
    assert os.listdir(tmp_path) == []


@pytest.mark.mpi
@pytest.mark.timeout(120)
@pytest.mark.skipif(MPIRUN is None, reason="mpirun not installed (apt-get install openmpi-bin)")
def test_compare_names_a_job_that_fails_and_ends_the_others():
    """A library whose ranks fail at start is an error naming its job and the cause; the other jobs,
    launched beside it, are hung up on and end (the command returns, no process left waiting)."""
    pytest.importorskip("mpi4py")
    cmd = [sys.executable, "-m", "pycoll", "bench", "allreduce", "--np", "2", "--transport", "bogus", "--compare",
           "mpi", "--sizes", "8", "--rounds", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT}, timeout=110,
                          cwd=ROOT)
    assert proc.returncode == 1
    assert "pycoll-bogus job exited before all 2 ranks connected" in proc.stderr
    assert "PYCOLL_TRANSPORT='bogus' is not a transport" in proc.stderr


def _descendants(pid):
    """The pids of `pid`'s children and their children (the jobs' mpirun and their ranks)."""
    out = subprocess.run(["ps", "-eo", "pid=,ppid="], capture_output=True, text=True).stdout
    children = {}
    for line in out.splitlines():
        child, parent = (int(v) for v in line.split())
        children.setdefault(parent, []).append(child)
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _still_running(pids, seconds):
    """Those of `pids` that have not exited within `seconds` (waited on with pidfds: an exit, reaped
    or not, makes its pidfd readable)."""
    fds = {}
    for pid in pids:
        try:
            fds[os.pidfd_open(pid)] = pid
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + seconds
    try:
        while fds and time.monotonic() < deadline:
            ready, _, _ = select.select(list(fds), [], [], deadline - time.monotonic())
            for fd in ready:
                os.close(fd)
                del fds[fd]
        return list(fds.values())
    finally:
        for fd in fds:
            os.close(fd)


@pytest.mark.mpi
@pytest.mark.timeout(120)
@pytest.mark.skipif(MPIRUN is None, reason="mpirun not installed (apt-get install openmpi-bin)")
def test_compare_ended_by_sigterm_leaves_no_job_behind():
    """SIGTERM to the driver in the middle of the rounds, while other jobs' ranks are stopped for a
    turn: it exits 143 and every job it launched ends (none left stopped, holding its ports)."""
    pytest.importorskip("mpi4py")
    cmd = [sys.executable, "-m", "pycoll", "bench", "allreduce", "--np", "2", "--transport", "shm", "--compare",
           "mpi", "--sizes", "8,64K", "--rounds", "500", "--round-seconds", "0.05"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": ROOT}, cwd=ROOT)
    for line in proc.stdout:
        if "round 1/" in line:
            break
    launched = _descendants(proc.pid)
    assert len(launched) >= 6, launched  # two mpiruns, their ranks
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(60)
    left = _still_running(launched, 30)
    for p in left:  # do not leave them to the next test either
        os.kill(p, signal.SIGCONT)
        os.kill(p, signal.SIGKILL)
    assert code == 143 and not left, f"exit {code}; still running after the driver ended: {left}"


COMPARE_ROW = re.compile(r"^\s+(\d+) (\S+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)x"
                         r"\s+(\d+)\s+(\d+)\s+(\S+)$")


@pytest.mark.mpi
@pytest.mark.timeout(300)
@pytest.mark.skipif(MPIRUN is None, reason="mpirun not installed (apt-get install openmpi-bin)")
def test_compare_runs_every_library_in_jobs_of_its_own(tmp_path):
    """N=2, tiny sizes: pycoll over shm beside Open MPI, Open MPI over TCP and Gloo, each an mpirun job of
    its own (no pid shared, none the driver's); every row has a time inside its spread, CPU per call no
    more than the cores could give in that time, the ratio to pycoll's time, nothing wrong, and pycoll's
    rows the algorithm its tuner chose."""
    pytest.importorskip("mpi4py")
    pytest.importorskip("torch")
    from pycoll.selection import IMPLEMENTATIONS
    out_json = tmp_path / "rows.json"
    env = {**os.environ, "PYTHONPATH": ROOT}
    cmd = [sys.executable, "-m", "pycoll", "bench", "allreduce", "--np", "2", "--transport", "shm", "--compare",
           "mpi,mpi-tcp,gloo", "--sizes", "8,64K", "--rounds", "2", "--round-seconds", "0.01", "--json", str(out_json)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=280, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [COMPARE_ROW.match(line).groups() for line in proc.stdout.splitlines() if COMPARE_ROW.match(line)]
    assert [(int(r[0]), r[1]) for r in rows] == [(s, lib) for s in (8, 65536)
                                                 for lib in ("pycoll-shm", "mpi", "mpi-tcp", "gloo")]
    saved = json.loads(out_json.read_text())
    pids = saved["meta"]["pids"]
    assert sorted(pids) == ["gloo", "mpi", "mpi-tcp", "pycoll-shm"] and all(len(p) == 2 for p in pids.values())
    every = [pid for p in pids.values() for pid in p] + [saved["meta"]["driver_pid"]]
    assert len(set(every)) == len(every)
    assert saved["meta"]["waiting_cpu_s"] < 0.1 * saved["meta"]["turns_s"] + 0.1  # the waiting jobs kept still
    by_key = {(r["size"], r["library"]): r for r in saved["rows"]}
    for size, lib, t, lo, hi, cpu, busbw, ratio, wrong, offset, algo in rows:
        row, ours = by_key[int(size), lib], by_key[int(size), "pycoll-shm"]
        t, lo, hi, cpu, ratio = (float(v) for v in (t, lo, hi, cpu, ratio))
        assert 0 < lo <= t <= hi < 1e6 and wrong == "0" and row["rounds"] == 2
        assert 0 < cpu <= os.cpu_count() * hi * 1.05  # a rank's CPU in a call: at most every core, all the call
        assert t == pytest.approx(row["time_us"], abs=0.06)
        assert ratio == pytest.approx(row["time_us"] / ours["time_us"], rel=0.01, abs=0.006)
        assert float(busbw) == pytest.approx(int(size) / (t * 1e-6) / 1e9, rel=0.01, abs=0.001)
        assert algo in IMPLEMENTATIONS["allreduce"] if lib == "pycoll-shm" else algo == "-"


def test_agreement_judges_the_ratio_over_pairs_of_rounds():
    """Rounds in two states, in other shares on each side, give the typical ratio (1) where the ratio
    of medians jumps (0.53); a few rounds in a spell barely move it; the table marks a ratio outside
    the tolerance."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import standalone_peers
    bench, alone = [0.8] * 13 + [1.5] * 11, [0.8] * 11 + [1.5] * 13
    assert statistics.median(bench) / statistics.median(alone) == pytest.approx(0.8 / 1.5)
    assert standalone_peers.pair_ratio(bench, alone) == 1.0
    assert standalone_peers.pair_ratio([100.0 + i for i in range(18)] + [300.0] * 6,
                                       [100.0 + i for i in range(24)]) == pytest.approx(1.0, abs=0.05)
    row = {"peer": "mpi", "size": 8, "ratio": 0.8, "time_ratio": 0.6, "best_ratio": 1.0, "cpu_ratio": 0.9,
           **{f"{side}_{m}": v for side, scale in (("bench", 1.0), ("alone", 1.25))
              for m, v in (("time_us", scale), ("best_us", 0.8), ("cpu_us", scale), ("time_runs", [scale, 2 * scale]))}}
    table = standalone_peers.markdown([row], 0.15).splitlines()
    assert len(table) == 3 and "| **0.80** (outside) |" in table[2] and "| 1.0 2.0 | 1.2 2.5 |" in table[2]


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.timeout(1800)
@pytest.mark.skipif(MPIRUN is None, reason="mpirun not installed (apt-get install openmpi-bin)")
def test_peer_columns_agree_with_standalone_loops():
    """The bench's Open MPI, Open MPI-over-TCP and Gloo times (N=2) are within 15% of plain mpi4py and
    torch loops run alone under the same mpirun line, alternating with the bench: the median ratio over
    every pair of a bench round and a standalone round (8 repeats of 3 rounds a side). Timing on a
    shared machine: load that changes between a bench run and the next loop moves one and not the
    other, so this can miss on a loaded machine without the bench being wrong (the failure prints
    every repeat's figure to judge by)."""
    pytest.importorskip("mpi4py")
    pytest.importorskip("torch")
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import standalone_peers
    rows = standalone_peers.agreement(2, [8, 64 << 10, 1 << 20, 16 << 20], ["mpi", "mpi-tcp", "gloo"], 8, 3, 0.1)
    print(standalone_peers.markdown(rows, 0.15))  # shown with -s, or in the failure's captured output
    off = [(r["peer"], r["size"], round(r["ratio"], 2)) for r in rows if abs(r["ratio"] - 1) > 0.15]
    assert not off, (f"bench/standalone medians off by more than 15% (load average {os.getloadavg()}) at {off}\n"
                     + standalone_peers.markdown(rows, 0.15))


@pytest.mark.timeout(60)
def test_cross_cpu_state_times_an_exchange_between_two_cpus():
    """benchmarks/cross_cpu.py (the machine-state check around the cores test's jobs): a 1 MiB exchange
    between processes bound to CPUs 0 and 1 against one process's two copies, and the verdict."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import cross_cpu
    s = cross_cpu.state()
    assert s["reference_us"] > 0
    if (os.cpu_count() or 1) >= 2:
        assert s["exchange_us"] > 0 and s["ratio"] == pytest.approx(s["exchange_us"] / s["reference_us"])
        assert s["slow"] == (s["ratio"] > cross_cpu.SLOW)


@pytest.mark.timeout(180)
def test_torch_layer_floor_prints_each_size():
    """benchmarks/torch_layer_floor.py under `pycoll run -n 2`: a null Python backend beside pycoll's,
    one table row per size with both layers' figures."""
    pytest.importorskip("torch")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    out = subprocess.run([sys.executable, "-m", "pycoll", "run", "-n", "2", sys.executable,
                          "benchmarks/torch_layer_floor.py", "--rounds", "4"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=170)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = [line for line in out.stdout.splitlines() if re.search(r"\| (8|1048576|16777216) B \|", line)]
    assert len(rows) == 3 and all(len(re.findall(r"\*\*\+-?\d+\.\d us\*\*", r)) == 2 for r in rows), out.stdout
