"""FP8 (e4m3) quantisation and scaled GEMMs: the numeric core of FP8 training, without Transformer Engine.

Choices:
- One format, ``float8_e4m3fn`` (largest finite value 448), for activations, weights and gradients alike.
- Scales are decoding factors in fp32: ``x ~= q * scale``, ``scale = amax / 448`` over a scaling group (an all-zero
  group gets scale 1). Quantising multiplies by the scale's reciprocal (one correctly rounded ``1 / scale`` per
  group, as Transformer Engine's ``scale`` / ``scale_inv`` pair) and clamps to +-448, so nothing overflows to NaN.
  NOTE: not ``x / scale`` element by element: a correctly rounded fp32 division per element made the Triton
  quantisation kernels compute-bound on an H100 (~2 TB/s); the product is within one fp32 ulp of the quotient
  before the rounding to e4m3.
- Three scaling groups, named by how the operand is cut along its contraction dimension K:
  ``tiles`` (1x128: one scale per row and 128 consecutive K values, activations and gradients), ``blocks``
  (128x128: weights, as DeepSeek-V3 stores them) and ``rows`` (one scale per row, the row-wise fallback). A partial
  last tile or block is scaled by its own amax (the missing values count as zeros).
- A quantised operand (``Quantized``) is always ``[rows, K]`` row-major with K the contraction dimension, so
  ``scaled_matmul(a, b)`` computes ``a @ b.T`` whatever the recipe; the GEMM's column-major second operand is then a
  free ``.t()`` view.
- GEMMs go through ``torch.nn.functional.scaled_mm`` (``BlockWise1x128`` x ``BlockWise128x128`` or
  ``BlockWise1x128`` x ``BlockWise1x128``) or, row-wise, ``torch._scaled_mm``; output bf16. Block-wise scaling
  needs a CUDA build of torch that implements it on the GPU in use (cuBLAS on SM90+); ``blockwise_supported`` probes
  that once, checking the result against the dequantised product. Off CUDA, row-wise runs torch's CPU kernel and
  block-wise is emulated (dequantise, fp32 matmul): the same numbers up to accumulation order, so the recipes are
  testable on CPU.
- Non-finite values cannot be scaled: ``check_finite=True`` (the default of the public functions) raises
  ``Fp8Error`` naming the operand. It costs a device sync, so the training path (``fp8_linear``) turns it off: there a
  NaN/inf input gives a NaN output, which the loss check of the training loop reports.
- On CUDA, tiles, blocks and rows are quantised by Triton kernels (one read, one fp8 write, scales written in the
  layout the GEMM wants; rows read twice); the torch expressions below are the reference and the path elsewhere,
  and wherever the package's Triton switch is off (``kernels._triton.use_triton``: ``LOONGFORGE_TRITON=0``).
"""

from __future__ import annotations

import contextlib
import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F

from loongforge_hf.kernels._triton import use_triton

try:  # NOTE: triton is optional; without it (or off CUDA) the torch path quantises.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
GROUP = 128
KINDS = ("tiles", "blocks", "rows")


class Fp8Error(ValueError):
    """A tensor that cannot be quantised to FP8 (inf/NaN) or a GEMM the FP8 path cannot run; the message says which."""


class Quantized(NamedTuple):
    """An FP8 operand ``[rows, K]`` (row-major, K the contraction dimension) and its fp32 decoding scales:
    tiles ``[rows, ceil(K/128)]``, blocks ``[ceil(rows/128), ceil(K/128)]``, rows ``[rows, 1]``."""
    data: torch.Tensor
    scale: torch.Tensor
    kind: str


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


ROW_ALIGN = 16


def padded_rows(m: int) -> int:
    """The GEMM's M for ``m`` tokens: rounded up to ``ROW_ALIGN`` (cuBLAS's FP8 kernels want M, and the leading
    dimension of 1x128 scales, aligned; an expert's token count is anything, 1 or 17 included)."""
    return _ceil(m, ROW_ALIGN) * ROW_ALIGN


def _pad_rows(x: torch.Tensor, multiple: int = ROW_ALIGN) -> torch.Tensor:
    """``x`` with zero rows appended up to a multiple of ``multiple`` (``padded_rows`` by default; the same tensor
    where nothing is missing)."""
    extra = _ceil(x.shape[0], multiple) * multiple - x.shape[0]
    return F.pad(x, (0, 0, 0, extra)) if extra else x


def scales_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """Decoding scales ``amax / 448`` (fp32); 1 where a group is all zeros; NaN/inf stay as they are."""
    amax = amax.float()
    return torch.where(amax == 0, torch.ones_like(amax), amax / FP8_MAX)


def cast_to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x * (1 / scale)`` saturated to +-448 and rounded to e4m3 (``scale`` broadcasts against ``x``)."""
    return (x.float() * (1.0 / scale.float())).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def _check(scale: torch.Tensor, what: str) -> None:
    if not bool(torch.isfinite(scale).all()):
        raise Fp8Error(f"{what}: the tensor holds inf or NaN values, which FP8 cannot scale.")


# ---- Triton kernels -------------------------------------------------------------------------------------------------
if triton is not None:
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
        # NOTE: IEEE-rounded divisions (``/`` is an approximate one in Triton), one per tile, so results equal torch's
        # bit for bit; the operands are broadcast explicitly because div_rn does not broadcast.
        scale = tl.where(amax == 0, 1.0, tl.math.div_rn(amax, tl.zeros((BLOCK_R,), tl.float32) + FMAX))
        inv = tl.math.div_rn(tl.zeros((BLOCK_R,), tl.float32) + 1.0, scale)
        q = tl.clamp(x * inv[:, None], -FMAX, FMAX)
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
        q = tl.clamp(x * tl.math.div_rn(tl.full((), 1.0, tl.float32), scale), -FMAX, FMAX)
        tl.store(q_ptr + r[:, None] * cols + c[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(s_ptr + pid_r * s_cols + pid_c, scale)

    @triton.jit
    def _rows_kernel(x_ptr, q_ptr, s_ptr, dst_ptr, rows, cols, out_cols, stride_xb, stride_xr, stride_xc,
                     SCATTER: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, FMAX: tl.constexpr):
        """One scale per row of batch ``program_id(1)`` of ``x`` (columns past ``cols`` up to ``out_cols`` written
        as zeros); row ``r`` goes to output row ``dst[r]`` (``SCATTER``: the grouped experts' padded layout) or
        ``batch * rows + r``."""
        b = tl.program_id(1)
        r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        live = r < rows
        base = x_ptr + b * stride_xb + r[:, None] * stride_xr
        amax = tl.zeros((BLOCK_R,), tl.float32)
        for c0 in range(0, cols, BLOCK_C):
            c = c0 + tl.arange(0, BLOCK_C)
            x = tl.load(base + c[None, :] * stride_xc, mask=live[:, None] & (c[None, :] < cols), other=0.0)
            x = x.to(tl.float32)
            amax = tl.maximum(amax, tl.max(tl.where(x == x, tl.abs(x), float("inf")), axis=1))
        scale = tl.where(amax == 0, 1.0, tl.math.div_rn(amax, tl.zeros((BLOCK_R,), tl.float32) + FMAX))
        inv = tl.math.div_rn(tl.zeros((BLOCK_R,), tl.float32) + 1.0, scale)
        if SCATTER:
            out = tl.load(dst_ptr + r, mask=live, other=0)
        else:
            out = b * rows + r
        for c0 in range(0, out_cols, BLOCK_C):
            c = c0 + tl.arange(0, BLOCK_C)
            x = tl.load(base + c[None, :] * stride_xc, mask=live[:, None] & (c[None, :] < cols), other=0.0)
            q = tl.clamp(x.to(tl.float32) * inv[:, None], -FMAX, FMAX)
            tl.store(q_ptr + out[:, None] * out_cols + c[None, :], q.to(q_ptr.dtype.element_ty),
                     mask=live[:, None] & (c[None, :] < out_cols))
        tl.store(s_ptr + out, scale, mask=live)


def rows_into_triton(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, dst: torch.Tensor | None = None) -> None:
    """``x`` ``[B, R, C]`` (any strides) quantised with one scale per row into ``q`` ``[*, C']`` (``C' >= C``, the
    rest zero) and ``s``: row ``r`` of batch ``b`` at ``dst[r]`` where given (B = 1), else at ``b * R + r``. ``q``'s
    dtype is the kernel's output type (FP8 in training; fp32 lets the interpreter's tests round with torch)."""
    batch, rows, cols = x.shape
    if not (batch and rows and cols):
        return
    block_r = 16
    _rows_kernel[(_ceil(rows, block_r), batch)](
        x, q, s, dst if dst is not None else s, rows, cols, q.shape[-1], x.stride(0), x.stride(1), x.stride(2),
        SCATTER=dst is not None, BLOCK_R=block_r, BLOCK_C=256, FMAX=FP8_MAX)


def _rows_triton(x: torch.Tensor, out_cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    q = torch.empty(x.shape[0], out_cols, dtype=FP8_DTYPE, device=x.device)
    s = torch.empty(x.shape[0], 1, dtype=torch.float32, device=x.device)
    rows_into_triton(x[None], q, s)
    return q, s


def _tiles_triton(x: torch.Tensor, out_cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = x.shape
    tiles = _ceil(out_cols, GROUP)
    q = torch.empty(rows, out_cols, dtype=FP8_DTYPE, device=x.device)
    # NOTE: scales are written K-tile-major, i.e. the ``[rows, tiles]`` view has strides (1, rows): the layout
    # scaled_mm wants for a 1x128-scaled operand, with no copy afterwards.
    s = torch.empty(tiles, rows, dtype=torch.float32, device=x.device)
    block_r = 32
    _tiles_kernel[(_ceil(rows, block_r), tiles)](x, q, s, rows, cols, out_cols, x.stride(0), x.stride(1), 1, rows,
                                                 BLOCK_R=block_r, TILE=GROUP, FMAX=FP8_MAX)
    return q, s.t()


def _blocks_triton(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = w.shape
    q = torch.empty(rows, cols, dtype=FP8_DTYPE, device=w.device)
    s = torch.empty(_ceil(rows, GROUP), _ceil(cols, GROUP), dtype=torch.float32, device=w.device)
    _blocks_kernel[s.shape](w, q, s, rows, cols, w.stride(0), w.stride(1), s.shape[1], BLOCK=GROUP, FMAX=FP8_MAX,
                            num_warps=8)
    return q, s


# ---- quantisation ---------------------------------------------------------------------------------------------------
def _as_matrix(x: torch.Tensor, fn: str) -> None:
    if x.dim() != 2:
        raise Fp8Error(f"{fn}: expects a 2-D tensor [rows, K], got shape {tuple(x.shape)}.")
    if not x.is_floating_point() or x.dtype == FP8_DTYPE:
        raise Fp8Error(f"{fn}: expects a floating-point tensor to quantise, got {x.dtype}.")


def quantize_tiles(x: torch.Tensor, *, pad_to: int = 1, check_finite: bool = True) -> Quantized:
    """1x128 scaling along the last dimension of 2-D ``x`` (any strides: a transposed view is read as is).
    ``pad_to`` rounds K up with zeros (a GEMM contracting over K wants a multiple of 128)."""
    _as_matrix(x, "quantize_tiles")
    rows, cols = x.shape
    out_cols = _ceil(cols, pad_to) * pad_to
    if use_triton(x) and rows and cols:
        q, s = _tiles_triton(x, out_cols)
    else:
        tiles = _ceil(out_cols, GROUP)
        xp = F.pad(x.float(), (0, tiles * GROUP - cols)).view(rows, tiles, GROUP)
        s = scales_from_amax(xp.abs().amax(-1))
        q = cast_to_fp8(xp, s[..., None]).view(rows, tiles * GROUP)[:, :out_cols].contiguous()
    if check_finite:
        _check(s, "quantize_tiles")
    return Quantized(q, s, "tiles")


def quantize_blocks(w: torch.Tensor, *, check_finite: bool = True) -> Quantized:
    """128x128 block scaling of 2-D ``w`` (a weight ``[out, in]``)."""
    _as_matrix(w, "quantize_blocks")
    rows, cols = w.shape
    if use_triton(w) and rows and cols:
        q, s = _blocks_triton(w)
    else:
        nr, nc = _ceil(rows, GROUP), _ceil(cols, GROUP)
        wp = F.pad(w.float(), (0, nc * GROUP - cols, 0, nr * GROUP - rows)).view(nr, GROUP, nc, GROUP)
        s = scales_from_amax(wp.abs().amax(dim=(1, 3)))
        q = cast_to_fp8(wp, s[:, None, :, None]).view(nr * GROUP, nc * GROUP)[:rows, :cols].contiguous()
    if check_finite:
        _check(s, "quantize_blocks")
    return Quantized(q, s, "blocks")


def quantize_rows(x: torch.Tensor, *, pad_to: int = 1, check_finite: bool = True) -> Quantized:
    """One scale per row of 2-D ``x``; ``pad_to`` rounds the last dimension up with zeros."""
    _as_matrix(x, "quantize_rows")
    rows, cols = x.shape
    out_cols = _ceil(cols, pad_to) * pad_to
    if use_triton(x) and rows and cols:
        q, s = _rows_triton(x, out_cols)
    else:
        xf = F.pad(x.float(), (0, out_cols - cols))
        s = scales_from_amax(xf.abs().amax(-1, keepdim=True)) if cols else torch.ones(rows, 1, device=x.device)
        q = cast_to_fp8(xf, s)
    if check_finite:
        _check(s, "quantize_rows")
    return Quantized(q, s, "rows")


def quantize(x: torch.Tensor, kind: str, *, pad_to: int = 1, check_finite: bool = True) -> Quantized:
    if kind == "tiles":
        return quantize_tiles(x, pad_to=pad_to, check_finite=check_finite)
    if kind == "rows":
        return quantize_rows(x, pad_to=pad_to, check_finite=check_finite)
    if kind == "blocks":
        return quantize_blocks(x, check_finite=check_finite)
    raise Fp8Error(f"quantize: unknown scaling {kind!r}; use one of {KINDS}.")


def quantize_blocks_dual(w: torch.Tensor) -> tuple[Quantized, Quantized]:
    """128x128 block scaling of 2-D ``w`` ``[N, K]`` and of its transpose ``[K, N]`` (the forward's and the input
    gradient's operand; blocks are square, so the second is the first transposed). No finiteness check (the
    training path's use).

    NOTE: two passes over ``w`` (the second reads it through the transposed view) measured faster on an H100 than
    one pass that stores a transposed copy of each block, and than an fp8 ``.t().contiguous()``
    (scripts/bench_fp8_linear.py, docs/fp8.md)."""
    _as_matrix(w, "quantize_blocks_dual")
    return quantize_blocks(w, check_finite=False), quantize_blocks(w.t(), check_finite=False)


def quantize_transposed(x: torch.Tensor, kind: str) -> Quantized:
    """``x.T`` ``[K, M']`` of an activation or output gradient ``x`` ``[M, K]``, quantised as a weight-gradient GEMM
    takes it (it contracts over the tokens M): 1x128 tiles or 128x128 blocks with the tokens zero-padded to a multiple
    of 128, or one scale per row with them padded to 16. No finiteness check (the training path's use)."""
    if kind == "blocks":  # NOTE: 128x128 blocks have no pad_to: the tokens are padded before
        return quantize_blocks(_pad_rows(x, GROUP).t(), check_finite=False)
    return quantize(x.t(), kind, pad_to=ROW_ALIGN if kind == "rows" else GROUP, check_finite=False)


def quantize_operands(x: torch.Tensor, col_kind: str = "tiles") -> tuple[Quantized, Quantized]:
    """Both FP8 operands of an activation or output gradient ``x`` ``[M, K]`` (no finiteness check: the training
    path's use): its 1x128 tiles with rows zero-padded to ``padded_rows(M)`` (the forward's or the input gradient's
    GEMM) and ``quantize_transposed(x, col_kind)``, ``col_kind`` "tiles" or "blocks" (the weight-gradient GEMM).

    NOTE: two single-use kernels, the second reading the transposed view. A Triton kernel that read each 128x128
    tile once and wrote both (the second through a transpose in shared memory) measured slower on an H100 than the
    two (8192 x 28672 bf16: 0.69 against 0.53 ms; 128x128 blocks 0.54 against 0.54 ms; docs/fp8.md)."""
    _as_matrix(x, "quantize_operands")
    if col_kind not in ("tiles", "blocks"):
        raise Fp8Error(f"quantize_operands: the transposed operand is 'tiles' or 'blocks', got {col_kind!r}.")
    return quantize_tiles(_pad_rows(x), check_finite=False), quantize_transposed(x, col_kind)


def expand_scale(q: Quantized) -> torch.Tensor:
    """The scale of every element of ``q.data`` (fp32, same shape)."""
    rows, cols = q.data.shape
    if q.kind == "rows":
        return q.scale.expand(rows, cols)
    s = q.scale.repeat_interleave(GROUP, dim=1)[:, :cols]
    return s.repeat_interleave(GROUP, dim=0)[:rows] if q.kind == "blocks" else s


def dequantize(q: Quantized, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``data * scale``, element by element, in fp32, returned as ``dtype``."""
    return (q.data.float() * expand_scale(q)).to(dtype)


def dequantize_blocks(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """A 128x128 block-scaled FP8 tensor (DeepSeek-V3's ``weight`` and ``weight_scale_inv``) in ``dtype``."""
    want = (_ceil(data.shape[0], GROUP), _ceil(data.shape[1], GROUP))
    if data.dim() != 2 or tuple(scale.shape) != want:
        raise Fp8Error(f"dequantize_blocks: an FP8 tensor of shape {tuple(data.shape)} needs 128x128 block scales "
                       f"of shape {want}, got {tuple(scale.shape)}.")
    return dequantize(Quantized(data, scale.float(), "blocks"), dtype)


def transpose_blocks(q: Quantized) -> Quantized:
    """The block-scaled transpose: blocks are square, so data and scales just transpose."""
    if q.kind != "blocks":
        raise Fp8Error(f"transpose_blocks: only 128x128 blocks transpose exactly, got {q.kind}.")
    return Quantized(q.data.t().contiguous(), q.scale.t().contiguous(), "blocks")


# ---- GEMM -----------------------------------------------------------------------------------------------------------
# the operand pairs an FP8 GEMM takes (cuBLAS's block-wise kernels on SM90 take no 128x128 x 128x128)
PAIRS = (("tiles", "blocks"), ("blocks", "tiles"), ("tiles", "tiles"), ("rows", "rows"))


def _k_major(scale: torch.Tensor) -> torch.Tensor:
    """``scale`` ([rows, K/128]) with strides (1, rows), as scaled_mm reads 1x128 scales."""
    return scale.t().contiguous().t()


def _scaled_mm_args(a: Quantized, b: Quantized):
    """(scale_a, recipe_a, scale_b, recipe_b) in the layouts ``torch.nn.functional.scaled_mm`` reads."""
    from torch.nn.functional import ScalingType

    if (a.kind, b.kind) not in PAIRS:
        raise Fp8Error(f"scaled_matmul: no FP8 GEMM for a {a.kind} x {b.kind} pair; use one of {PAIRS}.")

    def scales(q: Quantized):
        if q.kind == "tiles":
            return _k_major(q.scale), ScalingType.BlockWise1x128
        # NOTE: 128x128 scales [rows/128, K/128] are read K-block-major with K/128 padded to a multiple of 4 (a
        # padded copy only where it is not: no extra launches for the usual sizes).
        k_blocks = q.scale.shape[1]
        if k_blocks % 4 == 0 and q.scale.is_contiguous():
            return q.scale.t(), ScalingType.BlockWise128x128
        padded = torch.ones(q.scale.shape[0], _ceil(k_blocks, 4) * 4, dtype=torch.float32, device=q.scale.device)
        padded[:, :k_blocks] = q.scale
        return padded.t(), ScalingType.BlockWise128x128

    return (*scales(a), *scales(b))


def _check_gemm(a: Quantized, b: Quantized) -> None:
    k = a.data.shape[1]
    if b.data.shape[1] != k:
        raise Fp8Error(f"scaled_matmul: contraction sizes differ ({tuple(a.data.shape)} x {tuple(b.data.shape)}.T).")
    need = 16 if a.kind == "rows" else GROUP
    m_need = GROUP if a.kind == "blocks" else 1
    n_need = GROUP if b.kind == "blocks" else 16
    if k % need or a.data.shape[0] % m_need or b.data.shape[0] % n_need:
        raise Fp8Error(f"scaled_matmul: {a.kind} x {b.kind} FP8 GEMM needs K % {need} == 0, M % {m_need} == 0 and "
                       f"N % {n_need} == 0, got K={k}, M={a.data.shape[0]}, N={b.data.shape[0]}.")


# ``aten::_scaled_mm_v2.out`` (what ``F.scaled_mm`` calls, writing into a given tensor), where torch has it.
_SCALED_MM_V2_OUT = getattr(getattr(torch.ops.aten, "_scaled_mm_v2", None), "out", None)


def scaled_matmul(a: Quantized, b: Quantized, *, out_dtype: torch.dtype = torch.bfloat16,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b.T`` from two quantised operands (``[M, K]`` and ``[N, K]``), result ``[M, N]`` in ``out_dtype``.
    With ``out`` (a contiguous ``[M, N]`` tensor; ``out_dtype`` is then its dtype) the result is written there: by
    the block-wise GEMM itself on CUDA where ``out`` is bf16 (the GEMM's output type; checked on an H100 to equal
    ``F.scaled_mm``'s result), else copied in."""
    _check_gemm(a, b)
    if (a.kind, b.kind) not in PAIRS:
        raise Fp8Error(f"scaled_matmul: no FP8 GEMM for a {a.kind} x {b.kind} pair; use one of {PAIRS}.")
    # NOTE: written by the GEMM only where cuBLAS takes the pointer (16-byte aligned, as a gradient-buffer view of a
    # weight whose sizes are multiples of 128 is); elsewhere the result is copied in.
    direct = out if (out is not None and out.dtype == torch.bfloat16 and a.data.is_cuda
                     and out.data_ptr() % 16 == 0) else None
    if a.kind == "rows" or (a.data.is_cuda and not hasattr(F, "scaled_mm")):
        # NOTE: row-wise through torch._scaled_mm, the entry point every torch since 2.5 has (shapes pick the recipe);
        # block-wise needs torch.nn.functional.scaled_mm's explicit recipes where that exists (torch >= 2.10).
        result = _legacy_scaled_mm(a, b)
    elif a.data.is_cuda:
        scale_a, recipe_a, scale_b, recipe_b = _scaled_mm_args(a, b)
        if direct is not None and _SCALED_MM_V2_OUT is not None:
            result = _SCALED_MM_V2_OUT(a.data, b.data.t(), [scale_a], [recipe_a.value], [], [scale_b],
                                       [recipe_b.value], [], None, torch.bfloat16, [], False, out=direct)
        else:
            result = F.scaled_mm(a.data, b.data.t(), scale_a, recipe_a, scale_b, recipe_b,
                                 output_dtype=torch.bfloat16)
    else:
        # NOTE: block-wise scaled_mm has no CPU kernel; the dequantised product is the same sum in another order.
        result = dequantize(a) @ dequantize(b).t()
    if out is None:
        return result.to(out_dtype)
    return out if result is out else out.copy_(result)


def _legacy_scaled_mm(a: Quantized, b: Quantized) -> torch.Tensor:
    if a.kind == "rows":
        scale_a, scale_b = a.scale.contiguous(), b.scale.reshape(1, -1).contiguous()
    else:  # 1x128 scales [M, K/128] K-tile-major; b's [K/128, N] (1x128) or [K/128, N/128] (blocks)
        scale_a, scale_b = _k_major(a.scale), b.scale.t()
    return torch._scaled_mm(a.data, b.data.t(), scale_a, scale_b, out_dtype=torch.bfloat16)


@functools.lru_cache(maxsize=None)
def blockwise_supported(device_index: int, recipe: str = "blockwise") -> bool:
    """Whether this GPU and torch build run the block-wise FP8 GEMMs of ``recipe`` (1x128 x 128x128 for the forward
    and input gradient; for the weight gradient 1x128 x 1x128, or 128x128 x 1x128 with ``blockwise_wgrad2d``) and
    get the dequantised product (probed once per device and recipe)."""
    device = torch.device("cuda", device_index)
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(256, 384, device=device, generator=g)
    w = torch.randn(128, 384, device=device, generator=g)
    kind_dy, kind_x = WGRAD_KINDS[recipe]  # the weight gradient's pairing: w stands in for dy.T, x for x.T
    for a, b in ((quantize_tiles(x), quantize_blocks(w)), (quantize(w, kind_dy), quantize(x, kind_x))):
        try:
            got = scaled_matmul(a, b, out_dtype=torch.float32)
        except (RuntimeError, ValueError, NotImplementedError, TypeError, AttributeError):
            return False
        want = dequantize(a) @ dequantize(b).t()
        if not bool(((got - want).norm() / want.norm()) < 1e-2):
            return False
    return True


# ---- quantised weights shared by the micro-batches of one optimizer step -------------------------------------------
_WEIGHT_CACHE: dict | None = None


@contextlib.contextmanager
def weight_cache(enabled: bool = True):
    """Inside, each weight is quantised once (per scaling) and reused by every later GEMM that takes it: what the
    micro-batches of one optimizer step share, as Transformer Engine's ``is_first_microbatch`` does. The caller
    promises that weights do not change inside (the training engine opens it around one step's forward and backward
    passes, before the optimizer runs). The quantised copies are held until the block ends (block-wise: 2 bytes per
    weight value for ``w`` and ``w.T``). A nested block leaves the outer one in charge."""
    global _WEIGHT_CACHE
    if not enabled or _WEIGHT_CACHE is not None:
        yield
        return
    _WEIGHT_CACHE = {}
    try:
        yield
    finally:
        _WEIGHT_CACHE = None


def cached_weight(w: torch.Tensor, kind: str, quantize):
    """``quantize()`` (the quantisation of weight ``w`` named ``kind``), computed once inside ``weight_cache`` where
    ``w`` is a parameter (a view of one, e.g. one expert's slice, is a new object per call: quantised each time)."""
    if _WEIGHT_CACHE is None or not isinstance(w, torch.nn.Parameter):
        return quantize()
    key = (id(w), kind)
    hit = _WEIGHT_CACHE.get(key)
    # NOTE: the entry keeps ``w`` alive (its id cannot be reused) and its version (an in-place change misses).
    if hit is not None and hit[1] == w._version:
        return hit[2]
    value = quantize()
    _WEIGHT_CACHE[key] = (w, w._version, value)
    return value


# ---- the three GEMMs of a linear layer, and fp8_linear --------------------------------------------------------------
RECIPES = ("blockwise", "blockwise_wgrad2d", "rowwise")
# how each recipe scales the operands of the weight-gradient GEMM dy.T @ x (both contract over tokens): dy.T, x.T
WGRAD_KINDS = {"blockwise": ("tiles", "tiles"), "blockwise_wgrad2d": ("blocks", "tiles"), "rowwise": ("rows", "rows")}


class GemmPrecision(NamedTuple):
    """Which of a linear layer's GEMMs run in FP8 (the others run in the input's dtype)."""
    fwd: bool = True
    dgrad: bool = True
    wgrad: bool = True


def forward_only(precision: GemmPrecision) -> GemmPrecision:
    """``precision`` with no backward GEMMs where grad mode is off (evaluation, generation, the first pass of a
    recomputed layer): the forward then quantises neither ``w.T`` nor ``x.T`` for a backward that never runs."""
    return precision if torch.is_grad_enabled() else precision._replace(dgrad=False, wgrad=False)


def check_recipe(recipe: str) -> None:
    if recipe not in RECIPES:
        raise Fp8Error(f"FP8 recipe {recipe!r} is not supported; use one of {RECIPES}.")


def is_blockwise(recipe: str) -> bool:
    """Whether the recipe scales activations in 1x128 tiles and weights in 128x128 blocks (not row-wise)."""
    return recipe != "rowwise"


def gemm_eligible(n: int, k: int, recipe: str) -> bool:
    """Whether a weight ``[n, k]`` can run the recipe's three GEMMs (N and K are GEMM dimensions of the forward and
    the input gradient: multiples of 128 for the block-wise recipes, 16 for ``rowwise``); tokens are padded, never
    refused."""
    step = GROUP if is_blockwise(recipe) else ROW_ALIGN
    return n > 0 and k > 0 and n % step == 0 and k % step == 0


def gemm_fwd(x: torch.Tensor, w: torch.Tensor, recipe: str, *, for_dgrad: bool = True,
             for_wgrad: bool = False) -> tuple[torch.Tensor, Quantized | None, Quantized | None]:
    """``x @ w.T`` in FP8 (``x`` ``[M, K]``, ``w`` ``[N, K]``), and what the backward GEMMs can reuse: with
    ``for_dgrad`` (block-wise) ``w.T`` quantised with ``w`` (for ``gemm_dgrad``), with ``for_wgrad`` (block-wise)
    ``x.T`` quantised as the recipe's weight gradient takes it (for ``gemm_wgrad``; kept instead of ``x``), else
    None. Any M: rows are zero-padded to ``padded_rows`` and sliced off the result; M = 0 gives an empty result."""
    m = x.shape[0]
    if m == 0:
        return x.new_zeros(0, w.shape[0]), None, None
    xtq = None
    if is_blockwise(recipe):
        if for_dgrad:
            wq, wtq = cached_weight(w, "blocks_dual", lambda: quantize_blocks_dual(w))
        else:
            wq, wtq = cached_weight(w, "blocks", lambda: quantize_blocks(w, check_finite=False)), None
        if for_wgrad:
            xq, xtq = quantize_operands(x, WGRAD_KINDS[recipe][1])
        else:
            xq = quantize_tiles(_pad_rows(x), check_finite=False)
        y = scaled_matmul(xq, wq, out_dtype=x.dtype)
    else:
        wtq = None
        y = scaled_matmul(quantize_rows(_pad_rows(x), check_finite=False),
                          cached_weight(w, "rows", lambda: quantize_rows(w, check_finite=False)), out_dtype=x.dtype)
    return (y if y.shape[0] == m else y[:m]), wtq, xtq


def gemm_dgrad(dy: torch.Tensor, w: torch.Tensor, recipe: str, wtq: Quantized | None = None) -> torch.Tensor:
    """``dy @ w`` in FP8 (``dy`` ``[M, N]``, ``w`` ``[N, K]``): the input gradient (any M, as ``gemm_fwd``).
    ``wtq``: ``w.T`` already block-quantised (what ``gemm_fwd`` returns)."""
    m = dy.shape[0]
    if m == 0:
        return dy.new_zeros(0, w.shape[1])
    if is_blockwise(recipe):
        wt = wtq if wtq is not None else cached_weight(w, "blocks_t",
                                                       lambda: quantize_blocks(w.t(), check_finite=False))
        dx = scaled_matmul(quantize_tiles(_pad_rows(dy), check_finite=False), wt, out_dtype=dy.dtype)
    else:
        dx = scaled_matmul(quantize_rows(_pad_rows(dy), check_finite=False),
                           cached_weight(w, "rows_t", lambda: quantize_rows(w.t(), check_finite=False)),
                           out_dtype=dy.dtype)
    return dx if dx.shape[0] == m else dx[:m]


def gemm_wgrad(dy: torch.Tensor, x: torch.Tensor | None, recipe: str, *, out: torch.Tensor | None = None,
               xtq: Quantized | None = None) -> torch.Tensor:
    """``dy.T @ x`` in FP8 (``dy`` ``[M, N]``, ``x`` ``[M, K]``): the weight gradient, contracting over tokens,
    which are zero-padded to the GEMM's multiple; M = 0 gives zeros. ``xtq``: ``x.T`` already quantised
    (``gemm_fwd(for_wgrad=True)``; ``x`` may then be None). ``out``: write it there (``scaled_matmul``)."""
    if dy.shape[0] == 0:
        return out.zero_() if out is not None else dy.new_zeros(dy.shape[1], x.shape[1] if x is not None
                                                                else xtq.data.shape[0])
    kind_dy, kind_x = WGRAD_KINDS[recipe]
    b = xtq if xtq is not None else quantize_transposed(x, kind_x)
    return scaled_matmul(quantize_transposed(dy, kind_dy), b, out_dtype=dy.dtype, out=out)


class _Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, recipe, precision):
        x2 = x.reshape(-1, x.shape[-1])
        for_wgrad = precision.fwd and precision.wgrad and weight.requires_grad
        if precision.fwd:
            y, wtq, xtq = gemm_fwd(x2, weight, recipe, for_dgrad=precision.dgrad, for_wgrad=for_wgrad)
        else:
            y, wtq, xtq = x2 @ weight.t().to(x2.dtype), None, None
        if bias is not None:
            y = y + bias
        ctx.save_for_backward(x2 if xtq is None else None, weight)
        ctx.wtq, ctx.xtq = wtq, xtq
        ctx.recipe, ctx.precision, ctx.has_bias, ctx.x_shape = recipe, precision, bias is not None, x.shape
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x2, weight = ctx.saved_tensors
        xtq, ctx.xtq = ctx.xtq, None
        dy2 = dy.reshape(-1, weight.shape[0])
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = gemm_dgrad(dy2, weight, ctx.recipe, ctx.wtq) if ctx.precision.dgrad \
                else dy2 @ weight.to(dy2.dtype)
            dx = dx.view(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            dw = (gemm_wgrad(dy2, x2, ctx.recipe, xtq=xtq) if ctx.precision.wgrad
                  else dy2.t() @ x2).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2.sum(0)
        ctx.wtq = None
        return dx, dw, db, None, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
               recipe: str = "blockwise", precision: GemmPrecision = GemmPrecision()) -> torch.Tensor:
    """``x @ weight.T + bias`` with the forward GEMM and both backward GEMMs (input and weight gradient) in FP8.

    ``weight`` stays in its own (master) precision and is quantised on every call; the output and the gradients come
    back in the input's / weight's dtype. Needs ``weight``'s dimensions to be multiples of 128 (``blockwise``) or 16
    (``rowwise``, see ``gemm_eligible``); any number of tokens, none included. This is the hook a grouped-GEMM expert
    module calls per expert."""
    check_recipe(recipe)
    if not gemm_eligible(*weight.shape, recipe):
        step = GROUP if is_blockwise(recipe) else ROW_ALIGN
        raise Fp8Error(f"fp8_linear: weight {tuple(weight.shape)} does not fit the {recipe} FP8 GEMMs (both "
                       f"dimensions must be multiples of {step}); keep this layer in bf16.")
    if x.shape[-1] != weight.shape[1]:
        raise Fp8Error(f"fp8_linear: input of shape {tuple(x.shape)} does not match weight {tuple(weight.shape)}.")
    return _Fp8Linear.apply(x, weight, bias, recipe, forward_only(precision))
