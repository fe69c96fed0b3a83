"""pycoll: collective communication (allreduce and friends) for distributed training, in Python."""
from . import version
from .comm import ANY_SOURCE, Communicator, P2POp, P2PWork, Status
from .debug import MismatchError
from .errors import (EnvError, GrowError, JobEnded, PartitionError, PeerError, ProtocolError, PycollError,
                     RevokedError, StoreError, TimeoutError)
from .ops import AVG, BAND, BOR, BXOR, MAX, MIN, PROD, SUM, ReduceOp
from .trace.recorder import mark_step
from .work import Work
from .world import (allgather, allgatherv, allreduce, alltoall, alltoallv, barrier, broadcast,
                    default_comm, gather, init, join, recv, reduce, reduce_scatter, scatter, send)

__version__ = version.__version__

__all__ = [
    "ANY_SOURCE", "Communicator", "P2POp", "P2PWork", "Status", "MismatchError", "EnvError", "PeerError", "ProtocolError", "PycollError", "StoreError",
    "RevokedError", "PartitionError", "GrowError", "JobEnded",
    "TimeoutError", "ReduceOp", "Work", "SUM", "PROD", "MIN", "MAX", "AVG", "BAND", "BOR", "BXOR",
    "init", "join", "default_comm", "allreduce", "reduce", "reduce_scatter", "broadcast", "allgather",
    "allgatherv", "alltoall", "alltoallv", "gather", "scatter", "barrier", "send", "recv", "mark_step",
]
