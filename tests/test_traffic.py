"""`pycoll trace DIR --traffic` (pycoll/trace/traffic.py) against the wire, and what it needs from the
flight recorder: pycoll.mark_step(), the dump every rank writes when a job ends normally, and the
job identity that keeps two jobs' dumps apart.

The wire jobs run each algorithm family once per step (algo= forces it; a mark_step() after each
call), with the transport's sends recorded in the ranks as tests/test_patterns.py records them
(its _instrument); then the report's bytes and messages per ordered pair of ranks, step by step,
must equal what went over the wire (within an element per message: the patterns split blocks as
real numbers). Ranks are spread over two emulated hosts (PYCOLL_HOSTID), so the host-ordered
ring is not the rank order and the hierarchical algorithms run their cross-host phases, and the
report's within/between-host split is checked too. The board algorithms move no messages: for
one-shot the report's bytes are the slot reads the ranks make.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from multiproc import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ITEM = 4
COUNT = 3001  # float32 elements per call (odd: blocks split unevenly)
# (call, algorithm, root): one step each
WIRE_CASES = [
    ("allreduce", "ring", None), ("allreduce", "flat_ring", None), ("allreduce", "recursive_doubling", None),
    ("allreduce", "halving_doubling", None), ("allreduce", "tree", None), ("allreduce", "binomial", None),
    ("allreduce", "hierarchical", None), ("allreduce", "oneshot", None),  # (no board on tcp: recursive doubling)
    ("reduce_scatter", "ring", None), ("reduce_scatter", "halving_doubling", None),
    ("allgather", "ring", None), ("allgather", "recursive_doubling", None), ("allgather", "hierarchical", None),
    ("allgatherv", "ring", None), ("allgatherv", "recursive_doubling", None), ("allgatherv", "hierarchical", None),
    ("reduce_scatter_v", "ring", None),
    ("broadcast", "tree", 1), ("broadcast", "ring", 2), ("broadcast", "hierarchical", 3), ("reduce", "tree", 2),
    ("alltoall", "pairwise", None), ("alltoallv", "pairwise", None),
    ("gather", None, 1), ("scatter", None, 2), ("barrier", None, None), ("send", None, None),
]
BOARD_CASES = [("allreduce", "oneshot", None), ("broadcast", "oneshot", 1), ("reduce", "oneshot", 2),
               ("allgather", "oneshot", None), ("allreduce", "oneshot", "big")]  # big: past the slot, its fallback


def _call(comm, case):
    """Run one case on `comm` (every rank alike)."""
    call, algo, root = case
    n, r = comm.size, comm.rank
    count = 8192 if root == "big" else COUNT
    x = (np.arange(count, dtype=np.float32) % 7) + r
    kw = {} if algo is None else {"algo": algo}
    if call == "allreduce":
        comm.allreduce(x, **kw)
    elif call == "reduce_scatter":
        comm.reduce_scatter(x[:count - count % n], **kw)
    elif call == "allgather":
        comm.allgather(x[:501], **kw)
    elif call == "allgatherv":
        counts = [100 + 37 * k for k in range(n)]
        comm.allgatherv(x[:counts[r]], counts, **kw)
    elif call == "reduce_scatter_v":
        counts = [300 + 100 * k for k in range(n)]
        comm.reduce_scatter(x[:sum(counts)], counts=counts, **kw)
    elif call == "broadcast":
        comm.broadcast(x, root=root, **kw)
    elif call == "reduce":
        comm.reduce(x, root=root, **kw)
    elif call == "alltoall":
        comm.alltoall(x[:200 * n], **kw)
    elif call == "alltoallv":  # rank r sends rank j (r + 1) * (j + 2) elements, none to itself when r == j == 0
        sc = [(r + 1) * (j + 2) if (r, j) != (0, 0) else 0 for j in range(n)]
        rc = [(j + 1) * (r + 2) if (j, r) != (0, 0) else 0 for j in range(n)]
        comm.alltoallv(np.ones(sum(sc), np.float32), sc, rc, **kw)
    elif call == "gather":
        comm.gather(x[:777], root=root)
    elif call == "scatter":
        comm.scatter(np.zeros((n, 333), np.float32) if r == root else None, root=root, out=np.empty(333, np.float32))
    elif call == "barrier":
        comm.barrier()
    elif call == "send":  # rank 0 and rank 1 each send the last rank a message
        if r in (0, 1):
            comm.send(x[:100 * (r + 1)], n - 1, tag=r)
        elif r == n - 1:
            for src in (0, 1):
                comm.recv(np.empty(100 * (src + 1), np.float32), src, tag=src)


def _job(rank, folder, hosts, cases):
    """Rank side: join on emulated host hosts[rank], run each case as one step; per step, what this
    rank sent: [(dst, bytes)] over the transport and [(src, bytes)] read out of peers' board slots."""
    os.environ["PYCOLL_HOSTID"] = f"host{hosts[rank]}"
    os.environ["PYCOLL_TRACE_DIR"] = folder
    import pycoll
    from test_patterns import _instrument
    rec = {"sends": [], "posts": [], "reads": [], "fetched": [], "reduced": 0, "phase": 0, "writes": 0, "cma": [0, 0]}
    steps = []
    with pycoll.init() as comm:
        _instrument(comm, rec)
        for case in cases:
            rec.update(sends=[], reads=[], fetched=[], phase=0)
            _call(comm, case)
            reads = [(src, nb) for _, src, nb in rec["reads"]] + [(s._src, s.nbytes) for s in rec["fetched"]
                                                                  if not s._sliced]
            steps.append({"sends": [(dst, nb) for _, dst, nb, *_ in rec["sends"]], "reads": reads})
            assert pycoll.mark_step() == len(steps)
    return steps


def _dumps(folder):
    from pycoll.trace import analysis
    dumps, _ = analysis.load(str(folder))
    analysis.one_job(dumps)
    return dumps


def _check_against_wire(folder, hosts, cases, got, board=False):
    """The tally of the dumps in `folder` against what the ranks counted, step by step."""
    from pycoll.trace import traffic
    n = len(hosts)
    dumps = _dumps(folder)
    assert sorted(dumps) == list(range(n))
    for r, d in dumps.items():  # the ending dump, with the marks and what the report needs
        assert d["reason"].startswith("job ended"), d["reason"]
        assert d["steps"] == len(cases) and [k for k, _ in d["marks"]] == list(range(1, len(cases) + 1))
        assert d["host_id"] == f"host{hosts[r]}" and d["job"] and d["job"] == dumps[0]["job"]
    t = traffic.tally(dumps)
    assert t.steps == list(range(1, len(cases) + 1)) and t.note is None and not t.unmodeled
    assert t.host_of == {r: f"host{h}" for r, h in enumerate(hosts)}
    bad = []
    for i, case in enumerate(cases):
        wire_b, wire_m = {}, {}
        for src in range(n):
            for dst, nb in got[src][i]["sends"]:
                wire_b[src, dst] = wire_b.get((src, dst), 0) + nb
                wire_m[src, dst] = wire_m.get((src, dst), 0) + 1
            for owner, nb in got[src][i]["reads"]:  # a read of `owner`'s slot: owner sent it to src
                if owner != src:
                    wire_b[owner, src] = wire_b.get((owner, src), 0) + nb
        pairs = set(wire_b) | {p for p, v in t.bytes.items() if v[i]}
        for p in sorted(pairs):
            ours, theirs = t.bytes.get(p, [0] * len(cases))[i], wire_b.get(p, 0)
            msgs = wire_m.get(p, 0)
            if abs(ours - theirs) >= ITEM * max(1, msgs):
                bad.append(f"step {i + 1} {case}: {p[0]}->{p[1]} report {ours:.0f} bytes, wire {theirs}")
            if not board and t.messages.get(p, [0] * len(cases))[i] != msgs:
                bad.append(f"step {i + 1} {case}: {p[0]}->{p[1]} report {t.messages[p][i]:g} messages, wire {msgs}")
        between = sum(v for (a, b), v in wire_b.items() if hosts[a] != hosts[b])
        counted = sum(k["between"][i] for k in t.kinds.values())
        if abs(counted - between) >= ITEM * max(1, sum(wire_m.values())):
            bad.append(f"step {i + 1} {case}: report {counted:.0f} bytes between hosts, wire {between}")
    assert not bad, f"{len(bad)} mismatches:\n" + "\n".join(bad)
    return dumps


def _wire(tmp_path, hosts, transport, cases, board=False):
    got = run_ranks(_job, len(hosts), str(tmp_path), hosts, cases, init=False, timeout=180,
                    env={"PYCOLL_TRANSPORT": transport, "PYCOLL_TUNER": "static"})
    return _check_against_wire(tmp_path, hosts, cases, got, board)


@pytest.mark.timeout(240)
def test_report_matches_the_wire_two_hosts(tmp_path):
    """4 ranks on 2 emulated hosts, interleaved (hierarchical: its uniform plan)."""
    _wire(tmp_path, [0, 1, 0, 1], "tcp", WIRE_CASES)
    from pycoll.cli.trace import main
    import contextlib
    import io
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main([str(tmp_path), "--traffic", "--json"]) == 0
    report = json.loads(out.getvalue())
    assert report["steps"]["count"] == len(WIRE_CASES) and report["steps"]["marked"]
    assert report["hosts"] == ["host0", "host1"] and report["host_of"] == {"0": 0, "1": 1, "2": 0, "3": 1}
    assert report["window"]["bytes_between"] > 0 and report["window"]["bytes_within"] > 0
    assert {k["call"] for k in report["median_step"]["collectives"]} >= {"allreduce", "alltoallv", "send", "barrier"}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main([str(tmp_path), "--traffic"]) == 0
    text = out.getvalue()
    assert f"{len(WIRE_CASES)} marked steps" in text and "between hosts" in text and "host1: ranks 1, 3" in text


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_report_matches_the_wire_uneven_hosts(tmp_path):
    """5 ranks, 3 + 2 on two hosts: MPI's fold, Bruck's allgather, hierarchical's leader plan."""
    _wire(tmp_path, [0, 1, 0, 1, 0], "tcp", WIRE_CASES)


@pytest.mark.timeout(180)
def test_board_traffic_is_what_the_ranks_read(tmp_path):
    """One-shot on shm, 3 ranks: the report's bytes are the peers' slot reads; past the slot, the
    fallback's messages."""
    _wire(tmp_path, [0, 0, 0], "shm", BOARD_CASES, board=True)


# -- under pycoll run: the dump at exit, no marks, two jobs in one folder ------------------------------
API_JOB = r'''
import sys
import numpy as np
import pycoll
comm = pycoll.init()
x = np.ones(1000, np.float32)
for step in range(int(sys.argv[1])):
    comm.allreduce(x, algo="ring")
    if len(sys.argv) > 2:
        pycoll.mark_step()
comm.allreduce(x, algo="ring")
'''  # (never closed: the dump at exit)


def _pycoll_run(n, folder, script, *args):
    return subprocess.run([sys.executable, "-m", "pycoll", "run", "-n", str(n), "--trace-dir", str(folder),
                           str(script), *args], capture_output=True, text=True, cwd=ROOT, timeout=120,
                          env={**os.environ, "PYTHONPATH": ROOT, "PYCOLL_TUNER": "static"})


def _trace(*args):
    return subprocess.run([sys.executable, "-m", "pycoll", "trace", *map(str, args)], capture_output=True,
                          text=True, cwd=ROOT, timeout=60, env={**os.environ, "PYTHONPATH": ROOT})


@pytest.mark.timeout(240)
def test_exit_dumps_no_marks_and_mixed_jobs(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(API_JOB)
    a, b = tmp_path / "a", tmp_path / "b"
    for folder, args in ((a, ("3",)), (b, ("2", "mark"))):
        res = _pycoll_run(2, folder, script, *args)
        assert res.returncode == 0, res.stderr[-3000:]
    for r in range(2):
        dump = json.loads((a / f"rank{r}.json").read_text())
        assert dump["reason"] == "job ended (process exit)" and dump["steps"] == 0 and dump["marks"] == []
    res = _trace(a, "--traffic")
    assert res.returncode == 0, res.stderr
    assert "no step marks in the dumps" in res.stdout and "the recorded span as one step" in res.stdout
    # 4 ring allreduces of 4000 B on 2 ranks: each rank sends 4000 B a call
    assert json.loads(_trace(a, "--traffic", "--json").stdout)["window"]["bytes_within"] == 2 * 4 * 4000
    report = json.loads(_trace(b, "--traffic", "--json").stdout)
    assert report["steps"]["numbers"] == [1, 2] and report["median_step"]["total"]["bytes_within"] == 2 * 4000
    (a / "rank1.json").write_bytes((b / "rank1.json").read_bytes())  # job b's rank 1 among job a's dumps
    jobs = {json.loads((b / "rank0.json").read_text())["job"], json.loads((a / "rank0.json").read_text())["job"]}
    for extra in (("--traffic",), ()):
        res = _trace(a, *extra)
        assert res.returncode == 2 and "2 different jobs" in res.stderr, res.stderr
        assert all(job in res.stderr for job in jobs) and "ranks 0 of job" in res.stderr and "ranks 1 of job" in res.stderr


TORCH_JOB = r'''
import torch, torch.distributed as dist
import pycoll
dist.init_process_group("pycoll")
rank, size = dist.get_rank(), dist.get_world_size()
t = torch.ones(1000)
for step in range(3):
    dist.all_reduce(t)
    out = torch.empty(sum((j + 1) * (rank + 1) for j in range(size)))
    dist.all_to_all_single(out, torch.ones(sum((rank + 1) * (j + 1) for j in range(size))),
                           output_split_sizes=[(j + 1) * (rank + 1) for j in range(size)],
                           input_split_sizes=[(rank + 1) * (j + 1) for j in range(size)])
    pycoll.mark_step()
dist.destroy_process_group()
'''


@pytest.mark.timeout(240)
def test_torch_backend_job(tmp_path):
    pytest.importorskip("torch")
    script = tmp_path / "train.py"
    script.write_text(TORCH_JOB)
    folder = tmp_path / "trace"
    res = subprocess.run([sys.executable, "-m", "pycoll", "run", "-n", "2", "--trace-dir", str(folder), str(script)],
                         capture_output=True, text=True, cwd=ROOT, timeout=180,
                         env={**os.environ, "PYTHONPATH": ROOT, "PYCOLL_TUNER": "static", "PYCOLL_ALGO": "allreduce:ring"})
    assert res.returncode == 0, res.stderr[-3000:]
    res = _trace(folder, "--traffic", "--json")
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert report["steps"]["numbers"] == [1, 2, 3]
    kinds = {k["call"]: k for k in report["median_step"]["collectives"]}
    assert kinds["allreduce"]["algorithm"] == "ring" and kinds["allreduce"]["bytes_within"] == 2 * 4000
    # all_to_all_single with splits is alltoallv: rank r sends rank j (r + 1)(j + 1) floats
    assert kinds["alltoallv"]["bytes_within"] == 4 * (1 * 2 + 2 * 1)
    pairs = {(p["src"], p["dst"]): p["bytes"] for p in report["median_step"]["pairs"]}
    assert pairs == {(0, 1): 4000 + 8, (1, 0): 4000 + 8}
    comm = report["median_step"]["ranks"]["0"]
    assert 0 < comm["comm_s"] <= comm["step_s"]


def _caught_failure(comm):
    """Rank 0 calls an allreduce that rank 1 never joins (it ends), catches the error, and ends normally."""
    import pycoll
    x = np.ones(4, np.float32)
    comm.allreduce(x)
    if comm.rank == 0:
        with pytest.raises((pycoll.TimeoutError, pycoll.PeerError)):
            comm.allreduce(x, timeout=2.0)
    return True


@pytest.mark.timeout(120)
def test_an_ending_dump_never_replaces_a_failures(tmp_path):
    run_ranks(_caught_failure, 2, env={"PYCOLL_TRACE_DIR": str(tmp_path), "PYCOLL_TUNER": "static"})
    zero, one = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert zero["reason"].split()[0] in ("TimeoutError", "PeerError") and zero["error"], zero["reason"]
    assert one["reason"].startswith("job ended"), one["reason"]


# -- mark_step -----------------------------------------------------------------------------------------
def test_mark_step_numbers_and_keeps_the_newest():
    import pycoll
    from pycoll.trace import recorder
    first = pycoll.mark_step()
    assert pycoll.mark_step() == first + 1
    marks = recorder.marks()
    assert marks[-1][0] == first + 1 and marks[-2][0] == first and marks[-1][1] >= marks[-2][1]
    for _ in range(recorder.MAX_MARKS):
        pycoll.mark_step()
    marks = recorder.marks()
    assert len(marks) == recorder.MAX_MARKS and marks[-1][0] == first + 1 + recorder.MAX_MARKS
    assert [k for k, _ in marks] == list(range(marks[0][0], marks[-1][0] + 1))


def test_the_agreed_token_names_the_job_without_a_launcher_id(monkeypatch):
    """Plain torchrun or mpirun set no PYCOLL_JOB_TOKEN: the token the ranks agree on at rendezvous
    (world.connect calls agreed_token) names the job, the same on every rank, never the token itself."""
    from pycoll.trace import recorder
    for var in ("PYCOLL_JOB_TOKEN", "PYCOLL_JOB_TOKEN_FILE", *recorder.JOB_ID_VARIABLES):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(recorder, "_agreed_job", None)
    recorder.job_identity.cache_clear()
    assert recorder.job_identity() is None
    recorder.agreed_token(b"\x01" * 16)
    first = recorder.job_identity()
    recorder.agreed_token(b"\x02" * 16)
    assert first.startswith("token-") and first != recorder.job_identity() and "0101" not in first
    monkeypatch.setattr(recorder, "_agreed_job", None)
    recorder.job_identity.cache_clear()
