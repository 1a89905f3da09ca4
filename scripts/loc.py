"""Line counts of the product code (rl_core, flows, tasks, grpoflow, environments): per
package, in all, and the largest files; ``--max-file N`` / ``--max-total N`` fail (exit 1)
past a bound (``make test`` checks the per-file bound; docs/architecture.md)."""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("rl_core", "flows", "tasks", "grpoflow", "environments")


def counts() -> dict[str, int]:
    """Lines (``wc -l``) of every product ``.py`` file, by path relative to the repository."""
    return {str(p.relative_to(ROOT)): len(p.read_bytes().splitlines())
            for top in PRODUCT for p in sorted((ROOT / top).rglob("*.py"))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-file", type=int, help="fail if a file has more lines")
    ap.add_argument("--max-total", type=int, help="fail if the product has more lines")
    ap.add_argument("--top", type=int, default=10, help="largest files to list")
    args = ap.parse_args(argv)
    lines = counts()
    by_package: Counter[str] = Counter()
    for path, n in lines.items():
        parts = path.split("/")
        by_package[parts[0] if parts[0] != "rl_core" or len(parts) == 2 else "/".join(parts[:2])] += n
    for package, n in sorted(by_package.items()):
        print(f"{n:7d}  {package}")
    total = sum(lines.values())
    print(f"{total:7d}  total ({len(lines)} files)")
    print("largest files:")
    for path, n in sorted(lines.items(), key=lambda kv: -kv[1])[: args.top]:
        print(f"{n:7d}  {path}")
    failed = False
    if args.max_file and (over := {p: n for p, n in lines.items() if n > args.max_file}):
        print(f"files over {args.max_file} lines: {over}", file=sys.stderr)
        failed = True
    if args.max_total and total > args.max_total:
        print(f"the product has {total} lines, over {args.max_total}", file=sys.stderr)
        failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
