"""RMSNorm with Hugging Face's Llama / Qwen3 numerics, as a module megatron-core can build from a layer spec.

Choices:
- The forward is HF's expression, op for op: ``weight * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(x.dtype)``, so
  fp32 results are bit-identical to ``Qwen3RMSNorm`` / ``LlamaRMSNorm`` and bf16 ones round at the same two places.
- A ``torch.autograd.Function`` keeps only the input and one fp32 scalar per row for the backward (plain autograd would
  keep an fp32 copy of the whole input); the backward accumulates in fp32. An input that is a view into a larger
  buffer (megatron's ``k`` of the fused QKV output, for the k norm) is kept as a copy of its own
  (``_saved.standalone``), so the buffer is not held until the backward.
- ``RMSNorm(config, hidden_size, eps)`` has the keyword contract megatron uses for every norm slot (input, pre-MLP,
  q/k, final). Its weight carries ``sequence_parallel`` so megatron all-reduces the weight grad over the
  tensor-parallel group when sequence parallelism splits the tokens; megatron's own torch norm refuses that layout.
- On CUDA with Triton installed, forward and backward are one Triton kernel each (``_rmsnorm_triton.py``: fp32 math,
  the same two roundings, the weight grad reduced in fp32); the torch code below is the CPU path and the reference.
- Inference on a small CUDA input (a decode step: ``_triton.launch_bound``) runs torch's fused ``F.rms_norm``
  without the weight, then the weight multiply: HF's two roundings, two aten launches that cost the host less than
  one Triton launch. Only where torch has the fused kernel (``aten._fused_rms_norm``, torch 2.8+): before it
  ``F.rms_norm`` is the op-by-op composite, dearer than the Triton launch.
- ``config.layernorm_zero_centered_gamma`` stores ``weight - 1`` (initialised at zero) and applies ``1 + weight``
  with Gemma's numerics (``Gemma3RMSNorm``, the only HF norm stored that way): ``(x.float() * rstd * (1 +
  weight.float())).to(x.dtype)``, one rounding at the end, ``1 + weight`` in fp32 (a bf16 ``1 + weight`` would lose
  the weight's low bits).
- ``RMSNormWithoutWeight``: ``(x.float() * rsqrt(mean(x.float()^2) + eps)).to(x.dtype)``, no parameter (NanoChat's
  norms, Llama 4's ``L2Norm``), plain autograd, for the same slots.
- ``sharded_state_dict``: the weight replicated (megatron's ``MLP`` asks each child for one; a post-MLP norm there,
  Gemma 3's, needs it).
"""

from __future__ import annotations

import torch

from loongforge_hf.kernels._saved import needs_autograd, standalone
from loongforge_hf.kernels._triton import launch_bound, use_triton
from loongforge_hf.xpu import get_backend

FUSED_RMS_NORM = hasattr(torch.ops.aten, "_fused_rms_norm")


def _normalize(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    xf = x.to(torch.float32)
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return xf * rstd, rstd


def _forward(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered_gamma: bool, triton: bool):
    """(output, rstd)."""
    if triton:
        from loongforge_hf.kernels import _rmsnorm_triton

        return _rmsnorm_triton.forward(x, weight, eps, zero_centered_gamma)
    normed, rstd = _normalize(x, eps)
    if zero_centered_gamma:
        return (normed * (weight.to(torch.float32) + 1)).to(torch.promote_types(x.dtype, weight.dtype)), rstd
    return weight * normed.to(x.dtype), rstd


class _RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered_gamma: bool):
        ctx.zero_centered_gamma = zero_centered_gamma
        ctx.triton = use_triton(x)
        y, rstd = _forward(x, weight, eps, zero_centered_gamma, ctx.triton)
        ctx.save_for_backward(standalone(x), weight, rstd)
        return y

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        if ctx.triton:
            from loongforge_hf.kernels import _rmsnorm_triton

            grad_x, grad_weight = _rmsnorm_triton.backward(grad_out, x, weight, rstd, ctx.zero_centered_gamma,
                                                           ctx.needs_input_grad[0], ctx.needs_input_grad[1])
            return grad_x, grad_weight, None, None
        normed = x.to(torch.float32) * rstd
        grad_x = grad_weight = None
        if ctx.needs_input_grad[1]:
            # NOTE: the forward multiplies by the rounded normalised input, so the weight grad uses it too (Gemma's
            # zero-centred numerics round after the multiply: the fp32 one)
            rounded = normed if ctx.zero_centered_gamma else normed.to(x.dtype).to(torch.float32)
            grad_weight = (grad_out.to(torch.float32) * rounded).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
        if ctx.needs_input_grad[0]:
            gamma = weight.to(torch.float32) + 1 if ctx.zero_centered_gamma else weight.to(torch.float32)
            grad_normed = grad_out.to(torch.float32) * gamma
            dot = (grad_normed * normed).mean(-1, keepdim=True)
            grad_x = (rstd * (grad_normed - normed * dot)).to(x.dtype)
        return grad_x, grad_weight, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *,
             zero_centered_gamma: bool = False) -> torch.Tensor:
    """RMS-normalise the last dimension of ``x`` and scale by ``weight`` (or ``1 + weight``), HF numerics."""
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"rms_norm: weight has shape {tuple(weight.shape)}, expected ({x.shape[-1]},) for an input "
                         f"of shape {tuple(x.shape)}.")
    if not needs_autograd(x, weight):
        triton = use_triton(x)
        if triton and FUSED_RMS_NORM and launch_bound(x) and not zero_centered_gamma:
            return weight * torch.nn.functional.rms_norm(x, (x.shape[-1],), eps=eps)
        return _forward(x, weight, eps, zero_centered_gamma, triton)[0]
    return _RMSNormFunction.apply(x, weight, eps, zero_centered_gamma)


class RMSNorm(torch.nn.Module):
    """The norm for megatron's ``input_layernorm`` / ``pre_mlp_layernorm`` / ``q_layernorm`` / ``k_layernorm`` /
    final-norm slots: ``build_module(RMSNorm, config=config, hidden_size=..., eps=config.layernorm_epsilon)``."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        if getattr(config, "normalization", "RMSNorm") != "RMSNorm":
            raise ValueError(f"loongforge RMSNorm was built for a config with normalization="
                             f"{config.normalization!r}; set TransformerConfig.normalization='RMSNorm'.")
        self.hidden_size = hidden_size
        self.eps = eps
        self.zero_centered_gamma = bool(getattr(config, "layernorm_zero_centered_gamma", False))
        device = torch.device("cpu") if config.use_cpu_initialization else get_backend().device()
        init = torch.zeros if self.zero_centered_gamma else torch.ones
        self.weight = torch.nn.Parameter(init(hidden_size, dtype=config.params_dtype, device=device))
        # NOTE: megatron's finalize_model_grads sums the grads of params marked `sequence_parallel` over the TP group:
        # with sequence parallelism each TP rank normalises different tokens, so each holds a partial weight grad.
        self.weight.sequence_parallel = bool(config.sequence_parallel)
        # normalise a copy of the input (set by the builder for megatron's local CUDA graphs, whose first graphed
        # layer's input buffer does not outlive the forward: bridges/builder._keep_graph_input)
        self.copy_input = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.copy_input:
            x = x.clone()
        return rms_norm(x, self.weight, self.eps, zero_centered_gamma=self.zero_centered_gamma)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix, {},
                                                   sharded_offsets)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, zero_centered_gamma={self.zero_centered_gamma}"


class RMSNormWithoutWeight(torch.nn.Module):
    """An RMSNorm without weight (see the module docstring), built like ``RMSNorm`` for megatron's norm slots."""

    def __init__(self, config=None, hidden_size: int = 0, eps: float = 1e-6) -> None:
        super().__init__()
        self.hidden_size, self.eps = hidden_size, eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"
