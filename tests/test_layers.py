"""The layers hold: transports and algorithms import nothing from the layers above them, the tuner only goes down,
no module imports another's private names, and a split child is modelled with its own board."""
import ast
from pathlib import Path
from types import SimpleNamespace
from typing import Iterator, Tuple

import pytest

from pycoll.bootstrap.rendezvous import Membership
from pycoll.comm import Communicator
from pycoll.selection import Selector
from pycoll.topology import Topology
from pycoll.transports.capabilities import SharedBoard
from pycoll.tuner import DEFAULT, Tuner

PACKAGE = Path(__file__).resolve().parent.parent / "pycoll"
ABOVE_ALGORITHMS = ("pycoll.tuner", "pycoll.calibration", "pycoll.selection", "pycoll.comm", "pycoll.world",
                    "pycoll.cli")
SLOT, STAGE = 16 << 10, 512 << 10


def imports(path: Path) -> Iterator[Tuple[str, str]]:
    """(module, name) for every import in `path`, relative ones made absolute (name '' for `import x`)."""
    package = ".".join(("pycoll",) + path.relative_to(PACKAGE).parent.parts)
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from ((alias.name, "") for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            yield from ((module, alias.name) for alias in node.names)


def reaches(module: str, name: str, target: str) -> bool:
    """Whether `from module import name` (or `import module`) brings in anything of `target`."""
    return any(m == target or m.startswith(target + ".") for m in (module, f"{module}.{name}"))


@pytest.mark.parametrize("path", sorted((PACKAGE / "algorithms").glob("*.py")), ids=lambda p: p.name)
def test_algorithms_import_nothing_from_the_layers_above(path):
    bad = [(m, n) for m, n in imports(path) for above in ABOVE_ALGORITHMS if reaches(m, n, above)]
    assert not bad, f"{path.name} imports from above the algorithms: {bad}"


@pytest.mark.parametrize("path", sorted((PACKAGE / "transports").glob("*.py")), ids=lambda p: p.name)
def test_transports_import_nothing_from_algorithms_or_above(path):
    """A transport knows ranks, bytes and keys: no algorithm, channel, communicator or tuner."""
    above = ("pycoll.algorithms", "pycoll.channel") + ABOVE_ALGORITHMS
    bad = [(m, n) for m, n in imports(path) for a in above if reaches(m, n, a)]
    assert not bad, f"transports/{path.name} imports from above the transports: {bad}"


def test_the_cost_model_imports_only_downward():
    bad = [(m, n) for m, n in imports(PACKAGE / "tuner.py") for above in ABOVE_ALGORITHMS if reaches(m, n, above)]
    assert not bad


def test_no_module_imports_private_names_of_another():
    bad = [(str(p.relative_to(PACKAGE)), m, n) for p in PACKAGE.rglob("*.py") for m, n in imports(p)
           if n.startswith("_") and not n.startswith("__")]
    assert not bad


def test_a_child_without_a_board_is_modelled_without_one_shot_while_the_world_keeps_its_board():
    one_host = Topology.from_hosts([0] * 4)
    world = Selector("", Tuner(DEFAULT, SLOT, STAGE))
    child = world.for_board(0, 0)
    pair = one_host.subset([0, 2])
    assert child.tuner is not None and child.tuner.params == world.tuner.params
    assert child.choose("allreduce", 8, 2, topo=pair) not in ("oneshot", "twoshot")
    assert world.choose("allreduce", 8, 2, topo=pair) == "oneshot"
    assert world.choose("allreduce", 8, 4, topo=one_host) == "oneshot"
    static = Selector("", board_bytes=SLOT)  # PYCOLL_TUNER=static: the size rules
    assert static.choose("allreduce", 8, 2) == "oneshot"
    assert static.for_board(0, 0).choose("allreduce", 8, 2) == "recursive_doubling"


class FakeBoards(SharedBoard):
    """Boards that reach the ranks on rank 0's host, where every rank claims lane 0."""

    slot_bytes, stage_bytes = SLOT, STAGE

    def __init__(self, hosts):
        self.hosts = hosts

    def reaches(self, members):
        return all(self.hosts[m] == self.hosts[0] for m in members)

    def claim_lane(self, comm_id):
        return 0

    def open(self, comm_id, members, lanes):
        return SimpleNamespace(slot_bytes=SLOT, stage_bytes=STAGE)


class FakeTransport:
    """Rank 0's transport: its peers' lane numbers (0) arrive at once; it offers FakeBoards."""

    name = "auto(shm+tcp)"

    def __init__(self, hosts):
        self.boards = FakeBoards(hosts)

    def offers(self, kind):
        return self.boards if kind is SharedBoard else None

    def isend(self, view, peer, key, code):
        return ("send", peer)

    def irecv(self, view, peer, key, code):
        view[:] = bytes(view.nbytes)
        return ("recv", peer)

    def wait(self, reqs, timeout, what):
        pass


def _world(hosts, monkeypatch):
    """Rank 0 of a communicator over a stand-in transport with boards, calibrated from the model."""
    monkeypatch.setenv("PYCOLL_TUNER", "model")
    monkeypatch.delenv("PYCOLL_ALGO", raising=False)
    mine = [h for h in hosts if h == hosts[0]]
    comm = Communicator(FakeTransport(hosts), range(len(hosts)), 0, "world",
                        Membership(hosts=hosts, local_rank=0, local_size=len(mine)), 10.0)
    comm.calibrate()  # PYCOLL_TUNER=model: no probe, so no peers needed
    return comm


def test_split_children_get_the_board_of_their_own_hosts(monkeypatch):
    world = _world(["a", "a", "b", "b"], monkeypatch)
    assert world.selector.tuner is not None and world.selector.tuner.board_bytes == 0  # spans hosts
    local, spanning = world._child("world.split0.0", [0, 1]), world._child("world.split0.1", [0, 2])
    assert local._board_capacity() == (SLOT, STAGE) and spanning._board_capacity() == (0, 0)
    for child in (local, spanning):
        assert child.selector.tuner.params == world.selector.tuner.params
    assert local.selector.choose("allreduce", 8, 2, topo=local.topology) == "oneshot"
    assert spanning.selector.choose("allreduce", 8, 2, topo=spanning.topology) not in ("oneshot", "twoshot")
    alone = _world(["a"] * 4, monkeypatch)
    assert alone._board_capacity() == (SLOT, STAGE) and alone.selector.tuner.board_bytes == SLOT
    assert alone._child("world.dup0", [0, 1, 2, 3]).selector.tuner.stage_bytes == STAGE
