"""`pycoll trace DIR`: line up the flight recorder's dumps of a job and name the rank and call at fault;
`--traffic`: what each rank sent each other rank (trace/traffic.py)."""
from __future__ import annotations

import argparse
import json
import sys
from typing import List

from ..trace import analysis, chrome, traffic


def build_parser() -> argparse.ArgumentParser:
    """The `pycoll trace` argument parser."""
    p = argparse.ArgumentParser(
        prog="pycoll trace", allow_abbrev=False,
        description="Read the rank<R>.json dumps in DIR (PYCOLL_TRACE_DIR, or pycoll run --trace-dir) and "
                    "print the first call where the ranks disagree and which rank is at fault (or, with "
                    "--traffic, what each rank sent). Exit 0 when there is no disagreement (or the traffic "
                    "report was printed), 1 when there is, 2 when DIR holds nothing to read or dumps of "
                    "more than one job.")
    p.add_argument("folder", metavar="DIR", help="the job's trace folder")
    p.add_argument("--json", action="store_true", help="print the verdict (or the traffic report) as JSON")
    p.add_argument("--traffic", action="store_true",
                   help="instead: the bytes and messages each rank sent each other rank, within hosts and "
                        "between them, per collective and per step marked with pycoll.mark_step() (the "
                        "median step), and each rank's time inside communication per step")
    p.add_argument("--chrome", metavar="OUT.json",
                   help="also write every rank's recorded calls as a Chrome trace (open in Perfetto or "
                        "chrome://tracing): one track per rank and communicator")
    p.add_argument("--live", action="store_true",
                   help="print what each rank's live file says now (for a running job) instead")
    return p


def main(argv: List[str]) -> int:
    """Run `pycoll trace ARGV`."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    if args.live:
        lines = analysis.live_view(args.folder)
        print("\n".join(lines) if lines else f"pycoll trace: no rank*.live files in {args.folder}")
        return 0 if lines else 2
    try:
        dumps, live = analysis.load(args.folder)
        analysis.one_job(dumps)
        report = traffic.traffic(dumps) if args.traffic else None
    except analysis.TraceError as e:
        print(f"pycoll trace: {e}", file=sys.stderr)
        return 2
    if args.chrome:
        chrome.write(analysis.chrome_trace(dumps), args.chrome)
    if report is not None:
        print(json.dumps(report, indent=1) if args.json else traffic.render(report, args.folder))
        return 0
    verdict = analysis.analyse(dumps, live)
    if args.json:
        print(json.dumps(verdict, indent=1, default=str))
    else:
        print(analysis.render(verdict, args.folder))
        if args.chrome:
            print(f"chrome trace written to {args.chrome} (open it in https://ui.perfetto.dev or chrome://tracing)")
    return 1 if verdict["disagreements"] or verdict["deadlocks"] else 0
