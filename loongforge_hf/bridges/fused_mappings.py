"""Fused and special HF <-> megatron mappings: q/k/v and gate/up fused into one megatron tensor, rotary rows
interleaved, and routed experts.

Choices:
- Fused tensors (``QKV``, ``GatedMLP``) are read block by block straight into their place in the fused megatron tensor
  (``get_slice(out=...)``; the block layout comes from ``transforms.py``), so a rank's bytes are copied once, by the
  read; ``export_parts`` gives each rank's blocks of the separate HF tensors.
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


@dataclass(frozen=True)
class QKV(Mapping):
    """q, k, v projections fused in megatron's per-KV-group layout; TP splits whole KV groups."""

    megatron: str
    q: str
    k: str
    v: str
    tp_split = "column"

    def hf_names(self, layer):
        return [_fmt(self.q, layer), _fmt(self.k, layer), _fmt(self.v, layer)]

    def load(self, reader, ctx, layer):
        heads, groups = ctx.num_heads // ctx.tp_size, ctx.num_kv_heads // ctx.tp_size
        hd = ctx.head_dim
        q_name, k_name, v_name = self.hf_names(layer)
        q0 = ctx.tp_rank * heads * hd
        k0 = ctx.tp_rank * groups * hd
        dtypes = {reader.dtype(n) for n in (q_name, k_name, v_name)}
        if len(dtypes) > 1:
            raise ValueError(f"{q_name}, {k_name}, {v_name}: q, k, v must have one dtype, got "
                             f"{sorted(map(str, dtypes))}.")
        # NOTE: each block of q, k and v is read straight into its place in the fused tensor (what fuse_qkv builds,
        # without reading the three slices first and concatenating them).
        out = torch.empty((heads + 2 * groups) * hd, *reader.shape(q_name)[1:], dtype=dtypes.pop())
        first_row = (q0, k0, k0)
        for which, src, dst, rows in T.qkv_blocks(num_heads=heads, num_kv_heads=groups, head_dim=hd):
            _read_into(reader, (q_name, k_name, v_name)[which], out[dst:dst + rows], dim=0,
                       start=first_row[which] + src)
        return out

    def export(self, shards, ctx, layer):
        q, k, v = T.split_qkv(torch.cat(shards, dim=0), num_heads=ctx.num_heads, num_kv_heads=ctx.num_kv_heads,
                              head_dim=ctx.head_dim)
        q_name, k_name, v_name = self.hf_names(layer)
        return {q_name: q, k_name: k, v_name: v}

    def export_parts(self, shard, rank, ctx, layer):
        heads, groups, hd = ctx.num_heads // ctx.tp_size, ctx.num_kv_heads // ctx.tp_size, ctx.head_dim
        if shard.dim() == 0 or shard.shape[0] != (heads + 2 * groups) * hd:
            raise ValueError(f"{self.megatron}: a TP shard must have {(heads + 2 * groups) * hd} rows, got shape "
                             f"{tuple(shard.shape)}.")
        names, first_row = self.hf_names(layer), (rank * heads * hd, rank * groups * hd, rank * groups * hd)
        return [(names[which], 0, first_row[which] + src, shard[dst:dst + rows])
                for which, src, dst, rows in T.qkv_blocks(num_heads=heads, num_kv_heads=groups, head_dim=hd)]


@dataclass(frozen=True)
class GatedMLP(Mapping):
    """gate and up projections fused as megatron's gated fc1: each TP rank holds [gate_r; up_r]."""

    megatron: str
    gate: str
    up: str
    tp_split = "column"

    def hf_names(self, layer):
        return [_fmt(self.gate, layer), _fmt(self.up, layer)]

    def load(self, reader, ctx, layer):
        gate_name, up_name = self.hf_names(layer)
        start, stop = T.shard_range(reader.shape(gate_name)[0], rank=ctx.tp_rank, world=ctx.tp_size,
                                    name=gate_name)
        if reader.dtype(gate_name) != reader.dtype(up_name) or reader.shape(gate_name) != reader.shape(up_name):
            raise ValueError(f"{gate_name} and {up_name}: gate and up must have one shape and dtype, got "
                             f"{reader.shape(gate_name)} {reader.dtype(gate_name)} and {reader.shape(up_name)} "
                             f"{reader.dtype(up_name)}.")
        # NOTE: [gate; up] as fuse_gate_up builds it, each half read straight into its place.
        rows = stop - start
        out = torch.empty(2 * rows, *reader.shape(gate_name)[1:], dtype=reader.dtype(gate_name))
        _read_into(reader, gate_name, out[:rows], dim=0, start=start)
        _read_into(reader, up_name, out[rows:], dim=0, start=start)
        return out

    def export(self, shards, ctx, layer):
        parts = [T.split_gate_up(s) for s in shards]
        gate_name, up_name = self.hf_names(layer)
        return {gate_name: torch.cat([g for g, _ in parts], dim=0), up_name: torch.cat([u for _, u in parts], dim=0)}

    def export_parts(self, shard, rank, ctx, layer):
        if shard.dim() == 0 or shard.shape[0] % 2:
            raise ValueError(f"{self.megatron}: fc1 must have an even number of rows (gate then up), got shape "
                             f"{tuple(shard.shape)}.")
        half = shard.shape[0] // 2
        gate_name, up_name = self.hf_names(layer)
        return [(gate_name, 0, rank * half, shard[:half]), (up_name, 0, rank * half, shard[half:])]


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
        full = torch.cat(shards, dim=0)
        return {_fmt(self.hf, layer): T.deinterleave_rope_rows(full, block=self.block, rope_dim=self.rope_dim)}


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
