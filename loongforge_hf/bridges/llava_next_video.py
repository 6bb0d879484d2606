"""LlavaNextVideoForConditionalGeneration (llava-hf/LLaVA-NeXT-Video-7B-hf, -7B-DPO-hf, -34B-hf and LLaVA-NeXT-Video
fine-tunes): LLaVA-NeXT's bridge (``bridges/llava_next.py``) for images, and videos whose CLIP features are pooled
(``vision_resampler``) before the projector.

Choices:
- Everything LLaVA-NeXT's bridge declares holds (decoders, the three namings, ``vision_feature_layer``, the ViT's
  tensors, ``image_newline``, any-resolution crops with ``image_sizes``, the refusals); the pooling has no tensors.
- Videos: the processor's ``pixel_values_videos [videos, frames, C, H, W]`` (``video_inputs``, LLaVA-OneVision's
  ``llava_next.frame_video_inputs``) become the frames' patches and one ``(frames, 0, 0)`` row per video, ``frames
  (side // spatial_pool_stride)^2`` ``<video>`` tokens (``video_token_id``), no ``image_newline``
  (``multimodal.vision_llava_next_video``); frames must be ``vision_config.image_size`` pixels a side, as
  transformers' CLIP takes them.
- Refused besides LLaVA-NeXT's: ``spatial_pool_mode`` other than ``"average"`` / ``"max"`` (``"conv"``, a learned
  convolution no hub checkpoint uses), ``spatial_pool_stride`` not an int in ``1 .. side``; at forward, videos not
  as one ``[videos, frames, C, image_size, image_size]`` tensor.
"""

from __future__ import annotations

import torch

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.llava_next import LlavaNextBridge, frame_video_inputs
from loongforge_hf.bridges.qwen2_5_vl import VL_BRIDGES


class LlavaNextVideoBridge(LlavaNextBridge):
    """Declaration of ``LlavaNextVideoForConditionalGeneration``."""

    architectures = ("LlavaNextVideoForConditionalGeneration",)

    @property
    def pool_mode(self) -> str:
        return getattr(self.hf_config, "spatial_pool_mode", "average")

    @property
    def pool_stride(self) -> int:
        return getattr(self.hf_config, "spatial_pool_stride", 2)

    def check_vision_config(self) -> None:
        from loongforge_hf.multimodal.vision_llava_next_video import POOLS

        super().check_vision_config()
        if self.pool_mode not in POOLS:
            raise C.UnsupportedConfigError(f"spatial_pool_mode={self.pool_mode!r} is not supported: only "
                                           f"{' and '.join(map(repr, POOLS))} (the hub's checkpoints pool by average).")
        stride = self.pool_stride
        if isinstance(stride, bool) or not isinstance(stride, int) or not 1 <= stride <= self.side:
            raise C.UnsupportedConfigError(f"spatial_pool_stride={stride!r} must be an int from 1 to the "
                                           f"{self.side} patches a side of a frame.")

    def vision_item_tokens(self, grid_thw: torch.Tensor) -> torch.Tensor:
        """``[n]`` embeddings of the images ``(crops, height, width)`` and videos ``(frames, 0, 0)`` of ``grid_thw``."""
        from loongforge_hf.multimodal.vision_llava_next_video import next_video_counts

        return next_video_counts(grid_thw, pinpoints=self.pinpoints, tile=self.patch * self.side, side=self.side,
                                 stride=self.pool_stride)[1]

    def video_inputs(self, pixel_values_videos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The processor's ``pixel_values_videos [videos, frames, C, H, W]`` as the tower's patches and ``(frames,
        0, 0)`` rows."""
        return frame_video_inputs(self, pixel_values_videos, "LLaVA-NeXT-Video")

    def vision_tower(self, *, tp_group=None, recompute: bool = False):
        from loongforge_hf.multimodal.vision_llava_next_video import LlavaNextVideoTower

        return LlavaNextVideoTower(self.vision_config, pool_mode=self.pool_mode, pool_stride=self.pool_stride,
                                   tp_group=tp_group, recompute=recompute, **self.tower_options())


VL_BRIDGES.update({arch: LlavaNextVideoBridge for arch in LlavaNextVideoBridge.architectures})
