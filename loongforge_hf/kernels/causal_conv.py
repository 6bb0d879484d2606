"""The causal depthwise conv of the recurrent mixers (LFM2's short conv; Mamba2's, before its
``silu``), over rows that may pack documents and may continue from a history.

Choices:
- In the weight's dtype, as transformers' ``causal_conv1d_fn`` / ``causal_conv1d_update`` torch paths (the input is
  cast to it; the caller applies any activation and casts back).
- A row continues from ``history`` (its ``kernel - 1`` inputs before the first token: a cached generate's conv
  state, a context-parallel chunk's halo), zeros where None.
- Packed documents (``documents``: ``[b, s]`` non-decreasing ids): no tap reads another document, exactly as running
  each document alone from zeros (the history continues the first token's document). One masked product per tap:
  the kernels are short (LFM2: 3, Mamba2: 4).
- No Triton kernel: one ``F.conv1d`` (or ``kernel`` elementwise products) per layer; autograd differentiates it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv(inputs: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                history: torch.Tensor | None = None, documents: torch.Tensor | None = None) -> torch.Tensor:
    """``inputs`` ``[b, s, ch]``, ``weight`` ``[ch, 1, kernel]``, ``bias`` ``[ch]`` or None, ``history``
    ``[b, ch, kernel - 1]`` or None (zeros), ``documents`` ``[b, s]`` or None (one document a row) ->
    ``[b, s, ch]`` in the weight's dtype: ``out[t] = bias + sum_k weight[k] * in[t - (kernel - 1) + k]``."""
    kernel, seq = weight.shape[-1], inputs.shape[1]
    x = inputs.transpose(1, 2).to(weight.dtype)
    x = F.pad(x, (kernel - 1, 0)) if history is None else torch.cat((history.to(weight.dtype), x), dim=-1)
    if documents is None:
        return F.conv1d(x, weight, bias, groups=weight.shape[0]).transpose(1, 2)
    documents = torch.cat((documents[:, :1].expand(-1, kernel - 1), documents), dim=1)
    out = 0 if bias is None else bias[:, None]
    for lo in range(kernel):  # NOTE: tap ``kernel - 1 - lo`` tokens back, where that token is of the same document
        keep = documents[:, kernel - 1:] == documents[:, lo:lo + seq]
        out = out + weight[:, :, lo] * (x[..., lo:lo + seq] * keep[:, None].to(x.dtype))
    return out.transpose(1, 2)
