"""Triton SwiGLU forward and backward with the numerics of ``swiglu._SwiGLUFunction``.

Rows of ``[gate | up]`` (``2F`` wide) are cut into column blocks, one program per (row, block): the forward reads
each element once and writes ``silu(gate) * up``; the backward reads the fc1 output and the output grad once and
writes both halves of the fc1 grad, sigmoid recomputed in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _swiglu_fwd(X, Y, stride_x, stride_y, F, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < F
    gate = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(X + row * stride_x + F + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    # NOTE: silu rounds to the input dtype before the product, as F.silu(gate) * up does.
    silu = (g / (1.0 + tl.exp(-g))).to(X.dtype.element_ty)
    y = silu.to(tl.float32) * up.to(tl.float32)
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd(DY, X, DX, stride_dy, stride_x, stride_dx, F, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < F
    g = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X + row * stride_x + F + cols, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-g))
    d_gate = dy * up * sig * (1.0 + g * (1.0 - sig))
    d_up = dy * g * sig
    tl.store(DX + row * stride_dx + cols, d_gate.to(DX.dtype.element_ty), mask=mask)
    tl.store(DX + row * stride_dx + F + cols, d_up.to(DX.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1]) if t.stride(-1) == 1 else t.contiguous().reshape(-1, t.shape[-1])


def forward(x: torch.Tensor) -> torch.Tensor:
    x2 = _rows(x)
    m, f = x2.shape[0], x2.shape[1] // 2
    y = torch.empty((m, f), dtype=x.dtype, device=x.device)
    if m and f:
        _swiglu_fwd[(m, triton.cdiv(f, BLOCK))](x2, y, x2.stride(0), y.stride(0), f, BLOCK=BLOCK)
    return y.reshape(*x.shape[:-1], f)


def backward(grad_out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    x2, dy = _rows(x), _rows(grad_out)
    m, f = x2.shape[0], x2.shape[1] // 2
    dx = torch.empty_like(x2)
    if m and f:
        _swiglu_bwd[(m, triton.cdiv(f, BLOCK))](dy, x2, dx, dy.stride(0), x2.stride(0), dx.stride(0), f, BLOCK=BLOCK)
    return dx.reshape(x.shape)
