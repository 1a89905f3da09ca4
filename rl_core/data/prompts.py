"""Turn questions into model prompts: the tokenizer's chat template, or a plain template.

A question is text, or chat messages (``[{role, content}]``: a dataset's conversational
prompt, docs/data-and-rewards.md), to which ``data.system_prompt`` is prepended when they have
no system message of their own.

Rollout and evaluation must render prompts the same way, so both go through
:func:`render_prompt` / :func:`encode_prompts`.

This module must never load a tokenizer itself (callers pass one in), download anything, or
depend on Prefect or MLflow. It adds no special tokens beyond what the chat template writes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from rl_core.config import ConfigError, DataConfig

__all__ = ["PLAIN_TEMPLATE", "encode_prompts", "render_prompt"]

PLAIN_TEMPLATE: str = DataConfig.model_fields["plain_template"].default  # one default


def render_prompt(tokenizer: Any, question: str | Sequence[Mapping[str, str]], *,  # noqa: ANN401
                  system_prompt: str | None = None, use_chat_template: bool | None = None,
                  plain_template: str = PLAIN_TEMPLATE) -> str:
    """Prompt text for one question: the tokenizer's chat template over [system, user] (or the
    question's own messages) when ``use_chat_template`` allows and it has one, else
    ``plain_template`` with ``{question}`` replaced by the (last user message's) text, earlier
    messages' texts before it (docs/configuration.md, 'Prompts'). Raises
    :class:`~rl_core.config.ConfigError` for a required chat template that is missing or a
    template without ``{question}``."""
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if use_chat_template and not has_template:
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise ConfigError(
            f"data.use_chat_template is true but the tokenizer {name!r} has no chat template; "
            "set data.use_chat_template to false or null (auto) to use data.plain_template, or "
            "use a tokenizer that ships a chat template")
    messages = ([{"role": "user", "content": question}] if isinstance(question, str)
                else [{"role": m["role"], "content": m["content"]} for m in question])
    if system_prompt is not None and not any(m["role"] == "system" for m in messages):
        messages.insert(0, {"role": "system", "content": system_prompt})
    if has_template and use_chat_template is not False:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        if not isinstance(text, str):  # defensive: some versions wrap the result
            raise TypeError(f"apply_chat_template returned {type(text).__name__}, expected str")
        return text
    if "{question}" not in plain_template:
        raise ConfigError(
            f"data.plain_template must contain '{{question}}', got {plain_template!r}")
    last = max(i for i, m in enumerate(messages) if m["role"] == "user")
    before = [m["content"] for m in messages[:last]] + [
        plain_template.replace("{question}", messages[last]["content"])]
    return "\n\n".join([*before, *(m["content"] for m in messages[last + 1:])])


def encode_prompts(tokenizer: Any, questions: Iterable[str | Sequence[Mapping[str, str]]],  # noqa: ANN401
                   **kw: Any) -> list[list[int]]:  # noqa: ANN401
    """Render each question with :func:`render_prompt` (``kw`` passed through) and tokenize it
    with ``add_special_tokens=False``: only what the template writes (e.g. a BOS) is included."""
    texts = [render_prompt(tokenizer, q, **kw) for q in questions]
    if not texts:
        return []
    encoded = tokenizer(texts, add_special_tokens=False)
    return [list(ids) for ids in encoded["input_ids"]]
