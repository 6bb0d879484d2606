"""Gemma 3's vision tower: a SigLIP ViT (learned positions, LayerNorm blocks, tanh-GELU MLP, a final LayerNorm) and
Gemma 3's projector (average pooling to ``mm_tokens_per_image`` tokens, Gemma's RMSNorm, a matrix into the language
model's width); optionally split over TP.

Choices:
- Inputs as the Qwen towers take them, so the chunk's machinery (encoder data parallel, CP shares of the images,
  beam copies) serves it unchanged: ``pixel_values [N, C * P * P]``, each image's patches row-major
  (``vision.as_image_patches`` turns the processor's ``[n, C, H, W]`` into them), and ``grid_thw [n, 3]`` =
  ``(1, H / P, W / P)`` per image;
  ``merge`` is the pooling kernel, so an image gives ``h w / merge^2`` tokens as a Qwen tower's.
- The arithmetic is transformers' (``SiglipVisionModel`` without its pooling head, ``Gemma3MultiModalProjector``):
  the patch convolution as one matmul (bias included), the learned table added at positions ``0 .. h w - 1`` (images
  at the configured ``image_size`` only: transformers does not interpolate the table for Gemma 3), full attention
  within each image, LayerNorm at ``layer_norm_eps``, ``AvgPool2d`` over ``merge x merge`` patches, the RMSNorm in
  fp32 with ``1 + weight``, then ``@ mm_input_projection_weight`` in the model's dtype.
- ``projector`` replaces Gemma 3's and ``position_ids`` can be overridden: Idefics3's tower
  (``vision_idefics3.py``) is this ViT with its own projector and its bucketed position ids; ``depth`` (the blocks
  run) and ``head`` (what follows them) too: Aya Vision's tower (``vision_aya.py``) stops at its feature layer.
- Tensor parallelism, FP8 and ``recompute`` as the Qwen towers (``vision.VisionAttention`` with fused ``qkv`` rows,
  ``vision_qwen3.Qwen3VisionMLP``): attention split by heads, ``fc1`` by rows and ``fc2`` by columns (bias after the
  reduction); norms, the patch embedding, the position table and the projector are replicated.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loongforge_hf.multimodal.vision import PatchEmbed, _cu, run_block
from loongforge_hf.multimodal.vision_qwen3 import Qwen3VisionBlock


class Gemma3Projector(nn.Module):
    """``[n * h * w, d]`` ViT outputs -> ``[n * h/m * w/m, text_hidden]``: pooling, Gemma's RMSNorm, projection."""

    def __init__(self, vision_hidden: int, text_hidden: int, *, merge: int, eps: float) -> None:
        super().__init__()
        self.merge, self.eps = merge, eps
        self.norm = nn.Parameter(torch.zeros(vision_hidden))
        self.weight = nn.Parameter(torch.zeros(vision_hidden, text_hidden))

    def forward(self, x: torch.Tensor, grid: list[tuple[int, int, int]]) -> torch.Tensor:
        pieces, offset = [], 0
        for _, h, w in grid:
            image = x[offset:offset + h * w].reshape(1, h, w, -1).permute(0, 3, 1, 2)
            pieces.append(F.avg_pool2d(image, self.merge).flatten(2)[0].t())
            offset += h * w
        pooled = torch.cat(pieces) if pieces else x[:0]
        normed = pooled.float() * torch.rsqrt(pooled.float().pow(2).mean(-1, keepdim=True) + self.eps)
        normed = (normed * (1.0 + self.norm.float())).to(x.dtype)
        return torch.matmul(normed, self.weight).to(x.dtype)


class SiglipTower(nn.Module):
    """``forward(pixel_values [N, C*P*P], grid_thw [n, 3]) -> [N / merge^2, text_hidden]`` image embeddings."""

    family = "Gemma 3"
    depth = None  # NOTE: the blocks run (None: all); Aya Vision's tower stops at its feature layer

    def __init__(self, config, *, text_hidden: int, tokens_per_image: int, tp_group=None,
                 recompute: bool = False, projector: nn.Module | None = None) -> None:
        super().__init__()
        self.config = config
        self.recompute = recompute
        self.side = config.image_size // config.patch_size
        per_side = int(round(tokens_per_image ** 0.5))
        self.merge = self.side // per_side
        self.patch_embed = PatchEmbed(config, bias=True)
        self.position_embedding = nn.Embedding(self.side * self.side, config.hidden_size)
        self.blocks = nn.ModuleList([
            Qwen3VisionBlock(config, tp_group=tp_group, heads=config.num_attention_heads, eps=config.layer_norm_eps)
            for _ in range(config.num_hidden_layers)])
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.projector = projector if projector is not None else \
            Gemma3Projector(config.hidden_size, text_hidden, merge=self.merge, eps=config.layer_norm_eps)

    def position_ids(self, grid: list[tuple[int, int, int]], device) -> torch.Tensor:
        """Each patch's row of the position table: ``0 .. h w - 1`` per image (the images are whole tiles)."""
        return torch.arange(self.side * self.side, device=device).repeat(len(grid))

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        grid = [tuple(row) for row in grid_thw.tolist()]
        for t, h, w in grid:
            if (t, h, w) != (1, self.side, self.side):
                size = self.config.image_size
                raise ValueError(f"{self.family}'s vision tower takes {size}x{size} images ({self.side}x{self.side} "
                                 f"patches of {self.config.patch_size}); got a {t}x{h}x{w} grid.")
        x = self.patch_embed(pixel_values)
        x = x + self.position_embedding(self.position_ids(grid, x.device)).to(x.dtype)
        cu_images = _cu([h * w for _, h, w in grid]).to(x.device)
        for block in self.blocks[:self.depth]:
            x = run_block(self, block, x, cu_images, None, None)
        return self.head(x, grid)

    def head(self, x: torch.Tensor, grid: list[tuple[int, int, int]]) -> torch.Tensor:
        """The image embeddings from the last block run's output: the final LayerNorm, then the projector."""
        return self.projector(self.post_layernorm(x), grid)
