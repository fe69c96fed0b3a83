"""Write docs/predict.md: `pycoll predict` checked against measured runs on emulated clusters.

    sudo PYTHONPATH=. python docs/make_predict.py [--rate-mbit 200] [--epochs 3]

One host (a network namespace) records the trainer's workload with 2 ranks; then 2, 3 and 4 hosts x 2
ranks, packed and interleaved, each behind a tbf of --rate-mbit, run the same training and record it
too. `pycoll predict --measured` predicts every run from the one-host record alone, and then the 3- and
4-host runs from the 2-host packed run (calibrating on a run with the network in it). The records go to
docs/predict/, the plots beside this page. Then: a torch DDP model's record (examples/torch_ddp_record.py);
the congested uplink (4 hosts in 2 racks, tests/test_predict_racks.py), allreduce and training step with
the rack-oblivious and the rack-aware ring; single collectives on ranks sharing this machine's cores
(tests/test_predict_cores.py).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

from predict_cluster import measure_run, predict_runs, scratch, table  # noqa: E402
from test_predict_cores import (load as load_cores, measure as measure_cores, save as save_cores,  # noqa: E402
                                table as cores_table)
from test_predict_racks import RATE_MBIT, congested, congestion_table  # noqa: E402

REPO = os.path.dirname(HERE)


def torch_record(data: str) -> str:
    """examples/torch_ddp_record.py on 2 ranks of this host, then `pycoll predict` on its record for 4
    hosts x 2 ranks at 1 Gbit/s: the markdown section."""
    rec = os.path.join(data, "torch-h1x2.json")
    env = dict(os.environ, PYTHONPATH=REPO)
    run = subprocess.run([sys.executable, "-m", "pycoll", "run", "-n", "2", sys.executable, "examples/torch_ddp_record.py",
                          "--hidden", "512,512", "--batch-size", "240", "--bucket-mb", "0.25", "--steps", "30",
                          "--out", rec], capture_output=True, text=True, cwd=REPO, env=env, timeout=600)
    if run.returncode:
        raise RuntimeError(run.stdout + run.stderr)
    cmd = ["predict", "--workload", os.path.relpath(rec, REPO), "--hosts", "4", "--ppn", "2", "--link-gbit", "1"]
    pred = subprocess.run([sys.executable, "-m", "pycoll", *cmd], capture_output=True, text=True, cwd=REPO, env=env,
                          timeout=120)
    w = json.load(open(rec))
    out = [line for line in run.stdout.splitlines() if "workload record written" in line]
    itself = predict_runs(rec, [rec], w["tuner"]["net"]["gbit"])["runs"][0]
    return f"""## A torch DDP model's record

`pycoll run -n 2 python examples/torch_ddp_record.py --hidden 512,512 --batch-size 240 --bucket-mb 0.25 --steps 30
--out {os.path.relpath(rec, REPO)}`: the same MLP in torch, DDP on the "pycoll" backend, recorded through a DDP comm
hook (pycoll/predict/torch_record.py): {len(w['buckets'])} buckets of {', '.join(str(b['bytes']) for b in w['buckets'])}
bytes in launch order, ready at {', '.join(f"{b['ready_frac']:.0%}" for b in w['buckets'])} of forward+backward.

```
{chr(10).join(line.split('] ', 1)[-1] for line in out)}
$ pycoll {' '.join(cmd)}
{pred.stdout.strip()}
```

The recorded run itself, predicted from its record (`pycoll predict --workload R --measured R`):
{itself['predicted_ms']:.1f} ms [{itself['low_ms']:.1f}, {itself['high_ms']:.1f}] against {itself['measured_ms']:.1f} ms
measured ({itself['error']:+.0%}); the line above is the record's own prediction with nothing fitted.
"""


def congestion(data: str, trainer: list, cache: str) -> str:
    """The congested uplink: allreduce (tests/test_predict_racks.congested) and the training step on 4
    hosts x 1 rank in racks {{h0, h2}}, {{h1, h3}}, ring in rank order (flat_ring: crosses each uplink
    twice per direction) and in rack order (ring), measured and predicted: the markdown section."""
    res = congested(pathlib.Path(scratch()))
    runs, rows = {}, []
    for algo in ("flat_ring", "ring"):
        path = os.path.join(data, f"racks-h4x1-{algo}.json")
        racks = {"second": [1, 3], "uplink_mbit": RATE_MBIT, "file": os.path.join(scratch(), "racks.json"),
                 "ranks": {"A": [0, 2], "B": [1, 3]}}
        runs[algo] = measure_run(4, 1, "packed", RATE_MBIT, trainer, path, cache, racks,
                                 {"PYCOLL_ALGO": f"allreduce:{algo}"})
        gbit = runs[algo]["cluster"]["link_Bps"] * 8e-9
        got = predict_runs(os.path.join(data, "h1x2.json"), [path], gbit, ["--algo", algo])
        rows.append((algo, got["runs"][0], gbit))
    lines = ["| ring | predicted step ms [interval] | measured ms | error | predicted split (compute + comm + wait) | "
             "measured split |", "|---|---|---|---|---|---|"]
    for algo, r, _ in rows:
        p, m = r["prediction"], r["measured"]
        lines.append(f"| {algo} ({'rank order 0,1,2,3: rack-oblivious' if algo == 'flat_ring' else 'rack order 0,2,1,3'}) | "
                     f"{r['predicted_ms']:.1f} [{r['low_ms']:.1f}, {r['high_ms']:.1f}] | {r['measured_ms']:.1f} | "
                     f"{r['error']:+.0%} | {p['compute_ms']:.1f} + {p['comm_ms']:.1f} + {p['wait_ms']:.1f} | "
                     f"{m['compute_ms']:.1f} + {m['comm_ms']:.1f} + {m['wait_ms']:.1f} |")
    speed = rows[0][1]["measured_ms"] / rows[1][1]["measured_ms"]
    return f"""## A congested uplink: 4 hosts in 2 racks

Hosts h0 and h2 on one switch (the cluster's bridge), h1 and h3 behind a second switch (a bridge in a
namespace of its own) whose one uplink to the first is a tbf of {RATE_MBIT} Mbit/s both ways, like every
host's link: the two hosts of a rack share one link's worth to the other rack. The topology file
declares it (`{{"racks": {{"A": {{"ranks": [0, 2], "uplink_gbit": G}}, "B": {{"ranks": [1, 3], ...}}}}}}`, G the
uplink measured). Ranks are numbered across the racks, so the ring in rank order (what pycoll ran before it knew
the racks: host order 0, 1, 2, 3) crosses each uplink twice per direction; the rack-ordered ring (0, 2, 1, 3) once.

Allreduce (tests/test_predict_racks.py, median of 4 of the slowest rank; predicted by the tuner with the racks):

{congestion_table(res)}

The last rows are the run without the racks declared: the tuner took the network for one switch and
predicted half of what it measured; with the racks declared it predicts the same ring within 10% and
runs the rack-ordered one.

Training step (`python -m pycoll.trainer {' '.join(trainer)}`, 4 hosts x 1 rank, `PYCOLL_ALGO=allreduce:flat_ring`
or `allreduce:ring`, racks declared; predicted from the one-host record `docs/predict/h1x2.json` with
`--algo` the same ring, at the measured link rate):

{chr(10).join(lines)}

The rack-aware ring's step is {speed:.2f}x faster measured.
"""


def cores(data: str, measure: bool = True) -> str:
    """Single collectives on ranks sharing this machine's cores: the markdown section, measured now
    (and kept in docs/predict/cores.json), or with `measure` False from the measurements kept there."""
    path = os.path.join(data, "cores.json")
    if measure:
        save_cores(path, measure_cores([2, 4, 8]))
    res = load_cores(path)
    return f"""## Single collectives on ranks that share cores

`python tests/test_predict_cores.py 2,4,8`: allreduce of 8 B to 4 MiB on 2, 4 and 8 ranks of this 2-core
machine, every algorithm, median of 7 rounds (each visiting every point once) of the slowest rank, against `Tuner.predict` (the cost model of the
transfers alone, what the tuner ranks by) and `Tuner.call_time` (what `pycoll predict` charges a call:
predict plus a per-call cost, paid in turn by ranks that share a core, plus a scheduling turn per message
per rank beyond the cores), with the parameters the tuner probed at init and with the same links measured
sustained (median 4 MiB round trips, a 4 MiB reduction alone).

{cores_table(res)}

Why the tuner's absolute figures were 3-12x optimistic here, and what is fixed:
- every call costs Python beyond its messages (argument checks, selection, the Work, the hand-off to the
  communicator's worker, the slowest rank's wait for the last one to arrive), none of it in the model
  at first. Now `CALL_OVERHEAD` (8 us) x crowd^2, crowd = ranks per core: the ranks of a core run
  their calls in turn, and each waits through the others' turns. Measured beyond predict() and the
  wake-ups, 8 B one-shot, session 18: 1-12 us at 1 rank per core (the probe's latency, half of which
  predict() charges a post, swings 10-30 us between runs), 10-49 us at 2, 30-197 us at 4; it was 12, 40
  and 183 us before sessions 17-18 halved the Python of a small call.
- with more ranks than cores, a rank that waits for a message spins a while, then sleeps on its
  doorbell, and the sender must get a core first: each message waits about a scheduling turn per rank
  beyond the cores. Now `WAKE` x (ranks - cores) per message. It is kept out of the ranking: ranked
  with it the tuner would pick recursive doubling for 4 MiB on 3-8 ranks, measured 2-3x slower than
  the two-shot it picks without it (recursive doubling's large exchanges under crowding are
  underpriced ~3x).
- fixed in session 14: 4 MiB on 4 and 8 ranks came out 1.5-3.5x the model over the runs of session 13
  (the point that most often left 2x). The probe copies 1 MiB in cache, but 8 ranks' 4 MiB buffers and
  their two-shot stage slots touch 64-80 MiB (4 ranks: 32-40 MiB), beyond this machine's 32 MiB L3,
  so those copies run at memory speed. The tuner now reads the last-level cache from sysfs and times a
  copy twice its size against one in cache (`spill`, 2.4-4.4x here); a call whose ranks touch more than
  half the cache pays shm beta and gamma times `Params.spill_factor` (docs/topology.md). Those points
  now come out 0.7-1.4x. Re-predicted with the spill (2.7) on session 13's five saved runs, the picks
  within 2x go from 11, 10, 11, 12, 11 to 12 of 12 in all five.
- not fixed either: the probe takes the best of a few 1 MiB round trips and 256 KiB reductions, in
  cache, between two ranks while the others idle: its shm rate and latency swing 2-3x between runs
  minutes apart (the rows under the table). The sustained figures show what a median of larger probes
  would give.
- the rest is this machine: a point swings 2x from run to run, and more. Above all, the VM has spells
  of 10-30 s, minutes apart, in which all data crossing between its two CPUs runs 6-8x slower (session
  18, `benchmarks/cross_cpu.py`, no pycoll in it: a 1 MiB exchange between two processes bound to CPUs 0
  and 1 takes 77-95 us, in a spell 480-620 us; a ping-pong 93-117 us, in a spell 770-930 us), while
  each process's own copies stay fast. Open MPI's 2-rank allreduce slows the same way in the same
  spells (1 MiB: 0.11 or 0.54 ms a call; pycoll 0.074 or 0.50). Earlier sessions took this for a
  per-job state; it is a state of the machine in time, and a model calibrated at init cannot follow a
  state that flips mid-job. So the test measures the state before and after each job and runs a job
  again (up to 3 times) when a check finds the slow state; the rows under the table show the checks.
  The claim (tests/test_predict_cores.py) is for the set, not for every point, and the test skips
  above a load of 4 per core.
- session 14's runs of this table, the tuner's picks within 2x: 8, 11, 11, 10 and 12 of 12 (session 13,
  before the spill: 11, 10, 11, 12, 11, 9). Every pick that left 2x in session 14 is 2-rank two-shot in
  a slow job (2.1-3.5x: the bimodal state above) or 1 MiB on 4 ranks (2.0-2.1x). Session 15 added cma
  (cross-memory attach, docs/algorithms.md) to the candidates and to the table; below 4 MiB it is never
  the pick, at 4 MiB it is on some probes. Its runs: 12, 10 (both misses two-shot at 1 MiB: 2.01x and
  2.15x), 12 and, after its page cost was refitted (CMA_PAGE 0.9 -> 0.6), for the table above, 12 of 12.
- history: the first fit (session 10, at load 4.5-10) charged 0.25 ms x crowd per call and 0.25 ms per
  wake; session 11 refitted on a quiet machine to 0.04 ms x crowd and 0.1 ms. That priced a call
  with a core per rank 2-3x too slow (8 B on 2 ranks: 45 us predicted, 17-22 us measured). Session
  13 charged 12 us x crowd^2: fitted on three runs (the picks within 2x: 11, 10 and 11 of 12, from
  10, 9 and 10 with the old charge), then checked on two more (12 and 11 of 12). Session 18 refitted
  it after the small-call cuts on six runs' picks: at 12 us the 2-rank 8 B pick came out 0.51-0.62x
  the model in some, at 3 us 2.15x in another; at 8 us all six runs' picks fall within 0.62-1.8x.
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate-mbit", type=float, default=200)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--hidden", default="512,512")
    ap.add_argument("--batch-size", type=int, default=240)
    ap.add_argument("--bucket-kb", type=float, default=256)
    ap.add_argument("--hosts", default="2,3,4")
    ap.add_argument("--reuse", action="store_true", help="predict from the records already in docs/predict/")
    ap.add_argument("--sections", default="hosts,torch,racks,cores",
                    help="which sections to measure: hosts (the trainer on 1-4 hosts), torch, racks, cores "
                    "(cores-table: the cores section again from docs/predict/cores.json, with today's model)")
    a = ap.parse_args()
    sections = set(a.sections.split(","))
    trainer = ["--epochs", str(a.epochs), "--hidden", a.hidden, "--batch-size", str(a.batch_size),
               "--bucket-kb", f"{a.bucket_kb:g}", "--log-every", "0"]
    data = os.path.join(HERE, "predict")
    os.makedirs(data, exist_ok=True)
    cache = os.path.join(scratch(), "tuner")
    started = time.time()
    loads = os.path.join(data, "hosts-load.json")  # the load average while the host runs were measured
    runs = {}
    base = os.path.join(data, "h1x2.json")
    a.reuse = a.reuse or "hosts" not in sections
    if not a.reuse:
        load_start = os.getloadavg()[0]
        measure_run(1, 2, "packed", None, trainer, base, cache)
    print(f"recorded 1 host x 2 ranks ({time.time() - started:.0f} s)", flush=True)
    for hosts in [int(h) for h in a.hosts.split(",")]:
        for how in ("packed", "interleaved"):
            path = os.path.join(data, f"h{hosts}x2-{how}.json")
            if a.reuse:
                with open(path) as fh:
                    runs[path] = json.load(fh)
            else:
                runs[path] = measure_run(hosts, 2, how, a.rate_mbit, trainer, path, cache)
            print(f"ran {hosts} hosts x 2 {how}: {runs[path]['step_ms']:.1f} ms/step "
                  f"({time.time() - started:.0f} s)", flush=True)
    if not a.reuse:
        with open(loads, "w") as fh:
            json.dump({"start": load_start, "end": os.getloadavg()[0]}, fh)
    load = json.load(open(loads)) if os.path.exists(loads) else None
    load_text = (f"load average {load['start']:.1f} when the runs started, {load['end']:.1f} at the end"
                 if load else "load average not recorded")
    rates = [r["cluster"]["link_Bps"] for r in runs.values()]
    gbit = sum(rates) / len(rates) * 8e-9
    label = {p: os.path.basename(p)[:-5] for p in runs}
    one = predict_runs(base, list(runs), gbit, ["--plot", os.path.join(HERE, "predict_from_1host.png")])
    two_base = os.path.join(data, "h2x2-packed.json")
    later = [p for p in runs if not os.path.basename(p).startswith("h2x")]
    two = predict_runs(two_base, later, gbit, ["--plot", os.path.join(HERE, "predict_from_2hosts.png")])
    raw = predict_runs(base, list(runs), gbit, ["--no-fit"])
    rel = lambda p: os.path.relpath(p, os.path.dirname(HERE))  # noqa: E731
    cmd = f"pycoll predict --workload {rel(base)} --measured docs/predict/h*x2-*.json --link-gbit {gbit:.4g}"
    w = json.load(open(base))
    worst = dict(max(one["runs"], key=lambda r: abs(r["error"])), run=label[max(one["runs"], key=lambda r: abs(
        r["error"]))["run"]])
    parts = []
    for name, make in (("torch", lambda: torch_record(data)), ("racks", lambda: congestion(data, trainer, cache)),
                       ("cores", lambda: cores(data, "cores-table" not in sections))):
        frag = os.path.join(data, f"section-{name}.md")
        if name in sections or (name == "cores" and "cores-table" in sections):
            with open(frag, "w") as fh:
                fh.write(make())
            print(f"measured section {name} ({time.time() - started:.0f} s)", flush=True)
        if os.path.exists(frag):
            parts.append(open(frag).read())
    trace_frag = os.path.join(data, "section-trace.md")  # `pycoll predict --trace`: written by hand, kept
    if os.path.exists(trace_frag):
        parts.append(open(trace_frag).read())
    # its validation on emulated clusters: written by docs/make_predict_trace.py, kept
    trace_check = os.path.join(data, "section-trace-validation.md")
    if os.path.exists(trace_check):
        parts.append(open(trace_check).read())
    extra = "\n".join(parts)
    text = f"""# pycoll predict, checked against measured runs

Generated by `docs/make_predict.py` (`sudo PYTHONPATH=. python docs/make_predict.py`) on this 2-core
machine; every "host" is a network namespace (tests/netns_cluster.py) whose link is a tbf of
{a.rate_mbit:g} Mbit/s, measured in the same run at **{gbit * 1000:.0f} Mbit/s** (one raw TCP stream,
mean over the clusters). All ranks of all emulated hosts share the machine's 2 cores ({load_text}),
so compute per rank grows with the number of ranks and every figure is noisy; the model charges the
sharing (ranks / cores, `--shared-cores`, found from the records: their hosts are one machine).

Workload: `python -m pycoll.trainer {' '.join(trainer)}` (MLP 64-{a.hidden.replace(',', '-')}-10, float32,
{sum(b['bytes'] for b in w['buckets']) / 2**20:.2f} MiB of gradients in {len(w['buckets'])} buckets), recorded
with `--report-json` on one host with 2 ranks. Records: `docs/predict/*.json` (each holds `step_ms`,
the measured median step, and its own `prediction`).

## Predicted from the one-host record

`{cmd}`

{table(one, label)}

![predicted vs measured, from one host](predict_from_1host.png)

From a one-host record the model carries over the compute interference (how much slower a rank
computed in the recorded job than alone) but not the latency fit: the excess latency of messages
between two ranks sharing a loaded machine's cores is a wake-up delay of shm, and charging it to the
targets' messages overestimated the 2-host steps by 57% (mean error 28%). That choice was made after
seeing these runs, so this table is not a blind test; the 2-host calibration below is the fairer one.

The same without anything fitted from the record's measured slowdowns (`--no-fit`: compute from
the profile of one rank alone, communication at the tuner's calibrated prices):

{table(raw, label)}

## Calibrated on 2 hosts, predicting 3 and 4

`pycoll predict --workload docs/predict/h2x2-packed.json --measured <the 3- and 4-host runs> --link-gbit {gbit:.4g}`

{table(two, label)}

![predicted vs measured, from two hosts](predict_from_2hosts.png)

Goals: mean |error| <= 15%, max <= 25%. The worst point of the one-host table is {worst['run']}
({worst['error']:+.0%}); packed and interleaved placements run the same host-ordered algorithms, so a
difference between them beyond the noise of a loaded machine is not something the model can show.

{extra}"""
    with open(os.path.join(HERE, "predict.md"), "w") as fh:
        fh.write(text)
    print(text)


if __name__ == "__main__":
    main()
