"""What a kernel keeps for its backward.

A tensor kept for the backward keeps its whole storage alive. megatron splits k and v off the fused QKV projection's
output as strided views, so a norm or an attention kernel that keeps ``k`` or ``v`` as given holds the whole
``[s, b, q + 2 kv]`` buffer (4 hidden sizes per token for Qwen3-0.6B) until the backward, where ``k`` and ``v`` alone
are 2: ``standalone`` copies such a view once, and the buffer is freed after the layer's forward.
"""

from __future__ import annotations

import torch


def standalone(x: torch.Tensor) -> torch.Tensor:
    """``x`` when it spans its whole storage, else a contiguous copy of it (a view into a larger buffer)."""
    if x.untyped_storage().nbytes() <= x.numel() * x.element_size():
        return x
    return x.clone(memory_format=torch.contiguous_format)


def needs_autograd(*tensors: torch.Tensor | None) -> bool:
    """Whether a kernel's call must record its backward: grad mode on and an input that requires grad. Inference
    (generate's decode steps, evaluation) skips the ``autograd.Function`` and what it keeps (its per-call cost is a
    large share of a one-token step)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
