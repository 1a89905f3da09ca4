"""Flows whose parameters reach the Prefect API with their secrets masked.

Prefect stores a flow run's parameters as it is given them, and its UI and API show them to
anyone who can read the workspace. A credential typed into an override
(``storage.s3_endpoint_url=http://user:pass@host``, ``cluster.env={WANDB_API_KEY: ...}``)
would be stored there. :class:`RedactedFlow` masks them in ``serialize_parameters``, the one
place Prefect turns a flow's parameters into what it sends (creating a flow run or a
subflow run, a worker submitting one); the flow function itself is still called with the
real values, never with the serialized ones.

What is masked, by :func:`tasks.tracking.redact` and :func:`tasks.tracking.redact_config`:
an override whose key's last part looks secret (``*token*``, ``*key*``, ``*password*``, ...),
entries under such keys in an override's mapping value (``cluster.env={...}``), and in every
string ``user:pass@`` in URLs, AWS key ids, the values of secret-named environment variables
and ``token=``-style assignments.

What it cannot mask: parameters of a *deployment* run (``prefect deployment run --param``,
the UI's run form) are stored by the Prefect server before any code of ours runs. Keep
credentials in the environment or in Prefect Secret blocks, not in overrides.

Never changes the values the flow receives; never logs.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

import yaml
from prefect import Flow

from tasks.tracking import _is_secret_name, redact, redact_config

__all__ = ["RedactedFlow", "redact_override", "redact_parameters", "redacted_flow"]

P = ParamSpec("P")
R = TypeVar("R")

_MASK = "***"
_OVERRIDE = re.compile(r"^\s*[\w\-]+(?:\.[\w\-]+)*\s*=")  # ``section.key=value``


def _parse(raw: str) -> Any:
    """An override's value as the config loader reads it (YAML; the text when not YAML)."""
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw


def redact_override(item: str) -> str:
    """``key=value`` with the value masked where it holds a secret; unchanged otherwise.

    ``storage.s3_endpoint_url=http://u:p@h`` -> ``storage.s3_endpoint_url=http://***:***@h``;
    ``cluster.env={HF_TOKEN: x, A: '1'}`` -> ``cluster.env={"HF_TOKEN": "***", "A": "1"}``.
    """
    if not _OVERRIDE.match(item):
        return redact(item)
    key, raw = item.split("=", 1)
    name = key.strip()
    if raw.strip() and _is_secret_name(name.rsplit(".", 1)[-1]):
        return f"{key}={_MASK}"
    value = _parse(raw)
    if isinstance(value, dict | list):
        masked = redact_config({name: value})[name]
        if masked != value:
            return f"{key}={json.dumps(masked, default=str)}"
    return redact(item)


def _redact_value(name: str, value: Any) -> Any:
    if isinstance(value, str):
        if value and _is_secret_name(name):
            return _MASK  # a secret-named parameter or mapping entry
        return redact_override(value) if _OVERRIDE.match(value) else redact(value)
    if isinstance(value, list | tuple):
        return [_redact_value(name, v) for v in value]
    if isinstance(value, dict):
        return {k: _redact_value(str(k), v) for k, v in value.items()}
    return value


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
