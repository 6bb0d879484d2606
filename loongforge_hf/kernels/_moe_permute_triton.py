"""Triton kernels of ``moe_permute``: every one walks the tokens, reading a token's row of the ``[T, E]`` row map
(the permuted row of each (token, expert) pair, -1 where the token does not go to that expert).

- ``scatter``: token ``t``'s hidden row is written to each of its permuted rows, optionally times the pair's prob
  (fp32 product, one rounding), and the pair's prob copied to the permuted probs: permute's forward, and
  unpermute's backward without probs. Every permuted row has one writer: no atomics.
- ``gather_sum``: token ``t``'s output is the fp32 sum of its permuted rows, optionally times their probs, rounded
  once: unpermute's forward and permute's backward.
- ``scatter_with_prob_grads``: unpermute's backward with probs: the output grad times the prob to each permuted row,
  and the probs' grad, the fp32 dot of the output grad and the permuted row, for each (token, expert) pair (0 where
  the pair is not routed). One program per token walks the whole hidden size, so each dot is one program's sum.
Programs are (token, hidden block) except the last kernel, one per token. The number of experts (and the hidden size
of the last kernel) are compile-time constants: loop bounds Triton's interpreter can run (a runtime bound fails there).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _scatter(X, P, MAP, OUT, OUT_P, H, stride_x, stride_out, E: tl.constexpr,
             SCALE: tl.constexpr, COPY_P: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    cols = hb * BLOCK + tl.arange(0, BLOCK)
    mask = cols < H
    x = tl.load(X + t * stride_x + cols, mask=mask, other=0.0)
    for e in range(0, E):
        r = tl.load(MAP + t * E + e).to(tl.int64)
        if r >= 0:
            if SCALE:
                w = tl.load(P + t * E + e).to(tl.float32)
                tl.store(OUT + r * stride_out + cols, (x.to(tl.float32) * w).to(OUT.dtype.element_ty), mask=mask)
            else:
                tl.store(OUT + r * stride_out + cols, x.to(OUT.dtype.element_ty), mask=mask)
            if COPY_P:
                if hb == 0:
                    tl.store(OUT_P + r, tl.load(P + t * E + e))


@triton.jit
def _gather_sum(X, P, MAP, OUT, H, stride_x, stride_out, E: tl.constexpr, SCALE: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < H
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for e in range(0, E):
        r = tl.load(MAP + t * E + e).to(tl.int64)
        if r >= 0:
            x = tl.load(X + r * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
            if SCALE:
                x = x * tl.load(P + t * E + e).to(tl.float32)
            acc += x
    tl.store(OUT + t * stride_out + cols, acc.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _scatter_with_prob_grads(G, X, P, MAP, GX, GP, stride_g, stride_x, stride_gx, E: tl.constexpr, H: tl.constexpr,
                             BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    for e in range(0, E):
        r = tl.load(MAP + t * E + e).to(tl.int64)
        dot = tl.zeros((BLOCK,), dtype=tl.float32)
        if r >= 0:
            w = tl.load(P + t * E + e).to(tl.float32)
            for h in range(0, H, BLOCK):
                cols = h + tl.arange(0, BLOCK)
                mask = cols < H
                g = tl.load(G + t * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
                x = tl.load(X + r * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
                tl.store(GX + r * stride_gx + cols, (g * w).to(GX.dtype.element_ty), mask=mask)
                dot += g * x
        tl.store(GP + t * E + e, tl.sum(dot, axis=0).to(GP.dtype.element_ty))


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def scatter(x: torch.Tensor, row_map: torch.Tensor, num_rows: int, probs: torch.Tensor | None = None, *,
            scale: bool, copy_probs: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``out[row_map[t, e]] = x[t] (* probs[t, e] if scale)``; with ``copy_probs`` also the probs to their rows."""
    x = _rows(x)
    tokens, hidden = x.shape
    experts = row_map.shape[1]
    out = torch.empty((num_rows, hidden), dtype=x.dtype, device=x.device)
    out_p = torch.empty((num_rows,), dtype=probs.dtype, device=x.device) if copy_probs else None
    p = probs.contiguous() if probs is not None else x
    if tokens and hidden and num_rows:
        _scatter[(tokens, triton.cdiv(hidden, BLOCK))](
            x, p, row_map, out, out_p if out_p is not None else out, hidden, x.stride(0), out.stride(0), E=experts,
            SCALE=scale, COPY_P=copy_probs, BLOCK=BLOCK)
    return out, out_p


def gather_sum(x: torch.Tensor, row_map: torch.Tensor, probs: torch.Tensor | None, out_dtype: torch.dtype
               ) -> torch.Tensor:
    """``out[t] = sum_e x[row_map[t, e]] (* probs[t, e])`` in fp32, rounded once to ``out_dtype``."""
    x = _rows(x)
    tokens, experts = row_map.shape
    hidden = x.shape[1]
    out = torch.empty((tokens, hidden), dtype=out_dtype, device=x.device)
    p = probs.contiguous() if probs is not None else x
    if tokens and hidden:
        _gather_sum[(tokens, triton.cdiv(hidden, BLOCK))](
            x, p, row_map, out, hidden, x.stride(0), out.stride(0), E=experts, SCALE=probs is not None, BLOCK=BLOCK)
    return out


def scatter_with_prob_grads(grad: torch.Tensor, permuted: torch.Tensor, row_map: torch.Tensor, probs: torch.Tensor
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """unpermute's backward with probs: (grad of the permuted rows, grad of probs ``[T, E]``)."""
    grad, permuted = _rows(grad), _rows(permuted)
    tokens, experts = row_map.shape
    hidden = grad.shape[1]
    grad_x = torch.empty_like(permuted)
    grad_p = torch.empty((tokens, experts), dtype=probs.dtype, device=grad.device)
    if tokens:
        block = min(BLOCK, triton.next_power_of_2(max(hidden, 1)))
        _scatter_with_prob_grads[(tokens,)](
            grad, permuted, probs.contiguous(), row_map, grad_x, grad_p, grad.stride(0), permuted.stride(0),
            grad_x.stride(0), E=experts, H=hidden, BLOCK=block)
    return grad_x, grad_p
