"""A run's directory on local disk: its config (secrets masked), metrics stream, evaluations,
sample ledger, checkpoints, final model and ``summary.json`` written last (the layout:
docs/storage.md, 'The run directory'). Never imports Prefect or MLflow.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from rl_core.config import ExperimentConfig
from rl_core.secrets import redact_config

__all__ = ["CONTROL_FILE", "RunDir", "describe_run", "format_runs", "list_runs", "read_control",
           "write_control"]

log = logging.getLogger(__name__)
# A running job's settings changed at run time (``grpoflow scale``): read at every step.
CONTROL_FILE = "control.json"
CONTROLS = {"rollout.num_engines": int}


def _latest_run_name(root: Path, name: str) -> str | None:
    """The newest ``<name>-*`` run directory under ``root`` that holds a checkpoint."""
    runs = sorted((p for p in root.glob(f"{name}-*") if (p / "checkpoints").is_dir()),
                  key=lambda p: p.stat().st_mtime)
    return runs[-1].name if runs else None


class RunDir:
    """Appends metrics and evaluations; writes the summary."""

    def __init__(self, cfg: ExperimentConfig, *, resume_latest: bool = False) -> None:
        root = Path(cfg.storage.root).expanduser().resolve()
        name = cfg.run_name
        if name is None and resume_latest:
            name = _latest_run_name(root, cfg.name)
        self.name = name or f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}"
        (path := root / self.name).mkdir(parents=True, exist_ok=True)
        config = redact_config(cfg.model_dump(mode="json"))
        (path / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        self.path, self.metrics_path = path, path / "metrics.jsonl"
        self.evals_path, self.ledger_path = path / "evals.jsonl", path / "samples.jsonl"

    @property
    def model_dir(self) -> Path:
        return self.path / "model"

    @property
    def checkpoint_dir(self) -> Path:
        return self.path / "checkpoints"

    def truncate_after(self, step: int) -> None:
        """Drop metric and evaluation lines past ``step`` (work redone after a resume)."""
        for path in (self.metrics_path, self.evals_path, self.ledger_path):
            if path.is_file():
                keep = [line for line in path.read_text(encoding="utf-8").splitlines()
                        if line.strip() and json.loads(line)["step"] <= step]
                path.write_text("".join(line + "\n" for line in keep), encoding="utf-8")

    def read_evals(self) -> list[dict[str, Any]]:
        if not self.evals_path.is_file():
            return []
        lines = self.evals_path.read_text(encoding="utf-8").splitlines()
        return [json.loads(line) for line in lines if line.strip()]

    def log_metrics(self, step: int, metrics: dict[str, Any]) -> None:
        with self.metrics_path.open("a", encoding="utf-8") as f:
            f.write(json.dumps({"step": step, "time": time.time(), **metrics}) + "\n")

    def amend_metrics(self, step: int, extra: dict[str, Any]) -> None:
        """Add ``extra`` to the metrics line of ``step``, the last one (the checkpoint's time,
        known only after the line was written); the file is replaced whole, never half-written."""
        lines = self.metrics_path.read_text(encoding="utf-8").splitlines()
        last = json.loads(lines[-1])
        if last["step"] != step:
            raise ValueError(f"{self.metrics_path}: the last line is step {last['step']}, not {step}")
        lines[-1] = json.dumps({**last, **extra})
        tmp = self.metrics_path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
        os.replace(tmp, self.metrics_path)

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        """The sample ledger: which prompts a step consumed and what each sample scored."""
        with self.ledger_path.open("a", encoding="utf-8") as f:
            f.write(json.dumps({"step": step, "samples": rows}) + "\n")

    def log_eval(self, result: dict[str, Any]) -> None:
        with self.evals_path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(result) + "\n")

    def write_summary(self, summary: dict[str, Any]) -> Path:
        out = self.path / "summary.json"
        out.write_text(json.dumps(summary, indent=2))
        return out


def _jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # a line cut by a kill: the rest still counts
    return out


def _score(result: dict[str, Any]) -> tuple[str, float] | None:
    """An evaluation's headline: greedy pass@1 (GRPO, SFT with accuracy) or held-out loss."""
    if result.get("pass_at_1") is not None:
        return "pass@1", float(result["pass_at_1"])
    if result.get("loss") is not None:
        return "loss", float(result["loss"])
    return None


def describe_run(path: Path) -> dict[str, Any] | None:
    """What ``grpoflow runs`` shows of a run directory (None: not a run directory): kind,
    status (finished: ``summary.json`` written; else incomplete, running or stopped), steps
    done of the total, the last and the best evaluation, the model (registry URI, else the
    exported directory, else the latest checkpoint)."""
    config_file = path / "config.yaml"
    if not config_file.is_file():
        return None
    config = yaml.safe_load(config_file.read_text(encoding="utf-8")) or {}
    summary = json.loads(s.read_text()) if (s := path / "summary.json").is_file() else None
    metrics, evals = _jsonl(path / "metrics.jsonl"), _jsonl(path / "evals.jsonl")
    kind = (summary or {}).get("kind") or ("GRPO" if "algorithm" in config else "SFT")
    scored = [(e["step"], *sc) for e in evals if (sc := _score(e)) is not None]
    best = None
    if scored:
        pick = min if scored[-1][1] == "loss" else max
        best = pick(scored, key=lambda r: r[2])
    tracking = (summary or {}).get("tracking") or {}
    checkpoints = sorted(p.name for p in (path / "checkpoints").glob("step-*")
                         if (p / "MANIFEST.json").is_file())
    model = (tracking.get("alias_uri") or tracking.get("model_uri")
             or (str(path / "model") if (path / "model").is_dir() else None)
             or (str(path / "checkpoints" / checkpoints[-1]) if checkpoints else None))
    return {
        "run": path.name, "kind": kind, "status": "finished" if summary else "incomplete",
        "steps": max((m.get("step", 0) for m in metrics), default=0),
        "total_steps": (config.get("train") or {}).get("steps"),
        "last_eval": {"step": scored[-1][0], scored[-1][1]: scored[-1][2]} if scored else None,
        "best_eval": {"step": best[0], best[1]: best[2]} if best else None,
        "model": model, "updated": max((p.stat().st_mtime for p in path.iterdir()),
                                       default=path.stat().st_mtime),
    }


def list_runs(root: str | Path) -> list[dict[str, Any]]:
    """Every run directory under ``root`` (``storage.root``), oldest first."""
    root = Path(root).expanduser()
    if not root.is_dir():
        return []
    rows = [r for p in root.iterdir() if p.is_dir() and (r := describe_run(p)) is not None]
    return sorted(rows, key=lambda r: r["updated"])


def format_runs(runs: Sequence[dict[str, Any]]) -> str:
    """``grpoflow runs`` as a table, one run per line, oldest first."""

    def score(e: dict[str, Any] | None) -> str:
        if not e:
            return "-"
        key = "pass@1" if "pass@1" in e else "loss"
        return f"{key} {e[key]:.3f} @{e['step']}"

    rows = [("RUN", "KIND", "STATUS", "STEPS", "LAST EVAL", "BEST EVAL", "MODEL")]
    rows += [(r["run"], r["kind"], r["status"], f"{r['steps']}/{r['total_steps'] or '?'}",
              score(r["last_eval"]), score(r["best_eval"]), r["model"] or "-") for r in runs]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join("  ".join([*(c.ljust(w) for c, w in zip(row[:-1], widths, strict=True)),
                                row[-1]]) for row in rows)


def write_control(run: str | Path, **settings: Any) -> Path:
    """Set ``settings`` (``CONTROLS``' keys, dots as ``__``) in a run's control file, atomically
    (the flow may read it at any moment); the file."""
    path = Path(run) / CONTROL_FILE
    if not path.parent.is_dir():
        raise FileNotFoundError(f"no run directory {path.parent}")
    values = read_control(path.parent)
    for key, value in settings.items():
        name = key.replace("__", ".")
        if name not in CONTROLS:
            raise ValueError(f"{name} cannot change at run time; these can: {sorted(CONTROLS)}")
        values[name] = CONTROLS[name](value)
        if values[name] < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(values, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path


def read_control(run: str | Path) -> dict[str, Any]:
    """A run's control file (``{}`` if none; a malformed one is logged and ignored)."""
    path = Path(run) / CONTROL_FILE
    try:
        values = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        log.warning("%s: ignored (%s)", path, e)
        return {}
    return {k: v for k, v in values.items() if k in CONTROLS} if isinstance(values, dict) else {}
