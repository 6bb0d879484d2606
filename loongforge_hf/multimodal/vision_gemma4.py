"""Gemma 4's vision tower (``Gemma4VisionModel``) and its multimodal embedder (``Gemma4MultimodalEmbedder``):
patches in, the language model's image embeddings out; replicated on every rank of the first stage.

Choices:
- Inputs as the Qwen towers take them, so the chunk's machinery (beam copies, encoder data parallel) serves it
  unchanged: ``pixel_values [N, 3 * P * P]`` (the processor's patches without its padding, each image's row-major)
  and ``grid_thw [n, 3]`` = ``(1, h, w)`` per image (``bridges.gemma4_vl``'s ``vision_inputs`` makes them from the
  processor's ``pixel_values [n, max_patches, 3 P P]`` and ``image_position_ids``); ``merge`` is the pooling kernel,
  so an image gives ``h w / merge^2`` embeddings.
- The arithmetic is transformers': pixels scaled to ``2 (p - 0.5)``, a bias-free patch projection plus the x and y
  rows of the 2-D position table; blocks of Gemma 4's four RMSNorms (``x * (mean(x^2) + eps)^-0.5 * weight`` in
  fp32), q / k normalised per head with a weight and v without, the 2-D rope (the head's first half rotated by x,
  its second half by y, each as ``rotate_half`` over its half; ``axial`` frequencies over ``head_dim / 2``), scores
  unscaled, full attention within each image; the gated MLP (``hidden_activation``); the ``merge x merge`` average
  pool (row-major over the pooled grid) in fp32 times ``sqrt(hidden_size)``; the embedder's weightless RMSNorm and
  projection into the text width.
- Parameter names are the tower's own (``blocks.{i}.attn.q_proj.weight`` ...); ``bridges.gemma4_vl`` maps them to
  the checkpoint's one to one. ``recompute`` checkpoints each block in training (``vision.run_block``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loongforge_hf.kernels.rope import rotate_half
from loongforge_hf.multimodal.vision import _cu, run_block


def gemma4_rms(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``Gemma4RMSNorm``: in fp32, ``x * (mean(x^2) + eps)^-0.5`` (times ``weight`` where given), cast back."""
    xf = x.float()
    out = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    return (out if weight is None else out * weight.float()).to(x.dtype)


class Norm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gemma4_rms(x, self.weight, self.eps)


def _rope_2d(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [n, heads, d]``: its first half rotated with the x angles, its second with the y angles (``cos`` /
    ``sin [n, d]`` laid out ``[x, x, y, y]``), as transformers' ``apply_multidimensional_rope`` with 2 dimensions."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    halves = [(p * c) + (rotate_half(p) * s)
              for p, c, s in zip(x.chunk(2, dim=-1), cos.chunk(2, dim=-1), sin.chunk(2, dim=-1))]
    return torch.cat(halves, dim=-1)


class Gemma4VisionAttention(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        d, self.heads, self.kv_heads = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
        self.head_dim, self.eps = config.head_dim, config.rms_norm_eps
        self.tp_group = None  # NOTE: replicated (the chunk's training checkpoints read it)
        self.q_proj = nn.Linear(d, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, d, bias=False)
        self.q_norm = Norm(self.head_dim, self.eps)
        self.k_norm = Norm(self.head_dim, self.eps)

    def forward(self, x: torch.Tensor, cu_images: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        from megatron.core.packed_seq_params import PackedSeqParams

        from loongforge_hf.kernels.attention import packed_attention

        n = x.shape[0]
        q = _rope_2d(self.q_norm(self.q_proj(x).view(n, self.heads, self.head_dim)), cos, sin)
        k = _rope_2d(self.k_norm(self.k_proj(x).view(n, self.kv_heads, self.head_dim)), cos, sin)
        v = gemma4_rms(self.v_proj(x).view(n, self.kv_heads, self.head_dim), None, self.eps)
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_images, cu_seqlens_kv=cu_images)
        out = packed_attention(q, k, v, params, causal=False, scale=1.0) if n else q
        return self.o_proj(out.reshape(n, self.heads * self.head_dim))


class Gemma4VisionMLP(nn.Module):
    def __init__(self, config) -> None:
        from transformers.activations import ACT2FN

        super().__init__()
        d, f = config.hidden_size, config.intermediate_size
        self.gate_proj, self.up_proj = nn.Linear(d, f, bias=False), nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)
        self.act = ACT2FN[config.hidden_activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Gemma4VisionBlock(nn.Module):
    """Gemma 4's sandwich-norm encoder layer."""

    def __init__(self, config) -> None:
        super().__init__()
        d, eps = config.hidden_size, config.rms_norm_eps
        self.attn, self.mlp = Gemma4VisionAttention(config), Gemma4VisionMLP(config)
        self.input_layernorm, self.post_attention_layernorm = Norm(d, eps), Norm(d, eps)
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = Norm(d, eps), Norm(d, eps)

    def forward(self, x, cu_images, cos, sin):
        x = x + self.post_attention_layernorm(self.attn(self.input_layernorm(x), cu_images, cos, sin))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma4VisionTower(nn.Module):
    """``forward(pixel_values [N, 3 P P], grid_thw [n, 3]) -> [N / merge^2, text_hidden]`` image embeddings."""

    def __init__(self, config, *, text_hidden: int, recompute: bool = False) -> None:
        super().__init__()
        d = config.hidden_size
        self.config, self.recompute, self.merge = config, recompute, config.pooling_kernel_size
        self.patch_embed = nn.Linear(3 * config.patch_size ** 2, d, bias=False)
        self.position_table = nn.Parameter(torch.zeros(2, config.position_embedding_size, d))
        self.blocks = nn.ModuleList([Gemma4VisionBlock(config) for _ in range(config.num_hidden_layers)])
        self.projector = nn.Linear(d, text_hidden, bias=False)
        spatial = config.head_dim // 2
        base = config.rope_parameters["rope_theta"]
        self.register_buffer("inv_freq", 1.0 / (base ** (torch.arange(0, spatial, 2, dtype=torch.float) / spatial)),
                             persistent=False)

    def positions(self, grid: list[tuple[int, int, int]], device) -> torch.Tensor:
        """``[N, 2]`` (x, y) of each patch, row-major per image (the processor's ``image_position_ids``)."""
        rows = [torch.stack([torch.arange(w).repeat(h), torch.arange(h).repeat_interleave(w)], dim=-1)
                for _, h, w in grid]
        return (torch.cat(rows) if rows else torch.zeros(0, 2, dtype=torch.long)).to(device)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        grid = [tuple(row) for row in grid_thw.tolist()]
        k = self.merge
        for t, h, w in grid:
            if t != 1 or h % k or w % k or max(h, w) > self.config.position_embedding_size:
                raise ValueError(f"Gemma 4's vision tower takes single images of h x w patches, h and w multiples "
                                 f"of pooling_kernel_size={k} and at most position_embedding_size="
                                 f"{self.config.position_embedding_size}; got a {t}x{h}x{w} grid.")
        xy = self.positions(grid, pixel_values.device)
        x = self.patch_embed((2 * (pixel_values - 0.5)).to(self.patch_embed.weight.dtype))
        x = x + self.position_table[0][xy[:, 0]] + self.position_table[1][xy[:, 1]]
        freqs = xy[..., None].float() * self.inv_freq.to(x.device)  # NOTE: [N, 2, head_dim / 4]
        angles = torch.cat([freqs[:, 0], freqs[:, 0], freqs[:, 1], freqs[:, 1]], dim=-1)
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        cu_images = _cu([h * w for _, h, w in grid]).to(x.device)
        for block in self.blocks:
            x = run_block(self, block, x, cu_images, cos, sin)
        return self.project(self.pool(x, grid))

    def pool(self, x: torch.Tensor, grid: list[tuple[int, int, int]]) -> torch.Tensor:
        """Each image's ``merge x merge`` average (row-major over the pooled grid) in fp32, rounded to the model's
        dtype, then times ``sqrt(hidden_size)`` in fp32, rounded again (transformers' pooler, then its cast)."""
        pieces, offset = [], 0
        for _, h, w in grid:
            image = x[offset:offset + h * w].float().reshape(1, h, w, -1).permute(0, 3, 1, 2)
            pieces.append(F.avg_pool2d(image, self.merge).flatten(2)[0].t())
            offset += h * w
        pooled = (torch.cat(pieces) if pieces else x[:0].float()).to(x.dtype)
        return (pooled.float() * self.config.hidden_size ** 0.5).to(x.dtype)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """``Gemma4MultimodalEmbedder``: the weightless RMSNorm, then the projection into the text width."""
        return self.projector(gemma4_rms(x, None, self.config.rms_norm_eps))
