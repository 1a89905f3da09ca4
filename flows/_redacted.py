"""Flows whose parameters reach the Prefect API with their secrets masked.

Prefect stores a flow run's parameters as given and shows them to anyone who can read the
workspace. :class:`RedactedFlow` masks them in ``serialize_parameters`` with the rule of
:mod:`rl_core.secrets` (no rule of its own); the flow function still gets the real values.
Parameters of a *deployment* run are stored by the server before our code runs and cannot be
masked: keep credentials out of overrides (docs/reliability.md, 'Security'). Never logs.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

import yaml
from prefect import Flow

from rl_core.secrets import MASK, redact, redact_config

__all__ = ["RedactedFlow", "redact_override", "redact_parameters", "redacted_flow"]

P = ParamSpec("P")
R = TypeVar("R")
_OVERRIDE = re.compile(r"^\s*[\w\-]+(?:\.[\w\-]+)*\s*=")  # ``section.key=value``


def _parse(raw: str) -> Any:
    """An override's value as the config loader reads it (YAML; the text when not YAML)."""
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw


def redact_override(item: str) -> str:
    """``key=value`` with the value masked where it holds a secret; unchanged otherwise
    (``storage.s3_endpoint_url=http://u:p@h`` -> ``storage.s3_endpoint_url=http://***@h``)."""
    if not _OVERRIDE.match(item):
        return redact(item)
    key, raw = item.split("=", 1)
    masked = redact_config({key.strip(): (value := _parse(raw))})[key.strip()]
    if masked == MASK and value != MASK:
        return f"{key}={MASK}"
    if isinstance(value, dict | list) and masked != value:
        return f"{key}={json.dumps(masked, default=str)}"
    return redact(item)


def _redact_value(name: str, value: Any) -> Any:
    if isinstance(value, str) and _OVERRIDE.match(value):
        return redact_override(value)
    if isinstance(value, list | tuple):
        return [_redact_value(name, v) for v in value]
    return redact_config({name: value})[name]


def redact_parameters(parameters: dict[str, Any]) -> dict[str, Any]:
    """Serialized flow parameters (JSON-like) with every secret masked, whatever the name:
    override lists, strings, and mappings (by key name and by text)."""
    return {name: _redact_value(name, value) for name, value in parameters.items()}


class RedactedFlow(Flow[P, R]):
    """A Prefect flow whose parameters are stored redacted (see the module docstring)."""

    def serialize_parameters(self, parameters: dict[str, Any]) -> dict[str, Any]:
        return redact_parameters(super().serialize_parameters(parameters))

    def with_options(self, **kwargs: Any) -> RedactedFlow[P, R]:
        # Prefect builds the copy as a plain Flow; keep the redaction on it.
        new = super().with_options(**kwargs)
        new.__class__ = type(self)
        return new  # type: ignore[return-value]


def redacted_flow(**options: Any) -> Callable[[Callable[P, R]], RedactedFlow[P, R]]:
    """``@flow(**options)`` for a :class:`RedactedFlow`."""

    def wrap(fn: Callable[P, R]) -> RedactedFlow[P, R]:
        return RedactedFlow(fn, **options)

    return wrap
