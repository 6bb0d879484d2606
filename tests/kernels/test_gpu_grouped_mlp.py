"""The grouped expert MLP's ``torch._grouped_mm`` path on CUDA (bf16) against its per-expert loop, forward and
gradients, and against fp32 on the CPU; plus the path choice itself (grouped where the operands allow it)."""

import pytest
import torch

import loongforge_hf.kernels.grouped_mlp as grouped_module
from loongforge_hf.kernels.grouped_mlp import grouped_gated_mlp, grouped_mm_supported

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no _grouped_mm")]

# bf16 grouped GEMMs against the bf16 loop (both accumulate in fp32, round differently) and against fp32 on the CPU
# from the same bf16 values: bf16's resolution with slack for sums of up to 256 products.
ATOL, RTOL = 3e-2, 3e-2


def _operands(counts, hidden, ffn, seed=0):
    g = torch.Generator().manual_seed(seed)
    t, e = sum(counts), len(counts)
    return (torch.randn(t, hidden, generator=g), torch.randn(e, 2 * ffn, hidden, generator=g) / hidden ** 0.5,
            torch.randn(e, hidden, ffn, generator=g) / ffn ** 0.5, torch.rand(t, generator=g),
            torch.randn(t, hidden, generator=g))


def _run(device, dtype, ops, counts, use_grouped_mm):
    x, fc1, fc2, probs, grad = (o.to(device) for o in ops)
    x, fc1, fc2 = (o.to(dtype).requires_grad_() for o in (x, fc1, fc2))
    out = grouped_gated_mlp(x, fc1, fc2, torch.tensor(counts, device=device), probs,
                            use_grouped_mm=use_grouped_mm)
    out.backward(grad.to(dtype))
    return [t.float().cpu() for t in (out.detach(), x.grad, fc1.grad, fc2.grad)]


CASES = [([37, 0, 129, 5, 0, 64, 1, 20], 256, 96), ([0] * 3 + [300], 128, 64), ([11] * 16, 64, 32)]


@pytest.mark.parametrize("counts,hidden,ffn", CASES, ids=["odd-with-empty", "one-busy-expert", "even"])
def test_grouped_mm_matches_loop_and_fp32(counts, hidden, ffn):
    ops = _operands(counts, hidden, ffn)
    bf16 = torch.bfloat16
    assert grouped_mm_supported(ops[0].cuda().to(bf16), ops[1].cuda().to(bf16), ops[2].cuda().to(bf16))
    grouped = _run("cuda", bf16, ops, counts, None)
    loop = _run("cuda", bf16, ops, counts, False)
    ref = _run("cpu", torch.float32, [o.to(bf16).float() if i < 3 else o for i, o in enumerate(ops)], counts, False)
    for name, a, b, c in zip(("out", "d_x", "d_fc1", "d_fc2"), grouped, loop, ref):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL, msg=lambda m, n=name: f"{n} vs loop: {m}")
        torch.testing.assert_close(a, c, atol=ATOL, rtol=RTOL, msg=lambda m, n=name: f"{n} vs fp32: {m}")
    for e, n in enumerate(counts):
        if n == 0:
            assert torch.count_nonzero(grouped[2][e]) == 0 and torch.count_nonzero(grouped[3][e]) == 0


def test_default_path_is_grouped_on_cuda_bf16(monkeypatch):
    calls = []
    real = torch._grouped_mm
    monkeypatch.setattr(grouped_module.torch, "_grouped_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    _run("cuda", torch.bfloat16, _operands([3, 5], 64, 32), [3, 5], None)
    assert len(calls) >= 2  # fc1 and fc2 (the backward adds more)
    calls.clear()
    _run("cuda", torch.float32, _operands([3, 5], 64, 32), [3, 5], None)  # fp32: the loop
    assert not calls
    x, fc1, fc2 = (o.cuda().to(torch.bfloat16) for o in _operands([3, 5], 64, 30)[:3])
    assert not grouped_mm_supported(x, fc1, fc2)  # F=30: fc2's rows are not 16-byte aligned
