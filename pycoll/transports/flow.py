"""Credit flow control of eager messages: a rank running ahead cannot fill its peers' memory.

A message that arrives before its receive is posted waits in the receiver's memory (zmq's queues,
then the unexpected table). Without a bound, a rank that runs ahead (a root broadcasting in a
loop while its peers sleep) makes them buffer everything it sends: 10,000 broadcasts of 8 B to
64 KiB held ~130 MiB on each receiving rank. Here a sender may have at most `window` bytes' worth
of messages (see cost()) unconsumed at each peer, like NCCL's fixed per-peer buffers (NCCL_BUFFSIZE,
4 MiB). Sends past the window wait, in order, their requests not done, until the receiver hands
credit back as it consumes messages, in batches of a quarter window (a control message of its
own). The common path (a small message, its receive posted, the sender inside its window) only
counts.

Deadlock freedom: a sender whose held sends have waited ASK_AFTER s with no credit coming asks
for it (ASK; one at a time, so a peer that sleeps gets one, not one per ASK_AFTER). The receiver
then returns all it has consumed, or, if that is nothing, returns credit as soon as it consumes
its next message. So a sender waits only while its peer holds a full window of its messages
unconsumed, which the peer consumes in order: unless the program needs more than a window of
messages buffered at a peer that is blocked on a later one (two ranks that each send more than a
window before receiving anything; calls on two communicators in opposite orders), which deadlock
in NCCL and Gloo as well. A message bigger than the window goes when nothing else is in flight.
Asking only after a while keeps a sender streaming at the window's edge from turning every
message into a credit round trip: while the receiver consumes, batches come back by themselves.

The transport keeps both halves: the sender's state of peer p is guarded by the transport's send
lock of p (which also orders the sends), the receiver's by a lock here.
"""
from __future__ import annotations

import math
import threading
from collections import deque
from typing import Any, Callable, Deque, Iterable, List, Tuple

OVERHEAD = 512  # what holds a message besides its payload: frames, queue entries, table entries
PINNED = 8192   # zmq receives small messages in place in a read buffer of 8 KiB (ZMQ_IN_BATCH_SIZE)
# that stays allocated while any of them lives: a message that came alone in a read holds all of it
ASK_AFTER = 0.002  # s a held send waits for credit before its sender asks for it

Start = Callable[[], None]  # performs a send that was held back (the transport's send lock held)


def cost(nbytes: int) -> int:
    """What a message of `nbytes` can hold at its receiver before it is consumed, at most."""
    return (nbytes if nbytes > PINNED else PINNED) + OVERHEAD


class Credits:
    """Per-peer credit windows for the eager messages of one transport (both directions)."""

    def __init__(self, peers: Iterable[int], size: int, window: int) -> None:
        self.window = window
        self._batch = max(1, window // 4)
        self._peers = set(peers)
        # sender half, per peer (guarded by the transport's send lock of that peer)
        self._avail: List[int] = [window] * size          # cost the peer can still take from us
        self._held: List[Deque[Tuple[int, Start, Any]]] = [deque() for _ in range(size)]  # (cost, start, req)
        self._ask_at: List[float] = [math.inf] * size     # when to ASK the peer for credit (sends held, none asked)
        self.held = 0                                     # sends held back now, to all peers
        self._count = threading.Lock()                    # `held` changes under different peers' locks
        # receiver half, per peer
        self._lock = threading.Lock()
        self._owed: List[int] = [0] * size                # consumed, not yet returned
        self._starving: List[bool] = [False] * size       # the peer waits on credit: return at once
        self.held_back = 0   # sends that had to wait (for tests and probes)
        self.asks = 0        # ASK messages answered

    # -- sender -------------------------------------------------------------------------------------
    def admit(self, peer: int, nbytes: int) -> bool:
        """Take a message of `nbytes` from the peer's window and return True (send now), or False: the
        send has to wait, behind earlier held sends to that peer (call hold)."""
        need = (nbytes if nbytes > PINNED else PINNED) + OVERHEAD  # cost(), inline: every send pays it
        avail = self._avail[peer]
        if self._held[peer] or (avail < need and avail < self.window):
            return False
        self._avail[peer] = avail - need
        return True

    def hold(self, peer: int, nbytes: int, start: Start, req: Any, now: float) -> None:
        """Queue a send that may not go yet (behind the peer's earlier held sends)."""
        if not self._held[peer]:
            self._ask_at[peer] = now + ASK_AFTER
        self._held[peer].append((cost(nbytes), start, req))
        with self._count:
            self.held += 1
            self.held_back += 1

    def credit(self, peer: int, amount: int, now: float) -> List[Start]:
        """The peer returned `amount`: the held sends that may go now, to start in this order."""
        self._avail[peer] = min(self.window, self._avail[peer] + amount)
        ready: List[Start] = []
        held = self._held[peer]
        while held:
            need, start, _ = held[0]
            avail = self._avail[peer]
            if avail < need and avail < self.window:
                break
            held.popleft()
            self._avail[peer] = avail - need
            ready.append(start)
        if ready:
            with self._count:
                self.held -= len(ready)
        self._ask_at[peer] = now + ASK_AFTER if held else math.inf
        return ready

    def asks_due(self, now: float) -> Tuple[List[int], float]:
        """The peers to ASK for credit now (no more ASKs to them until credit comes), and the seconds
        until the next one is due (inf if none)."""
        due, wait = [], math.inf
        if self.held:
            for peer in self._peers:
                at = self._ask_at[peer]
                if at <= now:
                    due.append(peer)
                    self._ask_at[peer] = math.inf  # until its answer (credit) comes
                else:
                    wait = min(wait, at - now)
        return due, wait

    def drop(self, peer: int) -> List[Any]:
        """Forget the held sends to a peer that is gone; their requests, to fail."""
        reqs = [req for _, _, req in self._held[peer]]
        self._held[peer].clear()
        with self._count:
            self.held -= len(reqs)
        self._ask_at[peer] = math.inf
        return reqs

    def forget(self, peer: int) -> List[Any]:
        """The peer is gone for good (agreed dead): drop its held sends (their requests, to fail) and
        every count kept for it both ways, so nothing is asked of it, owed to it or shown for it."""
        reqs = self.drop(peer)
        self._peers.discard(peer)
        self._avail[peer] = self.window
        with self._lock:
            self._owed[peer], self._starving[peer] = 0, False
        return reqs

    # -- receiver -----------------------------------------------------------------------------------
    def consumed(self, peer: int, nbytes: int) -> int:
        """A message of `nbytes` from `peer` left our buffers; the credit to return to it now (0: none yet)."""
        need = (nbytes if nbytes > PINNED else PINNED) + OVERHEAD
        with self._lock:
            owed = self._owed[peer] + need
            if owed < self._batch and not self._starving[peer]:
                self._owed[peer] = owed
                return 0
            self._owed[peer] = 0
            self._starving[peer] = False
            return owed

    def asked(self, peer: int) -> int:
        """The peer waits on credit: what to return now; if nothing, return at the next consume."""
        with self._lock:
            self.asks += 1
            owed, self._owed[peer] = self._owed[peer], 0
            self._starving[peer] = not owed
            return owed

    def stats(self) -> dict:
        return {"window": self.window, "in_flight": {p: self.window - self._avail[p] for p in sorted(self._peers)},
                "held": self.held, "held_back": self.held_back, "owed": dict(enumerate(self._owed)),
                "asks": self.asks}
