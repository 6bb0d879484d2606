"""Triton RMSNorm forward and backward with the numerics of ``rmsnorm._RMSNormFunction`` (HF's).

One program normalises whole rows (a row fits one block; short rows such as q/k-norm heads go several to a
program). The backward starts a few programs per SM, each over a contiguous run of rows that it walks in tiles of
several rows (a q-norm over 16384 tokens x 16 heads of 128, walked one row at a time, left each load latency-bound).
Each program waits for its tile's loads, then reduces and stores, so the SM needs several programs resident to keep
loads in flight; their registers decide how many fit (``bwd_config``). Each program accumulates its share of the
weight gradient in an fp32 tile, reduced to one row at its end, and the per-program partial sums (``[programs, N]``
fp32) are added up by torch afterwards.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loongforge_hf.kernels._triton import row_programs


@triton.jit
def _gamma(W, cols, mask, ZERO_CENTERED: tl.constexpr):
    w = tl.load(W + cols, mask=mask, other=0.0)
    if ZERO_CENTERED:
        w = (w.to(tl.float32) + 1.0).to(W.dtype.element_ty)   # NOTE: `weight + 1` rounds in the weight dtype
    return w.to(tl.float32)


@triton.jit
def _offset(rows, INNER, stride_o, stride_i):
    # NOTE: row r of a [outer, INNER, N] view (q/k heads split off a fused projection) is at (r // INNER, r % INNER);
    # INNER == 1 (rows of one stride) is specialised by Triton, so the division folds away.
    return (rows // INNER) * stride_o + (rows % INNER) * stride_i


@triton.jit
def _rms_norm_fwd(X, W, Y, RSTD, INNER, stride_xo, stride_xi, stride_y, M, N, eps, ZERO_CENTERED: tl.constexpr,
                  ROWS: tl.constexpr, BLOCK: tl.constexpr):
    row_ids = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    rows = row_ids[:, None]
    cols = tl.arange(0, BLOCK)[None, :]
    mask = (rows < M) & (cols < N)
    x = tl.load(X + _offset(rows, INNER, stride_xo, stride_xi) + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / N + eps)
    normed = (x * rstd[:, None]).to(X.dtype.element_ty).to(tl.float32)
    y = _gamma(W, cols, cols < N, ZERO_CENTERED) * normed
    tl.store(Y + rows * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + row_ids, rstd, mask=row_ids < M)


@triton.jit
def _rms_norm_bwd(DY, X, W, RSTD, DX, DW, INNER, stride_dyo, stride_dyi, stride_xo, stride_xi, stride_dx, M, N,
                  ROWS_PER_PROGRAM: tl.constexpr,
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
        x = tl.load(X + _offset(rows, INNER, stride_xo, stride_xi) + cols, mask=live, other=0.0).to(tl.float32)
        dy = tl.load(DY + _offset(rows, INNER, stride_dyo, stride_dyi) + cols, mask=live, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row_ids, mask=row_ids < M, other=0.0)[:, None]
        normed = x * rstd
        if NEED_DW:
            # NOTE: the forward multiplies by the rounded normalised input, so the weight grad uses it too.
            dw += dy * normed.to(X.dtype.element_ty).to(tl.float32)
        if NEED_DX:
            grad_normed = dy * gamma
            dot = tl.sum(grad_normed * normed, axis=1)[:, None] / N
            dx = rstd * (grad_normed - normed * dot)
            tl.store(DX + rows * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=live)
    if NEED_DW:
        tl.store(DW + pid * N + cols, tl.sum(dw, axis=0)[None, :], mask=col_mask)


def _row_layout(t: torch.Tensor, inner: int | None = None) -> tuple[torch.Tensor, int, int, int, int]:
    """``t`` as rows of its last dim without a copy where its strides allow: (tensor, rows, inner, outer stride,
    inner stride), row ``r`` at ``(r // inner) * outer + (r % inner) * inner_stride``. Rows of one stride give
    ``inner == 1``; a strided view of heads (``[s, b, heads, d]`` split off a fused QKV output, which ``reshape``
    would copy) gives ``inner == heads``. ``inner`` given: that grouping (a contiguous copy where ``t`` has none)."""
    n = t.shape[-1]
    m = t.numel() // n if n else 0
    if t.stride(-1) == 1 and m:
        if inner is None:
            try:
                v = t.view(m, n)
                return v, m, 1, v.stride(0), 0
            except RuntimeError:
                inner = t.shape[-2] if t.dim() >= 3 else None
        if inner is not None:
            try:
                v = t.view(m // inner, inner, n)
                return v, m, inner, v.stride(0), v.stride(1)
            except RuntimeError:
                pass
    inner = inner or 1
    return t.contiguous(), m, inner, inner * n, n


# The backward's tiles, warps and programs per SM, from the register counts ptxas reports for sm_90 (bf16, dx and
# dw): 4096-element tiles of 8 warps needed 128 (rows of 1024) and 208 (rows of 128) registers a thread, so only one
# or two programs (8-16 warps) were resident per SM and each spent its reduction and stores with no loads in flight.
# Long rows: tiles of 2048 elements or one row, 8 elements a thread (~64 registers): 4 programs of 8 warps per SM
# resident (rows up to 2048), started as many as fit (the weight grad's fp32 partial rows, [programs, N], grow with
# the program count). Short rows (q/k heads): 1024-element tiles of 2 warps (~120 registers): 8 programs per SM, 8
# started (partial rows of 128 are small). Not timed here (no GPU): scripts/bench_kernels.py measures it.
def bwd_config(n: int) -> dict:
    """Tile rows, warps and programs per SM of the backward over rows of ``n`` (pure arithmetic)."""
    block = _block(n)
    long_rows = block >= 512
    tile_rows = max(1, min(64, (2048 if long_rows else 1024) // block))
    warps = min(16, tile_rows * block // 256) if long_rows else 2
    # NOTE: 64 registers a thread at 8 elements a thread: 8192 elements' worth of tiles fit an SM (rows of 4096: 16
    # warps, two programs)
    per_sm = max(1, 8192 // (tile_rows * block)) if long_rows else 8
    return {"tile_rows": tile_rows, "num_warps": warps, "programs_per_sm": per_sm}


def _block(n: int) -> int:
    return triton.next_power_of_2(n)


def _warps(elements: int) -> int:
    return 4 if elements <= 2048 else 8 if elements <= 8192 else 16


def forward(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered_gamma: bool):
    """(output shaped like ``x`` in ``promote(x, weight)`` dtype, rstd ``[rows]`` fp32)."""
    x2, m, inner, stride_o, stride_i = _row_layout(x)
    n = x.shape[-1]
    y = torch.empty((m, n), dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    rstd = torch.empty(m, dtype=torch.float32, device=x.device)
    if m:
        block = _block(n)
        rows = max(1, min(16, 2048 // block))
        _rms_norm_fwd[(triton.cdiv(m, rows),)](x2, weight, y, rstd, inner, stride_o, stride_i, y.stride(0), m, n, eps,
                                               ZERO_CENTERED=zero_centered_gamma, ROWS=rows, BLOCK=block,
                                               num_warps=_warps(rows * block))
    return y.reshape(x.shape), rstd


def backward(grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
             zero_centered_gamma: bool, need_dx: bool, need_dw: bool):
    x2, m, inner, stride_xo, stride_xi = _row_layout(x)
    dy, _, _, stride_dyo, stride_dyi = _row_layout(grad_out, inner)
    n = x.shape[-1]
    block = _block(n)
    config = bwd_config(n)
    tile_rows = config["tile_rows"]
    tiles = triton.cdiv(max(m, 1), tile_rows)
    # NOTE: row_programs starts 4 per SM (a few on the interpreter), scaled to the config's programs per SM
    programs = max(1, min(tiles, row_programs(tiles, x.device) * config["programs_per_sm"] // 4))
    per_program = triton.cdiv(triton.cdiv(max(m, 1), programs), tile_rows) * tile_rows
    programs = triton.cdiv(max(m, 1), per_program)
    dx = torch.empty((m, n), dtype=x.dtype, device=x.device) if need_dx else None
    partial = torch.empty((programs, n), dtype=torch.float32, device=x.device) if need_dw else None
    if m:
        _rms_norm_bwd[(programs,)](dy, x2, weight, rstd, dx if need_dx else x2, partial if need_dw else rstd,
                                   inner, stride_dyo, stride_dyi, stride_xo, stride_xi, n, m, n,
                                   ROWS_PER_PROGRAM=per_program, ZERO_CENTERED=zero_centered_gamma,
                                   NEED_DX=need_dx, NEED_DW=need_dw,
                                   ROWS=tile_rows, BLOCK=block, num_warps=config["num_warps"])
    grad_w = None
    if need_dw:
        grad_w = (partial.sum(0) if m else torch.zeros(n, dtype=torch.float32, device=x.device)).to(weight.dtype)
    return (dx.reshape(x.shape) if need_dx else None), grad_w
