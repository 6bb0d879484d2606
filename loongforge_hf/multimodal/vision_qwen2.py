"""The Qwen2-VL vision tower: a ViT of LayerNorm blocks with full attention within each frame, then the patch merger;
optionally split over TP.

Choices:
- ``config`` names fields as the Qwen3-VL tower's do (``bridges.qwen2_vl.tower_config`` builds it from Qwen2-VL's
  vision config): ``hidden_size`` the ViT width (Qwen2-VL's ``embed_dim``), ``intermediate_size`` its MLP width
  (``int(embed_dim * mlp_ratio)``, as transformers), ``out_hidden_size`` the merger's output (Qwen2-VL's
  ``hidden_size``).
- The blocks are ``vision_qwen3.Qwen3VisionBlock``: LayerNorm (with bias, eps 1e-6), attention with the fused
  ``qkv`` (biases), the MLP ``linear_fc1`` -> ``hidden_act`` -> ``linear_fc2`` (biases, no gate; transformers'
  ``fc1`` / ``fc2``, the bridge's table maps the names). Axial rope over (h, w) in fp32 (``vision.AxialRotary``) at the
  processor's block-major patch positions; no windows and no reordering: attention is full within each frame,
  packed over frames and images (``kernels.attention``'s packed attention, as the other Qwen towers).
- The merger: LayerNorm over each patch (with bias, eps 1e-6; Qwen2.5-VL's is an RMSNorm), then ``merge x merge``
  neighbouring patches concatenated through Linear-GELU(exact)-Linear; names ``ln_q``, ``mlp.0``, ``mlp.2`` as
  transformers'.
- Tensor parallelism, FP8 and ``recompute`` as ``vision.VisionTower``; norms, the patch embedding and the merger are
  replicated.
"""

from __future__ import annotations

import torch
from torch import nn

from loongforge_hf.multimodal.vision import (VISION_NORM_EPS, AxialRotary, PatchEmbed, VisionLinear,
                                             patch_positions, run_block)
from loongforge_hf.multimodal.vision_qwen3 import Qwen3VisionBlock


class Qwen2PatchMerger(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        width = config.hidden_size * config.spatial_merge_size ** 2
        self.ln_q = nn.LayerNorm(config.hidden_size, eps=VISION_NORM_EPS)
        self.mlp = nn.Sequential(VisionLinear(width, width), nn.GELU(), VisionLinear(width, config.out_hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        width = self.mlp[0].in_features
        return self.mlp(self.ln_q(x).reshape(x.numel() // width, width))


class Qwen2VisionTower(nn.Module):
    """``forward(pixel_values [N, C*T*P*P], grid_thw [n, 3]) -> [N / merge^2, out_hidden_size]`` image embeddings."""

    def __init__(self, config, *, tp_group=None, recompute: bool = False) -> None:
        super().__init__()
        self.config = config
        self.recompute = recompute
        self.merge = config.spatial_merge_size
        self.patch_embed = PatchEmbed(config)
        self.blocks = nn.ModuleList([Qwen3VisionBlock(config, tp_group=tp_group) for _ in range(config.depth)])
        self.merger = Qwen2PatchMerger(config)
        self.rotary = AxialRotary(config)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        positions, cu_frames = patch_positions(grid_thw.cpu(), merge=self.merge)
        device = pixel_values.device
        cu_frames = cu_frames.to(device)
        x = self.patch_embed(pixel_values)
        cos, sin = self.rotary(positions.to(device))
        for block in self.blocks:
            x = run_block(self, block, x, cu_frames, cos, sin)
        return self.merger(x)
