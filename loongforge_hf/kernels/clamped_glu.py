"""Clamped GLUs on megatron's gated fc1 output: ``[..., 2F] -> g * sigmoid(alpha * g) * (u + offset)`` with
``gate, up = x.chunk(2, -1)``, ``g = min(gate, limit)`` and ``u = clamp(up, -limit, limit)``: gpt-oss's (alpha
1.702, offset 1) and DeepSeek-V4's / HY-V4's clamped SwiGLU (alpha 1: ``silu(g) * u``, offset 0).

Choices:
- The math of megatron-core 0.16's gated MLP with ``activation_func=quick_gelu`` (``x * sigmoid(1.702 x)``),
  ``glu_linear_offset`` and ``activation_func_clamp_value`` (transformer/mlp.py, ``MLP.forward``'s ``glu``), which
  is HF's ``GptOssExperts._apply_gate`` (alpha 1.702, offset 1) on megatron's ``[gate; up]`` layout; with
  ``activation_func=silu`` and a clamp, HF's ``DeepseekV4Experts._apply_gate`` / ``HYV4Experts._apply_gate``
  (``silu(min(gate, limit)) * clamp(up, -limit, limit)``). The forward runs in the input dtype in HF's order
  (``F.silu`` for alpha 1, as HF's), so bf16 results round where HF's do.
- A ``torch.autograd.Function`` keeps only the fc1 output for the backward (autograd would keep the clamped halves,
  the sigmoid and the product) and recomputes in fp32 there; a clamped entry gets no gradient, the bound itself
  included in the range that does (``torch.clamp``'s rule).
- With a limit (gpt-oss's, DeepSeek-V4's, HY-V4's) it runs on CUDA as the Triton SwiGLU kernels with the clamp
  (``_swiglu_triton``: one read of the fc1 output forward, one of it and the output grad backward, with these
  numerics); the torch code is the CPU path and the reference.
- ``ClampedGLU(config)`` validates a ``TransformerConfig`` for it, as ``swiglu.SwiGLU(config)`` does for SwiGLU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loongforge_hf.kernels._saved import needs_autograd
from loongforge_hf.kernels._triton import launch_bound, use_triton

QUICK_GELU_ALPHA = 1.702  # megatron's quick_gelu: x * sigmoid(1.702 x)
SILU_ALPHA = 1.0          # silu: x * sigmoid(x)


def _triton(x: torch.Tensor, limit: float | None) -> bool:
    """Whether the clamped GLU runs as the Triton SwiGLU kernels with the clamp (CUDA, a limit)."""
    return limit is not None and use_triton(x)


def _forward(x: torch.Tensor, alpha: float, limit: float | None, offset: float, triton: bool = False) -> torch.Tensor:
    if triton:
        from loongforge_hf.kernels import _swiglu_triton

        return _swiglu_triton.forward(x, limit, offset, alpha)
    gate, up = x.chunk(2, dim=-1)
    if limit is not None:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    if alpha == SILU_ALPHA:
        return F.silu(gate) * (up + offset if offset else up)
    return gate * torch.sigmoid(alpha * gate) * (up + offset)


class _ClampedGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, alpha: float, limit: float | None, offset: float) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.alpha, ctx.limit, ctx.offset, ctx.triton = alpha, limit, offset, _triton(x, limit)
        return _forward(x, alpha, limit, offset, ctx.triton)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (x,) = ctx.saved_tensors
        alpha, limit = ctx.alpha, ctx.limit
        if ctx.triton:
            from loongforge_hf.kernels import _swiglu_triton

            return _swiglu_triton.backward(grad_out, x, limit, ctx.offset, alpha), None, None, None
        gate, up = x.to(torch.float32).chunk(2, dim=-1)
        grad = grad_out.to(torch.float32)
        g = gate if limit is None else gate.clamp(max=limit)
        u = up if limit is None else up.clamp(min=-limit, max=limit)
        sig = torch.sigmoid(alpha * g)
        grad_gate = grad * (u + ctx.offset) * sig * (1 + alpha * g * (1 - sig))
        grad_up = grad * g * sig
        if limit is not None:
            grad_gate = grad_gate * (gate <= limit)
            grad_up = grad_up * ((up >= -limit) & (up <= limit))
        return torch.cat((grad_gate, grad_up), dim=-1).to(x.dtype), None, None, None


def clamped_glu(x: torch.Tensor, *, limit: float | None, offset: float = 1.0,
                alpha: float = QUICK_GELU_ALPHA) -> torch.Tensor:
    """``g * sigmoid(alpha * g) * (u + offset)`` for ``x`` ``[..., 2F]`` = ``[gate, up]``, ``g = min(gate, limit)``,
    ``u = clamp(up, -limit, limit)`` (``limit`` None: no clamp)."""
    if x.shape[-1] % 2:
        raise ValueError(f"clamped_glu: the last dimension ({x.shape[-1]}) must be even: it holds [gate, up].")
    if not needs_autograd(x):
        return _forward(x, alpha, limit, offset, _triton(x, limit) and not launch_bound(x))
    return _ClampedGLUFunction.apply(x, alpha, limit, offset)


class ClampedGLU(torch.nn.Module):
    """The activation of a gated MLP whose config has ``activation_func=quick_gelu`` (megatron's
    ``fusions.fused_bias_geglu``), ``glu_linear_offset`` and ``activation_func_clamp_value`` (None: no clamp), or
    ``activation_func=silu`` with a clamp (a plain SwiGLU is ``swiglu.SwiGLU``)."""

    def __init__(self, config) -> None:
        super().__init__()
        from megatron.core.fusions.fused_bias_geglu import quick_gelu

        problems = []
        limit = getattr(config, "activation_func_clamp_value", None)
        if not config.gated_linear_unit:
            problems.append("gated_linear_unit must be True")
        if config.activation_func is F.silu and limit is None:
            problems.append("activation_func_clamp_value must be set with activation_func=silu")
        elif config.activation_func is not quick_gelu and config.activation_func is not F.silu:
            problems.append("activation_func must be megatron.core.fusions.fused_bias_geglu.quick_gelu or "
                            f"torch.nn.functional.silu with a clamp (got {config.activation_func!r})")
        if limit is not None and not limit > 0:
            problems.append(f"activation_func_clamp_value must be None or positive (got {limit!r})")
        if problems:
            raise ValueError("loongforge ClampedGLU does not match this TransformerConfig: " + "; ".join(problems)
                             + ".")
        self.limit = None if limit is None else float(limit)
        self.offset = float(getattr(config, "glu_linear_offset", 0.0))
        self.alpha = SILU_ALPHA if config.activation_func is F.silu else QUICK_GELU_ALPHA

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return clamped_glu(x, limit=self.limit, offset=self.offset, alpha=self.alpha)

    def extra_repr(self) -> str:
        return f"alpha={self.alpha}, limit={self.limit}, offset={self.offset}"
