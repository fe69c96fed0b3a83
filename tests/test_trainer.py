"""pycoll.trainer: model gradients, bucket planning, time split, and N-rank == 1-rank training."""
from __future__ import annotations

import argparse
import json
import re
import sys

import numpy as np
import pytest

from multiproc import run_ranks
from pycoll.trainer import ConfigError, TrainConfig, train
from pycoll.trainer.__main__ import parse_hidden, parse_straggler
from pycoll.trainer.buckets import GradBuckets, plan_buckets
from pycoll.trainer.data import eval_shard, global_batches, shard
from pycoll.trainer.loop import check_config
from pycoll.trainer.model import backward, forward, init_params, loss_and_correct
from pycoll.trainer.timing import breakdown, record_width, scaling_efficiency
from test_examples import mpirun, needs_mpirun, pycoll_run, run, succeeded

pytest.importorskip("sklearn")  # the digits data set


# -- pieces, in this process ---------------------------------------------------------------------
def test_backward_matches_finite_differences():
    rng = np.random.default_rng(1)
    params = init_params([5, 7, 4, 3], seed=2, dtype=np.float64)
    x, y = rng.standard_normal((6, 5)), rng.integers(0, 3, 6)
    logits, inputs = forward(params, x)
    grads = [np.empty_like(p) for p in params]
    order = list(backward(params, logits, inputs, y, grads))
    assert order == [5, 4, 3, 2, 1, 0]  # reverse parameters() order, as DDP's buckets expect
    eps = 1e-6
    for p, g in zip(params, grads):
        for idx in [(0,) * p.ndim, tuple(s - 1 for s in p.shape)]:
            old = p[idx]
            p[idx] = old + eps
            up = loss_and_correct(forward(params, x)[0], y)[0]
            p[idx] = old - eps
            down = loss_and_correct(forward(params, x)[0], y)[0]
            p[idx] = old
            assert g[idx] == pytest.approx((up - down) / (2 * eps) / len(y), rel=1e-5, abs=1e-8)


def test_bucket_plan_follows_ddp_rule():
    sizes = [400, 40, 800, 80, 120, 12]  # W1 b1 W2 b2 W3 b3, bytes
    assert plan_buckets(sizes, 0) == [[5], [4], [3], [2], [1], [0]]
    assert plan_buckets(sizes, 10 ** 6) == [[5, 4, 3, 2, 1, 0]]
    assert plan_buckets(sizes, 200) == [[5, 4, 3], [2], [1, 0]]  # a bucket closes once it reaches the cap


def test_gradients_are_views_of_contiguous_buckets():
    params = init_params([4, 6, 3], seed=0, dtype=np.float32)
    gb = GradBuckets(params, cap_bytes=50, comm=None)
    for i, g in enumerate(gb.grads):
        assert g.shape == params[i].shape and np.shares_memory(g, gb.flat)
    for bucket, view in zip(gb.plan, gb.views):
        gb.flat[:] = 0
        view[:] = 1
        assert all(gb.grads[i].all() for i in bucket)
        assert sum(gb.grads[i].sum() for i in range(len(params))) == view.size


def test_breakdown_separates_wait_from_comm():
    row = np.zeros(record_width(2))
    # step 0..10 ms: backward ends at 4, probe (launched 3) done at 6, buckets [3.5 -> 7], [7.5 -> 9],
    # sync ends at 9, optimizer until 10
    row[:] = [0, 4, 9, 10, 3, 6, 3.5, 7, 7.5, 9]
    b = breakdown(row[None] / 1000)
    assert b.compute[0] == pytest.approx(0.005) and b.wait[0] == pytest.approx(0.002)
    assert b.comm[0] == pytest.approx(0.003)
    assert b.comm_total[0] == pytest.approx(0.001 + 0.0015)  # bucket 0 starts after the probe at 6
    assert scaling_efficiency(300.0, 4, 100.0) == pytest.approx(0.75)


def test_global_batches_shard_evenly_and_identically():
    batches = list(global_batches(100, 24, epoch=3, seed=7))
    assert len(batches) == 4 and batches[0].tolist() == next(global_batches(100, 24, 3, 7)).tolist()
    for batch in batches:
        parts = [shard(batch, r, 4) for r in range(4)]
        assert np.array_equal(np.concatenate(parts), batch)
    with pytest.raises(ValueError):
        shard(batches[0], 0, 5)
    assert [eval_shard(10, r, 3) for r in range(3)] == [slice(0, 3), slice(3, 6), slice(6, 10)]


def test_cli_option_parsing_and_config_checks():
    assert parse_straggler("2:12.5") == (2, 12.5) and parse_hidden("32,16") == (32, 16)
    for bad in ("2", "x:5", "1:"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_straggler(bad)
    with pytest.raises(argparse.ArgumentTypeError):
        parse_hidden("32,0")
    with pytest.raises(ConfigError, match="divisible"):
        check_config(TrainConfig(batch_size=30), 4)
    with pytest.raises(ConfigError, match="--straggler rank 4"):
        check_config(TrainConfig(straggler=(4, 10.0)), 4)


# -- data-parallel equivalence, on real ranks ----------------------------------------------------
EQUIV = dict(epochs=1, batch_size=96, dtype="float64", log_every=0, bucket_kb=4)  # 14 steps
OPTIMIZERS = {"sgd": 0.05, "adam": 0.003}


def train_and_return_params(comm):
    """Rank body: a short float64 run per optimizer; final parameters, replica check, test accuracy."""
    runs = {}
    for optimizer, lr in OPTIMIZERS.items():
        result = train(comm, TrainConfig(optimizer=optimizer, lr=lr, **EQUIV))
        runs[optimizer] = ([p.tobytes() for p in result.params], result.replicas_identical, result.test.accuracy)
    return runs


@pytest.mark.timeout(150)
def test_n_ranks_train_like_one_rank_with_the_same_global_batch():
    runs = {n: run_ranks(train_and_return_params, n, timeout=120) for n in (1, 2, 4)}
    shapes = [p.shape for p in init_params([64, *TrainConfig().hidden, 10], 0, np.float64)]

    def arrays(raw):
        return [np.frombuffer(b, np.float64).reshape(s) for b, s in zip(raw, shapes)]
    for optimizer in OPTIMIZERS:
        reference = arrays(runs[1][0][optimizer][0])
        for n in (2, 4):
            first = runs[n][0][optimizer][0]
            for rank, per_rank in enumerate(runs[n]):
                raw, identical, _ = per_rank[optimizer]
                assert identical and raw == first, f"{optimizer}, {n} ranks: rank {rank} drifted from rank 0"
            for a, b in zip(reference, arrays(first)):
                assert np.allclose(a, b, rtol=1e-12, atol=1e-12), \
                    f"{optimizer}, {n} ranks: max diff {np.abs(a - b).max()}"
        assert runs[4][0][optimizer][2] > 0.5  # 14 steps already learn something (chance: 0.1)


# -- the command line -----------------------------------------------------------------------------
def _final_accuracy(out: str) -> float:
    """Held-out accuracy (%) from the final summary line."""
    found = re.search(r"final: train loss [\d.]+ acc [\d.]+% \| test loss [\d.]+ acc ([\d.]+)%", out)
    assert found, out
    return float(found.group(1))


def _waits(out: str) -> dict:
    """rank -> mean wait (ms) from the per-rank time table."""
    return {int(r): float(w) for r, w in re.findall(r"rank (\d+)\s+[\d.]+\s+[\d.]+\s+([\d.]+) \|", out)}


@pytest.mark.timeout(120)
def test_cli_under_pycoll_run_learns_and_draws_the_straggler(tmp_path):
    png = tmp_path / "steps.png"
    out = pycoll_run(2, "-m", "pycoll.trainer", "--epochs", "3", "--log-every", "10", "--straggler", "1:30",
                     "--timeline", str(png))
    assert re.search(r"\[rank 0\] epoch 1/3 step 10/66: loss [\d.]+ acc [\d.]+% \| step [\d.]+ ms = compute", out)
    assert "[rank 1]" not in out  # only rank 0 reports
    assert _final_accuracy(out) > 90.0, out
    waits = _waits(out)
    assert waits[0] > 15 and waits[0] > waits[1] + 10, out  # rank 0 idles while rank 1 sleeps 30 ms a step
    assert re.search(r"scaling efficiency [\d.]+% = \d+ / \(2 x \d+ samples/s 1-rank baseline", out), out
    assert "replicas bit-identical across 2 rank(s): yes" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    events = json.loads((tmp_path / "steps.trace.json").read_text())["traceEvents"]  # every step, Chrome format
    tracks = {(e["pid"], e["args"]["name"]) for e in events if e["name"] == "thread_name"}
    assert tracks == {(r, lane) for r in (0, 1) for lane in ("train", "comm worker")}
    assert max(e["args"]["step"] for e in events if e["ph"] == "X") == 65  # all recorded steps, not the last 20
    assert {e["name"] for e in events if e["ph"] == "X"} >= {"compute", "wait", "comm", "wait probe", "bucket 0"}


@pytest.mark.timeout(60)
def test_cli_one_rank_and_bad_config():
    out = succeeded(run([sys.executable, "-m", "pycoll.trainer", "--epochs", "2", "--optimizer", "adam",
                         "--lr", "0.003", "--log-every", "0"], timeout=50))
    assert _final_accuracy(out) > 90.0, out
    assert "scaling efficiency 100.0% = " in out and "1-rank baseline, this run itself)" in out
    bad = run([sys.executable, "-m", "pycoll.trainer", "--straggler", "3:10"], timeout=50)
    assert bad.returncode == 2 and "--straggler rank 3 is not in 0..0" in bad.stderr


@needs_mpirun
@pytest.mark.timeout(120)
def test_cli_under_mpirun():
    out = mpirun(2, "-m", "pycoll.trainer", "--epochs", "2", "--log-every", "0")
    assert "pycoll.trainer: 2 rank(s)" in out
    assert _final_accuracy(out) > 85.0, out
    assert "replicas bit-identical across 2 rank(s): yes" in out
