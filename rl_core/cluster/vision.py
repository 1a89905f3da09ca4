"""The vision tower of a vision-language model (Qwen2.5-VL's ViT, Qwen2-VL's), for the planner:
its parameters, the tokens an image becomes, its activations per image, and the planner's
``vision`` part (the formulas: docs/planner.md, "Vision-language models on GPUs").

An image of at most ``image_max_pixels`` pixels is resized to sides that are multiples of
``patch * spatial_merge`` (28), cut into ``patch`` x ``patch`` patches (14 x 14; each two frames
deep, an image being repeated in time), run through ``depth`` ViT blocks and merged
``spatial_merge``² (4) patches at a time into one token of the language model's width:
1,003,520 pixels (Qwen2-VL's default ``max_pixels``) = 5,120 patches = 1,280 tokens.
Pure standard-library arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["VisionPlan", "VisionShape", "vision_activation_bytes"]

_GIB = 2**30


@dataclass(frozen=True)
class VisionShape:
    """A Qwen-VL vision tower: ``depth`` blocks of width ``hidden`` with ``heads`` heads (fused
    QKV and output projection, both with biases), an MLP of width ``intermediate`` (``gated``:
    Qwen2.5-VL's SwiGLU with biases and RMSNorms; else Qwen2-VL's two-matrix GELU MLP and
    LayerNorms), a bias-free patch embedding of ``in_channels`` x ``temporal_patch`` x ``patch``²
    pixels, and the merger: a norm, then ``hidden * spatial_merge²`` -> same -> ``out_hidden``
    (the language model's width), both with biases."""
    depth: int
    hidden: int
    intermediate: int
    heads: int
    out_hidden: int
    patch: int = 14
    spatial_merge: int = 2
    temporal_patch: int = 2
    in_channels: int = 3
    gated: bool = True

    def __post_init__(self) -> None:
        for f in ("depth", "hidden", "intermediate", "heads", "out_hidden", "patch",
                  "spatial_merge", "temporal_patch", "in_channels"):
            if getattr(self, f) <= 0:
                raise ValueError(f"vision tower: {f} must be > 0, got {getattr(self, f)}")

    @property
    def block_params(self) -> int:
        """One ViT block: ``qkv`` (h -> 3h) and ``proj`` (h -> h) with biases, the MLP (SwiGLU:
        3 matrices; GELU: 2) with biases, two norms (RMSNorm: h each; LayerNorm: 2h)."""
        h, i = self.hidden, self.intermediate
        attn = h * 3 * h + 3 * h + h * h + h
        mlp = 3 * h * i + 2 * i + h if self.gated else 2 * h * i + i + h
        return attn + mlp + (2 if self.gated else 4) * h

    @property
    def patch_embed_params(self) -> int:
        return self.in_channels * self.temporal_patch * self.patch ** 2 * self.hidden

    @property
    def merger_params(self) -> int:
        """The patch merger: a norm over h, ``h·m² -> h·m²`` and ``h·m² -> out_hidden``."""
        w = self.hidden * self.spatial_merge ** 2
        return (1 if self.gated else 2) * self.hidden + w * w + w + w * self.out_hidden \
            + self.out_hidden

    @property
    def params(self) -> int:
        """``depth`` blocks + the patch embedding + the merger (Qwen2.5-VL: 676,550,144 with
        the 7B's merger, 668,684,288 with the 3B's)."""
        return self.depth * self.block_params + self.patch_embed_params + self.merger_params

    def tokens_per_image(self, max_pixels: int) -> int:
        """Language-model tokens of the largest image: ``max_pixels // (patch · merge)²`` (the
        processor keeps the area within ``max_pixels`` at sides that are multiples of 28)."""
        return max_pixels // (self.patch * self.spatial_merge) ** 2

    def patches_per_image(self, max_pixels: int) -> int:
        """Patches the ViT runs on for the largest image: ``tokens_per_image · merge²``."""
        return self.tokens_per_image(max_pixels) * self.spatial_merge ** 2


def vision_activation_bytes(v: VisionShape, *, images: int, max_pixels: int, trainable: bool,
                            tp: int = 1, dtype_bytes: int = 2) -> int:
    """The vision tower's activations for ``images`` images of ``max_pixels`` on one device, with
    flash attention (no n² term) and, when it trains, full recompute like the language model
    (:func:`rl_core.cluster.shapes.training_activation_bytes`). For n patches:
    ``one block = n · (8h + 4i) · bytes`` (norms, residual, QKV, attention output, projection;
    the MLP's inner activations), ``merger = n · 3h · bytes``. Frozen: the tower runs without
    gradients, so only the block being run and the merger live (``one block + merger``).
    Trainable: every block's input is kept, and the block being recomputed and its gradients
    (``depth · n · h · bytes + 2 · (one block + merger)``). Divided by ``tp``."""
    n, h = images * v.patches_per_image(max_pixels), v.hidden
    live = n * (8 * h + 4 * v.intermediate) * dtype_bytes + n * 3 * h * dtype_bytes
    total = v.depth * n * h * dtype_bytes + 2 * live if trainable else live
    return total // tp


@dataclass(frozen=True)
class VisionPlan:
    """The vision tower's share of a plan. Per sequence: ``images_per_sample`` images of
    ``max_pixels`` = ``patches_per_image`` patches = ``tokens_per_image`` tokens each
    (``image_tokens`` in all, part of the plan's ``seq_len``). Per device: ``rollout_weight_bytes``
    (part of the rollout's ``weight_bytes``), ``train_state_bytes`` (part of the training's
    ``state_bytes``: the frozen tower's weights only, a trained one's full 16 bytes/param),
    ``train_activation_bytes`` (part of its ``activation_bytes``, the micro-batch's images).
    ``sync_bytes``: the tower's weights in each weight sync (0 when frozen: the engines keep the
    ones they loaded)."""
    params: int
    trainable: bool
    images_per_sample: int
    max_pixels: int
    patches_per_image: int
    tokens_per_image: int
    rollout_weight_bytes: int
    train_state_bytes: int
    train_activation_bytes: int
    sync_bytes: int

    @property
    def image_tokens(self) -> int:
        return self.images_per_sample * self.tokens_per_image

    def reason(self) -> str:
        """The plan's reason line for the tower."""
        how = ("frozen: its weights only (no grads or Adam state), and not in the weight sync"
               if not self.trainable else
               "trained: 16 bytes/param like the language model, and in every weight sync")
        return (f"vision tower ({self.params / 1e9:.2f}B params) {how}; "
                f"{self.images_per_sample} image(s) of <= {self.max_pixels:,} pixels add "
                f"{self.image_tokens:,} tokens to each sequence (KV cache and activations)")

    def describe(self) -> str:
        """One paragraph for :func:`rl_core.cluster.planner.format_plan`."""
        how = "trained" if self.trainable else "frozen (model.freeze_vision)"
        sync = (f"{self.sync_bytes / _GIB:.1f} GiB of each weight sync" if self.trainable
                else "not in the weight sync")
        return (f"vision: {self.params / 1e9:.2f}B params, {how}: "
                f"{self.rollout_weight_bytes / _GIB:.1f} GiB of each rollout device's weights, "
                f"{self.train_state_bytes / _GIB:.1f} GiB state + "
                f"{self.train_activation_bytes / _GIB:.1f} GiB activations per training device; "
                f"{sync}\n  {self.images_per_sample} image(s) x {self.tokens_per_image:,} tokens "
                f"per sequence (image_max_pixels {self.max_pixels:,} = "
                f"{self.patches_per_image:,} patches, merged "
                f"{self.patches_per_image // max(1, self.tokens_per_image)} to a token)")
