"""The gated delta rule's Triton state pass on a GPU: against the torch loop in fp32, and the whole rule in bf16
against fp32 (Qwen3.5's layer shape)."""

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_state_pass_matches_the_torch_loop_on_cuda():
    from tests.kernels._delta_rule_checks import QWEN3_5, SMALL, check_state_pass

    worst = check_state_pass(SMALL + QWEN3_5, device="cuda")
    assert max(worst) < 1e-5, worst


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_rule_with_the_triton_pass_matches_fp32_torch_loop():
    """One 4096-token row of 16 key / 32 value heads of 128 in bf16 (the Triton pass) against fp32 inputs through the
    torch loop: output and gradients within 2e-2 of the reference's largest value (bf16 inputs and output)."""
    from loongforge_hf.kernels._triton import triton_paths
    from loongforge_hf.kernels.gated_delta_rule import gated_delta_rule

    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 4096, 16, 128, generator=gen) for _ in range(2))
    v = torch.randn(1, 4096, 32, 128, generator=gen)
    g = -torch.nn.functional.softplus(torch.randn(1, 4096, 32, generator=gen)) * 0.5
    beta = torch.rand(1, 4096, 32, generator=gen)
    grad = torch.randn(1, 4096, 32, 128, generator=gen).cuda()
    results = []
    for low, triton in ((True, True), (False, False)):
        inputs = [t.cuda().to(torch.bfloat16 if low and t.dim() == 4 else torch.float32).requires_grad_()
                  for t in (q, k, v, g, beta)]
        with triton_paths(triton):
            out = gated_delta_rule(*inputs)
            results.append([out.float(), *(x.float() for x in torch.autograd.grad(out, inputs, grad.to(out.dtype)))])
    for name, got, want in zip("out q k v g beta".split(), *results):
        assert float((got - want).abs().max() / want.abs().max()) < 2e-2, name
