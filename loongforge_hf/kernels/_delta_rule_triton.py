"""Triton kernels for the chunk-to-chunk state pass of the gated delta rule (``gated_delta_rule.state_pass``).

One program per (row x value head, block of value channels) keeps its ``[k_dim, BV]`` slice of the fp32 state in
registers and walks the chunks in order (forward) or in reverse (backward): the only sequential part of the chunked
rule, one launch each way where the torch loop launches a handful of ops per chunk. Value channels are independent
columns of the state, so blocks of them run in parallel. The products run as fp32 ``tl.dot`` with ``PRECISION``
(``"ieee"``: fp32 FMA, the torch path's numbers up to summation order; ``"tf32"`` is faster and coarser).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _program_tiles(C, K, V, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """This program's row x head, its chunk / key / value offsets and masks, its state tile's offsets and mask."""
    bh = tl.program_id(0).to(tl.int64)
    rc, rk = tl.arange(0, BC), tl.arange(0, BK)
    rv = tl.program_id(1) * BV + tl.arange(0, BV)
    mc, mk, mv = rc < C, rk < K, rv < V
    return bh, rc, rk, rv, mc, mk, mv, rk[:, None] * V + rv[None, :], mk[:, None] & mv[None, :]


@triton.jit
def _state_pass_fwd(W, U, KEND, DECAY, S0, STATES, FRESH, FINAL, N, C, K, V, HAS_S0: tl.constexpr,
                    BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PRECISION: tl.constexpr):
    bh, rc, rk, rv, mc, mk, mv, kv, kv_mask = _program_tiles(C, K, V, BC, BK, BV)
    if HAS_S0:
        state = tl.load(S0 + bh * K * V + kv, mask=kv_mask, other=0.0)
    else:
        state = tl.zeros([BK, BV], dtype=tl.float32)
    for c in range(N):
        chunk = bh * N + c
        tl.store(STATES + chunk * K * V + kv, state, mask=kv_mask)
        w = tl.load(W + chunk * C * K + rc[:, None] * K + rk[None, :], mask=mc[:, None] & mk[None, :], other=0.0)
        cv = chunk * C * V + rc[:, None] * V + rv[None, :]
        cv_mask = mc[:, None] & mv[None, :]
        fresh = tl.load(U + cv, mask=cv_mask, other=0.0) - tl.dot(w, state, input_precision=PRECISION)
        tl.store(FRESH + cv, fresh, mask=cv_mask)
        k_end_t = tl.load(KEND + chunk * C * K + rk[:, None] + rc[None, :] * K, mask=mk[:, None] & mc[None, :],
                          other=0.0)                                          # NOTE: [K, C], the chunk's k^T
        state = state * tl.load(DECAY + chunk) + tl.dot(k_end_t, fresh, input_precision=PRECISION)
    tl.store(FINAL + bh * K * V + kv, state, mask=kv_mask)


@triton.jit
def _state_pass_bwd(W, KEND, DECAY, D_STATES, D_FRESH, D_FINAL, D_U, D_NEXT, D_S0, N, C, K, V,
                    BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PRECISION: tl.constexpr):
    bh, rc, rk, rv, mc, mk, mv, kv, kv_mask = _program_tiles(C, K, V, BC, BK, BV)
    d_state = tl.load(D_FINAL + bh * K * V + kv, mask=kv_mask, other=0.0)   # NOTE: d of the state after the chunk
    for i in range(N):
        chunk = bh * N + (N - 1 - i)
        tl.store(D_NEXT + chunk * K * V + kv, d_state, mask=kv_mask)
        k_end = tl.load(KEND + chunk * C * K + rc[:, None] * K + rk[None, :], mask=mc[:, None] & mk[None, :],
                        other=0.0)
        cv = chunk * C * V + rc[:, None] * V + rv[None, :]
        cv_mask = mc[:, None] & mv[None, :]
        d_fresh = tl.load(D_FRESH + cv, mask=cv_mask, other=0.0) + tl.dot(k_end, d_state, input_precision=PRECISION)
        tl.store(D_U + cv, d_fresh, mask=cv_mask)
        w_t = tl.load(W + chunk * C * K + rk[:, None] + rc[None, :] * K, mask=mk[:, None] & mc[None, :], other=0.0)
        d_state = (d_state * tl.load(DECAY + chunk) - tl.dot(w_t, d_fresh, input_precision=PRECISION)
                   + tl.load(D_STATES + chunk * K * V + kv, mask=kv_mask, other=0.0))
    tl.store(D_S0 + bh * K * V + kv, d_state, mask=kv_mask)


TUNING = {"BV": 16, "num_warps": 8, "PRECISION": "ieee"}


def _blocks(chunk: int, k_dim: int, v_dim: int) -> dict:
    # NOTE: tl.dot needs every dimension >= 16
    return dict(BC=max(16, triton.next_power_of_2(chunk)), BK=max(16, triton.next_power_of_2(k_dim)),
                BV=max(16, min(TUNING["BV"], triton.next_power_of_2(v_dim))), num_warps=TUNING["num_warps"],
                PRECISION=TUNING["PRECISION"])


def state_pass_forward(w, u, k_end, decay, initial):
    """``state_pass``'s forward on contiguous fp32 tensors (shapes there): (states, fresh, final)."""
    b, h, n, c, k = w.shape
    v = u.shape[-1]
    states = w.new_empty(b, h, n, k, v)
    fresh = torch.empty_like(u)
    final = w.new_empty(b, h, k, v)
    blocks = _blocks(c, k, v)
    grid = (b * h, triton.cdiv(v, blocks["BV"]))
    _state_pass_fwd[grid](w, u, k_end, decay, final if initial is None else initial, states, fresh, final,
                          n, c, k, v, HAS_S0=initial is not None, **blocks)
    return states, fresh, final


def state_pass_backward(w, k_end, decay, d_states, d_fresh, d_final):
    """``state_pass``'s sequential backward: (d_u: the total gradient of each chunk's fresh corrections, d_next: the
    gradient of the state after each chunk, d_initial)."""
    b, h, n, c, k = w.shape
    v = d_fresh.shape[-1]
    d_u = torch.empty_like(d_fresh)
    d_next = w.new_empty(b, h, n, k, v)
    d_initial = w.new_empty(b, h, k, v)
    blocks = _blocks(c, k, v)
    grid = (b * h, triton.cdiv(v, blocks["BV"]))
    _state_pass_bwd[grid](w, k_end, decay, d_states, d_fresh, d_final, d_u, d_next, d_initial, n, c, k, v,
                          **blocks)
    return d_u, d_next, d_initial
