"""Lightning attention (MiniMax-Text-01 / M1's linear-attention layers): causal linear attention with a fixed decay
per head, ``o_t = sum_{s <= t} exp(-slope * (t - s)) (q_t . k_s) v_s``, run block by block in torch.

Choices:
- The block form of transformers' ``MiniMaxLightningAttention`` with its own decay tables (``query_decay``,
  ``key_decay``, ``diagonal_decay``, ``slope_rate``: persistent buffers, in the checkpoint): within a block the
  scores times the diagonal decay, across blocks the carried ``k^T v`` state ``[b, heads, d, d]`` scaled by the block's
  decay. The same tables and the same order of operations as transformers, so fp32 results agree to rounding; the
  tables come from the caller (loaded from the checkpoint), ``decay_tables`` builds them as transformers does.
- Plain torch ops (autograd gives the backward); no fused kernel: the state is ``d x d`` per head and the blocks few.
- ``initial_state`` / ``output_final_state`` carry the state across calls (packed documents run one call each).
"""

from __future__ import annotations

import torch


def slope_rates(heads: int, *, layer: int, num_layers: int) -> torch.Tensor:
    """transformers' ``get_slope_rate``: ``[heads, 1, 1]`` fp32, ``(2^(-8 / heads))^(h + 1)`` scaled down by depth."""
    base = 1 / (2 ** (8 / heads))
    exponent = torch.arange(heads) + 1
    factor = 1 - layer / (num_layers - 1 + 1e-5) + 1e-5
    return (base ** exponent * factor)[:, None, None]


def decay_tables(slope_rate: torch.Tensor, block_size: int):
    """transformers' ``decay_factors``: ``query_decay`` / ``key_decay`` ``[heads, block, 1]`` and ``diagonal_decay``
    ``[1, heads, block, block]`` (zero above the diagonal) from ``slope_rate`` ``[heads, 1, 1]``."""
    steps = torch.arange(block_size, device=slope_rate.device) + 1
    query_decay = torch.exp(-slope_rate * steps[:, None])
    key_decay = torch.exp(-slope_rate * (block_size - steps[:, None]))
    diagonal = slope_rate * (steps[:, None] - steps[None, :])[None, None]
    diagonal = torch.exp(torch.where(diagonal >= 0, -diagonal, float("-inf")))
    return query_decay, key_decay, diagonal


def lightning_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, slope_rate: torch.Tensor,
                        query_decay: torch.Tensor, key_decay: torch.Tensor, diagonal_decay: torch.Tensor,
                        initial_state: torch.Tensor | None = None, output_final_state: bool = False):
    """``q``, ``k``, ``v`` ``[b, heads, s, d]`` -> the output ``[b, heads, s, d]`` (and, with ``output_final_state``,
    the ``k^T v`` state ``[b, heads, d, d]``), from ``initial_state`` (None: zeros). The tables are transformers'
    buffers for these heads (``decay_tables``); their block length is the block size."""
    batch, heads, seq, dim = q.shape
    block = query_decay.shape[1]
    state = initial_state if initial_state is not None else q.new_zeros(batch, heads, dim, dim)
    outputs = []
    for start in range(0, seq, block):
        stop = min(start + block, seq)
        size = stop - start
        qb, kb, vb = q[:, :, start:stop], k[:, :, start:stop], v[:, :, start:stop]
        intra = torch.matmul(torch.matmul(qb, kb.transpose(-1, -2)) * diagonal_decay[:, :, :size, :size], vb)
        inter = torch.matmul(qb * query_decay[:, :size], state)
        outputs.append(inter + intra)
        block_decay = torch.exp(-slope_rate * size)
        state = state * block_decay + torch.matmul((kb * key_decay[:, -size:]).transpose(-1, -2), vb)
    out = torch.cat(outputs, dim=-2) if outputs else q.new_zeros(q.shape)
    return (out, state) if output_final_state else out
