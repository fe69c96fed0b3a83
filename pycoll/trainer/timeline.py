"""Draw every rank's last training steps as coloured bars (compute / comm / wait) into a PNG, and
write all of them as a Chrome trace (the format `pycoll trace --chrome` writes) for Perfetto."""
from __future__ import annotations

from typing import List, Tuple

import numpy as np

from ..trace import chrome
from .timing import (BACKWARD_END, PROBE_DONE, PROBE_LAUNCH, STEP_END, STEP_START, SYNC_END, breakdown,
                     bucket_spans)

COLORS = {"compute": "tab:blue", "comm": "tab:green", "wait": "tab:red"}
LAST_STEPS = 20  # more than this many steps per rank makes the bars too thin to read


def _spans(starts: np.ndarray, ends: np.ndarray) -> List[Tuple[float, float]]:
    return [(float(s), float(e - s)) for s, e in zip(starts, ends) if e > s]


def draw_timeline(records: np.ndarray, path: str, title: str) -> None:
    """Save a chart of `records` (ranks, steps, columns; seconds) to `path`.

    Each rank gets two lanes: its training thread (compute, then blocked on the gradient sync:
    wait for the slowest rank, then exposed comm) and, thinner, its communicator's worker (the wait
    probe, then each bucket's allreduce), which shows how much communication hides behind backward.
    """
    try:
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError:
        raise ImportError("--timeline needs matplotlib: pip install 'pycoll[trainer]' (or matplotlib)") from None
    shown = records[:, -LAST_STEPS:]
    ms = (shown - np.nanmin(shown[:, :, STEP_START])) * 1000
    ranks = len(ms)
    fig = Figure(figsize=(12, 1.2 + 0.8 * ranks))
    ax = fig.subplots()
    for r, rows in enumerate(ms):
        y = ranks - 1 - r
        b = breakdown(rows)
        waited = rows[:, BACKWARD_END] + b.wait
        main = {"compute": _spans(rows[:, STEP_START], rows[:, BACKWARD_END])
                + _spans(rows[:, SYNC_END], rows[:, STEP_END]),
                "wait": _spans(rows[:, BACKWARD_END], waited),
                "comm": _spans(waited, rows[:, SYNC_END])}
        spans = bucket_spans(rows)
        worker = {"wait": _spans(rows[:, PROBE_LAUNCH], rows[:, PROBE_DONE]),
                  "comm": _spans(spans[:, :, 0].ravel(), spans[:, :, 1].ravel())}
        for kind, bars in main.items():
            ax.broken_barh(bars, (y + 0.05, 0.5), facecolors=COLORS[kind])
        for kind, bars in worker.items():
            ax.broken_barh(bars, (y - 0.3, 0.25), facecolors=COLORS[kind], edgecolor="white", linewidth=0.3)
    ax.set_yticks([y + off for y in range(ranks) for off in (-0.175, 0.3)],
                  [f"rank {ranks - 1 - y} {lane}" for y in range(ranks) for lane in ("comm", "train")])
    ax.set_xlabel("ms since the first step shown")
    ax.set_title(f"{title} (last {shown.shape[1]} of {records.shape[1]} steps)")
    fig.legend(handles=[Patch(color=c, label=k) for k, c in COLORS.items()], loc="lower center", ncol=3)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=110)


def chrome_timeline(records: np.ndarray, path: str) -> None:
    """Save every step of `records` (ranks, steps, columns; seconds) as a Chrome trace at `path`: per
    rank a training-thread track (compute, wait, comm) and a worker track (the probe, each bucket)."""
    origin = float(np.nanmin(records[:, :, STEP_START]))
    events = []
    for r, rows in enumerate(records - origin):
        events += [chrome.process(r, f"rank {r}"), chrome.thread(r, 1, "train"), chrome.thread(r, 2, "comm worker")]
        b = breakdown(rows)
        waited = rows[:, BACKWARD_END] + b.wait
        spans = bucket_spans(rows)
        for step, row in enumerate(rows):
            lanes = [(1, "compute", row[STEP_START], row[BACKWARD_END]), (1, "wait", row[BACKWARD_END], waited[step]),
                     (1, "comm", waited[step], row[SYNC_END]), (1, "compute", row[SYNC_END], row[STEP_END]),
                     (2, "wait probe", row[PROBE_LAUNCH], row[PROBE_DONE])]
            lanes += [(2, f"bucket {k}", start, end) for k, (start, end) in enumerate(spans[step])]
            events += [chrome.span(name, r, tid, float(start), float(end - start), "trainer", {"step": step})
                       for tid, name, start, end in lanes if end > start]
    chrome.write(events, path)
