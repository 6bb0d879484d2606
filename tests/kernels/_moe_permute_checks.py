"""moe_permute's Triton kernels against its torch path (the reference), on one device: CUDA in the ``gpu`` test, the
CPU under ``TRITON_INTERPRET=1`` in test_moe_permute.py. ``LOONGFORGE_TRITON`` switches between the two paths.

Both paths sum in fp32 and round once, over <= k terms in another order: outputs and grads agree to one rounding of
the output dtype (fp32: 1e-5 relative); copies (permuted tokens and probs, the probs' grad of permute) are bit-exact.
"""

from types import SimpleNamespace

import torch

from loongforge_hf.kernels._triton import triton_paths
from loongforge_hf.kernels.moe_permute import permute, unpermute

TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2 ** -7, 2 ** -7)}


def routing_map(tokens: int, experts: int, topk: int, empty: int, gen: torch.Generator, device) -> tuple:
    used = max(topk, experts - empty)
    chosen = torch.rand(tokens, used, generator=gen).topk(topk, dim=1).indices
    routing = torch.zeros(tokens, experts, dtype=torch.bool).scatter_(1, chosen, True)
    probs = torch.rand(tokens, experts, generator=gen) + 0.1
    return routing.to(device), probs.to(device)


def allgather_config(**changes) -> SimpleNamespace:
    """What ``enable_megatron_fused_permute`` and the allgather dispatch read of a TransformerConfig: 4 experts,
    top-2, the allgather dispatcher at expert parallel 1, no capacity or padding (``changes`` override)."""
    return SimpleNamespace(**{**dict(num_moe_experts=4, moe_token_dispatcher_type="allgather",
                                     moe_pad_expert_input_to_capacity=False, moe_expert_capacity_factor=None,
                                     moe_router_padding_for_quantization=False, expert_model_parallel_size=1,
                                     moe_permute_fusion=False, moe_router_topk=2), **changes})


def megatron_dispatch(monkeypatch):
    """megatron's own permutation functions and allgather dispatcher class for this test (whatever an earlier
    ``enable_megatron_fused_permute`` installed is put back after it); returns that class."""
    from megatron.core.transformer.moe import moe_layer, moe_utils, token_dispatcher

    for name in ("permute", "unpermute", "sort_chunks_by_idxs"):
        monkeypatch.setattr(token_dispatcher, name, getattr(moe_utils, name))
    monkeypatch.setattr(moe_layer, "MoEAllGatherTokenDispatcher", token_dispatcher.MoEAllGatherTokenDispatcher)
    return token_dispatcher.MoEAllGatherTokenDispatcher


def dispatcher(cls, config, routing: torch.Tensor, local: int):
    """An allgather dispatcher of class ``cls`` holding ``routing`` (what its token_dispatch left), with the first
    ``local`` experts on this rank, built without process groups (its dispatch_postprocess needs none)."""
    d = cls.__new__(cls)
    d.num_local_experts, d.local_expert_indices, d.config, d.routing_map = local, list(range(local)), config, routing
    return d


def _both_paths(fn, tensors, grads):
    out = []
    for enabled in (True, False):
        with triton_paths(enabled):
            leaves = [t.clone().requires_grad_() for t in tensors]
            results = fn(*leaves)
            torch.autograd.backward([r for r in results if r is not None],
                                    [g for r, g in zip(results, grads) if r is not None])
            out.append([r.detach() for r in results if r is not None] + [t.grad for t in leaves])
    return out


def _compare(name, triton_results, torch_results, dtype, exact=()):
    atol, rtol = TOL[dtype]
    for i, (a, b) in enumerate(zip(triton_results, torch_results)):
        if a is None or b is None:
            assert a is None and b is None, f"{name}[{i}]"
        elif i in exact:
            assert torch.equal(a, b), f"{name}[{i}] differs"
        else:
            torch.testing.assert_close(a.float(), b.float(), atol=atol * max(1.0, float(b.abs().max())), rtol=rtol,
                                       msg=lambda m: f"{name}[{i}]: {m}")


def check_case(tokens, hidden, experts, topk, dtype, device, *, empty=2, seed=0) -> list[str]:
    gen = torch.Generator().manual_seed(seed)
    routing, probs = routing_map(tokens, experts, topk, empty, gen, device)
    rows = tokens * topk
    x = torch.randn(tokens, hidden, generator=gen).to(device=device, dtype=dtype)
    g_rows = torch.randn(rows, hidden, generator=gen).to(device=device, dtype=dtype)
    g_probs = torch.randn(rows, generator=gen).to(device)
    g_out = torch.randn(tokens, hidden, generator=gen).to(device=device, dtype=dtype)
    done = []
    tag = f"T={tokens} H={hidden} E={experts} k={topk} {dtype}"

    def perm(t, p):
        out, out_p, _ = permute(t, routing, p, num_out_tokens=rows)
        return out, out_p

    triton_r, torch_r = _both_paths(perm, [x, probs], [g_rows, g_probs])
    _compare(f"permute {tag}", triton_r, torch_r, dtype, exact=(0, 1, 3))
    done.append(f"permute {tag}")

    permuted, _, row_map = permute(x, routing, num_out_tokens=rows)
    for with_probs in (False, True):
        def unperm(t, p):
            return (unpermute(t, row_map, x.shape, p if with_probs else None, routing),)

        triton_r, torch_r = _both_paths(unperm, [permuted, probs], [g_out])
        if not with_probs:
            assert triton_r[2] is None and torch_r[2] is None
        _compare(f"unpermute probs={with_probs} {tag}", triton_r, torch_r, dtype,
                 exact=() if with_probs else (1,))
        if with_probs:
            assert torch.all(triton_r[2][~routing] == 0)
        done.append(f"unpermute probs={with_probs} {tag}")
    return done


def check_all(device, sizes=((1, 24, 6, 1), (7, 40, 5, 2), (33, 72, 9, 4), (50, 1030, 8, 3))) -> list[str]:
    done = []
    for dtype in (torch.float32, torch.bfloat16):
        for tokens, hidden, experts, topk in sizes:
            done += check_case(tokens, hidden, experts, topk, dtype, device)
    return done
