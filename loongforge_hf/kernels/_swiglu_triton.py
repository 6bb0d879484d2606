"""Triton SwiGLU forward and backward with the numerics of ``swiglu._SwiGLUFunction``.

Rows of ``[gate | up]`` (``2F`` wide) are cut into column blocks, one program per (row, block): the forward reads
each element once and writes ``silu(gate) * up``; the backward reads the fc1 output and the output grad once and
writes both halves of the fc1 grad, sigmoid recomputed in fp32.

With ``limit`` (``clamped_glu.clamped_glu``: DeepSeek-V4's / HY-V4's clamped SwiGLU, alpha 1; gpt-oss's clamped GLU,
``gate * sigmoid(alpha * gate)``, alpha 1.702, offset 1): the gate clamped above and up on both sides before them,
``offset`` added to up, with ``clamped_glu._ClampedGLUFunction``'s numerics (the clamped values, ``up + offset`` and
each step of ``gate * sigmoid(alpha * gate)`` rounded to the input dtype as torch's ops round them, NaN kept as
``torch.clamp`` keeps it; a clamped entry gets no gradient, the bound itself does).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _swiglu_fwd(X, Y, stride_x, stride_y, F, limit, offset, alpha, BLOCK: tl.constexpr, CLAMP: tl.constexpr,
                SILU: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < F
    gate = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(X + row * stride_x + F + cols, mask=mask, other=0.0)
    g, u = gate.to(tl.float32), up.to(tl.float32)
    if CLAMP:  # NOTE: the clamped values and up + offset rounded to the input dtype, as the torch ops round them
        g = tl.minimum(g, limit, propagate_nan=tl.PropagateNan.ALL).to(X.dtype.element_ty).to(tl.float32)
        u = tl.maximum(tl.minimum(u, limit, propagate_nan=tl.PropagateNan.ALL), -limit,
                       propagate_nan=tl.PropagateNan.ALL).to(X.dtype.element_ty).to(tl.float32)
        u = (u + offset).to(X.dtype.element_ty).to(tl.float32)
    if SILU:  # NOTE: silu rounds to the input dtype before the product, as F.silu(gate) * up does.
        silu = (g / (1.0 + tl.exp(-g))).to(X.dtype.element_ty)
    else:  # NOTE: gate * sigmoid(alpha * gate), each torch op rounding to the input dtype
        a = (alpha * g).to(X.dtype.element_ty).to(tl.float32)
        sig = (1.0 / (1.0 + tl.exp(-a))).to(X.dtype.element_ty).to(tl.float32)
        silu = (g * sig).to(X.dtype.element_ty)
    y = silu.to(tl.float32) * u
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd(DY, X, DX, stride_dy, stride_x, stride_dx, F, limit, offset, alpha, BLOCK: tl.constexpr,
                CLAMP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < F
    gate = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X + row * stride_x + F + cols, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
    if CLAMP:  # NOTE: in fp32, as the torch backward (its fp32 copy of the fc1 output, not rounded again)
        g = tl.minimum(gate, limit, propagate_nan=tl.PropagateNan.ALL)
        u = tl.maximum(tl.minimum(up, limit, propagate_nan=tl.PropagateNan.ALL), -limit,
                       propagate_nan=tl.PropagateNan.ALL) + offset
    else:
        g, u = gate, up
    sig = 1.0 / (1.0 + tl.exp(-(alpha * g)))
    d_gate = dy * u * sig * (1.0 + alpha * g * (1.0 - sig))
    d_up = dy * g * sig
    if CLAMP:
        d_gate = tl.where(gate <= limit, d_gate, 0.0)
        d_up = tl.where((up >= -limit) & (up <= limit), d_up, 0.0)
    tl.store(DX + row * stride_dx + cols, d_gate.to(DX.dtype.element_ty), mask=mask)
    tl.store(DX + row * stride_dx + F + cols, d_up.to(DX.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1]) if t.stride(-1) == 1 else t.contiguous().reshape(-1, t.shape[-1])


def forward(x: torch.Tensor, limit: float | None = None, offset: float = 0.0, alpha: float = 1.0) -> torch.Tensor:
    if (offset or alpha != 1.0) and limit is None:
        raise ValueError("_swiglu_triton: an offset or alpha is applied with a limit only (clamped_glu's path)")
    x2 = _rows(x)
    m, f = x2.shape[0], x2.shape[1] // 2
    y = torch.empty((m, f), dtype=x.dtype, device=x.device)
    if m and f:
        grid = (m, triton.cdiv(f, BLOCK))
        _swiglu_fwd[grid](x2, y, x2.stride(0), y.stride(0), f, float(limit or 0.0), float(offset), float(alpha),
                          BLOCK=BLOCK, CLAMP=limit is not None, SILU=alpha == 1.0)
    return y.reshape(*x.shape[:-1], f)


def backward(grad_out: torch.Tensor, x: torch.Tensor, limit: float | None = None, offset: float = 0.0,
             alpha: float = 1.0) -> torch.Tensor:
    x2, dy = _rows(x), _rows(grad_out)
    m, f = x2.shape[0], x2.shape[1] // 2
    dx = torch.empty_like(x2)
    if m and f:
        grid = (m, triton.cdiv(f, BLOCK))
        _swiglu_bwd[grid](dy, x2, dx, dy.stride(0), x2.stride(0), dx.stride(0), f, float(limit or 0.0),
                          float(offset), float(alpha), BLOCK=BLOCK, CLAMP=limit is not None)
    return dx.reshape(x.shape)
