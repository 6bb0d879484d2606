"""The state passing of ``parallel/ssd_cp.py`` without a world: a sequence cut into uneven chunks (one of a single
token, one longer than the scan's 16-token chunk), each run as an affine map of its incoming state and the chunks'
maps scanned in order, gives the whole sequence's output, final state and gradients (of x, the time steps, A, B, C
and D) as one run of ``kernels.ssd.ssd_scan``; with rows packing documents too (starts inside a chunk, at a chunk's
first token, two in one chunk; one row without any); fp32 within 1e-5. The distributed parts (halo, all-gathers,
padding, the mask's starts) run against transformers in tests/bridges/test_granitemoehybrid.py."""

import pytest
import torch

from loongforge_hf.kernels.ssd import ssd_scan
from loongforge_hf.parallel.ssd_cp import affine_ssd, incoming_states

TOL = 1e-5
BOUNDS = (0, 1, 37, 70, 71, 90)
STARTS = ((20, 37, 50, 60), ())  # NOTE: each row's document starts (row 1: one document)


def _inputs():
    gen = torch.Generator().manual_seed(0)
    b, s, heads, head_dim, groups, d_state = 2, 90, 4, 6, 2, 5
    x = torch.randn(b, s, heads, head_dim, generator=gen)
    dt = torch.rand(b, s, heads, generator=gen) + 0.1
    A = -torch.rand(heads, generator=gen) - 0.2
    B, C = (torch.randn(b, s, groups, d_state, generator=gen) for _ in range(2))
    D = torch.randn(heads, generator=gen)
    return [t.requires_grad_() for t in (x, dt, A, B, C, D)]


def _starts(seq: int) -> torch.Tensor:
    cuts = torch.zeros(len(STARTS), seq, dtype=torch.long)
    for row, starts in enumerate(STARTS):
        cuts[row, list(starts)] = 1
    return cuts


def _chunked(x, dt, A, B, C, D, *, packed: bool):
    cuts = _starts(x.shape[1])
    runs = []
    for lo, hi in zip(BOUNDS, BOUNDS[1:]):
        documents = cuts[:, lo:hi].cumsum(-1) if packed else None
        runs.append(affine_ssd(x[:, lo:hi], dt[:, lo:hi], A, B[:, lo:hi], C[:, lo:hi], chunk_size=16, D=D,
                               documents=documents))
    states = incoming_states([final for _, _, final in runs], head_dim=x.shape[-1])
    out = torch.cat([y0 + torch.einsum("bshn,bhpn->bshp", c_eff, state)
                     for (y0, c_eff, _), state in zip(runs, states)], dim=1)
    return out, states[-1]


@pytest.mark.parametrize("packed", (False, True))
def test_chunks_passing_states_equal_one_run(packed):
    inputs = _inputs()
    documents = _starts(inputs[0].shape[1]).cumsum(-1) if packed else None
    weights = torch.randn(2, 90, 4, 6, generator=torch.Generator().manual_seed(1))
    got = _chunked(*inputs, packed=packed)
    want = ssd_scan(*inputs[:5], chunk_size=16, D=inputs[5], output_final_state=True, documents=documents)
    assert (got[0] - want[0]).abs().max() < TOL and (got[1] - want[1]).abs().max() < TOL

    def grads(result):
        return torch.autograd.grad((result[0] * weights).sum() + result[1].sum(), inputs)

    for name, a, b in zip(("x", "dt", "A", "B", "C", "D"), grads(got), grads(want)):
        assert (a - b).abs().max() < TOL * b.abs().max(), (name, float((a - b).abs().max()))
