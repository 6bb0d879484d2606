"""RMSNorm against HF's Qwen3RMSNorm and a plain-torch reference: outputs and grads, fp32 and bf16, odd shapes."""

import pytest
import torch
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from loongforge_hf.kernels.rmsnorm import RMSNorm, rms_norm

SHAPES = [(3, 7, 41), (5, 41), (2, 1, 3, 17)]


def reference(x, weight, eps):
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _inputs(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(dtype)
    return x, w


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_is_bit_identical_to_qwen3_rmsnorm(shape, dtype):
    x, w = _inputs(shape, dtype)
    hf = Qwen3RMSNorm(shape[-1], eps=1e-6).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(w)
    assert torch.equal(rms_norm(x, w, 1e-6), hf(x))


# bf16: compared with the fp32 reference on the same (bf16-valued) inputs; the bound is bf16's resolution
# (rtol 2^-6, torch's default for bf16) since our output grad arrives rounded to bf16.
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype,atol,rtol", [(torch.float32, 1e-5, 1e-5), (torch.bfloat16, 1e-2, 1.6e-2)])
def test_grads_match_autograd_reference(shape, dtype, atol, rtol):
    x, w = _inputs(shape, dtype, seed=1)
    grad = torch.randn(shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    x1, w1 = x.clone().requires_grad_(), w.clone().requires_grad_()
    x2, w2 = x.float().requires_grad_(), w.float().requires_grad_()
    rms_norm(x1, w1, 1e-6).backward(grad)
    reference(x2, w2, 1e-6).backward(grad.float())
    torch.testing.assert_close(x1.grad.float(), x2.grad, atol=atol, rtol=rtol)
    torch.testing.assert_close(w1.grad.float(), w2.grad, atol=atol, rtol=rtol)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_centered_gamma_is_gemma3_rmsnorm(shape, dtype):
    """``1 + weight`` with Gemma's numerics: the output bit for bit ``Gemma3RMSNorm``'s (fp32 and bf16: one rounding,
    after the fp32 product), the grads those of autograd through ``Gemma3RMSNorm`` (fp32: 1e-5; bf16: the fp32 grads
    of the same inputs within bf16's resolution, as above)."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    x, w = _inputs(shape, dtype, seed=3)
    w = (w - 1).to(dtype)  # NOTE: stored zero-centred, as Gemma checkpoints are
    hf = Gemma3RMSNorm(shape[-1], eps=1e-6).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(w)
    assert torch.equal(rms_norm(x, w, 1e-6, zero_centered_gamma=True), hf(x))
    grad = torch.randn(shape, generator=torch.Generator().manual_seed(4)).to(dtype)
    x1, w1 = x.clone().requires_grad_(), w.clone().requires_grad_()
    rms_norm(x1, w1, 1e-6, zero_centered_gamma=True).backward(grad)
    hf32 = Gemma3RMSNorm(shape[-1], eps=1e-6)
    with torch.no_grad():
        hf32.weight.copy_(w.float())
    x2 = x.float().requires_grad_()
    hf32(x2).backward(grad.float())
    atol, rtol = (1e-5, 1e-5) if dtype == torch.float32 else (1e-2, 1.6e-2)
    torch.testing.assert_close(x1.grad.float(), x2.grad, atol=atol, rtol=rtol)
    torch.testing.assert_close(w1.grad.float(), hf32.weight.grad, atol=atol, rtol=rtol)


def _config(**overrides):
    kw = dict(num_layers=1, hidden_size=40, num_attention_heads=4, use_cpu_initialization=True,
              normalization="RMSNorm", layernorm_epsilon=1e-6)
    kw.update(overrides)
    return TransformerConfig(**kw)


def test_module_built_by_megatron_marks_sequence_parallel_and_matches_hf():
    config = _config(sequence_parallel=True, tensor_model_parallel_size=2, params_dtype=torch.bfloat16)
    norm = build_module(ModuleSpec(module=RMSNorm), config=config, hidden_size=41, eps=config.layernorm_epsilon)
    assert norm.weight.sequence_parallel is True
    assert norm.weight.dtype == torch.bfloat16 and torch.equal(norm.weight, torch.ones(41, dtype=torch.bfloat16))
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    hf = Qwen3RMSNorm(41, eps=1e-6).to(torch.bfloat16)
    hf.weight.data.copy_(norm.weight.data)
    x, _ = _inputs((3, 7, 41), torch.bfloat16)
    assert torch.equal(norm(x), hf(x))
    assert build_module(RMSNorm, config=_config(), hidden_size=8, eps=1e-6).weight.sequence_parallel is False


def test_module_zero_centered_gamma_from_config_starts_at_identity_scale():
    norm = RMSNorm(_config(layernorm_zero_centered_gamma=True), hidden_size=41)
    assert torch.equal(norm.weight, torch.zeros(41))
    x, _ = _inputs((3, 41), torch.float32)
    torch.testing.assert_close(norm(x), reference(x, torch.ones(41), 1e-6), atol=1e-6, rtol=1e-6)


def test_rejects_layernorm_config_and_bad_weight():
    with pytest.raises(ValueError, match="normalization='LayerNorm'"):
        RMSNorm(_config(normalization="LayerNorm"), hidden_size=8)
    with pytest.raises(ValueError, match="weight has shape"):
        rms_norm(torch.randn(2, 8), torch.ones(7))
