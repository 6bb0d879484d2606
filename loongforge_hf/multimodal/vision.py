"""The Qwen2.5-VL vision tower (ViT with windowed attention, then the patch merger), optionally split over TP.

Choices:
- Parameter names and shapes are transformers' (``patch_embed.proj.weight``, ``blocks.{i}.attn.qkv.weight``,
  ``merger.mlp.0.weight`` ...), so the bridge's table maps them one to one; the arithmetic is transformers' too (RMSNorm
  in fp32, axial rope over (h, w) applied in fp32, exact GELU in the merger).
- The patch embedding is a ``Conv3d`` whose kernel equals its stride; it runs as one matmul over flattened patches.
- Windowed attention: tokens are reordered so that every window is contiguous (transformers' ``window_index``), each
  block attends within windows or, for ``fullatt_block_indexes``, within frames, through ``kernels.attention``'s packed
  attention (varlen flash attention on GPU, one SDPA per window on CPU); the merger's output is put back in order.
- Tensor parallelism (``tp_group`` of size > 1): heads of attention and rows of the MLP are split; the input of each
  split sub-layer goes through megatron's copy-to-TP-region (identity, grads all-reduced) and the output of the
  row-split projection through reduce-from-TP-region; its bias is added after the reduction. Everything else is
  replicated.
- ``recompute=True`` checkpoints each block in training (non-reentrant ``torch.utils.checkpoint``).
- The linear layers are ``VisionLinear``: ``nn.Linear`` whose matmul (without the bias, which a row-split layer adds
  after its reduction) is one method, so ``fp8=`` can put it through FP8 GEMMs (``kernels.fp8_linear.swap_linears``
  sets ``fp8_impl``); the patch embedding stays in the model's dtype, as the language model's embeddings do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from loongforge_hf.kernels.rmsnorm import rms_norm
from loongforge_hf.kernels.rope import rotate_half

VISION_NORM_EPS = 1e-6


# ---- geometry: which patch sits where ----------------------------------------------------------------------------

@dataclass
class VisionLayout:
    patch_order: torch.Tensor    # [N] patch rows in window order
    restore: torch.Tensor        # [N / m^2] merged rows back to input order
    positions: torch.Tensor      # [N, 2] (h, w) of each patch, input order
    cu_windows: torch.Tensor     # int32 window boundaries (window order)
    cu_frames: torch.Tensor      # int32 frame boundaries


def _cu(sizes) -> torch.Tensor:
    """int32 cumulative boundaries ``[0, s0, s0 + s1, ...]``."""
    return F.pad(torch.cumsum(torch.as_tensor(sizes, dtype=torch.int64), 0), (1, 0)).to(torch.int32)


def patch_positions(grid_thw: torch.Tensor, *, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(``[N, 2]`` (h, w) of each patch of images of ``grid_thw`` in the processor's order, int32 frame boundaries).

    Patches arrive block-major: per frame, each ``merge x merge`` block's patches together, blocks row-major."""
    positions, frame_sizes = [], []
    for t, h, w in grid_thw.tolist():
        if h % merge or w % merge:
            raise ValueError(f"image_grid_thw row {(t, h, w)}: height and width must be multiples of "
                             f"spatial_merge_size={merge}.")
        bh, bw = h // merge, w // merge
        rows = torch.arange(h).view(bh, merge, 1, 1).expand(bh, merge, bw, merge).permute(0, 2, 1, 3).reshape(-1)
        cols = torch.arange(w).view(1, 1, bw, merge).expand(bh, merge, bw, merge).permute(0, 2, 1, 3).reshape(-1)
        positions.append(torch.stack([rows, cols], dim=-1).repeat(t, 1))
        frame_sizes += [h * w] * t
    return (torch.cat(positions) if positions else torch.zeros(0, 2, dtype=torch.long)), _cu(frame_sizes)


def vision_layout(grid_thw: torch.Tensor, *, merge: int, window: int) -> VisionLayout:
    """Patch positions (``patch_positions``) and window order for images of ``grid_thw`` (patches) with ``merge`` x
    ``merge`` merging and windows of ``window`` x ``window`` merged tokens.

    Windows tile each frame's merged grid row-major (the last row/column of windows may be narrower); inside a window,
    merged tokens stay row-major.
    """
    positions, cu_frames = patch_positions(grid_thw, merge=merge)
    unit = merge * merge
    order, window_sizes = [], []
    offset = 0
    for t, h, w in grid_thw.tolist():
        bh, bw = h // merge, w // merge
        r = torch.arange(bh).view(bh, 1).expand(bh, bw)
        c = torch.arange(bw).view(1, bw).expand(bh, bw)
        window_id = ((r // window) * math.ceil(bw / window) + c // window).reshape(-1)
        in_frame = torch.argsort(window_id, stable=True)
        sizes = torch.bincount(window_id) * unit
        for f in range(t):
            order.append(in_frame + offset + f * bh * bw)
            window_sizes.append(sizes)
        offset += t * bh * bw
    merged_order = torch.cat(order) if order else torch.zeros(0, dtype=torch.long)
    patch_order = (merged_order[:, None] * unit + torch.arange(unit)).reshape(-1)
    return VisionLayout(patch_order=patch_order, restore=torch.argsort(merged_order), positions=positions,
                        cu_windows=_cu(torch.cat(window_sizes) if window_sizes else []), cu_frames=cu_frames)


def as_image_patches(pixel_values: torch.Tensor, patch: int,
                     image_sizes: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Padded ``[n, C, H, W]`` images and each one's ``(height, width)`` in pixels (all of ``H x W`` when None) ->
    (``[sum h w, C * P * P]`` patches, each image's ``h = height // P`` by ``w = width // P`` top-left patches
    row-major, channels first in a patch as the convolution's weight; ``grid_thw [n, 3]`` = ``(1, h, w)``)."""
    n, c, height, width = pixel_values.shape
    sizes = [(height, width)] * n if image_sizes is None else [tuple(s) for s in torch.as_tensor(image_sizes).tolist()]
    if len(sizes) != n:
        raise ValueError(f"image_sizes gives {len(sizes)} sizes for {n} images in pixel_values.")
    pieces, grid = [], []
    for image, (size_h, size_w) in zip(pixel_values, sizes):
        h, w = int(size_h) // patch, int(size_w) // patch
        if not 0 < h * patch <= height or not 0 < w * patch <= width:
            raise ValueError(f"image_sizes entry {(size_h, size_w)} does not fit pixel_values of {height}x{width} "
                             f"pixels with {patch}-pixel patches.")
        crop = image[:, :h * patch, :w * patch].reshape(c, h, patch, w, patch)
        pieces.append(crop.permute(1, 3, 0, 2, 4).reshape(h * w, c * patch * patch))
        grid.append((1, h, w))
    return torch.cat(pieces), torch.tensor(grid, dtype=torch.long, device=pixel_values.device).reshape(n, 3)


def item_patches(tower, grid_thw: torch.Tensor) -> torch.Tensor:
    """``[n]`` rows of ``pixel_values`` each image / video of ``grid_thw`` takes: ``t h w`` patches, or the tower's
    own count where its grid rows are not patch grids (``tower.item_patches``: LLaVA-NeXT's)."""
    own = getattr(tower, "item_patches", None)
    return own(grid_thw) if own is not None else grid_thw.prod(-1)


def item_tokens(tower, grid_thw: torch.Tensor) -> torch.Tensor:
    """``[n]`` embeddings the tower gives each image / video of ``grid_thw``: ``t h w / merge^2``, or the tower's own
    count (``tower.item_tokens``: LLaVA-NeXT's, which depends on each image's size)."""
    own = getattr(tower, "item_tokens", None)
    return own(grid_thw) if own is not None else grid_thw.prod(-1) // tower.merge ** 2


# ---- modules -----------------------------------------------------------------------------------------------------

def _tp_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _mark_split(linear: nn.Linear, axis: int, *, bias: bool) -> None:
    """megatron's tensor-parallel attributes on a split linear's weight (and bias, split with its rows): its gradient
    norm then counts every rank's shard, not TP rank 0's alone (megatron takes a parameter without them for a
    replica)."""
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    set_tensor_model_parallel_attributes(linear.weight, True, axis, 1)
    if bias:
        set_tensor_model_parallel_attributes(linear.bias, True, 0, 1)


def _into_split(x: torch.Tensor, group) -> torch.Tensor:
    if _tp_size(group) == 1:
        return x
    from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

    return copy_to_tensor_model_parallel_region(x, group=group)


def _out_of_split(x: torch.Tensor, bias: torch.Tensor | None, group) -> torch.Tensor:
    if _tp_size(group) > 1:
        from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

        x = reduce_from_tensor_model_parallel_region(x, group=group)
    return x if bias is None else x + bias


class VisionLinear(nn.Linear):
    """``nn.Linear`` with its matmul as a method: ``fp8_impl(x, weight, bias)`` replaces ``F.linear`` when set."""

    fp8_impl = None

    def _linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, self.weight, bias) if self.fp8_impl is None else self.fp8_impl(x, self.weight, bias)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ weight.T`` without the bias."""
        return self._linear(x, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x, self.bias)


class VisionRMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = VISION_NORM_EPS) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class VisionAttention(nn.Module):
    """Attention within each image (``cu_seqlens``), fused ``qkv`` rows; ``bias=False``: no biases (Pixtral);
    ``proj_bias``: the output projection's own (InternViT: biased whatever its q / k / v)."""

    def __init__(self, dim: int, num_heads: int, *, tp_group=None, bias: bool = True,
                 proj_bias: bool | None = None) -> None:
        super().__init__()
        tp = _tp_size(tp_group)
        if num_heads % tp:
            raise ValueError(f"vision num_heads={num_heads} is not divisible by vision_tensor_parallel_size={tp}.")
        self.tp_group = tp_group
        self.head_dim = dim // num_heads
        self.local_heads = num_heads // tp
        self.qkv = VisionLinear(dim, 3 * self.local_heads * self.head_dim, bias=bias)
        self.proj = VisionLinear(self.local_heads * self.head_dim, dim, bias=bias if proj_bias is None else proj_bias)
        if tp > 1:
            _mark_split(self.qkv, 0, bias=bias)
            _mark_split(self.proj, 1, bias=False)  # NOTE: its bias is added after the reduction, whole

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        from megatron.core.packed_seq_params import PackedSeqParams

        from loongforge_hf.kernels.attention import packed_attention

        n = x.shape[0]
        q, k, v = self.split_qkv(x)
        if cos is not None:  # NOTE: None: a ViT without rope (SigLIP's learned positions)
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        if n == 0:
            # NOTE: a rank without images (encoder data parallel) still runs the tower, so every parameter is in
            # its graph; there is nothing to attend.
            out = v
        else:
            params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens)
            out = packed_attention(q, k, v, params, causal=False, scale=self.head_dim ** -0.5)
        out = out.reshape(n, self.local_heads * self.head_dim)
        return _out_of_split(self.proj.matmul(out), self.proj.bias, self.tp_group)

    def split_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's heads of q, k, v ``[n, local_heads, head_dim]`` each (InternViT's q / k norms act here)."""
        return self.qkv(_into_split(x, self.tp_group)).view(x.shape[0], 3, self.local_heads, self.head_dim).unbind(1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' vision rope: in fp32, ``cos``/``sin`` [n, head_dim] broadcast over heads."""
    xf, cos, sin = x.float(), cos[:, None, :].float(), sin[:, None, :].float()
    return (xf * cos + rotate_half(xf) * sin).to(x.dtype)


def run_block(tower: nn.Module, block: nn.Module, *args) -> torch.Tensor:
    """``block(*args)``, checkpointed (non-reentrant ``torch.utils.checkpoint``) when ``tower.recompute`` is set and
    ``tower`` trains with gradients enabled."""
    if tower.recompute and tower.training and torch.is_grad_enabled():
        return torch.utils.checkpoint.checkpoint(block, *args, use_reentrant=False)
    return block(*args)


def split_hidden(hidden: int, tp_group) -> int:
    """This TP rank's share of the ViT MLP's ``hidden`` width."""
    tp = _tp_size(tp_group)
    if hidden % tp:
        raise ValueError(f"vision intermediate_size={hidden} is not divisible by vision_tensor_parallel_size={tp}.")
    return hidden // tp


class VisionMLP(nn.Module):
    """Gated MLP ``down(act(gate(x)) * up(x))``; ``bias=False``: no biases (Pixtral)."""

    def __init__(self, dim: int, hidden: int, act: str, *, tp_group=None, bias: bool = True) -> None:
        super().__init__()
        from transformers.activations import ACT2FN

        tp, local = _tp_size(tp_group), split_hidden(hidden, tp_group)
        self.tp_group = tp_group
        self.gate_proj = VisionLinear(dim, local, bias=bias)
        self.up_proj = VisionLinear(dim, local, bias=bias)
        self.down_proj = VisionLinear(local, dim, bias=bias)
        self.act = ACT2FN[act]
        if tp > 1:
            _mark_split(self.gate_proj, 0, bias=bias)
            _mark_split(self.up_proj, 0, bias=bias)
            _mark_split(self.down_proj, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _into_split(x, self.tp_group)
        h = self.act(self.gate_proj(x)) * self.up_proj(x)
        return _out_of_split(self.down_proj.matmul(h), self.down_proj.bias, self.tp_group)


class VisionBlock(nn.Module):
    def __init__(self, config, *, tp_group=None) -> None:
        super().__init__()
        self.norm1 = VisionRMSNorm(config.hidden_size)
        self.norm2 = VisionRMSNorm(config.hidden_size)
        self.attn = VisionAttention(config.hidden_size, config.num_heads, tp_group=tp_group)
        self.mlp = VisionMLP(config.hidden_size, config.intermediate_size, config.hidden_act, tp_group=tp_group)

    def forward(self, x, cu_seqlens, cos, sin):
        x = x + self.attn(self.norm1(x), cu_seqlens, cos, sin)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """The projector: RMSNorm, then ``merge^2`` neighbouring patches concatenated through Linear-GELU-Linear."""

    def __init__(self, config) -> None:
        super().__init__()
        width = config.hidden_size * config.spatial_merge_size ** 2
        self.ln_q = VisionRMSNorm(config.hidden_size)
        self.mlp = nn.Sequential(VisionLinear(width, width), nn.GELU(), VisionLinear(width, config.out_hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        width = self.mlp[0].in_features
        return self.mlp(self.ln_q(x).reshape(x.numel() // width, width))


class PatchEmbed(nn.Module):
    """The patch convolution (kernel = stride) as one matmul over flattened patches: ``Conv3d`` over (frames, h, w)
    where ``config`` has a ``temporal_patch_size`` (Qwen's ViTs), else ``Conv2d`` (SigLIP)."""

    def __init__(self, config, *, bias: bool = False) -> None:
        super().__init__()
        temporal = getattr(config, "temporal_patch_size", None)
        channels = getattr(config, "in_channels", None) or config.num_channels
        if temporal is None:
            kernel = (config.patch_size, config.patch_size)
            self.proj = nn.Conv2d(channels, config.hidden_size, kernel_size=kernel, stride=kernel, bias=bias)
        else:
            kernel = (temporal, config.patch_size, config.patch_size)
            self.proj = nn.Conv3d(channels, config.hidden_size, kernel_size=kernel, stride=kernel, bias=bias)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        return F.linear(pixels.to(weight.dtype), weight.reshape(weight.shape[0], -1), self.proj.bias)


class AxialRotary(nn.Module):
    """The ViT's 2-D rope: ``forward(positions [n, 2]) -> cos, sin [n, head_dim]``, angles of h then w over a
    quarter of the head each, the pair repeated (rotate-half layout)."""

    def __init__(self, config) -> None:
        super().__init__()
        head_dim = config.hidden_size // config.num_heads
        theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        quarter = torch.arange(0, head_dim // 2, 2, dtype=torch.int64).float() / (head_dim // 2)
        self.register_buffer("inv_freq", 1.0 / (theta ** quarter), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions[..., None].float() * self.inv_freq.to(positions.device)    # [n, 2, head_dim / 4]
        angles = angles.flatten(1)
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos(), angles.sin()


class VisionTower(nn.Module):
    """``forward(pixel_values [N, C*T*P*P], grid_thw [n, 3]) -> [N / merge^2, out_hidden_size]`` image embeddings."""

    def __init__(self, config, *, tp_group=None, recompute: bool = False) -> None:
        super().__init__()
        self.config = config
        self.recompute = recompute
        self.merge = config.spatial_merge_size
        self.window = config.window_size // config.spatial_merge_size // config.patch_size
        self.full_attention = frozenset(config.fullatt_block_indexes or ())
        self.patch_embed = PatchEmbed(config)
        self.blocks = nn.ModuleList([VisionBlock(config, tp_group=tp_group) for _ in range(config.depth)])
        self.merger = PatchMerger(config)
        self.rotary = AxialRotary(config)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        layout = vision_layout(grid_thw.cpu(), merge=self.merge, window=self.window)
        device = pixel_values.device
        order = layout.patch_order.to(device)
        x = self.patch_embed(pixel_values)[order]
        cos, sin = self.rotary(layout.positions.to(device)[order])
        cu_windows, cu_frames = layout.cu_windows.to(device), layout.cu_frames.to(device)
        for i, block in enumerate(self.blocks):
            x = run_block(self, block, x, cu_frames if i in self.full_attention else cu_windows, cos, sin)
        return self.merger(x)[layout.restore.to(device)]
