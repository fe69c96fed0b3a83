"""Which transport `auto` uses for each pair of ranks: shm within a host, verbs between hosts whose
RDMA ports share a network, tcp otherwise.

At connect every rank of a job that spans hosts publishes an `Advert` in the store: its RDMA port
(device, port, GID and the network that GID lies on), or none with the reason (no RDMA device, no
pyverbs, PYCOLL_IB_DISABLE=1, the device could not be opened). Every rank reads every advert and
applies `choose` to each pair, so both ends of a pair, and every rank for every pair, decide the
same (the tuner prices each pair by that choice, and all ranks must pick the same algorithms).

Nothing here touches a device: this is the decision, given what the ranks advertised.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import List, Sequence

from .capabilities import Routes

SHM, VERBS, TCP = "shm", "verbs", "tcp"


@dataclass(frozen=True)
class Advert:
    """What a rank tells its peers about its RDMA port. `network` names the network the GID lies on
    ("roce-v2 10.9.0.0/24", "ib fe80:0000:0000:0000"): two ports with the same non-empty network
    reach each other; "" when it cannot be told (a link-local RoCE GID), and then auto does not use
    the port. `why` is empty for a usable port, else why this rank offers none (device is then "")."""

    device: str = ""
    port: int = 0
    gid: str = ""
    gid_index: int = 0
    link: str = ""     # "InfiniBand", "RoCE v2", "RoCE v1"
    network: str = ""
    why: str = ""

    @property
    def usable(self) -> bool:
        """A port auto may route over (an active port on a network it can name)."""
        return bool(self.device and self.network and not self.why)

    def describe(self) -> str:
        """'rxe0:1 RoCE v2, GID ::ffff:10.9.0.1, network 10.9.0.0/24', or the reason it has none."""
        if not self.device:
            return f"none ({self.why})"
        text = f"{self.device}:{self.port} {self.link}, GID index {self.gid_index} {self.gid}"
        if self.network:
            return text + f", network {self.network.split(' ', 1)[-1]}"
        return text + f" ({self.why or 'its network cannot be told'}: not used by auto)"

    def to_json(self) -> bytes:
        """The store record."""
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> "Advert":
        """Parse a store record; a record that is not one reads as no port (with the reason)."""
        try:
            d = json.loads(raw)
            return cls(str(d["device"]), int(d["port"]), str(d["gid"]), int(d["gid_index"]), str(d["link"]),
                       str(d["network"]), str(d["why"]))
        except (ValueError, KeyError, TypeError) as e:
            return cls(why=f"unreadable RDMA advert ({e}): is every rank running the same pycoll?")


def none(why: str) -> Advert:
    """The advert of a rank that offers no RDMA port, saying why."""
    return Advert(why=why)


def choose(same_host: bool, a: Advert, b: Advert) -> str:
    """The transport of one pair: shm on one host, verbs when both advertise a usable port on the
    same network, else tcp. Symmetric in a and b, so both ends agree."""
    if same_host:
        return SHM
    if a.usable and b.usable and a.network == b.network:
        return VERBS
    return TCP


def matrix(hosts: Sequence[str], adverts: Sequence[Advert]) -> List[List[str]]:
    """choose() for every pair (the diagonal is "self")."""
    n = len(hosts)
    return [["self" if i == j else choose(hosts[i] == hosts[j], adverts[i], adverts[j]) for j in range(n)]
            for i in range(n)]


class PairRoutes(Routes):
    """The Routes capability of `auto`: every pair's transport and every rank's advert."""

    def __init__(self, hosts: Sequence[str], adverts: Sequence[Advert]) -> None:
        self.hosts = list(hosts)
        self.adverts = list(adverts)
        self._matrix = matrix(self.hosts, self.adverts)

    def wire(self, a: int, b: int) -> str:
        return self._matrix[a][b]

    def port(self, rank: int) -> str:
        return self.adverts[rank].describe()

