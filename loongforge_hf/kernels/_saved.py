"""What a kernel keeps for its backward.

A tensor kept for the backward keeps its whole storage alive. megatron splits k and v off the fused QKV projection's
output as strided views, so a norm or an attention kernel that keeps ``k`` or ``v`` as given holds the whole
``[s, b, q + 2 kv]`` buffer (4 hidden sizes per token for Qwen3-0.6B) until the backward, where ``k`` and ``v`` alone
are 2: ``standalone`` copies such a view once, and the buffer is freed after the layer's forward.
"""

from __future__ import annotations

import contextlib

import torch

_TRAINING_NUMERICS = False


def standalone(x: torch.Tensor) -> torch.Tensor:
    """``x`` when it spans its whole storage, else a contiguous copy of it (a view into a larger buffer)."""
    if x.untyped_storage().nbytes() <= x.numel() * x.element_size():
        return x
    return x.clone(memory_format=torch.contiguous_format)


def needs_autograd(*tensors: torch.Tensor | None) -> bool:
    """Whether a kernel's call must record its backward: grad mode on and an input that requires grad. Inference
    (generate's decode steps, evaluation) skips the ``autograd.Function`` and what it keeps (its per-call cost is a
    large share of a one-token step). Always true under ``training_numerics``."""
    return _TRAINING_NUMERICS or (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors))


@contextlib.contextmanager
def training_numerics():
    """Kernels take their training path (the ``autograd.Function``'s forward) in no-grad forwards too, so that a
    no-grad forward gives bit for bit what a training forward of the same batch gives. The inference paths round
    differently (a fused norm, another Triton kernel: ~1e-7 relative): for the reference and old log-probs of a DPO /
    GRPO / RLOO step, where TRL's eager forwards give the policy's exact values when policy = reference, that noise
    would give the KL term a gradient, and AdamW's first step moves parameters with noise-sized gradients by the
    whole learning rate. Usable as a decorator."""
    global _TRAINING_NUMERICS
    previous, _TRAINING_NUMERICS = _TRAINING_NUMERICS, True
    try:
        yield
    finally:
        _TRAINING_NUMERICS = previous
