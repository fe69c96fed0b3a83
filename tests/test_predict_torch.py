"""pycoll predict on a torch DDP model: 2 ranks train through the "pycoll" backend and record the
workload (examples/torch_ddp_record.py, pycoll/predict/torch_record.py); predict reads the record."""
from __future__ import annotations

import json
import sys

import pytest

pytest.importorskip("torch")

from pycoll.predict.workload import load  # noqa: E402
from test_examples import pycoll_run, run  # noqa: E402


@pytest.mark.timeout(240)
def test_torch_ddp_records_a_workload_that_predicts(tmp_path):
    rec = tmp_path / "torch.json"
    out = pycoll_run(2, "examples/torch_ddp_record.py", "--hidden", "128,128", "--steps", "8", "--bucket-mb", "0.05",
                     "--out", str(rec))
    assert "workload record written" in out, out
    d = json.loads(rec.read_text())
    w = load(str(rec))
    assert w.source == "pycoll.torch" and w.ranks == 2 and w.host_of == [0, 0] and w.global_batch == 128
    # every parameter of the 64-128-128-10 MLP, once, over the buckets (DDP's buckets, in launch order)
    assert w.gradient_bytes == 4 * (64 * 128 + 128 + 128 * 128 + 128 + 128 * 10 + 10)
    assert len(w.buckets) >= 2 and w.buckets[-1].ready_frac == pytest.approx(1.0)
    assert all(0 < b.ready_frac <= 1.0 for b in w.buckets)
    assert [b.ready_frac for b in w.buckets] == sorted(b.ready_frac for b in w.buckets)
    assert [p.local_batch for p in w.profile] == [4, 8, 16, 32, 64, 128]
    assert all(p.fwd_bwd_ms > 0 for p in w.profile) and w.compute.fwd_bwd_ms > 0
    m = d["measured"]
    assert d["step_ms"] == m["step_ms"] > 0 and m["steps"] == 7 and m["comm_total_ms"] > 0
    assert m["wait_ms"] >= 0 and m["comm_ms"] >= 0 and d["prediction"]["step_ms"] > 0
    assert w.params.source in ("probe", "cache")
    proc = run([sys.executable, "-m", "pycoll", "predict", "--workload", str(rec), "--hosts", "2", "--ppn", "2",
                "--link-gbit", "1", "--json"])
    assert proc.returncode == 0, proc.stderr
    p = json.loads(proc.stdout)
    assert p["ranks"] == 4 and p["hosts"] == 2 and len(p["buckets"]) == len(w.buckets)
    assert p["step_ms"] > p["compute_ms"] > 0 and p["comm_total_ms"] > 0
    proc = run([sys.executable, "-m", "pycoll", "predict", "--workload", str(rec), "--measured", str(rec), "--json"])
    assert proc.returncode == 0, proc.stderr
    cmp = json.loads(proc.stdout)["runs"][0]
    assert cmp["measured_ms"] == pytest.approx(d["step_ms"]) and cmp["predicted_ms"] > 0
