"""Triton rotary embedding for megatron's ``[s, b, heads, d]`` layout, rotate-half pairs, forward and backward.

One program rotates a tile ``[BLOCK_S, BLOCK_R, HALF]`` per half: ``BLOCK_S`` positions times ``BLOCK_R`` of
their ``b x heads`` rows (a second grid axis walks the row chunks), the rows of a position sharing its ``cos`` and
``sin``, loaded once per position and program and broadcast over the rows. Tiles are sized for enough loads in flight
per SM (``TILE``; one program per token of 16 heads x 128 left the kernel at about half its bandwidth bound).

``cos`` and ``sin`` of the angles are fp32 tables ``[positions, rot]`` computed by torch once per angle tensor
(``cos_sin``; megatron passes the same cached angles to the q and k rotations of every layer, forward and backward),
not in the kernel: computed there, every thread evaluated the cos/sin of each column it holds, about one accurate
fp32 ``sin``/``cos`` pair per element, which cost about as much time as moving the data. The tables are what
megatron's unfused rotation computes (``torch.cos(freqs)``), read per half as given (megatron's angles are
``cat(f, f)``, which the kernel does not assume).

The rotation runs in fp32 and rounds once to the input dtype; channels past ``rot`` are copied. The backward is the
rotation by the negated angle, ``dx = dy * cos + rotate_half^T(dy * sin)``. The input may be a strided view (q, k
split off the fused QKV projection: any strides over ``s``, ``b``, ``heads``, last dim contiguous); the output is
contiguous.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_kernel(X, COS, SIN, Y, S, ROWS, H, D, ROT, stride_xs, stride_xb, stride_xh, stride_fs, SIGN: tl.constexpr,
                 BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr, HALF: tl.constexpr,
                 BLOCK_PASS: tl.constexpr):
    half = ROT // 2
    pos = tl.program_id(0).to(tl.int64) * BLOCK_S + tl.arange(0, BLOCK_S)[:, None, None]   # [BLOCK_S, 1, 1]
    cols = tl.arange(0, HALF)[None, None, :]                                               # [1, 1, HALF]
    smask = pos < S
    fmask = smask & (cols < half)
    # NOTE: each half's cos and sin read as given, once per position and program, shared by its b x heads rows.
    f_off = pos * stride_fs + cols
    c1 = tl.load(COS + f_off, mask=fmask, other=0.0)
    c2 = tl.load(COS + f_off + half, mask=fmask, other=0.0)
    s1 = tl.load(SIN + f_off, mask=fmask, other=0.0)
    s2 = tl.load(SIN + f_off + half, mask=fmask, other=0.0)
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)[None, :, None]      # [1, BLOCK_R, 1]: b * H + h
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


# Elements of one half-tile ([BLOCK_S, BLOCK_R, HALF]) of a program, 8 a thread at most: ptxas (sm_90, bf16) gives
# 2048-element tiles of 8 warps 48 registers a thread, five programs (40 warps, 40 KiB of loads) resident per SM;
# 4096-element tiles of 8 warps took 90, two programs.
TILE = 2048


def launch_config(s: int, b: int, h: int, d: int, rot: int) -> dict:
    """Block sizes and warps of one ``rotate`` call (pure arithmetic, no device)."""
    half_block = triton.next_power_of_2(max(rot // 2, 1))
    block_r = min(triton.next_power_of_2(b * h), max(1, TILE // half_block))
    block_s = min(triton.next_power_of_2(s), max(1, TILE // (block_r * half_block)))
    elements = block_s * block_r * half_block
    warps = max(1, min(8, elements // 256))
    return dict(chunks=triton.cdiv(b * h, block_r), BLOCK_S=block_s, BLOCK_R=block_r, HALF=half_block,
                BLOCK_PASS=triton.next_power_of_2(d - rot) if d > rot else 0, num_warps=warps)


def cos_sin(freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``cos`` and ``sin`` ``[positions, rot]`` of ``freqs [positions, 1, 1, rot]``, computed once per angle
    tensor: megatron hands the same (cached) angles to the q and k rotations of every layer, forward and backward.

    NOTE: the tables live on the angle tensor itself (an attribute, with its version counter), not in a global cache:
    they die with it, no other tensor can be served them (no pointer keys), and under CUDA graphs a table made during
    capture lives as long as the graph's static input it was made from."""
    try:
        version = freqs._version
    except RuntimeError:   # NOTE: inference tensors keep no version counter: not kept
        version = None
    kept = getattr(freqs, "_loongforge_cos_sin", None)
    if kept is not None and version is not None and kept[0] == version:
        return kept[1], kept[2]
    f = freqs.reshape(freqs.shape[0], freqs.shape[-1]).to(torch.float32)
    cos, sin = torch.cos(f).contiguous(), torch.sin(f).contiguous()
    if version is not None:
        freqs._loongforge_cos_sin = (version, cos, sin)
    return cos, sin


def rotate(x: torch.Tensor, freqs: torch.Tensor, *, inverse: bool = False) -> torch.Tensor:
    """``x [s, b, h, d]`` (last dim contiguous) rotated by ``freqs [s, 1, 1, rot]`` (angles); a new tensor."""
    s, b, h, d = x.shape
    rot = freqs.shape[-1]
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty((s, b, h, d), dtype=x.dtype, device=x.device)
    if x.numel():
        cos, sin = cos_sin(freqs)
        config = launch_config(s, b, h, d, rot)
        chunks = config.pop("chunks")
        _rope_kernel[(triton.cdiv(s, config["BLOCK_S"]), chunks)](
            x, cos, sin, y, s, b * h, h, d, rot, x.stride(0), x.stride(1), x.stride(2),
            cos.stride(0) if cos.shape[0] > 1 else 0, SIGN=-1 if inverse else 1, **config)
    return y
