"""pycoll predict: the step model on a workload built here (fast), and a real trainer run recorded
with --report-json then predicted (processes over real sockets/shm)."""
from __future__ import annotations

import json
import math
import sys

import pytest

from pycoll.cli import predict as cli
from pycoll.predict.model import Target, build_topology, expected_max_normal, placement, predict, sharing
from pycoll.predict.workload_trace import simulate_step
from pycoll.predict.workload import Bucket, ComputePoint, Workload, WorkloadError, from_dict, load
from pycoll.tuner import Link, Params
from test_examples import pycoll_run, run

MIB = 1 << 20


def workload(ranks: int = 2, host_of=(0, 0)) -> Workload:
    """Two buckets, compute linear in the batch (0.5 ms + 0.1 ms/sample), nothing measured to fit."""
    return Workload(source="test", global_batch=64, ranks=ranks, host_of=list(host_of), cores=[8],
                    buckets=[Bucket(4 * MIB, 0.5), Bucket(MIB, 1.0)],
                    compute=ComputePoint(64 / ranks, 0.5 + 0.1 * 64 / ranks, 0.2), jitter_frac=0.0,
                    profile=[ComputePoint(b, 0.5 + 0.1 * b, 0.2) for b in (4, 8, 16, 32, 64)],
                    params=Params(Link(10e-6, 1 / 5e9), Link(50e-6, 8 / 1e9), 1 / 4e9, "test"))


def timeline(fwd, opt, ready, comm, barrier, straggle):
    """The workload step as the trace simulator runs it (the same simulator as `predict --trace`)."""
    t = simulate_step(fwd, opt, ready, [(1 << 20, "ring", c) for c in comm], barrier, straggle)
    return t.step, t.wait, t.exposed, t.spans


def test_timeline_overlaps_buckets_with_backward():
    # backward ends at 10; bucket 0 ready at 5 runs 5..8 behind it, bucket 1 ready at 10 runs 10..12
    step, wait, exposed, spans = timeline(10.0, 1.0, [0.5, 1.0], [3.0, 2.0], 0.0, 0.0)
    assert (step, wait, exposed) == (13.0, 0.0, 2.0)
    assert spans == [(5.0, 5.0, 8.0), (10.0, 10.0, 12.0)]
    # bucket 0 too slow to hide: bucket 1 queues behind it
    step, wait, exposed, spans = timeline(10.0, 1.0, [0.5, 1.0], [7.0, 2.0], 0.0, 0.0)
    assert (step, exposed, spans[1][1]) == (15.0, 4.0, 12.0)
    # a slowest rank 4 later: the probe (a barrier at its bucket 0) ends at 0.5 * 14 + 1 = 8, the
    # buckets wait for it, and the average rank waits 0 but is exposed to the delay as comm
    step, wait, exposed, _ = timeline(10.0, 0.0, [1.0, 1.0], [1.0, 1.0], 1.0, 4.0)
    assert (step, wait, exposed) == (17.0, 5.0, 2.0)


def test_expected_max_of_normals():
    assert expected_max_normal(1) == 0.0
    assert expected_max_normal(2) == pytest.approx(1 / math.sqrt(math.pi), rel=1e-3)
    assert expected_max_normal(8) == pytest.approx(1.4236, rel=1e-3)


def test_compute_profile_interpolates_and_extends():
    w = workload()
    assert w.compute_at(16)[0] == pytest.approx(2.1)
    assert w.compute_at(12)[0] == pytest.approx(1.7)
    assert w.compute_at(128)[0] == pytest.approx(13.3)  # beyond the profile: the last segment's slope
    assert w.compute_at(2)[0] == pytest.approx(0.7)
    assert w.compute_at(16)[1] == pytest.approx(0.2)


def test_placement_and_core_sharing():
    assert placement(2, 3, "packed") == [0, 0, 0, 1, 1, 1]
    assert placement(2, 3, "scattered") == [0, 1, 0, 1, 0, 1]
    assert sharing(build_topology(placement(2, 4, "packed"), [2, 2])) == 2.0
    assert sharing(build_topology(placement(4, 2, "packed"), [2] * 4), shared_cores=2) == 4.0
    with pytest.raises(ValueError, match="placement"):
        placement(2, 2, "diagonal")


def test_prediction_adds_up_and_scales():
    w = workload()
    p1 = predict(w, Target(build_topology([0]), w.params, 64))
    assert p1.step_ms == pytest.approx(0.5 + 6.4 + 0.2) and p1.efficiency == pytest.approx(1.0) and not p1.buckets
    slow, fast = (predict(w, Target(build_topology(placement(4, 2, "packed"), [8] * 4), w.params.__class__(
        w.params.shm, Link(50e-6, 8e-9 / g), w.params.gamma), 64)) for g in (1, 100))
    for p in (slow, fast):
        assert p.step_ms == pytest.approx(p.compute_ms + p.comm_ms + p.wait_ms)
        assert p.low_ms <= p.step_ms <= p.high_ms
        assert p.compute_ms == pytest.approx(0.5 + 0.1 * 8 + 0.2)
        assert [b.algorithm for b in p.buckets] and all(b.end_ms > b.start_ms >= b.ready_ms for b in p.buckets)
    assert slow.step_ms > 5 * fast.step_ms  # 4 MiB + 1 MiB across 1 Gbit/s: tens of ms; 100 Gbit/s: below 1 ms
    assert slow.comm_total_ms == pytest.approx(sum(b.comm_ms for b in slow.buckets))
    assert slow.efficiency < fast.efficiency < 1


def test_record_round_trip_and_bad_files(tmp_path):
    w = workload()
    again = from_dict(json.loads(json.dumps(w.to_dict())))
    assert again.buckets == w.buckets and again.profile == w.profile
    assert list(again.params.row()) == pytest.approx(list(w.params.row()), rel=1e-12)
    with pytest.raises(WorkloadError, match="not a pycoll workload"):
        from_dict({"step_ms": 3})
    bad = w.to_dict()
    del bad["buckets"]
    with pytest.raises(WorkloadError, match="buckets"):
        from_dict(bad)
    with pytest.raises(WorkloadError, match="cannot read"):
        load(str(tmp_path / "missing.json"))


def test_cli_json_sweep_and_errors(tmp_path, capsys):
    path = tmp_path / "w.json"
    path.write_text(json.dumps(workload().to_dict()))
    assert cli.main(["--workload", str(path), "--hosts", "2", "--ppn", "2", "--link-gbit", "1", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["ranks"] == 4 and got["hosts"] == 2 and got["step_ms"] > got["compute_ms"] > 0
    assert cli.main(["--workload", str(path), "--hosts", "4", "--ppn", "2", "--sweep", "--sweep-gbit", "1,10",
                     "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [(r["hosts"], r["per_host"]) for r in rows[:6]] == [(1, 1), (1, 2), (2, 1), (2, 2), (4, 1), (4, 2)]
    assert len(rows) == 12 and all(r["step_ms"] > 0 for r in rows)
    assert cli.main(["--workload", str(path), "--hosts", "2", "--placement", "scattered"]) == 0
    assert "predicted step" in capsys.readouterr().out
    assert cli.main(["--workload", str(tmp_path / "none.json")]) == 2
    assert "cannot read" in capsys.readouterr().err


@pytest.mark.timeout(180)
def test_trainer_records_a_workload_that_predicts(tmp_path):
    rec = tmp_path / "rec.json"
    out = pycoll_run(2, "-m", "pycoll.trainer", "--epochs", "1", "--log-every", "0", "--hidden", "64,64",
                     "--bucket-kb", "8", "--report-json", str(rec))
    assert "predicted step" in out and "workload record written" in out
    d = json.loads(rec.read_text())
    assert d["step_ms"] > 0 and d["measured"]["step_ms"] == d["step_ms"] and d["prediction"]["step_ms"] > 0
    w = load(str(rec))
    assert w.ranks == 2 and w.host_of == [0, 0] and w.global_batch == 64
    assert w.gradient_bytes == 4 * (64 * 64 + 64 + 64 * 64 + 64 + 64 * 10 + 10)  # every parameter, once
    assert len(w.buckets) >= 2 and all(0 < b.ready_frac <= 1.001 for b in w.buckets)
    assert [p.local_batch for p in w.profile] == [2, 4, 8, 16, 32, 64]
    assert w.compute.fwd_bwd_ms > 0 and w.params.source in ("probe", "cache")
    proc = run([sys.executable, "-m", "pycoll", "predict", "--workload", str(rec), "--measured", str(rec), "--json"])
    assert proc.returncode == 0, proc.stderr
    cmp = json.loads(proc.stdout)
    assert cmp["runs"][0]["measured_ms"] == pytest.approx(d["step_ms"]) and cmp["runs"][0]["predicted_ms"] > 0
