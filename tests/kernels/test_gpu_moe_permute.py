"""moe_permute's Triton kernels against its torch path on CUDA (outputs and grads), at workload (c)'s MoE shape
(8192 tokens, hidden 2048, 128 experts, top-8) and edge cases; megatron's unfused permute / unpermute at that shape;
no host sync in permute / unpermute when ``num_out_tokens`` is given."""

import pytest
import torch
from megatron.core.transformer.moe import moe_utils

from loongforge_hf.kernels.moe_permute import permute, unpermute
from tests.kernels._moe_permute_checks import (allgather_config, check_all, check_case, dispatcher, megatron_dispatch,
                                               routing_map)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_workload_c_shape(dtype):
    assert len(check_case(8192, 2048, 128, 8, dtype, "cuda", empty=5)) == 3


def test_edge_cases():
    done = check_all("cuda", sizes=((1, 24, 6, 1), (1, 2048, 128, 8), (3, 1, 4, 2), (17, 4099, 3, 3),
                                    (129, 256, 256, 4)))
    assert len(done) == 30


def test_matches_megatron_unfused_at_workload_c_shape():
    gen = torch.Generator().manual_seed(3)
    routing, probs = routing_map(8192, 128, 8, 5, gen, "cuda")
    x = torch.randn(8192, 2048, generator=gen).to("cuda", torch.bfloat16)
    ours, ours_p, row_map = permute(x, routing, probs, num_out_tokens=8192 * 8)
    theirs, theirs_p, sorted_indices = moe_utils.permute(x, routing, probs, num_out_tokens=8192 * 8)
    assert torch.equal(ours, theirs) and torch.equal(ours_p, theirs_p)
    y = torch.randn_like(ours)
    back = unpermute(y, row_map, x.shape)
    ref = torch.zeros(x.shape, device="cuda").index_add_(0, sorted_indices, y.float())
    torch.testing.assert_close(back.float(), ref, atol=2 ** -7, rtol=2 ** -7)


def test_no_host_sync():
    gen = torch.Generator().manual_seed(4)
    routing, probs = routing_map(1024, 32, 4, 2, gen, "cuda")
    x = torch.randn(1024, 256, generator=gen).to("cuda", torch.bfloat16).requires_grad_()
    probs.requires_grad_()
    permute(x, routing, probs, num_out_tokens=4096)  # compile the kernels first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, out_p, row_map = permute(x, routing, probs, num_out_tokens=4096)
        back = unpermute(out * out_p[:, None].to(out.dtype), row_map, x.shape)
        back.float().sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert x.grad is not None and probs.grad is not None


def test_sync_free_allgather_dispatch_on_cuda(monkeypatch):
    """The allgather dispatch with every expert local (kernels/moe_permute.py's subclass) at workload (c)'s shape:
    megatron's permuted tokens, token counts and probabilities, with CUDA's sync check set to raise while it runs."""
    from megatron.core.transformer.moe import moe_layer

    from loongforge_hf.kernels.moe_permute import enable_megatron_fused_permute

    original = megatron_dispatch(monkeypatch)
    config = allgather_config(num_moe_experts=128, moe_router_topk=8)
    assert enable_megatron_fused_permute(config)
    cls = moe_layer.MoEAllGatherTokenDispatcher
    gen = torch.Generator().manual_seed(6)
    routing, probs = routing_map(8192, 128, 8, 5, gen, "cuda")
    x = torch.randn(8192, 2048, generator=gen).to("cuda", torch.bfloat16)

    def dispatch(method):
        return method(dispatcher(cls, config, routing, 128), x, probs)

    dispatch(cls.dispatch_postprocess)  # compile the kernels first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ours = dispatch(cls.dispatch_postprocess)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    theirs = dispatch(original.dispatch_postprocess)
    assert ours[1].is_cuda and torch.equal(ours[1].cpu(), theirs[1])
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[2], theirs[2])
