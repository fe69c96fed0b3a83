"""Emulated multi-host clusters: one network namespace per "host", each joined by a veth pair to a
bridge in the root namespace, each host's link rate-limited both ways with `tc ... tbf`.

    with Cluster(hosts=2, rate_mbit=200) as c:
        c.link_rate(0, 1)                                 # bytes/s of a raw TCP stream, measured
        c.run("test_mod:fn", placement=[0, 1, 0, 1])      # fn(comm) on 4 ranks, rank i in host i % 2

With `flow_mbit`, each TCP flow is capped below the link as cloud NICs do (AWS: 5 Gbit/s per flow
outside placement groups): the link is an htb class of `rate_mbit` whose children, one per hash
bucket of the flow's addresses and ports (FLOW_BUCKETS of them, chosen by a classic-BPF classifier),
are capped at `flow_mbit`; `link_rate(..., flows=4)` measures several flows at once. (`fq maxrate`
would be the one-line way, but sch_fq is not built into every kernel, this one's included.)

Names carry this process's pid and a counter (namespaces `pyc-<pid>-<k>-h<i>`, interfaces
`pcb<pid36>-<k>` / `pcv<pid36>-<k>h<i>`), so parallel pytest-xdist workers never collide; the subnet
is picked under a lock among the 10.200-249.x.0/24 not in use. Everything is removed on exit, also
when the body raises, and leftovers of dead processes are swept on the next start. Ranks run as
`ip netns exec NS python netns_cluster.py worker MODULE:FN ...` with the rendezvous store served
by this process on the bridge address.

Run as `python tests/netns_cluster.py sweep` to remove what crashed runs left behind.
"""
from __future__ import annotations

import atexit
import fcntl
import importlib
import ipaddress
import itertools
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any, Dict, List, Optional, Sequence

_COUNTER = itertools.count()
FLOW_BUCKETS_LOG2 = 10  # flows hash into 1024 htb classes: 8 flows share one with probability ~3%
_FLOW_BASE = 0x1000     # their class minors: 1:1000 .. 1:13ff
_LOCK = "/tmp/pycoll-netns.lock"
_NS_PREFIX = "pyc-"


class ClusterError(RuntimeError):
    """Setting up the emulated cluster failed, or a rank in it failed; the message says which."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and proc.returncode:
        raise ClusterError(f"`ip {' '.join(args)}` failed: {proc.stderr.strip()}")
    return proc


def _b36(n: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while True:
        n, d = divmod(n, 36)
        out = digits[d] + out
        if not n:
            return out


def unavailable() -> Optional[str]:
    """Why namespaces cannot be built here (not root, no ip/tc), or None when they can."""
    if os.geteuid() != 0:
        return "needs root (ip netns, veth, tc)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    return f"missing {missing}" if missing else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def sweep_stale() -> List[str]:
    """Delete namespaces and bridges made by processes that no longer run; returns what was removed."""
    removed = []
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        parts = name.split("-")
        if name.startswith(_NS_PREFIX) and len(parts) >= 2 and parts[1].isdigit() and not _alive(int(parts[1])):
            _ip("netns", "del", name, check=False)
            removed.append(name)
    for line in _ip("-o", "link", "show", "type", "bridge", check=False).stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        if name.startswith("pcb") and "-" in name:
            try:
                pid = int(name[3:name.index("-")], 36)
            except ValueError:
                continue
            if not _alive(pid):
                _ip("link", "del", name, check=False)
                removed.append(name)
    return removed


def _free_subnet() -> ipaddress.IPv4Network:
    used = [ipaddress.ip_interface(tok).network for line in _ip("-4", "-o", "addr", "show").stdout.splitlines()
            for tok in line.split() if "/" in tok and tok[0].isdigit()]
    for second in range(200, 250):
        for third in range(256):
            net = ipaddress.ip_network(f"10.{second}.{third}.0/24")
            if not any(net.overlaps(u) for u in used):
                return net
    raise ClusterError("no free 10.200-249.x.0/24 subnet for the emulated cluster")


class Cluster:
    """`hosts` namespaces on one bridge; with `rate_mbit`, each host's link is a tbf of that rate."""

    def __init__(self, hosts: int, rate_mbit: Optional[float] = None, burst_kib: int = 256,
                 latency_ms: Optional[float] = None,
                 sysctls: Optional[Dict[str, str]] = None, flow_mbit: Optional[float] = None,
                 delay_ms: float = 0.0, jitter_ms: float = 0.0, loss: float = 0.0, reorder: float = 0.0,
                 wire_seed: int = 0) -> None:
        if hosts < 1:
            raise ValueError(f"a cluster needs at least one host, got {hosts}")
        if flow_mbit and not rate_mbit:
            raise ValueError("a per-flow cap (flow_mbit) needs a link rate (rate_mbit)")
        self.flow_mbit = flow_mbit
        # host-to-host impairments through a userspace wire (netns_wire.py): this kernel has no netem
        self.impairments = {"delay_ms": delay_ms, "jitter_ms": jitter_ms, "loss": loss, "reorder": reorder}
        self.wire_seed = wire_seed
        self.wire: Any = None
        from pycoll import config  # not at the top: _worker must report even a failing pycoll import

        self.nhosts, self.rate_mbit, self.burst_kib = hosts, rate_mbit, burst_kib
        self.latency_ms = config.get("PYCOLL_TBF_LATENCY_MS") if latency_ms is None else latency_ms
        self.sysctls = dict(sysctls or {})  # per-namespace, e.g. {"net.ipv4.tcp_slow_start_after_idle": "0"}
        k = next(_COUNTER)
        tag = f"{_b36(os.getpid())}-{_b36(k)}"
        self.bridge = f"pcb{tag}"
        self.namespaces = [f"{_NS_PREFIX}{os.getpid()}-{k}-h{i}" for i in range(hosts)]
        self.veths = [f"pcv{tag}h{i}" for i in range(hosts)]
        self.addresses: List[str] = []
        self.gateway = ""
        self.workdir = tempfile.mkdtemp(prefix="pycoll-cluster-")
        self._procs: List[subprocess.Popen] = []
        self._built = False

    # -- lifetime ------------------------------------------------------------------------------------
    def __enter__(self) -> "Cluster":
        reason = unavailable()
        if reason:
            raise ClusterError(f"cannot build an emulated cluster: {reason}")
        sweep_stale()
        atexit.register(self.close)
        self._built = True
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _build(self) -> None:
        with open(_LOCK, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # subnet choice and address assignment, one cluster at a time
            net = _free_subnet()
            hosts = list(net.hosts())
            self.gateway = str(hosts[0])
            self.addresses = [str(hosts[i + 1]) for i in range(self.nhosts)]
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.gateway}/{net.prefixlen}", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for ns, veth, addr in zip(self.namespaces, self.veths, self.addresses):
            _ip("netns", "add", ns)
            _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("link", "set", veth, "master", self.bridge)
            _ip("link", "set", veth, "up")
            _ip("-n", ns, "addr", "add", f"{addr}/{net.prefixlen}", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            for key, value in self.sysctls.items():
                subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-q", "-w", f"{key}={value}"], check=True,
                               capture_output=True)
            if self.rate_mbit:
                self._shape(["tc"], veth)                                 # into the host
                self._shape(["ip", "netns", "exec", ns, "tc"], "eth0")    # out of the host
        if any(self.impairments.values()) and self.nhosts > 1:
            from netns_wire import Wire
            self.wire = Wire(self.namespaces, self.addresses, self.bridge[3:], seed=self.wire_seed,
                             **self.impairments)
            self.wire.start()

    def _shape(self, tc: List[str], dev: str) -> None:
        if self.flow_mbit:
            self._shape_flows(tc, dev)
            return
        cmd = tc + ["qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{self.rate_mbit}mbit",
                    "burst", f"{self.burst_kib}kb", "latency", f"{self.latency_ms:g}ms"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            raise ClusterError(f"`{' '.join(cmd)}` failed: {proc.stderr.strip()}")

    def _shape_flows(self, tc: List[str], dev: str) -> None:
        """htb: the link (1:1) at rate_mbit; other traffic (ARP, ...) in 1:2; each TCP flow, by a
        hash of its addresses and ports, in one of the per-flow classes capped at flow_mbit."""
        link, flow = f"{self.rate_mbit}mbit", f"{self.flow_mbit}mbit"
        lines = [f"qdisc add dev {dev} root handle 1: htb default 2",
                 f"class add dev {dev} parent 1: classid 1:1 htb rate {link} ceil {link} quantum 60000",
                 f"class add dev {dev} parent 1:1 classid 1:2 htb rate {link} ceil {link} quantum 60000"]
        # a flow's class is guaranteed next to nothing and borrows up to its cap from the link: a
        # class's own rate is sent whatever its parent has left, so 8 flows at rate=cap would pass 8 caps
        lines += [f"class add dev {dev} parent 1:1 classid 1:{_FLOW_BASE + b:x} htb rate 100kbit ceil {flow} "
                  "quantum 60000" for b in range(1 << FLOW_BUCKETS_LOG2)]
        lines.append(f"filter add dev {dev} parent 1: protocol all prio 1 bpf bytecode \"{_flow_hash_bpf()}\"")
        proc = subprocess.run(tc + ["-batch", "-"], input="\n".join(lines) + "\n", capture_output=True, text=True)
        if proc.returncode:
            raise ClusterError(f"`{' '.join(tc)} -batch` (per-flow htb on {dev}) failed: {proc.stderr.strip()[-2000:]}")

    def close(self) -> None:
        """Kill what runs in the namespaces, delete them and the bridge (idempotent)."""
        for p in self._procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        self._procs.clear()
        if self.wire is not None:
            self.wire.stop()
            self.wire = None
        if self._built:
            for ns in self.namespaces:
                pids = _ip("netns", "pids", ns, check=False).stdout.split()
                for pid in pids:  # anything our ranks left running inside our namespace
                    try:
                        os.kill(int(pid), 9)
                    except (ProcessLookupError, ValueError):
                        pass
                _ip("netns", "del", ns, check=False)
            _ip("link", "del", self.bridge, check=False)
            self._built = False
        shutil.rmtree(self.workdir, ignore_errors=True)
        atexit.unregister(self.close)

    def exists(self) -> bool:
        """True while any of this cluster's namespaces or its bridge exists."""
        names = _ip("netns", "list", check=False).stdout
        return any(ns in names.split() for ns in self.namespaces) or \
            _ip("link", "show", self.bridge, check=False).returncode == 0

    # -- processes -----------------------------------------------------------------------------------
    def popen(self, host: int, argv: Sequence[str], env: Optional[Dict[str, str]] = None,
              log: Optional[str] = None) -> subprocess.Popen:
        """Start `argv` inside host `host`'s namespace (killed at close)."""
        out = open(log, "w") if log else subprocess.DEVNULL
        proc = subprocess.Popen(["ip", "netns", "exec", self.namespaces[host], *argv], env=env,
                                stdout=out, stderr=subprocess.STDOUT if log else subprocess.DEVNULL)
        if log:
            out.close()
        self._procs.append(proc)
        return proc

    def link_rate(self, src: int, dst: int, nbytes: int = 16 << 20, timeout: float = 60.0, flows: int = 1) -> float:
        """Bytes per second of `flows` raw TCP streams at once (nbytes in all) from host `src` to host
        `dst`, timed at the receiver from the first byte to the last."""
        result = os.path.join(self.workdir, f"rate-{src}-{dst}-{secrets.token_hex(4)}.json")
        port = 20000 + secrets.randbelow(20000)
        sink = self.popen(dst, [sys.executable, __file__, "sink", self.addresses[dst], str(port), result, str(flows)])
        deadline = time.monotonic() + timeout
        while not os.path.exists(result + ".ready"):
            if sink.poll() is not None or time.monotonic() > deadline:
                raise ClusterError(f"link_rate: the receiver in host {dst} did not start")
            time.sleep(0.02)
        source = self.popen(src, [sys.executable, __file__, "source", self.addresses[dst], str(port), str(nbytes),
                                  str(flows)])
        for p in (source, sink):
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise ClusterError(f"link_rate {src}->{dst}: no result within {timeout:g} s") from None
        with open(result) as fh:
            got = json.load(fh)
        return got["bytes"] / got["seconds"]

    def run(self, target: str, placement: Sequence[int], args: Sequence[Any] = (),
            env: Optional[Dict[str, str]] = None, timeout: float = 120.0) -> List[Any]:
        """Run MODULE:FN(comm, *args) on len(placement) ranks, rank r in host placement[r]; the
        JSON-able results in rank order. ClusterError with every failing rank's output otherwise."""
        from pycoll.bootstrap.store import TCPStoreServer

        n = len(placement)
        token = secrets.token_bytes(16)
        server = TCPStoreServer(self.gateway, 0, token)
        procs, results, logs = [], [], []
        try:
            for r, host in enumerate(placement):
                same = [q for q in range(n) if placement[q] == host]
                rank_env = dict(os.environ, **(env or {}), RANK=str(r), WORLD_SIZE=str(n),
                                LOCAL_RANK=str(same.index(r)), LOCAL_WORLD_SIZE=str(len(same)),
                                MASTER_ADDR=self.gateway, MASTER_PORT=str(server.port),
                                PYCOLL_STORE_HOSTED="1", PYCOLL_JOB_TOKEN=token.hex())
                results.append(os.path.join(self.workdir, f"rank{r}-{secrets.token_hex(4)}.json"))
                logs.append(results[-1] + ".log")
                procs.append(self.popen(host, [sys.executable, __file__, "worker", target, json.dumps(list(args)),
                                               results[-1]], rank_env, logs[-1]))
            _await(procs, timeout, grace=1.0)
        finally:
            _stop(procs)
            server.close()
        values, stories = [], []
        for r, (p, path, log) in enumerate(zip(procs, results, logs)):
            try:
                with open(path) as fh:
                    got = json.load(fh)
            except (OSError, ValueError):
                got = {"ok": False, "error": f"no result (exit code {p.returncode}, killed after {timeout:g} s?)"}
            if not got["ok"]:
                with open(log) as fh:
                    stories.append(f"--- rank {r} (host {placement[r]}) ---\n{got['error']}\n{fh.read()[-3000:]}")
            values.append(got.get("value"))
        if stories:
            raise ClusterError(f"{len(stories)} rank(s) failed in the emulated cluster\n" + "\n".join(stories))
        return values


    def launch(self, argv: Sequence[str], ppn: int, hosts: Optional[Sequence[int]] = None,
               env: Optional[Dict[str, str]] = None, timeout: float = 300.0) -> List[str]:
        """Run `pycoll run -n ppn --nnodes H ... argv` on each of `hosts` (default all), as a user
        starts a multi-node job (node 0 in the first host serves the stores; torch's MASTER_ADDR is
        its address); every node's output, in host order. ClusterError with the outputs if any node
        fails or the job outlives `timeout`."""
        hosts = list(range(self.nhosts) if hosts is None else hosts)
        port = 21000 + secrets.randbelow(20000)
        node_env = dict(os.environ, **(env or {}), PYCOLL_JOB_TOKEN=secrets.token_hex(16))
        logs = [os.path.join(self.workdir, f"node{i}-{secrets.token_hex(4)}.log") for i in range(len(hosts))]
        procs = [self.popen(h, [sys.executable, "-m", "pycoll", "run", "-n", str(ppn), "--nnodes", str(len(hosts)),
                                "--node-rank", str(i), "--master-addr", self.addresses[hosts[0]],
                                "--master-port", str(port), *argv], node_env, logs[i])
                 for i, h in enumerate(hosts)]
        try:
            _await(procs, timeout, grace=2.0)
        finally:
            _stop(procs)
        outputs = []
        for path in logs:
            with open(path) as fh:
                outputs.append(fh.read())
        codes = [p.returncode for p in procs]
        if any(codes):
            story = "\n".join(f"--- node {i} (host {h}, exit code {c}) ---\n{out[-4000:]}"
                              for i, (h, c, out) in enumerate(zip(hosts, codes, outputs)))
            raise ClusterError(f"`pycoll run {' '.join(argv)}` failed on the emulated cluster "
                               f"(or ran past {timeout:g} s)\n{story}")
        return outputs


def _await(procs: Sequence[subprocess.Popen], timeout: float, grace: float) -> None:
    """Until every process has ended or `timeout` s passed; once one fails, `grace` s more for the
    others to report their side."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        if any(p.poll() not in (None, 0) for p in procs):
            time.sleep(grace)
            return
        time.sleep(0.05)


def _stop(procs: Sequence[subprocess.Popen]) -> None:
    """Kill whatever still runs and reap them all."""
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()

# -- what runs inside the namespaces ------------------------------------------------------------------
def _worker(target: str, args: str, out: str) -> None:
    try:
        module, _, name = target.partition(":")
        fn = getattr(importlib.import_module(module), name)
        import pycoll
        with pycoll.init() as comm:
            result = {"ok": True, "value": fn(comm, *json.loads(args))}
    except BaseException:
        result = {"ok": False, "error": traceback.format_exc()}
    with open(out + ".tmp", "w") as fh:
        json.dump(result, fh)
    os.replace(out + ".tmp", out)


def _flow_hash_bpf() -> str:
    """Classic BPF for cls_bpf (at egress, from the Ethernet header): IPv4 TCP packets go to class
    1:(_FLOW_BASE + h), h a multiplicative hash of (ports, source ^ destination address) in
    FLOW_BUCKETS_LOG2 bits; anything else returns 0 (no match: htb's default class)."""
    prog = [(0x28, 0, 0, 12),                 # ldh [12]            ethertype
            (0x15, 0, 16, 0x0800),            # jeq IPv4, else ret 0
            (0x30, 0, 0, 23),                 # ldb [23]            protocol
            (0x15, 0, 14, 6),                 # jeq TCP, else ret 0
            (0xb1, 0, 0, 14),                 # ldxb 4*([14]&0xf)   IP header length
            (0x40, 0, 0, 14),                 # ld [x+14]           source port << 16 | destination port
            (0x02, 0, 0, 0),                  # st M[0]
            (0x20, 0, 0, 26),                 # ld [26]             source address
            (0x07, 0, 0, 0),                  # tax
            (0x20, 0, 0, 30),                 # ld [30]             destination address
            (0xac, 0, 0, 0),                  # xor x
            (0x07, 0, 0, 0),                  # tax
            (0x60, 0, 0, 0),                  # ld M[0]
            (0xac, 0, 0, 0),                  # xor x
            (0x24, 0, 0, 2654435761),         # mul #golden ratio (Knuth)
            (0x74, 0, 0, 32 - FLOW_BUCKETS_LOG2),  # rsh: the top bits
            (0x04, 0, 0, 0x10000 | _FLOW_BASE),    # add: classid 1:(base + h)
            (0x16, 0, 0, 0),                  # ret a
            (0x06, 0, 0, 0)]                  # ret #0
    return f"{len(prog)}," + ",".join(f"{c} {t} {f} {k}" for c, t, f, k in prog)


def _sink(addr: str, port: str, out: str, flows: str = "1") -> None:
    import selectors
    import socket
    srv = socket.create_server((addr, int(port)))
    open(out + ".ready", "w").close()
    sel = selectors.DefaultSelector()
    for _ in range(int(flows)):
        conn, _ = srv.accept()
        conn.setblocking(False)
        sel.register(conn, selectors.EVENT_READ)
    buf = bytearray(1 << 20)
    total, first, last, open_ = 0, None, 0.0, int(flows)
    while open_:
        for key, _ in sel.select():
            try:
                k = key.fileobj.recv_into(buf)  # type: ignore[union-attr]
            except BlockingIOError:
                continue
            if not k:
                sel.unregister(key.fileobj)
                open_ -= 1
                continue
            now = time.perf_counter()
            if first is None:
                first, k = now, 0  # time from the first chunk's arrival: count what comes after it
            total, last = total + k, now
    with open(out, "w") as fh:
        json.dump({"bytes": total, "seconds": max(last - (first or last), 1e-9)}, fh)


def _source(addr: str, port: str, nbytes: str, flows: str = "1") -> None:
    import socket
    import threading
    data = bytes(1 << 20)
    socks = [socket.create_connection((addr, int(port))) for _ in range(int(flows))]

    def pour(s: socket.socket, left: int) -> None:
        with s:
            while left > 0:
                s.sendall(data[:min(left, len(data))])
                left -= len(data)
    threads = [threading.Thread(target=pour, args=(s, int(nbytes) // len(socks))) for s in socks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


if __name__ == "__main__":
    cmd = sys.argv[1] if len(sys.argv) > 1 else ""
    if cmd == "worker":
        _worker(*sys.argv[2:5])
    elif cmd == "sink":
        _sink(*sys.argv[2:6])
    elif cmd == "source":
        _source(*sys.argv[2:6])
    elif cmd == "sweep":
        print("\n".join(sweep_stale()) or "nothing to remove")
    else:
        sys.exit("usage: netns_cluster.py sweep | worker MODULE:FN ARGS OUT | sink ADDR PORT OUT | source ADDR PORT N")
