"""The Worker that runs a communicator's queued calls: order, and waiters running the queue inline."""
import threading

import pytest

from pycoll.errors import TimeoutError
from pycoll.work import Worker

pytestmark = pytest.mark.timeout(30)


def test_waiter_runs_queued_calls_in_order_on_its_own_thread():
    worker = Worker("test")
    gate = threading.Event()
    ran = []
    first = worker.submit("first", lambda: (gate.wait(10), ran.append(("first", threading.current_thread())))[1])
    # the worker thread holds `first`; what is queued behind it waits for it, whoever runs it
    second = worker.submit("second", lambda: ran.append(("second", threading.current_thread())) or 2)
    assert not second.is_completed()
    gate.set()
    assert second.wait() and second.result() == 2
    assert [name for name, _ in ran] == ["first", "second"]
    assert first.is_success()
    worker.close()


def test_wait_on_a_call_not_started_runs_it_on_the_waiting_thread():
    worker = Worker("test")
    me = threading.current_thread()
    order, threads = [], []

    def call(i):
        order.append(i)
        threads.append(threading.current_thread())
        return i
    for k in range(100):  # the worker thread may win the race for a call now and then, never every time
        works = [worker.submit(f"w{3 * k + j}", lambda i=3 * k + j: call(i)) for j in range(3)]
        assert works[1].result() == 3 * k + 1  # runs w0 and w1 (here, or on the worker), leaves w2
        assert works[2].wait() and works[0].is_success()
    assert order == list(range(300))
    assert threads.count(me) > 50, f"only {threads.count(me)} of 300 calls ran on the waiting thread"
    worker.close()


def test_errors_and_timeouts_reach_the_waiter():
    worker = Worker("test")

    def boom():
        raise ValueError("rank 3: bad call")
    failed = worker.submit("failing", boom)
    with pytest.raises(ValueError, match="bad call"):
        failed.wait()
    assert failed.is_completed() and not failed.is_success()
    assert isinstance(failed.exception(), ValueError)
    gate = threading.Event()
    slow = worker.submit("slow call", lambda: gate.wait(10))
    later = worker.submit("later", lambda: 1)
    with pytest.raises(TimeoutError, match="later was not complete"):
        later.wait(timeout=0.05)  # with a timeout nothing runs inline: the caller only waits
    gate.set()
    assert slow.wait() and later.result() == 1
    worker.close()


def test_close_lets_queued_work_finish():
    worker = Worker("test")
    done = []
    works = [worker.submit(f"w{i}", lambda i=i: done.append(i)) for i in range(50)]
    worker.close()
    assert done == list(range(50)) and all(w.is_success() for w in works)
