"""megatron's fused ``linear_qkv`` / gated ``linear_fc1`` from a checkpoint that packs q / k / v (gate / up) as row
ranges of one HF tensor (Phi-3's ``qkv_proj``, ``gate_up_proj``).

Choices:
- The block reads and writes are ``QKV``'s and ``GatedMLP``'s (``fused_mappings``), with each block's rows starting
  inside the one HF tensor (``_sources``); export writes the one tensor again.
- ``rows_to_megatron`` / ``rows_to_hf`` permute any tensor with the HF weight's rows (a LoRA B, a DoRA magnitude) as
  the weight's rows are permuted: TP rank after TP rank, each rank's rows in megatron's order
  (``lora.plan.Target.b_to_megatron``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loongforge_hf.bridges import transforms as T
from loongforge_hf.bridges.fused_mappings import _GateUpRows, _QKVRows
from loongforge_hf.bridges.mappings import _fmt


@dataclass(frozen=True)
class PackedQKV(_QKVRows):
    """One HF tensor holding q, k, v as rows ``[q; k; v]`` (Phi-3's ``qkv_proj``) as megatron's ``linear_qkv``."""

    megatron: str
    hf: str
    tp_split = "column"

    def hf_names(self, layer):
        return [_fmt(self.hf, layer)]

    def _sources(self, layer, ctx):
        q_rows, kv_rows = ctx.num_heads * ctx.head_dim, ctx.num_kv_heads * ctx.head_dim
        name = _fmt(self.hf, layer)
        return [(name, 0), (name, q_rows), (name, q_rows + kv_rows)]

    def export(self, shards, ctx, layer):
        return {_fmt(self.hf, layer): torch.cat(self._split(shards, ctx), dim=0)}

    def export_parts(self, shard, rank, ctx, layer):  # NOTE: beside export (mappings.streams_export)
        return self._parts(shard, rank, ctx, layer)

    def rows_to_megatron(self, rows: torch.Tensor, ctx) -> torch.Tensor:
        """A tensor with this HF weight's rows (a LoRA B, a DoRA magnitude) in ``linear_qkv``'s row order, each TP
        rank's rows contiguous."""
        q_rows, kv_rows = ctx.num_heads * ctx.head_dim, ctx.num_kv_heads * ctx.head_dim
        q, k, v = rows.split([q_rows, kv_rows, kv_rows])
        return T.fuse_qkv(q, k, v, num_heads=ctx.num_heads, num_kv_heads=ctx.num_kv_heads, head_dim=ctx.head_dim)

    def rows_to_hf(self, rows: torch.Tensor, ctx) -> torch.Tensor:
        """The inverse of ``rows_to_megatron`` (the TP ranks' rows concatenated in rank order)."""
        return torch.cat(self._split([rows], ctx), dim=0)


@dataclass(frozen=True)
class PackedGatedMLP(_GateUpRows):
    """One HF tensor holding gate and up as rows ``[gate; up]`` (Phi-3's ``gate_up_proj``) as megatron's fc1."""

    megatron: str
    hf: str
    intermediate_size: int
    tp_split = "column"

    def hf_names(self, layer):
        return [_fmt(self.hf, layer)]

    def _sources(self, layer, ctx):
        name = _fmt(self.hf, layer)
        return [(name, 0), (name, self.intermediate_size)]

    def _rows(self, reader, layer):
        name = _fmt(self.hf, layer)
        if reader.shape(name)[0] != 2 * self.intermediate_size:
            raise ValueError(f"{name}: expected 2 x intermediate_size = {2 * self.intermediate_size} rows (gate then "
                             f"up), got shape {tuple(reader.shape(name))}.")
        return self.intermediate_size

    def export(self, shards, ctx, layer):
        return {_fmt(self.hf, layer): torch.cat(self._halves(shards), dim=0)}

    def export_parts(self, shard, rank, ctx, layer):  # NOTE: beside export (mappings.streams_export)
        return self._parts(shard, rank, ctx, layer)

    def rows_to_megatron(self, rows: torch.Tensor, ctx) -> torch.Tensor:
        """A tensor with this HF weight's rows in the order the TP ranks' fc1 shards hold them, concatenated:
        ``[gate_0; up_0; gate_1; up_1; ...]``."""
        gate, up = rows.split(self.intermediate_size)
        return torch.cat([T.fuse_gate_up(g, u) for g, u in zip(gate.chunk(ctx.tp_size), up.chunk(ctx.tp_size))])

    def rows_to_hf(self, rows: torch.Tensor, ctx) -> torch.Tensor:
        """The inverse of ``rows_to_megatron``."""
        return torch.cat(self._halves(list(rows.chunk(ctx.tp_size))), dim=0)
