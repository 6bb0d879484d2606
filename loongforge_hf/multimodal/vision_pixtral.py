"""Mistral 3's vision tower: a Pixtral ViT (patch convolution, ``ln_pre`` RMSNorm, RMSNorm blocks with a gated MLP,
2-D rope, no biases) and Mistral 3's projector (RMSNorm, ``merge x merge`` patch merger, Linear-GELU-Linear);
optionally split over TP.

Choices:
- Inputs as the Qwen towers take them, so the chunk's machinery (encoder data parallel, CP shares of the images,
  beam copies) serves it unchanged: ``pixel_values [N, C * P * P]``, each image's real patches row-major
  (``as_image_patches`` crops the processor's padded ``[n, C, H, W]`` images to their ``image_sizes``), and
  ``grid_thw [n, 3]`` = ``(1, h, w)`` patches per image; ``merge`` is ``spatial_merge_size``, so an image gives
  ``h w / merge^2`` tokens as a Qwen tower's.
- The arithmetic is transformers' (``PixtralVisionModel``, ``Mistral3MultiModalProjector``): the convolution as one
  matmul without bias, RMSNorms at eps 1e-5 (``ln_pre`` and the blocks'; the projector's at the text config's
  ``rms_norm_eps``), attention within each image only, the rope's angles ``h * f[0::2]`` then ``w * f[1::2]`` over
  half the head (``f``: the ``head_dim / 2`` default frequencies of ``rope_theta``), that pair repeated
  (rotate-half layout) and applied in fp32; the projector merges each image's ``merge x merge`` blocks row-major,
  a block's features channel-major then (row, column) inside the block, as ``torch.nn.functional.unfold`` orders them.
- The tower reads the last block's output (``vision_feature_layer=-1``; the bridge refuses others). An image's patch
  grid must divide by ``merge`` (the processor resizes to multiples of ``patch_size x merge``).
- Tensor parallelism, FP8 and ``recompute`` as the Qwen towers (``vision.VisionAttention``, ``vision.VisionMLP``,
  both without biases): attention split by heads, gate / up by rows, down and the output projection by columns;
  norms, the patch embedding and the projector are replicated.
"""

from __future__ import annotations

import torch
from torch import nn

from loongforge_hf.multimodal.vision import (PatchEmbed, VisionAttention, VisionLinear, VisionMLP,  # noqa: F401
                                             VisionRMSNorm, _cu, as_image_patches, run_block)

PIXTRAL_NORM_EPS = 1e-5  # NOTE: transformers' PixtralRMSNorm layers are built with eps=1e-5, not from the config


class PixtralRotary(nn.Module):
    """``forward(positions [n, 2]) -> cos, sin [n, head_dim]``: (h, w) angles over the even / odd default
    frequencies, the pair repeated."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        self.head_dim, self.theta = head_dim, theta  # NOTE: no buffer: the tower's .to(dtype) would round it

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        steps = torch.arange(0, self.head_dim, 2, dtype=torch.float, device=positions.device) / self.head_dim
        freqs, pos = 1.0 / (self.theta ** steps), positions.float()
        angles = torch.cat([pos[:, :1] * freqs[0::2], pos[:, 1:] * freqs[1::2]], dim=-1)
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos(), angles.sin()


class PixtralBlock(nn.Module):
    """RMSNorm, attention (2-D rope, no biases), RMSNorm, gated MLP (no biases): pre-norm residuals."""

    def __init__(self, config, *, tp_group=None) -> None:
        super().__init__()
        self.norm1 = VisionRMSNorm(config.hidden_size, eps=PIXTRAL_NORM_EPS)
        self.norm2 = VisionRMSNorm(config.hidden_size, eps=PIXTRAL_NORM_EPS)
        self.attn = VisionAttention(config.hidden_size, config.num_attention_heads, tp_group=tp_group, bias=False)
        self.mlp = VisionMLP(config.hidden_size, config.intermediate_size, config.hidden_act, tp_group=tp_group,
                             bias=False)

    def forward(self, x, cu_seqlens, cos, sin):
        x = x + self.attn(self.norm1(x), cu_seqlens, cos, sin)
        return x + self.mlp(self.norm2(x))


class Mistral3Projector(nn.Module):
    """``[sum h w, d]`` ViT outputs -> ``[sum h w / merge^2, text_hidden]``: RMSNorm, patch merger,
    Linear-act-Linear."""

    def __init__(self, vision_hidden: int, text_hidden: int, *, merge: int, eps: float, act: str,
                 bias: bool) -> None:
        super().__init__()
        from transformers.activations import ACT2FN

        self.merge = merge
        self.norm = VisionRMSNorm(vision_hidden, eps=eps)
        self.merger = VisionLinear(vision_hidden * merge * merge, vision_hidden, bias=False)
        self.linear_1 = VisionLinear(vision_hidden, text_hidden, bias=bias)
        self.act = ACT2FN[act]
        self.linear_2 = VisionLinear(text_hidden, text_hidden, bias=bias)

    def forward(self, x: torch.Tensor, grid: list[tuple[int, int, int]]) -> torch.Tensor:
        x, m, pieces, offset = self.norm(x), self.merge, [], 0
        for _, h, w in grid:
            image = x[offset:offset + h * w].reshape(h // m, m, w // m, m, -1)
            pieces.append(image.permute(0, 2, 4, 1, 3).reshape((h // m) * (w // m), -1))
            offset += h * w
        merged = torch.cat(pieces) if pieces else x.new_zeros(0, self.merger.in_features)
        return self.linear_2(self.act(self.linear_1(self.merger(merged))))


class PixtralTower(nn.Module):
    """``forward(pixel_values [N, C*P*P], grid_thw [n, 3]) -> [N / merge^2, text_hidden]`` image embeddings."""

    def __init__(self, config, *, text_config, merge: int, projector_act: str, projector_bias: bool,
                 tp_group=None, recompute: bool = False) -> None:
        super().__init__()
        self.config = config
        self.recompute = recompute
        self.merge = merge
        self.patch_embed = PatchEmbed(config, bias=False)
        self.pre_norm = VisionRMSNorm(config.hidden_size, eps=PIXTRAL_NORM_EPS)
        self.blocks = nn.ModuleList([PixtralBlock(config, tp_group=tp_group) for _ in range(config.num_hidden_layers)])
        theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        self.rotary = PixtralRotary(config.hidden_size // config.num_attention_heads, theta)
        self.projector = Mistral3Projector(config.hidden_size, text_config.hidden_size, merge=merge,
                                           eps=text_config.rms_norm_eps, act=projector_act, bias=projector_bias)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        grid = [tuple(row) for row in grid_thw.tolist()]
        for t, h, w in grid:
            if t != 1 or h % self.merge or w % self.merge:
                raise ValueError(f"Pixtral's vision tower takes single images whose patch grid divides by "
                                 f"spatial_merge_size={self.merge}; got a {t}x{h}x{w} grid.")
        device = pixel_values.device
        positions = [torch.stack(torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij"), -1).reshape(-1, 2)
                     for _, h, w in grid]
        cos, sin = self.rotary(torch.cat(positions).to(device) if positions else torch.zeros(0, 2, device=device))
        x = self.pre_norm(self.patch_embed(pixel_values))
        cu_images = _cu([h * w for _, h, w in grid]).to(device)
        for block in self.blocks:
            x = run_block(self, block, x, cu_images, cos, sin)
        return self.projector(x, grid)
