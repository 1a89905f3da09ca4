"""Tool calls in a model's text, Hermes format: ``<tool_call>{"name", "arguments"}</tool_call>``.

The format of Qwen2.5/Qwen3, Hermes and most open chat models, one or more per turn. The
engine's OpenAI routes return them in ``message.tool_calls``, as SGLang's
``--tool-call-parser`` does, when the request offers ``tools`` (never otherwise: a text that
merely looks like a call stays text); the agents' tool environments use the same parser.
Malformed calls are reported, never guessed.
"""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ToolCall", "parse_tool_calls"]

_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass
class ToolCall:
    """One parsed call; ``error`` is set (and ``name`` may be empty) when it is malformed."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every ``<tool_call>...</tool_call>`` in ``text``, in order (Hermes/Qwen format). A body
    that is not a JSON object with a string ``name`` and an object ``arguments`` (a JSON
    string holding an object is accepted, as OpenAI sends it) comes back with ``error``."""
    calls = []
    for body in _CALL.findall(text):
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            calls.append(ToolCall("", error=f"the tool call is not valid JSON ({e.msg})"))
            continue
        name = obj.get("name") if isinstance(obj, dict) else None
        args = obj.get("arguments", {}) if isinstance(obj, dict) else None
        if isinstance(args, str):
            with contextlib.suppress(json.JSONDecodeError):
                args = json.loads(args)
        if not isinstance(name, str) or not isinstance(args, dict):
            calls.append(ToolCall(name if isinstance(name, str) else "", error=(
                'a tool call must be {"name": str, "arguments": {...}}')))
            continue
        calls.append(ToolCall(name, args))
    return calls
