"""LLaVA-NeXT-Video's vision tower: LLaVA-NeXT's any-resolution tower (``vision_llava_next.LlavaNextTower``) for
images, and videos whose frames go through the same CLIP ViT, are pooled (``vision_resampler``) and then projected.

Choices:
- Inputs, ``grid_thw`` rows ``(crops, height, width)`` of images, their crops, unpadding and ``image_newline``:
  LLaVA-NeXT's. A video is a ``(frames, 0, 0)`` row, as LLaVA-OneVision's (``vision_llava_onevision``): its frames
  are crops of the tile's size, so the encoder's data parallel shares, CP shares and generate's beam copies count
  images and videos alike (``item_patches`` / ``item_tokens``), and both go through the tower in one call.
- The arithmetic is transformers' (``LlavaNextVideoModel.get_video_features``, ``LlavaNextVideoPooler``): each frame's
  selected features (``vision_feature_layer``, the class token dropped) as a ``side x side`` map, pooled by
  ``spatial_pool_mode`` (``"average"``: ``avg_pool2d``; ``"max"``: ``max_pool2d``) with kernel and stride
  ``spatial_pool_stride`` (``side // stride`` a side, the rest dropped as torch's pooling drops it), then LLaVA's
  projector; the frames' tokens one after another, no ``image_newline``. The pooling runs before the projector
  (LLaVA-OneVision resizes after it); the projector still runs once for all items (``project``).
- ``"conv"`` pooling (a learned convolution, which no hub checkpoint uses) is refused by the bridge.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loongforge_hf.multimodal.vision_llava_next import LlavaNextTower, anyres_counts

POOLS = {"average": F.avg_pool2d, "max": F.max_pool2d}


def is_video(row) -> bool:
    """A ``grid_thw`` row ``(frames, 0, 0)``: a video's (an image's carries its picture's size)."""
    return row[1] == row[2] == 0


def next_video_counts(grid: torch.Tensor, *, pinpoints: list, tile: int, side: int,
                      stride: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(``[n]`` crops, ``[n]`` embeddings) of ``grid`` rows: LLaVA-NeXT's of a picture ``(crops, height, width)``;
    ``frames`` crops and ``frames (side // stride)^2`` embeddings of a video ``(frames, 0, 0)``."""
    videos = torch.tensor([is_video(row) for row in grid.tolist()], dtype=torch.bool, device=grid.device)
    crops, tokens = grid[:, 0].clone(), grid[:, 0] * (side // stride) ** 2
    if not bool(videos.all()):
        images = anyres_counts(grid[~videos], pinpoints=pinpoints, tile=tile, side=side)
        crops[~videos], tokens[~videos] = images
    return crops, tokens


class LlavaNextVideoTower(LlavaNextTower):
    """``forward(pixel_values [N, C*P*P], grid_thw [n, 3]) -> [tokens, text_hidden]``; rows ``(crops, height,
    width)`` of images, ``(frames, 0, 0)`` of videos."""

    def __init__(self, config, *, pool_mode: str, pool_stride: int, **next_tower) -> None:
        super().__init__(config, **next_tower)
        self.pool, self.pool_stride = POOLS[pool_mode], pool_stride

    def counts(self, grid_thw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return next_video_counts(grid_thw, pinpoints=self.pinpoints, tile=self.tile, side=self.side,
                                 stride=self.pool_stride)

    def project(self, items: list[torch.Tensor], rows: list) -> list[torch.Tensor]:
        return super().project([self.pooled(item) if is_video(row) else item for item, row in zip(items, rows)], rows)

    def pooled(self, frames: torch.Tensor) -> torch.Tensor:
        """``[frames, side^2, width]`` -> ``[frames, (side // stride)^2, width]``: each frame's map pooled."""
        count, side, width = frames.shape[0], self.side, frames.shape[-1]
        maps = frames.reshape(count, side, side, width).permute(0, 3, 1, 2)
        return self.pool(maps, self.pool_stride, self.pool_stride).flatten(2).transpose(1, 2)

    def pack(self, crops: torch.Tensor, count: int, height: int, width: int) -> list[torch.Tensor]:
        if is_video((count, height, width)):
            return [crops.flatten(0, 1)]
        return super().pack(crops, count, height, width)
