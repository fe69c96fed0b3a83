"""A process that holds no secret of the job and tries to get in (tests/test_token_security.py):
`python token_stranger.py OUT HOST PORT pycoll|torch`. It runs with no PYCOLL_JOB_TOKEN* variable and
writes what it achieved to OUT/stranger.json.

- the store: join pycoll's TCPStore with no token and a guessed one, and read `pycoll/0/token`
  and every key the job wrote, or (torch) list and read every key of torch's open TCPStore;
- rank 0's bulk-stream listener (held open for it by token_job.py): a hello made with a guessed
  token, and rank 1's captured zmq hello replayed there;
- rank 0's tcp (zmq ROUTER) port: rank 1's captured hellos replayed, then a dozen hellos with
  guessed tokens, each followed by a data message.
"""
import json
import os
import secrets
import socket
import sys
import time

import zmq

out, host, port, kind = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
for var in ("PYCOLL_JOB_TOKEN", "PYCOLL_JOB_TOKEN_FILE"):
    assert var not in os.environ, var

from pycoll.bootstrap.store import TCPStore  # noqa: E402
from pycoll.errors import StoreError  # noqa: E402
from pycoll.transports import wire  # noqa: E402

report = {"store": {}, "values": {}, "bulk": [], "zmq_sent": 0}


def wait_for(name, timeout=90.0):
    path = os.path.join(out, name)
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise SystemExit(f"{name} never came")
        time.sleep(0.05)
    with open(path) as fh:
        return json.load(fh)


# -- the store ----------------------------------------------------------------------------------
def attack_store():
    global port
    if port == 0:  # a store on a port only the job knows (mpirun without MASTER_ADDR): a scanner finds it
        port = wait_for("rank0.json")["store_port"]
    for label, token in (("no token", None), ("guessed token", secrets.token_bytes(32))):
        try:
            s = TCPStore(host, port, token=token, timeout=3)
            report["store"][label] = "joined"
            for key in ("pycoll/0/token", "token", "pycoll/0/tokenref"):
                try:
                    report["values"][key] = s.get(key, timeout=0.5).hex()
                except Exception:  # noqa: BLE001
                    pass
            s.close()
        except StoreError as e:
            report["store"][label] = f"refused: {e}"


st = None
if kind == "torch":
    import datetime

    import torch.distributed as dist
    try:
        st = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=10))
        report["store"]["torch"] = "joined"  # torch's store admits anyone: only what is in it matters
    except Exception as e:  # noqa: BLE001
        st, report["store"]["torch"] = None, f"refused: {e}"
elif port != 0:
    attack_store()

bulk = wait_for("bulk.json")
capture = wait_for("capture1.json")  # rank 1's hellos so far: what a sniffer saw (its zmq hello to rank 0)
if st is not None:  # torch: read every key, now that the job has rendezvoused
    for key in st.list_keys():
        try:
            report["values"][key] = bytes(st.get(key)).hex()
        except Exception:  # noqa: BLE001
            pass

# -- rank 0's bulk-stream listener ------------------------------------------------------------------
bhost, bport = bulk["endpoint"].rsplit(":", 1)
attempts = [("guessed", wire.make_hello(secrets.token_bytes(32), 1, 0, secrets.token_bytes(16), wire.BULK_PURPOSE))]
attempts += [("replayed", bytes.fromhex(h)) for h in capture["hellos"]]
socks = []
for label, hello in attempts:
    try:
        sock = socket.create_connection((bhost.strip("[]"), int(bport)), timeout=5)
        sock.sendall(hello)
        socks.append((label, sock))
    except OSError as e:
        report["bulk"].append([label, f"connect failed: {e}"])
with open(os.path.join(out, "bulk.go"), "w"):
    pass
for label, sock in socks:  # the job answers a member with its own hello; a stranger gets a hang-up
    sock.settimeout(30)
    try:
        got = sock.recv(wire.HELLO.size)
        report["bulk"].append([label, "answered" if got else "hung up"])
    except OSError as e:
        report["bulk"].append([label, f"hung up ({type(e).__name__})"])
    sock.close()

# -- rank 0's zmq ROUTER ----------------------------------------------------------------------------
r0 = wait_for("rank0.json")
r1 = wait_for("rank1.json")
ctx = zmq.Context()
dealer = ctx.socket(zmq.DEALER)
dealer.setsockopt(zmq.LINGER, 2000)
dealer.connect(r0["endpoint"])
data = [wire.pack_header(wire.KIND_DATA, 0, 0, 0, 0, 4), b"evil"]
for h in r1["hellos"]:
    hello = bytes.fromhex(h)
    replay = ctx.socket(zmq.DEALER)
    replay.setsockopt(zmq.LINGER, 2000)
    replay.connect(r0["endpoint"])
    replay.send_multipart([wire.pack_header(wire.KIND_HELLO, 0, 0, 0, 0, len(hello)), hello])
    replay.send_multipart(data)
    report["zmq_sent"] += 2
time.sleep(0.5)  # the replays reach rank 0 (and its log) before the flood
for _ in range(12):  # more than a burst: the log must stay short
    hello = wire.make_hello(secrets.token_bytes(32), 1, 0, secrets.token_bytes(16))
    dealer.send_multipart([wire.pack_header(wire.KIND_HELLO, 0, 0, 0, 0, len(hello)), hello])
    dealer.send_multipart(data)
    report["zmq_sent"] += 2
time.sleep(2.0)
if kind != "torch" and not report["store"]:
    attack_store()
report["token_seen"] = any(r0["token"] in v for v in report["values"].values())
with open(os.path.join(out, "stranger.json"), "w") as fh:
    json.dump(report, fh)
with open(os.path.join(out, "go"), "w"):
    pass
ctx.destroy(linger=0)
