"""`pycoll info`: this machine's topology (host id, NUMA node, NICs, RDMA devices), the job's link
matrix like `nvidia-smi topo -m`, and the tuner's table of predicted times per algorithm and size.

Alone it describes this rank (`--hosts H --ppn L` models H hosts of L ranks, rank i on host i mod H);
under a launcher (`pycoll run -n 4 pycoll info`) every rank joins, the tuner calibrates, and rank 0
prints the whole job with the measured parameters and the algorithm each size would use.
"""
from __future__ import annotations

import argparse
import os
from typing import List, Optional

from ..calibration import base_params
from ..selection import Selector
from ..topology import Topology, detect
from ..transports.shm_board import SLOT_BYTES, STAGE_BYTES
from ..tuner import MODELED, Tuner
from .bench import parse_size


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="pycoll info", description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="8,1K,64K,1M,4M,16M,64M", help="message sizes of the tuner table")
    ap.add_argument("--collective", action="append", choices=sorted(MODELED),
                    help="limit the table to these collectives (repeatable)")
    ap.add_argument("--hosts", type=int, default=0, help="model H hosts (standalone only)")
    ap.add_argument("--ppn", type=int, default=1, help="ranks per host of the model")
    return ap


def render(topo: Topology, selector: Selector, sizes: List[int], collectives: List[str]) -> str:
    """The matrix and the tuner table (the selector's pick marked `*`)."""
    tuner = selector.tuner or Tuner(base_params(topo), SLOT_BYTES, STAGE_BYTES)
    table = tuner.table(topo, sizes, collectives,
                        choose=lambda coll, s: selector.choose(coll, s, topo.size, topo=topo))
    static = "" if selector.tuner else "\n(PYCOLL_TUNER=static or PYCOLL_ALGO: `*` is the size rule's pick)"
    return f"{topo.matrix()}\n\n{table}{static}"


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",") if s]
    collectives = args.collective or list(MODELED)
    if "WORLD_SIZE" in os.environ or "OMPI_COMM_WORLD_SIZE" in os.environ or "SLURM_NTASKS" in os.environ:
        import pycoll
        with pycoll.init() as comm:
            if comm.rank == 0:
                print(render(comm.topology, comm.selector, sizes, collectives))
        return 0
    me = detect(0)
    if args.hosts < 1 or args.ppn < 1:
        topo = Topology([me])
    else:
        topo = Topology.from_hosts([f"host{r % args.hosts}" for r in range(args.hosts * args.ppn)])
    nic_text = ", ".join(f"{n.name} {n.address} {n.speed or '?'} Mbit/s" for n in me.nics) or "none"
    print(f"this rank: host id {me.host}\n  hostname {me.hostname}, NUMA node {me.numa}, NICs {nic_text}, "
          f"RDMA {', '.join(me.rdma) or 'none'}\n")
    # modelled as the default transport (auto) runs: shm, with its board and stage, between ranks on a host
    print(render(topo, Selector(tuner=Tuner(base_params(topo), SLOT_BYTES, STAGE_BYTES)), sizes, collectives))
    return 0
