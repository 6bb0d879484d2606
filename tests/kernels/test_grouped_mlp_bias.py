"""Routed experts with biases and gpt-oss's clamped GLU (kernels/grouped_mlp.py, kernels/clamped_glu.py) against
transformers' own ``GptOssExperts``, on CPU in fp32: outputs and the gradients of the input, the routing weights and
every weight and bias, through the per-expert loop and the ``_grouped_mm`` path (torch's CPU fallback, forced), with
entries clamped and an expert without tokens; the megatron module (bias parameters, attributes, expert-tensor
parallel shards, checkpoint sharding); LowRank adapters with biases; the refusals (activation, FP8, LoRA). The
``gpu`` tests compare the grouped path with the loop in bf16 on CUDA and check that it reads nothing on the host.

Tolerances: fp32 atol = rtol = 1e-5 (the same math with other GEMM kernels: differences of a few fp32 ulps of
entries up to ~30); bf16 clamped GLU against autograd in bf16: atol 1e-2, rtol 1.6e-2 (ours rounds once in fp32,
autograd at every op), as for SwiGLU.
"""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from loongforge_hf.kernels.clamped_glu import ClampedGLU, clamped_glu
from loongforge_hf.kernels.grouped_mlp import GroupedMLP, LowRank, grouped_gated_mlp

from .test_grouped_mlp import _Group

FP32 = dict(atol=1e-5, rtol=1e-5)
LIMIT = 2.0  # small, so that moderate inputs cross it
HIDDEN, FFN, EXPERTS, TOPK, EMPTY = 16, 12, 4, 2, 2  # expert EMPTY gets no tokens

needs_grouped_mm = pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no _grouped_mm")


def _activation(limit=LIMIT):
    return lambda h: clamped_glu(h, limit=limit, offset=1.0)


# ---- transformers' GptOssExperts and its weights in megatron's layout -----------------------------------------------
def _hf_experts(*, hidden=HIDDEN, ffn=FFN, experts=EXPERTS, seed=0):
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    config = GptOssConfig(hidden_size=hidden, intermediate_size=ffn, num_local_experts=experts,
                          num_experts_per_tok=TOPK, swiglu_limit=LIMIT, num_hidden_layers=1, num_attention_heads=2,
                          num_key_value_heads=1, head_dim=8, vocab_size=32)
    config._experts_implementation = "eager"
    module = GptOssExperts(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        module.gate_up_proj.copy_(torch.randn(module.gate_up_proj.shape, generator=g) / hidden ** 0.5)
        module.gate_up_proj_bias.copy_(torch.randn(module.gate_up_proj_bias.shape, generator=g))
        module.down_proj.copy_(torch.randn(module.down_proj.shape, generator=g) / ffn ** 0.5)
        module.down_proj_bias.copy_(torch.randn(module.down_proj_bias.shape, generator=g))
    return module


def _gate_up(t: torch.Tensor) -> torch.Tensor:
    """HF's alternating gate / up columns (last dimension) -> megatron's [gate; up]."""
    return torch.cat((t[..., ::2], t[..., 1::2]), dim=-1)


def _megatron(hf):
    """fc1 [E, 2F, H], b1 [E, 2F], fc2 [E, H, F], b2 [E, H] from GptOssExperts (copies)."""
    return (_gate_up(hf.gate_up_proj.detach()).transpose(1, 2).contiguous(), _gate_up(hf.gate_up_proj_bias.detach()),
            hf.down_proj.detach().transpose(1, 2).contiguous(), hf.down_proj_bias.detach().clone())


def _megatron_grads(hf):
    return (_gate_up(hf.gate_up_proj.grad).transpose(1, 2), _gate_up(hf.gate_up_proj_bias.grad),
            hf.down_proj.grad.transpose(1, 2), hf.down_proj_bias.grad)


def _routing(tokens, *, experts=EXPERTS, empty=EMPTY, seed=1):
    """Fixed top-k routing that never picks expert ``empty``: indices [T, K], softmaxed weights [T, K]."""
    g = torch.Generator().manual_seed(seed)
    allowed = torch.tensor([e for e in range(experts) if e != empty])
    indices = torch.stack([allowed[torch.randperm(len(allowed), generator=g)[:TOPK]] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, TOPK, generator=g), dim=-1)
    return indices, weights


def _permute(indices, experts=EXPERTS):
    """megatron's dispatcher layout: the (token, slot) pairs sorted by expert. Returns each row's token, each row's
    flat (token, slot) position and the tokens per expert."""
    flat = indices.flatten()
    order = torch.argsort(flat, stable=True)
    return order // indices.shape[1], order, torch.bincount(flat, minlength=experts)


def _case(tokens=23, seed=0):
    hf = _hf_experts(seed=seed)
    g = torch.Generator().manual_seed(seed + 10)
    x = 2 * torch.randn(tokens, HIDDEN, generator=g)
    indices, weights = _routing(tokens, seed=seed + 1)
    grad = torch.randn(tokens, HIDDEN, generator=g)
    return hf, x, indices, weights, grad


def _run_hf(hf, x, indices, weights, grad):
    xs, ws = x.clone().requires_grad_(), weights.clone().requires_grad_()
    out = hf(xs, indices, ws)
    out.backward(grad)
    return out.detach(), xs.grad, ws.grad, _megatron_grads(hf)


def _run_ours(params, x, indices, weights, grad, *, use_grouped_mm, adapters=(None, None)):
    """Permute, run ``grouped_gated_mlp`` on (fc1, b1, fc2, b2) leaves, un-permute (sum each token's rows)."""
    fc1, b1, fc2, b2 = (p.clone().requires_grad_() for p in params)
    xs, ws = x.clone().requires_grad_(), weights.clone().requires_grad_()
    token, flat, counts = _permute(indices)
    rows = grouped_gated_mlp(xs[token], fc1, fc2, counts, ws.flatten()[flat], biases=(b1, b2),
                             activation=_activation(), adapters=adapters, use_grouped_mm=use_grouped_mm)
    out = torch.zeros_like(x).index_add(0, token, rows)
    out.backward(grad)
    return out.detach(), xs.grad, ws.grad, (fc1.grad, b1.grad, fc2.grad, b2.grad)


PATHS = [pytest.param(False, id="loop"), pytest.param(True, id="grouped_mm", marks=needs_grouped_mm)]


@pytest.mark.parametrize("use_grouped_mm", PATHS)
def test_matches_gpt_oss_experts(use_grouped_mm):
    hf, x, indices, weights, grad = _case()
    params = _megatron(hf)
    want_out, want_dx, want_dw, (w1, wb1, w2, wb2) = _run_hf(hf, x, indices, weights, grad)
    out, dx, dw, (g1, gb1, g2, gb2) = _run_ours(params, x, indices, weights, grad, use_grouped_mm=use_grouped_mm)
    for name, a, b in (("out", out, want_out), ("d_x", dx, want_dx), ("d_weights", dw, want_dw),
                       ("d_fc1", g1, w1), ("d_fc1_bias", gb1, wb1), ("d_fc2", g2, w2), ("d_fc2_bias", gb2, wb2)):
        torch.testing.assert_close(a, b, **FP32, msg=lambda m, n=name: f"{n}: {m}")
    # the clamp is active on both halves: gate above the limit, up beyond it on either side
    token, _, counts = _permute(indices)
    expert = torch.repeat_interleave(torch.arange(EXPERTS), counts)
    h = torch.einsum("th,tfh->tf", x[token], params[0][expert]) + params[1][expert]
    gate, up = h.chunk(2, dim=-1)
    assert (gate > LIMIT).any() and (gate <= LIMIT).any() and (up > LIMIT).any() and (up < -LIMIT).any()
    # the expert without tokens: zero gradients, not None
    assert counts[EMPTY] == 0
    for g in (g1, gb1, g2, gb2):
        assert torch.count_nonzero(g[EMPTY]) == 0
        assert torch.count_nonzero(g) > 0


@needs_grouped_mm
def test_grouped_mm_path_equals_loop_and_runs_without_grad():
    hf, x, indices, weights, grad = _case(tokens=31, seed=3)
    params = _megatron(hf)
    loop = _run_ours(params, x, indices, weights, grad, use_grouped_mm=False)
    grouped = _run_ours(params, x, indices, weights, grad, use_grouped_mm=True)
    for a, b in zip((*grouped[:3], *grouped[3]), (*loop[:3], *loop[3])):
        torch.testing.assert_close(a, b, **FP32)
    token, flat, counts = _permute(indices)
    fc1, b1, fc2, b2 = params
    with torch.no_grad():  # inference: no autograd Function recorded, the same values
        for use in (False, True):
            rows = grouped_gated_mlp(x[token], fc1, fc2, counts, weights.flatten()[flat], biases=(b1, b2),
                                     activation=_activation(), use_grouped_mm=use)
            torch.testing.assert_close(torch.zeros_like(x).index_add(0, token, rows), loop[0], **FP32)


# ---- the clamped GLU op ---------------------------------------------------------------------------------------------
def _glu_reference(x, limit, offset=1.0, alpha=1.702):
    gate, up = x.chunk(2, dim=-1)
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return gate * torch.sigmoid(alpha * gate) * (up + offset)


@pytest.mark.parametrize("limit", [LIMIT, None], ids=["clamped", "no-clamp"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, FP32), (torch.bfloat16, dict(atol=1e-2, rtol=1.6e-2))],
                         ids=["fp32", "bf16"])
def test_clamped_glu_matches_autograd_reference(limit, dtype, tol):
    g = torch.Generator().manual_seed(4)
    x = (3 * torch.randn(5, 3, 34, generator=g)).to(dtype)
    grad = torch.randn(5, 3, 17, generator=g).to(dtype)
    assert torch.equal(clamped_glu(x, limit=limit), _glu_reference(x, limit))  # the forward, bit for bit
    ours, ref = x.clone().requires_grad_(), x.float().requires_grad_()
    clamped_glu(ours, limit=limit).backward(grad)
    _glu_reference(ref, limit).backward(grad.float())
    assert ours.grad.dtype == dtype
    torch.testing.assert_close(ours.grad.float(), ref.grad, **tol)
    if limit is not None:  # a clamped entry gets no gradient
        gate, up = x.float().chunk(2, dim=-1)
        d_gate, d_up = ours.grad.chunk(2, dim=-1)
        assert (gate > limit).any() and (up.abs() > limit).any()
        assert not d_gate[gate > limit].any() and not d_up[up.abs() > limit].any()


def test_clamped_glu_odd_width_is_rejected():
    with pytest.raises(ValueError, match="must be even"):
        clamped_glu(torch.randn(3, 5), limit=1.0)


# ---- LowRank adapters with biases, SwiGLU with biases ----------------------------------------------------------------
def _low_rank(e, out, inp, r, g, scaling):
    return LowRank((torch.randn(e, r, inp, generator=g) / inp ** 0.5).requires_grad_(),
                   (torch.randn(e, out, r, generator=g) / r ** 0.5).requires_grad_(), scaling)


def _per_token(x, fc1, b1, fc2, b2, counts, probs, activation):
    expert = torch.repeat_interleave(torch.arange(len(counts)), torch.as_tensor(counts))
    h = torch.einsum("th,tfh->tf", x, fc1[expert]) + b1[expert]
    act = activation(h) * probs.unsqueeze(-1)
    return torch.einsum("tf,thf->th", act, fc2[expert]) + b2[expert] * probs.unsqueeze(-1)


@pytest.mark.parametrize("activation", [pytest.param(None, id="swiglu"), pytest.param(_activation(), id="clamped")])
def test_biases_with_adapters_and_swiglu(activation):
    """Biases on top of LowRank terms (both projections) against a per-token reference on merged weights, through
    the loop and, where torch has it, the ``_grouped_mm`` path; SwiGLU experts take biases too."""
    g = torch.Generator().manual_seed(5)
    counts = [3, 0, 7, 1, 0, 5]
    e, t, ffn = len(counts), sum(counts), 8
    x = torch.randn(t, HIDDEN, generator=g)
    fc1, fc2 = torch.randn(e, 2 * ffn, HIDDEN, generator=g) / 4, torch.randn(e, HIDDEN, ffn, generator=g) / 4
    b1, b2 = torch.randn(e, 2 * ffn, generator=g), torch.randn(e, HIDDEN, generator=g)
    probs = torch.rand(t, generator=g)
    adapters = (_low_rank(e, 2 * ffn, HIDDEN, 4, g, 2.0), _low_rank(e, HIDDEN, ffn, 4, g, 0.5))
    kw = {} if activation is None else {"activation": activation}
    from loongforge_hf.kernels.swiglu import swiglu

    merged = [w + a.scaling * torch.bmm(a.B, a.A) for w, a in zip((fc1, fc2), adapters)]
    want = _per_token(x, merged[0], b1, merged[1], b2, counts, probs, activation or swiglu).detach()
    paths = [False] + ([True] if hasattr(torch, "_grouped_mm") else [])
    results = []
    for use in paths:
        leaves = [b1.clone().requires_grad_(), b2.clone().requires_grad_()]
        for a in adapters:
            a.A.grad = a.B.grad = None
        out = grouped_gated_mlp(x, fc1, fc2, counts, probs, adapters=adapters, biases=tuple(leaves),
                                use_grouped_mm=use, **kw)
        torch.testing.assert_close(out, want, **FP32)
        out.backward(torch.ones_like(out))
        results.append([leaves[0].grad, leaves[1].grad, *(t.grad.clone() for a in adapters for t in (a.A, a.B))])
    for grouped in results[1:]:
        for a, b in zip(grouped, results[0]):
            torch.testing.assert_close(a, b, **FP32)


def test_bias_shapes_are_checked():
    x, fc1, fc2 = torch.randn(3, 16), torch.randn(2, 24, 16), torch.randn(2, 16, 12)
    with pytest.raises(ValueError, match="fc2's bias"):
        grouped_gated_mlp(x, fc1, fc2, [1, 2], biases=(torch.zeros(2, 24), torch.zeros(2, 12)))


# ---- the megatron module ---------------------------------------------------------------------------------------------
def _config(**kw):
    from megatron.core.fusions.fused_bias_geglu import quick_gelu
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = dict(num_layers=2, hidden_size=HIDDEN, num_attention_heads=2, ffn_hidden_size=24, moe_ffn_hidden_size=FFN,
                num_moe_experts=8, moe_router_topk=TOPK, gated_linear_unit=True, activation_func=quick_gelu,
                glu_linear_offset=1.0, activation_func_clamp_value=LIMIT, bias_activation_fusion=False,
                add_bias_linear=True, use_cpu_initialization=True, perform_initialization=False,
                params_dtype=torch.float32, expert_model_parallel_size=2, expert_tensor_parallel_size=1)
    return TransformerConfig(**{**base, **kw})


def _module(config, *, local=EXPERTS, ep=(0, 2), etp=(0, 1), edp=(0, 1)):
    pg = SimpleNamespace(ep=_Group(*ep), expt_tp=_Group(*etp), expt_dp=_Group(*edp))
    return GroupedMLP(local, config, pg_collection=pg)


def _load(module, params):
    with torch.no_grad():
        for t, p in zip((module.linear_fc1.weight, module.linear_fc1.bias, module.linear_fc2.weight,
                         module.linear_fc2.bias), params):
            t.copy_(p)


def test_module_parameters_attributes_and_forward():
    m = _module(_config(perform_initialization=True))
    assert [n for n, _ in m.named_parameters()] == ["linear_fc1.weight", "linear_fc1.bias", "linear_fc2.weight",
                                                    "linear_fc2.bias"]
    b1, b2 = m.linear_fc1.bias, m.linear_fc2.bias
    assert tuple(b1.shape) == (EXPERTS, 2 * FFN) and tuple(b2.shape) == (EXPERTS, HIDDEN)
    assert not b1.any() and not b2.any()  # zero, like megatron's biases
    assert b1.dtype == b2.dtype == m.linear_fc1.weight.dtype
    assert b1.allreduce is False and b2.allreduce is False  # expert parallel: reduced over expert-DP only
    assert (b1.tensor_model_parallel, b1.partition_dim) == (True, 1)
    assert (b2.tensor_model_parallel, b2.partition_dim) == (True, 0)  # etp 1: no replica on another rank
    assert not getattr(b2, "sequence_parallel", False)
    assert isinstance(m.activation, ClampedGLU) and (m.activation.limit, m.activation.offset) == (LIMIT, 1.0)
    hf, x, indices, weights, grad = _case(seed=6)
    _load(m, _megatron(hf))
    want = _run_hf(hf, x, indices, weights, grad)
    token, flat, counts = _permute(indices)
    xs = x.clone().requires_grad_()
    rows, bias = m(xs[token], counts, weights.flatten()[flat])
    assert bias is None
    out = torch.zeros_like(x).index_add(0, token, rows)
    out.backward(grad)
    torch.testing.assert_close(out, want[0], **FP32)
    torch.testing.assert_close(xs.grad, want[1], **FP32)
    for p, w in zip((m.linear_fc1.weight, b1, m.linear_fc2.weight, b2), want[3]):
        torch.testing.assert_close(p.grad, w, **FP32)


def test_expert_tensor_parallel_shards_sum_to_the_whole():
    """ETP rank r holds fc1 rows and fc1 bias entries [gate_r; up_r], fc2 columns r and the whole fc2 bias, added on
    rank 0 only: the partial outputs sum (the dispatcher's reduce-scatter) to the unsplit experts' output, and each
    rank's fc2 bias gradient is the whole one (the replicas stay equal)."""
    hf, x, indices, weights, grad = _case(seed=7)
    params = _megatron(hf)
    token, flat, counts = _permute(indices)
    probs = weights.flatten()[flat]

    def run(module):
        xs = x[token].clone().requires_grad_()
        out, _ = module(xs, counts, probs)
        out.backward(grad[token])
        return out.detach(), xs.grad

    full = _module(_config(tensor_model_parallel_size=2))
    _load(full, params)
    want_out, want_dx = run(full)
    etp, f = 2, FFN // 2
    total, dx = torch.zeros_like(want_out), torch.zeros_like(want_dx)
    for r in range(etp):
        rows = torch.cat([torch.arange(r * f, (r + 1) * f), FFN + torch.arange(r * f, (r + 1) * f)])
        shard = _module(_config(tensor_model_parallel_size=2), etp=(r, etp))
        assert shard.linear_fc2.bias.tensor_model_parallel is False  # a replica: counted on TP rank 0 only
        assert (shard.linear_fc1.bias.tensor_model_parallel, shard.linear_fc1.bias.partition_dim) == (True, 1)
        _load(shard, (params[0][:, rows], params[1][:, rows], params[2][:, :, r * f:(r + 1) * f], params[3]))
        out, d = run(shard)
        total += out
        dx += d
        torch.testing.assert_close(shard.linear_fc1.bias.grad, full.linear_fc1.bias.grad[:, rows], **FP32)
        torch.testing.assert_close(shard.linear_fc2.weight.grad, full.linear_fc2.weight.grad[:, :, r * f:(r + 1) * f],
                                   **FP32)
        torch.testing.assert_close(shard.linear_fc2.bias.grad, full.linear_fc2.bias.grad, **FP32)
    torch.testing.assert_close(total, want_out, **FP32)
    torch.testing.assert_close(dx, want_dx, **FP32)


def test_sharded_state_dict_biases():
    """EP rank 1 of 2, ETP rank 1 of 2, 4 local experts of 8: fc1's bias is saved as gate and up halves of the
    global [8, 2F] ([gate; up]), fc2's as its experts' block of [8, H], a replica on ETP rank 1."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    m = _module(_config(tensor_model_parallel_size=2), ep=(1, 2), etp=(1, 2), edp=(1, 2))
    sd = m.sharded_state_dict(prefix="decoder.layers.3.mlp.experts.", sharded_offsets=((0, 3, 5),))
    p = "decoder.layers.3.mlp.experts."
    b1, b2 = sd[f"{p}linear_fc1.bias"], sd[f"{p}linear_fc2.bias"]
    assert isinstance(b1, ShardedTensorFactory) and b1.key == f"{p}experts.linear_fc1.bias"
    with torch.no_grad():
        m.linear_fc1.bias.copy_(torch.arange(m.linear_fc1.bias.numel(), dtype=torch.float32).view(4, 12))
    gate, up = b1.build_fn(b1.key, m.linear_fc1.bias, b1.replica_id, None)
    for part, row in ((gate, 6), (up, 18)):  # F=12: gate entries 6:12 (ETP rank 1 of 2), up entries 12 + 6:12 + 12
        assert part.global_shape == (5, 8, 24) and part.global_offset == (3, 4, row)
        assert part.replica_id == (0, 0, 1)
    torch.testing.assert_close(b1.merge_fn([gate.data, up.data]), m.linear_fc1.bias.detach())
    assert b2.key == f"{p}experts.linear_fc2.bias"
    assert b2.global_shape == (5, 8, 16) and b2.global_offset == (3, 4, 0) and b2.replica_id == (0, 1, 1)
    nobias = _module(_config(add_bias_linear=False))
    assert sorted(nobias.sharded_state_dict(prefix=p)) == [f"{p}linear_fc1.weight", f"{p}linear_fc2.weight"]


# ---- refusals --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides,match", [
    (dict(activation_func=F.gelu, activation_func_clamp_value=None),
     "activation_func must be torch.nn.functional.silu .SwiGLU., megatron"),
    (dict(activation_func=F.gelu), "activation_func must be .*quick_gelu or torch.nn.functional.silu with a clamp"),
    (dict(gated_linear_unit=False, add_bias_linear=False),
     "with gated_linear_unit=False activation_func must be .*relu2.* the gated activations need gated_linear_unit"),
    (dict(gated_linear_unit=False), "add_bias_linear must be False without gated_linear_unit"),
    (dict(activation_func_clamp_value=-1.0), "activation_func_clamp_value must be None or positive"),
    (dict(activation_func=F.silu, activation_func_clamp_value=None), "glu_linear_offset must be 0"),
])
def test_module_refuses_activations_it_does_not_compute(overrides, match):
    with pytest.raises(ValueError, match=match):
        _module(_config(**overrides))


def test_module_takes_a_clamped_swiglu():
    """silu with a clamp (DeepSeek-V4's / HY-V4's experts, tests/kernels/test_clamped_swiglu.py), megatron's offset
    kept."""
    m = _module(_config(activation_func=F.silu))
    assert isinstance(m.activation, ClampedGLU)
    assert (m.activation.alpha, m.activation.limit, m.activation.offset) == (1.0, LIMIT, 1.0)


def test_module_refuses_replicated_fc2_bias_outside_the_tensor_parallel_groups():
    with pytest.raises(ValueError, match="expert_tensor_parallel_size == tensor_model_parallel_size"):
        _module(_config(), etp=(0, 2))


def test_fp8_experts_refuse_biases_and_the_clamped_glu():
    from loongforge_hf.kernels.fp8 import Fp8Error
    from loongforge_hf.kernels.fp8_linear import Fp8GroupedExperts, Fp8Settings, swap_linears

    settings = Fp8Settings(mode="on", recipe="blockwise")
    m = _module(_config(hidden_size=128, moe_ffn_hidden_size=128))
    with pytest.raises(Fp8Error, match=r"do not support expert biases \(add_bias_linear\) or the activation "
                                       "ClampedGLU"):
        Fp8GroupedExperts(m, name="experts", settings=settings)
    report = swap_linears([torch.nn.ModuleDict({"experts": m})], mode="on", recipe="blockwise")
    assert report.swapped == [] and "ClampedGLU" in report.skipped["0.experts"]
    assert "forward" not in m.__dict__  # left in the model's dtype
    from megatron.core.fusions.fused_bias_geglu import quick_gelu

    plain = _module(_config(hidden_size=128, moe_ffn_hidden_size=128, add_bias_linear=False,
                            activation_func=quick_gelu))
    with pytest.raises(Fp8Error, match="the activation ClampedGLU"):
        Fp8GroupedExperts(plain, name="experts", settings=settings)


def test_lora_experts_take_the_biases_and_the_clamped_glu():
    """LoRA on experts with biases and gpt-oss's clamped GLU: the module is adaptable, and the adapted forward is
    ``grouped_gated_mlp`` with the adapters' terms, the biases and the clamped GLU (which differs from the frozen
    experts'). Parity with PEFT on a whole gpt-oss: tests/integrations/test_lora_moe_bridges.py."""
    from torch import nn

    from loongforge_hf.lora.experts import ExpertAdapter, LoraGroupedMLP, check_param_adaptable

    m = _module(_config())
    check_param_adaptable(m, "experts")  # NOTE: no refusal
    hf, x, indices, weights, _ = _case(seed=9)
    _load(m, _megatron(hf))
    g = torch.Generator().manual_seed(10)
    terms = (_low_rank(EXPERTS, 2 * FFN, HIDDEN, 3, g, 2.0), _low_rank(EXPERTS, HIDDEN, FFN, 3, g, 2.0))
    token, flat, counts = _permute(indices)
    inputs = (x[token], counts, weights.flatten()[flat])
    with torch.no_grad():
        frozen, _ = m(*inputs)
        m.__class__ = LoraGroupedMLP
        m.lora = nn.ModuleDict({name: ExpertAdapter(t.A.detach().clone(), t.B.detach().clone(), scaling=t.scaling,
                                                    expert_parallel=True)
                                for name, t in zip(("gate_up_proj", "down_proj"), terms)})
        adapted, _ = m(*inputs)
        expected = grouped_gated_mlp(inputs[0], m.linear_fc1.weight, m.linear_fc2.weight, counts, inputs[2],
                                     adapters=terms, biases=(m.linear_fc1.bias, m.linear_fc2.bias),
                                     activation=m.activation)
    torch.testing.assert_close(adapted, expected, **FP32)
    assert (adapted - frozen).abs().max() > 1e-3


# ---- CUDA: the grouped GEMMs against the loop in bf16 -------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@needs_grouped_mm
@pytest.mark.parametrize("limit", [LIMIT, None], ids=["clamped", "no-clamp"])
def test_gpu_grouped_mm_with_biases_matches_loop_bf16(limit):
    """bf16 on CUDA, the grouped path chosen by default, against the bf16 loop elementwise (atol = rtol = 3e-2: both
    accumulate in fp32 and round at the same points, as in test_gpu_grouped_mlp.py) and, without the clamp, against
    fp32 on the CPU (||a - ref|| / ||ref|| < 1e-2, per tensor). With the clamp the fp32 comparison of gradients is
    no measure: an fc1 output within a bf16 ulp of the limit is clamped on one side and not on the other, and its
    gradient jumps between zero and its full value (~6% of d_x measured on this case, for both paths alike)."""
    from loongforge_hf.kernels.grouped_mlp import grouped_mm_supported

    g = torch.Generator().manual_seed(8)
    counts, hidden, ffn = [37, 0, 129, 5, 0, 64, 1, 20], 256, 96
    e, t = len(counts), sum(counts)
    ops = [2 * torch.randn(t, hidden, generator=g), torch.randn(e, 2 * ffn, hidden, generator=g) / hidden ** 0.5,
           torch.randn(e, 2 * ffn, generator=g), torch.randn(e, hidden, ffn, generator=g) / ffn ** 0.5,
           torch.randn(e, hidden, generator=g)]
    probs, grad = torch.rand(t, generator=g), torch.randn(t, hidden, generator=g)

    def run(device, dtype, use_grouped_mm):
        x, fc1, b1, fc2, b2 = (o.to(device=device, dtype=dtype).requires_grad_() for o in ops)
        if device == "cuda" and use_grouped_mm is None:
            assert grouped_mm_supported(x, fc1, fc2, biases=(b1, b2))
        p = probs.to(device).requires_grad_()
        out = grouped_gated_mlp(x, fc1, fc2, torch.tensor(counts, device=device), p, biases=(b1, b2),
                                activation=_activation(limit), use_grouped_mm=use_grouped_mm)
        out.backward(grad.to(device=device, dtype=dtype))
        return [v.float().cpu() for v in (out.detach(), x.grad, fc1.grad, b1.grad, fc2.grad, b2.grad, p.grad)]

    grouped, loop = run("cuda", torch.bfloat16, None), run("cuda", torch.bfloat16, False)
    ops = [o.to(torch.bfloat16).float() for o in ops]
    ref = run("cpu", torch.float32, False)
    names = ("out", "d_x", "d_fc1", "d_fc1_bias", "d_fc2", "d_fc2_bias", "d_probs")
    for name, a, b, c in zip(names, grouped, loop, ref):
        torch.testing.assert_close(a, b, atol=3e-2, rtol=3e-2, msg=lambda m, n=name: f"{n} vs loop: {m}")
        if limit is not None and name != "out":
            continue
        for path, v in (("grouped", a), ("loop", b)):
            err = ((v - c).norm() / c.norm()).item()
            assert err < 1e-2, f"{name} ({path}) vs fp32: {err:.2e}"
    for i in (2, 3, 4, 5):
        assert torch.count_nonzero(grouped[i][1]) == 0 and torch.count_nonzero(grouped[i][4]) == 0
    if limit is not None:  # the clamp is active
        h = torch.einsum("th,tfh->tf", ops[0], ops[1][torch.repeat_interleave(torch.arange(e), torch.tensor(counts))])
        assert (h[:, :ffn] > limit).any() and (h[:, ffn:].abs() > limit).any()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@needs_grouped_mm
def test_gpu_grouped_mm_with_biases_reads_nothing_on_the_host():
    """The grouped path with biases keeps the token counts on the device, forward and backward (what CUDA-graph
    capture of an MoE layer needs, kernels/moe_permute.py): a synchronising op raises under sync debug mode."""
    g = torch.Generator(device="cuda").manual_seed(9)
    counts = torch.tensor([5, 0, 11, 16], device="cuda")
    e, t, hidden, ffn = 4, 32, 64, 32

    def randn(*shape):
        return torch.randn(*shape, device="cuda", generator=g).to(torch.bfloat16).requires_grad_()

    x, fc1, b1, fc2, b2 = randn(t, hidden), randn(e, 2 * ffn, hidden), randn(e, 2 * ffn), randn(e, hidden, ffn), \
        randn(e, hidden)
    probs = torch.rand(t, device="cuda", generator=g).requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = grouped_gated_mlp(x, fc1, fc2, counts, probs, biases=(b1, b2), activation=_activation())
        out.backward(torch.ones_like(out))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(v.grad is not None for v in (x, fc1, b1, fc2, b2, probs))
