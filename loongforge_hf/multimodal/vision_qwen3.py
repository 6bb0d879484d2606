"""The Qwen3-VL vision tower: a ViT with a learned, resampled position table, LayerNorm blocks, a GELU MLP, the patch
merger and DeepStack's mergers of intermediate blocks; optionally split over TP.

Choices:
- Parameter names and shapes are transformers' (``patch_embed.proj``, ``pos_embed``, ``blocks.{i}.norm1``,
  ``blocks.{i}.attn.qkv``, ``blocks.{i}.mlp.linear_fc1``, ``merger.norm``, ``deepstack_merger_list.{k}.linear_fc2``
  ...), so the bridge's table maps them one to one; so is the arithmetic: LayerNorm (eps 1e-6) in the model's dtype,
  axial rope over (h, w) in fp32 (``vision.AxialRotary``), the configured activation in the MLP, exact GELU in the
  mergers.
- The learned ``num_position_embeddings`` table is a square grid resampled to each image's patch grid by bilinear
  interpolation with aligned corners (transformers' ``fast_pos_embed_interpolate``), then laid out in the
  processor's block-major patch order and repeated over the frames.
- Attention is full within each frame (no windows); packed over frames and images with ``kernels.attention``'s packed
  attention, as the Qwen2.5-VL tower's full-attention blocks.
- DeepStack: the output of block ``deepstack_visual_indexes[k]`` goes through ``deepstack_merger_list[k]`` (LayerNorm
  after the ``merge x merge`` shuffle); ``forward`` returns the merged embeddings with these features concatenated on
  the feature axis, ``[N / merge^2, out_hidden_size * (1 + len(deepstack_visual_indexes))]``, so the chunk's
  machinery (encoder data parallel, CP shares, sequence-parallel splice) moves them with the embeddings as one tensor
  (``chunk.py`` splits them off and adds them to the first decoder layers' outputs). Qwen3.5's tower has none (its
  ``vision_config`` no ``deepstack_visual_indexes``): the merged embeddings alone.
- Tensor parallelism, FP8 and ``recompute`` as ``vision.VisionTower`` (the same ``VisionAttention``, ``VisionLinear``);
  the MLP's ``linear_fc1`` is split by rows, ``linear_fc2`` by columns (bias after the reduction); norms, the position
  table, the patch embedding and the mergers are replicated.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loongforge_hf.multimodal.vision import (VISION_NORM_EPS, AxialRotary, PatchEmbed, VisionAttention, VisionLinear,
                                             _into_split, _mark_split, _out_of_split, _tp_size, patch_positions,
                                             run_block, split_hidden)


class Qwen3VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str, *, tp_group=None) -> None:
        super().__init__()
        from transformers.activations import ACT2FN

        tp, local = _tp_size(tp_group), split_hidden(hidden, tp_group)
        self.tp_group = tp_group
        self.linear_fc1 = VisionLinear(dim, local, bias=True)
        self.linear_fc2 = VisionLinear(local, dim, bias=True)
        self.act = ACT2FN[act]
        if tp > 1:
            _mark_split(self.linear_fc1, 0, bias=True)
            _mark_split(self.linear_fc2, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.linear_fc1(_into_split(x, self.tp_group)))
        return _out_of_split(self.linear_fc2.matmul(h), self.linear_fc2.bias, self.tp_group)


class Qwen3VisionBlock(nn.Module):
    """LayerNorm, attention, LayerNorm, MLP (pre-norm residuals); also SigLIP's encoder layer (``heads``, ``eps``
    given: its config names them otherwise; no rope)."""

    def __init__(self, config, *, tp_group=None, heads: int | None = None, eps: float = VISION_NORM_EPS) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=eps)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=eps)
        self.attn = VisionAttention(config.hidden_size, heads or config.num_heads, tp_group=tp_group)
        self.mlp = Qwen3VisionMLP(config.hidden_size, config.intermediate_size, config.hidden_act, tp_group=tp_group)

    def forward(self, x, cu_seqlens, cos, sin):
        x = x + self.attn(self.norm1(x), cu_seqlens, cos, sin)
        return x + self.mlp(self.norm2(x))


class Qwen3PatchMerger(nn.Module):
    """LayerNorm (over one patch, or over the ``merge^2`` concatenated patches when ``post_shuffle``), then
    Linear-GELU-Linear over the concatenated patches."""

    def __init__(self, config, *, post_shuffle: bool) -> None:
        super().__init__()
        width = config.hidden_size * config.spatial_merge_size ** 2
        self.post_shuffle = post_shuffle
        self.norm = nn.LayerNorm(width if post_shuffle else config.hidden_size, eps=VISION_NORM_EPS)
        self.linear_fc1 = VisionLinear(width, width)
        self.act = nn.GELU()
        self.linear_fc2 = VisionLinear(width, config.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        width = self.linear_fc1.in_features
        x = self.norm(x.reshape(-1, width)) if self.post_shuffle else self.norm(x).reshape(-1, width)
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class Qwen3VisionTower(nn.Module):
    """``forward(pixel_values [N, C*T*P*P], grid_thw [n, 3]) -> [N / merge^2, out_hidden_size * (1 + deepstack)]``."""

    def __init__(self, config, *, tp_group=None, recompute: bool = False) -> None:
        super().__init__()
        self.config = config
        self.recompute = recompute
        self.merge = config.spatial_merge_size
        # NOTE: Qwen3.5's vision_config has no DeepStack field
        self.deepstack_visual_indexes = list(getattr(config, "deepstack_visual_indexes", None) or ())
        self.patch_embed = PatchEmbed(config, bias=True)
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.hidden_size)
        self.side = int(config.num_position_embeddings ** 0.5)
        self.blocks = nn.ModuleList([Qwen3VisionBlock(config, tp_group=tp_group) for _ in range(config.depth)])
        self.merger = Qwen3PatchMerger(config, post_shuffle=False)
        self.deepstack_merger_list = nn.ModuleList([Qwen3PatchMerger(config, post_shuffle=True)
                                                    for _ in self.deepstack_visual_indexes])
        self.rotary = AxialRotary(config)

    @property
    def deepstack_count(self) -> int:
        return len(self.deepstack_visual_indexes)

    def position_table(self, grid_thw: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``[N, hidden]``: the learned grid resampled to each image's ``h x w`` patches (bilinear, corners
        aligned), read at the patches' ``positions`` (block-major, repeated over frames)."""
        table = self.pos_embed.weight.view(self.side, self.side, -1).permute(2, 0, 1)[None]
        pieces, offset = [], 0
        for t, h, w in grid_thw.tolist():
            grid = F.interpolate(table, size=(h, w), mode="bilinear", align_corners=True)[0]     # [hidden, h, w]
            rows = positions[offset:offset + t * h * w]
            pieces.append(grid[:, rows[:, 0], rows[:, 1]].t())
            offset += t * h * w
        return torch.cat(pieces) if pieces else table.new_zeros(0, table.shape[1])

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        grid = grid_thw.cpu()
        positions, cu_frames = patch_positions(grid, merge=self.merge)
        device = pixel_values.device
        positions, cu_frames = positions.to(device), cu_frames.to(device)
        x = self.patch_embed(pixel_values)
        x = x + self.position_table(grid, positions).to(x.dtype)
        cos, sin = self.rotary(positions)
        deepstack = []
        for i, block in enumerate(self.blocks):
            x = run_block(self, block, x, cu_frames, cos, sin)
            if i in self.deepstack_visual_indexes:
                deepstack.append(self.deepstack_merger_list[self.deepstack_visual_indexes.index(i)](x))
        return torch.cat([self.merger(x), *deepstack], dim=-1) if deepstack else self.merger(x)
