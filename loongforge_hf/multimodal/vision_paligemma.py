"""PaliGemma's vision tower: a SigLIP ViT (``vision_siglip.SiglipTower``: its last hidden states, after the final
LayerNorm) and PaliGemma's projector, one linear with its bias into the language model's width; optionally split
over TP.

Choices:
- Inputs, arithmetic and tensor parallelism are SigLIP's (``vision_siglip.py``); one token per patch (no pooling:
  ``merge`` 1), so an image gives ``(image_size / patch_size)^2`` tokens, as PaliGemma's processor lays them out.
- The projector is transformers' ``PaliGemmaMultiModalProjector`` (``nn.Linear(vision hidden, projection_dim)``),
  replicated; the features are not rescaled (transformers 5 scatters them after the scaled text embedding).
"""

from __future__ import annotations

import torch
from torch import nn

from loongforge_hf.multimodal.vision import VisionLinear
from loongforge_hf.multimodal.vision_siglip import SiglipTower


class LinearProjector(nn.Module):
    """``[sum h w, d]`` ViT outputs -> ``[sum h w, text_hidden]``: one linear with its bias."""

    def __init__(self, vision_hidden: int, text_hidden: int) -> None:
        super().__init__()
        self.proj = VisionLinear(vision_hidden, text_hidden, bias=True)

    def forward(self, x: torch.Tensor, grid: list[tuple[int, int, int]]) -> torch.Tensor:
        return self.proj(x)


class PaliGemmaTower(SiglipTower):
    """``forward(pixel_values [N, C*P*P], grid_thw [n, 3]) -> [N, text_hidden]`` image embeddings."""

    family = "PaliGemma"

    def __init__(self, config, *, text_hidden: int, tp_group=None, recompute: bool = False) -> None:
        side = config.image_size // config.patch_size
        super().__init__(config, text_hidden=text_hidden, tokens_per_image=side * side, tp_group=tp_group,
                         recompute=recompute, projector=LinearProjector(config.hidden_size, text_hidden))
