"""Dynamic-mask attention (Doge's ``DogeAttention``): a bias per KV head and key, computed by the caller from the
values, added to the scaled scores; where there are more keys than ``keep_window``, each query row keeps only the
``keep_window`` keys of largest (masked) bias.

Choices:
- Materialised scores (``attention._materialised``: transformers' eager math, softmax in fp32): no fused kernel takes
  a bias per key with a top-k mask per row. Memory is ``[b, heads, sq, skv]`` per layer, as transformers' eager and
  SDPA paths (which also materialise the float mask).
- The mask is built as transformers' ``prepare_dynamic_mask``: the bias where the key is allowed (causal, padding,
  documents), the dtype's smallest finite value where not; past ``keep_window`` keys, ``torch.topk`` of each row
  (masked keys included, with that smallest value) and the others set to the smallest value too. A row with no
  allowed key (a padded query) thus keeps transformers' result, a uniform average over all values, not zeros.
- Ties in the top-k (equal biases: a head with ``A = 0``) are broken by ``torch.topk`` alone, as in transformers; a
  tie that the kept window cuts through may pick other keys under another layout (not exact there).
"""

from __future__ import annotations

import torch

from loongforge_hf.kernels.attention import _materialised, _ScoreRule

_PLAIN = _ScoreRule(softcap=None, sinks=None)


def dynamic_mask_bias(bias: torch.Tensor, *, allowed: torch.Tensor, keep_window: int) -> torch.Tensor:
    """``bias [b, h_kv, skv]`` and ``allowed`` (bool, True = may attend, broadcast to ``[b, 1, sq, skv]``) ->
    the float mask ``[b, h_kv, sq, skv]`` added to the scores (module docstring)."""
    smallest = torch.finfo(bias.dtype).min
    mask = bias[:, :, None, :].expand(-1, -1, allowed.shape[-2], -1).masked_fill(~allowed, smallest)
    if mask.shape[-1] > keep_window:
        top = torch.topk(mask, keep_window, dim=-1, largest=True, sorted=False).indices
        kept = torch.zeros(mask.shape, dtype=torch.bool, device=mask.device).scatter(-1, top, True)
        mask = mask.masked_fill(~kept, smallest)
    return mask


def dynamic_mask_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bias: torch.Tensor, *,
                           allowed: torch.Tensor, scale: float, keep_window: int,
                           dropout_p: float = 0.0) -> torch.Tensor:
    """``query [b, h, sq, d]`` over ``key / value [b, h_kv, skv, d]`` with the per-key ``bias [b, h_kv, skv]`` under
    ``allowed`` (bool, True = may attend, broadcast to ``[b, 1, sq, skv]``) -> ``[b, h, sq, d_v]``."""
    mask = dynamic_mask_bias(bias, allowed=allowed, keep_window=keep_window)
    groups = query.shape[1] // key.shape[1]
    if groups > 1:  # NOTE: query head i reads KV head i // groups (transformers' repeat_kv)
        mask = mask.repeat_interleave(groups, dim=1)
    return _materialised(query, key, value, mask, scale=scale, rule=_PLAIN, dropout_p=dropout_p)
