"""Mamba-1's selective scan (``state = exp(dt * A) * state + dt * B * x``, ``y = state . C + D * x``, times
``silu(z)``) in torch, op for op transformers' sequential path (``mamba_selective_scan`` /
``mamba_selective_state_update``), over rows that may pack documents and may continue from a state.

Choices:
- Sequential over the tokens (one step per token, as transformers' torch path on CPU): exact against it in fp32;
  the discretised ``exp(dt * A)`` and ``dt * B * x`` for the whole sequence first (``[b, d, s, N]``, fp32), the
  state in fp32, each output ``state . C`` in the inputs' dtype. No chunked / parallel form and no Triton kernel:
  correct first; long sequences pay a Python step a token.
- Packed documents (``documents``: ``[b, s]`` non-decreasing ids): the state restarts (decay 0) at each document's
  first token, exactly as running each document alone from zeros; ``initial_state`` continues the first document.
- Autograd differentiates the loop.
"""

from __future__ import annotations

import torch


def selective_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   D: torch.Tensor, z: torch.Tensor, *, documents: torch.Tensor | None = None,
                   initial_state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``x``, ``z`` ``[b, d, s]``; ``dt`` ``[b, d, s]`` after softplus (fp32); ``A`` ``[d, N]`` (``-exp(A_log)``);
    ``B``, ``C`` ``[b, s, N]``; ``D`` ``[d]``; ``documents`` ``[b, s]`` or None; ``initial_state`` ``[b, d, N]`` or
    None (zeros) -> ``y`` ``[b, d, s]`` (fp32: transformers' output before ``out_proj``), the final state
    ``[b, d, N]`` (fp32)."""
    batch, d, seq = x.shape
    dtype = x.dtype
    decay = torch.exp(A[None, :, None, :] * dt[:, :, :, None])              # [b, d, s, N]
    if documents is not None:  # NOTE: no decay into a document's first token: its state starts from zero
        first = torch.cat((torch.zeros_like(documents[:, :1], dtype=torch.bool), documents[:, 1:] != documents[:, :-1]),
                          dim=1)
        decay = decay * (~first)[:, None, :, None].to(decay.dtype)
    inputs = dt[:, :, :, None] * B[:, None, :, :].float() * x[:, :, :, None].float()
    state = torch.zeros(batch, d, A.shape[-1], dtype=torch.float32, device=x.device) if initial_state is None \
        else initial_state.float()
    outputs = []
    for t in range(seq):
        state = decay[:, :, t] * state + inputs[:, :, t]
        outputs.append(torch.matmul(state.to(dtype), C[:, t, :, None].to(dtype))[..., 0])
    y = torch.stack(outputs, dim=-1) + x * D[None, :, None].float()
    return y * torch.nn.functional.silu(z), state
