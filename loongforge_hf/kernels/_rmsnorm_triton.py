"""Triton RMSNorm forward and backward with the numerics of ``rmsnorm._RMSNormFunction`` (HF's).

One program normalises whole rows (a row fits one block; short rows such as q/k-norm heads go several to a
program). The backward starts a few programs per SM, each over a contiguous run of rows that it walks in tiles of
several rows (``BWD_TILE`` elements; a q-norm over 16384 tokens x 16 heads of 128, walked one row at a time, left
each load latency-bound). Each program accumulates its share of the weight gradient in an fp32 tile, reduced to one
row at its end, and the per-program partial sums (``[programs, N]`` fp32) are added up by torch afterwards.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loongforge_hf.kernels._triton import row_programs


@triton.jit
def _gamma(W, cols, mask, ZERO_CENTERED: tl.constexpr):
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        w = w + 1.0   # NOTE: Gemma's `1 + weight.float()`, in fp32
    return w


@triton.jit
def _rms_norm_fwd(X, W, Y, RSTD, stride_x, stride_y, M, N, eps, ZERO_CENTERED: tl.constexpr, ROWS: tl.constexpr,
                  BLOCK: tl.constexpr):
    row_ids = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    rows = row_ids[:, None]
    cols = tl.arange(0, BLOCK)[None, :]
    mask = (rows < M) & (cols < N)
    x = tl.load(X + rows * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / N + eps)
    normed = x * rstd[:, None]
    if not ZERO_CENTERED:  # NOTE: Llama's numerics round the normalised input; Gemma's round only the product
        normed = normed.to(X.dtype.element_ty).to(tl.float32)
    y = _gamma(W, cols, cols < N, ZERO_CENTERED) * normed
    tl.store(Y + rows * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + row_ids, rstd, mask=row_ids < M)


@triton.jit
def _rms_norm_bwd(DY, X, W, RSTD, DX, DW, stride_dy, stride_x, stride_dx, M, N, ROWS_PER_PROGRAM: tl.constexpr,
                  ZERO_CENTERED: tl.constexpr, NEED_DX: tl.constexpr, NEED_DW: tl.constexpr, ROWS: tl.constexpr,
                  BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)[None, :]
    col_mask = cols < N
    gamma = _gamma(W, cols, col_mask, ZERO_CENTERED)
    dw = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
    first = pid.to(tl.int64) * ROWS_PER_PROGRAM
    # NOTE: ROWS_PER_PROGRAM is a multiple of ROWS, so the tiles of one program never reach into the next one's.
    for start in range(0, ROWS_PER_PROGRAM, ROWS):
        row_ids = first + start + tl.arange(0, ROWS)
        rows = row_ids[:, None]
        live = col_mask & (rows < M)
        x = tl.load(X + rows * stride_x + cols, mask=live, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows * stride_dy + cols, mask=live, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row_ids, mask=row_ids < M, other=0.0)[:, None]
        normed = x * rstd
        if NEED_DW:
            # NOTE: the forward multiplies by the rounded normalised input, so the weight grad uses it too.
            if ZERO_CENTERED:
                dw += dy * normed
            else:
                dw += dy * normed.to(X.dtype.element_ty).to(tl.float32)
        if NEED_DX:
            grad_normed = dy * gamma
            dot = tl.sum(grad_normed * normed, axis=1)[:, None] / N
            dx = rstd * (grad_normed - normed * dot)
            tl.store(DX + rows * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=live)
    if NEED_DW:
        tl.store(DW + pid * N + cols, tl.sum(dw, axis=0)[None, :], mask=col_mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1]) if t.stride(-1) == 1 else t.contiguous().reshape(-1, t.shape[-1])


# Elements of one backward tile: several short rows (q/k-norm heads) or one long row per loop step, so that each
# step has enough loads in flight; the fp32 weight-grad accumulator is a tile too.
BWD_TILE = 4096


def _block(n: int) -> int:
    return triton.next_power_of_2(n)


def _warps(elements: int) -> int:
    return 4 if elements <= 2048 else 8 if elements <= 8192 else 16


def forward(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered_gamma: bool):
    """(output shaped like ``x`` in ``promote(x, weight)`` dtype, rstd ``[rows]`` fp32)."""
    x2 = _rows(x)
    m, n = x2.shape
    y = torch.empty((m, n), dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    rstd = torch.empty(m, dtype=torch.float32, device=x.device)
    if m:
        block = _block(n)
        rows = max(1, min(16, 2048 // block))
        _rms_norm_fwd[(triton.cdiv(m, rows),)](x2, weight, y, rstd, x2.stride(0), y.stride(0), m, n, eps,
                                               ZERO_CENTERED=zero_centered_gamma, ROWS=rows, BLOCK=block,
                                               num_warps=_warps(rows * block))
    return y.reshape(x.shape), rstd


def backward(grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
             zero_centered_gamma: bool, need_dx: bool, need_dw: bool):
    x2, dy = _rows(x), _rows(grad_out)
    m, n = x2.shape
    block = _block(n)
    tile_rows = max(1, min(64, BWD_TILE // block))
    programs = row_programs(triton.cdiv(max(m, 1), tile_rows), x.device)
    per_program = triton.cdiv(triton.cdiv(max(m, 1), programs), tile_rows) * tile_rows
    programs = triton.cdiv(max(m, 1), per_program)
    dx = torch.empty_like(x2) if need_dx else None
    partial = torch.empty((programs, n), dtype=torch.float32, device=x.device) if need_dw else None
    if m:
        _rms_norm_bwd[(programs,)](dy, x2, weight, rstd, dx if need_dx else x2, partial if need_dw else rstd,
                                   dy.stride(0), x2.stride(0), dx.stride(0) if need_dx else 0, m, n,
                                   ROWS_PER_PROGRAM=per_program, ZERO_CENTERED=zero_centered_gamma,
                                   NEED_DX=need_dx, NEED_DW=need_dw,
                                   ROWS=tile_rows, BLOCK=block, num_warps=_warps(tile_rows * block))
    grad_w = None
    if need_dw:
        grad_w = (partial.sum(0) if m else torch.zeros(n, dtype=torch.float32, device=x.device)).to(weight.dtype)
    return (dx.reshape(x.shape) if need_dx else None), grad_w
