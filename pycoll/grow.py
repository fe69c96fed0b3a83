"""Grow: newcomers (a restarted rank, a new node's ranks) join a running job; members and newcomers
form one new communicator at a step boundary.

    comm = pycoll.init()        # a newcomer (PYCOLL_NEWCOMER=1, as `pycoll run --elastic` starts one)
                                # returns from here already a rank of the grown communicator
    ...                         # a member, at a step boundary:
    if grow.arrivals(comm) > grow.admitted(comm):
        comm = comm.grow()      # members keep ranks 0..n-1, the newcomers follow

MPI joins processes with MPI_Comm_accept/MPI_Comm_connect and MPI_Intercomm_merge (the accepting side
first), NCCL 2.28 with ncclCommGrow (members keep their ranks, new ranks after them); this is the same
contract. Healing a newcomer (the model, the optimizer, the data position) is the application's:
torchft broadcasts it from a live peer, and so do the trainer (trainer/elastic.py) and pycoll.torch.elastic.

How it works:
* Arrivals. A newcomer connects to the job's store (a launcher's, which outlives any rank; like any
  rank it must prove it holds the job token, else the store refuses it and logs the refusal), takes a
  ticket t (an atomic add on `pycoll/elastic/arrivals`), writes who it is under `newcomer/<t>` (its
  launcher slot, restart count, host, pid) and waits for `admit/<t>`. A member learns of arrivals from
  a thread blocked on the store until the next ticket's key appears, so watching costs no traffic per
  step: arrivals(comm) is a local read.
* Agreement. The members agree on T, the highest ticket any of them has seen (ft.agree_max: it can
  ride on an agreement the caller runs anyway, grow(arrivals=T)), so all admit the same newcomers: the
  tickets after the previous grow's, up to T, ordered by (slot, ticket). Every member reads their
  keys (they exist: a member saw them); the lowest rank writes each admission (rank, size, name).
* The new world. Members and newcomers rendezvous in a store namespace of their own
  (`pycoll/elastic/grow<T>/`) and connect a new transport of the grown size, authenticated by the job
  token as at init (world.connect), with a name, id and connections of its own: no message of the old
  communicator can match a call of the new one. The members then agree, on the old communicator, that
  every one of them connected, and the lowest live rank writes the outcome for the newcomers. Only
  then is the old communicator released (its transport closed, and with it its split/dup children): a
  grow that fails leaves the members where they were (GrowError) and the newcomers raise GrowError.
* Bounds. Every wait is bounded: a newcomer that never connects makes each member's connect time out
  after PYCOLL_GROW_TIMEOUT, the members agree the grow failed and go on; a newcomer waits for its
  admission at most its timeout and stops waiting (JobEnded) once the job is marked ended (finish(),
  or `pycoll run` when a rank exits 0).
* Between calls only. grow() raises RuntimeError, before sending anything, while calls of the
  communicator are in flight (async work, p2p), so no call of the old communicator can straddle it.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import weakref
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Dict, List, Optional, Tuple

from . import config, ft
from .bootstrap.env import JobEnv, discover
from .bootstrap.rendezvous import make_store
from .bootstrap.store import PrefixStore, Store
from .errors import EnvError, GrowError, JobEnded, PycollError, TimeoutError
from .logutil import quiet_unless_asked
from .trace import recorder
from .transports.base import Transport

if TYPE_CHECKING:  # comm.py imports this module
    from .comm import Communicator

log = quiet_unless_asked(logging.getLogger("pycoll.grow"))
# on stderr: each grow's phases, timed, under PYCOLL_DEBUG=INFO (the logger's filter), and warnings where the
# application has set up no logging (as logging's last resort would print them, which a handler here disables)
_stderr = logging.StreamHandler()
_stderr.setFormatter(logging.Formatter("pycoll %(levelname)s %(message)s"))
_stderr.addFilter(lambda record: record.levelno < logging.WARNING or not logging.getLogger().handlers)
log.addHandler(_stderr)
log.setLevel(logging.INFO)

PREFIX = "pycoll/elastic"  # the job's keys for arrivals, in the store every rank reaches
CLOSED_KEY = f"{PREFIX}/closed"  # set when the job ends: waiting newcomers give up (JobEnded)
_SLICE = 1.0  # s: longest single store wait of a waiting newcomer or of the watcher (between checks)
_INFO_WAIT = 5.0  # s a member waits for a seen newcomer's key (it exists already: a member saw it)


@dataclass
class Origin:
    """What a job's world communicator was made from: the store every rank reaches (not a namespace),
    the job (with its token), the transport's name; and the tickets dealt with so far. Shared by
    the communicators that follow it (shrink keeps the transport; grow passes it on)."""

    store: Store
    job: JobEnv
    transport: str
    settled: int = 0  # tickets up to this one are admitted or refused
    watch: Optional["_Watch"] = None


@dataclass(frozen=True)
class Growth:
    """How a grown communicator was made: ranks 0..members-1 were the members of the one it grew
    from, members..size-1 are the newcomers; `ticket` the highest ticket it admitted; `began` when
    this rank started the grow (a newcomer: announced itself), time.monotonic()."""

    members: int
    size: int
    ticket: int
    began: float

    @property
    def newcomers(self) -> List[int]:
        """The newcomers' ranks in the grown communicator."""
        return list(range(self.members, self.size))


_origins: "weakref.WeakKeyDictionary[Transport, Origin]" = weakref.WeakKeyDictionary()
_growths: "weakref.WeakKeyDictionary[Communicator, Growth]" = weakref.WeakKeyDictionary()


def register(comm: "Communicator", ns: Store, job: JobEnv, transport: str) -> None:
    """world.connect: remember what `comm` (a world) was made from, for grow() and arrivals()."""
    store = ns.store if isinstance(ns, PrefixStore) else ns
    _origins[comm.transport] = Origin(store, job, transport)


def growth(comm: "Communicator") -> Optional[Growth]:
    """How `comm` was grown (grow() or join() made it), else None: a newcomer asks `comm.rank >=
    growth(comm).members` to know that it must be healed."""
    return _growths.get(comm)


def _origin(comm: "Communicator", call: str) -> Origin:
    origin = _origins.get(comm.transport)
    if origin is None:
        raise PycollError(f"rank {comm.rank}: {call} on {comm.name}: this communicator's job was not made by "
                          "pycoll.init() or pycoll.join() (its store, where newcomers announce themselves, is "
                          "unknown here)")
    return origin


# -- members: watching for arrivals ----------------------------------------------------------------------
class _Watch:
    """A thread blocked on the store until the next newcomer's key appears (the store answers a
    waiting get the moment a key is set), so members learn of arrivals without any traffic per step."""

    def __init__(self, store: Store, seen: int) -> None:
        self.seen = seen  # the highest ticket whose newcomer key appeared (tickets come in order)
        self._store = store
        self._thread = threading.Thread(target=self._loop, name="pycoll-arrivals", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            try:
                self._store.get(f"{PREFIX}/newcomer/{self.seen + 1}", _SLICE)
            except TimeoutError:
                continue
            except Exception:  # noqa: BLE001  the store was closed: the job is ending
                return
            self.seen += 1


def arrivals(comm: "Communicator") -> int:
    """The highest ticket of a newcomer this member has seen arrive (local, no communication; the
    first call starts watching the store). Newcomers are waiting while it exceeds admitted(comm);
    the members agree on it (ft.agree_max) and pass it to grow(arrivals=)."""
    origin = _origin(comm, "arrivals")
    if origin.watch is None:
        origin.watch = _Watch(origin.store, _scan(origin.store, origin.settled))
    return origin.watch.seen


def admitted(comm: "Communicator") -> int:
    """The highest ticket the job's grows have dealt with so far (admitted, or refused)."""
    return _origin(comm, "admitted").settled


def _scan(store: Store, seen: int) -> int:
    """The highest ticket from `seen` on whose newcomer key is in the store (a few store requests)."""
    while store.check([f"{PREFIX}/newcomer/{seen + 1}"]):
        seen += 1
    return seen


def finish(comm: "Communicator") -> None:
    """Mark the job ended: a newcomer still waiting to be admitted gives up (JobEnded, exit 0)
    instead of waiting for its timeout. Any member may call it, once the members will grow no more."""
    _origin(comm, "finish").store.set(CLOSED_KEY, f"ended by rank {comm.rank} of {comm.name}".encode())


# -- members: grow ----------------------------------------------------------------------------------------
def grow(comm: "Communicator", timeout: Optional[float] = None, arrivals: Optional[int] = None
         ) -> "Communicator":
    """Communicator.grow: see the module docstring and that method."""
    origin = _origin(comm, "grow")
    _check_idle(comm)
    limit = config.get("PYCOLL_GROW_TIMEOUT") if timeout is None else comm._deadline(timeout, "grow")
    transport = comm.transport
    live = set(range(transport.size)) - transport.dead_peers()
    if set(comm.group) != live:
        raise ValueError(f"rank {comm.rank}: grow on {comm.name}, which holds ranks {sorted(comm.group)} of the "
                         f"job's live ranks {sorted(live)}: grow the communicator of every live rank (the world, "
                         "or what shrink() made of it), then split it again")
    began = time.monotonic()
    if arrivals is None:
        seen = origin.watch.seen if origin.watch is not None else origin.settled
        _, dead, arrivals = ft.agree_max(comm, True, _scan(origin.store, seen))
        if dead:
            raise GrowError(f"rank {comm.rank}: grow on {comm.name}: members {dead} died; shrink() first", dead)
    elif isinstance(arrivals, bool) or not isinstance(arrivals, int) or arrivals < 0:
        raise ValueError(f"rank {comm.rank}: grow arrivals={arrivals!r} must be a ticket number agreed by "
                         "the members (ft.agree_max over grow.arrivals(comm))")
    if arrivals <= origin.settled:
        return comm
    tickets = list(range(origin.settled + 1, arrivals + 1))
    origin.settled = arrivals
    chosen, refused = _plan(origin.store, tickets, comm.rank)
    size = comm.size + len(chosen)
    name, space = f"{comm.name}.grow{arrivals}", f"{PREFIX}/grow{arrivals}"
    if comm.rank == 0:
        for ticket, why in refused:
            origin.store.set(f"{PREFIX}/admit/{ticket}", json.dumps({"refused": why}).encode())
        for i, (_, ticket, _info) in enumerate(chosen):
            origin.store.set(f"{PREFIX}/admit/{ticket}", json.dumps(
                {"grow": arrivals, "rank": comm.size + i, "size": size, "members": comm.size, "name": name,
                 "transport": origin.transport, "timeout": limit}).encode())
    if not chosen:
        return comm
    who = ", ".join(f"slot {info.get('slot')} (ticket {t}, pid {info.get('pid')} on {info.get('host')})"
                    for _, t, info in chosen)
    log.info("rank %d: growing %s from %d to %d ranks at t=%.3f: admitting %s", comm.rank, comm.name, comm.size,
             size, began, who)
    planned = time.monotonic()
    new: Optional["Communicator"] = None
    error = ""
    try:
        job = replace(origin.job, rank=comm.rank, size=size, local_rank=None, local_size=None, token_file=None)
        new = _connect(job, PrefixStore(space, origin.store), origin.transport, limit, name, None)
    except Exception as e:  # noqa: BLE001  (every member learns of it in the agreement below)
        error = f"{type(e).__name__}: {e}"
    connected = time.monotonic()
    try:
        _, dead, failed = ft.agree_max(comm, True, int(new is None), timeout=limit + comm.timeout)
    except BaseException:
        if new is not None:
            new.close()
        raise
    ok = not dead and not failed
    if comm.rank == min(r for r in range(comm.size) if r not in dead):  # the lowest live member tells them
        origin.store.set(f"{space}/outcome", b"ok" if ok else b"failed: the members could not all connect")
    if not ok:
        if new is not None:
            new.close()
        why = f"members {dead} died during it" if dead else \
            f"not every member connected to the newcomers within {limit:g} s"
        log.warning("rank %d: grow of %s to %d ranks failed (%s)%s; going on with %d ranks", comm.rank, comm.name,
                    size, why, f"; here: {error}" if error else "", comm.size)
        raise GrowError(f"rank {comm.rank}: grow of {comm.name} to {size} ranks (admitting {who}) failed: {why}"
                        f"{f' (here: {error})' if error else ''}; {comm.name} is "
                        f"{'revoked: shrink() it' if dead else 'usable again'}", dead)
    assert new is not None
    new.timeout = comm.timeout
    new.store, comm.store = comm.store, None  # the job's store goes on with the grown world
    _origins[new.transport] = origin
    _growths[new] = Growth(comm.size, size, arrivals, began)
    ft.replace_default(comm, new)
    _release(comm)
    log.info("rank %d: %s grew to %d ranks as %s in %.3f s (planned after %.3f s, connected after %.3f s)", comm.rank,
             comm.name, size, new.name, time.monotonic() - began, planned - began, connected - began)
    return new


def _release(comm: "Communicator") -> None:
    """Close the old communicator and its transport, so nothing of it survives to mix with the new
    one. The transport closes on a thread of its own: a tcp transport lingers up to 5 s for goodbyes
    to peers that closed theirs first, which must not hold up the grown job."""
    owned, comm._owns_transport = comm._owns_transport, False
    comm.close()
    if owned:
        threading.Thread(target=comm.transport.close, name=f"pycoll-close-{comm.name}", daemon=True).start()


def _check_idle(comm: "Communicator") -> None:
    """grow() runs between calls: RuntimeError, before anything is sent, while calls are in flight."""
    comm._check_open("grow")
    queued = comm._inflight
    p2p = comm._p2p_worker
    p2p_busy = p2p is not None and (p2p._running or bool(p2p._items))
    if queued or p2p_busy:
        what = f"{queued} collective call(s)" if queued else "point-to-point calls"
        raise RuntimeError(f"rank {comm.rank}: grow on {comm.name} while {what} of it are in flight: wait() for "
                           "them first; grow() runs between calls (at a step boundary), so no call of the old "
                           "communicator can straddle the new one")


def _plan(store: Store, tickets: List[int], rank: int) -> Tuple[List[Tuple[int, int, Dict]], List[Tuple[int, str]]]:
    """The newcomers of `tickets` to admit, as (slot, ticket, info) in admission order, and those refused
    with the reason (a key that is not what a newcomer writes). Every member computes the same."""
    chosen, refused = [], []
    for ticket in tickets:
        try:
            raw = store.get(f"{PREFIX}/newcomer/{ticket}", _INFO_WAIT)
        except TimeoutError:
            raise GrowError(f"rank {rank}: newcomer ticket {ticket} has no key in the store although a member saw "
                            "it: the store lost it") from None
        try:
            info = json.loads(raw.decode())
            slot = int(info["slot"])
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            log.warning("rank %d: refused newcomer ticket %d: its key is not a newcomer's (%r)", rank, ticket,
                        raw[:80])
            refused.append((ticket, "its announcement was malformed"))
            continue
        chosen.append((slot, ticket, info))
    chosen.sort(key=lambda c: (c[0], c[1]))
    return chosen, refused


def _connect(job: JobEnv, ns: Store, transport: str, timeout: float, name: str,
             owned_store: Optional[Store]) -> "Communicator":
    from . import world  # world imports comm, which imports this module
    return world.connect(job, ns, transport, timeout, owned_store=owned_store, name=name)


# -- newcomers: join ---------------------------------------------------------------------------------------
def join(timeout: Optional[float] = None) -> "Communicator":
    """Join a running job as a newcomer (what pycoll.init() does under PYCOLL_NEWCOMER=1): announce
    this process in the job's store and wait until the members grow; returns the grown communicator
    (this process's rank follows the members'). The launcher's environment says where the store is
    (PYCOLL_STORE_PORT or PYCOLL_STORE_HOSTED) and holds the job token; RANK is this process's slot,
    which orders newcomers admitted together. GrowError if the grow fails, TimeoutError if no
    member admits it within `timeout` (PYCOLL_TIMEOUT), JobEnded if the job ends first."""
    settings = config.load()
    timeout = settings["PYCOLL_TIMEOUT"] if timeout is None else float(timeout)
    job = discover()
    if job.store_port is None and not job.store_hosted:
        raise EnvError(f"slot {job.rank}: a newcomer needs the job's store served by a launcher, which outlives "
                       "any rank (PYCOLL_STORE_PORT, as `pycoll run` sets, or PYCOLL_STORE_HOSTED=1 with "
                       "MASTER_ADDR/MASTER_PORT)")
    if job.token is None:
        raise EnvError(f"slot {job.rank}: a newcomer must hold the job token (PYCOLL_JOB_TOKEN or "
                       "PYCOLL_JOB_TOKEN_FILE, as `pycoll run` passes it)")
    store, job = make_store(job, timeout)  # a wrong token: the store refuses (StoreError) and logs it
    try:
        comm = _join(store, job, timeout, settings["PYCOLL_RESTART_COUNT"])
    except BaseException:
        store.close()
        raise
    return comm


def _join(store: Store, job: JobEnv, timeout: float, restart: int) -> "Communicator":
    began = time.monotonic()
    ticket = store.add(f"{PREFIX}/arrivals", 1)
    me = {"slot": job.rank, "restart": restart, "host": socket.gethostname(), "pid": os.getpid()}
    store.set(f"{PREFIX}/newcomer/{ticket}", json.dumps(me).encode())
    log.info("slot %d: announced as newcomer ticket %d; waiting to be admitted", job.rank, ticket)
    plan = _admission(store, ticket, job.rank, began + timeout)
    admitted = time.monotonic()
    if "refused" in plan:
        raise GrowError(f"slot {job.rank}: the members refused newcomer ticket {ticket}: {plan['refused']}")
    space = f"{PREFIX}/grow{plan['grow']}"
    joined = replace(job, rank=int(plan["rank"]), size=int(plan["size"]), local_rank=None, local_size=None)
    with recorder.PROCESS.lock:  # its flight-recorder files are named by its launcher slot, as before it
        if recorder.PROCESS.rank is None:  # died (its rank in the grown job is another rank's slot)
            recorder.PROCESS.rank = job.rank
    try:
        comm = _connect(joined, PrefixStore(space, store), str(plan["transport"]), float(plan["timeout"]),
                        str(plan["name"]), store)
    except Exception as e:
        raise GrowError(f"slot {job.rank}: could not join the job as rank {plan['rank']} of {plan['size']}: "
                        f"{type(e).__name__}: {e}") from e
    connected = time.monotonic()
    comm.timeout = timeout
    try:
        outcome = store.get(f"{space}/outcome", float(plan["timeout"]) + timeout)
    except TimeoutError:
        outcome = b"failed: the members said nothing of the outcome"
    if outcome != b"ok":
        comm.close()
        raise GrowError(f"slot {job.rank}: the grow that admitted ticket {ticket} as rank {plan['rank']} of "
                        f"{plan['size']} {outcome.decode(errors='replace')}")
    origin = _origins[comm.transport]
    origin.settled = int(plan["grow"])
    _growths[comm] = Growth(int(plan["members"]), int(plan["size"]), int(plan["grow"]), began)
    log.info("slot %d: joined as rank %d of %d (%s) at t=%.3f: admitted %.3f s after announcing itself at t=%.3f, "
             "connected after %.3f s", job.rank, comm.rank, comm.size, comm.name, time.monotonic(), admitted - began,
             began, connected - began)
    return comm


def _admission(store: Store, ticket: int, slot: int, deadline: float) -> Dict:
    """The members' answer to `ticket` (bounded: TimeoutError at `deadline`, JobEnded when the job ended)."""
    key = f"{PREFIX}/admit/{ticket}"
    while True:
        left = deadline - time.monotonic()
        try:
            raw = store.get(key, max(0.01, min(_SLICE, left)))
        except TimeoutError:
            if store.check([CLOSED_KEY]):
                reason = store.get(CLOSED_KEY, 1.0).decode(errors="replace")
                ended = JobEnded(f"slot {slot}: the job ended before admitting newcomer ticket {ticket} ({reason})")
                log.warning("%s; nothing left to join, exiting", ended)
                raise ended from None
            if time.monotonic() >= deadline:
                raise TimeoutError(f"slot {slot}: no member admitted newcomer ticket {ticket} within the timeout: "
                                   "do the members call comm.grow() at their step boundaries?") from None
            continue
        try:
            return json.loads(raw.decode())
        except (ValueError, UnicodeDecodeError):
            raise GrowError(f"slot {slot}: the admission of ticket {ticket} is malformed") from None
