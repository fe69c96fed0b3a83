"""The runnable jobs of examples/parallel/ (issue 37), each started as a user starts it (`pycoll run -n N`,
torchrun) on backend "pycoll" and on gloo: the two runs' results must agree as the job's JSON `match` says
(bit-identical weights and loss, or within float32 rounding), and bad input must fail with a clear message
before anything is sent.

Shared helpers for every job's section: `run_job` (start a job, return its JSON), `assert_same_results`
(pycoll against gloo as `match` says) and `bad_input` (start one rank of a world that has no peers and
expect a usage error naming the problem). One section per job below."""
import json
import os
import shutil
import subprocess
import sys
from typing import Dict, List, Optional

import pytest

from multiproc import free_port

torch = pytest.importorskip("torch")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOBS = os.path.join(ROOT, "examples", "parallel")
TORCHRUN = shutil.which("torchrun")
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR",
               "MASTER_PORT", "PYCOLL_STORE_HOSTED", "PYCOLL_STORE_PORT", "PYCOLL_JOB_TOKEN", "PYCOLL_JOB_TOKEN_FILE",
               "OMP_NUM_THREADS")
QUICK = ["--steps", "2", "--warmup", "1"]  # the default run's jobs: one untimed and two timed steps


def job_env(**extra: str) -> Dict[str, str]:
    """This environment without any launcher's variables (a test's own launcher sets them), plus `extra`."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env.update(extra)
    return env


def run_job(tmp_path, script: str, n: int, *args: str, backend: str = "pycoll", launcher: str = "pycoll",
            env: Optional[Dict[str, str]] = None, timeout: float = 170) -> dict:
    """Run examples/parallel/`script` on `n` ranks under `launcher` ("pycoll": `pycoll run -n n`, or "torchrun")
    with --backend `backend` and `args`; its JSON results (a failed job fails the test with its output)."""
    out = tmp_path / f"{script}-{backend}-{launcher}-{n}-{abs(hash(args))}.json"
    job = [os.path.join(JOBS, script), "--backend", backend, "--json", str(out), *args]
    if launcher == "pycoll":
        cmd = [sys.executable, "-m", "pycoll", "run", "-n", str(n), "--timeout", str(timeout - 10),
               sys.executable, *job]
    else:
        cmd = [TORCHRUN, "--nproc-per-node", str(n), "--master-port", str(free_port()), *job]
    proc = subprocess.run(cmd, cwd=ROOT, env=env or job_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, \
        f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    result = json.loads(out.read_text())
    assert result["backend"] == backend and result["ranks"] == n, result
    assert result["step_ms"] > 0 and len(result["step_ms_per_step"]) == result["steps"], result
    return result


def assert_same_results(ours: dict, theirs: dict) -> None:
    """pycoll's results against gloo's: bit-identical weights and loss where the job says its reductions have
    one order, else the loss and the weights' checksum within float32 rounding."""
    assert ours["match"] == theirs["match"], (ours["match"], theirs["match"])
    if ours["match"] == "bit-identical":
        assert ours["weights_sha"] == theirs["weights_sha"], (ours, theirs)
        assert ours["loss"] == theirs["loss"], (ours["loss"], theirs["loss"])
    else:
        assert ours["match"] == "float32 rounding", ours["match"]
        assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-5), (ours["loss"], theirs["loss"])
        assert ours["checksum"] == pytest.approx(theirs["checksum"], rel=1e-5), (ours["checksum"], theirs["checksum"])


def bad_input(script: str, world: int, args: List[str], local_world: Optional[int] = None) -> str:
    """Start rank 0 of a `world`-rank job whose MASTER_PORT nobody serves: the job must refuse `args` with
    exit status 2 before it connects anywhere (else it would wait for its peers). Its stderr."""
    env = job_env(RANK="0", WORLD_SIZE=str(world), LOCAL_RANK="0", LOCAL_WORLD_SIZE=str(local_world or world),
                  MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    proc = subprocess.run([sys.executable, os.path.join(JOBS, script), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    return proc.stderr


# ---------------------------------------------------------------------------------------------- tp.py

@pytest.mark.timeout(200)
def test_tp_two_ranks_bit_identical_to_gloo(tmp_path):
    ours = run_job(tmp_path, "tp.py", 2, *QUICK)
    theirs = run_job(tmp_path, "tp.py", 2, *QUICK, backend="gloo")
    assert ours["match"] == "bit-identical" and ours["tp"] == 2
    assert_same_results(ours, theirs)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_tp_four_ranks_matches_gloo_and_one_process(tmp_path):
    ours = run_job(tmp_path, "tp.py", 4, *QUICK)
    theirs = run_job(tmp_path, "tp.py", 4, *QUICK, backend="gloo")
    assert ours["match"] == "float32 rounding" and ours["tp"] == 4
    assert_same_results(ours, theirs)
    alone = run_job(tmp_path, "tp.py", 1, *QUICK)  # the same model unsharded: the same training within rounding
    assert alone["loss"] == pytest.approx(ours["loss"], rel=1e-4)
    assert alone["checksum"] == pytest.approx(ours["checksum"], rel=1e-5)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world,args,message", [
    (3, [], "TP degree 3 does not divide --heads 4"),
    (2, ["--heads", "3", "--dim", "60"], "TP degree 2 does not divide --heads 3"),
    (1, ["--heads", "5"], "--heads 5 does not divide --dim 64"),
])
def test_tp_bad_input(world, args, message):
    assert message in bad_input("tp.py", world, args)


# ---------------------------------------------------------------------------------------------- pp.py

@pytest.mark.timeout(200)
@pytest.mark.parametrize("schedule", ["gpipe", pytest.param("1f1b", marks=pytest.mark.slow)])
def test_pp_bit_identical_to_gloo(tmp_path, schedule):
    args = [*QUICK, "--schedule", schedule, "--microbatches", "4"]
    ours = run_job(tmp_path, "pp.py", 2, *args)
    theirs = run_job(tmp_path, "pp.py", 2, *args, backend="gloo")
    assert_same_results(ours, theirs)
    assert ours["match"] == "bit-identical" and ours["schedule"] == schedule and ours["stages"] == 2
    assert ours["bubble_theory"] == pytest.approx(1 / 5)
    assert len(ours["bubble_per_stage"]) == 2
    assert all(0 <= b < 1 for b in ours["bubble_per_stage"]) and 0 <= ours["bubble"] < 1, ours
    assert 0 < ours["pipe_ms"] <= ours["step_ms"] * 1.5, ours  # the schedule's part of the step
    assert 0 <= ours["bubble_compute_only"] < 1, ours


def _spans(order: str, forward: float = 1.0, backward: float = 2.0, slow: Dict[int, float] = {}) -> list:
    """A stage's compute spans run in `order` ("FFBB": kinds in the order run), each forward `forward`
    s and each backward `backward` s, the k-th op `slow[k]` times longer."""
    out, t = [], 0.0
    for k, kind in enumerate(order):
        took = (forward if kind == "F" else backward) * slow.get(k, 1.0)
        out.append((kind, t, t + took))
        t += took + 100.0  # (the recorded gaps are the measured idle: the replay leaves them out)
    return out


@pytest.mark.parametrize("orders", [("FFFFBBBB", "FFFFBBBB"), ("FFBFBFBB", "FBFBFBFB")], ids=["gpipe", "1f1b"])
def test_pp_compute_only_bubble_is_the_formula_for_equal_steady_compute(orders):
    """The replay of a step's compute spans (free communication): equal, steady stages give exactly
    (p-1)/(m+p-1) for GPipe and 1F1B; uneven compute (one op slower, the next as much faster: the same
    work) make the next stage wait, above it."""
    sys.path.insert(0, JOBS)
    try:
        from pp import compute_only_bubble
    finally:
        sys.path.remove(JOBS)
    assert compute_only_bubble([_spans(o) for o in orders]) == pytest.approx(1 / 5)
    slowed = compute_only_bubble([_spans(orders[0], slow={1: 1.5, 2: 0.5}), _spans(orders[1])])
    assert slowed > 1 / 5 + 0.01
    assert compute_only_bubble([_spans("FB"), _spans("FB")]) == pytest.approx(1 / 2)


@pytest.mark.skipif(TORCHRUN is None, reason="torchrun comes with torch")
@pytest.mark.timeout(200)
def test_pp_under_torchrun_matches_pycoll_run(tmp_path):
    """torchrun on pycoll against `pycoll run` on gloo (one torch thread per rank in both): the same weights."""
    env = job_env(OMP_NUM_THREADS="1")
    ours = run_job(tmp_path, "pp.py", 2, *QUICK, launcher="torchrun", env=env)
    theirs = run_job(tmp_path, "pp.py", 2, *QUICK, backend="gloo", env=env)
    assert_same_results(ours, theirs)


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_pp_bubble_near_theory(tmp_path):
    """With stages of real work (width 256, sequence 64), the measured bubble falls as microbatches grow and
    stays near (p-1)/(m+p-1): the idle time is the schedule's, not the job's overhead."""
    size = ["--dim", "256", "--seq", "64", "--batch", "32", "--layers", "4", "--steps", "3"]
    bubbles = {}
    for m in (1, 4):
        r = run_job(tmp_path, "pp.py", 2, *size, "--microbatches", str(m))
        bubbles[m] = r["bubble"]
        print(f"p=2 m={m}: bubble {r['bubble']:.3f}, theory {r['bubble_theory']:.3f}")
        assert r["bubble"] == pytest.approx(r["bubble_theory"], abs=0.1), r
    assert bubbles[1] > bubbles[4]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world,args,message", [
    (2, ["--microbatches", "3"], "--microbatches 3 does not divide --batch 8"),
    (2, ["--schedule", "1f1b", "--microbatches", "1"], "1F1B needs at least as many microbatches as stages (2)"),
    (3, [], "3 stages (one per rank) do not divide --layers 2"),
])
def test_pp_bad_input(world, args, message):
    assert message in bad_input("pp.py", world, args)


# ------------------------------------------------------------------------------------------ hybrid.py

@pytest.mark.timeout(240)
def test_hybrid_two_by_two_bit_identical_to_gloo(tmp_path):
    ours = run_job(tmp_path, "hybrid.py", 4, *QUICK)
    theirs = run_job(tmp_path, "hybrid.py", 4, *QUICK, backend="gloo")
    assert ours["mesh"] == [[0, 1], [2, 3]] and ours["placement"] == "tp-inside-host", ours
    assert ours["match"] == "bit-identical" and ours["dp_style"] == "fsdp"
    assert_same_results(ours, theirs)


def _two_nodes(tmp_path, script: str, ranks_per_node: int, *args: str, backend: str = "pycoll",
               timeout: float = 200) -> dict:
    """`script` on 2 'hosts' of this machine: two `pycoll run --nnodes 2` launchers (node 0 serves the store),
    so LOCAL_WORLD_SIZE is `ranks_per_node` and the job sees two hosts. Node 0's rank 0 writes the JSON."""
    out = tmp_path / f"{script}-{backend}-2nodes.json"
    master, store = free_port(), free_port()
    env = job_env(PYCOLL_JOB_TOKEN=os.urandom(32).hex())
    job = [sys.executable, os.path.join(JOBS, script), "--backend", backend, "--json", str(out), *args]
    procs = [subprocess.Popen([sys.executable, "-m", "pycoll", "run", "-n", str(ranks_per_node), "--nnodes", "2",
                               "--node-rank", str(node), "--master-port", str(master), "--store-port", str(store),
                               "--timeout", str(timeout - 20), *job], cwd=ROOT, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for node in (0, 1)]
    try:
        outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outputs)
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_hybrid_placements_and_dp_styles_train_the_same_model(tmp_path):
    """2 hosts x 2 ranks: TP across hosts (mesh [[0, 2], [1, 3]]) on pycoll equals gloo's and equals TP inside
    hosts bit for bit (the same replicas, batches and groups of two); DDP along dp equals FSDP2."""
    across = _two_nodes(tmp_path, "hybrid.py", 2, *QUICK, "--tp-across-hosts")
    assert across["mesh"] == [[0, 2], [1, 3]] and across["placement"] == "tp-across-hosts", across
    assert_same_results(across, _two_nodes(tmp_path, "hybrid.py", 2, *QUICK, "--tp-across-hosts", backend="gloo"))
    inside = _two_nodes(tmp_path, "hybrid.py", 2, *QUICK)
    assert inside["mesh"] == [[0, 1], [2, 3]]
    assert_same_results(across, inside)
    ddp = run_job(tmp_path, "hybrid.py", 4, *QUICK, "--dp-style", "ddp")
    assert_same_results(ddp, inside)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world,local,args,message", [
    (4, 4, ["--tp", "3"], "does not divide the world: --tp 3 must divide the 4 ranks"),
    (4, 2, ["--tp", "4"], "--tp-inside-host: TP groups of 4 ranks do not fit in hosts of 2 ranks"),
    (4, 4, ["--tp-across-hosts"], "a TP group takes one rank from each of 2 hosts, and the job's 1 host(s)"),
    (8, 8, ["--tp", "8"], "TP degree 8 does not divide --heads 4"),
])
def test_hybrid_bad_input(world, local, args, message):
    assert message in bad_input("hybrid.py", world, args, local_world=local)


# ---------------------------------------------------------------------------------------------- ep.py

EP_TINY = ["--tokens", "32", "--hidden", "32", "--ffn", "64", "--steps", "3", "--warmup", "1"]


def traffic_report(trace) -> dict:
    """`pycoll trace DIR --traffic --json` of a job's flight-recorder dumps."""
    proc = subprocess.run([sys.executable, "-m", "pycoll", "trace", str(trace), "--traffic", "--json"],
                          cwd=ROOT, env=job_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout)


def _check_ep(r: dict, n: int) -> None:
    """What any ep.py result must hold: every token copy lands on one rank, the bytes sent are those copies'
    rows (each sent 4 times: dispatch and combine, forward and backward) plus the counts, the loss is finite."""
    assert r["experts"] == 2 * n and r["a2a_calls_per_step"] == 5, r
    copies, row = r["tokens"] * n * r["top_k"], r["hidden"] * 4
    counts_bytes = n * (n - 1) * (r["experts"] // n) * 8
    for per_rank, sent in zip(r["tokens_per_rank"], r["a2a_bytes"]):
        assert sum(per_rank) == copies
        remote = (sent - counts_bytes) / (4 * row)  # copies that left their rank
        assert remote == int(remote) and 0 < remote <= copies, (sent, copies)
    assert len(r["expert_ms"]) == len(r["a2a_ms"]) == n and r["wait_ms"] >= 0
    assert bool(torch.isfinite(torch.tensor(r["losses"])).all())


def _same_ep(ours: dict, theirs: dict) -> None:
    """ep.py on pycoll against gloo: as `match` says, and, where bit-identical, the same routing and losses
    at every step."""
    assert_same_results(ours, theirs)
    if ours["match"] == "bit-identical":
        for key in ("losses", "a2a_bytes", "tokens_per_rank"):
            assert ours[key] == theirs[key], key
    else:
        for step, (a, b) in enumerate(zip(ours["losses"], theirs["losses"])):
            assert a == pytest.approx(b, rel=1e-5), step


@pytest.mark.timeout(150)
def test_ep_two_ranks_bit_identical_to_gloo_and_bytes_match_the_traffic_report(tmp_path):
    ours = run_job(tmp_path, "ep.py", 2, *EP_TINY, env=job_env(PYCOLL_TRACE_DIR=str(tmp_path / "trace")))
    theirs = run_job(tmp_path, "ep.py", 2, *EP_TINY, backend="gloo")
    for r in (ours, theirs):
        _check_ep(r, 2)
    assert ours["match"] == "bit-identical"
    _same_ep(ours, theirs)
    assert ours["losses"][-1] != ours["losses"][0]  # it trained: the experts' and router's weights moved

    traffic = traffic_report(tmp_path / "trace")
    calls = {c["call"]: c for c in traffic["median_step"]["collectives"] if c["calls"]}
    assert {k: c["calls"] for k, c in calls.items()} == {"alltoall": 1, "alltoallv": 4, "allreduce": 1}, calls
    router = calls["allreduce"]["bytes_within"]  # the counts, the tokens, the router's gradient
    timed = traffic["per_step"][1:]  # step 1 is the warm-up (marked, not timed)
    assert [s["bytes_within"] - router for s in timed] == ours["a2a_bytes"]


@pytest.mark.timeout(120)
def test_ep_skew_loads_the_first_ranks(tmp_path):
    even = run_job(tmp_path, "ep.py", 2, *EP_TINY)
    skew = run_job(tmp_path, "ep.py", 2, *EP_TINY, "--skew", "3")
    for r in (even, skew):
        _check_ep(r, 2)
    assert skew["skew"] == 3.0 and skew["load_imbalance"] > even["load_imbalance"] + 0.2, (skew, even)
    assert all(row[0] > row[1] for row in skew["tokens_per_rank"])  # rank 0 holds the favoured experts


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ep_four_ranks_skewed_matches_gloo(tmp_path):
    args = [*EP_TINY, "--skew", "--top-k", "3"]
    ours = run_job(tmp_path, "ep.py", 4, *args)
    theirs = run_job(tmp_path, "ep.py", 4, *args, backend="gloo")
    for r in (ours, theirs):
        _check_ep(r, 4)
    assert ours["match"] == "float32 rounding"
    _same_ep(ours, theirs)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world,args,message", [
    (3, ["--experts", "4"], "--experts 4 cannot be divided among 3 ranks"),
    (2, ["--experts", "4", "--top-k", "5"], "--top-k 5 must be between 1 and --experts (4)"),
    (2, ["--top-k", "0"], "--top-k 0 must be between 1 and --experts (4)"),
])
def test_ep_bad_input(world, args, message):
    assert message in bad_input("ep.py", world, args)


# ------------------------------------------------------------------------------------------- serve.py

SERVE_TINY = ["--layers", "2", "--hidden", "64", "--heads", "4", "--vocab", "128", "--batch", "2",
              "--prompt-len", "8", "--new-tokens", "8", "--steps", "2", "--warmup", "1"]


@pytest.fixture(scope="module")
def serve_alone(tmp_path_factory) -> dict:
    """serve.py as one process with no launcher (no peers, no all_reduce): the tokens every parallel run must
    reproduce."""
    out = tmp_path_factory.mktemp("serve-alone") / "alone.json"
    proc = subprocess.run([sys.executable, os.path.join(JOBS, "serve.py"), *SERVE_TINY, "--json", str(out)],
                          cwd=ROOT, env=job_env(OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["ranks"] == 1 and r["tp"] == 1 and r["allreduces_per_token"] == 0
    assert len(r["tokens"]) == 2 * 2 and all(len(t) == 8 for t in r["tokens"])
    return r


def _check_serve(r: dict, alone: dict, tp: int) -> None:
    """Tokens equal the one-process run's; two all_reduces per layer per token of batch x hidden float32."""
    assert r["tokens"] == alone["tokens"]
    layers, batch, hidden = r["layers"], r["batch"], r["hidden"]
    assert r["tp"] == tp and r["allreduces_per_token"] == (2 * layers if tp > 1 else 0)
    assert r["allreduce_bytes_per_token"] == (2 * layers * batch * hidden * 4 if tp > 1 else 0)
    assert r["prefill_allreduce_bytes"] == (2 * layers * batch * r["prompt_len"] * hidden * 4 if tp > 1 else 0)
    assert 0 < r["tpot_ms"] <= r["tpot_p99_ms"] and r["ttft_ms"] > 0 and r["min_logit_gap"] > 0


def _same_serve(ours: dict, theirs: dict) -> None:
    """serve.py on pycoll against gloo: the same tokens, and the last logits as `match` says (bit-identical
    when a tensor-parallel group has at most 2 ranks)."""
    assert ours["match"] == theirs["match"] == ("bit-identical" if ours["tp"] <= 2 else "float32 rounding")
    assert ours["tokens"] == theirs["tokens"]
    if ours["match"] == "bit-identical":
        assert ours["logits_sha"] == theirs["logits_sha"]
    assert ours["checksum"] == pytest.approx(theirs["checksum"], rel=1e-5)


@pytest.mark.timeout(150)
def test_serve_two_ranks_tokens_equal_one_process_and_gloo(tmp_path, serve_alone):
    """... and pycoll's traffic report finds allreduces_per_token all_reduces in a token's step."""
    ours = run_job(tmp_path, "serve.py", 2, *SERVE_TINY, env=job_env(PYCOLL_TRACE_DIR=str(tmp_path / "trace")))
    theirs = run_job(tmp_path, "serve.py", 2, *SERVE_TINY, backend="gloo")
    for r in (ours, theirs):
        _check_serve(r, serve_alone, tp=2)
    _same_serve(ours, theirs)
    traffic = traffic_report(tmp_path / "trace")
    calls = {c["call"]: c["calls"] for c in traffic["median_step"]["collectives"] if c["calls"]}
    assert calls == {"allreduce": ours["allreduces_per_token"]}, calls  # the median step is a decode step
    assert traffic["steps"]["count"] == 3 * 8  # a warm-up batch and 2 timed ones, 8 tokens each


@pytest.mark.timeout(150)
def test_serve_disaggregated_two_ranks_tokens_equal_one_process_and_gloo(tmp_path, serve_alone):
    ours = run_job(tmp_path, "serve.py", 2, *SERVE_TINY, "--disaggregate")
    theirs = run_job(tmp_path, "serve.py", 2, *SERVE_TINY, "--disaggregate", backend="gloo")
    kv = 2 * 2 * 2 * 8 * 64 * 4  # keys and values x layers x batch x prompt x hidden x float32
    for r in (ours, theirs):
        _check_serve(r, serve_alone, tp=1)
        assert r["disaggregate"] and r["handoff_bytes"] == kv + 2 * 8 and r["handoff_messages"] == 2 * 2 + 1
        assert r["ttft_ms"] >= r["prefill_ms"] - 5.0  # clocks on two ranks, started by one barrier
    _same_serve(ours, theirs)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("disaggregate", [pytest.param(False, marks=pytest.mark.slow),
                                          pytest.param(True, marks=pytest.mark.slow)],
                         ids=["tp4", "disaggregated-tp2"])
def test_serve_four_ranks(tmp_path, serve_alone, disaggregate):
    flag = ["--disaggregate"] if disaggregate else []
    ours = run_job(tmp_path, "serve.py", 4, *SERVE_TINY, *flag)
    theirs = run_job(tmp_path, "serve.py", 4, *SERVE_TINY, *flag, backend="gloo")
    for r in (ours, theirs):
        _check_serve(r, serve_alone, tp=2 if disaggregate else 4)
    _same_serve(ours, theirs)
    if disaggregate:
        assert ours["handoff_messages"] == 2 * (2 * 2 + 1)  # two prefill ranks, each its heads' K and V


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(TORCHRUN is None, reason="torchrun comes with torch")
def test_ep_and_serve_under_torchrun(tmp_path, serve_alone):
    _check_serve(run_job(tmp_path, "serve.py", 2, *SERVE_TINY, "--disaggregate", launcher="torchrun"),
                 serve_alone, tp=1)
    _check_ep(run_job(tmp_path, "ep.py", 2, *EP_TINY, launcher="torchrun"), 2)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world,args,message", [
    (3, ["--heads", "4"], "--heads 4 cannot be split over a tensor-parallel degree of 3"),
    (4, ["--heads", "3", "--hidden", "48", "--disaggregate"],
     "--heads 3 cannot be split over a tensor-parallel degree of 2"),
    (3, ["--heads", "3", "--hidden", "48", "--disaggregate"], "needs an even number of ranks, got 3"),
    (2, ["--hidden", "50", "--heads", "4"], "--hidden 50 is not a multiple of --heads 4"),
    (2, ["--ffn", "63"], "--ffn 63 cannot be split over a tensor-parallel degree of 2"),
])
def test_serve_bad_input(world, args, message):
    assert message in bad_input("serve.py", world, args)
