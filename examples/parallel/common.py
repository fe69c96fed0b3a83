"""What every job in examples/parallel/ shares: its command line, joining the job, timing its steps and
writing its results. Nothing here is specific to one kind of parallelism.

A job uses it like this (run as `python examples/parallel/JOB.py`, so `import common` finds this file):

    from common import Steps, env_layout, finish, init, make_parser, report, weights_digest

    parser = make_parser(__doc__)              # --backend pycoll|gloo, --json FILE, --steps, --warmup, --seed
    parser.add_argument(...)                   # the job's own options
    args = parser.parse_args()
    layout = env_layout()                      # rank, world, local rank/size from the launcher: no I/O
    if bad(args, layout): parser.error(...)    # validate before anything is sent
    init(args.backend)                         # torch.distributed.init_process_group
    steps = Steps(args.warmup)
    for _ in range(args.warmup + args.steps):
        with steps.step():                     # times the step; pycoll.mark_step() at its end
            ...
    report(args, steps, loss=..., **weights_digest(params), match="bit-identical")  # every rank calls
    finish(args.backend)                       # tears the group down and exits 0

Launchers: `pycoll run -n N python JOB.py ...` and `torchrun --nproc-per-node N JOB.py ...` both set RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT; with none of them set the job runs as
a world of one process. Backend "pycoll" needs no import: pycoll's `torch.backends` entry point registers it.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import json
import os
import socket
import statistics
import sys
import time
from typing import Any, Dict, Iterable, Iterator, List, NamedTuple, Optional

import torch
import torch.distributed as dist

from pycoll import mark_step

BACKENDS = ("pycoll", "gloo")
MATCHES = ("bit-identical", "float32 rounding")  # what a job's `match` key promises against gloo


def make_parser(doc: Optional[str]) -> argparse.ArgumentParser:
    """An argument parser with the options every job has: --backend pycoll|gloo (default pycoll),
    --json FILE (rank 0 writes the results there), --steps N timed steps after --warmup W untimed ones,
    --seed S for the random weights and data. `doc` is the job's module docstring (first line: the
    description, the rest: shown after the options)."""
    lines = (doc or "").strip().splitlines()
    p = argparse.ArgumentParser(description=lines[0] if lines else None,
                                epilog="\n".join(lines[1:]).strip() or None,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=BACKENDS, default="pycoll", help="torch.distributed backend (default pycoll)")
    p.add_argument("--json", metavar="FILE", default=None, help="write the results as JSON to FILE (rank 0)")
    p.add_argument("--steps", type=_positive, default=5, metavar="N", help="timed steps (default 5)")
    p.add_argument("--warmup", type=_non_negative, default=1, metavar="W",
                   help="untimed steps before them (default 1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights and data (default 0)")
    return p


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


class Layout(NamedTuple):
    """Where this process sits, as the launcher's variables say (read before any connection is made).
    Ranks fill hosts in order: host h holds ranks h*local_world .. (h+1)*local_world-1, as torchrun
    and `pycoll run` place them."""
    rank: int
    world: int
    local_rank: int
    local_world: int

    @property
    def hosts(self) -> int:
        """How many hosts the job spans."""
        return self.world // self.local_world

    def host_of(self, rank: int) -> int:
        """The host index of `rank`."""
        return rank // self.local_world


def env_layout() -> Layout:
    """This process's Layout from RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE (torchrun and
    `pycoll run` set them); with none set, a world of one. SystemExit names the variable that is
    missing or wrong."""
    env = os.environ
    if "RANK" not in env and "WORLD_SIZE" not in env:
        return Layout(0, 1, 0, 1)
    try:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        local_rank = int(env.get("LOCAL_RANK", rank))
        local_world = int(env.get("LOCAL_WORLD_SIZE", world))
    except (KeyError, ValueError) as e:
        raise SystemExit(f"{_prog()}: error: the launcher's variables are incomplete or not numbers ({e!r}): "
                         f"start the job with `pycoll run -n N python {_prog()} ...` or "
                         f"`torchrun --nproc-per-node N {_prog()} ...`")
    if not (0 <= rank < world and 0 <= local_rank < local_world and world % local_world == 0):
        raise SystemExit(f"{_prog()}: error: RANK={rank} WORLD_SIZE={world} LOCAL_RANK={local_rank} "
                         f"LOCAL_WORLD_SIZE={local_world} do not describe hosts of equal size")
    return Layout(rank, world, local_rank, local_world)


def init(backend: str, timeout_s: float = 300.0) -> Layout:
    """Join the job: torch.distributed.init_process_group(backend) from the launcher's variables (or a
    world of one on a free loopback port when there is no launcher). Also gives each rank its share of
    the host's cores for torch's intra-op threads unless OMP_NUM_THREADS says otherwise (N ranks each
    running all cores' threads slow each other down)."""
    layout = env_layout()
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // layout.local_world))
    timeout = datetime.timedelta(seconds=timeout_s)
    if "RANK" in os.environ:
        dist.init_process_group(backend, timeout=timeout)
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                                timeout=timeout)
    return layout


class Steps:
    """Times training steps (or generated tokens): `with steps.step(): ...` measures one, and ends it
    with pycoll.mark_step(), so a flight-recorder trace can tell the steps apart. The first `warmup`
    steps are marked but not kept in `times_ms`."""

    def __init__(self, warmup: int = 0) -> None:
        self.warmup = warmup
        self.count = 0
        self.times_ms: List[float] = []

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """One step: its wall time from entry to exit, then mark_step()."""
        t0 = time.perf_counter()
        yield
        elapsed = (time.perf_counter() - t0) * 1e3
        mark_step()
        if self.count >= self.warmup:
            self.times_ms.append(elapsed)
        self.count += 1


def median(values: Iterable[float]) -> float:
    """The median of `values` (at least one)."""
    return float(statistics.median(list(values)))


def percentile(values: Iterable[float], q: float) -> float:
    """The q-th percentile (0..100) of `values` (at least one), linear between the nearest two."""
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return float(xs[lo] + (xs[hi] - xs[lo]) * (k - lo))


def weights_digest(tensors: Iterable[torch.Tensor]) -> Dict[str, Any]:
    """`weights_sha` (sha256 of the tensors' float32 bytes in order: equal only if bit-identical) and
    `checksum` (their float64 sum of absolute values, to compare within rounding)."""
    flat = torch.cat([t.detach().reshape(-1).to(torch.float32) for t in tensors])
    return {"weights_sha": hashlib.sha256(flat.numpy().tobytes()).hexdigest(),
            "checksum": float(flat.to(torch.float64).abs().sum())}


def report(args: argparse.Namespace, steps: Steps, **extra: Any) -> Dict[str, Any]:
    """Gather every rank's step times and write the results: every rank must call it (it all-gathers).
    `step_ms` is the median over the timed steps of the slowest rank's time for that step (a step ends
    for the job when its last rank ends it); `step_ms_per_step` keeps each step's. `extra` (JSON-able:
    loss, weights_sha, match, ...) is added as given. Rank 0 prints one summary line and writes
    --json FILE; returns the results on every rank."""
    world = dist.get_world_size()
    per_rank: List[Optional[List[float]]] = [None] * world
    dist.all_gather_object(per_rank, steps.times_ms)
    counts = {len(t or []) for t in per_rank}
    if len(counts) != 1:
        raise RuntimeError(f"ranks timed different numbers of steps: {[len(t or []) for t in per_rank]}")
    per_step = [max(t[i] for t in per_rank if t is not None) for i in range(counts.pop())]
    result: Dict[str, Any] = {"backend": args.backend, "ranks": world,
                              "step_ms": median(per_step) if per_step else None,
                              "steps": len(per_step), "step_ms_per_step": per_step}
    result.update(extra)
    if dist.get_rank() == 0:
        shown = {k: v for k, v in result.items() if k != "step_ms_per_step" and not isinstance(v, (list, dict))}
        print(f"[{_prog()}] " + ", ".join(f"{k} {_fmt(v)}" for k, v in shown.items()), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
                f.write("\n")
    return result


def _fmt(v: Any) -> str:
    """A value for the summary line: floats to 4 digits, digests to their first 16 characters."""
    if isinstance(v, float):
        return f"{v:.4g}"
    return v[:16] if isinstance(v, str) and len(v) == 64 else str(v)


def finish(backend: str) -> None:
    """End the job: destroy the process group on pycoll; on gloo leave at once with exit status 0
    (torch 2.13's gloo teardown can abort at interpreter exit, with or without destroy_process_group)."""
    sys.stdout.flush()
    sys.stderr.flush()
    if backend == "gloo":
        os._exit(0)
    dist.destroy_process_group()


def _prog() -> str:
    return os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "job"
