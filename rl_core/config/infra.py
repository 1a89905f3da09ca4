"""Around the loop: evaluation, checkpoints, cluster, storage, tracking."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rl_core.config.base import Section


class EvalConfig(Section):
    """Held-out evaluation: greedy pass@1 and sampled pass@k."""
    every: int = Field(10, ge=0, description="Evaluate every N steps; 0 = only before/after.")
    num_examples: int = Field(
        200, ge=1, description="Held-out problems evaluated (the first N), each greedily.")
    pass_k: int = Field(4, ge=1, description="Samples per problem for pass@k; 1: no pass@k.")
    pass_k_examples: int = Field(64, ge=0, description="Problems (the first N) that get the "
        "pass@k samples; 0: no pass@k.")
    temperature: float = Field(1.0, ge=0.0, description="Sampling temperature of the pass@k "
        "samples (pass@1 is greedy).")
    max_new_tokens: int | None = Field(
        None, ge=1, description="Tokens per answer at most; default: rollout.max_new_tokens.")
    promotion_metric: Literal["pass_at_1", "pass_at_k"] = Field(
        "pass_at_1", description="What the scheduled evaluation compares (candidate vs champion).")
    promotion_margin: float = Field(
        0.01, ge=0.0, description="The candidate must beat the champion by more than this.")
    champion_alias: str = Field("champion", min_length=1, description="Registry alias of the "
        "best version; the scheduled evaluation moves it to a candidate that wins.")


class CheckpointConfig(Section):
    """Where checkpoints go and how often."""
    every: int = Field(0, ge=0, description="Save every N steps; 0 = only at the end.")
    keep_last: int = Field(2, ge=1, description="Complete checkpoints kept; older ones are "
        "deleted.")
    uri: str | None = Field(None, description="Defaults to <run_dir>/checkpoints.")


class ClusterConfig(Section):
    """Where the planes run: this process and local engines, or Ray actors."""
    mode: Literal["local", "ray"] = Field(
        "local", description="`local`: trainer in the flow process, engines as local processes; "
        "`ray`: both planes as Ray actors (docs/architecture.md).")
    address: str | None = Field(None, description="Ray to join (`auto`, `host:port`, "
        "`ray://host:port`); None starts a local Ray bound to 127.0.0.1 for the run.")
    placement: Literal["colocated", "disaggregated"] = Field("colocated", description="Planes "
        "share devices (time-sliced) or get separate device pools.")
    trainer_ranks: int = Field(1, ge=1, description="Data-parallel trainer actors (Ray).")
    cpus_per_trainer: float = Field(1.0, ge=0, description="CPUs each Ray trainer actor reserves.")
    gpus_per_trainer: float = Field(0.0, ge=0, description="GPUs each Ray trainer actor reserves "
        "(below 1: a share of one); 0: the ranks train on the CPU.")
    cpus_per_engine: float = Field(1.0, ge=0, description="CPUs each Ray engine actor reserves.")
    gpus_per_engine: float = Field(0.0, ge=0, description="GPUs each Ray engine actor reserves "
        "(a TP=4 engine: 4; below 1: a share of one).")
    num_cpus: int | None = Field(None, ge=1, description="CPUs of a local Ray (default: all).")
    timeout_s: float = Field(300.0, gt=0, description="Bound on Ray start, placement, calls.")
    env: dict[str, str | None] = Field(
        default_factory=dict, description="Environment for every engine and trainer process, "
        "over the platform presets (docs/platforms.md); a null value removes a preset.")


class StorageConfig(Section):
    """Durable storage root for data, models and checkpoints."""
    root: str = Field("runs", description="Local directory (or s3:// once storage lands).")
    cache_dir: str = Field(".cache/grpoflow", description="Prepared data and built models.")
    s3_endpoint_url: str | None = Field(None, description="S3-compatible endpoint (MinIO, Ceph, "
                                        "R2); default: AWS_ENDPOINT_URL or AWS.")


class TrackingConfig(Section):
    """MLflow, the system of record: params, per-step metrics, checkpoints, the registry."""
    backend: Literal["none", "mlflow"] = Field(
        "mlflow", description="`mlflow`: a SQLite store (`store`) unless `uri` is set.")
    uri: str | None = Field(None, description="Tracking URI; default: MLFLOW_TRACKING_URI.")
    store: Literal["project", "run"] = Field(
        "project", description="Without `uri` or MLFLOW_TRACKING_URI: `project`, one SQLite "
        "store for every run under `storage.root` (`<root>/mlflow.db`: `mlflow ui "
        "--backend-store-uri sqlite:///runs/mlflow.db` shows them all, one model registry); "
        "`run`, a store in each run's directory.")
    experiment: str | None = Field(None, description="Default: the config's `name`.")
    samples_every: int = Field(10, ge=0, description="Sample-generation table every K steps.")
    samples_rows: int = Field(16, ge=1, description="Samples in each sample-generation table.")
    traces_per_step: int = Field(4, ge=0, description="Multi-turn episodes logged as MLflow "
        "traces each step (turns, tool calls, rewards, timings); 0: none.")
    system_metrics: bool = Field(
        True, description="Log MLflow's system metrics of the host (needs psutil).")
    system_metrics_interval_s: float = Field(
        10.0, gt=0, description="Seconds between system-metric samples.")
    register_model: bool = Field(True, description="Register the final model as `model.name`.")
    alias: str = Field("candidate", description="Alias given to each new registered version.")
    checkpoint_artifacts: bool = Field(
        True, description="Log local checkpoints as artifacts (s3:// ones by reference only).")
    flush_timeout_s: float = Field(120.0, ge=0, description="At the end, wait this long for unsent "
        "metrics to reach MLflow; what is left goes to <run_dir>/mlflow-unsent-metrics.jsonl "
        "(replayable).")
