"""Allreduce over shm is right wherever the buffers start within their pages (the correctness half of
the offset matrix; benchmarks/shm_offsets.py times it): offsets 0, 8, 16, 64 and 2048+16 bytes, the
same on every rank or different per rank, plain and registered buffers, one-shot, two-shot across
several stage blocks and the registered path, in and out of place; results exact and the same bits
on every rank."""
import hashlib

import numpy as np
import pytest

from multiproc import run_ranks

pytestmark = pytest.mark.timeout(180)
SHM = {"PYCOLL_TRANSPORT": "shm"}
OFFSETS = (0, 8, 16, 64, 2048 + 16)


def _at(raw: np.ndarray, offset: int, count: int) -> np.ndarray:
    """`count` float32 starting `offset` bytes into a page of the uint8 array `raw`."""
    base = -raw.ctypes.data % 4096
    return raw[base + offset:base + offset + 4 * count].view(np.float32)


def _offset_matrix(comm):
    from pycoll.transports.shm_board import SLOT_BYTES, STAGE_BYTES
    n, r = comm.size, comm.rank
    bad, digests = [], []
    counts = (SLOT_BYTES // 4 - 3, 2 * STAGE_BYTES // 4 + 5)  # one-shot; two-shot over 3 stage blocks
    for count in counts:
        window = comm.empty(4 * count + 2 * 4096, np.uint8)
        plain = np.empty(4 * count + 2 * 4096, np.uint8)
        out_raw = np.empty(4 * count + 2 * 4096, np.uint8)
        for same in (True, False):
            for i, offset in enumerate(OFFSETS):
                mine = offset if same else OFFSETS[(i + r) % len(OFFSETS)]
                want = sum(np.arange(count, dtype=np.float32) % 97 + k for k in range(n))
                for kind, raw in (("plain", plain), ("registered", window)):
                    x = _at(raw, mine, count)
                    x[:] = np.arange(count, dtype=np.float32) % 97 + r
                    if kind == "plain":
                        out = _at(out_raw, OFFSETS[(i + 2) % len(OFFSETS)], count)
                        comm.allreduce(x, out=out)
                        if not np.array_equal(out, want):
                            bad.append(f"out of place {kind} count={count} offset={mine} same={same}")
                    comm.allreduce(x)
                    if not np.array_equal(x, want):
                        bad.append(f"{kind} count={count} offset={mine} same={same}")
                    x[:] = np.random.default_rng([r, count, i]).standard_normal(count).astype(np.float32)
                    comm.allreduce(x)
                    digests.append(hashlib.sha1(x.tobytes()).hexdigest())
        comm.free(window)
    return bad, digests


@pytest.mark.parametrize("n", [2, 4])
def test_allreduce_is_right_at_every_buffer_offset(n):
    results = run_ranks(_offset_matrix, n, env=SHM, timeout=170)
    for rank, (bad, digests) in enumerate(results):
        assert not bad, f"rank {rank}: {bad}"
        assert digests == results[0][1], f"rank {rank} got other bits than rank 0"
