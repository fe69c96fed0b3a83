"""The verbs (RDMA) transport.

Where no RDMA device is usable (CI), only the skip reason and PYCOLL_TRANSPORT=verbs's error are
checked, and every device test skips saying why. Inside the soft-RoCE VM (tests/rdma/run-vm.sh)
the device tests run for real: p2p of every size class, flow control, the MR cache, every
collective, and a rank killed mid-transfer. test_soft_roce_vm boots that VM from here
(slow, and only with PYCOLL_RDMA_VM=1: .ci/run-rdma-vm sets it, and .ci/run runs that stage).
A test that asserts a count says in its message what made each one.
"""
import os
import signal
import subprocess
import threading
import time

import numpy as np
import pytest

from collective_cases import run_matrix
from multiproc import run_ranks
from pycoll import config
from pycoll.transports.verbs_device import unavailable_reason
from test_collectives import ALL, _assert_matrix

REASON = unavailable_reason()
VERBS = {"PYCOLL_TRANSPORT": "verbs"}
HERE = os.path.dirname(os.path.abspath(__file__))
needs_device = pytest.mark.skipif(REASON is not None, reason=f"no usable RDMA device: {REASON}")


# -- without a device (normal CI) -------------------------------------------------------------
@pytest.mark.skipif(REASON is None, reason="an RDMA device is usable here")
def test_unavailable_reason_says_what_to_do():
    assert ("pyverbs" in REASON and "pip install 'pycoll[rdma]'" in REASON) or \
        ("RDMA" in REASON and ("rdma link add" in REASON or "PYCOLL_IB_DEV" in REASON)), REASON


def _init(comm):
    return comm.transport.name


@pytest.mark.skipif(REASON is None, reason="an RDMA device is usable here")
@pytest.mark.timeout(90)
def test_transport_verbs_without_a_device_is_a_clear_error():
    from pycoll.errors import EnvError
    from pycoll.transports import create_transport
    with pytest.raises(EnvError, match="PYCOLL_TRANSPORT=verbs|RDMA"):
        create_transport("verbs", 0, 2)
    for ok, story in run_ranks(_init, 2, env=VERBS, timeout=80, expect_fail=True):
        assert not ok and "EnvError" in story and REASON.split(";")[0] in story, story


# -- on a device (the soft-RoCE VM) -----------------------------------------------------------
def _eager_max():
    from pycoll.transports.verbs import eager_max
    return eager_max()


def _sizes():
    e = _eager_max()
    return [0, 1, 7, 1000, e - 1, e, e + 1, 3 * e + 5, 1 << 20, (8 << 20) + 3, 24 << 20]


def _p2p_every_size(comm):
    got = []
    for i, nbytes in enumerate(_sizes()):
        dtype = np.float64 if nbytes % 8 == 0 else np.uint8
        count = nbytes // np.dtype(dtype).itemsize
        want = np.random.default_rng(i).integers(0, 250, count).astype(dtype)
        for src in (0, 1):  # both directions
            if comm.rank == src:
                comm.send(want, 1 - src, tag=i)
            else:
                buf = np.empty(count, dtype)
                comm.recv(buf, src, tag=i)
                got.append((nbytes, bool(np.array_equal(buf, want))))
    assert comm.transport.name == "verbs"
    return got


@needs_device
@pytest.mark.timeout(300)
def test_p2p_every_size_both_ways():
    sizes = _sizes()
    for rank, got in enumerate(run_ranks(_p2p_every_size, 2, env=VERBS, timeout=280)):
        assert [n for n, _ in got] == sizes, (f"rank {rank} received {len(got)} messages; expected {len(sizes)}, "
                                              f"one per size class sent by the other rank ({sizes} bytes)")
        bad = [n for n, ok in got if not ok]
        assert not bad, f"rank {rank}: the messages of {bad} bytes arrived with other contents than were sent"


def _unexpected_flood(comm):
    """Both ranks start 300 eager and 6 rendezvous sends before either posts a receive (credits run
    out on both sides at once), then receive them in reverse tag order (transport level: isend)."""
    from pycoll.channel import byte_view
    from pycoll.transports import MsgKey
    t, peer = comm.transport, 1 - comm.rank
    e = _eager_max()
    small = [np.full(50, tag + comm.rank, np.int32) for tag in range(300)]
    big = [np.full(e + 100 * k, k + comm.rank, np.uint8) for k in range(6)]
    sends = [t.isend(byte_view(x), peer, MsgKey(77, 0, tag)) for tag, x in enumerate(small)]
    sends += [t.isend(byte_view(x), peer, MsgKey(77, 1, k)) for k, x in enumerate(big)]
    time.sleep(1.0)
    got = {"rendezvous": [], "eager": []}  # per message received: its tag and whether it held what was sent
    for k in reversed(range(6)):
        buf = np.empty(e + 100 * k, np.uint8)
        t.wait([t.irecv(byte_view(buf), peer, MsgKey(77, 1, k))], 60, "flood")
        got["rendezvous"].append((k, bool((buf == k + peer).all())))
    for tag in reversed(range(300)):
        buf = np.empty(50, np.int32)
        t.wait([t.irecv(byte_view(buf), peer, MsgKey(77, 0, tag))], 60, "flood")
        got["eager"].append((tag, bool((buf == tag + peer).all())))
    t.wait(sends, 60, "flood sends")
    return got, sum(r.done for r in sends)


@needs_device
@pytest.mark.timeout(300)
def test_flow_control_with_both_sides_flooding():
    for rank, (got, sent) in enumerate(run_ranks(_unexpected_flood, 2, env=VERBS, timeout=280)):
        assert sent == 306, (f"rank {rank}: {sent} of its 306 sends completed (300 eager sends of 200 bytes, "
                             "one per tag 0-299, and 6 rendezvous sends just above the eager limit)")
        for kind, want in (("eager", 300), ("rendezvous", 6)):
            assert len(got[kind]) == want, (f"rank {rank} received {len(got[kind])} {kind} messages; expected "
                                            f"{want}, one per {kind} send of the other rank")
            bad = [tag for tag, ok in got[kind] if not ok]
            assert not bad, f"rank {rank}: the {kind} messages of tags {bad} held other contents than were sent"


def _ordering_and_mismatch(comm):
    import pycoll
    e = _eager_max()
    out = {}
    if comm.rank == 0:
        for k in range(3):  # same tag: delivered in send order, eager and rendezvous mixed
            comm.send(np.full(e if k == 1 else e + 10, k, np.uint8), 1, tag=7)
        comm.send(np.zeros(10, np.float32), 1, tag=8)          # eager, wrong size
        comm.send(np.zeros(e, np.float32), 1, tag=9)           # rendezvous, wrong size
        comm.send(np.arange(5, dtype=np.int64), 1, tag=10)     # still fine afterwards
        return out
    for k in range(3):
        n = e if k == 1 else e + 10
        buf = np.empty(n, np.uint8)
        comm.recv(buf, 0, tag=7)
        out[f"fifo{k}"] = bool((buf == k).all())
    for tag, count in ((8, 20), (9, e // 2)):
        buf = np.full(count, 5, np.float32)
        try:
            comm.recv(buf, 0, tag=tag)
            out[f"mismatch{tag}"] = "no error"
        except pycoll.ProtocolError as err:
            out[f"mismatch{tag}"] = "rank 0" in str(err) and bool((buf == 5).all())
    buf = np.empty(5, np.int64)
    comm.recv(buf, 0, tag=10)
    out["after"] = buf.tolist() == list(range(5))
    return out


@needs_device
@pytest.mark.timeout(200)
def test_fifo_within_a_tag_and_size_mismatch_is_a_protocol_error():
    got = run_ranks(_ordering_and_mismatch, 2, env=VERBS, timeout=180)[1]
    assert got == {"fifo0": True, "fifo1": True, "fifo2": True, "mismatch8": True,
                   "mismatch9": True, "after": True}, got


def _mr_cache(comm):
    """Registrations made by five rendezvous transfers of one 4 MiB array, then by a new array.
    Counted from this function's start: the communicator's init may have registered buffers of its
    own (the tuner's calibration ping-pongs a 1 MiB array, a rendezvous-size message, unless a
    cached measurement spares it), and those are freed before this runs."""
    import gc
    mrs = comm.transport._mrs
    at_start = mrs.registrations
    x = np.arange(1 << 20, dtype=np.float32)  # 4 MiB: rendezvous
    for i in range(5):
        if comm.rank == 0:
            comm.send(x, 1, tag=i)
        else:
            comm.recv(x, 0, tag=i)
    after_reuse = mrs.registrations - at_start
    held = len(mrs._entries)  # the first acquire reaped whatever init had registered and freed
    del x
    gc.collect()
    y = np.ones(1 << 20, np.float32)  # a new buffer needs a new registration, never a stale hit
    if comm.rank == 0:
        comm.send(y, 1, tag=99)
    else:
        comm.recv(y, 0, tag=99)
    return at_start, after_reuse, held, mrs.registrations - at_start, len(mrs._entries), float(y.sum())


@needs_device
@pytest.mark.timeout(200)
@pytest.mark.parametrize("tuner", ["probe", "static"])
def test_mr_cache_reuses_registrations_and_drops_freed_buffers(tuner):
    env = {**VERBS, "PYCOLL_TUNER": tuner, "PYCOLL_TUNER_CACHE": "off"}
    for rank, (at_start, after_reuse, held, total, held_after, total_y) in enumerate(
            run_ranks(_mr_cache, 2, env=env, timeout=180)):
        init = ("the calibration's 1 MiB ping-pong array (registered at init, freed since)"
                if tuner == "probe" else "nothing (PYCOLL_TUNER=static: no calibration)")
        assert at_start == (1 if tuner == "probe" else 0), \
            f"rank {rank}: {at_start} registrations before the test's transfers; expected one per buffer of {init}"
        assert after_reuse == 1, (f"rank {rank}: five {'sends' if rank == 0 else 'receives'} of one 4 MiB array "
                                  f"made {after_reuse} registrations; expected 1 (the first transfer's, reused "
                                  "by the other four)")
        assert held == 1, (f"rank {rank}: {held} registrations held after the five transfers; expected 1 (the "
                           f"4 MiB array's; {init} is dropped once freed)")
        assert total == 2, (f"rank {rank}: {total} registrations after a transfer of a new array; expected 2 "
                            "(the first array's, then the new array's: a freed array's registration is never "
                            "reused for another at the same address)")
        assert held_after == 1, (f"rank {rank}: {held_after} registrations held at the end; expected 1 (the new "
                                 "array's; the freed first array's is deregistered)")
        assert total_y == (1 << 20)


@needs_device
@pytest.mark.timeout(900)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_every_collective_over_verbs(n):
    _assert_matrix(run_ranks(run_matrix, n, ALL, n != 3, timeout=880, env=VERBS))


def _die_mid_transfer(comm):
    """Large allreduces in a loop; rank 1 kills itself (SIGKILL) in the middle of the third."""
    import pycoll
    x = np.ones(4 << 20, np.float32)
    if comm.rank == 1:
        comm.allreduce(x)
        comm.allreduce(x)
        threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGKILL)).start()
    start = time.monotonic()
    try:
        for _ in range(200):
            comm.allreduce(x)
    except pycoll.PeerError as e:
        return type(e).__name__, e.peer, str(e), time.monotonic() - start
    return "no error", None, "", time.monotonic() - start


@needs_device
@pytest.mark.timeout(300)
@pytest.mark.parametrize("n", [2, 4])
def test_rank_killed_mid_transfer_fails_the_others_fast(n):
    results = run_ranks(_die_mid_transfer, n, env={**VERBS, "PYCOLL_TIMEOUT": "120"}, timeout=280,
                        expect_fail=True)
    assert not results[1][0] and "exited with code -9" in results[1][1], results[1]
    for rank, (ok, value) in enumerate(results):
        if rank == 1:
            continue
        assert ok, value
        kind, peer, message, elapsed = value
        # the dead rank's neighbours name it; a rank waiting on one of them may instead hear
        # that this neighbour closed its communicator (it gave up on rank 1 and left)
        assert kind == "PeerError" and ("rank 1" in message or "closed its communicator" in message), value
        assert elapsed < 60, f"rank {rank} took {elapsed:.1f} s to notice"


# -- fault tolerance: refused, saying why ------------------------------------------------------
def _verbs_comm():
    """A stand-in communicator over a VerbsTransport object that was never opened (no pyverbs needed):
    what pycoll.ft looks at before doing anything."""
    from types import SimpleNamespace
    from pycoll.transports.verbs import VerbsTransport
    return SimpleNamespace(transport=VerbsTransport.__new__(VerbsTransport), rank=1, name="world", closed=False)


@pytest.mark.parametrize("call", ["revoke", "agree", "shrink"])
def test_verbs_refuses_revoke_agree_shrink_with_the_reason(call):
    import pycoll
    from pycoll import ft
    comm = _verbs_comm()
    with pytest.raises(pycoll.PycollError) as info:
        ft.agree(comm, True) if call == "agree" else getattr(ft, call)(comm)
    assert str(info.value).startswith(f"rank 1: {call} on world: the verbs transport cannot survive a dead rank "
                                      "(a dead peer's queue pair goes to the error state"), info.value
    assert "use PYCOLL_TRANSPORT=tcp, shm or auto" in str(info.value)


def _ft_on_verbs(comm):
    import pycoll
    refused = []
    for call in (comm.revoke, lambda: comm.agree(True), comm.shrink):
        try:
            call()
        except pycoll.PycollError as e:
            refused.append(str(e))
    x = np.ones(4, np.float32)
    comm.allreduce(x)
    return refused, float(x[0])


@needs_device
@pytest.mark.timeout(120)
def test_verbs_communicator_refuses_fault_tolerance_and_still_works():
    for refused, total in run_ranks(_ft_on_verbs, 2, env=VERBS, timeout=100):
        assert len(refused) == 3, (f"{len(refused)} of revoke, agree and shrink were refused; expected all 3 "
                                   f"(one PycollError each): {refused}")
        assert all("verbs transport cannot survive a dead rank" in e for e in refused), refused
        assert total == 2.0, f"an allreduce of ones over 2 ranks gave {total} after the refusals; expected 2"


# -- the VM itself (CI's RDMA stage) ------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.skipif(not config.get("PYCOLL_RDMA_VM"),
                    reason="boots a soft-RoCE VM for many minutes: set PYCOLL_RDMA_VM=1 or run .ci/run-rdma-vm")
@pytest.mark.timeout(3600)
def test_soft_roce_vm():
    proc = subprocess.run(["bash", os.path.join(HERE, "rdma", "run-vm.sh")], capture_output=True,
                          text=True, timeout=3500)
    out = proc.stdout + proc.stderr
    print(out[-20000:])  # the guest's test summary and the verbs-vs-tcp table (shown with -s)
    assert proc.returncode == 0 and " passed" in out and "== guest-tests exit code 0" in out, out[-6000:]
