"""generate's KV cache layer for DeepSeek Sparse Attention (``sparse_attention.SparseAttention``'s
``kv_cache_layer``): transformers' ``DynamicLayer`` of a layer's MLA keys and values plus its indexer's keys, grown,
reordered and emptied together (``kv_cache.own_cached_attention``)."""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer


class SparseAttentionCacheLayer(DynamicLayer):
    """transformers' ``DynamicLayer`` (the layer's MLA keys and values, ``[b, heads / TP, slots, d]``) plus its
    indexer's keys ``index_keys`` ``[b, slots, index_head_dim]`` (whole on every TP rank; None on a shared layer),
    grown, reordered and emptied with them."""

    def __init__(self) -> None:
        super().__init__()
        self.index_keys: torch.Tensor | None = None

    def update_index_keys(self, keys: torch.Tensor) -> torch.Tensor:
        self.index_keys = keys if self.index_keys is None else torch.cat([self.index_keys, keys], dim=1)
        return self.index_keys

    def reset(self) -> None:
        super().reset()
        self.index_keys = None

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)
        if tokens_to_remove < 0 and self.index_keys is not None:
            self.index_keys = self.index_keys[:, :tokens_to_remove]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        if self.index_keys is not None:
            self.index_keys = self.index_keys.index_select(0, beam_idx.to(self.index_keys.device))

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        if self.index_keys is not None:
            self.index_keys = self.index_keys.repeat_interleave(repeats, dim=0)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        if self.index_keys is not None:
            self.index_keys = self.index_keys[indices, ...]
