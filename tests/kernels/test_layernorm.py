"""``kernels.layernorm.LayerNorm`` against ``torch.nn.LayerNorm`` (what transformers' StarCoder2 runs): outputs and the
input, weight and bias gradients bit for bit in fp32 and bf16 on an odd shape; megatron's ``sequence_parallel`` mark
on both parameters; configs it does not implement refused; the dense spec's norm slots for each normalization.
``LayerNormWithoutBias`` against transformers' ``CohereLayerNorm`` (fp32 math, one rounding): outputs and gradients
within 1e-5 in fp32, outputs within one bf16 rounding in bf16; no bias parameter; the spec's slots with
``norm_bias=False``. With ``layernorm_zero_centered_gamma`` against transformers' ``NemotronLayerNorm1P`` (weight + 1)
and ``LayerNormWithoutParameters`` against ``OlmoLayerNorm``: outputs and gradients bit for bit in fp32 and bf16; the
spec's slots with ``norm_weight=False``."""

from types import SimpleNamespace

import pytest
import torch

from megatron.core.transformer.identity_op import IdentityOp

from loongforge_hf.kernels.layernorm import LayerNorm, LayerNormWithoutBias, LayerNormWithoutParameters
from loongforge_hf.kernels.rmsnorm import RMSNorm
from loongforge_hf.kernels.specs import final_norm_spec, get_layer_spec, norm_class


def _config(**kw):
    base = dict(normalization="LayerNorm", layernorm_zero_centered_gamma=False, use_cpu_initialization=True,
                params_dtype=torch.float32, sequence_parallel=False)
    return SimpleNamespace(**{**base, **kw})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_torch_layer_norm(dtype):
    g = torch.Generator().manual_seed(0)
    hidden = 341
    ours = LayerNorm(_config(params_dtype=dtype), hidden, eps=1e-5)
    ref = torch.nn.LayerNorm(hidden, eps=1e-5, dtype=dtype)
    with torch.no_grad():
        for p in (ours.weight, ours.bias):
            p.copy_(torch.randn(hidden, generator=g).to(dtype))
        ref.weight.copy_(ours.weight)
        ref.bias.copy_(ours.bias)
    x = (3 * torch.randn(9, 41, hidden, generator=g) + 1).to(dtype)
    x_ours, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    grad = torch.randn(9, 41, hidden, generator=g).to(dtype)
    y_ours, y_ref = ours(x_ours), ref(x_ref)
    assert torch.equal(y_ours, y_ref)
    y_ours.backward(grad)
    y_ref.backward(grad)
    assert torch.equal(x_ours.grad, x_ref.grad)
    assert torch.equal(ours.weight.grad, ref.weight.grad) and torch.equal(ours.bias.grad, ref.bias.grad)


def test_sequence_parallel_mark_and_refusals():
    norm = LayerNorm(_config(sequence_parallel=True), 8)
    assert norm.weight.sequence_parallel and norm.bias.sequence_parallel
    assert not LayerNorm(_config(), 8).bias.sequence_parallel
    with pytest.raises(ValueError, match="normalization='RMSNorm'"):
        LayerNorm(_config(normalization="RMSNorm"), 8)
    with pytest.raises(ValueError, match="layernorm_zero_centered_gamma needs a norm weight"):
        LayerNormWithoutParameters(_config(layernorm_zero_centered_gamma=True), 8)


def test_spec_norms_follow_normalization():
    sub = get_layer_spec(qk_norm=False, normalization="LayerNorm").submodules
    assert sub.input_layernorm is LayerNorm and sub.pre_mlp_layernorm is LayerNorm
    assert final_norm_spec(normalization="LayerNorm") is LayerNorm and final_norm_spec() is RMSNorm
    assert norm_class("RMSNorm") is RMSNorm
    with pytest.raises(ValueError, match="normalization='L2Norm' is not supported"):
        norm_class("L2Norm")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_without_bias_matches_cohere_layer_norm(dtype):
    from transformers.models.cohere.modeling_cohere import CohereLayerNorm

    g = torch.Generator().manual_seed(1)
    hidden = 341
    ours = LayerNormWithoutBias(_config(params_dtype=dtype, sequence_parallel=True), hidden, eps=1e-5)
    ref = CohereLayerNorm(hidden, eps=1e-5).to(dtype)
    with torch.no_grad():
        ours.weight.copy_((1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype))
        ref.weight.copy_(ours.weight)
    assert ours.bias is None and [n for n, _ in ours.named_parameters()] == ["weight"] and ours.weight.sequence_parallel
    x = (3 * torch.randn(9, 41, hidden, generator=g) + 1).to(dtype)
    x_ours, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    grad = torch.randn(9, 41, hidden, generator=g).to(dtype)
    y_ours, y_ref = ours(x_ours), ref(x_ref)
    assert y_ours.dtype == dtype
    if dtype == torch.bfloat16:  # NOTE: both round once from fp32; the fp32 results differ in the last bits
        torch.testing.assert_close(y_ours, y_ref, atol=0, rtol=2 ** -7)  # NOTE: one bf16 ulp at most
        return
    torch.testing.assert_close(y_ours, y_ref, atol=1e-5, rtol=1e-5)
    y_ours.backward(grad)
    y_ref.backward(grad)
    torch.testing.assert_close(x_ours.grad, x_ref.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours.weight.grad, ref.weight.grad, atol=1e-4, rtol=1e-5)


def test_spec_norms_without_bias():
    sub = get_layer_spec(qk_norm=False, normalization="LayerNorm", norm_bias=False,
                         parallel_residual="shared").submodules
    assert sub.input_layernorm is LayerNormWithoutBias and sub.pre_mlp_layernorm is IdentityOp
    assert final_norm_spec(normalization="LayerNorm", norm_bias=False) is LayerNormWithoutBias
    assert norm_class("RMSNorm", bias=False) is RMSNorm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_centred_and_parameterless_match_nemotron_and_olmo(dtype):
    from transformers.models.nemotron.modeling_nemotron import NemotronLayerNorm1P
    from transformers.models.olmo.modeling_olmo import OlmoLayerNorm

    g = torch.Generator().manual_seed(2)
    hidden = 341
    one_p = LayerNorm(_config(params_dtype=dtype, layernorm_zero_centered_gamma=True), hidden, eps=1e-5)
    assert torch.equal(one_p.weight, torch.zeros(hidden, dtype=dtype))  # NOTE: gamma 1 stored as 0
    ref_1p = NemotronLayerNorm1P(hidden, eps=1e-5).to(dtype)
    with torch.no_grad():
        for p in (one_p.weight, one_p.bias):
            p.copy_((0.1 * torch.randn(hidden, generator=g)).to(dtype))
        ref_1p.weight.copy_(one_p.weight)
        ref_1p.bias.copy_(one_p.bias)
    bare = LayerNormWithoutParameters(_config(params_dtype=dtype), hidden, eps=1e-5)
    assert list(bare.parameters()) == []
    x = (3 * torch.randn(9, 41, hidden, generator=g) + 1).to(dtype)
    grad = torch.randn(9, 41, hidden, generator=g).to(dtype)
    for ours, ref in ((one_p, ref_1p), (bare, OlmoLayerNorm(hidden))):
        x_ours, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()
        y_ours, y_ref = ours(x_ours), ref(x_ref)
        assert y_ours.dtype == dtype and torch.equal(y_ours, y_ref)
        y_ours.backward(grad)
        y_ref.backward(grad)
        assert torch.equal(x_ours.grad, x_ref.grad)
        for p_ours, p_ref in zip(ours.parameters(), ref.parameters(), strict=True):
            assert torch.equal(p_ours.grad, p_ref.grad)
    sub = get_layer_spec(qk_norm=False, normalization="LayerNorm", norm_weight=False).submodules
    assert sub.input_layernorm is LayerNormWithoutParameters and sub.pre_mlp_layernorm is LayerNormWithoutParameters
    assert final_norm_spec(normalization="LayerNorm", norm_weight=False) is LayerNormWithoutParameters
    from loongforge_hf.kernels.rmsnorm import RMSNormWithoutWeight  # NOTE: NanoChat's (its parity: test_dense_parity)

    assert norm_class("RMSNorm", weight=False) is RMSNormWithoutWeight
