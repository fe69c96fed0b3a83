"""One rank of a job that tests/test_token_security.py attacks: `python token_job.py OUT [torch]`.

It records what a sniffer would capture (every hello it sends), holds rank 0's bulk-stream listener
open until the test's stranger has tried it (OUT/bulk.go), writes OUT/rank<R>.json (endpoints, the
token, its hellos, the store port), waits for OUT/go, then allreduces and reports how many
connections and messages its transport turned away in OUT/done<R>.json.
"""
import json
import os
import sys
import time

import numpy as np

out = sys.argv[1]
use_torch = len(sys.argv) > 2 and sys.argv[2] == "torch"


def wait_for(name, timeout=90.0):
    deadline = time.monotonic() + timeout
    while not os.path.exists(os.path.join(out, name)):
        if time.monotonic() > deadline:
            raise SystemExit(f"{name} never came")
        time.sleep(0.05)


def write(name, data):
    tmp = os.path.join(out, name + ".tmp")
    with open(tmp, "w") as fh:
        json.dump(data, fh)
    os.replace(tmp, os.path.join(out, name))


from pycoll.transports import bulk, wire  # noqa: E402

captured = []
_make_hello = wire.make_hello


def recording_make_hello(*args):
    hello = _make_hello(*args)
    captured.append(hello.hex())
    return hello


wire.make_hello = recording_make_hello
_establish = bulk.BulkLinks.establish


def held_establish(self, endpoints, token, deadline, streams=None):
    if self.rank == 0:  # the stranger gets the listener to itself first
        write("bulk.json", {"endpoint": self.endpoint})
    if self.rank == 1:  # what a sniffer has seen by now: rank 1's zmq hello to rank 0
        write("capture1.json", {"hellos": list(captured)})
    wait_for("bulk.go")
    return _establish(self, endpoints, token, deadline + 60, streams)


bulk.BulkLinks.establish = held_establish

if use_torch:
    import torch
    import torch.distributed as dist

    import pycoll.torch as pt  # registers the backend (the tests turn torch's autoload off)
    dist.init_process_group("pycoll")
    comm = pt._world
else:
    import pycoll
    comm = pycoll.init()
tr = comm.transport
write(f"rank{comm.rank}.json", {
    "rank": comm.rank, "endpoint": tr.endpoint, "token": tr._token.hex(), "hellos": captured,
    "store_port": getattr(comm.store, "port", None), "transport": tr.name})
wait_for("go")
x = np.full(8, comm.rank + 1, dtype=np.float32)
comm.allreduce(x)
ok = bool(np.all(x == comm.size * (comm.size + 1) / 2))
write(f"done{comm.rank}.json", {"ok": ok, "rejected": tr.rejected, "bulk_rejected": tr._bulk.rejected})
if use_torch:
    dist.destroy_process_group()
else:
    comm.close()
print(f"rank {comm.rank}: allreduce {'OK' if ok else 'WRONG'}", flush=True)
sys.exit(0 if ok else 1)
