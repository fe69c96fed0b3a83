"""Racks and shared uplinks: the topology file declares racks and their uplink rate; the tuner (and so
`pycoll predict`) charges the bytes crossing a rack's uplink at its rate, and the host-ordered ring
leaves each rack once. Fast: the topology file, the cost model, the ordering, the algorithms' results
on ranks with racks declared. Slow: 4 emulated hosts in 2 racks behind one uplink each, the ring with
and without the racks declared, measured against predicted."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from multiproc import run_ranks
from netns_cluster import Cluster, unavailable
from pycoll.cli import predict as cli
from pycoll.errors import EnvError
from pycoll.predict.model import build_topology, placement
from pycoll.predict.workload import from_dict
from pycoll.topology import RankInfo, Topology, detect, load_topo_file
from pycoll.tuner import Link, Params, Round, Tuner, round_time
from test_predict import workload

MIB = 1 << 20
PARAMS = Params(Link(10e-6, 1 / 5e9), Link(100e-6, 8 / 1e9), 1 / 4e9, "test")
INTERLEAVED = {"racks": {"A": {"hosts": ["a", "c"], "uplink_gbit": 1}, "B": {"hosts": ["b", "d"], "uplink_gbit": 1}},
               "hosts": {"a": [0], "b": [1], "c": [2], "d": [3]}}


def racked(host_of, racks, gbit=1.0):
    """A topology of ranks on hosts `host_of` with host h in rack racks[h], every uplink `gbit`."""
    return build_topology(host_of, [8] * (max(host_of) + 1), racks, {r: gbit for r in set(racks)})


def test_topology_file_declares_racks(tmp_path):
    path = tmp_path / "topo.json"
    path.write_text(json.dumps(INTERLEAVED))
    spec = load_topo_file(str(path))
    infos = [detect(r, spec) for r in range(4)]
    assert [(i.host, i.rack, i.uplink_gbit) for i in infos] == [("a", "A", 1), ("b", "B", 1), ("c", "A", 1),
                                                                ("d", "B", 1)]
    assert RankInfo.from_json(infos[1].to_json()) == infos[1]
    topo = Topology(infos)
    assert topo.racks == ["A", "B"] and topo.rack_of == [0, 1, 0, 1] and topo.uplink_gbit == [1, 1]
    assert topo.ring_order() == [0, 2, 1, 3]  # one crossing of each uplink per direction, not two
    assert topo.layout != Topology.from_hosts("abcd").layout  # the selector's memo tells them apart
    assert topo.uplinks.beta == pytest.approx((8e-9, 8e-9))
    assert "rack A (uplink 1 Gbit/s)" in topo.matrix()
    by_rank = {"racks": {"A": {"ranks": [0, 1]}, "B": {"ranks": [2, 3], "uplink_gbit": 10}},
               "hosts": {"p": [0], "q": [1], "r": [2], "s": [3]}}
    topo = Topology([detect(r, by_rank) for r in range(4)])
    assert topo.uplink_gbit == [0, 10] and topo.uplinks.rack_of == (0, 0, 1, 1)
    for bad, why in (({"racks": {"A": {"hosts": ["zz"]}}}, "does not declare"),
                     ({"racks": {"A": {"ranks": [0]}, "B": {"ranks": [0]}}}, "two racks"),
                     ({"racks": {"A": {"ranks": [0], "uplink_gbit": -1}}}, ">= 0"),
                     ({"racks": {"A": {"rank": [0]}}}, "'hosts' and/or 'ranks'")):
        path.write_text(json.dumps(bad))
        with pytest.raises(EnvError, match=why):
            load_topo_file(str(path))


def test_uplink_is_charged_for_its_sharing():
    # two flows leave rack A through one 1 Gbit/s uplink: twice one flow's time, whatever the hosts' NICs
    rnd = Round(1, [(0, 1, MIB), (2, 3, MIB)])
    one_switch = round_time(rnd, [0, 1, 2, 3], PARAMS)
    topo = racked([0, 1, 2, 3], ["A", "B", "A", "B"])
    shared = round_time(rnd, topo.host_of, PARAMS, uplinks=topo.uplinks)
    assert one_switch == pytest.approx(100e-6 + MIB * 8e-9)
    assert shared == pytest.approx(100e-6 + 2 * MIB * 8e-9)
    assert round_time(rnd, topo.host_of, PARAMS, streams=2, uplinks=topo.uplinks) == pytest.approx(
        100e-6 + 4 * MIB * 8e-9)
    # a faster uplink than its hosts' links is no bottleneck; a rack without a rate is none either
    fast = racked([0, 1, 2, 3], ["A", "B", "A", "B"], gbit=10)
    assert round_time(rnd, fast.host_of, PARAMS, uplinks=fast.uplinks) == pytest.approx(one_switch)
    assert racked([0, 1], ["A", "B"], gbit=0).uplinks is None


def test_rack_aware_ring_and_hierarchical_cross_each_uplink_once():
    tuner, S = Tuner(PARAMS), 4 * MIB
    for ppn in (1, 2):
        host_of = placement(4, ppn, "packed")
        inter = racked(host_of, ["A", "B", "A", "B"])
        flat = build_topology(host_of, [8] * 4)
        # host order 0,1,2,3 alternates racks: each uplink carries two ring edges per direction
        assert tuner.predict("allreduce", "flat_ring", S, inter) == pytest.approx(
            2 * tuner.predict("allreduce", "flat_ring", S, flat), rel=0.05)
        assert tuner.predict("allreduce", "ring", S, inter) == pytest.approx(
            tuner.predict("allreduce", "ring", S, flat), rel=1e-9)
        # the hierarchical algorithm's inter-host phase runs its ring in rack order too
        assert tuner.predict("allreduce", "hierarchical", S, inter) == pytest.approx(
            tuner.predict("allreduce", "hierarchical", S, flat), rel=0.05)
        best = tuner.rank("allreduce", S, inter, ["ring", "flat_ring", "halving_doubling", "hierarchical"])[0]
        assert best[1] in ("ring", "hierarchical")
    # racks in host order already: nothing to reorder, and halving-doubling's first (largest) exchange crosses
    blocks = racked([0, 1, 2, 3], ["A", "A", "B", "B"])
    assert blocks.ring_order() == [0, 1, 2, 3]
    assert tuner.predict("allreduce", "halving_doubling", S, blocks) > tuner.predict("allreduce", "ring", S, blocks)


def test_predict_reads_racks_from_the_topology_file_and_the_record(tmp_path, capsys):
    w = workload(4, (0, 1, 2, 3))
    wpath, topo = tmp_path / "w.json", tmp_path / "topo.json"
    wpath.write_text(json.dumps(w.to_dict()))
    topo.write_text(json.dumps(INTERLEAVED))
    steps = {}
    for algo in ("ring", "flat_ring"):
        for spec in ("--topo-file", None):
            args = ["--workload", str(wpath), "--hosts", "4", "--link-gbit", "1", "--algo", algo, "--json"]
            assert cli.main(args + ([spec, str(topo)] if spec else [])) == 0
            steps[algo, spec] = json.loads(capsys.readouterr().out)["comm_total_ms"]
    assert steps["flat_ring", "--topo-file"] == pytest.approx(2 * steps["flat_ring", None], rel=0.1)
    assert steps["ring", "--topo-file"] == pytest.approx(steps["ring", None], rel=1e-6)
    w.racks, w.uplink_gbit = ["A", "B", "A", "B"], {"A": 1.0, "B": 1.0}
    again = from_dict(json.loads(json.dumps(w.to_dict())))
    assert again.racks == w.racks and again.uplink_gbit == w.uplink_gbit


def _collectives(comm):
    """Allreduce (ring, hierarchical, the tuner's pick), allgather and broadcast on the rack order."""
    out = {}
    for algo in ("ring", "hierarchical", None):
        x = np.arange(1001, dtype=np.float64) * (comm.rank + 1)
        comm.allreduce(x, algo=algo)
        out[f"allreduce/{algo}"] = bool(np.array_equal(x, np.arange(1001) * comm.size * (comm.size + 1) / 2))
    g = comm.allgather(np.full(3, comm.rank, np.int32), algo="ring")
    out["allgather"] = bool(np.array_equal(g, np.repeat(np.arange(comm.size), 3).reshape(comm.size, 3)))
    b = np.full(5, comm.rank, np.int64)
    comm.broadcast(b, root=1, algo="ring")
    out["broadcast"] = bool((b == 1).all())
    out["order"] = comm.topology.ring_order()
    return out


@pytest.mark.timeout(120)
def test_collectives_are_right_on_the_rack_order(tmp_path):
    path = tmp_path / "topo.json"
    path.write_text(json.dumps(INTERLEAVED))
    got = run_ranks(_collectives, 4, env={"PYCOLL_TOPO_FILE": str(path), "PYCOLL_TRANSPORT": "tcp"}, timeout=100)
    for r in got:
        assert r.pop("order") == [0, 2, 1, 3] and all(r.values()), r


# -- slow: an emulated cluster with a congested uplink ---------------------------------------------------
RATE_MBIT = 200
SIZES = [4 * MIB, 16 * MIB]


def congested(tmp_path, iters: int = 4):
    """4 hosts (one rank each), racks {h0, h2} and {h1, h3}: every host's link and each rack's uplink
    at RATE_MBIT. The allreduce with no racks declared (the ring in host order 0, 1, 2, 3 crosses
    each uplink twice per direction), then with them (rack order 0, 2, 1, 3; flat_ring is the
    rack-oblivious order again, priced with the racks), measured and predicted in the same run."""
    from predict_cluster import add_racks
    tuner_cache = {"PYCOLL_TUNER_CACHE": str(tmp_path / "tuner"), "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    with Cluster(hosts=4, rate_mbit=RATE_MBIT) as cluster:
        add_racks(cluster, [1, 3], RATE_MBIT)
        host = min(cluster.link_rate(0, 2), cluster.link_rate(2, 0))
        uplink = min(cluster.link_rate(0, 1), cluster.link_rate(1, 0))
        spec = tmp_path / "racks.json"
        gbit = uplink * 8e-9
        spec.write_text(json.dumps({"racks": {"A": {"ranks": [0, 2], "uplink_gbit": gbit},
                                              "B": {"ranks": [1, 3], "uplink_gbit": gbit}}}))
        oblivious = cluster.run("test_emulated_cluster:bench", [0, 1, 2, 3], [SIZES, ["ring"], iters],
                                env=tuner_cache, timeout=400)[0]
        aware = cluster.run("test_emulated_cluster:bench", [0, 1, 2, 3],
                            [SIZES, ["ring", "flat_ring", "halving_doubling"], iters],
                            env=dict(tuner_cache, PYCOLL_TOPO_FILE=str(spec)), timeout=400)[0]
    assert not cluster.exists()
    return {"host_Bps": host, "uplink_Bps": uplink, "oblivious": oblivious, "aware": aware}


def congestion_table(res) -> str:
    """Markdown: per size and ring, predicted (with the racks) and measured, and the error."""
    lines = [f"4 hosts x 1 rank, racks {{h0, h2}} and {{h1, h3}}; host links {res['host_Bps'] * 8e-6:.0f} Mbit/s, "
             f"each rack's uplink {res['uplink_Bps'] * 8e-6:.0f} Mbit/s (tbf, measured)", "",
             "| size | ring order | racks declared | algorithm run | predicted (ms) | measured (ms) | error |",
             "|---|---|---|---|---|---|---|"]
    for row in sorted(res["aware"]["rows"], key=lambda r: (r["bytes"], r["algo"] != "flat_ring")):
        if row["algo"] == "halving_doubling" and not row["chosen"]:
            continue
        order = "0,1,2,3 (rack-oblivious)" if row["algo"] == "flat_ring" else \
            "0,2,1,3 (rack-aware)" if row["algo"] == "ring" else row["algo"]
        lines.append(f"| {row['bytes'] // MIB} MiB | {order} | yes | {row['algo']}{' (chosen)' if row['chosen'] else ''}"
                     f" | {row['predicted'] * 1e3:.0f} | {row['measured'] * 1e3:.0f} | "
                     f"{row['predicted'] / row['measured'] - 1:+.0%} |")
    for row in res["oblivious"]["rows"]:
        if row["algo"] == "ring":
            lines.append(f"| {row['bytes'] // MIB} MiB | 0,1,2,3 (rack-oblivious) | no | ring | "
                         f"{row['predicted'] * 1e3:.0f} (no racks known) | {row['measured'] * 1e3:.0f} | "
                         f"{row['predicted'] / row['measured'] - 1:+.0%} |")
    return "\n".join(lines)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.skipif(unavailable() is not None, reason=f"emulated cluster: {unavailable()}")
def test_congested_uplink_rack_aware_ring_is_faster_and_predicted(tmp_path):
    res = congested(tmp_path)
    print("\n" + congestion_table(res))
    rows = {(r["bytes"], r["algo"]): r for r in res["aware"]["rows"]}
    before = {r["bytes"]: r for r in res["oblivious"]["rows"] if r["algo"] == "ring"}
    for size in SIZES:
        aware, oblivious = rows[size, "ring"], rows[size, "flat_ring"]
        assert aware["ok"] and oblivious["ok"] and before[size]["ok"]
        for row in (aware, oblivious):  # predicted within 25% of measured, both orders
            assert abs(row["predicted"] / row["measured"] - 1) <= 0.25, congestion_table(res)
        # rack-aware measurably faster, both than flat_ring and than the ring before racks were declared
        assert aware["measured"] * 1.4 < min(oblivious["measured"], before[size]["measured"]), congestion_table(res)
        chosen = [r["algo"] for r in res["aware"]["rows"] if r["bytes"] == size and r["chosen"]]
        assert chosen[0] in ("ring", "hierarchical"), congestion_table(res)  # the tuner picks a rack-aware one
