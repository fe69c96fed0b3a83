"""Validate `pycoll predict --trace` on emulated clusters: record each job on one host, predict it on
H hosts x 2 ranks, run it there, compare. Writes docs/predict/trace-validation.json (every run) and
docs/predict/section-trace-validation.md (included in docs/predict.md by docs/make_predict.py).

    sudo PYTHONPATH=. python docs/make_predict_trace.py [--only dp,tp,...] [--hosts 2,3,4] [--repeats 1]
    sudo PYTHONPATH=. python docs/make_predict_trace.py --repredict    # today's model on the kept traces
    PYTHONPATH=. python docs/make_predict_trace.py --render            # the section from the JSON

The configurations below were fixed (and committed) before the first full run: record with one
configuration, check on configurations chosen before looking at the results. For each job and each H
in 2, 3, 4 (tests/predict_trace_cluster.py does the running):

- record: the job with 2H ranks on ONE host (every node of `pycoll run --nnodes H -n 2` in the first
  host's network namespace: one host id, every pair on shared memory), traced;
- targets: the same job on H hosts x 2 ranks (one node per namespace) on each of two links, tbf at
  1000 and 200 Mbit/s (serve: the userspace wire with a one-way delay of 1 and 4 ms), traced; the
  recording and its targets run back to back, so a slow spell of the machine hits them alike;
- predicted: `pycoll predict --trace RECORD --hosts H --ppn 2 --topo-file LINK --shared-cores 2 --json`,
  LINK declaring the net link as measured on that cluster before its runs: `gbit` (one raw TCP
  stream's rate), `latency_us` (one pycoll message between two hosts: half an 8-byte send/recv
  ping-pong's round trip, what the tuner's net alpha is) and `burst_kib` (the tbf's bucket, as the
  cluster sets it; 0 on the wire); --shared-cores because every emulated host shares this machine's
  2 cores (2H ranks on 2 cores, in the recording and in the target alike);
- measured: the target's median step from its own trace, counted as predict counts the recording's
  (marks, the first step left out, each step the slowest rank's); the job's JSON figure is kept too.

Each run is bounded by --timeout; a run that fails is recorded as failed and the others go on. A full
run (69 runs: 46 targets, 23 recordings) took 36-38 min at load average 10-25 on the project's 2-core
VM; --repeats N takes N times that. The traces stay under /var/tmp/pycoll-trace-validation/ for
--repredict.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(REPO, "tests"))

from netns_cluster import Cluster  # noqa: E402
from predict_trace_cluster import SYSCTLS, error, measure_link, predict_trace, run_traced  # noqa: E402

OUT = os.path.join(HERE, "predict", "trace-validation.json")
SECTION = os.path.join(HERE, "predict", "section-trace-validation.md")
PAGE = os.path.join(HERE, "predict.md")
HEADING = "## Validation of `--trace` what-if on emulated clusters"
KEEP = "/var/tmp/pycoll-trace-validation"  # the traces (outside the repository: predictions are re-made from them)

# -- the configurations (fixed before the first full run) ----------------------------------------------
PPN = 2
SHARED_CORES = 2              # this machine's cores: every emulated host shares them
HOSTS = (2, 3, 4)
RATES_MBIT = (1000, 200)      # tbf on each host's link
DELAYS_MS = (1.0, 4.0)        # serve: one-way delay of the userspace wire
GOAL_MEAN, GOAL_MAX = 0.10, 0.20
PY = sys.executable
PAR = os.path.join(REPO, "examples", "parallel")


@dataclass(frozen=True)
class Job:
    """A job to validate: its title, its command (for a world of `ranks`; {RESULT} is its JSON's
    path), the link it is checked on ("rate": tbf; "delay": the wire) and where it does not fit."""

    name: str
    title: str
    argv: Callable[[int], List[str]]
    link: str = "rate"
    unfit: Callable[[int], Optional[str]] = lambda hosts: None


def _par(script: str, *args: str) -> Callable[[int], List[str]]:
    return lambda ranks: [PY, os.path.join(PAR, script), "--backend", "pycoll", "--json", "{RESULT}", *args]


def _pp(schedule: str) -> Callable[[int], List[str]]:
    # one block per stage (stages = ranks); 8 microbatches: 1F1B needs at least as many as stages
    return lambda ranks: _par("pp.py", "--schedule", schedule, "--layers", str(ranks), "--dim", "96", "--heads", "4",
                              "--seq", "64", "--batch", "16", "--microbatches", "8", "--steps", "8")(ranks)


HYBRID = ["--tp", "2", "--dp-style", "ddp", "--dim", "32", "--heads", "4", "--mlp-ratio", "2", "--seq", "128",
          "--batch", "32", "--steps", "8"]
JOBS: Dict[str, Job] = {j.name: j for j in (
    Job("dp", "DP: python -m pycoll.trainer (numpy MLP 64-512-512-10, 1.2 MiB of gradients in 256 KiB buckets)",
        lambda ranks: [PY, "-m", "pycoll.trainer", "--epochs", "4", "--hidden", "512,512", "--batch-size", "240",
                       "--bucket-kb", "256", "--log-every", "0", "--baseline-sps", "1", "--report-json", "{RESULT}"]),
    Job("tp", "TP: examples/parallel/tp.py (TP over all ranks, 2 blocks, dim 96, 24 heads, seq 64, batch 8)",
        _par("tp.py", "--layers", "2", "--dim", "96", "--heads", "24", "--seq", "64", "--batch", "8", "--steps", "8")),
    Job("pp-gpipe", "PP GPipe: examples/parallel/pp.py (a stage per rank, one block each, 8 microbatches)",
        _pp("gpipe")),
    Job("pp-1f1b", "PP 1F1B: examples/parallel/pp.py --schedule 1f1b (as GPipe)", _pp("1f1b")),
    Job("ep", "EP: examples/parallel/ep.py (2 experts a rank, top-2, 512 tokens a rank, hidden 128, ffn 256)",
        _par("ep.py", "--tokens", "512", "--hidden", "128", "--ffn", "256", "--steps", "8")),
    Job("hybrid-inside", "hybrid: examples/parallel/hybrid.py --tp 2 --tp-inside-host (DDP over the TP pairs)",
        _par("hybrid.py", "--tp-inside-host", *HYBRID)),
    Job("hybrid-across", "hybrid: examples/parallel/hybrid.py --tp 2 --tp-across-hosts",
        _par("hybrid.py", "--tp-across-hosts", *HYBRID),
        unfit=lambda hosts: None if hosts % 2 == 0 else
        f"a TP pair takes one rank from each of 2 hosts: {hosts} hosts are not a multiple of 2"),
    Job("serve", "serve: examples/parallel/serve.py (TP decoding over all ranks, 2 layers, hidden 192, 24 heads, "
        "batch 1, 16-token prompts, 24 new tokens x 3; a step = a token)",
        _par("serve.py", "--layers", "2", "--hidden", "192", "--heads", "24", "--batch", "1", "--prompt-len", "16",
             "--new-tokens", "24", "--steps", "3"), link="delay"),
)}


# -- running ------------------------------------------------------------------------------------------
def _model_version() -> str:
    """The commit predicting, with '+' where the model's files differ from it."""
    def git(*a: str) -> str:
        return subprocess.run(["git", *a], capture_output=True, text=True, cwd=REPO).stdout.strip()
    head = git("rev-parse", "--short", "HEAD")
    if not head:
        return "a tree outside git"
    return head + ("+" if git("status", "--porcelain", "--", "pycoll/predict", "pycoll/tuner.py") else "")


def _predict(run: Dict[str, Any], record: Dict[str, Any]) -> Dict[str, Any]:
    """The prediction of target `run` from `record`'s trace with the link measured for it."""
    link = run["link"]
    try:
        got = predict_trace(record["trace"], run["hosts"], PPN, link["gbit"], link["latency_us"], SHARED_CORES,
                            link.get("burst_kib", 0.0))
    except Exception as e:  # a failed prediction is a result to report, not the end of the script
        return {"status": "failed", "error": str(e)[-3000:], "model": _model_version()}
    return {"status": "ok", "model": _model_version(), "step_ms": got["step_ms"],
            "split": got["split"], "replay_step_ms": got.get("replay_step_ms"),
            "repriced": got.get("repriced"), "error": error(got["step_ms"], run.get("measured_ms"))}


def _kept(run: Dict[str, Any]) -> Dict[str, Any]:
    """A run as the JSON keeps it: the job's own result reduced to its numbers and words (its lists,
    per rank and per step, are in the kept trace's folder)."""
    if isinstance(run.get("result"), dict):
        run["result"] = {k: v for k, v in run["result"].items() if isinstance(v, (int, float, str, bool))}
    return run


class Book:
    """The runs so far (docs/predict/trace-validation.json), saved after each one."""

    def __init__(self, fresh: bool) -> None:
        self.data: Dict[str, Any] = {"runs": []}
        if os.path.exists(OUT) and not fresh:
            with open(OUT) as fh:
                self.data = json.load(fh)

    def save(self) -> None:
        os.makedirs(os.path.dirname(OUT), exist_ok=True)
        with open(OUT + ".tmp", "w") as fh:
            json.dump(self.data, fh, indent=1)
        os.replace(OUT + ".tmp", OUT)


def _links(c: Cluster, nbytes: int) -> Dict[str, Any]:
    """The cluster's link as measured (predict_trace_cluster.measure_link) and its tbf bucket."""
    try:
        return dict(measure_link(c, nbytes), burst_kib=float(c.burst_kib) if c.rate_mbit else 0.0)
    except Exception as e:
        return {"error": str(e)[-1000:]}


def validate_hosts(book: Book, session: str, jobs: Sequence[Job], hosts: int, link: str, repeats: int,
                   timeout: float) -> None:
    """Every job of `jobs` on `hosts` hosts: clusters for both link settings built at once, links
    measured, then per job (and repeat) the recording and its two targets back to back."""
    settings = RATES_MBIT if link == "rate" else DELAYS_MS
    kw = (lambda s: {"rate_mbit": s}) if link == "rate" else (lambda s: {"delay_ms": s})
    nbytes = 16 << 20 if link == "rate" else 4 << 20  # the wire is one Python thread
    clusters = [Cluster(hosts, sysctls=SYSCTLS, **kw(s)) for s in settings]
    try:
        for c in clusters:
            c.__enter__()
        measured = [_links(c, nbytes) for c in clusters]
        print(f"  {hosts} hosts: links " + ", ".join(f"{s:g} {'Mbit/s' if link == 'rate' else 'ms'}: "
                                                     f"{m.get('gbit', float('nan')) * 1e3:.0f} Mbit/s, "
                                                     f"{m.get('latency_us', float('nan')):.0f} us"
                                                     for s, m in zip(settings, measured)), flush=True)
        for job in jobs:
            for rep in range(repeats):
                tag = f"{job.name}-h{hosts}-r{rep}"
                argv = job.argv(hosts * PPN)
                rec = run_traced(clusters[0], argv, [0] * hosts, PPN, os.path.join(KEEP, session, tag, "record"),
                                 timeout)
                rec.update(job=job.name, hosts=hosts, ranks=hosts * PPN, role="record", repeat=rep, session=session)
                book.data["runs"].append(_kept(rec))
                _say(rec)
                for s, c, m in zip(settings, clusters, measured):
                    label = f"{s:g}{'mbit' if link == 'rate' else 'ms'}"
                    run = run_traced(c, argv, list(range(hosts)), PPN, os.path.join(KEEP, session, tag, label),
                                     timeout)
                    run.update(job=job.name, hosts=hosts, ranks=hosts * PPN, role="target", repeat=rep,
                               session=session, link=dict(m, **kw(s)), record_trace=rec["trace"])
                    if run["status"] == "ok" and rec["status"] == "ok" and "gbit" in m:
                        run["prediction"] = _predict(run, rec)
                        run["first_prediction"] = run["prediction"]
                    book.data["runs"].append(_kept(run))
                    _say(run)
                book.save()
        after = [_links(c, nbytes) for c in clusters]
        book.data.setdefault("links", []).append({"session": session, "hosts": hosts, "link": link,
                                                  "settings": list(settings), "before": measured, "after": after})
        book.save()
    finally:
        for c in clusters:
            c.close()


def _say(run: Dict[str, Any]) -> None:
    what = f"{run['job']} {run['hosts']}x{PPN} {run['role']}"
    if run["role"] == "target":
        lk = run["link"]
        what += f" {lk.get('rate_mbit', lk.get('delay_ms')):g}{' Mbit/s' if 'rate_mbit' in lk else ' ms'}"
    if run["status"] != "ok":
        print(f"  {what}: FAILED after {run['wall_s']:.0f} s: {run.get('error', '')[-300:]}", flush=True)
        return
    p = run.get("prediction", {})
    pred = f", predicted {p['step_ms']:.1f} ms ({p['error']:+.1%})" if p.get("status") == "ok" else \
        (f", prediction FAILED: {p.get('error', '')[-200:]}" if p else "")
    print(f"  {what}: {run['wall_s']:.0f} s, load {run['load'][0]:.1f}-{run['load'][1]:.1f}, measured "
          f"{run['measured_ms']:.1f} ms{pred}", flush=True)


def repredict(book: Book) -> None:
    """Today's model on every kept target's recording (the first prediction stays beside it)."""
    records = {r["trace"]: r for r in book.data["runs"] if r["role"] == "record"}
    for run in book.data["runs"]:
        if run["role"] != "target" or run["status"] != "ok" or "gbit" not in run["link"]:
            continue
        rec = records.get(run["record_trace"])
        if rec is None or rec["status"] != "ok" or not os.path.isdir(rec["trace"]):
            continue
        run["prediction"] = _predict(run, rec)
        run.setdefault("first_prediction", run["prediction"])
        _say(run)
    book.save()


# -- the section ---------------------------------------------------------------------------------------
def _pct(v: Optional[float]) -> str:
    return "—" if v is None else f"{v:+.1%}"


def _mark(v: Optional[float]) -> str:
    if v is None:
        return "—"
    return f"**{v:+.1%} miss**" if abs(v) > GOAL_MAX else f"{v:+.1%}"


def _link_text(lk: Dict[str, Any]) -> str:
    if "rate_mbit" in lk:
        return f"{lk['rate_mbit']:g} Mbit/s (measured {lk.get('gbit', 0) * 1e3:.0f}, {lk.get('latency_us', 0):.0f} us)"
    return (f"{lk['delay_ms']:g} ms one way (measured {lk.get('latency_us', 0) / 1e3:.2f} ms, "
            f"{lk.get('gbit', 0) * 1e3:.0f} Mbit/s)")


def _summary(errors: List[float], what: str = "runs") -> str:
    if not errors:
        return "no runs"
    mean = statistics.fmean(abs(e) for e in errors)
    worst = max(abs(e) for e in errors)
    verdict = lambda v, g: "met" if v <= g else "**missed**"  # noqa: E731
    return (f"mean \\|error\\| **{mean:.1%}** (goal <= {GOAL_MEAN:.0%}: {verdict(mean, GOAL_MEAN)}), max \\|error\\| "
            f"**{worst:.1%}** (goal <= {GOAL_MAX:.0%}: {verdict(worst, GOAL_MAX)}) over {len(errors)} {what}; "
            f"{sum(abs(e) > GOAL_MAX for e in errors)} beyond {GOAL_MAX:.0%}")


def _session_errors(runs: List[Dict[str, Any]], which: str) -> List[float]:
    return [r[which]["error"] for r in runs if r["role"] == "target" and r["status"] == "ok"
            and (r.get(which) or {}).get("status") == "ok" and r[which].get("error") is not None]


def _job_table(name: str, job: Job, runs: List[Dict[str, Any]], records: Dict[str, Dict[str, Any]]) -> List[str]:
    """One job's targets (and failed recordings) of one session."""
    mine = [r for r in runs if r["job"] == name and r["role"] == "target"]
    lines = [f"### {job.title}", ""]
    unfit = [h for h in HOSTS if job.unfit(h)]
    if unfit:
        lines += [f"Not run on {', '.join(map(str, unfit))} hosts: {job.unfit(unfit[0])}.", ""]
    show_first = any((r.get("first_prediction") or {}).get("model") != (r.get("prediction") or {}).get("model")
                     for r in mine)
    head = "| hosts x ranks | link | load | recorded on 1 host ms | measured ms | predicted ms | error |"
    rule = "|---|---|---|---|---|---|---|"
    if show_first:
        head += " first prediction ms | its error |"
        rule += "---|---|"
    lines += [head, rule]
    for r in sorted(mine, key=lambda r: (r["hosts"], r["repeat"], -r["link"].get("rate_mbit", 0),
                                         r["link"].get("delay_ms", 0))):
        rec = records.get(r["record_trace"], {})
        cells = [f"{r['hosts']} x {PPN}", _link_text(r["link"]), f"{r['load'][0]:.1f}-{r['load'][1]:.1f}",
                 f"{rec['measured_ms']:.1f}" if rec.get("status") == "ok" else "failed"]
        p, f = r.get("prediction") or {}, r.get("first_prediction") or {}
        if r["status"] != "ok":
            cells += ["run failed", "—", "—"]
        else:
            cells += [f"{r['measured_ms']:.1f}", f"{p['step_ms']:.1f}" if p.get("status") == "ok" else "failed",
                      _mark(p.get("error") if p.get("status") == "ok" else None)]
        if show_first:
            cells += [f"{f['step_ms']:.1f}", _mark(f.get("error"))] if f.get("status") == "ok" else ["—", "—"]
        lines.append("| " + " | ".join(cells) + " |")
    failed = [str(r["hosts"]) for r in runs if r["job"] == name and r["role"] == "record" and r["status"] != "ok"]
    if failed:
        lines += ["", f"Recordings that failed: on {', '.join(failed)} hosts (their targets are not predicted)."]
    return lines + [""]


def _median_errors(runs: List[Dict[str, Any]]) -> Optional[List[float]]:
    """Per configuration (job, hosts, link) with more than one repeat: the median prediction's error
    against the median measured step; None where no configuration was repeated."""
    groups: Dict[tuple, List[Dict[str, Any]]] = {}
    for r in runs:
        if r["role"] == "target" and r["status"] == "ok" and (r.get("prediction") or {}).get("status") == "ok":
            lk = r["link"]
            groups.setdefault((r["job"], r["hosts"], lk.get("rate_mbit"), lk.get("delay_ms")), []).append(r)
    if not any(len(g) > 1 for g in groups.values()):
        return None
    return [statistics.median(r["prediction"]["step_ms"] for r in g) / statistics.median(r["measured_ms"] for r in g)
            - 1.0 for g in groups.values()]


def render(data: Dict[str, Any]) -> str:
    """The markdown section: the latest session's runs job by job, its errors against the goal, then
    each earlier session's errors (every run of every session is in the JSON)."""
    runs = data["runs"]
    records = {r["trace"]: r for r in runs if r["role"] == "record"}
    order = [s["session"] for s in data.get("sessions", [])] or sorted({r["session"] for r in runs})
    done = [s for s in order if any(r["session"] == s and r["role"] == "target" for r in runs)]
    latest = [r for r in runs if done and r["session"] == done[-1]]
    lines = [HEADING, "",
             "Generated by `docs/make_predict_trace.py` (`sudo PYTHONPATH=. python docs/make_predict_trace.py`; "
             "the configurations are fixed in it and were committed before the first full run). Each job is "
             f"recorded with 2H ranks on one host (every rank on shared memory), then run on H hosts x {PPN} ranks "
             "(network namespaces, tests/netns_cluster.py) on two links: tbf at "
             f"{' and '.join(f'{r:g}' for r in RATES_MBIT)} Mbit/s, or for TP decoding (serve) the userspace wire with "
             f"{' and '.join(f'{d:g}' for d in DELAYS_MS)} ms one-way delay. Predicted: `pycoll predict --trace RECORD "
             f"--hosts H --ppn {PPN} --topo-file LINK --shared-cores {SHARED_CORES} --json`, LINK declaring the net "
             "link as measured on that cluster before its runs (`gbit`: one TCP stream's rate; `latency_us`: one "
             "pycoll "
             "message between two hosts, half an 8-byte send/recv round trip; `burst_kib`: the tbf's bucket). "
             "Measured: the target run's median step from its own trace, counted as the prediction counts the "
             "recording's. Every emulated host shares this machine's 2 cores: 2H ranks on 2 cores in the recording "
             "and in the target alike. Load average: before and after each run (other developers' jobs, and the "
             "job's own 2H ranks).", ""]
    notes = data.get("notes", {})  # what happened to a session's runs, by session (written by hand)
    if done:
        lines += [f"Session {done[-1]}" + (f" ({notes[done[-1]]})" if done[-1] in notes else "") + ":", ""]
    for name, job in JOBS.items():
        if any(r["job"] == name for r in latest):
            lines += _job_table(name, job, latest, records)
    now, first = _session_errors(latest, "prediction"), _session_errors(latest, "first_prediction")
    models = sorted({r["prediction"]["model"] for r in latest if r.get("prediction")})
    lines += ["### All runs", "", f"Session {done[-1] if done else '—'}, today's model ({', '.join(models)}): "
              f"{_summary(now)}."]
    medians = _median_errors(latest)
    if medians is not None:
        lines += ["", f"Per configuration, the median of its repeats' predictions against the median of its "
                  f"measured runs: {_summary(medians, 'configurations')}."]
    if any((r.get("first_prediction") or {}).get("model") != (r.get("prediction") or {}).get("model")
           for r in latest if r["role"] == "target"):
        lines += ["", f"Its first predictions, made when each run was measured: {_summary(first)}."]
    earlier = done[:-1]
    if earlier:
        lines += ["", "| earlier session | load | targets | first predictions (model then) | today's model on its "
                  "recordings |", "|---|---|---|---|---|"]
        for sess in earlier:
            mine = [r for r in runs if r["session"] == sess]
            loads = [x for r in mine for x in r["load"]]
            then = sorted({(r.get("first_prediction") or {}).get("model", "?") for r in mine if r["role"] == "target"})
            targets = sum(r["role"] == "target" for r in mine)
            lines.append(f"| {sess} | {min(loads):.1f}-{max(loads):.1f} | {targets} | "
                         f"{_summary(_session_errors(mine, 'first_prediction'))} ({', '.join(then)}) | "
                         f"{_summary(_session_errors(mine, 'prediction'))} |")
        lines += [f"\nSession {sess}: {notes[sess]}." for sess in earlier if sess in notes]
    lines += ["", *NOTES]
    secs = [r["wall_s"] for r in latest]
    loads = [x for r in latest for x in r["load"]]
    if latest:
        lines += ["", f"_Session {done[-1]}: {len(latest)} runs ({sum(r['role'] == 'target' for r in latest)} "
                  f"targets, {sum(r['status'] != 'ok' for r in latest)} failed), {sum(secs) / 60:.0f} min of runs on "
                  f"this {os.cpu_count()}-core machine at load average {min(loads):.1f}-{max(loads):.1f}; every run of "
                  "every session in docs/predict/trace-validation.json._", ""]
    return "\n".join(lines)


# What changed in the model and in the method since the first session, and why (written by hand).
NOTES: List[str] = [
    "#### What changed after the first session, and why",
    "",
    "The first session (20261207-094011, model a436fba) described the link with `--link-gbit` and "
    "`--link-latency-us`, the latter half a raw 8-byte TCP echo's round trip (11 us). Its errors, and probes run "
    "beside it on 2 hosts x 2 ranks, showed two things the model had wrong (pycoll/predict/trace_target.py, "
    "commit d268ab5) and one the method had wrong:",
    "",
    "1. **Crowding.** `--shared-cores` scaled compute only: a call on the target was priced as if each emulated "
    "host had its own 2 cores (no rank beyond the cores), while the one-host recording's price of the same call "
    "counted 2H ranks on 2 cores. Moving a call from the recording to the target therefore took off the "
    "recording's charges for crowding (the tuner's CALL_OVERHEAD x crowd^2 and a scheduling turn per message per "
    "rank beyond the cores), though the target's ranks are exactly as crowded. Now both sides price a call with "
    "every rank that shares its cores (also a TP pair among 8 ranks on 2 cores: the tuner counted the pair "
    "alone).",
    "2. **Token bucket.** The emulated links are tbf rate limiters with a 256 KiB bucket: a burst passes at once "
    "and the rate holds only on average. Interleaved probe (load 17-22): a 192 KiB allreduce took 6.5 ms at 200 "
    "Mbit/s and 6.6 ms at 1000 Mbit/s, where its bytes at 193 Mbit/s need 8.1 ms; 1 MiB took 39-42 ms at 200 "
    "Mbit/s (44 ms at the rate, 33 ms with the bucket). The model priced every byte at the rate: a TP allreduce "
    "at 200 Mbit/s 7.9 ms dearer than on shared memory, measured about as dear as at 1000 Mbit/s. A topology "
    "file's `links.net.burst_kib` now declares a bucket: each call takes the tokens its host links hold when it "
    "starts in the replay, refilled at the rate while the link is idle, and is priced with the rest of its bytes "
    "only (two passes of the replay).",
    "3. **Message latency (the method).** The tuner's net alpha is what one pycoll message between hosts costs, "
    "not the wire's latency: a pycoll send/recv ping-pong between two emulated hosts measured 133-155 us one way "
    "at load 20 where the raw echo measured 11 us (shared memory: 48-63 us; the tuner's defaults are 120 and 40)."
    " With 11 us a message between hosts was priced cheaper than one inside a host. From the second session the "
    "script measures pycoll's own latency and passes the link as a topology file (gbit, latency_us, burst_kib).",
    "",
    "The first session's recordings predicted again with the new model (its link as measured then, with the tbf's"
    " 256 KiB bucket): mean |error| 26.6% -> 23.8% (table above, model 90ef77a); the second session, recorded and"
    " run afresh with both changes: 20.0%. **The goal (mean <= 10%, max <= 20%) is missed in both**, and most of "
    "what is left is the machine: the same configuration measured in the two sessions differs by 21% (median over"
    " the 46 targets, up to 67%; recordings 24%, up to 68%); one configuration run eight times in a row (pp 1F1B,"
    " 2 x 2, load 14-23) measured 253-475 ms. A prediction from one run of the recording checked against one run "
    "of the target cannot come closer than that noise; the lead's re-run on a quiet machine is the real test.",
    "",
    "Seen but not modelled: with ranks beyond the cores and the others computing, a rank waiting on shared memory"
    " yields its core before it sleeps and a computing rank runs a scheduler slice in its place: a ping-pong "
    "between two ranks of 4 on 2 cores (the other two computing) took 10-18 ms a round trip within one host and "
    "3-7 ms between two hosts (load 9-10), where the model has 0.3 and 0.8 ms. Jobs whose steps wait on many "
    "small messages (pp, hybrid's TP pairs) can therefore run faster on 2 hosts than recorded on one, as some "
    "runs above did; the tuner's WAKE charge (0.1 ms per message per rank beyond the cores) was fitted on "
    "collectives with no rank computing.",
    "",
    "**Session 20261207-141449** ran on a quieter machine (load 2.6-7.5, mostly the job's own "
    "ranks) and after the tcp transport stopped handing every message to zmq's I/O threads (each message now a "
    "frame on the pair's raw stream, written by the sending thread and read by the waiting one: a pycoll message "
    "between hosts 31-48 us instead of 115-164). Nothing in the model changed. On the targets, a message between "
    "hosts no longer costs three thread wake-ups on crowded cores, which the model never priced: mean |error| "
    "19.5% -> 10.2%, max 73.8% -> 31.4%, 6 of 46 beyond 20%. **Still missed, narrowly on the mean.** The misses "
    "left: DP at 1000 Mbit/s on 2 and 3 hosts (-23%, -29%: the target slower than its bytes and messages, not "
    "seen at 200 Mbit/s); hybrid with TP across hosts at 200 Mbit/s (-31%); TP and PP GPipe at 200 Mbit/s on "
    "3 hosts (-23%, -24%); serve at 4 ms on 3 hosts (+29%). The session before it (20261207-124656) is the same "
    "model on the old transport: its 4-host runs were dropped (see its note).",
    "",
    "**Session 20261207-171044** is the first run of model 8fdf744, recorded and run afresh. "
    "One change: **arrival order.** The tuner charges a call the message latency of every round that crosses "
    "hosts, which is what it costs when all members come in together. In a replay they come in one by one, and a "
    "member then waits only for the crossings on the way from the last member's data to it: recursive doubling "
    "over 3 hosts x 2 crosses once from a rank of the third host and twice from the others. Measured in session "
    "20261207-141449, serve at 4 ms on 3 hosts spent 5.9-9 ms (median 8.0) from the last member ready to the "
    "end of its 8 B allreduces, where the model charged two 4.5 ms crossings. Now the replay takes the latency a "
    "member is spared off its end, given who came in last (pycoll/predict/trace_target.py, Pricer.relief). "
    "Serve on 3 hosts, this session: -0.4% and +0.5% (the model before it, on the same recordings: +17.4% and "
    "+27.0%); all 46 targets: mean |error| 10.6%, max 38.0%, 7 beyond 20% (the model before it: 11.6%, 38.0%, "
    "8). Session 20261207-141449's recordings predicted again: 10.2% -> 9.3%, max 31.4% (unchanged). **Still "
    "missed.** The same configurations measured in the two sessions differ by more than what is left: PP GPipe on "
    "4 hosts recorded 187 ms then and 149 ms now, and its targets are -28% and -35% off now, 0.9% and -18% then.",
    "",
    "**Session 20261207-175315** (the table above) repeats session 20261207-171044 with the same model, straight "
    "after it: mean |error| 12.2%, max 43.5%, 8 of 46 beyond 20%. The same configuration measured twice in a row "
    "moves by more than the goal: TP 2 x 2 at 200 Mbit/s ran 80.9 ms and then 144.7 ms (-12.8% and -43.5% "
    "against the same model), serve 3 x 2 at 1 ms 15.9 ms and then 14.3 ms (-0.4% and +23.0%). A single run of "
    "the recording against a single run of each target cannot show the model within 10%; `--repeats 3` and "
    "medians per configuration (the script reports them) would.",
]


def write_section(data: Dict[str, Any]) -> None:
    """The section file, and the same text in docs/predict.md in place of its copy (docs/make_predict.py
    puts it last, after section-trace.md), so the page shows it without measuring the rest again."""
    text = render(data)
    with open(SECTION, "w") as fh:
        fh.write(text)
    if not os.path.exists(PAGE):
        return
    with open(PAGE) as fh:
        page = fh.read()
    at = page.find(HEADING)
    page = (page[:at] if at >= 0 else page.rstrip("\n") + "\n\n") + text
    with open(PAGE, "w") as fh:
        fh.write(page)


def main(argv: Sequence[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default=",".join(JOBS), help=f"comma-separated jobs (default all: {','.join(JOBS)})")
    ap.add_argument("--hosts", default=",".join(map(str, HOSTS)), help="host counts (default 2,3,4)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="recordings and targets per job and host count, taking turns (default 1; with more the "
                         "section adds each configuration's medians)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds each run may take (default 300)")
    ap.add_argument("--fresh", action="store_true", help="start a new JSON instead of adding to it")
    ap.add_argument("--repredict", action="store_true", help="only predict the kept runs again with today's model")
    ap.add_argument("--render", action="store_true", help="only write the section from the JSON")
    a = ap.parse_args(argv)
    book = Book(a.fresh)
    if a.render:
        write_section(book.data)
        return 0
    if a.repredict:
        repredict(book)
        write_section(book.data)
        return 0
    names = a.only.split(",")
    unknown = [n for n in names if n not in JOBS]
    if unknown:
        ap.error(f"unknown jobs {unknown}: choose from {', '.join(JOBS)}")
    session = time.strftime("%Y%m%d-%H%M%S")
    started = time.monotonic()
    book.data.setdefault("sessions", []).append({"session": session, "model": _model_version(), "argv": list(argv),
                                                 "load_before": os.getloadavg()[0], "cpus": os.cpu_count()})
    for hosts in [int(h) for h in a.hosts.split(",")]:
        for link in ("rate", "delay"):
            jobs = [JOBS[n] for n in names if JOBS[n].link == link and not JOBS[n].unfit(hosts)]
            if not jobs:
                continue
            print(f"== {hosts} hosts, {link}: {', '.join(j.name for j in jobs)} ({time.monotonic() - started:.0f} s)",
                  flush=True)
            try:
                validate_hosts(book, session, jobs, hosts, link, a.repeats, a.timeout)
            except Exception:  # a cluster that cannot be built: say so, go on with the next
                traceback.print_exc()
                book.data.setdefault("problems", []).append({"session": session, "hosts": hosts, "link": link,
                                                             "error": traceback.format_exc()[-3000:]})
                book.save()
            write_section(book.data)
    book.data["sessions"][-1].update(seconds=time.monotonic() - started, load_after=os.getloadavg()[0])
    book.save()
    write_section(book.data)
    print(f"wrote {OUT} and {SECTION} in {(time.monotonic() - started) / 60:.0f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
