"""Pre-flight: refuse a config that cannot work, within seconds and before any task runs.

:func:`preflight` runs the checks that need no download, build or start, cheapest first (data
paths, storage, engine flags, the model's context window, files and prompt rendering: the table
in docs/configuration.md, 'Pre-flight checks'), raising :class:`~rl_core.config.ConfigError`
(:class:`~rl_core.models.hub.ModelError`) with one paragraph: field, value, limit and fix. The
CLI calls it after loading the config, a flow again with the fetched model (``model_path=``).
Never imports Prefect or MLflow; never downloads, builds, starts or writes anything.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from rl_core import storage
from rl_core.config import ConfigError, ExperimentConfig

__all__ = ["context_length", "preflight"]

log = logging.getLogger(__name__)

# rope_scaling types whose factor stretches the trained context (as vLLM derives it).
_STRETCHING_ROPE = {"linear", "dynamic", "yarn"}
# Flags grpoflow passes every SGLang server itself, and where to set what they set.
_SGLANG_FLAGS = {"--model-path": "model.path", "--tp-size": "rollout.sglang_tp", "--host": None,
    "--dp-size": "rollout.num_engines (one server per engine)", "--dtype": "model.dtype",
    "--mem-fraction-static": "rollout.sglang_mem_fraction_static", "--port": None,
    "--trust-remote-code": "model.trust_remote_code", "--base-gpu-id": None}


def preflight(cfg: ExperimentConfig, *, model_path: str | Path | None = None,
              data: bool = True, model: bool = True) -> None:
    """Raise :class:`ConfigError` (one paragraph) for the first problem found in ``cfg``.
    ``model_path``: the fetched model directory (default: wherever ``model.path`` is on this
    machine already, if anywhere). ``data=False`` / ``model=False`` skip the data or model
    checks (``download-model`` needs no data, ``prepare-data`` no model)."""
    if data:
        _check_data(cfg)
    _check_storage(cfg)
    _check_engines(cfg)
    if model:
        _check_model(cfg, model_path)


def _check_data(cfg: ExperimentConfig) -> None:
    from rl_core.data.sources import _looks_like_path  # the loader's own rule: path or hub name

    d = cfg.data
    evals = [] if d.source == "synthetic" or d.eval_source is None else [d.eval_source]
    for field, source in [("data.source", d.source)] + [("data.eval_source", s) for s in evals]:
        explicit = source.lower().startswith("file://")
        if source == "synthetic" or ("://" in source and not explicit):
            continue  # s3:// (or a scheme the loader refuses): prepare-data's to reach
        raw = source[len("file://") :] if explicit else source
        path = Path(raw).expanduser()
        fix = (f"fix {field}: a .jsonl or .parquet file, a dataset directory, a hub dataset "
               "name such as openai/gsm8k, an s3:// URI, or synthetic")
        if not path.exists():
            if explicit or _looks_like_path(raw, path):
                raise ConfigError(f"{field}={source!r}: no such file or directory "
                                  f"({path.absolute()}); {fix}")
            continue  # a hub dataset name: prepare-data asks the hub
        try:
            if path.is_dir():
                if not any(path.iterdir()):
                    raise ConfigError(f"{field}={source!r}: the directory {path} is empty; {fix}")
            elif path.is_file():
                with open(path, "rb") as f:
                    f.read(1)
            else:  # a FIFO or a device would block or never end
                raise ConfigError(f"{field}={source!r}: {path} is not a regular file or a "
                                  f"directory; {fix}")
        except OSError as exc:
            raise ConfigError(f"{field}={source!r}: {path} cannot be read ({exc.strerror}); make "
                              f"it readable by this user or {fix}") from None


def _check_storage(cfg: ExperimentConfig) -> None:
    for field, value in (("storage.root", cfg.storage.root),
                         ("storage.cache_dir", cfg.storage.cache_dir),
                         ("checkpoint.uri", cfg.checkpoint.uri)):
        if value is None or storage.is_remote(value):
            continue
        path = Path(value).expanduser().absolute()
        existing = next(p for p in (path, *path.parents) if p.exists())
        if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
            what = "is not a directory" if not existing.is_dir() else "is not writable"
            raise ConfigError(
                f"{field}={value!r}: {existing} {what}, so {path} cannot be written; point "
                f"{field} at a directory this user can write (or create {path} for it)")


def _check_engines(cfg: ExperimentConfig) -> None:
    r = cfg.rollout
    if r.engine == "embedded" and cfg.model.trust_remote_code:
        raise ConfigError(
            "model.trust_remote_code=true with rollout.engine=embedded: the embedded engine "
            "runs no model code, only architectures transformers ships; use rollout.engine="
            "local (in-process) or sglang, or a model that needs no remote code")
    if r.engine != "sglang":
        return
    for arg in r.sglang_extra_args:
        if (flag := str(arg).split("=", 1)[0]) in _SGLANG_FLAGS:
            field = _SGLANG_FLAGS[flag]
            where = f"set it with {field}" if field else "grpoflow gives each engine its own"
            raise ConfigError(
                f"rollout.sglang_extra_args has {flag}, which grpoflow already passes every SGLang "
                f"server ({where}); a second {flag} would override it and the engine would not be "
                f"where grpoflow looks for it. Remove {flag} from rollout.sglang_extra_args")


def context_length(path: str | Path) -> tuple[int, str] | None:
    """The context window from ``<path>/config.json`` and where it comes from:
    ``max_position_embeddings`` (of ``text_config`` for multimodal configs), stretched by a
    linear/dynamic/yarn ``rope_scaling`` factor; None when the config names no limit or
    does not read (the verification says why). Reads the JSON only: no model code runs."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for section in (config, config.get("text_config") or {}):
        limit = section.get("max_position_embeddings")
        if isinstance(limit, int) and limit > 0:
            rope = section.get("rope_scaling") or {}
            kind, factor = rope.get("rope_type") or rope.get("type"), rope.get("factor")
            if kind in _STRETCHING_ROPE and isinstance(factor, int | float) and factor > 1:
                base = rope.get("original_max_position_embeddings") or limit
                return int(base * factor), (f"max_position_embeddings {base} x {kind} "
                                            f"rope_scaling factor {factor:g} in its config.json")
            return limit, "max_position_embeddings in its config.json"
    return None


def _check_context(cfg: ExperimentConfig, limit: int, model: str, source: str) -> None:
    """``data.max_prompt_tokens`` + the tokens a sequence may generate fit ``limit``."""
    prompt = cfg.data.max_prompt_tokens
    for field, new in (("rollout.max_new_tokens", cfg.rollout.max_new_tokens),
                       ("eval.max_new_tokens", cfg.eval.max_new_tokens)):
        if new is not None and prompt + new > limit:
            raise ConfigError(
                f"data.max_prompt_tokens={prompt} + {field}={new} = {prompt + new} tokens, more "
                f"than the context window of {model} ({limit} tokens, {source}); lower "
                f"data.max_prompt_tokens (longer prompts are skipped and counted) or {field} "
                f"so that their sum is at most {limit}, or use a model with a longer context")


def _check_model(cfg: ExperimentConfig, model_path: str | Path | None) -> None:
    from rl_core.models.hub import EMBEDDED_TINY, local_model_dir, tiny_spec_for, verify_model_dir

    m = cfg.model
    d = Path(model_path) if model_path else local_model_dir(m, cfg.data, cfg.storage.cache_dir)
    if d is None:
        if m.path == EMBEDDED_TINY:  # not built yet: its spec knows its context
            limit = tiny_spec_for(m, cfg.data).max_position_embeddings
            _check_context(cfg, limit, "the embedded tiny model", "its max_position_embeddings")
        else:
            log.info("pre-flight: %s is not on this machine yet; its checks run after fetch-model",
                     m.path)
        return
    _check_vision_model(cfg, d)
    if (found := context_length(d)) is not None:
        _check_context(cfg, found[0], f"the model at {d}", found[1])
    elif (d / "config.json").is_file():
        log.warning("pre-flight: %s/config.json names no context length; not checked", d)
    verify_model_dir(d, trust_remote_code=m.trust_remote_code)
    _check_prompt(cfg, d)


def _check_vision_model(cfg: ExperimentConfig, d: Path) -> None:
    """A vision-language checkpoint (a ``vision_config`` in its config.json) trains on the
    torch backend only, and ``model.freeze_vision`` needs one (docs/vlm.md)."""
    try:
        config = json.loads((d / "config.json").read_text())
    except (OSError, ValueError):
        return  # verify_model_dir says what is wrong with it
    vision = isinstance(config, dict) and "vision_config" in config
    if vision and cfg.train.backend == "megatron":
        raise ConfigError(
            f"train.backend: megatron does not train vision-language models; {d} is one "
            f"({config.get('model_type')}). Use train.backend: torch (FSDP2 on GPUs), which "
            "trains its language model and, with model.freeze_vision: false, its vision tower.")
    if vision and config.get("image_token_id") is None:
        raise ConfigError(
            f"model.path: {d} is a vision-language model ({config.get('model_type')}) without "
            "an image_token_id; grpoflow runs the Qwen2-VL family (Qwen2-VL, Qwen2.5-VL, "
            "Qwen3-VL): docs/vlm.md")


def _check_prompt(cfg: ExperimentConfig, d: Path) -> None:
    """One prompt renders as the run renders it, and leaves room for a question."""
    from transformers import AutoTokenizer

    from rl_core.data.prompts import encode_prompts

    c = cfg.data
    tok = AutoTokenizer.from_pretrained(d, trust_remote_code=cfg.model.trust_remote_code)
    chat = bool(getattr(tok, "chat_template", None)) and c.use_chat_template is not False
    try:
        [ids] = encode_prompts(tok, [""], system_prompt=c.system_prompt,
                               use_chat_template=c.use_chat_template,
                               plain_template=c.plain_template)
    except ConfigError:  # data.use_chat_template: true without a chat template
        raise
    except Exception as exc:  # noqa: BLE001 - a template that does not render (jinja)
        raise ConfigError(
            f"the chat template of the tokenizer at {d} does not render a prompt "
            f"({type(exc).__name__}: {exc}); fix chat_template (tokenizer_config.json or "
            "chat_template.jinja), or set data.use_chat_template=false to use data.plain_template"
        ) from None
    if len(ids) >= c.max_prompt_tokens:
        what = "the chat template" if chat else f"data.plain_template={c.plain_template!r}"
        system = " with data.system_prompt" if c.system_prompt else ""
        raise ConfigError(
            f"{what}{system} is {len(ids)} tokens before any question, and "
            f"data.max_prompt_tokens={c.max_prompt_tokens}: every prompt would be skipped as "
            f"too long; raise data.max_prompt_tokens well above {len(ids)}, or shorten the "
            "template" + (" or data.system_prompt" if c.system_prompt else ""))
