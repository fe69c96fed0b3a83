"""Read the flight recorder's dumps of a job and say which rank is at fault, in which call, and why.

The ranks' calls are lined up per communicator by call number (every rank numbers a communicator's
collectives alike). The first call number where the ranks do not all hold the same completed call
is the disagreement; each rank that causes it is a culprit of one kind:

- `no_dump`: it left no dump at all (dead, killed, or stuck where a signal cannot reach it);
- `never_entered`: it never reached the call (its last completed call, and where it was when it dumped);
- `mismatch`: it entered another collective, dtype, count, op or root (both sides are shown);
- `stuck`: it is still inside a call that other ranks completed.

Point-to-point calls are not numbered across ranks; the ones still waiting form a wait-for graph
(with the collectives' peers they still waited for) whose cycles are reported as deadlocks.
"""
from __future__ import annotations

import glob
import json
import os
import re
from collections import Counter
from typing import Any, Dict, List, Optional, Sequence, Tuple

from . import chrome
from .recorder import read_live

DONE = "completed"
_FIELDS = ("call", "dtype", "count", "op", "root")


class TraceError(ValueError):
    """A trace folder that holds nothing to analyse, or a file that is not a dump."""


def load(folder: str) -> Tuple[Dict[int, dict], Dict[int, dict]]:
    """({rank: dump}, {rank: live file}) of a trace folder."""
    if not os.path.isdir(folder):
        raise TraceError(f"{folder} is not a folder (pass the PYCOLL_TRACE_DIR / --trace-dir of the job)")
    dumps: Dict[int, dict] = {}
    for path in glob.glob(os.path.join(folder, "rank*.json")):
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError) as e:
            raise TraceError(f"{path} is not a readable pycoll trace dump: {e}") from None
        if not isinstance(data, dict) or "pycoll_trace" not in data:
            raise TraceError(f"{path} is not a pycoll trace dump (no 'pycoll_trace' field)")
        dumps[int(data["rank"])] = data
    live: Dict[int, dict] = {}
    for path in glob.glob(os.path.join(folder, "rank*.live")):
        try:
            info = read_live(path)
        except (OSError, ValueError):
            continue
        live[int(info["rank"])] = info
    if not dumps and not live:
        raise TraceError(f"{folder} holds no rank*.json dumps or rank*.live files")
    return dumps, live


# ranks of one job are alive together: their dumps' lifetimes overlap, within this much clock skew
SKEW_S = 5.0


def one_job(dumps: Dict[int, dict]) -> None:
    """TraceError naming the ranks of each job when the dumps come from more than one job: by the job
    identity the dumps carry (a hash of the job token, or a launcher's job id), and where a dump
    has none, by lifetimes that never overlapped (the ranks of one job run at the same time)."""
    jobs: Dict[str, List[int]] = {}
    for r, d in sorted(dumps.items()):
        if d.get("job"):
            jobs.setdefault(d["job"], []).append(r)
    if len(jobs) > 1:
        named = "; ".join(f"ranks {span(rs)} of job {job}" for job, rs in jobs.items())
        raise TraceError(f"the dumps come from {len(jobs)} different jobs ({named}): a folder holds one job's "
                         "dumps (give each job its own PYCOLL_TRACE_DIR, or remove the older dumps)")
    lives = {r: (d["started"], d["time"]) for r, d in dumps.items() if d.get("started") and d.get("time")}
    if len(lives) > 1 and not jobs:
        late = max(lives, key=lambda r: lives[r][0])
        early = min(lives, key=lambda r: lives[r][1])
        if lives[late][0] > lives[early][1] + SKEW_S:
            raise TraceError(f"the dumps come from different jobs: rank {early}'s process ended (dump at "
                             f"{_clock(lives[early][1])}) before rank {late}'s began ({_clock(lives[late][0])}); "
                             "a folder holds one job's dumps (give each job its own PYCOLL_TRACE_DIR, or "
                             "remove the older dumps)")


def _clock(t: float) -> str:
    import time
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def describe_call(e: Optional[dict]) -> str:
    """'allreduce (count 4, float32, op sum)' or 'recv from 1 (tag 0, count 4, float32)'."""
    if e is None:
        return "nothing"
    if e.get("p2p"):
        direction = "to" if e["call"].endswith("send") else "from"
        peer = "any rank" if e.get("peer") == -1 else e.get("peer")
        return f"{e['call']} {direction} {peer} (tag {e.get('tag')}, count {e.get('count')}, {e.get('dtype')})"
    parts = [f"count {e['count']}" if e.get("count") is not None else None, e.get("dtype"),
             f"op {e['op']}" if e.get("op") else None,
             f"root {e['root']}" if e.get("root") is not None else None]
    inner = ", ".join(p for p in parts if p)
    return e["call"] + (f" ({inner})" if inner else "")


def _at(e: Optional[dict]) -> str:
    return f" at {_short(e['site'])}" if e and e.get("site") else ""


def _short(site: Optional[str]) -> str:
    """A call site with the working directory's prefix taken off."""
    if not site:
        return "?"
    cwd = os.getcwd() + os.sep
    return site[len(cwd):] if site.startswith(cwd) else site


def _ranks(rs: Sequence[int]) -> str:
    rs = sorted(rs)
    return ("rank " if len(rs) == 1 else "ranks ") + ", ".join(map(str, rs))


def _fingerprint(e: dict) -> Tuple:
    return tuple(json.dumps(e.get(k), sort_keys=True) for k in _FIELDS)


class _Comm:
    """One communicator as every rank that dumped saw it."""

    def __init__(self, cid: str, name: str, group: List[int]) -> None:
        self.id, self.name, self.group = cid, name, group
        self.calls: Dict[int, Dict[int, dict]] = {}   # global rank -> seq -> entry (collectives)
        self.p2p: Dict[int, List[dict]] = {}          # global rank -> its point-to-point entries
        self.recorded: Dict[int, int] = {}            # global rank -> entries ever recorded

    def last(self, rank: int) -> int:
        return max(self.calls.get(rank, {}) or [0])

    def completed(self, rank: int) -> Optional[dict]:
        done = [e for e in self.calls.get(rank, {}).values() if e["state"] == DONE]
        return max(done, key=lambda e: e["seq"]) if done else None


def _comms(dumps: Dict[int, dict]) -> Dict[str, _Comm]:
    comms: Dict[str, _Comm] = {}
    for rank, dump in dumps.items():
        for c in dump.get("comms", []):
            comm = comms.setdefault(c["id"], _Comm(c["id"], c["name"], list(c["group"])))
            comm.calls[rank] = {e["seq"]: e for e in c["calls"] if not e.get("p2p")}
            comm.p2p[rank] = [e for e in c["calls"] if e.get("p2p")]
            comm.recorded[rank] = c.get("recorded", len(c["calls"]))
    return comms


def analyse(dumps: Dict[int, dict], live: Optional[Dict[int, dict]] = None) -> Dict[str, Any]:
    """The verdict on a job's dumps: {"ranks", "dumped", "no_dump", "disagreements", "deadlocks"}.

    Each disagreement is {"comm", "seq", "expected", "culprits": [{"rank", "kind", "text", ...}],
    "hints"}, the earliest (by when its call was entered) first."""
    live = live or {}
    comms = _comms(dumps)
    ranks = sorted(set(dumps) | set(live) | {r for c in comms.values() for r in c.group})
    missing = [r for r in ranks if r not in dumps] if dumps else []
    found = [d for d in (_disagreement(c, dumps, live) for c in comms.values()) if d is not None]
    found.sort(key=lambda d: (d.pop("_t"), d["comm"]))
    return {"ranks": ranks, "dumped": sorted(dumps), "no_dump": missing, "disagreements": found,
            "deadlocks": _deadlocks(comms, dumps)}


def _disagreement(comm: _Comm, dumps: Dict[int, dict], live: Dict[int, dict]) -> Optional[Dict[str, Any]]:
    """The first call of `comm` that its ranks do not all hold completed and alike, judged."""
    dumped = [r for r in comm.group if r in dumps]
    absent = [r for r in comm.group if r not in dumps]
    if not dumped:
        return None
    present_calls = {r: comm.calls.get(r, {}) for r in dumped}
    lows = [min(calls) for calls in present_calls.values() if calls]
    lo = max(lows) if lows else 1
    hi = max((comm.last(r) for r in dumped), default=0)
    for seq in range(lo, hi + 1):
        entries = {r: present_calls[r].get(seq) for r in dumped}
        there = {r: e for r, e in entries.items() if e is not None}
        gone = [r for r, e in entries.items() if e is None and comm.last(r) < seq]
        prints = Counter(_fingerprint(e) for e in there.values())
        all_done = all(e["state"] == DONE for e in there.values())
        if len(prints) <= 1 and all_done and not gone:
            continue  # alike and finished by every rank that dumped (so the absent ones took part too)
        return _judge(comm, seq, there, gone, absent, prints, dumps, live)
    if absent:  # every dumped rank completed all it entered: the absent ranks are what is left
        return _judge(comm, hi + 1, {}, [], absent, Counter(), dumps, live)
    return None


def _judge(comm: _Comm, seq: int, there: Dict[int, dict], gone: List[int], absent: List[int],
           prints: Counter, dumps: Dict[int, dict], live: Dict[int, dict]) -> Dict[str, Any]:
    """Name each culprit of `comm`'s call `seq`."""
    # the call the majority entered (a tie goes to the lowest rank's, as PYCOLL_DEBUG=DETAIL does)
    ranked = sorted(there.items())
    top = max(prints.values()) if prints else 0
    expected_print = next((_fingerprint(e) for _, e in ranked if prints[_fingerprint(e)] == top), None)
    expected = next((e for _, e in ranked if _fingerprint(e) == expected_print), None)
    agree = [r for r, e in ranked if _fingerprint(e) == expected_print]
    done = [r for r in agree if there[r]["state"] == DONE]
    culprits: List[Dict[str, Any]] = []
    for r in absent:
        text = f"rank {r}: left no dump: dead, killed, or stuck where no signal reached it (a suspect)"
        progress = _live_line(live.get(r), comm.id)
        culprits.append({"rank": r, "kind": "no_dump", "text": text + (f"; {progress}" if progress else "")})
    for r in gone:
        last = comm.completed(r)
        dump = dumps[r]
        last_text = (f"its last completed call on {comm.name} is {last['seq']} ({describe_call(last)}{_at(last)})"
                     if last else f"it completed no call on {comm.name}")
        where = dump.get("where")
        culprits.append({"rank": r, "kind": "never_entered", "last_completed": last, "where": where,
                         "text": f"rank {r}: never entered call {seq}; {last_text}; when it dumped "
                                 f"({dump.get('reason')}) it was at {_short(where)}"})
    for r, e in ranked:
        if _fingerprint(e) != expected_print:
            culprits.append({"rank": r, "kind": "mismatch", "entered": e, "expected": expected,
                             "text": f"rank {r}: entered a different call: {describe_call(e)}{_at(e)}, where "
                                     f"{_ranks(agree)} entered {describe_call(expected)}{_at(expected)}"})
    if done:
        for r in agree:
            e = there[r]
            if e["state"] != DONE:
                waited = f"; it was waiting for {_ranks(e['waiting_for'])}" if e.get("waiting_for") else ""
                culprits.append({"rank": r, "kind": "stuck", "entered": e,
                                 "text": f"rank {r}: stuck inside call {seq} ({describe_call(e)}{_at(e)}, "
                                         f"{e['state']}) that {_ranks(done)} completed{waited}"})
    if not culprits:  # all entered the same call, none finished: say whom each waited for
        for r, e in ranked:
            waited = f"waiting for {_ranks(e['waiting_for'])}" if e.get("waiting_for") else e["state"]
            culprits.append({"rank": r, "kind": "waiting", "entered": e,
                             "text": f"rank {r}: inside call {seq} ({describe_call(e)}{_at(e)}), {waited}"})
    times = [e["enter"] for e in there.values()]
    return {"comm": comm.name, "comm_id": comm.id, "seq": seq, "expected": expected, "agree": agree,
            "culprits": culprits, "hints": _skipped(comm, seq, dumps), "_t": min(times) if times else float("inf")}


def _live_line(info: Optional[dict], cid: str) -> Optional[str]:
    if info is None:
        return None
    for c in info["comms"]:
        if c["comm_id"] == cid:
            return f"its live file says it entered call {c['entered']} and completed call {c['completed']}"
    return None


def _skipped(comm: _Comm, seq: int, dumps: Dict[int, dict]) -> List[str]:
    """Where a rank made fewer calls from one line of code than the others up to call `seq` (only
    while no ring has wrapped): the call it skipped, or an extra call the others made."""
    ranks = [r for r in comm.group if r in dumps and comm.calls.get(r)]
    if len(ranks) < 2 or any(min(comm.calls[r]) != 1 for r in ranks):
        return []
    counts = {r: Counter((e["site"], e["call"]) for s, e in comm.calls[r].items() if s <= seq) for r in ranks}
    hints = []
    for site, call in sorted({k for c in counts.values() for k in c}, key=lambda k: (str(k[0]), k[1])):
        made = {r: counts[r][(site, call)] for r in ranks}
        usual = Counter(made.values()).most_common(1)[0][0]
        odd = [r for r in ranks if made[r] != usual]
        if odd and len(odd) < len(ranks):
            for r in odd:
                skipped = f" (it skipped {usual - made[r]})" if made[r] < usual else ""
                hints.append(f"rank {r} made {made[r]} {call} call(s) from {_short(site)} up to call {seq}, "
                             f"the other ranks {usual}{skipped}")
    return hints


def _deadlocks(comms: Dict[str, _Comm], dumps: Dict[int, dict]) -> List[Dict[str, Any]]:
    """Cycles among the ranks' unfinished calls: r -> p when r waits on p (a pending receive from p, a
    pending send to p, or a collective still waiting for p). A cycle within one collective call is
    that call's disagreement, already reported; one through a point-to-point call or across calls
    or communicators is a deadlock of its own."""
    edges: Dict[int, List[Tuple[int, str, Tuple]]] = {}
    for comm in comms.values():
        for r in dumps:
            for e in comm.p2p.get(r, []):
                if e["state"] != DONE and e.get("peer") not in (None, -1):
                    edges.setdefault(r, []).append((comm.group[e["peer"]], f"{describe_call(e)} on "
                                                    f"{comm.name}{_at(e)}", ("p2p", comm.id, r, e["seq"])))
            for e in comm.calls.get(r, {}).values():
                if e["state"] != DONE:
                    for p in e.get("waiting_for") or []:
                        edges.setdefault(r, []).append((p, f"{describe_call(e)} call {e['seq']} on "
                                                        f"{comm.name}{_at(e)}", (comm.id, e["seq"])))
    cycles, seen = [], set()
    for start in sorted(edges):
        cycle = _cycle(start, edges, [], set())
        if not cycle or frozenset(r for r, _ in cycle) in seen:
            continue
        kinds = {what for _, (_, _, what) in cycle}
        if len(kinds) == 1 and next(iter(kinds))[0] != "p2p":
            continue
        seen.add(frozenset(r for r, _ in cycle))
        text = " while ".join(f"rank {r} waits in {how} for rank {nxt}" for r, (nxt, how, _) in cycle)
        cycles.append({"ranks": sorted(r for r, _ in cycle), "text": f"deadlock: {text}"})
    return cycles


def _cycle(node: int, edges: Dict[int, List[Tuple[int, str, Tuple]]], path: List[Tuple[int, Tuple]],
           on_path: set) -> Optional[List[Tuple[int, Tuple]]]:
    """A cycle through `node` reached along `path`, as [(rank, the edge it waits on)]."""
    for edge in edges.get(node, []):
        peer = edge[0]
        if peer in on_path or peer == node:
            start = next((i for i, (r, _) in enumerate(path) if r == peer), len(path))
            return path[start:] + [(node, edge)]
        if peer in edges and len(path) < 64:
            found = _cycle(peer, edges, path + [(node, edge)], on_path | {node})
            if found:
                return found
    return None


def render(verdict: Dict[str, Any], folder: str = "") -> str:
    """The verdict as text: the first disagreement and its culprits, then any others, then deadlocks."""
    lines = [f"pycoll trace{' ' + folder if folder else ''}: {len(verdict['ranks'])} rank(s); dumps from "
             f"{_ranks(verdict['dumped']) if verdict['dumped'] else 'no rank'}"
             + (f"; no dump from {_ranks(verdict['no_dump'])}" if verdict["no_dump"] else "")]
    if not verdict["dumped"]:
        lines.append("no disagreement: no rank dumped (no pycoll error, signal or uncaught exception)")
        return "\n".join(lines)
    if not verdict["disagreements"] and not verdict["deadlocks"]:
        lines.append("no disagreement: every rank that dumped holds the same calls, all completed")
        return "\n".join(lines)
    for cyc in verdict["deadlocks"]:
        lines.append(cyc["text"].replace("deadlock:", "DEADLOCK:", 1))
    for i, d in enumerate(verdict["disagreements"]):
        head = "also" if i or verdict["deadlocks"] else "FIRST DISAGREEMENT"
        exp = d["expected"]
        entered = (f": {describe_call(exp)} entered by {_ranks(d['agree'])}{_at(exp)}" if exp else "")
        lines.append(f"{head}: {d['comm']} call {d['seq']}{entered}")
        lines.extend(f"  {c['text']}" for c in d["culprits"])
        lines.extend(f"  hint: {h}" for h in d["hints"])
    return "\n".join(lines)


def culprit_ranks(verdict: Dict[str, Any]) -> List[int]:
    """The ranks a deadlock, or else the first disagreement, blames."""
    if verdict["deadlocks"]:
        return sorted(verdict["deadlocks"][0]["ranks"])
    if verdict["disagreements"]:
        return sorted({c["rank"] for c in verdict["disagreements"][0]["culprits"] if c["kind"] != "waiting"})
    return []


def chrome_trace(dumps: Dict[int, dict]) -> List[Dict[str, Any]]:
    """Every rank's recorded calls as Chrome trace events (chrome.write saves them): one process per
    rank, one track per communicator; unfinished calls last until the rank's dump."""
    events: List[Dict[str, Any]] = []
    for rank, dump in sorted(dumps.items()):
        events.append(chrome.process(rank, f"rank {rank}"))
        for tid, c in enumerate(dump.get("comms", []), start=1):
            events.append(chrome.thread(rank, tid, c["name"]))
            for e in c["calls"]:
                end = e.get("end") or dump["time"]
                args = {k: e[k] for k in ("seq", "dtype", "count", "op", "root", "peer", "tag", "algo", "state",
                                          "site", "waiting_for", "error") if e.get(k) is not None}
                name = e["call"] if e.get("p2p") else f"{e['call']} #{e['seq']}"
                events.append(chrome.span(name, rank, tid, e["start"], end - e["start"], c["name"], args))
                if e["start"] > e["enter"]:
                    events.append(chrome.span(f"{name} (queued)", rank, tid, e["enter"], e["start"] - e["enter"],
                                              c["name"]))
    return events


def live_view(folder: str, ranks: Optional[Sequence[int]] = None) -> List[str]:
    """What each rank's live file says now: one line per rank (its last entered and completed call
    per communicator), then per communicator how many ranks have completed up to which call."""
    infos: Dict[int, dict] = {}
    for path in glob.glob(os.path.join(folder, "rank*.live")):
        try:
            info = read_live(path)
        except (OSError, ValueError):
            continue
        infos[int(info["rank"])] = info
    lines = []
    per_comm: Dict[str, Dict[int, List[int]]] = {}
    for rank in sorted(set(infos) | set(ranks or [])):
        info = infos.get(rank)
        if info is None:
            lines.append(f"rank {rank}: no live file (no communicator yet, or PYCOLL_TRACE_BUFFER=0)")
            continue
        parts = []
        for c in info["comms"]:
            p2p = (f", p2p {c['p2p_completed']}/{c['p2p_entered']} done" if c["p2p_entered"] else "")
            failed = f", call {c['failed']} FAILED" if c["failed"] else ""
            state = ("idle" if c["entered"] == c["completed"] else f"in call {c['entered']}")
            parts.append(f"{c['name']}: entered {c['entered']}, completed {c['completed']} ({state}{failed}){p2p}")
            per_comm.setdefault(c["name"], {}).setdefault(c["completed"], []).append(rank)
        lines.append(f"rank {rank} (pid {info['pid']}): " + ("; ".join(parts) or "no communicator"))
    for name, by_done in per_comm.items():
        groups = sorted(by_done.items(), reverse=True)
        lines.append(f"{name}: " + ", ".join(f"{len(rs)} rank(s) up to call {done} ({span(rs)})"
                                             for done, rs in groups))
    return lines


def progress(folder: str) -> Tuple:
    """A value that changes whenever any rank's live file records a call entered or completed."""
    snapshot = []
    for path in sorted(glob.glob(os.path.join(folder, "rank*.live"))):
        try:
            info = read_live(path)
        except (OSError, ValueError):
            continue
        snapshot.append((info["rank"], tuple((c["comm_id"], c["entered"], c["completed"], c["p2p_entered"],
                                              c["p2p_completed"]) for c in info["comms"])))
    return tuple(snapshot)


def span(ranks: Sequence[int]) -> str:
    """'0-3, 6' for ranks [0, 1, 2, 3, 6]."""
    rs, out, i = sorted(ranks), [], 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        out.append(str(rs[i]) if i == j else f"{rs[i]}-{rs[j]}")
        i = j + 1
    return ", ".join(out)


def dump_ranks(folder: str) -> Dict[int, float]:
    """{rank: modification time} of the dumps in `folder`."""
    found = {}
    for path in glob.glob(os.path.join(folder, "rank*.json")):
        m = re.fullmatch(r"rank(\d+)\.json", os.path.basename(path))
        if m:
            try:
                found[int(m[1])] = os.path.getmtime(path)
            except OSError:
                pass
    return found
