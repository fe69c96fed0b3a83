"""Rank/size discovery: explicit arguments, torchrun, Open MPI, PMI (MPICH/Hydra), Slurm, singleton."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional

from .. import config
from ..errors import EnvError
from .token import env_token

# (source name, rank variable, size variable, local rank variable, local size variable)
_LAUNCHERS = [
    ("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
    ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
     "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("pmi", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    ("slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"),
]
MPI_SOURCES = ("openmpi", "pmi")


@dataclass(frozen=True)
class JobEnv:
    """Where this process stands in the job, and how to reach the rendezvous store."""

    rank: int
    size: int
    source: str                      # args | torchrun | openmpi | pmi | slurm | singleton
    local_rank: Optional[int] = None
    local_size: Optional[int] = None
    master_addr: Optional[str] = None
    master_port: Optional[int] = None
    store_hosted: bool = False       # the launcher serves the store, so rank 0 must not
    store_port: Optional[int] = None  # PYCOLL_STORE_PORT: the launcher's store is there, not at master_port
    token: Optional[bytes] = None    # PYCOLL_JOB_TOKEN or _FILE, or agreed before the store (bootstrap/token.py)
    token_file: Optional[str] = None  # rank 0: the private token file to remove once every peer connected


def _int(env: Mapping[str, str], name: str, value: Optional[str] = None) -> int:
    raw = env[name] if value is None else value
    try:
        # Slurm writes SLURM_NTASKS_PER_NODE as e.g. "2(x3)": the leading count is ours
        return int(raw.split("(")[0].split(",")[0])
    except ValueError:
        raise EnvError(f"{name}={raw!r} is not an integer") from None


def discover(rank: Optional[int] = None, size: Optional[int] = None,
             env: Optional[Mapping[str, str]] = None) -> JobEnv:
    """Work out rank and size; a half-set pair or an out-of-range rank is an EnvError naming the variables."""
    env = os.environ if env is None else env
    if (rank is None) != (size is None):
        raise EnvError("pass both rank= and size= to pycoll.init, or neither")
    local_rank = local_size = None
    if rank is not None:
        source = "args"
    else:
        source = "singleton"
        for name, rvar, svar, lrvar, lsvar in _LAUNCHERS:
            have_r, have_s = rvar in env, svar in env
            if have_r != have_s:
                present, missing = (rvar, svar) if have_r else (svar, rvar)
                raise EnvError(f"{present} is set but {missing} is not: the {name} launcher "
                               f"variables must come as a pair (set both, or neither)")
            if have_r:
                source, rank, size = name, _int(env, rvar), _int(env, svar)
                local_rank = _int(env, lrvar) if lrvar in env else None
                local_size = _int(env, lsvar) if lsvar in env else None
                break
        else:
            rank, size = 0, 1
    assert rank is not None and size is not None
    if size < 1:
        raise EnvError(f"world size {size} (from {source}) must be at least 1")
    if not 0 <= rank < size:
        raise EnvError(f"rank {rank} (from {source}) is outside 0..{size - 1}")
    addr = env.get("MASTER_ADDR") or None
    port_raw = env.get("MASTER_PORT") or None
    if port_raw is not None and addr is None:
        raise EnvError("MASTER_PORT is set but MASTER_ADDR is not: set both (or neither under mpirun)")
    port = _int(env, "MASTER_PORT") if port_raw is not None else (29500 if addr else None)
    if port is not None and not 0 <= port < 65536:
        raise EnvError(f"MASTER_PORT={port} is not a TCP port")
    token = env_token(env)
    store_port = config.get("PYCOLL_STORE_PORT", env)
    if store_port is not None and addr is None:
        raise EnvError("PYCOLL_STORE_PORT is set but MASTER_ADDR is not: the launcher's store is at "
                       "MASTER_ADDR:PYCOLL_STORE_PORT")
    if size > 1 and addr is None and source not in MPI_SOURCES:
        raise EnvError(f"rank {rank} of {size} (from {source}) has no rendezvous: set MASTER_ADDR and "
                       "MASTER_PORT, pass store= to pycoll.init, or run under mpirun with mpi4py installed")
    return JobEnv(rank=rank, size=size, source=source, local_rank=local_rank, local_size=local_size,
                  master_addr=addr, master_port=port,
                  store_hosted=store_port is not None or config.get("PYCOLL_STORE_HOSTED", env),
                  store_port=store_port, token=token)
