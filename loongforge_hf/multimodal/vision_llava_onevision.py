"""LLaVA-OneVision's vision tower: LLaVA-NeXT's any-resolution tower (``vision_llava_next.LlavaNextTower``) over a
SigLIP ViT, the unpadded map of a large picture shrunk to at most ``anyres_max_N`` tiles' worth of features.

Choices:
- Inputs, ``grid_thw`` rows ``(crops, height, width)``, crops, the tiles' map and its unpadding, ``image_newline``
  after each row and the base crop's features first: LLaVA-NeXT's.
- The ViT is SigLIP's as LLaVA-OneVision runs it (``SiglipVisionModel``, no pooling head): the patch convolution with
  bias, the learned table at ``0 .. h w - 1``, no class token and no pre-norm; features of ``vision_feature_layer``
  (transformers' ``hidden_states``, the last before ``post_layernorm``) with every token kept (the ``"full"``
  strategy), then LLaVA's projector. The blocks and the other modules are ``vision_clip.ClipTower``'s (TP, FP8,
  recompute, the unused blocks frozen).
- The arithmetic is transformers' (``LlavaOnevisionModel.pack_image_features``, the processor's token count): where
  the unpadded ``h x w`` map holds more than ``1.1^2 N`` tiles' features (``ratio = sqrt(h w / (N side^2)) > 1.1``)
  it is resized bilinearly (``align_corners=False``) to ``int(h // ratio) x int(w // ratio)``, and those rows take
  the newlines.
- Videos (2x2-pooled frames) and multi-image samples (each image its base crop only) are not built here; the model
  refuses multi-image samples (``multimodal.modeling``).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from loongforge_hf.multimodal.vision import PatchEmbed
from loongforge_hf.multimodal.vision_llava_next import LlavaNextTower, anyres_layout


def max_tiles(vision_aspect_ratio) -> int:
    """``N`` of ``"anyres_max_N"``; ValueError otherwise."""
    text = str(vision_aspect_ratio)
    if not (text.startswith("anyres_max_") and text[len("anyres_max_"):].isdigit() and int(text[11:]) > 0):
        raise ValueError(f"vision_aspect_ratio={vision_aspect_ratio!r} must be 'anyres_max_N' with N > 0.")
    return int(text[len("anyres_max_"):])


def shrunk(height: int, width: int, *, side: int, tiles: int) -> tuple[int, int]:
    """The ``height x width`` unpadded map's size after the ``anyres_max_<tiles>`` rule."""
    ratio = math.sqrt(height * width / (tiles * side ** 2))
    return (int(height // ratio), int(width // ratio)) if ratio > 1.1 else (height, width)


def onevision_counts(grid: torch.Tensor, *, pinpoints: list, tile: int, side: int,
                     tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(``[n]`` crops, ``[n]`` embeddings) of the pictures of ``grid`` rows ``(crops, height, width)``."""
    crops, tokens = [], []
    for _, height, width in grid.tolist():
        rows, cols, keep_h, keep_w = anyres_layout(height, width, pinpoints=pinpoints, tile=tile, side=side)
        h, w = shrunk(keep_h.stop - keep_h.start, keep_w.stop - keep_w.start, side=side, tiles=tiles)
        crops.append(1 + rows * cols)
        tokens.append(side * side + h * (w + 1))
    as_tensor = dict(dtype=torch.long, device=grid.device)
    return torch.tensor(crops, **as_tensor), torch.tensor(tokens, **as_tensor)


class LlavaOnevisionTower(LlavaNextTower):
    """``forward(pixel_values [N, C*P*P], grid_thw [n, 3] of (crops, height, width)) -> [tokens, text_hidden]``."""

    family = "SigLIP"
    lead = 0

    def __init__(self, config, *, max_tiles: int, **next_tower) -> None:
        super().__init__(config, **next_tower)
        self.max_tiles = max_tiles

    def build_embeddings(self, config, d: int, patch: int) -> None:
        self.patch_embed = PatchEmbed(SimpleNamespace(hidden_size=d, patch_size=patch,
                                                      num_channels=config.num_channels), bias=True)
        self.position_embedding = nn.Embedding(self.side * self.side, d)

    def embed(self, pixel_values: torch.Tensor, n: int) -> torch.Tensor:
        x = self.patch_embed(pixel_values).reshape(n, self.side * self.side, -1)
        return x + self.position_embedding.weight.to(x.dtype)

    def counts(self, grid_thw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return onevision_counts(grid_thw, pinpoints=self.pinpoints, tile=self.tile, side=self.side,
                                tiles=self.max_tiles)

    def kept_map(self, tiles: torch.Tensor, height: int, width: int) -> torch.Tensor:
        kept = super().kept_map(tiles, height, width)
        size = shrunk(kept.shape[0], kept.shape[1], side=self.side, tiles=self.max_tiles)
        if size == tuple(kept.shape[:2]):
            return kept
        return F.interpolate(kept.permute(2, 0, 1)[None], list(size), mode="bilinear")[0].permute(1, 2, 0)
