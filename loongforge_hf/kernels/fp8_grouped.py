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
  expert come from ``tokens_per_expert`` on the device (``repeat_interleave`` with a known ``output_size``). Only FP8
  data (1 byte) is scattered: row-wise scales do not depend on the padding, so rows are quantised first. Outputs are
  gathered back to the ``T`` token rows, so rows past the last group (never written by the GEMM) are never read.
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

from loongforge_hf.kernels.fp8 import Fp8Error, cast_to_fp8, quantize_rows, scales_from_amax
from loongforge_hf.kernels.grouped_mlp import check_expert_shapes, scale_by_probs
from loongforge_hf.kernels.swiglu import swiglu

__all__ = ["fp8_grouped_gated_mlp", "fp8_grouped_linear", "grouped_fp8_supported", "quantize_segments",
           "scaled_grouped_mm"]

ALIGN = 16


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
        local = torch.arange(tokens, device=counts.device) - (ends - counts)[self.expert]
        self.dst = (pads - padded)[self.expert] + local

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
    if w.is_contiguous():
        q = quantize_rows(w.reshape(e * r, c), check_finite=False)
        return q.data.view(e, r, c), q.scale.view(e, r)
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
    xq = quantize_rows(x, check_finite=False)
    wq, ws = _quantize_weight_rows(w)
    return layout.scatter(xq.data), wq.transpose(-2, -1), layout.scatter_scales(xq.scale), ws


def _dgrad_operands(dy, w, layout: Layout):
    """``dy_e @ w[e]`` operands: a ``[rows, N]``, b ``[E, N, K]`` (column-major), scales."""
    dq = quantize_rows(dy, check_finite=False)
    wtq, wts = _quantize_weight_rows(w.transpose(-2, -1))
    return layout.scatter(dq.data), wtq.transpose(-2, -1), layout.scatter_scales(dq.scale), wts


def _wgrad_operands(dy, x, layout: Layout):
    """``dy_e.T @ x_e`` operands: a ``[N, rows]`` (row-major), b ``[rows, K]`` (column-major), group-major scales."""
    dq, ds = quantize_segments(dy, layout.expert, layout.experts)
    xq, xs = quantize_segments(x, layout.expert, layout.experts)
    return layout.scatter_columns(dq), layout.scatter_columns(xq).t(), ds.reshape(-1), xs.reshape(-1)


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
            dw = torch.where((layout.counts > 0)[:, None, None], dw, 0).to(w.dtype)
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
                          probs: torch.Tensor | None = None, *, emulate: bool | None = None) -> torch.Tensor:
    """``grouped_gated_mlp`` with both projections as grouped FP8 GEMMs: x ``[T, H]`` sorted by expert, fc1
    ``[E, 2F, H]``, fc2 ``[E, H, F]``, ``tokens_per_expert`` ``[E]`` (tensor or list), ``probs`` ``[T]`` or None.
    ``emulate``: force (True) or forbid (False) the emulated GEMM; None picks by device (once per call)."""
    counts = torch.as_tensor(tokens_per_expert).to(x.device, non_blocking=True)
    check_expert_shapes(x, fc1, fc2, counts, "fp8_grouped_gated_mlp")
    if emulate is None:
        emulate = not grouped_fp8_supported(x.device)
    layout = Layout(counts, x.shape[0])
    act = scale_by_probs(swiglu(fp8_grouped_linear(x, fc1, layout, emulate=emulate)), probs)
    return fp8_grouped_linear(act, fc2, layout, emulate=emulate)
