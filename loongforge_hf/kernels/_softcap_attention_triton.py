"""Triton kernels of ``softcap_attention``: flash-style attention whose scores are soft-capped (``cap * tanh(s / cap)``,
Gemma 2), forward and backward, without materialising the ``[b, h, sq, skv]`` scores.

One program takes a block of queries (forward, dq) or of keys (dk / dv) of one batch row and query head; the scores of
a tile are recomputed from q and k in fp32, capped, masked (causal / window bounds relative to each query's position,
megatron's bool mask where given: True = masked), then softmaxed online (forward) or against the forward's
log-sum-exp (backward). The cap's derivative ``1 - tanh^2`` multiplies the score gradient. ``tanh`` is written with
``exp`` (``1 - 2 / (exp(2x) + 1)``), which the interpreter runs too.

NOTE: off CUDA (Triton's interpreter) the operands of ``tl.dot`` are widened to fp32 first (``DOT_FP32``), as in
``_decode_attention_triton``: the interpreter multiplies bf16 operands as their raw bit patterns. Probabilities and
score gradients are still rounded to the inputs' dtype first, as on the GPU.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _mm(a, b, DOT_FP32: tl.constexpr):
    if DOT_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    return tl.dot(a, b)


@triton.jit
def _capped_scores(q, k, scale, cap, SOFTCAP: tl.constexpr, DOT_FP32: tl.constexpr):
    """(capped scores, tanh) of a ``[BM, D] x [BN, D]`` tile in fp32."""
    s = _mm(q, tl.trans(k), DOT_FP32) * scale
    if SOFTCAP:
        t = 1.0 - 2.0 / (tl.exp(2.0 * s / cap) + 1.0)
        return cap * t, t
    return s, s


@triton.jit
def _allowed(offs_m, offs_n, b, sq, skv, q_offset, left, right, M, smb, smq, smk,
             CAUSAL: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_MASK: tl.constexpr):
    """Which (query, key) pairs of the tile may attend."""
    rel = offs_n[None, :] - (q_offset + offs_m[:, None])
    ok = (offs_m[:, None] < sq) & (offs_n[None, :] < skv)
    if CAUSAL:
        ok = ok & (rel <= 0)
    if HAS_LEFT:
        ok = ok & (rel >= -left)
    if HAS_RIGHT:
        ok = ok & (rel <= right)
    if HAS_MASK:
        masked = tl.load(M + b * smb + offs_m[:, None] * smq + offs_n[None, :] * smk, mask=ok, other=1)
        ok = ok & (masked == 0)
    return ok


@triton.jit
def _key_range(start_m, sq, skv, q_offset, left, right, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               CAUSAL: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """[lo, hi) of the keys any query of the block ``start_m`` may see, ``lo`` a multiple of BLOCK_N."""
    lo = 0
    hi = skv
    last = q_offset + tl.minimum(start_m + BLOCK_M, sq) - 1
    if CAUSAL:
        hi = tl.minimum(hi, last + 1)
    if HAS_RIGHT:
        hi = tl.minimum(hi, last + right + 1)
    if HAS_LEFT:
        lo = tl.maximum(0, q_offset + start_m - left)
        lo = (lo // BLOCK_N) * BLOCK_N
    return lo, hi


@triton.jit
def _rows(X, base, offs, stride, offs_d, ok):
    """Rows ``offs`` of a ``[.., s, D]`` tensor at ``base`` (zeros where not ``ok``)."""
    return tl.load(X + base + offs[:, None] * stride + offs_d[None, :], mask=ok, other=0.0)


@triton.jit
def _probs_and_score_grads(q, k, v, do, lse, delta, offs_m, offs_n, b, sq, skv, q_offset, scale, cap, left, right,
                           M, smb, smq, smk, SOFTCAP: tl.constexpr, CAUSAL: tl.constexpr, HAS_LEFT: tl.constexpr,
                           HAS_RIGHT: tl.constexpr, HAS_MASK: tl.constexpr, DOT_FP32: tl.constexpr):
    """A tile's probabilities (from the forward's log-sum-exp) and the gradient of its raw scores, the cap's
    ``1 - tanh^2`` included."""
    s, t = _capped_scores(q, k, scale, cap, SOFTCAP, DOT_FP32)
    ok = _allowed(offs_m, offs_n, b, sq, skv, q_offset, left, right, M, smb, smq, smk,
                  CAUSAL, HAS_LEFT, HAS_RIGHT, HAS_MASK)
    p = tl.where(ok, tl.exp(s - lse[:, None]), 0.0)
    ds = p * (_mm(do, tl.trans(v), DOT_FP32) - delta[:, None])
    if SOFTCAP:
        ds = ds * (1.0 - t * t)
    return p, ds


@triton.jit
def _forward(Q, K, V, M, Out, LSE,
             sqb, sqh, sqs, skb, skh, sks, svb, svh, svs, sob, soh, sos, smb, smq, smk,
             H, sq, skv, q_offset, scale, cap, left, right,
             GROUPS: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
             BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr, CAUSAL: tl.constexpr, HAS_LEFT: tl.constexpr,
             HAS_RIGHT: tl.constexpr, HAS_MASK: tl.constexpr, DOT_FP32: tl.constexpr):
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    hk = h // GROUPS
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    q = _rows(Q, b * sqb + h * sqh, offs_m, sqs, offs_d, (offs_m[:, None] < sq) & d_ok[None, :])
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    lo, hi = _key_range(start_m, sq, skv, q_offset, left, right, BLOCK_M, BLOCK_N, CAUSAL, HAS_LEFT, HAS_RIGHT)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kv_ok = (offs_n[:, None] < skv) & d_ok[None, :]
        k = _rows(K, b * skb + hk * skh, offs_n, sks, offs_d, kv_ok)
        v = _rows(V, b * svb + hk * svh, offs_n, svs, offs_d, kv_ok)
        s, _ = _capped_scores(q, k, scale, cap, SOFTCAP, DOT_FP32)
        ok = _allowed(offs_m, offs_n, b, sq, skv, q_offset, left, right, M, smb, smq, smk,
                      CAUSAL, HAS_LEFT, HAS_RIGHT, HAS_MASK)
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # NOTE: a row with no key yet
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _mm(p.to(v.dtype), v, DOT_FP32)
        m_i = m_new
    empty = l_i == 0.0  # NOTE: a row with no allowed key: zeros, and a log-sum-exp that gives p = 0 in backward
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("inf"), m_i + tl.log(tl.where(empty, 1.0, l_i)))
    tl.store(Out + b * sob + h * soh + offs_m[:, None] * sos + offs_d[None, :], out.to(Out.dtype.element_ty),
             mask=(offs_m[:, None] < sq) & d_ok[None, :])
    tl.store(LSE + bh * sq + offs_m, lse, mask=offs_m < sq)


@triton.jit
def _backward_dkdv(Q, K, V, M, DO, LSE, DELTA, DK, DV,
                   sqb, sqh, sqs, skb, skh, sks, svb, svh, svs, sob, soh, sos, smb, smq, smk,
                   H, sq, skv, q_offset, scale, cap, left, right,
                   GROUPS: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr, CAUSAL: tl.constexpr, HAS_LEFT: tl.constexpr,
                   HAS_RIGHT: tl.constexpr, HAS_MASK: tl.constexpr, DOT_FP32: tl.constexpr):
    """dk / dv of one key block for one query head (``DK / DV [b, h, skv, D]``: the caller sums a group's heads)."""
    start_n = tl.program_id(0) * BLOCK_N
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    hk = h // GROUPS
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    kv_ok = (offs_n[:, None] < skv) & d_ok[None, :]
    k = _rows(K, b * skb + hk * skh, offs_n, sks, offs_d, kv_ok)
    v = _rows(V, b * svb + hk * svh, offs_n, svs, offs_d, kv_ok)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    # NOTE: the queries that may see this block: causal / a right bound start them at its first key's position
    lo = 0
    hi = sq
    if CAUSAL:
        lo = tl.maximum(0, start_n - q_offset)
    if HAS_RIGHT:
        lo = tl.maximum(lo, start_n - right - q_offset)
    if HAS_LEFT:
        hi = tl.minimum(hi, tl.minimum(start_n + BLOCK_N, skv) - 1 + left - q_offset + 1)
    lo = (lo // BLOCK_M) * BLOCK_M
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q_ok = (offs_m[:, None] < sq) & d_ok[None, :]
        q = _rows(Q, b * sqb + h * sqh, offs_m, sqs, offs_d, q_ok)
        do = _rows(DO, b * sob + h * soh, offs_m, sos, offs_d, q_ok)
        lse = tl.load(LSE + bh * sq + offs_m, mask=offs_m < sq, other=float("inf"))
        delta = tl.load(DELTA + bh * sq + offs_m, mask=offs_m < sq, other=0.0)
        p, ds = _probs_and_score_grads(q, k, v, do, lse, delta, offs_m, offs_n, b, sq, skv, q_offset, scale, cap,
                                       left, right, M, smb, smq, smk, SOFTCAP, CAUSAL, HAS_LEFT, HAS_RIGHT,
                                       HAS_MASK, DOT_FP32)
        dv += _mm(tl.trans(p.to(do.dtype)), do, DOT_FP32)
        dk += _mm(tl.trans(ds.to(q.dtype)), q, DOT_FP32)
    out_ok = (offs_n[:, None] < skv) & d_ok[None, :]
    base = bh * skv * D + offs_n[:, None] * D + offs_d[None, :]
    tl.store(DK + base, (dk * scale).to(DK.dtype.element_ty), mask=out_ok)
    tl.store(DV + base, dv.to(DV.dtype.element_ty), mask=out_ok)


@triton.jit
def _backward_dq(Q, K, V, M, DO, LSE, DELTA, DQ,
                 sqb, sqh, sqs, skb, skh, sks, svb, svh, svs, sob, soh, sos, smb, smq, smk,
                 H, sq, skv, q_offset, scale, cap, left, right,
                 GROUPS: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr, CAUSAL: tl.constexpr, HAS_LEFT: tl.constexpr,
                 HAS_RIGHT: tl.constexpr, HAS_MASK: tl.constexpr, DOT_FP32: tl.constexpr):
    """dq of one query block (``DQ [b, h, sq, D]``, contiguous)."""
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    hk = h // GROUPS
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    q_ok = (offs_m[:, None] < sq) & d_ok[None, :]
    q = _rows(Q, b * sqb + h * sqh, offs_m, sqs, offs_d, q_ok)
    do = _rows(DO, b * sob + h * soh, offs_m, sos, offs_d, q_ok)
    lse = tl.load(LSE + bh * sq + offs_m, mask=offs_m < sq, other=float("inf"))
    delta = tl.load(DELTA + bh * sq + offs_m, mask=offs_m < sq, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    lo, hi = _key_range(start_m, sq, skv, q_offset, left, right, BLOCK_M, BLOCK_N, CAUSAL, HAS_LEFT, HAS_RIGHT)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kv_ok = (offs_n[:, None] < skv) & d_ok[None, :]
        k = _rows(K, b * skb + hk * skh, offs_n, sks, offs_d, kv_ok)
        v = _rows(V, b * svb + hk * svh, offs_n, svs, offs_d, kv_ok)
        _, ds = _probs_and_score_grads(q, k, v, do, lse, delta, offs_m, offs_n, b, sq, skv, q_offset, scale, cap,
                                       left, right, M, smb, smq, smk, SOFTCAP, CAUSAL, HAS_LEFT, HAS_RIGHT,
                                       HAS_MASK, DOT_FP32)
        dq += _mm(ds.to(k.dtype), k, DOT_FP32)
    tl.store(DQ + bh * sq * D + offs_m[:, None] * D + offs_d[None, :], (dq * scale).to(DQ.dtype.element_ty),
             mask=q_ok)
