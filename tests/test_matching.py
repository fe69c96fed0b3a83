"""The matching engine every transport shares, without processes: FIFO matching, unexpected
arrivals, and failure fan-out to pending and later requests."""
from __future__ import annotations

import numpy as np
import pytest

from pycoll.errors import PeerError
from pycoll.transports.base import MsgKey, Request
from pycoll.transports.liveness import PidWatch
from pycoll.transports.matching import Matcher, fail_all, match_of

KEY = MsgKey(0xC0, 3, 1)


def _recv(peer: int, key: MsgKey = KEY) -> Request:
    return Request(peer, key, memoryview(bytearray(8)), 0, is_recv=True)


def _send(peer: int, key: MsgKey = KEY) -> Request:
    return Request(peer, key, memoryview(bytearray(8)), 0, is_recv=False)


def test_posted_receives_match_arrivals_oldest_first():
    m: Matcher[str] = Matcher(0)
    first, second = _recv(1), _recv(1)
    assert m.post(first) is None and m.post(second) is None
    assert m.waiting(match_of(1, KEY)) is first
    assert m.take(match_of(1, KEY)) is first
    assert m.take(match_of(1, KEY)) is second
    assert m.posted == {} and m.unexpected == {}  # emptied queues leave no keys behind


def test_unexpected_arrivals_wait_for_their_receive_in_order():
    m: Matcher[str] = Matcher(0)
    assert m.take(match_of(2, KEY)) is None
    m.stash(match_of(2, KEY), "x")
    m.stash(match_of(2, KEY), "y")
    other = MsgKey(0xC0, 3, 2)  # another tag does not match
    assert m.post(_recv(2, other)) is None
    assert m.post(_recv(2)) == "x" and m.post(_recv(2)) == "y"
    assert m.unexpected == {} and list(m.posted) == [match_of(2, other)]
    assert m.take(match_of(2, KEY)) is None


def test_a_closed_peer_fails_its_posted_and_later_requests_but_not_what_it_sent_before():
    m: Matcher[str] = Matcher(0)
    pending, other = _recv(1), _recv(2)
    m.post(pending)
    m.post(other)
    m.stash(match_of(1, MsgKey(0xC0, 4, 0)), "sent before closing")
    failed = m.peer_gone(1, "it closed its communicator")
    assert failed == [pending] and pending.done and isinstance(pending.error, PeerError)
    assert "rank 0: cannot receive from rank 1 (comm 0xc0, call 3, tag 1): it closed" in str(pending.error)
    assert not other.done  # another peer's receive is untouched
    assert m.post(_recv(1, MsgKey(0xC0, 4, 0))) == "sent before closing"
    late, send = _recv(1), _send(1)
    assert m.post(late) is None and late.done and "cannot receive from rank 1" in str(late.error)
    assert not m.admit(send, "send to") and "cannot send to rank 1" in str(send.error)
    assert m.admit(_send(2), "send to")


def test_a_death_breaks_every_request_with_the_first_error():
    m: Matcher[str] = Matcher(0)
    reqs = [_recv(1), _recv(2), _recv(3)]
    for r in reqs:
        m.post(r)
    first = PeerError("rank 0: rank 2 died", 2)
    assert m.break_job(first) == reqs and all(r.done and r.error is first for r in reqs)
    m.break_job(PeerError("rank 0: rank 3 died", 3))
    assert m.broken is first
    send = _send(1)
    assert m.fail_pending([send]) and send.error is first
    done = _send(1)
    done.done = True
    assert not m.fail_pending([done]) and done.error is None  # completed requests keep their result


def test_refuse_fails_only_new_requests_and_fail_all_keeps_the_first_error():
    m: Matcher[str] = Matcher(0)
    posted = _recv(1)
    m.post(posted)
    m.refuse(1, "its bulk stream broke")
    assert not posted.done
    new = _recv(1)
    m.post(new)
    assert new.done and "its bulk stream broke" in str(new.error)
    a, b = _send(1), _send(2)
    b.error = PeerError("earlier", 2)
    fail_all([a, b], PeerError("later", 1))
    assert a.done and str(a.error) == "later" and str(b.error) == "earlier"


def test_pid_watch_reports_an_exited_process_once(tmp_path):
    import subprocess
    import sys
    w = PidWatch(0)
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    w.watch(5, child.pid, "rank 5")
    assert w.exited() == []
    child.stdin.close()
    child.wait(timeout=30)
    assert w.exited() == [5] and w.exited() == [] and not w.fds
    with pytest.raises(PeerError, match="rank 5 died while the transport connected"):
        w.watch(5, child.pid, "rank 5")  # reaped: no such process any more
    w.close()


@pytest.mark.parametrize("n", [1, 1000])
def test_matching_keeps_no_state_after_balanced_traffic(n):
    m: Matcher[np.ndarray] = Matcher(0)
    for i in range(n):
        key = MsgKey(1, i, 0)
        if i % 2:
            m.post(_recv(i % 7, key))
            assert m.take(match_of(i % 7, key)) is not None
        else:
            m.stash(match_of(i % 7, key), np.zeros(1))
            assert m.post(_recv(i % 7, key)) is not None
    assert m.posted == {} and m.unexpected == {}


def test_any_source_receive_takes_the_first_arrival_from_any_peer_and_learns_the_sender():
    from pycoll.transports.base import ANY
    m: Matcher[str] = Matcher(0)
    m.stash(match_of(2, KEY), "from 2")
    m.stash(match_of(1, KEY), "from 1")
    m.stash(match_of(2, KEY), "from 2 again")
    m.stash(match_of(3, MsgKey(0xC0, 3, 9)), "other tag")
    got = []
    for _ in range(3):
        req = _recv(ANY)
        got.append((m.post(req), req.peer))
    assert got == [("from 2", 2), ("from 1", 1), ("from 2 again", 2)]  # arrival order, FIFO per peer
    assert list(m.unexpected) == [match_of(3, MsgKey(0xC0, 3, 9))] and m.wild == 0


def test_an_arrival_goes_to_the_earliest_posted_of_its_peers_and_the_any_source_receives():
    from pycoll.transports.base import ANY
    m: Matcher[str] = Matcher(0)
    own1, wild1, own2, wild2 = _recv(1), _recv(ANY), _recv(1), _recv(ANY)
    for r in (own1, wild1, own2, wild2):
        assert m.post(r) is None
    assert m.wild == 2 and m.waiting(match_of(1, KEY)) is own1
    assert m.take(match_of(1, KEY)) is own1
    assert m.waiting(match_of(1, KEY)) is wild1 and wild1.peer == ANY  # waiting leaves it unmatched
    assert m.take(match_of(1, KEY)) is wild1 and wild1.peer == 1
    assert m.take(match_of(2, KEY)) is wild2 and wild2.peer == 2  # another peer's arrival
    assert m.take(match_of(2, KEY)) is None and m.take(match_of(1, KEY)) is own2
    assert m.posted == {} and m.wild == 0


def test_a_closed_peer_leaves_any_source_receives_waiting_and_a_death_fails_them():
    from pycoll.transports.base import ANY
    m: Matcher[str] = Matcher(0)
    wild = _recv(ANY)
    m.post(wild)
    assert m.peer_gone(1, "it closed its communicator") == [] and not wild.done and m.wild == 1
    death = PeerError("rank 0: rank 2 died", 2)
    assert m.break_job(death) == [wild] and wild.error is death and m.wild == 0
    late = _recv(ANY)
    assert m.post(late) is None and late.done and late.error is death
    assert "recv from any rank" == late.describe()
