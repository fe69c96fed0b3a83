"""`pycoll predict --trace` against a measured run on an emulated cluster (issue 38 item 3; the whole
validation, every job on 2-4 hosts, is docs/make_predict_trace.py): a job recorded with 4 ranks on one
host predicts the same job on 2 hosts x 2 ranks at 200 Mbit/s within the goal's worst case (|error| <= 20%,
medians of three recordings' predictions and three target runs, taking turns).

Needs root (network namespaces, veth, tc); slow (six runs of the job: 90 s at load 10).
"""
import os
import statistics
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from netns_cluster import Cluster  # noqa: E402
from predict_trace_cluster import SYSCTLS, error, measure_link, predict_trace, run_traced  # noqa: E402

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(os.geteuid() != 0, reason="emulated cluster: needs root (ip netns, veth, tc)")]

# the trainer's data parallelism: 1.2 MiB of gradients a step, so at 200 Mbit/s the link is most of a step
DP = [sys.executable, "-m", "pycoll.trainer", "--epochs", "3", "--hidden", "512,512", "--batch-size", "240",
      "--bucket-kb", "256", "--log-every", "0", "--baseline-sps", "1", "--report-json", "{RESULT}"]


@pytest.mark.timeout(900)
def test_one_host_trace_predicts_two_hosts(tmp_path):
    # recordings and targets take turns, three of each, and the medians are compared: one slow spell of
    # a loaded machine (a recording's median step 20 ms in one run, 52 ms in the next at load 10) hits
    # one pair, not the answer
    predicted, measured = [], []
    with Cluster(2, rate_mbit=200, sysctls=SYSCTLS) as c:
        link = measure_link(c)
        for i in range(3):
            rec = run_traced(c, DP, [0, 0], 2, str(tmp_path / f"record{i}"), timeout=240)   # 4 ranks in one host
            assert rec["status"] == "ok", rec.get("error")
            tgt = run_traced(c, DP, [0, 1], 2, str(tmp_path / f"target{i}"), timeout=240)   # 2 hosts x 2 ranks
            assert tgt["status"] == "ok", tgt.get("error")
            # the link as measured, and the tbf's bucket as the cluster set it
            got = predict_trace(rec["trace"], 2, 2, link["gbit"], link["latency_us"],
                                shared_cores=os.cpu_count() or 1, burst_kib=c.burst_kib)
            assert got["mode"] == "what-if" and got["target"]["hosts"] == 2 and got["target"]["burst_kib"] == 256
            assert got["step_ms"] > rec["measured_ms"], "a step whose gradients cross a 200 Mbit/s link is slower"
            predicted.append(got["step_ms"])
            measured.append(tgt["measured_ms"])
    err = error(statistics.median(predicted), statistics.median(measured))
    assert abs(err) <= 0.20, (f"predicted {predicted} ms, measured {measured} ms: medians {err:+.1%}; link {link}")
