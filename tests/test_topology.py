"""Topology detection, PYCOLL_TOPO_FILE, the link matrix and `pycoll info`; and the topology-aware
algorithms (host-ordered rings, hierarchical) against numpy on fake hosts, 2..8 ranks, 1-4 per host."""
import json
import os
import subprocess
import sys

import pytest

from collective_cases import CHECKS, COMBOS, counts_for
from multiproc import run_ranks
from pycoll.errors import EnvError
from pycoll.topology import NET, SHM, Nic, RankInfo, Topology, detect, host_id, load_topo_file, nics

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_detect_reports_this_host():
    me = detect(0, {})
    assert me.host == host_id() and me.hostname and isinstance(me.numa, int)
    assert all(n.name != "lo" and n.address for n in me.nics)
    assert [n.name for n in me.nics] == [n.name for n in nics()]
    assert RankInfo.from_json(me.to_json()) == me


def test_hostid_variable_overrides_detection(monkeypatch):
    monkeypatch.setenv("PYCOLL_HOSTID", "node-7")
    assert detect(3, {}).host == "node-7"


def test_topo_file_declares_hosts_and_devices(tmp_path):
    spec = {"hosts": {"a": [0, 2], "b": [1, 3]},
            "ranks": {"1": {"numa": 1, "nics": [{"name": "ib0", "speed": 100000}], "rdma": ["mlx5_0"]}}}
    path = tmp_path / "topo.json"
    path.write_text(json.dumps(spec))
    loaded = load_topo_file(str(path))
    infos = [detect(r, loaded) for r in range(5)]
    assert [i.host for i in infos[:4]] == ["a", "b", "a", "b"] and infos[4].host == host_id()
    assert infos[1].numa == 1 and infos[1].nics == (Nic("ib0", 100000),) and infos[1].rdma == ("mlx5_0",)


@pytest.mark.parametrize("text,match", [("{", "cannot be read"), ('{"hostz": {}}', "keys among"),
                                        ('{"hosts": {"a": 3}}', "list of ranks"),
                                        ('{"hosts": {"a": [0], "b": [0]}}', "twice")])
def test_bad_topo_files_say_what_is_wrong(tmp_path, text, match):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(EnvError, match=match):
        load_topo_file(str(path))


def test_links_hosts_and_ring_order():
    topo = Topology([RankInfo("h0", numa=0), RankInfo("h1", numa=0), RankInfo("h0", numa=1),
                     RankInfo("h1", numa=0)])
    assert topo.members == [[0, 2], [1, 3]] and topo.host_of == [0, 1, 0, 1] and topo.uniform
    assert topo.ring_order() == [0, 2, 1, 3]
    assert [topo.link(0, b) for b in range(4)] == ["X", "NET", "SYS", "NET"] and topo.link(1, 3) == "NODE"
    assert topo.link_class(0, 2) == SHM and topo.link_class(0, 1) == NET
    sub = topo.subset([3, 1, 2])
    assert sub.members == [[0, 1], [2]] and not sub.uniform and sub.per_host == 2
    matrix = topo.matrix()
    assert "Legend" in matrix and matrix.splitlines()[1].split()[:5] == ["R0", "X", "NET", "SYS", "NET"]


def test_net_speed_is_the_slowest_nic():
    topo = Topology([RankInfo("a", nics=(Nic("eth0", 25000), Nic("eth1", 100000))),
                     RankInfo("b", nics=(Nic("eth0", 10000),)), RankInfo("c")])
    assert topo.net_speed() == 10000 and Topology.from_hosts([0, 1]).net_speed() is None


@pytest.mark.timeout(60)
def test_pycoll_info_alone_prints_matrix_and_tuner_table():
    out = subprocess.run([sys.executable, "-m", "pycoll", "info", "--hosts", "2", "--ppn", "2", "--sizes", "8,16M"],
                         capture_output=True, text=True, cwd=REPO, timeout=50)
    assert out.returncode == 0, out.stderr
    assert "this rank: host id" in out.stdout and "Legend" in out.stdout and "NET" in out.stdout
    assert "hierarchical" in out.stdout and "*" in out.stdout and "4 ranks on 2 hosts" in out.stdout


@pytest.mark.timeout(90)
def test_pycoll_info_under_a_launcher_prints_the_job(tmp_path):
    topo = tmp_path / "topo.json"
    topo.write_text(json.dumps({"hosts": {"left": [0, 2], "right": [1, 3]}}))
    env = dict(os.environ, PYCOLL_TOPO_FILE=str(topo), PYCOLL_TUNER_CACHE=str(tmp_path / "cache"))
    out = subprocess.run([sys.executable, "-m", "pycoll", "run", "-n", "4", sys.executable, "-m", "pycoll", "info",
                          "--collective", "allreduce", "--sizes", "8,4M"], capture_output=True, text=True,
                         cwd=REPO, timeout=80, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "h0: left (2 ranks: [0, 2])" in out.stdout and "tuner (probe)" in out.stdout
    assert "4 ranks on 2 hosts" in out.stdout and out.stdout.count("*") == 2


def _topology_of(comm):
    return comm.topology.members, comm.transport.name, comm.local_rank, comm.local_size


@pytest.mark.timeout(60)
def test_topo_file_hosts_reach_the_communicator_and_transport(tmp_path):
    path = tmp_path / "topo.json"
    path.write_text(json.dumps({"hosts": {"x": [0, 2], "y": [1]}}))
    got = run_ranks(_topology_of, 3, env={"PYCOLL_TOPO_FILE": str(path), "PYCOLL_TUNER": "model"})
    assert got == [([[0, 2], [1]], "auto(shm+tcp)", 0, 2), ([[0, 2], [1]], "auto(tcp)", 0, 1),
                   ([[0, 2], [1]], "auto(shm+tcp)", 1, 2)]


# -- topology-aware algorithms against numpy ------------------------------------------------------------
ALGOS = {"allreduce": ["hierarchical", "ring"], "broadcast": ["hierarchical", "ring"],
         "allgather": ["hierarchical", "ring"], "reduce_scatter": ["ring"]}
EXTRA = [("int16", "bor"), ("uint16", "min"), ("complex64", "sum"), ("bool", "sum"), ("float64", "prod")]


def _topology_matrix(rank, layout):
    os.environ["PYCOLL_HOSTID"] = f"fake-host-{layout[rank]}"
    import pycoll
    failures, digests, checked, salt = [], [], 0, 0
    with pycoll.init() as comm:
        members = comm.topology.members
        for coll, algos in ALGOS.items():
            for algo in algos:
                for count in counts_for(comm.size, False):
                    combos = COMBOS + EXTRA if coll in ("allreduce", "reduce_scatter") else COMBOS[:3]
                    for dtype, op in combos:
                        salt += 1
                        root = salt % comm.size
                        try:
                            ok = CHECKS[coll](comm, algo, count, dtype, op, root, salt, digests)
                        except Exception as e:
                            ok = f"raised {type(e).__name__}: {e}"
                        checked += 1
                        if ok is not True:
                            failures.append(f"{coll}/{algo} count={count} {dtype} {op} root={root}: {ok}")
    return members, checked, failures, digests


LAYOUTS = [[0, 1], [0, 0], [0, 1, 0], [0, 1, 0, 1], [0, 0, 0, 1], [0, 1, 0, 1, 0], [0, 1, 2, 0, 1, 2],
           [0, 1, 0, 1, 0, 1, 0], [0, 1, 0, 1, 0, 1, 0, 1], [0, 1, 2, 3, 0, 1, 2, 3], [0, 0, 1, 2, 0, 1, 3, 0]]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("layout", LAYOUTS, ids=["".join(map(str, lay)) for lay in LAYOUTS])
def test_topology_aware_algorithms_match_numpy(layout):
    results = run_ranks(_topology_matrix, len(layout), layout, init=False, timeout=380,
                        env={"PYCOLL_TUNER": "model"})
    hosts = sorted(set(layout), key=layout.index)
    want = [[r for r in range(len(layout)) if layout[r] == h] for h in hosts]
    for r, (members, checked, failures, _) in enumerate(results):
        assert members == want
        assert checked > 100 and not failures, f"rank {r}:\n" + "\n".join(failures[:20])
    assert len({tuple(res[3]) for res in results}) == 1, "ranks disagree bit-wise on float32 results"
