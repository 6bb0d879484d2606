"""Triton AdamW step over one parameter tensor, the numerics of torch's fused AdamW (``torch._fused_adamw_``).

One program per ``BLOCK`` elements reads p, g, m, v once and writes p, m, v once (the minimum traffic of the update:
14 bytes per bf16 element), all math in fp32 registers with one rounding per stored tensor:
``g *= 1/grad_scale``, ``p -= lr*wd * p``, ``m = b1*m + (1-b1)*g``, ``v = b2*v + (1-b2)*g*g``,
``p -= lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps)``, division and square root correctly rounded (``div_rn`` / ``sqrt_rn``)
as in torch's CUDA kernel. The grads are multiplied by ``1 / grad_scale`` (one correctly rounded division per
program), where torch divides each grad: within one fp32 ulp of torch's quotient. NOTE: a correctly rounded division
per element for ``grad_scale`` made the kernel compute-bound on an H100: 17.6 ms instead of 13.1 ms (the bandwidth
bound) over workload (b)'s 2.8 B bf16 parameters; 4096-element programs of 8 warps were slower than 1024 of 4 when
compute-bound and equal otherwise.
The bias corrections ``1 - b**step`` come from the step count on the device (no host read): each program computes them
in fp64 from ``ln b`` passed as two fp32 halves (Triton passes Python floats as fp32, and ``1 - 0.999**1`` in fp32
would lose four digits to cancellation).
"""

from __future__ import annotations

import math
import struct

import torch
import triton
import triton.language as tl

BLOCK = 1024
NUM_WARPS = 4


@triton.jit
def _adamw_step(P, G, M, V, STEP, SCALE, FOUND, n, lr, lr_wd, b1, one_minus_b1, b2, one_minus_b2, eps,
                ln_b1_hi, ln_b1_lo, ln_b2_hi, ln_b2_lo,
                HAS_SCALE: tl.constexpr, HAS_FOUND: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    if HAS_FOUND:
        n = tl.where(tl.load(FOUND) == 0.0, n, 0)
    mask = offs < n
    step = tl.load(STEP).to(tl.float64)
    ln_b1 = tl.cast(ln_b1_hi, tl.float64) + tl.cast(ln_b1_lo, tl.float64)
    ln_b2 = tl.cast(ln_b2_hi, tl.float64) + tl.cast(ln_b2_lo, tl.float64)
    bc1 = 1.0 - tl.exp(step * ln_b1)
    bc2_sqrt = tl.sqrt(1.0 - tl.exp(step * ln_b2))
    step_size = (tl.cast(lr, tl.float64) / bc1).to(tl.float32)
    bc2_sqrt = bc2_sqrt.to(tl.float32)

    p = tl.load(P + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(M + offs, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(V + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_SCALE:
        g = g * tl.div_rn(tl.full((), 1.0, tl.float32), tl.load(SCALE))
    p = p - lr_wd * p
    m = b1 * m + one_minus_b1 * g
    v = b2 * v + one_minus_b2 * g * g
    denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
    p = p - tl.div_rn(step_size * m, denom)
    tl.store(P + offs, p.to(P.dtype.element_ty), mask=mask)
    tl.store(M + offs, m.to(M.dtype.element_ty), mask=mask)
    tl.store(V + offs, v.to(V.dtype.element_ty), mask=mask)


def _halves(x: float) -> tuple[float, float]:
    """``x`` as fp32 ``hi + lo`` (about 48 bits of it)."""
    hi = struct.unpack("f", struct.pack("f", x))[0]
    return hi, x - hi


def adamw_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
               step: torch.Tensor, *, lr: float, weight_decay: float, beta1: float, beta2: float, eps: float,
               grad_scale: torch.Tensor | None = None, found_inf: torch.Tensor | None = None) -> None:
    """One AdamW update of contiguous ``param``, ``exp_avg``, ``exp_avg_sq`` in place; ``step`` (a one-element fp32
    tensor on the parameter's device) already holds the new step count. ``grad`` is only read."""
    n = param.numel()
    if n == 0:
        return
    b1_hi, b1_lo = _halves(math.log(beta1)) if beta1 > 0 else (-math.inf, 0.0)
    b2_hi, b2_lo = _halves(math.log(beta2)) if beta2 > 0 else (-math.inf, 0.0)
    _adamw_step[(triton.cdiv(n, BLOCK),)](
        param, grad, exp_avg, exp_avg_sq, step,
        grad_scale if grad_scale is not None else step, found_inf if found_inf is not None else step,
        n, lr, lr * weight_decay, beta1, 1.0 - beta1, beta2, 1.0 - beta2, eps, b1_hi, b1_lo, b2_hi, b2_lo,
        HAS_SCALE=grad_scale is not None, HAS_FOUND=found_inf is not None, BLOCK=BLOCK, num_warps=NUM_WARPS)
