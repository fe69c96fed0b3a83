"""pycoll predict on an emulated cluster (slow): record the trainer's workload on one host, predict
2 hosts x 2 ranks (packed and interleaved) behind a 200 Mbit/s tbf, run them, compare (goal 25%).
docs/make_predict.py runs the full set (2, 3, 4 hosts) and writes docs/predict.md."""
from __future__ import annotations

import pytest

from netns_cluster import unavailable
from predict_cluster import measure_run, predict_runs, table

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=f"emulated cluster: {unavailable()}")
TRAINER = ["--epochs", "3", "--hidden", "512,512", "--batch-size", "240", "--bucket-kb", "256", "--log-every", "0"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_hosts_predicted_from_one(tmp_path):
    cache = str(tmp_path / "tuner")
    base = str(tmp_path / "h1.json")
    measure_run(1, 2, "packed", None, TRAINER, base, cache)
    runs = {}
    for how in ("packed", "interleaved"):
        runs[str(tmp_path / f"h2-{how}.json")] = how
        rec = measure_run(2, 2, how, 200, TRAINER, str(tmp_path / f"h2-{how}.json"), cache)
    gbit = rec["cluster"]["link_Bps"] * 8e-9
    got = predict_runs(base, list(runs), gbit)
    print("\n" + table(got, runs))
    assert len(got["runs"]) == 2 and all(r["measured_ms"] > 0 for r in got["runs"])
    assert got["max_abs_error"] <= 0.25, table(got, runs)
