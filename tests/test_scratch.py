"""The scratch pool (pycoll/scratch.py): buffers are reused across calls, never lent twice at once,
kept up to the cap (least recently returned dropped first), dropped when their borrower fails, and
emptied when the transport closes. Real calls over tcp and shm use it in tests/test_memory_flat.py,
test_collectives.py and test_soak.py."""
import threading
import time

import numpy as np
import pytest

from pycoll.scratch import MIN_POOLED, ScratchPool, borrow


def test_a_given_back_buffer_is_lent_again_for_any_size_of_its_class():
    pool = ScratchPool(64 << 20)
    first = pool.take(300 << 10)
    assert first.nbytes == 512 << 10 and first.dtype == np.uint8  # the power-of-two class at or above
    pool.give(first)
    again = pool.take(400 << 10)
    assert again is first
    assert pool.stats()["hits"] == 1 and pool.stats()["misses"] == 1 and pool.stats()["lent"] == 512 << 10


def test_two_borrowers_never_share_a_buffer():
    pool = ScratchPool(64 << 20)
    a, b = pool.take(1 << 20), pool.take(1 << 20)
    assert not np.shares_memory(a, b)
    pool.give(a)
    pool.give(b)
    assert pool.stats()["held"] == 2 << 20


def test_threads_taking_at_once_each_get_their_own():
    pool = ScratchPool(64 << 20)
    start, errors = threading.Barrier(8), []

    def borrower(i: int) -> None:
        start.wait()
        for _ in range(200):
            with borrow(pool, 256 << 10, np.uint8) as buf:
                buf[:] = i
                time.sleep(0)  # let the others take and write theirs meanwhile
                if not np.all(buf == i):
                    errors.append(i)
    threads = [threading.Thread(target=borrower, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert pool.stats()["lent"] == 0 and pool.stats()["buffers"] <= 8


def test_the_cap_drops_the_least_recently_returned_first():
    pool = ScratchPool(3 << 20)
    one, two = pool.take(1 << 20), pool.take(2 << 20)
    pool.give(one)
    pool.give(two)  # 3 MiB held: at the cap
    big = pool.take(2 << 20)
    assert big is two
    other = pool.take(2 << 20)  # a second 2 MiB buffer is mapped
    pool.give(big)  # 1 + 2 MiB: at the cap
    pool.give(other)  # the 1 MiB one, returned first, goes, then the first 2 MiB one
    stats = pool.stats()
    assert stats["held"] == 2 << 20 and stats["buffers"] == 1 and stats["evicted"] == 2
    assert pool.take(2 << 20) is other and pool.take(1 << 20) is not one


def test_a_buffer_larger_than_the_cap_is_never_kept():
    pool = ScratchPool(1 << 20)
    huge = pool.take(4 << 20)
    pool.give(huge)
    assert pool.stats()["held"] == 0 and pool.stats()["lent"] == 0
    none = ScratchPool(0)  # PYCOLL_SCRATCH_POOL=0: a fresh buffer per call
    buf = none.take(1 << 20)
    none.give(buf)
    assert none.take(1 << 20) is not buf


def test_a_failed_block_drops_its_buffer_and_small_ones_bypass_the_pool():
    pool = ScratchPool(64 << 20)
    with pytest.raises(RuntimeError):
        with borrow(pool, (2, 1 << 17), np.float32) as tmp:
            assert tmp.shape == (2, 1 << 17) and tmp.dtype == np.float32
            raise RuntimeError("a peer died")  # a late message may still land in tmp: not lent again
    assert pool.stats() == {"held": 0, "buffers": 0, "lent": 0, "hits": 0, "misses": 1, "evicted": 0}
    with borrow(pool, MIN_POOLED // 8 - 1, np.float64) as small:
        assert small.nbytes < MIN_POOLED
    assert pool.stats()["misses"] == 1  # made with np.empty, not counted
    with borrow(None, 1 << 20, np.uint8) as fresh:  # a transport without a pool
        assert fresh.nbytes == 1 << 20


def test_clear_lets_go_of_every_kept_buffer():
    pool = ScratchPool(64 << 20)
    pool.give(pool.take(1 << 20))
    pool.clear()
    assert pool.stats()["held"] == 0 and pool.stats()["buffers"] == 0
