"""``kernels.gated_delta_rule`` against a token-by-token recurrence written here and against transformers' torch
code (chunked and recurrent), fp32, over odd shapes and chunk sizes, outputs and gradients."""

import pytest
import torch

from loongforge_hf.kernels.gated_delta_rule import gated_delta_rule

TOL = 1e-5


def _recurrence(q, k, v, g, beta):
    """The rule token by token, straight from its definition (fp32), from a zero state."""
    return _recurrence_from(q, k, v, g, beta, torch.zeros(v.shape[0], v.shape[2], k.shape[-1], v.shape[-1]))[0]


def _recurrence_from(q, k, v, g, beta, state):
    """The rule token by token from ``state`` ``[b, h, k_dim, v_dim]``, straight from its definition (fp32): (outputs,
    final state)."""
    rep = v.shape[2] // k.shape[2]
    q = q.float() * torch.rsqrt((q.float() ** 2).sum(-1, keepdim=True) + 1e-6)
    k = k.float() * torch.rsqrt((k.float() ** 2).sum(-1, keepdim=True) + 1e-6)
    q = q.repeat_interleave(rep, dim=2) * q.shape[-1] ** -0.5
    k = k.repeat_interleave(rep, dim=2)
    out = []
    for t in range(v.shape[1]):
        state = state * g[:, t].float().exp()[..., None, None]
        u = beta[:, t].float()[..., None] * (v[:, t].float() - torch.einsum("bhkv,bhk->bhv", state, k[:, t]))
        state = state + k[:, t][..., None] * u[..., None, :]
        out.append(torch.einsum("bhkv,bhk->bhv", state, q[:, t]))
    return torch.stack(out, dim=1), state


def _inputs(batch, seq, k_heads, v_heads, dk, dv, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(batch, seq, k_heads, dk, generator=gen) for _ in range(2))
    v = torch.randn(batch, seq, v_heads, dv, generator=gen)
    g = -2.0 * torch.rand(batch, seq, v_heads, generator=gen)
    beta = torch.rand(batch, seq, v_heads, generator=gen)
    return q, k, v, g, beta


@pytest.mark.parametrize("shape, chunk", [((2, 37, 2, 4, 8, 12), 7), ((1, 41, 3, 3, 5, 9), 64),
                                          ((3, 9, 1, 2, 16, 4), 4), ((1, 130, 2, 2, 8, 8), 64)])
def test_matches_the_recurrence_and_transformers(shape, chunk):
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    q, k, v, g, beta = _inputs(*shape)
    ours = gated_delta_rule(q, k, v, g, beta, chunk_size=chunk)
    assert ours.shape == v.shape and ours.dtype == torch.float32
    assert (ours - _recurrence(q, k, v, g, beta)).abs().max() < TOL
    for fn in (hf.torch_chunk_gated_delta_rule, hf.torch_recurrent_gated_delta_rule):
        ref, _ = fn(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)
        assert (ours - ref).abs().max() < TOL, fn.__name__


def test_gradients_match_the_recurrence():
    inputs = [t.requires_grad_() for t in _inputs(2, 23, 2, 4, 6, 5, seed=1)]
    grad_out = torch.randn(2, 23, 4, 5, generator=torch.Generator().manual_seed(3))
    ours = torch.autograd.grad((gated_delta_rule(*inputs, chunk_size=8) * grad_out).sum(), inputs)
    ref = torch.autograd.grad((_recurrence(*inputs) * grad_out).sum(), inputs)
    for name, a, b in zip("q k v g beta".split(), ours, ref):
        assert (a - b).abs().max() < TOL * max(1.0, float(b.abs().max())), name


def test_bf16_inputs_give_bf16_output_close_to_fp32():
    q, k, v, g, beta = _inputs(1, 20, 2, 2, 8, 8, seed=4)
    low = gated_delta_rule(*(t.bfloat16() for t in (q, k, v, g, beta)), chunk_size=8)
    assert low.dtype == torch.bfloat16
    assert (low.float() - gated_delta_rule(q, k, v, g, beta, chunk_size=8)).abs().max() < 5e-2


def test_value_heads_must_group_over_key_heads():
    q, k, v, g, beta = _inputs(1, 4, 2, 3, 4, 4)
    with pytest.raises(ValueError, match="3 value heads do not group over 2 key heads"):
        gated_delta_rule(q, k, v, g, beta)


def test_state_carried_across_calls():
    """The final state (fp32) of a prefill equals the recurrence's; prefills in pieces of 10, 1, 19, 1 and 6 tokens
    (the one-token pieces run the recurrence step) from each piece's final state give one prefill's outputs and final
    state; a state coming in is the recurrence's from that state."""
    q, k, v, g, beta = _inputs(2, 37, 2, 4, 8, 12, seed=5)
    whole, final = gated_delta_rule(q, k, v, g, beta, chunk_size=7, output_final_state=True)
    ref, ref_final = _recurrence_from(q, k, v, g, beta, torch.zeros(2, 4, 8, 12))
    assert final.dtype == torch.float32 and final.shape == (2, 4, 8, 12)
    assert (whole - ref).abs().max() < TOL and (final - ref_final).abs().max() < TOL
    outs, state = [], None
    for lo, hi in ((0, 10), (10, 11), (11, 30), (30, 31), (31, 37)):
        out, state = gated_delta_rule(*(t[:, lo:hi] for t in (q, k, v, g, beta)), chunk_size=7, initial_state=state,
                                      output_final_state=True)
        outs.append(out)
    assert (torch.cat(outs, dim=1) - whole).abs().max() < TOL and (state - final).abs().max() < TOL
    start = torch.randn(2, 4, 8, 12, generator=torch.Generator().manual_seed(6))
    for lo, hi in ((0, 37), (5, 6)):  # NOTE: chunked, and one token (the recurrence step)
        piece = [t[:, lo:hi] for t in (q, k, v, g, beta)]
        out, end = gated_delta_rule(*piece, chunk_size=7, initial_state=start, output_final_state=True)
        ref, ref_end = _recurrence_from(*piece, start)
        assert (out - ref).abs().max() < TOL and (end - ref_end).abs().max() < TOL, (lo, hi)
    assert torch.equal(gated_delta_rule(*piece, initial_state=start), out)  # NOTE: the output alone
    with pytest.raises(ValueError, match=r"initial_state of shape \(2, 4, 8\), expected \(2, 4, 8, 12\)"):
        gated_delta_rule(q, k, v, g, beta, initial_state=start[..., 0])
