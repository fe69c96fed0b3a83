"""The Chrome trace format (the JSON Perfetto and chrome://tracing open), written by `pycoll trace
--chrome` and by the trainer's --timeline: one process per rank, one thread per track."""
from __future__ import annotations

import json
from typing import Any, Dict, List, Optional


def process(pid: int, name: str) -> Dict[str, Any]:
    """Metadata naming process `pid` (a rank)."""
    return {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": name}}


def thread(pid: int, tid: int, name: str) -> Dict[str, Any]:
    """Metadata naming track `tid` of process `pid` (a communicator, a thread)."""
    return {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}}


def span(name: str, pid: int, tid: int, start_s: float, seconds: float, cat: str = "",
         args: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """A complete event ('X') from `start_s` lasting `seconds` (both in seconds; the format counts us)."""
    event = {"ph": "X", "name": name, "cat": cat, "pid": pid, "tid": tid, "ts": start_s * 1e6,
             "dur": max(0.0, seconds) * 1e6}
    if args:
        event["args"] = args
    return event


def write(events: List[Dict[str, Any]], path: str) -> None:
    """Save `events` as a Chrome trace file."""
    with open(path, "w") as out:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, out)
