"""Which weights' ``main_grad`` (megatron DDP's gradient buffer views) are known to hold zeros, so that a
weight-gradient GEMM may write its result into the buffer instead of adding it (one read and one write of the
gradient less: the FP8 GEMMs cannot accumulate into their output, so their gradients were added afterwards).

Choices:
- ``MegatronEngine`` marks every parameter with a ``main_grad`` right after DDP zeroed the buffers (``mark_zeroed``
  over the list ``with_main_grad`` builds once); nothing else marks, so a buffer zeroed by other code is simply added
  to, as before.
- A writer takes the mark with ``claim`` in its backward, when it is about to write: the first weight-gradient
  written in a step replaces the zeros, every later one (other micro-batches, a weight used twice) adds. Taking it
  at backward time, not at forward time, keeps that right whatever order the backward passes run in.
- A path that adds into ``main_grad`` without claiming (megatron's own linear, taken for an FP8 layer's bf16 calls
  under ``fp8="adaptive"``) drops the mark in its forward (``forget``), which runs before any backward of that call.
- Only the FP8 linear layers claim: their weights (attention and MLP projections) are written by nothing else.
"""

from __future__ import annotations

import torch

_ZEROED = "_loongforge_main_grad_zeroed"


def with_main_grad(modules) -> list[torch.Tensor]:
    """The parameters of ``modules`` that have a ``main_grad`` (once, after DDP wrapped them)."""
    return [p for module in modules for p in module.parameters() if getattr(p, "main_grad", None) is not None]


def mark_zeroed(params: list[torch.Tensor]) -> None:
    """After the gradient buffers were zeroed: every ``main_grad`` of ``params`` (``with_main_grad``) holds zeros."""
    for p in params:
        setattr(p, _ZEROED, True)


def claim(param: torch.Tensor) -> bool:
    """True once after ``mark_zeroed``: the caller then writes ``param.main_grad`` instead of adding to it."""
    if getattr(param, _ZEROED, False):
        setattr(param, _ZEROED, False)
        return True
    return False


def forget(param: torch.Tensor) -> None:
    """``param.main_grad`` is about to be added to by a path that does not claim: the mark, if any, is dropped."""
    claim(param)
