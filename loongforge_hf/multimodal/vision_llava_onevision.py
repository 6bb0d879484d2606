"""LLaVA-OneVision's vision tower: LLaVA-NeXT's any-resolution tower (``vision_llava_next.LlavaNextTower``) over a
SigLIP ViT, the unpadded map of a large picture shrunk to at most ``anyres_max_N`` tiles' worth of features; the
images of multi-image samples and the frames of videos as transformers' ``LlavaOnevisionModel`` takes them.

Choices:
- Inputs, ``grid_thw`` rows ``(crops, height, width)``, crops, the tiles' map and its unpadding, ``image_newline``
  after each row and the base crop's features first: LLaVA-NeXT's. Two more kinds of row, told apart by their
  values: ``(1, height, width)``, an image of a multi-image sample (transformers' ``batch_num_images`` above 1: its
  base crop only, then one ``image_newline``; a single picture always takes 2 crops or more), and ``(frames, 0,
  0)``, a video (its frames are resized whole, so it has no picture size). Images and videos then go through the
  tower in one call, as the Qwen-VL towers take them, and the encoder's data parallel shares and generate's beam
  copies count them alike (``item_patches`` / ``item_tokens``).
- The ViT is SigLIP's as LLaVA-OneVision runs it (``SiglipVisionModel``, no pooling head): the patch convolution with
  bias, the learned table at ``0 .. h w - 1``, no class token and no pre-norm; features of ``vision_feature_layer``
  (transformers' ``hidden_states``, the last before ``post_layernorm``) with every token kept (the ``"full"``
  strategy), then LLaVA's projector. The blocks and the other modules are ``vision_clip.ClipTower``'s (TP, FP8,
  recompute, the unused blocks frozen).
- The arithmetic is transformers' (``LlavaOnevisionModel.pack_image_features``, the processor's token count): where
  the unpadded ``h x w`` map holds more than ``1.1^2 N`` tiles' features (``ratio = sqrt(h w / (N side^2)) > 1.1``)
  it is resized bilinearly (``align_corners=False``) to ``int(h // ratio) x int(w // ratio)``, and those rows take
  the newlines.
- Videos as ``get_video_features`` / ``apply_pooling``: each frame a crop through the ViT and the projector, its
  ``side x side`` map resized bilinearly to ``ceil(side / 2)`` a side, the frames' features one after another, then
  one ``image_newline`` for the whole video.
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
    """(``[n]`` crops, ``[n]`` embeddings) of the items of ``grid`` rows: ``(crops, height, width)`` of a picture,
    ``(1, height, width)`` of an image of a multi-image sample, ``(frames, 0, 0)`` of a video."""
    crops, tokens = [], []
    for count, height, width in grid.tolist():
        if height == width == 0:
            crops.append(count)
            tokens.append(count * math.ceil(side / 2) ** 2 + 1)
        elif count == 1:
            crops.append(1)
            tokens.append(side * side + 1)
        else:
            rows, cols, keep_h, keep_w = anyres_layout(height, width, pinpoints=pinpoints, tile=tile, side=side)
            h, w = shrunk(keep_h.stop - keep_h.start, keep_w.stop - keep_w.start, side=side, tiles=tiles)
            crops.append(1 + rows * cols)
            tokens.append(side * side + h * (w + 1))
    as_tensor = dict(dtype=torch.long, device=grid.device)
    return torch.tensor(crops, **as_tensor), torch.tensor(tokens, **as_tensor)


class LlavaOnevisionTower(LlavaNextTower):
    """``forward(pixel_values [N, C*P*P], grid_thw [n, 3]) -> [tokens, text_hidden]``; rows ``(crops, height,
    width)``, ``(1, height, width)`` (an image of a multi-image sample) or ``(frames, 0, 0)`` (a video)."""

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

    def pack(self, crops: torch.Tensor, count: int, height: int, width: int) -> list[torch.Tensor]:
        newline = self.image_newline.to(crops.dtype)[None]
        if height == width == 0:  # NOTE: a video: transformers' apply_pooling of each frame, one newline after all
            side, pooled = self.side, math.ceil(self.side / 2)
            frames = crops.reshape(count, side, side, -1).permute(0, 3, 1, 2)
            frames = F.interpolate(frames, [pooled, pooled], mode="bilinear").permute(0, 2, 3, 1)
            return [frames.reshape(-1, crops.shape[-1]), newline]
        if count == 1:  # NOTE: an image of a multi-image sample: its base crop, one newline
            return [crops[0], newline]
        return super().pack(crops, count, height, width)

    def kept_map(self, tiles: torch.Tensor, height: int, width: int) -> torch.Tensor:
        kept = super().kept_map(tiles, height, width)
        size = shrunk(kept.shape[0], kept.shape[1], side=self.side, tiles=self.max_tiles)
        if size == tuple(kept.shape[:2]):
            return kept
        return F.interpolate(kept.permute(2, 0, 1)[None], list(size), mode="bilinear")[0].permute(1, 2, 0)
