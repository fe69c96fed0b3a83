"""Topology: which ranks share a host, their NUMA nodes, NICs and RDMA devices, and the link between
any two ranks (like `nvidia-smi topo -m`).

Each rank detects its own RankInfo at init and publishes it through the rendezvous store; every
rank then builds the same Topology. The host id is NCCL's hostHash recipe (hostname + boot id),
plus the network namespace, so ranks in different containers or namespaces count as different
hosts; PYCOLL_HOSTID overrides it. PYCOLL_TOPO_FILE (JSON) overrides any of it per rank:

    {"hosts": {"nodeA": [0, 2], "nodeB": [1, 3]},           # rank -> host, replaces detection
     "ranks": {"1": {"numa": 1, "nics": [{"name": "ib0", "speed": 100000}], "rdma": ["mlx5_0"]}},
     "links": {"net": {"latency_us": 20, "gbit": 100}},     # tuner parameters (no probe for them)
     "racks": {"r0": {"hosts": ["nodeA"], "uplink_gbit": 10},  # hosts (or "ranks") behind one switch,
               "r1": {"ranks": [1, 3], "uplink_gbit": 10}}}   # and the rate of its uplink (shared)

Racks make the host-ordered ring leave each rack once (racks in first-appearance order, hosts
grouped by rack), and the tuner charge the bytes crossing a rack's uplink at its rate (`uplinks`).
"""
from __future__ import annotations

import json
import os
import socket
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

from . import config
from .bootstrap.netif import list_interfaces
from .errors import EnvError

SYS_NET = "/sys/class/net"
SYS_IB = "/sys/class/infiniband"
SYS_NODE = "/sys/devices/system/node"
SYS_CPU = "/sys/devices/system/cpu"

SHM, NET = "shm", "net"  # link classes the tuner models: within a host, between hosts
# matrix labels, nearest first: self, same host and NUMA node, same host across NUMA nodes, network
SELF, NODE, SYS, NETWORK = "X", "NODE", "SYS", "NET"
LEGEND = {SELF: "self", NODE: "same host, same NUMA node (shm)",
          SYS: "same host, across NUMA nodes (shm)", NETWORK: "different hosts (network)"}


def host_id() -> str:
    """hostname + boot id + network namespace: ranks with the same value share a host (NCCL's hostHash)."""
    parts = [socket.gethostname()]
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            parts.append(fh.read().strip())
    except OSError:
        pass
    try:
        parts.append(str(os.stat("/proc/self/ns/net").st_ino))
    except OSError:
        pass
    return config.get("PYCOLL_HOSTID") or "/".join(parts)


@dataclass(frozen=True)
class Nic:
    """A usable network interface: its name, link speed in Mbit/s (None if the kernel does not say)
    and IPv4 address."""

    name: str
    speed: Optional[int] = None
    address: Optional[str] = None


@dataclass(frozen=True)
class RankInfo:
    """What one rank reports about where it runs."""

    host: str
    hostname: str = ""
    numa: int = -1
    nics: Tuple[Nic, ...] = ()
    rdma: Tuple[str, ...] = ()
    cores: int = 0  # CPUs the host has (0: unknown); ranks beyond that share cores
    rack: str = ""  # the rack (switch) its host hangs off, from PYCOLL_TOPO_FILE ("": none declared)
    uplink_gbit: float = 0.0  # that rack's uplink to the other racks, shared by its hosts (0: no limit)

    def to_json(self) -> str:
        """The store record of this rank."""
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "RankInfo":
        """Parse a store record (written by to_json)."""
        d = json.loads(text)
        return cls(host=d["host"], hostname=d.get("hostname", ""), numa=int(d.get("numa", -1)),
                   nics=tuple(Nic(n["name"], n.get("speed"), n.get("address")) for n in d.get("nics", ())),
                   rdma=tuple(d.get("rdma", ())), cores=int(d.get("cores", 0)), rack=str(d.get("rack", "")),
                   uplink_gbit=float(d.get("uplink_gbit", 0.0)))


def _read(path: str) -> Optional[str]:
    try:
        with open(path) as fh:
            return fh.read().strip()
    except OSError:
        return None


def _cpulist(text: str) -> List[int]:
    """'0-3,8,10-11' -> [0, 1, 2, 3, 8, 10, 11]."""
    cpus: List[int] = []
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


def last_level_cache() -> int:
    """Bytes of the largest (last-level) CPU cache the first CPU this process may run on has; 0 if
    sysfs does not say. Copies whose data outgrow it run at memory speed (the tuner's spill term)."""
    try:
        cpu = min(os.sched_getaffinity(0))
        names = os.listdir(f"{SYS_CPU}/cpu{cpu}/cache")
    except (OSError, AttributeError, ValueError):
        return 0
    best = 0
    for name in names:
        size = _read(f"{SYS_CPU}/cpu{cpu}/cache/{name}/size") or ""
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:], 1)
        digits = size.rstrip("KMG")
        if digits.isdigit():
            best = max(best, int(digits) * unit)
    return best


def numa_node() -> int:
    """The NUMA node of the first CPU this process may run on; -1 without NUMA information."""
    try:
        cpu = min(os.sched_getaffinity(0))
        nodes = sorted(n for n in os.listdir(SYS_NODE) if n.startswith("node") and n[4:].isdigit())
    except (OSError, AttributeError, ValueError):
        return -1
    for node in nodes:
        text = _read(f"{SYS_NODE}/{node}/cpulist")
        if text and cpu in _cpulist(text):
            return int(node[4:])
    return -1


def nics() -> List[Nic]:
    """Interfaces that are up and have an IPv4 address, loopback excluded, with their speed."""
    out = []
    for name, addr in list_interfaces():
        if name == "lo":
            continue
        raw = _read(f"{SYS_NET}/{name}/speed")
        speed = int(raw) if raw and raw.lstrip("-").isdigit() and int(raw) > 0 else None
        out.append(Nic(name, speed, addr))
    return out


def rdma_devices() -> List[str]:
    """RDMA device names (/sys/class/infiniband): mlx5_0, rxe0, ..."""
    try:
        return sorted(os.listdir(SYS_IB))
    except OSError:
        return []


def load_topo_file(path: Optional[str] = None) -> Dict[str, Any]:
    """PYCOLL_TOPO_FILE's contents ({} when unset); EnvError names the file and what is wrong."""
    path = path if path is not None else config.get("PYCOLL_TOPO_FILE")
    if not path:
        return {}
    try:
        with open(path) as fh:
            data = json.load(fh)
    except (OSError, ValueError) as e:
        raise EnvError(f"PYCOLL_TOPO_FILE={path!r} cannot be read as JSON: {e}") from None
    if not isinstance(data, dict) or set(data) - {"hosts", "ranks", "links", "racks"}:
        raise EnvError(f"PYCOLL_TOPO_FILE={path!r} must be a JSON object with keys among "
                       f"'hosts', 'ranks', 'links', 'racks'")
    hosts = data.get("hosts", {})
    if not isinstance(hosts, dict) or not all(isinstance(v, list) for v in hosts.values()):
        raise EnvError(f"PYCOLL_TOPO_FILE={path!r}: 'hosts' must map a host name to a list of ranks")
    seen = [r for ranks in hosts.values() for r in ranks]
    if len(seen) != len(set(seen)) or not all(isinstance(r, int) and r >= 0 for r in seen):
        raise EnvError(f"PYCOLL_TOPO_FILE={path!r}: 'hosts' lists a rank twice or a non-rank: {seen}")
    check_racks(data, f"PYCOLL_TOPO_FILE={path!r}")
    return data


def check_racks(spec: Dict[str, Any], where: str) -> None:
    """EnvError unless spec's "racks" maps a rack name to {"hosts": [names in "hosts"], "ranks": [ranks],
    "uplink_gbit": >= 0 (optional; 0: no limit)}, with no host or rank in two racks."""
    racks = spec.get("racks", {})
    if not isinstance(racks, dict):
        raise EnvError(f"{where}: 'racks' must map a rack name to {{'hosts': [...], 'ranks': [...], 'uplink_gbit': G}}")
    names = set(spec.get("hosts", {}))
    seen_hosts: List[str] = []
    seen_ranks: List[int] = []
    for rack, d in racks.items():
        if not isinstance(d, dict) or set(d) - {"hosts", "ranks", "uplink_gbit"} or not (d.get("hosts") or d.get("ranks")):
            raise EnvError(f"{where}: rack {rack!r} must be an object with 'hosts' and/or 'ranks' (and optionally "
                           f"'uplink_gbit'), got {d!r}")
        hosts, ranks = list(d.get("hosts", [])), list(d.get("ranks", []))
        if set(hosts) - names:
            raise EnvError(f"{where}: rack {rack!r} names hosts {sorted(set(hosts) - names)} that 'hosts' does not declare")
        if not all(isinstance(r, int) and r >= 0 for r in ranks):
            raise EnvError(f"{where}: rack {rack!r}: 'ranks' must be rank numbers, got {ranks}")
        gbit = d.get("uplink_gbit", 0)
        if not isinstance(gbit, (int, float)) or gbit < 0:
            raise EnvError(f"{where}: rack {rack!r}: 'uplink_gbit' must be a number >= 0 (0: no limit), got {gbit!r}")
        seen_hosts += hosts
        seen_ranks += ranks + [r for h in hosts for r in spec["hosts"][h]]
    if len(seen_hosts) != len(set(seen_hosts)) or len(seen_ranks) != len(set(seen_ranks)):
        raise EnvError(f"{where}: 'racks' puts a host or a rank in two racks")


def rack_of_rank(spec: Dict[str, Any], rank: int) -> Tuple[str, float]:
    """(rack name, its uplink Gbit/s) of `rank` in a topology file's "racks" (("", 0.0): in none)."""
    host = next((name for name, ranks in spec.get("hosts", {}).items() if rank in ranks), None)
    for rack, d in spec.get("racks", {}).items():
        if rank in d.get("ranks", []) or (host is not None and host in d.get("hosts", [])):
            return str(rack), float(d.get("uplink_gbit", 0.0))
    return "", 0.0


def detect(rank: int, topo_file: Optional[Dict[str, Any]] = None) -> RankInfo:
    """This rank's RankInfo: detected, then overridden by PYCOLL_TOPO_FILE's entries for `rank`."""
    spec = load_topo_file() if topo_file is None else topo_file
    host = next((name for name, ranks in spec.get("hosts", {}).items() if rank in ranks), None)
    over = spec.get("ranks", {}).get(str(rank), {})
    rack, uplink = rack_of_rank(spec, rank)
    nic_list = [Nic(n["name"], n.get("speed"), n.get("address")) for n in over["nics"]] \
        if "nics" in over else nics()
    return RankInfo(host=host or host_id(), hostname=socket.gethostname(),
                    numa=int(over.get("numa", numa_node())), nics=tuple(nic_list),
                    rdma=tuple(over.get("rdma", rdma_devices())), cores=int(over.get("cores", os.cpu_count() or 0)),
                    rack=rack, uplink_gbit=uplink)


class Uplinks(NamedTuple):
    """Racks' uplinks for the tuner: rack index of each host (-1: none), seconds per byte of each rack's
    uplink (0: not limited)."""

    rack_of: Tuple[int, ...]
    beta: Tuple[float, ...]


@dataclass
class Topology:
    """Every rank's RankInfo, and what follows: hosts, per-host ranks, link classes, ring order."""

    ranks: List[RankInfo]
    hosts: List[str] = field(init=False)         # distinct host ids, in order of first appearance
    host_of: List[int] = field(init=False)       # rank -> index into hosts
    members: List[List[int]] = field(init=False)  # host index -> its ranks, ascending
    racks: List[str] = field(init=False)         # distinct declared racks, in order of first appearance
    rack_of: List[int] = field(init=False)       # host index -> index into racks (-1: in no declared rack)
    layout: Tuple[Any, ...] = field(init=False)  # what algorithm choices depend on: host_of (and racks)

    def __post_init__(self) -> None:
        index: Dict[str, int] = {}
        self.host_of = [index.setdefault(info.host, len(index)) for info in self.ranks]
        self.hosts = list(index)
        self.members = [[r for r, h in enumerate(self.host_of) if h == i] for i in range(len(index))]
        rack_index: Dict[str, int] = {}
        self.rack_of = [rack_index.setdefault(self.ranks[m[0]].rack, len(rack_index)) if self.ranks[m[0]].rack
                        else -1 for m in self.members]
        self.racks = list(rack_index)
        self.layout = tuple(self.host_of)
        if self.racks:
            self.layout += (tuple(self.rack_of), tuple(self.uplink_gbit))

    @classmethod
    def from_hosts(cls, hosts: Sequence[Any], cores: int = 0) -> "Topology":
        """A topology that knows only which host each rank is on (hosts[r] is any label), and
        optionally how many cores every host has."""
        return cls([RankInfo(host=str(h), cores=cores) for h in hosts])

    @property
    def size(self) -> int:
        """Number of ranks."""
        return len(self.ranks)

    @property
    def nhosts(self) -> int:
        """Number of distinct hosts."""
        return len(self.hosts)

    @property
    def uniform(self) -> bool:
        """True when every host has the same number of ranks."""
        return len({len(m) for m in self.members}) == 1

    @property
    def cores(self) -> List[int]:
        """Cores per host index (the fewest any of its ranks reported; 0 when unknown)."""
        return [min(self.ranks[r].cores for r in m) for m in self.members]

    @property
    def per_host(self) -> int:
        """The most ranks any host has."""
        return max(len(m) for m in self.members)

    def local_index(self, rank: int) -> int:
        """`rank`'s position among the ranks of its host."""
        return self.members[self.host_of[rank]].index(rank)

    def link(self, a: int, b: int) -> str:
        """Matrix label of the path between ranks a and b: X, NODE, SYS or NET."""
        if a == b:
            return SELF
        if self.host_of[a] != self.host_of[b]:
            return NETWORK
        return NODE if self.ranks[a].numa == self.ranks[b].numa else SYS

    def link_class(self, a: int, b: int) -> str:
        """The tuner's class of the link between a and b: shm (same host) or net."""
        return SHM if self.host_of[a] == self.host_of[b] else NET

    @property
    def uplink_gbit(self) -> List[float]:
        """Per declared rack: the rate of its uplink (0: not limited); the fewest any of its ranks reported."""
        return [min(info.uplink_gbit for info in self.ranks if info.rack == rack) for rack in self.racks]

    @property
    def uplinks(self) -> Optional["Uplinks"]:
        """The racks' shared uplinks as the tuner charges them, None when no rack declares a rate."""
        rates = self.uplink_gbit
        if not any(rates):
            return None
        return Uplinks(tuple(self.rack_of), tuple(8e-9 / g if g else 0.0 for g in rates))

    def host_order(self) -> List[int]:
        """Host indices grouped by rack (racks and hosts in first-appearance order; a host in no
        declared rack is a group of its own): a ring over them crosses each rack's uplink once."""
        groups: Dict[Any, List[int]] = {}
        for h, k in enumerate(self.rack_of):
            groups.setdefault(k if k >= 0 else ("host", h), []).append(h)
        return [h for hosts in groups.values() for h in hosts]

    def ring_order(self) -> List[int]:
        """Ranks grouped by host, hosts grouped by rack, as NCCL orders its rings: the ring leaves
        each host once and each rack once, so one stream per host crosses the network and one
        per rack its uplink."""
        return [r for h in self.host_order() for r in self.members[h]]

    def subset(self, ranks: Sequence[int]) -> "Topology":
        """The topology of the ranks `ranks` (renumbered 0..len-1 in that order)."""
        return Topology([self.ranks[r] for r in ranks])

    def net_speed(self) -> Optional[int]:
        """The slowest usable NIC speed (Mbit/s) over the ranks that report one, None if none does."""
        speeds = [max(n.speed for n in info.nics if n.speed) for info in self.ranks
                  if any(n.speed for n in info.nics)]
        return min(speeds) if speeds else None

    def _rack_note(self, host: int) -> str:
        k = self.rack_of[host]
        if k < 0:
            return ""
        gbit = self.uplink_gbit[k]
        return f", rack {self.racks[k]}" + (f" (uplink {gbit:g} Gbit/s)" if gbit else "")

    def matrix(self) -> str:
        """A `nvidia-smi topo -m`-style table: the link between every pair of ranks, then each rank's
        host, NUMA node, NICs and RDMA devices, then the legend."""
        n = self.size
        width = max(5, len(str(n - 1)) + 2)
        head = " " * 6 + "".join(f"{'R' + str(c):>{width}}" for c in range(n))
        lines = [head + "   host  NUMA  NICs (Mbit/s)  RDMA"]
        for r, info in enumerate(self.ranks):
            cells = "".join(f"{self.link(r, c):>{width}}" for c in range(n))
            nic_text = ",".join(f"{x.name}({x.speed or '?'})" for x in info.nics) or "-"
            lines.append(f"{'R' + str(r):<6}{cells}   h{self.host_of[r]:<4} {info.numa:>4}  "
                         f"{nic_text}  {','.join(info.rdma) or '-'}")
        lines.append("")
        lines += [f"  h{i}: {hid} ({len(self.members[i])} ranks: {self.members[i]})" + self._rack_note(i)
                  for i, hid in enumerate(self.hosts)]
        lines.append("Legend:")
        lines += [f"  {k:<4} = {v}" for k, v in LEGEND.items()]
        return "\n".join(lines)
