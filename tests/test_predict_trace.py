"""`pycoll predict --trace DIR` (pycoll/predict/trace_replay.py, trace_target.py): replay a job from its
flight-recorder dumps and predict it on another cluster.

The simulator's rules are checked first on hand-made dumps (a collective starts when its last member is
ready, a receive ends after its send, an async call overlaps compute until it is waited for). Then real
jobs are recorded as users record them (`pycoll run -n 2 --trace-dir D`, 2 ranks, a few steps) and
replayed: with the recorded durations the replay must give back the measured median step (within 5%:
the programs and dependencies describe the run), and the CLI's answer must add up (compute + exposed
comm + wait = the step). What-if: the recorded TP job on more hosts and slower links gets slower, a job
that only computes does not, core sharing slows compute, and bad input (a placement that does not fit,
a missing rank, two jobs' dumps, no marks) gets a clear answer.
"""
import json
import os
import shutil
import subprocess
import sys

import pytest

from pycoll.cli import predict as cli
from pycoll.predict import trace_replay, trace_target
from pycoll.trace import analysis
from pycoll.trace.analysis import TraceError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOBS = os.path.join(ROOT, "examples", "parallel")
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
               "PYCOLL_JOB_TOKEN", "PYCOLL_JOB_TOKEN_FILE", "PYCOLL_TRACE_DIR", "PYCOLL_STORE_HOSTED",
               "PYCOLL_STORE_PORT")
QUICK = ["--steps", "4", "--warmup", "1"]

COMPUTE_JOB = '''
import time
import numpy as np
import pycoll
with pycoll.init() as comm:
    a = np.random.default_rng(comm.rank).random((160, 160))
    comm.barrier()
    for _ in range(8):
        t = time.perf_counter()
        while time.perf_counter() - t < 0.02:  # 20 ms of compute, no communication
            a = a @ a
            a /= np.abs(a).max()
        pycoll.mark_step()
    comm.barrier()
'''


# -- the simulator on hand-made dumps ------------------------------------------------------------------
def _call(seq, call, enter, start, end, **kw):
    e = {"seq": seq, "call": call, "p2p": call in ("send", "recv", "isend", "irecv"), "dtype": "float32",
         "count": 1024, "itemsize": 4, "state": "completed", "enter": enter, "start": start, "end": end, "site": None}
    if not e["p2p"]:
        e.update(op="sum", root=None, algorithm="ring")
    e.update(kw)
    return e


def _dump(rank, calls, marks, job="job-a", hosts=("h0", "h0")):
    return {"pycoll_trace": 1, "rank": rank, "host_id": hosts[rank], "host": "m", "job": job, "started": 0.0,
            "time": 100.0, "steps": len(marks), "marks": [[k + 1, t] for k, t in enumerate(marks)],
            "comms": [{"name": "world", "id": "0x1", "rank": rank, "size": 2, "group": [0, 1], "capacity": 100,
                       "recorded": len(calls), "hosts": list(hosts), "calls": calls}]}


def _two_ranks():
    """Two steps; in each rank 0 computes 1 ms and rank 1 3 ms before an allreduce that takes 0.5 ms
    once both are in; in step 2 rank 0 then sends rank 1 a message (isend, waited at once) for
    which rank 1 posted an irecv before its allreduce and waited at the step's end, 2 ms after it came."""
    r0 = [_call(1, "allreduce", 1.001, 1.001, 1.0035),
          _call(2, "allreduce", 1.0045, 1.0045, 1.0070),
          _call(1, "isend", 1.0070, 1.0070, 1.0075, peer=1, tag=0)]
    r1 = [_call(1, "allreduce", 1.003, 1.003, 1.0035),
          _call(2, "allreduce", 1.0065, 1.0065, 1.0070),
          _call(1, "irecv", 1.0060, 1.0060, 1.0075, peer=0, tag=0)]
    return {0: _dump(0, r0, [1.0, 1.0035, 1.0080]), 1: _dump(1, r1, [1.0, 1.0035, 1.0095])}


def test_replay_follows_the_dependencies():
    trace = trace_replay.build(_two_ranks())
    assert trace.steps == [2, 3] and trace.marked
    assert sorted(k[0] for k in trace.instances) == ["c", "c", "p"]
    out = trace_replay.replay(trace)
    assert out["error"] == pytest.approx(0, abs=1e-9)
    assert [s["measured_ms"] for s in out["per_step"]] == pytest.approx([3.5, 6.0])
    # the isend ended before rank 0's next event: waited at once; rank 1's irecv at its step's end
    ops0 = [(op.kind, op.block) for op in trace.programs[0] if op.kind in ("issue", "wait")]
    assert ops0 == [("issue", True), ("issue", True), ("issue", True)]
    ops1 = [(op.kind, op.block) for op in trace.programs[1] if op.kind in ("issue", "wait", "mark")]
    assert ops1 == [("issue", True), ("mark", False), ("issue", False), ("issue", True), ("wait", False),
                    ("mark", False)]
    tl = out["_timeline"]
    # rank 0 waited for rank 1 in both allreduces: 2 ms each
    assert [round(b.wait * 1e3, 6) for b in tl.blocked[0][:2]] == [2.0, 2.0]
    assert all(b.last == 1 for b in tl.blocked[0][:2])

    # why: step 2 waited on rank 1's 3 ms of compute, then the allreduce; rank 0 waited 2 ms for rank 1
    why = out["why"]
    assert why["step"] == 2
    path = [(p["rank"], p["kind"], round(p["t0_ms"], 6), round(p["t1_ms"], 6)) for p in why["critical_path"]]
    assert path == [(1, "compute", 0.0, 3.0), (why["rank"], "call", 3.0, 3.5)], path
    assert why["waiting_for_ms"] == {0: {1: pytest.approx(2.0)}}

    # rank 1 computing twice as slowly: each allreduce starts 3 ms later for both ranks
    costs = trace_replay.recorded_costs(trace)
    costs.compute[1] = 2.0
    slow = trace_replay.simulate(trace, costs)
    assert slow.start[("c", "0x1", 1)] - tl.start[("c", "0x1", 1)] == pytest.approx(0.003)
    # the receive overlapped 2 ms of rank 1's compute: a message 1 ms slower still ends within it
    costs = trace_replay.recorded_costs(trace)
    key = next(k for k in trace.instances if k[0] == "p")
    costs.times[key] = {m: (h, a + 0.001, o) for m, (h, a, o) in costs.times[key].items()}
    late = trace_replay.simulate(trace, costs)
    assert late.marks[1][3] == pytest.approx(tl.marks[1][3])
    assert late.ends[key][1] == pytest.approx(tl.ends[key][1] + 0.001)


def test_bad_dumps_are_named():
    dumps = _two_ranks()
    with pytest.raises(TraceError, match=r"ranks 1 of the job's 2 left no dump"):
        trace_replay.build({0: dumps[0]})
    other = dict(dumps[1], job="job-b")
    with pytest.raises(TraceError, match="different jobs"):
        analysis.one_job({0: dumps[0], 1: other})
    unmarked = {r: dict(d, marks=[], steps=0) for r, d in dumps.items()}
    trace = trace_replay.build(unmarked)
    assert not trace.marked and "no step marks" in trace.notes[0]
    out = trace_replay.replay(trace)
    assert out["measured_step_ms"] == pytest.approx(6.5) and out["error"] == pytest.approx(0, abs=1e-9)


def test_a_wrapped_ring_predicts_from_the_steps_it_kept():
    dumps = _two_ranks()
    for d in dumps.values():  # a ring of 3 that saw 4 calls: one before the first allreduce is gone, so
        d["comms"][0].update(capacity=3, recorded=4)  # step 2 may have lost calls; step 3 is held whole
    trace = trace_replay.build(dumps)
    assert trace.steps == [3]
    assert any("1 earlier marked steps are left out" in n for n in trace.notes), trace.notes
    out = trace_replay.replay(trace)
    assert out["step_ms"] == pytest.approx(6.0) and out["error"] == pytest.approx(0, abs=1e-9)


def test_placement_must_fit():
    trace = trace_replay.build(_two_ranks())
    for kw in ({"hosts": 3}, {"ppn": 4}, {"hosts": 2, "ppn": 2}):
        with pytest.raises(ValueError, match="does not fit the trace's 2 ranks"):
            trace_target.target_cluster(trace, **kw)
    target = trace_target.target_cluster(trace, hosts=2)
    assert target.host_of == [0, 1]
    assert trace_target.target_cluster(trace, ppn=2).host_of == [0, 0]


# -- real jobs ---------------------------------------------------------------------------------------------
def _env():
    return {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}


def record(folder, n, *command, timeout=170):
    """Run `command` (after `python`) on `n` ranks with `pycoll run --trace-dir folder`; the folder."""
    cmd = [sys.executable, "-m", "pycoll", "run", "-n", str(n), "--timeout", str(timeout - 10), "--trace-dir",
           str(folder), sys.executable, *command]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, \
        f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return str(folder)


def predict(capsys, *args):
    """(exit status, JSON answer or None, stderr) of `pycoll predict` with `args` (+ --json)."""
    rc = cli.main([*args, "--json"])
    out, err = capsys.readouterr()
    return rc, (json.loads(out) if rc == 0 else None), err


def assert_replayed(answer, marked=True):
    """The replay gives back the measured step, and the split adds up to it."""
    assert answer["mode"] == "replay" and answer["marked"] == marked
    assert abs(answer["error"]) < 0.05, answer
    sp = answer["split"]
    assert sp["compute_ms"] + sp["comm_ms"] + sp["wait_ms"] == pytest.approx(answer["step_ms"], rel=1e-6), answer
    assert answer["typical"]["step_ms"] > 0
    if marked:
        assert len(answer["steps"]) >= 3 and len(answer["per_step"]) == len(answer["steps"])
        for row in answer["per_step"]:
            assert row["predicted_ms"] == pytest.approx(row["measured_ms"], rel=0.05), answer["per_step"]
    else:
        assert any("no step marks" in n for n in answer["notes"])


JOB_CASES = [
    pytest.param(("tp", [os.path.join(JOBS, "tp.py"), *QUICK]), id="tp"),
    pytest.param(("pp", [os.path.join(JOBS, "pp.py"), *QUICK]), id="pp-gpipe", marks=pytest.mark.slow),
    pytest.param(("serve", [os.path.join(JOBS, "serve.py"), "--steps", "1", "--warmup", "0", "--new-tokens", "8",
                            "--layers", "2", "--prompt-len", "16"]), id="serve", marks=pytest.mark.slow),
    pytest.param(("trainer", ["-m", "pycoll.trainer", "--epochs", "1", "--log-every", "0"]), id="trainer"),
    pytest.param(("pp", [os.path.join(JOBS, "pp.py"), "--schedule", "1f1b", *QUICK]), id="pp-1f1b",
                 marks=pytest.mark.slow),
    pytest.param(("ep", [os.path.join(JOBS, "ep.py"), *QUICK, "--tokens", "256"]), id="ep", marks=pytest.mark.slow),
    pytest.param(("hybrid", [os.path.join(JOBS, "hybrid.py"), *QUICK]), id="hybrid", marks=pytest.mark.slow),
    pytest.param(("ddp", [os.path.join(ROOT, "examples", "torch_ddp.py"), "--epochs", "1"]), id="ddp",
                 marks=pytest.mark.slow),
]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("case", JOB_CASES)
def test_replay_of_a_recorded_job(tmp_path, capsys, case):
    name, command = case
    if name != "trainer":
        pytest.importorskip("torch")
    folder = record(tmp_path / name, 2, *command)
    rc, answer, err = predict(capsys, "--trace", folder)
    assert rc == 0, err
    assert_replayed(answer)  # every job marks its steps (the trainer and torch_ddp.py too)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_replay_of_hybrid_on_four_ranks(tmp_path, capsys):
    pytest.importorskip("torch")
    for style in ("fsdp", "ddp"):  # (2 x 2: TP inside the host, FSDP2 or DDP along dp)
        folder = record(tmp_path / style, 4, os.path.join(JOBS, "hybrid.py"), *QUICK, "--dp-style", style)
        rc, answer, err = predict(capsys, "--trace", folder)
        assert rc == 0, err
        assert_replayed(answer)


@pytest.fixture(scope="module")
def tp_trace(tmp_path_factory):
    pytest.importorskip("torch")
    return record(tmp_path_factory.mktemp("tp"), 2, os.path.join(JOBS, "tp.py"), "--steps", "6", "--warmup", "1")


@pytest.fixture(scope="module")
def compute_trace(tmp_path_factory):
    folder = tmp_path_factory.mktemp("compute")
    script = folder / "compute_job.py"
    script.write_text(COMPUTE_JOB)
    return record(folder / "trace", 2, str(script))


@pytest.mark.timeout(200)
def test_whatif_more_hosts_and_slower_links_slow_a_tp_job(tp_trace, capsys, tmp_path):
    rc, replayed, err = predict(capsys, "--trace", tp_trace)
    assert rc == 0, err
    # the recorded placement, retargeted to itself: nothing is repriced
    rc, same, err = predict(capsys, "--trace", tp_trace, "--hosts", "1")
    assert rc == 0, err
    assert same["mode"] == "what-if" and same["repriced"]["repriced"] == 0
    assert same["step_ms"] == pytest.approx(replayed["step_ms"], rel=1e-9)
    steps = []
    for gbit, latency in (("10", "20"), ("1", "100"), ("0.1", "500")):
        rc, answer, err = predict(capsys, "--trace", tp_trace, "--hosts", "2", "--link-gbit", gbit,
                                  "--link-latency-us", latency)
        assert rc == 0, err
        assert answer["target"]["hosts"] == 2 and answer["repriced"]["repriced"] > 0
        # the TP group moved across hosts: its board allreduce becomes a network one
        assert all("twoshot ->" not in k or "-> twoshot" not in k for k in answer["repriced"]["algorithms"])
        sp = answer["split"]
        assert sp["compute_ms"] + sp["comm_ms"] + sp["wait_ms"] == pytest.approx(answer["step_ms"], rel=1e-6)
        steps.append(answer["step_ms"])
    assert replayed["step_ms"] < steps[1] < steps[2], (replayed["step_ms"], steps)
    assert steps[0] < steps[2]
    # a topology file: the hosts' 1 Gbit/s links behind 0.1 Gbit/s rack uplinks cost what 0.1 Gbit/s links do
    topo = tmp_path / "topo.json"
    topo.write_text(json.dumps({"hosts": {"a": [0], "b": [1]}, "links": {"net": {"latency_us": 500, "gbit": 1}},
                                "racks": {"A": {"hosts": ["a"], "uplink_gbit": 0.1},
                                          "B": {"hosts": ["b"], "uplink_gbit": 0.1}}}))
    rc, racked, err = predict(capsys, "--trace", tp_trace, "--topo-file", str(topo))
    assert rc == 0, err
    assert racked["target"]["racks"] == ["A", "B"]
    assert racked["step_ms"] == pytest.approx(steps[2], rel=1e-6)


@pytest.mark.timeout(200)
def test_whatif_leaves_a_compute_job_alone_but_charges_core_sharing(compute_trace, capsys):
    rc, replayed, err = predict(capsys, "--trace", compute_trace)
    assert rc == 0, err
    assert_replayed(replayed)
    rc, far, err = predict(capsys, "--trace", compute_trace, "--hosts", "2", "--link-gbit", "0.05",
                           "--link-latency-us", "1000")
    assert rc == 0, err
    assert far["step_ms"] == pytest.approx(replayed["step_ms"], rel=0.02), (far["step_ms"], replayed["step_ms"])
    rc, shared, err = predict(capsys, "--trace", compute_trace, "--shared-cores", "1")
    assert rc == 0, err
    assert shared["step_ms"] == pytest.approx(2 * replayed["step_ms"], rel=0.05), \
        (shared["step_ms"], replayed["step_ms"])


@pytest.mark.timeout(200)
def test_bad_targets_and_folders_are_refused(tp_trace, compute_trace, tmp_path, capsys):
    rc, _, err = predict(capsys, "--trace", tp_trace, "--hosts", "3")
    assert rc == 2 and "does not fit the trace's 2 ranks" in err
    bad = tmp_path / "placement.json"
    bad.write_text("[0, 1, 1]")
    rc, _, err = predict(capsys, "--trace", tp_trace, "--placement", str(bad))
    assert rc == 2 and "places 3 ranks, the trace has 2" in err
    rc, _, err = predict(capsys, "--trace", tp_trace, "--algo", "ring")
    assert rc == 2 and "--algo" in err and "--workload only" in err
    one = tmp_path / "one"
    one.mkdir()
    shutil.copy(os.path.join(tp_trace, "rank0.json"), one / "rank0.json")
    rc, _, err = predict(capsys, "--trace", str(one))
    assert rc == 2 and "ranks 1 of the job's 2 left no dump" in err
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    shutil.copy(os.path.join(tp_trace, "rank0.json"), mixed / "rank0.json")
    shutil.copy(os.path.join(compute_trace, "rank1.json"), mixed / "rank1.json")
    rc, _, err = predict(capsys, "--trace", str(mixed))
    assert rc == 2 and "different jobs" in err
    rc, _, err = predict(capsys, "--trace", str(tmp_path / "nowhere"))
    assert rc == 2 and "is not a folder" in err
