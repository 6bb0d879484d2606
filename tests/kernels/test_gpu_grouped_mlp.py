"""The grouped expert MLP's ``torch._grouped_mm`` path on CUDA (bf16) against its per-expert loop, forward and
gradients, and against fp32 on the CPU, with SwiGLU, with Gemma 4's gated tanh-GELU (``kernels/geglu.py``) and with
Nemotron-H's plain relu2 experts (``kernels/relu2.py``, ``gated=False``: fc1 ``[E, F, H]``); plus the path choice
itself (grouped where the operands allow it, the plain stacks included).

Tolerances:
- grouped vs the bf16 loop, elementwise: atol = rtol = 3e-2 (both accumulate in fp32 and round to bf16 at the same
  points; they differ by a few bf16 ulps of the largest entries).
- both vs fp32 on the CPU (same bf16-valued operands): norm-relative error ``||a - ref|| / ||ref|| < 1e-2``, per
  tensor and, for the weight gradients, per expert that received tokens. An elementwise bound is the wrong measure
  there: a weight gradient sums over up to 300 tokens, so an entry near zero carries the rounding of much larger
  terms (relative differences of hundreds). The bf16 loop on the CPU measures ~4.5e-3 on these cases (bf16 rounds
  at 2**-9 relative, four times on the way), so 1e-2 leaves about 2x slack and still fails on one wrong expert,
  a missing probability scaling or a dropped gradient term. The relu2 experts take the same bounds: on the CPU their
  bf16 loop and ``_grouped_mm``'s fallback measure 4e-3 to 5.5e-3 against fp32 on the Nemotron-H experts' case
  (``test_grouped_mlp.py``), transformers' own bf16 ``NemotronHExperts`` 4e-3 to 5e-3.
"""

import pytest
import torch

import loongforge_hf.kernels.grouped_mlp as grouped_module
from loongforge_hf.kernels.geglu import geglu
from loongforge_hf.kernels.grouped_mlp import grouped_gated_mlp, grouped_mm_supported
from loongforge_hf.kernels.relu2 import relu2
from loongforge_hf.kernels.swiglu import swiglu

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no _grouped_mm")]

ATOL, RTOL = 3e-2, 3e-2   # grouped vs the bf16 loop, elementwise
NORM_RTOL = 1e-2          # bf16 vs fp32, ||a - ref|| / ||ref||


def _assert_norm_close(a: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    err = ((a - ref).norm() / ref.norm()).item()
    assert err < NORM_RTOL, f"{what}: ||a - ref|| / ||ref|| = {err:.2e} (allowed {NORM_RTOL:.0e})"


def _operands(counts, hidden, ffn, seed=0, gated=True):
    g = torch.Generator().manual_seed(seed)
    t, e = sum(counts), len(counts)
    rows = 2 * ffn if gated else ffn
    return (torch.randn(t, hidden, generator=g), torch.randn(e, rows, hidden, generator=g) / hidden ** 0.5,
            torch.randn(e, hidden, ffn, generator=g) / ffn ** 0.5, torch.rand(t, generator=g),
            torch.randn(t, hidden, generator=g))


def _run(device, dtype, ops, counts, use_grouped_mm, activation=swiglu):
    x, fc1, fc2, probs, grad = (o.to(device) for o in ops)
    x, fc1, fc2 = (o.to(dtype).requires_grad_() for o in (x, fc1, fc2))
    out = grouped_gated_mlp(x, fc1, fc2, torch.tensor(counts, device=device), probs, activation=activation,
                            gated=activation is not relu2, use_grouped_mm=use_grouped_mm)
    out.backward(grad.to(dtype))
    return [t.float().cpu() for t in (out.detach(), x.grad, fc1.grad, fc2.grad)]


CASES = [([37, 0, 129, 5, 0, 64, 1, 20], 256, 96), ([0] * 3 + [300], 128, 64), ([11] * 16, 64, 32)]


@pytest.mark.parametrize("counts,hidden,ffn,activation", [*((*c, swiglu) for c in CASES), (*CASES[0], geglu),
                                                           (*CASES[0], relu2), (*CASES[1], relu2)],
                         ids=["odd-with-empty", "one-busy-expert", "even", "geglu-odd-with-empty",
                              "relu2-odd-with-empty", "relu2-one-busy-expert"])
def test_grouped_mm_matches_loop_and_fp32(counts, hidden, ffn, activation):
    ops = _operands(counts, hidden, ffn, gated=activation is not relu2)
    bf16 = torch.bfloat16
    assert grouped_mm_supported(ops[0].cuda().to(bf16), ops[1].cuda().to(bf16), ops[2].cuda().to(bf16))
    grouped = _run("cuda", bf16, ops, counts, None, activation)
    loop = _run("cuda", bf16, ops, counts, False, activation)
    ref = _run("cpu", torch.float32, [o.to(bf16).float() if i < 3 else o for i, o in enumerate(ops)], counts, False,
               activation)
    for i, (name, a, b, c) in enumerate(zip(("out", "d_x", "d_fc1", "d_fc2"), grouped, loop, ref)):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL, msg=lambda m, n=name: f"{n} vs loop: {m}")
        for path, t in (("grouped", a), ("loop", b)):
            _assert_norm_close(t, c, f"{name} ({path}) vs fp32")
            if i >= 2:  # weight gradients: each expert that got tokens on its own
                for e, n in enumerate(counts):
                    if n:
                        _assert_norm_close(t[e], c[e], f"{name}[expert {e}] ({path}) vs fp32")
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
    calls.clear()
    _run("cuda", torch.bfloat16, _operands([3, 5], 64, 32, gated=False), [3, 5], None, relu2)  # plain stacks too
    assert len(calls) >= 2
