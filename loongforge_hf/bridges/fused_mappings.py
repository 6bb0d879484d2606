"""Fused and special HF <-> megatron mappings: q/k/v and gate/up fused into one megatron tensor, rotary rows
interleaved, and routed experts.

Choices:
- Fused tensors (``QKV``, ``GatedMLP``) are read block by block straight into their place in the fused megatron tensor
  (``get_slice(out=...)``; the block layout comes from ``transforms.py``), so a rank's bytes are copied once, by the
  read; ``export_parts`` gives each rank's blocks of the separate HF tensors.
- ``QKV`` and ``GatedMLP`` share their block reads and writes (``_QKVRows``, ``_GateUpRows``) with the packed
  mappings of ``packed_mappings.py`` (q / k / v or gate / up as row ranges of one HF tensor: Phi-3), differing only in
  where each block's rows start (``_sources``).
- ``RopeColumnParallel`` interleaves rotary rows on load and puts them back in halves on export (a permutation).
- Routed experts: ``Expert`` wraps a per-expert mapping whose names carry ``{expert}``; megatron names use the index
  local to the expert-parallel rank, HF names the global one. Its tensors split over the expert-tensor-parallel group
  (``ShardContext.for_experts``), not the attention's TP group.
- Every name here is also importable from ``mappings`` (its module ``__getattr__``), where ``Mapping`` and the read
  helpers they build on live.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from loongforge_hf.bridges import transforms as T
from loongforge_hf.bridges.mappings import Mapping, _fmt, _read_into


class _QKVRows(Mapping):
    """q, k, v rows fused in megatron's per-KV-group layout; TP splits whole KV groups, or, with more TP ranks than
    KV heads, gives each rank one replica of one KV head (``ShardContext.kv_replicas``: read on every replica, exported
    from the first). Subclasses say where the three come from (``_sources``: an HF tensor and the row q / k / v starts
    at in it) and how ``export`` names them; each defines ``export_parts`` (``_parts``) beside its ``export``."""

    def _sources(self, layer, ctx) -> list[tuple[str, int]]:
        raise NotImplementedError

    @staticmethod
    def _first_rows(ctx, rank: int) -> tuple[int, int, int]:
        """The first row of q, k and v that TP rank ``rank`` holds (a replicated KV head: its HF head's rows)."""
        kv_row = ctx.first_kv_head(rank) * ctx.head_dim
        return rank * (ctx.num_heads // ctx.tp_size) * ctx.head_dim, kv_row, kv_row

    def load(self, reader, ctx, layer):
        heads, groups = ctx.num_heads // ctx.tp_size, ctx.local_kv_heads
        hd = ctx.head_dim
        sources = self._sources(layer, ctx)
        dtypes = {reader.dtype(n) for n, _ in sources}
        if len(dtypes) > 1:
            raise ValueError(f"{[n for n, _ in sources]}: q, k, v must have one dtype, got "
                             f"{sorted(map(str, dtypes))}.")
        # NOTE: each block of q, k and v is read straight into its place in the fused tensor (what fuse_qkv builds,
        # without reading the three slices first and concatenating them).
        out = torch.empty((heads + 2 * groups) * hd, *reader.shape(sources[0][0])[1:], dtype=dtypes.pop())
        first_row = self._first_rows(ctx, ctx.tp_rank)
        for which, src, dst, rows in T.qkv_blocks(num_heads=heads, num_kv_heads=groups, head_dim=hd):
            name, base = sources[which]
            _read_into(reader, name, out[dst:dst + rows], dim=0, start=base + first_row[which] + src)
        return out

    def _split(self, shards, ctx):
        r = ctx.kv_replicas
        q, k, v = T.split_qkv(torch.cat(shards, dim=0), num_heads=ctx.num_heads, num_kv_heads=ctx.num_kv_heads * r,
                              head_dim=ctx.head_dim)
        return q, T.first_replicas(k, replicas=r, head_dim=ctx.head_dim), \
            T.first_replicas(v, replicas=r, head_dim=ctx.head_dim)

    def _parts(self, shard, rank, ctx, layer):
        heads, groups, hd = ctx.num_heads // ctx.tp_size, ctx.local_kv_heads, ctx.head_dim
        if shard.dim() == 0 or shard.shape[0] != (heads + 2 * groups) * hd:
            raise ValueError(f"{self.megatron}: a TP shard must have {(heads + 2 * groups) * hd} rows, got shape "
                             f"{tuple(shard.shape)}.")
        sources, first_row = self._sources(layer, ctx), self._first_rows(ctx, rank)
        # NOTE: a replicated KV head is written once, from its first replica
        keeps_kv = rank % ctx.kv_replicas == 0
        return [(sources[which][0], 0, sources[which][1] + first_row[which] + src, shard[dst:dst + rows])
                for which, src, dst, rows in T.qkv_blocks(num_heads=heads, num_kv_heads=groups, head_dim=hd)
                if which == 0 or keeps_kv]


@dataclass(frozen=True)
class QKV(_QKVRows):
    """q, k, v projections (three HF tensors) fused as megatron's ``linear_qkv``."""

    megatron: str
    q: str
    k: str
    v: str
    tp_split = "column"

    def hf_names(self, layer):
        return [_fmt(self.q, layer), _fmt(self.k, layer), _fmt(self.v, layer)]

    def _sources(self, layer, ctx):
        return [(name, 0) for name in self.hf_names(layer)]

    def export(self, shards, ctx, layer):
        return dict(zip(self.hf_names(layer), self._split(shards, ctx)))

    def export_parts(self, shard, rank, ctx, layer):  # NOTE: beside export (mappings.streams_export)
        return self._parts(shard, rank, ctx, layer)


class _GateUpRows(Mapping):
    """gate and up rows fused as megatron's gated fc1: each TP rank holds ``[gate_r; up_r]``. Subclasses say where the
    two come from (``_sources``: an HF tensor and the row each starts at in it) and how ``export`` names them."""

    def _sources(self, layer, ctx) -> list[tuple[str, int]]:
        raise NotImplementedError

    def _rows(self, reader, layer) -> int:
        raise NotImplementedError

    def load(self, reader, ctx, layer):
        (gate_name, gate_base), (up_name, up_base) = self._sources(layer, ctx)
        full = self._rows(reader, layer)
        start, stop = T.shard_range(full, rank=ctx.tp_rank, world=ctx.tp_size, name=gate_name)
        # NOTE: [gate; up] as fuse_gate_up builds it, each half read straight into its place.
        rows = stop - start
        out = torch.empty(2 * rows, *reader.shape(gate_name)[1:], dtype=reader.dtype(gate_name))
        _read_into(reader, gate_name, out[:rows], dim=0, start=gate_base + start)
        _read_into(reader, up_name, out[rows:], dim=0, start=up_base + start)
        return out

    def _halves(self, shards):
        parts = [T.split_gate_up(s) for s in shards]
        return torch.cat([g for g, _ in parts], dim=0), torch.cat([u for _, u in parts], dim=0)

    def _parts(self, shard, rank, ctx, layer):
        if shard.dim() == 0 or shard.shape[0] % 2:
            raise ValueError(f"{self.megatron}: fc1 must have an even number of rows (gate then up), got shape "
                             f"{tuple(shard.shape)}.")
        half = shard.shape[0] // 2
        (gate_name, gate_base), (up_name, up_base) = self._sources(layer, ctx)
        return [(gate_name, 0, gate_base + rank * half, shard[:half]),
                (up_name, 0, up_base + rank * half, shard[half:])]


@dataclass(frozen=True)
class GatedMLP(_GateUpRows):
    """gate and up projections (two HF tensors) fused as megatron's gated fc1."""

    megatron: str
    gate: str
    up: str
    tp_split = "column"

    def hf_names(self, layer):
        return [_fmt(self.gate, layer), _fmt(self.up, layer)]

    def _sources(self, layer, ctx):
        return [(name, 0) for name in self.hf_names(layer)]

    def _rows(self, reader, layer):
        gate_name, up_name = self.hf_names(layer)
        if reader.dtype(gate_name) != reader.dtype(up_name) or reader.shape(gate_name) != reader.shape(up_name):
            raise ValueError(f"{gate_name} and {up_name}: gate and up must have one shape and dtype, got "
                             f"{reader.shape(gate_name)} {reader.dtype(gate_name)} and {reader.shape(up_name)} "
                             f"{reader.dtype(up_name)}.")
        return reader.shape(gate_name)[0]

    def export(self, shards, ctx, layer):
        return dict(zip(self.hf_names(layer), self._halves(shards)))

    def export_parts(self, shard, rank, ctx, layer):  # NOTE: beside export (mappings.streams_export)
        return self._parts(shard, rank, ctx, layer)


@dataclass(frozen=True)
class RopeColumnParallel(Mapping):
    """A column-parallel weight whose rows are blocks of ``block`` rows ending in ``rope_dim`` rotary rows.

    megatron's multi-latent attention reads rotary dims in interleaved pairs ``(x0, x1), (x2, x3), ...``. A checkpoint
    whose rotary rows are in halves (DeepSeek-V3 with ``rope_interleave=False``) is interleaved on load and put back
    in halves on export (a permutation: the round trip is exact). TP splits whole blocks (heads) when it can; a block
    larger than a TP shard (the single block of ``kv_a_proj_with_mqa``) is read whole, permuted, then sliced.
    """

    megatron: str
    hf: str
    block: int
    rope_dim: int
    tp_split = "column"

    def hf_names(self, layer):
        return [_fmt(self.hf, layer)]

    def load(self, reader, ctx, layer):
        name = _fmt(self.hf, layer)
        rows = reader.shape(name)[0]
        start, stop = T.shard_range(rows, rank=ctx.tp_rank, world=ctx.tp_size, name=name)
        if (stop - start) % self.block == 0:
            part = reader.get_slice(name, dim=0, start=start, stop=stop)
            return T.interleave_rope_rows(part, block=self.block, rope_dim=self.rope_dim)
        return T.interleave_rope_rows(reader.get(name), block=self.block, rope_dim=self.rope_dim)[start:stop].clone()

    def export(self, shards, ctx, layer):
        return {_fmt(self.hf, layer): self.rows_to_hf(torch.cat(shards, dim=0), ctx)}

    def rows_to_megatron(self, rows: torch.Tensor, ctx=None) -> torch.Tensor:
        """A tensor with this HF weight's rows (a LoRA B, a DoRA magnitude) with its rotary rows in pairs."""
        return T.interleave_rope_rows(rows, block=self.block, rope_dim=self.rope_dim)

    def rows_to_hf(self, rows: torch.Tensor, ctx=None) -> torch.Tensor:
        """The inverse of ``rows_to_megatron``."""
        return T.deinterleave_rope_rows(rows, block=self.block, rope_dim=self.rope_dim)


def _with_expert(mapping: Mapping, *, hf_index: int, megatron_index: int) -> Mapping:
    """``mapping`` with ``{expert}`` filled in: the local index in the megatron name, the global one in HF names."""
    values = {}
    for f in fields(mapping):
        value = getattr(mapping, f.name)
        if isinstance(value, str):
            index = megatron_index if f.name == "megatron" else hf_index
            values[f.name] = value.replace("{expert}", str(index))
    return replace(mapping, **values)


@dataclass(frozen=True)
class Expert(Mapping):
    """One routed expert's tensor: ``inner`` names it with ``{expert}`` (and ``{layer}``).

    Expert-parallel rank ``r`` of ``E`` holds experts ``[r * N / E, (r + 1) * N / E)`` as local experts
    ``0 .. N / E - 1``; ``bind`` gives the plain mapping of one of them, whose ``load`` and ``export`` take the
    expert context (``ShardContext.for_experts``).
    """

    inner: Mapping

    @property
    def megatron(self) -> str:  # type: ignore[override]
        return self.inner.megatron

    @property
    def tp_split(self) -> str | None:  # type: ignore[override]
        return self.inner.tp_split

    def bind(self, *, global_expert: int, local_expert: int) -> Mapping:
        return _with_expert(self.inner, hf_index=global_expert, megatron_index=local_expert)

    def hf_names(self, layer):
        raise TypeError("Expert mappings name tensors per expert: bind() first.")

    def load(self, reader, ctx, layer):
        raise TypeError("Expert mappings load per expert: bind() first.")

    def export(self, shards, ctx, layer):
        raise TypeError("Expert mappings export per expert: bind() first.")
