"""Where the tuner's parameters come from: built-in defaults, PYCOLL_TOPO_FILE "links", a cache of
earlier measurements, or a short probe of the links at init (PYCOLL_TUNER).

Calibration (PYCOLL_TUNER=probe, the default): one pair of ranks per link class ping-pongs small and
1 MiB messages (between hosts, where tcp opened several streams per pair (PYCOLL_NSOCKS=auto),
2 MiB over one stream and cut over all of them, alternately: the flow and the link; pick_streams
then sets how many streams large payloads use); every rank times numpy reductions; an allgather
gives all ranks the same numbers, so all make the same choices. Results are cached per (transport, host pair) in PYCOLL_TUNER_CACHE
(default ~/.cache/pycoll/tuner, `off` disables) for a day, keyed also by the package version and the
cost model's code, so numbers measured by other code are never reused. PYCOLL_TUNER=model uses
built-in constants (and PYCOLL_TOPO_FILE "links"), =static the size rules of
selection.default_order; setting PYCOLL_ALGO skips the probe.

Where the transport reaches some pairs of hosts over verbs (auto, capabilities.Routes), those pairs
are a link class of their own (tuner.RDMA): the first such pair of hosts ping-pongs like the net
pair does, and the tcp pairs keep the net link (probed on the first of them).
"""
from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import tempfile
import time
from dataclasses import replace
from typing import Callable, Dict, FrozenSet, List, Optional, Sequence, Tuple

import numpy as np

from . import config, tuner
from .algorithms.recursive_doubling import allgather
from .channel import Channel
from .errors import EnvError
from .topology import NET, SHM, Topology, last_level_cache, load_topo_file
from .transports.capabilities import Routes, Striping
from .tuner import DEFAULT, DEFAULT_RDMA, RDMA, Link, Params, Tuner, info_log, pick_streams
from .version import __version__

CACHE_TTL = 24 * 3600.0
PROBE_BIG = 1 << 20
PROBE_STRIPED = 2 << 20  # one stream against all of them: 4 parts of PYCOLL_TCP_STRIPE_MIN's default
PROBE_SMALL_REPS, PROBE_BIG_REPS = 8, 3
BETA_FLOOR = 1 / 25e9  # no link is taken to be faster than 25 GB/s
# a best 8-byte shm round trip of over 2 ms is the scheduler, not the link (10-60 us here, 2-8 ranks)
SHM_ALPHA_MAX = 1e-3
FLOW = "flow"  # one stream between hosts, measured with the net link
COLUMNS = {SHM: (0, 1), NET: (2, 3), FLOW: (5, 6), RDMA: (10, 11)}  # each link's alpha and beta (Params.row(), then rdma)
CACHE, SPILL = 7, 8  # the columns of a host's last-level cache and the measured spill (Params.row())
STREAMS = 9  # the calibration table's column of streams the net pair holds (after Params.row())
WIDTH = 12
SPILL_CAP = 128 << 20  # the spill probe copies at most this much (twice the cache in all, up to 256 MiB)


def mode() -> str:
    """PYCOLL_TUNER: probe (default), model or static; EnvError for anything else."""
    return config.get("PYCOLL_TUNER")


def file_links(topo_file: Optional[Dict] = None) -> Dict[str, Link]:
    """Link parameters declared in PYCOLL_TOPO_FILE's "links" ({"net": {"latency_us", "gbit"}}; also
    "shm", and "rdma" for the pairs of hosts reached over verbs)."""
    spec = load_topo_file() if topo_file is None else topo_file
    out = {}
    for cls, d in spec.get("links", {}).items():
        if cls not in (SHM, NET, RDMA) or not isinstance(d, dict) or not {"latency_us", "gbit"} <= set(d):
            raise EnvError(f"PYCOLL_TOPO_FILE links: {cls!r} must be 'shm', 'net' or 'rdma' with latency_us and gbit")
        out[cls] = Link(float(d["latency_us"]) * 1e-6, 8e-9 / float(d["gbit"]))
    return out


def base_params(topo: Topology) -> Params:
    """DEFAULT, with the net beta from the slowest NIC speed and any links PYCOLL_TOPO_FILE declares."""
    params = DEFAULT
    speed = topo.net_speed()
    if speed:
        params = replace(params, net=Link(params.net.alpha, 8 / (speed * 1e6)))
    links = file_links()
    if links:
        params = replace(params, shm=links.get(SHM, params.shm), net=links.get(NET, params.net), source="file")
    return params


def cache_dir() -> Optional[str]:
    """PYCOLL_TUNER_CACHE (default ~/.cache/pycoll/tuner); None when it is off."""
    path = config.get("PYCOLL_TUNER_CACHE")
    return None if path.lower() in ("0", "off", "none") else path


@functools.lru_cache(maxsize=None)
def code_version() -> str:
    """The package version and a hash of the cost model's and the calibration's source: part of
    every cache key, so that measurements made by other code are never reused."""
    digest = hashlib.sha256()
    for path in (tuner.__file__, __file__):
        with open(path, "rb") as fh:
            digest.update(fh.read())
    return f"{__version__}/{digest.hexdigest()[:16]}"


def _cache_entry(key: str) -> Tuple[Optional[str], str]:
    """The file that holds `key`'s measurement (None: the cache is off) and the key stored in it."""
    full = f"{code_version()}|{key}"
    root = cache_dir()
    return None if root is None else os.path.join(root, hashlib.sha1(full.encode()).hexdigest() + ".json"), full


def cache_get(key: str) -> Optional[Link]:
    """A cached link measurement younger than CACHE_TTL, else None."""
    got = cache_read(key)
    return Link(got["alpha"], got["beta"]) if got is not None and {"alpha", "beta"} <= got.keys() else None


def cache_put(key: str, link: Link) -> None:
    """Store a link measurement (cache_write)."""
    cache_write(key, alpha=link.alpha, beta=link.beta)


def cache_read(key: str) -> Optional[Dict[str, float]]:
    """The numbers cached under `key` if younger than CACHE_TTL, else None."""
    path, full = _cache_entry(key)
    try:
        with open(path) as fh:  # type: ignore[arg-type]
            d = json.load(fh)
        if d["key"] == full and time.time() - d["time"] < CACHE_TTL:
            return {k: float(v) for k, v in d.items() if k not in ("key", "time")}
    except (OSError, TypeError, ValueError, KeyError):
        pass
    return None


def cache_write(key: str, **values: float) -> None:
    """Store measured numbers under `key` (atomically; a cache that cannot be written is skipped)."""
    path, full = _cache_entry(key)
    if path is None:
        return
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path))
        with os.fdopen(fd, "w") as fh:
            json.dump({"key": full, **values, "time": time.time()}, fh)
        os.replace(tmp, path)
    except OSError:
        pass


def spill_probe(key: str) -> Tuple[float, float]:
    """(this host's last-level cache in bytes, measure_spill of it): cached under `key` while the
    cache size is the same, else measured (about 20 ms) and cached."""
    cache_bytes = float(last_level_cache())
    got = cache_read(key)
    if got is None or got.get("cache") != cache_bytes or "spill" not in got:
        got = {"cache": cache_bytes, "spill": measure_spill(int(cache_bytes))}
        cache_write(key, **got)
    return got["cache"], got["spill"]


Wire = Callable[[int, int], str]  # the transport ("shm", "verbs", "tcp") between two ranks


def probe_pairs(topo: Topology, wire: Optional[Wire] = None) -> Dict[str, Tuple[int, int]]:
    """The ranks that measure each link class: two ranks of the first host with two, and the first
    ranks of the first two hosts; where `wire` says some pairs of hosts talk over verbs, the first
    ranks of the first such pair of hosts measure rdma, and of the first other pair, net."""
    pairs = {}
    shared = next((m for m in topo.members if len(m) > 1), None)
    if shared:
        pairs[SHM] = (shared[0], shared[1])
    for i in range(topo.nhosts):
        for j in range(i + 1, topo.nhosts):
            a, b = topo.members[i][0], topo.members[j][0]
            cls = RDMA if wire is not None and wire(a, b) == "verbs" else NET
            pairs.setdefault(cls, (a, b))
    return pairs


def rdma_hosts(topo: Topology, wire: Optional[Wire]) -> FrozenSet[Tuple[str, str]]:
    """The pairs of host ids (sorted) whose first ranks talk over verbs (Params.rdma_hosts)."""
    if wire is None:
        return frozenset()
    return frozenset(tuple(sorted((topo.hosts[i], topo.hosts[j]))) for i in range(topo.nhosts)
                     for j in range(i + 1, topo.nhosts) if wire(topo.members[i][0], topo.members[j][0]) == "verbs")


def wire_of(ch: Channel) -> Optional[Wire]:
    """What carries each pair of the channel's ranks, where the transport says (auto's Routes)."""
    routes = ch.transport.offers(Routes)
    if routes is None:
        return None
    group = ch.group
    return lambda a, b: routes.wire(group[a], group[b])


def measure_gamma() -> float:
    """Seconds per byte of a float32 numpy reduction (best of a few 256 KiB adds)."""
    a = np.ones(1 << 16, np.float32)
    b = np.ones_like(a)
    best = math.inf
    for _ in range(4):
        t = time.perf_counter()
        np.add(a, b, out=a)
        best = min(best, time.perf_counter() - t)
    return max(best / a.nbytes, 1e-12)


def measure_spill(cache_bytes: int) -> float:
    """How many times slower (best of a few each) a copy runs whose source and destination fill
    twice the last-level cache than a 1 MiB one in cache: the tuner's price for calls whose data
    outgrow the cache (Params.spill_factor). 1.0 when the cache size is unknown."""
    if cache_bytes <= 0:
        return 1.0
    out = []
    for nbytes, reps in ((PROBE_BIG, 8), (min(cache_bytes, SPILL_CAP), 5)):
        src = np.ones(nbytes // 8, np.float64)  # writes every page: no first-touch faults while timing
        dst = np.zeros_like(src)
        dst += 1.0  # (zeros may come from calloc's untouched pages)
        best = math.inf
        for _ in range(reps):
            t = time.perf_counter()
            np.copyto(dst, src)
            best = min(best, time.perf_counter() - t)
        out.append(best / src.nbytes)
    return max(1.0, out[1] / out[0])


def ping_pong(ch: Channel, me: int, peer: int, tag: int, big_bytes: int = PROBE_BIG) -> Optional[Link]:
    """Measure the link to `peer`: the lower rank of the pair times, the other echoes. alpha is half
    the best 8-byte round trip, beta what a `big_bytes` message adds to the best one (at most
    BETA_FLOOR's rate: on a busy machine the difference of two minima can come out near zero)."""
    links = ping_pong_widths(ch, me, peer, tag, big_bytes, (0,), None)
    return None if links is None else links[0]


def ping_pong_widths(ch: Channel, me: int, peer: int, tag: int, big_bytes: int, widths: Sequence[int],
                     striping: Optional[Striping]) -> Optional[List[Link]]:
    """ping_pong, with the big messages cut over each of `widths` streams in turn (0: as the
    transport stands), set on `striping` by the lead, who sends them: a Link per width (None on the
    echoing rank). The widths alternate, so a noisy moment on a busy machine hits them all alike."""
    small, big = np.zeros(1, np.float64), np.zeros(big_bytes // 8, np.float64)
    lead = me < peer
    best: Dict[Tuple[int, int], float] = {}
    plan = [(small, 0)] * (PROBE_SMALL_REPS + 1) + [(big, w) for _ in range(PROBE_BIG_REPS + 1) for w in widths]
    for i, (payload, width) in enumerate(plan):
        if lead and width and striping is not None:
            striping.use(width)
        t = time.perf_counter()
        if lead:
            ch.wait(ch.isend(payload, peer, tag + i))
            ch.wait(ch.irecv(small, peer, tag + i))
        else:
            ch.wait(ch.irecv(payload, peer, tag + i))
            ch.wait(ch.isend(small, peer, tag + i))
        key = (payload.nbytes, width)
        if key in best:  # the first of each kind warms up
            best[key] = min(best[key], time.perf_counter() - t)
        else:
            best[key] = math.inf
    if not lead:
        return None
    rtt = best[(small.nbytes, 0)]
    return [Link(rtt / 2, max((best[(big.nbytes, w)] - rtt) / big.nbytes, BETA_FLOOR)) for w in widths]


def plausible(cls: str, link: Link, base: Link) -> Optional[Link]:
    """None if the probe of `cls` cannot have measured the link: over shm, an alpha above
    SHM_ALPHA_MAX means neither rank of the pair got a core for the whole probe (a busy machine).
    Kept, such a probe made a whole job run binomial for 16-64 MiB (fewest messages wins when a
    message seems to cost milliseconds), 2.6x slower than two-shot."""
    if cls == SHM and link.alpha > SHM_ALPHA_MAX:
        tuner.log.warning("pycoll: the shm probe measured %.0f us per message, which is this machine's "
                          "scheduling, not its memory; the tuner uses the default %.0f us instead",
                          link.alpha * 1e6, base.alpha * 1e6)
        return None
    return link


def probe_net(ch: Channel, me: int, peer: int, tag: int, striping: Optional[Striping]
              ) -> Tuple[Optional[Link], Optional[Link]]:
    """(link, one flow) between two hosts, measured by the lead of the pair (None, None on the other
    rank). With several streams to `peer`, 2 MiB over one stream and over all of them, alternately
    (both ranks of the pair run the same steps); else one measurement serves as both."""
    streams = striping.streams(peer) if striping is not None else 1
    if streams <= 1:
        link = ping_pong(ch, me, peer, tag)
        return link, link
    width = striping.width()  # type: ignore[union-attr]
    try:
        links = ping_pong_widths(ch, me, peer, tag, PROBE_STRIPED, (1, streams), striping)
    finally:
        striping.use(width)  # type: ignore[union-attr]
    return (None, None) if links is None else (links[1], links[0])


def calibrate(make_channel: Callable[[int], Channel], rank: int, topo: Topology, transport: str,
              base: Params) -> Params:
    """Agree on Params across all ranks: cached or PYCOLL_TOPO_FILE values where present, probed
    where not. `make_channel(seq)` gives a Channel on the tuner's own communicator id."""
    first = make_channel(1)
    pairs = probe_pairs(topo, wire_of(first))
    declared = file_links()
    keys = {cls: f"{transport}|{cls}|{topo.ranks[a].host}|{topo.ranks[b].host}" for cls, (a, b) in pairs.items()}
    striping = first.transport.offers(Striping)
    mine = np.full(WIDTH, np.nan)
    mine[4] = measure_gamma()
    if SHM in pairs and rank == pairs[SHM][0]:  # the spill matters where ranks share a host's cache
        mine[[CACHE, SPILL]] = spill_probe(f"{transport}|mem|{topo.ranks[rank].host}")
    for cls, (a, b) in pairs.items():
        links: List[Optional[Link]] = [declared.get(cls) or (cache_get(keys[cls]) if rank == a else None)]
        if cls == NET:
            links.append(links[0] if cls in declared else cache_get(keys[cls] + "|" + FLOW) if rank == a else None)
        if all(link is not None for link in links):
            for c, link in zip((cls, FLOW), links):
                mine[list(COLUMNS[c])] = (link.alpha, link.beta)  # type: ignore[union-attr]
        if cls == NET and rank == a:
            mine[STREAMS] = striping.streams(b) if striping is not None else 1
    table = np.empty((topo.size, WIDTH))
    allgather(first, mine, table.reshape(-1), None)
    missing = [cls for cls in pairs if np.isnan(table[:, COLUMNS[cls][0]]).all()]
    source = "probe" if missing else ("file" if declared else "cache")
    if missing:
        ch = make_channel(2)
        for k, cls in enumerate(missing):
            a, b = pairs[cls]
            if rank not in (a, b):
                continue
            peer = b if rank == a else a
            if cls == NET:
                link, flow = probe_net(ch, rank, peer, 100 * k, striping)
            else:
                link = flow = ping_pong(ch, rank, peer, 100 * k)
                if link is not None:
                    link = flow = plausible(cls, link, base.shm)  # None: the default stays, nothing cached
            if link is not None and flow is not None:
                cache_put(keys[cls], link)
                mine[list(COLUMNS[cls])] = (link.alpha, link.beta)
                if cls == NET:
                    cache_put(keys[cls] + "|" + FLOW, flow)
                    mine[list(COLUMNS[FLOW])] = (flow.alpha, flow.beta)
        allgather(make_channel(3), mine, table.reshape(-1), None)
    row = base.row()
    if np.isnan(table[:, COLUMNS[FLOW][0]]).all():  # nothing measured between hosts: a flow is the link
        table[:, list(COLUMNS[FLOW])] = table[:, list(COLUMNS[NET])]
    for col in range(STREAMS):
        got = table[:, col][~np.isnan(table[:, col])]
        if got.size:
            row[col] = float(got.max())
    params = replace(Params.from_row(row, source), rdma=base.rdma, rdma_hosts=base.rdma_hosts)
    if not np.isnan(table[:, COLUMNS[RDMA][0]]).all():
        params = replace(params, rdma=Link(*(float(np.nanmax(table[:, c])) for c in COLUMNS[RDMA])))
    streams = table[:, STREAMS][~np.isnan(table[:, STREAMS])]
    return replace(params, nsocks=pick_streams(params, int(streams.max()) if streams.size else 1))


def for_communicator(make_channel: Callable[[int], Channel], rank: int, topo: Topology,
                     transport: str, board_bytes: int = 0, stage_bytes: int = 0,
                     peer_memory: bool = True) -> Optional[Tuner]:
    """A communicator's tuner (Communicator.calibrate, at init for the world): None (static rules)
    under PYCOLL_TUNER=static; else the model, probed unless PYCOLL_TUNER=model or PYCOLL_ALGO is set."""
    how = mode()
    if how == "static":
        return None
    params = base_params(topo)
    over_verbs = rdma_hosts(topo, wire_of(make_channel(0)))
    if over_verbs:
        params = replace(params, rdma=file_links().get(RDMA, DEFAULT_RDMA), rdma_hosts=over_verbs)
    if how == "probe" and topo.size > 1 and not config.get("PYCOLL_ALGO"):
        t = time.perf_counter()
        params = calibrate(make_channel, rank, topo, transport, params)
        info_log().info("rank %d: tuner calibrated in %.0f ms (%s): shm %s, net %s, one stream %s, %d stream(s) "
                        "per payload, copies %.2gx slower beyond %.0f MiB of cache%s", rank,
                        (time.perf_counter() - t) * 1e3, params.source, params.shm.describe(),
                        params.net.describe(), params.flow_link().describe(), params.nsocks, params.spill,
                        params.cache / (1 << 20), f"; rdma {params.rdma.describe()} between "
                        f"{len(params.rdma_hosts)} pair(s) of hosts" if params.rdma_hosts else "")
    return Tuner(settle_streams(make_channel(4).transport.offers(Striping), params), board_bytes, stage_bytes,
                 peer_memory)


def settle_streams(striping: Optional[Striping], params: Params) -> Params:
    """Set the transport's stripe width (PYCOLL_NSOCKS=auto: the calibration's pick, params.nsocks;
    a fixed PYCOLL_NSOCKS stays) and return params with the width in use, for the model."""
    if striping is None:
        return params
    if striping.automatic:  # every rank keeps the agreed pick in its model, whatever its own streams allow
        striping.use(params.nsocks)
        return params
    return replace(params, nsocks=striping.width())
