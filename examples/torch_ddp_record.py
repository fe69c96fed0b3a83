"""A torch DDP model on the "pycoll" backend, recorded as a workload for `pycoll predict`.

    pycoll run -n 2 python examples/torch_ddp_record.py --hidden 512,512 --steps 30 --out rec.json
    pycoll predict --workload rec.json --hosts 4 --ppn 2 --link-gbit 1

An MLP on random 64-feature inputs (10 classes), trained with DDP (bucket_cap_mb sets its gradient
buckets) through pycoll.predict.torch_record.Recorder, which times every step through a DDP comm
hook and writes the same JSON as `python -m pycoll.trainer --report-json`.
"""
import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import pycoll.torch  # noqa: F401  (registers the "pycoll" backend)
from pycoll.predict.torch_record import Recorder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", default="256,256", help="hidden layer widths, comma separated")
    ap.add_argument("--batch-size", type=int, default=128, help="global batch (all ranks together)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--bucket-mb", type=float, default=0.25, help="DDP bucket_cap_mb")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    ap.add_argument("--out", required=True, help="workload record (JSON), written by rank 0")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    dist.init_process_group("pycoll")
    rank, size = dist.get_rank(), dist.get_world_size()
    widths = [64] + [int(h) for h in args.hidden.split(",")] + [10]
    torch.manual_seed(0)
    layers = []
    for a, b in zip(widths, widths[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    model = nn.Sequential(*layers[:-1])
    ddp = DDP(model, bucket_cap_mb=args.bucket_mb)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    rec = Recorder(ddp, opt, nn.functional.cross_entropy)
    g = torch.Generator().manual_seed(1)
    pool_x, pool_y = torch.randn(4 * args.batch_size, 64, generator=g), torch.randint(0, 10, (4 * args.batch_size,),
                                                                                        generator=g)
    local = args.batch_size // size
    for step in range(args.steps):
        at = (step * args.batch_size + rank * local) % (len(pool_x) - local)
        loss = rec.step(pool_x[at:at + local], pool_y[at:at + local])
    out = rec.save(args.out, args.batch_size, pool_x, pool_y)
    if out is not None:
        p, m = out["prediction"], out["measured"]
        print(f"loss {loss:.3f}; {len(out['buckets'])} buckets; measured step {m['step_ms']:.2f} ms = compute "
              f"{m['compute_ms']:.2f} + comm {m['comm_ms']:.2f} + wait {m['wait_ms']:.2f}; predicted "
              f"{p['step_ms']:.2f} ms; workload record written to {args.out}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
