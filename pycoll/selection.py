"""The selection layer: which algorithms implement which collective, PYCOLL_ALGO parsing (NCCL
syntax), and the pick per call (the tuner's cheapest, or the size rules).

`PYCOLL_ALGO=ring,tree;allreduce:^tree`: a bare list applies to every collective that has one
of the named algorithms, `coll:list` to one collective, and `^` excludes instead of selecting.
"""
from __future__ import annotations

import functools
import importlib
from . import config
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Tuple

from .logutil import quiet_unless_asked
from .topology import Topology
from .tuner import MODELED, Tuner, info_log, log as tuner_log

# the tuner's logger (each choice below, and calibration's line) speaks at INFO only under
# PYCOLL_DEBUG=INFO/TRACE, not whenever the application's root logger is at INFO
quiet_unless_asked(tuner_log)

# collective -> algorithm -> "module:function" in pycoll.algorithms (resolved on first use)
IMPLEMENTATIONS: Dict[str, Dict[str, str]] = {
    "allreduce": {"ring": "hierarchical:ring_allreduce", "recursive_doubling": "recursive_doubling:allreduce",
                  "halving_doubling": "halving_doubling:allreduce",
                  "tree": "tree:allreduce_double_tree", "binomial": "tree:allreduce",
                  "hierarchical": "hierarchical:allreduce", "flat_ring": "ring:allreduce",
                  "oneshot": "oneshot:allreduce", "twoshot": "twoshot:allreduce", "cma": "cma:allreduce",
                  "mpi_native": "mpi_native:allreduce"},
    "broadcast": {"oneshot": "oneshot:broadcast", "tree": "tree:broadcast", "cma": "cma:broadcast",
                  "ring": "hierarchical:ring_broadcast",
                  "hierarchical": "hierarchical:broadcast", "mpi_native": "mpi_native:broadcast"},
    "reduce": {"oneshot": "oneshot:reduce", "tree": "tree:reduce", "mpi_native": "mpi_native:reduce"},
    "allgather": {"oneshot": "oneshot:allgather", "ring": "hierarchical:ring_allgather", "cma": "cma:allgather",
                  "recursive_doubling": "recursive_doubling:allgather",
                  "hierarchical": "hierarchical:allgather", "mpi_native": "mpi_native:allgather"},
    "reduce_scatter": {"ring": "hierarchical:ring_reduce_scatter",
                       "halving_doubling": "halving_doubling:reduce_scatter", "cma": "cma:reduce_scatter",
                       "mpi_native": "mpi_native:reduce_scatter"},
    "alltoall": {"pairwise": "pairwise:alltoall", "mpi_native": "mpi_native:alltoall"},
    "alltoallv": {"pairwise": "pairwise:alltoallv", "mpi_native": "mpi_native:alltoallv"},
    "gather": {"linear": "linear:gather", "mpi_native": "mpi_native:gather"},
    "scatter": {"linear": "linear:scatter", "mpi_native": "mpi_native:scatter"},
    "barrier": {"oneshot": "oneshot:barrier", "dissemination": "barrier:barrier", "mpi_native": "mpi_native:barrier"},
}
ALGORITHM_NAMES = frozenset({"ring", "tree", "halving_doubling", "recursive_doubling", "hierarchical",
                             "pairwise", "linear", "mpi_native", "binomial", "dissemination", "flat_ring",
                             "oneshot", "twoshot", "cma"})
# chosen only when named: MPI's own collectives, and the ring in plain rank order (for comparison)
NAMED_ONLY = frozenset({"mpi_native", "flat_ring"})
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
            # `^x` means every portable algorithm but x: NAMED_ONLY ones only ever when named
            chosen = impls - names - NAMED_ONLY if invert else impls & names
            if chosen or explicit:
                allowed[coll] = frozenset(chosen)
    return allowed


@functools.lru_cache(maxsize=None)
def resolve(collective: str, algorithm: str) -> Callable:
    """The function implementing `algorithm` for `collective`."""
    module, _, func = IMPLEMENTATIONS[collective][algorithm].partition(":")
    return getattr(importlib.import_module(f"pycoll.algorithms.{module}"), func)


class Selector:
    """Picks an algorithm per call: PYCOLL_ALGO restricts the choice; among the rest the tuner's cost
    model picks the cheapest for the communicator's topology, or (no tuner) default_order's size rule.
    `board_bytes` is what the communicator's board slot holds, for the size rule (default: the
    tuner's; 0: no board)."""

    def __init__(self, spec: Optional[str] = None, tuner: Optional[Tuner] = None,
                 board_bytes: Optional[int] = None) -> None:
        self.spec = (config.get("PYCOLL_ALGO") or "") if spec is None else spec
        self.allowed = parse_algo(self.spec)
        self.tuner = tuner
        self.board_bytes = board_bytes if board_bytes is not None else tuner.board_bytes if tuner else 0
        self._memo: Dict[Tuple[Any, ...], Tuple[str, Callable]] = {}
        self._calls: Dict[Tuple[Any, ...], Tuple[Topology, Callable]] = {}  # function()'s answers
        self._modeled: Dict[str, List[str]] = {}  # collective -> what the tuner chooses among
        for coll, algos in (MODELED.items() if tuner is not None else ()):
            named = coll in self.allowed
            allowed = self.allowed.get(coll, frozenset(IMPLEMENTATIONS[coll]))
            modeled = [a for a in algos if a in allowed and (named or a not in NAMED_ONLY)]
            if modeled and (not named or allowed <= set(modeled)):  # a named unmodeled one: size rule
                self._modeled[coll] = modeled

    def for_board(self, board_bytes: int, stage_bytes: int, peer_memory: bool = True) -> "Selector":
        """This selector (PYCOLL_ALGO and calibrated model) for a communicator with another board:
        a slot of `board_bytes` and a stage slot of `stage_bytes` (0: none), e.g. a split child, whose
        ranks can (`peer_memory`) or cannot reach each other's memory."""
        tuner = None if self.tuner is None else Tuner(self.tuner.params, board_bytes, stage_bytes, peer_memory)
        return Selector(self.spec, tuner, board_bytes)

    def choose(self, collective: str, nbytes: int, size: int, algo: Optional[str] = None,
               topo: Optional[Topology] = None) -> str:
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
        modeled = self._modeled.get(collective)
        if modeled and topo is not None and size > 1:
            return self._decide(collective, nbytes, topo, modeled)[0]
        for name in default_order(collective, nbytes, size, self.board_bytes):
            if name in allowed:
                return name
        return sorted(allowed)[0]

    def _decide(self, collective: str, nbytes: int, topo: Topology, candidates: List[str]) -> Tuple[str, Callable]:
        """(name, bound function), decided once per (collective, size class, host layout)."""
        size = size_class(nbytes)
        key = (collective, size, topo.layout)
        hit = self._memo.get(key)
        if hit is None:
            assert self.tuner is not None
            ranked = self.tuner.rank(collective, size, topo, candidates)
            name = ranked[0][1]
            if len(self._memo) > 4096:
                self._memo.clear()
            hit = self._memo[key] = (name, self.bind(collective, name, topo))
            info_log().info("%s of %d B on %d ranks / %d hosts: %s, predicted %.3f ms (%s)", collective, size,
                            topo.size, topo.nhosts, name, ranked[0][0] * 1e3,
                            ", ".join(f"{a} {t * 1e3:.3f}" for t, a in ranked[1:]))
        return hit

    def function(self, collective: str, nbytes: int, topo: Topology, algo: Optional[str] = None) -> Callable:
        """The function to run for one call: chosen, and bound to the topology where it needs one
        (remembered per exact call shape: the same answer costs a dict lookup on the hot path)."""
        key = (collective, nbytes, algo)
        hit = self._calls.get(key)
        if hit is not None and hit[0] is topo:  # (the topology kept beside the answer: another one misses)
            return hit[1]
        modeled = self._modeled.get(collective)
        if algo is None and modeled and topo.size > 1:
            fn = self._decide(collective, nbytes, topo, modeled)[1]
        else:
            fn = self.bind(collective, self.choose(collective, nbytes, topo.size, algo, topo), topo)
        if len(self._calls) > 4096:
            self._calls.clear()
        self._calls[key] = (topo, fn)
        return fn

    def phase(self, collective: str, nbytes: int, topo: Topology, streams: int) -> Callable:
        """A flat algorithm for one phase of a hierarchical one, with `streams` copies sharing each NIC."""
        if self.tuner is not None:
            name = self.tuner.best_phase(collective, nbytes, topo, streams)[0]
        else:
            name = next(a for a in default_order(collective, nbytes, topo.size, self.board_bytes)
                        if a in IMPLEMENTATIONS[collective] and a not in NAMED_ONLY | {"hierarchical"})
        return self.bind(collective, name, topo)

    def bind(self, collective: str, algorithm: str, topo: Topology) -> Callable:
        """resolve(), with topo= and selector= filled in for the topology-aware algorithms."""
        fn = resolve(collective, algorithm)
        if not IMPLEMENTATIONS[collective][algorithm].startswith("hierarchical:"):
            return fn
        bound = functools.partial(fn, topo=topo, selector=self)
        bound.accepts_src = getattr(fn, "accepts_src", False)  # type: ignore[attr-defined]
        return bound


def size_class(nbytes: int) -> int:
    """`nbytes` rounded up to one of four sizes per power of two: the tuner decides per class, so a
    program with many different sizes pays for a bounded number of decisions."""
    if nbytes <= 8:
        return nbytes
    step = 1 << ((nbytes - 1).bit_length() - 3)  # an eighth of the power of two at or above nbytes
    return -(-nbytes // step) * step  # 5/8, 6/8, 7/8 or 8/8 of that power of two


def default_order(collective: str, nbytes: int, size: int, board_bytes: int) -> List[str]:
    """Preference order by message size, MPICH/Open MPI style (the tuner refines it); one-shot where
    the data fits a board slot of `board_bytes` (0: the communicator has no board)."""
    pow2 = size & (size - 1) == 0
    board = board_bytes > 0
    if collective == "allreduce":
        if board and nbytes <= board_bytes:  # one post on the board
            return ["oneshot", "recursive_doubling", "halving_doubling", "ring", "tree", "binomial"]
        if nbytes <= (256 << 10):  # measured here (4 ranks, tcp): fewest steps win up to ~256 KiB
            return ["recursive_doubling", "halving_doubling", "ring", "tree", "binomial"]
        if nbytes <= (1 << 20) and pow2:
            return ["halving_doubling", "ring", "tree", "recursive_doubling", "binomial"]
        return ["ring", "halving_doubling", "tree", "recursive_doubling", "binomial"]
    if collective == "broadcast":
        small = ["oneshot"] if board and nbytes <= board_bytes else []
        return small + (["tree", "ring"] if nbytes <= (1 << 20) else ["ring", "tree"])
    if collective == "allgather":  # nbytes: the whole result; a board slot holds one rank's block
        small = ["oneshot"] if board and nbytes <= board_bytes * size else []
        return small + (["recursive_doubling", "ring"] if nbytes <= (64 << 10) else ["ring", "recursive_doubling"])
    if collective == "reduce":
        return (["oneshot"] if board and nbytes <= board_bytes else []) + ["tree"]
    if collective == "reduce_scatter":
        return ["halving_doubling", "ring"] if pow2 and nbytes <= (1 << 20) else ["ring", "halving_doubling"]
    return list(IMPLEMENTATIONS[collective])
