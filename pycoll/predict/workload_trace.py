"""A bucket workload's step as a trace, so `--workload` and `--trace` are predicted by one simulator.

`pycoll predict --workload` knows one data-parallel step from its profile (forward+backward time,
when each gradient bucket is ready, the optimizer) rather than from recorded calls. This module
writes that step as the programs trace_replay.simulate runs for a recorded job:

    rank: compute (to bucket 0 ready) -> issue the wait probe (a barrier) and bucket 0's allreduce
          -> compute (to bucket 1 ready) -> issue bucket 1 ... -> compute (rest of backward)
          -> wait for the probe -> wait for every bucket -> compute (optimizer) -> mark

on two ranks that stand for the job's N: an average rank, and the slowest one, whose backward
ends `straggle` later (the expected maximum of N ranks' jitter). Each allreduce runs on the
communicator's one queue, in order, and starts when its last member is ready, as in a replay; its
duration is what the tuner prices it at for the target's N ranks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

from .trace_replay import Costs, Instance, Op, Timeline, Trace, simulate

COMM = "dp"          # the one communicator of a workload's step
AVERAGE, SLOWEST = 0, 1  # the two ranks standing for the job


@dataclass(frozen=True)
class StepTimes:
    """The average rank's step (seconds) and its parts: when it stopped computing, how long it was
    blocked until the wait probe was done (waiting for the slowest rank), the rest of its blocked
    time (exposed communication), and per bucket (ready, start, end)."""

    step: float
    wait: float
    exposed: float
    spans: List[Tuple[float, float, float]]


def _entry(call: str, seq: int, nbytes: int, algorithm: str) -> Dict[str, object]:
    return {"call": call, "seq": seq, "count": max(1, nbytes // 4), "itemsize": 4, "dtype": "float32",
            "op": "sum", "algorithm": algorithm, "enter": 0.0, "start": 0.0, "end": 0.0, "state": "completed"}


def step_trace(fwd: float, opt: float, ready: Sequence[float], buckets: Sequence[Tuple[int, str, float]],
               barrier: float, straggle: float) -> Tuple[Trace, Costs]:
    """The trace of one step and what each call costs: `buckets` are (bytes, algorithm, seconds) in
    launch order, `ready` each one's fraction of the backward, `barrier` the probe's seconds."""
    members = [AVERAGE, SLOWEST]
    instances: Dict[Tuple, Instance] = {}
    times: Dict[Tuple, Dict[int, Tuple[float, float, float]]] = {}
    # no bucket ready, no calls (one rank's step: compute alone)
    calls = [("barrier", 8, "probe", barrier)] + [("allreduce", b, a, c) for b, a, c in buckets] if ready else []
    for seq, (call, nbytes, algo, secs) in enumerate(calls):
        key = ("c", COMM, seq)
        e = _entry(call, seq, nbytes, algo)
        instances[key] = Instance(key, "coll", COMM, call, list(members), {m: dict(e) for m in members},
                                  handoff={m: 0.0 for m in members}, after={m: secs for m in members},
                                  own={m: secs for m in members}, queued={m: True for m in members})
        times[key] = {m: (0.0, secs, secs) for m in members}
    programs: Dict[int, List[Op]] = {}
    for m, backward in ((AVERAGE, fwd), (SLOWEST, fwd + straggle)):
        ops: List[Op] = []
        done = 0.0
        for seq, frac in enumerate(ready):
            at = frac * backward
            if at > done:
                ops.append(Op("compute", at - done))
                done = at
            if seq == 0:
                ops.append(Op("issue", key=("c", COMM, 0)))
            ops.append(Op("issue", key=("c", COMM, seq + 1)))
        if backward > done:
            ops.append(Op("compute", backward - done))
        ops += [Op("wait", key=("c", COMM, seq)) for seq in range(len(calls))]
        ops += [Op("compute", opt), Op("mark", step=1)]
        programs[m] = ops
    comms = {COMM: {"name": "world", "group": list(members), "hosts": None, "board": None}}
    trace = Trace("workload", None, list(members), {m: "host" for m in members}, {m: "host" for m in members},
                  comms, instances, programs, {m: 0.0 for m in members}, True, [1],
                  {1: {m: 0.0 for m in members}})
    return trace, Costs(times, {m: 1.0 for m in members}, "the tuner's prices")


def simulate_step(fwd: float, opt: float, ready: Sequence[float], buckets: Sequence[Tuple[int, str, float]],
                  barrier: float, straggle: float) -> StepTimes:
    """One step simulated (see step_trace); times in the unit of the inputs."""
    trace, costs = step_trace(fwd, opt, ready, buckets, barrier, straggle)
    tl: Timeline = simulate(trace, costs)
    step = tl.marks[AVERAGE][1]
    if not ready:
        return StepTimes(step, 0.0, 0.0, [])
    blocked = step - opt - fwd
    probe_end = tl.ends[("c", COMM, 0)][AVERAGE]
    wait = min(max(probe_end - fwd, 0.0), blocked)
    spans = [(frac * fwd, tl.start[("c", COMM, k + 1)], tl.ends[("c", COMM, k + 1)][AVERAGE])
             for k, frac in enumerate(ready)]
    return StepTimes(step, wait, blocked - wait, spans)
