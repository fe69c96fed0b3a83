"""Persistent calls (comm.allreduce_init and friends, pycoll/persistent.py) on real processes over shm
and tcp: each kind equal to its plain call, started many times on the same buffers with new contents,
recorded per start, matched across ranks, ended by revoke, and the bad uses refused."""
import numpy as np
import pytest

from multiproc import run_ranks

SHM, TCP = {"PYCOLL_TRANSPORT": "shm"}, {"PYCOLL_TRANSPORT": "tcp"}


def _every_kind(comm, starts):
    """Every persistent kind against its plain call, `starts` runs each with new contents (small and
    large enough for the board's stage or tcp's bulk streams); the recorder's entries per run."""
    import pycoll
    r, n = comm.rank, comm.size
    rec = comm._recorder
    recorded0 = rec._n
    runs = 0
    for count in (6 * n, 40_000 * n):
        x = np.zeros(count, np.float32)
        want = np.empty_like(x)
        handles = {
            "allreduce": comm.allreduce_init(x),
            "allreduce max out": comm.allreduce_init(x, out=np.empty_like(x), op="max"),
            "broadcast": comm.broadcast_init(x, root=n - 1),
            "allgather": comm.allgather_init(x[: count // n]),
            "reduce_scatter": comm.reduce_scatter_init(x, op=pycoll.SUM),
            "alltoall": comm.alltoall_init(x),
        }
        for i in range(starts):
            for name, h in handles.items():
                fill = (np.arange(count) * (r + 1) + i * 7 + len(name)) % 13
                x[:] = fill
                ref = fill.astype(np.float32)
                if name == "allreduce":
                    want[:] = comm.allreduce(ref.copy())
                    got = h() if i % 2 else (h.start(), h.wait())[1]
                    assert got is x and np.array_equal(x, want), (name, i)
                elif name == "allreduce max out":
                    want[:] = comm.allreduce(ref.copy(), op="max")
                    got = h()
                    assert np.array_equal(got, want), (name, i)
                elif name == "broadcast":
                    want[:] = comm.broadcast(ref.copy(), root=n - 1)
                    h()
                    assert np.array_equal(x, want), (name, i)
                elif name == "allgather":
                    expect = comm.allgather(ref[: count // n].copy())
                    got = h()
                    assert np.array_equal(got, expect), (name, i)
                elif name == "reduce_scatter":
                    expect = comm.reduce_scatter(ref.copy())
                    got = h()
                    assert np.array_equal(got, expect), (name, i)
                elif name == "alltoall":
                    expect = comm.alltoall(ref.copy())
                    got = h()
                    assert np.array_equal(got, expect), (name, i)
                runs += 1
                assert h.runs == i + 1
        buf = np.zeros(count, np.int64)
        h = comm.reduce_init(buf, root=0, op="sum")
        for i in range(starts):
            buf[:] = r + i
            plain = comm.reduce(np.full(count, r + i, np.int64), root=0)
            h()
            if r == 0:
                assert np.array_equal(buf, plain)
            runs += 1
    bar = comm.barrier_init()
    for _ in range(starts):
        bar()
        runs += 1
    # point to point: a ring of persistent sends and receives, posted many times
    out = np.zeros(5, np.int32)
    into = np.zeros(5, np.int32)
    send = comm.send_init(out, (r + 1) % n, tag=9)
    recv = comm.recv_init(into, (r - 1) % n, tag=9)
    anyrecv = comm.recv_init(into, None, tag=11)
    anysend = comm.send_init(out, (r + 1) % n, tag=11)
    for i in range(starts):
        out[:] = 100 * r + i
        recv.start()
        send.start()
        send.wait()
        assert recv.wait() is into and np.all(into == 100 * ((r - 1) % n) + i)
        anyrecv.start()
        anysend()
        anyrecv.wait()
        assert anyrecv.source == (r - 1) % n and np.all(into == 100 * ((r - 1) % n) + i)
    entries = rec.entries()
    collectives = [e for e in entries if e[1] not in ("send", "recv", "isend", "irecv")]
    return runs, rec._n - recorded0, len(collectives), [e[1] for e in entries[-3:]]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("env", [SHM, TCP], ids=["shm", "tcp"])
@pytest.mark.parametrize("n", [2, 4])
def test_every_kind_equals_the_plain_call(n, env):
    starts = 3
    for runs, recorded, _, last in run_ranks(_every_kind, n, starts, env=env, timeout=220):
        # each handle run is one ring entry, beside the plain calls compared against (and the p2p posts)
        assert runs == 2 * (7 * starts) + starts
        assert recorded >= runs
        assert last[-1] in ("send", "isend", "recv", "irecv")


def _recorded(comm):
    """A handle's runs are in the flight recorder as calls of their collective, numbered in order
    with the plain calls around them."""
    x = np.ones(4, np.float32)
    h = comm.allreduce_init(x, op="max")
    comm.allreduce(x)
    for _ in range(3):
        h()
    h.start()
    h.wait()
    comm.barrier()
    calls = [(e[0], e[1], e[4]) for e in comm._recorder.entries()]
    return calls[-6:]


@pytest.mark.timeout(60)
def test_each_start_is_recorded():
    for calls in run_ranks(_recorded, 2, env=SHM):
        seqs = [c[0] for c in calls]
        assert [c[1] for c in calls] == ["allreduce"] * 5 + ["barrier"]
        assert seqs == list(range(seqs[0], seqs[0] + 6))
        assert all(c[2] == 2 for c in calls)  # completed


def _mismatch(comm, against_plain):
    """Rank 0 starts handle A (allreduce sum), rank 1 handle B (allreduce max), or a plain call."""
    import pycoll
    x = np.ones(8, np.float32)
    a = comm.allreduce_init(x, op="sum")
    b = comm.allreduce_init(x, op="max")
    try:
        if comm.rank == 0:
            a()
        elif against_plain:
            comm.allreduce(x, op="sum")
        else:
            b()
    except pycoll.ProtocolError as e:
        return type(e).__name__, str(e)
    return None, None


@pytest.mark.timeout(90)
@pytest.mark.parametrize("env", [SHM, TCP, {**TCP, "PYCOLL_DEBUG": "DETAIL"}], ids=["shm", "tcp", "tcp-detail"])
def test_mismatched_handles_name_both(env):
    results = run_ranks(_mismatch, 2, False, env=env)
    kind, text = results[0]
    assert kind == "MismatchError", results
    assert "op sum" in text and "op max" in text and "rank 1" in text, text


@pytest.mark.timeout(90)
def test_handle_against_plain_call_is_a_mismatch():
    results = run_ranks(_mismatch, 2, True, env=TCP)
    kind, text = results[0]
    assert kind == "MismatchError" and "plain call" in text and "op sum" in text, results


def _revoked(comm):
    """Rank 0 starts a handle rank 1 never starts; rank 1 revokes: the started run ends with
    RevokedError, and later starts raise it at once."""
    import time
    import pycoll
    x = np.ones(8, np.float32)
    h = comm.allreduce_init(x)
    comm.barrier()
    if comm.rank == 0:
        h.start()
        t0 = time.monotonic()
        with pytest.raises(pycoll.RevokedError):
            h.wait()
        waited = time.monotonic() - t0
        assert not h.active
        with pytest.raises(pycoll.RevokedError):
            h.start()
        return waited
    time.sleep(0.3)
    comm.revoke()
    return 0.0


@pytest.mark.timeout(90)
@pytest.mark.parametrize("env", [SHM, TCP], ids=["shm", "tcp"])
def test_revoke_ends_a_started_handle(env):
    waited, _ = run_ranks(_revoked, 2, env=env)
    assert waited < 30


def _times_out(comm):
    import pycoll
    x = np.ones(8, np.float32)
    h = comm.allreduce_init(x, timeout=0.5)
    comm.barrier()
    done = np.zeros(1, np.int64)
    if comm.rank == 0:  # rank 1 never starts it
        with pytest.raises(pycoll.TimeoutError):
            h()
        comm.send(done, 1)
    else:
        comm.recv(done, 0)  # (a point-to-point message: the collectives' numbering is out of step now)
    return True


@pytest.mark.timeout(60)
def test_a_run_is_bounded_by_the_timeout():
    assert run_ranks(_times_out, 2, env=SHM) == [True, True]


def _bad_input(comm):
    """Starting twice, waiting unstarted, changed buffers, a freed handle, a closed communicator."""
    import torch
    x = np.zeros(4, np.float32)
    h = comm.allreduce_init(x)
    errors = {}

    def expect(kind, what, fn):
        try:
            fn()
        except kind as e:
            errors[what] = str(e)
        else:
            raise AssertionError(f"{what}: no {kind.__name__}")

    expect(RuntimeError, "wait unstarted", h.wait)
    h.start()
    expect(RuntimeError, "start twice", h.start)
    expect(RuntimeError, "call while started", h)
    h.wait()
    expect(RuntimeError, "wait twice", h.wait)
    x.resize(8, refcheck=False)  # (numpy refuses while the handle references it, unless told not to check)
    expect(ValueError, "resized", h)
    y = np.zeros(4, np.float32)
    hy = comm.allreduce_init(y)
    y.flags.writeable = False
    expect(ValueError, "read-only", hy)
    v = np.zeros(4, np.float32)
    hv = comm.allreduce_init(v)
    with pytest.raises(ValueError):  # numpy itself refuses to resize an array the handle holds
        v.resize(8)
    assert hv.active is False
    t = torch.zeros(16)
    ht = comm.allreduce_init(t)
    ht()
    t.set_(torch.zeros(1 << 16))  # other memory (resize_ torch refuses: numpy shares the storage)
    expect(ValueError, "tensor moved", ht)
    z = np.ones(2, np.float32)
    hz = comm.allreduce_init(z)
    hz.free()
    expect(RuntimeError, "freed", hz)
    with pytest.raises(ValueError):
        comm.allreduce_init(np.ones(3, np.float32), op="nosuchop")  # checked at init, as the plain call
    with pytest.raises(TypeError):
        comm.allreduce_init(np.ones(3, np.complex64), op="max")
    s = comm.send_init(np.ones(2), (comm.rank + 1) % comm.size)
    expect(RuntimeError, "p2p wait unstarted", s.wait)
    p2p = comm.recv_init(np.ones(2), (comm.rank + 1) % comm.size)
    p2p.start()
    expect(RuntimeError, "p2p start twice", p2p.start)
    s()  # match the posted receive of the peer
    p2p.wait()
    w = np.ones(2, np.float32)
    hw = comm.allreduce_init(w)
    comm.barrier()
    return errors, hw


def _bad_input_then_close(comm):
    errors, hw = _bad_input(comm)
    dup = comm.dup()
    hd = dup.allreduce_init(np.ones(2, np.float32))
    hd()
    dup.close()
    try:
        hd()
    except RuntimeError as e:
        errors["closed"] = str(e)
    # shrink() replaces the communicator: its handles say so
    shrunk = comm.shrink()
    try:
        hw()
    except RuntimeError as e:
        errors["shrunk"] = str(e)
    h2 = shrunk.allreduce_init(np.ones(2, np.float32))
    assert h2()[0] == shrunk.size
    return errors


@pytest.mark.timeout(90)
def test_bad_input_raises_clear_errors():
    for errors in run_ranks(_bad_input_then_close, 2, env=SHM):
        assert "not started" in errors["wait unstarted"] and "not started" in errors["wait twice"]
        assert "started twice" in errors["start twice"] and "wait() first" in errors["call while started"]
        assert "(8,)" in errors["resized"] and "(4,)" in errors["resized"]
        assert "read-only" in errors["read-only"]
        assert "resized or moved" in errors["tensor moved"]
        assert "freed" in errors["freed"]
        assert "not started" in errors["p2p wait unstarted"] and "started twice" in errors["p2p start twice"]
        assert "closed" in errors["closed"] and "closed" in errors["shrunk"]


def _torch_reuse(rank, size, port, steps):
    """dist.all_reduce of one tensor (and an async one, as DDP's buckets) many times: equal to the plain
    call every time, and after the first two sightings of its memory every call is a handle's hit."""
    import torch
    import torch.distributed as dist
    import pycoll.torch  # noqa: F401
    dist.init_process_group("pycoll", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    pg = dist.group.WORLD
    backend = pg if hasattr(pg, "handles") else pg._get_backend(torch.device("cpu"))
    comm = backend.comm
    t = torch.zeros(4096)
    bucket = torch.zeros(1 << 16)
    for i in range(steps):
        t.copy_(torch.arange(4096) * (rank + 1) + i)
        want = comm.allreduce(t.numpy().copy())
        dist.all_reduce(t)
        assert np.array_equal(t.numpy(), want), i
        bucket.fill_(rank + i)
        dist.all_reduce(bucket, op=dist.ReduceOp.AVG, async_op=True).wait()
        assert float(bucket[0]) == sum(range(size)) / size + i
    # a new tensor, perhaps in the freed memory of t (then the same bytes: t's handle serves it)
    hits_before = backend.handles.hits
    del t
    for _ in range(3):
        u = torch.ones(4096)
        dist.all_reduce(u)
        assert float(u[0]) == size
    strided = torch.ones(64, 64).t()  # same count, other layout: the plain path
    dist.all_reduce(strided)
    assert float(strided[0, 0]) == size
    dist.destroy_process_group()
    return backend.handles.hits, backend.handles.made, hits_before


@pytest.mark.timeout(120)
def test_torch_backend_reuses_handles():
    pytest.importorskip("torch")
    from multiproc import free_port
    steps = 6
    for hits, made, _ in run_ranks(_torch_reuse, 2, 2, free_port(), steps, init=False, timeout=110):
        assert made >= 2  # the tensor and the bucket
        assert hits >= 2 * (steps - 2)  # every call after the second sighting of each


@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_bench_times_handles_and_the_bare_floor(tmp_path):
    """`pycoll bench --np 2 --persistent --compare python-shm,torch-pycoll`: a job calling persistent
    handles, Python's bare shared-memory loop and dist.all_reduce on pycoll beside the plain pycoll job,
    each in processes of its own; every one's first allreduce right."""
    import json
    import os
    import shutil
    import subprocess
    import sys
    if shutil.which("mpirun") is None:
        pytest.skip("mpirun not installed")
    pytest.importorskip("mpi4py")
    pytest.importorskip("torch")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "rows.json"
    cmd = [sys.executable, "-m", "pycoll", "bench", "allreduce", "--np", "2", "--transport", "shm", "--persistent",
           "--compare", "python-shm,torch-pycoll", "--sizes", "8,4K", "--rounds", "1", "--round-seconds", "0.01",
           "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": root}, timeout=280,
                          cwd=root)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())["rows"]
    libs = ["pycoll-shm", "pycoll-shm-persistent", "python-shm", "torch-pycoll"]
    assert [(r["size"], r["library"]) for r in rows] == [(s, lib) for s in (8, 4096) for lib in libs]
    assert all(r["wrong"] == 0 and r["time_us"] > 0 and r["cpu_us"] > 0 for r in rows)
    assert all(set(r["ratio"]) == {"pycoll-shm", "pycoll-shm-persistent"} for r in rows)
    assert not [f for f in os.listdir("/dev/shm") if f.startswith("pycoll-bench-floor-")]  # the floor's files go
