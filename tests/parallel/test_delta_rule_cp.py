"""The state passing of ``parallel/delta_rule_cp.py`` without a world: a sequence cut into uneven chunks (one of a
single token, one longer than the kernel's 64-token chunk), each run as an affine map of its incoming state and the
chunks' maps scanned in order, gives the whole sequence's output, final state and gradients (of q, k, v, the decay
and beta) as one run of ``kernels.gated_delta_rule``; fp32 within 1e-5 (measured ~1e-6). The distributed parts
(halo, all-gathers, packed documents, padding) run against transformers in tests/bridges/test_qwen3_5.py."""

import torch

from loongforge_hf.kernels.gated_delta_rule import gated_delta_rule
from loongforge_hf.parallel.delta_rule_cp import affine_delta_rule, incoming_states

TOL = 1e-5
BOUNDS = (0, 1, 37, 110, 111, 150)


def _inputs():
    gen = torch.Generator().manual_seed(0)
    b, s, hk, hv, dk, dv = 2, 150, 2, 4, 8, 12
    shapes = ((b, s, hk, dk), (b, s, hk, dk), (b, s, hv, dv))
    q, k, v = (torch.randn(*shape, generator=gen) for shape in shapes)
    g = -torch.rand(b, s, hv, generator=gen)
    beta = torch.rand(b, s, hv, generator=gen)
    return [t.requires_grad_() for t in (q, k, v, g, beta)]


def _chunked(q, k, v, g, beta):
    runs = [affine_delta_rule(*(t[:, lo:hi] for t in (q, k, v, g, beta))) for lo, hi in zip(BOUNDS, BOUNDS[1:])]
    states = incoming_states([final for _, _, final in runs], value_dim=v.shape[-1])
    out = torch.cat([o0 + torch.einsum("bshk,bhkv->bshv", q_eff, state)
                     for (o0, q_eff, _), state in zip(runs, states)], dim=1)
    return out, states[-1]


def test_chunks_passing_states_equal_one_run():
    inputs = _inputs()
    weights = torch.randn(2, 150, 4, 12, generator=torch.Generator().manual_seed(1))
    got, want = _chunked(*inputs), gated_delta_rule(*inputs, output_final_state=True)
    assert (got[0] - want[0]).abs().max() < TOL and (got[1] - want[1]).abs().max() < TOL

    def grads(result):
        return torch.autograd.grad((result[0] * weights).sum() + result[1].sum(), inputs)

    for name, a, b in zip(("q", "k", "v", "g", "beta"), grads(got), grads(want)):
        assert (a - b).abs().max() < TOL * b.abs().max(), (name, float((a - b).abs().max()))
