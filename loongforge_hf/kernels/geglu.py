"""Gated tanh-GELU (Gemma's GeGLU) on megatron's gated fc1 output: ``[..., 2F] -> gelu_tanh(gate) * up`` with
``gate, up = x.chunk(2, -1)``.

Choices:
- ``gelu_tanh`` is transformers' ``gelu_pytorch_tanh`` (``GELUTanh``: torch's ``F.gelu(approximate="tanh")``) and
  the function the bridges put in ``TransformerConfig.activation_func`` for it (``bridges/config_map.py`` takes it
  from here), so a config asks for this activation by that function's identity, as megatron's ``quick_gelu`` asks
  for gpt-oss's GLU.
- The forward is transformers' expert ``act_fn(gate) * up`` (Gemma 4's ``Gemma4TextExperts``, the dense Gemma MLP
  alike) in the input dtype: in bf16 it rounds after the GELU and after the product, where transformers' does; in
  fp32 it is the same ops, bit for bit.
- A ``torch.autograd.Function`` keeps only the fc1 output for the backward (autograd would keep gate, up and the
  GELU) and recomputes in fp32 there: ``grad_gate = gelu_backward(grad * up, gate)`` (torch's own derivative of the
  tanh GELU, the op autograd runs for ``F.gelu``) and ``grad_up = grad * gelu_tanh(gate)``, rounded once to the
  input dtype (autograd in bf16 rounds at each of its ops).
- Torch only (no Triton kernel): a few elementwise launches, the CPU path and the reference alike.
- ``GeGLU(config)`` validates a ``TransformerConfig`` for it, as ``swiglu.SwiGLU(config)`` does for SwiGLU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loongforge_hf.kernels._saved import needs_autograd
from loongforge_hf.kernels.swiglu import check_plain_gated


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """transformers' ``gelu_pytorch_tanh`` (Gemma's MLP): torch's tanh-approximated GELU."""
    return F.gelu(x, approximate="tanh")


def _forward(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return gelu_tanh(gate) * up


class _GeGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return _forward(x)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        gate, up = x.to(torch.float32).chunk(2, dim=-1)
        grad = grad_out.to(torch.float32)
        grad_gate = torch.ops.aten.gelu_backward(grad * up, gate, approximate="tanh")
        grad_up = grad * gelu_tanh(gate)
        return torch.cat((grad_gate, grad_up), dim=-1).to(x.dtype)


def geglu(x: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(x[..., :F]) * x[..., F:]`` for ``x`` of last dimension ``2F``."""
    if x.shape[-1] % 2:
        raise ValueError(f"geglu: the last dimension ({x.shape[-1]}) must be even: it holds [gate, up].")
    if not needs_autograd(x):
        return _forward(x)
    return _GeGLUFunction.apply(x)


class GeGLU(torch.nn.Module):
    """The activation of a gated MLP whose config has ``activation_func=gelu_tanh`` (this module's)."""

    def __init__(self, config) -> None:
        super().__init__()
        check_plain_gated(config, gelu_tanh, "loongforge_hf.kernels.geglu.gelu_tanh", "GeGLU")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return geglu(x)
