"""Triton rotary embedding for megatron's ``[s, b, heads, d]`` layout, rotate-half pairs, forward and backward.

One program rotates ``BLOCK_S`` positions, every batch row and head of each: the rows of one position (its
``b x heads`` pairs, walked in chunks of ``BLOCK_R``) share that position's angles, so ``cos`` and ``sin`` of
``freqs[s, 0, 0, :rot]`` are computed once per position and program in fp32 registers (never materialised), then
broadcast over the rows. A tile is ``[BLOCK_S, BLOCK_R, HALF]`` per half, sized to a few thousand elements so that
each program keeps enough loads in flight (one program per token of 16 heads x 128 left the kernel at about half its
bandwidth bound, and recomputed the same angles for every batch row). Each half's angles are read as given (megatron's
are ``cat(f, f)``, which the kernel does not assume). The rotation runs in fp32 and rounds once to the input dtype;
channels past ``rot`` are copied. The backward is the rotation by the negated angle,
``dx = dy * cos + rotate_half^T(dy * sin)``. The input may be a strided view (q, k split off the fused QKV projection:
any strides over ``s``, ``b``, ``heads``, last dim contiguous); the output is contiguous.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_kernel(X, F, Y, S, ROWS, H, D, ROT, stride_xs, stride_xb, stride_xh, stride_fs, SIGN: tl.constexpr,
                 CHUNKS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr, HALF: tl.constexpr,
                 BLOCK_PASS: tl.constexpr):
    half = ROT // 2
    pos = tl.program_id(0).to(tl.int64) * BLOCK_S + tl.arange(0, BLOCK_S)[:, None, None]   # [BLOCK_S, 1, 1]
    cols = tl.arange(0, HALF)[None, None, :]                                               # [1, 1, HALF]
    smask = pos < S
    fmask = smask & (cols < half)
    # NOTE: each half's angles read as given; cos and sin once per position, shared by all b x heads rows.
    f_base = F + pos * stride_fs + cols
    f1 = tl.load(f_base, mask=fmask, other=0.0).to(tl.float32)
    f2 = tl.load(f_base + half, mask=fmask, other=0.0).to(tl.float32)
    c1, s1, c2, s2 = tl.cos(f1), tl.sin(f1), tl.cos(f2), tl.sin(f2)
    # NOTE: CHUNKS = cdiv(ROWS, BLOCK_R) is a compile-time count (1 for megatron's q and k at micro-batch <= 4).
    for chunk in range(CHUNKS):
        r = chunk * BLOCK_R + tl.arange(0, BLOCK_R)[None, :, None]                       # [1, BLOCK_R, 1]: b * H + h
        rmask = smask & (r < ROWS)
        mask = rmask & (cols < half)
        x_base = X + pos * stride_xs + (r // H).to(tl.int64) * stride_xb + (r % H).to(tl.int64) * stride_xh
        y_base = Y + (pos * ROWS + r) * D
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
            pcols = ROT + tl.arange(0, BLOCK_PASS)[None, None, :]
            pmask = rmask & (pcols < D)
            tl.store(y_base + pcols, tl.load(x_base + pcols, mask=pmask, other=0.0), mask=pmask)


# Elements of one half-tile ([BLOCK_S, BLOCK_R, HALF]) a program rotates per loop step: with both halves loaded that
# is 16 KiB of bf16 in flight per program at the cap.
TILE = 4096


def launch_config(s: int, b: int, h: int, d: int, rot: int) -> dict:
    """Block sizes and warps of one ``rotate`` call (pure arithmetic, no device)."""
    half_block = triton.next_power_of_2(max(rot // 2, 1))
    block_r = min(triton.next_power_of_2(b * h), max(1, TILE // half_block))
    block_s = min(triton.next_power_of_2(s), max(1, TILE // (block_r * half_block)))
    elements = block_s * block_r * half_block
    warps = 1 if elements <= 256 else 2 if elements <= 512 else 4 if elements <= 2048 else 8
    return dict(CHUNKS=triton.cdiv(b * h, block_r), BLOCK_S=block_s, BLOCK_R=block_r, HALF=half_block,
                BLOCK_PASS=triton.next_power_of_2(d - rot) if d > rot else 0, num_warps=warps)


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
        config = launch_config(s, b, h, d, rot)
        _rope_kernel[(triton.cdiv(s, config["BLOCK_S"]),)](
            x, f, y, s, b * h, h, d, rot, x.stride(0), x.stride(1), x.stride(2), f.stride(0) if f.shape[0] > 1 else 0,
            SIGN=-1 if inverse else 1, **config)
    return y
