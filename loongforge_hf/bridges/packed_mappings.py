"""megatron's fused ``linear_qkv`` / gated ``linear_fc1`` from a checkpoint that packs q / k / v (gate / up) as row
ranges of one HF tensor (Phi-3's ``qkv_proj``, ``gate_up_proj``).

Choices:
- The block reads and writes are ``QKV``'s and ``GatedMLP``'s (``fused_mappings``), with each block's rows starting
  inside the one HF tensor (``_sources``); export writes the one tensor again.
- ``rows_to_megatron`` / ``rows_to_hf`` permute any tensor with the HF weight's rows (a LoRA B, a DoRA magnitude) as
  the weight's rows are permuted: TP rank after TP rank, each rank's rows in megatron's order
  (``lora.plan.Target.b_to_megatron``).
- ``GroupedQKV``: one HF tensor already in megatron's per-KV-group layout (Falcon's ``query_key_value``, GPTBigCode's
  ``c_attn``): a plain column-parallel split while each TP rank holds whole groups; with more TP ranks than KV heads,
  each rank reads its query heads and its KV head's k / v rows (``ShardContext.kv_replicas``), and a head's k / v are
  exported from its first replica.
- ``ShardInterleavedQKV``: CodeGen's ``qkv_proj``, q / v / k interleaved by the four model-parallel shards it was
  trained with: per head, three blocks of ``head_dim`` rows read into megatron's ``[q, k, v]`` and written back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loongforge_hf.bridges import transforms as T
from loongforge_hf.bridges.fused_mappings import _GateUpRows, _QKVRows
from loongforge_hf.bridges.mappings import Mapping, _fmt, _read_into


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
        rank's rows contiguous (a replicated KV head's rows on each of its replicas)."""
        q_rows, kv_rows, r, hd = ctx.num_heads * ctx.head_dim, ctx.num_kv_heads * ctx.head_dim, ctx.kv_replicas, \
            ctx.head_dim
        q, k, v = rows.split([q_rows, kv_rows, kv_rows])
        k, v = (T.replicate_heads(t, replicas=r, head_dim=hd) for t in (k, v))
        return T.fuse_qkv(q, k, v, num_heads=ctx.num_heads, num_kv_heads=ctx.num_kv_heads * r, head_dim=hd)

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


@dataclass(frozen=True)
class GroupedQKV(Mapping):
    """One HF tensor holding q / k / v in megatron's ``linear_qkv`` layout (per KV group: its query heads, its key,
    its value), weight or bias, as megatron's ``linear_qkv``."""

    megatron: str
    hf: str
    tp_split = "column"

    def hf_names(self, layer):
        return [_fmt(self.hf, layer)]

    def _blocks(self, ctx, rank: int) -> list[tuple[int, int, int]]:
        """(row in the HF tensor, row in rank ``rank``'s shard, rows) of each block that rank holds."""
        hd, r = ctx.head_dim, ctx.kv_replicas
        per_group, heads = ctx.num_heads // ctx.num_kv_heads, ctx.num_heads // ctx.tp_size
        group = ctx.first_kv_head(rank)
        base = group * (per_group + 2) * hd
        if r == 1:  # NOTE: whole groups, one contiguous block
            rows = ctx.local_kv_heads * (per_group + 2) * hd
            return [(base, 0, rows)]
        q_start = base + (rank % r) * heads * hd  # NOTE: this replica's share of its group's query heads
        return [(q_start, 0, heads * hd), (base + per_group * hd, heads * hd, 2 * hd)]

    def load(self, reader, ctx, layer):
        name = _fmt(self.hf, layer)
        blocks = self._blocks(ctx, ctx.tp_rank)
        out = torch.empty(sum(rows for _, _, rows in blocks), *reader.shape(name)[1:], dtype=reader.dtype(name))
        for src, dst, rows in blocks:
            _read_into(reader, name, out[dst:dst + rows], dim=0, start=src)
        return out

    def export(self, shards, ctx, layer):
        return {_fmt(self.hf, layer): self._whole(shards, ctx, layer)}

    def _whole(self, shards, ctx, layer: int = 0) -> torch.Tensor:
        """The HF tensor from the TP ranks' shards (each replicated KV head from its first replica)."""
        rows = (ctx.num_heads + 2 * ctx.num_kv_heads) * ctx.head_dim
        full = torch.empty(rows, *shards[0].shape[1:], dtype=shards[0].dtype)
        for rank, shard in enumerate(shards):
            for _, _, start, block in self.export_parts(shard, rank, ctx, layer):
                full[start:start + block.shape[0]] = block
        return full

    def export_parts(self, shard, rank, ctx, layer):
        blocks = self._blocks(ctx, rank)
        if shard.dim() == 0 or shard.shape[0] != sum(rows for _, _, rows in blocks):
            raise ValueError(f"{self.megatron}: a TP shard must have {sum(rows for _, _, rows in blocks)} rows, got "
                             f"shape {tuple(shard.shape)}.")
        if rank % ctx.kv_replicas:  # NOTE: a replicated KV head is written once, from its first replica
            blocks = blocks[:1]
        return [(_fmt(self.hf, layer), 0, src, shard[dst:dst + rows]) for src, dst, rows in blocks]

    def rows_to_megatron(self, rows: torch.Tensor, ctx) -> torch.Tensor:
        """A tensor with this HF tensor's rows (a LoRA B, a DoRA magnitude) in the order the TP ranks' shards hold
        them, concatenated (a replicated KV head's rows on each of its replicas; the HF order without replicas)."""
        return torch.cat([rows[src:src + n] for rank in range(ctx.tp_size) for src, _, n in self._blocks(ctx, rank)])

    def rows_to_hf(self, rows: torch.Tensor, ctx) -> torch.Tensor:
        """The inverse of ``rows_to_megatron`` (each replicated KV head's rows from its first replica)."""
        sizes = [sum(n for _, _, n in self._blocks(ctx, rank)) for rank in range(ctx.tp_size)]
        return self._whole(list(rows.split(sizes)), ctx)


@dataclass(frozen=True)
class ShardInterleavedQKV(GroupedQKV):
    """CodeGen's ``qkv_proj``: ``mp_num`` blocks of rows (the model-parallel shards it was trained with), each ``[q;
    v; k]`` of its ``heads / mp_num`` heads, as megatron's ``linear_qkv`` (a query group per head: ``[q, k, v]`` head
    by head); each TP rank reads its heads' q / k / v rows, weight or bias, and writes them back in place."""

    mp_num: int = 4

    def _blocks(self, ctx, rank: int) -> list[tuple[int, int, int]]:
        hd, heads = ctx.head_dim, ctx.num_heads // ctx.tp_size
        per_shard = ctx.num_heads // self.mp_num
        local = per_shard * hd  # NOTE: one of q / v / k of a shard
        blocks = []
        for i, head in enumerate(range(rank * heads, (rank + 1) * heads)):
            base = (head // per_shard) * 3 * local + (head % per_shard) * hd
            blocks += [(base + part * local, (3 * i + slot) * hd, hd) for slot, part in enumerate((0, 2, 1))]
        return blocks

    def export_parts(self, shard, rank, ctx, layer):
        blocks = self._blocks(ctx, rank)
        if shard.dim() == 0 or shard.shape[0] != sum(rows for _, _, rows in blocks):
            raise ValueError(f"{self.megatron}: a TP shard must have {sum(rows for _, _, rows in blocks)} rows, got "
                             f"shape {tuple(shard.shape)}.")
        return [(_fmt(self.hf, layer), 0, src, shard[dst:dst + rows]) for src, dst, rows in blocks]
