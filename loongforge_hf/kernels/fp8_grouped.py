"""FP8 routed experts: fc1 and fc2 of every local expert each as one grouped, row-wise scaled FP8 GEMM (forward,
input gradient and weight gradient), ``fp8_grouped_gated_mlp``; the math of ``grouped_mlp.grouped_gated_mlp``.

Choices:
- The GEMM is ``torch._scaled_grouped_mm`` (e4m3 operands, fp32 row-wise scales, bf16 out). What it needs, as read
  in torch's source (aten/src/ATen/native/cuda/GroupedBlas.cpp ``_scaled_grouped_mm_cuda`` and
  ``_check_scales_fp8_rowwise``, GroupedMMUtils.h ``check_valid_strides_and_return_transposed``,
  cuda/GroupMMCommon.cuh ``prepare_grouped_gemm_data``; the meta function ``_meta_grouped_mm_common`` in
  torch/_meta_registrations.py repeats the host checks, which the CPU tests run on meta tensors):
  - compute capability 9.0 or 10.x only (``_scaled_mm_allowed_device(sm90_only, sm100_only)``); no CPU kernel;
  - ``mat_a`` row-major, ``mat_b`` column-major (its last-but-one stride 1), leading strides multiples of 16 bytes;
    ``mat_a.size(-1)``, ``mat_b.size(-2)`` and ``mat_b.size(-1)`` multiples of 16; ``offs`` int32 1-D (cumulative ends);
  - 2d x 3d (forward and input gradient, groups over M): ``a [M_total, K]``, ``b [G, K, N]``, ``scale_a`` 1-D
    ``[M_total]``, ``scale_b`` ``[G, N]`` (last dimension contiguous); out ``[M_total, N]``;
  - 2d x 2d (weight gradient, groups over K): ``a [M, K_total]``, ``b [K_total, N]``, ``scale_a`` 1-D ``[G * M]`` and
    ``scale_b`` 1-D ``[G * N]`` (group-major: group g's scales start at ``g * M`` / ``g * N``); out ``[G, M, N]``;
  - group sizes: the device-side setup asserts every group's size along the dynamic dimension to be a multiple of 16
    (older builds for every layout, newer ones where the group moves a TMA address: K groups of 2d x 2d); a failed
    device assert kills the CUDA context, so every group here is padded to a multiple of 16 in all three GEMMs;
  - an empty K group (an expert without tokens in the weight gradient) is not guaranteed to write its output (CUTLASS
    skips K = 0 problems); those gradients are set to zero afterwards.
- Padding without a host sync: tokens are scattered into a buffer of ``T + 15 * E`` rows (rounded up to 16), every
  expert's segment starting at a multiple of 16, the rest zero; the destination rows, padded offsets and each token's
  expert come from ``tokens_per_expert`` on the device (``repeat_interleave`` with a known ``output_size``). Outputs
  are gathered back to the ``T`` token rows, so rows past the last group (never written by the GEMM) are never read.
- On CUDA with triton, each operand is one kernel that quantises and writes straight into its padded layout
  (``Layout.quantize_rows``: rows at their padded place; ``Layout.quantize_columns``: one program per expert segment
  and column block takes the segment's amax, then writes the transposed FP8 values and the segment's zero padding;
  weights of any strides, ``W[e].T`` included). Elsewhere torch ops do the same in steps (quantise, then scatter the
  1-byte data): the reference the GPU tests compare the kernels with, bit for bit. The torch steps cost the (c)
  workload of scripts/bench_train.py 130 ms of a 310 ms step on an H100 (``scatter_reduce``, ``index_copy``, casts).
- Scales: forward ``x`` per token row and ``W[e]`` per output row (over K); input gradient ``dy`` per token row and
  ``W[e].T`` per input channel (over N); weight gradient ``dy.T`` and ``x.T`` per (channel, expert segment), the amax
  taken over the segment's tokens (``quantize_segments``). Padding rows and empty experts get scale 1.
- Block scaling is not used: torch has no block-scaled grouped GEMM on sm90 (its MX grouped GEMM is sm100 only), so
  the experts run row-wise under either recipe of ``fp8_linear``.
- Off the GPUs above (CPU included) ``scaled_grouped_mm`` is emulated from the same quantised operands: dequantise,
  fp32 matmul per group, bf16 result; the same numbers up to accumulation order, which the CPU tests check.
"""

from __future__ import annotations

import torch

from loongforge_hf.kernels._triton import use_triton
from loongforge_hf.kernels.fp8 import (FP8_DTYPE, FP8_MAX, Fp8Error, cached_weight, cast_to_fp8, quantize_rows,
                                       rows_into_triton, scales_from_amax)
from loongforge_hf.kernels.grouped_mlp import check_expert_shapes, scale_by_probs
from loongforge_hf.kernels.swiglu import swiglu

try:  # NOTE: triton is optional; without it (or off CUDA) torch ops quantise and scatter.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

__all__ = ["fp8_grouped_gated_mlp", "fp8_grouped_linear", "grouped_fp8_supported", "quantize_segments",
           "scaled_grouped_mm"]

ALIGN = 16


# ---- Triton kernels: quantise straight into the padded GEMM layouts ------------------------------------------------
if triton is not None:
    @triton.jit
    def _segment_columns_kernel(x_ptr, q_ptr, s_ptr, counts_ptr, starts_ptr, dst_ptr, cols, out_cols,
                                stride_xr, stride_xc, ALIGN: tl.constexpr, BLOCK_T: tl.constexpr,
                                BLOCK_C: tl.constexpr, FMAX: tl.constexpr):
        """Expert ``program_id(0)``'s token rows of ``x``, a block of columns: one scale per column over the
        segment, the values written transposed (``q[c, dst + t]``) with the segment's padding up to ``ALIGN`` zero."""
        e = tl.program_id(0)
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        live = c < cols
        n = tl.load(counts_ptr + e)
        first = tl.load(starts_ptr + e)
        dst = tl.load(dst_ptr + e)
        amax = tl.zeros((BLOCK_C,), tl.float32)
        for t0 in range(0, n, BLOCK_T):
            t = t0 + tl.arange(0, BLOCK_T)
            x = tl.load(x_ptr + (first + t)[:, None] * stride_xr + c[None, :] * stride_xc,
                        mask=(t[:, None] < n) & live[None, :], other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.max(tl.where(x == x, tl.abs(x), float("inf")), axis=0))
        scale = tl.where(amax == 0, 1.0, tl.math.div_rn(amax, tl.zeros((BLOCK_C,), tl.float32) + FMAX))
        inv = tl.math.div_rn(tl.zeros((BLOCK_C,), tl.float32) + 1.0, scale)
        tl.store(s_ptr + e * cols + c, scale, mask=live)
        padded = (n + ALIGN - 1) // ALIGN * ALIGN
        for t0 in range(0, padded, BLOCK_T):
            t = t0 + tl.arange(0, BLOCK_T)
            x = tl.load(x_ptr + (first + t)[:, None] * stride_xr + c[None, :] * stride_xc,
                        mask=(t[:, None] < n) & live[None, :], other=0.0).to(tl.float32)
            q = tl.trans(tl.clamp(x * inv[None, :], -FMAX, FMAX).to(q_ptr.dtype.element_ty))
            tl.store(q_ptr + c[:, None] * out_cols + (dst + t)[None, :], q,
                     mask=live[:, None] & (t[None, :] < padded))

    @triton.jit
    def _zero_empty_kernel(y_ptr, counts_ptr, size, BLOCK: tl.constexpr):
        """``y[e] = 0`` where expert ``e`` has no tokens; other experts' programs return at once."""
        e = tl.program_id(0)
        if tl.load(counts_ptr + e) == 0:
            i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
            tl.store(y_ptr + e * size + i, tl.zeros((BLOCK,), y_ptr.dtype.element_ty), mask=i < size)


def _columns_into_triton(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, layout: "Layout") -> None:
    """``x`` ``[T, C]`` scaled per (segment, column) of ``layout`` into ``q`` ``[C, layout.rows]`` (transposed,
    padding zero) and ``s`` ``[experts * C]``. ``q``'s dtype is the kernel's output type (FP8 in training)."""
    cols = x.shape[1]
    if not (layout.experts and cols):
        return
    block_c = 64
    _segment_columns_kernel[(layout.experts, -(-cols // block_c))](
        x, q, s, layout.counts, layout.starts, layout.dst_starts, cols, layout.rows, x.stride(0), x.stride(1),
        ALIGN=ALIGN, BLOCK_T=64, BLOCK_C=block_c, FMAX=FP8_MAX)


def grouped_fp8_supported(device: torch.device) -> bool:
    """Whether ``torch._scaled_grouped_mm`` runs on ``device`` (a CUDA GPU of compute capability 9.0 or 10.x)."""
    from loongforge_hf.xpu import get_backend

    if device.type != "cuda" or not hasattr(torch, "_scaled_grouped_mm"):
        return False
    capability = get_backend().compute_capability(device)
    return capability is not None and (capability == (9, 0) or capability[0] == 10)


class Layout:
    """Where each of ``T`` tokens (sorted by expert, ``counts[e]`` each) sits in the padded GEMM buffer."""

    def __init__(self, counts: torch.Tensor, tokens: int) -> None:
        counts = counts.to(torch.int64)
        self.experts, self.tokens = counts.numel(), tokens
        self.counts = counts
        padded = (counts + ALIGN - 1) // ALIGN * ALIGN
        ends, pads = torch.cumsum(counts, 0), torch.cumsum(padded, 0)
        self.rows = -(-(tokens + (ALIGN - 1) * self.experts) // ALIGN) * ALIGN
        self.offs = pads.to(torch.int32)
        self.expert = torch.repeat_interleave(torch.arange(self.experts, device=counts.device), counts,
                                              output_size=tokens)
        self.starts, self.dst_starts = ends - counts, pads - padded  # each segment's first token / padded row
        local = torch.arange(tokens, device=counts.device) - self.starts[self.expert]
        self.dst = self.dst_starts[self.expert] + local

    def quantize_rows(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Token rows ``x`` ``[T, C]`` quantised with one scale per row, in the padded buffer: FP8 ``[rows, C]``
        and scales ``[rows]`` (1 on padding rows; the padding rows' data is not read back, see ``gather``)."""
        if not use_triton(x):
            q = quantize_rows(x, check_finite=False)
            return self.scatter(q.data), self.scatter_scales(q.scale)
        # NOTE: one kernel writes each row at its padded place; padding rows' data stays uninitialised: a
        # forward / input-gradient GEMM row depends on its own input row only, and those output rows are never
        # gathered.
        q = torch.empty(self.rows, x.shape[1], dtype=FP8_DTYPE, device=x.device)
        s = torch.ones(self.rows, dtype=torch.float32, device=x.device)
        rows_into_triton(x[None], q, s, self.dst)
        return q, s

    def quantize_columns(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Token rows ``x`` ``[T, C]`` scaled per (expert segment, column) and transposed into the padded buffer:
        FP8 ``[C, rows]`` with zeros on padding, scales ``[experts * C]`` group-major (1 for an empty segment or an
        all-zero column): the weight-gradient GEMM's operand."""
        if not use_triton(x):
            q, s = quantize_segments(x, self.expert, self.experts)
            return self.scatter_columns(q), s.reshape(-1)
        # NOTE: columns past the last segment's padding are never read (they lie outside every group of offs).
        q = torch.empty(x.shape[1], self.rows, dtype=FP8_DTYPE, device=x.device)
        s = torch.empty(self.experts * x.shape[1], dtype=torch.float32, device=x.device)
        _columns_into_triton(x, q, s, self)
        return q, s

    def scatter(self, q: torch.Tensor) -> torch.Tensor:
        """FP8 token rows ``[T, C]`` into a zero buffer ``[rows, C]``."""
        # NOTE: index_copy has no FP8 kernel; the bytes move as uint8.
        out = torch.zeros(self.rows, q.shape[1], dtype=torch.uint8, device=q.device)
        return out.index_copy_(0, self.dst, q.view(torch.uint8)).view(q.dtype)

    def scatter_scales(self, s: torch.Tensor) -> torch.Tensor:
        out = torch.ones(self.rows, dtype=torch.float32, device=s.device)
        return out.index_copy_(0, self.dst, s.reshape(-1))

    def scatter_columns(self, q: torch.Tensor) -> torch.Tensor:
        """FP8 token rows ``[T, C]`` transposed into a contiguous zero buffer ``[C, rows]``."""
        out = torch.zeros(q.shape[1], self.rows, dtype=torch.uint8, device=q.device)
        return out.index_copy_(1, self.dst, q.view(torch.uint8).t()).view(q.dtype)

    def gather(self, y: torch.Tensor) -> torch.Tensor:
        return y.index_select(0, self.dst)

    def zero_empty(self, y: torch.Tensor) -> torch.Tensor:
        """``y`` ``[experts, ...]`` (contiguous) with the slabs of experts without tokens set to zero, in place."""
        if not use_triton(y):
            return y.masked_fill_((self.counts == 0).view(-1, *([1] * (y.dim() - 1))), 0)
        # NOTE: a kernel that exits at once for experts with tokens: no pass over the whole gradient (a
        # torch.where / masked_fill reads and writes every element: 6.4 ms of (c)'s FP8 step on an H100).
        size, block = y[0].numel() if self.experts else 0, 4096
        if size:
            _zero_empty_kernel[(self.experts, -(-size // block))](y, self.counts, size, BLOCK=block)
        return y


def quantize_segments(x: torch.Tensor, expert: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (expert segment, column) scaling of ``x`` ``[T, C]``, whose row ``t`` belongs to segment ``expert[t]``:
    the FP8 data ``[T, C]`` and the scales ``[experts, C]`` (1 for an empty segment or an all-zero column)."""
    amax = torch.zeros(experts, x.shape[1], dtype=torch.float32, device=x.device)
    amax.scatter_reduce_(0, expert[:, None].expand(-1, x.shape[1]), x.detach().abs().float(), "amax")
    scale = scales_from_amax(amax)
    return cast_to_fp8(x, scale.index_select(0, expert)), scale


def _quantize_weight_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` ``[E, R, C]`` (any strides) with one scale per (expert, row): contiguous FP8 ``[E, R, C]``, scales
    ``[E, R]``."""
    e, r, c = w.shape
    if use_triton(w):
        q = torch.empty(e, r, c, dtype=FP8_DTYPE, device=w.device)
        s = torch.empty(e, r, dtype=torch.float32, device=w.device)
        rows_into_triton(w, q, s, None)
        return q, s
    scale = scales_from_amax(w.detach().abs().amax(-1))
    return cast_to_fp8(w, scale[..., None]).contiguous(), scale


def scaled_grouped_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                      offs: torch.Tensor, *, emulate: bool | None = None) -> torch.Tensor:
    """``torch._scaled_grouped_mm(a, b, scale_a, scale_b, offs=offs)`` (bf16 out), 2d x 3d or 2d x 2d, or its
    emulation (``emulate``; None: wherever ``grouped_fp8_supported`` says no)."""
    if emulate is None:
        emulate = not grouped_fp8_supported(a.device)
    if not emulate:
        return torch._scaled_grouped_mm(a, b, scale_a, scale_b, offs=offs, out_dtype=torch.bfloat16)
    ends = offs.tolist()
    starts = [0] + ends[:-1]
    if b.dim() == 3:  # groups over the rows of a
        out = torch.zeros(a.shape[0], b.shape[2], dtype=torch.float32, device=a.device)
        for g, (s, e) in enumerate(zip(starts, ends)):
            out[s:e] = (a[s:e].float() * scale_a[s:e, None]) @ (b[g].float() * scale_b[g][None, :])
        return out.to(torch.bfloat16)
    groups, m, n = len(ends), a.shape[0], b.shape[1]
    sa, sb = scale_a.view(groups, m), scale_b.view(groups, n)
    out = torch.empty(groups, m, n, dtype=torch.float32, device=a.device)
    for g, (s, e) in enumerate(zip(starts, ends)):
        out[g] = (a[:, s:e].float() * sa[g][:, None]) @ (b[s:e].float() * sb[g][None, :])
    return out.to(torch.bfloat16)


def _forward_operands(x, w, layout: Layout):
    """``x_e @ w[e].T`` operands: a ``[rows, K]``, b ``[E, K, N]`` (column-major), scales."""
    xq, xs = layout.quantize_rows(x)
    wq, ws = cached_weight(w, "expert_rows", lambda: _quantize_weight_rows(w))
    return xq, wq.transpose(-2, -1), xs, ws


def _dgrad_operands(dy, w, layout: Layout):
    """``dy_e @ w[e]`` operands: a ``[rows, N]``, b ``[E, N, K]`` (column-major), scales."""
    dq, ds = layout.quantize_rows(dy)
    wtq, wts = cached_weight(w, "expert_rows_t", lambda: _quantize_weight_rows(w.transpose(-2, -1)))
    return dq, wtq.transpose(-2, -1), ds, wts


def _wgrad_operands(dy, x, layout: Layout):
    """``dy_e.T @ x_e`` operands: a ``[N, rows]`` (row-major), b ``[rows, K]`` (column-major), group-major scales."""
    dq, ds = layout.quantize_columns(dy)
    xq, xs = layout.quantize_columns(x)
    return dq, xq.t(), ds, xs


class _Fp8GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, layout, emulate):
        ctx.save_for_backward(x, w)
        ctx.layout, ctx.emulate = layout, emulate
        y = scaled_grouped_mm(*_forward_operands(x, w, layout), layout.offs, emulate=emulate)
        return layout.gather(y).to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        layout, emulate = ctx.layout, ctx.emulate
        dy = dy.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = layout.gather(scaled_grouped_mm(*_dgrad_operands(dy, w, layout), layout.offs,
                                                 emulate=emulate)).to(x.dtype)
        if ctx.needs_input_grad[1]:
            dw = scaled_grouped_mm(*_wgrad_operands(dy, x, layout), layout.offs, emulate=emulate)
            # NOTE: an expert without tokens is a K = 0 problem, which the grouped kernel need not write.
            dw = layout.zero_empty(dw).to(w.dtype)
        ctx.layout = None
        return dx, dw, None, None


def _check_dims(w: torch.Tensor, what: str) -> None:
    if w.shape[1] % ALIGN or w.shape[2] % ALIGN:
        raise Fp8Error(f"fp8_grouped: {what} {tuple(w.shape)} needs both matrix dimensions to be multiples of {ALIGN} "
                       "(torch._scaled_grouped_mm); keep these experts in bf16.")


def fp8_grouped_linear(x: torch.Tensor, w: torch.Tensor, layout: Layout, *,
                       emulate: bool | None = None) -> torch.Tensor:
    """``x_e @ w[e].T`` for every expert's segment of ``x`` ``[T, K]`` (``w`` ``[E, N, K]``), all three GEMMs FP8."""
    _check_dims(w, "weight")
    return _Fp8GroupedLinear.apply(x, w, layout, emulate)


def fp8_grouped_gated_mlp(x: torch.Tensor, fc1: torch.Tensor, fc2: torch.Tensor, tokens_per_expert,
                          probs: torch.Tensor | None = None, *, emulate: bool | None = None,
                          activation=swiglu) -> torch.Tensor:
    """``grouped_gated_mlp`` with both projections as grouped FP8 GEMMs: x ``[T, H]`` sorted by expert, fc1
    ``[E, 2F, H]``, fc2 ``[E, H, F]``, ``tokens_per_expert`` ``[E]`` (tensor or list), ``probs`` ``[T]`` or None.
    ``emulate``: force (True) or forbid (False) the emulated GEMM; None picks by device (once per call).
    ``activation``: ``[..., 2F] -> [..., F]`` on the fc1 output (SwiGLU, or the clamped SwiGLU's ``ClampedGLU``)."""
    counts = torch.as_tensor(tokens_per_expert).to(x.device, non_blocking=True)
    check_expert_shapes(x, fc1, fc2, counts, "fp8_grouped_gated_mlp")
    if emulate is None:
        emulate = not grouped_fp8_supported(x.device)
    layout = Layout(counts, x.shape[0])
    act = scale_by_probs(activation(fp8_grouped_linear(x, fc1, layout, emulate=emulate)), probs)
    return fp8_grouped_linear(act, fc2, layout, emulate=emulate)
