"""A run's directory on local disk: its config (secrets masked), metrics stream, evaluations,
sample ledger, checkpoints, final model and ``summary.json`` written last (the layout:
docs/storage.md, 'The run directory'). Never imports Prefect or MLflow.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import yaml

from rl_core.config import ExperimentConfig
from rl_core.secrets import redact_config

__all__ = ["RunDir"]


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
