"""The `pycoll` command: `pycoll run`, `pycoll bench`, `pycoll info`, `pycoll env`, `pycoll trace`, `pycoll predict`."""
from __future__ import annotations

import importlib
import sys
from typing import List, Optional

_COMMANDS = {
    "run": ("pycoll.cli.run", "start N local ranks of a script with the torchrun variables set"),
    "bench": ("pycoll.cli.bench", "nccl-tests-style benchmark, optionally beside Open MPI and Gloo"),
    "info": ("pycoll.cli.info", "topology (like nvidia-smi topo -m) and the tuner's table"),
    "env": ("pycoll.cli.env", "every PYCOLL_* variable's value here, or the README's tables of them"),
    "trace": ("pycoll.cli.trace", "read a job's flight-recorder dumps: which rank and call hung or failed"),
    "predict": ("pycoll.cli.predict", "a training step's time on H hosts from a recorded workload, and why"),
}


def main(argv: Optional[List[str]] = None) -> int:
    """Dispatch `pycoll <command> ...` to the module that implements the command."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in _COMMANDS:
        lines = [f"  {name:<6} {doc}" for name, (_, doc) in _COMMANDS.items()]
        print("usage: pycoll <command> [args...]\n\ncommands:\n" + "\n".join(lines),
              file=sys.stderr if argv and argv[0] not in ("-h", "--help") else sys.stdout)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    module = importlib.import_module(_COMMANDS[argv[0]][0])
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
