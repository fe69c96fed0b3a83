"""examples/parallel/ep.py and serve.py: run under `pycoll run -n N` on pycoll and on gloo, their results equal
(bit-identical where the job's `match` says so, else within float32 rounding); serve's tokens equal the
one-process run's, with and without --disaggregate; bad options refused before anything is sent."""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest

from multiproc import free_port

pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[1]
JOBS = REPO / "examples" / "parallel"
TORCHRUN = shutil.which("torchrun")
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "PYCOLL_STORE_HOSTED", "PYCOLL_STORE_PORT", "PYCOLL_JOB_TOKEN", "TORCHELASTIC_RUN_ID")
EP_TINY = ["--tokens", "32", "--hidden", "32", "--ffn", "64", "--steps", "3"]
SERVE_TINY = ["--layers", "2", "--hidden", "64", "--heads", "4", "--vocab", "128", "--batch", "2",
              "--prompt-len", "8", "--new-tokens", "8", "--steps", "2"]


def _env(**extra: str) -> Dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), **extra}
    for var in LAUNCHER_VARS:
        if var not in extra:
            env.pop(var, None)
    return env


def _job(tmp_path: Path, n: int, script: str, *args: str, launcher: str = "pycoll",
         trace: Optional[Path] = None) -> Dict[str, Any]:
    """The JSON results of examples/parallel/SCRIPT on n ranks (n = 0: one process, no launcher); with
    `trace`, the ranks' flight-recorder dumps go there (PYCOLL_TRACE_DIR)."""
    out = tmp_path / f"{script}-{n}-{len(list(tmp_path.iterdir()))}.json"
    path = str(JOBS / script)
    if n == 0:
        cmd = [sys.executable, path]
    elif launcher == "torchrun":
        cmd = [TORCHRUN, "--nproc-per-node", str(n), "--master-port", str(free_port()), path]
    else:
        cmd = [sys.executable, "-m", "pycoll", "run", "-n", str(n), "--timeout", "100", sys.executable, path]
    cmd += [*args, "--json", str(out)]
    try:
        env = _env(PYCOLL_TRACE_DIR=str(trace)) if trace else _env()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=110)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{' '.join(cmd)} ran past 110 s; stdout:\n{e.stdout}\nstderr:\n{e.stderr}")
    assert proc.returncode == 0, " ".join(cmd) + "\n" + proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads(out.read_text())


def _traffic(trace: Path) -> Dict[str, Any]:
    """`pycoll trace DIR --traffic --json` of a job's dumps."""
    proc = subprocess.run([sys.executable, "-m", "pycoll", "trace", str(trace), "--traffic", "--json"],
                          capture_output=True, text=True, env=_env(), cwd=REPO, timeout=60)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout)


def _equal(a: Any, b: Any, exact: bool, where: str = "") -> None:
    """a == b, or within float32 rounding (relative 1e-5) where not exact."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _equal(a[k], b[k], exact, f"{where}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _equal(x, y, exact, f"{where}[{i}]")
    elif isinstance(a, float) and not exact:
        assert math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-6), f"{where}: {a} vs {b}"
    else:
        assert a == b, f"{where}: {a!r} vs {b!r}"


def _same_results(p: Dict[str, Any], g: Dict[str, Any], keys: List[str], shas: List[str]) -> None:
    """pycoll's results equal gloo's as the job's `match` promises."""
    assert (p["backend"], g["backend"]) == ("pycoll", "gloo")
    reducing = p.get("tp", p["ranks"])  # ranks in the all_reduce whose order could differ
    assert p["match"] == g["match"] == ("bit-identical" if reducing <= 2 else "float32 rounding")
    exact = p["match"] == "bit-identical"
    for key in keys:
        _equal(p[key], g[key], exact, key)
    if exact:
        for key in shas:
            assert p[key] == g[key], key


# -- ep.py --------------------------------------------------------------------------------------------

def _check_ep(r: Dict[str, Any], n: int) -> None:
    """What an ep.py result must hold whatever the backend: every token copy lands on one rank, the bytes
    are those copies' rows (4 exchanges) plus the counts, the loss is finite."""
    assert r["ranks"] == n and r["experts"] == 2 * n and r["a2a_calls_per_step"] == 5
    copies = r["tokens"] * n * r["top_k"]
    row = r["hidden"] * 4
    counts_bytes = n * (n - 1) * (r["experts"] // n) * 8
    for per_rank, sent in zip(r["tokens_per_rank"], r["a2a_bytes"]):
        assert sum(per_rank) == copies
        remote = (sent - counts_bytes) / (4 * row)  # copies that left their rank, each sent 4 times
        assert remote == int(remote) and 0 < remote <= copies, (sent, copies)
    assert len(r["expert_ms"]) == len(r["a2a_ms"]) == n and r["wait_ms"] >= 0
    assert all(math.isfinite(x) for row in r["losses"] for x in row) and r["step_ms"] > 0


@pytest.mark.timeout(150)
def test_ep_pycoll_equals_gloo_on_2_ranks(tmp_path):
    """... and the all-to-all bytes the job counts are those pycoll's traffic report finds in each step."""
    p = _job(tmp_path, 2, "ep.py", *EP_TINY, "--backend", "pycoll", trace=tmp_path / "trace")
    g = _job(tmp_path, 2, "ep.py", *EP_TINY, "--backend", "gloo")
    for r in (p, g):
        _check_ep(r, 2)
    _same_results(p, g, ["losses", "a2a_bytes", "tokens_per_rank", "checksum", "loss"], ["weights_sha"])
    assert p["losses"][-1] != p["losses"][0]  # it trained: the experts' and router's weights moved

    traffic = _traffic(tmp_path / "trace")
    calls = {c["call"]: c for c in traffic["median_step"]["collectives"] if c["calls"]}
    assert set(calls) == {"alltoall", "alltoallv", "allreduce"}, calls  # the counts, the tokens, the router
    assert (calls["alltoall"]["calls"], calls["alltoallv"]["calls"], calls["allreduce"]["calls"]) == (1, 4, 1)
    router = calls["allreduce"]["bytes_within"]
    timed = traffic["per_step"][1:]  # step 1 is the warm-up (marked, not timed)
    assert [s["bytes_within"] - router for s in timed] == p["a2a_bytes"]


@pytest.mark.timeout(120)
def test_ep_skew_loads_the_first_ranks(tmp_path):
    even = _job(tmp_path, 2, "ep.py", *EP_TINY, "--steps", "2")
    skew = _job(tmp_path, 2, "ep.py", *EP_TINY, "--steps", "2", "--skew", "3")
    for r in (even, skew):
        _check_ep(r, 2)
    assert skew["skew"] == 3.0 and skew["load_imbalance"] > even["load_imbalance"] + 0.2
    assert all(row[0] > row[1] for row in skew["tokens_per_rank"])  # rank 0 holds the favoured experts


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ep_pycoll_equals_gloo_on_4_ranks_skewed(tmp_path):
    p = _job(tmp_path, 4, "ep.py", *EP_TINY, "--skew", "--top-k", "3", "--backend", "pycoll")
    g = _job(tmp_path, 4, "ep.py", *EP_TINY, "--skew", "--top-k", "3", "--backend", "gloo")
    for r in (p, g):
        _check_ep(r, 4)
    _same_results(p, g, ["losses", "a2a_bytes", "tokens_per_rank", "checksum", "loss"], ["weights_sha"])


# -- serve.py -----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def serve_reference(tmp_path_factory) -> Dict[str, Any]:
    """serve.py on one process, no launcher: the tokens every parallel run must reproduce."""
    r = _job(tmp_path_factory.mktemp("serve1"), 0, "serve.py", *SERVE_TINY, "--backend", "gloo")
    assert r["ranks"] == 1 and r["tp"] == 1 and r["allreduces_per_token"] == 0
    assert len(r["tokens"]) == 2 * 2 and all(len(t) == 8 for t in r["tokens"])
    return r


def _check_serve(r: Dict[str, Any], ref: Dict[str, Any], tp: int) -> None:
    """Tokens equal the one-process run's; two allreduces per layer per token, each batch x hidden float32."""
    assert r["tokens"] == ref["tokens"]
    assert r["tp"] == tp
    layers, batch, hidden = r["layers"], r["batch"], r["hidden"]
    assert r["allreduces_per_token"] == (2 * layers if tp > 1 else 0)
    assert r["allreduce_bytes_per_token"] == (2 * layers * batch * hidden * 4 if tp > 1 else 0)
    assert r["prefill_allreduce_bytes"] == (2 * layers * batch * r["prompt_len"] * hidden * 4 if tp > 1 else 0)
    assert 0 < r["tpot_ms"] <= r["tpot_p99_ms"] and r["ttft_ms"] > 0 and r["step_ms"] > 0
    assert r["min_logit_gap"] > 0


@pytest.mark.timeout(150)
def test_serve_tp_tokens_equal_one_process_and_gloo(tmp_path, serve_reference):
    """... and pycoll's traffic report finds the job's allreduces in each token's step."""
    p = _job(tmp_path, 2, "serve.py", *SERVE_TINY, "--backend", "pycoll", trace=tmp_path / "trace")
    g = _job(tmp_path, 2, "serve.py", *SERVE_TINY, "--backend", "gloo")
    for r in (p, g):
        _check_serve(r, serve_reference, tp=2)
    _same_results(p, g, ["tokens", "checksum"], ["logits_sha"])
    traffic = _traffic(tmp_path / "trace")
    calls = {c["call"]: c["calls"] for c in traffic["median_step"]["collectives"] if c["calls"]}
    assert calls == {"allreduce": p["allreduces_per_token"]}, calls  # the median step is a decode step
    assert traffic["steps"]["count"] == 3 * 8  # a warm-up batch and 2 timed ones of 8 tokens


@pytest.mark.timeout(150)
def test_serve_disaggregated_tokens_equal_one_process_and_gloo(tmp_path, serve_reference):
    p = _job(tmp_path, 2, "serve.py", *SERVE_TINY, "--disaggregate", "--backend", "pycoll")
    g = _job(tmp_path, 2, "serve.py", *SERVE_TINY, "--disaggregate", "--backend", "gloo")
    kv = 2 * 2 * 2 * 8 * 64 * 4  # keys and values x layers x batch x prompt x hidden x float32
    for r in (p, g):
        _check_serve(r, serve_reference, tp=1)
        assert r["disaggregate"] and r["handoff_bytes"] == kv + 2 * 8 and r["handoff_messages"] == 2 * 2 + 1
        assert r["ttft_ms"] >= r["prefill_ms"] - 5.0  # measured on different ranks from one barrier
    _same_results(p, g, ["tokens", "checksum"], ["logits_sha"])


@pytest.mark.timeout(400)
@pytest.mark.parametrize("disaggregate", [pytest.param(False, marks=pytest.mark.slow), True],
                         ids=["tp4", "disaggregated-tp2"])
def test_serve_4_ranks(tmp_path, serve_reference, disaggregate):
    flag = ["--disaggregate"] if disaggregate else []
    p = _job(tmp_path, 4, "serve.py", *SERVE_TINY, *flag, "--backend", "pycoll")
    g = _job(tmp_path, 4, "serve.py", *SERVE_TINY, *flag, "--backend", "gloo")
    tp = 2 if disaggregate else 4
    for r in (p, g):
        _check_serve(r, serve_reference, tp=tp)
    _same_results(p, g, ["tokens", "checksum"], ["logits_sha"])


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(TORCHRUN is None, reason="torchrun comes with torch")
def test_ep_and_serve_under_torchrun(tmp_path, serve_reference):
    r = _job(tmp_path, 2, "serve.py", *SERVE_TINY, "--disaggregate", launcher="torchrun")
    _check_serve(r, serve_reference, tp=1)
    _check_ep(_job(tmp_path, 2, "ep.py", *EP_TINY, launcher="torchrun"), 2)


# -- bad input ----------------------------------------------------------------------------------------

@pytest.mark.timeout(60)
@pytest.mark.parametrize("script,ranks,args,says", [
    ("ep.py", 3, ["--experts", "4"], "--experts 4 cannot be divided among 3 ranks"),
    ("ep.py", 2, ["--experts", "4", "--top-k", "5"], "--top-k 5 must be between 1 and --experts (4)"),
    ("serve.py", 3, ["--heads", "4"], "--heads 4 cannot be split over a tensor-parallel degree of 3"),
    ("serve.py", 4, ["--heads", "3", "--hidden", "48", "--disaggregate"],
     "--heads 3 cannot be split over a tensor-parallel degree of 2"),
    ("serve.py", 3, ["--heads", "3", "--hidden", "48", "--disaggregate"], "needs an even number of ranks"),
    ("serve.py", 2, ["--hidden", "50", "--heads", "4"], "--hidden 50 is not a multiple of --heads 4"),
])
def test_bad_options_refused_before_anything_is_sent(tmp_path, script, ranks, args, says):
    """Rank 0 of a job whose other ranks never start: it must refuse its options and exit 2 at once, not
    wait for them in init_process_group (the run's timeout would catch that)."""
    env = _env(RANK="0", WORLD_SIZE=str(ranks), LOCAL_RANK="0", LOCAL_WORLD_SIZE=str(ranks),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    proc = subprocess.run([sys.executable, str(JOBS / script), *args], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=50)
    assert proc.returncode == 2 and says in proc.stderr, proc.stdout + proc.stderr
