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

__all__ = ["IMAGE_MARK", "PLAIN_TEMPLATE", "encode_prompts", "encode_record_prompts",
           "place_images", "render_prompt"]

PLAIN_TEMPLATE: str = DataConfig.model_fields["plain_template"].default  # one default


def render_prompt(tokenizer: Any, question: str | Sequence[Mapping[str, str]], *,  # noqa: ANN401
                  system_prompt: str | None = None, use_chat_template: bool | None = None,
                  plain_template: str = PLAIN_TEMPLATE, images: int = 0) -> str:
    """Prompt text for one question: the tokenizer's chat template over [system, user] (or the
    question's own messages) when ``use_chat_template`` allows and it has one, else
    ``plain_template`` with ``{question}`` replaced by the (last user message's) text, earlier
    messages' texts before it (docs/configuration.md, 'Prompts'). Raises
    :class:`~rl_core.config.ConfigError` for a required chat template that is missing or a
    template without ``{question}``. ``images``: how many images the record has; those its
    messages do not place (``data.image_field``'s) go first in the first user message, or
    at each ``<image>`` of its text (docs/vlm.md, "Images in the prompt")."""
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if use_chat_template and not has_template:
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise ConfigError(
            f"data.use_chat_template is true but the tokenizer {name!r} has no chat template; "
            "set data.use_chat_template to false or null (auto) to use data.plain_template, or "
            "use a tokenizer that ships a chat template")
    messages = ([{"role": "user", "content": question}] if isinstance(question, str)
                else [{"role": m["role"], "content": m["content"]} for m in question])
    if images:
        messages = place_images(messages, images)
    if system_prompt is not None and not any(m["role"] == "system" for m in messages):
        messages.insert(0, {"role": "system", "content": system_prompt})
    if images and not (has_template and use_chat_template is not False):
        raise ConfigError("a record with images needs the tokenizer's chat template (it writes "
                          "the image placeholders); set data.use_chat_template to true or null")
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


IMAGE_MARK = "<image>"  # where a text question places a data.image_field image (verl's form)


def place_images(messages: Sequence[Mapping[str, Any]], images: int) -> list[dict[str, Any]]:
    """``messages`` with image parts for the ``images`` a record has beyond the ones its
    messages already hold: at the first user message's ``<image>`` marks when it has exactly
    that many, else before its text."""
    out = [dict(m) for m in messages]
    held = sum(1 for m in out if isinstance(m["content"], list)
               for p in m["content"] if p.get("type") in ("image", "image_url"))
    extra = images - held
    if extra <= 0:
        return out
    user = next(i for i, m in enumerate(out) if m["role"] == "user")
    content = out[user]["content"]
    parts = [{"type": "text", "text": content}] if isinstance(content, str) else list(content)
    text = parts[0].get("text", "") if parts and parts[0].get("type") == "text" else None
    if text is not None and text.count(IMAGE_MARK) == extra:
        pieces = text.split(IMAGE_MARK)
        placed: list[dict[str, Any]] = []
        for k, piece in enumerate(pieces):
            if piece:
                placed.append({"type": "text", "text": piece})
            if k < extra:
                placed.append({"type": "image"})
        out[user]["content"] = placed + parts[1:]
    else:
        out[user]["content"] = [{"type": "image"}] * extra + parts
    return out


def encode_prompts(tokenizer: Any, questions: Iterable[str | Sequence[Mapping[str, str]]],  # noqa: ANN401
                   **kw: Any) -> list[list[int]]:  # noqa: ANN401
    """Render each question with :func:`render_prompt` (``kw`` passed through) and tokenize it
    with ``add_special_tokens=False``: only what the template writes (e.g. a BOS) is included."""
    texts = [render_prompt(tokenizer, q, **kw) for q in questions]
    if not texts:
        return []
    encoded = tokenizer(texts, add_special_tokens=False)
    return [list(ids) for ids in encoded["input_ids"]]


def encode_record_prompts(tokenizer: Any, records: Sequence[Any], vision: Any = None,  # noqa: ANN401
                          **kw: Any) -> list[list[int]]:  # noqa: ANN401
    """:func:`encode_prompts` of records' questions with their images placed (``vision``: a
    :class:`~rl_core.models.vlm.VisionProcessor`, which expands each image's pad to the
    model's token count; needed when a record has images)."""
    if not any(getattr(r, "images", ()) for r in records):
        return encode_prompts(tokenizer, [r.question for r in records], **kw)
    if vision is None:
        raise ConfigError(f"{sum(1 for r in records if r.images)} records carry images but "
                          "model.path is a text model: use a vision-language model "
                          "(docs/vlm.md) or set data.image_field: null")
    texts = [render_prompt(tokenizer, r.question, images=len(r.images), **kw) for r in records]
    if not texts:
        return []
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
    return [vision.expand(list(ids), vision.process(r.images) if r.images else None)
            for ids, r in zip(encoded, records, strict=True)]
