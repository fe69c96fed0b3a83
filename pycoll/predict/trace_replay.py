"""Replay a recorded job from its flight-recorder dumps (`pycoll predict --trace DIR`).

Every rank's dump (PYCOLL_TRACE_DIR/rank<R>.json, pycoll/trace/recorder.py) holds, per communicator,
each call with when it was entered, started and ended, and the marks of pycoll.mark_step(). From
them each rank becomes a program, in the order the rank entered its calls:

    compute (the recorded time between the caller's calls) -> issue call -> compute -> wait ...

and the calls become instances shared by the ranks taking part, with the dependencies that matter:

- a collective (matched across ranks by communicator and call number) starts when the last member
  is ready for it: it has entered it, the call before it on that communicator (one queue per
  communicator and rank, as pycoll runs them) has ended, and the hand-off to the queue's thread is over;
- a point-to-point receive matches the send of the same pair and tag in posting order (MPI's
  non-overtaking order, the transport's); the transfer starts when both are posted, and a
  pipeline stage that waits on its neighbour's activations waits through this;
- an async call lets the caller compute on until it waits on the call's Work. The recorder keeps,
  per async call, when the caller's first wait that found it done began and returned (`wait_begin`,
  `wait_end`: pycoll/work.py stamps them, torch's Work too): the program computes up to
  `wait_begin`, then waits for the call there, and goes on from when the call ended or the wait
  began, whichever is later. Where a call has no recorded wait (dumps written before pycoll kept
  them; a call only polled with is_completed(), never waited for, or waited for through a future,
  as DDP does) the wait is inferred: a call that ended before the caller's next event was waited
  for at once (the trainer and DDP wait on their last bucket at the end of backward) and the
  caller was blocked until it ended; any other call is waited for just before the caller's first
  event after it ended (the latest point the trace allows: on the recorded run it blocked nothing).

Each member's time in an instance is split into what it took after the last member was ready
(`after`, the part a slower link stretches) and, where it finished before that (an eager send, a
root's scatter), its own time from its start (`own`). The simulation replays the programs with
those durations (recorded, or repriced for another cluster by trace_target.py) and the compute
scaled per rank; the recorded run replayed as recorded must give back its own step times, which
is what `pycoll predict --trace DIR` checks and reports.

Steps: rank r's step k runs from its mark k-1 to its mark k; the job's step k is the slowest
rank's, and the step time is the median over the steps every rank marked and every recorder still
holds whole (a full ring drops its oldest calls), the first step (communicator set-up) left out.
With no marks the whole recorded span is one step.
"""
from __future__ import annotations

import math
import statistics
from bisect import bisect_right
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ..trace import analysis, traffic
from ..trace.analysis import TraceError

Key = Tuple[Any, ...]  # ("c", comm id, seq) or ("p", comm id, src, dst, tag, k): an instance
BLOCKING_P2P = ("send", "recv")  # waited for on the caller's thread, off the p2p queue


@dataclass
class Instance:
    """One call as all its members made it: a collective, or a matched send and receive."""

    key: Key
    kind: str                      # "coll" or "p2p"
    comm: str                      # the communicator's id
    call: str                      # allreduce, alltoallv, isend (the sender's call for p2p), ...
    members: List[int]             # global ranks (p2p: sender, receiver)
    entries: Dict[int, dict]       # global rank -> its dump entry
    handoff: Dict[int, float]      # seconds from ready in the queue to started (the worker's wake-up)
    after: Dict[int, float]        # seconds from the last member ready to its end (< 0: it did not wait for it)
    own: Dict[int, float]          # seconds from its own start to its end
    queued: Dict[int, bool]        # member's call runs in its communicator's queue (collectives, isend/irecv)

    @property
    def nbytes(self) -> int:
        """Bytes the call moves as the Communicator counts them (an allgather's output, else its input)."""
        e = next(iter(self.entries.values()))
        item = e.get("itemsize") or 0
        if self.kind == "p2p":
            return traffic._total(e.get("count")) * item
        if e["call"] == "alltoallv":
            sent = sum(sum(x.get("send_counts") or []) for x in self.entries.values())
            return sent * item // max(1, len(self.members))
        counts = traffic._per_rank(e.get("count"), len(self.members))
        coll = traffic.BASE.get(e["call"], e["call"])
        return (sum(counts) if coll == "allgather" else traffic._total(e.get("count"))) * item


@dataclass
class Op:
    """One step of a rank's program: compute `seconds`, issue instance `key` (blocking the caller
    until it ends if `block`), wait for instance `key`, or mark step `step`."""

    kind: str                      # "compute", "issue", "wait", "mark"
    seconds: float = 0.0
    key: Optional[Key] = None
    block: bool = False
    step: int = 0


@dataclass
class Trace:
    """A job's dumps as programs and instances, with its recorded steps."""

    folder: str
    job: Optional[str]
    ranks: List[int]
    host_of: Dict[int, str]                 # global rank -> host id
    machine_of: Dict[int, str]              # global rank -> the machine (hostname) it ran on
    comms: Dict[str, Dict[str, Any]]        # comm id -> {"name", "group", "hosts", "board"}
    instances: Dict[Key, Instance]
    programs: Dict[int, List[Op]]
    begin: Dict[int, float]                 # when each rank's program starts (recorded clock)
    marked: bool
    steps: List[int]                        # the counted steps' numbers ([0]: the whole span)
    measured: Dict[int, Dict[int, float]]   # step -> rank -> recorded seconds (marks, or the span)
    notes: List[str] = field(default_factory=list)

    def measured_steps(self) -> List[float]:
        """Each counted step's recorded time: the slowest rank's."""
        return [max(self.measured[k].values()) for k in self.steps]


# -- reading ----------------------------------------------------------------------------------------
def load(folder: str) -> Trace:
    """Read a job's dumps into a Trace; TraceError (naming them) for dumps of several jobs, ranks
    that left no dump, or nothing to replay."""
    dumps, _ = analysis.load(folder)
    if not dumps:
        raise TraceError(f"{folder} holds no rank*.json dumps (run the job with PYCOLL_TRACE_DIR set, or "
                         "`pycoll run --trace-dir DIR`: every rank dumps when it ends)")
    analysis.one_job(dumps)
    return build(dumps, folder)


def build(dumps: Dict[int, dict], folder: str = "") -> Trace:
    """A Trace from one job's dumps ({rank: dump})."""
    comms: Dict[str, Dict[str, Any]] = {}
    for d in dumps.values():
        for c in d.get("comms", []):
            info = comms.setdefault(c["id"], {"name": c["name"], "group": list(c["group"]), "hosts": None,
                                              "board": c.get("board")})
            if c.get("hosts") and info["hosts"] is None:
                info["hosts"] = list(c["hosts"])
    ranks = sorted(set(dumps) | {g for c in comms.values() for g in c["group"]})
    missing = [r for r in ranks if r not in dumps]
    if missing:
        raise TraceError(f"ranks {analysis.span(missing)} of the job's {len(ranks)} left no dump in "
                         f"{folder or 'the folder'} "
                         f"(dumps of ranks {analysis.span(sorted(dumps))}): a replay needs every rank's calls "
                         "(a rank that died or was killed dumps nothing; `pycoll trace DIR` says which)")
    host_of: Dict[int, str] = {r: d["host_id"] for r, d in dumps.items() if d.get("host_id")}
    for c in comms.values():
        for g, h in zip(c["group"], c["hosts"] or []):
            host_of.setdefault(g, h)
    for r in ranks:
        host_of.setdefault(r, f"rank{r}")
    machine_of = {r: str(d.get("host") or host_of[r]) for r, d in dumps.items()}

    marked, steps, bounds, notes = _windows(dumps)
    held = {r: _held(d, *bounds[r]) for r, d in dumps.items()}
    instances = _collectives(held, comms)
    instances.update(_p2p(held, comms, dumps))
    used = {r: set() for r in dumps}
    for inst in instances.values():
        for m in inst.members:
            used[m].add(id(inst.entries[m]))
    dropped = sum(1 for r in dumps for _, e in held[r] if id(e) not in used[r])
    if dropped:
        notes.append(f"{dropped} calls in the replayed span are not matched on every member (cut by the window "
                     "or unfinished): their time counts as compute")
    by_entry = {(m, id(inst.entries[m])): inst for inst in instances.values() for m in inst.members}
    programs, begin = {}, {}
    for r, d in dumps.items():
        marks = [(k, t) for k, t in ((int(k), float(t)) for k, t in d.get("marks") or [])
                 if bounds[r][0] < t <= bounds[r][1]] if marked else []
        calls = [(e, by_entry[r, id(e)]) for _, e in held[r] if (r, id(e)) in by_entry]
        programs[r] = _program(r, calls, marks, bounds[r][0])
        begin[r] = bounds[r][0]
    if marked:
        measured = {k: {r: _mark(dumps[r], k) - _mark(dumps[r], k - 1) for r in dumps} for k in steps}
    else:
        first = min(begin.values())
        measured = {0: {r: max([e["end"] for _, e in held[r]] + [begin[r]]) - first for r in dumps}}
    job = next((d.get("job") for d in dumps.values() if d.get("job")), None)
    return Trace(folder, job, ranks, host_of, machine_of, comms, instances, programs, begin, marked, steps,
                 measured, notes)


def _mark(dump: dict, k: int) -> float:
    for step, t in dump.get("marks") or []:
        if int(step) == k:
            return float(t)
    raise TraceError(f"rank {dump.get('rank')} holds no mark of step {k}")


def _windows(dumps: Dict[int, dict]) -> Tuple[bool, List[int], Dict[int, Tuple[float, float]], List[str]]:
    """(marked, counted steps, per rank (begin, end] of the replayed span, notes)."""
    marked = {r: traffic._steps(d) for r, d in dumps.items()}
    unmarked = [r for r, s in marked.items() if not s]
    notes: List[str] = []
    if unmarked:
        notes.append(("no step marks in the dumps" if len(unmarked) == len(dumps) else
                      f"ranks {analysis.span(unmarked)} marked no steps") +
                     " (call pycoll.mark_step() at the end of each step): the whole recorded span is predicted "
                     "as one step")
        bounds = {}
        for r, d in dumps.items():
            window = traffic._window_start(d)
            enters = [e["enter"] for c in d.get("comms", []) for e in c.get("calls", []) if e["enter"] >= window]
            bounds[r] = ((min(enters) if enters else window) - 1e-9, math.inf)
        return False, [0], bounds, notes
    common = set.intersection(*({k for k, _, _ in s} for s in marked.values()))
    spans = {r: {k: (a, b) for k, a, b in s} for r, s in marked.items()}
    windows = {r: traffic._window_start(d) for r, d in dumps.items()}
    whole = sorted(k for k in common if all(spans[r][k][0] >= windows[r] for r in dumps))
    steps = [k for k in whole if k >= 2 and k - 1 in common] or whole[:1]
    # a run of consecutive steps (the replay runs through every call between its ends)
    run = [steps[0]] if steps else []
    for k in steps[1:]:
        if k != run[-1] + 1:
            break
        run.append(k)
    if not run:
        raise TraceError("no step that every rank marked is held whole by every rank's flight recorder "
                         "(raise PYCOLL_TRACE_BUFFER, or mark steps with pycoll.mark_step())")
    lost = len([k for k in common if k not in whole and k != 1])
    if lost:
        notes.append(f"{lost} earlier marked steps are left out: the recorders no longer hold all their calls "
                     f"(a ring keeps PYCOLL_TRACE_BUFFER calls per communicator); predicted from the {len(run)} kept")
    skipped = len([k for k in whole if k not in run and k != 1])
    if skipped:
        notes.append(f"{skipped} marked steps after a gap in the marks are left out")
    bounds = {r: (spans[r][run[0]][0], spans[r][run[-1]][1]) for r in dumps}
    return True, run, bounds, notes


def _held(dump: dict, lo: float, hi: float) -> List[Tuple[dict, dict]]:
    """(communicator, entry) of a dump's completed calls entered in (lo, hi], by when they were entered."""
    out = [(c, e) for c in dump.get("comms", []) for e in c.get("calls", [])
           if lo < e["enter"] <= hi and e.get("state") == "completed" and e.get("end")]
    out.sort(key=lambda ce: (ce[1]["enter"], ce[1]["seq"]))
    return out


def _collectives(held: Dict[int, List[Tuple[dict, dict]]], comms: Dict[str, Dict[str, Any]]) -> Dict[Key, Instance]:
    """The collectives every member holds in its replayed span, with their members' recorded times."""
    calls: Dict[Key, Dict[int, dict]] = defaultdict(dict)
    for r, items in held.items():
        for c, e in items:
            if not e.get("p2p"):
                calls["c", c["id"], e["seq"]][r] = e
    # the end of the call before, per rank and communicator (the queue's hand-off is measured after it)
    last_end: Dict[Tuple[int, str], float] = {}
    prev_end: Dict[Tuple[int, Key], float] = {}
    for key in sorted(calls, key=lambda k: (k[1], k[2])):
        for r, e in calls[key].items():
            prev_end[r, key] = last_end.get((r, key[1]), -math.inf)
            last_end[r, key[1]] = e["end"]
    out: Dict[Key, Instance] = {}
    for key, entries in calls.items():
        group = comms[key[1]]["group"]
        if set(entries) != set(group):
            continue
        last = max(e["start"] for e in entries.values())
        out[key] = Instance(
            key, "coll", key[1], entries[group[0]]["call"], list(group), entries,
            handoff={r: max(0.0, e["start"] - max(e["enter"], prev_end[r, key])) for r, e in entries.items()},
            after={r: e["end"] - last for r, e in entries.items()},
            own={r: e["end"] - e["start"] for r, e in entries.items()},
            queued={r: e["start"] != e["enter"] for r, e in entries.items()})
    return out


def _p2p(held: Dict[int, List[Tuple[dict, dict]]], comms: Dict[str, Dict[str, Any]],
         dumps: Dict[int, dict]) -> Dict[Key, Instance]:
    """Sends matched with receives: per communicator, sender, receiver and tag, in posting order
    (counted from the first call a recorder holds, or from its last where a ring has wrapped);
    a receive from any rank takes the first unmatched send to it with its tag."""
    sends: Dict[Tuple[str, int, int, int], List[dict]] = defaultdict(list)
    recvs: Dict[Tuple[str, int, int, int], List[dict]] = defaultdict(list)
    anysrc: Dict[Tuple[str, int, int], List[dict]] = defaultdict(list)
    wrapped = False
    window = {r: {id(e) for _, e in items} for r, items in held.items()}
    for r, d in dumps.items():
        for c in d.get("comms", []):
            group = c["group"]
            wrapped = wrapped or c.get("recorded", 0) > c.get("capacity", 0)
            for e in sorted((e for e in c.get("calls", []) if e.get("p2p")), key=lambda e: (e["enter"], e["seq"])):
                peer = e.get("peer")
                if peer is None:
                    continue
                if e["call"].endswith("send"):
                    sends[c["id"], r, group[peer], e.get("tag")].append(e)
                elif peer == -1:
                    anysrc[c["id"], r, e.get("tag")].append(e)
                else:
                    recvs[c["id"], group[peer], r, e.get("tag")].append(e)
    for (cid, dst, tag), posted in anysrc.items():  # the earliest unmatched send to dst with that tag
        for e in posted:
            cands = [(s[len(recvs[cid, src, d, t])]["enter"] if len(s) > len(recvs[cid, src, d, t]) else math.inf, src)
                     for (c2, src, d, t), s in sends.items() if c2 == cid and d == dst and t == tag]
            if cands and min(cands)[0] < math.inf:
                recvs[cid, min(cands)[1], dst, tag].append(e)
    out: Dict[Key, Instance] = {}
    for (cid, src, dst, tag), s_list in sends.items():
        r_list = recvs.get((cid, src, dst, tag), [])
        n = min(len(s_list), len(r_list))
        pairs = zip(s_list[-n:], r_list[-n:]) if wrapped else zip(s_list[:n], r_list[:n])
        for k, (se, re_) in enumerate(pairs):
            if id(se) not in window[src] or id(re_) not in window[dst] or src == dst:
                continue
            if se.get("state") != "completed" or re_.get("state") != "completed":
                continue
            key = ("p", cid, src, dst, tag, k)
            last = max(se["enter"], re_["enter"])
            entries = {src: se, dst: re_}
            out[key] = Instance(key, "p2p", cid, se["call"], [src, dst], entries,
                                handoff={src: 0.0, dst: 0.0},
                                after={g: e["end"] - last for g, e in entries.items()},
                                own={g: e["end"] - e["enter"] for g, e in entries.items()},
                                queued={g: e["call"] not in BLOCKING_P2P for g, e in entries.items()})
    return out


def _waited(e: dict) -> bool:
    """Whether entry `e` holds when its caller waited on it (an async call waited for, in a dump that
    records waits)."""
    return e.get("wait_begin") is not None and e.get("wait_end") is not None


def _program(rank: int, calls: List[Tuple[dict, Instance]], marks: List[Tuple[int, float]], begin: float) -> List[Op]:
    """Rank `rank`'s program from its matched calls, their recorded waits and its marks (see the
    module docstring for how the waits a dump does not hold are inferred)."""
    events: List[Tuple[float, int, Any]] = [(e["enter"], 0, (e, inst)) for e, inst in calls]
    events += [(t, 1, k) for k, t in marks]
    events += [(e["wait_begin"], 2, (e, inst)) for e, inst in calls if _waited(e)]
    events.sort(key=lambda ev: (ev[0], ev[1]))
    ops: List[Op] = []
    released = begin
    pending: List[Tuple[float, Key]] = []  # (end, key) of async calls not yet waited for

    def waits_before(t: float) -> None:
        nonlocal pending
        due = sorted(p for p in pending if p[0] <= t)
        ops.extend(Op("wait", key=key) for _, key in due)
        pending = [p for p in pending if p[0] > t]

    for i, (t, kind, what) in enumerate(events):
        if t > released:
            ops.append(Op("compute", t - released))
            released = t
        waits_before(t)
        if kind == 1:
            ops.append(Op("mark", step=what))
            continue
        e, inst = what
        if kind == 2:  # the recorded wait: blocked until the call ended (the wait's own return is compute)
            ops.append(Op("wait", key=inst.key))
            released = max(released, e["end"])
            continue
        nxt = events[i + 1][0] if i + 1 < len(events) else math.inf
        block = (inst.kind == "coll" and e["start"] == e["enter"]) or e["call"] in BLOCKING_P2P or \
            (nxt >= e["end"] and not _waited(e))
        ops.append(Op("issue", key=inst.key, block=block))
        if block:
            released = max(released, e["end"])
        elif not _waited(e):
            pending.append((e["end"], inst.key))
    ops.extend(Op("wait", key=key) for _, key in sorted(pending))
    return ops


# -- simulating -------------------------------------------------------------------------------------
@dataclass
class Costs:
    """What the simulation charges: per instance and member, (handoff, after, own) seconds, and
    per rank the factor on its compute; `relief`: per instance, per member that is the last ready
    and per member, the seconds that member ends before `after` (a call priced for its slowest
    arrival order: the last member's data may cross fewer links than the worst case)."""

    times: Dict[Key, Dict[int, Tuple[float, float, float]]]
    compute: Dict[int, float]
    source: str = "recorded durations"
    relief: Dict[Key, Dict[int, Dict[int, float]]] = field(default_factory=dict)


def recorded_costs(trace: Trace) -> Costs:
    """The recorded run's own durations: the replay gives back the recorded steps exactly when
    the programs and their dependencies describe the run (a check of the matching and the queues)."""
    return Costs({k: {m: (i.handoff[m], i.after[m], i.own[m]) for m in i.members} for k, i in trace.instances.items()},
                 {r: 1.0 for r in trace.ranks})


def signature(inst: Instance) -> Tuple[Any, ...]:
    """What makes calls alike: communicator, call, bytes, algorithm (alltoallv: its counts too)."""
    e = next(iter(inst.entries.values()))
    extra = tuple(tuple(inst.entries[m].get("send_counts") or ()) for m in inst.members) \
        if inst.call == "alltoallv" else ()
    return (inst.kind, inst.comm, inst.call, inst.nbytes, e.get("algorithm"), e.get("root"), e.get("tag"), extra)


def typical_costs(trace: Trace) -> Costs:
    """Every call charged the mean of its kind (same signature, same member): the durations a
    model of the calls would give, with the recorded compute; arrival skew, queueing and waiting
    then come from the simulation alone, so the replay's error says how far the step follows from
    typical call costs and the recorded compute."""
    groups: Dict[Tuple[Any, ...], List[Instance]] = defaultdict(list)
    for inst in trace.instances.values():
        groups[signature(inst)].append(inst)
    times: Dict[Key, Dict[int, Tuple[float, float, float]]] = {}
    for alike in groups.values():
        for pos, m in enumerate(alike[0].members):
            ms = [i.members[pos] for i in alike]
            med = tuple(statistics.fmean([getattr(i, f)[mm] for i, mm in zip(alike, ms)])
                        for f in ("handoff", "after", "own"))
            for i, mm in zip(alike, ms):
                after = i.after[mm]
                # a member that did not wait for the last one keeps that shape (an eager send stays eager)
                h, a, o = med
                times.setdefault(i.key, {})[mm] = (h, a if after >= 0 else min(a, -1e-12), o)
    return Costs(times, {r: 1.0 for r in trace.ranks}, "typical durations (each call the mean of its kind)")


@dataclass
class Blocked:
    """A span a rank's caller spent blocked on an instance: `wait` seconds of it before the last
    member was ready (waiting for `last`), the rest communication."""

    rank: int
    key: Key
    t0: float
    t1: float
    wait: float
    last: int
    step: int


@dataclass
class Timeline:
    """A simulated run: per rank its step ends, per step its split, and every blocked span."""

    marks: Dict[int, Dict[int, float]]            # rank -> step -> simulated time of its mark
    end: Dict[int, float]                         # rank -> when its program ended
    split: Dict[int, Dict[int, List[float]]]      # rank -> step -> [compute, comm, wait] seconds
    blocked: Dict[int, List[Blocked]]             # rank -> its blocked spans, in order
    computed: Dict[int, List[Tuple[float, float, int]]]  # rank -> (t0, t1, step) of its compute
    ready: Dict[Key, Dict[int, float]]            # instance -> member -> when it was ready
    ends: Dict[Key, Dict[int, float]]             # instance -> member -> when it ended
    start: Dict[Key, float]                       # instance -> when its last member was ready


def simulate(trace: Trace, costs: Costs) -> Timeline:
    """Run every rank's program against the others' (see the module docstring); TraceError if the
    programs cannot all finish (the dumps do not describe one consistent run)."""
    ranks = trace.ranks
    t = {r: trace.begin[r] - min(trace.begin.values()) for r in ranks}
    pc = {r: 0 for r in ranks}
    step = {r: (trace.steps[0] if trace.marked else 0) for r in ranks}
    issued: Dict[Key, Dict[int, float]] = defaultdict(dict)
    ready: Dict[Key, Dict[int, float]] = {}
    ends: Dict[Key, Dict[int, float]] = {}
    start: Dict[Key, float] = {}
    last_ready: Dict[Key, int] = {}  # per instance, the member ready last (its readiness is `start`)
    lanes = _lanes(trace)
    lane_end: Dict[Tuple[int, str, str], float] = {}
    lane_pos: Dict[Tuple[int, str, str], int] = defaultdict(int)
    marks: Dict[int, Dict[int, float]] = {r: {} for r in ranks}
    split: Dict[int, Dict[int, List[float]]] = {r: defaultdict(lambda: [0.0, 0.0, 0.0]) for r in ranks}
    blocked: Dict[int, List[Blocked]] = {r: [] for r in ranks}
    computed: Dict[int, List[Tuple[float, float, int]]] = {r: [] for r in ranks}

    def lane_of(inst: Instance, m: int) -> Optional[Tuple[int, str, str]]:
        if inst.kind == "coll":
            return (m, inst.comm, "coll")
        return (m, inst.comm, "p2p") if inst.queued[m] else None

    def resolve(inst: Instance) -> List[Instance]:
        """Settle what can be settled of `inst`, member by member: a member of a collective is ready
        once it issued the call and its queue reached it (and the call before on it ended); a p2p
        member once it posted it (the transport moves a message whatever the queue waits on first:
        an irecv posted before an isend on both sides of an exchange must not wait for each other).
        It ends `after` the last member was ready, or, where it did not wait for that (an eager send,
        a scatter's root), `own` after it was ready itself; a p2p queue records completions in
        posting order. Returns the instances next on the queues it moved."""
        key, cost, coll = inst.key, costs.times[inst.key], inst.kind == "coll"
        rd, en = ready.setdefault(key, {}), ends.setdefault(key, {})
        nxt: List[Instance] = []
        moved = True
        while moved:
            moved = False
            for m in inst.members:
                lane = lane_of(inst, m)
                if m in en or m not in issued[key]:
                    continue
                head = lane is None or lanes[lane][lane_pos[lane]] == key
                if coll and not head:
                    continue
                if m not in rd:
                    free = lane_end.get(lane, -math.inf) if coll else -math.inf
                    rd[m] = max(issued[key][m], free) + cost[m][0]
                    moved = True
                    if len(rd) == len(inst.members):
                        last_ready[key] = max(rd, key=rd.get)
                        start[key] = rd[last_ready[key]]
                _, after, own = cost[m]
                if (after >= 0 and key not in start) or not head:  # (p2p: it ends once its queue reaches it)
                    continue
                e = max(start[key] + after - _relief(costs, key, last_ready[key], m) if after >= 0 else rd[m] + own,
                        rd[m])
                if lane is not None:
                    if not coll:
                        e = max(e, lane_end.get(lane, -math.inf))
                    lane_end[lane] = e
                    lane_pos[lane] += 1
                    if lane_pos[lane] < len(lanes[lane]):
                        nxt.append(trace.instances[lanes[lane][lane_pos[lane]]])
                en[m] = e
                moved = True
        return nxt

    def settle(inst: Instance) -> None:
        work = [inst]
        while work:
            work.extend(resolve(work.pop()))

    def done(key: Key, r: int) -> bool:
        return r in ends.get(key, ())

    def block_on(r: int, key: Key) -> None:
        t0, t1 = t[r], max(t[r], ends[key][r])
        if t1 > t0:
            rd = ready[key]
            others = {m: v for m, v in rd.items() if m != r}
            last = max(others, key=others.get) if others else r
            wait = 0.0
            if key in start and last != r and rd[last] > rd[r]:
                wait = min(max(0.0, start[key] - t0), t1 - t0)
            blocked[r].append(Blocked(r, key, t0, t1, wait, last, step[r]))
            s = split[r][step[r]]
            s[1] += t1 - t0 - wait
            s[2] += wait
        t[r] = t1

    progress = True
    while progress:
        progress = False
        for r in ranks:
            prog = trace.programs[r]
            while pc[r] < len(prog):
                op = prog[pc[r]]
                if op.kind == "compute":
                    d = op.seconds * costs.compute[r]
                    computed[r].append((t[r], t[r] + d, step[r]))
                    split[r][step[r]][0] += d
                    t[r] += d
                elif op.kind == "mark":
                    marks[r][op.step] = t[r]
                    step[r] = op.step + 1
                elif op.kind == "issue":
                    if r not in issued[op.key]:
                        issued[op.key][r] = t[r]
                        settle(trace.instances[op.key])
                    if op.block:
                        if not done(op.key, r):
                            break
                        block_on(r, op.key)
                else:  # wait
                    if not done(op.key, r):
                        break
                    block_on(r, op.key)
                pc[r] += 1
                progress = True
    stuck = [r for r in ranks if pc[r] < len(trace.programs[r])]
    if stuck:
        what = "; ".join(f"rank {r} at {_describe(trace, trace.programs[r][pc[r]].key, r)}" for r in stuck[:8])
        raise TraceError(f"the replay cannot go on: {what} (the dumps do not describe one consistent run)")
    return Timeline(marks, dict(t), {r: dict(s) for r, s in split.items()}, blocked, computed, ready, ends, start)


def _relief(costs: Costs, key: Key, last: int, member: int) -> float:
    """Seconds `member` of instance `key` ends before its `after`, `last` having been ready last (Costs.relief)."""
    by_last = costs.relief.get(key)
    return by_last.get(last, {}).get(member, 0.0) if by_last else 0.0


def _lanes(trace: Trace) -> Dict[Tuple[int, str, str], List[Key]]:
    """Per (rank, communicator, "coll"/"p2p"): the instances its queue runs, in order."""
    lanes: Dict[Tuple[int, str, str], List[Tuple[Tuple[float, int], Key]]] = defaultdict(list)
    for inst in trace.instances.values():
        for m in inst.members:
            if inst.kind == "coll":
                lanes[m, inst.comm, "coll"].append(((inst.key[2], 0), inst.key))
            elif inst.queued[m]:
                e = inst.entries[m]
                lanes[m, inst.comm, "p2p"].append(((e["enter"], e["seq"]), inst.key))
    return {lane: [k for _, k in sorted(items)] for lane, items in lanes.items()}


def _describe(trace: Trace, key: Optional[Key], rank: Optional[int] = None) -> str:
    """A call as its rank made it: 'allreduce call 7 on world (count 8192, float32, op sum)',
    'irecv from 0 (tag 0, count 2048, float32) on world'."""
    if key is None:
        return "?"
    inst = trace.instances[key]
    name = trace.comms[inst.comm]["name"]
    if inst.kind == "coll":
        inner = analysis.describe_call(next(iter(inst.entries.values())))[len(inst.call):].strip()
        return f"{inst.call} call {key[2]} on {name}" + (f" {inner}" if inner else "")
    e = inst.entries[rank if rank in inst.entries else key[2]]
    peer = key[2] if rank == key[3] else key[3]
    return f"{e['call']} {'from' if rank == key[3] else 'to'} {peer} (tag {key[4]}, count {e.get('count')}) on {name}"


# -- steps ------------------------------------------------------------------------------------------
def step_times(trace: Trace, tl: Timeline) -> Dict[int, Dict[int, float]]:
    """step -> rank -> simulated seconds (from its mark before to its mark; the span without marks)."""
    if not trace.marked:
        first = min(trace.begin.values())
        zero = {r: trace.begin[r] - first for r in trace.ranks}
        return {0: {r: tl.end[r] - min(zero.values()) for r in trace.ranks}}
    out: Dict[int, Dict[int, float]] = {}
    first = min(trace.begin.values())
    for k in trace.steps:
        row = {}
        for r in trace.ranks:
            before = tl.marks[r].get(k - 1, trace.begin[r] - first) if k != trace.steps[0] else trace.begin[r] - first
            row[r] = tl.marks[r][k] - before
        out[k] = row
    return out


def _median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else 0.0


# -- why -------------------------------------------------------------------------------------------
def waiting_for(tl: Timeline, step: int) -> Dict[int, Dict[int, float]]:
    """rank -> the rank it waited for -> seconds, in step `step` (time blocked in a call before the
    last member was ready for it, charged to that member)."""
    out: Dict[int, Dict[int, float]] = {}
    for r, spans in tl.blocked.items():
        for b in spans:
            if b.step == step and b.wait > 0:
                out.setdefault(r, {})
                out[r][b.last] = out[r].get(b.last, 0.0) + b.wait
    return out


def critical_path(trace: Trace, tl: Timeline, step: int, rank: int) -> List[Dict[str, Any]]:
    """What step `step` of `rank` waited on, in order: walking back from its end, a rank's compute,
    a call it was blocked in, and where a call waited for a later member, on to that member at the
    moment it issued the call (or its queue freed up). Consecutive compute of one rank is merged.
    Each item: {"rank", "kind": "compute" | "call", "what", "t0_ms", "t1_ms"} from the step's start."""
    first = min(trace.begin.values())
    start = tl.marks[rank].get(step - 1, trace.begin[rank] - first) if trace.marked else 0.0
    end = tl.marks[rank][step] if trace.marked else tl.end[rank]
    segs: Dict[int, List[Tuple[float, float, str, Any]]] = {}
    for r in trace.ranks:
        items = [(a, b, "compute", None) for a, b, _ in tl.computed[r] if b > a]
        items += [(b.t0, b.t1, "call", b) for b in tl.blocked[r]]
        segs[r] = sorted(items, key=lambda x: (x[1], x[0]))
    path: List[Dict[str, Any]] = []
    r, t, eps = rank, end, 1e-9
    for _ in range(100000):
        if t <= start + eps:
            break
        ends = [x[1] for x in segs[r]]
        i = bisect_right(ends, t + eps) - 1
        if i < 0:
            break
        a, b, kind, blk = segs[r][i]
        if b <= start + eps:
            break
        if kind == "compute":
            path.append({"rank": r, "kind": "compute", "what": "compute", "t0": max(a, start), "t1": b})
            t = a
            continue
        inst_start = tl.start[blk.key]
        path.append({"rank": r, "kind": "call", "what": _describe(trace, blk.key, r),
                     "t0": max(inst_start if blk.wait > 0 else a, start), "t1": b})
        if blk.wait > 0 and blk.last != r:
            r, t = blk.last, tl.ready[blk.key][blk.last]
        else:
            t = a
    path.reverse()
    merged: List[Dict[str, Any]] = []
    for item in path:
        last = merged[-1] if merged else None
        if last and item["kind"] == last["kind"] == "compute" and last["rank"] == item["rank"]:
            last["t1"] = item["t1"]
        else:
            merged.append(dict(item))
    for item in merged:
        item["t0_ms"], item["t1_ms"] = (item.pop("t0") - start) * 1e3, (item.pop("t1") - start) * 1e3
    return merged


def why(trace: Trace, tl: Timeline, step: int, rank: int) -> Dict[str, Any]:
    """The critical path of step `step` (ending on `rank`, its slowest) and every rank's waiting for
    whom in it, with the path's compute and communication in total."""
    path = critical_path(trace, tl, step, rank)
    return {"step": step, "rank": rank, "critical_path": path,
            "path_compute_ms": sum(p["t1_ms"] - p["t0_ms"] for p in path if p["kind"] == "compute"),
            "path_comm_ms": sum(p["t1_ms"] - p["t0_ms"] for p in path if p["kind"] == "call"),
            "waiting_for_ms": {r: {p: s * 1e3 for p, s in sorted(w.items())}
                               for r, w in sorted(waiting_for(tl, step).items())}}


def replay(trace: Trace, costs: Optional[Costs] = None) -> Dict[str, Any]:
    """Simulate the trace (with `costs`, default its recorded durations) and say how the median
    step compares with the recorded one: {"step_ms", "measured_step_ms", "error", "split", ...}."""
    costs = costs or recorded_costs(trace)
    tl = simulate(trace, costs)
    times = step_times(trace, tl)
    order = sorted(times, key=lambda s: max(times[s].values()))
    middle = order[(len(order) - 1) // 2:len(order) // 2 + 1]  # the median step, or the two around it
    step = _median([max(times[s].values()) for s in middle])
    measured = _median(trace.measured_steps())
    parts = []
    for s in middle:  # each middle step's split on its slowest rank (what is left: a span's start before
        slowest = max(times[s], key=times[s].get)  # the rank's first call, counted as waiting)
        c, m, w = tl.split[slowest].get(s, [0.0, 0.0, 0.0])
        parts.append((c, m, w + max(0.0, times[s][slowest] - (c + m + w)), slowest))
    c, m, w = (_median([p[i] for p in parts]) for i in range(3))
    return {"trace": trace.folder, "job": trace.job, "ranks": len(trace.ranks), "marked": trace.marked,
            "steps": trace.steps if trace.marked else [], "notes": list(trace.notes), "durations": costs.source,
            "step_ms": step * 1e3, "median_step": middle[0], "slowest_rank": parts[0][3],
            "split": {"compute_ms": c * 1e3, "comm_ms": m * 1e3, "wait_ms": w * 1e3},
            "measured_step_ms": measured * 1e3,
            "error": (step - measured) / measured if measured > 0 else None,
            "per_step": [{"step": s, "predicted_ms": max(times[s].values()) * 1e3,
                          "measured_ms": max(trace.measured[s].values()) * 1e3} for s in trace.steps],
            "why": why(trace, tl, middle[0], parts[0][3]),
            "_timeline": tl}
