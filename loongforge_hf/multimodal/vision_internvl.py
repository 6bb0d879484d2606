"""InternVL's vision tower: an InternViT (patch convolution, a class token, absolute positions, LayerNorm or RMSNorm
blocks with layer scale and optional q / k norms, a GELU MLP) and InternVL's projector (pixel shuffle, LayerNorm,
Linear-GELU-Linear); optionally split over TP.

Choices:
- Inputs as the Qwen towers take them, so the chunk's machinery (encoder data parallel, CP shares of the images,
  beam copies) serves it unchanged: ``pixel_values [N, C * P * P]``, each tile's patches row-major
  (``vision.as_image_patches`` turns the processor's ``[n, C, H, W]`` tiles into them), and ``grid_thw [n, 3]`` =
  ``(1, H / P, W / P)`` per tile; ``merge`` is ``1 / downsample_ratio``, so a tile gives ``h w / merge^2`` tokens as
  a Qwen tower's image does. A tile is an image here: the processor's thumbnails and crops of one picture (and a
  video's frames) are separate tiles, their tokens one after another.
- The arithmetic is transformers' (``InternVLVisionModel``, ``InternVLModel.pixel_shuffle``,
  ``InternVLMultiModalProjector``): the convolution as one matmul with its bias; the class token first, then the
  whole learned table added (tiles at the configured ``image_size`` only: the processor resizes every tile to it;
  transformers would interpolate the table otherwise); full attention within each tile, its class token included,
  without rope; a block is ``x + lambda_1 * attn(norm1(x))``, then ``x + lambda_2 * mlp(norm2(x))`` (``norm_type``:
  LayerNorm or RMSNorm at ``layer_norm_eps``); the q / k norms (``use_qk_norm``) are RMSNorms over the whole width
  (eps 1e-6, as transformers builds them) before the heads split; a final LayerNorm where ``use_mean_pooling`` is
  False; the class tokens dropped; the pixel shuffle puts each ``merge x merge`` block's features (row, column)
  row-major, channels last; the projector's LayerNorm at eps 1e-5 (``nn.LayerNorm``'s default, as transformers').
- Tensor parallelism, FP8 and ``recompute`` as the Qwen towers (``vision.VisionAttention`` with fused ``qkv`` rows,
  ``vision_qwen3.Qwen3VisionMLP``): attention split by heads, ``fc1`` by rows and ``fc2`` by columns (biases after
  the reduction); the q / k norms' weights split with the heads, their mean square summed over the TP group (an
  all-reduce whose backward sums the gradient: each rank's heads depend on every rank's columns); the other norms,
  the layer scales, the class token, the table, the patch embedding and the projector are replicated.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from loongforge_hf.multimodal.vision import (PatchEmbed, VisionAttention, VisionLinear, VisionRMSNorm, _cu, _tp_size,
                                             run_block)
from loongforge_hf.multimodal.vision_qwen3 import Qwen3VisionMLP

QK_NORM_EPS = 1e-6  # NOTE: transformers builds InternVLVisionRMSNorm(embed_dim) for q / k without the config's eps


class SplitRMSNorm(nn.Module):
    """RMSNorm over a ``width`` whose columns are split over ``tp_group`` (this rank holds ``local`` of them and their
    weights): the mean square is the group's."""

    def __init__(self, width: int, local: int, *, eps: float, tp_group=None) -> None:
        super().__init__()
        self.width, self.eps, self.tp_group = width, eps, tp_group
        self.weight = nn.Parameter(torch.ones(local))
        if _tp_size(tp_group) > 1:
            from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

            set_tensor_model_parallel_attributes(self.weight, True, 0, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        square = xf.pow(2).sum(-1, keepdim=True)
        if _tp_size(self.tp_group) > 1:
            from torch.distributed.nn.functional import all_reduce

            square = all_reduce(square, group=self.tp_group)
        return self.weight * (xf * torch.rsqrt(square / self.width + self.eps)).to(x.dtype)


class InternVisionAttention(VisionAttention):
    """``VisionAttention`` (no rope) with InternViT's biases and its optional q / k norms over the whole width."""

    def __init__(self, config, *, tp_group=None) -> None:
        d = config.hidden_size
        super().__init__(d, config.num_attention_heads, tp_group=tp_group, bias=bool(config.attention_bias),
                         proj_bias=True)
        self.q_norm = self.k_norm = None
        if config.use_qk_norm:
            local = self.local_heads * self.head_dim
            self.q_norm = SplitRMSNorm(d, local, eps=QK_NORM_EPS, tp_group=tp_group)
            self.k_norm = SplitRMSNorm(d, local, eps=QK_NORM_EPS, tp_group=tp_group)

    def split_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = super().split_qkv(x)
        if self.q_norm is not None:
            q = self.q_norm(q.flatten(1)).view_as(q)
            k = self.k_norm(k.flatten(1)).view_as(k)
        return q, k, v


class InternVisionBlock(nn.Module):
    """norm, attention, layer scale; norm, MLP, layer scale (pre-norm residuals)."""

    def __init__(self, config, *, tp_group=None) -> None:
        super().__init__()
        d = config.hidden_size
        norm = nn.LayerNorm if config.norm_type == "layer_norm" else VisionRMSNorm
        self.norm1 = norm(d, eps=config.layer_norm_eps)
        self.norm2 = norm(d, eps=config.layer_norm_eps)
        self.attn = InternVisionAttention(config, tp_group=tp_group)
        self.mlp = Qwen3VisionMLP(d, config.intermediate_size, config.hidden_act, tp_group=tp_group)
        self.lambda_1 = nn.Parameter(torch.ones(d))
        self.lambda_2 = nn.Parameter(torch.ones(d))

    def forward(self, x, cu_seqlens, cos, sin):
        x = x + self.lambda_1 * self.attn(self.norm1(x), cu_seqlens, cos, sin)
        return x + self.lambda_2 * self.mlp(self.norm2(x))


class InternVLProjector(nn.Module):
    """``[sum h w, d]`` ViT outputs (class tokens dropped) -> ``[sum h w / merge^2, text_hidden]``: pixel shuffle,
    LayerNorm, Linear-act-Linear."""

    def __init__(self, vision_hidden: int, text_hidden: int, *, merge: int, act: str) -> None:
        super().__init__()
        from transformers.activations import ACT2FN

        width = vision_hidden * merge * merge
        self.merge = merge
        self.norm = nn.LayerNorm(width)
        self.linear_1 = VisionLinear(width, text_hidden)
        self.act = ACT2FN[act]
        self.linear_2 = VisionLinear(text_hidden, text_hidden)

    def forward(self, x: torch.Tensor, grid: list[tuple[int, int, int]]) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(self.norm(pixel_shuffle(x, grid, self.merge)))))


def pixel_shuffle(x: torch.Tensor, grid: list[tuple[int, int, int]], merge: int) -> torch.Tensor:
    """``[sum h w, d]`` patch features of images of ``grid`` (each row-major) -> ``[sum h w / merge^2, d merge^2]``:
    each ``merge x merge`` block's features (row, column) row-major, channels last, the blocks row-major (InternVL's
    and Idefics3's pixel shuffle)."""
    m, pieces, offset = merge, [], 0
    for _, h, w in grid:
        tile = x[offset:offset + h * w].reshape(h // m, m, w // m, m, -1)
        pieces.append(tile.permute(0, 2, 1, 3, 4).reshape((h // m) * (w // m), -1))
        offset += h * w
    return torch.cat(pieces) if pieces else x.reshape(0, x.shape[-1] * m * m)


class InternViTTower(nn.Module):
    """``forward(pixel_values [N, C*P*P], grid_thw [n, 3]) -> [N / merge^2, text_hidden]`` tile embeddings."""

    def __init__(self, config, *, text_hidden: int, merge: int, projector_act: str, tp_group=None,
                 recompute: bool = False) -> None:
        super().__init__()
        d, patch = config.hidden_size, config.patch_size[0]
        self.config = config
        self.recompute = recompute
        self.merge = merge
        self.side = config.image_size[0] // patch
        self.patch_embed = PatchEmbed(SimpleNamespace(hidden_size=d, patch_size=patch,
                                                      num_channels=config.num_channels), bias=True)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, d))
        self.position_embedding = nn.Parameter(torch.zeros(1, self.side * self.side + 1, d)) \
            if config.use_absolute_position_embeddings else None
        self.blocks = nn.ModuleList([InternVisionBlock(config, tp_group=tp_group)
                                     for _ in range(config.num_hidden_layers)])
        self.post_norm = None if config.use_mean_pooling else nn.LayerNorm(d, eps=config.layer_norm_eps)
        self.projector = InternVLProjector(d, text_hidden, merge=merge, act=projector_act)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        grid = [tuple(row) for row in grid_thw.tolist()]
        side, d = self.side, self.config.hidden_size
        for t, h, w in grid:
            if (t, h, w) != (1, side, side):
                raise ValueError(f"InternVL's vision tower takes tiles of {self.config.image_size} pixels "
                                 f"({side}x{side} patches); got a {t}x{h}x{w} grid.")
        x = self.patch_embed(pixel_values).reshape(len(grid), side * side, d)
        x = torch.cat([self.cls_token.to(x.dtype).expand(len(grid), 1, d), x], dim=1)
        if self.position_embedding is not None:
            x = x + self.position_embedding.to(x.dtype)
        x = x.reshape(-1, d)
        cu_tiles = _cu([side * side + 1] * len(grid)).to(x.device)
        for block in self.blocks:
            x = run_block(self, block, x, cu_tiles, None, None)
        if self.post_norm is not None:
            x = self.post_norm(x)
        return self.projector(x.reshape(len(grid), side * side + 1, d)[:, 1:].reshape(-1, d), grid)
