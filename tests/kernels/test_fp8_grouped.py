"""Grouped FP8 experts on CPU (the emulated grouped GEMM): per-segment quantisation against a plain reference, the
operands' layouts against torch's own checks (meta tensors), and outputs and gradients against the fp32 reference."""

import pytest
import torch

from loongforge_hf.kernels import fp8_grouped as G
from loongforge_hf.kernels.fp8 import FP8_MAX
from loongforge_hf.kernels.grouped_mlp import grouped_gated_mlp

# NOTE: measured on these inputs: 5.8-7.7% relative Frobenius error (output, x, probs, W1, W2) against fp32: two
# row-wise e4m3 GEMMs in a row, bf16 intermediates. A wrong scale or a misplaced padding row gives errors of order 1.
REL_TOL = 0.09
COUNTS = [0, 1, 17, 30, 0, 16]


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_segment_quantisation_matches_reference():
    g = torch.Generator().manual_seed(1)
    counts = [0, 1, 17, 3]
    x = torch.randn(sum(counts), 40, generator=g) * torch.logspace(-3, 2, 40)
    x[1:18, :8] = 0  # all-zero columns inside a segment
    expert = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    q, s = G.quantize_segments(x, expert, len(counts))
    assert s.shape == (4, 40) and torch.equal(s[0], torch.ones(40))  # the empty expert
    start = 0
    for e, c in enumerate(counts):
        seg = x[start:start + c]
        if c:
            amax = seg.abs().amax(0)
            want = torch.where(amax == 0, torch.ones_like(amax), amax / FP8_MAX)
            torch.testing.assert_close(s[e], want, rtol=0, atol=0)
            ref = (seg / want).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            torch.testing.assert_close(q[start:start + c].float(), ref.float(), rtol=0, atol=0)
            assert q[start:start + c].float().abs().amax(0)[amax > 0].eq(FP8_MAX).all()
        start += c
    assert torch.equal(s[2, :8], torch.ones(8))


def test_layout_pads_each_segment_to_16_rows():
    counts = torch.tensor([0, 1, 17, 30, 0, 16])
    lay = G.Layout(counts, int(counts.sum()))
    assert lay.offs.dtype == torch.int32 and lay.offs.tolist() == [0, 16, 48, 80, 80, 96]
    assert lay.rows % 16 == 0 and lay.rows >= 96
    assert lay.dst.tolist() == [0] + list(range(16, 33)) + list(range(48, 78)) + list(range(80, 96))
    q = torch.arange(64, dtype=torch.float32).reshape(64, 1).repeat(1, 2).to(torch.float8_e4m3fn)
    buf = G.Layout(counts, 64).scatter(q)
    assert buf.dtype == torch.float8_e4m3fn and torch.equal(buf[lay.dst].float(), q.float())
    keep = torch.ones(lay.rows, dtype=torch.bool)
    keep[lay.dst] = False
    assert torch.equal(buf[keep].float(), torch.zeros(int(keep.sum()), 2))


def test_operands_pass_torch_scaled_grouped_mm_checks():
    """The three GEMMs' operands, on meta tensors, go through torch's own shape, stride and scale checks."""
    g = torch.Generator().manual_seed(2)
    counts = torch.tensor(COUNTS)
    t, h, f = int(counts.sum()), 64, 48
    x, w = torch.randn(t, h, generator=g).bfloat16(), torch.randn(len(COUNTS), 2 * f, h, generator=g).bfloat16()
    dy = torch.randn(t, 2 * f, generator=g).bfloat16()
    lay = G.Layout(counts, t)
    for ops, shape in ((G._forward_operands(x, w, lay), (lay.rows, 2 * f)),
                       (G._dgrad_operands(dy, w, lay), (lay.rows, h)),
                       (G._wgrad_operands(dy, x, lay), (len(COUNTS), 2 * f, h))):
        out = torch._scaled_grouped_mm(*(o.to("meta") for o in ops), offs=lay.offs.to("meta"),
                                       out_dtype=torch.bfloat16)
        assert tuple(out.shape) == shape and out.dtype == torch.bfloat16


def test_emulated_gemms_are_the_dequantised_products():
    g = torch.Generator().manual_seed(3)
    counts = torch.tensor([3, 0, 20])
    lay = G.Layout(counts, 23)
    x, w = torch.randn(23, 32, generator=g), torch.randn(3, 16, 32, generator=g)
    a, b, sa, sb = G._forward_operands(x, w, lay)
    y = lay.gather(G.scaled_grouped_mm(a, b, sa, sb, lay.offs, emulate=True))
    deq_x = lay.gather(a.float() * sa[:, None])
    deq_w = b.float() * sb[:, None, :]
    want = torch.cat([deq_x[:3] @ deq_w[0], deq_x[3:] @ deq_w[2]])
    torch.testing.assert_close(y.float(), want.bfloat16().float(), rtol=0, atol=0)
    assert _rel(y, torch.cat([x[:3] @ w[0].t(), x[3:] @ w[2].t()])) < 0.06


@pytest.mark.parametrize("with_probs", [True, False])
def test_grouped_fp8_mlp_against_fp32_reference(with_probs):
    g = torch.Generator().manual_seed(5)
    e, h, f, t = len(COUNTS), 64, 32, sum(COUNTS)
    x = torch.randn(t, h, generator=g).bfloat16()
    probs = torch.rand(t, generator=g) if with_probs else None
    fc1 = (torch.randn(e, 2 * f, h, generator=g) * 0.1).bfloat16().requires_grad_()
    fc2 = (torch.randn(e, h, f, generator=g) * 0.1).bfloat16().requires_grad_()
    xa = x.clone().requires_grad_()
    pa = probs.clone().requires_grad_() if with_probs else None
    out = G.fp8_grouped_gated_mlp(xa, fc1, fc2, torch.tensor(COUNTS), pa)
    assert out.shape == x.shape and out.dtype == x.dtype
    proj = torch.randn(t, h, generator=g)
    (out.float() * proj).sum().backward()
    xr, pr = x.float().requires_grad_(), probs.clone().requires_grad_() if with_probs else None
    w1, w2 = fc1.detach().float().requires_grad_(), fc2.detach().float().requires_grad_()
    ref = grouped_gated_mlp(xr, w1, w2, COUNTS, pr, use_grouped_mm=False)
    (ref * proj).sum().backward()
    pairs = [(out, ref), (xa.grad, xr.grad)] + ([(pa.grad, pr.grad)] if with_probs else [])
    used = torch.tensor(COUNTS) > 0
    pairs += [(fc1.grad[used], w1.grad[used]), (fc2.grad[used], w2.grad[used])]
    errors = [_rel(a, b) for a, b in pairs]
    assert max(errors) < REL_TOL, errors
    assert min(errors) > 1e-3, errors  # the GEMMs really went through FP8
    for grad in (fc1.grad, fc2.grad):  # experts without tokens: zero weight gradients
        assert torch.equal(grad[~used], torch.zeros_like(grad[~used]))


def test_no_tokens_at_all_gives_zero_grads():
    fc1 = torch.randn(3, 32, 16).bfloat16().requires_grad_()
    fc2 = torch.randn(3, 16, 16).bfloat16().requires_grad_()
    x = torch.zeros(0, 16, dtype=torch.bfloat16, requires_grad=True)
    out = G.fp8_grouped_gated_mlp(x, fc1, fc2, torch.zeros(3, dtype=torch.int64), torch.zeros(0))
    assert out.shape == (0, 16)
    out.sum().backward()
    assert torch.equal(fc1.grad, torch.zeros_like(fc1)) and torch.equal(fc2.grad, torch.zeros_like(fc2))


def test_shapes_the_grouped_gemm_cannot_take_are_refused():
    with pytest.raises(G.Fp8Error, match="multiples of 16"):
        G.fp8_grouped_gated_mlp(torch.randn(4, 24), torch.randn(2, 16, 24), torch.randn(2, 24, 8), [2, 2])
    with pytest.raises(ValueError, match="token counts"):
        G.fp8_grouped_gated_mlp(torch.randn(4, 16), torch.randn(2, 32, 16), torch.randn(2, 16, 16), [4])
