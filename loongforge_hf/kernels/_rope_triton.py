"""Triton rotary embedding for megatron's ``[s, b, heads, d]`` layout, rotate-half pairs, forward and backward.

One program per (position, batch row) rotates every head of that token: ``cos`` and ``sin`` of the angles
``freqs[s, 0, 0, :rot]`` are computed once in fp32 in registers (never materialised), the rotation runs in fp32 and
rounds once to the input dtype; channels past ``rot`` are copied. The backward is the rotation by the negated angle,
``dx = dy * cos + rotate_half^T(dy * sin)``. The input may be a strided view (q, k split off the fused QKV projection);
the output is contiguous.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_kernel(X, F, Y, B, H, D, ROT, stride_xs, stride_xb, stride_xh, stride_fs, SIGN: tl.constexpr,
                 BLOCK_H: tl.constexpr, HALF: tl.constexpr, BLOCK_PASS: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    s = pid // B
    b = pid % B
    half = ROT // 2
    heads = tl.arange(0, BLOCK_H)[:, None]
    cols = tl.arange(0, HALF)[None, :]
    hmask = heads < H
    cmask = cols < half
    mask = hmask & cmask
    # NOTE: cos/sin per channel of each half (megatron's freqs are cat(f, f), but each half is read as given).
    f1 = tl.load(F + s * stride_fs + cols, mask=cmask, other=0.0).to(tl.float32)
    f2 = tl.load(F + s * stride_fs + half + cols, mask=cmask, other=0.0).to(tl.float32)
    c1, s1, c2, s2 = tl.cos(f1), tl.sin(f1), tl.cos(f2), tl.sin(f2)
    x_base = X + s * stride_xs + b * stride_xb + heads * stride_xh
    y_base = Y + (s * B + b) * H * D + heads * D
    x1 = tl.load(x_base + cols, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_base + half + cols, mask=mask, other=0.0).to(tl.float32)
    if SIGN > 0:
        # y = x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1]
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
    else:
        # dx = dy * cos + rotate_half^T(dy * sin), rotate_half^T([u1, u2]) = [u2, -u1]
        y1 = x1 * c1 + x2 * s2
        y2 = x2 * c2 - x1 * s1
    tl.store(y_base + cols, y1.to(Y.dtype.element_ty), mask=mask)
    tl.store(y_base + half + cols, y2.to(Y.dtype.element_ty), mask=mask)
    if BLOCK_PASS > 0:
        pcols = ROT + tl.arange(0, BLOCK_PASS)[None, :]
        pmask = hmask & (pcols < D)
        tl.store(y_base + pcols, tl.load(x_base + pcols, mask=pmask, other=0.0), mask=pmask)


def rotate(x: torch.Tensor, freqs: torch.Tensor, *, inverse: bool = False) -> torch.Tensor:
    """``x [s, b, h, d]`` (last dim contiguous) rotated by ``freqs [s, 1, 1, rot]`` (angles); a new tensor."""
    s, b, h, d = x.shape
    rot = freqs.shape[-1]
    if x.stride(-1) != 1:
        x = x.contiguous()
    f = freqs.reshape(freqs.shape[0], rot)
    if f.stride(-1) != 1:
        f = f.contiguous()
    y = torch.empty((s, b, h, d), dtype=x.dtype, device=x.device)
    if x.numel():
        _rope_kernel[(s * b,)](x, f, y, b, h, d, rot, x.stride(0), x.stride(1), x.stride(2),
                               f.stride(0) if f.shape[0] > 1 else 0, SIGN=-1 if inverse else 1,
                               BLOCK_H=triton.next_power_of_2(h), HALF=triton.next_power_of_2(rot // 2),
                               BLOCK_PASS=triton.next_power_of_2(d - rot) if d > rot else 0)
    return y
