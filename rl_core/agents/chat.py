"""Token-exact chat: the ids of a conversation that grows turn by turn.

:class:`ChatTokens` makes an episode's non-model tokens from the chat template: the prompt, and
after each model turn the template's tokens up to the next generation prompt (the difference of
two renderings; a turn cut short gets the end-of-turn token first). docs/agents.md, 'What an
episode is'. Never imports Prefect or MLflow; never decodes and re-encodes a model turn.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rl_core.agents.env import Message

__all__ = ["ChatTokens", "message_images"]

_BASE: list[Message] = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]


class ChatTokens:
    """The chat template of ``tokenizer`` as token ids for episodes (see the module docstring)."""

    def __init__(self, tokenizer: Any, vision: Any = None) -> None:  # noqa: ANN401
        if not getattr(tokenizer, "chat_template", None):
            name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
            raise ValueError(f"the tokenizer {name!r} has no chat template: multi-turn episodes "
                             "(agent.env) need one; use a chat model's tokenizer")
        self.tokenizer = tokenizer
        self.vision = vision  # a VisionProcessor: image parts' pads expanded (docs/vlm.md)
        self._base = self.render(_BASE, generation_prompt=False)
        eos = tokenizer.eos_token or ""
        cut = self._base.rfind(eos) if eos else -1
        # The template's text after an assistant turn's end-of-turn token (ChatML: "\n").
        self._after_eos = self._base[cut + len(eos):] if cut >= 0 else ""
        self.end_of_turn = self.encode(eos) if eos else []
        self.stop_ids = set(self.end_of_turn) | {tokenizer.eos_token_id} - {None}

    def render(self, messages: Sequence[Message], *, generation_prompt: bool) -> str:
        text = self.tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=generation_prompt)
        if not isinstance(text, str):
            raise TypeError(f"apply_chat_template returned {type(text).__name__}, expected str")
        return text

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prompt_ids(self, messages: Sequence[Message]) -> list[int]:
        """The first messages with the generation prompt: what the model answers first."""
        return self.encode(self.render(messages, generation_prompt=True))

    def observation_ids(self, messages: Sequence[Message], turn_ids: Sequence[int]) -> list[int]:
        """The tokens that follow the model turn ``turn_ids``: its end-of-turn token when the
        turn was cut short, the template's text after it, ``messages`` and the generation
        prompt of the next model turn."""
        full = self.render([*_BASE, *messages], generation_prompt=True)
        if not full.startswith(self._base):
            raise ValueError("the chat template renders earlier messages differently once more "
                             "follow (it rewrites history), so a conversation cannot grow token "
                             "by token; use a template that only appends")
        closed = bool(turn_ids) and turn_ids[-1] in self.stop_ids
        head = [] if closed else list(self.end_of_turn)
        return head + self.encode(self._after_eos + full[len(self._base):])

    def with_images(self, ids: list[int], messages: Sequence[Message]) -> tuple[list[int], list[bytes]]:
        """``ids`` rendered from ``messages`` with their image parts' pads expanded, and those
        images' bytes in order (none: ``ids`` as they are). Raises ValueError for images
        without a vision-language model, or a bad image (named by message and part)."""
        images = message_images(messages)
        if not images:
            return ids, []
        if self.vision is None:
            raise ValueError(f"{len(images)} image(s) in the messages but the model is a text "
                             "model; image observations need a vision-language model")
        return self.vision.expand(ids, self.vision.process(images)), images


def message_images(messages: Sequence[Message]) -> list[bytes]:
    """The image parts' images of ``messages`` as checked, encoded bytes, in order."""
    from rl_core.data.images import ImageError, ImageSpec, load_image

    out = []
    for i, m in enumerate(messages):
        if not isinstance(m.get("content"), list):
            continue
        for j, part in enumerate(m["content"]):
            if part.get("type") == "image":
                try:
                    out.append(load_image(part["image"], ImageSpec()))
                except ImageError as exc:
                    raise ValueError(f"message {i}, part {j}: {exc}") from exc
    return out
