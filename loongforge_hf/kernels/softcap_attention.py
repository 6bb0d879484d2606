"""Soft-capped attention (Gemma 2's ``attn_logit_softcapping``) without materialised scores: Triton flash-style
kernels (``_softcap_attention_triton``).

Choices:
- ``cap * tanh(scores / cap)`` is taken per tile from q and k in fp32, in the forward (online softmax: output and the
  rows' log-sum-exp) and again in the backward (dq per query block; dk / dv per key block and query head, summed over
  a grouped-query head's group here): memory is the inputs, outputs and ``[b, h, sq]`` fp32 row statistics, where
  transformers' eager attention (which Gemma 2 needs for its cap: SDPA has none) keeps ``[b, h, sq, skv]`` scores and
  probabilities per layer.
- The masks ``attention.sdpa`` takes: causal with the queries at any offset into the keys (a context-parallel chunk, a
  KV cache's last tokens), megatron's window bounds ``(left, right)``, and megatron's bool mask (True = masked;
  ``[b or 1, 1, sq, skv]``: padding, packed documents) read tile by tile. A row with no allowed key gives zeros, as
  ``attention._materialised``.
- Used (``usable``) where Triton runs (CUDA, or its interpreter) in fp16 / bf16 without dropout or sinks and with
  head sizes up to 256; fp32 keeps transformers' eager math (``attention._materialised``), which the fp32 parity
  tests compare bit-for-bit in summation order.
"""

from __future__ import annotations

import torch

from loongforge_hf.kernels._triton import use_triton

_MAX_HEAD_DIM = 256


def usable(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, *,
           dropout_p: float, rule) -> bool:
    """Whether the kernels serve this ``attention.sdpa`` call under the score ``rule`` (a cap, no sinks)."""
    return (rule is not None and rule.softcap is not None and rule.sinks is None and dropout_p == 0.0
            and use_triton(query) and query.dtype in (torch.float16, torch.bfloat16)
            and key.dtype == value.dtype == query.dtype and query.shape[-1] == key.shape[-1] == value.shape[-1]
            and query.shape[-1] <= _MAX_HEAD_DIM
            and (mask is None or (mask.dtype == torch.bool and mask.dim() == 4 and mask.shape[1] == 1)))


def _blocks(d: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N forward; BLOCK_M, BLOCK_N backward) for head size ``d``: the backward holds dk and dv
    accumulators beside k and v, so its tiles are smaller for wide heads."""
    if d <= 64:
        return 64, 64, 64, 64
    if d <= 128:
        return 64, 64, 64, 32
    return 64, 32, 32, 32


class _SoftcapAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, cap: float, scale: float, causal: bool, q_offset: int, left: int, right: int):
        import triton

        from loongforge_hf.kernels._softcap_attention_triton import _forward

        b, h, sq, d = q.shape
        skv = k.shape[2]
        q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        lse = torch.empty(b, h, sq, dtype=torch.float32, device=q.device)
        m, mstrides = _mask_args(mask, q)
        bm, bn, _, _ = _blocks(d)
        _forward[(triton.cdiv(sq, bm), b * h)](
            q, k, v, m, out, lse, *_strides(q, k, v, out), *mstrides, h, sq, skv, q_offset, scale,
            float(cap), max(left, 0), max(right, 0), **_flags(q, k, d, bm, bn, causal, left, right, mask))
        ctx.save_for_backward(q, k, v, out, lse, *(() if mask is None else (mask,)))
        ctx.args = (scale, float(cap), causal, q_offset, left, right, mask is not None)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        import triton

        from loongforge_hf.kernels._softcap_attention_triton import _backward_dkdv, _backward_dq

        q, k, v, out, lse, *saved = ctx.saved_tensors
        scale, cap, causal, q_offset, left, right, has_mask = ctx.args
        mask = saved[0] if has_mask else None
        b, h, sq, d = q.shape
        hk, skv = k.shape[1], k.shape[2]
        grad_out = grad_out if grad_out.stride() == out.stride() else grad_out.contiguous()
        delta = (grad_out.float() * out.float()).sum(-1)  # NOTE: rowsum(dO * O), [b, h, sq] fp32
        m, mstrides = _mask_args(mask, q)
        _, _, bm, bn = _blocks(d)
        flags = _flags(q, k, d, bm, bn, causal, left, right, mask)
        common = (*_strides(q, k, v, grad_out), *mstrides, h, sq, skv, q_offset, scale, cap, max(left, 0),
                  max(right, 0))
        dk = torch.empty(b, h, skv, d, dtype=torch.float32 if hk != h else k.dtype, device=q.device)
        dv = torch.empty_like(dk)
        _backward_dkdv[(triton.cdiv(skv, bn), b * h)](q, k, v, m, grad_out, lse, delta, dk, dv, *common, **flags)
        dq = torch.empty(b, h, sq, d, dtype=q.dtype, device=q.device)
        _backward_dq[(triton.cdiv(sq, bm), b * h)](q, k, v, m, grad_out, lse, delta, dq, *common, **flags)
        if hk != h:  # NOTE: a grouped-query head's group of query heads share its k / v
            dk = dk.view(b, hk, h // hk, skv, d).sum(2).to(k.dtype)
            dv = dv.view(b, hk, h // hk, skv, d).sum(2).to(v.dtype)
        return dq, dk, dv, None, None, None, None, None, None, None


def _strides(q, k, v, o) -> tuple[int, ...]:
    return (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3])


def _mask_args(mask: torch.Tensor | None, q: torch.Tensor):
    if mask is None:
        return q, (0, 0, 0)
    m = mask.view(torch.uint8)
    return m, (m.stride(0) if m.shape[0] > 1 else 0, m.stride(2), m.stride(3))


def _flags(q, k, d: int, bm: int, bn: int, causal: bool, left: int, right: int, mask) -> dict:
    import triton

    return dict(GROUPS=q.shape[1] // k.shape[1], D=d, BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_M=bm,
                BLOCK_N=bn, SOFTCAP=True, CAUSAL=causal, HAS_LEFT=left >= 0, HAS_RIGHT=right >= 0,
                HAS_MASK=mask is not None, DOT_FP32=not q.is_cuda)


def softcap_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, cap: float, scale: float,
                      causal: bool, q_offset: int, window: tuple[int, int] | None = None,
                      mask: torch.Tensor | None = None) -> torch.Tensor:
    """``query [b, h, sq, d]`` over ``key / value [b, h_kv, skv, d]`` -> ``[b, h, sq, d]``, scores soft-capped at
    ``cap``; query i at key position ``q_offset + i``; ``window`` megatron's ``(left, right)`` (negative: unbounded);
    ``mask`` megatron's bool mask (True = masked)."""
    left, right = window if window is not None else (-1, -1)
    if mask is not None:
        mask = mask.expand(mask.shape[0], 1, query.shape[2], key.shape[2])
    return _SoftcapAttention.apply(query, key, value, mask, cap, scale, causal, q_offset, left, right)
