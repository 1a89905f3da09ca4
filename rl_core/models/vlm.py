"""What a Qwen2-VL-family model (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) needs beside the token ids,
shared by the engine and the trainer so both see the same inputs (issue 37, docs/vlm.md).

:class:`VisionProcessor` turns a prompt's images (encoded bytes) into the model's pixel
inputs (:class:`ImageInputs`: ``pixel_values`` and ``image_grid_thw``, by the checkpoint's own
image processor) and expands each image placeholder of the token ids
(``<|vision_start|><|image_pad|>...<|vision_end|>``, any number of pads) to one pad per merged
patch, as SGLang's processor does: a prompt whose pads are already expanded stays as it is.

transformers keeps M-RoPE state on the model object (``rope_deltas``, one batch at a time); an
engine with continuous batching and a trainer with packed rows cannot. :func:`mrope_positions`
computes a padded batch's 3-row (temporal, height, width) positions per row, and the position
its next token takes: a decode step continues at the row's last position + 1 on all three
rows, as SGLang's ``MRotaryEmbedding`` does.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = ["BANNED_LOGIT", "ImageInputs", "VisionProcessor", "concat_images", "copy_processor", "is_vision_checkpoint",
           "is_vision_config", "is_vision_model", "mrope_positions", "placeholder_ids", "vision_processor"]


def is_vision_config(config: Any) -> bool:  # noqa: ANN401 - a transformers config
    """Whether ``config`` is a Qwen2-VL-family vision-language model's."""
    return getattr(config, "vision_config", None) is not None and \
        getattr(config, "image_token_id", None) is not None


def is_vision_model(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a vision-language model whose image pads this module fills."""
    return is_vision_config(getattr(model, "config", None)) and \
        hasattr(getattr(model, "model", None), "get_rope_index")


@dataclass(frozen=True)
class ImageInputs:
    """One sequence's images as the model takes them: ``pixel_values`` (patches, dim) and
    ``grid_thw`` (images, 3); ``tokens`` is each image's pad count (merged patches)."""

    pixel_values: torch.Tensor
    grid_thw: torch.Tensor
    tokens: tuple[int, ...]

    @property
    def count(self) -> int:
        return len(self.tokens)


def concat_images(items: Sequence[ImageInputs | None]) -> ImageInputs | None:
    """Several sequences' images in row order (what one forward over their rows takes)."""
    kept = [x for x in items if x is not None and x.count]
    if not kept:
        return None
    return ImageInputs(torch.cat([x.pixel_values for x in kept]),
                       torch.cat([x.grid_thw for x in kept]),
                       tuple(t for x in kept for t in x.tokens))


class VisionProcessor:
    """A checkpoint's image processor and placeholder tokens (see the module docstring)."""

    def __init__(self, model_dir: str | Path, config: Any) -> None:  # noqa: ANN401
        from transformers import AutoImageProcessor

        if not is_vision_config(config):
            raise ValueError(f"{model_dir}: not a Qwen2-VL-family vision-language model "
                             "(its config has no vision_config and image_token_id)")
        try:
            self.processor = AutoImageProcessor.from_pretrained(str(model_dir))
        except (OSError, ValueError) as exc:
            raise ValueError(f"{model_dir}: no image processor (preprocessor_config.json): "
                             f"{exc}") from exc
        _check_patches(model_dir, self.processor, config.vision_config)
        self.pad = int(config.image_token_id)
        self.start = getattr(config, "vision_start_token_id", None)
        self.end = getattr(config, "vision_end_token_id", None)
        self.merge = int(getattr(config.vision_config, "spatial_merge_size", 2))

    def process(self, images: Sequence[bytes]) -> ImageInputs:
        """Decode and resize ``images`` (encoded bytes) by the processor's rules."""
        from PIL import Image

        pics = [Image.open(io.BytesIO(data)).convert("RGB") for data in images]
        out = self.processor(images=pics, return_tensors="pt")
        grid = out["image_grid_thw"].long()
        tokens = tuple(int(n) for n in grid.prod(-1) // self.merge**2)
        return ImageInputs(out["pixel_values"], grid, tokens)

    def placeholders(self, ids: Sequence[int]) -> list[tuple[int, int]]:
        """Each image placeholder's [start, end) span of pads in ``ids``. Pads between a
        vision start and end token form one image; without those tokens (a checkpoint that has
        none) each run of pads is one image."""
        spans, i, n = [], 0, len(ids)
        while i < n:
            if ids[i] == self.pad:
                j = i
                while j < n and ids[j] == self.pad:
                    j += 1
                spans.append((i, j))
                i = j
            else:
                i += 1
        if self.start is not None:
            for a, b in spans:
                if a == 0 or ids[a - 1] != self.start or b >= n or ids[b] != self.end:
                    raise ValueError(
                        f"image pads at tokens {a}..{b - 1} are not between a vision start "
                        f"({self.start}) and end ({self.end}) token: write each image as "
                        "<|vision_start|><|image_pad|><|vision_end|> (the chat template's form)")
        return spans

    def expand(self, ids: Sequence[int], images: ImageInputs | None) -> list[int]:
        """``ids`` with image ``k``'s placeholder holding ``images.tokens[k]`` pads; raises
        ValueError when the placeholders and the images do not pair up."""
        spans = self.placeholders(ids)
        count = images.count if images is not None else 0
        if len(spans) != count:
            raise ValueError(f"the prompt has {len(spans)} image placeholder(s) but {count} "
                             "image(s) were given: one <|vision_start|><|image_pad|><|vision_end|> "
                             "per image, in order")
        if images is None:
            return list(ids)
        out, at = [], 0
        for (a, b), n in zip(spans, images.tokens, strict=True):
            out += [*ids[at:a], *([self.pad] * n)]
            at = b
        return out + list(ids[at:])


def _check_patches(model_dir: str | Path, processor: Any, vision: Any) -> None:  # noqa: ANN401
    """Refuse an image processor whose patches are not the vision tower's (Qwen2-VL and
    Qwen2.5-VL: 14x14, Qwen3-VL: 16x16; merged 2x2): its pixels would not fit the tower's
    patch embedding, or its pad counts would not be the tower's merged patches."""
    def sizes(x: Any) -> set[int]:  # noqa: ANN401 - an int or a (h, w) pair
        return {int(v) for v in x} if isinstance(x, list | tuple) else {int(x)}

    for mine, theirs in (("patch_size", "patch_size"), ("merge_size", "spatial_merge_size"),
                         ("temporal_patch_size", "temporal_patch_size")):
        a, b = getattr(processor, mine, None), getattr(vision, theirs, None)
        if a is not None and b is not None and sizes(a) != sizes(b):
            raise ValueError(f"{model_dir}: the image processor's {mine} is {a} but the vision "
                             f"tower's {theirs} is {b} (preprocessor_config.json does not "
                             "belong to this model)")


def is_vision_checkpoint(model_dir: str | Path) -> bool:
    """Whether ``model_dir``'s config.json describes a vision-language model (no loading)."""
    import json

    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and "vision_config" in config


# What a logit of a placeholder token is set to: never sampled, finite (no inf or NaN in
# log-probs and entropies), and the same in the engine and the trainer.
BANNED_LOGIT = -1e9


def placeholder_ids(config: Any) -> list[int]:  # noqa: ANN401 - a transformers config
    """The vision placeholder tokens of a Qwen2-VL-family config (image and video pads, vision
    start and end): only the processor writes them, so neither engine nor trainer lets the
    model sample them (their logits are :data:`BANNED_LOGIT` in both, so log-probs agree)."""
    names = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    return sorted({int(v) for n in names if (v := getattr(config, n, None)) is not None})


PROCESSOR_FILES = ("preprocessor_config.json", "video_preprocessor_config.json",
                   "processor_config.json")


def copy_processor(src: str | Path, dst: str | Path) -> None:
    """A vision-language model's image processor files from ``src`` into ``dst`` (an export
    or a checkpoint's ``model/``: weights and tokenizer are written there by others)."""
    import shutil

    for name in PROCESSOR_FILES:
        if (f := Path(src) / name).is_file():
            shutil.copyfile(f, Path(dst) / name)


def vision_processor(model_dir: str | Path, trust_remote_code: bool = False,
                     ) -> VisionProcessor | None:
    """The checkpoint's :class:`VisionProcessor`, or None for a text model."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code)
    return VisionProcessor(model_dir, config) if is_vision_config(config) else None


def mrope_positions(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor,
                    images: ImageInputs | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions (3, n, W), next (n,)) of a padded batch ``ids`` (n, W) with ``mask`` (1 on
    real tokens, left or right padding) whose rows' images are ``images`` in row order: each
    row's M-RoPE positions, and the position its next token takes."""
    pad = model.config.image_token_id
    kinds = ((ids == pad) & mask.bool()).int()
    grid = images.grid_thw.to(ids.device) if images is not None else None
    positions, _ = model.model.get_rope_index(ids, mm_token_type_ids=kinds, image_grid_thw=grid,
                                              attention_mask=mask)
    positions = positions.masked_fill(~mask.bool()[None], 0)
    return positions, positions.amax(dim=(0, 2)) + 1
