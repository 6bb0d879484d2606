"""The GLM-4.1V vision tower: a ViT of RMSNorm blocks with a learned, resampled position grid, a 2x2 downsampling
convolution and a gated patch merger; optionally split over TP.

Choices:
- ``config`` names fields as ``bridges.glm4v.tower_config`` builds them from GLM-4.1V's vision config:
  ``intermediate_size`` is the blocks' MLP width (transformers' ``out_hidden_size``: GLM's blocks use it),
  ``merger_size`` the merger's MLP width (GLM's ``intermediate_size``).
- Parameter names and shapes are transformers' (``patch_embed.proj``, ``post_conv_layernorm``,
  ``embeddings.position_embedding``, ``blocks.{i}.attn.qkv``, ``blocks.{i}.mlp.gate_proj``, ``post_layernorm``,
  ``downsample``, ``merger.proj`` ...), so the bridge's table maps them one to one; so is the arithmetic: RMSNorm in
  fp32 (``rms_norm_eps``), axial rope over (h, w) in fp32 (``vision.AxialRotary``) at the processor's block-major
  patch positions, the gated MLPs with ``hidden_act``, the merger's LayerNorm and exact GELU.
- The patch convolution (bias included) is normalised, then the learned square grid is resampled to each image's
  ``h x w`` patches (bicubic, corners not aligned, border padding: transformers' ``grid_sample`` at patch centres)
  and added. Attention is full within each frame, packed over images (``kernels.attention``'s packed attention).
  A video of grid ``(t, h, w)`` is ``t`` frames of ``(1, h, w)`` (each frame's grid and attention its own), as
  transformers' ``get_video_features`` splits it.
- The downsample is a ``merge x merge`` convolution with stride ``merge`` over each block of patches (the processor
  gives a block's patches together), run as one matmul over the block's flattened patches.
- Tensor parallelism, FP8 and ``recompute`` as ``vision.VisionTower`` (the same ``VisionAttention``, ``VisionMLP``):
  heads and the blocks' MLP rows split; norms, the position grid, the patch embedding, the downsample and the merger
  are replicated.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loongforge_hf.multimodal.vision import (AxialRotary, PatchEmbed, VisionAttention, VisionLinear, VisionMLP,
                                             VisionRMSNorm, patch_positions, run_block)


class Glm4vVisionBlock(nn.Module):
    def __init__(self, config, *, tp_group=None) -> None:
        super().__init__()
        self.norm1 = VisionRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.norm2 = VisionRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.attn = VisionAttention(config.hidden_size, config.num_heads, tp_group=tp_group,
                                    bias=config.attention_bias, proj_bias=False)
        self.mlp = VisionMLP(config.hidden_size, config.intermediate_size, config.hidden_act, tp_group=tp_group,
                             bias=False)

    def forward(self, x, cu_seqlens, cos, sin):
        x = x + self.attn(self.norm1(x), cu_seqlens, cos, sin)
        return x + self.mlp(self.norm2(x))


class Glm4vPatchMerger(VisionMLP):
    """``proj`` -> LayerNorm -> GELU (exact), then the gated MLP (``gate_proj``, ``up_proj``, ``down_proj``)."""

    def __init__(self, config) -> None:
        width = config.out_hidden_size
        super().__init__(width, config.merger_size, config.hidden_act, bias=False)
        self.proj = VisionLinear(width, width, bias=False)
        self.post_projection_norm = nn.LayerNorm(width)
        self.act1 = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(self.act1(self.post_projection_norm(self.proj(x))))


class PositionGrid(nn.Module):
    """The learned ``side x side`` position table, resampled at each patch's centre of its image's patch grid."""

    def __init__(self, config) -> None:
        super().__init__()
        self.side = config.image_size // config.patch_size
        self.position_embedding = nn.Embedding(self.side * self.side, config.hidden_size)

    def forward(self, grid_thw: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``[N, hidden]`` for patches at ``positions`` ``[N, 2]`` (h, w) of the images of ``grid_thw``."""
        weight = self.position_embedding.weight
        table = weight.view(self.side, self.side, -1).permute(2, 0, 1)[None].float()
        sizes = torch.as_tensor(grid_thw, device=positions.device)
        per_patch = torch.repeat_interleave(sizes[:, 1:].float(), sizes.prod(-1), dim=0)       # [N, 2] (h, w)
        centres = (positions.float() + 0.5) / per_patch * 2 - 1
        grid = centres.flip(-1)[None, :, None, :]                                               # (x = w, y = h)
        out = F.grid_sample(table, grid, mode="bicubic", align_corners=False, padding_mode="border")
        return out[0, :, :, 0].t().to(weight.dtype)


class Glm4vVisionTower(nn.Module):
    """``forward(pixel_values [N, C*T*P*P], grid_thw [n, 3]) -> [N / merge^2, out_hidden_size]`` image embeddings."""

    def __init__(self, config, *, tp_group=None, recompute: bool = False) -> None:
        super().__init__()
        self.config = config
        self.recompute = recompute
        self.merge = config.spatial_merge_size
        self.patch_embed = PatchEmbed(config, bias=True)
        self.post_conv_layernorm = VisionRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.embeddings = PositionGrid(config)
        self.blocks = nn.ModuleList([Glm4vVisionBlock(config, tp_group=tp_group) for _ in range(config.depth)])
        self.post_layernorm = VisionRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.downsample = nn.Conv2d(config.hidden_size, config.out_hidden_size, kernel_size=self.merge,
                                    stride=self.merge)
        self.merger = Glm4vPatchMerger(config)
        self.rotary = AxialRotary(config)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        grid = grid_thw.cpu()
        positions, cu_frames = patch_positions(grid, merge=self.merge)
        device = pixel_values.device
        positions, cu_frames = positions.to(device), cu_frames.to(device)
        x = self.post_conv_layernorm(self.patch_embed(pixel_values))
        x = x + self.embeddings(grid, positions).to(x.dtype)
        cos, sin = self.rotary(positions)
        for block in self.blocks:
            x = run_block(self, block, x, cu_frames, cos, sin)
        x = self.post_layernorm(x)
        # NOTE: a block's merge x merge patches (row-major) as the convolution's (channel, row, column) input
        d, m = x.shape[-1], self.merge
        blocks = x.reshape(-1, m, m, d).permute(0, 3, 1, 2).reshape(-1, d * m * m)
        weight = self.downsample.weight
        x = F.linear(blocks, weight.reshape(weight.shape[0], -1), self.downsample.bias)
        return self.merger(x)
