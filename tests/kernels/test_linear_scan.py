"""kernels.linear_scan (the parallel scan of ``h_t = a_t * h_{t-1} + b_t``) and kernels.selective_scan on it,
against the token-by-token loop: fp64 to 1e-12 (the same arithmetic grouped differently), fp32 to 2e-6 relative
of the largest state (Mamba-like decays over 300 tokens); gradients of ``a``, ``b`` and the initial state alike;
the selective scan in fp32 to 1e-5 of the largest output against the loop in fp64."""

from __future__ import annotations

import pytest
import torch

from loongforge_hf.kernels.linear_scan import linear_scan
from loongforge_hf.kernels.selective_scan import selective_scan


def _loop(a, b, initial, dim):
    a, b = a.movedim(dim, 0), b.movedim(dim, 0)
    h = torch.zeros_like(b[0]) if initial is None else initial
    states = []
    for t in range(a.shape[0]):
        h = a[t] * h + b[t]
        states.append(h)
    return torch.stack(states).movedim(0, dim)


def _grads(out, inputs, weight):
    return torch.autograd.grad((out * weight).sum(), inputs)


@pytest.mark.parametrize("seq", [1, 2, 5, 16, 37])
@pytest.mark.parametrize("dim,with_initial", [(1, False), (2, True), (-1, True)])
def test_linear_scan_matches_the_loop_fp64(seq, dim, with_initial):
    torch.manual_seed(seq)
    shape = [2, 3, 4, 5]
    shape[dim] = seq
    a = torch.rand(shape, dtype=torch.float64)
    a[a < 0.1] = 0  # NOTE: restarts (packed documents' first tokens)
    a.requires_grad_()
    b = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    initial = torch.randn(a.select(dim, 0).shape, dtype=torch.float64, requires_grad=True) if with_initial else None
    inputs = [a, b] + ([initial] if with_initial else [])
    ours, ref = linear_scan(a, b, initial=initial, dim=dim), _loop(a, b, initial, dim % a.dim())
    assert ours.dtype == torch.float64
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-12)
    weight = torch.randn_like(ref)
    for g, r in zip(_grads(ours, inputs, weight), _grads(ref, inputs, weight)):
        torch.testing.assert_close(g, r, rtol=0, atol=1e-12)


def test_linear_scan_fp32_long_sequence_and_bf16_inputs():
    torch.manual_seed(0)
    a = torch.exp(-torch.rand(2, 8, 300, 4) * torch.arange(1, 5.0))  # NOTE: exp(dt * A) with A = -1 .. -4
    b = torch.randn(2, 8, 300, 4)
    initial = torch.randn(2, 8, 4)
    ref = _loop(a.double(), b.double(), initial.double(), 2)
    ours = linear_scan(a, b, initial=initial, dim=2)
    assert ours.dtype == torch.float32
    assert (ours.double() - ref).abs().max() <= 2e-6 * ref.abs().max()
    half = linear_scan(a.bfloat16(), b.bfloat16(), dim=2)  # NOTE: bf16 inputs: fp32 states of the rounded inputs
    assert half.dtype == torch.float32
    torch.testing.assert_close(half, _loop(a.bfloat16().float(), b.bfloat16().float(), None, 2), rtol=1e-5,
                               atol=1e-5)
    with pytest.raises(ValueError, match=r"a \(2, 8, 300, 4\) and b \(2, 8, 4\) differ"):
        linear_scan(a, initial)


def test_selective_scan_matches_the_sequential_path_with_documents_and_a_state():
    """fp32 (the scan's dtype, as transformers') against the loop in fp64 on the same values: 1e-5 of the largest."""
    torch.manual_seed(1)
    batch, d, seq, n = 2, 6, 23, 4
    x, z = torch.randn(batch, d, seq), torch.randn(batch, d, seq)
    dt = torch.nn.functional.softplus(torch.randn(batch, d, seq)).requires_grad_()
    A, B, C = -torch.exp(torch.randn(d, n)), torch.randn(batch, seq, n), torch.randn(batch, seq, n)
    D, state = torch.randn(d), torch.randn(batch, d, n)
    documents = torch.tensor([[0] * 10 + [1] * 13, [0] * 23])
    y, last = selective_scan(x, dt, A, B, C, D, z, documents=documents, initial_state=state)
    ref, h = [], state.double()
    for t in range(seq):  # NOTE: transformers' torch path, the state reset at a document's first token
        keep = 0.0 if t and documents[0, t] != documents[0, t - 1] else 1.0
        decay = torch.exp(A[None].double() * dt[:, :, t, None]) * torch.tensor([keep, 1.0], dtype=torch.float64)[
            :, None, None]
        h = decay * h + dt[:, :, t, None].double() * B[:, None, t].double() * x[:, :, t, None].double()
        ref.append((h @ C[:, t, :, None].double())[..., 0])
    expected = (torch.stack(ref, dim=-1) + (x * D[None, :, None]).double()) * torch.nn.functional.silu(z).double()
    assert (y.double() - expected).abs().max() <= 1e-5 * expected.abs().max()
    assert (last.double() - h).abs().max() <= 1e-5 * h.abs().max()
    weight = torch.randn_like(y)
    grad, ref_grad = _grads(y, [dt], weight)[0], _grads(expected, [dt], weight.double())[0]
    assert (grad.double() - ref_grad).abs().max() <= 1e-5 * ref_grad.abs().max()


def test_selective_scan_first_token_of_another_document_ignores_the_state():
    """A row whose first id is not 0 (a context-parallel chunk starting a document) restarts at its first token: the
    same outputs as from zeros; ids from 0 read the state."""
    torch.manual_seed(2)
    batch, d, seq, n = 2, 3, 9, 4
    x, z, dt = torch.randn(batch, d, seq), torch.randn(batch, d, seq), torch.rand(batch, d, seq)
    A, B, C = -torch.exp(torch.randn(d, n)), torch.randn(batch, seq, n), torch.randn(batch, seq, n)
    D, state = torch.randn(d), torch.randn(batch, d, n)
    documents = torch.tensor([[1] * 4 + [2] * 5, [0] * 9])
    y, _ = selective_scan(x, dt, A, B, C, D, z, documents=documents, initial_state=state)
    fresh, _ = selective_scan(x, dt, A, B, C, D, z, documents=documents)
    continued, _ = selective_scan(x, dt, A, B, C, D, z, documents=documents[1:].expand(2, -1), initial_state=state)
    assert torch.equal(y[0], fresh[0]) and torch.equal(y[1], continued[1]) and not torch.allclose(y[1], fresh[1])
