"""Summarise a test timeline (``GRPOFLOW_TEST_TIMELINE=FILE make test``): per worker, the
busy time, the first start and the last end; per module, its total time; the tail (how long
one worker ran alone at the end); the tests that waited most (wall time minus the CPU time
of the test's process and the children it reaped).

    python scripts/test_timeline.py FILE [--modules N]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file", type=Path)
    ap.add_argument("--modules", type=int, default=25, help="how many modules to list")
    ap.add_argument("--idle", type=int, default=25, help="how many idle tests to list")
    args = ap.parse_args()
    rows = [json.loads(x) for x in args.file.read_text().splitlines() if x.strip()]
    t0 = min(r["start"] for r in rows)
    by_worker: dict[str, list[dict]] = defaultdict(list)
    by_module: dict[str, float] = defaultdict(float)
    module_worker: dict[str, str] = {}
    for r in rows:
        by_worker[r["worker"]].append(r)
        module = r["id"].split("::")[0]
        by_module[module] += r["end"] - r["start"]
        module_worker[module] = r["worker"]
    ends = []
    for worker, rs in sorted(by_worker.items()):
        busy = sum(r["end"] - r["start"] for r in rs)
        first, last = min(r["start"] for r in rs) - t0, max(r["end"] for r in rs) - t0
        ends.append(last)
        print(f"{worker}: {len(rs)} tests, busy {busy:.0f}s, from {first:.0f}s to {last:.0f}s")
    if len(ends) > 1:
        print(f"tail: one worker alone for the last {max(ends) - sorted(ends)[-2]:.0f}s")
    print(f"\nthe {args.modules} longest modules:")
    for module, seconds in sorted(by_module.items(), key=lambda kv: -kv[1])[: args.modules]:
        print(f"  {seconds:7.1f}s  {module_worker[module]}  {module}")
    waited = sorted(((r["end"] - r["start"] - r["cpu"], r) for r in rows if "cpu" in r),
                    key=lambda x: -x[0])  # fmt: skip
    if waited:
        total = sum(w for w, _ in waited if w > 0)
        print(f"\nwaiting (wall - CPU), {total:.0f}s in all; the {args.idle} longest:")
        for w, r in waited[: args.idle]:
            print(f"  {w:6.1f}s of {r['end'] - r['start']:6.1f}s  {r['id']}")


if __name__ == "__main__":
    main()
