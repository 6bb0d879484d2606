"""Triton cross-entropy of one chunk of logits, for ``cross_entropy._Plan.chunk`` on one tensor-parallel rank.

One program per token row, two passes over the row in blocks: an online max and sum of exponentials (fp32), then,
when the gradient is wanted, ``softmax * (1 + 2 z lse) - onehot(label)`` (times the row's validity and optional output
grad) written over the logits in place, in their dtype. Columns at or past ``REAL_COLS`` (vocabulary padding) count as
-inf. The vocabulary sizes are compile-time constants (one compilation per model). This replaces the fp32 copy and
the eight element-wise passes of the torch path with two reads and one write.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096


@triton.jit
def _ce_chunk(LOGITS, LABEL, IN_SHARD, VALID, SCALE, LOSS, z_loss, N_COLS: tl.constexpr, REAL_COLS: tl.constexpr,
              WITH_GRAD: tl.constexpr, HAS_SCALE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = LOGITS + row * N_COLS
    m = tl.full([], -float("inf"), tl.float32)
    d = tl.zeros([], tl.float32)
    for start in range(0, REAL_COLS, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < REAL_COLS, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        d = d * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    lse = m + tl.log(d)
    label = tl.load(LABEL + row)
    in_shard = tl.load(IN_SHARD + row) != 0
    valid = (tl.load(VALID + row) != 0).to(tl.float32)
    target = tl.load(base + label).to(tl.float32)
    target = tl.where(in_shard, target, 0.0)
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
            g = tl.where((cols == label) & in_shard, g - valid, g) * scale
            tl.store(base + cols, g.to(LOGITS.dtype.element_ty), mask=inside)


def chunk_loss(logits: torch.Tensor, label: torch.Tensor, in_shard: torch.Tensor, valid: torch.Tensor, *,
               real_cols: int, z_loss: float, with_grad: bool, row_scale: torch.Tensor | None = None):
    """Per-row loss (fp32) of contiguous ``logits [c, V]``; with ``with_grad`` the logits become d(loss)/d(logits)."""
    c, v = logits.shape
    assert logits.stride(1) == 1 and logits.stride(0) == v
    loss = torch.empty(c, dtype=torch.float32, device=logits.device)
    if c:
        _ce_chunk[(c,)](logits, label, in_shard, valid, row_scale if row_scale is not None else loss, loss,
                        float(z_loss), N_COLS=v, REAL_COLS=real_cols, WITH_GRAD=with_grad,
                        HAS_SCALE=row_scale is not None, BLOCK=BLOCK, num_warps=8)
    return loss
