"""SwiGLU against silu(gate) * up in plain torch: outputs and grads, fp32 and bf16, odd shapes; megatron's MLP slot."""

import pytest
import torch
import torch.nn.functional as F
from megatron.core.transformer.transformer_config import TransformerConfig

from loongforge_hf.kernels.swiglu import SwiGLU, swiglu

SHAPES = [(3, 7, 82), (5, 2), (2, 3, 1, 34)]


def reference(x):
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def _input(shape, dtype, seed=0):
    return (2 * torch.randn(shape, generator=torch.Generator().manual_seed(seed))).to(dtype)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_is_bit_identical_to_reference(shape, dtype):
    x = _input(shape, dtype)
    assert torch.equal(swiglu(x), reference(x))


# bf16: compared with the fp32 reference on the same inputs; ours computes the backward in fp32 and rounds once.
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype,atol,rtol", [(torch.float32, 1e-5, 1e-5), (torch.bfloat16, 1e-2, 1.6e-2)])
def test_grad_matches_autograd_reference(shape, dtype, atol, rtol):
    x = _input(shape, dtype, seed=1)
    grad = torch.randn(*shape[:-1], shape[-1] // 2, generator=torch.Generator().manual_seed(2)).to(dtype)
    x1, x2 = x.clone().requires_grad_(), x.float().requires_grad_()
    swiglu(x1).backward(grad)
    reference(x2).backward(grad.float())
    assert x1.grad.dtype == dtype
    torch.testing.assert_close(x1.grad.float(), x2.grad, atol=atol, rtol=rtol)


def test_odd_width_is_rejected():
    with pytest.raises(ValueError, match="must be even"):
        swiglu(torch.randn(3, 5))


def _config(**overrides):
    kw = dict(num_layers=1, hidden_size=16, num_attention_heads=2, gated_linear_unit=True, activation_func=F.silu,
              bias_activation_fusion=False, add_bias_linear=False)
    kw.update(overrides)
    return TransformerConfig(**kw)


def test_module_checks_the_config_it_stands_for():
    x = _input((4, 10), torch.float32)
    assert torch.equal(SwiGLU(config=_config())(x), reference(x))
    with pytest.raises(ValueError, match="gated_linear_unit must be True"):
        SwiGLU(_config(gated_linear_unit=False))
    with pytest.raises(ValueError, match="activation_func must be"):
        SwiGLU(_config(activation_func=F.gelu))
