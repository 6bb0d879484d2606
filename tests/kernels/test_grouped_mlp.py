"""Grouped expert MLP (kernels/grouped_mlp.py) against a per-token reference, on CPU: outputs and gradients over odd
token counts (experts with no tokens included), routing probabilities, expert-tensor-parallel shards, the megatron
module (parameter attributes, probabilities on the input, distributed-checkpoint sharding); with low-rank adapters
(LoRA on the experts), the ``_grouped_mm`` path (torch's CPU fallback, forced) against the loop, and the grouped
GEMMs its backward runs for frozen expert weights. Gemma 4's gated tanh-GELU (kernels/geglu.py) against transformers'
activation and its ``Gemma4TextExperts``, Nemotron-H's plain relu2 experts (kernels/relu2.py, ``gated=False``)
against transformers' activation and its ``NemotronHExperts`` (fp32 and bf16, loop and ``_grouped_mm``; tolerances
where they are set), the plain module's layout and checkpoint sharding, and what refuses plain experts."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from loongforge_hf.kernels.grouped_mlp import GroupedMLP, LowRank, grouped_gated_mlp, grouped_mm_supported

from ._op_count import GroupedMmCount

COUNTS = [[3, 0, 7, 1], [0, 0, 5, 0], [1, 2, 0, 9], [0, 0, 0, 0]]
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def _reference(x, fc1, fc2, counts, probs):
    """Token by token: its expert's weights gathered per token, SwiGLU in fp32, scaled by its probability."""
    expert = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    h = torch.einsum("th,tfh->tf", x.float(), fc1.float()[expert])
    gate, up = h.chunk(2, dim=-1)
    act = F.silu(gate) * up
    if probs is not None:
        act = act * probs.float().unsqueeze(-1)
    return torch.einsum("tf,thf->th", act, fc2.float()[expert])


def _operands(counts, dtype, *, hidden=16, ffn=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    e, t = len(counts), sum(counts)
    x = torch.randn(t, hidden, generator=g).to(dtype).requires_grad_()
    fc1 = (torch.randn(e, 2 * ffn, hidden, generator=g) / 4).to(dtype).requires_grad_()
    fc2 = (torch.randn(e, hidden, ffn, generator=g) / 4).to(dtype).requires_grad_()
    probs = torch.rand(t, generator=g)
    grad = torch.randn(t, hidden, generator=g).to(dtype)
    return x, fc1, fc2, probs, grad


def _run(fn, x, fc1, fc2, grad):
    for t in (x, fc1, fc2):
        t.grad = None
    out = fn()
    out.backward(grad)
    return [out.detach().float(), x.grad.float(), fc1.grad.float(), fc2.grad.float()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("counts", COUNTS, ids=[",".join(map(str, c)) for c in COUNTS])
@pytest.mark.parametrize("with_probs", [True, False], ids=["probs", "no-probs"])
def test_matches_per_token_reference(dtype, counts, with_probs):
    x, fc1, fc2, probs, grad = _operands(counts, dtype)
    p = probs if with_probs else None
    got = _run(lambda: grouped_gated_mlp(x, fc1, fc2, torch.tensor(counts), p), x, fc1, fc2, grad)
    ref = _run(lambda: _reference(x, fc1, fc2, counts, p), x, fc1, fc2, grad.float())
    for name, a, b in zip(("out", "d_x", "d_fc1", "d_fc2"), got, ref):
        torch.testing.assert_close(a, b, **TOL[dtype], msg=lambda m, n=name: f"{n}: {m}")
    for e, c in enumerate(counts):  # an expert without tokens gets a zero gradient, not None
        if c == 0:
            assert torch.count_nonzero(got[2][e]) == 0 and torch.count_nonzero(got[3][e]) == 0


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no _grouped_mm")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_path_equals_loop(dtype):
    """The ``_grouped_mm`` path (forced; on CPU torch runs its own fallback) reads ``offs`` as the loop splits."""
    counts = [3, 0, 7, 1, 0, 5]
    x, fc1, fc2, probs, grad = _operands(counts, dtype, hidden=16, ffn=8)
    loop = _run(lambda: grouped_gated_mlp(x, fc1, fc2, counts, probs, use_grouped_mm=False), x, fc1, fc2, grad)
    grouped = _run(lambda: grouped_gated_mlp(x, fc1, fc2, counts, probs, use_grouped_mm=True), x, fc1, fc2, grad)
    for a, b in zip(grouped, loop):
        torch.testing.assert_close(a, b, **TOL[dtype])


def test_expert_tensor_parallel_shards_sum_to_the_whole():
    """ETP rank r holds fc1 rows [gate_r; up_r] and fc2 columns r of each expert: the partial outputs sum to the
    unsplit MLP's output and each shard's gradient is its slice of the unsplit gradient."""
    counts, etp, ffn = [2, 0, 5, 3], 2, 12
    x, fc1, fc2, probs, grad = _operands(counts, torch.float32, ffn=ffn)
    full = _run(lambda: grouped_gated_mlp(x, fc1, fc2, counts, probs), x, fc1, fc2, grad)
    f = ffn // etp
    total, d_x = torch.zeros_like(full[0]), torch.zeros_like(full[1])
    for r in range(etp):
        rows = torch.cat([torch.arange(r * f, (r + 1) * f), ffn + torch.arange(r * f, (r + 1) * f)])
        s1 = fc1.detach()[:, rows].clone().requires_grad_()
        s2 = fc2.detach()[:, :, r * f:(r + 1) * f].clone().requires_grad_()
        xr = x.detach().clone().requires_grad_()
        out, dx, d1, d2 = _run(lambda: grouped_gated_mlp(xr, s1, s2, counts, probs), xr, s1, s2, grad)
        total += out
        d_x += dx
        torch.testing.assert_close(d1, full[2][:, rows])
        torch.testing.assert_close(d2, full[3][:, :, r * f:(r + 1) * f])
    torch.testing.assert_close(total, full[0])
    torch.testing.assert_close(d_x, full[1])


def test_bad_shapes_raise():
    x, fc1, fc2, _, _ = _operands([1, 2], torch.float32)
    with pytest.raises(ValueError, match="must be"):
        grouped_gated_mlp(x, fc1[:, :-1], fc2, [1, 2])
    with pytest.raises(ValueError, match="token counts"):
        grouped_gated_mlp(x, fc1, fc2, [1, 1, 1])


def test_grouped_mm_not_chosen_on_cpu_or_fp32():
    x, fc1, fc2, _, _ = _operands([1, 2], torch.bfloat16)
    assert not grouped_mm_supported(x, fc1, fc2)  # CPU tensors: the loop


class _Group:
    def __init__(self, rank, size):
        self._rank, self._size = rank, size

    def rank(self):
        return self._rank

    def size(self):
        return self._size


def _config(**kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = dict(num_layers=2, hidden_size=16, num_attention_heads=2, ffn_hidden_size=24, moe_ffn_hidden_size=12,
                num_moe_experts=8, moe_router_topk=2, gated_linear_unit=True, activation_func=F.silu,
                add_bias_linear=False, use_cpu_initialization=True, perform_initialization=False,
                params_dtype=torch.float32, expert_model_parallel_size=2, expert_tensor_parallel_size=2)
    return TransformerConfig(**{**base, **kw})


def _module(config, *, ep=(1, 2), etp=(1, 2), edp=(0, 1), local=4):
    pg = SimpleNamespace(ep=_Group(*ep), expt_tp=_Group(*etp), expt_dp=_Group(*edp))
    return GroupedMLP(local, config, pg_collection=pg)


def test_module_layout_attributes_and_forward():
    m = _module(_config())
    fc1, fc2 = m.linear_fc1.weight, m.linear_fc2.weight
    assert tuple(fc1.shape) == (4, 12, 16) and tuple(fc2.shape) == (4, 16, 6)  # F=12 over ETP 2: 6 per rank
    assert fc1.allreduce is False and fc2.allreduce is False  # expert parallel: reduced over expert-DP only
    assert fc1.tensor_model_parallel and (fc1.partition_dim, fc2.partition_dim) == (1, 2)
    assert [n for n, _ in m.named_parameters()] == ["linear_fc1.weight", "linear_fc2.weight"]
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        fc1.copy_(torch.randn(fc1.shape, generator=g))
        fc2.copy_(torch.randn(fc2.shape, generator=g))
    counts = torch.tensor([2, 0, 3, 1])
    x, probs = torch.randn(6, 16, generator=g), torch.rand(6, generator=g)
    out, bias = m(x, counts, probs)
    assert bias is None
    torch.testing.assert_close(out, _reference(x, fc1.detach(), fc2.detach(), counts.tolist(), probs))


def test_module_probs_on_input_for_top1():
    m = _module(_config(moe_router_topk=1, moe_router_pre_softmax=True, moe_apply_probs_on_input=True))
    with torch.no_grad():
        m.linear_fc1.weight.normal_()
        m.linear_fc2.weight.normal_()
    counts = torch.tensor([1, 2, 0, 3])
    x, probs = torch.randn(6, 16), torch.rand(6)
    out, _ = m(x, counts, probs)
    expected = _reference(probs.unsqueeze(-1) * x, m.linear_fc1.weight.detach(), m.linear_fc2.weight.detach(),
                          counts.tolist(), None)
    torch.testing.assert_close(out, expected)


def test_module_refuses_configs_it_does_not_compute():
    with pytest.raises(ValueError, match="gated_linear_unit"):
        _module(_config(gated_linear_unit=False))


def test_initialisation_fills_every_expert():
    m = _module(_config(perform_initialization=True, init_method=lambda w: w.fill_(0.5),
                        output_layer_init_method=lambda w: w.fill_(-0.25)))
    assert bool((m.linear_fc1.weight == 0.5).all()) and bool((m.linear_fc2.weight == -0.25).all())


def test_sharded_state_dict_global_layout():
    """EP rank 1 of 2, ETP rank 1 of 2, 4 local experts of 8: fc1 is saved as gate and up halves of the global
    [8, 2F, H] tensor ([gate; up] rows), fc2 as its block of [8, H, F]; the layer axis offsets come first."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    m = _module(_config(), edp=(1, 2))
    layer_axis = ((0, 3, 5),)
    sd = m.sharded_state_dict(prefix="decoder.layers.3.mlp.experts.", sharded_offsets=layer_axis)
    p = "decoder.layers.3.mlp.experts."
    fc1, fc2 = sd[f"{p}linear_fc1.weight"], sd[f"{p}linear_fc2.weight"]
    assert isinstance(fc1, ShardedTensorFactory)
    assert fc1.key == "decoder.layers.3.mlp.experts.experts.linear_fc1.weight"
    with torch.no_grad():
        m.linear_fc1.weight.copy_(torch.arange(m.linear_fc1.weight.numel(), dtype=torch.float32).view(4, 12, 16))
    gate, up = fc1.build_fn(fc1.key, m.linear_fc1.weight, fc1.replica_id, None)
    for part, row in ((gate, 6), (up, 18)):  # F=12: gate rows 6:12 (ETP rank 1 of 2), up rows 12 + 6:12 + 12
        assert part.global_shape == (5, 8, 24, 16)
        assert part.global_offset == (3, 4, row, 0)
        assert part.replica_id == (0, 0, 1)
    torch.testing.assert_close(fc1.merge_fn([gate.data, up.data]), m.linear_fc1.weight.detach())
    assert fc2.key == "decoder.layers.3.mlp.experts.experts.linear_fc2.weight"
    assert fc2.global_shape == (5, 8, 16, 12) and fc2.global_offset == (3, 4, 0, 6)


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no _grouped_mm")
def test_grouped_mm_path_takes_a_broadcast_gradient():
    """``out.sum().backward()`` hands ``_grouped_mm``'s backward a zero-stride gradient, which it refuses as is."""
    counts = [2, 0, 3]
    x, fc1, fc2, probs, _ = _operands(counts, torch.float32, hidden=16, ffn=8)
    grouped_gated_mlp(x, fc1, fc2, counts, probs, use_grouped_mm=True).sum().backward()
    got = [t.grad.clone() for t in (x, fc1, fc2)]
    for t in (x, fc1, fc2):
        t.grad = None
    grouped_gated_mlp(x, fc1, fc2, counts, probs, use_grouped_mm=False).sum().backward()
    for a, t in zip(got, (x, fc1, fc2)):
        torch.testing.assert_close(a, t.grad)


def _low_rank(e, out, inp, r, dtype, g, scaling):
    a = (torch.randn(e, r, inp, generator=g) / inp ** 0.5).to(dtype).requires_grad_()
    b = (torch.randn(e, out, r, generator=g) / r ** 0.5).to(dtype).requires_grad_()
    return LowRank(a, b, scaling)


def _lora_case(counts, dtype, which, r):
    """Operands with frozen expert stacks and a LowRank on fc1 and / or fc2 (``which``)."""
    x, fc1, fc2, probs, grad = _operands(counts, dtype, hidden=16, ffn=8)
    fc1, fc2 = fc1.detach(), fc2.detach()
    g = torch.Generator().manual_seed(7)
    adapters = (_low_rank(len(counts), 16, 16, r, dtype, g, 2.0) if "fc1" in which else None,
                _low_rank(len(counts), 16, 8, r, dtype, g, 0.5) if "fc2" in which else None)
    return x, fc1, fc2, probs, grad, adapters


def _run_lora(x, fc1, fc2, counts, probs, grad, adapters, grouped):
    leaves = [x, *(t for a in adapters if a is not None for t in (a.A, a.B))]
    for t in leaves:
        t.grad = None
    out = grouped_gated_mlp(x, fc1, fc2, counts, probs, adapters=adapters, use_grouped_mm=grouped)
    out.backward(grad)
    return [out.detach().float()] + [t.grad.float() for t in leaves]


# NOTE: torch's CPU fallback checks strides as the CUDA kernel does: bf16 with r=4 (8 bytes a row) runs on a rank
# padded to 8, which must not change the result
@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no _grouped_mm")
@pytest.mark.parametrize("dtype,r", [(torch.float32, 4), (torch.bfloat16, 8), (torch.bfloat16, 4)],
                         ids=["fp32", "bf16", "bf16_r4_padded"])
@pytest.mark.parametrize("which", ["fc1", "fc2", "fc1+fc2"])
def test_lora_grouped_mm_path_equals_loop(dtype, r, which):
    """Adapted experts through ``_grouped_mm`` (two more grouped GEMMs per adapted projection) against the loop:
    output and the gradients of x, A and B, experts without tokens included (theirs are zero)."""
    counts = [3, 0, 7, 1, 0, 5]
    x, fc1, fc2, probs, grad, adapters = _lora_case(counts, dtype, which, r)
    loop = _run_lora(x, fc1, fc2, counts, probs, grad, adapters, False)
    grouped = _run_lora(x, fc1, fc2, counts, probs, grad, adapters, True)
    for a, b in zip(grouped, loop):
        torch.testing.assert_close(a, b, **TOL[dtype])
    for g in grouped[2:]:
        assert torch.count_nonzero(g[1]) == 0 and torch.count_nonzero(g[4]) == 0
        assert torch.count_nonzero(g) > 0
    # the adapters do change the output: against the frozen experts alone
    plain = grouped_gated_mlp(x, fc1, fc2, counts, probs, use_grouped_mm=True)
    assert (plain.detach().float() - grouped[0]).abs().max() > 1e-2


def test_lora_loop_matches_per_token_reference():
    """The loop (the reference of the grouped path) adds ``scaling * (t A_e^T) B_e^T`` to each expert's products:
    against the per-token reference on merged weights ``W_e + scaling * B_e A_e``."""
    counts = [2, 0, 4, 3]
    x, fc1, fc2, probs, grad, adapters = _lora_case(counts, torch.float32, "fc1+fc2", 4)
    got = grouped_gated_mlp(x, fc1, fc2, counts, probs, adapters=adapters)
    merged = [w + a.scaling * torch.bmm(a.B, a.A) for w, a in zip((fc1, fc2), adapters)]
    torch.testing.assert_close(got, _reference(x, *merged, counts, probs), **TOL[torch.float32])


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no _grouped_mm")
def test_lora_backward_computes_no_gradient_of_frozen_experts():
    """Forward: 3 grouped GEMMs per adapted projection. Backward: per projection 1 for the frozen stack (its input's
    gradient only) and 2 for each of A and B (the factor's and its input's): 10; 12 once the stacks train too."""
    counts = [3, 0, 7, 1]
    x, fc1, fc2, probs, grad, adapters = _lora_case(counts, torch.float32, "fc1+fc2", 4)
    for trained, backward_calls in ((False, 10), (True, 12)):
        fc1.requires_grad_(trained)
        fc2.requires_grad_(trained)
        with GroupedMmCount() as forward:
            out = grouped_gated_mlp(x, fc1, fc2, counts, probs, adapters=adapters, use_grouped_mm=True)
        with GroupedMmCount() as backward:
            out.backward(grad)
        assert (forward.calls, backward.calls) == (6, backward_calls)
        assert (fc1.grad is not None) == trained


def test_lora_adapter_shapes_are_checked():
    x, fc1, fc2, probs, _, adapters = _lora_case([1, 2, 0, 1], torch.float32, "fc1+fc2", 4)
    with pytest.raises(ValueError, match="fc2's adapter A"):
        grouped_gated_mlp(x, fc1, fc2, [1, 2, 0, 1], probs, adapters=(adapters[0], adapters[0]))


# ---- Gemma 4's gated tanh-GELU experts (kernels/geglu.py) against transformers' Gemma4TextExperts -------------------
# NOTE: the activation in bf16 against autograd's fp32 (the same bf16 input): ours rounds the gradient once, as the
# clamped GLU's test allows. The experts in bf16 against transformers' fp32 on the same bf16-valued operands:
# norm-relative error per tensor below 1e-2 (transformers' own bf16 experts measure 4e-3 to 6e-3 there, ours the
# same; an elementwise bound fails on near-zero sums: transformers scales by the routing weight after down_proj and
# sums the top-k rows in bf16, megatron scales the activation before fc2)
GEGLU_TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=1.6e-2)}
GEMMA4_NORM_RTOL = 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_geglu_matches_transformers_activation(dtype):
    from transformers.activations import ACT2FN

    from loongforge_hf.kernels.geglu import geglu

    g = torch.Generator().manual_seed(4)
    x = (3 * torch.randn(5, 3, 34, generator=g)).to(dtype)
    grad = torch.randn(5, 3, 17, generator=g).to(dtype)

    def hf(t):
        gate, up = t.chunk(2, dim=-1)
        return ACT2FN["gelu_pytorch_tanh"](gate) * up

    assert torch.equal(geglu(x), hf(x))  # the forward, bit for bit (no grad: the plain path)
    ours, ref = x.clone().requires_grad_(), x.float().requires_grad_()
    out = geglu(ours)
    assert torch.equal(out.detach(), hf(x))  # ... and through the autograd Function
    out.backward(grad)
    hf(ref).backward(grad.float())
    assert ours.grad.dtype == dtype
    torch.testing.assert_close(ours.grad.float(), ref.grad, **GEGLU_TOL[dtype])
    with pytest.raises(ValueError, match="must be even"):
        geglu(torch.randn(3, 5))


def _gemma4_case(*, hidden=16, ffn=8, experts=6, tokens=19, topk=2, empty=3):
    """transformers' ``Gemma4TextExperts`` (fp32) and bf16-valued operands: input, top-k routing that never picks
    expert ``empty``, routing weights, output gradient."""
    from transformers import Gemma4TextConfig
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextExperts

    config = Gemma4TextConfig(hidden_size=hidden, moe_intermediate_size=ffn, num_experts=experts, top_k_experts=topk,
                              hidden_activation="gelu_pytorch_tanh", enable_moe_block=True)
    config._experts_implementation = "eager"
    hf = Gemma4TextExperts(config)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        hf.gate_up_proj.copy_((torch.randn(hf.gate_up_proj.shape, generator=g) / hidden ** 0.5).bfloat16())
        hf.down_proj.copy_((torch.randn(hf.down_proj.shape, generator=g) / ffn ** 0.5).bfloat16())
    allowed = torch.tensor([e for e in range(experts) if e != empty])
    indices = torch.stack([allowed[torch.randperm(len(allowed), generator=g)[:topk]] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, topk, generator=g), dim=-1).bfloat16().float()
    x = (2 * torch.randn(tokens, hidden, generator=g)).bfloat16().float()
    grad = torch.randn(tokens, hidden, generator=g).bfloat16().float()
    return hf, x, indices, weights, grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("use_grouped_mm", [
    pytest.param(False, id="loop"),
    pytest.param(True, id="grouped_mm", marks=pytest.mark.skipif(not hasattr(torch, "_grouped_mm"),
                                                                 reason="this torch has no _grouped_mm"))])
def test_geglu_experts_match_gemma4_experts(dtype, use_grouped_mm):
    """transformers' ``Gemma4TextExperts`` in fp32 (``[gate; up]`` halves, ``[out, in]`` stacks: megatron's layout as
    they are) against the grouped MLP with ``gated_activation`` of a gelu-tanh config in ``dtype``, tokens permuted
    by expert as megatron's dispatcher does (expert 3 gets none): output and the gradients of the input, the routing
    weights and both stacks."""
    from loongforge_hf.kernels.geglu import GeGLU, gelu_tanh
    from loongforge_hf.kernels.grouped_mlp import gated_activation

    activation = gated_activation(_config(activation_func=gelu_tanh))
    assert isinstance(activation, GeGLU)
    hf, x, indices, weights, grad = _gemma4_case()
    xs, ws = x.clone().requires_grad_(), weights.clone().requires_grad_()
    want = hf(xs, indices, ws)
    want.backward(grad)
    want = [want.detach(), xs.grad, ws.grad, hf.gate_up_proj.grad, hf.down_proj.grad]

    fc1, fc2 = (w.detach().to(dtype).requires_grad_() for w in (hf.gate_up_proj, hf.down_proj))
    xs, ws = x.to(dtype).requires_grad_(), weights.to(dtype).requires_grad_()
    flat = indices.flatten()
    order = torch.argsort(flat, stable=True)
    token, counts = order // indices.shape[1], torch.bincount(flat, minlength=hf.num_experts)
    rows = grouped_gated_mlp(xs[token], fc1, fc2, counts, ws.flatten()[order], activation=activation,
                             use_grouped_mm=use_grouped_mm)
    out = torch.zeros_like(xs).index_add(0, token, rows)
    out.backward(grad.to(dtype))
    got = [out.detach(), xs.grad, ws.grad, fc1.grad, fc2.grad]
    for name, a, b in zip(("out", "d_x", "d_weights", "d_gate_up", "d_down"), got, want):
        assert a.dtype == dtype, name
        if dtype == torch.float32:
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
        else:
            err = ((a.float() - b).norm() / b.norm()).item()
            assert err < GEMMA4_NORM_RTOL, f"{name}: ||a - ref|| / ||ref|| = {err:.2e}"
    assert counts[3] == 0 and torch.count_nonzero(fc1.grad[3]) == 0 and torch.count_nonzero(fc2.grad[3]) == 0
    with pytest.raises(ValueError, match="glu_linear_offset must be 0"):
        gated_activation(_config(activation_func=gelu_tanh, glu_linear_offset=1.0))


# ---- Nemotron-H's plain relu2 experts (kernels/relu2.py, gated=False) against transformers' NemotronHExperts --------
# NOTE: the tolerances of the Gemma 4 experts above (GEGLU_TOL's fp32 bound, GEMMA4_NORM_RTOL in bf16) for the same
# reasons: transformers scales by the routing weight after down_proj, megatron before fc2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_relu2_matches_transformers_activation(dtype):
    """Bit for bit: the forward and, through autograd, the gradient (the same ops as transformers' ``relu2``)."""
    from transformers.activations import ACT2FN

    from loongforge_hf.kernels.relu2 import relu2

    g = torch.Generator().manual_seed(5)
    x = (3 * torch.randn(5, 3, 17, generator=g)).to(dtype)
    grad = torch.randn(5, 3, 17, generator=g).to(dtype)
    ours, ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, want = relu2(ours), ACT2FN["relu2"](ref)
    assert torch.equal(out, want)
    out.backward(grad)
    want.backward(grad)
    assert torch.equal(ours.grad, ref.grad)


def _nemotron_h_case(*, hidden=16, ffn=8, experts=6, tokens=19, topk=2, empty=3):
    """transformers' ``NemotronHExperts`` (fp32, relu2) and bf16-valued operands: input, top-k routing that never
    picks expert ``empty``, routing weights, output gradient."""
    from transformers import NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHExperts

    config = NemotronHConfig(hidden_size=hidden, moe_intermediate_size=ffn, n_routed_experts=experts,
                             num_experts_per_tok=topk, mlp_hidden_act="relu2")
    config._experts_implementation = "eager"
    hf = NemotronHExperts(config)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        hf.up_proj.copy_((torch.randn(hf.up_proj.shape, generator=g) / hidden ** 0.5).bfloat16())
        hf.down_proj.copy_((torch.randn(hf.down_proj.shape, generator=g) / ffn ** 0.5).bfloat16())
    allowed = torch.tensor([e for e in range(experts) if e != empty])
    indices = torch.stack([allowed[torch.randperm(len(allowed), generator=g)[:topk]] for _ in range(tokens)])
    weights = torch.sigmoid(torch.randn(tokens, topk, generator=g)).bfloat16().float()
    x = (2 * torch.randn(tokens, hidden, generator=g)).bfloat16().float()
    grad = torch.randn(tokens, hidden, generator=g).bfloat16().float()
    return hf, x, indices, weights, grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("use_grouped_mm", [
    pytest.param(False, id="loop"),
    pytest.param(True, id="grouped_mm", marks=pytest.mark.skipif(not hasattr(torch, "_grouped_mm"),
                                                                 reason="this torch has no _grouped_mm"))])
def test_relu2_experts_match_nemotron_h_experts(dtype, use_grouped_mm):
    """transformers' ``NemotronHExperts`` in fp32 (``[out, in]`` stacks: megatron's plain layout as they are) against
    the grouped MLP with ``expert_activation`` of a plain relu2 config (``gated=False``) in ``dtype``, tokens permuted
    by expert as megatron's dispatcher does (expert 3 gets none): output and the gradients of the input, the routing
    weights and both stacks."""
    from loongforge_hf.kernels.grouped_mlp import expert_activation
    from loongforge_hf.kernels.relu2 import Relu2, relu2

    activation = expert_activation(_config(gated_linear_unit=False, activation_func=relu2))
    assert isinstance(activation, Relu2)
    hf, x, indices, weights, grad = _nemotron_h_case()
    xs, ws = x.clone().requires_grad_(), weights.clone().requires_grad_()
    want = hf(xs, indices, ws)
    want.backward(grad)
    want = [want.detach(), xs.grad, ws.grad, hf.up_proj.grad, hf.down_proj.grad]

    fc1, fc2 = (w.detach().to(dtype).requires_grad_() for w in (hf.up_proj, hf.down_proj))
    xs, ws = x.to(dtype).requires_grad_(), weights.to(dtype).requires_grad_()
    flat = indices.flatten()
    order = torch.argsort(flat, stable=True)
    token, counts = order // indices.shape[1], torch.bincount(flat, minlength=hf.num_experts)
    rows = grouped_gated_mlp(xs[token], fc1, fc2, counts, ws.flatten()[order], activation=activation, gated=False,
                             use_grouped_mm=use_grouped_mm)
    out = torch.zeros_like(xs).index_add(0, token, rows)
    out.backward(grad.to(dtype))
    got = [out.detach(), xs.grad, ws.grad, fc1.grad, fc2.grad]
    for name, a, b in zip(("out", "d_x", "d_weights", "d_up", "d_down"), got, want):
        assert a.dtype == dtype, name
        if dtype == torch.float32:
            torch.testing.assert_close(a, b, **GEGLU_TOL[dtype], msg=lambda m, n=name: f"{n}: {m}")
        else:
            err = ((a.float() - b).norm() / b.norm()).item()
            assert err < GEMMA4_NORM_RTOL, f"{name}: ||a - ref|| / ||ref|| = {err:.2e}"
    assert counts[3] == 0 and torch.count_nonzero(fc1.grad[3]) == 0 and torch.count_nonzero(fc2.grad[3]) == 0


def _relu2_config(**kw):
    from loongforge_hf.kernels.relu2 import relu2

    return _config(gated_linear_unit=False, activation_func=relu2, **kw)


def test_relu2_module_layout_forward_and_checkpoint():
    """EP rank 1 of 2, ETP rank 1 of 2, 4 local experts of 8, F=12: fc1 ``[4, 6, 16]`` (no gate half), the forward
    against the per-token reference, and the checkpoint keys / global shapes of megatron's ``SequentialMLP`` with a
    plain MLP: fc1 one block of ``[8, F, H]`` (rows 6:12 on ETP rank 1), no factory."""
    from megatron.core.dist_checkpointing import ShardedTensor

    m = _module(_relu2_config(perform_initialization=True, init_method=lambda w: w.fill_(0.5),
                              output_layer_init_method=lambda w: w.fill_(-0.25)), edp=(1, 2))
    fc1, fc2 = m.linear_fc1.weight, m.linear_fc2.weight
    assert tuple(fc1.shape) == (4, 6, 16) and tuple(fc2.shape) == (4, 16, 6) and not m.gated
    assert bool((fc1 == 0.5).all()) and bool((fc2 == -0.25).all())  # every expert initialised
    assert fc1.allreduce is False and (fc1.partition_dim, fc2.partition_dim) == (1, 2)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        fc1.copy_(torch.randn(fc1.shape, generator=g))
        fc2.copy_(torch.randn(fc2.shape, generator=g))
    counts = torch.tensor([2, 0, 3, 1])
    x, probs = torch.randn(6, 16, generator=g), torch.rand(6, generator=g)
    out, bias = m(x, counts, probs)
    expert = torch.repeat_interleave(torch.arange(4), counts)
    act = torch.relu(torch.einsum("th,tfh->tf", x, fc1.detach()[expert])).square() * probs.unsqueeze(-1)
    assert bias is None
    torch.testing.assert_close(out, torch.einsum("tf,thf->th", act, fc2.detach()[expert]))

    sd = m.sharded_state_dict(prefix="decoder.layers.3.mlp.experts.", sharded_offsets=((0, 3, 5),))
    s1, s2 = sd["decoder.layers.3.mlp.experts.linear_fc1.weight"], sd["decoder.layers.3.mlp.experts.linear_fc2.weight"]
    assert isinstance(s1, ShardedTensor) and s1.data is fc1
    assert s1.key == "decoder.layers.3.mlp.experts.experts.linear_fc1.weight"
    assert (s1.global_shape, s1.global_offset, s1.replica_id) == ((5, 8, 12, 16), (3, 4, 6, 0), (0, 0, 1))
    assert (s2.global_shape, s2.global_offset) == ((5, 8, 16, 12), (3, 4, 0, 6))


def test_relu2_refusals():
    """What the plain experts do not take, each naming its field: another activation without the gate, relu2 with
    it, biases, a gated-width fc1, LoRA on them (``lora/experts.py``) and FP8 (``fp8_linear``: SwiGLU only)."""
    from loongforge_hf.kernels.fp8_linear import fp8_experts_refusal
    from loongforge_hf.kernels.relu2 import relu2
    from loongforge_hf.lora import LoraConfigError
    from loongforge_hf.lora.experts import check_param_adaptable

    with pytest.raises(ValueError, match=r"with gated_linear_unit=False activation_func must be .*relu2"):
        _module(_config(gated_linear_unit=False))
    with pytest.raises(ValueError, match=r"activation_func must be torch.nn.functional.silu .* got <function relu2"):
        _module(_config(activation_func=relu2))
    with pytest.raises(ValueError, match="add_bias_linear must be False without gated_linear_unit"):
        _module(_relu2_config(add_bias_linear=True, expert_tensor_parallel_size=1), etp=(0, 1))
    x, fc1, fc2, probs, _ = _operands([1, 2], torch.float32)
    with pytest.raises(ValueError, match=r"fc1 \(2, 24, 16\) must be \[E, F, H\]"):
        grouped_gated_mlp(x, fc1, fc2, [1, 2], probs, activation=relu2, gated=False)
    m = _module(_relu2_config(expert_model_parallel_size=1, expert_tensor_parallel_size=1), ep=(0, 1), etp=(0, 1))
    with pytest.raises(LoraConfigError, match=r"not supported for plain \(not gated\) relu2 experts"):
        check_param_adaptable(m, "experts")
    assert "the activation Relu2 (only SwiGLU and the clamped SwiGLU)" in fp8_experts_refusal(m)
