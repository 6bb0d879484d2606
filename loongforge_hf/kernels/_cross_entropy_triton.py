"""Triton cross-entropy of one chunk of logits, for ``cross_entropy._Plan.chunk`` on one tensor-parallel rank.

One program per token row, two passes over the row in blocks: an online max and sum of exponentials (fp32), then,
when the gradient is wanted, ``softmax * (1 + 2 z lse) - onehot(label)`` (times the row's validity and optional output
grad) written over the logits in place, in their dtype. Columns at or past ``REAL_COLS`` (vocabulary padding) count as
-inf. The vocabulary sizes are compile-time constants (one compilation per model). This replaces the fp32 copy and
the eight element-wise passes of the torch path with two reads and one write. With ``STATS`` the first pass also
keeps the online sum of ``exp(x - max) * x`` (for the entropy ``lse - sum(p * x)``) and the column of the row's
first maximum (``argmax``'s pick: a later block replaces it only with a strictly larger value). With ``SMOOTH``
(label smoothing eps, over ``VOCAB`` true columns) it also keeps the row sum of the logits: the loss is
``lse - (1 - eps) * x_label - eps * sum(x) / VOCAB`` and the grad ``softmax - (1 - eps) * onehot - eps / VOCAB``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096


@triton.jit
def _ce_chunk(LOGITS, LABEL, IN_SHARD, VALID, SCALE, LOSS, ENTROPY, FIRST_MAX, z_loss, eps, inv_vocab,
              N_COLS: tl.constexpr, REAL_COLS: tl.constexpr, WITH_GRAD: tl.constexpr, HAS_SCALE: tl.constexpr,
              STATS: tl.constexpr, SMOOTH: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = LOGITS + row * N_COLS
    m = tl.full([], -float("inf"), tl.float32)
    d = tl.zeros([], tl.float32)
    xs = tl.zeros([], tl.float32)
    first = tl.zeros([], tl.int32)
    total = tl.zeros([], tl.float32)
    for start in range(0, REAL_COLS, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        real = cols < REAL_COLS
        x = tl.load(base + cols, mask=real, other=-float("inf")).to(tl.float32)
        block_max = tl.max(x, axis=0)
        m_new = tl.maximum(m, block_max)
        e = tl.exp(x - m_new)
        d = d * tl.exp(m - m_new) + tl.sum(e, axis=0)
        if STATS:
            xs = xs * tl.exp(m - m_new) + tl.sum(tl.where(real, e * x, 0.0), axis=0)
            first = tl.where(block_max > m, start + tl.argmax(x, axis=0).to(tl.int32), first)
        if SMOOTH:
            total += tl.sum(tl.where(real, x, 0.0), axis=0)
        m = m_new
    lse = m + tl.log(d)
    if STATS:
        tl.store(ENTROPY + row, lse - xs / d)
        tl.store(FIRST_MAX + row, first)
    label = tl.load(LABEL + row)
    in_shard = tl.load(IN_SHARD + row) != 0
    valid = (tl.load(VALID + row) != 0).to(tl.float32)
    target = tl.load(base + label).to(tl.float32)
    target = tl.where(in_shard, target, 0.0)
    if SMOOTH:
        loss = (lse - (1.0 - eps) * target - eps * total * inv_vocab + z_loss * lse * lse) * valid
    else:
        loss = (lse - target + z_loss * lse * lse) * valid
    tl.store(LOSS + row, loss)
    if WITH_GRAD:
        factor = valid * (1.0 + 2.0 * z_loss * lse)
        if HAS_SCALE:
            scale = tl.load(SCALE + row).to(tl.float32)
        else:
            scale = 1.0
        # NOTE: the padded columns get gradient 0 (exp(-inf)), written like the rest
        for start in range(0, N_COLS, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            inside = cols < N_COLS
            x = tl.load(base + cols, mask=inside & (cols < REAL_COLS), other=-float("inf")).to(tl.float32)
            g = tl.exp(x - lse) * factor
            if SMOOTH:
                g = tl.where(cols < REAL_COLS, g - valid * eps * inv_vocab, g)
                g = tl.where((cols == label) & in_shard, g - valid * (1.0 - eps), g) * scale
            else:
                g = tl.where((cols == label) & in_shard, g - valid, g) * scale
            tl.store(base + cols, g.to(LOGITS.dtype.element_ty), mask=inside)


def chunk_loss(logits: torch.Tensor, label: torch.Tensor, in_shard: torch.Tensor, valid: torch.Tensor, *,
               real_cols: int, z_loss: float, with_grad: bool, row_scale: torch.Tensor | None = None,
               stats: bool = False, smoothing: float = 0.0, vocab_size: int | None = None):
    """``(loss,)`` per row (fp32) of contiguous ``logits [c, V]``, plus each row's entropy (fp32) and first-maximum
    column (int32) with ``stats``; with ``with_grad`` the logits become d(loss)/d(logits)."""
    c, v = logits.shape
    assert logits.stride(1) == 1 and logits.stride(0) == v
    loss = torch.empty(c, dtype=torch.float32, device=logits.device)
    entropy = torch.empty(c if stats else 0, dtype=torch.float32, device=logits.device)
    first_max = torch.empty(c if stats else 0, dtype=torch.int32, device=logits.device)
    if c:
        _ce_chunk[(c,)](logits, label, in_shard, valid, row_scale if row_scale is not None else loss, loss,
                        entropy if stats else loss, first_max if stats else loss, float(z_loss), float(smoothing),
                        1.0 / (vocab_size or real_cols), N_COLS=v, REAL_COLS=real_cols, WITH_GRAD=with_grad,
                        HAS_SCALE=row_scale is not None, STATS=stats, SMOOTH=bool(smoothing), BLOCK=BLOCK,
                        num_warps=8)
    return (loss, entropy, first_max) if stats else (loss,)
