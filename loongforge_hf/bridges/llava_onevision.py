"""LlavaOnevisionForConditionalGeneration (llava-hf/llava-onevision-qwen2-*-ov-hf, -si-hf): LLaVA-NeXT's
bridge (``bridges/llava_next.py``) over a SigLIP ViT, with OneVision's ``anyres_max_N`` shrinking of large pictures.

Choices:
- Everything LLaVA-NeXT's bridge declares holds (decoders, the three namings, ``image_newline``, crops and
  ``image_sizes``, the pinpoint refusals) but the ViT: ``vision_config.model_type`` must be ``siglip_vision_model``
  and the strategy ``"full"`` (the hub's; SigLIP has no class token, and transformers' ``"default"`` would drop a
  patch and then refuse the crops itself). The ViT's tensors outside the blocks are SigLIP's (``embeddings.
  patch_embedding`` with its bias, ``embeddings.position_embedding``, ``post_layernorm``), all replicated.
- An image takes the tokens ``multimodal.vision_llava_onevision.onevision_counts`` gives (the processor's count).
- Refused besides LLaVA-NeXT's: a SigLIP pooling head (``vision_config.vision_use_head``; the hub's towers have
  none), ``vision_aspect_ratio`` not of the form ``anyres_max_N``; at forward, multi-image samples
  (``batch_num_images`` above 1). Videos (2x2-pooled frames) are not supported.
"""

from __future__ import annotations

import torch

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.llava_next import LlavaNextBridge
from loongforge_hf.bridges.qwen2_5_vl import VL_BRIDGES


class LlavaOnevisionBridge(LlavaNextBridge):
    """Declaration of ``LlavaOnevisionForConditionalGeneration``."""

    architectures = ("LlavaOnevisionForConditionalGeneration",)
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

        hf = self.hf_config
        return LlavaOnevisionTower(self.vision_config, text_hidden=hf.text_config.hidden_size,
                                   pinpoints=self.pinpoints, max_tiles=self.max_tiles,
                                   feature_layers=self.feature_layers, projector_act=hf.projector_hidden_act,
                                   projector_bias=bool(hf.multimodal_projector_bias), tp_group=tp_group,
                                   recompute=recompute)


VL_BRIDGES.update({arch: LlavaOnevisionBridge for arch in LlavaOnevisionBridge.architectures})
