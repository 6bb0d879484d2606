"""Idefics3's (and SmolVLM's) vision tower: a SigLIP ViT (``vision_siglip.SiglipTower``) with Idefics3's bucketed
position ids, then its connector (pixel shuffle by ``scale_factor``, one linear without bias); optionally split over
TP.

Choices:
- Inputs as the other towers take them, so the chunk's machinery (encoder data parallel, CP shares of the images,
  beam copies) serves it unchanged: ``pixel_values [N, C * P * P]``, each tile's patches row-major
  (``bridges.idefics3.Idefics3Bridge.vision_inputs`` turns the processor's ``[b, n, C, H, W]`` tiles into them, the
  padding images dropped) and ``grid_thw [n, 3]`` = ``(1, H / P, W / P)`` per tile; ``merge`` is ``scale_factor``, so
  a tile gives ``h w / merge^2`` tokens. A tile is an image here: a picture's crops and its global image (and a
  video's frames) are separate tiles, their tokens one after another.
- The arithmetic is transformers' (``Idefics3VisionTransformer``, ``Idefics3Connector``): SigLIP's (the patch
  convolution as one matmul with its bias, the learned table, full attention within each tile, LayerNorm blocks, the
  final LayerNorm); the position ids are transformers' ``bucketize`` of each patch's fractional row and column into
  the table's grid, computed as it computes them (in float32): for a whole tile they are ``0 .. h w - 1`` on most
  grid sizes, but not on all (a 25x25 grid maps rows 5, 9, 10, ... one row down), so they are not assumed; tiles at
  the configured size only (every tile the processor gives; padded tiles, which transformers masks, are refused by
  the bridge); the pixel shuffle is InternVL's (``vision_internvl.pixel_shuffle``: each ``merge x merge`` block's
  features (row, column) row-major, channels last), then ``modality_projection.proj``.
- Tensor parallelism, FP8 and ``recompute`` as SigLIP's (``vision.VisionAttention`` with fused ``qkv`` rows, ``fc1`` by
  rows, ``fc2`` by columns); the norms, the table, the patch embedding and the connector are replicated.
"""

from __future__ import annotations

import torch
from torch import nn

from loongforge_hf.multimodal.vision import VisionLinear
from loongforge_hf.multimodal.vision_internvl import pixel_shuffle
from loongforge_hf.multimodal.vision_siglip import SiglipTower


def bucketed_positions(h: int, w: int, side: int, device=None) -> torch.Tensor:
    """``[h w]`` rows of a ``side x side`` position table for a tile of ``h x w`` real patches, as transformers'
    ``Idefics3VisionEmbeddings`` buckets them (fractional coordinates ``i / h`` into ``arange(1 / side, 1, 1 / side)``,
    float32)."""
    boundaries = torch.arange(1 / side, 1.0, 1 / side, device=device)

    def buckets(count: int) -> torch.Tensor:
        step = 1.0 / torch.tensor([count], device=device)
        coords = torch.arange(count, device=device, dtype=torch.float32)[None, :] * step[:, None]
        return torch.bucketize(torch.clamp(coords, max=1.0 - 1e-6), boundaries, right=True)[0]

    return (buckets(h)[:, None] * side + buckets(w)[None, :]).reshape(-1)


class Idefics3Connector(nn.Module):
    """``[sum h w, d]`` ViT outputs -> ``[sum h w / merge^2, text_hidden]``: pixel shuffle, one linear (no bias)."""

    def __init__(self, vision_hidden: int, text_hidden: int, *, merge: int) -> None:
        super().__init__()
        self.merge = merge
        self.proj = VisionLinear(vision_hidden * merge * merge, text_hidden, bias=False)

    def forward(self, x: torch.Tensor, grid: list[tuple[int, int, int]]) -> torch.Tensor:
        return self.proj(pixel_shuffle(x, grid, self.merge))


class Idefics3Tower(SiglipTower):
    """``forward(pixel_values [N, C*P*P], grid_thw [n, 3]) -> [N / merge^2, text_hidden]`` tile embeddings."""

    family = "Idefics3"

    def __init__(self, config, *, text_hidden: int, merge: int, tp_group=None, recompute: bool = False) -> None:
        side = config.image_size // config.patch_size
        super().__init__(config, text_hidden=text_hidden, tokens_per_image=(side // merge) ** 2, tp_group=tp_group,
                         recompute=recompute,
                         projector=Idefics3Connector(config.hidden_size, text_hidden, merge=merge))

    def position_ids(self, grid: list[tuple[int, int, int]], device) -> torch.Tensor:
        if not grid:
            return torch.zeros(0, dtype=torch.long, device=device)
        return torch.cat([bucketed_positions(h, w, self.side, device) for _, h, w in grid])
