"""`pycoll info` as a job of one rank (no launcher, or a launcher's job of one): the tuner's table models
this host with one rank per core (or the --hosts/--ppn given) and says so on the line above it, instead
of pricing one rank that sends nothing (a table of zeros)."""
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Tuple

import pytest

from pycoll.cli.info import main

REPO = Path(__file__).resolve().parent.parent
LAUNCHER_VARS = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "OMPI_COMM_WORLD_SIZE",
                 "SLURM_NTASKS", "PYCOLL_TOPO_FILE")
CELL = re.compile(r"^(\d+(?:\.\d+)?)(us|ms|s)(\*?)$")
UNIT = {"us": 1e-6, "ms": 1e-3, "s": 1.0}


def info(*args: str, **env: str) -> subprocess.CompletedProcess:
    """`python -m pycoll info ARGS` with no launcher's variables in its environment (but `env`)."""
    clean = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    return subprocess.run([sys.executable, "-m", "pycoll", "info", *args], capture_output=True, text=True,
                          cwd=REPO, timeout=50, env={**clean, **env})


def table(out: str) -> Tuple[str, str, Dict[Tuple[str, str], List[Tuple[float, bool]]]]:
    """(the line above the tuner table, the table's first line, {(collective, algorithm): [(seconds,
    picked)] per size}); an algorithm that cannot run a size ("-") is left out of its row."""
    lines = out.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("tuner ("))
    assert lines[first + 1].split()[:2] == ["collective", "algorithm"], lines[first + 1]
    rows: Dict[Tuple[str, str], List[Tuple[float, bool]]] = {}
    for line in lines[first + 2:]:
        coll, algo, *cells = line.split()
        parsed = [CELL.match(c) for c in cells if c.rstrip("*") != "-"]
        assert all(parsed), f"a cell that is no time: {line}"
        rows[(coll, algo)] = [(float(m[1]) * UNIT[m[2]], bool(m[3])) for m in parsed]
    return lines[first - 1], lines[first], rows


def check_priced(rows: Dict[Tuple[str, str], List[Tuple[float, bool]]], collectives: List[str]) -> None:
    """Every time is positive and every collective has a pick per size."""
    assert {coll for coll, _ in rows} == set(collectives)
    assert all(t > 0 for cells in rows.values() for t, _ in cells), rows
    for coll in collectives:
        picks = sum(picked for (c, _), cells in rows.items() if c == coll for _, picked in cells)
        assert picks == 3, f"{coll}: {picks} picks for 3 sizes"


@pytest.mark.timeout(60)
def test_alone_models_this_host_one_rank_per_core():
    out = info("--sizes", "8,1M,64M", "--collective", "allreduce", "--collective", "broadcast")
    assert out.returncode == 0, out.stderr
    ranks = max(2, os.cpu_count() or 0)
    note, head, rows = table(out.stdout)
    assert note.startswith("a rank alone sends nothing, so the table models this host with one rank per core: "
                           f"{ranks} ranks"), note
    assert head.endswith(f"; {ranks} ranks on 1 hosts"), head
    check_priced(rows, ["allreduce", "broadcast"])
    assert "this rank: host id" in out.stdout and f"({ranks} ranks: " in out.stdout  # the matrix of the model
    # a launcher's job of one rank is alone too
    one = info("--sizes", "8,1M,64M", "--collective", "allreduce", "--collective", "broadcast", WORLD_SIZE="1")
    assert one.returncode == 0, one.stderr
    assert table(one.stdout)[:2] == (note, head)


@pytest.mark.timeout(60)
def test_alone_with_hosts_and_ppn_models_them():
    out = info("--hosts", "2", "--ppn", "2", "--sizes", "8,64K,16M")
    assert out.returncode == 0, out.stderr
    note, head, rows = table(out.stdout)
    assert note == ("a rank alone sends nothing, so the table models 4 ranks on 2 hosts "
                    "(--hosts 2 --ppn 2, rank i on host i mod 2)"), note
    assert head.endswith("; 4 ranks on 2 hosts") and "NET" in out.stdout
    check_priced(rows, sorted({coll for coll, _ in rows}))
    assert len({coll for coll, _ in rows}) == 5 and ("allreduce", "hierarchical") in rows
    # --ppn alone: one host of that many ranks
    ppn = info("--ppn", "3", "--sizes", "8,64K,16M", "--collective", "reduce")
    assert ppn.returncode == 0, ppn.stderr
    note, head, rows = table(ppn.stdout)
    assert "models 3 ranks on 1 hosts (--hosts 1 --ppn 3" in note and head.endswith("; 3 ranks on 1 hosts")
    check_priced(rows, ["reduce"])


@pytest.mark.parametrize("args, message", [
    (("--hosts", "1", "--ppn", "1"), "--hosts 1 --ppn 1 models one rank, which sends nothing"),
    (("--hosts", "1"), "--hosts 1 --ppn 1 models one rank, which sends nothing"),
    (("--ppn", "0"), "--ppn must be at least 1 (got 0)"),
    (("--hosts", "-2", "--ppn", "4"), "--hosts must be at least 1 (got -2)"),
])
def test_a_model_of_fewer_than_two_ranks_is_refused(args, message, monkeypatch, capsys):
    for var in LAUNCHER_VARS:
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(SystemExit) as exit:
        main(list(args))
    out = capsys.readouterr()
    assert exit.value.code == 2 and message in out.err and "tuner (" not in out.out, out.err
