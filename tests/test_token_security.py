"""Issue 19: a process holding no secret of the job cannot get the job token or pass a hello, on every
launch path we can run here. Each job is two real ranks (tests/token_job.py) attacked by a stranger
process (tests/token_stranger.py): it tries pycoll's store with no and a guessed token (or reads every
key of torch's open store), rank 0's bulk-stream listener and its tcp port with guessed tokens and
with rank 1's captured hellos replayed. The job must still allreduce right, and rank 0 must have
turned the stranger away, logging it rate-limited.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from multiproc import free_port

from pycoll.bootstrap import token as token_mod
from pycoll.bootstrap.env import discover
from pycoll.bootstrap.store import TCPStore, TCPStoreServer, _encode, _decode_fields, _recv_frame, \
    OP_HELLO, ST_DENIED, _MAGIC, store_mac
from pycoll.errors import EnvError, StoreError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = os.path.join(ROOT, "tests", "token_job.py")
STRANGER = os.path.join(ROOT, "tests", "token_stranger.py")
MPIRUN = shutil.which("mpirun")
JOB_TIMEOUT = 150


def clean_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYCOLL_", "OMPI_", "PMI_", "SLURM_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONPATH=ROOT, PYCOLL_TRANSPORT="tcp", PYCOLL_TUNER="static", PYCOLL_TUNER_CACHE="off",
               TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    env.update(extra)
    return env


def torchrun_env(rank: int, port: int, addr: str = "127.0.0.1", **extra: str) -> dict:
    return clean_env(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                     MASTER_ADDR=addr, MASTER_PORT=str(port), **extra)


def start(cmd, env) -> subprocess.Popen:
    return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def finish(procs, timeout=JOB_TIMEOUT):
    """(returncode, stdout, stderr) of each; kills what is still running at the deadline."""
    deadline = time.monotonic() + timeout
    results = []
    for p in procs:
        try:
            o, e = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, 9)
            o, e = p.communicate()
        results.append((p.returncode, o, e))
    return results


def attacked(out, procs, host, port, kind="pycoll"):
    """Run the stranger against the job whose processes are `procs`; return its report and the ranks'."""
    stranger = start([sys.executable, STRANGER, out, host, str(port), kind], clean_env())
    res = finish([stranger] + procs)
    so = res[0]
    assert so[0] == 0, f"the stranger crashed: {so[2][-3000:]}\njob: {[r[2][-2000:] for r in res[1:]]}"
    with open(os.path.join(out, "stranger.json")) as fh:
        report = json.load(fh)
    done = []
    for r in range(2):
        path = os.path.join(out, f"done{r}.json")
        assert os.path.exists(path), f"rank {r} never finished: {[x[2][-3000:] for x in res[1:]]}"
        with open(path) as fh:
            done.append(json.load(fh))
    return report, done, res[1:]


def assert_turned_away(report, done, outputs, store_open=False):
    if not store_open:
        assert report["store"] and all(v.startswith("refused") for v in report["store"].values()), report["store"]
    assert not report["token_seen"], "the stranger read the job token"
    assert report["bulk"] and all(not v.startswith("answered") for _, v in report["bulk"]), report["bulk"]
    assert all(d["ok"] for d in done), done                      # the job is unaffected
    assert done[0]["bulk_rejected"] >= 2, done                   # guessed + replayed bulk hello
    # the stranger's messages are dropped (a few may still be in flight when rank 0 counts)
    assert done[0]["rejected"] >= report["zmq_sent"] * 3 // 4, (done, report)
    joined = "".join(o[2] for o in outputs)
    assert "replayed hello" in joined, joined[-4000:]           # rank 1's captured zmq hello, sent first
    logged = len(re.findall(r"tcp transport dropped a message", joined))
    assert 1 <= logged <= 5, joined[-4000:]                     # rate-limited: a burst of 5 at most ...
    assert "more suppressed" in joined, joined[-4000:]            # ... and a count of the rest


@pytest.fixture
def out():
    path = tempfile.mkdtemp(prefix="pycoll-token-test-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


# -- launch paths --------------------------------------------------------------------------------------------
@pytest.mark.timeout(200)
def test_torchrun_style_on_loopback(out):
    """RANK/WORLD_SIZE/MASTER_ADDR=127.0.0.1 with no token: rank 0 draws one before its store and leaves
    it in a uid-private file; the store demands it, and the file is gone once the job is connected."""
    port = free_port()
    procs = [start([sys.executable, JOB, out], torchrun_env(r, port)) for r in range(2)]
    report, done, outputs = attacked(out, procs, "127.0.0.1", port)
    assert_turned_away(report, done, outputs)
    assert not os.path.exists(os.path.join(token_mod.private_dir(), token_mod.port_file(port)))
    assert all(rc == 0 for rc, _, _ in outputs)


@pytest.mark.timeout(200)
def test_pycoll_run_one_node(out):
    port, store_port = free_port(), free_port()
    procs = [start([sys.executable, "-m", "pycoll", "run", "-n", "2", "--master-port", str(port),
                    "--store-port", str(store_port), JOB, out], clean_env())]
    stranger = start([sys.executable, STRANGER, out, "127.0.0.1", str(store_port), "pycoll"], clean_env())
    res = finish([stranger] + procs)
    assert res[0][0] == 0, res[0][2][-3000:] + res[1][2][-3000:]
    with open(os.path.join(out, "stranger.json")) as fh:
        report = json.load(fh)
    done = [json.load(open(os.path.join(out, f"done{r}.json"))) for r in range(2)]
    assert_turned_away(report, done, res[1:])
    assert res[1][0] == 0, res[1][2][-3000:]


@pytest.mark.timeout(200)
def test_pycoll_run_two_nodes_on_loopback(out):
    """Node 0 draws the token and prints the line for the others; a node without it refuses to start."""
    port, store_port = free_port(), free_port()
    base = [sys.executable, "-m", "pycoll", "run", "-n", "1", "--nnodes", "2", "--master-port", str(port),
            "--store-port", str(store_port)]
    lonely = subprocess.run(base + ["--node-rank", "1", JOB, out], env=clean_env(), cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert lonely.returncode == 2 and "PYCOLL_JOB_TOKEN" in lonely.stderr, lonely.stderr
    node0 = start(base + ["--node-rank", "0", JOB, out], clean_env())
    lines, token = [], None
    deadline = time.monotonic() + 60
    while token is None and time.monotonic() < deadline:
        line = node0.stderr.readline()
        lines.append(line)
        m = re.search(r"PYCOLL_JOB_TOKEN=([0-9a-f]{64}) pycoll run --nnodes 2 --node-rank R .*"
                      rf"--store-port {store_port}", line)
        token = m and m[1]
    assert token, "".join(lines)
    rest = []
    pump = threading.Thread(target=lambda: rest.extend(node0.stderr), daemon=True)
    pump.start()
    node1 = start(base + ["--node-rank", "1", JOB, out], clean_env(PYCOLL_JOB_TOKEN=token))
    stranger = start([sys.executable, STRANGER, out, "127.0.0.1", str(store_port), "pycoll"], clean_env())
    res = finish([stranger, node1])
    node0.wait(JOB_TIMEOUT)
    pump.join(10)
    assert res[0][0] == 0, res[0][2][-3000:] + "".join(rest)[-3000:] + res[1][2][-3000:]
    report = json.load(open(os.path.join(out, "stranger.json")))
    done = [json.load(open(os.path.join(out, f"done{r}.json"))) for r in range(2)]
    assert_turned_away(report, done, [(0, "", "".join(rest)), res[1]])
    assert node0.returncode == 0 and res[1][0] == 0


def _host_address() -> str:
    from pycoll.bootstrap.netif import select_address
    addr = select_address()[1]
    if token_mod_is_loopback(addr):
        pytest.skip("this host has no address but loopback")
    return addr


def token_mod_is_loopback(addr: str) -> bool:
    from pycoll.bootstrap.rendezvous import is_loopback
    return is_loopback(addr)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("secret", ["none", "token", "file", "open-file", "insecure"])
def test_multi_host_simulated(out, secret, tmp_path):
    """Two 'hosts' (PYCOLL_HOSTID differs) meeting at a non-loopback MASTER_ADDR: refused without a
    shared secret (saying what to set); a token, a private token file or PYCOLL_INSECURE=1 (with a
    warning on every rank) let it run."""
    addr, port = _host_address(), free_port()
    extra = {}
    token = os.urandom(32).hex()
    if secret == "token":
        extra["PYCOLL_JOB_TOKEN"] = token
    elif secret in ("file", "open-file"):
        path = tmp_path / "job.token"
        path.write_text(token + "\n")
        path.chmod(0o600 if secret == "file" else 0o644)
        extra["PYCOLL_JOB_TOKEN_FILE"] = str(path)
    elif secret == "insecure":
        extra["PYCOLL_INSECURE"] = "1"
    procs = [start([sys.executable, JOB, out], torchrun_env(r, port, addr, PYCOLL_HOSTID=f"host{r}", **extra))
             for r in range(2)]
    if secret in ("none", "open-file", "insecure"):
        for name in ("bulk.go", "go"):  # no stranger: the job must not wait for one
            open(os.path.join(out, name), "w").close()
        res = finish(procs, 90)
        if secret == "none":
            for rc, _, err in res:
                assert rc != 0 and "PYCOLL_JOB_TOKEN" in err and "PYCOLL_INSECURE=1" in err, err[-3000:]
        elif secret == "open-file":
            for rc, _, err in res:
                assert rc != 0 and "chmod 600" in err, err[-3000:]
        else:
            for rc, _, err in res:
                assert rc == 0 and "PYCOLL_INSECURE=1: the job token travels through the rendezvous store" in err, \
                    err[-3000:]
        return
    # the store binds 0.0.0.0 for a non-loopback MASTER_ADDR: attack it there
    report, done, outputs = attacked(out, procs, addr, port)
    assert_turned_away(report, done, outputs)
    assert all(rc == 0 for rc, _, _ in outputs)


def _mpirun(n, args, env, x_vars=()):
    env = {**env, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMPI_MCA_btl_tcp_if_include": "lo", "OMPI_MCA_oob_tcp_if_include": "lo"}
    xs = [a for v in ("PYTHONPATH", "PYCOLL_TRANSPORT", "PYCOLL_TUNER", "PYCOLL_TUNER_CACHE", *x_vars)
          for a in ("-x", v)]
    return start([MPIRUN, "--oversubscribe", "-np", str(n), *xs, sys.executable, *args], env)


@pytest.mark.mpi
@pytest.mark.timeout(200)
@pytest.mark.skipif(MPIRUN is None, reason="mpirun not installed")
@pytest.mark.parametrize("master_addr", [False, True], ids=["no-MASTER_ADDR", "MASTER_ADDR"])
def test_mpirun(out, master_addr):
    """Rank 0 draws the token and broadcasts it over MPI, with or without MASTER_ADDR: the store demands it."""
    pytest.importorskip("mpi4py")
    port = free_port() if master_addr else 0
    env = clean_env(**({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)} if master_addr else {}))
    job = _mpirun(2, [JOB, out], env, ("MASTER_ADDR", "MASTER_PORT") if master_addr else ())
    report, done, outputs = attacked(out, [job], "127.0.0.1", port)
    assert_turned_away(report, done, outputs)
    assert outputs[0][0] == 0, outputs[0][2][-3000:]


@pytest.mark.timeout(200)
def test_torch_backend_store_never_holds_the_token(out):
    """init_process_group('pycoll') over torch's own (open) TCPStore: the stranger lists and reads every
    key of it and finds no token; the hellos turn it away as on every other path."""
    pytest.importorskip("torch")
    port = free_port()
    procs = [start([sys.executable, JOB, out, "torch"], torchrun_env(r, port)) for r in range(2)]
    report, done, outputs = attacked(out, procs, "127.0.0.1", port, kind="torch")
    assert report["store"]["torch"] == "joined"  # torch's store admits anyone ...
    assert any("tokenref" in k for k in report["values"]), sorted(report["values"])  # ... and it read it all
    assert_turned_away(report, done, outputs, store_open=True)
    assert all(rc == 0 for rc, _, _ in outputs)


# -- pieces --------------------------------------------------------------------------------------------------
@pytest.mark.timeout(30)
def test_store_answer_replayed_on_another_connection_is_refused():
    """The store's hello is challenge-response: a sniffed answer is worthless on any other connection."""
    srv = TCPStoreServer("127.0.0.1", 0, token=b"job-secret")
    try:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as s:
            nonce = _decode_fields(_recv_frame(s)[1:])[1]
            answer = _encode(OP_HELLO, _MAGIC, store_mac(b"job-secret", nonce))  # what the sniffer saw
            s.sendall(answer)
            assert _recv_frame(s) == b"\x00"
        with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as s:
            _recv_frame(s)
            s.sendall(answer)
            assert _recv_frame(s) == bytes([ST_DENIED])
        with pytest.raises(StoreError, match="refused"):
            TCPStore("127.0.0.1", srv.port, token=b"guess", timeout=2)
    finally:
        srv.close()


def test_token_file_must_be_private(tmp_path):
    path = tmp_path / "t"
    path.write_text("abcd\n")
    path.chmod(0o640)
    with pytest.raises(EnvError, match="chmod 600"):
        discover(env={"PYCOLL_JOB_TOKEN_FILE": str(path)})
    path.chmod(0o600)
    assert discover(env={"PYCOLL_JOB_TOKEN_FILE": str(path)}).token == b"\xab\xcd"
    assert discover(env={"PYCOLL_JOB_TOKEN_FILE": str(path), "PYCOLL_JOB_TOKEN": "ef"}).token == b"\xef"
    path.write_text("not hex")
    with pytest.raises(EnvError, match="hex"):
        discover(env={"PYCOLL_JOB_TOKEN_FILE": str(path)})


def test_private_files_are_private_and_stale_ones_rejected():
    folder = token_mod.private_dir()
    assert os.stat(folder).st_mode & 0o777 == 0o700 and os.stat(folder).st_uid == os.getuid()
    path = token_mod.write_private("test-x.token", b"\x01\x02")
    try:
        assert os.stat(path).st_mode & 0o777 == 0o600
        assert token_mod.read_private("test-x.token") == b"\x01\x02"
        os.chmod(path, 0o644)
        assert token_mod.read_private("test-x.token") is None  # opened up: not trusted
    finally:
        token_mod.remove_private(path)
    assert token_mod.fingerprint(b"a") != token_mod.fingerprint(b"b")
