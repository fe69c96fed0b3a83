"""Print `pycoll bench --json` results of two transports side by side (out-of-place busbw).

    python tests/rdma/compare_bench.py bench-verbs.json bench-tcp.json
"""
import json
import sys
from typing import Dict, List


def load(path: str) -> Dict[int, dict]:
    with open(path) as fh:
        rows: List[dict] = json.load(fh)
    return {row["size"]: row for row in rows}


def main(paths: List[str]) -> int:
    if len(paths) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    a, b = load(paths[0]), load(paths[1])
    name_a, name_b = (next(iter(t.values()))["transport"] for t in (a, b))
    print(f"| size (B) | {name_a} time (us) | {name_a} busbw (GB/s) | {name_b} time (us) | "
          f"{name_b} busbw (GB/s) | {name_a}/{name_b} |")
    print("|---:|---:|---:|---:|---:|---:|")
    for size in sorted(set(a) & set(b)):
        ra, rb = a[size]["out"], b[size]["out"]
        ratio = ra["busbw"] / rb["busbw"] if rb["busbw"] else float("nan")
        print(f"| {size} | {ra['time_us']:.1f} | {ra['busbw']:.4f} | {rb['time_us']:.1f} | "
              f"{rb['busbw']:.4f} | {ratio:.2f}x |")
    wrong = sum(r[p]["wrong"] for t in (a, b) for r in t.values() for p in ("out", "in"))
    print(f"# wrong results: {wrong}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
