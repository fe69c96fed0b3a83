"""`python -m pycoll.trainer`: train the digits MLP data-parallel on however many ranks launched it.

    python -m pycoll.trainer                                   # 1 rank
    python -m pycoll run -n 4 python -m pycoll.trainer --epochs 5
    mpirun -np 4 python -m pycoll.trainer --timeline steps.png --straggler 2:20
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import List, Optional, Tuple

import numpy as np

import pycoll

from .data import load_digits
from .loop import ConfigError, train
from .optim import OPTIMIZERS
from .report import Console, summary_lines
from .schema import TrainConfig
from .timeline import chrome_timeline, draw_timeline
from .workload import prediction_line, record


def parse_straggler(text: str) -> Tuple[int, float]:
    """--straggler RANK:MS as (rank, milliseconds)."""
    rank, sep, ms = text.partition(":")
    try:
        if sep:
            return int(rank), float(ms)
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"expected RANK:MS (e.g. 1:50), got {text!r}")


def parse_hidden(text: str) -> Tuple[int, ...]:
    """--hidden 128,64 as a tuple of positive layer widths."""
    try:
        widths = tuple(int(w) for w in text.split(","))
    except ValueError:
        widths = ()
    if not widths or min(widths) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer widths (e.g. 128,64), got {text!r}")
    return widths


def build_parser() -> argparse.ArgumentParser:
    """The trainer's options; defaults come from TrainConfig."""
    d = TrainConfig()
    p = argparse.ArgumentParser(prog="python -m pycoll.trainer", description=__doc__.split("\n")[0],
                                epilog="How times are measured: see pycoll/trainer/README.md.")
    p.add_argument("--epochs", type=int, default=d.epochs,
                   help=f"passes over the training set (default {d.epochs})")
    p.add_argument("--batch-size", type=int, default=d.batch_size,
                   help=f"global batch, split evenly across ranks (default {d.batch_size})")
    p.add_argument("--lr", type=float, default=d.lr, help=f"learning rate (default {d.lr})")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default=d.optimizer,
                   help="sgd (momentum 0.9) or adam")
    p.add_argument("--hidden", type=parse_hidden, default=d.hidden, metavar="W[,W...]",
                   help=f"hidden layer widths (default {','.join(map(str, d.hidden))})")
    p.add_argument("--bucket-kb", type=float, default=d.bucket_kb,
                   help=f"gradient bucket size in KiB (default {d.bucket_kb:g}; 0: one bucket per parameter)")
    p.add_argument("--dtype", choices=("float32", "float64"), default=d.dtype,
                   help=f"parameter and gradient type (default {d.dtype})")
    p.add_argument("--seed", type=int, default=d.seed,
                   help=f"initialisation and shuffling seed (default {d.seed})")
    p.add_argument("--log-every", type=int, default=d.log_every, metavar="K",
                   help=f"print loss and time split every K steps (default {d.log_every}; 0: per epoch only)")
    p.add_argument("--straggler", type=parse_straggler, metavar="RANK:MS",
                   help="make RANK sleep MS milliseconds in compute every step")
    p.add_argument("--baseline-sps", type=float, metavar="S",
                   help="1-rank throughput (samples/s) for the scaling efficiency; default: measured in this run")
    p.add_argument("--blas-threads", type=int, default=d.blas_threads, metavar="T",
                   help=f"BLAS threads per rank (default {d.blas_threads}, as torchrun sets OMP_NUM_THREADS)")
    p.add_argument("--elastic", action="store_true",
                   help="go on when a rank dies: the survivors drop that step, shrink and re-shard "
                        "(run under `pycoll run --elastic`)")
    p.add_argument("--timeline", metavar="OUT.png",
                   help="draw each rank's last steps (compute / comm / wait), and write all steps beside it as "
                        "OUT.trace.json, a Chrome trace for https://ui.perfetto.dev or chrome://tracing")
    p.add_argument("--report-json", metavar="FILE",
                   help="write the run as a workload record for `pycoll predict` (buckets, when backward "
                        "produced them, compute per local batch, the measured step under step_ms, the tuner's "
                        "parameters) with the model's prediction of this run beside what was measured")
    return p


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The TrainConfig of parsed options."""
    return TrainConfig(epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, optimizer=args.optimizer,
                       hidden=args.hidden, bucket_kb=args.bucket_kb, seed=args.seed, log_every=args.log_every,
                       dtype=args.dtype, straggler=args.straggler, baseline_sps=args.baseline_sps,
                       blas_threads=args.blas_threads, elastic=args.elastic)


def main(argv: Optional[List[str]] = None) -> int:
    """Run the trainer on the ranks pycoll.init() finds; rank 0 prints and draws."""
    args = build_parser().parse_args(argv)
    cfg = config_from_args(args)
    data = load_digits(np.dtype(cfg.dtype))  # before init: a newcomer (--elastic) is ready when it joins
    with pycoll.init() as comm:
        try:
            result = train(comm, cfg, Console(comm.rank == 0), data)
        except ConfigError as e:
            print(f"pycoll.trainer: {e}", file=sys.stderr)
            return 2
        rec = record(result.comm, cfg, result) if args.report_json else None
        if result.comm.rank == 0:
            for line in summary_lines(result, cfg):
                print(line)
            if rec is not None:
                with open(args.report_json, "w") as fh:
                    json.dump(rec, fh, indent=1)
                print(prediction_line(rec))
                print(f"workload record written to {args.report_json} (pycoll predict --workload {args.report_json})")
            if args.timeline:
                straggler = f", rank {cfg.straggler[0]} +{cfg.straggler[1]:g} ms/step" if cfg.straggler else ""
                draw_timeline(result.records, args.timeline, f"pycoll.trainer: {comm.size} rank(s), "
                              f"global batch {cfg.batch_size}, buckets of {cfg.bucket_kb:g} KiB{straggler}")
                trace = os.path.splitext(args.timeline)[0] + ".trace.json"
                chrome_timeline(result.records, trace)
                print(f"timeline written to {args.timeline} (all steps as a Chrome trace: {trace})")
        if result.comm is not comm:  # shrunk (--elastic): the survivors' communicator owns the transport now
            result.comm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
