"""`pycoll env`: every PYCOLL_* variable's value here (validated as pycoll.init() would), or the
README's environment tables (`--markdown`; `--readme README.md` rewrites them in place)."""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from .. import config
from ..errors import EnvError


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="pycoll env", description=__doc__)
    ap.add_argument("--markdown", action="store_true", help="print the README tables")
    ap.add_argument("--readme", metavar="PATH", help="regenerate the tables between the markers in PATH")
    args = ap.parse_args(argv)
    if args.markdown:
        print(config.markdown_table() + "\n\n" + config.markdown_table(test=True))
    elif args.readme:
        with open(args.readme) as fh:
            text = fh.read()
        with open(args.readme, "w") as fh:
            fh.write(config.render_readme(text))
    else:
        try:
            values = config.load()
        except EnvError as e:
            print(f"pycoll env: {e}", file=sys.stderr)
            return 2
        for name, value in values.items():
            var = config.REGISTRY[name]
            shown = "unset" if value is None else "(hidden)" if var.secret else value
            print(f"{name}={shown}{'' if value == var.parse(None) else '  (set)'}")
    return 0
