"""One megatron tensor ``[heads, ...]`` from one HF tensor per head (StableLM's per-head q / k LayerNorms:
``q_layernorm.norms.{h}.weight``, one ``nn.LayerNorm`` per head).

Choices:
- ``PerHeadStack`` stacks this TP rank's heads' tensors along a new first dim, the heads split over TP as the q / k /
  v rows are (whole heads per rank: the query heads, or the KV heads for the k norms); export unstacks them, each
  row one whole HF tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loongforge_hf.bridges import transforms as T
from loongforge_hf.bridges.mappings import Mapping, _fmt


@dataclass(frozen=True)
class PerHeadStack(Mapping):
    """``hf`` names head ``{head}``'s tensor (and ``{layer}``), one for each of ``heads`` heads."""

    megatron: str
    hf: str
    heads: int
    tp_split = "column"

    def _name(self, layer, head: int) -> str:
        return _fmt(self.hf.replace("{head}", str(head)), layer)

    def hf_names(self, layer):
        return [self._name(layer, h) for h in range(self.heads)]

    def load(self, reader, ctx, layer):
        start, stop = T.shard_range(self.heads, rank=ctx.tp_rank, world=ctx.tp_size, name=self.megatron)
        return torch.stack([reader.get(self._name(layer, h)) for h in range(start, stop)])

    def export(self, shards, ctx, layer):
        return {self._name(layer, h): row for h, row in enumerate(torch.cat(shards, dim=0).unbind(0))}

    def export_parts(self, shard, rank, ctx, layer):
        return [(self._name(layer, rank * shard.shape[0] + i), 0, 0, row) for i, row in enumerate(shard.unbind(0))]
