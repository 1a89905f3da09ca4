"""Reading config files (YAML plus dotted command-line overrides), errors that name the field
and the fix, and `Section`, the strict base of every section. Shared by every schema
(:mod:`rl_core.config` for GRPO, :mod:`rl_core.sft` for SFT).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

__all__ = ["ConfigError", "Section", "apply_overrides", "flatten", "read_config", "validate_config"]

M = TypeVar("M", bound=BaseModel)


class ConfigError(ValueError):
    """A configuration problem a user can fix; the message names the field and the fix."""


def _format_error(err: ValidationError, origin: str, root: type[BaseModel]) -> str:
    lines = [f"invalid config ({origin}):"]
    for e in err.errors():
        path = ".".join(str(p) for p in e["loc"]) or "<root>"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
            if (parent := _section_for(e["loc"][:-1], root)) is not None:
                msg += f"; allowed keys: {', '.join(sorted(parent.model_fields))}"
        elif e["type"] == "literal_error":
            msg = f"got {e.get('input')!r}; allowed values: {e.get('ctx', {}).get('expected')}"
        elif e["type"] == "value_error":
            msg = msg.removeprefix("Value error, ")  # our validators name the value themselves
        elif "input" in e and not isinstance(e["input"], dict):
            msg += f" (got {e['input']!r})"
        lines.append(f"  {path}: {msg}")
    return "\n".join(lines)


def _section_for(loc: tuple[Any, ...], root: type[BaseModel]) -> type[BaseModel] | None:
    cls: type[BaseModel] = root
    for part in loc:
        field = cls.model_fields.get(str(part))
        ann = getattr(field, "annotation", None)
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return None
        cls = ann
    return cls


def _parse_value(raw: str) -> Any:
    """Parse an override's value as YAML so `0.001`, `true`, `[1, 2]` and `null` work."""
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `a.b.c=value` overrides to a nested dict (a copy is returned)."""
    out = json.loads(json.dumps(data))
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form section.key=value "
                              "(for example algorithm.kl_coef=0.001)")
        key, raw = item.split("=", 1)
        parts = [p for p in key.strip().split(".") if p]
        if not parts:
            raise ConfigError(f"override {item!r} has an empty key")
        node = out
        for i, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(
                    f"override {item!r}: {'.'.join(parts[: i + 1])} is a value, not a section")
            node = child
        node[parts[-1]] = _parse_value(raw)
    return out


def read_config(path: str | Path | None, overrides: Sequence[str] | None,
                example: str) -> tuple[dict[str, Any], str]:
    """A YAML config's mapping (``{}`` when ``path`` is None) with dotted ``overrides``
    applied, and where it came from (for errors); ``example`` is suggested when the file is
    missing."""
    data: dict[str, Any] = {}
    origin = "defaults"
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist (try {example})")
        try:
            loaded = yaml.safe_load(p.read_text(encoding="utf-8"))
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {p} is not valid YAML: {exc}") from exc
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {p} must hold a mapping at the top level")
        data, origin = loaded or {}, str(p)
    if overrides:
        data = apply_overrides(data, list(overrides))
        origin += " + overrides " + " ".join(overrides)
    return data, origin


def validate_config(cls: type[M], data: dict[str, Any], origin: str) -> M:
    """``cls`` from ``data``; a :class:`ConfigError` naming each bad field and the fix."""
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_error(exc, origin, cls)) from None


def flatten(cfg: BaseModel | dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Flatten a config to dotted keys (for tracking params and run summaries)."""
    data = cfg.model_dump(mode="json") if isinstance(cfg, BaseModel) else cfg
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, name + "."))
        elif isinstance(value, dict):  # an empty mapping field (cluster.env) stays visible
            out[name] = "{}"
        else:
            out[name] = value
    return out


class Section(BaseModel):
    """The base of every config section: unknown keys and non-finite floats are errors."""


    # allow_inf_nan=False: every float here is a rate, a weight or a bound on a wait; an
    # infinite timeout or learning rate is a mistake, never a setting.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)
