"""Every PYCOLL_* environment variable, declared once: its kind, default, accepted values and meaning.

The package reads them only through get(), when the object that needs one is built, so a process
that sets the environment before that sees its value. pycoll.init() calls load() first, so a bad
value fails there, naming the variable and what it accepts. The README's environment tables are
generated from REGISTRY (`pycoll env --readme README.md` rewrites them).
"""
from __future__ import annotations

import difflib
import logging
import math
import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional

from .errors import EnvError

log = logging.getLogger("pycoll.config")


@dataclass(frozen=True)
class Kind:
    """How a variable's text becomes its value; `convert` raises ValueError for text outside `accepts`."""

    convert: Callable[[str], Any]
    accepts: str


def integer(low: int = 0, high: Optional[int] = None) -> Kind:
    """A whole number in [low, high]."""
    def convert(text: str) -> int:
        value = int(text)
        if value < low or (high is not None and value > high):
            raise ValueError(text)
        return value
    return Kind(convert, f"an integer >= {low}" if high is None else f"an integer from {low} to {high}")


_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def size(low: int = 0, unlimited: bool = False) -> Kind:
    """A byte count >= low, with an optional K, M or G suffix (binary units); `inf` too if `unlimited`."""
    def convert(text: str) -> float:
        text = text.strip().upper()
        if unlimited and text == "INF":
            return math.inf
        match = re.fullmatch(r"(\d+)\s*(?:([KMG])I?)?B?", text)
        value = int(match[1]) * _UNITS[match[2] or ""] if match else -1
        if value < low:
            raise ValueError(text)
        return value
    return Kind(convert, f"a byte count >= {low} (K, M, G suffixes allowed){', or inf' if unlimited else ''}")


def number(positive: bool = True) -> Kind:
    """A finite number, > 0 or (positive=False) >= 0."""
    def convert(text: str) -> float:
        value = float(text)
        if not math.isfinite(value) or value < 0 or (positive and value == 0):
            raise ValueError(text)
        return value
    return Kind(convert, "a number > 0" if positive else "a number >= 0")


def one_of(*choices: str) -> Kind:
    """One of `choices`, matched without regard to case or surrounding blanks; returns its spelling there."""
    canonical = {c.lower(): c for c in choices}

    def convert(text: str) -> str:
        try:
            return canonical[text.strip().lower()]
        except KeyError:
            raise ValueError(text) from None
    return Kind(convert, "one of " + ", ".join(choices))


def auto_or(kind: Kind) -> Kind:
    """`auto` (returned as "auto"), or a value of `kind`."""
    def convert(text: str) -> Any:
        return "auto" if text.strip().lower() == "auto" else kind.convert(text)
    return Kind(convert, f"auto, or {kind.accepts}")


def _flag(text: str) -> bool:
    if text.strip() not in ("0", "1"):
        raise ValueError(text)
    return text.strip() == "1"


TEXT = Kind(str, "text")
def _congestion(text: str) -> str:
    """auto, system, or a congestion control's name as the kernel spells them (lower case, digits, _)."""
    name = text.strip().lower()
    if not re.fullmatch(r"[a-z0-9_]{1,15}", name):
        raise ValueError(text)
    return name


PATH = Kind(os.path.expanduser, "a path")
HEX = Kind(bytes.fromhex, "hex digits")
FLAG = Kind(_flag, "0 or 1")


@dataclass(frozen=True)
class Var:
    """One variable. `default` is text, parsed like a set value; None: unset has no value (get() gives None)."""

    name: str
    kind: Kind
    default: Optional[str]
    doc: str
    test: bool = False    # read only by the test harness (tests/, .ci/), never by the package
    secret: bool = False  # its value is never logged

    def parse(self, text: Optional[str]) -> Any:
        """The value of `text` (None or blank: the default); EnvError naming the variable otherwise."""
        if text is None or not text.strip():
            text = self.default
        if text is None:
            return None
        try:
            return self.kind.convert(text)
        except ValueError:
            shown = "(hidden)" if self.secret else repr(text)
            raise EnvError(f"{self.name}={shown} is not valid: it takes {self.kind.accepts}") from None


_VARS = [
    # -- what runs ---------------------------------------------------------------------------
    Var("PYCOLL_TRANSPORT", one_of("auto", "tcp", "shm", "mpi", "verbs"), "auto",
        "the transport: `auto` is shm between ranks on one host and, across hosts, verbs (RDMA) where both "
        "ranks have an active RDMA port on one network, else tcp (`pycoll info` shows each pair's); `mpi` "
        "runs under mpirun, `verbs` is RDMA between all ranks; `pycoll.init(transport=)` wins"),
    Var("PYCOLL_ALGO", TEXT, None,
        "NCCL syntax over algorithm names: `ring`, `allreduce:^tree`, "
        "`broadcast:ring;allreduce:halving_doubling`; unset: the tuner picks; set: no calibration probe"),
    Var("PYCOLL_TUNER", one_of("probe", "model", "static"), "probe",
        "`probe`: calibrate at init, cached a day in `PYCOLL_TUNER_CACHE`; `model`: built-in constants; "
        "`static`: size rules (docs/topology.md)"),
    Var("PYCOLL_TUNER_CACHE", PATH, "~/.cache/pycoll/tuner",
        "folder of the tuner's calibration cache, per transport and host pair; `off` disables it"),
    Var("PYCOLL_TIMEOUT", number(), "300",
        "seconds any wait may take before `pycoll.TimeoutError` names the peers; per call: `timeout=`"),
    Var("PYCOLL_DEBUG", one_of("WARN", "INFO", "TRACE", "DETAIL"), "WARN",
        "`WARN`: warnings only; `INFO` (or `TRACE`): the tuner's calibration and each choice with its predicted time; `DETAIL`: "
        "before every collective all ranks compare (collective, dtype, count, op, root) and raise "
        "`pycoll.MismatchError` naming the first differing rank; every rank must set the same"),
    Var("PYCOLL_TRACE_DIR", PATH, None,
        "folder of the flight recorder: each rank writes `rank<R>.json` there when a pycoll error ends a "
        "call, on SIGUSR1 or SIGTERM, after an uncaught exception and when the job ends normally, and "
        "keeps `rank<R>.live` (its progress) up to date; read them with `pycoll trace DIR` (`--traffic`: "
        "what each rank sent to whom) (`pycoll run` sets it)"),
    Var("PYCOLL_TRACE_BUFFER", integer(0), "2000",
        "calls each communicator's flight recorder keeps (a ring); `0` turns recording off"),
    # -- where ranks are ---------------------------------------------------------------------
    Var("PYCOLL_TOPO_FILE", PATH, None,
        "JSON that declares hosts, NUMA nodes, NICs, RDMA devices and link speeds (docs/topology.md)"),
    Var("PYCOLL_HOSTID", TEXT, None,
        "this rank's host id (ranks with the same id share memory); unset: hostname + boot id + "
        "network namespace"),
    Var("PYCOLL_SOCKET_IFNAME", TEXT, None,
        "NCCL-syntax interface selection for TCP (`eth`, `^docker`, `=eth0`); unset: `ib*`, then any "
        "but docker/lo/virbr, then docker, then lo"),
    Var("PYCOLL_IB_DEV", TEXT, None,
        "RDMA device (and `:port`) for `verbs`, e.g. `mlx5_0:1`; unset: the first active port"),
    Var("PYCOLL_IB_GID_INDEX", integer(0), None,
        "GID index for `verbs`; unset: on RoCE the best of v2 IPv4-mapped, v2, v1; on InfiniBand 0"),
    Var("PYCOLL_IB_DISABLE", FLAG, "0",
        "`1`: `auto` never uses RDMA (ranks on other hosts are reached over tcp) and never loads pyverbs; "
        "as NCCL_IB_DISABLE. A rank that sets it offers no RDMA port, so its pairs run tcp on both ends"),
    # -- transport tuning --------------------------------------------------------------------
    Var("PYCOLL_SHM_RING", size(0), "0",
        "bytes of each shm ring, rounded down to a power of two (at least 64 KiB); `0`: up to 16 MiB, "
        "within 256 MiB per host"),
    Var("PYCOLL_CMA", FLAG, "1",
        "`1`: single-host ranks may copy straight between each other's memory (process_vm_readv/writev, "
        "as Open MPI's CMA) where the kernel allows it; `0`: never (large allreduces run two-shot)"),
    Var("PYCOLL_TCP_BULK_THRESHOLD", size(0, unlimited=True), "128K",
        "tcp payloads of this size and more to other ranks are announced on the raw stream of each pair and "
        "read straight into the posted buffer, parked unread until their receive is posted; smaller ones travel "
        "as frames on that stream too, read as they come (`inf`: every message rides zmq)"),
    Var("PYCOLL_NSOCKS", auto_or(integer(1, 16)), "auto",
        "tcp bulk streams per pair of ranks, large payloads cut over them (NCCL_NSOCKS_PERTHREAD), for "
        "networks that cap each flow below the link rate. `auto`: 4 to ranks on other hosts, 1 on this "
        "host; the tuner's probe times one stream against 4 and cuts over as many as fill the link "
        "once it carries 1.5 streams' worth, else over one (also without a probe); a number: that "
        "many to every rank, all used (every rank must set the same)"),
    Var("PYCOLL_TCP_CC", Kind(_congestion, "auto, system, or a congestion control the kernel has (cubic, reno, ...)"),
        "auto",
        "TCP congestion control of the tcp bulk streams to ranks on other hosts. `auto`: the kernel's default, "
        "unless that is bbr (its first version ignores loss: a collective's flows at once into a shallow-"
        "buffered link overrun it, retransmit and stall), then cubic, or reno where cubic is not permitted; "
        "`system`: the kernel's default always; a name: that one (an error if the kernel refuses it)"),
    Var("PYCOLL_TCP_STRIPE_MIN", size(1), "512K",
        "smallest part a tcp bulk payload is cut into over several streams (`PYCOLL_NSOCKS`; parts are whole "
        "4 KiB pages but the last): smaller "
        "payloads go whole, each on the next stream in turn"),
    Var("PYCOLL_TCP_COPY_THRESHOLD", size(0), "64K",
        "tcp payloads below PYCOLL_TCP_BULK_THRESHOLD of this size and more are written from the user's buffer "
        "(the send completes once the kernel has them); smaller ones are copied into their frame"),
    Var("PYCOLL_TCP_IO_THREADS", integer(1), "1", "zmq I/O threads per rank"),
    Var("PYCOLL_TCP_SOCKET_BUFFER", size(0), "0",
        "SO_SNDBUF and SO_RCVBUF of tcp sockets (zmq and bulk streams); `0`: kernel autotuning"),
    Var("PYCOLL_TCP_LOCAL_SNDBUF", size(0), "512K",
        "SO_SNDBUF of tcp bulk streams between ranks on one host (`0`: kernel autotuning). Over loopback, "
        "data queued past the window leaves from the peer's CPU when its ACK comes and overtakes what "
        "waits on ours; a small buffer avoids that reordering"),
    Var("PYCOLL_TCP_EAGER_WINDOW", size(0), "4M",
        "bytes' worth of small messages (below PYCOLL_TCP_BULK_THRESHOLD) a tcp sender may have unconsumed "
        "at each peer (a message counts at least 8.5 KiB; `0`: unbounded). Sends past it wait for the receiver to hand credit "
        "back, so a rank running ahead cannot fill its peers' memory"),
    Var("PYCOLL_TCP_SPIN_US", integer(0), "50",
        "microseconds a tcp waiter polls its sockets without sleeping (yielding the CPU between polls) "
        "before it blocks: a reply that comes within it is seen without a wake-up; `0`: block at once"),
    Var("PYCOLL_TCP_PROGRESS_MS", number(positive=False), "2",
        "while bulk payloads pass to or from ranks on other hosts and no call waits, a tcp transport's "
        "background thread reads what they sent, every this many milliseconds (a payload whose receive is "
        "not yet posted is read aside): "
        "a receiver that does not read holds back its TCP acknowledgements, and the sender's transfer "
        "stalls until the receive is posted; `0`: no such thread"),
    Var("PYCOLL_TCP_HEARTBEAT", number(positive=False), "0",
        "seconds of silence after which a tcp peer counts as dead (zmq heartbeats, sent every quarter "
        "of it): how ranks cut off by a network partition, or frozen, are noticed; `0`: off (a dead process "
        "is noticed anyway, by its dropped connection). `pycoll run --elastic` sets 10 unless given"),
    Var("PYCOLL_VERBS_SLOT", size(136), "64K",
        "bytes per verbs receive slot: messages that fit (less a 72-byte prefix) are sent eagerly, "
        "larger ones by RDMA write"),
    Var("PYCOLL_VERBS_CREDITS", integer(4), "32", "verbs receive slots per peer"),
    Var("PYCOLL_VERBS_CHUNK", size(4096), "1M", "RDMA write size of large verbs messages"),
    Var("PYCOLL_VERBS_SPIN_US", integer(0), "50",
        "microseconds a verbs waiter polls the completion queue before blocking on its channel"),
    Var("PYCOLL_VERBS_MR_CACHE", integer(0), "64",
        "idle user-buffer memory registrations verbs keeps for reuse (each pins memory)"),
    Var("PYCOLL_VERBS_ACK_TIMEOUT", integer(0, 31), "16",
        "verbs queue pair ACK timeout, 4.096 us * 2^n per try (16: 0.27 s), 6 retries; `0`: wait forever"),
    # -- algorithms --------------------------------------------------------------------------
    Var("PYCOLL_RING_SEGMENT", size(1), "4M",
        "largest message of the ring algorithms' pipeline and of halving-doubling's exchanges"),
    Var("PYCOLL_SCRATCH_POOL", size(0), "64M",
        "free scratch buffers (algorithms' receive and staging buffers) each transport keeps for later calls; "
        "`0`: a fresh buffer per call (pycoll/scratch.py)"),
    # -- set by launchers --------------------------------------------------------------------
    Var("PYCOLL_JOB_TOKEN", HEX, None,
        "hex secret shared by all ranks (set by `pycoll run`; on several nodes export the same on each); "
        "it never goes into the store (docs/security.md)", secret=True),
    Var("PYCOLL_JOB_TOKEN_FILE", PATH, None,
        "a file holding the hex job token, e.g. on a shared file system; refused unless only its owner "
        "can read it (`chmod 600`); `PYCOLL_JOB_TOKEN` wins"),
    Var("PYCOLL_INSECURE", FLAG, "0",
        "`1`: a multi-host job with no shared secret (no token, token file, `pycoll run` or mpirun) passes "
        "its token through the rendezvous store, so anyone who reaches the store can join; every rank "
        "warns. `0`: such a job is refused"),
    Var("PYCOLL_STORE_HOSTED", FLAG, "0",
        "`1`: a launcher serves pycoll's rendezvous store on `MASTER_ADDR:MASTER_PORT`, so rank 0 does not"),
    Var("PYCOLL_STORE_PORT", integer(1, 65535), None,
        "port of the rendezvous store the launcher serves on `MASTER_ADDR` (set by `pycoll run`): "
        "`pycoll.init()` connects there and no rank serves one, so `MASTER_PORT` stays free for "
        "torch's own store"),
    Var("PYCOLL_NEWCOMER", FLAG, "0",
        "`1`: this process joins a running job (`pycoll.init()` calls `pycoll.join()`: it announces itself "
        "in the store and waits for the members' next `comm.grow()`); set by `pycoll run --elastic` for a "
        "restarted rank and for the ranks of a node that joins later (`--nnodes MIN:MAX`)"),
    Var("PYCOLL_RESTART_COUNT", integer(0), "0",
        "how many times `pycoll run --elastic --max-restarts K` has restarted this rank's slot (torchrun's "
        "`TORCHELASTIC_RESTART_COUNT`); for the application, pycoll only reports it"),
    Var("PYCOLL_GROW_TIMEOUT", number(), "60",
        "seconds `comm.grow()` waits for the admitted newcomers to connect before the members go on "
        "without them (`pycoll.GrowError`); per call: `timeout=`"),
    # -- the test harness only ---------------------------------------------------------------
    Var("PYCOLL_RDMA_VM", FLAG, "0",
        "`1`: tests/test_verbs.py boots the soft-RoCE VM and runs the verbs tests there "
        "(tests/rdma/README.md; `.ci/run-rdma-vm` sets it)", test=True),
    Var("PYCOLL_RDMA_CACHE", PATH, "/var/cache/pycoll-rdma",
        "where tests/rdma/build-image.sh keeps the VM image (about 900 MB)", test=True),
    Var("PYCOLL_RDMA_MIRROR", TEXT, None,
        "Debian mirror for tests/rdma/build-image.sh; unset: the first of this host's apt sources", test=True),
    Var("PYCOLL_RDMA_OUT", PATH, None,
        "folder for the VM's guest.log and console.log; unset: a fresh temporary folder", test=True),
    Var("PYCOLL_RDMA_TIMEOUT", number(), "1500", "seconds the VM may run (tests/rdma/run-vm-pair.sh: 3000)",
        test=True),
    Var("PYCOLL_RDMA_MEM", integer(256), "3072",
        "MiB of memory of the VM (tests/rdma/run-vm-pair.sh: of each of its two, default 2048)", test=True),
    Var("PYCOLL_RDMA_CPUS", integer(1), "2", "vCPUs of the VM", test=True),
    Var("PYCOLL_RDMA_ACCEL", one_of("auto", "kvm", "tcg"), "auto",
        "how qemu runs the VM; `auto`: KVM where the host has kvm_intel or kvm_amd, else TCG emulation",
        test=True),
    Var("PYCOLL_RDMA_PYTEST_ARGS", TEXT, None,
        "more pytest arguments for the verbs tests in the VM, e.g. `-k p2p`", test=True),
    Var("PYCOLL_RDMA_BENCH", FLAG, "1", "`0`: the VM skips the verbs-vs-tcp bench after its tests", test=True),
    Var("PYCOLL_RDMA_ITERS", integer(1), "10", "iterations per size of the VM's bench", test=True),
    Var("PYCOLL_RDMA_PAIR", TEXT, None,
        "`NODE,ADDRESS`: set by tests/rdma/run-vm-pair.sh in each of its two VMs (this VM's node, 0 or 1, "
        "and VM 0's address); tests/test_verbs_hosts.py runs its jobs' ranks split over both VMs", test=True),
    Var("PYCOLL_TBF_LATENCY_MS", number(positive=False), "20",
        "tests/netns_cluster.py: milliseconds a packet may queue in an emulated host's rate limiter (tbf)",
        test=True),
    Var("PYCOLL_SSAI", one_of("0", "1"), "1",
        "tests/test_emulated_cluster.py: `net.ipv4.tcp_slow_start_after_idle` in the emulated hosts",
        test=True),
    Var("PYCOLL_CLUSTER_REPORT", PATH, None,
        "tests/test_emulated_cluster.py appends its measured table and JSON to this file", test=True),
]
REGISTRY: Dict[str, Var] = {v.name: v for v in _VARS}


def get(name: str, env: Optional[Mapping[str, str]] = None) -> Any:
    """The parsed value of variable `name` in `env` (default: os.environ, read now); EnvError if invalid."""
    try:
        var = REGISTRY[name]
    except KeyError:
        raise KeyError(f"{name} is not declared in pycoll.config.REGISTRY") from None
    return var.parse((os.environ if env is None else env).get(name))


def load(env: Optional[Mapping[str, str]] = None) -> Dict[str, Any]:
    """Every package variable's value (test-harness ones aside). Invalid values raise one EnvError
    naming them all; values other than the default are logged at INFO, unknown PYCOLL_* names warned of."""
    env = os.environ if env is None else env
    values: Dict[str, Any] = {}
    errors: List[str] = []
    for var in REGISTRY.values():
        if not var.test:
            try:
                values[var.name] = var.parse(env.get(var.name))
            except EnvError as e:
                errors.append(str(e))
    if errors:
        raise EnvError("; ".join(errors))
    for name, value in values.items():
        var = REGISTRY[name]
        if value != var.parse(None):
            log.info("%s=%s (default: %s)", name, "(hidden)" if var.secret else env[name],
                     "unset" if var.default is None else var.default)
    for name in env:
        if name.startswith("PYCOLL_") and name not in REGISTRY:
            near = difflib.get_close_matches(name, REGISTRY, n=1)
            log.warning("%s is not a pycoll variable%s", name, f" (did you mean {near[0]}?)" if near else "")
    return values


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown_table(test: bool = False) -> str:
    """The README table of the package's variables (test=True: of the test harness's)."""
    rows = ["| variable | default | accepts | meaning |", "|---|---|---|---|"]
    for var in REGISTRY.values():
        if var.test == test:
            default = "unset" if var.default is None else f"`{var.default}`"
            rows.append(f"| `{var.name}` | {default} | {_cell(var.kind.accepts)} | {_cell(var.doc)} |")
    return "\n".join(rows)


def render_readme(text: str) -> str:
    """`text` with the tables between `<!-- env-table:start -->` / `end` (and `test-env-table`) regenerated."""
    for marker, test in (("env-table", False), ("test-env-table", True)):
        start, end = f"<!-- {marker}:start -->", f"<!-- {marker}:end -->"
        if text.count(start) != 1 or text.count(end) != 1:
            raise ValueError(f"the README must hold {start} and {end} once each")
        head, rest = text.split(start)
        _, tail = rest.split(end)
        text = f"{head}{start}\n{markdown_table(test)}\n{end}{tail}"
    return text
