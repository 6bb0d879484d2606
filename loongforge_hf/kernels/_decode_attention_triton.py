"""Triton split-key attention for a few query rows over many keys, with the log-sum-exp: the partial attention of a
decode step over one rank's share of a KV cache sharded over context parallelism (``attention.partial_attention``).

Flash-decoding's split: a one-token query has too little work per (batch, key head) to fill a GPU, so the keys are
cut into splits (a fixed count per batch x key heads and GPU: ``split_count``), one program per (batch, key head,
split). Each program loads its key head's query rows once (the query heads of a grouped-query group and the step's
positions, ``GROUPS x SQ`` rows, padded to at least 16 for ``tl.dot``), walks its split in blocks of ``BLOCK_N``
keys with an online softmax (fp32 scores and statistics; the probabilities rounded to the values' dtype for
``p @ v``, as flash attention does) and writes its output and log-sum-exp, packed in one fp32 tensor
(``split_partials``). A second kernel combines the splits of each row by their
log-sum-exps (``combine``); for a CP-sharded cache the splits of every CP rank are all-gathered first and combined
in one pass, straight into the query's dtype (``attention.sharded_attention``). Keys and values are read in place
through their strides (a slice of a longer cache buffer is not copied); ``allowed`` may be broadcast over the
batch. Rows with no allowed key give zeros and a log-sum-exp of -inf.

NOTE: off CUDA (Triton's interpreter) the operands of ``tl.dot`` are widened to fp32 first (``DOT_FP32``): the
interpreter multiplies bf16 operands as their raw 16-bit patterns (a 16 x 16 product off by ~1e10). The probabilities
are still rounded to the values' dtype first, as on the GPU.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

BLOCK_N = 64
MAX_ROWS = 64  # NOTE: query rows (GROUPS x SQ) one program holds; more go to the blocked path
_LN2 = math.log(2.0)


@triton.jit
def _split_attention(Q, K, V, ALLOWED, PARTS, sq_b, sq_h, sq_s, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, sa_b, sa_s,
                     sa_n, H_KV, N, SQ, SPLIT_LEN, ROWS_TOTAL, scale_log2, GROUPS: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                     BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, DOT_FP32: tl.constexpr):
    pair = tl.program_id(0)
    split = tl.program_id(1)
    b = (pair // H_KV).to(tl.int64)
    kv_head = (pair % H_KV).to(tl.int64)
    rows = tl.arange(0, BLOCK_M)
    live_rows = rows < GROUPS * SQ
    group = rows // SQ
    pos = rows % SQ
    head = kv_head * GROUPS + group
    dq = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q = tl.load(Q + b * sq_b + head[:, None] * sq_h + pos[:, None] * sq_s + dq[None, :],
                mask=live_rows[:, None] & (dq[None, :] < D), other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    best = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    mass = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    first = split * SPLIT_LEN
    k_base = K + b * sk_b + kv_head * sk_h
    v_base = V + b * sv_b + kv_head * sv_h
    for start in range(first, tl.minimum(first + SPLIT_LEN, N), BLOCK_N):  # NOTE: a split past N does nothing
        keys = start + tl.arange(0, BLOCK_N)
        live_keys = keys < N
        k = tl.load(k_base + keys[None, :].to(tl.int64) * sk_n + dq[:, None],
                    mask=live_keys[None, :] & (dq[:, None] < D), other=0.0)
        if DOT_FP32:
            k = k.to(tl.float32)
        scores = tl.dot(q, k) * scale_log2  # NOTE: [BLOCK_M, BLOCK_N] fp32, in log2 units
        ok = tl.load(ALLOWED + b * sa_b + pos[:, None] * sa_s + keys[None, :] * sa_n,
                     mask=live_rows[:, None] & live_keys[None, :], other=0)
        scores = tl.where(ok != 0, scores, float("-inf"))
        top = tl.maximum(best, tl.max(scores, axis=1))
        shift = tl.where(top == float("-inf"), 0.0, top)  # NOTE: no key yet: exp2(-inf) = 0 everywhere
        rescale = tl.exp2(best - shift)
        p = tl.exp2(scores - shift[:, None])
        mass = mass * rescale + tl.sum(p, axis=1)
        v = tl.load(v_base + keys[:, None].to(tl.int64) * sv_n + dv[None, :],
                    mask=live_keys[:, None] & (dv[None, :] < DV), other=0.0)
        p = p.to(v.dtype)
        if DOT_FP32:
            p, v = p.to(tl.float32), v.to(tl.float32)
        acc = acc * rescale[:, None] + tl.dot(p, v)
        best = top
    some = mass > 0.0
    out = acc / tl.where(some, mass, 1.0)[:, None]
    lse = tl.where(some, (best + tl.log2(tl.where(some, mass, 1.0))) * 0.6931471805599453, float("-inf"))
    # NOTE: PARTS [splits, b h sq, DV + 1] fp32: each row's output, then its log-sum-exp; row (b, head, pos) is
    # (b h + head) sq + pos
    row_ids = (b * H_KV * GROUPS + head) * SQ + pos
    base = PARTS + (split * ROWS_TOTAL + row_ids) * (DV + 1)
    tl.store(base[:, None] + dv[None, :], out, mask=live_rows[:, None] & (dv[None, :] < DV))
    tl.store(base + DV, lse, mask=live_rows)


@triton.jit
def _combine_parts(PARTS, OUT, LSE, COUNT, ROWS_TOTAL, DV: tl.constexpr, BLOCK_P: tl.constexpr,
                   BLOCK_DV: tl.constexpr, WRITE_LSE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    parts = tl.arange(0, BLOCK_P)
    live = parts < COUNT
    dv = tl.arange(0, BLOCK_DV)
    base = PARTS + (parts.to(tl.int64) * ROWS_TOTAL + row) * (DV + 1)
    lses = tl.load(base + DV, mask=live, other=float("-inf"))
    top = tl.max(lses, axis=0)
    shift = tl.where(top == float("-inf"), 0.0, top)
    weights = tl.exp(lses - shift)  # NOTE: 0 for an empty part (and for a row no part attends anywhere)
    total = tl.sum(weights, axis=0)
    outs = tl.load(base[:, None] + dv[None, :], mask=live[:, None] & (dv[None, :] < DV), other=0.0)
    out = tl.sum(weights[:, None] * outs, axis=0) / tl.where(total > 0.0, total, 1.0)
    tl.store(OUT + row * DV + dv, out, mask=dv < DV)  # NOTE: in OUT's dtype
    if WRITE_LSE:
        tl.store(LSE + row, tl.where(total > 0.0, shift + tl.log(tl.where(total > 0.0, total, 1.0)), float("-inf")))


def usable(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Shapes the kernels take: grouped-query heads, at most ``MAX_ROWS`` query rows per key head, head sizes up to
    256, the last dimension contiguous; on a GPU bf16 / fp16 (``tl.dot`` would take fp32 as TF32)."""
    b, h, sq, d = query.shape
    h_kv = key.shape[1]
    return ((query.dtype in (torch.bfloat16, torch.float16) or not query.is_cuda) and h % h_kv == 0
            and (h // h_kv) * sq <= MAX_ROWS and d <= 256 and value.shape[-1] <= 256
            and query.stride(-1) == key.stride(-1) == value.stride(-1) == 1 and key.dtype == query.dtype)


def split_count(batch: int, key_heads: int, device: torch.device) -> int:
    """How many splits of the keys: about two programs per SM over the batch's key heads (a fixed number for a GPU
    and shape, whatever the keys' length: the same on every rank holding a share, and in a CUDA graph)."""
    if device.type == "cuda":
        from loongforge_hf.xpu import get_backend

        programs = 2 * get_backend().multiprocessor_count(device)
    else:
        programs = 4  # NOTE: Triton's interpreter
    return max(1, min(64, triton.cdiv(programs, batch * key_heads)))


def split_partials(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, allowed: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """Each split's attention of ``query [b, h, sq, d]`` over its part of ``key / value [b, h_kv, n, d]`` under
    ``allowed`` (``attention.partial_attention``'s arguments) -> ``[splits, b h sq, d_v + 1]`` fp32: the outputs and,
    in the last column, their log-sum-exps, what ``combine`` takes (stacked over CP ranks too)."""
    b, h, sq, d = query.shape
    h_kv, n, d_v = key.shape[1], key.shape[-2], value.shape[-1]
    allowed = (allowed if allowed.dtype == torch.bool else allowed != 0).expand(b, 1, sq, n).view(torch.uint8)
    splits = split_count(b, h_kv, query.device)
    split_len = max(1, triton.cdiv(triton.cdiv(n, splits), BLOCK_N)) * BLOCK_N  # NOTE: whole key blocks
    rows_total = b * h * sq
    parts = torch.empty((splits, rows_total, d_v + 1), dtype=torch.float32, device=query.device)
    groups = h // h_kv
    _split_attention[(b * h_kv, splits)](
        query, key, value, allowed, parts, query.stride(0), query.stride(1), query.stride(2),
        key.stride(0), key.stride(1), key.stride(2), value.stride(0), value.stride(1), value.stride(2),
        allowed.stride(0), allowed.stride(2), allowed.stride(3), h_kv, n, sq, split_len, rows_total,
        scale / _LN2, GROUPS=groups, BLOCK_M=max(16, triton.next_power_of_2(groups * sq)), BLOCK_N=BLOCK_N, D=d,
        DV=d_v, BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_DV=max(16, triton.next_power_of_2(d_v)),
        DOT_FP32=not query.is_cuda)
    return parts


def combine(parts: torch.Tensor, shape: tuple, *, dtype: torch.dtype = torch.float32, with_lse: bool = True):
    """``split_partials``' results, any number stacked (``[count, rows, d_v + 1]``: the splits of one rank or of
    every CP rank) -> the attention over all their keys ``shape [b, h, sq, d_v]`` in ``dtype`` (and its log-sum-exp
    ``[b, h, sq]`` fp32 with ``with_lse``). Rows no part attends anywhere give zeros (and -inf)."""
    count, rows_total, width = parts.shape
    out = torch.empty(shape, dtype=dtype, device=parts.device)
    lse = torch.empty(shape[:-1], dtype=torch.float32, device=parts.device) if with_lse else out
    _combine_parts[(rows_total,)](parts, out, lse, count, rows_total, DV=width - 1,
                                  BLOCK_P=triton.next_power_of_2(count),
                                  BLOCK_DV=max(16, triton.next_power_of_2(width - 1)), WRITE_LSE=with_lse)
    return (out, lse) if with_lse else out


def partial_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, allowed: torch.Tensor,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``attention.partial_attention`` (same arguments and results) through the two kernels above."""
    b, h, sq, _ = query.shape
    return combine(split_partials(query, key, value, allowed=allowed, scale=scale), (b, h, sq, value.shape[-1]))
