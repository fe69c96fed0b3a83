"""PYCOLL_DEBUG=DETAIL: ranks that disagree on a call all raise, naming the first rank that differs.

Without DETAIL the transport's header check still turns a size or dtype mismatch into a
ProtocolError on every rank (never a hang or garbage). A different op or broadcast root cannot be
seen in the messages: those calls complete with results that differ between ranks. Different
collectives usually fail (ProtocolError, or TimeoutError after PYCOLL_TIMEOUT), but when their
messages happen to agree in size (allreduce against allgather on 2 ranks) they complete with wrong
results. Only DETAIL catches all of these.
"""
from __future__ import annotations

import hashlib
import time
from typing import Any, Callable, Dict, Tuple

import numpy as np
import pytest

from collective_cases import run_matrix
from multiproc import run_ranks
from pycoll.selection import IMPLEMENTATIONS

TCP = {"PYCOLL_TRANSPORT": "tcp"}
DETAIL = {**TCP, "PYCOLL_DEBUG": "DETAIL"}
PLAIN = {**TCP, "PYCOLL_TIMEOUT": "3"}  # a call waiting on a message that never comes fails after 3 s


def _x(comm, count: int = 10, dtype: Any = np.float32) -> np.ndarray:
    return np.full(count, comm.rank + 1, dtype)


def _counts(n: int, odd: bool) -> list:
    """allgatherv counts: the same total everywhere, split differently on the odd ranks."""
    return [1] + [2] * (n - 2) + [3] if odd else [2] * n


# case -> (what a rank calls, given whether it is one of the odd ranks; the field DETAIL names)
MISMATCHES: Dict[str, Tuple[Callable[[Any, bool], Any], str]] = {
    "count": (lambda c, odd: c.allreduce(_x(c, 10 + odd)), "count"),
    "dtype": (lambda c, odd: c.allreduce(_x(c, 10, np.int32 if odd else np.float32)), "dtype"),
    "op": (lambda c, odd: c.allreduce(_x(c), op="max" if odd else "sum"), "op"),
    "root": (lambda c, odd: c.broadcast(_x(c), root=1 if odd else 0), "root"),
    "collective": (lambda c, odd: c.broadcast(_x(c)) if odd else c.allreduce(_x(c)), "collective"),
    "per-rank counts": (lambda c, odd: c.allgatherv(_x(c, _counts(c.size, odd)[c.rank]), _counts(c.size, odd)),
                        "per-rank counts"),
    "reduce_scatter counts": (lambda c, odd: c.reduce_scatter(_x(c, 2 * c.size), counts=_counts(c.size, odd)),
                              "per-rank counts"),
    "async count": (lambda c, odd: c.allreduce(_x(c, 10 + odd), async_op=True).wait(), "count"),
    "count on a dup": (lambda c, odd: c.dup().allreduce(_x(c, 10 + odd)), "count"),
}


def _mismatches(comm) -> Dict[str, Dict[str, Any]]:
    """Run every case (ranks in the upper half odd), each followed by a sum that must come out right."""
    import pycoll
    outcomes = {}
    for case, (call, _) in MISMATCHES.items():
        t0 = time.monotonic()
        try:
            got = call(comm, comm.rank >= comm.size // 2)
            outcome = {"error": None, "result": hashlib.sha1(np.asarray(got).tobytes()).hexdigest()}
        except pycoll.PycollError as e:
            outcome = {"error": type(e).__name__, "message": str(e), "peer": getattr(e, "peer", None),
                       "value_error": isinstance(e, ValueError), "protocol": isinstance(e, pycoll.ProtocolError)}
        outcome["took"] = time.monotonic() - t0
        check = comm.allreduce(np.ones(5, np.int64))
        outcome["after"] = check.tolist() == [comm.size] * 5
        outcomes[case] = outcome
    return outcomes


@pytest.fixture(scope="module")
def detail():
    return run_ranks(_mismatches, 4, env=DETAIL, timeout=90)


@pytest.fixture(scope="module")
def plain():
    return run_ranks(_mismatches, 2, env=PLAIN, timeout=120)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", MISMATCHES)
def test_detail_names_the_first_differing_rank_and_field(detail, case):
    field = MISMATCHES[case][1]
    for rank, outcomes in enumerate(detail):
        got = outcomes[case]
        assert got["error"] == "MismatchError", (rank, got)
        assert got["value_error"] and got["protocol"] and got["peer"] == 2, (rank, got)
        assert f"disagree on the {field}: rank 2 called" in got["message"], (rank, got)
        assert "but rank 0 called" in got["message"], (rank, got)
        assert f"rank {rank} of 4" in got["message"]  # each rank names its own call
        assert got["after"], f"rank {rank}: the communicator broke after the {case} mismatch"


@pytest.mark.timeout(120)
def test_detail_message_spells_out_both_calls(detail):
    msg = detail[1]["collective"]["message"]
    assert msg.startswith("allreduce (call ") and "rank 2 called broadcast (count 10, float32, root 0) " \
        "but rank 0 called allreduce (count 10, float32, op sum)" in msg, msg
    assert "allgatherv (count 8 split " in detail[0]["per-rank counts"]["message"]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("case", ["count", "dtype", "per-rank counts", "reduce_scatter counts", "async count",
                                  "count on a dup"])
def test_without_detail_size_and_dtype_mismatches_are_protocol_errors(plain, case):
    for rank, outcomes in enumerate(plain):
        got = outcomes[case]
        assert got["error"] == "ProtocolError" and "different sizes or dtypes" in got["message"], (rank, got)
        assert got["took"] < 2 and got["after"], (rank, got)


@pytest.mark.timeout(150)
def test_without_detail_a_different_collective_fails_within_the_timeout(plain):
    for got in (outcomes["collective"] for outcomes in plain):
        assert got["error"] in ("ProtocolError", "TimeoutError") and got["took"] < 3 + 5 and got["after"], got


@pytest.mark.timeout(150)
@pytest.mark.parametrize("case", ["op", "root"])
def test_without_detail_op_and_root_mismatches_go_unnoticed(plain, case):
    """Documented limit: nothing on the wire differs, so only DETAIL catches these."""
    first, second = (outcomes[case] for outcomes in plain)
    assert first["error"] is second["error"] is None and first["after"] and second["after"]
    assert first["result"] != second["result"]  # the ranks silently disagree


@pytest.mark.timeout(180)
def test_detail_has_no_false_positives_on_the_collective_matrix():
    """Every collective x algorithm x count x dtype/op, on 3 ranks (non power of two), under DETAIL."""
    results = run_ranks(run_matrix, 3, tuple(IMPLEMENTATIONS), False, timeout=170, env=DETAIL)
    assert all(r["checked"] > 500 and not r["failures"] for r in results), [r["failures"][:3] for r in results]
    assert len({tuple(r["digests"]) for r in results}) == 1


@pytest.fixture(scope="module")
def plain_shm():
    """The same mismatches over shm, where these small calls run on the shared-memory board."""
    return run_ranks(_mismatches, 2, env={"PYCOLL_TRANSPORT": "shm", "PYCOLL_TIMEOUT": "3"}, timeout=120)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("case", MISMATCHES)
def test_without_detail_the_board_turns_every_mismatch_into_a_protocol_error(plain_shm, case):
    """Board posts carry their size and a signature (dtype, collective, op, root), so over shm even the
    op and root mismatches that tcp cannot see are caught; allgatherv keeps to messages."""
    for rank, outcomes in enumerate(plain_shm):
        got = outcomes[case]
        assert got["error"] == "ProtocolError", (rank, got)
        assert "different sizes" in got["message"] or "different collectives" in got["message"], (rank, got)
        assert got["took"] < 2 and got["after"], (rank, got)
