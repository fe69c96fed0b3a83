"""Which algorithms implement which collective, PYCOLL_ALGO parsing (NCCL syntax), and the default pick.

`PYCOLL_ALGO=ring,tree;allreduce:^tree`: a bare list applies to every collective that has one
of the named algorithms, `coll:list` to one collective, and `^` excludes instead of selecting.
"""
from __future__ import annotations

import functools
import importlib
import os
from typing import Callable, Dict, FrozenSet, List, Optional

# collective -> algorithm -> "module:function" (resolved on first use)
IMPLEMENTATIONS: Dict[str, Dict[str, str]] = {
    "allreduce": {"ring": "ring:allreduce", "recursive_doubling": "recursive_doubling:allreduce",
                  "halving_doubling": "halving_doubling:allreduce",
                  "tree": "tree:allreduce_double_tree", "binomial": "tree:allreduce",
                  "mpi_native": "mpi_native:allreduce"},
    "broadcast": {"tree": "tree:broadcast", "ring": "tree:broadcast_chain",
                  "mpi_native": "mpi_native:broadcast"},
    "reduce": {"tree": "tree:reduce", "mpi_native": "mpi_native:reduce"},
    "allgather": {"ring": "ring:allgather", "recursive_doubling": "recursive_doubling:allgather",
                  "mpi_native": "mpi_native:allgather"},
    "reduce_scatter": {"ring": "ring:reduce_scatter", "halving_doubling": "halving_doubling:reduce_scatter",
                       "mpi_native": "mpi_native:reduce_scatter"},
    "alltoall": {"pairwise": "pairwise:alltoall", "mpi_native": "mpi_native:alltoall"},
    "alltoallv": {"pairwise": "pairwise:alltoallv", "mpi_native": "mpi_native:alltoallv"},
    "gather": {"linear": "linear:gather", "mpi_native": "mpi_native:gather"},
    "scatter": {"linear": "linear:scatter", "mpi_native": "mpi_native:scatter"},
    "barrier": {"dissemination": "barrier:barrier", "mpi_native": "mpi_native:barrier"},
}
ALGORITHM_NAMES = frozenset({"ring", "tree", "halving_doubling", "recursive_doubling", "hierarchical",
                             "pairwise", "linear", "mpi_native", "binomial", "dissemination"})
COLLECTIVE_ALIASES = {"allgatherv": "allgather", "reducescatter": "reduce_scatter", "bcast": "broadcast"}


def parse_algo(spec: Optional[str]) -> Dict[str, FrozenSet[str]]:
    """The allowed algorithms per collective; ValueError names the bad token."""
    allowed: Dict[str, FrozenSet[str]] = {}
    if not spec or not spec.strip():
        return allowed
    for part in spec.lower().split(";"):
        part = part.strip()
        if not part:
            continue
        colls: List[str]
        if ":" in part:
            coll, _, part = part.partition(":")
            coll = COLLECTIVE_ALIASES.get(coll.strip(), coll.strip())
            if coll not in IMPLEMENTATIONS:
                raise ValueError(f"PYCOLL_ALGO={spec!r}: unknown collective {coll!r} "
                                 f"(known: {sorted(IMPLEMENTATIONS)})")
            colls, explicit = [coll], True
        else:
            colls, explicit = list(IMPLEMENTATIONS), False
        invert = part.startswith("^")
        names = {n.strip() for n in part.lstrip("^").split(",") if n.strip()}
        bad = sorted(names - ALGORITHM_NAMES)
        if bad or not names:
            raise ValueError(f"PYCOLL_ALGO={spec!r}: unknown algorithm {bad[0] if bad else '(empty)'!r} "
                             f"(known: {sorted(ALGORITHM_NAMES)})")
        for coll in colls:
            impls = set(IMPLEMENTATIONS[coll])
            # `^x` means every portable algorithm but x: mpi_native only ever when named
            chosen = impls - names - {"mpi_native"} if invert else impls & names
            if chosen or explicit:
                allowed[coll] = frozenset(chosen)
    return allowed


@functools.lru_cache(maxsize=None)
def resolve(collective: str, algorithm: str) -> Callable:
    """The function implementing `algorithm` for `collective`."""
    module, _, func = IMPLEMENTATIONS[collective][algorithm].partition(":")
    return getattr(importlib.import_module(f"{__package__}.{module}"), func)


class Selector:
    """Picks an algorithm per call: PYCOLL_ALGO restricts the choice, a size rule picks among the rest."""

    def __init__(self, spec: Optional[str] = None) -> None:
        self.spec = os.environ.get("PYCOLL_ALGO", "") if spec is None else spec
        self.allowed = parse_algo(self.spec)

    def choose(self, collective: str, nbytes: int, size: int, algo: Optional[str] = None) -> str:
        """Algorithm name for one call of `collective` moving `nbytes` per rank among `size` ranks."""
        impls = IMPLEMENTATIONS[collective]
        if algo is not None:
            if algo not in impls:
                raise ValueError(f"algo={algo!r} does not implement {collective} (choose from {sorted(impls)})")
            return algo
        allowed = self.allowed.get(collective, frozenset(impls))
        if not allowed:
            raise ValueError(f"PYCOLL_ALGO={self.spec!r} leaves no algorithm for {collective} "
                             f"(it has {sorted(impls)})")
        for name in default_order(collective, nbytes, size):
            if name in allowed:
                return name
        return sorted(allowed)[0]


def default_order(collective: str, nbytes: int, size: int) -> List[str]:
    """Preference order by message size, MPICH/Open MPI style (the tuner refines it)."""
    pow2 = size & (size - 1) == 0
    if collective == "allreduce":
        if nbytes <= (256 << 10):  # measured here (4 ranks, tcp): fewest steps win up to ~256 KiB
            return ["recursive_doubling", "halving_doubling", "ring", "tree", "binomial"]
        if nbytes <= (1 << 20) and pow2:
            return ["halving_doubling", "ring", "tree", "recursive_doubling", "binomial"]
        return ["ring", "halving_doubling", "tree", "recursive_doubling", "binomial"]
    if collective == "broadcast":
        return ["tree", "ring"] if nbytes <= (1 << 20) else ["ring", "tree"]
    if collective == "allgather":
        return ["recursive_doubling", "ring"] if nbytes <= (64 << 10) else ["ring", "recursive_doubling"]
    if collective == "reduce_scatter":
        return ["halving_doubling", "ring"] if pow2 and nbytes <= (1 << 20) else ["ring", "halving_doubling"]
    return list(IMPLEMENTATIONS[collective])
