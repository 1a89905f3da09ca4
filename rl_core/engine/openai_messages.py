"""OpenAI request checking shared by the engine's routes and the agent gateway: the error shape,
chat messages and completion prompts.

:class:`OpenAIError` is a refusal in OpenAI's error body (``{"error": {"message", "type",
"param", "code"}}``), which the ``openai`` client raises by status (400 ``BadRequestError``,
404 ``NotFoundError``, ...). :func:`normalize_messages` checks chat messages field by field and
says which message is wrong. Never touches the engine.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

from fastapi.responses import JSONResponse

__all__ = ["OpenAIError", "checked", "is_int", "is_number", "message_images",
           "normalize_messages", "openai_error", "prompt_list"]

_ROLES = {"system", "user", "assistant", "tool", "developer"}


class OpenAIError(Exception):
    """A request refused, answered as ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, message: str, status: int = 400, *, param: str | None = None,
                 code: str | None = None, type: str | None = None) -> None:  # noqa: A002
        super().__init__(message)
        self.status, self.param, self.code = status, param, code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    def response(self) -> JSONResponse:
        return openai_error(str(self), self.status, param=self.param, code=self.code,
                            type=self.type)


def openai_error(message: str, status: int = 400, *, param: str | None = None,
                 code: str | None = None, type: str | None = None) -> JSONResponse:  # noqa: A002
    """OpenAI's error body; ``type`` defaults by status (4xx: invalid_request_error)."""
    kind = type or ("invalid_request_error" if status < 500 else "server_error")
    return JSONResponse({"error": {"message": message, "type": kind, "param": param,
                                   "code": code}}, status_code=status)


def is_number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def checked(body: dict[str, Any], name: str, ok: Any, what: str) -> Any:
    value = body.get(name)
    if value is not None and not ok(value):
        raise OpenAIError(f"{name} must be {what}, got {json.dumps(value)[:80]}", param=name,
                          code="invalid_value")
    return value


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Chat messages as the template takes them: ``content`` a string (a list of text parts
    is joined; ``None`` stays for an assistant turn with tool calls), ``developer`` as
    ``system``; with image parts (OpenAI's ``image_url``, or ``{"type": "image", "image":
    ...}``) the content stays a list, each image part as ``{"type": "image", "image": <url>}``
    (what Qwen-VL chat templates render; :func:`message_images` lists them). Anything else
    (unknown parts or roles) is a 400 naming the message."""
    if not isinstance(messages, list) or not messages:
        raise OpenAIError("messages must be a non-empty list of chat messages", param="messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in _ROLES:
            raise OpenAIError(f"{where} must be an object with role one of {sorted(_ROLES)}, got "
                              f"{json.dumps(m)[:120]}", param=where)
        content = m.get("content")
        if isinstance(content, list):
            parts = [_content_part(part, f"{where}.content") for part in content]
            if all(p["type"] == "text" for p in parts):
                content = "".join(p["text"] for p in parts)
            else:
                content = parts
        elif content is not None and not isinstance(content, str):
            raise OpenAIError(f"{where}.content must be a string, a list of text parts or null",
                              param=f"{where}.content")
        calls = m.get("tool_calls")
        if calls is not None and not (m["role"] == "assistant" and isinstance(calls, list) and all(
                isinstance(c, dict) and isinstance(c.get("function"), dict)
                and isinstance(c["function"].get("name"), str)
                and isinstance(c["function"].get("arguments", "{}"), str | dict)
                for c in calls)):
            raise OpenAIError(f"{where}.tool_calls must be a list of {{\"type\": \"function\", "
                              '"function": {"name", "arguments"}} on an assistant message',
                              param=f"{where}.tool_calls")
        if content is None and not (m["role"] == "assistant" and calls):
            raise OpenAIError(f"{where}.content is null; only an assistant message with "
                              "tool_calls may omit it", param=f"{where}.content")
        role = "system" if m["role"] == "developer" else m["role"]
        out.append({**{k: v for k, v in m.items() if v is not None}, "role": role,
                    "content": content})
    return out


def _content_part(part: Any, where: str) -> dict[str, Any]:
    """One content part: a text part, or an image part as ``{"type": "image", "image": url}``."""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text" and isinstance(part.get("text"), str):
        return {"type": "text", "text": part["text"]}
    url = part.get("image_url") if kind == "image_url" else part.get("image") \
        if kind == "image" else None
    url = url.get("url") if isinstance(url, dict) else url
    if isinstance(url, str) and url:
        return {"type": "image", "image": url}
    raise OpenAIError(f"{where}: a part must be {{\"type\": \"text\", \"text\"}} or "
                      '{"type": "image_url", "image_url": {"url"}}, got '
                      f"{json.dumps(part)[:120]}", param=where)


def message_images(messages: Sequence[dict[str, Any]]) -> list[str]:
    """The image urls of :func:`normalize_messages`' messages, in the order they render."""
    return [p["image"] for m in messages if isinstance(m.get("content"), list)
            for p in m["content"] if p.get("type") == "image"]


def prompt_list(prompt: Any) -> tuple[list[str | list[int]], bool]:
    """A completions ``prompt``: a string, token ids, or a list of either (a batch)."""
    if isinstance(prompt, str):
        return [prompt], True
    if isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt):
        return [list(prompt)], True
    if isinstance(prompt, list) and prompt and all(
            isinstance(p, str) or (isinstance(p, list) and p and all(is_int(t) for t in p))
            for p in prompt):
        return list(prompt), False
    raise OpenAIError("prompt must be a string, a non-empty list of token ids, or a list of "
                      "those", param="prompt")
