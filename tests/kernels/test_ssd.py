"""``kernels.ssd`` (Mamba2's chunked SSD scan) against transformers' torch chunk scan (``mamba2_chunk_scan``, the
granitemoehybrid / mamba2 torch path: the same ops, so equal) and a token-by-token recurrence written here (outputs
and gradients, fp32), over odd shapes and several chunks; packed documents against each document alone; the one-token
step (``ssd_step``) against transformers' ``mamba2_selective_state_update``."""

import pytest
import torch
import torch.nn.functional as F

from loongforge_hf.kernels.ssd import ssd_scan, ssd_step

TOL = 1e-5


def _inputs(batch=2, seq=37, heads=4, head_dim=3, groups=2, d_state=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq, heads, head_dim, generator=gen)
    dt = F.softplus(torch.randn(batch, seq, heads, generator=gen))
    A = -0.5 - torch.rand(heads, generator=gen)
    B, C = (torch.randn(batch, seq, groups, d_state, generator=gen) for _ in range(2))
    D = torch.randn(heads, generator=gen)
    state = torch.randn(batch, heads, head_dim, d_state, generator=gen)
    return x, dt, A, B, C, D, state


def _recurrence(x, dt, A, B, C, D, state):
    """The scan token by token, straight from its definition (fp32): (outputs, final state)."""
    rep = x.shape[2] // B.shape[2]
    B, C = B.repeat_interleave(rep, dim=2), C.repeat_interleave(rep, dim=2)
    out = []
    for t in range(x.shape[1]):
        decay = torch.exp(dt[:, t] * A)[..., None, None]
        state = state * decay + (dt[:, t, :, None] * x[:, t])[..., None] * B[:, t, :, None, :]
        out.append(torch.einsum("bhpn,bhn->bhp", state, C[:, t]) + D[:, None] * x[:, t])
    return torch.stack(out, dim=1), state


@pytest.mark.parametrize("chunk_size", (8, 16))
def test_equals_transformers_chunk_scan(chunk_size):
    """37 tokens (several chunks, the last one partial), a state coming in and the final one out: equal to
    transformers' torch scan (fed the raw ``dt`` and its ``dt_bias`` / softplus / limit)."""
    from transformers.models.granitemoehybrid.modeling_granitemoehybrid import mamba2_chunk_scan

    x, _, A, B, C, D, state = _inputs()
    raw, bias = torch.randn(2, 37, 4), torch.randn(4)
    want, want_state = mamba2_chunk_scan(x, raw, A, B, C, chunk_size, D=D, dt_bias=bias, dt_softplus=True,
                                         dt_limit=(0.0, 1.2), initial_states=state, return_final_states=True)
    dt = F.softplus(raw + bias).clamp(0.0, 1.2)
    got, got_state = ssd_scan(x, dt, A, B, C, chunk_size=chunk_size, D=D, initial_state=state,
                              output_final_state=True)
    assert torch.equal(got, want) and torch.equal(got_state, want_state)


def test_recurrence_outputs_and_gradients():
    inputs = [t.requires_grad_() for t in _inputs(batch=1, seq=29, heads=6, head_dim=4, groups=3, d_state=7)]
    x, dt, A, B, C, D, state = inputs
    got, got_state = ssd_scan(x, dt, A, B, C, chunk_size=8, D=D, initial_state=state, output_final_state=True)
    want, want_state = _recurrence(*inputs)
    assert (got - want).abs().max() < TOL and (got_state - want_state).abs().max() < TOL
    weights = torch.randn_like(got), torch.randn_like(got_state)
    grads = torch.autograd.grad((got * weights[0]).sum() + (got_state * weights[1]).sum(), inputs)
    wants = torch.autograd.grad((want * weights[0]).sum() + (want_state * weights[1]).sum(), inputs)
    for name, g, w in zip("x dt A B C D state".split(), grads, wants):
        assert (g - w).abs().max() / w.abs().max() < TOL, name


def test_packed_documents_restart():
    """A row of documents of 5, 20 and 12 tokens (boundaries inside chunks and on none) beside a row of one: each
    document as scanned alone (the state coming in continues the first document only)."""
    x, dt, A, B, C, D, state = _inputs()
    documents = torch.tensor([[0] * 5 + [1] * 20 + [2] * 12, [0] * 37])
    got = ssd_scan(x, dt, A, B, C, chunk_size=8, D=D, initial_state=state, documents=documents)
    whole = ssd_scan(x, dt, A, B, C, chunk_size=8, D=D, initial_state=state)
    assert torch.equal(got[1], whole[1])
    start = 0
    for i, n in enumerate((5, 20, 12)):
        part = slice(start, start + n)
        alone = ssd_scan(x[:1, part], dt[:1, part], A, B[:1, part], C[:1, part], chunk_size=8, D=D,
                         initial_state=state[:1] if i == 0 else None)
        assert (got[0, part] - alone[0]).abs().max() < TOL, (n, (got[0, part] - alone[0]).abs().max())
        start += n


def test_step_equals_transformers_state_update():
    """One token from a state: transformers' ``mamba2_selective_state_update`` (fed the raw ``dt``, its ``dt_bias``
    and softplus, its per-head parameters expanded as its Mamba2 layer expands them) to 1e-6, and the recurrence."""
    from transformers.models.granitemoehybrid.modeling_granitemoehybrid import mamba2_selective_state_update

    x, _, A, B, C, D, state = _inputs(seq=1, heads=6, groups=3)
    raw, bias = torch.randn(2, 6), torch.randn(6)
    head_dim, d_state = x.shape[-1], B.shape[-1]
    want_state = state.clone()
    want = mamba2_selective_state_update(want_state, x[:, 0], raw[..., None].expand(-1, -1, head_dim),
                                         A[:, None, None].expand(-1, head_dim, d_state), B[:, 0], C[:, 0],
                                         D[:, None].expand(-1, head_dim), dt_bias=bias[:, None].expand(-1, head_dim),
                                         dt_softplus=True)
    dt = F.softplus(raw + bias)
    got, got_state = ssd_step(state, x[:, 0], dt, A, B[:, 0], C[:, 0], D=D)
    assert (got - want).abs().max() < 1e-6 and (got_state - want_state).abs().max() < 1e-6
    rec, rec_state = _recurrence(x, dt[:, None], A, B, C, D, state)
    assert (got - rec[:, 0]).abs().max() < TOL and (got_state - rec_state).abs().max() < TOL
