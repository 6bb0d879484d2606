"""Attention with learned sinks (gpt-oss) on torch's flash-attention kernel: no materialised scores.

Choices:
- A sink is one more logit per query head in the softmax whose value vector is zero, so for a row with log-sum-exp
  ``lse`` over its allowed scores: ``softmax([s, sink])[:-1] @ V = (softmax(s) @ V) * w`` with
  ``w = sigmoid(lse - sink)``. The forward is the flash kernel's output and log-sum-exp (fp32), then that one scale
  per row and head.
- Backward: the flash kernel's own backward, handed the output gradient times ``w`` and the *scaled* output as its
  ``out``. Its row term ``rowsum(dO * out)`` is then ``w^2 rowsum(g * o)``, which is what the sink adds to plain
  attention's ``w rowsum(g * o)``: the lse path contributes ``-w (1 - w) rowsum(g * o)`` times the same softmax
  probabilities. So dq / dk / dv are exact; the sink's gradient is ``-sum over rows of (1 - w) rowsum(g * out)``.
- Always the kernel's variable-length entry (a dense batch is ``b`` sequences of one length): it takes grouped-query
  heads and megatron's window bounds, and its causal rule aligns queries to the end of their keys (a context-parallel
  chunk, a KV cache's last tokens).
- Used (``usable``) on CUDA in fp16 / bf16 without dropout, soft-capping or an explicit mask, head sizes a multiple
  of 8 up to 256; elsewhere ``attention._materialised`` (transformers' eager math).
"""

from __future__ import annotations

import torch

_MAX_HEAD_DIM = 256


def usable(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, dropout_p: float, rule) -> bool:
    """Whether the flash path serves this call under the score ``rule`` (sinks, no soft-cap)."""
    return (rule is not None and rule.sinks is not None and rule.softcap is None and dropout_p == 0.0
            and query.device.type == "cuda" and query.dtype in (torch.float16, torch.bfloat16)
            and key.dtype == value.dtype == query.dtype and query.shape[-1] == key.shape[-1] == value.shape[-1]
            and query.shape[-1] % 8 == 0 and query.shape[-1] <= _MAX_HEAD_DIM
            and hasattr(torch.ops.aten, "_flash_attention_forward"))


class _SinkFlash(torch.autograd.Function):
    """Packed ``q [t, h, d]``, ``k / v [t_kv, h_kv, d]``, cumulative lengths; ``sinks [h]`` -> ``[t, h, d]``."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, cu_q, cu_k, max_q: int, max_k: int, causal: bool, scale: float, left: int,
                right: int):
        out, lse, rng_state, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale, window_size_left=left,
            window_size_right=right)
        lse = lse.reshape(q.shape[1], -1)[:, :q.shape[0]]  # NOTE: [h, t]
        w = torch.sigmoid(lse - sinks.float()[:, None]).t().unsqueeze(-1)  # NOTE: [t, h, 1]
        scaled = (out.float() * w).to(q.dtype)
        ctx.save_for_backward(q, k, v, scaled, lse, w, cu_q, cu_k, rng_state, unused)
        ctx.args = (max_q, max_k, causal, scale, left, right, sinks.dtype)
        return scaled

    @staticmethod
    def backward(ctx, grad):
        q, k, v, scaled, lse, w, cu_q, cu_k, rng_state, unused = ctx.saved_tensors
        max_q, max_k, causal, scale, left, right, sink_dtype = ctx.args
        grad = grad.contiguous()
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            (grad.float() * w).to(grad.dtype), q, k, v, scaled, lse.contiguous(), cu_q, cu_k, max_q, max_k, 0.0,
            causal, rng_state, unused, scale=scale, window_size_left=left, window_size_right=right)
        rows = (grad.float() * scaled.float()).sum(-1, keepdim=True)  # NOTE: rowsum(g * out), [t, h, 1]
        dsinks = -((1.0 - w) * rows).sum(dim=(0, 2)).to(sink_dtype)
        return dq, dk, dv, dsinks, None, None, None, None, None, None, None, None


def _sink_tensor(sinks, heads: int, device) -> torch.Tensor:
    if isinstance(sinks, torch.Tensor):
        return sinks
    return torch.full((heads,), float(sinks), device=device)


def _bounds(window, causal: bool) -> tuple[int, int]:
    left, right = window if window is not None else (-1, -1)
    return left, (0 if causal else right)


def dense(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, sinks, causal: bool, scale: float,
          window) -> torch.Tensor:
    """``query [b, h, sq, d]`` over ``key / value [b, h_kv, skv, d]`` (queries the last ``sq`` keys) -> ``[b, h, sq,
    d]``."""
    b, h, sq, d = query.shape
    skv = key.shape[-2]
    flat = lambda x: x.transpose(1, 2).reshape(-1, x.shape[1], d)  # noqa: E731 - [b, h, s, d] -> [b s, h, d]
    cu_q = torch.arange(0, (b + 1) * sq, sq, device=query.device, dtype=torch.int32)
    cu_k = torch.arange(0, (b + 1) * skv, skv, device=query.device, dtype=torch.int32)
    left, right = _bounds(window, causal)
    out = _SinkFlash.apply(flat(query), flat(key), flat(value), _sink_tensor(sinks, h, query.device), cu_q, cu_k, sq,
                           skv, causal, scale, left, right)
    return out.reshape(b, sq, h, d).transpose(1, 2)


def packed(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
           max_q: int, max_k: int, *, sinks, causal: bool, scale: float, window) -> torch.Tensor:
    """Packed documents ``query [t, h, d]``, ``key / value [t_kv, h_kv, d]`` -> ``[t, h, d]``."""
    left, right = _bounds(window, causal)
    return _SinkFlash.apply(query, key, value, _sink_tensor(sinks, query.shape[1], query.device),
                            cu_q.to(torch.int32), cu_k.to(torch.int32), max_q, max_k, causal, scale, left, right)
