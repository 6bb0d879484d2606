"""Squared ReLU (transformers' ``relu2``: Nemotron-H's and Arcee's MLPs, Nemotron 3 Nano's experts): ``relu(x) ** 2``
on a plain (not gated) fc1 output, ``[..., F] -> [..., F]``.

Choices:
- ``relu2`` is transformers' ``ReLUSquaredActivation`` (``relu`` then ``square``, in the input dtype: bit for bit in
  fp32 and bf16) and the function the bridges put in ``TransformerConfig.activation_func`` for it
  (``bridges/config_map.py`` takes it from here), so a config asks for it by this function's identity, as for
  ``geglu.gelu_tanh``.
- Torch ops, no ``autograd.Function``: autograd keeps one tensor for the backward, ``relu(x)`` (the ReLU's output
  and the square's input are the same tensor), which is all the derivative ``2 * relu(x)`` needs; a fused kernel
  would save nothing and round the same (``grad * 2r`` of two bf16 values is exact in fp32, then rounded once).
- ``Relu2(config)`` validates a ``TransformerConfig`` for the grouped experts' non-gated MLP
  (``grouped_mlp.expert_activation``), as ``swiglu.SwiGLU(config)`` does for SwiGLU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def relu2(x: torch.Tensor) -> torch.Tensor:
    """transformers' ``relu2``: the squared ReLU."""
    return F.relu(x).square()


def check_plain_relu2(config, module: str) -> None:
    """Raise unless ``config`` is a plain (not gated) MLP with ``relu2``, no clamp: what ``module`` computes."""
    problems = []
    if config.gated_linear_unit:
        problems.append("gated_linear_unit must be False")
    if config.activation_func is not relu2:
        problems.append(f"activation_func must be loongforge_hf.kernels.relu2.relu2 (got {config.activation_func!r})")
    if getattr(config, "activation_func_clamp_value", None) is not None:
        problems.append("activation_func_clamp_value must be None")
    if problems:
        raise ValueError(f"loongforge {module} does not match this TransformerConfig: " + "; ".join(problems) + ".")


class Relu2(torch.nn.Module):
    """The activation of a non-gated expert MLP whose config has ``activation_func=relu2`` (this module's)."""

    def __init__(self, config) -> None:
        super().__init__()
        check_plain_relu2(config, "Relu2")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return relu2(x)
