"""RDMA transport on pyverbs: one reliable-connected queue pair per peer, credit flow control.

Every message is a SEND into one of the peer's pre-posted receive slots, starting with the wire
header and a verbs trailer (operation, returned credits, message id, and for CTS an rkey/address):
  EAGER   payloads up to the slot size, copied into a registered send slot; the receiver copies
          them out of its slot (or hands the slot to the receive's sink: no copy at all).
  RTS     announces a larger message. The receiver matches it with a posted receive, registers
          that buffer (MR cache) and answers CTS with address, rkey and chunk size, or NACK when
          the sizes differ; the sender then RDMA-WRITEs straight from its own registered buffer,
          chunk by chunk, each WITH IMM = message id, so the receiver sees every chunk land (a
          sink reduces it right there: the chunk is already in the receive's own buffer).
  CREDIT  returns receive slots when no message goes the other way to carry them.
  HELLO   first on each queue pair: proves the job token (HMAC); BYE: a normal close.
Each SEND and WRITE WITH IMM consumes one receive slot at the peer, so it costs one credit; the
peer returns them in the trailer of its next message. Data needs two credits and CREDIT one, so
two ranks that both run dry can always hand each other their slots back (no deadlock).

Waiting polls the completion queue for a short spin (PYCOLL_VERBS_SPIN_US), then blocks on the
completion channel. While it waits on a silent peer it sends that peer a probe (an 8-byte RDMA
write) every second; a dead peer's queue pair is gone, so the probe fails after the retry timeout.
"""
from __future__ import annotations

import json
import logging
import secrets
import select
import struct
import threading
import time
from collections import deque
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Tuple

from .. import config
from ..bootstrap.store import Store
from ..errors import EnvError, PeerError, ProtocolError, TimeoutError
from . import wire
from .base import Request, Transport
from .request import ANY
from .capabilities import SinkReceive
from .matching import fail, fail_all
from .verbs_device import (LandingPool, MrCache, Port, Registration, SlotPool, load_pyverbs, open_channel,
                           open_port)

log = logging.getLogger("pycoll.verbs")


LANDING_KEEP = 64 << 20  # idle landing-buffer bytes kept for reuse
PROBE_AFTER = 1.0  # seconds without any completion before a waiter probes the peers it waits on
_LINGER = 5.0      # close(): at most this long to flush what was sent
_BYE_WAIT = 0.5    # close(): how long to wait for peers closing at the same moment to say bye

TRAILER = struct.Struct("<BxxxIIIIQ4x")  # op, credits returned, message id, rkey, chunk, address
PREFIX = wire.HEADER.size + TRAILER.size


def eager_max() -> int:
    """The largest payload sent eagerly (in a receive slot) under the current PYCOLL_VERBS_SLOT."""
    return config.get("PYCOLL_VERBS_SLOT") - PREFIX
OP_EAGER, OP_RTS, OP_CTS, OP_NACK, OP_CREDIT, OP_HELLO, OP_BYE = range(7)
_DATA, _CONTROL = 2, 1  # credits a message needs: data keeps the last one for CREDIT/BYE
_RECV_BIT = 1 << 62
_POLL_BATCH = 16
_CONTROL_HEADER = wire.pack_header(wire.KIND_DATA, 0, 0, 0, 0, 0)
_WC_STATUS = {1: "local length error", 2: "local QP operation error", 4: "local protection error",
              5: "flushed: the queue pair is in the error state", 7: "bad response",
              8: "local access error", 9: "remote invalid request", 10: "remote access error",
              11: "remote operation error", 12: "transport retries exhausted: no answer from the peer",
              13: "RNR retries exhausted"}
_BYE_HEADER = wire.pack_header(wire.KIND_BYE, 0, 0, 0, 0, 0)


class _Peer:
    """One remote rank: its queue pair, credits, and the sends waiting for credits."""

    def __init__(self, rank: int, credits: int) -> None:
        self.rank = rank
        self.qp: Any = None
        self.psn = secrets.randbits(24)
        self.recv_wrs: List[Any] = []
        self.credits = credits   # receive slots the peer has posted for us that we have not used
        self.owed = 0            # slots we reposted for it and have not told it about
        self.sq_used = 0
        # (credits needed, needs a send slot, post one work request -> finished?, request or None)
        self.backlog: Deque[Tuple[int, bool, Callable[[], bool], Optional[Request]]] = deque()
        self.next_id = 0
        self.hello = self.bye = self.dead = self.probing = False
        self.device = "?"  # its RDMA device, as it published it
        self.probe_target = (0, 0)  # (address, rkey) of the peer's probe word


class _Transfer:
    """A large message in flight: the request, the registered memory it moves through, progress.

    The memory is the user's buffer (a registration from the MR cache) or, for a receive with a
    sink, a landing buffer: the sink may read the receive's own buffer as an operand (allreduce
    reduces `incoming op buf` into buf), so the payload must land apart from it.
    """

    __slots__ = ("req", "reg", "land", "addr", "done_bytes", "posted", "remote")

    def __init__(self, req: Request, reg: Optional[Registration], addr: int,
                 land: Optional[SlotPool] = None) -> None:
        self.req, self.reg, self.land, self.addr = req, reg, land, addr
        self.done_bytes = self.posted = 0
        self.remote = (0, 0, 0)  # sender side: (address, rkey, chunk) from the CTS

    @property
    def mr(self) -> Any:
        return self.land.mr if self.land is not None else self.reg.mr


_Arrival = Tuple[wire.Header, Optional[bytes], int]  # header, eager payload or None (RTS), msg id


class VerbsTransport(Transport):
    """Tagged point-to-point over RDMA (InfiniBand or RoCE, soft-RoCE included) with pyverbs."""

    name = "verbs"
    fragile_because = ("a dead peer's queue pair goes to the error state and this transport neither revokes, "
                       "settles nor reconnects queue pairs")

    def __init__(self, rank: int, size: int, address: Optional[str] = None,
                 hosts: Optional[List[str]] = None, *, peers: Optional[Sequence[int]] = None) -> None:
        """`peers`: the ranks it may connect to (default all; AutoTransport passes those on other
        hosts, then limit_to() the ones whose port shares its network). Opens the device and
        registers its slots here, so a rank that cannot use verbs knows before it says it can."""
        super().__init__(rank, size)
        self.capabilities[SinkReceive] = SinkReceive()
        self._pv = pv = load_pyverbs()
        self._slot = config.get("PYCOLL_VERBS_SLOT")        # bytes per receive slot: the eager limit
        self._eager_max = eager_max()
        self._credits = credits = config.get("PYCOLL_VERBS_CREDITS")  # receive slots per peer
        self._spin_s = config.get("PYCOLL_VERBS_SPIN_US") * 1e-6  # CQ polling before blocking on the channel
        self._ack_timeout = config.get("PYCOLL_VERBS_ACK_TIMEOUT")  # 4.096 us * 2**n per try, 6 retries
        self._candidates = sorted(set(range(size) if peers is None else peers) - {rank})
        self._active = list(self._candidates)  # the peers connect() reaches (limit_to)
        self._index = {r: i for i, r in enumerate(self._candidates)}  # peer -> its block of receive slots
        npeers = len(self._candidates)
        self._ctx, port = open_port(pv, config.get("PYCOLL_IB_DEV") or "")
        self.port: Port = port
        e = pv.e
        try:
            self._pd = pv.pd.PD(self._ctx)
            self._channel, self._fd = open_channel(pv, self._ctx)
            self._sq_depth = 2 * credits
            self._cq = pv.cq.CQ(self._ctx, npeers * (credits + self._sq_depth) + 16, None, self._channel, 0)
            local_write = e.IBV_ACCESS_LOCAL_WRITE
            self._recv = SlotPool(pv, self._pd, max(1, npeers) * credits, self._slot, local_write)
            self._send = SlotPool(pv, self._pd, max(16, min(credits * npeers, 128)), self._slot, local_write)
            self._probe = SlotPool(pv, self._pd, 1, 64, local_write | e.IBV_ACCESS_REMOTE_WRITE)
        except pv.Error as err:
            self._ctx.close()
            raise EnvError(f"rank {rank}: cannot set up RDMA resources on {port.device}: {err} (the locked-"
                           "memory limit? `ulimit -l unlimited`)") from err
        self._free_slots = list(range(self._send.count))
        self._mrs = MrCache(pv, self._pd, config.get("PYCOLL_VERBS_MR_CACHE"))
        self._landing = LandingPool(pv, self._pd, LANDING_KEEP)
        self._chunk = min(config.get("PYCOLL_VERBS_CHUNK"), self.port.max_msg) // 16 * 16
        self._peers = [_Peer(r, credits) for r in range(size)]
        self._lock = threading.Lock()      # all state below, and every verbs call on the queues
        self._leader = threading.Lock()    # held by the one thread blocked on the channel
        self._cond = threading.Condition()
        self._generation = 0               # bumped whenever the leader stops waiting
        self._last_completion = 0.0        # when the CQ last had something (probes wait for quiet)
        self._probed = 0.0                 # when waiters last probed silent peers (AutoTransport waits
        # in 1 ms slices: the quiet second is counted across them)
        self._wrs: Dict[int, Tuple[_Peer, int, Optional[Callable[[], None]]]] = {}  # on success
        self._next_wr = 0
        self._incoming: Dict[Tuple[int, int], _Transfer] = {}  # (peer, msg id) -> receive
        self._outgoing: Dict[Tuple[int, int], _Transfer] = {}  # (peer, msg id) -> send
        self._token = b""
        self._closing = False
        self.rejected = 0

    def limit_to(self, peers: Sequence[int]) -> None:
        """Before connect(): reach only `peers` (of those given at construction)."""
        extra = sorted(set(peers) - set(self._candidates))
        if extra:
            raise ValueError(f"rank {self.rank}: verbs was set up for ranks {self._candidates}, not {extra}")
        self._active = sorted(set(peers))

    # -- connection set-up -------------------------------------------------------------------
    def _create_qp(self, peer: _Peer) -> None:
        pv, e = self._pv, self._pv.e
        cap = pv.qp.QPCap(max_send_wr=self._sq_depth, max_recv_wr=self._credits, max_send_sge=1, max_recv_sge=1)
        init = pv.qp.QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self._cq, rcq=self._cq, cap=cap, sq_sig_all=1)
        peer.qp = pv.qp.QP(self._pd, init)
        attr = pv.qp.QPAttr(port_num=self.port.port)
        attr.qp_access_flags = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE
        attr.pkey_index = 0
        peer.qp.to_init(attr)
        for i in range(self._credits):
            slot = self._index[peer.rank] * self._credits + i
            sge = pv.wr.SGE(self._recv.addr(slot), self._slot, self._recv.mr.lkey)
            peer.recv_wrs.append(pv.wr.RecvWR(wr_id=_RECV_BIT | slot, num_sge=1, sg=[sge]))
            peer.qp.post_recv(peer.recv_wrs[-1])

    def connect(self, store: Store, token: bytes, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        self._token = token
        for peer in self._others():
            self._create_qp(peer)
        me = {"dev": self.port.device, "gid": self.port.gid, "lid": self.port.lid, "mtu": self.port.mtu,
              "qpn": [p.qp.qp_num if p.qp else 0 for p in self._peers],
              "psn": [p.psn for p in self._peers],
              "probe": [self._probe.base, self._probe.mr.rkey]}
        store.set(f"verbs/{self.rank}", json.dumps(me).encode())
        for peer in self._others():
            raw = store.get(f"verbs/{peer.rank}", max(0.0, deadline - time.monotonic()))
            self._connect_qp(peer, raw)
        store.set(f"verbs/{self.rank}/ready", b"1")  # our queue pairs accept packets from now on
        for peer in self._others():
            store.get(f"verbs/{peer.rank}/ready", max(0.0, deadline - time.monotonic()))
        with self._lock:
            for peer in self._others():
                hello = wire.make_hello(token, self.rank, peer.rank, secrets.token_bytes(16))
                header = wire.pack_header(wire.KIND_HELLO, 0, 0, 0, 0, len(hello))
                self._queue(peer, _CONTROL, lambda p=peer, h=header, b=hello:
                            self._post_message(p, OP_HELLO, h, memoryview(b)))
        while not all(p.hello for p in self._others()):
            left = deadline - time.monotonic()
            if left <= 0:
                missing = [p.rank for p in self._others() if not p.hello]
                raise TimeoutError(f"rank {self.rank}: verbs transport heard no authenticated hello from "
                                   f"ranks {missing} within {timeout:g} s", peers=missing)
            self._wait_once(min(left, PROBE_AFTER))
            if self.matcher.broken is not None:
                raise self.matcher.broken

    def _connect_qp(self, peer: _Peer, raw: bytes) -> None:
        """Move the queue pair to `peer` to ready-to-send, from the connection data it published."""
        pv = self._pv
        try:
            info = json.loads(raw)
            qpn, psn = int(info["qpn"][self.rank]), int(info["psn"][self.rank])
            gid, lid, mtu = str(info["gid"]), int(info["lid"]), int(info["mtu"])
            peer.device = str(info.get("dev", "?"))
            probe_addr, probe_rkey = (int(v) for v in info["probe"])
        except (ValueError, KeyError, IndexError, TypeError) as e:
            raise ProtocolError(f"rank {self.rank}: rank {peer.rank} published unusable verbs connection "
                                f"data ({e}): is it running the same pycoll version?", peer.rank) from e
        attr = pv.qp.QPAttr(port_num=self.port.port)
        attr.path_mtu = min(mtu, self.port.mtu)
        attr.dest_qp_num, attr.rq_psn, attr.sq_psn = qpn, psn, peer.psn
        attr.max_dest_rd_atomic = attr.max_rd_atomic = 1
        # retry_cnt 6, not 7: soft-RoCE (rxe) takes 7 as "retry forever", and a dead peer would then
        # never fail; rnr_retry 7 is "forever" by the spec (credits keep receives posted anyway)
        attr.min_rnr_timer, attr.timeout, attr.retry_cnt, attr.rnr_retry = 12, self._ack_timeout, 6, 7
        route = pv.addr.GlobalRoute(dgid=pv.addr.GID(gid), sgid_index=self.port.gid_index)
        attr.ah_attr = pv.addr.AHAttr(port_num=self.port.port, is_global=int(self.port.ethernet),
                                      gr=route, dlid=lid)
        try:
            peer.qp.to_rts(attr)
        except pv.Error as e:
            raise PeerError(f"rank {self.rank}: cannot connect the queue pair to rank {peer.rank} "
                            f"(gid {gid}, lid {lid}, qpn {qpn}) on {self.port.device}: {e}", peer.rank) from e
        peer.probe_target = (probe_addr, probe_rkey)

    def _others(self) -> List[_Peer]:
        """The peers this transport reaches (each has a queue pair once connected)."""
        return [self._peers[r] for r in self._active]

    # -- data path -----------------------------------------------------------------------------
    def _start_send(self, req: Request) -> None:
        peer, key, view = req.peer, req.key, req.view
        header = wire.pack_header(wire.KIND_DATA, req.dtype, key.comm_id, key.seq, key.tag, req.nbytes)
        with self._lock:
            if peer == self.rank:
                self._arrive(self._peers[peer], wire.unpack_header(header), view, 0)
                req.done = True
                return
            p = self._peers[peer]
            if p.qp is None:
                raise ValueError(f"rank {self.rank}: the verbs transport has no queue pair to rank {peer} "
                                 f"(it reaches ranks {self._active})")
            if req.nbytes <= self._eager_max:
                def eager() -> bool:
                    self._post_message(p, OP_EAGER, header, view)
                    req.done = True  # copied into the send slot: the buffer is free again
                    return True
                self._queue(p, _DATA, eager, req)
            else:
                msg_id, p.next_id = p.next_id, (p.next_id + 1) & 0xFFFFFFFF
                reg, addr = self._mrs.acquire(view)  # registers while the RTS travels
                self._outgoing[(peer, msg_id)] = _Transfer(req, reg, addr)
                self._queue(p, _DATA, lambda: self._post_message(p, OP_RTS, header, msg_id=msg_id), req)

    def _start_recv(self, req: Request) -> None:
        with self._lock:
            arrival = self.matcher.post(req)  # what a peer sent before dying still counts
            if arrival is not None:
                header, payload, msg_id = arrival
                self._start_receive(self._peers[req.peer], req, header,
                                    None if payload is None else memoryview(payload), msg_id)

    def wait_for(self, reqs: Sequence[Request], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while True:
            generation = self._generation
            with self._lock:
                self._poll()
            now = time.monotonic()
            if now >= deadline or all(r.done for r in reqs):
                return all(r.done for r in reqs)
            if now - max(self._last_completion, self._probed) >= PROBE_AFTER:
                self._probe_peers({p for r in reqs if not r.done  # any source: every peer
                                   for p in (self._active if r.peer == ANY else (r.peer,))})
                self._probed = now
            self._wait_once(min(deadline - now, PROBE_AFTER), generation)

    def progress(self) -> None:
        """One non-blocking look at the completion queue (handle what completed, post what the credits
        allow), unless another thread holds it: AutoTransport's turn for verbs while a caller waits on
        another part, so a peer's clear-to-send is answered and its RDMA writes go on."""
        if not self._lock.acquire(blocking=False):
            return
        try:
            moved = self._poll()
        finally:
            self._lock.release()
        if moved:
            with self._cond:
                self._generation += 1
                self._cond.notify_all()

    def _wait_once(self, limit: float, generation: Optional[int] = None) -> None:
        """Spin briefly on the CQ, then block on the completion channel for up to `limit` s (one
        thread at a time; the others sleep until it has handled what arrived)."""
        if not self._leader.acquire(blocking=False):
            with self._cond:
                if generation is None or self._generation == generation:
                    self._cond.wait(limit)
            return
        try:
            spin_until = time.monotonic() + self._spin_s
            while time.monotonic() < spin_until:
                with self._lock:
                    if self._poll():
                        return
            with self._lock:
                self._cq.req_notify()
                if self._poll():  # completions that arrived before the arming
                    return
            if select.select([self._fd], [], [], limit)[0]:
                with self._lock:
                    try:
                        self._channel.get_cq_event(self._cq)
                        self._cq.ack_events(1)
                    except self._pv.Error:  # the event was already taken (non-blocking fd)
                        pass
        finally:
            self._leader.release()
            with self._cond:
                self._generation += 1
                self._cond.notify_all()

    # -- completions (all under self._lock) -----------------------------------------------------
    def _poll(self) -> int:
        """Handle every completion queued now; then post what the returned credits allow."""
        total = 0
        while True:
            n, wcs = self._cq.poll(_POLL_BATCH)
            for wc in wcs:
                if wc.wr_id & _RECV_BIT:
                    self._on_receive(wc)
                else:
                    self._on_send_done(wc)
            total += n
            if n < _POLL_BATCH:
                break
        if total:
            self._last_completion = time.monotonic()
            for peer in self._others():
                self._flush(peer)
        return total

    def _on_send_done(self, wc: Any) -> None:
        peer, slot, then = self._wrs.pop(wc.wr_id)
        peer.sq_used -= 1
        if slot >= 0:
            self._free_slots.append(slot)
        if wc.status != self._pv.e.IBV_WC_SUCCESS:
            self._peer_failed(peer, wc.status)
        elif then is not None:
            then()

    def _on_receive(self, wc: Any) -> None:
        slot = wc.wr_id & ~_RECV_BIT
        peer = self._peers[self._candidates[slot // self._credits]]
        if wc.status != self._pv.e.IBV_WC_SUCCESS:
            self._peer_failed(peer, wc.status)
            return
        if wc.opcode == self._pv.e.IBV_WC_RECV_RDMA_WITH_IMM:
            self._on_chunk(peer, wc.imm_data, wc.byte_len)
        else:
            self._on_message(peer, self._recv.slot(slot)[:wc.byte_len])
        if not peer.dead:
            peer.qp.post_recv(peer.recv_wrs[slot % self._credits])
            peer.owed += 1

    def _on_message(self, peer: _Peer, data: memoryview) -> None:
        try:
            header = wire.unpack_header(bytes(data[:wire.HEADER.size]))
            op, credits, msg_id, rkey, chunk, addr = TRAILER.unpack_from(data, wire.HEADER.size)
        except (ValueError, struct.error) as e:
            self._reject(peer, f"not a pycoll verbs message ({e})")
            return
        peer.credits = min(self._credits, peer.credits + credits)
        payload = data[PREFIX:]
        if not peer.hello:
            self._on_hello(peer, op, payload)
        elif op == OP_EAGER:
            if payload.nbytes != header.nbytes:
                self._reject(peer, f"announced {header.nbytes} bytes but sent {payload.nbytes}")
            else:
                self._arrive(peer, header, payload, 0)
        elif op == OP_RTS:
            self._arrive(peer, header, None, msg_id)
        elif op in (OP_CTS, OP_NACK):
            self._on_cts(peer, op, msg_id, rkey, addr, chunk)
        elif op == OP_BYE:
            self._on_bye(peer)
        elif op != OP_CREDIT:
            self._reject(peer, f"unknown operation {op}")

    def _on_hello(self, peer: _Peer, op: int, payload: memoryview) -> None:
        try:
            if op != OP_HELLO:
                raise ValueError(f"operation {op} before the hello")
            wire.check_hello(self._token, self.rank, bytes(payload), src=peer.rank)
            peer.hello = True
        except ValueError as e:
            self._reject(peer, str(e))

    def _arrive(self, peer: _Peer, header: wire.Header, payload: Optional[memoryview], msg_id: int) -> None:
        """A message (eager payload, or an RTS when payload is None) matched or kept for later."""
        match = (peer.rank, header.comm_id, header.seq, header.tag)
        req = self.matcher.take(match)
        if req is None:
            self.matcher.stash(match, (header, None if payload is None else bytes(payload), msg_id))
            return
        self._start_receive(peer, req, header, payload, msg_id)

    def _start_receive(self, peer: _Peer, req: Request, header: wire.Header,
                       payload: Optional[memoryview], msg_id: int) -> None:
        req.check_incoming(self.rank, header.nbytes, header.dtype)
        if payload is not None:
            if req.error is None:
                req.deliver(payload)
            req.done = True
            return
        if req.error is not None:  # tell the sender its message is dropped, so its send finishes
            self._queue(peer, _DATA, lambda: self._post_message(peer, OP_NACK, _CONTROL_HEADER, msg_id=msg_id))
            req.done = True
            return
        if req.sink is None:
            reg, addr = self._mrs.acquire(req.view)
            xfer = _Transfer(req, reg, addr)
        else:
            land = self._landing.take(req.nbytes)
            xfer = _Transfer(req, None, land.base, land)
        self._incoming[(peer.rank, msg_id)] = xfer
        self._queue(peer, _DATA, lambda: self._post_message(
            peer, OP_CTS, _CONTROL_HEADER, msg_id=msg_id, rkey=xfer.mr.rkey, addr=xfer.addr, chunk=self._chunk))

    def _on_chunk(self, peer: _Peer, msg_id: int, nbytes: int) -> None:
        xfer = self._incoming.get((peer.rank, msg_id))
        if xfer is None:
            self._reject(peer, f"RDMA write for unknown message {msg_id}")
            return
        req, offset = xfer.req, xfer.done_bytes
        xfer.done_bytes += nbytes
        if xfer.done_bytes > req.nbytes:
            req.error = ProtocolError(f"rank {self.rank}: rank {peer.rank} wrote {xfer.done_bytes} bytes "
                                      f"into a {req.nbytes}-byte receive", peer.rank)
        elif xfer.land is not None:  # reduce (or whatever the sink does) as each chunk lands
            req.deliver(xfer.land.view[offset:offset + nbytes], offset)
        if xfer.done_bytes >= req.nbytes:
            del self._incoming[(peer.rank, msg_id)]
            self._release(xfer)
            req.done = True

    def _on_cts(self, peer: _Peer, op: int, msg_id: int, rkey: int, addr: int, chunk: int) -> None:
        xfer = self._outgoing.get((peer.rank, msg_id))
        if xfer is None:
            self._reject(peer, f"clear-to-send for unknown message {msg_id}")
            return
        if op == OP_NACK:  # the receiver refused it (and raised a ProtocolError there)
            self._finish_send(peer, msg_id)
            return
        xfer.remote = (addr, rkey, max(16, min(chunk, self._chunk)))
        self._queue(peer, _DATA, lambda: self._post_chunk(peer, msg_id, xfer), xfer.req, slot=False)

    def _finish_send(self, peer: _Peer, msg_id: int) -> None:
        xfer = self._outgoing.pop((peer.rank, msg_id), None)
        if xfer is not None:
            self._release(xfer)
            xfer.req.done = True

    def _release(self, xfer: _Transfer) -> None:
        if xfer.land is not None:
            self._landing.give(xfer.land)
        else:
            self._mrs.release(xfer.reg)

    # -- posting (under self._lock) ----------------------------------------------------------
    def _queue(self, peer: _Peer, credits: int, post: Callable[[], bool],
               req: Optional[Request] = None, slot: bool = True) -> None:
        """Post in order, as credits, send-queue room and (for SENDs) send slots allow."""
        peer.backlog.append((credits, slot, post, req))
        self._flush(peer)

    def _flush(self, peer: _Peer) -> None:
        while peer.backlog and not peer.dead:
            credits, slot, post, _ = peer.backlog[0]
            if peer.credits < credits or peer.sq_used >= self._sq_depth or slot and not self._free_slots:
                break
            if post():
                peer.backlog.popleft()
        if peer.owed >= self._credits // 4 and peer.credits >= _CONTROL and not peer.dead and \
                peer.sq_used < self._sq_depth and self._free_slots:
            self._post_message(peer, OP_CREDIT, _CONTROL_HEADER)

    def _post_message(self, peer: _Peer, op: int, header: bytes, payload: Optional[memoryview] = None,
                      msg_id: int = 0, rkey: int = 0, addr: int = 0, chunk: int = 0) -> bool:
        """SEND header + trailer (+ payload) from a send slot; returns True (one request posted)."""
        pv = self._pv
        slot = self._free_slots.pop()
        buf = self._send.slot(slot)
        buf[:wire.HEADER.size] = header
        TRAILER.pack_into(buf, wire.HEADER.size, op, peer.owed, msg_id, rkey, chunk, addr)
        peer.owed = 0
        length = PREFIX
        if payload is not None and payload.nbytes:
            buf[PREFIX:PREFIX + payload.nbytes] = payload.cast("B")
            length += payload.nbytes
        sge = pv.wr.SGE(self._send.addr(slot), length, self._send.mr.lkey)
        wr = pv.wr.SendWR(wr_id=self._track(peer, slot, None), opcode=pv.e.IBV_WR_SEND, num_sge=1, sg=[sge])
        self._post_send(peer, wr, credits=1)
        return True

    def _post_chunk(self, peer: _Peer, msg_id: int, xfer: _Transfer) -> bool:
        """RDMA WRITE WITH IMM of the next chunk straight from the sender's buffer; True after the last."""
        pv = self._pv
        addr, rkey, chunk = xfer.remote
        offset = xfer.posted
        length = min(chunk, xfer.req.nbytes - offset)
        xfer.posted += length
        last = xfer.posted >= xfer.req.nbytes
        then = (lambda: self._finish_send(peer, msg_id)) if last else None
        sge = pv.wr.SGE(xfer.addr + offset, length, xfer.mr.lkey)
        wr = pv.wr.SendWR(wr_id=self._track(peer, -1, then), opcode=pv.e.IBV_WR_RDMA_WRITE_WITH_IMM,
                          num_sge=1, imm_data=msg_id, sg=[sge])
        wr.set_wr_rdma(rkey, addr + offset)
        self._post_send(peer, wr, credits=1)
        return last

    def _track(self, peer: _Peer, slot: int, then: Optional[Callable[[], None]]) -> int:
        self._next_wr += 1
        self._wrs[self._next_wr] = (peer, slot, then)
        return self._next_wr

    def _post_send(self, peer: _Peer, wr: Any, credits: int) -> None:
        try:
            peer.qp.post_send(wr)
        except self._pv.Error as e:  # the queue pair is in the error state: the peer is gone
            peer, slot, _ = self._wrs.pop(wr.wr_id)
            if slot >= 0:
                self._free_slots.append(slot)
            self._peer_failed(peer, f"post_send failed: {e}")
            return
        peer.credits -= credits
        peer.sq_used += 1

    def _probe_peers(self, ranks: set) -> None:
        """An 8-byte RDMA write to each silent peer: it fails within the retry timeout if it is gone."""
        pv = self._pv
        with self._lock:
            for rank in ranks:
                peer = self._peers[rank]
                if peer.qp is None or peer.dead or peer.probing or peer.sq_used >= self._sq_depth:
                    continue
                peer.probing = True
                sge = pv.wr.SGE(self._probe.base, 8, self._probe.mr.lkey)
                wr = pv.wr.SendWR(wr_id=self._track(peer, -1, lambda p=peer: setattr(p, "probing", False)),
                                  opcode=pv.e.IBV_WR_RDMA_WRITE, num_sge=1, sg=[sge])
                wr.set_wr_rdma(peer.probe_target[1], peer.probe_target[0])
                self._post_send(peer, wr, credits=0)

    # -- failures ------------------------------------------------------------------------------
    def _peer_failed(self, peer: _Peer, status: Any) -> None:
        """The queue pair to `peer` broke. After its bye that is a normal close; otherwise the peer
        died and, as with tcp, the whole communicator fails: every wait ends with a PeerError."""
        if peer.dead:
            return
        peer.dead = True
        if peer.bye or self._closing:
            self._peer_closed(peer)
            return
        why = status if isinstance(status, str) else \
            f"work completion status {status}, {_WC_STATUS.get(status, 'unknown')}"
        if self.matcher.broken is None:
            log.warning("rank %d: rank %d died or became unreachable: %s", self.rank, peer.rank, why)
        self.matcher.break_job(PeerError(
            f"rank {self.rank}: rank {peer.rank} died or became unreachable (the queue pair from "
            f"{self.port.device} here to its {peer.device} failed: {why}); this communicator cannot complete "
            "collectives any more: recreate it", peer.rank))
        self._fail_transfers(self.matcher.broken, None)

    def _on_bye(self, peer: _Peer) -> None:
        """The peer closed after its last message: nothing still expected from it will come."""
        peer.bye = True
        self._peer_closed(peer)

    def _peer_closed(self, peer: _Peer) -> None:
        self.matcher.peer_gone(peer.rank, "it closed its communicator")
        self._fail_transfers(PeerError(f"rank {self.rank}: rank {peer.rank} closed its communicator before "
                                       "this transfer finished", peer.rank), {peer.rank})

    def _fail_transfers(self, error: PeerError, ranks: Optional[set]) -> None:
        """End with `error` every transfer with, and send queued to, a rank in `ranks` (every rank
        when None); the matcher fails the posted receives."""
        def hit(rank: int) -> bool:
            return ranks is None or rank in ranks
        for table in (self._incoming, self._outgoing):
            for key in [k for k in table if hit(k[0])]:
                xfer = table.pop(key)
                self._release(xfer)
                fail(xfer.req, error)
        for peer in self._peers:
            if hit(peer.rank):
                fail_all([req for _, _, _, req in peer.backlog if req is not None], error)
                peer.backlog.clear()

    def _reject(self, peer: _Peer, reason: str) -> None:
        self.rejected += 1
        log.warning("rank %d: verbs transport dropped a message from rank %d: %s", self.rank, peer.rank, reason)

    # -- teardown ------------------------------------------------------------------------------
    def _shutdown(self) -> None:
        """Say bye, flush what was sent (bounded), then destroy queue pairs, memory and the device."""
        start = time.monotonic()
        with self._lock:
            self._poll()
            self._closing = True
            for peer in self._others():
                if not peer.dead and not peer.bye and peer.hello:
                    self._queue(peer, _CONTROL, lambda p=peer: self._post_message(p, OP_BYE, _BYE_HEADER))
        while True:
            with self._lock:
                self._poll()
                flushed = not self._wrs and not any(p.backlog for p in self._peers if not p.dead)
                heard = all(p.bye or p.dead for p in self._others())
            elapsed = time.monotonic() - start
            if flushed and (heard or elapsed >= _BYE_WAIT) or elapsed >= _LINGER:
                break
            self._wait_once(0.05)
        for peer in self._others():
            if peer.qp is not None:
                peer.qp.close()
        for resource in (self._mrs, self._landing, self._recv, self._send, self._probe, self._cq, self._channel,
                         self._pd, self._ctx):
            resource.close()
