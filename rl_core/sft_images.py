"""Images in SFT rows (docs/sft.md, "Images"): read and checked as GRPO's records read them,
tokenized as the GRPO rollout renders them, so SFT trains on the ids the rollout later sends.

A row's images are those of its ``data.image_field`` column (one reference or a list), then
those of its chat turns' image parts (``{"type": "image", "image": ...}`` or OpenAI's
``image_url``), each loaded by :mod:`rl_core.data.images` (paths relative to the data file,
``s3://``, bytes, ``datasets`` Image cells, base64 data URLs) and refused, row named, like a
GRPO record's. A prompt row with images is encoded by
:func:`~rl_core.data.prompts.encode_record_prompts` (images at the prompt's ``<image>`` marks,
else first; each pad expanded by the checkpoint's processor); a chat row's image parts are
rendered by the chat template and expanded the same way, never trained on.
Imports no torch itself (the processor is passed in).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from rl_core.config import ConfigError
from rl_core.data.images import ImageSpec
from rl_core.data.prompts import encode_record_prompts
from rl_core.data.records import IMAGE_PARTS, field_images, message_images

__all__ = ["check_vision_model", "encode_image_prompt", "expand_parts", "keep_whole_images",
           "parts_problem", "row_images"]


def parts_problem(role: str, content: Sequence[Any], turn: int, name: str) -> str | None:
    """Why a chat turn's content parts are unusable, or None: text and image parts only, and
    none in an assistant turn (the model writes text; pictures go in user turns)."""
    if role == "assistant":
        return (f"turn {turn} of {name!r}: an assistant turn's content must be text (images go "
                "in the user's turns)")
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind not in ("text", *IMAGE_PARTS) or (
                kind == "text" and not isinstance(part.get("text"), str)):
            return (f"turn {turn} of {name!r}, part {j}: not {{'type': 'text', 'text': ...}}, "
                    "{'type': 'image', 'image': ...} or {'type': 'image_url', 'image_url': "
                    "{'url': ...}}")
    return None


def row_images(fields: dict[str, Any], row: Mapping[str, Any], messages_field: str,
               spec: ImageSpec) -> tuple[dict[str, Any] | None, str | None]:
    """``fields`` (a checked row's) with its images read: ``images`` (encoded bytes, those of
    ``spec.field`` first) and chat turns whose image parts are left as ``{"type": "image"}``;
    or (None, why) naming the field and the image."""
    pixels, problems = field_images(row, spec)
    if not problems and "messages" in fields:
        messages, problems = message_images(
            [{"role": r, "content": c} for r, c in fields["messages"]], spec, messages_field,
            pixels)
        fields = {"messages": tuple((m["role"], m["content"]) for m in messages)}
    if problems:
        return None, "; ".join(problems)
    return ({**fields, "images": tuple(pixels)} if pixels else fields), None


def check_vision_model(model_path: str | Path, image_field: str | None, pictured: int = 0) -> None:
    """Refuse a text model for rows with images (``pictured`` of them, or any row when
    ``image_field`` is set): it would train without the pictures."""
    from rl_core.models.vlm import is_vision_checkpoint

    if not (pictured or image_field is not None) or is_vision_checkpoint(model_path):
        return
    what = f"{pictured} SFT examples carry images" if pictured else "SFT rows carry images"
    raise ConfigError(
        f"{what} (data.image_field={image_field!r} or image parts in the chat turns) but "
        f"model.path ({model_path}) is a text model: it would train without the pictures. Use "
        "a vision-language model (Qwen2-VL, Qwen2.5-VL, Qwen3-VL; docs/vlm.md), or set "
        "data.image_field: null and drop the image parts to train on the text.")


def encode_image_prompt(tokenizer: Any, prompt: str, images: Sequence[bytes], d: Any,  # noqa: ANN401
                        vision: Any) -> list[int]:  # noqa: ANN401
    """A prompt row's prompt ids with its images: rendered and expanded exactly as the GRPO
    rollout encodes a record (``data.render_prompts``), else the literal prompt, which must
    hold one ``<|vision_start|><|image_pad|><|vision_end|>`` per image, expanded."""
    if vision is None:
        raise ValueError(f"the row has {len(images)} image(s) but the model has no image "
                         "processor (a text model); use a vision-language model")
    if d.render_prompts:
        [ids] = encode_record_prompts(
            tokenizer, [SimpleNamespace(question=prompt, images=tuple(images))], vision,
            system_prompt=d.system_prompt, use_chat_template=d.use_chat_template,
            plain_template=d.plain_template)
        return ids
    ids = list(tokenizer(prompt, add_special_tokens=False)["input_ids"]) if prompt else []
    return vision.expand(ids, vision.process(images))


def expand_parts(parts: list[tuple[list[int], bool]], vision: Any,  # noqa: ANN401
                 images: Sequence[bytes]) -> list[tuple[list[int], bool]]:
    """A chat row's (ids, trained) parts with each image placeholder expanded to its image's
    pad count, in order; raises ValueError when placeholders and images do not pair up or a
    trained part holds one."""
    if vision is None:
        raise ValueError(f"the row has {len(images)} image(s) but the model has no image "
                         "processor (a text model); use a vision-language model")
    tokens = vision.process(images).tokens
    out, k = [], 0
    for ids, trained in parts:
        spans = vision.placeholders(ids)
        if spans and trained:
            raise ValueError("an assistant turn holds an image placeholder; images go in the "
                             "user's turns")
        if k + len(spans) > len(tokens):
            raise ValueError(f"the chat template wrote more image placeholders than the row's "
                             f"{len(tokens)} image(s)")
        new, at = [], 0
        for (a, b), n in zip(spans, tokens[k : k + len(spans)], strict=True):
            new += [*ids[at:a], *([vision.pad] * n)]
            at = b
        out.append((new + list(ids[at:]), trained))
        k += len(spans)
    if k != len(tokens):
        raise ValueError(f"the chat template wrote {k} image placeholder(s) for the row's "
                         f"{len(tokens)} image(s); use a template that renders image parts")
    return out


def keep_whole_images(ids: list[int], limit: int, vision: Any) -> tuple[int, int]:  # noqa: ANN401
    """(where to cut ``ids`` to at most ``limit`` tokens without cutting an image, how many
    images are kept): a cut through an image moves before its vision start token."""
    spans = vision.placeholders(ids)
    if len(ids) <= limit:
        return len(ids), len(spans)
    for k, (a, b) in enumerate(spans):
        end = b + (vision.end is not None)  # through the vision end token
        if end > limit:
            return a - (vision.start is not None), k
    return limit, len(spans)
