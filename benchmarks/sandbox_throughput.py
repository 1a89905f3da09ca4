"""Throughput of the code sandbox (rl_core/rewards/sandbox.py): hundreds of tiny programs
submitted at once, queued behind ``max_concurrent`` bubblewrap slots.

Each program is a fresh sandbox (namespaces, mounts, limits, a Python start-up) that runs a
few unit tests through the ``code_tests`` harness (:func:`rl_core.rewards.code.run_tests`), as
a code reward or a code environment's step does. All ``--programs`` are submitted together
from as many threads; the table gives, per slot count, the wall time of the lot, programs per
second, the median and 95th-percentile latency (queueing included) and how each run ended.
Writes JSON (default ``benchmarks/results/sandbox_throughput.json``)::

    python -m benchmarks.sandbox_throughput [--programs 200] [--slots 1 2 4 8]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import statistics
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOLUTION = "def add(a, b):\n    return a + b\n"
TESTS = ["assert add(2, 2) == 4", "assert add(1, 2) == 3", "assert add(-1, 1) == 0"]


def _batch(box: object, programs: int) -> dict[str, object]:
    from rl_core.rewards.code import run_tests

    latencies: list[float] = [0.0] * programs
    statuses: list[str] = [""] * programs
    go = threading.Event()

    def one(i: int) -> None:
        go.wait()
        t0 = time.monotonic()
        report = run_tests(SOLUTION, TESTS, sandbox=box)  # type: ignore[arg-type]
        latencies[i] = time.monotonic() - t0
        statuses[i] = report.status if report.all_passed or report.status != "ok" else "failed"

    threads = [threading.Thread(target=one, args=(i,)) for i in range(programs)]
    for t in threads:
        t.start()
    t0 = time.monotonic()
    go.set()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    ordered = sorted(latencies)
    return {"wall_s": round(wall, 3), "per_s": round(programs / wall, 1),
            "p50_s": round(statistics.median(ordered), 3),
            "p95_s": round(ordered[int(0.95 * (programs - 1))], 3),
            "ended": dict(collections.Counter(statuses))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--programs", type=int, default=200, help="programs submitted at once")
    ap.add_argument("--slots", type=int, nargs="+", default=[1, 2, 4, 8],
                    help="max_concurrent values to measure")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/sandbox_throughput.json")
    args = ap.parse_args(argv)

    from rl_core.rewards.sandbox import Sandbox, SandboxLimits

    rows = []
    print(f"{'slots':>5} {'wall s':>7} {'prog/s':>7} {'p50 s':>6} {'p95 s':>6}  ended")
    for slots in args.slots:
        # wall_s covers a start-up on a loaded machine; the queue holds every program
        box = Sandbox(SandboxLimits(wall_s=30.0), max_concurrent=slots,
                      max_queued=args.programs)
        row = {"slots": slots, "programs": args.programs, **_batch(box, args.programs)}
        rows.append(row)
        print(f"{slots:>5} {row['wall_s']:>7} {row['per_s']:>7} {row['p50_s']:>6} "
              f"{row['p95_s']:>6}  {row['ended']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"cpus": os.cpu_count(), "machine": platform.processor()
                                    or platform.machine(), "rows": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
