"""Triton FP8 (e4m3) quantisation kernels with the numerics of the torch reference in ``fp8.py``.

Every kernel computes ``scale = amax / 448`` (1 for an all-zero group) and ``clamp(x / scale, -448, 448)`` with
IEEE-rounded divisions (``tl.math.div_rn``; Triton's ``/`` is approximate), so fp8 bytes and scales equal the torch
reference bit for bit. A NaN makes its group's amax inf, so the caller's finiteness check still sees it.

Layouts: quantised operands are row-major ``[rows, K]``; 1x128 scales are written K-tile-major (the ``[rows, tiles]``
view has strides (1, rows), as ``scaled_mm`` reads them). The dual kernels read a matrix once per pass and write it
quantised twice, as is and transposed: the transposed tile goes through ``tl.trans`` in registers, so both stores are
row-contiguous (coalesced), never one byte per row.
- ``tiles_dual``: 1x128 tiles of ``x`` and of ``x.T`` from one read of each 128x128 block.
- ``blocks_dual``: 128x128 blocks of ``w`` and of ``w.T`` (the same blocks transposed) from one read.
- ``rows_dual``: one scale per row of ``x`` and per row of ``x.T`` (per column of ``x``). A row's scale needs the
  whole row, so this takes two passes: the first reads ``x`` once for per-tile row and column maxima (reduced by
  torch, a few per cent of the input's size), the second reads it again and writes both layouts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
GROUP = 128


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


@triton.jit
def _tiles_kernel(x_ptr, q_ptr, s_ptr, rows, cols, out_cols, stride_xr, stride_xc, stride_sr, stride_st,
                  BLOCK_R: tl.constexpr, TILE: tl.constexpr, FMAX: tl.constexpr):
    pid_r = tl.program_id(0)
    pid_t = tl.program_id(1)
    r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    c = pid_t * TILE + tl.arange(0, TILE)
    load = (r[:, None] < rows) & (c[None, :] < cols)
    x = tl.load(x_ptr + r[:, None] * stride_xr + c[None, :] * stride_xc, mask=load, other=0.0).to(tl.float32)
    a = tl.where(x == x, tl.abs(x), float("inf"))  # NOTE: a NaN makes the tile's scale inf, caught by _check
    amax = tl.max(a, axis=1)
    # NOTE: the operands are broadcast explicitly because div_rn does not broadcast.
    scale = tl.where(amax == 0, 1.0, tl.math.div_rn(amax, tl.zeros((BLOCK_R,), tl.float32) + FMAX))
    q = tl.clamp(tl.math.div_rn(x, tl.zeros((BLOCK_R, TILE), tl.float32) + scale[:, None]), -FMAX, FMAX)
    store = (r[:, None] < rows) & (c[None, :] < out_cols)
    tl.store(q_ptr + r[:, None] * out_cols + c[None, :], q.to(q_ptr.dtype.element_ty), mask=store)
    tl.store(s_ptr + r * stride_sr + pid_t * stride_st, scale, mask=r < rows)


@triton.jit
def _blocks_kernel(x_ptr, q_ptr, s_ptr, rows, cols, stride_xr, stride_xc, s_cols,
                   BLOCK: tl.constexpr, FMAX: tl.constexpr):
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    r = pid_r * BLOCK + tl.arange(0, BLOCK)
    c = pid_c * BLOCK + tl.arange(0, BLOCK)
    mask = (r[:, None] < rows) & (c[None, :] < cols)
    x = tl.load(x_ptr + r[:, None] * stride_xr + c[None, :] * stride_xc, mask=mask, other=0.0).to(tl.float32)
    a = tl.where(x == x, tl.abs(x), float("inf"))
    amax = tl.max(tl.max(a, axis=1), axis=0)
    scale = tl.where(amax == 0, 1.0, tl.math.div_rn(amax, FMAX))
    q = tl.clamp(tl.math.div_rn(x, tl.zeros((BLOCK, BLOCK), tl.float32) + scale), -FMAX, FMAX)
    tl.store(q_ptr + r[:, None] * cols + c[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + pid_r * s_cols + pid_c, scale)


@triton.jit
def _rows_kernel(x_ptr, q_ptr, s_ptr, rows, cols, out_cols, stride_xr, stride_xc,
                 BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, FMAX: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    amax = tl.zeros((BLOCK_R,), tl.float32)
    for c0 in range(0, cols, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        mask = (r[:, None] < rows) & (c[None, :] < cols)
        x = tl.load(x_ptr + r[:, None] * stride_xr + c[None, :] * stride_xc, mask=mask, other=0.0)
        x = x.to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.where(x == x, tl.abs(x), float("inf")), axis=1))
    scale = tl.where(amax == 0, 1.0, tl.math.div_rn(amax, tl.zeros((BLOCK_R,), tl.float32) + FMAX))
    for c0 in range(0, out_cols, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        load = (r[:, None] < rows) & (c[None, :] < cols)
        x = tl.load(x_ptr + r[:, None] * stride_xr + c[None, :] * stride_xc, mask=load, other=0.0)
        x = x.to(tl.float32)
        q = tl.clamp(tl.math.div_rn(x, tl.zeros((BLOCK_R, BLOCK_C), tl.float32) + scale[:, None]), -FMAX, FMAX)
        store = (r[:, None] < rows) & (c[None, :] < out_cols)
        tl.store(q_ptr + r[:, None] * out_cols + c[None, :], q.to(q_ptr.dtype.element_ty), mask=store)
    tl.store(s_ptr + r, scale, mask=r < rows)


@triton.jit
def _tiles_dual_kernel(x_ptr, q_ptr, s_ptr, qt_ptr, st_ptr, rows, cols, q_rows, qt_cols, stride_xr, stride_xc,
                       TILE: tl.constexpr, FMAX: tl.constexpr):
    # NOTE: one read of a 128x128 block gives both 1x128 tilings: along the row (x's K) and along the column
    # (x^T's K, written transposed).
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    r = pid_r * TILE + tl.arange(0, TILE)
    c = pid_c * TILE + tl.arange(0, TILE)
    rl, cl = r.to(tl.int64), c.to(tl.int64)
    load = (r[:, None] < rows) & (c[None, :] < cols)
    x = tl.load(x_ptr + rl[:, None] * stride_xr + cl[None, :] * stride_xc, mask=load, other=0.0).to(tl.float32)
    a = tl.where(x == x, tl.abs(x), float("inf"))
    zero = tl.zeros((TILE,), tl.float32)
    zeros = tl.zeros((TILE, TILE), tl.float32)
    amax_r = tl.max(a, axis=1)
    s_r = tl.where(amax_r == 0, 1.0, tl.math.div_rn(amax_r, zero + FMAX))
    q = tl.clamp(tl.math.div_rn(x, zeros + s_r[:, None]), -FMAX, FMAX)
    tl.store(q_ptr + rl[:, None] * cols + cl[None, :], q.to(q_ptr.dtype.element_ty),
             mask=(r[:, None] < q_rows) & (c[None, :] < cols))
    tl.store(s_ptr + pid_c * q_rows + r, s_r, mask=r < q_rows)
    amax_c = tl.max(a, axis=0)
    s_c = tl.where(amax_c == 0, 1.0, tl.math.div_rn(amax_c, zero + FMAX))
    # NOTE: transposed in registers, so the store runs along x^T's rows (contiguous bytes), not down its columns.
    qt = tl.trans(tl.clamp(tl.math.div_rn(x, zeros + s_c[None, :]), -FMAX, FMAX).to(qt_ptr.dtype.element_ty))
    tl.store(qt_ptr + cl[:, None] * qt_cols + rl[None, :], qt, mask=(c[:, None] < cols) & (r[None, :] < qt_cols))
    tl.store(st_ptr + pid_r * cols + c, s_c, mask=c < cols)


@triton.jit
def _blocks_dual_kernel(x_ptr, q_ptr, qt_ptr, s_ptr, st_ptr, rows, cols, stride_xr, stride_xc, s_rows, s_cols,
                        BLOCK: tl.constexpr, FMAX: tl.constexpr):
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    r = pid_r * BLOCK + tl.arange(0, BLOCK)
    c = pid_c * BLOCK + tl.arange(0, BLOCK)
    rl, cl = r.to(tl.int64), c.to(tl.int64)
    mask = (r[:, None] < rows) & (c[None, :] < cols)
    x = tl.load(x_ptr + rl[:, None] * stride_xr + cl[None, :] * stride_xc, mask=mask, other=0.0).to(tl.float32)
    a = tl.where(x == x, tl.abs(x), float("inf"))
    amax = tl.max(tl.max(a, axis=1), axis=0)
    scale = tl.where(amax == 0, 1.0, tl.math.div_rn(amax, FMAX))
    q = tl.clamp(tl.math.div_rn(x, tl.zeros((BLOCK, BLOCK), tl.float32) + scale), -FMAX, FMAX)
    q = q.to(q_ptr.dtype.element_ty)
    tl.store(q_ptr + rl[:, None] * cols + cl[None, :], q, mask=mask)
    tl.store(qt_ptr + cl[:, None] * rows + rl[None, :], tl.trans(q), mask=(c[:, None] < cols) & (r[None, :] < rows))
    tl.store(s_ptr + pid_r * s_cols + pid_c, scale)
    tl.store(st_ptr + pid_c * s_rows + pid_r, scale)


@triton.jit
def _amax_partials_kernel(x_ptr, pr_ptr, pc_ptr, rows, cols, q_rows, stride_xr, stride_xc,
                          BLOCK: tl.constexpr):
    # NOTE: per 128x128 tile, the max |x| of each row (written to pr[tile column, row]) and of each column (to
    # pc[tile row, column]); rows from ``rows`` to ``q_rows`` are padding and get 0.
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    r = pid_r * BLOCK + tl.arange(0, BLOCK)
    c = pid_c * BLOCK + tl.arange(0, BLOCK)
    rl, cl = r.to(tl.int64), c.to(tl.int64)
    load = (r[:, None] < rows) & (c[None, :] < cols)
    x = tl.load(x_ptr + rl[:, None] * stride_xr + cl[None, :] * stride_xc, mask=load, other=0.0).to(tl.float32)
    a = tl.where(x == x, tl.abs(x), float("inf"))
    tl.store(pr_ptr + pid_c * q_rows + rl, tl.max(a, axis=1), mask=r < q_rows)
    tl.store(pc_ptr + pid_r * cols + cl, tl.max(a, axis=0), mask=c < cols)


@triton.jit
def _rows_dual_kernel(x_ptr, sr_ptr, sc_ptr, q_ptr, qt_ptr, rows, cols, q_rows, stride_xr, stride_xc,
                      BLOCK: tl.constexpr, FMAX: tl.constexpr):
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    r = pid_r * BLOCK + tl.arange(0, BLOCK)
    c = pid_c * BLOCK + tl.arange(0, BLOCK)
    rl, cl = r.to(tl.int64), c.to(tl.int64)
    load = (r[:, None] < rows) & (c[None, :] < cols)
    x = tl.load(x_ptr + rl[:, None] * stride_xr + cl[None, :] * stride_xc, mask=load, other=0.0).to(tl.float32)
    s_r = tl.load(sr_ptr + r, mask=r < q_rows, other=1.0)
    s_c = tl.load(sc_ptr + c, mask=c < cols, other=1.0)
    zeros = tl.zeros((BLOCK, BLOCK), tl.float32)
    q = tl.clamp(tl.math.div_rn(x, zeros + s_r[:, None]), -FMAX, FMAX)
    tl.store(q_ptr + rl[:, None] * cols + cl[None, :], q.to(q_ptr.dtype.element_ty),
             mask=(r[:, None] < q_rows) & (c[None, :] < cols))
    qt = tl.trans(tl.clamp(tl.math.div_rn(x, zeros + s_c[None, :]), -FMAX, FMAX).to(qt_ptr.dtype.element_ty))
    tl.store(qt_ptr + cl[:, None] * q_rows + rl[None, :], qt, mask=(c[:, None] < cols) & (r[None, :] < q_rows))


def tiles(x: torch.Tensor, out_cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """1x128 tiles of ``x`` (any strides) with K zero-padded to ``out_cols``: (data, K-tile-major scales)."""
    rows, cols = x.shape
    n_tiles = _ceil(out_cols, GROUP)
    q = torch.empty(rows, out_cols, dtype=FP8_DTYPE, device=x.device)
    s = torch.empty(n_tiles, rows, dtype=torch.float32, device=x.device)
    block_r = 32
    _tiles_kernel[(_ceil(rows, block_r), n_tiles)](x, q, s, rows, cols, out_cols, x.stride(0), x.stride(1), 1, rows,
                                                   BLOCK_R=block_r, TILE=GROUP, FMAX=FP8_MAX)
    return q, s.t()


def blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """128x128 blocks of ``w``: (data, scales ``[ceil(rows/128), ceil(cols/128)]``)."""
    rows, cols = w.shape
    q = torch.empty(rows, cols, dtype=FP8_DTYPE, device=w.device)
    s = torch.empty(_ceil(rows, GROUP), _ceil(cols, GROUP), dtype=torch.float32, device=w.device)
    _blocks_kernel[s.shape](w, q, s, rows, cols, w.stride(0), w.stride(1), s.shape[1], BLOCK=GROUP, FMAX=FP8_MAX,
                            num_warps=8)
    return q, s


def rows(x: torch.Tensor, out_cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per row of ``x``, K zero-padded to ``out_cols``: (data, scales ``[rows, 1]``)."""
    n_rows, cols = x.shape
    q = torch.empty(n_rows, out_cols, dtype=FP8_DTYPE, device=x.device)
    s = torch.empty(n_rows, 1, dtype=torch.float32, device=x.device)
    block_r = 16
    _rows_kernel[(_ceil(n_rows, block_r),)](x, q, s, n_rows, cols, out_cols, x.stride(0), x.stride(1),
                                            BLOCK_R=block_r, BLOCK_C=256, FMAX=FP8_MAX)
    return q, s


def tiles_dual(x: torch.Tensor, q_rows: int):
    """1x128 tiles of ``x`` (rows zero-padded to ``q_rows``) and of ``x.T`` (K zero-padded to a multiple of 128):
    (q, scales [q_rows, K/128] K-tile-major, qt, scales [cols, ceil(rows/128)] K-tile-major)."""
    n_rows, cols = x.shape
    qt_cols = _ceil(n_rows, GROUP) * GROUP
    q = torch.empty(q_rows, cols, dtype=FP8_DTYPE, device=x.device)
    s = torch.empty(_ceil(cols, GROUP), q_rows, dtype=torch.float32, device=x.device)
    qt = torch.empty(cols, qt_cols, dtype=FP8_DTYPE, device=x.device)
    st = torch.empty(qt_cols // GROUP, cols, dtype=torch.float32, device=x.device)
    _tiles_dual_kernel[(_ceil(max(q_rows, qt_cols), GROUP), _ceil(cols, GROUP))](
        x, q, s, qt, st, n_rows, cols, q_rows, qt_cols, x.stride(0), x.stride(1), TILE=GROUP, FMAX=FP8_MAX,
        num_warps=8)
    return q, s.t(), qt, st.t()


def blocks_dual(w: torch.Tensor):
    """128x128 blocks of ``w`` and of ``w.T`` from one read: (q, scales, qt, scales of qt)."""
    n_rows, cols = w.shape
    q = torch.empty(n_rows, cols, dtype=FP8_DTYPE, device=w.device)
    qt = torch.empty(cols, n_rows, dtype=FP8_DTYPE, device=w.device)
    nr, nc = _ceil(n_rows, GROUP), _ceil(cols, GROUP)
    s = torch.empty(nr, nc, dtype=torch.float32, device=w.device)
    st = torch.empty(nc, nr, dtype=torch.float32, device=w.device)
    _blocks_dual_kernel[(nr, nc)](w, q, qt, s, st, n_rows, cols, w.stride(0), w.stride(1), nr, nc,
                                  BLOCK=GROUP, FMAX=FP8_MAX, num_warps=8)
    return q, s, qt, st


def rows_dual(x: torch.Tensor, q_rows: int, scales_from_amax):
    """One scale per row of ``x`` (rows zero-padded to ``q_rows``) and per row of ``x.T`` (K zero-padded to
    ``q_rows``): (q [q_rows, cols], scales [q_rows, 1], qt [cols, q_rows], scales [cols, 1]).
    ``scales_from_amax``: the reference's amax -> scale (run by torch on the reduced maxima)."""
    n_rows, cols = x.shape
    grid = (_ceil(q_rows, GROUP), _ceil(cols, GROUP))
    pr = torch.empty(grid[1], q_rows, dtype=torch.float32, device=x.device)
    pc = torch.empty(grid[0], cols, dtype=torch.float32, device=x.device)
    _amax_partials_kernel[grid](x, pr, pc, n_rows, cols, q_rows, x.stride(0), x.stride(1), BLOCK=GROUP, num_warps=8)
    s = scales_from_amax(pr.amax(0))
    st = scales_from_amax(pc.amax(0))
    q = torch.empty(q_rows, cols, dtype=FP8_DTYPE, device=x.device)
    qt = torch.empty(cols, q_rows, dtype=FP8_DTYPE, device=x.device)
    _rows_dual_kernel[grid](x, s, st, q, qt, n_rows, cols, q_rows, x.stride(0), x.stride(1), BLOCK=GROUP,
                            FMAX=FP8_MAX, num_warps=8)
    return q, s[:, None], qt, st[:, None]
