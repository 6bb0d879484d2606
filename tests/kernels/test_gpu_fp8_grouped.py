"""Grouped FP8 experts on the GPU: the Triton kernels that quantise into the padded layouts bit for bit against the
torch steps, torch._scaled_grouped_mm against the emulation from the same quantised operands (forward, input
gradient, weight gradient), the grouped MLP's output and gradients against fp32 (relative Frobenius error < 9%, as on
CPU; with DeepSeek-V4's clamped SwiGLU too), zero weight gradients for empty experts, no host sync, and a rank without
tokens."""

import pytest
import torch

from loongforge_hf.kernels import fp8_grouped as G
from loongforge_hf.kernels.grouped_mlp import grouped_gated_mlp
from loongforge_hf.xpu import registry

from ._fp8_grouped_checks import check_grouped_quantisation


def _grouped_fp8_gpu() -> bool:
    # NOTE: asked of torch directly: the tests' conftest makes cpu the active backend at collection.
    if not torch.cuda.is_available() or not hasattr(torch, "_scaled_grouped_mm"):
        return False
    major, minor = torch.cuda.get_device_capability()
    return (major, minor) == (9, 0) or major == 10


pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not _grouped_fp8_gpu(),
                                 reason="needs a CUDA GPU where torch._scaled_grouped_mm runs (sm90 / sm100)")]


@pytest.fixture(autouse=True, scope="module")
def _cuda_backend():
    """The cuda backend active (``grouped_fp8_supported`` asks it), as outside the tests."""
    patch = pytest.MonkeyPatch()
    patch.setenv("LOONGFORGE_DEVICE", "cuda")
    registry._reset_for_tests()
    assert G.grouped_fp8_supported(torch.device("cuda", 0))
    yield
    patch.undo()
    registry._reset_for_tests()


REL_TOL = 0.09
COUNTS = [0, 1, 17, 512, 1000, 33, 0, 255]  # 8 experts of workload (c): hidden 2048, moe_intermediate 768
H, F = 2048, 768


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _inputs(seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    t, e = sum(COUNTS), len(COUNTS)
    x = torch.randn(t, H, device="cuda", generator=g).bfloat16()
    fc1 = (torch.randn(e, 2 * F, H, device="cuda", generator=g) * 0.02).bfloat16()
    fc2 = (torch.randn(e, H, F, device="cuda", generator=g) * 0.02).bfloat16()
    probs = torch.rand(t, device="cuda", generator=g)
    return x, fc1, fc2, probs, g


def test_layout_kernels_match_torch_steps_bit_for_bit():
    assert len(check_grouped_quantisation("cuda", fp8_out=True)) == 10


def test_grouped_gemm_matches_emulation_from_same_operands():
    x, fc1, _, _, g = _inputs()
    lay = G.Layout(torch.tensor(COUNTS, device="cuda"), x.shape[0])
    dy = torch.randn(x.shape[0], 2 * F, device="cuda", generator=g).bfloat16()
    used = torch.tensor(COUNTS, device="cuda") > 0
    for name, ops in (("fwd", G._forward_operands(x, fc1, lay)), ("dgrad", G._dgrad_operands(dy, fc1, lay)),
                      ("wgrad", G._wgrad_operands(dy, x, lay))):
        got = G.scaled_grouped_mm(*ops, lay.offs, emulate=False)
        want = G.scaled_grouped_mm(*ops, lay.offs, emulate=True)
        if name == "wgrad":
            got, want = got[used], want[used]
        else:
            got, want = lay.gather(got), lay.gather(want)
        # NOTE: same quantised operands: only accumulation order and the bf16 rounding of the output differ.
        assert _rel(got, want) < 1e-2, (name, _rel(got, want))


@pytest.mark.parametrize("with_probs", [True, False])
def test_grouped_fp8_mlp_against_fp32(with_probs):
    x, fc1, fc2, probs, g = _inputs(1)
    probs = probs if with_probs else None
    xa, w1, w2 = x.clone().requires_grad_(), fc1.clone().requires_grad_(), fc2.clone().requires_grad_()
    pa = probs.clone().requires_grad_() if with_probs else None
    out = G.fp8_grouped_gated_mlp(xa, w1, w2, torch.tensor(COUNTS, device="cuda"), pa)
    proj = torch.randn(*x.shape, device="cuda", generator=g)
    (out.float() * proj).sum().backward()
    xr, r1, r2 = x.float().requires_grad_(), fc1.float().requires_grad_(), fc2.float().requires_grad_()
    pr = probs.clone().requires_grad_() if with_probs else None
    ref = grouped_gated_mlp(xr, r1, r2, COUNTS, pr, use_grouped_mm=False)
    (ref * proj).sum().backward()
    used = torch.tensor(COUNTS, device="cuda") > 0
    pairs = {"out": (out, ref), "x": (xa.grad, xr.grad), "fc1": (w1.grad[used], r1.grad[used]),
             "fc2": (w2.grad[used], r2.grad[used])}
    if with_probs:
        pairs["probs"] = (pa.grad, pr.grad)
    errors = {k: _rel(a, b) for k, (a, b) in pairs.items()}
    assert max(errors.values()) < REL_TOL, errors
    for grad in (w1.grad, w2.grad):
        assert torch.equal(grad[~used], torch.zeros_like(grad[~used]))


def test_grouped_fp8_mlp_with_the_clamped_swiglu():
    """DeepSeek-V4's / HY-V4's clamped SwiGLU (the Triton SwiGLU kernels with the clamp) between the FP8 GEMMs against
    fp32 with the same activation (tolerances as tests/kernels/test_fp8.py's CPU case: the fc1 output's gradient
    flips between zero and not where FP8 moves an entry across the limit), the clamp active, no host sync."""
    from types import SimpleNamespace

    import torch.nn.functional as F_

    from loongforge_hf.kernels.clamped_glu import ClampedGLU

    limit = 2.0
    act = ClampedGLU(SimpleNamespace(gated_linear_unit=True, activation_func=F_.silu,
                                     activation_func_clamp_value=limit, glu_linear_offset=0.0))
    x, fc1, fc2, probs, g = _inputs(4)
    xa, w1, w2 = x.clone().requires_grad_(), fc1.clone().requires_grad_(), fc2.clone().requires_grad_()
    counts = torch.tensor(COUNTS, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = G.fp8_grouped_gated_mlp(xa, w1, w2, counts, probs, activation=act)
        proj = torch.randn(*x.shape, device="cuda", generator=g)
        (out.float() * proj).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    xr, r1, r2 = x.float().requires_grad_(), fc1.float().requires_grad_(), fc2.float().requires_grad_()
    ref = grouped_gated_mlp(xr, r1, r2, COUNTS, probs, activation=act, use_grouped_mm=False)
    (ref * proj).sum().backward()
    plain = grouped_gated_mlp(x.float(), fc1.float(), fc2.float(), COUNTS, probs, use_grouped_mm=False)
    used = torch.tensor(COUNTS, device="cuda") > 0
    errors = {"out": _rel(out, ref), "fc2": _rel(w2.grad[used], r2.grad[used]), "x": _rel(xa.grad, xr.grad),
              "fc1": _rel(w1.grad[used], r1.grad[used])}
    assert errors["out"] < REL_TOL and errors["fc2"] < REL_TOL, errors
    assert errors["x"] < 0.12 and errors["fc1"] < 0.12, errors
    assert _rel(plain, ref) > 2 * errors["out"], (_rel(plain, ref), errors)  # NOTE: the clamp moves the result


def test_no_host_sync_in_forward_and_backward():
    x, fc1, fc2, probs, _ = _inputs(2)
    w1, w2 = fc1.clone().requires_grad_(), fc2.clone().requires_grad_()
    counts = torch.tensor(COUNTS, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = G.fp8_grouped_gated_mlp(x.requires_grad_(), w1, w2, counts, probs)
        out.backward(torch.ones_like(out))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(w1.grad).all() and torch.isfinite(w2.grad).all()


def test_all_experts_empty():
    _, fc1, fc2, _, _ = _inputs(3)
    w1, w2 = fc1.clone().requires_grad_(), fc2.clone().requires_grad_()
    x = torch.zeros(0, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out = G.fp8_grouped_gated_mlp(x, w1, w2, torch.zeros(len(COUNTS), dtype=torch.int64, device="cuda"),
                                  torch.zeros(0, device="cuda"))
    assert out.shape == (0, H)
    out.sum().backward()
    assert torch.equal(w1.grad, torch.zeros_like(w1)) and torch.equal(w2.grad, torch.zeros_like(w2))


def test_adaptive_times_the_expert_module(tmp_path):
    """``adaptive``'s decision for a grouped expert module at the (c) expert shape: forward + backward of all its
    experts timed in bf16 and FP8 on this GPU (the choice is the timing's; both times recorded in the cache)."""
    from loongforge_hf.kernels.fp8_autotune import Fp8Autotuner

    fc1 = torch.nn.Parameter((torch.randn(len(COUNTS), 2 * F, H, device="cuda") * 0.02).bfloat16())
    fc2 = torch.nn.Parameter((torch.randn(len(COUNTS), H, F, device="cuda") * 0.02).bfloat16())
    tuner = Fp8Autotuner("blockwise", tmp_path / "cache.json")
    with torch.no_grad():  # as in a recomputed layer's first pass
        tuner.decide_experts(fc1, fc2, 4096, train=True, where="language:experts")
    assert fc1.grad is None and fc2.grad is None
    (entry,) = Fp8Autotuner("blockwise", tmp_path / "cache.json").entries.values()
    assert entry["gemm"] == f"experts:{len(COUNTS)}" and entry["bf16_ms"] > 0 and entry["fp8_ms"] > 0
