"""Aya Vision's tower: a SigLIP ViT (``vision_siglip.SiglipTower``) read at ``vision_feature_layer``, then Aya
Vision's projector (pixel shuffle by ``downsample_factor``, LayerNorm, ``linear_1``, SwiGLU, ``linear_2``);
optionally split over TP.

Choices:
- Inputs, arithmetic and tensor parallelism are SigLIP's (``vision_siglip.py``); each tile the processor gives
  (``[n, C, H, W]``) is an image of ``(image_size / patch_size / downsample_factor)^2`` tokens.
- The features are transformers' ``hidden_states[k]`` (``feature_layer`` = k, 0 .. ``num_hidden_layers``): the
  output of block k, before ``post_layernorm`` (SigLIP does not tie the last hidden state to the normed one), all
  patches kept (the ``"full"`` strategy: SigLIP has no class token). Blocks after k and ``post_layernorm`` are built,
  loaded, frozen and exported as read, never run (``vision_feature_layer.FeatureLayerTower``: a trainable parameter
  among them, a LoRA adapter, enters the output as a zero term).
- The projector is transformers' ``AyaVisionMultiModalProjector``: its pixel shuffle is Idefics3's and InternVL's
  (``vision_internvl.pixel_shuffle``: each ``merge x merge`` block's features (row, column) row-major, channels last),
  LayerNorm at ``adapter_layer_norm_eps``, ``linear_1`` into ``alignment_intermediate_size``, whose first half is the
  value and second half the gate (``x * silu(gate)``), ``linear_2``; replicated.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loongforge_hf.multimodal.vision import VisionLinear
from loongforge_hf.multimodal.vision_feature_layer import FeatureLayerTower
from loongforge_hf.multimodal.vision_internvl import pixel_shuffle
from loongforge_hf.multimodal.vision_siglip import SiglipTower


class AyaVisionProjector(nn.Module):
    """``[sum h w, d]`` features -> ``[sum h w / merge^2, text_hidden]``: pixel shuffle, LayerNorm, SwiGLU MLP."""

    def __init__(self, vision_hidden: int, text_hidden: int, *, merge: int, intermediate: int, eps: float) -> None:
        super().__init__()
        width = vision_hidden * merge * merge
        self.merge = merge
        self.layernorm = nn.LayerNorm(width, eps=eps)
        self.linear_1 = VisionLinear(width, intermediate, bias=True)
        self.linear_2 = VisionLinear(intermediate // 2, text_hidden, bias=True)

    def forward(self, x: torch.Tensor, grid: list[tuple[int, int, int]]) -> torch.Tensor:
        value, gate = self.linear_1(self.layernorm(pixel_shuffle(x, grid, self.merge))).chunk(2, dim=-1)
        return self.linear_2(F.silu(gate) * value)


class AyaVisionTower(FeatureLayerTower, SiglipTower):
    """``forward(pixel_values [N, C*P*P], grid_thw [n, 3]) -> [N / merge^2, text_hidden]`` tile embeddings."""

    family = "Aya Vision"

    def __init__(self, config, *, text_hidden: int, merge: int, feature_layer: int, intermediate: int, eps: float,
                 tp_group=None, recompute: bool = False) -> None:
        side = config.image_size // config.patch_size
        projector = AyaVisionProjector(config.hidden_size, text_hidden, merge=merge, intermediate=intermediate,
                                       eps=eps)
        super().__init__(config, text_hidden=text_hidden, tokens_per_image=(side // merge) ** 2, tp_group=tp_group,
                         recompute=recompute, projector=projector)
        self.read_at(feature_layer)
