"""Tasks that set a run up: prepare data, fetch the model, bring the planes up.

Data preparation and model fetching are keyed by the digest of their inputs: a second run
with the same inputs finds the output in the cache directory, skips the work and says so.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from rl_core import storage
from rl_core.base_model import snapshot_model
from rl_core.config import ConfigError, DataConfig, ExperimentConfig, ModelConfig
from rl_core.data.images import image_spec
from rl_core.data.sources import load_records, read_parquet, write_parquet
from rl_core.data.synthetic import generate_splits
from rl_core.models.vlm import is_vision_checkpoint
from rl_core.planes import PlanesHandle, bring_up_planes
from rl_core.rewards import answer_check

__all__ = ["PreparedData", "bring_up", "cached_snapshot", "fetch_model", "prepare_data",
           "source_fingerprint"]


@dataclass(frozen=True)
class PreparedData:
    """Validated snapshots of the train and eval sets (GRPO: Parquet; SFT: JSON lines)."""

    train_path: str
    eval_path: str
    train_digest: str
    eval_digest: str
    num_train: int
    num_eval: int
    source: str
    cached: bool


def source_fingerprint(source: str, with_folder: bool = False) -> str:
    """What identifies a source's content cheaply: S3 ETags and sizes, else paths, sizes and
    mtimes (of a file; of every file under a folder, or under a file's folder with
    ``with_folder``: the images its rows name by relative path)."""
    if storage.is_remote(source):
        return storage.fingerprint(source)  # ETags and sizes: a changed object is new data
    p = Path(source)
    if p.is_file() and with_folder:
        return f"{source_fingerprint(str(p))}|{source_fingerprint(str(p.parent))}"
    if p.is_file():
        st = p.stat()
        return f"{p.resolve()}:{st.st_size}:{st.st_mtime_ns}"
    if p.is_dir():
        parts = sorted(f"{f.relative_to(p)}:{f.stat().st_size}:{f.stat().st_mtime_ns}"
                       for f in p.rglob("*") if f.is_file())
        return f"{p.resolve()}:" + ",".join(parts)
    return source


def data_key(data: DataConfig, answers: str = "number") -> str:
    """The digest of everything that determines the prepared data (``answers``: what the
    reward needs of an answer, ``rl_core.rewards.answer_kind``)."""
    images = data.image_field is not None  # rows name image files beside the data file
    blob = json.dumps({"config": data.model_dump(mode="json"),
                       "source": source_fingerprint(data.source, images),
                       "eval_source": source_fingerprint(data.eval_source or data.source, images),
                       "snapshot": 2, "answers": answers},  # 2: every column kept
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def cached_snapshot(out: Path, build: Callable[[Path], PreparedData], what: str) -> PreparedData:
    """The prepared data in ``out``: as cached (``meta.json`` there: the inputs are unchanged),
    or ``build(out)``'s, with ``meta.json`` written last (a directory without it is an
    interrupted preparation, redone next time). GRPO's and SFT's preparation both."""
    log = get_run_logger()
    meta_path = out / "meta.json"
    if meta_path.is_file():
        log.info("data: cached %s snapshot %s (inputs unchanged), skipping preparation", what, out)
        return PreparedData(**{**json.loads(meta_path.read_text()), "cached": True})
    started = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    prepared = build(out)
    tmp = meta_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(prepared), indent=2))
    os.replace(tmp, meta_path)
    log.info("data: %d train / %d held-out %s rows from %s in %.1fs -> %s", prepared.num_train,
             prepared.num_eval, what, prepared.source, time.perf_counter() - started, out)
    return prepared


@task(name="prepare-data", timeout_seconds=1800, retries=2, retry_delay_seconds=5)
def prepare_data(data: DataConfig, cache_dir: str, answers: str = "number") -> PreparedData:
    """Any supported source -> validated Parquet snapshots with content digests. ``answers``:
    ``number`` refuses a row without a numeric final answer (``reward.fn: gsm8k``), ``any``
    takes any non-null answer (``rl_core.rewards.answer_kind`` of the run's reward)."""

    def build(out: Path) -> PreparedData:
        if data.source == "synthetic":
            train, test = generate_splits(data.synthetic_train_size, data.synthetic_test_size,
                                          data.seed, **data.synthetic_knobs())
            train = train[: data.max_train_examples]  # the warm start still saw the whole split
        else:
            fields = dict(subset=data.subset, question_field=data.question_field,
                          answer_field=data.answer_field, id_field=data.id_field,
                          max_bad_fraction=data.max_bad_fraction, cache_dir=cache_dir,
                          answer_check=answer_check(answers), images=image_spec(data))
            train = load_records(data.source, data.train_split, limit=data.max_train_examples,
                                 **fields)
            test = load_records(data.eval_source or data.source, data.eval_split, **fields)
        return PreparedData(
            train_path=str(out / "train.parquet"), eval_path=str(out / "eval.parquet"),
            train_digest=write_parquet(train, out / "train.parquet"),
            eval_digest=write_parquet(test, out / "eval.parquet"),
            num_train=len(train), num_eval=len(test), source=data.source, cached=False)

    return cached_snapshot(Path(cache_dir) / "data" / data_key(data, answers), build, "prompt")


def _not_a_config_error(task: object, task_run: object, state: object) -> bool:
    """Retry a fetch (the hub, S3), unless what failed is the model itself (a ConfigError:
    remote code, a mismatched tokenizer): another attempt would fail the same way."""
    failure = state.result(raise_on_failure=False)  # type: ignore[attr-defined]
    return not isinstance(failure, ConfigError)


@task(name="fetch-model", timeout_seconds=3600, retries=2, retry_delay_seconds=10,
      retry_condition_fn=_not_a_config_error)
def fetch_model(
    model: ModelConfig, data: DataConfig, cache_dir: str, revision: str | None = None
) -> str:
    """Resolve ``model.path`` to a verified local HF directory, cached by content: hub snapshots
    by (repo id, commit sha), checked against their manifest when reused. ``revision`` defaults to
    ``model.revision``, else ``main``. HF_TOKEN is passed on, never logged."""
    log = get_run_logger()
    started = time.perf_counter()
    token = os.environ.get("HF_TOKEN")
    snap = snapshot_model(model, data, cache_dir, revision=revision, token=token)
    what = f"{snap.source}@{snap.revision[:12]}" if snap.revision else snap.source
    where = f"{snap.path} (content key {snap.key}, verified)"
    if snap.offline:
        log.warning("model: the hub cannot be reached; using the cached %s in %s", what, where)
    elif snap.kind == "local":
        log.info("model: local directory %s", where)
    elif snap.cached:
        skipped = "build" if snap.kind == "tiny" else "download"
        log.info("model: cached %s in %s, skipping the %s", what, where, skipped)
    else:
        elapsed = time.perf_counter() - started
        log.info("model: %s ready in %.1fs in %s", what, elapsed, where)
    return str(snap.path)


@task(name="bring-up-planes", timeout_seconds=1800, cache_policy=NO_CACHE)
def bring_up(cfg: ExperimentConfig, model_path: str, data: PreparedData, work_dir: str,
             with_trainer: bool = True) -> PlanesHandle:
    """Start the rollout engines and the trainer on ``model_path`` (logs under ``work_dir``)."""
    train = read_parquet(data.train_path)
    test = read_parquet(data.eval_path)[: cfg.eval.num_examples]
    if (pictured := sum(1 for r in (*train, *test) if r.images)) and not is_vision_checkpoint(
            model_path):
        raise ConfigError(
            f"{pictured} records carry images (data.image_field={cfg.data.image_field!r} or "
            f"image parts in the chat messages) but model.path ({model_path}) is a text model: "
            "it would train without the pictures. Use a vision-language model (Qwen2-VL, "
            "Qwen2.5-VL, Qwen3-VL; docs/vlm.md), or set data.image_field: null and drop the "
            "image parts to train on the text.")
    return bring_up_planes(cfg, model_path, train, test, work_dir, with_trainer=with_trainer)
