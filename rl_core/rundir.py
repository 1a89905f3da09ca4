"""A run's directory on local disk: its config, metrics stream, evaluations and outputs.

Layout::

    <storage.root>/<run_name>/
        config.yaml        the resolved config
        metrics.jsonl      one JSON object per step (and per evaluation)
        evals.jsonl        evaluation results with sample generations
        model/             the final policy in Hugging Face format
        summary.json       written last

Never imports Prefect or MLflow.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import yaml

from rl_core.config import ExperimentConfig

__all__ = ["RunDir"]


class RunDir:
    """Appends metrics and evaluations; writes the summary."""

    def __init__(self, cfg: ExperimentConfig) -> None:
        name = cfg.run_name or f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}"
        self.name = name
        self.path = Path(cfg.storage.root).expanduser().resolve() / name
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / "config.yaml").write_text(
            yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
        )
        self.metrics_path = self.path / "metrics.jsonl"
        self.evals_path = self.path / "evals.jsonl"

    @property
    def model_dir(self) -> Path:
        return self.path / "model"

    def log_metrics(self, step: int, metrics: dict[str, Any]) -> None:
        with self.metrics_path.open("a", encoding="utf-8") as f:
            f.write(json.dumps({"step": step, "time": time.time(), **metrics}) + "\n")

    def log_eval(self, result: dict[str, Any]) -> None:
        with self.evals_path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(result) + "\n")

    def write_summary(self, summary: dict[str, Any]) -> Path:
        out = self.path / "summary.json"
        out.write_text(json.dumps(summary, indent=2))
        return out
