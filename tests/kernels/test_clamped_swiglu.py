"""DeepSeek-V4's / HY-V4's clamped SwiGLU in our grouped expert MLP (kernels/clamped_glu.py with alpha 1,
kernels/grouped_mlp.py) against transformers' own ``DeepseekV4Experts`` and ``HYV4Experts`` on CPU in fp32: outputs
and the gradients of the input, the routing weights and both expert stacks, through the per-expert loop and the
``_grouped_mm`` path (torch's CPU fallback, forced), with entries clamped on both halves and an expert without tokens;
the op itself against HF's ``_apply_gate`` (forward bit for bit in fp32 and bf16, backward against autograd); which
activation a config picks (a plain SwiGLU without the clamp).

Tolerances: fp32 atol = rtol = 1e-5 (the same math through other GEMM kernels); bf16 gradients against autograd in
bf16: atol 1e-2, rtol 1.6e-2 (ours rounds once in fp32, autograd at every op), as for gpt-oss's clamped GLU.
"""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from loongforge_hf.kernels.clamped_glu import SILU_ALPHA, ClampedGLU, clamped_glu
from loongforge_hf.kernels.grouped_mlp import gated_activation, grouped_gated_mlp
from loongforge_hf.kernels.swiglu import SwiGLU

FP32 = dict(atol=1e-5, rtol=1e-5)
LIMIT = 1.5  # small, so that moderate inputs cross it
HIDDEN, FFN, EXPERTS, TOPK, EMPTY = 16, 12, 4, 2, 1  # expert EMPTY gets no tokens

needs_grouped_mm = pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no _grouped_mm")


def _hf_experts(model_type: str, seed: int = 0):
    """transformers' routed experts of ``model_type`` (random stacks ``[E, 2F, H]`` / ``[E, H, F]``)."""
    if model_type == "deepseek_v4":
        from transformers import DeepseekV4Config as Config
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Experts as Experts
        extra = dict(intermediate_size=FFN)
    else:
        from transformers import HYV4Config as Config
        from transformers.models.hy_v4.modeling_hy_v4 import HYV4Experts as Experts
        extra = dict(moe_intermediate_size=FFN)
    config = Config(hidden_size=HIDDEN, num_local_experts=EXPERTS, n_routed_experts=EXPERTS, swiglu_limit=LIMIT,
                    num_experts_per_tok=TOPK, **extra)
    config._experts_implementation = "eager"
    module = Experts(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        module.gate_up_proj.copy_(torch.randn(module.gate_up_proj.shape, generator=g) / HIDDEN ** 0.5)
        module.down_proj.copy_(torch.randn(module.down_proj.shape, generator=g) / FFN ** 0.5)
    return module


def _routing(tokens: int, seed: int):
    """Top-k routing that never picks expert EMPTY: indices [T, K], weights [T, K]."""
    g = torch.Generator().manual_seed(seed)
    allowed = torch.tensor([e for e in range(EXPERTS) if e != EMPTY])
    indices = torch.stack([allowed[torch.randperm(len(allowed), generator=g)[:TOPK]] for _ in range(tokens)])
    return indices, torch.softmax(torch.randn(tokens, TOPK, generator=g), dim=-1)


def _permute(indices):
    """megatron's dispatcher layout: (token, slot) pairs sorted by expert; each row's token and flat position, the
    tokens per expert."""
    order = torch.argsort(indices.flatten(), stable=True)
    return order // indices.shape[1], order, torch.bincount(indices.flatten(), minlength=EXPERTS)


@pytest.mark.parametrize("use_grouped_mm", [pytest.param(False, id="loop"),
                                            pytest.param(True, id="grouped_mm", marks=needs_grouped_mm)])
@pytest.mark.parametrize("model_type", ["deepseek_v4", "hy_v4"])
def test_matches_transformers_experts(model_type, use_grouped_mm):
    hf = _hf_experts(model_type)
    g = torch.Generator().manual_seed(7)
    tokens = 29
    x, grad = 2 * torch.randn(tokens, HIDDEN, generator=g), torch.randn(tokens, HIDDEN, generator=g)
    indices, weights = _routing(tokens, seed=8)
    xs, ws = x.clone().requires_grad_(), weights.clone().requires_grad_()
    want = hf(xs, indices, ws)
    want.backward(grad)

    # HF's stacks are [gate; up] halves along dim 1, megatron's fc1 rows too: the same tensor
    fc1, fc2 = (t.detach().clone().requires_grad_() for t in (hf.gate_up_proj, hf.down_proj))
    ox, ow = x.clone().requires_grad_(), weights.clone().requires_grad_()
    token, flat, counts = _permute(indices)
    activation = ClampedGLU(SimpleNamespace(gated_linear_unit=True, activation_func=F.silu,
                                            activation_func_clamp_value=LIMIT, glu_linear_offset=0.0))
    rows = grouped_gated_mlp(ox[token], fc1, fc2, counts, ow.flatten()[flat], activation=activation,
                             use_grouped_mm=use_grouped_mm)
    out = torch.zeros_like(x).index_add(0, token, rows)
    out.backward(grad)
    for name, a, b in (("out", out, want), ("d_x", ox.grad, xs.grad), ("d_weights", ow.grad, ws.grad),
                       ("d_fc1", fc1.grad, hf.gate_up_proj.grad), ("d_fc2", fc2.grad, hf.down_proj.grad)):
        torch.testing.assert_close(a, b, **FP32, msg=lambda m, n=name: f"{n}: {m}")
    h = torch.einsum("th,tfh->tf", x[token], fc1.detach()[torch.repeat_interleave(torch.arange(EXPERTS), counts)])
    gate, up = h.chunk(2, dim=-1)  # the clamp is active on both halves
    assert (gate > LIMIT).any() and (gate <= LIMIT).any() and (up > LIMIT).any() and (up < -LIMIT).any()
    assert counts[EMPTY] == 0 and not fc1.grad[EMPTY].any() and fc1.grad.any() and not fc2.grad[EMPTY].any()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, FP32), (torch.bfloat16, dict(atol=1e-2, rtol=1.6e-2))],
                         ids=["fp32", "bf16"])
def test_op_matches_hf_apply_gate(dtype, tol):
    hf = _hf_experts("deepseek_v4")
    g = torch.Generator().manual_seed(3)
    x = (3 * torch.randn(5, 3, 2 * FFN, generator=g)).to(dtype)
    grad = torch.randn(5, 3, FFN, generator=g).to(dtype)
    with torch.no_grad():
        assert torch.equal(clamped_glu(x, limit=LIMIT, offset=0.0, alpha=SILU_ALPHA), hf._apply_gate(x))
    ours, ref = x.clone().requires_grad_(), x.float().requires_grad_()
    clamped_glu(ours, limit=LIMIT, offset=0.0, alpha=SILU_ALPHA).backward(grad)
    hf._apply_gate(ref).backward(grad.float())
    assert ours.grad.dtype == dtype
    torch.testing.assert_close(ours.grad.float(), ref.grad, **tol)
    gate, up = x.float().chunk(2, dim=-1)
    d_gate, d_up = ours.grad.chunk(2, dim=-1)
    assert (gate > LIMIT).any() and (up.abs() > LIMIT).any()
    assert not d_gate[gate > LIMIT].any() and not d_up[up.abs() > LIMIT].any()  # a clamped entry: no gradient


def test_config_picks_the_activation():
    def config(limit=None, activation=F.silu):
        return SimpleNamespace(gated_linear_unit=True, activation_func=activation, activation_func_clamp_value=limit,
                               glu_linear_offset=0.0)

    clamped = gated_activation(config(LIMIT))
    assert isinstance(clamped, ClampedGLU) and (clamped.alpha, clamped.limit, clamped.offset) == (1.0, LIMIT, 0.0)
    assert isinstance(gated_activation(config()), SwiGLU)
    with pytest.raises(ValueError, match="activation_func_clamp_value must be set with activation_func=silu"):
        ClampedGLU(config())
    with pytest.raises(ValueError, match="activation_func_clamp_value must be None or positive"):
        gated_activation(config(-1.0))
    with pytest.raises(ValueError, match="activation_func must be"):
        gated_activation(config(LIMIT, F.gelu))
