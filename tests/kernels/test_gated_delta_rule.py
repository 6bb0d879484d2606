"""``kernels.gated_delta_rule`` against a token-by-token recurrence written here and against transformers' torch
code (chunked and recurrent), fp32, over odd shapes and chunk sizes, outputs and gradients; the per-channel decay
(Kimi Delta Attention) against transformers' ``chunk_kimi_delta_attention`` / ``recurrent_kimi_delta_attention``."""

import pytest
import torch

from loongforge_hf.kernels.gated_delta_rule import gated_delta_rule

from ._interpret import needs_triton, run_interpreted

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


def _fake_fla_kernel(q, k, v, g, beta, *, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                     cu_seqlens):
    """fla's ``chunk_gated_delta_rule`` contract (one flattened row, documents at ``cu_seqlens``, q / k normalised
    in the kernel, q scaled by ``scale``) over our torch code, for checking what is handed to it on CPU."""
    assert q.shape[0] == 1 and use_qk_l2norm_in_kernel and scale == k.shape[-1] ** -0.5
    outs, states = [], []
    bounds = cu_seqlens.tolist()
    for i, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        state = None if initial_state is None else initial_state[i:i + 1]
        out, final = gated_delta_rule(*(x[:, lo:hi] for x in (q, k, v, g, beta)), initial_state=state,
                                      output_final_state=True)
        outs.append(out)
        states.append(final)
    return torch.cat(outs, 1), (torch.cat(states) if output_final_state else None)


def test_fla_rows_flatten_to_one_varlen_call(monkeypatch):
    """``fla_delta_rule.gated_delta_rule_rows`` (what Gated DeltaNet layers call when fla runs) hands fla's kernel
    the rows as one flattened row with a document per row and each row's initial state, and returns outputs and
    final states per row: the same as our torch code on the rows (the kernel stood in for by our code, fp32)."""
    from loongforge_hf.kernels import fla_delta_rule

    monkeypatch.setattr(fla_delta_rule, "_chunk_kernel", lambda: _fake_fla_kernel)
    gen = torch.Generator().manual_seed(3)
    q, k = (torch.randn(3, 37, 2, 8, generator=gen) for _ in range(2))
    v = torch.randn(3, 37, 4, 6, generator=gen)
    g = -torch.rand(3, 37, 4, generator=gen)
    beta = torch.rand(3, 37, 4, generator=gen)
    state = torch.randn(3, 4, 8, 6, generator=gen)
    got, got_state = fla_delta_rule.gated_delta_rule_rows(q, k, v, g, beta, initial_state=state,
                                                          output_final_state=True)
    want, want_state = gated_delta_rule(q, k, v, g, beta, initial_state=state, output_final_state=True)
    assert (got - want).abs().max() < TOL and (got_state - want_state).abs().max() < TOL
    alone = fla_delta_rule.gated_delta_rule_rows(q, k, v, g, beta)  # NOTE: zero states, the output only
    assert (alone - gated_delta_rule(q, k, v, g, beta)).abs().max() < TOL


def test_fla_taken_only_where_it_runs(monkeypatch):
    """fla is used on CUDA only; its gated backward is refused on Hopper with Triton 3.4 - 3.7.0 unless tilelang is
    there (fla's own flags, read from the installed fla), KDA's (per-channel decay, its own kernels) is not; an fla
    without ``chunk_kda`` runs Kimi's decay in torch; ``LOONGFORGE_DELTA_RULE=torch`` turns it off."""
    import sys
    import types

    from loongforge_hf.kernels import fla_delta_rule

    monkeypatch.setattr(fla_delta_rule, "_chunk_kernel", lambda: _fake_fla_kernel)
    monkeypatch.setattr(fla_delta_rule, "_kda_kernel", lambda: None)
    assert not fla_delta_rule.available(torch.device("cpu"))
    assert not fla_delta_rule.available(torch.device("cuda"), per_channel=True)  # NOTE: an fla without chunk_kda
    monkeypatch.setattr(fla_delta_rule, "_kda_kernel", lambda: _fake_fla_kernel)
    assert not fla_delta_rule.available(torch.device("cpu"), per_channel=True)
    for above_3_7_1, refused in ((False, True), (True, False)):
        utils = types.SimpleNamespace(IS_NVIDIA_HOPPER=True, TRITON_ABOVE_3_4_0=True, TRITON_ABOVE_3_7_1=above_3_7_1)
        monkeypatch.setitem(sys.modules, "fla", types.SimpleNamespace(utils=utils))
        fla_delta_rule._backward_refused.cache_clear()
        assert fla_delta_rule._backward_refused() is refused
        assert fla_delta_rule.available(torch.device("cuda")) is True
        assert fla_delta_rule.available(torch.device("cuda"), backward=True) is not refused
        assert fla_delta_rule.available(torch.device("cuda"), backward=True, per_channel=True)  # NOTE: KDA's backward
        monkeypatch.setenv("LOONGFORGE_DELTA_RULE", "torch")
        assert not fla_delta_rule.available(torch.device("cuda"))
        assert not fla_delta_rule.available(torch.device("cuda"), per_channel=True)
        monkeypatch.delenv("LOONGFORGE_DELTA_RULE")
    fla_delta_rule._backward_refused.cache_clear()


def test_gradients_reach_the_initial_state_through_the_final_state():
    """With a state coming in that requires grad and a loss on the outputs and the final state (what context
    parallelism chains), every gradient, the initial state's included, is the recurrence's."""
    q, k, v, g, beta = _inputs(1, 19, 1, 2, 6, 5, seed=7)
    start = torch.randn(1, 2, 6, 5, generator=torch.Generator().manual_seed(8))
    weights = torch.randn(1, 19, 2, 5, generator=torch.Generator().manual_seed(9))
    grads = []
    for fn in (lambda *a: gated_delta_rule(*a[:5], chunk_size=8, initial_state=a[5], output_final_state=True),
               _recurrence_from):
        inputs = [t.clone().requires_grad_() for t in (q, k, v, g, beta, start)]
        out, final = fn(*inputs)
        grads.append(torch.autograd.grad((out * weights).sum() + final.square().sum(), inputs))
    for name, a, b in zip("q k v g beta initial".split(), *grads):
        assert (a - b).abs().max() < TOL * max(1.0, float(b.abs().max())), name


@needs_triton
def test_triton_state_pass_matches_the_torch_loop_in_the_interpreter():
    """The Triton kernels of the chunk-to-chunk state pass (forward and reverse walks) against the torch loop: every
    output and input gradient within 1e-5 of the largest value (fp32)."""
    worst = run_interpreted("from tests.kernels._delta_rule_checks import check_state_pass\ncheck_state_pass()")
    assert len(worst) == 2 * 8 and max(worst) < 1e-5, worst


def test_packed_documents_in_one_call_match_one_call_each():
    """``gated_delta_rule_packed`` (documents on chunks of their own, the state not carried past a document's last
    chunk) against one ``gated_delta_rule`` call per document: outputs and every input gradient (fp32, 1e-5), with
    documents shorter than, equal to and longer than a chunk, of one token, and bad bounds refused."""
    from loongforge_hf.kernels.gated_delta_rule import gated_delta_rule_packed

    bounds = [[0, 1, 9, 17, 30], [0, 30]]
    inputs = [t.requires_grad_() for t in _inputs(2, 30, 2, 4, 6, 5, seed=11)]
    weights = torch.randn(2, 30, 4, 5, generator=torch.Generator().manual_seed(12))
    packed = gated_delta_rule_packed(*inputs, bounds, chunk_size=8)
    one_each = torch.cat([torch.cat([gated_delta_rule(*(t[row:row + 1, lo:hi] for t in inputs), chunk_size=8)
                                     for lo, hi in zip(cuts, cuts[1:])], dim=1) for row, cuts in enumerate(bounds)])
    assert (packed - one_each).abs().max() < TOL
    grads = [torch.autograd.grad((out * weights).sum(), inputs) for out in (packed, one_each)]
    for name, a, b in zip("q k v g beta".split(), *grads):
        assert (a - b).abs().max() < TOL * max(1.0, float(b.abs().max())), name
    with pytest.raises(ValueError, match="are not 2 rows of sorted document bounds from 0 to 30"):
        gated_delta_rule_packed(*inputs, [[0, 30], [0, 12, 29]])


def test_per_channel_decay_matches_transformers_kimi_delta_attention():
    """A decay per key channel (``g`` ``[b, s, h, k_dim]``, strong enough that some channels forget within a token):
    outputs and the final state against transformers' chunked and recurrent KDA code over 21 tokens in chunks of 8,
    every input's gradient against autograd through its recurrence; a decode step from the state; two packed
    documents against one call each."""
    from transformers.models.kimi_linear import modeling_kimi_linear as kimi

    from loongforge_hf.kernels.gated_delta_rule import gated_delta_rule_packed

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 21, 3, 8, generator=gen) for _ in range(3))
    g, beta = -3.0 * torch.rand(2, 21, 3, 8, generator=gen), torch.rand(2, 21, 3, generator=gen)
    chunked, _ = kimi.chunk_kimi_delta_attention(q, k, v, g, beta, chunk_size=8, use_qk_l2norm_in_kernel=True)
    ours = [t.clone().requires_grad_() for t in (q, k, v, g, beta)]
    theirs = [t.clone().requires_grad_() for t in (q, k, v, g, beta)]
    out, final = gated_delta_rule(*ours, chunk_size=8, output_final_state=True)
    want, want_final = kimi.recurrent_kimi_delta_attention(*theirs, None, True, use_qk_l2norm_in_kernel=True)
    assert (out - chunked).abs().max() < TOL and (out - want).abs().max() < TOL
    assert (final - want_final).abs().max() < TOL
    d_out, d_final = torch.randn(out.shape, generator=gen), torch.randn(final.shape, generator=gen)
    ((out * d_out).sum() + (final * d_final).sum()).backward()
    ((want * d_out).sum() + (want_final * d_final).sum()).backward()
    for a, b in zip(ours, theirs):
        assert (a.grad - b.grad).abs().max() < TOL * max(1.0, float(b.grad.abs().max()))
    one = (t[:, :1] for t in (q, k, v, g, beta))
    step, state = gated_delta_rule(*one, initial_state=want_final.detach(), output_final_state=True)
    ref_step, ref_state = kimi.recurrent_kimi_delta_attention(*(t[:, :1] for t in (q, k, v, g, beta)),
                                                              want_final.detach(), True, use_qk_l2norm_in_kernel=True)
    assert (step - ref_step).abs().max() < TOL and (state - ref_state).abs().max() < TOL
    packed = gated_delta_rule_packed(q, k, v, g, beta, [[0, 6, 21], [0, 21]], chunk_size=8)
    first = gated_delta_rule(*(t[:1, :6] for t in (q, k, v, g, beta)), chunk_size=8)
    second = gated_delta_rule(*(t[:1, 6:] for t in (q, k, v, g, beta)), chunk_size=8)
    assert (packed[:1] - torch.cat((first, second), dim=1)).abs().max() < TOL
    assert (packed[1:] - out[1:].detach()).abs().max() < TOL
