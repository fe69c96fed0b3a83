"""The PYCOLL_* registry (pycoll/config.py): every name in the code is declared and in the README,
the README tables are the generated ones, values are parsed and checked, overrides are logged,
and pycoll.init() fails on a bad value naming it."""
import glob
import logging
import math
import os
import re

import pytest

from multiproc import run_ranks
from pycoll import config
from pycoll.cli import env as env_cli
from pycoll.errors import EnvError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAME = re.compile(r"PYCOLL_[A-Z0-9_]+")


def _read(path):
    with open(path, errors="replace") as fh:
        return fh.read()


def _names_in(patterns, skip=()):
    """{PYCOLL_* name: files it appears in} over the files matching `patterns` under ROOT."""
    found = {}
    for pattern in patterns:
        for path in glob.glob(os.path.join(ROOT, pattern), recursive=True):
            rel = os.path.relpath(path, ROOT)
            if os.path.isfile(path) and rel not in skip:
                for name in NAME.findall(_read(path)):
                    found.setdefault(name, set()).add(rel)
    return found


PACKAGE = ["pycoll/**/*.py"]
EVERYWHERE = PACKAGE + ["tests/**/*", ".ci/*", "docs/**/*.md", "docs/**/*.py", "examples/**/*", "README.md"]
THIS = os.path.relpath(__file__, ROOT)  # names some bad ones on purpose


# -- the registry and the code agree ---------------------------------------------------------
def test_readme_tables_are_the_generated_ones():
    readme = _read(os.path.join(ROOT, "README.md"))
    assert config.render_readme(readme) == readme, "README is stale: run `pycoll env --readme README.md`"


def test_every_name_in_the_code_is_declared():
    undeclared = {n: sorted(f) for n, f in _names_in(EVERYWHERE, skip={THIS}).items() if n not in config.REGISTRY}
    assert not undeclared, f"declare these in pycoll/config.py: {undeclared}"


def test_the_package_reads_no_test_variable():
    inside = _names_in(PACKAGE, skip={"pycoll/config.py"})
    assert not [n for n in inside if config.REGISTRY[n].test]


def test_every_declared_name_is_used_and_in_its_readme_table():
    used = _names_in(EVERYWHERE, skip={THIS, "pycoll/config.py", "README.md"})
    assert sorted(set(config.REGISTRY) - set(used)) == [], "declared but never read: drop them"
    for test in (False, True):
        table = config.markdown_table(test)
        for var in config.REGISTRY.values():
            assert (f"| `{var.name}` |" in table) == (var.test == test)


def test_choices_and_limits_match_the_code():
    from pycoll.transports import NAMES
    from pycoll.transports.verbs import PREFIX
    accepts = config.REGISTRY["PYCOLL_TRANSPORT"].kind.accepts
    assert sorted(accepts[len("one of "):].split(", ")) == sorted(NAMES)
    slot = config.REGISTRY["PYCOLL_VERBS_SLOT"]
    assert slot.parse(str(PREFIX + 64)) == PREFIX + 64
    with pytest.raises(EnvError):
        slot.parse(str(PREFIX + 63))
    assert f"less a {PREFIX}-byte prefix" in slot.doc


# -- parsing -----------------------------------------------------------------------------------
@pytest.mark.parametrize("name, bad, accepts", [
    ("PYCOLL_TIMEOUT", "abc", "a number > 0"),
    ("PYCOLL_TIMEOUT", "0", "a number > 0"),
    ("PYCOLL_TIMEOUT", "inf", "a number > 0"),
    ("PYCOLL_TRANSPORT", "carrier-pigeon", "one of auto, tcp, shm, mpi, verbs"),
    ("PYCOLL_SHM_RING", "-5", "a byte count >= 0"),
    ("PYCOLL_TCP_BULK_THRESHOLD", "12Q", "or inf"),
    ("PYCOLL_TCP_IO_THREADS", "0", "an integer >= 1"),
    ("PYCOLL_VERBS_ACK_TIMEOUT", "32", "an integer from 0 to 31"),
    ("PYCOLL_IB_GID_INDEX", "one", "an integer >= 0"),
    ("PYCOLL_STORE_HOSTED", "yes", "0 or 1"),
    ("PYCOLL_STORE_PORT", "0", "an integer from 1 to 65535"),
    ("PYCOLL_DEBUG", "verbose", "one of WARN, INFO, TRACE, DETAIL"),
])
def test_bad_values_name_the_variable_the_value_and_what_it_takes(name, bad, accepts):
    for call in (lambda: config.get(name, {name: bad}), lambda: config.load({name: bad})):
        with pytest.raises(EnvError) as err:
            call()
        assert f"{name}={bad!r}" in str(err.value) and accepts in str(err.value)


def test_load_reports_every_bad_value_at_once():
    with pytest.raises(EnvError) as err:
        config.load({"PYCOLL_TIMEOUT": "abc", "PYCOLL_SHM_RING": "-5"})
    assert "PYCOLL_TIMEOUT='abc'" in str(err.value) and "PYCOLL_SHM_RING='-5'" in str(err.value)


def test_a_secret_is_never_shown():
    with pytest.raises(EnvError) as err:
        config.load({"PYCOLL_JOB_TOKEN": "not-hex-s3cret"})
    assert "PYCOLL_JOB_TOKEN" in str(err.value) and "s3cret" not in str(err.value)


@pytest.mark.parametrize("name, text, value", [
    ("PYCOLL_TRANSPORT", " TCP ", "tcp"),
    ("PYCOLL_DEBUG", "detail", "DETAIL"),
    ("PYCOLL_TIMEOUT", "2.5", 2.5),
    ("PYCOLL_SHM_RING", "1M", 1 << 20),
    ("PYCOLL_TCP_LOCAL_SNDBUF", "256KiB", 256 << 10),
    ("PYCOLL_TCP_BULK_THRESHOLD", "inf", math.inf),
    ("PYCOLL_TCP_COPY_THRESHOLD", "1000", 1000),
    ("PYCOLL_STORE_HOSTED", "1", True),
    ("PYCOLL_STORE_PORT", "29501", 29501),
    ("PYCOLL_JOB_TOKEN", "abCD", b"\xab\xcd"),
    ("PYCOLL_TUNER_CACHE", "off", "off"),
    ("PYCOLL_TOPO_FILE", "~/topo.json", os.path.expanduser("~/topo.json")),
    ("PYCOLL_TIMEOUT", "  ", 300.0),  # blank: the default
])
def test_values(name, text, value):
    assert config.get(name, {name: text}) == value


def test_defaults_round_trip():
    for var in config.REGISTRY.values():
        unset = config.get(var.name, {})
        assert unset == var.parse(None)
        if var.default is not None:
            assert config.get(var.name, {var.name: var.default}) == unset
            assert f"`{var.default}`" in config.markdown_table(var.test)
    assert config.load({}) == {n: v.parse(None) for n, v in config.REGISTRY.items() if not v.test}


def test_get_reads_the_environment_when_called(monkeypatch):
    monkeypatch.setenv("PYCOLL_TIMEOUT", "7")
    assert config.get("PYCOLL_TIMEOUT") == 7.0
    monkeypatch.delenv("PYCOLL_TIMEOUT")
    assert config.get("PYCOLL_TIMEOUT") == 300.0


def test_an_undeclared_name_is_a_programming_error():
    with pytest.raises(KeyError, match="not declared"):
        config.get("PYCOLL_NO_SUCH_THING")


def test_the_transport_reads_its_settings_when_built(monkeypatch):
    from pycoll.transports.tcp import TcpTransport
    monkeypatch.setenv("PYCOLL_TCP_BULK_THRESHOLD", "inf")
    monkeypatch.setenv("PYCOLL_TCP_COPY_THRESHOLD", "1K")
    tr = TcpTransport(0, 1, "127.0.0.1")
    try:
        assert (tr._bulk_threshold, tr._copy_threshold) == (math.inf, 1024)
    finally:
        tr.close()


# -- logging -------------------------------------------------------------------------------------
def test_overrides_are_logged_at_info_and_strangers_warned_of(caplog, monkeypatch):
    monkeypatch.setenv("PYCOLL_DEBUG", "INFO")  # (pycoll's INFO lines only when asked for: logutil)
    caplog.set_level(logging.INFO, logger="pycoll.config")
    config.load({"PYCOLL_TIMEOUT": "30", "PYCOLL_TRANSPORT": "auto", "PYCOLL_JOB_TOKEN": "abcd",
                 "PYCOLL_TRANSPOT": "tcp"})
    info = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert info == ["PYCOLL_TIMEOUT=30 (default: 300)", "PYCOLL_JOB_TOKEN=(hidden) (default: unset)"]
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warned == ["PYCOLL_TRANSPOT is not a pycoll variable (did you mean PYCOLL_TRANSPORT?)"]
    assert all(r.name == "pycoll.config" for r in caplog.records)


# -- `pycoll env` ----------------------------------------------------------------------------------
def test_pycoll_env_prints_values_tables_and_rewrites_a_readme(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("PYCOLL_TIMEOUT", "30")
    assert env_cli.main([]) == 0
    out = capsys.readouterr().out
    assert "PYCOLL_TIMEOUT=30.0  (set)\n" in out and "PYCOLL_TRANSPORT=auto\n" in out and "PYCOLL_ALGO=unset\n" in out
    monkeypatch.setenv("PYCOLL_TIMEOUT", "soon")
    assert env_cli.main([]) == 2
    assert "pycoll env: PYCOLL_TIMEOUT='soon' is not valid" in capsys.readouterr().err
    assert env_cli.main(["--markdown"]) == 0
    assert capsys.readouterr().out == config.markdown_table() + "\n\n" + config.markdown_table(test=True) + "\n"
    readme = tmp_path / "README.md"
    readme.write_text("a\n<!-- env-table:start -->\nSTALE ROWS\n<!-- env-table:end -->\nb\n"
                      "<!-- test-env-table:start -->\n<!-- test-env-table:end -->\n")
    assert env_cli.main(["--readme", str(readme)]) == 0
    assert readme.read_text() == config.render_readme(readme.read_text())
    assert "STALE ROWS" not in readme.read_text() and "| `PYCOLL_RDMA_VM` |" in readme.read_text()


# -- pycoll.init() ---------------------------------------------------------------------------------
def _never_called(comm):
    raise AssertionError("init() should have failed")


def test_init_fails_on_a_bad_variable_naming_it():
    results = run_ranks(_never_called, 2, env={"PYCOLL_TIMEOUT": "abc"}, expect_fail=True, timeout=60)
    for ok, story in results:
        assert not ok
        assert "EnvError: PYCOLL_TIMEOUT='abc' is not valid: it takes a number > 0" in story, story
