"""Rotary position embedding with Hugging Face semantics, and the inverse frequencies HF configs ask for.

Choices:
- Rotate-half layout (HF's ``rotate_half``: the first and second halves of the rotary dims are the pair), with
  ``cos = cat(freqs, freqs)``. Partial rotary (``partial_rotary_factor`` < 1) rotates the first ``rotary_dim`` channels
  and passes the rest through, as HF's partial-rotary models do.
- Inverse frequencies are computed in fp32 like HF (``base ** (arange(0, dim, 2) / dim)``); ``rope_scaling`` types
  ``default``, ``linear``, ``llama3``, ``yarn`` and ``longrope`` (short or long factors) are understood, any other
  raises and says which are. YaRN's and LongRoPE's scale on cos and sin (``rope_attention_factor``) is applied to
  q's and k's rotary channels before the rotation instead (``rotary_scale_module``, megatron's q / k norm slots): the
  rotation is linear, so the product is the same, and megatron's rotation takes no such scale on its fused path.
- LongRoPE's two sets of frequencies in one rotary embedding (``longrope_rotary``), picked per forward by its length
  (``select_longrope``), as transformers picks them.
- The op is plain differentiable torch: autograd keeps only ``cos`` and ``sin`` (the inputs), so a hand-written
  backward would save nothing.
- megatron's ``RotaryEmbedding`` (built inside ``GPTModel``) uses the same layout when ``rotary_interleaved`` is False;
  ``set_megatron_inv_freq`` installs HF's inverse frequencies into it (megatron hard-codes llama3's
  ``low/high_freq_factor`` and ``original_max_position_embeddings``).
- In training, megatron applies the rotation itself (``rope_utils.apply_rotary_pos_emb`` on ``[s, b, heads, d]`` with
  the angles ``freqs [s, 1, 1, rot]``; llama3 scaling lives only in those frequencies). ``enable_megatron_fused_rope``
  fills megatron's fused-rope slot (``rope_utils.fused_apply_rotary_pos_emb``, Transformer Engine's when TE is
  installed, else empty) with ``rotary_sbhd`` and sets ``config.apply_rope_fusion``: on CUDA with Triton one kernel
  per direction (``_rope_triton.py``: cos/sin computed in registers, fp32 math, one rounding), elsewhere
  ``apply_rotary`` with megatron's unfused numerics. Only the non-packed (bshd) call goes there: megatron's packed
  (THD) call needs TE's kernel, and our runtime passes no ``packed_seq_params`` to the language model.
"""

from __future__ import annotations

import functools
import math
from typing import Mapping

import torch

from loongforge_hf.kernels._saved import needs_autograd
from loongforge_hf.kernels._triton import use_triton

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` over the last dimension."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` on the first ``cos.shape[-1]`` channels of ``x``; the rest pass through.

    ``cos`` / ``sin`` must broadcast against ``x[..., :rotary_dim]`` (e.g. ``[b, 1, s, d]`` for ``x`` of
    ``[b, heads, s, d]``) and are cast to ``x.dtype`` first, as HF does.
    """
    rotary_dim = cos.shape[-1]
    if rotary_dim % 2 or rotary_dim > x.shape[-1] or sin.shape[-1] != rotary_dim:
        raise ValueError(f"apply_rotary: cos/sin last dims ({cos.shape[-1]}, {sin.shape[-1]}) must be equal, even and "
                         f"at most the input's head dim ({x.shape[-1]}).")
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    if rotary_dim == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    return torch.cat((x_rot * cos + rotate_half(x_rot) * sin, x_pass), dim=-1)


def llama3_scale_inv_freq(inv_freq: torch.Tensor, *, factor: float, low_freq_factor: float, high_freq_factor: float,
                          original_max_position_embeddings: int) -> torch.Tensor:
    """Llama 3.1's frequency-dependent scaling.

    Wavelengths shorter than ``original / high_freq_factor`` keep their frequency, longer than
    ``original / low_freq_factor`` are slowed by ``factor``; in between, the two blend linearly in
    ``original / wavelength``.
    """
    if high_freq_factor <= low_freq_factor:
        raise ValueError(f"llama3 rope scaling needs high_freq_factor > low_freq_factor, got {high_freq_factor} and "
                         f"{low_freq_factor}.")
    context = original_max_position_embeddings
    wavelength = 2 * math.pi / inv_freq
    slowed = inv_freq / factor
    # NOTE: 0 at the long-wavelength edge, 1 at the short one; only used strictly between the two edges.
    blend = (context / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - blend) * slowed + blend * inv_freq
    long = wavelength > context / low_freq_factor
    short = wavelength < context / high_freq_factor
    return torch.where(long, slowed, torch.where(short, inv_freq, blended))


def rope_inv_freq(head_dim: int, *, base: float, partial_rotary_factor: float = 1.0,
                  rope_scaling: Mapping | None = None, device: torch.device | None = None,
                  longrope_long: bool = False) -> torch.Tensor:
    """Inverse frequencies ``[rotary_dim // 2]`` (fp32) for a head of ``head_dim`` channels.

    ``rope_scaling`` is an HF ``rope_scaling`` / ``rope_parameters`` dict (``rope_type`` or legacy ``type``);
    ``longrope_long``: LongRoPE's long factors (transformers' for sequences past ``original_max_position_embeddings``)
    instead of its short ones.
    """
    rotary_dim = int(head_dim * partial_rotary_factor)
    if rotary_dim < 2:
        raise ValueError(f"rope: head_dim={head_dim} x partial_rotary_factor={partial_rotary_factor} leaves no "
                         "channels to rotate.")
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=device).to(torch.float32) / rotary_dim
    inv_freq = 1.0 / (base ** exponents)
    scaling = dict(rope_scaling or {})
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
                   if k not in scaling]
        if missing:
            raise ValueError(f"rope_scaling of type 'llama3' lacks {', '.join(missing)}.")
        return llama3_scale_inv_freq(
            inv_freq, factor=scaling["factor"], low_freq_factor=scaling["low_freq_factor"],
            high_freq_factor=scaling["high_freq_factor"],
            original_max_position_embeddings=scaling["original_max_position_embeddings"])
    if rope_type == "longrope":
        # NOTE: transformers' frequencies up to original_max_position_embeddings (short), past it (long)
        key = "long_factor" if longrope_long else "short_factor"
        factors = torch.tensor(scaling[key], dtype=torch.float32, device=device)
        if factors.shape != inv_freq.shape:
            raise ValueError(f"longrope {key} has {factors.numel()} values, the {rotary_dim} rotary dims need "
                             f"{inv_freq.numel()}.")
        return 1.0 / (factors * base ** exponents)
    if rope_type == "yarn":
        return yarn_inv_freq(base ** exponents, scaling, base=base, rotary_dim=rotary_dim)
    raise ValueError(f"rope_scaling type {rope_type!r} is not supported; "
                     f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}.")


def yarn_inv_freq(pos_freqs: torch.Tensor, scaling: Mapping, *, base: float, rotary_dim: int) -> torch.Tensor:
    """YaRN's frequencies from the plain ones' inverses ``pos_freqs`` (``base ** (2i / dim)``): frequencies that turn
    more than ``beta_fast`` times over ``original_max_position_embeddings`` kept, fewer than ``beta_slow`` times
    divided by ``factor``, a linear ramp over the dims between (bounds floored / ceiled unless ``truncate`` is
    False); transformers' formula."""
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def dim_of(rotations: float) -> float:  # NOTE: the dim whose frequency turns `rotations` times over `original`
        return rotary_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    kept = (1 - ramp).to(pos_freqs.device)
    return 1.0 / (factor * pos_freqs) * (1 - kept) + 1.0 / pos_freqs * kept


def rope_attention_factor(scaling: Mapping, max_position_embeddings: int) -> float:
    """The scale transformers puts on cos and sin: ``attention_factor`` if given; else LongRoPE's
    ``sqrt(1 + ln(factor) / ln(original))`` and YaRN's ``0.1 ln(factor) + 1`` (or its ``mscale`` /
    ``mscale_all_dim`` ratio), ``factor`` defaulting to ``max_position_embeddings / original``, 1 where it is <= 1;
    1 for every other rope type."""
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in ("longrope", "yarn"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_position_embeddings / original
    if rope_type == "longrope":
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    return float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)


def rotary_scale_module(factor: float, rotary_dim: int, norm: type | None = None) -> type:
    """A module for megatron's ``q_layernorm`` / ``k_layernorm`` slots that multiplies each head's first
    ``rotary_dim`` channels by ``factor`` (before the rotary embedding; the rotation is linear, so this is the
    rotation with cos and sin scaled by ``factor``, as transformers applies YaRN's / LongRoPE's attention factor);
    with ``norm`` (the model's q / k norm class), that norm first."""
    base = norm or torch.nn.Module

    class RotaryScale(base):
        def __init__(self, config=None, hidden_size: int = 0, eps: float = 0.0) -> None:
            if norm is None:
                super().__init__()
            else:
                super().__init__(config, hidden_size, eps)
            if not 0 < rotary_dim <= hidden_size:
                raise ValueError(f"RotaryScale: {rotary_dim} rotary dims do not fit a head of {hidden_size}.")
            scale = torch.ones(hidden_size, dtype=torch.float32)
            scale[:rotary_dim] = factor
            self.register_buffer("rotary_scale", scale, persistent=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if norm is not None:
                x = super().forward(x)
            return x * self.rotary_scale.to(device=x.device, dtype=x.dtype)

    return RotaryScale


def rope_cos_sin(inv_freq: torch.Tensor, position_ids: torch.Tensor, *, dtype: torch.dtype = torch.float32,
                 attention_scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos``, ``sin`` of shape ``position_ids.shape + [2 * len(inv_freq)]``, in fp32, then cast to ``dtype``."""
    freqs = position_ids.to(torch.float32)[..., None] * inv_freq.to(device=position_ids.device, dtype=torch.float32)
    angles = torch.cat((freqs, freqs), dim=-1)
    return (angles.cos() * attention_scaling).to(dtype), (angles.sin() * attention_scaling).to(dtype)


def set_megatron_inv_freq(rotary_embedding: torch.nn.Module, inv_freq: torch.Tensor) -> None:
    """Replace the inverse frequencies of megatron's ``RotaryEmbedding`` (e.g. ``GPTModel.rotary_pos_emb``)."""
    current = rotary_embedding.inv_freq
    if current.shape != inv_freq.shape:
        raise ValueError(f"set_megatron_inv_freq: megatron's RotaryEmbedding has {current.numel()} frequencies, got "
                         f"{inv_freq.numel()}; check kv_channels and rotary_percent against head_dim and "
                         "partial_rotary_factor.")
    rotary_embedding.inv_freq = inv_freq.to(device=current.device, dtype=torch.float32)
    # NOTE: RotaryEmbedding.forward is an lru_cache over (module, seq_len, ...): cached embeddings hold the old
    # frequencies, so the cache is dropped.
    cache_clear = getattr(type(rotary_embedding).forward, "cache_clear", None)
    if cache_clear is not None:
        cache_clear()


@functools.cache
def longrope_rotary(base: type) -> type:
    """megatron's rotary embedding with LongRoPE's two sets of frequencies: ``short_inv_freq``, or ``long_inv_freq``
    while ``use_long`` is set (``select_longrope``: transformers uses the long ones for a forward whose positions go
    past ``original_max``). ``decode_table``: a table of every position up to a length for one-token decode steps,
    each row as transformers computes that step (short rows below ``original_max``, long ones from it)."""

    class LongRopeRotary(base):
        use_long = False

        def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None):
            return self._angles(max_seq_len, offset, packed_seq, cp_group, self.use_long)

        @functools.lru_cache(maxsize=32)
        def _angles(self, max_seq_len: int, offset: int, packed_seq: bool, cp_group, use_long: bool):
            self.inv_freq = self.long_inv_freq if use_long else self.short_inv_freq
            return base.forward.__wrapped__(self, max_seq_len, offset, packed_seq, cp_group)

        def decode_table(self, max_seq_len: int, **kwargs) -> torch.Tensor:
            short = self._angles(max_seq_len, 0, kwargs.get("packed_seq", False), kwargs.get("cp_group"), False)
            long = self._angles(max_seq_len, 0, kwargs.get("packed_seq", False), kwargs.get("cp_group"), True)
            return torch.cat((short[:self.original_max], long[self.original_max:]))

    return LongRopeRotary


def make_longrope(rotary_embedding: torch.nn.Module, *, short: torch.Tensor, long: torch.Tensor,
                  original_max: int) -> None:
    """Turn megatron's ``RotaryEmbedding`` into ``longrope_rotary``'s, with these frequencies."""
    set_megatron_inv_freq(rotary_embedding, short)
    rotary_embedding.__class__ = longrope_rotary(type(rotary_embedding))
    device = rotary_embedding.inv_freq.device
    rotary_embedding.short_inv_freq, rotary_embedding.long_inv_freq = short.to(device), long.to(device)
    rotary_embedding.original_max = int(original_max)


def select_longrope(modules, length: int) -> None:
    """Before a forward of ``length`` positions (transformers': the largest position id + 1): the long frequencies in
    ``modules``' LongRoPE rotary embeddings where ``length`` passes their ``original_max``, else the short ones."""
    for module in modules:
        module.use_long = length > module.original_max


class _RotarySBHD(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        from loongforge_hf.kernels import _rope_triton

        ctx.save_for_backward(freqs)
        return _rope_triton.rotate(t, freqs)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        from loongforge_hf.kernels import _rope_triton

        (freqs,) = ctx.saved_tensors
        return _rope_triton.rotate(grad_out, freqs, inverse=True), None


def rotary_sbhd(t: torch.Tensor, freqs: torch.Tensor, transpose_output_memory: bool = False,
                interleaved: bool = False) -> torch.Tensor:
    """megatron's fused-rope slot: ``t [s, b, heads, d]`` rotated by the angles ``freqs [s, 1, 1, rot]`` (rotate-half
    pairs, channels past ``rot`` unchanged)."""
    if interleaved:
        raise ValueError("rotary_sbhd: interleaved rotary pairs are not supported; use rotary_interleaved=False.")
    rot = freqs.shape[-1]
    if (use_triton(t) and t.dim() == 4 and freqs.dim() == 4 and freqs.shape[1:3] == (1, 1)
            and freqs.shape[0] in (1, t.shape[0]) and rot % 2 == 0 and rot <= t.shape[-1]):
        if not needs_autograd(t, freqs):
            from loongforge_hf.kernels import _rope_triton

            return _rope_triton.rotate(t, freqs)
        return _RotarySBHD.apply(t, freqs)
    # NOTE: megatron's unfused numerics (rope_utils._apply_rotary_pos_emb_bshd with mscale 1): cos/sin in fp32, cast.
    return apply_rotary(t, torch.cos(freqs), torch.sin(freqs))


def enable_megatron_fused_rope(config) -> bool:
    """Route megatron's rotary embedding of this config's layers through ``rotary_sbhd`` (or TE's fused rope where TE
    filled the slot). False, changing nothing, for layouts the slot does not serve (MLA, interleaved, mRoPE)."""
    from megatron.core.models.common.embeddings import rope_utils

    if (getattr(config, "multi_latent_attention", False) or getattr(config, "rotary_interleaved", False)
            or getattr(config, "mrope_section", None)):
        return False
    if rope_utils.fused_apply_rotary_pos_emb is None:
        rope_utils.fused_apply_rotary_pos_emb = rotary_sbhd
    config.apply_rope_fusion = True
    return True
