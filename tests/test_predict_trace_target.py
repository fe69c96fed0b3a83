"""trace_target's pricing on hand-made dumps (no processes): calls priced with the crowding of every rank
that shares the cores, and a link's token bucket (a topology file's links.net.burst_kib). The whole
check against measured runs is docs/make_predict_trace.py and tests/test_predict_trace_cluster.py.
"""
import json

import pytest

from pycoll.predict import trace_replay, trace_target
from pycoll.tuner import CALL_OVERHEAD, WAKE

KIB = 1024
COUNT = 48 * KIB  # float32s: a 192 KiB allreduce


def _dumps(ranks: int, gap: float, calls: int = 6, call_s: float = 0.002) -> dict:
    """`ranks` ranks on one host, each step `gap` s of compute then an allreduce of 192 KiB that takes
    `call_s` once all are in; a mark after each."""
    dumps = {}
    for r in range(ranks):
        t, entries, marks = 1.0, [], [1.0]
        for k in range(calls):
            t += gap
            entries.append({"seq": k + 1, "call": "allreduce", "p2p": False, "dtype": "float32", "count": COUNT,
                            "itemsize": 4, "state": "completed", "enter": t, "start": t, "end": t + call_s,
                            "site": None, "op": "sum", "root": None, "algorithm": "ring"})
            t += call_s
            marks.append(t)
        dumps[r] = {"pycoll_trace": 1, "rank": r, "host_id": "h0", "host": "m", "job": "j", "started": 0.0,
                    "time": 100.0, "steps": calls, "marks": [[i + 1, m] for i, m in enumerate(marks)],
                    "comms": [{"name": "world", "id": "0x1", "rank": r, "size": ranks, "group": list(range(ranks)),
                               "capacity": 100, "recorded": calls, "hosts": ["h0"] * ranks, "calls": entries}]}
    return dumps


def _target(trace, tmp_path, hosts: int, burst_kib: float, shared: int = 0) -> trace_target.ClusterSpec:
    topo = tmp_path / f"link-{burst_kib:g}.json"
    topo.write_text(json.dumps({"links": {"net": {"gbit": 0.2, "latency_us": 100, "burst_kib": burst_kib}}}))
    return trace_target.target_cluster(trace, hosts=hosts, topo_file=str(topo), shared_cores=shared)


def test_shared_cores_crowd_the_target_as_the_recording():
    trace = trace_replay.build(_dumps(4, 0.01))
    recorded = trace_target.recorded_cluster(trace)
    recorded = trace_target.ClusterSpec(recorded.host_of, [2], recorded.params, [""], {}, 0)  # 4 ranks, 2 cores
    spread = trace_target.ClusterSpec([0, 0, 1, 1], [2, 2], recorded.params, ["", ""], {}, 0)
    shared = trace_target.ClusterSpec([0, 0, 1, 1], [2, 2], recorded.params, ["", ""], {}, 2)
    assert recorded.crowding([0, 1, 2, 3]) == (2.0, 2.0)
    assert spread.crowding([0, 1, 2, 3]) == (1.0, 0.0)    # hosts of their own: a core per rank
    assert shared.crowding([0, 2]) == (2.0, 2.0)          # emulated hosts on 2 cores: as crowded as recorded
    assert recorded.crowding([0, 1]) == (2.0, 2.0)        # a pair among 4 ranks on 2 cores waits like the 4
    # the pricing topology gives a group's ranks their share of the cores (the tuner's per-round crowding)
    assert shared.priced([0, 1, 2, 3]).cores == [1.0, 1.0]
    assert recorded.priced([0, 1]).cores == [1.0]
    # a message between two of 4 ranks on 2 cores waits a scheduling turn per rank beyond the cores
    inst = next(iter(trace.instances.values()))
    pr, ps = trace_target.Pricer(trace, shared), trace_target.Pricer(trace, spread)
    t_shared, algo = pr.collective(inst, None)
    t_spread, algo2 = ps.collective(inst, None)
    assert algo == algo2  # the selector sees the cores each rank reports either way
    assert t_shared > t_spread + CALL_OVERHEAD * 3 + WAKE * 2  # crowd 2 (4x the overhead) and 2 wake-ups a message


def test_a_token_bucket_passes_calls_that_fit_it(tmp_path):
    # 2 ranks, each call 192 KiB between 2 hosts at 0.2 Gbit/s: 7.9 ms of bytes at the rate
    idle = trace_replay.build(_dumps(2, gap=0.05))   # 50 ms between calls: a 256 KiB bucket refills (10.5 ms)
    busy = trace_replay.build(_dumps(2, gap=0.0005))  # back to back: it cannot
    for trace, expect in ((idle, "all"), (busy, "first")):
        recorded = trace_target.recorded_cluster(trace)
        plain = trace_target.whatif(trace, _target(trace, tmp_path, 2, 0), recorded)
        bucket = trace_target.whatif(trace, _target(trace, tmp_path, 2, 256), recorded)
        costs, _ = trace_target.retarget(trace, _target(trace, tmp_path, 2, 256), recorded)
        tl = trace_replay.simulate(trace, costs)
        scales = trace_target.bucket_scales(trace, tl, _target(trace, tmp_path, 2, 256), recorded)
        order = sorted(trace.instances, key=lambda k: k[2])
        if expect == "all":  # every call finds a full bucket: none of its bytes wait for the rate
            assert [scales.get(k) for k in order] == [0.0] * len(order)
            assert bucket["step_ms"] < plain["step_ms"] - 6.0
        else:  # the first call empties it; later ones find what refilled while they were not sending at
            assert scales[order[0]] == 0.0  # the rate (the gap and the call's 2 ms of its own: ~2.5 ms)
            assert all(0.5 < scales.get(k, 1.0) < 0.9 for k in order[2:])
            assert 1.0 < plain["step_ms"] - bucket["step_ms"] < 4.0
        assert bucket["target"]["burst_kib"] == 256 and plain["target"]["burst_kib"] == 0
    with pytest.raises(ValueError, match="burst_kib must be >= 0"):
        _target(idle, tmp_path, 2, -1)


def _six_ranks_rd(gap: float = 0.01, calls: int = 4) -> dict:
    """6 ranks on one host, each step an 8 B allreduce (recursive doubling when spread over hosts)."""
    dumps = _dumps(6, gap, calls, call_s=0.0002)
    for d in dumps.values():
        for e in d["comms"][0]["calls"]:
            e.update(count=2, algorithm="oneshot")
    return dumps


def test_a_call_waits_only_on_the_links_its_last_member_s_data_crosses(tmp_path):
    # recursive doubling over 3 hosts x 2 (fold 0->1, 2->3; then 1<->3, 4<->5; then 1<->4, 3<->5; unfold)
    # crosses hosts in two rounds, and the tuner charges both; but with the others in early, a member
    # waits only for the crossings on the way from the last member's data to it
    trace = trace_replay.build(_six_ranks_rd())
    target = _target(trace, tmp_path, 3, 0)
    a = target.params.net.alpha
    inst = next(iter(trace.instances.values()))
    relief = trace_target.Pricer(trace, target).relief(inst, "recursive_doubling")
    # a rank of host 2 last: one crossing reaches hosts 0 and 1, and host 2 has everything at once
    assert relief[4] == pytest.approx({0: a, 1: a, 2: a, 3: a, 4: 2 * a, 5: 2 * a})
    # rank 0 last: its data crosses twice to reach rank 5 (1->3, 3->5), once to ranks 2, 3 and 4
    assert relief[0] == pytest.approx({0: 2 * a, 1: 2 * a, 2: a, 3: a, 4: a})
    # the replay ends each member that much earlier when that member is the last one ready
    recorded = trace_target.recorded_cluster(trace)
    costs, _ = trace_target.retarget(trace, target, recorded)
    assert inst.key in costs.relief
    late = {k: dict(v) for k, v in costs.times.items()}
    for key in late:  # rank 4 the last one ready in every call
        h, aft, o = late[key][4]
        late[key][4] = (h + 0.001, aft, o)
    spared = trace_replay.simulate(trace, trace_replay.Costs(late, costs.compute, relief=costs.relief))
    plain = trace_replay.simulate(trace, trace_replay.Costs(late, costs.compute))
    key = inst.key
    assert spared.ends[key][0] == pytest.approx(plain.ends[key][0] - a)
    assert spared.ends[key][5] == pytest.approx(plain.ends[key][5] - 2 * a)
    # on one host nothing crosses: nothing to spare
    assert trace_target.Pricer(trace, recorded).relief(inst, "recursive_doubling") == {}
