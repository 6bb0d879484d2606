"""MoE router top-k (kernels/router.py) against megatron-core's unfused topk_routing_with_score_function.

Forward: bit-equal on CPU (the torch path is megatron's expressions). Backward: one fp32 softmax backward against
megatron's chain that rounds to the logits' dtype at each step: fp32 within 1e-6, bf16 within 2 bf16 ulps of the
largest gradient (atol 2**-7 * max|grad|) and rtol 2**-7.
"""

import pytest
import torch

from loongforge_hf.kernels.router import _ours, enable_megatron_fused_router, topk_softmax

from ._router_checks import distinct_logits


def _megatron(logits, topk, pre, scale):
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    return topk_routing_with_score_function(logits, topk, use_pre_softmax=pre, scaling_factor=scale)


def _logits(tokens, experts, dtype):
    return distinct_logits(tokens, experts).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pre", [False, True])
@pytest.mark.parametrize("scale", [None, 2.5])
def test_topk_softmax_matches_megatron(dtype, pre, scale):
    tokens, experts, k = 37, 60, 6
    x = _logits(tokens, experts, dtype)
    proj = torch.randn(tokens, experts, generator=torch.Generator().manual_seed(1))
    a = x.clone().requires_grad_()
    probs, routing_map = topk_softmax(a, k, pre_softmax=pre, scaling_factor=scale)
    b = x.clone().requires_grad_()
    ref_probs, ref_map = _megatron(b, k, pre, scale)
    assert probs.dtype == dtype and routing_map.dtype == torch.bool
    assert torch.equal(probs, ref_probs) and torch.equal(routing_map, ref_map)
    assert int(routing_map.sum()) == tokens * k
    (probs.float() * proj).sum().backward()
    (ref_probs.float() * proj).sum().backward()
    if dtype == torch.float32:
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-6)
    else:
        atol = 2 ** -7 * b.grad.float().abs().max().item()
        torch.testing.assert_close(a.grad.float(), b.grad.float(), rtol=2 ** -7, atol=atol)
    if not pre:  # a softmax over the chosen logits: nothing flows to the experts not chosen
        assert not a.grad[~routing_map].any()


def test_bad_arguments_name_the_problem():
    with pytest.raises(ValueError, match="logits \\[tokens, experts\\]"):
        topk_softmax(torch.zeros(2, 3, 4), 2)
    with pytest.raises(ValueError, match="topk=9 must lie in \\[1, 8\\]"):
        topk_softmax(torch.zeros(4, 8), 9)


def test_megatron_router_calls_it_only_for_the_cases_served():
    """The wrapper megatron's router calls: softmax routing goes to topk_softmax, sigmoid / grouped / biased / fused
    routing to megatron's function with the same arguments."""
    seen = []

    def original(logits, topk, **kw):
        seen.append(kw)
        return "megatron"

    wrapped = _ours(original)
    x = _logits(8, 16, torch.float32)
    probs, routing_map = wrapped(x, 2, use_pre_softmax=True, scaling_factor=None, score_function="softmax")
    assert routing_map.sum() == 16 and not seen
    for kw in ({"score_function": "sigmoid"}, {"num_groups": 4, "group_topk": 2},
               {"expert_bias": torch.zeros(16)}, {"fused": True}):
        assert wrapped(x, 2, **kw) == "megatron"
        assert all(seen[-1][key] is value for key, value in kw.items())
    enable_megatron_fused_router()
    enable_megatron_fused_router()  # idempotent: wrapped once
    from megatron.core.transformer.moe import router

    assert router.topk_routing_with_score_function.loongforge_fused
    assert not getattr(router.topk_routing_with_score_function.original, "loongforge_fused", False)
