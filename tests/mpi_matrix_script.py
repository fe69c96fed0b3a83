"""Run under `mpirun -np N` with PYCOLL_TRANSPORT=mpi (tests/test_mpi_transport.py drives it).

Every collective and algorithm over the mpi transport, mpi_native for every collective (world and
split communicators), transport point-to-point checks with MPI's tag space and with a 2-tag space
that forces hash collisions, and async calls on several communicators at once. Rank 0 prints one
line, RESULT_PREFIX + JSON {"ranks": [{"checked", "failures", "digests", "seconds", "thread_level"}]}.
"""
from __future__ import annotations

import faulthandler
import json
import os
import sys
import time
from typing import Callable, Dict, List, Tuple

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # collective_cases, under mpirun too

import pycoll  # noqa: E402
from collective_cases import CHECKS, run_matrix  # noqa: E402
from pycoll.channel import byte_view  # noqa: E402
from pycoll.errors import ProtocolError  # noqa: E402
from pycoll.ids import comm_hash  # noqa: E402
from pycoll.ops import DTYPE_CODES, bfloat16, dtype_code  # noqa: E402
from pycoll.selection import Selector  # noqa: E402
from pycoll.transports.base import MsgKey, Request  # noqa: E402
from pycoll.transports.mpi import EAGER_BYTES  # noqa: E402

RESULT_PREFIX = "MPI_MATRIX_RESULT "
P2P_COMM = comm_hash("mpi-transport-p2p-checks")  # keys no Communicator uses
TIMEOUT = 60.0
WATCHDOG = 80.0  # MPI's own collectives have no deadline: a hang dumps every thread's stack and exits


class P2P:
    """Point-to-point checks straight on the transport: each rank sends right and receives from the left."""

    def __init__(self, comm: pycoll.Communicator) -> None:
        self.tr, self.rank, self.n = comm.transport, comm.rank, comm.size
        self.right, self.left = (self.rank + 1) % self.n, (self.rank - 1) % self.n
        self.seq = 0
        self.checked = 0
        self.failures: List[str] = []

    def key(self, tag: int = 0) -> MsgKey:
        return MsgKey(P2P_COMM, self.seq, tag)

    @staticmethod
    def payload(sender: int, count: int, dtype: np.dtype, salt: int) -> np.ndarray:
        raw = np.random.default_rng([sender, count, salt]).integers(0, 256, count * dtype.itemsize, np.uint8)
        return raw.view(dtype)

    def check(self, label: str, fn: Callable[[], object]) -> None:
        self.seq += 1
        try:
            ok = fn()
        except Exception as e:
            ok = f"raised {type(e).__name__}: {e}"
        self.checked += 1
        if ok is not True:
            self.failures.append(f"p2p {label} (tag space {self.tr.tag_space}): {ok}")

    def send(self, arr: np.ndarray, tag: int = 0) -> Request:
        return self.tr.isend(byte_view(arr), self.right, self.key(tag), dtype_code(arr.dtype))

    def recv(self, arr: np.ndarray, tag: int = 0) -> Request:
        return self.tr.irecv(byte_view(arr), self.left, self.key(tag), dtype_code(arr.dtype))

    def exchange(self, sends: List[np.ndarray], recvs: List[np.ndarray]) -> None:
        """Message i goes out with tag i. The last is received first, alone, so a colliding earlier
        one is pulled out of MPI as unexpected; then the rest are received in reverse order."""
        out = [self.send(a, i) for i, a in enumerate(sends)]
        last = self.recv(recvs[-1], len(recvs) - 1)
        self.tr.wait([last], TIMEOUT, "p2p check, last message")
        into = [self.recv(recvs[i], i) for i in reversed(range(len(recvs) - 1))]
        self.tr.wait(into + out + [last], TIMEOUT, "p2p check")

    def roundtrip(self, count: int, dtype: np.dtype) -> object:
        sent = self.payload(self.rank, count, dtype, self.seq)
        got = np.zeros(count, dtype)
        self.exchange([sent], [got])
        want = self.payload(self.left, count, dtype, self.seq)
        return got.tobytes() == want.tobytes() or "payload differs"

    def out_of_order(self) -> object:
        sizes = [(7, 4 << 20, 0, EAGER_BYTES, EAGER_BYTES + 1)[i % 5] for i in range(20)]
        sends = [self.payload(self.rank, c, np.dtype(np.uint8), i) for i, c in enumerate(sizes)]
        recvs = [np.zeros(c, np.uint8) for c in sizes]
        self.exchange(sends, recvs)
        bad = [i for i, c in enumerate(sizes)
               if recvs[i].tobytes() != self.payload(self.left, c, np.dtype(np.uint8), i).tobytes()]
        return not bad or f"tags {bad} got the wrong payload"

    def same_key_fifo(self) -> object:
        sizes = [10, EAGER_BYTES + 10, 3, 200_000]
        out = [self.send(np.full(c, i, np.uint8)) for i, c in enumerate(sizes)]
        recvs = [np.zeros(c, np.uint8) for c in sizes]
        into = [self.recv(r) for r in recvs]
        self.tr.wait(into + out, TIMEOUT, "fifo check")
        return all((r == i).all() for i, r in enumerate(recvs)) or "same-key messages out of order"

    def mismatch(self, sent: np.ndarray, expect: np.ndarray) -> object:
        """A message that does not fit the receive: ProtocolError, the buffer untouched, the stream usable."""
        expect.view(np.uint8)[:] = 0xAB
        out, into = self.send(sent), self.recv(expect)
        try:
            self.tr.wait([into], TIMEOUT, "mismatch check")
            return "no ProtocolError"
        except ProtocolError:
            pass
        self.tr.wait([out], TIMEOUT, "mismatched send")
        if not (expect.view(np.uint8) == 0xAB).all():
            return "the receive buffer was written"
        return self.roundtrip(1000, np.dtype(np.float64))  # the same key again: still lined up

    def run(self) -> Dict[str, object]:
        dtypes = [*DTYPE_CODES, bfloat16()]
        for dtype in dtypes:
            for count in (0, 1, 1000, EAGER_BYTES // dtype.itemsize + 1):
                self.check(f"{dtype} x {count}", lambda: self.roundtrip(count, dtype))
        for nbytes in (1, EAGER_BYTES, 64 << 20):
            self.check(f"{nbytes} B", lambda: self.roundtrip(nbytes, np.dtype(np.uint8)))
        self.check("tags out of order", self.out_of_order)
        self.check("same key FIFO", self.same_key_fifo)
        for label, sent, expect in [
                ("16 B into 8 B", np.ones(4, np.float32), np.zeros(2, np.float32)),
                ("16 B of float32 into int32", np.ones(4, np.float32), np.zeros(4, np.int32)),
                ("1 MiB into 2 MiB", np.ones(1 << 18, np.float32), np.zeros(1 << 19, np.float32)),
                ("2 MiB into 1 MiB", np.ones(1 << 19, np.float32), np.zeros(1 << 18, np.float32)),
                ("1 MiB of float32 into int32", np.ones(1 << 18, np.float32), np.zeros(1 << 18, np.int32))]:
            self.check(f"mismatch {label}", lambda: self.mismatch(sent, expect))
        return {"checked": self.checked, "failures": self.failures}


def async_mixed(comm: pycoll.Communicator) -> Dict[str, object]:
    """Async collectives in flight at once on the world, a split, and dups (one on mpi_native)."""
    half = comm.split(comm.rank % 2, key=-comm.rank)
    dup, native = comm.dup(), comm.dup()
    a = np.full(300_000, comm.rank, np.float64)
    b = np.full(10, comm.rank + 1, np.int64)
    c = np.full(7, comm.rank, np.float32)
    d = np.full(100_000, comm.rank, np.int32)
    works = [comm.allreduce(a, async_op=True), half.allreduce(b, op="max", async_op=True),
             dup.broadcast(c, root=comm.size - 1, async_op=True),
             native.allreduce(d, async_op=True, algo="mpi_native"), comm.barrier(async_op=True)]
    for w in works:
        w.wait(timeout=TIMEOUT)
    n = comm.size
    want = {"a": sum(range(n)), "b": max(r + 1 for r in range(n) if r % 2 == comm.rank % 2),
            "c": n - 1, "d": sum(range(n))}
    got = {"a": a[0], "b": b[0], "c": c[0], "d": d[0]}
    same = all((arr == arr.reshape(-1)[0]).all() for arr in (a, b, c, d))
    for sub in (half, dup, native):
        sub.close()
    return {"checked": 1, "failures": [] if same and got == want else [f"got {got}, want {want}"]}


def forced_native(sub: pycoll.Communicator, collectives: Tuple[str, ...]) -> Dict[str, object]:
    """The matrix with mpi_native chosen the PYCOLL_ALGO way (gather/scatter/barrier take no algo=)."""
    sub.selector = Selector("mpi_native")
    with sub:
        return run_matrix(sub, collectives, False)


def two_tags(comm: pycoll.Communicator) -> Dict[str, object]:
    """The p2p checks and some collectives with only 2 MPI tags, so keys collide all the time."""
    tr, full = comm.transport, comm.transport.tag_space
    comm.barrier()  # all traffic before the switch is done on every rank
    tr.tag_space = 2
    p2p = P2P(comm).run()
    coll = run_matrix(comm, ("allreduce", "alltoallv", "broadcast"), False)
    comm.barrier()
    tr.tag_space = full
    return {"checked": p2p["checked"] + coll["checked"], "failures": p2p["failures"] + coll["failures"]}


class Tally:
    """Checked cases, failures and seconds per section of this rank's run."""

    def __init__(self) -> None:
        self.checked = 0
        self.failures: List[str] = []
        self.seconds: Dict[str, float] = {}

    def run(self, section: str, fn: Callable[[], Dict[str, object]]) -> Dict[str, object]:
        t = time.perf_counter()
        res = fn()
        self.seconds[section] = time.perf_counter() - t
        self.checked += int(res["checked"])
        self.failures += [f"[{section}] {f}" for f in res["failures"]]
        return res


def thread_level() -> str:
    from mpi4py import MPI  # initialized by now
    names = ("single", "funneled", "serialized", "multiple")
    return {getattr(MPI, f"THREAD_{name.upper()}"): name for name in names}[MPI.Query_thread()]


def main() -> None:
    faulthandler.dump_traceback_later(WATCHDOG, exit=True)
    with pycoll.init() as comm:
        assert comm.transport.name == "mpi", comm.transport.name
        tally = Tally()
        world = tally.run("matrix", lambda: run_matrix(comm, tuple(CHECKS), "--big" in sys.argv))
        tally.run("native world", lambda: forced_native(comm.dup(), ("gather", "scatter", "barrier")))
        tally.run("native split", lambda: forced_native(comm.split(comm.rank % 2, key=-comm.rank),
                                                        tuple(CHECKS)))
        tally.run("p2p", P2P(comm).run)
        tally.run("two MPI tags", lambda: two_tags(comm))
        tally.run("async", lambda: async_mixed(comm))
        mine = json.dumps({"checked": tally.checked, "failures": tally.failures, "digests": world["digests"],
                           "seconds": tally.seconds, "thread_level": thread_level()}).encode()
        sizes = comm.allgather(np.array([len(mine)], np.int64)).reshape(-1)
        blob = comm.allgatherv(np.frombuffer(mine, np.uint8), [int(s) for s in sizes])
        if comm.rank == 0:
            edges = np.concatenate([[0], np.cumsum(sizes)])
            ranks = [json.loads(blob[a:b].tobytes()) for a, b in zip(edges, edges[1:])]
            print(RESULT_PREFIX + json.dumps({"ranks": ranks}), flush=True)


if __name__ == "__main__":
    main()
