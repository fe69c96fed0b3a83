"""The workload record: what `pycoll predict` needs to know about one training job, written by
`python -m pycoll.trainer --report-json FILE` (pycoll/trainer/workload.py) or by a torch DDP model
(pycoll/predict/torch_record.py), and read back here.

A record holds, in JSON (times in milliseconds, sizes in bytes):

* `step_ms`: the measured median step; `measured`: its split (compute, exposed comm, wait, comm total);
* `buckets`: the gradient buckets in launch order, each with its `bytes` and `ready_frac`, when it
  became ready as a fraction of forward+backward (0: at the step's start, 1: at backward's end);
* `compute`: forward+backward and optimizer per step at the recorded local batch, `jitter_frac`
  (the spread of a rank's forward+backward from step to step, relative to its median) and
  `per_rank_ms` (each rank's median forward+backward);
* `profile`: forward+backward and optimizer timed on one rank alone at several local batch sizes,
  so a prediction for more ranks (a smaller share of the global batch) knows the compute it will do;
* `tuner`: the cost model's parameters and the board sizes of the recording run (Params.row order);
* `topology`: the ranks' hosts (`host_of`), cores per host, which hosts are one machine, and where
  racks were declared (PYCOLL_TOPO_FILE) each host's rack (`racks`) and the racks' `uplink_gbit`.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Sequence, Tuple

from ..tuner import Link, Params

KIND = "pycoll.workload"
VERSION = 1


class WorkloadError(ValueError):
    """A workload record that cannot be read or lacks what a prediction needs (the message says what)."""


@dataclass(frozen=True)
class Bucket:
    """One gradient bucket: its size and when backward finished it (fraction of forward+backward)."""

    nbytes: int
    ready_frac: float


@dataclass(frozen=True)
class ComputePoint:
    """Forward+backward and optimizer milliseconds per step at one local batch size (one rank alone)."""

    local_batch: float
    fwd_bwd_ms: float
    optimizer_ms: float


@dataclass
class Workload:
    """A parsed workload record (see the module docstring)."""

    source: str
    global_batch: int
    ranks: int
    host_of: List[int]
    cores: List[int]
    buckets: List[Bucket]
    compute: ComputePoint                      # at the recorded local batch, the ranks' medians
    jitter_frac: float                         # relative step-to-step spread of forward+backward
    profile: List[ComputePoint]                # one rank alone, by local batch
    params: Params                             # the tuner's parameters when it was recorded
    board_bytes: int = 0
    stage_bytes: int = 0
    step_ms: float = math.nan                  # measured
    measured: Dict[str, float] = field(default_factory=dict)
    machines: List[str] = field(default_factory=list)  # per host: the machine it runs on
    racks: List[str] = field(default_factory=list)     # per host: its rack ("" none; empty: no racks declared)
    uplink_gbit: Dict[str, float] = field(default_factory=dict)  # per rack: its uplink's rate (0: no limit)
    extra: Dict[str, Any] = field(default_factory=dict)  # everything else the file holds

    @property
    def local_batch(self) -> float:
        """Samples per rank per step in the recorded run."""
        return self.global_batch / self.ranks

    @property
    def gradient_bytes(self) -> int:
        """Bytes averaged per step (all buckets)."""
        return sum(b.nbytes for b in self.buckets)

    def compute_at(self, local_batch: float) -> Tuple[float, float]:
        """(forward+backward, optimizer) ms per step of one rank alone at `local_batch` samples:
        piecewise linear through the profile, extended linearly beyond it; without a profile, the
        recorded run's forward+backward scaled in proportion to the batch."""
        points = sorted(self.profile, key=lambda p: p.local_batch)
        if not points:
            scale = local_batch / self.local_batch
            return self.compute.fwd_bwd_ms * scale, self.compute.optimizer_ms
        if len(points) == 1:
            p = points[0]
            return p.fwd_bwd_ms * local_batch / p.local_batch, p.optimizer_ms
        i = 1
        while i < len(points) - 1 and points[i].local_batch < local_batch:
            i += 1
        a, b = points[i - 1], points[i]
        fwd = a.fwd_bwd_ms + (local_batch - a.local_batch) * (b.fwd_bwd_ms - a.fwd_bwd_ms) / (b.local_batch - a.local_batch)
        if local_batch < points[0].local_batch:  # below the profile: no less than proportional scaling
            fwd = max(fwd, points[0].fwd_bwd_ms * local_batch / points[0].local_batch)
        opt = median([p.optimizer_ms for p in points])  # the update does not depend on the batch
        return max(fwd, 0.0), opt

    def to_dict(self) -> Dict[str, Any]:
        """The JSON form (what `load` reads back)."""
        out = dict(self.extra)
        out.update({
            "kind": KIND, "version": VERSION, "source": self.source, "step_ms": self.step_ms,
            "global_batch": self.global_batch, "ranks": self.ranks,
            "topology": {"host_of": self.host_of, "cores": self.cores, "machines": self.machines,
                         **({"racks": self.racks, "uplink_gbit": self.uplink_gbit} if self.racks else {})},
            "buckets": [{"bytes": b.nbytes, "ready_frac": b.ready_frac} for b in self.buckets],
            "compute": {"local_batch": self.compute.local_batch, "fwd_bwd_ms": self.compute.fwd_bwd_ms,
                        "optimizer_ms": self.compute.optimizer_ms, "jitter_frac": self.jitter_frac},
            "profile": [{"local_batch": p.local_batch, "fwd_bwd_ms": p.fwd_bwd_ms, "optimizer_ms": p.optimizer_ms}
                        for p in self.profile],
            "tuner": {"source": self.params.source, "shm": _link(self.params.shm), "net": _link(self.params.net),
                      "gamma_s_per_byte": self.params.gamma, "cache_bytes": self.params.cache,
                      "spill": self.params.spill, "board_bytes": self.board_bytes,
                      "stage_bytes": self.stage_bytes},
            "measured": self.measured,
        })
        return out


def _link(link: Link) -> Dict[str, float]:
    return {"alpha_us": link.alpha * 1e6, "gbit": 8e-9 / link.beta}


def _unlink(d: Dict[str, Any]) -> Link:
    return Link(float(d["alpha_us"]) * 1e-6, 8e-9 / float(d["gbit"]))


def from_dict(d: Dict[str, Any], where: str = "workload") -> Workload:
    """Parse a record; WorkloadError names the missing or malformed field."""
    if not isinstance(d, dict) or d.get("kind") != KIND:
        raise WorkloadError(f"{where}: not a pycoll workload record (expected \"kind\": \"{KIND}\"; write one "
                            f"with `python -m pycoll.trainer --report-json FILE`)")
    if d.get("version") != VERSION:
        raise WorkloadError(f"{where}: record version {d.get('version')!r}, this pycoll reads version {VERSION}")
    try:
        topo, comp, tun = d["topology"], d["compute"], d["tuner"]
        known = {"kind", "version", "source", "step_ms", "global_batch", "ranks", "topology", "buckets", "compute",
                 "profile", "tuner", "measured"}
        return Workload(
            source=str(d["source"]), global_batch=int(d["global_batch"]), ranks=int(d["ranks"]),
            host_of=[int(h) for h in topo["host_of"]], cores=[int(c) for c in topo["cores"]],
            machines=[str(m) for m in topo.get("machines", [])],
            racks=[str(r) for r in topo.get("racks", [])],
            uplink_gbit={str(k): float(v) for k, v in topo.get("uplink_gbit", {}).items()},
            buckets=[Bucket(int(b["bytes"]), float(b["ready_frac"])) for b in d["buckets"]],
            compute=ComputePoint(float(comp["local_batch"]), float(comp["fwd_bwd_ms"]), float(comp["optimizer_ms"])),
            jitter_frac=float(comp.get("jitter_frac", 0.0)),
            profile=[ComputePoint(float(p["local_batch"]), float(p["fwd_bwd_ms"]), float(p["optimizer_ms"]))
                     for p in d.get("profile", [])],
            params=Params(_unlink(tun["shm"]), _unlink(tun["net"]), float(tun["gamma_s_per_byte"]),
                          str(tun.get("source", "record")), cache=float(tun.get("cache_bytes", 0.0)),
                          spill=float(tun.get("spill", 1.0))),
            board_bytes=int(tun.get("board_bytes", 0)), stage_bytes=int(tun.get("stage_bytes", 0)),
            step_ms=float(d.get("step_ms", math.nan)), measured=dict(d.get("measured", {})),
            extra={k: v for k, v in d.items() if k not in known})
    except (KeyError, TypeError, ValueError) as e:
        raise WorkloadError(f"{where}: malformed workload record ({type(e).__name__}: {e})") from None


def load(path: str) -> Workload:
    """Read a workload record from a JSON file."""
    try:
        with open(path) as fh:
            data = json.load(fh)
    except (OSError, ValueError) as e:
        raise WorkloadError(f"cannot read workload record {path!r}: {e}") from None
    return from_dict(data, path)


def save(workload: Workload, path: str) -> None:
    """Write a workload record as JSON."""
    with open(path, "w") as fh:
        json.dump(workload.to_dict(), fh, indent=1)
        fh.write("\n")


def median(values: Sequence[float]) -> float:
    """Median of finite values (NaN when there are none)."""
    vals = sorted(v for v in values if math.isfinite(v))
    if not vals:
        return math.nan
    mid = len(vals) // 2
    return vals[mid] if len(vals) % 2 else (vals[mid - 1] + vals[mid]) / 2
