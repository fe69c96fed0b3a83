"""Run torch's own DistributedTest suite against a backend (pycoll or gloo), one subset per call.

torch ships the suite (torch/testing/_internal/distributed/distributed_test.py) but not its driver, which
accepts only gloo/nccl/ucc. This driver registers pycoll, declares it a plugin with the ddp and subgroup
features, and - with ``--lift-gloo-gates`` - treats it like gloo wherever the suite gates a test on the
*name* "gloo" (``BACKEND != "gloo"``, ``require_backend_is_available({"gloo"})``), so those tests run on
pycoll instead of silently skipping. Results go to a JSON file: one record per test (passed / failed /
skipped, with the reason), which tests/test_torch_suite.py compares between backends.

    BACKEND is set from --backend; WORLD_SIZE from --world-size; TEMP_DIR is made here.
    python tests/torch_suite/runner.py --backend pycoll --world-size 2 --json out.json test_a test_b
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import re
import sys
import tempfile
import time
import types
import unittest

SUITE = "torch.testing._internal.distributed.distributed_test"
LIFT_ENV = "TORCH_SUITE_LIFT_GLOO_GATES"  # set by main(), inherited by the spawned ranks


def _gloo_like_source(src: str) -> tuple[str, int]:
    """Rewrite the suite's name-only gates so that BACKEND 'pycoll' passes them like 'gloo' (and like
    'mpi' for CPU all_to_all); returns the new source and how many gates were rewritten."""
    rules = [
        (r'BACKEND != "gloo"', 'BACKEND not in _GLOO_LIKE'),
        (r'BACKEND == "gloo"', 'BACKEND in _GLOO_LIKE'),
        (r'require_backend_is_available\(\{"gloo"\}\)', 'require_backend_is_available(set(_GLOO_LIKE))'),
        # CPU all_to_all(_single) is gated on the name "mpi"; pycoll implements both (gloo keeps skipping)
        (r'BACKEND != "mpi", "Only MPI supports (CPU )?all_to_all', lambda m: m.group(0).replace(
            'BACKEND != "mpi"', 'BACKEND not in ("mpi", "pycoll")')),
    ]
    count = 0
    for pattern, repl in rules:
        src, n = re.subn(pattern, repl, src)
        count += n
    return src, count


def load_suite() -> types.ModuleType:
    """Import distributed_test for the backend in $BACKEND (gates lifted when $TORCH_SUITE_LIFT_GLOO_GATES=1)."""
    backend = os.environ["BACKEND"]
    if backend == "pycoll":
        import pycoll.torch  # noqa: F401  registers the backend before the suite's decorators run
    from torch.testing._internal.common_distributed import DistTestCases

    if backend not in ("gloo", "nccl", "ucc", "mpi"):
        # "gpu" gates 33 CPU tests (DDP, object collectives) that gloo runs here on CPU: a misnomer,
        # nothing in them touches a GPU unless CUDA is available; "cuda" stays gloo/nccl/ucc only
        for feature in ("plugin", "ddp", "subgroup", "gpu"):
            DistTestCases.backend_feature[feature].add(backend)
    if os.environ.get(LIFT_ENV) != "1":
        return importlib.import_module(SUITE)
    spec = importlib.util.find_spec(SUITE)
    assert spec is not None and spec.origin is not None, f"{SUITE} is not in this torch wheel"
    with open(spec.origin) as f:
        src, _ = _gloo_like_source(f.read())
    module = types.ModuleType(SUITE)
    module.__file__ = spec.origin
    module._GLOO_LIKE = ("gloo", backend)
    sys.modules[SUITE] = module
    exec(compile(src, spec.origin, "exec", dont_inherit=True), module.__dict__)  # no __future__ of ours
    return module


def _setup_env(args: argparse.Namespace) -> None:
    os.environ["BACKEND"] = args.backend
    os.environ["WORLD_SIZE"] = str(args.world_size)
    os.environ[LIFT_ENV] = "1" if args.lift_gloo_gates else "0"
    if "TEMP_DIR" not in os.environ:
        tmp = tempfile.mkdtemp(prefix="pycoll-suite-")
        for sub in ("barrier", "test_dir", "init_dir"):
            os.makedirs(os.path.join(tmp, sub))
        os.environ["TEMP_DIR"] = tmp
    os.environ.setdefault("INIT_METHOD", "env://")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="pycoll")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--no-lift", dest="lift_gloo_gates", action="store_false",
                   help="run the suite as torch wrote it (gloo-named tests skip on pycoll)")
    p.add_argument("--list", action="store_true", help="print the test names and exit")
    p.add_argument("--json", help="write one record per test here")
    p.add_argument("tests", nargs="*", help="test method names (default: all)")
    return p.parse_args(argv)


if __name__ in ("__main__", "__mp_main__"):
    if __name__ == "__main__":
        _ARGS = _parse(None)
        _setup_env(_ARGS)
    _suite = load_suite()
    from torch.testing._internal.distributed.distributed_test import TestDistBackend  # noqa: E402

    class TestDistBackendWithSpawn(TestDistBackend, _suite.DistributedTest._DistTestBase):
        """The suite's test base, each test spawned as WORLD_SIZE fresh ranks (as torch's own driver does)."""

        def setUp(self) -> None:
            super().setUp()
            self._spawn_processes()


class _Recorder(unittest.TextTestResult):
    """Keeps one record per test: outcome, seconds, and the reason or the tail of the traceback."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.records: dict[str, dict] = {}
        self._t0 = 0.0

    def startTest(self, test) -> None:
        self._t0 = time.monotonic()
        super().startTest(test)

    def _put(self, test, outcome: str, detail: str = "") -> None:
        name = test.id().split(".")[-1]
        self.records[name] = {"outcome": outcome, "seconds": round(time.monotonic() - self._t0, 2),
                              "detail": detail[-3000:]}
        if _ARGS.json:  # after every test, so a run cut short still says how far it got
            with open(_ARGS.json + ".tmp", "w") as f:
                json.dump({"backend": _ARGS.backend, "world_size": _ARGS.world_size,
                           "lifted_gloo_gates": _ARGS.lift_gloo_gates, "tests": self.records}, f, indent=1)
            os.replace(_ARGS.json + ".tmp", _ARGS.json)

    def addSuccess(self, test) -> None:
        super().addSuccess(test)
        self._put(test, "passed")

    def addFailure(self, test, err) -> None:
        super().addFailure(test, err)
        self._put(test, "failed", self._exc_info_to_string(err, test))

    def addError(self, test, err) -> None:
        super().addError(test, err)
        self._put(test, "failed", self._exc_info_to_string(err, test))

    def addSkip(self, test, reason) -> None:
        super().addSkip(test, reason)
        self._put(test, "skipped", str(reason))


def main() -> int:
    cls = TestDistBackendWithSpawn
    names = sorted(n for n in dir(cls) if n.startswith("test_"))
    if _ARGS.list:
        print("\n".join(names))
        return 0
    wanted = _ARGS.tests or names
    unknown = [t for t in wanted if t not in names]
    if unknown:
        print(f"unknown tests: {unknown}", file=sys.stderr)
        return 2
    suite = unittest.TestSuite(cls(t) for t in wanted)
    runner = unittest.TextTestRunner(resultclass=_Recorder, verbosity=2)
    result = runner.run(suite)
    return 0 if result.wasSuccessful() else 1


if __name__ == "__main__":
    sys.exit(main())
