"""Several tcp streams per pair of ranks (PYCOLL_NSOCKS): payloads cut over them arrive whole, in
tag/FIFO order, with mismatches and dead peers reported as with one stream; each stream's hello
is bound to its index. Forced on loopback here (auto opens one stream on a host); the emulated
cluster (test_emulated_cluster.py) shows the rate it buys under a per-flow cap."""
import secrets

import pytest

from collective_cases import run_matrix
from multiproc import run_ranks
from test_collectives import ALL, _assert_matrix
from test_faults import BOUND_S, N, VICTIM, _killed_mid_allreduce
from test_p2p import BULK, _large, _mismatch, _out_of_order
from pycoll.transports import wire

# every payload from 1 KiB on goes on the streams, and from 8 KiB on in 2-3 parts
STRIPED = {"PYCOLL_TRANSPORT": "tcp", "PYCOLL_NSOCKS": "3", "PYCOLL_TCP_BULK_THRESHOLD": "1K",
           "PYCOLL_TCP_STRIPE_MIN": "1"}


def _streams(comm):
    bulk = comm.transport._bulk
    return {peer: (len(socks), bulk.stripes[peer]) for peer, socks in bulk.socks.items()}


@pytest.mark.timeout(120)
def test_streams_per_pair_forced_and_auto_on_one_host():
    got = run_ranks(_streams, 3, env=STRIPED)
    assert got == [{p: (3, 3) for p in range(3) if p != r} for r in range(3)]
    # auto on one host: one stream per pair, loopback has no per-flow cap to beat
    got = run_ranks(_streams, 2, env={"PYCOLL_TRANSPORT": "tcp"})
    assert got == [{1: (1, 1)}, {0: (1, 1)}]
    # the pair takes the smaller of its two ranks' wishes: rank 1 with 2, the others with 3
    got = run_ranks(_streams, 2, env={**STRIPED, "PYCOLL_NSOCKS": "2"})
    assert got == [{1: (2, 2)}, {0: (2, 2)}]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("n,big", [(2, True), (3, False), (4, False)])
def test_collective_matrix_over_three_streams(n, big):
    """Every collective and algorithm, odd counts (1009, 1_000_003) included, cut over 3 streams."""
    _assert_matrix(run_ranks(run_matrix, n, ALL, big, timeout=560, env=STRIPED))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("count,mixed", [(BULK, False), (BULK, True), (1_000_003, False)])
def test_tags_out_of_order_and_fifo_within_a_tag(count, mixed):
    """Striped payloads received in another order than sent are parked whole and delivered later."""
    assert run_ranks(_out_of_order, 2, count, mixed, env=STRIPED)[1] == [3, 1, 2, 10, 11, 12]


@pytest.mark.timeout(120)
def test_64_mib_message_over_three_streams():
    assert run_ranks(_large, 2, env=STRIPED)[1] is True


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [BULK, 1_000_003])
def test_mismatch_is_an_error_and_the_streams_stay_in_step(n):
    _, (size_msg, dtype_msg, intact) = run_ranks(_mismatch, 2, n, env=STRIPED)
    assert f"{4 * n} bytes" in size_msg and f"expects {8 * n} bytes" in size_msg and "rank 0" in size_msg
    assert "dtype" in dtype_msg and intact


@pytest.mark.timeout(120)
def test_survivors_name_the_dead_rank_within_5s():
    results = run_ranks(_killed_mid_allreduce, N, VICTIM, expect_fail=True, timeout=90,
                        env={**STRIPED, "PYCOLL_TIMEOUT": "30"})
    for rank, (ok, value) in enumerate(results):
        if rank == VICTIM:
            assert not ok and "code -9" in value
            continue
        assert ok, value
        kind, peer, msg, took = value
        assert kind == "PeerError" and peer == VICTIM and took < BOUND_S, (rank, kind, peer, took, msg)


def test_a_stream_hello_opens_only_its_own_index_once():
    token = secrets.token_bytes(32)
    hello = wire.make_hello(token, 3, 1, secrets.token_bytes(16), wire.bulk_purpose(2))
    seen: set = set()
    assert wire.check_bulk_hello(token, 1, hello, seen) == (3, 2)
    with pytest.raises(ValueError, match="replayed"):
        wire.check_bulk_hello(token, 1, hello, seen)
    with pytest.raises(ValueError, match="wrong job token"):
        wire.check_bulk_hello(secrets.token_bytes(32), 1, hello, set())
    with pytest.raises(ValueError, match="not 2"):  # addressed to another rank
        wire.check_bulk_hello(token, 2, hello, set())
    with pytest.raises(ValueError, match="wrong job token"):  # a zmq hello is no bulk hello
        wire.check_bulk_hello(token, 1, wire.make_hello(token, 3, 1, secrets.token_bytes(16)), set())
