"""What a Qwen2.5-VL/Qwen3-VL forward needs beside the token ids, computed per sequence so an
engine can batch and cache sequences as it does text (issue 37, docs/vlm.md).

transformers' model keeps M-RoPE state on itself (``model.model.rope_deltas``, one batch at a
time); an engine with continuous batching cannot: :func:`prefill_inputs` returns a prompt's
input embeddings (the vision tower's output scattered over its image pads) and its 3-row
(temporal, height, width) positions with the offset its decode steps continue from
(:func:`decode_positions`): position ``cache_length + delta`` on all three rows, as SGLang's
``MRotaryEmbedding`` does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["VisionPrefill", "decode_positions", "is_vision_model", "prefill_inputs"]


def is_vision_model(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a vision-language model whose image pads this module fills."""
    return getattr(getattr(model, "config", None), "image_token_id", None) is not None and \
        hasattr(getattr(model, "model", None), "get_rope_index")


@dataclass
class VisionPrefill:
    """One prompt's inputs: ``embeds`` [L, hidden], ``positions`` [3, L], ``delta`` (a decode
    step at cache length n takes position n + delta)."""

    embeds: torch.Tensor
    positions: torch.Tensor
    delta: int


def prefill_inputs(model: torch.nn.Module, ids: Sequence[int], pixel_values: torch.Tensor | None,
                   grid_thw: torch.Tensor | None) -> VisionPrefill:
    """The embeddings and M-RoPE positions of one prompt whose images (``pixel_values`` as the
    image processor returns them, ``grid_thw`` [images, 3]) stand at its image pads."""
    inner = model.model
    input_ids = torch.tensor([list(ids)], dtype=torch.long, device=model.device)
    embeds = inner.get_input_embeddings()(input_ids)
    pad = model.config.image_token_id
    n_pads = int((input_ids == pad).sum())
    if pixel_values is None or grid_thw is None or n_pads == 0:
        if n_pads:
            raise ValueError(f"the prompt has {n_pads} image pads but no image was given")
        positions = torch.arange(len(ids), device=model.device).expand(3, -1)
        return VisionPrefill(embeds[0], positions, 0)
    merge = inner.visual.spatial_merge_size
    expected = int((grid_thw.prod(-1) // merge**2).sum())
    if expected != n_pads:
        raise ValueError(f"the prompt has {n_pads} image pads but its images make {expected} "
                         "tokens: expand each image's pad to grid_t*grid_h*grid_w/merge^2")
    features = inner.get_image_features(pixel_values.to(model.device), grid_thw.to(model.device),
                                        return_dict=True).pooler_output
    features = torch.cat(features, dim=0).to(embeds.dtype)
    embeds = embeds.masked_scatter((input_ids == pad).unsqueeze(-1).expand_as(embeds), features)
    kinds = (input_ids == pad).int()
    positions, deltas = inner.get_rope_index(input_ids, mm_token_type_ids=kinds,
                                             image_grid_thw=grid_thw.to(model.device))
    return VisionPrefill(embeds[0], positions[:, 0], int(deltas.reshape(-1)[0]))


def decode_positions(cache_lengths: Sequence[int], deltas: Sequence[int],
                     device: torch.device | str = "cpu") -> torch.Tensor:
    """[3, batch, 1] positions of one decode step per sequence (its cache length + delta)."""
    pos = torch.tensor([n + d for n, d in zip(cache_lengths, deltas, strict=True)], device=device)
    return pos.view(1, -1, 1).expand(3, -1, -1)
