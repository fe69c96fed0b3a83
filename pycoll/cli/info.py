"""`pycoll info`: this machine's topology (host id, NUMA node, NICs, RDMA devices), the job's link
matrix like `nvidia-smi topo -m`, and the tuner's table of predicted times per algorithm and size.

Alone (no launcher, or a launcher's job of one rank) it describes this rank, and since one rank has
nothing to send, its table models this host with one rank per core (`--hosts H --ppn L`: H hosts of
L ranks, rank i on host i mod H), saying so above the table; under a launcher (`pycoll run -n 4
pycoll info`) every rank joins, the tuner calibrates, and rank 0 prints the whole job with the
measured parameters and the algorithm each size would use, and, under `auto`, which transport
carries each pair of ranks (shm, verbs or tcp) with each rank's RDMA port or why it has none.
"""
from __future__ import annotations

import argparse
import os
from typing import Callable, List, Optional, Tuple

from ..calibration import base_params
from ..selection import Selector
from ..topology import RankInfo, Topology, detect
from ..transports.capabilities import Routes
from ..transports.shm_board import SLOT_BYTES, STAGE_BYTES
from ..transports.verbs_device import local_advert
from ..tuner import MODELED, Tuner
from .bench import parse_size


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="pycoll info", description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="8,1K,64K,1M,4M,16M,64M", help="message sizes of the tuner table")
    ap.add_argument("--collective", action="append", choices=sorted(MODELED),
                    help="limit the table to these collectives (repeatable)")
    ap.add_argument("--hosts", type=int, help="alone: model H hosts (default 1: this host)")
    ap.add_argument("--ppn", type=int, help="alone: ranks per host of the model (default: one per core of "
                                            "this host; 1 with --hosts)")
    return ap


def render(topo: Topology, selector: Selector, sizes: List[int], collectives: List[str], note: str = "",
           pairs: str = "") -> str:
    """The matrix, `pairs` (pair_table's), and the tuner table (the selector's pick marked `*`),
    `note` on the line above the table."""
    tuner = selector.tuner or Tuner(base_params(topo), SLOT_BYTES, STAGE_BYTES)
    table = tuner.table(topo, sizes, collectives,
                        choose=lambda coll, s: selector.choose(coll, s, topo.size, topo=topo))
    static = "" if selector.tuner else "\n(PYCOLL_TUNER=static or PYCOLL_ALGO: `*` is the size rule's pick)"
    above = f"{note}\n" if note else ""
    between = f"\n\n{pairs}" if pairs else ""
    return f"{topo.matrix()}{between}\n\n{above}{table}{static}"


def pair_table(size: int, wire: Callable[[int, int], str], port: Callable[[int], str]) -> str:
    """Which transport carries each pair of ranks (`auto`'s choice), a matrix like the link matrix,
    then each rank's RDMA port as it advertised it (or why it has none)."""
    width = 7
    lines = ["transport per pair (auto: shm on one host; verbs between hosts whose RDMA ports share a "
             "network; tcp otherwise)",
             " " * 6 + "".join(f"{'R' + str(c):>{width}}" for c in range(size))]
    for r in range(size):
        lines.append(f"{'R' + str(r):<6}" + "".join(f"{'-' if r == c else wire(r, c):>{width}}" for c in range(size)))
    lines.append("RDMA port of each rank:")
    lines += [f"  R{r}: {port(r)}" for r in range(size)]
    return "\n".join(lines)


def alone() -> bool:
    """Whether this process is a job of one rank: no launcher (torchrun/pycoll run, mpirun, srun) set
    a job size, or it set 1."""
    sizes = [os.environ[v] for v in ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS") if v in os.environ]
    return not sizes or sizes[0].strip() == "1"


def modelled(me: RankInfo, hosts: Optional[int], ppn: Optional[int]) -> Tuple[Topology, str]:
    """The topology the table of a rank alone models, and the line that says which: H hosts of L ranks
    (rank i on host i mod H) when --hosts or --ppn is given, else this host with one rank per core
    (at least 2: one rank has nothing to send)."""
    if hosts is None and ppn is None:
        n = max(2, me.cores)
        how = (f"{n} ranks on its {me.cores} cores" if me.cores > 1 else "2 ranks sharing its 1 core"
               if me.cores == 1 else "2 ranks (its core count is unknown)")
        note = (f"a rank alone sends nothing, so the table models this host with one rank per core: {how} "
                f"(--hosts H --ppn L models another shape)")
        return Topology([me] * n), note
    hosts, ppn = hosts or 1, ppn or 1
    topo = Topology.from_hosts([f"host{r % hosts}" for r in range(hosts * ppn)])
    note = (f"a rank alone sends nothing, so the table models {hosts * ppn} ranks on {hosts} hosts "
            f"(--hosts {hosts} --ppn {ppn}, rank i on host i mod {hosts})")
    return topo, note


def main(argv: Optional[List[str]] = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",") if s]
    collectives = args.collective or list(MODELED)
    if not alone():
        import pycoll
        with pycoll.init() as comm:
            if comm.rank == 0:
                routes = comm.transport.offers(Routes)
                pairs = "" if routes is None else pair_table(comm.size, routes.wire, routes.port)
                print(render(comm.topology, comm.selector, sizes, collectives, pairs=pairs))
        return 0
    for name in ("hosts", "ppn"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            ap.error(f"--{name} must be at least 1 (got {getattr(args, name)})")
    if (args.hosts or 1) * (args.ppn or 1) < 2 and (args.hosts, args.ppn) != (None, None):
        ap.error(f"--hosts {args.hosts or 1} --ppn {args.ppn or 1} models one rank, which sends nothing: "
                 "give at least 2 ranks")
    me = detect(0)
    topo, note = modelled(me, args.hosts, args.ppn)
    nic_text = ", ".join(f"{n.name} {n.address} {n.speed or '?'} Mbit/s" for n in me.nics) or "none"
    print(f"this rank: host id {me.host}\n  hostname {me.hostname}, NUMA node {me.numa}, NICs {nic_text}, "
          f"RDMA {', '.join(me.rdma) or 'none'}\n  RDMA port that auto would offer ranks on other hosts: "
          f"{local_advert().describe()}\n")
    # modelled as the default transport (auto) runs: shm, with its board and stage, between ranks on a host
    print(render(topo, Selector(tuner=Tuner(base_params(topo), SLOT_BYTES, STAGE_BYTES)), sizes, collectives, note))
    return 0
