"""`auto`'s choice of transport per pair of ranks (shm, verbs, tcp) and the tuner's rdma link, on a
machine without RDMA (normal CI): the decision from each rank's advertised port (pure logic), the
networks GIDs lie on, the rdma link's prices, and real auto jobs across fake hosts that choose tcp
without ever loading pyverbs. The same choice with real RDMA ports runs in two soft-RoCE VMs
(tests/test_verbs_hosts.py, tests/rdma/run-vm-pair.sh).
"""
import json
import time
from dataclasses import replace

import numpy as np
import pytest

from multiproc import run_ranks
from pycoll.calibration import file_links, probe_pairs, rdma_hosts
from pycoll.cli.info import pair_table
from pycoll.topology import NET, SHM, Topology
from pycoll.transports.routes import SHM as WIRE_SHM, TCP, VERBS, Advert, PairRoutes, choose, matrix, none
from pycoll.transports.verbs_device import gid_network
from pycoll.tuner import RDMA, Link, Params, Round, Tuner, round_time

ROCE_A = Advert("mlx5_0", 1, "::ffff:10.9.0.1", 3, "RoCE v2", "roce-v2 10.9.0.0/24")
ROCE_B = Advert("mlx5_1", 1, "::ffff:10.9.0.2", 3, "RoCE v2", "roce-v2 10.9.0.0/24")
ROCE_OTHER = Advert("mlx5_0", 1, "::ffff:10.8.0.2", 3, "RoCE v2", "roce-v2 10.8.0.0/24")
ROCE_V1 = Advert("mlx5_0", 1, "::ffff:10.9.0.3", 1, "RoCE v1", "roce-v1 10.9.0.0/24")
IB = Advert("mlx5_2", 1, "fe80::2:c903:3:1234", 0, "InfiniBand", "ib fe80:0000:0000:0000")
LINK_LOCAL = Advert("rxe0", 1, "fe80::5054:ff:fe12:3456", 0, "RoCE v2", "", "a link-local GID names no network")
NONE = none("no RDMA device: /sys/class/infiniband is empty")
ADVERTS = [ROCE_A, ROCE_B, ROCE_OTHER, ROCE_V1, IB, LINK_LOCAL, NONE, none("PYCOLL_IB_DISABLE=1")]


# -- the decision -------------------------------------------------------------------------------------
@pytest.mark.parametrize("a", ADVERTS, ids=lambda a: a.device or a.why[:20])
def test_pairs_on_one_host_are_shm_whatever_they_advertise(a):
    assert choose(True, a, ROCE_A) == choose(True, NONE, a) == WIRE_SHM


@pytest.mark.parametrize("a, b, want", [
    (ROCE_A, ROCE_B, VERBS),        # RoCE v2 ports on one IP network
    (IB, IB, VERBS),                # InfiniBand ports with one subnet prefix
    (ROCE_A, ROCE_OTHER, TCP),      # other IP networks: no route between the ports
    (ROCE_A, ROCE_V1, TCP),         # RoCE v1 and v2 do not talk
    (ROCE_A, IB, TCP),              # Ethernet and InfiniBand
    (LINK_LOCAL, LINK_LOCAL, TCP),  # link-local GIDs: their network cannot be told
    (ROCE_A, NONE, TCP),            # a rank without a port (or with PYCOLL_IB_DISABLE=1)
    (NONE, NONE, TCP),
], ids=["same-roce-net", "same-ib-subnet", "other-ip-net", "v1-v2", "roce-ib", "link-local", "one-side", "neither"])
def test_ports_on_one_network_choose_verbs_and_anything_else_tcp(a, b, want):
    assert choose(False, a, b) == want


def test_the_choice_is_the_same_from_both_ends():
    """Both ranks of a pair decide alone, from the same two adverts: they must agree."""
    for a in ADVERTS:
        for b in ADVERTS:
            for same in (True, False):
                assert choose(same, a, b) == choose(same, b, a), (a, b, same)


def test_every_rank_gets_the_same_matrix_for_three_hosts_one_without_rdma():
    hosts = ["h0", "h0", "h1", "h1", "h2"]
    adverts = [ROCE_A, ROCE_A, ROCE_B, ROCE_B, NONE]
    m = matrix(hosts, adverts)
    assert m[0] == ["self", "shm", "verbs", "verbs", "tcp"]
    assert m[2] == ["verbs", "verbs", "self", "shm", "tcp"]
    assert m[4] == ["tcp"] * 4 + ["self"]
    assert all(m[i][j] == m[j][i] for i in range(5) for j in range(5))
    routes = PairRoutes(hosts, adverts)
    assert routes.wire(1, 3) == VERBS and routes.port(4) == "none (no RDMA device: /sys/class/infiniband is empty)"


def test_adverts_travel_as_json_and_garbage_reads_as_no_port():
    for a in ADVERTS:
        assert Advert.from_json(a.to_json()) == a
    bad = Advert.from_json(b'{"device": "mlx5_0"}')
    assert not bad.usable and "unreadable RDMA advert" in bad.why
    assert choose(False, bad, ROCE_A) == TCP
    assert ROCE_A.describe() == "mlx5_0:1 RoCE v2, GID index 3 ::ffff:10.9.0.1, network 10.9.0.0/24"
    assert "not used by auto" in LINK_LOCAL.describe()


# -- the network of a GID -------------------------------------------------------------------------------
def test_the_network_of_a_gid():
    assert gid_network("fe80:0000:0000:0000:0002:c903:0003:1234", "InfiniBand") == ("ib fe80:0000:0000:0000", "")
    # an IPv4-mapped RoCE GID lies on its interface's IP network: 127.0.0.1 is lo's, 127.0.0.0/8
    assert gid_network("0000:0000:0000:0000:0000:ffff:7f00:0001", "RoCE v2") == ("roce-v2 127.0.0.0/8", "")
    assert gid_network("::ffff:127.0.0.1", "RoCE v1") == ("roce-v1 127.0.0.0/8", "")
    network, why = gid_network("fe80::5054:ff:fe12:3456", "RoCE v2")
    assert network == "" and "PYCOLL_IB_GID_INDEX" in why
    network, why = gid_network("::ffff:203.0.113.77", "RoCE v2")  # an address no interface here has
    assert network == "" and "203.0.113.77 is on no interface here" in why


# -- the tuner's rdma link --------------------------------------------------------------------------
NET_BETA, RDMA_BETA = 8 / 10e9, 8 / 100e9
PRICED = Params(shm=Link(10e-6, 1 / 5e9), net=Link(100e-6, NET_BETA), gamma=0.0, rdma=Link(15e-6, RDMA_BETA),
                rdma_hosts=frozenset({("a", "b")}))


def test_a_round_over_verbs_pays_the_rdma_link_and_a_mixed_one_both_on_the_nic():
    topo = Topology.from_hosts(["a", "b", "c"])
    rdma = PRICED.rdma_pairs(topo)
    assert rdma == {(0, 1), (1, 0)}
    x = 1 << 20
    over_verbs = Round(1, [(0, 1, x), (1, 0, x)])
    assert round_time(over_verbs, topo.host_of, PRICED, rdma=rdma) == pytest.approx(15e-6 + x * RDMA_BETA)
    assert round_time(over_verbs, topo.host_of, PRICED) == pytest.approx(100e-6 + x * NET_BETA)  # no verbs pairs
    mixed = Round(1, [(0, 1, x), (0, 2, x)])  # host a sends over verbs to b and over tcp to c, on one NIC
    assert round_time(mixed, topo.host_of, PRICED, rdma=rdma) == pytest.approx(100e-6 + x * (RDMA_BETA + NET_BETA))


def test_the_tuner_prices_host_pairs_over_verbs_in_any_subset():
    tuner = Tuner(PRICED)
    plain = Tuner(Params(PRICED.shm, PRICED.net, 0.0))
    pair = Topology.from_hosts(["a", "b"])
    size = 64 << 20
    fast, slow = tuner.predict("allreduce", "ring", size, pair), plain.predict("allreduce", "ring", size, pair)
    assert slow / fast == pytest.approx(NET_BETA / RDMA_BETA, rel=0.05), (fast, slow)
    # hosts a and c talk over tcp: priced as before
    other = Topology.from_hosts(["a", "c"])
    assert tuner.predict("allreduce", "ring", size, other) == plain.predict("allreduce", "ring", size, other)
    with_gamma = Tuner(replace(PRICED, gamma=1 / 4e9))  # (the table prints the reduction rate)
    assert "rdma 15.0 us + 100 Gbit/s" in with_gamma.table(pair, [8], ["allreduce"]).splitlines()[0]
    assert "rdma" not in Tuner(replace(PRICED, gamma=1 / 4e9, rdma_hosts=frozenset())).table(
        pair, [8], ["allreduce"]).splitlines()[0]


def test_the_calibration_probes_one_verbs_pair_and_one_tcp_pair():
    topo = Topology.from_hosts(["a", "a", "b", "c"])
    verbs_ab = {(0, 2), (2, 0), (1, 2), (2, 1)}

    def wire(x, y):
        return "shm" if topo.host_of[x] == topo.host_of[y] else "verbs" if (x, y) in verbs_ab else "tcp"
    assert probe_pairs(topo, wire) == {SHM: (0, 1), RDMA: (0, 2), NET: (0, 3)}
    assert probe_pairs(topo) == {SHM: (0, 1), NET: (0, 2)}  # a transport that does not say: all net
    assert rdma_hosts(topo, wire) == frozenset({("a", "b")}) and rdma_hosts(topo, None) == frozenset()


def test_a_topology_file_may_declare_the_rdma_link():
    links = file_links({"links": {"rdma": {"latency_us": 4, "gbit": 200}}})
    assert links[RDMA] == Link(4e-6, 8e-9 / 200)


def test_pycoll_info_shows_each_pairs_transport_and_each_rank_s_port():
    routes = PairRoutes(["h0", "h0", "h1"], [ROCE_A, ROCE_A, ROCE_B])
    text = pair_table(3, routes.wire, routes.port)
    rows = text.splitlines()
    assert rows[2].split() == ["R0", "-", "shm", "verbs"] and rows[4].split() == ["R2", "verbs", "verbs", "-"]
    assert "R2: mlx5_1:1 RoCE v2, GID index 3 ::ffff:10.9.0.2, network 10.9.0.0/24" in text


# -- real jobs here, where no RDMA device exists --------------------------------------------------------
def _auto_across_fake_hosts(comm):
    import sys
    from pycoll.transports.capabilities import Routes
    from pycoll.transports.verbs_device import rdma_present
    routes = comm.transport.offers(Routes)
    best = float("inf")
    for _ in range(5):  # what auto's look for RDMA costs where there is none (per init: one call)
        t = time.perf_counter()
        for _ in range(200):
            rdma_present()
        best = min(best, (time.perf_counter() - t) / 200)
    x = np.full(1 << 18, comm.rank + 1, np.float32)
    comm.allreduce(x)
    params = comm.selector.tuner.params
    return {"name": comm.transport.name, "row": [routes.wire(comm.rank, c) for c in range(comm.size)],
            "port": routes.port(comm.rank), "pyverbs": "pyverbs" in sys.modules,
            "verbs_module": "pycoll.transports.verbs" in sys.modules, "probe_s": best,
            "sum_ok": bool((x == sum(range(1, comm.size + 1))).all()),
            "rdma": (params.rdma, sorted(params.rdma_hosts)), "resilient": comm.transport.resilient}


@pytest.mark.timeout(120)
def test_auto_between_fake_hosts_without_rdma_chooses_tcp_and_never_loads_pyverbs(tmp_path):
    topo = tmp_path / "topo.json"
    topo.write_text(json.dumps({"hosts": {"a": [0, 1], "b": [2, 3]}}))
    got = run_ranks(_auto_across_fake_hosts, 4, timeout=110,
                    env={"PYCOLL_TOPO_FILE": str(topo), "PYCOLL_TUNER": "model"})
    for rank, g in enumerate(got):
        assert g["name"] == "auto(shm+tcp)" and g["sum_ok"] and g["resilient"], (rank, g)
        assert g["row"] == [("self" if c == rank else "shm" if c // 2 == rank // 2 else "tcp") for c in range(4)], g
        assert g["port"] == "none (no RDMA device: /sys/class/infiniband is empty)", g
        assert not g["pyverbs"] and not g["verbs_module"], f"rank {rank} loaded verbs on a machine without RDMA"
        assert g["rdma"] == (None, []), g  # the tuner prices no pair as rdma
        assert g["probe_s"] < 1e-3, f"rank {rank}: looking for an RDMA device took {g['probe_s'] * 1e6:.0f} us"


@pytest.mark.timeout(120)
def test_ib_disable_is_what_each_rank_advertises(tmp_path):
    topo = tmp_path / "topo.json"
    topo.write_text(json.dumps({"hosts": {"a": [0], "b": [1]}}))
    got = run_ranks(_auto_across_fake_hosts, 2, timeout=110,
                    env={"PYCOLL_TOPO_FILE": str(topo), "PYCOLL_TUNER": "model", "PYCOLL_IB_DISABLE": "1"})
    for rank, g in enumerate(got):
        assert g["name"] == "auto(tcp)" and g["port"] == "none (PYCOLL_IB_DISABLE=1)" and g["sum_ok"], (rank, g)
