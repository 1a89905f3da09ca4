"""Token-exact chat: the ids of a conversation that grows turn by turn.

:class:`ChatTokens` makes an episode's non-model tokens from the chat template: the prompt, and
after each model turn the template's tokens up to the next generation prompt (what the template
writes after an earlier assistant turn's end-of-turn token, so a template that rewrites earlier
turns, e.g. drops their reasoning, still yields them; a turn cut short gets the end-of-turn token
first). :meth:`ChatTokens.render` of the whole conversation tells whether re-rendering would
differ from the recorded chain (docs/agents.md, 'Reasoning templates'). Never imports Prefect or
MLflow; never decodes and re-encodes a model turn.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rl_core.agents.env import Message

__all__ = ["TEMPLATE_MISMATCH", "ChatTokens", "message_images"]

# The stand-in history a model turn's successors are rendered after: its text is a marker, so
# what the template writes after the turn (from its end-of-turn token) is found whatever the
# template does to the turn itself.
_MARK = "grpoflow-turn-7f3a9c"
_STAND_IN: list[Message] = [{"role": "user", "content": "u"}, {"role": "assistant", "content": _MARK}]
# What an episode does when the template renders the conversation differently from the
# recorded tokens (agent.template_mismatch; docs/agents.md, 'Reasoning templates').
TEMPLATE_MISMATCH = ("keep_prefix", "new_sample")


class ChatTokens:
    """The chat template of ``tokenizer`` as token ids for episodes (see the module docstring)."""

    def __init__(self, tokenizer: Any, vision: Any = None) -> None:  # noqa: ANN401
        if not getattr(tokenizer, "chat_template", None):
            name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
            raise ValueError(f"the tokenizer {name!r} has no chat template: multi-turn episodes "
                             "(agent.env) need one; use a chat model's tokenizer")
        self.tokenizer = tokenizer
        self.vision = vision  # a VisionProcessor: image parts' pads expanded (docs/vlm.md)
        eos = tokenizer.eos_token or ""
        self.end_of_turn = self.encode(eos) if eos else []
        self.stop_ids = set(self.end_of_turn) | {tokenizer.eos_token_id} - {None}

    def render(self, messages: Sequence[Message], *, generation_prompt: bool,
               tools: list[dict[str, Any]] | None = None,
               template_kwargs: dict[str, Any] | None = None) -> str:
        """``messages`` as the template's text (with ``tools`` and template arguments, as an
        OpenAI request gives them)."""
        extra = {**({"tools": tools} if tools else {}), **(template_kwargs or {})}
        text = self.tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=generation_prompt, **extra)
        if not isinstance(text, str):
            raise TypeError(f"apply_chat_template returned {type(text).__name__}, expected str")
        return text

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        """Ids as text, special tokens included (a model turn as the chain holds it)."""
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=False))

    def content(self, turn_ids: Sequence[int]) -> str:
        """A model turn as an assistant message's content: its text without the stop token
        that ended it (the template writes its own end-of-turn token)."""
        closed = bool(turn_ids) and turn_ids[-1] in self.stop_ids
        return self.decode(turn_ids[:-1] if closed else turn_ids)

    def prompt(self, messages: Sequence[Message], **template: Any) -> tuple[list[int], str]:  # noqa: ANN401
        """``messages`` with the generation prompt, as ids and as the template's text."""
        text = self.render(messages, generation_prompt=True, **template)
        return self.encode(text), text

    def prompt_ids(self, messages: Sequence[Message]) -> list[int]:
        """The first messages with the generation prompt: what the model answers first."""
        return self.prompt(messages)[0]

    def observation(self, messages: Sequence[Message], turn_ids: Sequence[int],
                    **template: Any) -> tuple[list[int], str]:  # noqa: ANN401
        """The tokens that follow the model turn ``turn_ids`` (its end-of-turn token when the
        turn was cut short, the template's text after it, ``messages`` and the generation
        prompt of the next model turn), and their text. The template renders ``messages``
        after a stand-in turn; only what it writes after that turn's end-of-turn token is
        kept, so earlier turns are never re-tokenized, even where the template rewrites them
        (Qwen3's dropped reasoning)."""
        full = self.render([*_STAND_IN, *messages],
                           generation_prompt=True, **template)
        eos = self.tokenizer.eos_token or ""
        at = full.rfind(_MARK)
        end = -1 if at < 0 else full.find(eos, at + len(_MARK)) if eos else at + len(_MARK)
        if end < 0:
            raise ValueError("the chat template rewrites history so that an earlier assistant "
                             "turn loses its text or its end-of-turn token "
                             f"({eos!r}): the tokens after a model turn cannot be found; use a "
                             "template that keeps earlier turns' text")
        closed = bool(turn_ids) and turn_ids[-1] in self.stop_ids
        head, head_text = ([], "") if closed else (list(self.end_of_turn), eos)
        text = full[end + len(eos):]
        return head + self.encode(text), head_text + text

    def observation_ids(self, messages: Sequence[Message], turn_ids: Sequence[int]) -> list[int]:
        """:meth:`observation`'s ids."""
        return self.observation(messages, turn_ids)[0]

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
