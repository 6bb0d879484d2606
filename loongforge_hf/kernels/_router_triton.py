"""Triton top-k softmax routing (forward) with the numerics of ``router._topk_softmax_torch``.

One program per block of token rows; a row's expert logits (up to a few hundred) sit in registers. The top k are
taken by k rounds of "largest value, lowest index among equals", the selected experts' probabilities (softmax over
the k selected logits, or the full softmax's scores with ``PRE``) rounded to the logits' dtype, optionally scaled
(rounded again, as megatron's ``probs * scaling_factor`` in that dtype), and written once: the dense ``[T, E]``
probabilities, the routing map, and the ``[T, k]`` indices and fp32 probabilities the backward reads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _topk_softmax_fwd(L, P, MAP, IDX, PSEL, T, E, stride_l, scale, K: tl.constexpr, KP: tl.constexpr,
                      BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, PRE: tl.constexpr, SCALED: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    kk = tl.arange(0, KP)
    in_rows = rows < T
    valid = in_rows[:, None] & (cols[None, :] < E)
    x = tl.load(L + rows[:, None].to(tl.int64) * stride_l + cols[None, :], mask=valid, other=float("-inf"))
    x = x.to(tl.float32)
    if PRE:
        # NOTE: megatron's softmax(logits, fp32).type_as(logits): the top k are chosen among the rounded scores
        mx = tl.max(x, axis=1)
        e = tl.where(valid, tl.exp(x - mx[:, None]), 0.0)
        s = e / tl.sum(e, axis=1)[:, None]
        work = tl.where(valid, s.to(L.dtype.element_ty).to(tl.float32), float("-inf"))
    else:
        work = x
    top_v = tl.full((BLOCK_T, KP), float("-inf"), tl.float32)
    top_i = tl.zeros((BLOCK_T, KP), tl.int32)
    for k in tl.static_range(K):
        v = tl.max(work, axis=1)
        i = tl.min(tl.where(work == v[:, None], cols[None, :], BLOCK_E), axis=1)
        top_v = tl.where(kk[None, :] == k, v[:, None], top_v)
        top_i = tl.where(kk[None, :] == k, i[:, None], top_i)
        work = tl.where(cols[None, :] == i[:, None], float("-inf"), work)
    chosen = kk[None, :] < K
    if PRE:
        p = top_v
    else:
        mx = tl.max(tl.where(chosen, top_v, float("-inf")), axis=1)
        e = tl.where(chosen, tl.exp(top_v - mx[:, None]), 0.0)
        p = e / tl.sum(e, axis=1)[:, None]
    psel = p  # the fp32 probabilities the backward differentiates (before rounding and scaling)
    p = p.to(L.dtype.element_ty).to(tl.float32)
    if SCALED:
        p = (p * scale).to(L.dtype.element_ty).to(tl.float32)
    dense = tl.zeros((BLOCK_T, BLOCK_E), tl.float32)
    routed = tl.zeros((BLOCK_T, BLOCK_E), tl.int32)
    for k in tl.static_range(K):
        pk = tl.sum(tl.where(kk[None, :] == k, p, 0.0), axis=1)
        ik = tl.sum(tl.where(kk[None, :] == k, top_i, 0), axis=1)
        hit = cols[None, :] == ik[:, None]
        dense = tl.where(hit, pk[:, None], dense)
        routed = tl.where(hit, 1, routed)
    out = rows[:, None].to(tl.int64) * E + cols[None, :]
    tl.store(P + out, dense.to(P.dtype.element_ty), mask=valid)
    tl.store(MAP + out, routed.to(MAP.dtype.element_ty), mask=valid)
    sel = rows[:, None].to(tl.int64) * K + kk[None, :]
    tl.store(IDX + sel, top_i.to(IDX.dtype.element_ty), mask=in_rows[:, None] & chosen)
    tl.store(PSEL + sel, psel, mask=in_rows[:, None] & chosen)


def topk_softmax_fwd(logits: torch.Tensor, topk: int, pre_softmax: bool, scaling_factor: float | None):
    """(dense probs [T, E] in the logits' dtype, routing map [T, E] bool, top indices [T, k] int64, the selected
    experts' fp32 probabilities [T, k] before rounding and scaling)."""
    tokens, experts = logits.shape
    probs = torch.empty_like(logits)
    routing_map = torch.empty(tokens, experts, dtype=torch.int8, device=logits.device)
    idx = torch.empty(tokens, topk, dtype=torch.int64, device=logits.device)
    psel = torch.empty(tokens, topk, dtype=torch.float32, device=logits.device)
    block_e = triton.next_power_of_2(experts)
    block_t = max(1, min(16, 4096 // block_e))
    if tokens:
        _topk_softmax_fwd[(triton.cdiv(tokens, block_t),)](
            logits, probs, routing_map, idx, psel, tokens, experts, logits.stride(0),
            float(scaling_factor or 1.0), K=topk, KP=triton.next_power_of_2(topk), BLOCK_T=block_t, BLOCK_E=block_e,
            PRE=bool(pre_softmax), SCALED=bool(scaling_factor))
    return probs, routing_map.view(torch.bool), idx, psel
