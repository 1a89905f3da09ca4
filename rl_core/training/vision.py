"""The torch trainer's side of a vision-language model (issue 37, docs/vlm.md, "The trainer"):
a batch's images (encoded bytes per row) as ``pixel_values``/``image_grid_thw`` by the
checkpoint's own image processor, M-RoPE positions per row, and packing that keeps each
image with its sequence.

The engine and the trainer use the same processor and :func:`rl_core.models.vlm.mrope_positions`,
so a prompt's pixels and positions are the same on both planes. In a packed row (a group's
prompt once, then its completions: :mod:`rl_core.training.packing`) each token keeps the
position it has in its own unpacked row, and the prompt's images go in once per group;
rows with image pads outside the prompt (an agent's image observations) are not packed.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from rl_core.models.vlm import (
    ImageInputs,
    VisionProcessor,
    concat_images,
    mrope_positions,
    placeholder_ids,
)
from rl_core.training.packing import PackPlan
from rl_core.types import Batch

__all__ = ["TrainerVision", "freeze_vision_tower"]

_CACHE_ROWS = 4096  # processed image lists kept (a step's rows are processed once per pass)


def freeze_vision_tower(model: torch.nn.Module) -> int:
    """Stop gradients into the vision tower and its merger; the parameters frozen."""
    visual = getattr(getattr(model, "model", None), "visual", None)
    if visual is None:
        raise ValueError("model.freeze_vision: this model has no vision tower (model.visual)")
    params = list(visual.parameters())
    for p in params:
        p.requires_grad_(False)
    return sum(p.numel() for p in params)


class TrainerVision:
    """Pixels and positions for a vision-language policy's forwards (module docstring)."""

    def __init__(self, model_dir: str | Path, model: torch.nn.Module) -> None:
        self.model = model
        self.processor = VisionProcessor(model_dir, model.config)
        self._cache: OrderedDict[str, ImageInputs] = OrderedDict()
        self.banned = torch.tensor(placeholder_ids(model.config))  # never sampled (engine too)

    def pixels(self, images: tuple[bytes, ...]) -> ImageInputs | None:
        """One row's images, processed once and cached by their content."""
        if not images:
            return None
        key = hashlib.sha256(b"".join(hashlib.sha256(x).digest() for x in images)).hexdigest()
        if (hit := self._cache.get(key)) is not None:
            self._cache.move_to_end(key)
            return hit
        value = self.processor.process(images)
        self._cache[key] = value
        if len(self._cache) > _CACHE_ROWS:
            self._cache.popitem(last=False)
        return value

    def packable(self, batch: Batch) -> bool:
        """Whether every row's image pads lie in its prompt (so a group's prompt, packed once,
        carries every image of the group)."""
        if batch.prompt_lens is None:
            return False
        pads = batch.input_ids == self.processor.pad
        after = torch.arange(pads.shape[1])[None, :] >= batch.prompt_lens[:, None]
        return not bool((pads & after).any())

    def inputs(self, batch: Batch, plan: PackPlan | None) -> dict[str, Any]:
        """``position_ids`` (3 rows), ``pixel_values`` and ``image_grid_thw`` for a forward
        over ``batch`` (its rows as they are, or packed by ``plan``)."""
        assert batch.images is not None
        ids, mask = batch.input_ids.long(), batch.attention_mask.long()
        rows = [self.pixels(images) for images in batch.images]
        for i, x in enumerate(rows):  # each row's pads must match its images
            pads = int((ids[i] == self.processor.pad).sum())
            want = sum(x.tokens) if x is not None else 0
            if pads != want:
                raise ValueError(f"batch row {i}: {pads} image pad tokens but its "
                                 f"{x.count if x else 0} image(s) make {want}; a sample's "
                                 "prompt_ids must hold its images' expanded pads")
        positions, _ = mrope_positions(self.model, ids, mask, concat_images(rows))
        if plan is None:
            return self._pixel_kwargs(concat_images(rows), positions)
        width = plan.input_ids.shape[1]
        packed = torch.zeros((3, plan.input_ids.numel()), dtype=positions.dtype)
        lengths = mask.sum(-1).tolist()
        first: dict[int, int] = {}  # packed row -> its group's first row (whose prompt it holds)
        for b, n in enumerate(lengths):
            slots = plan.src[b, : n - 1]
            packed[:, slots] = positions[:, b, : n - 1]
            first.setdefault(int(plan.src[b, 0]) // width, b)
        images = concat_images([rows[first[g]] for g in sorted(first)])
        return self._pixel_kwargs(images, packed.view(3, *plan.input_ids.shape))

    @staticmethod
    def _pixel_kwargs(images: ImageInputs | None, positions: torch.Tensor) -> dict[str, Any]:
        out: dict[str, Any] = {"position_ids": positions}
        if images is not None:
            out.update(pixel_values=images.pixel_values, image_grid_thw=images.grid_thw)
        return out
