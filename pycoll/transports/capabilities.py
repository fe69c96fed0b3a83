"""What a transport offers beyond tagged point-to-point, declared as typed objects.

Layers above ask `transport.offers(Kind)` and get an instance of Kind or None, instead of probing
for attributes. A capability speaks in ranks, bytes and lanes; what a board post means (which
collective, op or root) is the algorithm layer's business and travels as an opaque signature.
"""
from __future__ import annotations

import mmap
from abc import ABC, abstractmethod
from typing import Any, Callable, ContextManager, Dict, List, Optional, Sequence, Tuple

import numpy as np


class Capability:
    """Base of everything a transport can offer; `Transport.offers(kind)` looks one up by class."""


class SinkReceive(Capability):
    """irecv(..., sink=f) hands a payload to f(piece, offset) straight from the transport's own
    buffer (a ring, a stream buffer, a landing zone), so a reduction can read it without a copy."""


class Routes(Capability, ABC):
    """Which transport carries each pair of ranks (`auto`: shm, verbs or tcp, decided at connect the
    same way on every rank), for the tuner's link prices and `pycoll info`."""

    @abstractmethod
    def wire(self, a: int, b: int) -> str:
        """The transport between transport ranks a and b ("shm", "verbs", "tcp"; "self" when a == b)."""

    @abstractmethod
    def port(self, rank: int) -> str:
        """Rank `rank`'s RDMA port as it advertised it, or why it offers none."""


class Striping(Capability, ABC):
    """Large payloads cut over several TCP streams per pair of ranks (NCCL_NSOCKS_PERTHREAD): where
    the network caps each flow below the link rate, k streams move up to k flows' worth. The
    streams are opened at connect (PYCOLL_NSOCKS); how many a payload is cut over can change
    between calls (each payload's announcement says how it was cut)."""

    automatic: bool  # PYCOLL_NSOCKS=auto: the tuner picks the width; else the user fixed it

    @abstractmethod
    def streams(self, peer: int) -> int:
        """Streams open to `peer` (1: its payloads go whole)."""

    @abstractmethod
    def width(self) -> int:
        """How many streams large payloads are cut over now (to peers that have that many)."""

    @abstractmethod
    def use(self, streams: int) -> None:
        """Cut large payloads over `streams` streams from now on (at most what each peer has)."""


class Board(ABC):
    """One communicator's slots in memory its ranks share: each call, every member posts a flat array
    and reads everyone's (see transports/shm_board.py for the protocol)."""

    slot_bytes: int   # what a small slot holds
    stage_bytes: int  # what a stage slot holds (0: no stage)

    @abstractmethod
    def exchange(self, data: np.ndarray, sig: int, order: Sequence[int], timeout: float, what: object,
                 stage: bool = False, hole: Tuple[int, int] = (0, 0)) -> List[np.ndarray]:
        """Post `data` with the opaque 64-bit signature `sig`, wait for every member's post of this
        call, and return the members' arrays in `order`; ProtocolError if a member posted another
        byte count or signature. The elements [hole[0], hole[1]) of `data` are not copied: the slot
        holds there whatever its owner writes into it (through the view this call returns)."""

    def prepare(self, data: np.ndarray, sig: int, order: Sequence[int], stage: bool = False,
                hole: Tuple[int, int] = (0, 0)) -> Optional[Callable[[float, object], List[np.ndarray]]]:
        """exchange() made ready for calls again and again on this same `data` (a persistent handle's):
        `go(timeout, what)` runs it; None where the board cannot (then exchange() each time)."""
        return None


class SharedBoard(Capability, ABC):
    """Shared-memory boards for communicators whose ranks all share this host's memory. Opening one
    takes two steps, so that the agreement between ranks stays above the transport: each member
    claims a lane locally, the members exchange their lane numbers, and each opens the board."""

    slot_bytes: int
    stage_bytes: int

    @abstractmethod
    def reaches(self, members: Sequence[int]) -> bool:
        """True if every one of `members` (global ranks) shares a board with this rank."""

    @abstractmethod
    def claim_lane(self, comm_id: int) -> int:
        """A lane of this rank's own board for communicator `comm_id`; -1 when none is left."""

    @abstractmethod
    def open(self, comm_id: int, members: Sequence[int], lanes: Dict[int, int]) -> Board:
        """The board of communicator `comm_id`, given every member's claimed lane (all >= 0)."""


class MpiCommunicators(Capability, ABC):
    """MPI communicators mirroring pycoll's, for running MPI's own collectives (algorithm mpi_native)."""

    @abstractmethod
    def comm_for(self, group: Sequence[int], comm_id: int) -> Any:
        """The MPI communicator whose rank i is world rank group[i] (made on first use by the group)."""

    @abstractmethod
    def serialized(self) -> ContextManager[Any]:
        """The context any other MPI call of this process must run in (the transport's lock, unless
        MPI provides MPI_THREAD_MULTIPLE)."""


class SharedMemory(Capability, ABC):
    """Memory a rank allocates that its same-host peers map as well (NCCL's window registration,
    torch's SymmetricMemory): the rank `allocate`s it and gets a handle, the peers `attach` by that
    handle, then the owner `seal`s it (closes what they found it by). Nothing has a name in the file
    system, so nothing outlives the processes that map it, kill -9 included. The agreement (who
    allocates what, when everyone has attached) is the layers above's business."""

    @abstractmethod
    def reaches(self, members: Sequence[int]) -> bool:
        """True if every one of `members` (global ranks) can map this rank's memory and it theirs."""

    @abstractmethod
    def allocate(self, nbytes: int) -> Tuple[mmap.mmap, int]:
        """`nbytes` of zeroed shared memory, all of it allocated now (mapped here), and its handle."""

    @abstractmethod
    def attach(self, owner: int, handle: int, nbytes: int) -> mmap.mmap:
        """Map the `nbytes` that rank `owner` allocated under `handle` (before it sealed them)."""

    @abstractmethod
    def seal(self, handle: int) -> None:
        """Every peer has attached the memory of `handle`: close what they found it by."""


class PeerMemory(Capability, ABC):
    """Copies in one step between this process's memory and a same-host peer's ordinary memory
    (Linux cross-memory attach, process_vm_readv/writev: Open MPI's single-copy path), so that a
    collective reads a peer's array where it lies instead of through a stage. Addresses are the
    peer's own; which ones may be touched, and when, is the layers above's agreement."""

    @abstractmethod
    def reaches(self, members: Sequence[int]) -> bool:
        """True if this rank can read and write the memory of every one of `members` (global ranks):
        probed once per peer, since the kernel may refuse (ptrace rules, seccomp)."""

    @abstractmethod
    def read(self, peer: int, address: int, into: np.ndarray) -> None:
        """Copy into.nbytes bytes at `address` in rank `peer`'s memory into the C-contiguous `into`."""

    @abstractmethod
    def write(self, peer: int, address: int, data: np.ndarray) -> None:
        """Copy the C-contiguous `data` to `address` in rank `peer`'s memory."""
