"""LlavaOnevisionForConditionalGeneration (llava-hf/llava-onevision-qwen2-*-ov-hf, -si-hf): LLaVA-NeXT's
bridge (``bridges/llava_next.py``) over a SigLIP ViT, with OneVision's ``anyres_max_N`` shrinking of large pictures.

Choices:
- Everything LLaVA-NeXT's bridge declares holds (decoders, the three namings, ``image_newline``, crops and
  ``image_sizes``, the pinpoint refusals) but the ViT: ``vision_config.model_type`` must be ``siglip_vision_model``
  and the strategy ``"full"`` (the hub's; SigLIP has no class token, and transformers' ``"default"`` would drop a
  patch and then refuse the crops itself). The ViT's tensors outside the blocks are SigLIP's (``embeddings.
  patch_embedding`` with its bias, ``embeddings.position_embedding``, ``post_layernorm``), all replicated.
- An image or a video takes the tokens ``multimodal.vision_llava_onevision.onevision_counts`` gives (the
  processor's count).
- Multi-image samples: with transformers' ``batch_num_images`` (the processor's: images per sample), each image of
  a sample with more than one takes its base crop only (``image_grid`` gives its row ``(1, height, width)``; the
  processor's ``pixel_values`` pad it with zero crops, which are dropped), ``side^2 + 1`` ``<image>`` tokens.
- Videos: the processor's ``pixel_values_videos [videos, frames, C, H, W]`` (``video_inputs``) become the frames'
  patches and one ``(frames, 0, 0)`` row per video, ``frames ceil(side / 2)^2 + 1`` ``<video>`` tokens
  (``video_token_id``); frames must be ``vision_config.image_size`` pixels a side, as the processor resizes them.
- Refused besides LLaVA-NeXT's: a SigLIP pooling head (``vision_config.vision_use_head``; the hub's towers have
  none), ``vision_aspect_ratio`` not of the form ``anyres_max_N``; at forward, ``batch_num_images`` that do not add
  up to the images given, videos not as one ``[videos, frames, C, image_size, image_size]`` tensor.
"""

from __future__ import annotations

import torch

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.llava_next import LlavaNextBridge, frame_video_inputs
from loongforge_hf.bridges.qwen2_5_vl import VL_BRIDGES


class LlavaOnevisionBridge(LlavaNextBridge):
    """Declaration of ``LlavaOnevisionForConditionalGeneration``."""

    architectures = ("LlavaOnevisionForConditionalGeneration",)
    multi_image_samples = True  # NOTE: takes transformers' batch_num_images (multimodal.modeling)
    tower_type, feature_strategy, nested_probe = "siglip_vision_model", "full", "embeddings.patch_embedding.weight"

    @property
    def max_tiles(self) -> int:
        from loongforge_hf.multimodal.vision_llava_onevision import max_tiles

        return max_tiles(getattr(self.hf_config, "vision_aspect_ratio", "anyres_max_9"))

    def check_vision_config(self) -> None:
        super().check_vision_config()
        if getattr(self.vision_config, "vision_use_head", False):
            raise C.UnsupportedConfigError("vision_config.vision_use_head=True is not supported: LLaVA-OneVision "
                                           "never reads SigLIP's pooling head.")
        try:
            self.max_tiles
        except ValueError as error:
            raise C.UnsupportedConfigError(str(error)) from None

    def vision_item_tokens(self, grid_thw: torch.Tensor) -> torch.Tensor:
        from loongforge_hf.multimodal.vision_llava_onevision import onevision_counts

        return onevision_counts(grid_thw, pinpoints=self.pinpoints, tile=self.patch * self.side, side=self.side,
                                tiles=self.max_tiles)[1]

    def image_grid(self, sizes: torch.Tensor, batch_num_images=None) -> torch.Tensor:
        """LLaVA-NeXT's rows, ``(1, height, width)`` for the images of samples with more than one
        (``batch_num_images``, as transformers' ``get_image_features`` reads it)."""
        grid = super().image_grid(sizes)
        if batch_num_images is None:
            return grid
        counts = [int(n) for n in torch.as_tensor(batch_num_images).reshape(-1).tolist()]
        if sum(counts) != len(sizes) or min(counts, default=0) < 0:
            raise ValueError(f"batch_num_images={counts} does not add up to the {len(sizes)} images of image_sizes.")
        grid[torch.tensor([n != 1 for n in counts for _ in range(n)], dtype=torch.bool), 0] = 1
        return grid

    def video_inputs(self, pixel_values_videos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The processor's ``pixel_values_videos [videos, frames, C, H, W]`` as the tower's patches and ``(frames,
        0, 0)`` rows (``llava_next.frame_video_inputs``)."""
        return frame_video_inputs(self, pixel_values_videos, "LLaVA-OneVision")

    # ---- vision tensors ----------------------------------------------------------------------------------------
    def _outer_names(self) -> tuple[dict[str, str], dict[str, str]]:
        e = f"{self.vision_prefix}.embeddings"
        before = {"patch_embed.proj.weight": f"{e}.patch_embedding.weight",
                  "patch_embed.proj.bias": f"{e}.patch_embedding.bias",
                  "position_embedding.weight": f"{e}.position_embedding.weight"}
        return before, super()._outer_names()[1]

    def vision_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = super().vision_shapes()
        shapes[f"{self.vision_prefix}.embeddings.position_embedding.weight"] = \
            (self.side * self.side, self.vision_config.hidden_size)
        return shapes

    def vision_tower(self, *, tp_group=None, recompute: bool = False):
        from loongforge_hf.multimodal.vision_llava_onevision import LlavaOnevisionTower

        return LlavaOnevisionTower(self.vision_config, max_tiles=self.max_tiles, tp_group=tp_group,
                                   recompute=recompute, **self.tower_options())


VL_BRIDGES.update({arch: LlavaOnevisionBridge for arch in LlavaOnevisionBridge.architectures})
