"""A broken job fails fast and says why; strangers on our ports are turned away without harm."""
import os
import secrets
import socket
import time

import numpy as np
import pytest
import zmq

from multiproc import free_port, run_ranks
from pycoll.transports import wire

pytestmark = pytest.mark.timeout(150)


def _init_error(rank):
    import pycoll
    t0 = time.monotonic()
    try:
        pycoll.init()
    except pycoll.PycollError as e:
        return type(e).__name__, str(e), getattr(e, "peers", None), time.monotonic() - t0
    return "no error"


def test_unreachable_master_addr_names_the_address():
    port = free_port()
    env = {"MASTER_PORT": str(port), "PYCOLL_STORE_HOSTED": "1", "PYCOLL_TIMEOUT": "2"}
    for name, msg, _, took in run_ranks(_init_error, 2, init=False, env=env):
        assert name == "StoreError" and f"127.0.0.1:{port}" in msg and "MASTER_ADDR" in msg
        assert 1.5 < took < 10


def test_rank_that_never_joins_is_named():
    results = run_ranks(_init_error, 3, init=False, env={"WORLD_SIZE": "4", "PYCOLL_TIMEOUT": "3"})
    for name, msg, peers, took in results:
        assert name == "TimeoutError" and peers == [3] and "ranks [3]" in msg and took < 15


STRANGER_BYTES = [
    b"GET / HTTP/1.1\r\nHost: pycoll\r\n\r\n",
    b"SSH-2.0-OpenSSH_9.6\r\n",
    b"\xff" + bytes(8) + b"\x7f\x03\x00" + b"BOGUS".ljust(20, b"\0") + bytes(32),  # ZMTP 3, no such mechanism
]
EXPECTED_REJECTS = len(STRANGER_BYTES) + 5  # + the forged messages below but the first copy of the hello


def _strangers(comm):
    tr = comm.transport
    host, port = tr.endpoint[len("tcp://"):].rsplit(":", 1)
    # What port scanners send; each fails the zmq handshake. Random bytes would not always: libzmq
    # reads a first byte other than 0xff as a ZMTP/1.0 frame length and may parse them as messages.
    for garbage in STRANGER_BYTES:
        with socket.create_connection((host, int(port))) as s:
            s.sendall(garbage)
    ctx = zmq.Context()
    forged = [
        [b"garbage"],                                                         # no header
        [os.urandom(wire.HEADER.size), b"x"],                                 # bad magic
        [wire.pack_header(wire.KIND_HELLO, 0, 0, 0, 0, 10), os.urandom(wire.HELLO.size)],  # bad token
        [wire.pack_header(wire.KIND_DATA, 0, comm.comm_id, 1, 0, 8), b"12345678"],  # unauthenticated
    ]
    hello = wire.make_hello(tr._token, 0, comm.rank, secrets.token_bytes(16))
    replay = [wire.pack_header(wire.KIND_HELLO, 0, 0, 0, 0, len(hello)), hello]
    socks = []
    for frames in forged + [replay, replay]:  # the second copy of a valid hello is a replay
        s = ctx.socket(zmq.DEALER)
        s.connect(tr.endpoint)
        s.send_multipart(frames)
        socks.append(s)
    deadline = time.monotonic() + 40  # a stalled handshake is dropped after 5 s (HANDSHAKE_IVL)
    while True:  # all ranks leave the loop in the same iteration, so their calls stay matched
        done = np.array([tr.rejected >= EXPECTED_REJECTS or time.monotonic() > deadline], np.int32)
        comm.allreduce(done, op="min")
        if done[0]:
            break
        time.sleep(0.05)
    x = np.full(1000, comm.rank + 1, np.float64)
    comm.allreduce(x)
    for s in socks:
        s.close(linger=0)
    ctx.term()
    return tr.rejected, float(x[0])


def test_strangers_are_rejected_and_the_job_carries_on():
    for rejected, value in run_ranks(_strangers, 2, env={"PYCOLL_TRANSPORT": "tcp"}, timeout=120):
        assert rejected == EXPECTED_REJECTS
        assert value == 3.0
