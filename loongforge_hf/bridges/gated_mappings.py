"""Mappings of Qwen3.5 / Qwen3-Next's attention tensors: the full-attention layers' q projection with its output gate,
and the linear-attention layers' projections and conv split by heads.

Choices:
- ``GatedQKV``: transformers' ``q_proj`` gives each head ``2 * head_dim`` rows, its query then its output gate
  (``[heads, 2, head_dim]``); megatron's ``linear_qkv`` with ``attention_output_gate`` holds per KV group its queries,
  then their gates, then the group's key and value (``[groups, (2 * heads / groups + 2) * head_dim]``). TP splits whole
  KV groups, as ``QKV``. Each rank's shard is assembled from its heads' rows in memory. With ``gate`` the gates are
  a tensor of their own (AFMoE's ``gate_proj``, ``[heads * head_dim]`` rows beside ``q_proj``'s): the same shard.
  ``rows_to_megatron`` / ``rows_to_hf`` move ``q_proj``'s rows (a LoRA B) to the group's queries-then-gates order.
- ``HeadSections``: one megatron column-parallel tensor made of row sections of one or more HF tensors, each section
  split evenly over TP and a rank's pieces concatenated in order (the linear-attention ``in_proj``: q, k, v of
  ``in_proj_qkv``, then ``in_proj_z``, ``in_proj_b``, ``in_proj_a``; the conv's q, k, v channels). The caller checks
  that every section divides by the TP size (whole heads per rank). A section given as ``(size, units)`` of fewer
  units (groups) than TP ranks is replicated instead, each unit on ``tp / units`` consecutive ranks, exported from
  its first (Mamba2's B / C of one group at TP 2: ``parallel/kv_replicas.py``). ``rows_to_megatron`` /
  ``rows_to_hf`` move a tensor with the rows of one part's HF tensor (``part``; a LoRA B, a DoRA magnitude: Mamba2's
  and LFM2's ``in_proj``, each Gated DeltaNet in-projection) to megatron's row order, TP rank after TP rank, and
  back; ``rank_rows`` gives each part's rows per rank (the slots of a fused LoRA output); ``replicates`` says whether a
  section is replicated at a TP size (no one such order).
- ``KeyHeadGroups``: the same megatron tensor from HF tensors whose rows run key head by key head, each head's
  group holding its sections in turn (Qwen3-Next's ``in_proj_qkvz``: per key head its q, k, then the v and z rows of
  the value heads it serves; ``in_proj_ba``: their b, then their a). A rank reads its key heads' rows in one block
  and regroups them section by section, so both layouts give megatron the same ``in_proj`` (a LoRA B's rows too:
  ``rows_to_megatron`` / ``rows_to_hf``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loongforge_hf.bridges.mappings import Mapping, _fmt


def _rows(reader, name: str, start: int, stop: int) -> torch.Tensor:
    return reader.get_slice(name, dim=0, start=start, stop=stop)


@dataclass(frozen=True)
class GatedQKV(Mapping):
    """``q_proj`` (queries and gates per head, or queries alone and the gates in ``gate``), ``k_proj``, ``v_proj``
    -> megatron's gated ``linear_qkv``."""

    megatron: str
    q: str
    k: str
    v: str
    gate: str | None = None
    tp_split = "column"

    def hf_names(self, layer):
        names = [_fmt(self.q, layer), _fmt(self.k, layer), _fmt(self.v, layer)]
        return names + ([_fmt(self.gate, layer)] if self.gate else [])

    def rows_to_megatron(self, rows: torch.Tensor, ctx, part: int = 0) -> torch.Tensor:
        """A tensor with the rows of ``q_proj`` (``part`` 0; ``k_proj`` / ``v_proj`` as they are) in megatron's row
        order: per KV group its heads' queries, then their gates (TP splits whole groups); with ``gate`` (the gates
        a tensor of their own) every part's rows are in order already."""
        if part or self.gate:
            return rows
        groups, hd, rest = ctx.num_kv_heads, ctx.head_dim, rows.shape[1:]
        return rows.reshape(groups, -1, 2, hd, *rest).transpose(1, 2).reshape(-1, *rest)

    def rows_to_hf(self, rows: torch.Tensor, ctx, part: int = 0) -> torch.Tensor:
        """The inverse of ``rows_to_megatron``."""
        if part or self.gate:
            return rows
        groups, hd, rest = ctx.num_kv_heads, ctx.head_dim, rows.shape[1:]
        return rows.reshape(groups, 2, -1, hd, *rest).transpose(1, 2).reshape(-1, *rest)

    def _queries_and_gates(self, reader, layer, rank: int, heads: int, hd: int) -> torch.Tensor:
        """This rank's heads' rows, each head's query then its gate."""
        if self.gate is None:
            return _rows(reader, _fmt(self.q, layer), rank * heads * 2 * hd, (rank + 1) * heads * 2 * hd)
        q, g = (_rows(reader, _fmt(name, layer), rank * heads * hd, (rank + 1) * heads * hd)
                for name in (self.q, self.gate))
        width = q.shape[1:]
        return torch.stack([q.reshape(heads, hd, *width), g.reshape(heads, hd, *width)], dim=1).reshape(-1, *width)

    def load(self, reader, ctx, layer):
        k_name, v_name = self.hf_names(layer)[1:3]
        heads, groups, hd = ctx.num_heads // ctx.tp_size, ctx.num_kv_heads // ctx.tp_size, ctx.head_dim
        r = ctx.tp_rank
        qg = self._queries_and_gates(reader, layer, r, heads, hd)
        k = _rows(reader, k_name, r * groups * hd, (r + 1) * groups * hd)
        v = _rows(reader, v_name, r * groups * hd, (r + 1) * groups * hd)
        width = qg.shape[1:]
        qg = qg.reshape(groups, heads // groups, 2, hd, *width)
        fused = torch.cat([qg[:, :, 0].reshape(groups, -1, *width), qg[:, :, 1].reshape(groups, -1, *width),
                           k.reshape(groups, hd, *width), v.reshape(groups, hd, *width)], dim=1)
        return fused.reshape(-1, *width).contiguous()

    def export(self, shards, ctx, layer):
        heads, groups, hd = ctx.num_heads // ctx.tp_size, ctx.num_kv_heads // ctx.tp_size, ctx.head_dim
        per = heads // groups
        qs, ks, vs = [], [], []
        for shard in shards:
            width = shard.shape[1:]
            grouped = shard.reshape(groups, (2 * per + 2) * hd, *width)
            q, gate, k, v = torch.split(grouped, [per * hd, per * hd, hd, hd], dim=1)
            qg = torch.stack([q.reshape(groups, per, hd, *width), gate.reshape(groups, per, hd, *width)], dim=2)
            qs.append(qg.reshape(-1, *width))
            ks.append(k.reshape(-1, *width))
            vs.append(v.reshape(-1, *width))
        names = self.hf_names(layer)
        out = {names[1]: torch.cat(ks).contiguous(), names[2]: torch.cat(vs).contiguous()}
        qg = torch.cat(qs)
        if self.gate is None:
            return {names[0]: qg.contiguous(), **out}
        qg = qg.reshape(-1, 2, hd, *qg.shape[1:])
        return {names[0]: qg[:, 0].reshape(-1, *qg.shape[3:]).contiguous(), **out,
                names[3]: qg[:, 1].reshape(-1, *qg.shape[3:]).contiguous()}


@dataclass(frozen=True)
class HeadSections(Mapping):
    """A column-parallel tensor of ``parts``: ``(HF name pattern, section sizes along its rows)`` in order; a size
    or ``(size, units)``, replicated where the units are fewer than the TP ranks."""

    megatron: str
    parts: tuple[tuple[str, tuple[int | tuple[int, int], ...]], ...]
    tp_split = "column"

    def hf_names(self, layer):
        return [_fmt(name, layer) for name, _ in self.parts]

    def _pieces(self, layer, tp_size: int):
        """(HF name, first row of the section, rows per rank, ranks holding each block) for each section, in
        megatron's order."""
        for name, sections in self.parts:
            start = 0
            for section in sections:
                size, units = section if isinstance(section, tuple) else (section, tp_size)
                replicas = max(1, tp_size // units)
                yield _fmt(name, layer), start, size * replicas // tp_size, replicas
                start += size

    def load(self, reader, ctx, layer):
        return torch.cat([_rows(reader, name, start + ctx.tp_rank // r * per, start + (ctx.tp_rank // r + 1) * per)
                          for name, start, per, r in self._pieces(layer, ctx.tp_size)], dim=0)

    def export(self, shards, ctx, layer):
        pieces = list(self._pieces(layer, ctx.tp_size))
        split = [torch.split(shard, [per for _, _, per, _ in pieces], dim=0) for shard in shards]
        out: dict[str, list[torch.Tensor]] = {name: [] for name in self.hf_names(layer)}
        for i, (name, _, _, r) in enumerate(pieces):
            # NOTE: a section's rank blocks in rank order, a replicated block from its first rank
            out[name] += [rank_pieces[i] for rank_pieces in split[::r]]
        return {name: torch.cat(blocks, dim=0).contiguous() for name, blocks in out.items()}

    def replicates(self, tp_size: int) -> bool:
        return any(r > 1 for *_, r in self._pieces(0, tp_size))

    def _part_pieces(self, part: int, tp_size: int) -> list[tuple[int, int]]:
        """(first row, rows per rank) of each section of the HF tensor ``parts[part]``."""
        name = _fmt(self.parts[part][0], 0)
        return [(start, per) for n, start, per, _ in self._pieces(0, tp_size) if n == name]

    def rank_rows(self, tp_size: int) -> list[int]:
        """The rows each TP rank holds of each HF tensor, in order (no section replicated)."""
        return [sum(per for _, per in self._part_pieces(i, tp_size)) for i in range(len(self.parts))]

    def rows_to_megatron(self, rows: torch.Tensor, ctx, part: int = 0) -> torch.Tensor:
        """A tensor with the rows of the HF tensor ``parts[part]`` in megatron's row order: each TP rank's pieces of
        it, rank after rank (no section replicated)."""
        pieces = self._part_pieces(part, ctx.tp_size)
        return torch.cat([rows[start + r * per:start + (r + 1) * per] for r in range(ctx.tp_size)
                          for start, per in pieces])

    def rows_to_hf(self, rows: torch.Tensor, ctx, part: int = 0) -> torch.Tensor:
        """The inverse of ``rows_to_megatron`` (the TP ranks' rows concatenated in rank order)."""
        ranks = [torch.split(block, [per for _, per in self._part_pieces(part, ctx.tp_size)])
                 for block in rows.chunk(ctx.tp_size)]
        return torch.cat([rank[i] for i in range(len(ranks[0])) for rank in ranks])


@dataclass(frozen=True)
class KeyHeadGroups(Mapping):
    """A column-parallel tensor of ``parts``: ``(HF name pattern, section sizes within one key head's group)``, each
    HF tensor ``[groups * sum(sections), ...]``; megatron holds a rank's groups section by section, part by part."""

    megatron: str
    parts: tuple[tuple[str, tuple[int, ...]], ...]
    groups: int
    tp_split = "column"

    def hf_names(self, layer):
        return [_fmt(name, layer) for name, _ in self.parts]

    def load(self, reader, ctx, layer):
        local = self.groups // ctx.tp_size
        pieces = []
        for name, sections in self.parts:
            width = sum(sections)
            rows = _rows(reader, _fmt(name, layer), ctx.tp_rank * local * width, (ctx.tp_rank + 1) * local * width)
            grouped = rows.reshape(local, width, *rows.shape[1:])
            pieces += [s.reshape(-1, *rows.shape[1:]) for s in torch.split(grouped, list(sections), dim=1)]
        return torch.cat(pieces, dim=0).contiguous()

    def export(self, shards, ctx, layer):
        local = self.groups // ctx.tp_size
        sizes = [local * size for _, sections in self.parts for size in sections]
        out: dict[str, list[torch.Tensor]] = {name: [] for name in self.hf_names(layer)}
        for shard in shards:
            pieces = iter(torch.split(shard, sizes, dim=0))
            for name, sections in self.parts:
                own = [next(pieces).reshape(local, size, *shard.shape[1:]) for size in sections]
                out[_fmt(name, layer)].append(torch.cat(own, dim=1).reshape(-1, *shard.shape[1:]))
        return {name: torch.cat(blocks, dim=0).contiguous() for name, blocks in out.items()}

    def rank_rows(self, tp_size: int) -> list[int]:
        """The rows each TP rank holds of each HF tensor, in order."""
        return [self.groups // tp_size * sum(sections) for _, sections in self.parts]

    def rows_to_megatron(self, rows: torch.Tensor, ctx, part: int = 0) -> torch.Tensor:
        """A tensor with the rows of the HF tensor ``parts[part]`` in megatron's row order: each TP rank's key heads
        regrouped section by section, rank after rank."""
        sections, rest = list(self.parts[part][1]), rows.shape[1:]
        grouped = rows.reshape(ctx.tp_size, self.groups // ctx.tp_size, sum(sections), *rest)
        pieces = [s.reshape(ctx.tp_size, -1, *rest) for s in torch.split(grouped, sections, dim=2)]
        return torch.cat(pieces, dim=1).reshape(-1, *rest)

    def rows_to_hf(self, rows: torch.Tensor, ctx, part: int = 0) -> torch.Tensor:
        """The inverse of ``rows_to_megatron``."""
        sections, rest, local = list(self.parts[part][1]), rows.shape[1:], self.groups // ctx.tp_size
        blocks = torch.split(rows.reshape(ctx.tp_size, -1, *rest), [local * size for size in sections], dim=1)
        own = [b.reshape(ctx.tp_size, local, size, *rest) for b, size in zip(blocks, sections)]
        return torch.cat(own, dim=2).reshape(-1, *rest)
