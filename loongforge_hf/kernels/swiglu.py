"""SwiGLU on megatron's gated fc1 output: ``[..., 2F] -> silu(gate) * up`` with ``gate, up = x.chunk(2, -1)``.

Choices:
- The forward is HF's ``act_fn(gate_proj(x)) * up_proj(x)`` in the input dtype, so bf16 results round where HF's do.
- A ``torch.autograd.Function`` keeps only the fc1 output for the backward (autograd would keep gate, up and
  silu(gate)) and recomputes the sigmoid in fp32 there.
- On CUDA with Triton installed, forward and backward are one Triton kernel each (``_swiglu_triton.py``, same
  numerics); the torch code below is the CPU path and the reference, and inference's path on small CUDA inputs
  (``_triton.launch_bound``: two aten launches cost a decode step's host less than one Triton launch).
- ``SwiGLU(config)`` fills megatron's ``MLPSubmodules.activation_func`` slot. megatron-core 0.16 builds that slot only
  when ``config.use_te_activation_func`` is True (transformer/mlp.py, MLP.__init__) and then calls it on the whole fc1
  output; otherwise megatron applies ``config.activation_func`` (silu) to the gate itself: the same math. The dense
  spec's MLP (``specs.SwiGLUMLP``) calls ``swiglu`` itself.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loongforge_hf.kernels._saved import needs_autograd
from loongforge_hf.kernels._triton import launch_bound, use_triton


def _forward(x: torch.Tensor, triton: bool) -> torch.Tensor:
    if triton:
        from loongforge_hf.kernels import _swiglu_triton

        return _swiglu_triton.forward(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class _SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.triton = use_triton(x)
        return _forward(x, ctx.triton)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        if ctx.triton:
            from loongforge_hf.kernels import _swiglu_triton

            return _swiglu_triton.backward(grad_out, x)
        gate, up = x.to(torch.float32).chunk(2, dim=-1)
        grad = grad_out.to(torch.float32)
        sig = torch.sigmoid(gate)
        silu = gate * sig
        grad_gate = grad * up * sig * (1 + gate * (1 - sig))
        grad_up = grad * silu
        return torch.cat((grad_gate, grad_up), dim=-1).to(x.dtype)


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :F]) * x[..., F:]`` for ``x`` of last dimension ``2F``."""
    if x.shape[-1] % 2:
        raise ValueError(f"swiglu: the last dimension ({x.shape[-1]}) must be even: it holds [gate, up].")
    if not needs_autograd(x):
        return _forward(x, use_triton(x) and not launch_bound(x))
    return _SwiGLUFunction.apply(x)


def check_plain_gated(config, activation, name: str, module: str) -> None:
    """Raise unless ``config`` is a gated MLP with ``activation`` (called ``name``), no clamp and no linear offset:
    what ``module`` (a plain gated activation: SwiGLU, GeGLU) computes."""
    problems = []
    if not config.gated_linear_unit:
        problems.append("gated_linear_unit must be True")
    if config.activation_func is not activation:
        problems.append(f"activation_func must be {name} (got {config.activation_func!r})")
    if getattr(config, "activation_func_clamp_value", None) is not None:
        problems.append("activation_func_clamp_value must be None")
    if getattr(config, "glu_linear_offset", 0.0):
        problems.append("glu_linear_offset must be 0")
    if problems:
        raise ValueError(f"loongforge {module} does not match this TransformerConfig: " + "; ".join(problems) + ".")


class SwiGLU(torch.nn.Module):
    """megatron's ``activation_func`` slot for a gated MLP: built as ``SwiGLU(config=config)``."""

    def __init__(self, config) -> None:
        super().__init__()
        check_plain_gated(config, F.silu, "torch.nn.functional.silu", "SwiGLU")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return swiglu(x)
