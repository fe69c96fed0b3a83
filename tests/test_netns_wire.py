"""The emulated cluster's userspace wire (netns_wire.py): delay, loss and reordering between hosts,
measured with real packets, and a multi-node `pycoll run` job launched across the hosts."""
import json
import os
import subprocess
import sys
import threading
import time

import pytest

from netns_cluster import Cluster, unavailable

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=f"emulated cluster: {unavailable()}")
PROBE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "wire_probe.py")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _wait_for(path: str, proc: subprocess.Popen, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        assert proc.poll() is None and time.monotonic() < deadline, f"the probe server did not start ({path})"
        time.sleep(0.01)


def _rtt_ms(c: Cluster, n: int = 60) -> float:
    ready = os.path.join(c.workdir, "tcp.ready")
    server = c.popen(1, [sys.executable, PROBE, "tcp-server", c.addresses[1], "23456", ready])
    _wait_for(ready, server)
    out = subprocess.run(["ip", "netns", "exec", c.namespaces[0], sys.executable, PROBE, "tcp-client",
                          c.addresses[1], "23456", str(n)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return float(out.stdout)


def _udp(c: Cluster, n: int) -> dict:
    ready = os.path.join(c.workdir, "udp.ready")
    server = c.popen(1, [sys.executable, PROBE, "udp-server", c.addresses[1], "23457", ready, str(n)],
                     log=os.path.join(c.workdir, "udp.out"))
    _wait_for(ready, server)
    subprocess.run(["ip", "netns", "exec", c.namespaces[0], sys.executable, PROBE, "udp-client", c.addresses[1],
                    "23457", str(n)], check=True, timeout=60)
    server.wait(30)
    with open(os.path.join(c.workdir, "udp.out")) as fh:
        return json.loads(fh.read())


@pytest.mark.timeout(120)
def _can_realtime() -> bool:
    """Whether a thread of ours may take SCHED_FIFO (root with CAP_SYS_NICE; a container may lack it)."""
    got = []

    def probe() -> None:
        try:
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
            got.append(True)
        except OSError:
            got.append(False)
    t = threading.Thread(target=probe)
    t.start()
    t.join()
    return got[0]


def test_delay_adds_two_one_way_delays_to_a_round_trip():
    with Cluster(2) as c:
        base = _rtt_ms(c)
    with Cluster(2, delay_ms=3.0) as c:
        delayed = _rtt_ms(c)
        assert c.wire.stats["packets"] > 100, c.wire.stats
        assert c.wire.stats["realtime"] or not _can_realtime(), "the wire runs ahead of the ranks (SCHED_FIFO)"
    # 3 ms each way: a round trip of 6 ms over the wire's own, with room for a loaded machine's wake-ups
    assert base < 1.0, f"round trip without the wire {base:.3f} ms"
    assert 6.0 <= delayed < 6.0 + base + 3.0, f"round trip with 3 ms one way {delayed:.2f} ms (without: {base:.3f})"


@pytest.mark.timeout(120)
def test_loss_drops_that_share_of_packets():
    with Cluster(2, loss=0.2, wire_seed=1) as c:
        got = _udp(c, 1000)
        dropped = c.wire.stats["dropped"]
    # 1000 datagrams, each dropped with probability 0.2: 200 +- 4 standard deviations (12.6 each)
    assert 150 <= 1000 - got["received"] <= 250, got
    assert dropped == 1000 - got["received"], (dropped, got)


@pytest.mark.timeout(120)
def test_jitter_and_reorder_deliver_out_of_order():
    with Cluster(2) as c:
        plain = _udp(c, 300)
    with Cluster(2, delay_ms=2.0, jitter_ms=1.5, reorder=0.05, wire_seed=2) as c:
        mixed = _udp(c, 300)
        stats = c.wire.stats
    assert plain == {"received": 300, "out_of_order": 0}, plain
    assert mixed["received"] == 300 and mixed["out_of_order"] >= 10, (mixed, stats)
    assert stats["reordered"] >= 3, stats


@pytest.mark.timeout(180)
def test_launch_runs_a_multi_node_job_across_the_wire():
    with Cluster(2, delay_ms=1.0) as c:
        outputs = c.launch([os.path.join(ROOT, "examples", "hello_allreduce.py")], ppn=2, timeout=150)
        assert c.wire.stats["packets"] > 0
    lines = [line for out in outputs for line in out.splitlines() if "allreduce(sum of ranks)" in line]
    assert len(lines) == 4 and all(line.endswith("[6.0, 6.0, 6.0, 6.0] OK") for line in lines), outputs
