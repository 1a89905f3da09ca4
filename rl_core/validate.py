"""``grpoflow validate``: what a run would check before its first step, in seconds.

Without Prefect, MLflow, an engine or a download: the pre-flight checks, the model (where it
resolves), the first rows of the data through the field mapping, a few prompts rendered and
tokenized against the limits, the reward called once on gold answers, and where each plane
will run. Each finding is an ``ok`` / ``warn`` / ``fail`` line naming the field and the fix
(docs/troubleshooting.md). Never imports Prefect or MLflow.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rl_core.config import ConfigError, ExperimentConfig, resolve_device
from rl_core.secrets import redact

__all__ = ["Finding", "describe_planes", "validate"]


@dataclass(frozen=True)
class Finding:
    status: str  # ok, warn or fail
    what: str  # the check
    detail: str  # what was found, and the fix when it is not ok


def describe_planes(cfg: ExperimentConfig) -> dict[str, str]:
    """Where each plane runs: the trainer's device and ranks, the engines' kind and devices."""
    c, r, t = cfg.cluster, cfg.rollout, cfg.train
    if c.mode == "ray":
        gpu = c.gpus_per_trainer > 0
        trainer = (f"{c.trainer_ranks} {t.backend} rank(s) as Ray actors on "
                   f"{'GPU' if gpu else 'CPU'} ({c.gpus_per_trainer:g} GPU, "
                   f"{c.cpus_per_trainer:g} CPU each; placement {c.placement})")
    else:
        device = resolve_device(t.device, "train.device")
        trainer = f"one {t.backend} trainer in the flow's process on {device} (train.device={t.device})"
    if r.engine == "sglang":
        engines = f"{r.num_engines} SGLang server(s) on GPUs (tp {r.sglang_tp} each)"
    elif r.engine == "embedded":
        where = ("GPU" if c.gpus_per_engine > 0 else "CPU") if c.mode == "ray" else \
            resolve_device(r.device, "rollout.device")
        engines = (f"{r.num_engines} embedded engine process(es) on {where}, "
                   f"{cfg.thread_budget()[0]} thread(s) each")
    else:
        shared = r.weight_sync in ("auto", "shared") and c.mode == "local"
        engines = ("the engine core in the flow's process, reading the trainer's weights in "
                   "place" if shared else
                   f"the engine core in the flow's process on "
                   f"{resolve_device(r.device, 'rollout.device')}")
    if c.mode == "ray" and r.engine != "local":
        engines += f" as Ray actors ({c.gpus_per_engine:g} GPU each)"
    return {"cluster": c.mode, "trainer": trainer, "engines": engines,
            "weight sync": r.weight_sync}


def _model(cfg: ExperimentConfig) -> tuple[Path | None, Finding]:
    from rl_core.models.hub import EMBEDDED_TINY, local_model_dir

    m = cfg.model
    d = local_model_dir(m, cfg.data, cfg.storage.cache_dir)
    if d is not None:
        return d, Finding("ok", "model", f"{m.path} -> {d}")
    if m.path == EMBEDDED_TINY:
        return None, Finding("warn", "model", f"{m.path} is not built yet: the first run builds "
                             "it (about a minute on 2 cores; `grpoflow bootstrap-model` does it "
                             "alone); its tokenizer checks run then")
    return None, Finding("warn", "model", f"{m.path} is not on this machine yet: the run "
                         "fetches it (`grpoflow download-model CONFIG` does it alone); the "
                         "tokenizer checks run after that")


def _rows(cfg: ExperimentConfig, n: int) -> tuple[list[Any], Finding]:
    from rl_core.data.images import image_spec
    from rl_core.data.sources import load_records
    from rl_core.data.synthetic import generate_splits
    from rl_core.rewards import answer_check, answer_kind

    d = cfg.data
    if d.source == "synthetic":
        train, _ = generate_splits(n, 1, d.seed, **d.synthetic_knobs())
        return train[:n], Finding("ok", "data", f"synthetic: {len(train[:n])} rows generated")
    records = load_records(d.source, d.train_split, subset=d.subset, limit=n,
                           question_field=d.question_field, answer_field=d.answer_field,
                           id_field=d.id_field, max_bad_fraction=d.max_bad_fraction,
                           cache_dir=cfg.storage.cache_dir,
                           answer_check=answer_check(answer_kind(cfg.reward)),
                           images=image_spec(d))
    if pictured := sum(1 for r in records if r.images):
        return records, Finding("ok", "data", f"{d.source} (split {d.train_split}): the first "
                                f"{len(records)} rows read and valid, {pictured} with images "
                                f"(decoded and checked; data.image_field={d.image_field})")
    return records, Finding("ok", "data", f"{d.source} (split {d.train_split}): the first "
                            f"{len(records)} rows read and valid (data.question_field="
                            f"{d.question_field}, data.answer_field={d.answer_field})")


def _prompts(cfg: ExperimentConfig, model_dir: Path, records: list[Any]) -> list[Finding]:
    from transformers import AutoTokenizer

    from rl_core.data.prompts import encode_record_prompts
    from rl_core.models.vlm import vision_processor
    from rl_core.preflight import context_length

    d = cfg.data
    tok = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=cfg.model.trust_remote_code)
    vision = vision_processor(model_dir, cfg.model.trust_remote_code) \
        if any(r.images for r in records) else None
    ids = encode_record_prompts(tok, records, vision, system_prompt=d.system_prompt,
                                use_chat_template=d.use_chat_template,
                                plain_template=d.plain_template)
    lengths = [len(x) for x in ids]
    out = [Finding("ok", "prompt", "row 1 renders as " + repr(tok.decode(ids[0])[:300]))]
    new = cfg.rollout.max_new_tokens
    context = (found[0] if (found := context_length(model_dir)) else None)
    too_long = [(i + 1, n) for i, n in enumerate(lengths) if n > d.max_prompt_tokens]
    summary = (f"{min(lengths)}-{max(lengths)} tokens (mean {sum(lengths) / len(lengths):.1f}) "
               f"of data.max_prompt_tokens={d.max_prompt_tokens}; + rollout.max_new_tokens={new}"
               + (f" within the model's context of {context}" if context else ""))
    if context is not None and max(lengths) + new > context:
        row, n = max(enumerate(lengths, start=1), key=lambda x: x[1])
        out.append(Finding("fail", "prompt length", f"row {row}: {n} prompt tokens + "
                           f"rollout.max_new_tokens={new} exceed the model's context of "
                           f"{context}; shorten the prompts, lower rollout.max_new_tokens, or "
                           "use a model with a longer context"))
    elif too_long:
        out.append(Finding("warn", "prompt length", f"{len(too_long)} of {len(lengths)} rows "
                           f"(row {too_long[0][0]}: {too_long[0][1]} tokens) exceed "
                           f"data.max_prompt_tokens={d.max_prompt_tokens}: the run skips and "
                           "counts them; raise it to keep them"))
    else:
        out.append(Finding("ok", "prompt length", summary))
    return out


def _reward(cfg: ExperimentConfig, records: list[Any]) -> list[Finding]:
    """Each reward function (``reward.fn``, then ``reward.extra``) loaded in its form and
    called once on three rows' gold answers (the answer as the completion), the way a run's
    workers call it (`rl_core.rewards.forms`)."""
    from rl_core.data.records import cell_text
    from rl_core.rewards.forms import (
        PER_SAMPLE,
        call_one,
        call_whole,
        load_reward_fn,
        reward_form,
    )
    from rl_core.rewards.terms import term_name

    r = cfg.reward
    judge = r.fn.strip() == "judge"
    terms = [] if judge else [("reward.fn", r.fn, r.args, None)]
    terms += [(f"reward.extra[{i}]", e.fn, e.args, e.name) for i, e in enumerate(r.extra)]
    out = [Finding("ok", "reward", "reward.fn=judge: an LLM judge on engines of its own, "
                   "checked when they start (docs/judges.md)")] if judge else []
    items = [(i, cell_text(rec.answer), rec.answer, rec.question, rec.columns)
             for i, rec in enumerate(records[:3])]
    for field, spec, args, label in terms:
        name = f"{field}={spec}"
        try:
            fn = load_reward_fn(spec, args)
            form = reward_form(fn, spec)
        except ValueError as exc:
            out.append(Finding("fail", "reward", f"{field}: {exc}"))
            continue
        outcomes = (call_whole(fn, form, items, r.timeout_s) if form != PER_SAMPLE
                    else [call_one(fn, it[1], it[2]) for it in items])
        if failed := [value for kind, value in outcomes if kind in ("error", "timeout")]:
            called = ("fn(prompts, completions, **columns)" if form[0] == "batched"
                      else "fn(completion, answer)")
            out.append(Finding("fail", "reward", f"{name} raised {failed[0] or 'a timeout'} on "
                               f"the gold answers of rows 1-{len(items)} ({items[0][1][:60]!r}, "
                               f"...; called as {called}); fix the function or {field}"))
            continue
        scores = [value for _, value in outcomes]  # None: the function gave no score
        what = f"{name} ({form[0]}{', async' if form[1] else ''}, logged as " \
               f"reward/{term_name(spec, label)})"
        if field == "reward.fn" and not any(v for v in scores if v is not None):
            out.append(Finding("warn", "reward", f"{what} gives the gold answers {scores}: "
                               "nothing scores, so no group would have a gradient; check "
                               "data.answer_field and reward.fn"))
        else:
            out.append(Finding("ok", "reward", f"{what} on {len(scores)} gold answers: {scores}"))
    return out


def validate(cfg: ExperimentConfig, rows: int = 8) -> list[Finding]:
    """Every check, cheapest first; a failure stops only the checks that depend on it."""
    from rl_core.preflight import preflight

    started, out = time.perf_counter(), []
    try:
        preflight(cfg)
        out.append(Finding("ok", "pre-flight", "data paths, storage, engine settings, the "
                           "model's context and files, the prompt template"))
    except (ConfigError, ValueError, OSError) as exc:
        out.append(Finding("fail", "pre-flight", str(exc)))
    try:
        model_dir, found = _model(cfg)
    except (ValueError, OSError) as exc:
        model_dir, found = None, Finding("fail", "model", str(exc))
    out.append(found)
    try:
        records, found = _rows(cfg, rows)
        out.append(found)
    except Exception as exc:  # noqa: BLE001 - a bad mapping, file, row or bucket: shown as is
        records = []
        out.append(Finding("fail", "data", f"{type(exc).__name__}: {exc}"))
    if records and model_dir is not None:
        try:
            out += _prompts(cfg, model_dir, records)
        except (ValueError, OSError) as exc:
            out.append(Finding("fail", "prompt", str(exc)))
    if records:
        out += _reward(cfg, records)
    try:
        planes = describe_planes(cfg)
        out.append(Finding("ok", "planes", "; ".join(f"{k}: {v}" for k, v in planes.items())))
    except ConfigError as exc:
        out.append(Finding("fail", "planes", str(exc)))
    out.append(Finding("ok", "time", f"{time.perf_counter() - started:.1f}s"))
    return [Finding(f.status, f.what, redact(f.detail)) for f in out]  # a URL's token, a key


def main(argv: list[str] | None = None) -> int:
    """``python -m rl_core.validate CONFIG [overrides]``: the findings as JSON (``grpoflow
    doctor CONFIG`` runs this in a bounded child process); exit 2 when one fails."""
    import json
    import sys

    from rl_core.config import load_config

    args = list(sys.argv[1:] if argv is None else argv)
    config = args.pop(0) if args and "=" not in args[0] else None
    findings = validate(load_config(config, args))
    print(json.dumps([f.__dict__ for f in findings]))
    return 2 if any(f.status == "fail" for f in findings) else 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
