"""tcp: every message between two ranks rides their stream 0 as a frame (or a bulk announcement and
its payload), in one ordered byte stream: order, head-of-line, bursts, a close, a death mid-frame."""
import os
import time

import numpy as np
import pytest

from multiproc import run_ranks

TCP = {"PYCOLL_TRANSPORT": "tcp", "PYCOLL_TIMEOUT": "30"}
BULK = 1 << 20   # a bulk payload (past PYCOLL_TCP_BULK_THRESHOLD, 128K)
TRACKED = 100_000  # a data frame written from the user's buffer (past PYCOLL_TCP_COPY_THRESHOLD, 64K)

pytestmark = pytest.mark.timeout(120)


def _until(comm, what, done, timeout=30.0):
    """Drive the transport (a non-blocking turn of its io loop at a time) until done() holds."""
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError(f"rank {comm.rank}: {what} did not happen within {timeout:g} s")
        comm.transport.progress()
        time.sleep(0.001)


def _arrived(comm, peer, tag):
    """Messages from `peer` with `tag` that came before their receives (kept as unexpected)."""
    return sum(len(q) for m, q in comm.transport.matcher.unexpected.items() if m[0] == peer and m[3] == tag)


def _small_behind_unclaimed_bulk(comm):
    """Rank 0 sends a bulk payload (tag 1), then a small message (tag 2); rank 1 receives tag 2
    first: the unclaimed payload ahead of it on the stream must not hold it up (with PARK_AFTER
    at 30 s only the posted-receive rule can free it in time)."""
    import pycoll.transports.tcp as tcp
    tcp.PARK_AFTER = 30.0
    if comm.rank == 0:
        comm.send(np.full(BULK // 8, 1.5), 1, tag=1)
        comm.send(np.full(2, 7.0), 1, tag=2)
        comm.recv(np.empty(1), 1, tag=3)  # rank 1 is through
        return None
    _until(comm, "the bulk payload waiting unclaimed at the head of stream 0", lambda: comm.transport._bulk.blocked(0))
    small, big = np.empty(2), np.empty(BULK // 8)
    t0 = time.monotonic()
    comm.recv(small, 0, tag=2)
    waited = time.monotonic() - t0
    comm.recv(big, 0, tag=1)
    comm.send(np.zeros(1), 0, tag=3)
    return waited, small.tolist(), bool(np.all(big == 1.5))


def test_a_small_message_is_not_held_up_by_an_unclaimed_bulk_payload_ahead_of_it():
    waited, small, big_ok = run_ranks(_small_behind_unclaimed_bulk, 2, env=TCP)[1]
    assert small == [7.0, 7.0] and big_ok
    assert waited < 10.0, f"the small receive waited {waited:.1f} s behind the unclaimed payload"


SIZES = [8, 0, TRACKED, BULK, 8, 3, BULK + 5, 1000, TRACKED, 0, 16]


def _one_tag_every_kind(comm, late):
    """Messages of every kind (copied frames, tracked frames, bulk, empty) with ONE key: they match
    in the order sent (MPI's non-overtaking rule), posted before or after they came."""
    if comm.rank == 0:
        reqs = [comm.isend(np.full(n, k % 250 + 1, np.uint8), 1, tag=5) for k, n in enumerate(SIZES)]
        for r in reqs:
            r.wait()
        comm.recv(np.empty(1), 1, tag=6)
        return None
    if late:  # all of them arrive before their receives: stashed, parked, read aside
        _until(comm, "every message's arrival", lambda: _arrived(comm, 0, 5) == len(SIZES))
    bufs = [np.empty(n, np.uint8) for n in SIZES]
    reqs = [comm.irecv(b, 0, tag=5) for b in bufs]
    for r in reqs:
        r.wait()
    comm.send(np.zeros(1), 0, tag=6)
    return [bool(np.all(b == k % 250 + 1)) for k, b in enumerate(bufs)]


@pytest.mark.parametrize("late", [False, True])
@pytest.mark.parametrize("streams", ["1", "3"])
def test_messages_of_every_kind_with_one_key_match_in_order(late, streams):
    """(With 3 streams per pair the bulk payloads are cut over them, parts beside the frames.)"""
    env = dict(TCP, PYCOLL_NSOCKS=streams, PYCOLL_TCP_STRIPE_MIN="256K")
    assert run_ranks(_one_tag_every_kind, 2, late, env=env)[1] == [True] * len(SIZES)


def _burst(comm, count):
    """A burst of small frames (many per read, headers cut at the read-ahead buffer's end), some
    tracked ones among them, both ways at once."""
    peer = 1 - comm.rank
    sizes = [TRACKED if k % 97 == 0 else 1 + k % 40 for k in range(count)]
    sends = [comm.isend(np.full(n, (k + comm.rank) % 200, np.uint8), peer, tag=k % 3) for k, n in enumerate(sizes)]
    bufs = [np.empty(n, np.uint8) for n in sizes]
    recvs = [comm.irecv(b, peer, tag=k % 3) for k, b in enumerate(bufs)]
    for r in sends + recvs:
        r.wait()
    return all(np.all(b == (k + peer) % 200) for k, b in enumerate(bufs))


def test_a_burst_of_frames_both_ways_arrives_intact():
    assert run_ranks(_burst, 2, 3000, env=TCP) == [True, True]


def _send_then_close(comm):
    """Rank 1 sends, closes at once and exits; rank 0 receives everything only after the grace
    period its dropped connection gets: nothing sent before the goodbye is lost."""
    if comm.rank == 1:
        for k, n in enumerate(SIZES):
            comm.isend(np.full(n, k + 1, np.uint8), 0, tag=k)
        return None  # the harness closes the communicator (flushing what is queued), then the process exits
    _until(comm, "rank 1's close", lambda: 1 in comm.transport.dead)  # (after the grace period its drop gets)
    got = []
    for k, n in enumerate(SIZES):
        buf = np.empty(n, np.uint8)
        comm.recv(buf, 1, tag=k)
        got.append(bool(np.all(buf == k + 1)))
    try:
        comm.recv(np.empty(1), 1, tag=99)
        after = "nothing"
    except Exception as e:  # the peer said goodbye: a later receive from it fails, naming it
        after = f"{type(e).__name__}: {e}"
    return got, after


def test_data_sent_before_a_normal_close_is_all_delivered():
    got, after = run_ranks(_send_then_close, 2, env=TCP)[0]
    assert got == [True] * len(SIZES)
    assert after.startswith("PeerError") and "rank 1" in after and "closed" in after


def _dies_mid_frame(comm):
    """Rank 1 writes half a frame header on its stream to rank 0 and dies; rank 0's receive from it
    fails with a PeerError naming rank 1 (not a hang, not garbage)."""
    from pycoll.transports import wire
    if comm.rank == 1:
        comm.send(np.full(4, 2.0), 0, tag=1)  # a whole frame first: still delivered
        header = wire.pack_header(wire.KIND_DATA, 0, 1, 2, 3, 8)
        comm.transport._bulk.socks[0][0].send(header[:20])
        os._exit(7)
    first = np.empty(4)
    comm.recv(first, 1, tag=1)
    t0 = time.monotonic()
    try:
        comm.recv(np.empty(4), 1, tag=2)
        return "no error"
    except Exception as e:
        return first.tolist(), type(e).__name__, getattr(e, "peer", None), str(e), time.monotonic() - t0


def test_a_peer_dying_mid_frame_fails_the_receive_naming_it():
    first, kind, peer, message, waited = run_ranks(_dies_mid_frame, 2, env=TCP, expect_fail=True)[0][1]
    assert first == [2.0] * 4
    assert kind == "PeerError" and peer == 1 and "rank 1" in message, message
    assert waited < 20, f"noticed after {waited:.1f} s"


@pytest.mark.parametrize("threshold", ["inf", "0"])
def test_every_message_on_zmq_or_every_one_bulk(threshold):
    """PYCOLL_TCP_BULK_THRESHOLD=inf: every message rides zmq (no frames); 0: every one is a bulk
    payload, empty ones too; either way one key still matches in order, and a revocation notice
    (an empty message) neither hangs nor holds up what follows it."""
    env = dict(TCP, PYCOLL_TCP_BULK_THRESHOLD=threshold)
    assert run_ranks(_one_tag_every_kind, 2, True, env=env)[1] == [True] * len(SIZES)
    assert run_ranks(_revoke_then_talk, 2, env=env) == ["RevokedError", "RevokedError"]


def _revoke_then_talk(comm):
    """Rank 0 revokes the world (a notice to rank 1), then sends on a duplicate made before: rank 1
    gets that message behind the notice, and both see the world revoked."""
    side = comm.dup()
    if comm.rank == 0:
        comm.revoke()
        side.send(np.full(3, 4.0), 1, tag=1)
    else:
        buf = np.empty(3)
        side.recv(buf, 0, tag=1)
        assert buf.tolist() == [4.0] * 3
    try:
        comm.allreduce(np.ones(1))
        return "no error"
    except Exception as e:
        return type(e).__name__
