"""The tuner: cost-model arithmetic, choices on one host and across hosts, Selector semantics
(PYCOLL_ALGO, algo=, static mode), the calibration probe and its cache, PYCOLL_DEBUG=INFO."""
import json
import logging
import math
from dataclasses import replace

import numpy as np
import pytest

from multiproc import run_ranks
from pycoll import calibration, tuner
from pycoll.selection import NAMED_ONLY, Selector, default_order, parse_algo
from pycoll.errors import EnvError
from pycoll.topology import Topology, last_level_cache
from pycoll.tuner import DEFAULT, MODELED, SPILL_AT, Link, Params, Tuner, pick_streams

MIB = 1 << 20
S = 64 * MIB
BETA = 1 / 25e6  # 200 Mbit/s
BANDWIDTH_ONLY = Tuner(Params(shm=Link(0.0, 0.0), net=Link(0.0, BETA), gamma=0.0))


def interleaved(hosts, per_host):
    return Topology.from_hosts([r % hosts for r in range(hosts * per_host)])


@pytest.mark.parametrize("hosts,per_host", [(2, 2), (4, 2), (2, 4), (3, 2)])
def test_nic_bytes_per_algorithm(hosts, per_host):
    """With only the network costing anything the model is NIC bytes per host * beta."""
    topo, n = interleaved(hosts, per_host), hosts * per_host
    predict = lambda algo: BANDWIDTH_ONLY.predict("allreduce", algo, S, topo) / BETA  # noqa: E731
    ring = 2 * (n - 1) / n * S
    assert math.isclose(predict("ring"), ring)                     # one stream leaves each host
    assert math.isclose(predict("flat_ring"), per_host * ring)     # every rank's stream does
    assert math.isclose(predict("hierarchical"), 2 * (hosts - 1) / hosts * S)  # the link-rate bound


def test_broadcast_and_allgather_hierarchical_bounds():
    topo = interleaved(2, 2)
    assert math.isclose(BANDWIDTH_ONLY.predict("broadcast", "hierarchical", S, topo) / BETA, S)  # all of it in
    assert math.isclose(BANDWIDTH_ONLY.predict("allgather", "hierarchical", S, topo) / BETA, S / 2)
    assert math.isclose(BANDWIDTH_ONLY.predict("allgather", "ring", S, topo) / BETA, 3 / 4 * S)


def test_latency_counts_messages():
    t = Tuner(Params(shm=Link(1e-5, 0.0), net=Link(1e-4, 0.0), gamma=0.0))
    one_host = Topology.from_hosts([0] * 4)
    assert math.isclose(t.predict("allreduce", "recursive_doubling", 8, one_host), 2 * 1e-5)
    assert math.isclose(t.predict("allreduce", "ring", 8, one_host), 6 * 2 * 1e-5)  # 2 segments a step
    assert math.isclose(t.predict("allreduce", "recursive_doubling", 8, interleaved(2, 2)), 1e-4 + 1e-5)
    assert t.predict("allreduce", "ring", 8, Topology.from_hosts([0])) == 0.0


def test_ranks_sharing_cores_pay_bytes_and_reductions_in_turn():
    """4 ranks on 2 cores: a round where all four move data costs its bytes and reductions twice,
    its latency once; a round where only two move (one per core) costs what it did."""
    params = Params(shm=Link(1e-5, 1 / 1e9), net=Link(1e-4, 1 / 1e9), gamma=1 / 2e9)
    t = Tuner(params)
    roomy, crowded = Topology.from_hosts([0] * 4, cores=8), Topology.from_hosts([0] * 4, cores=2)
    unknown = Topology.from_hosts([0] * 4)
    for algo in ("recursive_doubling", "halving_doubling", "ring"):
        alone = t.predict("allreduce", algo, MIB, roomy)
        latency = t.predict("allreduce", algo, 0, roomy)
        assert math.isclose(t.predict("allreduce", algo, MIB, unknown), alone)
        assert math.isclose(t.predict("allreduce", algo, MIB, crowded) - latency, 2 * (alone - latency))
    pair = tuner.Round(1, [(0, 1, MIB), (1, 0, MIB)], MIB)
    assert math.isclose(tuner.round_time(pair, [0] * 4, params, 1, [2]),
                        tuner.round_time(pair, [0] * 4, params))
    # measured on 2 cores over tcp, 4 ranks: recursive doubling 5.8 ms, halving-doubling 3.7 ms at 1 MiB
    tcp = Tuner(Params(shm=Link(109e-6, 8 / 47e9), net=Link(120e-6, 8 / 10e9), gamma=1 / 31e9))
    assert tcp.rank("allreduce", MIB, unknown, ["recursive_doubling", "halving_doubling"])[0][1] == \
        "recursive_doubling"
    assert tcp.rank("allreduce", MIB, crowded, ["recursive_doubling", "halving_doubling"])[0][1] == \
        "halving_doubling"


def test_recursive_doubling_pays_a_latency_per_segment_of_a_large_message():
    """Measured over tcp at 2 ranks, 64 MiB: recursive doubling 62-68 ms, halving-doubling 42-46 ms.
    Its one message per step is charged like halving-doubling's segments, so large sizes go to a
    bandwidth algorithm and small ones (one segment) keep recursive doubling."""
    tcp = Tuner(Params(shm=Link(109e-6, 1.69e-10), net=Link(120e-6, 8 / 10e9), gamma=1 / 40e9))
    two = Topology.from_hosts([0] * 2, cores=2)
    t1, t4 = (tcp.predict("allreduce", "recursive_doubling", s, two) for s in (MIB, 4 * MIB))
    assert math.isclose(t4 - t1, 3 * MIB * 1.69e-10 + 3 * MIB / 40e9)  # up to a segment: one latency
    big = tcp.predict("allreduce", "recursive_doubling", 64 * MIB, two)
    assert math.isclose(big, 16 * t4)  # 16 segments: 16 latencies, as 16 calls of one segment pay
    pick = lambda s: tcp.rank("allreduce", s, two, ["recursive_doubling", "halving_doubling"])[0][1]  # noqa: E731
    assert pick(MIB) == "recursive_doubling" and pick(64 * MIB) == "halving_doubling"


def test_single_host_choices_are_sensible():
    topo = Topology.from_hosts([0] * 4)
    sel = Selector("", Tuner(DEFAULT))
    assert sel.choose("allreduce", 8, 4, topo=topo) == "recursive_doubling"
    assert sel.choose("allreduce", 64 * 1024, 4, topo=topo) == "recursive_doubling"
    assert sel.choose("allreduce", 64 * MIB, 4, topo=topo) in ("ring", "halving_doubling")
    assert sel.choose("allgather", 8, 4, topo=topo) == "recursive_doubling"
    assert sel.choose("broadcast", 64 * MIB, 4, topo=topo) == "ring"
    for coll in MODELED:
        for nbytes in (0, 8, MIB, 64 * MIB):
            for n in (2, 3, 4, 5, 8):
                assert sel.choose(coll, nbytes, n, topo=Topology.from_hosts([0] * n)) not in NAMED_ONLY


def test_twoshot_only_with_a_stage_on_one_host_and_counted_as_its_copies():
    """Two-shot costs one board post per stage block and one more, (2n-1)/n of nbytes copied per rank
    (the others' shares in, its own reduced share in, the others' out: what a message of (2n-1)/2n of
    nbytes costs) and (n-1)/n of nbytes reduced; without a stage or across hosts it is never chosen."""
    params = Params(shm=Link(1e-5, 1 / 1e9), net=Link(1e-4, 1 / 1e9), gamma=1 / 2e9)
    stage = 512 << 10
    one_host, two_hosts = Topology.from_hosts([0] * 4, cores=8), interleaved(2, 2)
    t = Tuner(params, 16 << 10, stage)
    want = (32 + 1) * tuner.BOARD_POST * 1e-5 + 7 / 8 * 16 * MIB / 1e9 + 0.75 * 16 * MIB / 2e9
    assert math.isclose(t.predict("allreduce", "twoshot", 16 * MIB, one_host), want)
    assert t.predict("allreduce", "twoshot", 16 * MIB, two_hosts) == math.inf
    assert Tuner(params, 16 << 10, 0).predict("allreduce", "twoshot", 16 * MIB, one_host) == math.inf
    # fewer copies and rounds than any message-based algorithm at 4 ranks; at 2 as well (measured here at
    # 2 ranks, 1-16 MiB: 1.15-1.4x faster than halving-doubling or the ring), on the same model
    pair = Topology.from_hosts([0] * 2, cores=8)
    want2 = (32 + 1) * tuner.BOARD_POST * 1e-5 + 3 / 4 * 16 * MIB / 1e9 + 0.5 * 16 * MIB / 2e9
    assert math.isclose(t.predict("allreduce", "twoshot", 16 * MIB, pair), want2)
    sel = Selector("allreduce:^cma", t)  # (cma: the next test)
    assert sel.choose("allreduce", 16 * MIB, 4, topo=one_host) == "twoshot"
    assert sel.choose("allreduce", 1 * MIB, 2, topo=pair) == "twoshot"
    assert sel.choose("allreduce", 64 * MIB, 2, topo=pair) == "twoshot"
    assert sel.choose("allreduce", 16 * MIB, 4, topo=two_hosts) != "twoshot"


def test_cma_on_one_host_with_a_board_counted_as_single_copies_and_pages():
    """Cross-memory attach: two posts, (n-1)/n of nbytes read from peers and as much written, priced as
    a message of (n-1)/2n of nbytes, CMA_PAGE per page copied and (n-1)/n of nbytes reduced; never
    across hosts or without a board. It beats two-shot on large calls and loses on small ones, where
    the pages' kernel work outweighs the copies it saves; without the cache's spill it never does."""
    params = Params(shm=Link(1e-5, 1 / 1e9), net=Link(1e-4, 1 / 1e9), gamma=1 / 2e9)
    one_host, two_hosts = Topology.from_hosts([0] * 4, cores=8), interleaved(2, 2)
    t = Tuner(params, 16 << 10, 512 << 10)
    pages = 2 * 3 * (4 * MIB // 4096)
    want = (2 * tuner.BOARD_POST * 1e-5 + 3 / 8 * 16 * MIB / 1e9 + 0.75 * 16 * MIB / 2e9
            + pages * tuner.CMA_PAGE * 4096 / 1e9)
    assert math.isclose(t.predict("allreduce", "cma", 16 * MIB, one_host), want)
    assert t.predict("allreduce", "cma", 16 * MIB, two_hosts) == math.inf
    assert Tuner(params, 0, 0).predict("allreduce", "cma", 16 * MIB, one_host) == math.inf
    # ranks that cannot reach each other's memory (PYCOLL_CMA=0, the kernel refuses): never cma
    assert Tuner(params, 16 << 10, 512 << 10, peer_memory=False).predict("allreduce", "cma", 16 * MIB,
                                                                         one_host) == math.inf
    # with a calibration of this 2-core machine (its cache spill included): two-shot at 1 MiB, cma at 64
    measured = Tuner(Params(shm=Link(1.3e-5, 1 / 7.5e9), net=Link(1e-4, 1 / 1e9), gamma=1 / 40e9, cache=32 * MIB,
                            spill=3.2), 16 << 10, 2 * MIB)
    cores2 = Topology.from_hosts([0] * 4, cores=2)
    assert Selector("", measured).choose("allreduce", MIB, 4, topo=cores2) == "twoshot"
    assert Selector("", measured).choose("allreduce", 64 * MIB, 4, topo=cores2) == "cma"



def test_cma_data_movement_counted_as_single_copies_and_pages():
    """reduce_scatter reads (n-1)/n of nbytes through the scratch block (a quarter of a message per byte)
    and reduces it; allgather copies n-1 blocks of nbytes/n straight into its output and broadcast nbytes
    out of the root (half a message per byte); each page costs CMA_PAGE copies of it besides. Never
    across hosts."""
    params = Params(shm=Link(1e-5, 1 / 1e9), net=Link(1e-4, 1 / 1e9), gamma=1 / 2e9)
    four = Topology.from_hosts([0] * 4, cores=8)
    t = Tuner(params, 16 << 10, 512 << 10)
    page = tuner.CMA_PAGE * 4096 / 1e9
    posts = 2 * tuner.BOARD_POST * 1e-5
    S = 16 * MIB
    assert math.isclose(t.predict("reduce_scatter", "cma", S, four),
                        posts + 3 / 16 * S / 1e9 + 0.75 * S / 2e9 + 3 * (S // 4 // 4096) * page)
    assert math.isclose(t.predict("allgather", "cma", S, four), posts + 3 / 8 * S / 1e9 + 3 * (S // 4 // 4096) * page)
    # (three ranks read the root's buffer: the model charges the root's memory with all of them)
    assert math.isclose(t.predict("broadcast", "cma", S, four), posts + 3 * S / 2 / 1e9 + (S // 4096) * page)
    for coll in ("reduce_scatter", "allgather", "broadcast"):
        assert t.predict(coll, "cma", S, interleaved(2, 2)) == math.inf


def test_multi_host_large_messages_go_bandwidth_optimal():
    sel = Selector("", Tuner(replace_net(DEFAULT, BETA)))
    for hosts, per_host in ((2, 2), (4, 2), (3, 2), (2, 3)):
        topo = interleaved(hosts, per_host)
        name = sel.choose("allreduce", 16 * MIB, topo.size, topo=topo)
        t = sel.tuner.predict("allreduce", name, 16 * MIB, topo)
        assert t <= 1.05 * 2 * (hosts - 1) / hosts * 16 * MIB * BETA, (hosts, per_host, name)


def replace_net(params, beta):
    return Params(params.shm, Link(params.net.alpha, beta), params.gamma)


def test_selector_keeps_algo_and_pycoll_algo_semantics():
    t = Tuner(DEFAULT)
    topo = interleaved(2, 2)
    assert Selector("allreduce:ring", t).choose("allreduce", 8, 4, topo=topo) == "ring"
    assert Selector("", t).choose("allreduce", 8, 4, "flat_ring", topo) == "flat_ring"
    with pytest.raises(ValueError, match="does not implement allreduce"):
        Selector("", t).choose("allreduce", 8, 4, "pairwise", topo)
    # a named algorithm the model does not know (mpi_native): the size rule decides among the named
    assert Selector("allreduce:ring,mpi_native", t).choose("allreduce", 8, 4, topo=topo) == "ring"
    assert "flat_ring" not in parse_algo("^ring")["allreduce"] and "hierarchical" in parse_algo("^ring")["allreduce"]
    assert parse_algo("flat_ring")["allreduce"] == frozenset({"flat_ring"})
    static = Selector("")
    assert static.choose("allreduce", 16 * MIB, 4, topo=topo) == default_order("allreduce", 16 * MIB, 4, 0)[0]
    assert static.phase("allreduce", MIB, Topology.from_hosts([0, 1]), 2).__name__ in ("allreduce",
                                                                                       "allreduce_double_tree")


def test_mode_and_links_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("PYCOLL_TUNER", "bogus")
    with pytest.raises(EnvError, match="PYCOLL_TUNER"):
        calibration.mode()
    monkeypatch.setenv("PYCOLL_TUNER", "Static")
    assert calibration.mode() == "static"
    path = tmp_path / "topo.json"
    path.write_text(json.dumps({"links": {"net": {"latency_us": 50, "gbit": 0.2}}}))
    monkeypatch.setenv("PYCOLL_TOPO_FILE", str(path))
    params = calibration.base_params(Topology.from_hosts([0, 1]))
    assert params.source == "file" and math.isclose(params.net.beta, BETA) and params.shm == DEFAULT.shm
    path.write_text(json.dumps({"links": {"ib": {"gbit": 1}}}))
    with pytest.raises(EnvError, match="links"):
        calibration.base_params(Topology.from_hosts([0, 1]))


def test_cache_round_trip_and_expiry(monkeypatch, tmp_path):
    monkeypatch.setenv("PYCOLL_TUNER_CACHE", str(tmp_path))
    assert calibration.cache_get("k") is None
    calibration.cache_put("k", Link(1e-5, 2e-9))
    assert calibration.cache_get("k") == Link(1e-5, 2e-9)
    monkeypatch.setattr(calibration, "CACHE_TTL", -1.0)
    assert calibration.cache_get("k") is None
    monkeypatch.setenv("PYCOLL_TUNER_CACHE", "off")
    calibration.cache_put("k2", Link(1.0, 1.0))
    assert calibration.cache_dir() is None and calibration.cache_get("k2") is None


def test_an_shm_probe_slower_than_any_memory_is_dropped_for_the_default(caplog):
    """Over shm a best round trip of milliseconds is the scheduler (a busy machine), not the link:
    the probe is dropped with a warning; a slow network is kept as measured."""
    slow = Link(3e-3, 1e-10)
    with caplog.at_level(logging.WARNING, logger="pycoll.tuner"):
        assert calibration.plausible("shm", slow, DEFAULT.shm) is None
    assert "3000 us per message" in caplog.text
    assert calibration.plausible("shm", Link(2e-5, 1e-10), DEFAULT.shm) == Link(2e-5, 1e-10)
    assert calibration.plausible("net", slow, DEFAULT.net) == slow


def _calibrate_with_a_stalled_probe(comm):
    from pycoll import calibration as cal
    real = cal.ping_pong

    def stalled(ch, me, peer, tag, big_bytes=cal.PROBE_BIG):
        link = real(ch, me, peer, tag, big_bytes)
        return None if link is None else Link(5e-3, link.beta)  # as if every round trip waited 10 ms
    cal.ping_pong = stalled
    comm.calibrate()
    p = comm.selector.tuner.params
    return p.shm, p.source, comm.selector.choose("allreduce", 16 << 20, comm.size, None, comm.topology)


@pytest.mark.timeout(60)
def test_a_stalled_shm_probe_leaves_the_default_and_a_board_algorithm_for_large_calls():
    """Kept, such a probe sent 16-64 MiB to binomial for a whole job (docs/benchmarks.md, session 12)."""
    got = run_ranks(_calibrate_with_a_stalled_probe, 2, env={"PYCOLL_TRANSPORT": "shm", "PYCOLL_TUNER_CACHE": "off"})
    for shm, source, pick in got:
        assert shm == DEFAULT.shm and source == "probe" and pick in ("twoshot", "cma"), got


def test_cache_entries_of_other_code_are_never_reused(monkeypatch, tmp_path):
    """The key holds the package version and a hash of tuner.py and calibration.py."""
    import pycoll
    monkeypatch.setenv("PYCOLL_TUNER_CACHE", str(tmp_path))
    assert calibration.code_version().startswith(pycoll.__version__ + "/")
    calibration.cache_put("k", Link(1e-5, 2e-9))
    assert calibration.cache_get("k") == Link(1e-5, 2e-9)
    monkeypatch.setattr(calibration, "code_version", lambda: "0.0.1/0123456789abcdef")
    assert calibration.cache_get("k") is None


def test_spill_prices_working_sets_beyond_the_cache():
    p = Params(shm=Link(1e-5, 1 / 10e9), net=DEFAULT.net, gamma=1 / 20e9, cache=32 * MIB, spill=2.5)
    assert p.spill_factor(16 * MIB) == 1.0 and p.spilled(16 * MIB) is p  # half the cache: still in it
    assert p.spill_factor(64 * MIB) == pytest.approx(2.5)  # where the probe measures it
    f = [p.spill_factor(w * MIB) for w in (20, 32, 64, 256, 4096)]
    assert f == sorted(f) and f[-1] < 1 + 1.5 / SPILL_AT
    q = p.spilled(64 * MIB)
    assert q.shm.beta == pytest.approx(2.5 * p.shm.beta) and q.gamma == pytest.approx(2.5 * p.gamma)
    assert q.shm.alpha == p.shm.alpha and q.net == p.net
    # 8 ranks of 4 MiB on one host touch 64 MiB: the call costs more than the cache-blind model says;
    # 2 ranks of 4 MiB (16 MiB) cost the same
    blind = Tuner(replace(p, spill=1.0), 16 << 10, 2 << 20)
    for n, more in ((8, True), (2, False)):
        topo = Topology.from_hosts([0] * n, 2)
        a, b = (t.predict("allreduce", "twoshot", 4 * MIB, topo) for t in (Tuner(p, 16 << 10, 2 << 20), blind))
        assert (a > 1.5 * b) if more else a == b
    # a row from before the cache and spill (7 values) reads as neither
    old = Params.from_row(p.row()[:7], "probe")
    assert (old.cache, old.spill) == (0.0, 1.0) and Params.from_row(p.row(), "probe").spill == 2.5


def test_table_marks_one_choice_per_size():
    text = Tuner(DEFAULT).table(interleaved(2, 2), [8, 16 * MIB], ["allreduce"])
    rows = [line for line in text.splitlines() if line.startswith("allreduce")]
    assert len(rows) == len(MODELED["allreduce"]) and sum(line.count("*") for line in rows) == 2


# -- on real ranks ---------------------------------------------------------------------------------
def _calibrated(rank, layout):
    import os
    import time
    os.environ["PYCOLL_HOSTID"] = f"fake-{layout[rank]}"
    import pycoll
    t = time.perf_counter()
    with pycoll.init() as comm:
        took = time.perf_counter() - t
        p = comm.selector.tuner.params
        x = np.full(1 << 20, rank, np.float32)
        comm.allreduce(x)
        from pycoll.transports.capabilities import Striping
        striping = comm.transport.offers(Striping)
        return p.source, p.row().tolist(), took, bool((x == sum(range(comm.size))).all()), \
            (p.nsocks, striping.streams((rank + 1) % comm.size), striping.width())


@pytest.mark.timeout(120)
def test_probe_agrees_everywhere_then_comes_from_the_cache(tmp_path):
    env = {"PYCOLL_TUNER_CACHE": str(tmp_path)}
    layout = [0, 1, 0, 1]
    first = run_ranks(_calibrated, 4, layout, init=False, env=env)
    assert {r[0] for r in first} == {"probe"} and len({tuple(r[1]) for r in first}) == 1
    row = first[0][1]
    assert all(math.isfinite(v) and v > 0 for v in row) and row[3] < 1e-8  # net beta: faster than 100 MB/s
    assert all(r[3] for r in first)
    second = run_ranks(_calibrated, 4, layout, init=False, env=env)
    assert {r[0] for r in second} == {"cache"} and second[0][1][:4] == row[:4]
    # the host's cache and the spill measured beyond it came along, and from the cache the second time
    assert row[7] == last_level_cache() and row[8] >= 1.0 and second[0][1][7:9] == row[7:9]
    # one entry per link class, one stream between hosts, and the spill of the shm pair's host
    assert len(list(tmp_path.iterdir())) == 4
    # PYCOLL_NSOCKS=auto opened 4 streams to the other (fake) host; every rank cuts over what the
    # tuner picked from the probe (over loopback: one, unless the busy machine's noise says more)
    assert len({r[4] for r in first}) == 1 and {r[4] for r in second} == {first[0][4]}
    nsocks, streams, width = first[0][4]
    assert streams == 4 and width == nsocks == pick_streams(Params.from_row(row, "probe"), 4)


def test_streams_picked_to_fill_the_link_with_capped_flows():
    def params(link_mbit, flow_mbit):
        return Params(shm=DEFAULT.shm, net=Link(1e-4, 8e-6 / link_mbit), gamma=DEFAULT.gamma,
                      flow=Link(1e-4, 8e-6 / flow_mbit))
    assert pick_streams(params(400, 100), 4) == 4    # the emulated cloud NIC: 4 flows fill it
    assert pick_streams(params(400, 100), 2) == 2    # no more than the pair has
    assert pick_streams(params(250, 100), 4) == 3
    assert pick_streams(params(130, 100), 4) == 1    # loopback noise, or a cap not worth cutting for
    assert pick_streams(Params(DEFAULT.shm, DEFAULT.net, DEFAULT.gamma), 4) == 1  # nothing measured
    # the model: a 16 MiB allreduce, 2 hosts x 2 ranks, is bound by one flow per pair until cut over 4
    topo = interleaved(2, 2)
    slow = Tuner(params(400, 100)).predict("allreduce", "hierarchical", 16 * MIB, topo)
    fast = Tuner(replace(params(400, 100), nsocks=4)).predict("allreduce", "hierarchical", 16 * MIB, topo)
    link = Tuner(Params(DEFAULT.shm, params(400, 100).net, DEFAULT.gamma)).predict(
        "allreduce", "hierarchical", 16 * MIB, topo)
    assert slow > 1.8 * fast and fast == pytest.approx(link)


def _tuner_kind(comm):
    t = comm.selector.tuner
    return None if t is None else t.params.source


@pytest.mark.timeout(60)
def test_static_mode_and_pycoll_algo_skip_the_probe():
    assert run_ranks(_tuner_kind, 2, env={"PYCOLL_TUNER": "static"}) == [None, None]
    assert run_ranks(_tuner_kind, 2, env={"PYCOLL_ALGO": "allreduce:ring"}) == ["default", "default"]


def _logged_choice(comm):
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("pycoll.tuner").addHandler(handler)
    comm.allreduce(np.ones(1024, np.float32))
    comm.allreduce(np.ones(1024, np.float32))  # the same size again: decided once, logged once
    return [r.getMessage() for r in records]


@pytest.mark.timeout(60)
def test_debug_info_logs_the_choice_with_its_predicted_time():
    got = run_ranks(_logged_choice, 2, env={"PYCOLL_DEBUG": "INFO", "PYCOLL_TUNER": "model"})
    for msgs in got:
        assert len(msgs) == 1 and msgs[0].startswith("allreduce of 4096 B on 2 ranks / 1 hosts: ")
        assert "predicted" in msgs[0] and " ms" in msgs[0]
