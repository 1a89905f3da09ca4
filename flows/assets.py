"""Flows that prepare what a run consumes, usable on their own or ahead of training.

    prepare-data:   any supported source -> validated Parquet snapshots with digests
    download-model: HF hub id (at a revision), local directory or the embedded tiny model
                    -> verified directory; hub snapshots cached by (repo id, commit sha)

Both are keyed by the digest of their inputs: a second run finds the output and says so.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from flows._redacted import redacted_flow
from rl_core.config import load_config
from rl_core.rewards import answer_kind
from tasks.setup import fetch_model, prepare_data

__all__ = ["download_model", "prepare_data_flow"]


@redacted_flow(name="prepare-data")
def prepare_data_flow(
    config: str | None = None, overrides: list[str] | None = None
) -> dict[str, Any]:
    """Validate and snapshot the config's train and eval data."""
    cfg = load_config(config, overrides or [])
    return asdict(prepare_data(cfg.data, cfg.storage.cache_dir, answer_kind(cfg.reward)))


@redacted_flow(name="download-model")
def download_model(config: str | None = None, overrides: list[str] | None = None,
                   uri: str | None = None, revision: str | None = None) -> str:
    """Fetch and verify ``uri`` (default: ``model.path``) at ``revision`` (default: the config's,
    else ``main``); returns the local path. Run it where the hub is reachable to fill
    ``storage.cache_dir`` for offline machines."""
    cfg = load_config(config, [*(overrides or []), *([f"model.path={uri}"] if uri else [])])
    return fetch_model(cfg.model, cfg.data, cfg.storage.cache_dir, revision)
