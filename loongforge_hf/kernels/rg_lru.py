"""The RG-LRU (Griffin's Real-Gated Linear Recurrent Unit, RecurrentGemma's recurrent blocks): block-diagonal input
and recurrence gates, a per-channel decay, the normalised input and the diagonal linear recurrence over time.

Choices:
- The gates as transformers' ``RecurrentGemmaRglru`` op for op (``baddbmm`` over the heads' blocks, sigmoid, the
  decay ``a = exp(-8 * r * softplus(recurrent_param))``, the input times ``sqrt(1 - a^2)`` with transformers'
  clipped derivative, ``sqrt_bound``), so fp32 results are transformers' own.
- Resets (``reset`` ``[b, s]``: a row's first token, a packed document's first, the first real token after left
  padding): the decay there is zero and the input is not normalised, as transformers at ``position_ids == 0``.
- The recurrence ``h_t = a_t * h_{t-1} + x_t`` in fp32 (transformers' ``_rnn_scan`` steps it token by token) by
  ``kernels.linear_scan``: a parallel scan in ``O(log s)`` tensor steps with its backward by hand, within fp32
  rounding of the sequential sums; its output in the input's dtype. No fused kernel.
- A cached step continues from ``state`` (fp32 ``[b, channels]``) and returns the last one.
- ``scan``: ``kernels.linear_scan`` or a stand-in of its signature (``parallel/linear_scan_cp.py``: the states
  passed between context-parallel chunks).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loongforge_hf.kernels.linear_scan import linear_scan as scan

MAX_SQRT_GRADIENT = 1000.0  # NOTE: transformers' _MAX_SQRT_GRADIENT


class _SqrtBound(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return torch.sqrt(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return grad / torch.sqrt(torch.clip(4.0 * x, min=1 / (MAX_SQRT_GRADIENT ** 2)))


def sqrt_bound(x: torch.Tensor) -> torch.Tensor:
    """``sqrt(x)`` whose derivative is clipped at ``MAX_SQRT_GRADIENT`` (transformers' ``SqrtBoundDerivative``)."""
    return _SqrtBound.apply(x)


def linear_scan(x: torch.Tensor, a: torch.Tensor, state: torch.Tensor | None = None, *, scan=scan):
    """``x``, ``a`` ``[b, s, c]``, ``state`` fp32 ``[b, c]`` or None (zeros) -> ``h`` ``[b, s, c]`` in ``x``'s dtype
    (``h_t = a_t h_{t-1} + x_t``, accumulated in fp32) and the last state (fp32 ``[b, c]``)."""
    states = scan(a, x, initial=state, dim=1)
    return states.to(x.dtype), states[:, -1]


def rg_lru(x: torch.Tensor, *, input_gate_weight: torch.Tensor, input_gate_bias: torch.Tensor,
           recurrent_gate_weight: torch.Tensor, recurrent_gate_bias: torch.Tensor, recurrent_param: torch.Tensor,
           reset: torch.Tensor, state: torch.Tensor | None = None, scan=scan):
    """``x`` ``[b, s, heads * block]`` (the conv's output), the gates' ``[heads, block, block]`` weights and
    ``[heads, block]`` biases, ``recurrent_param`` ``[heads * block]``, ``reset`` ``[b, s]`` bool -> the RG-LRU's
    output ``[b, s, heads * block]`` (``x``'s dtype) and the last state (fp32 ``[b, heads * block]``)."""
    batch, seq, width = x.shape
    heads, block = input_gate_bias.shape
    blocks = x.reshape(batch * seq, heads, block).permute(1, 0, 2)

    def gate(weight, bias):
        out = torch.baddbmm(bias[:, None, :], blocks, weight)
        return torch.sigmoid(out.transpose(0, 1).reshape(batch, seq, width))

    input_gate, recurrent_gate = gate(input_gate_weight, input_gate_bias), gate(recurrent_gate_weight,
                                                                                recurrent_gate_bias)
    log_a = -8.0 * recurrent_gate * F.softplus(recurrent_param)
    a, a_square = torch.exp(log_a), torch.exp(2 * log_a)
    reset = reset[:, :, None]
    multiplier = reset + ~reset * sqrt_bound(1 - a_square)
    normalized = x * input_gate * multiplier.type(x.dtype)
    return linear_scan(normalized, a * ~reset, state, scan=scan)
