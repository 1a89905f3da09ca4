"""grpoflow's benchmarks: scripts that print a table and write JSON to ``benchmarks/results``.

Run each as a module from the repository root (``.venv/bin/python -m benchmarks.NAME``);
``docs/benchmarks.md`` keeps the commands and the latest numbers with the machine they ran
on. This module holds the few helpers the newer scripts share (run metadata, the load
average, running ``grpoflow train`` and reading its metrics, printing a table); it imports
nothing heavy. Benchmarks never assert anything about time: tests do that for behaviour.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
# ``grpoflow`` as this checkout's code runs it (``python -m grpoflow.cli`` from ROOT), not
# whatever an installed ``grpoflow`` script next to the interpreter imports.
GRPOFLOW = [sys.executable, "-m", "grpoflow.cli"]

__all__ = [
    "GRPOFLOW",
    "RESULTS",
    "ROOT",
    "GrpoflowRun",
    "format_table",
    "git",
    "load1",
    "mean",
    "run_grpoflow_train",
    "run_meta",
    "write_json",
]


def load1() -> float:
    """The 1-minute load average (what ``uptime`` shows first)."""
    return os.getloadavg()[0]


def git(*cmd: str) -> str | None:
    """``git CMD`` in the repository; ``None`` when git is missing or fails."""
    try:
        out = subprocess.run(["git", *cmd], cwd=ROOT, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def run_meta(module: str, argv: Sequence[str] | None) -> dict[str, Any]:
    """What every result file records about the run: command, date, machine, load, versions
    and the git state (the commit and which product files differ from it)."""
    import torch

    args = list(sys.argv[1:] if argv is None else argv)
    return {
        "command": " ".join([".venv/bin/python", "-m", module, *args]),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "loadavg_at_start": list(os.getloadavg()),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "git_head": git("rev-parse", "HEAD"),
        "git_dirty_files": git("status", "--porcelain", "--", "rl_core", "flows", "tasks", "grpoflow"),
    }


def write_json(path: Path, doc: dict[str, Any]) -> None:
    """Write ``doc`` (with ``loadavg_at_end`` added) as indented JSON and say where."""
    doc["loadavg_at_end"] = list(os.getloadavg())
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    print(f"wrote {path}")


def mean(xs: Sequence[float]) -> float:
    return statistics.fmean(xs) if xs else float("nan")


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table (numbers right-aligned), printable and pasteable into the docs."""
    cells = [[str(h) for h in headers]] + [[_cell(v) for v in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    numeric = [all(_is_num(r[i]) for r in rows) if rows else False for i in range(len(headers))]

    def line(r: Sequence[str]) -> str:
        parts = [c.rjust(w) if num else c.ljust(w) for c, w, num in zip(r, widths, numeric, strict=True)]
        return "| " + " | ".join(parts) + " |"

    sep = "|" + "|".join(("-" * (w + 1) + ":") if n else ("-" * (w + 2)) for w, n in zip(widths, numeric, strict=True)) + "|"
    return "\n".join([line(cells[0]), sep, *(line(r) for r in cells[1:])])


def _is_num(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _cell(v: Any) -> str:
    if isinstance(v, float):
        if v != v:  # nan
            return "–"
        if abs(v) >= 1000:
            return f"{v:,.0f}"
        if abs(v) >= 100:
            return f"{v:.0f}"
        if abs(v) >= 10:
            return f"{v:.1f}"
        return f"{v:.3f}" if abs(v) < 1 else f"{v:.2f}"
    return str(v)


class GrpoflowRun:
    """A finished ``grpoflow train`` run: its directory, metrics lines and summary."""

    def __init__(self, path: Path, wall_s: float, load_start: float, load_end: float) -> None:
        self.path = path
        self.wall_s = wall_s
        self.load_start, self.load_end = load_start, load_end
        lines = (path / "metrics.jsonl").read_text().splitlines()
        self.metrics: list[dict[str, Any]] = [json.loads(x) for x in lines if x.strip()]
        summary = path / "summary.json"
        self.summary: dict[str, Any] = json.loads(summary.read_text()) if summary.is_file() else {}

    def step_walls(self) -> list[tuple[int, float]]:
        """``(step, seconds)`` for steps 2..N: the time between consecutive metric lines,
        i.e. everything the loop did for that step (its phases, the checkpoint, the Prefect
        task calls and the tracking, ledger and console writes of the step before)."""
        m = self.metrics
        return [(b["step"], b["time"] - a["time"]) for a, b in zip(m, m[1:], strict=False)]


def run_grpoflow_train(
    overrides: Sequence[str],
    *,
    run_name: str,
    storage_root: Path,
    config: Path = ROOT / "configs" / "tiny-cpu.yaml",
    env: dict[str, str] | None = None,
    timeout_s: float = 1800,
    log_path: Path | None = None,
    root: Path = ROOT,
) -> GrpoflowRun:
    """``grpoflow train CONFIG --quiet --no-resume`` in a process of its own; the run.

    ``env`` is added to this process's environment (e.g. a ``PREFECT_HOME`` of its own).
    The output goes to ``log_path`` (or is captured and shown only on failure). ``root`` is
    the source tree whose code runs (another commit's worktree, for a before/after).
    """
    argv = [
        *GRPOFLOW, "train", str(config), "--quiet", "--no-resume",
        f"storage.root={storage_root}", f"run_name={run_name}", *overrides,
    ]  # fmt: skip
    full_env = {**os.environ, **(env or {})}
    load_start = load1()
    t0 = time.perf_counter()
    if log_path is not None:
        with log_path.open("w") as log:
            done = subprocess.run(argv, cwd=root, env=full_env, stdout=log, stderr=subprocess.STDOUT,
                                  timeout=timeout_s)  # fmt: skip
        tail = log_path.read_text()[-4000:]
    else:
        done = subprocess.run(argv, cwd=root, env=full_env, capture_output=True, text=True,
                              timeout=timeout_s)  # fmt: skip
        tail = (done.stdout + done.stderr)[-4000:]
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise RuntimeError(f"grpoflow train failed (rc={done.returncode}): {' '.join(argv)}\n{tail}")
    return GrpoflowRun(storage_root / run_name, wall, load_start, load1())
