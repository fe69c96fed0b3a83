"""Network partitions in the emulated cluster (tests/netns_cluster.py): a host loses its link
(`ip link set eth0 down` in its namespace) in the middle of a training-style loop (allreduce,
revoke, agree, shrink: pycoll/ft.py). Both sides see the other as dead (PYCOLL_TCP_HEARTBEAT); the
side holding a strict majority of the ranks, or exactly half with rank 0, shrinks the other out and
goes on; the other side raises PartitionError instead of continuing alone.
"""
from __future__ import annotations

import os
import subprocess
import time
from typing import Any, Dict, List

import numpy as np
import pytest

from netns_cluster import Cluster, unavailable
from test_ft import _marked_at, _step

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(unavailable() is not None, reason=f"emulated cluster: {unavailable()}")]

HEARTBEAT = 2.0  # s of silence before a tcp peer counts as dead


def _cut_time(path: str) -> float:
    """When the link went down (wall clock: the namespaces share it), as the cutting rank wrote it."""
    return _marked_at(os.path.dirname(path), os.path.basename(path))


def loop_through_a_cut(comm: Any, placement: List[int], cut_host: int, cut_at: int, steps: int,
                       cut_file: str) -> Dict[str, Any]:
    """`steps` allreduce steps with the issue's recovery loop; the first rank of host `cut_host`
    takes its host's link down before step `cut_at` (and writes when to `cut_file`). Each result is
    checked against the ranks it ran on. What this rank ended with, and how long after the cut:
    'continued' (its group) or 'partition' (the PartitionError)."""
    import pycoll
    me = comm.rank
    step = 0
    while step < steps:
        if step == cut_at and me == placement.index(cut_host) and not os.path.exists(cut_file):
            subprocess.run(["ip", "link", "set", "eth0", "down"], check=True)
            with open(cut_file + ".tmp", "w") as f:
                f.write(repr(time.time()))
            os.replace(cut_file + ".tmp", cut_file)
        x = np.full(1 << 12, (me + 1) * (step + 1), np.float64)
        try:
            comm, ok, _ = _step(comm, x)
        except pycoll.PartitionError as e:
            return {"outcome": "partition", "error": str(e), "survivors": e.survivors,
                    "after": time.time() - _cut_time(cut_file)}
        if not ok:
            continue
        expect = sum(g + 1 for g in _step.ran_on) * (step + 1)
        assert np.all(x == expect), (step, x[0], expect, _step.ran_on, comm.group)
        step += 1
    return {"outcome": "continued", "group": list(comm.group), "after": time.time() - _cut_time(cut_file)}


CASES = {
    # 3 hosts x 2 ranks, rank i on host i % 3; host 0 (ranks 0 and 3) is cut: 2 of 6, a minority
    # although it holds rank 0
    "3x2-host0-cut": ([0, 1, 2, 0, 1, 2], 0, {0, 3}),
    # 3 hosts x 1 rank: the lone rank of host 2 is cut off
    "3x1-host2-cut": ([0, 1, 2], 2, {2}),
    # 2 hosts x 2 ranks, a tie: the half holding rank 0 goes on, whichever host lost its link
    "2x2-host1-cut": ([0, 0, 1, 1], 1, {2, 3}),
    "2x2-host0-cut": ([0, 0, 1, 1], 0, {2, 3}),
}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", list(CASES))
def test_a_host_losing_its_link_majority_goes_on_minority_refuses(case, tmp_path):
    placement, cut_host, losers = CASES[case]
    n = len(placement)
    env = {"PYCOLL_TRANSPORT": "auto", "PYCOLL_TIMEOUT": "60", "PYCOLL_TCP_HEARTBEAT": str(HEARTBEAT),
           "PYCOLL_TUNER_CACHE": str(tmp_path / "tuner"), "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    with Cluster(hosts=max(placement) + 1) as cluster:
        results = cluster.run("test_ft_partition:loop_through_a_cut", placement, [placement, cut_host, 3, 8, str(tmp_path / "cut")],
                              env=env, timeout=200)
    assert not cluster.exists()
    winners = sorted(set(range(n)) - losers)
    for rank, got in enumerate(results):
        print(f"{case}: rank {rank} (host {placement[rank]}): {got['outcome']} {got['after']:.1f} s after the cut"
              + (f", on ranks {got['group']}" if got["outcome"] == "continued" else ""))
        if rank in losers:
            assert got["outcome"] == "partition", got
            assert "minority" in got["error"] and "must not continue alone" in got["error"], got
            assert got["survivors"] == sorted(losers), got
        else:
            assert got == {"outcome": "continued", "group": winners, "after": got["after"]}, got
        assert got["after"] < HEARTBEAT + 15, got  # silence detected, then one agreement (a loaded machine)
