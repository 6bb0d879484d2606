"""The Triton router top-k on the GPU against the torch path (kernels/router.py): indices and map equal, the dense
probabilities equal up to the kernel's exp (fp32 within 1e-6, bf16 within one ulp, 2**-7 relative; two with
scaling), and the op's gradients against megatron's unfused routing (bf16: 2**-7 relative to the largest)."""

import pytest
import torch

from ._router_checks import assert_same_routing, distinct_logits

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _logits(tokens, experts, dtype):
    return distinct_logits(tokens, experts).to(dtype).cuda()


@pytest.mark.parametrize("shape", [(8192, 128, 8), (4096, 60, 4), (1000, 8, 2), (7, 256, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pre,scale", [(False, None), (True, None), (False, 2.5)])
def test_triton_router_matches_torch_path(shape, dtype, pre, scale):
    from loongforge_hf.kernels import _router_triton
    from loongforge_hf.kernels.router import _topk_softmax_torch, _triton_router_ok

    assert _triton_router_ok(torch.cuda.current_device())  # the probe that lets training use the kernel
    tokens, experts, k = shape
    x = _logits(tokens, experts, dtype)
    got = _router_triton.topk_softmax_fwd(x, k, pre, scale)
    want = _topk_softmax_torch(x, k, pre, scale)
    assert_same_routing(got, want, 1e-6 if dtype == torch.float32 else (2 ** -6 if scale else 2 ** -7))


@pytest.mark.parametrize("pre", [False, True])
def test_router_gradients_against_megatron(pre):
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    from loongforge_hf.kernels.router import topk_softmax

    x = _logits(8192, 128, torch.bfloat16)
    proj = torch.randn(8192, 128, device="cuda")
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    probs, routing_map = topk_softmax(a, 8, pre_softmax=pre)
    ref, ref_map = topk_routing_with_score_function(b, 8, use_pre_softmax=pre)
    assert torch.equal(routing_map, ref_map)
    (probs.float() * proj).sum().backward()
    (ref.float() * proj).sum().backward()
    atol = 2 ** -7 * b.grad.float().abs().max().item()
    torch.testing.assert_close(a.grad.float(), b.grad.float(), rtol=2 ** -7, atol=atol)
