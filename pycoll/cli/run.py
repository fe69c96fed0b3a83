"""`pycoll run`: start N local ranks of a script with the torchrun variables set.

Like torchrun's agent, the launcher on node 0 serves the rendezvous store itself, so every
rank (rank 0 included) is a client and the store outlives any one rank. That store listens on
a port of its own, passed as PYCOLL_STORE_PORT (with the job token it demands in
PYCOLL_JOB_TOKEN); MASTER_ADDR:MASTER_PORT is left free for torch, whose rank 0 binds
MASTER_PORT in init_process_group, so torch scripts on any backend run unchanged. Each rank's output
is prefixed with `[rank R] `. The first rank to fail brings the whole job down, so no rank
hangs forever in a collective waiting for a dead peer, and each rank runs in its own
process group, so teardown also reaches the processes a rank started.

With --elastic a rank killed by a signal does not end the job (the others revoke, agree and shrink:
pycoll/ft.py); with --max-restarts K as well, a rank that fails is started again in its slot, up to K
times in all, as a newcomer (PYCOLL_NEWCOMER=1, PYCOLL_RESTART_COUNT=its slot's restarts) that
pycoll.init() makes join the running job at the members' next comm.grow() (pycoll/grow.py), as
torchrun's --max-restarts restarts workers; the restart after the K-th ends the job with the reason.
--nnodes MIN:MAX starts the job on nodes 0..MIN-1; a node started later with a node rank in MIN..MAX-1
joins it, its ranks newcomers too. Each such event is printed with the seconds since the launcher
started.

Every rank gets PYCOLL_TRACE_DIR (--trace-dir, or a private folder kept only if the job fails), so
the flight recorder keeps each rank's progress in a live file there. The launcher reads those files
without disturbing the ranks: SIGQUIT prints them (one line per rank, then how many ranks are up to
which call), and --hang-timeout ends a job whose files stop moving. Before it ends a failed, hung or
timed-out job, it sends SIGUSR1 to every live rank, waits (bounded) for their dumps and prints
`pycoll trace`'s verdict.
"""
from __future__ import annotations

import argparse
import os
import shutil
import socket
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import IO, Dict, List, Optional, Tuple

from ..bootstrap.store import TCPStoreServer
from ..bootstrap.token import draw, env_token
from ..errors import EnvError, StoreError
from ..grow import CLOSED_KEY
from ..trace import analysis

MULTINODE_PORT = 29500  # the default master port when other nodes must know it in advance
GRACE_S = 5.0  # how long ranks get between SIGTERM and SIGKILL at teardown
TIMEOUT_EXIT = 124  # exit code when --timeout expires, as timeout(1) uses
_POLL_S = 0.05
DUMP_WAIT_S = 5.0  # how long ranks get to write their flight-recorder dumps before teardown
_PROGRESS_POLL_S = 0.5  # how often --hang-timeout looks at the ranks' live files
_HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_OUTPUT_LOCK = threading.Lock()  # one lock for stdout and stderr: whole lines, never mixed


def build_parser() -> argparse.ArgumentParser:
    """The `pycoll run` argument parser; everything after the script is left for the script."""
    p = argparse.ArgumentParser(
        prog="pycoll run", allow_abbrev=False,
        description="Start N local ranks of a script (or module, or command) with RANK, "
                    "WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT, ... set, torchrun style.")
    p.add_argument("-n", "--nproc-per-node", "--nproc_per_node", dest="nproc", type=int, default=1,
                   metavar="N", help="ranks to start on this node (default 1)")
    p.add_argument("--nnodes", type=parse_nnodes, default=(1, 1), metavar="K|MIN:MAX",
                   help="nodes in the job (default 1); MIN:MAX (with --elastic): the job starts on nodes "
                        "0..MIN-1, and a node started later with --node-rank MIN..MAX-1 joins it")
    p.add_argument("--node-rank", "--node_rank", dest="node_rank", type=int, default=0, metavar="R",
                   help="this node's index in 0..K-1 (0..MAX-1) (default 0); node 0 serves the store")
    p.add_argument("--master-addr", "--master_addr", dest="master_addr", default="127.0.0.1",
                   metavar="A", help="address of node 0 (default 127.0.0.1)")
    p.add_argument("--master-port", "--master_port", dest="master_port", type=int, default=None,
                   metavar="P", help=f"MASTER_PORT: the port torch's store binds on node 0 (default: a "
                                     f"free port with one node, {MULTINODE_PORT} with several)")
    p.add_argument("--store-port", "--store_port", dest="store_port", type=int, default=None,
                   metavar="P", help="PYCOLL_STORE_PORT: the port of pycoll's store, served by this "
                                     "launcher on node 0 (default: a free port with one node, "
                                     "master port + 1 with several)")
    p.add_argument("--timeout", type=float, default=None, metavar="S",
                   help=f"kill the job and exit {TIMEOUT_EXIT} if it runs longer than S seconds")
    p.add_argument("--trace-dir", dest="trace_dir", default=None, metavar="DIR",
                   help="PYCOLL_TRACE_DIR of every rank: flight-recorder dumps and live files land there "
                        "(read them with `pycoll trace DIR`); default: a private folder kept only if the job fails")
    p.add_argument("--hang-timeout", dest="hang_timeout", type=float, default=None, metavar="S",
                   help="if no rank enters or completes a pycoll call for S seconds, print every rank's "
                        f"progress, have the ranks dump their flight recorders, and end the job (exit {TIMEOUT_EXIT})")
    p.add_argument("--elastic", action="store_true",
                   help="a rank that dies (killed by a signal) does not end the job: the others may revoke, agree "
                        "and shrink (pycoll/ft.py) and go on; exit 0 when every survivor exits 0. Sets "
                        "PYCOLL_TCP_HEARTBEAT=10 unless it is set")
    p.add_argument("--max-restarts", "--max_restarts", dest="max_restarts", type=int, default=0, metavar="K",
                   help="with --elastic: start a rank that fails (a signal or a non-zero exit) again in its slot, "
                        "as a newcomer that joins the running job (PYCOLL_NEWCOMER=1, PYCOLL_RESTART_COUNT); at "
                        "most K restarts in all: one more failure ends the job, saying so (default 0: none)")
    p.add_argument("-m", "--module", action="store_true",
                   help="run the target as a Python module (python -m target)")
    p.add_argument("target", nargs="?", metavar="script.py|module|command",
                   help="a .py file runs with this Python; anything else runs as a command")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to every rank")
    return p


def parse_nnodes(text: str) -> Tuple[int, int]:
    """--nnodes K or MIN:MAX (torchrun's syntax) as (MIN, MAX); K is K:K."""
    low, sep, high = text.partition(":")
    try:
        nodes = (int(low), int(high)) if sep else (int(low), int(low))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a node count K or a range MIN:MAX, got {text!r}") from None
    if nodes[0] < 1 or nodes[1] < nodes[0]:
        raise argparse.ArgumentTypeError(f"--nnodes {text}: need 1 <= MIN <= MAX")
    return nodes


def main(argv: List[str]) -> int:
    """Run `pycoll run ARGV`; return the job's exit code (2 for bad arguments)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        _check(parser, args)
        cmd = _command(parser, args)
        token = _job_token(parser, args)
    except SystemExit as e:  # argparse exits on bad input or --help; the caller wants a code
        return int(e.code or 0)
    master_port = args.master_port
    multinode = args.nnodes[1] > 1
    if master_port is None:
        master_port = MULTINODE_PORT if multinode else 0
    store_port = args.store_port
    if store_port is None:
        store_port = master_port + 1 if multinode else 0
    host = "::" if ":" in args.master_addr else "0.0.0.0"
    server = None
    if args.node_rank == 0:
        try:
            server = TCPStoreServer(host=host, port=store_port, token=bytes.fromhex(token))
        except StoreError as e:
            _say(str(e))
            return 1
        store_port = server.port
    try:
        if master_port == 0:  # one node: a port for torch that is free now (the store holds its own)
            try:
                master_port = _free_port(host)
            except OSError as e:
                _say(f"cannot find a free port for MASTER_PORT on {host}: {e}")
                return 1
        job = _Job(args, cmd, master_port, store_port, token)
        job.server = server
        return job.run()
    finally:
        if server is not None:
            server.close()


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Reject arguments that cannot describe a job, before anything starts."""
    if args.nproc < 1:
        parser.error(f"-n/--nproc-per-node must be at least 1, not {args.nproc}")
    low, high = args.nnodes
    if high > low and not args.elastic:
        parser.error(f"--nnodes {low}:{high} (nodes joining later) needs --elastic")
    if not 0 <= args.node_rank < high:
        parser.error(f"--node-rank must be in 0..{high - 1}, not {args.node_rank}")
    if args.max_restarts < 0:
        parser.error(f"--max-restarts must be at least 0, not {args.max_restarts}")
    if args.max_restarts and not args.elastic:
        parser.error("--max-restarts needs --elastic: a restarted rank joins a job that went on without it")
    if args.master_port is not None and not 0 <= args.master_port <= 65535:
        parser.error(f"--master-port must be in 0..65535, not {args.master_port}")
    multinode = high > 1
    if args.master_port == 0 and multinode:
        parser.error("--master-port 0 (a random port) works only with --nnodes 1: "
                     "the other nodes must know the port in advance")
    if args.store_port is not None and not 0 <= args.store_port <= 65535:
        parser.error(f"--store-port must be in 0..65535, not {args.store_port}")
    if args.store_port == 0 and multinode:
        parser.error("--store-port 0 (a random port) works only with --nnodes 1: "
                     "the other nodes must know the port in advance")
    if multinode and args.store_port is None and (args.master_port or MULTINODE_PORT) == 65535:
        parser.error("--master-port 65535 leaves no port above it for pycoll's store: pass --store-port")
    if args.store_port and args.store_port == args.master_port:
        parser.error(f"--store-port and --master-port must differ (torch's store binds MASTER_PORT), "
                     f"both are {args.store_port}")
    if args.timeout is not None and not args.timeout > 0:
        parser.error(f"--timeout must be a positive number of seconds, not {args.timeout:g}")
    if args.hang_timeout is not None and not args.hang_timeout > 0:
        parser.error(f"--hang-timeout must be a positive number of seconds, not {args.hang_timeout:g}")


def _command(parser: argparse.ArgumentParser, args: argparse.Namespace) -> List[str]:
    """The argv every rank runs: `python -m mod`, `python script.py` or a plain command."""
    if args.target is None:
        parser.error("missing the script, module (-m) or command to run")
    if args.module:
        return [sys.executable, "-m", args.target, *args.args]
    if args.target.endswith(".py"):
        if not os.path.isfile(args.target):
            parser.error(f"script not found: {args.target}")
        return [sys.executable, args.target, *args.args]
    if shutil.which(args.target) is None:
        parser.error(f"command not found: {args.target}")
    return [args.target, *args.args]


def _job_token(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    """The hex job token the store demands and every rank gets. One node: drawn here (or the one in the
    environment). Several nodes must share it: PYCOLL_JOB_TOKEN or PYCOLL_JOB_TOKEN_FILE; node 0 draws
    one if neither is set and prints how to start the others; the others refuse to start without one."""
    try:
        token = env_token()
    except EnvError as e:
        parser.error(str(e))
    if token is not None:
        return token.hex()
    nodes = _nodes_text(args.nnodes)
    if args.nnodes[1] > 1 and args.node_rank > 0:
        parser.error(f"node {args.node_rank} of {nodes} needs the job token that node 0 printed: "
                     "start it with PYCOLL_JOB_TOKEN=... (or PYCOLL_JOB_TOKEN_FILE=...) in its environment")
    token = draw()
    if args.nnodes[1] > 1:
        _say(f"no PYCOLL_JOB_TOKEN was set, so this job's token is drawn here; start the other nodes with\n"
             f"  PYCOLL_JOB_TOKEN={token.hex()} pycoll run --nnodes {nodes} --node-rank R "
             f"--master-addr {args.master_addr} --master-port "
             f"{args.master_port if args.master_port is not None else MULTINODE_PORT}"
             f"{f' --store-port {args.store_port}' if args.store_port is not None else ''} ...\n"
             "(keep it secret: whoever holds it can join the job)")
    return token.hex()


def _nodes_text(nodes: Tuple[int, int]) -> str:
    """--nnodes as it was written: K, or MIN:MAX."""
    return str(nodes[0]) if nodes[0] == nodes[1] else f"{nodes[0]}:{nodes[1]}"


class _Job:
    """This node's ranks: start them, relay their output, watch them, and tear them all down."""

    def __init__(self, args: argparse.Namespace, cmd: List[str], master_port: int, store_port: int,
                 token: str) -> None:
        self.args, self.cmd, self.token = args, cmd, token
        self.master_port, self.store_port = master_port, store_port
        self.procs: Dict[int, subprocess.Popen] = {}  # global rank -> process
        self.pumps: Dict[int, List[threading.Thread]] = {}
        self.signals: List[int] = []  # signals the launcher received, to forward
        self.quits = 0  # SIGQUITs received: each asks for the live view
        self.trace_dir = args.trace_dir or os.environ.get("PYCOLL_TRACE_DIR") or None
        self.private_trace = self.trace_dir is None  # ours: removed unless the job fails
        if self.trace_dir is None:
            self.trace_dir = tempfile.mkdtemp(prefix="pycoll-trace-")
        os.makedirs(self.trace_dir, exist_ok=True)
        self.failed = False
        self._lost: Dict[int, int] = {}  # --elastic: ranks killed by a signal -> exit code
        self.started = time.monotonic()
        self.restarts: List[str] = []  # --max-restarts: what was restarted, and when
        self.slot_restarts: Dict[int, int] = {}  # slot -> times restarted
        self.finishing = False  # a rank exited 0: the job is ending, nobody is restarted any more
        self.server: Optional[TCPStoreServer] = None  # node 0: the store (newcomers learn there that it ended)

    def run(self) -> int:
        """Start every rank and supervise them; always leaves no rank or rank's child behind."""
        in_main = threading.current_thread() is threading.main_thread()
        previous = {s: signal.signal(s, self._on_signal) for s in _HANDLED_SIGNALS} if in_main else {}
        if in_main:
            previous[signal.SIGQUIT] = signal.signal(signal.SIGQUIT, self._on_quit)
        try:
            for local_rank in range(self.args.nproc):
                rank = self.args.node_rank * self.args.nproc + local_rank
                try:
                    self._spawn(rank, local_rank)
                except OSError as e:
                    _say(f"cannot start rank {rank} ({' '.join(self.cmd)}): {e}")
                    return 1
            return self._supervise()
        finally:
            self._stop()
            for s, handler in previous.items():
                signal.signal(s, handler)
            if self.private_trace and not (self.failed and analysis.dump_ranks(self.trace_dir)):
                shutil.rmtree(self.trace_dir, ignore_errors=True)  # kept only while it holds a failure's dumps

    def _on_signal(self, signum: int, frame: object) -> None:
        self.signals.append(signum)

    def _on_quit(self, signum: int, frame: object) -> None:
        self.quits += 1

    @property
    def joiner(self) -> bool:
        """This node joins a running job (--nnodes MIN:MAX, node rank MIN or more): its ranks are newcomers."""
        return self.args.node_rank >= self.args.nnodes[0]

    def _env(self, rank: int, local_rank: int) -> Dict[str, str]:
        a = self.args
        low, high = a.nnodes
        size = a.nproc * (high if self.joiner else low)  # a newcomer's RANK is its slot: within this size
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(size),
                   LOCAL_RANK=str(local_rank), LOCAL_WORLD_SIZE=str(a.nproc),
                   GROUP_RANK=str(a.node_rank), NODE_RANK=str(a.node_rank),
                   MASTER_ADDR=a.master_addr, MASTER_PORT=str(self.master_port),
                   PYCOLL_STORE_PORT=str(self.store_port), PYCOLL_TRACE_DIR=self.trace_dir,
                   PYTHONUNBUFFERED="1")
        env.pop("PYCOLL_STORE_HOSTED", None)  # that says "pycoll's store is at MASTER_PORT": not ours
        env["PYCOLL_JOB_TOKEN"] = self.token
        env.pop("PYCOLL_JOB_TOKEN_FILE", None)
        if a.elastic:
            env.setdefault("PYCOLL_TCP_HEARTBEAT", "10")  # ranks cut off by a partition count as dead
            restarts = self.slot_restarts.get(rank, 0)
            env["PYCOLL_RESTART_COUNT"] = str(restarts)
            env["PYCOLL_NEWCOMER"] = "1" if restarts or self.joiner else "0"
        return env

    def _spawn(self, rank: int, local_rank: int) -> None:
        proc = subprocess.Popen(self.cmd, env=self._env(rank, local_rank), stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        if rank in self.pumps:  # a restart: the previous process's output is drained first
            self._join_output(rank)
        self.procs[rank] = proc
        prefix = f"[rank {rank}] ".encode()
        self.pumps[rank] = [threading.Thread(target=_pump, args=(src, dst, prefix), daemon=True,
                                             name=f"pycoll-run-rank{rank}")
                            for src, dst in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr))]
        for t in self.pumps[rank]:
            t.start()

    def _supervise(self) -> int:
        """Wait for every rank; the first failure, a signal or the timeout ends the job."""
        deadline = None if self.args.timeout is None else time.monotonic() + self.args.timeout
        running = dict(self.procs)
        seen, moved, looked = analysis.progress(self.trace_dir), time.monotonic(), 0.0
        while running:
            if self.quits:
                self.quits = 0
                self._live_view("SIGQUIT")
            if self.signals:
                signum = self.signals[0]
                _say(f"received {signal.Signals(signum).name}; stopping all ranks")
                self._stop(signum)
                return 128 + signum
            ended = {rank: code for rank, code in ((r, p.poll()) for r, p in running.items()) if code is not None}
            for rank in ended:
                del running[rank]
            if self.args.elastic:
                if any(c == 0 for c in ended.values()) and not self.finishing:
                    self._finish()
                if self.args.max_restarts:
                    ended, code = self._restart(ended, running)
                    if code is not None:
                        return code
                self._lost.update({r: c for r, c in ended.items() if c < 0})
                for rank in sorted(r for r, c in ended.items() if c < 0):
                    _say(f"rank {rank} (pid {self.procs[rank].pid}) was killed by signal {_signal_name(-ended[rank])}; "
                         f"the others go on (--elastic) [at {self._elapsed()}]")
                ended = {r: c for r, c in ended.items() if c >= 0}
            failed = sorted((rank for rank, code in ended.items() if code != 0),
                            key=lambda rank: (ended[rank] > 0, rank))  # a killed rank is the likelier cause
            if failed:
                return self._fail(failed[0], ended[failed[0]], failed[1:])
            if deadline is not None and time.monotonic() >= deadline:
                _say(f"the job ran past --timeout {self.args.timeout:g} s; killing all ranks")
                self._post_mortem()
                self._stop()
                return TIMEOUT_EXIT
            now = time.monotonic()
            if self.args.hang_timeout is not None and now - looked >= _PROGRESS_POLL_S:
                looked, snapshot = now, analysis.progress(self.trace_dir)
                if snapshot != seen:
                    seen, moved = snapshot, now
                elif now - moved >= self.args.hang_timeout:
                    self._live_view(f"no rank entered or completed a pycoll call for --hang-timeout "
                                    f"{self.args.hang_timeout:g} s")
                    self._post_mortem()
                    _say("stopping all ranks")
                    self._stop()
                    return TIMEOUT_EXIT
            time.sleep(_POLL_S)
        if self._lost and len(self._lost) == len(self.procs):
            _say("every rank was killed; nobody survived (--elastic)")
            return 1
        return 0

    def _elapsed(self) -> str:
        return f"{time.monotonic() - self.started:.2f} s"

    def _restart(self, ended: Dict[int, int], running: Dict[int, subprocess.Popen]
                 ) -> Tuple[Dict[int, int], Optional[int]]:
        """--max-restarts: start each failed rank of `ended` again in its slot, as a newcomer, while
        restarts are left and no rank has finished; (the ranks still to judge, None), or (_, the job's
        exit code) once a failure finds the restarts spent."""
        failed = sorted(r for r, c in ended.items() if c != 0)
        if self.finishing or not failed:
            return ended, None
        for rank in failed:
            code = ended[rank]
            how = f"was killed by signal {_signal_name(-code)}" if code < 0 else f"exited with code {code}"
            pid = self.procs[rank].pid
            if len(self.restarts) >= self.args.max_restarts:
                done = "; ".join(self.restarts)
                _say(f"rank {rank} (pid {pid}) {how} [at {self._elapsed()}]: --max-restarts {self.args.max_restarts} "
                     f"exhausted ({done}); ending the job")
                return ended, self._fail(rank, code, [])
            self.slot_restarts[rank] = self.slot_restarts.get(rank, 0) + 1
            self.restarts.append(f"rank {rank} {how} at {self._elapsed()}")
            local_rank = rank - self.args.node_rank * self.args.nproc
            try:
                self._spawn(rank, local_rank)
            except OSError as e:
                _say(f"cannot restart rank {rank} ({' '.join(self.cmd)}): {e}")
                return ended, self._fail(rank, code, [])
            running[rank] = self.procs[rank]
            _say(f"rank {rank} (pid {pid}) {how} [at {self._elapsed()}]; restarted it as a newcomer (pid "
                 f"{self.procs[rank].pid}, restart {len(self.restarts)} of --max-restarts {self.args.max_restarts}): "
                 "it joins at the others' next grow")
        return {r: c for r, c in ended.items() if r not in failed}, None

    def _finish(self) -> None:
        """A rank finished: the job is ending. No rank is restarted any more, and newcomers still waiting
        to be admitted are told so through the store (they exit 0: pycoll.JobEnded)."""
        self.finishing = True
        if self.server is not None:
            self.server.put(CLOSED_KEY, f"a rank exited 0 at {self._elapsed()} of `pycoll run`".encode())

    def _live_view(self, why: str) -> None:
        """Print each rank's progress from its live file (the ranks are not disturbed)."""
        _say(f"{why}: each rank's last pycoll calls (from {self.trace_dir}):")
        for line in analysis.live_view(self.trace_dir, sorted(self.procs)):
            _say(f"  {line}")

    def _post_mortem(self) -> None:
        """Have every live rank with a flight recorder dump it (SIGUSR1), wait for the dumps (at most
        DUMP_WAIT_S), and print the verdict on them; the job is ended afterwards."""
        self.failed = True
        asked = time.time()
        live_files = {r for r in self.procs if os.path.exists(os.path.join(self.trace_dir, f"rank{r}.live"))}
        waiting = [r for r in sorted(live_files) if self.procs[r].poll() is None]
        for r in waiting:  # only ranks with a live file: they installed the SIGUSR1 handler
            try:
                os.kill(self.procs[r].pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + DUMP_WAIT_S
        while waiting and time.monotonic() < deadline:
            dumped = analysis.dump_ranks(self.trace_dir)
            waiting = [r for r in waiting if dumped.get(r, 0) < asked - 1 and self.procs[r].poll() is None]
            time.sleep(_POLL_S)
        if waiting:
            _say(f"{'rank' if len(waiting) == 1 else 'ranks'} {waiting} wrote no dump within {DUMP_WAIT_S:g} s")
        try:
            verdict = analysis.analyse(*analysis.load(self.trace_dir))
        except analysis.TraceError:
            return  # no rank used pycoll: nothing to say
        for line in analysis.render(verdict).splitlines():
            _say(line)
        _say(f"flight-recorder dumps are in {self.trace_dir} (pycoll trace {self.trace_dir} --chrome out.json "
             "draws them)")

    def _fail(self, rank: int, code: int, others: List[int]) -> int:
        """Report rank `rank`'s failure (and others that ended with it), stop the job, return its code."""
        self._join_output(rank)  # its last words (a traceback) come before our verdict
        how = f"was killed by signal {_signal_name(-code)}" if code < 0 else f"exited with code {code}"
        also = f" (ranks {others} failed at the same time)" if others else ""
        _say(f"rank {rank} (pid {self.procs[rank].pid}) {how}{also}; stopping all ranks")
        self._post_mortem()
        self._stop()
        return code if code > 0 else 128 - code

    def _stop(self, first: int = signal.SIGTERM) -> None:
        """Send `first` to live ranks, SIGKILL after GRACE_S, then SIGKILL every rank's group."""
        live = [p for p in self.procs.values() if p.poll() is None]
        for proc in live:
            _killpg(proc.pid, first)
        deadline = time.monotonic() + GRACE_S
        for proc in live:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for proc in self.procs.values():  # leftovers: ranks past the grace and their children
            _killpg(proc.pid, signal.SIGKILL)
        for proc in self.procs.values():
            proc.wait()
        for rank in self.procs:
            self._join_output(rank)

    def _join_output(self, rank: int) -> None:
        for t in self.pumps[rank]:
            t.join(timeout=2.0)


def _free_port(host: str) -> int:
    """A TCP port nothing listens on now, on the interfaces torch's store will bind (`host`)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _killpg(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass  # the group is already gone


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return str(signum)


def _pump(src: IO[bytes], dst: IO[str], prefix: bytes) -> None:
    """Copy a rank's pipe to our stream line by line, each line prefixed and written whole."""
    with src:
        for line in iter(src.readline, b""):
            _write(dst, prefix + (line if line.endswith(b"\n") else line + b"\n"))


def _write(stream: IO[str], data: bytes) -> None:
    with _OUTPUT_LOCK:
        try:
            raw = getattr(stream, "buffer", None)
            if raw is not None:
                raw.write(data)
                raw.flush()
            else:  # a text-only stream, e.g. one that pytest substituted
                stream.write(data.decode(errors="replace"))
                stream.flush()
        except (OSError, ValueError):
            pass  # our own output is gone (closed pipe); keep draining so no rank blocks on it


def _say(message: str) -> None:
    """Print a launcher message on stderr, in whole lines like the ranks' output."""
    _write(sys.stderr, f"pycoll run: {message}\n".encode())
