"""Llama 4's vision tower: its ViT (unfolded patches through a linear without bias, a class token after the patches,
a learned position table, pre- and post-LayerNorms, LayerNorm blocks with biased q / k / v / o, a 2-D rope and a
GELU MLP), its pixel-shuffle adapter and the projector into the language model; optionally split over TP.

Choices:
- Inputs as the Qwen towers take them, so the chunk's machinery (encoder data parallel, CP shares of the images,
  beam copies) serves it unchanged: ``pixel_values [N, C * P * P]``, each tile's patches row-major
  (``vision.as_image_patches`` turns the processor's ``[n, C, H, W]`` tiles into them; a patch's values channels
  first, as ``nn.Unfold`` lays them out), and ``grid_thw [n, 3]`` = ``(1, H / P, W / P)`` per tile; ``merge`` is
  ``1 / pixel_shuffle_ratio``, so a tile gives ``h w / merge^2`` tokens as a Qwen tower's image does. A tile is an
  image here: the processor's tiles and global view of one picture are separate tiles, their tokens one after
  another.
- The arithmetic is transformers' (``Llama4VisionModel``, ``Llama4MultiModalProjector``): the class token after the
  patches, the whole table added (tiles at the configured ``image_size`` only: the processor resizes every tile to
  it), LayerNorms at eps 1e-5 (``nn.LayerNorm``'s default, which transformers builds whatever ``norm_eps`` says),
  full attention within each tile, its class token included; exact GELU in the blocks and the adapter (transformers
  hard-codes ``nn.GELU()`` whatever ``hidden_act`` says); the class token dropped after the post-LayerNorm; the pixel
  shuffle puts each ``merge x merge`` block's features (row, column) row-major, channels last; the adapter is
  ``gelu(fc2(gelu(fc1(x))))``, then ``linear_1``.
- The rope: transformers multiplies each head's channel pairs ``(2i, 2i + 1)`` as complex numbers by
  ``exp(1j * angle_i)``, the first quarter of the head's angles ``(column + 1) * f``, the second ``(row + 1) * f``
  (``f``: the ``head_dim / 4`` frequencies of ``rope_theta`` over ``head_dim / 2``), the class token's 0. Here q and k
  of each head are reordered even channels then odd ones (``Llama4VisionAttention.split_qkv``): q . k is the same
  and the pairs become the rotate-half layout ``vision.VisionAttention`` applies (in fp32); v is left as it is.
- Tensor parallelism, FP8 and ``recompute`` as the Qwen towers (``vision_qwen3.Qwen3VisionBlock``: the same
  LayerNorm block, ``vision.VisionAttention`` with fused ``qkv`` rows): attention split by heads, ``fc1`` by rows
  and ``fc2`` by columns (biases after the reduction); the norms, the class token, the table, the patch embedding,
  the adapter and the projector are replicated.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from loongforge_hf.multimodal.vision import VisionAttention, VisionLinear, _cu, run_block
from loongforge_hf.multimodal.vision_clip import check_square_grids
from loongforge_hf.multimodal.vision_qwen3 import Qwen3VisionBlock

LLAMA4_NORM_EPS = 1e-5  # NOTE: transformers builds nn.LayerNorm(hidden_size) without the config's norm_eps


class Llama4VisionAttention(VisionAttention):
    """``VisionAttention`` whose q and k come with each head's even channels first, then its odd ones."""

    def split_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = super().split_qkv(x)
        return torch.cat([q[..., 0::2], q[..., 1::2]], -1), torch.cat([k[..., 0::2], k[..., 1::2]], -1), v


class Llama4VisionBlock(Qwen3VisionBlock):
    """LayerNorm, attention (biased, 2-D rope on neighbouring channel pairs), LayerNorm, GELU MLP (biased)."""

    def __init__(self, config, *, tp_group=None) -> None:
        d, heads = config.hidden_size, config.num_attention_heads
        gelu = SimpleNamespace(hidden_size=d, intermediate_size=config.intermediate_size, hidden_act="gelu")
        super().__init__(gelu, tp_group=tp_group, heads=heads, eps=LLAMA4_NORM_EPS)
        self.attn = Llama4VisionAttention(d, heads, tp_group=tp_group)


class Llama4Rotary(nn.Module):
    """``forward(side, device) -> cos, sin [side^2 + 1, head_dim]``: a tile's patches row-major, then its class
    token (angle 0); each angle twice (the even channels', then the odd ones')."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        self.head_dim, self.theta = head_dim, theta  # NOTE: no buffer: the tower's .to(dtype) would round it

    def forward(self, side: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        half = self.head_dim // 2
        freqs = 1.0 / (self.theta ** (torch.arange(0, half, 2, device=device)[:half // 2].float() / half))
        index = torch.arange(side * side, device=device)
        angles = torch.cat([(index % side + 1)[:, None] * freqs, (index // side + 1)[:, None] * freqs], dim=-1)
        angles = torch.cat([angles, angles.new_zeros(1, angles.shape[1])])
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos(), angles.sin()


class Llama4Adapter(nn.Module):
    """``[n, side^2, d]`` ViT outputs -> ``[n * side^2 / merge^2, projector_output_dim]``: pixel shuffle, then the
    adapter's two GELU-activated linears (no biases)."""

    def __init__(self, config, *, merge: int) -> None:
        super().__init__()
        self.merge = merge
        self.fc1 = VisionLinear(config.intermediate_size, config.projector_input_dim, bias=False)
        self.fc2 = VisionLinear(config.projector_output_dim, config.projector_output_dim, bias=False)
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor, side: int) -> torch.Tensor:
        n, m, d, per_side = x.shape[0], self.merge, x.shape[-1], side // self.merge
        x = x.reshape(n, per_side, m, per_side, m, d).permute(0, 1, 3, 2, 4, 5)
        return self.act(self.fc2(self.act(self.fc1(x.reshape(n * per_side * per_side, m * m * d)))))


class Llama4VisionTower(nn.Module):
    """``forward(pixel_values [N, C*P*P], grid_thw [n, 3]) -> [N / merge^2, text_hidden]`` image embeddings."""

    def __init__(self, config, *, text_hidden: int, merge: int, side: int, patch: int, tp_group=None,
                 recompute: bool = False) -> None:
        super().__init__()
        d = config.hidden_size
        self.config = config
        self.recompute = recompute
        self.merge, self.side = merge, side
        self.patch_embed = nn.Linear(config.num_channels * patch * patch, d, bias=False)
        self.class_embedding = nn.Parameter(torch.zeros(d))
        self.position_embedding = nn.Parameter(torch.zeros(side * side + 1, d))
        self.pre_norm = nn.LayerNorm(d, eps=LLAMA4_NORM_EPS)
        self.blocks = nn.ModuleList([Llama4VisionBlock(config, tp_group=tp_group)
                                     for _ in range(config.num_hidden_layers)])
        self.post_norm = nn.LayerNorm(d, eps=LLAMA4_NORM_EPS)
        self.adapter = Llama4Adapter(config, merge=merge)
        self.projector = VisionLinear(config.vision_output_dim, text_hidden, bias=False)
        theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        self.rotary = Llama4Rotary(d // config.num_attention_heads, theta)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        side, d = self.side, self.config.hidden_size
        n = check_square_grids(grid_thw, side, f"Llama 4's vision tower takes {self.config.image_size}-pixel tiles")
        x = self.patch_embed(pixel_values.to(self.patch_embed.weight.dtype)).reshape(n, side * side, d)
        x = torch.cat([x, self.class_embedding.to(x.dtype).expand(n, 1, d)], dim=1)
        x = self.pre_norm(x + self.position_embedding.to(x.dtype)).reshape(n * (side * side + 1), d)
        cos, sin = (t.repeat(n, 1) for t in self.rotary(side, x.device))
        cu_tiles = _cu([side * side + 1] * n).to(x.device)
        for block in self.blocks:
            x = run_block(self, block, x, cu_tiles, cos, sin)
        x = self.post_norm(x).reshape(n, side * side + 1, d)[:, :-1]
        return self.projector(self.adapter(x, side))
