"""moe_permute against megatron-core's unfused ``moe_utils.permute`` / ``unpermute``: outputs and gradients of the
tokens and the probs, on random routing maps (empty experts, top-k 1..4, one token), fp32 and bf16; the Triton kernels
in the interpreter (child process); the dispatcher wiring of ``enable_megatron_fused_permute``.

Tolerances: fp32 1e-5 (sums of <= 4 terms in another order). bf16: megatron adds the permuted rows in bf16 (rounding
at each add) where ours rounds an fp32 sum once, so ours is compared with an fp32 reference to one rounding of the
output dtype and megatron's result is checked to lie within k roundings of that reference.
"""


import pytest
import torch
from megatron.core.transformer.moe import moe_utils

from loongforge_hf.kernels.moe_permute import enable_megatron_fused_permute, permute, unpermute

from ._interpret import needs_triton, run_interpreted
from ._moe_permute_checks import allgather_config, dispatcher, megatron_dispatch

BF16_ULP = 2.0 ** -7


def _routing(tokens: int, experts: int, topk: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A top-k routing map with some experts left empty, and softmax-like probs (nonzero everywhere)."""
    used = max(topk, experts - 2)  # the last two experts get no token
    scores = torch.rand(tokens, used, generator=gen)
    chosen = scores.topk(topk, dim=1).indices
    routing = torch.zeros(tokens, experts, dtype=torch.bool)
    routing.scatter_(1, chosen, True)
    probs = torch.rand(tokens, experts, generator=gen) + 0.1
    return routing, probs


def _run(fn, tokens, probs, grad_out, grad_probs):
    leaves = [tokens.clone().requires_grad_(), probs.clone().requires_grad_()]
    out, out_probs = fn(*leaves)
    loss = (out.float() * grad_out.float()).sum()
    if out_probs is not None:
        loss = loss + (out_probs.float() * grad_probs).sum()
    loss.backward()
    return [out.detach(), None if out_probs is None else out_probs.detach(), leaves[0].grad, leaves[1].grad]


def _close(ours, theirs, *, atol, rtol, what):
    torch.testing.assert_close(ours.float(), theirs.float(), atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


CASES = [(1, 6, 1), (1, 6, 3), (7, 5, 2), (33, 9, 4), (64, 16, 1), (50, 8, 3)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_probs", [False, True])
def test_permute_unpermute_match_megatron(dtype, with_probs):
    gen = torch.Generator().manual_seed(0)
    for tokens, experts, topk in CASES:
        routing, probs = _routing(tokens, experts, topk, gen)
        hidden = 24
        x = torch.randn(tokens, hidden, generator=gen).to(dtype)
        rows = int(routing.sum())
        g_perm = torch.randn(rows, hidden, generator=gen).to(dtype)
        g_pprobs = torch.randn(rows, generator=gen)
        g_out = torch.randn(tokens, hidden, generator=gen).to(dtype)
        case = f"T={tokens} E={experts} k={topk} {dtype} probs={with_probs}"

        def ours_perm(t, p):
            out, out_p, _ = permute(t, routing, p if with_probs else None, num_out_tokens=rows)
            return out, out_p

        def theirs_perm(t, p):
            out, out_p, _ = moe_utils.permute(t, routing, p if with_probs else None, num_out_tokens=rows)
            return out, out_p

        ours, theirs = _run(ours_perm, x, probs, g_perm, g_pprobs), _run(theirs_perm, x, probs, g_perm, g_pprobs)
        assert torch.equal(ours[0], theirs[0]), case  # a copy: bit-exact
        if with_probs:
            assert torch.equal(ours[1], theirs[1]), case
            assert torch.equal(ours[3], theirs[3]), case
        else:
            assert ours[1] is None and ours[3] is None
        # grad of the tokens: a sum over <= k rows (megatron's index_add_ rounds each add in bf16)
        ref = torch.zeros(tokens, hidden).index_add_(0, moe_utils.permute(x, routing)[2], g_perm.float())
        _close(ours[2], ref, atol=1e-5 if dtype == torch.float32 else BF16_ULP, rtol=1e-5 if dtype == torch.float32
               else BF16_ULP, what=f"permute grad {case}")
        _close(theirs[2], ref, atol=1e-5 if dtype == torch.float32 else topk * BF16_ULP * 4,
               rtol=1e-5 if dtype == torch.float32 else topk * BF16_ULP, what=f"megatron permute grad {case}")

        permuted, _, row_map = permute(x, routing, num_out_tokens=rows)
        sorted_indices = moe_utils.permute(x, routing)[2]

        def ours_unperm(t, p):
            return unpermute(t, row_map, x.shape, p if with_probs else None, routing), None

        def theirs_unperm(t, p):
            return moe_utils.unpermute(t, sorted_indices, x.shape, p if with_probs else None, routing), None

        ours = _run(ours_unperm, permuted, probs, g_out, None)
        theirs = _run(theirs_unperm, permuted, probs, g_out, None)
        # fp32 reference of the forward: sum over the token's rows of row (* prob)
        weights = probs.T.contiguous().masked_select(routing.T.contiguous()) if with_probs else torch.ones(rows)
        ref = torch.zeros(tokens, hidden).index_add_(0, sorted_indices, permuted.float() * weights[:, None])
        tol = (1e-5, 1e-5) if dtype == torch.float32 else (BF16_ULP, BF16_ULP)
        _close(ours[0], ref, atol=tol[0], rtol=tol[1], what=f"unpermute {case}")
        _close(ours[0], theirs[0], atol=tol[0] * topk * 4, rtol=tol[1] * topk, what=f"unpermute vs megatron {case}")
        if dtype == torch.float32 or not with_probs:
            # grad of the permuted rows: a copy of the token's grad (times one prob, rounded once)
            _close(ours[2], theirs[2], atol=tol[0], rtol=tol[1], what=f"unpermute grad {case}")
        else:
            ref = g_out.float().index_select(0, sorted_indices) * weights[:, None]
            _close(ours[2], ref, atol=tol[0], rtol=tol[1], what=f"unpermute grad {case}")
        if with_probs:
            # grad of the probs: fp32 dots, zero where not routed
            _close(ours[3], theirs[3], atol=1e-4 if dtype == torch.float32 else 1e-3, rtol=1e-5,
                   what=f"probs grad {case}")
            assert torch.all(ours[3][~routing] == 0)
        else:
            assert ours[3] is None


def test_fewer_out_tokens_drop_the_last_rows():
    gen = torch.Generator().manual_seed(1)
    routing, probs = _routing(20, 6, 2, gen)
    x = torch.randn(20, 8, generator=gen)
    full, full_probs, _ = moe_utils.permute(x, routing, probs)
    out, out_probs, row_map = permute(x, routing, probs, num_out_tokens=30)
    assert torch.equal(out, full[:30]) and torch.equal(out_probs, full_probs[:30])
    assert int((row_map >= 0).sum()) == 30
    # without num_out_tokens the routed pairs are counted
    assert permute(x, routing)[0].shape == full.shape


def test_unpermute_checks_the_restore_shape():
    routing = torch.tensor([[True, False], [True, True]])
    permuted, _, row_map = permute(torch.randn(2, 4), routing)
    with pytest.raises(ValueError, match="restore_shape"):
        unpermute(permuted, row_map, torch.Size((3, 4)))


def test_dispatcher_wiring(monkeypatch):
    from megatron.core.transformer.moe import token_dispatcher

    megatron_dispatch(monkeypatch)
    for refused in ({"moe_expert_capacity_factor": 1.0}, {"moe_pad_expert_input_to_capacity": True},
                    {"moe_token_dispatcher_type": "flex"}, {"moe_token_dispatcher_type": "alltoall"}):
        config = allgather_config(**refused)
        if refused.get("moe_token_dispatcher_type") == "alltoall" and torch.cuda.is_available():
            continue
        assert not enable_megatron_fused_permute(config) and not config.moe_permute_fusion
    assert token_dispatcher.permute is moe_utils.permute
    config = allgather_config()
    assert enable_megatron_fused_permute(config) and config.moe_permute_fusion
    assert getattr(token_dispatcher.permute, "loongforge_fused", False)
    wrapped = token_dispatcher.permute
    assert enable_megatron_fused_permute(allgather_config()) and token_dispatcher.permute is wrapped

    gen = torch.Generator().manual_seed(2)
    routing, probs = _routing(9, 4, 2, gen)
    x = torch.randn(9, 16, generator=gen)
    fused = token_dispatcher.permute(x, routing, probs=probs, num_out_tokens=torch.tensor(18), fused=True)
    unfused = token_dispatcher.permute(x, routing, probs=probs, num_out_tokens=18, fused=False)
    assert torch.equal(fused[0], unfused[0]) and torch.equal(fused[1], unfused[1])
    assert fused[2].shape == (9, 4) and unfused[2].shape == (18,)  # ours: the row map; megatron's: sorted indices
    back = token_dispatcher.unpermute(fused[0], fused[2], x.shape, routing_map=routing, fused=True)
    torch.testing.assert_close(back, x * 2)
    back = token_dispatcher.unpermute(unfused[0], unfused[2], x.shape, routing_map=routing, fused=False)
    torch.testing.assert_close(back, x * 2)
    sizes, order = torch.tensor([3, 5, 10]), torch.tensor([2, 0, 1])
    chunks, _ = token_dispatcher.sort_chunks_by_idxs(unfused[0], sizes, order, fused=True)
    assert torch.equal(chunks, torch.cat([unfused[0][8:], unfused[0][:8]]))


@needs_triton
def test_triton_kernels_match_torch_path_in_the_interpreter():
    checked = run_interpreted("from tests.kernels._moe_permute_checks import check_all\ncheck_all('cpu')")
    assert len(checked) >= 8, checked


@pytest.mark.parametrize("local", [4, 2])
def test_sync_free_allgather_dispatch_matches_megatron(monkeypatch, local):
    """Every expert local (4 of 4): the subclass's dispatch gives megatron's permuted tokens, token counts (left on
    the device) and probabilities, and the same gradients, without reading anything back to the host (``cpu``,
    ``item``, ``tolist`` and ``masked_select`` raise while it runs). Half the experts local (2 of 4, expert parallel
    under the allgather dispatcher): megatron's own method runs."""
    from megatron.core.transformer.moe import moe_layer

    original = megatron_dispatch(monkeypatch)
    config = allgather_config()
    assert enable_megatron_fused_permute(config)
    cls = moe_layer.MoEAllGatherTokenDispatcher
    assert cls is not original and issubclass(cls, original) and cls.sync_free
    enable_megatron_fused_permute(allgather_config())
    assert moe_layer.MoEAllGatherTokenDispatcher is cls  # installed once

    gen = torch.Generator().manual_seed(5)
    routing, probs = _routing(11, 4, 2, gen)
    x, grad_out = torch.randn(11, 8, generator=gen), torch.randn(22, 8, generator=gen)
    grad_probs = torch.randn(22, generator=gen)
    grad_out, grad_probs = grad_out[:routing[:, :local].sum()], grad_probs[:routing[:, :local].sum()]

    def dispatch(method, *, no_sync: bool):
        d = dispatcher(cls, config, routing, local)
        leaves = [x.clone().requires_grad_(), probs.clone().requires_grad_()]
        with pytest.MonkeyPatch.context() as m:
            if no_sync:
                for name in ("cpu", "item", "tolist", "masked_select"):
                    m.setattr(torch.Tensor, name, lambda *a, _n=name, **k: pytest.fail(f"host sync: {_n}"))
            out, counts, out_probs = method(d, *leaves)
        ((out * grad_out).sum() + (out_probs * grad_probs).sum()).backward()
        back = d.combine_preprocess(out.detach())
        return out.detach(), counts, out_probs.detach(), leaves[0].grad, leaves[1].grad, back

    ours = dispatch(cls.dispatch_postprocess, no_sync=local == 4)
    theirs = dispatch(original.dispatch_postprocess, no_sync=False)
    assert torch.equal(ours[1], theirs[1]) and ours[1].dtype == torch.int64
    for a, b in zip(ours[:1] + ours[2:], theirs[:1] + theirs[2:]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
