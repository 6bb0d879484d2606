"""Plain-torch attention the kernels are checked against: repeated K/V heads, a materialised mask, softmax in fp32."""

import torch


def allowed_mask(sq: int, skv: int, *, causal: bool, window=None, q_offset=None) -> torch.Tensor:
    """Bool [sq, skv], True where query i (at key position q_offset + i, default skv - sq) may attend key j."""
    q_offset = skv - sq if q_offset is None else q_offset
    q_pos = torch.arange(q_offset, q_offset + sq)[:, None]
    k_pos = torch.arange(skv)[None, :]
    allowed = torch.ones(sq, skv, dtype=torch.bool)
    if causal:
        allowed &= k_pos <= q_pos
    if window is not None:
        allowed &= (k_pos >= q_pos - window[0]) & (k_pos <= q_pos + window[1])
    return allowed


def attention_reference(q, k, v, *, scale, allowed=None):
    """megatron layout: q [sq, b, h, d], k / v [skv, b, h_kv, d] -> [sq, b, h * d_v]; ``allowed`` broadcasts to
    [b, h, sq, skv]. Rows with nothing allowed give zeros."""
    groups = q.shape[2] // k.shape[2]
    k = k.float().repeat_interleave(groups, dim=2)
    v = v.float().repeat_interleave(groups, dim=2)
    scores = torch.einsum("qbhd,kbhd->bhqk", q.float(), k) * scale
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.where(allowed.any(-1, keepdim=True), scores.softmax(-1), torch.zeros_like(scores))
    else:
        probs = scores.softmax(-1)
    out = torch.einsum("bhqk,kbhd->qbhd", probs, v)
    return out.reshape(out.shape[0], out.shape[1], -1).to(q.dtype)


def load_balanced_rows(length: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """The rows of a sequence that context-parallel rank ``cp_rank`` holds: chunks r and 2*cp-1-r of 2*cp."""
    chunk = length // (2 * cp_size)
    first, second = cp_rank, 2 * cp_size - 1 - cp_rank
    return torch.cat((torch.arange(first * chunk, (first + 1) * chunk),
                      torch.arange(second * chunk, (second + 1) * chunk)))
