"""The data-parallel training run: broadcast the start, train on shards, evaluate, gather the timings."""
from __future__ import annotations

import hashlib
import itertools
import os
import time
from dataclasses import dataclass
from typing import Callable, Optional, Tuple, TypeVar

import numpy as np

from .. import config, grow
from ..comm import Communicator
from ..trace.recorder import mark_step
from .elastic import Elastic, Event, heal, is_newcomer
from .data import Digits, eval_shard, global_batches, load_digits, shard, steps_per_epoch
from .model import Params, forward, init_params, layer_sizes, loss_and_correct
from .optim import Adam
from .replica import Replica
from .report import Console, Window, epoch_line, header_line, step_line
from .schema import Metrics, TrainConfig, TrainResult
from .timing import breakdown, throughput

T = TypeVar("T")
BASELINE_STEPS = 20  # timed steps of the in-run 1-rank baseline (after one warm-up step)


class ConfigError(ValueError):
    """A TrainConfig that cannot run on this many ranks."""


def check_config(cfg: TrainConfig, ranks: int) -> None:
    """Raise ConfigError naming the option that does not fit (before any rank communicates)."""
    if cfg.epochs < 1 or cfg.batch_size < 1 or cfg.bucket_kb < 0 or cfg.log_every < 0 \
            or cfg.blas_threads < 1:
        raise ConfigError("--epochs, --batch-size and --blas-threads must be positive, "
                          "--bucket-kb and --log-every not negative")
    if cfg.batch_size % ranks:
        raise ConfigError(f"--batch-size {cfg.batch_size} (global) must be divisible by the {ranks} ranks")
    if cfg.straggler and not 0 <= cfg.straggler[0] < ranks:
        raise ConfigError(f"--straggler rank {cfg.straggler[0]} is not in 0..{ranks - 1}")


def train(comm: Communicator, cfg: TrainConfig, console: Optional[Console] = None,
          data: Optional[Digits] = None) -> TrainResult:
    """Train the MLP on digits across `comm`; every rank must call it with the same config. `data`:
    load_digits() done already (an elastic newcomer loads it before it joins, so the members do not
    wait for that while they heal it)."""
    if not (cfg.elastic and is_newcomer(comm)):  # (a newcomer joins whatever size the run has come to)
        check_config(cfg, comm.size)
    from threadpoolctl import threadpool_limits  # installed with scikit-learn
    with threadpool_limits(cfg.blas_threads, user_api="blas"):
        return _train(comm, cfg, console or Console(False), data or load_digits(np.dtype(cfg.dtype)))


def _train(comm: Communicator, cfg: TrainConfig, console: Console, data: Digits) -> TrainResult:
    """train(), inside the BLAS thread limit."""
    per_epoch = steps_per_epoch(len(data.y_train), cfg.batch_size)
    if per_epoch == 0:
        raise ConfigError(f"--batch-size {cfg.batch_size} exceeds the {len(data.y_train)} training samples")
    sizes = layer_sizes(data.features, cfg.hidden, data.classes)
    newcomer = cfg.elastic and is_newcomer(comm)  # joined a running run: healed below, from rank 0
    if not newcomer:
        console.line(header_line(cfg, comm.size, len(data.y_train), len(data.y_test), sizes))
    params = init_params(sizes, cfg.seed + comm.rank, np.dtype(cfg.dtype))
    baseline = None
    if not newcomer:
        for p in params:  # every rank drew its own start; rank 0's wins, as in DDP's constructor
            comm.broadcast(p, root=0)
        baseline = _baseline(comm, cfg, data, params)
    straggle = cfg.straggler[1] / 1000 if cfg.straggler and cfg.straggler[0] == comm.rank else 0.0
    replica = Replica(params, cfg.optimizer, cfg.lr, int(cfg.bucket_kb * 1024), comm, straggle)

    total = per_epoch * cfg.epochs
    local_batch = cfg.batch_size // comm.size
    rows = np.full((total, replica.record_width), np.nan)  # a newcomer's steps before it joined stay NaN
    losses, correct, seen = np.zeros(total), np.zeros(total), np.full(total, float(local_batch))
    pos = _Position()
    clock = np.array([np.nan if baseline is None else baseline, 0.0])  # 1-rank samples/s, the common start
    if not newcomer:
        comm.barrier()
        clock[1] = time.perf_counter()  # the common origin of every rank's timeline (to a barrier's skew)
    elastic = Elastic(comm, lambda event: _announce(elastic, event)) if cfg.elastic else None
    if elastic is not None and newcomer:
        elastic.retry(lambda c: _heal(c, pos, replica, clock), 0)
        comm = elastic.comm
        seen[:pos.step] = 0  # the steps before it joined had no samples here
        _joined(comm, pos)
    first_since_grow = False
    while pos.epoch < cfg.epochs:
        batches = list(global_batches(len(data.y_train), cfg.batch_size, pos.epoch, cfg.seed))
        while pos.index < len(batches):
            batch = batches[pos.index]
            pos.tried += 1
            step = pos.step
            if elastic is None:
                mine = shard(batch, comm.rank, comm.size)
                losses[step], correct[step], rows[step] = replica.step(data.x_train[mine], data.y_train[mine])
            else:  # the batch over whoever is left; a step that failed anywhere is run again, over the survivors
                replica.buckets.comm = elastic.comm  # (a report's reduction may have shrunk it too)
                got = elastic.call(lambda c: replica.gradients(*_part(data, batch, c)), pos.tried,
                                   replica.buckets.abandon)
                comm = elastic.comm
                if got is None:
                    continue
                replica.update(got[2])
                losses[step], correct[step], rows[step] = got
                seen[step] = len(np.array_split(batch, comm.size)[comm.rank])
            pos.index += 1
            pos.step += 1
            mark_step()  # the flight recorder's step boundary (pycoll trace --traffic, predict --trace)
            if first_since_grow and comm.rank == 0:
                print(f"pycoll.trainer: [t={time.monotonic():.3f}] first step on {comm.size} ranks done "
                      f"(step {pos.step})", flush=True)
            first_since_grow = False
            if cfg.log_every and pos.step % cfg.log_every == 0:
                lo, hi = pos.step - cfg.log_every, pos.step
                window = _sync(elastic, comm, lambda c: _window(c, losses[lo:hi], correct[lo:hi], seen[lo:hi],
                                                              rows[lo:hi]), pos.tried)
                comm = elastic.comm if elastic is not None else comm
                console.line(step_line(pos.epoch, cfg.epochs, pos.step, total, window))
            console.progress(pos.step, total)
            # newcomers the members agreed on in this step grow in at its very end: a newcomer's first
            # call is then the next step's, as the members' is
            if elastic is not None and elastic.newcomers_waiting:
                first_since_grow = elastic.grow(pos.tried, lambda c: _heal(c, pos, replica, clock))
                comm = elastic.comm
        lo, hi = pos.first, pos.step
        window = _sync(elastic, comm, lambda c: _window(c, losses[lo:hi], correct[lo:hi], seen[lo:hi],
                                                      rows[lo:hi]), pos.tried)
        test = _sync(elastic, comm, lambda c: evaluate(c, params, data.x_test, data.y_test), pos.tried)
        console.line(epoch_line(pos.epoch, cfg.epochs, window, test))
        pos.epoch, pos.index, pos.first = pos.epoch + 1, 0, pos.step
    console.done()
    if elastic is not None:
        comm = elastic.comm
        if elastic.grows and comm.rank == 0:
            grow.finish(comm)  # a newcomer still waiting for a step boundary waits no more

    result = TrainResult(params=params, train=evaluate(comm, params, data.x_train, data.y_train), test=test,
                         plan=replica.buckets.plan, replicas_identical=_replicas_identical(comm, params),
                         events=[] if elastic is None else elastic.events, comm=comm)
    gathered = comm.gather(rows[:pos.step] - clock[1], root=0)
    if comm.rank == 0:
        result.records = gathered
        result.samples_per_s = throughput(gathered, cfg.batch_size)
        result.baseline_sps = result.samples_per_s if np.isnan(clock[0]) else float(clock[0])
    return result


@dataclass
class _Position:
    """Where a run is: what a newcomer is healed with (besides the model and the optimizer)."""
    step: int = 0   # steps that updated the model
    tried: int = 0  # steps attempted (one that failed and ran again counts twice here)
    epoch: int = 0
    index: int = 0  # the epoch's next global batch
    first: int = 0  # `step` when the epoch began (its report's window)


def _heal(comm: Communicator, pos: _Position, replica: Replica, clock: np.ndarray) -> bool:
    """Give every rank rank 0's position, parameters and optimizer state (elastic.heal)."""
    opt = replica.optimizer
    counters = np.array([pos.step, pos.tried, pos.epoch, pos.index, pos.first, getattr(opt, "t", 0)], np.int64)
    heal(comm, counters, clock, list(replica.params) + opt.state_arrays())
    pos.step, pos.tried, pos.epoch, pos.index, pos.first = (int(c) for c in counters[:5])
    if isinstance(opt, Adam):
        opt.t = int(counters[5])
    return True


def _joined(comm: Communicator, pos: _Position) -> None:
    """A newcomer says when it announced itself and where it joined the run."""
    joined = grow.growth(comm)
    announced = f", announced at t={joined.began:.3f}" if joined is not None else ""
    print(f"pycoll.trainer: [t={time.monotonic():.3f}] joined the run as rank {comm.rank} of {comm.size} at step "
          f"{pos.step} (slot {os.environ.get('RANK', '?')}, restart {config.get('PYCOLL_RESTART_COUNT')}"
          f"{announced}), healed from rank 0", flush=True)


def _part(data: Digits, batch: np.ndarray, comm: Communicator) -> Tuple[np.ndarray, np.ndarray, float]:
    """This rank's share of a global batch over however many ranks are left (elastic: uneven shares),
    and its gradient's weight (model.backward): the average over the ranks is the global batch's."""
    mine = np.array_split(batch, comm.size)[comm.rank]
    return data.x_train[mine], data.y_train[mine], len(mine) * comm.size / len(batch)


def _sync(elastic: Optional[Elastic], comm: Communicator, fn: Callable[[Communicator], T], step: int) -> T:
    """A reduction for the report: on `comm`, or, elastic, again over the survivors if a rank dies
    during it."""
    return fn(comm) if elastic is None else elastic.retry(fn, step)


def _announce(elastic: Elastic, event: Event) -> None:
    """Print a failure event on the (new) rank 0."""
    if elastic.comm.rank == 0:
        print(f"pycoll.trainer: {event}", flush=True)


def evaluate(comm: Communicator, params: Params, x: np.ndarray, y: np.ndarray) -> Metrics:
    """Mean loss and accuracy over (x, y), each rank scoring its part and the sums allreduced."""
    part = eval_shard(len(y), comm.rank, comm.size)
    loss, right = loss_and_correct(forward(params, x[part])[0], y[part])
    sums = comm.allreduce(np.array([loss, right, len(y[part])], np.float64))
    return Metrics(loss=sums[0] / sums[2], accuracy=sums[1] / sums[2])


def _window(comm: Communicator, losses: np.ndarray, correct: np.ndarray, seen: np.ndarray,
            rows: np.ndarray) -> Window:
    """Loss and accuracy over these steps of all ranks (`seen`: samples per step here), with the time
    split averaged over ranks."""
    b = breakdown(rows)  # (a newcomer's steps before it joined are NaN: they count as none)
    timed = np.count_nonzero(~np.isnan(b.step))
    sums = comm.allreduce(np.array([losses.sum(), correct.sum(), seen.sum(), np.nansum(b.step),
                                    np.nansum(b.compute), np.nansum(b.wait), np.nansum(b.comm),
                                    np.nansum(b.comm_total), timed]))
    per_step_ms = 1000 * sums[3:-1] / max(sums[-1], 1)
    return Window(sums[0] / sums[2], sums[1] / sums[2], *per_step_ms)


def _baseline(comm: Communicator, cfg: TrainConfig, data: Digits, params: Params) -> Optional[float]:
    """1-rank samples/s: passed in, None with one rank (the run is its own baseline), or timed on
    rank 0 alone (a copy of the model, the whole global batch per step, no communication) while the
    other ranks wait in a barrier."""
    if cfg.baseline_sps is not None or comm.size == 1:
        return cfg.baseline_sps
    sps = None
    if comm.rank == 0:
        alone = Replica([p.copy() for p in params], cfg.optimizer, cfg.lr, int(cfg.bucket_kb * 1024), None)
        epochs = (global_batches(len(data.y_train), cfg.batch_size, e, cfg.seed) for e in itertools.count())
        batches = itertools.islice(itertools.chain.from_iterable(epochs), BASELINE_STEPS + 1)
        warm_up = next(batches)
        alone.step(data.x_train[warm_up], data.y_train[warm_up])
        start = time.perf_counter()
        for batch in batches:
            alone.step(data.x_train[batch], data.y_train[batch])
        sps = BASELINE_STEPS * cfg.batch_size / (time.perf_counter() - start)
    comm.barrier()
    return sps


def _replicas_identical(comm: Communicator, params: Params) -> bool:
    """Whether every rank holds bit-for-bit the same parameters (compared by digest)."""
    digest = hashlib.blake2b(b"".join(p.tobytes() for p in params), digest_size=16).digest()
    every = comm.allgather(np.frombuffer(digest, np.uint8))
    return bool((every == every[0]).all())
