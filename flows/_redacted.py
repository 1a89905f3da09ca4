"""Flows whose parameters reach the Prefect API with their secrets masked.

Prefect stores a flow run's parameters as given, and its UI and API show them to anyone who
can read the workspace: a credential typed into an override
(``storage.s3_endpoint_url=http://user:pass@host``, ``cluster.env={WANDB_API_KEY: ...}``)
would be stored there. :class:`RedactedFlow` masks them in ``serialize_parameters``, the one
place Prefect turns parameters into what it sends (creating a flow or subflow run, a worker
submitting one); the flow function is still called with the real values.

What is masked is what :mod:`rl_core.secrets` masks everywhere else (no rule of its own here;
an override is only read as ``key=value``): an override whose key looks secret
(:func:`~rl_core.secrets.is_secret_name`), every ``cluster.env`` value but the known-harmless
settings, the value after a secret-named flag in an argument list, and in every string
``user:pass@`` in URLs, AWS key ids, HF tokens, the values of secret-named environment
variables and ``token=``-style assignments.

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
    """``key=value`` with the value masked where it holds a secret; unchanged otherwise.

    ``storage.s3_endpoint_url=http://u:p@h`` -> ``storage.s3_endpoint_url=http://***@h``;
    ``cluster.env={HF_TOKEN: x, OMP_NUM_THREADS: '2'}`` ->
    ``cluster.env={"HF_TOKEN": "***", "OMP_NUM_THREADS": "2"}``.
    """
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
