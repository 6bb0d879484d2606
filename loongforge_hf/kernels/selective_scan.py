"""Mamba-1's selective scan (``state = exp(dt * A) * state + dt * B * x``, ``y = state . C + D * x``, times
``silu(z)``) in torch: transformers' sequential path (``mamba_selective_scan`` / ``mamba_selective_state_update``)
as a parallel scan, over rows that may pack documents and may continue from a state.

Choices:
- The discretised ``exp(dt * A)`` and ``dt * B * x`` for the whole sequence first (``[b, d, s, N]``, fp32, as
  transformers'), every state by ``kernels.linear_scan`` (``O(log s)`` tensor steps, its backward by hand; within
  fp32 rounding of the token-by-token loop), the outputs ``state . C`` in the inputs' dtype. No fused kernel: the
  ``[b, d, s, N]`` fp32 states are kept for the backward.
- Packed documents (``documents``: ``[b, s]`` non-decreasing ids): the state restarts (decay 0) at each document's
  first token, exactly as running each document alone from zeros; ``initial_state`` continues document 0 (a first
  token of another id restarts too: a context-parallel chunk starting a document).
- ``scan``: ``kernels.linear_scan`` or a stand-in of its signature (``parallel/linear_scan_cp.py``: the states
  passed between context-parallel chunks).
"""

from __future__ import annotations

import torch

from loongforge_hf.kernels.linear_scan import linear_scan


def selective_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   D: torch.Tensor, z: torch.Tensor, *, documents: torch.Tensor | None = None,
                   initial_state: torch.Tensor | None = None, scan=linear_scan) -> tuple[torch.Tensor, torch.Tensor]:
    """``x``, ``z`` ``[b, d, s]``; ``dt`` ``[b, d, s]`` after softplus (fp32); ``A`` ``[d, N]`` (``-exp(A_log)``);
    ``B``, ``C`` ``[b, s, N]``; ``D`` ``[d]``; ``documents`` ``[b, s]`` or None; ``initial_state`` ``[b, d, N]`` or
    None (zeros) -> ``y`` ``[b, d, s]`` (fp32: transformers' output before ``out_proj``), the final state
    ``[b, d, N]`` (fp32)."""
    dtype = x.dtype
    decay = torch.exp(A[None, :, None, :] * dt[:, :, :, None])              # [b, d, s, N]
    if documents is not None:  # NOTE: no decay into a document's first token: its state starts from zero
        first = documents != torch.nn.functional.pad(documents[:, :-1], (1, 0))  # NOTE: id 0 before the row
        decay = decay * (~first)[:, None, :, None].to(decay.dtype)
    inputs = dt[:, :, :, None] * B[:, None, :, :].float() * x[:, :, :, None].float()
    states = scan(decay, inputs, initial=initial_state, dim=2)  # NOTE: [b, d, s, N] fp32
    del decay, inputs  # NOTE: the scan keeps what its backward needs; the peak is the states' copies below
    outputs = torch.einsum("bdsn,bsn->bds", states.to(dtype), C.to(dtype))
    y = outputs + x * D[None, :, None].float()
    return y * torch.nn.functional.silu(z), states[:, :, -1]
