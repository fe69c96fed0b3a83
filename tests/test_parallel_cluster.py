"""The jobs of examples/parallel/ on emulated hosts (docs/learning-path.md's claims, checked): where
TP's traffic goes with each placement, and what link delay does to the time per output token."""
import statistics

import pytest

from netns_cluster import Cluster, unavailable
from parallel_cluster import round_trip_ms, run_cluster

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(unavailable() is not None, reason=f"emulated cluster: {unavailable()}")]
HYBRID = ["--dp-style", "ddp", "--dim", "32", "--heads", "4", "--mlp-ratio", "2", "--seq", "32", "--batch", "32",
          "--steps", "2"]
SERVE = ["--layers", "2", "--hidden", "64", "--heads", "4", "--batch", "1", "--prompt-len", "16",
         "--new-tokens", "24", "--steps", "2"]


@pytest.mark.timeout(600)
def test_tp_across_hosts_sends_its_activations_over_the_link():
    """2 hosts x 2 ranks: with TP inside hosts only DP's gradients cross; across, every TP allreduce
    does. The traffic report of each run says so, and both placements train the same model."""
    with Cluster(2, rate_mbit=1000) as c:
        inside = run_cluster(c, "hybrid.py", 2, ["--tp-inside-host", *HYBRID], "pycoll", trace=True)
        across = run_cluster(c, "hybrid.py", 2, ["--tp-across-hosts", *HYBRID], "pycoll", trace=True)
    between = [j["traffic"]["median_step"]["total"]["bytes_between"] for j in (inside, across)]
    # TP: 4 allreduces per block forward and backward of batch x seq x dim floats, each rank sending
    # its share; DP: the gradients of half the model per rank, once per step
    activations = 2 * 4 * 32 * 32 * 32 * 4
    assert between[1] >= 2 * activations and between[1] > 10 * between[0], between  # (measured: 30x)
    assert inside["result"]["mesh"] == [[0, 1], [2, 3]] and across["result"]["mesh"] == [[0, 2], [1, 3]]
    assert inside["result"]["weights_sha"] == across["result"]["weights_sha"]


@pytest.mark.timeout(900)
def test_link_delay_adds_allreduces_times_rounds_times_delay_to_each_token():
    """TP decoding over 2 hosts (one rank each): the tuner picks recursive doubling (one exchange,
    the fewest rounds) for these few-KiB allreduces, and each token's time grows by allreduces per
    token x 1 x the one-way delay measured on the wire, within 25%."""
    tpot, one_way = {}, {}
    for d in (0.0, 4.0):
        with Cluster(2, delay_ms=d) as c:
            rtt = [round_trip_ms(c)]
            runs = [run_cluster(c, "serve.py", 1, SERVE, "pycoll", trace=True) for _ in range(3)]
            rtt.append(round_trip_ms(c))
        one_way[d] = statistics.median(rtt) / 2
        tpot[d] = statistics.median(j["result"]["tpot_ms"] for j in runs)
        algos = {x["algorithm"] for j in runs for x in j["traffic"]["median_step"]["collectives"]
                 if x["call"] == "allreduce" and x["calls"]}
        assert algos == {"recursive_doubling"}, algos
    per_token = runs[0]["result"]["allreduces_per_token"]
    predicted = per_token * 1 * (one_way[4.0] - one_way[0.0])
    growth = tpot[4.0] - tpot[0.0]
    print(f"tpot {tpot}, one-way {one_way}: growth {growth:.2f} ms, predicted {predicted:.2f} ms")
    assert per_token == 4
    assert growth == pytest.approx(predicted, rel=0.25), (tpot, one_way)
