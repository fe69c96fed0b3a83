"""Pairwise-exchange alltoall(v): n-1 steps, at step k rank r sends its block for r+k and receives
the block from r-k; (n-1)/n * S bytes out and in per rank, one peer at a time."""
from __future__ import annotations

from typing import List, Sequence

import numpy as np

from ..channel import Channel
from ..transports.base import Request


def alltoall(ch: Channel, send: np.ndarray, recv: np.ndarray) -> None:
    """Block i of `send` (send.size // n elements) goes to rank i; block i of `recv` comes from rank i."""
    n = ch.size
    block = send.size // n
    counts, displs = [block] * n, [i * block for i in range(n)]
    alltoallv(ch, send, counts, displs, recv, counts, displs)


def alltoallv(ch: Channel, send: np.ndarray, send_counts: Sequence[int], send_displs: Sequence[int],
              recv: np.ndarray, recv_counts: Sequence[int], recv_displs: Sequence[int]) -> None:
    """send[send_displs[i]:+send_counts[i]] goes to rank i; recv[recv_displs[i]:+recv_counts[i]]
    comes from rank i (counts and displacements in elements)."""
    n, r = ch.size, ch.rank

    def out(i: int) -> np.ndarray:
        return send[send_displs[i]: send_displs[i] + send_counts[i]]

    def into(i: int) -> np.ndarray:
        return recv[recv_displs[i]: recv_displs[i] + recv_counts[i]]

    np.copyto(into(r), out(r))
    for k in range(1, n):
        dst, src = (r + k) % n, (r - k) % n
        reqs: List[Request] = []
        if recv_counts[src]:
            reqs.append(ch.irecv(into(src), src, tag=k))
        if send_counts[dst]:
            reqs.append(ch.isend(out(dst), dst, tag=k))
        ch.wait(*reqs)
