"""Routed experts stacked on disk: one HF tensor per projection holding every expert along dim 0 (gpt-oss's
``experts.gate_up_proj``, GraniteMoE's ``input_linear``; DBRX's ``w1`` / ``v1`` / ``w2`` concatenate the experts'
matrices along their rows), read and written one expert at a time.

Choices:
- Each mapping here is one expert's (``expert``: ``{expert}`` until ``moe.StackedExpert`` / ``Expert`` bind it): it
  reads that expert's row of the stack (``get_slice`` along dim 0: only its bytes, also through the MXFP4 reader)
  and exports it as block ``expert`` of the stack (``Mapping.hf_block``: the exporter plans the stacked tensor once
  and fills it expert by expert, ``CheckpointWriter.add_part``); with ``rows``, the expert's matrix is rows
  ``[expert * rows, (expert + 1) * rows)`` of a 2-D tensor (DBRX's ``[experts * ffn, hidden]``) and its block those
  rows.
- Layouts: an expert's matrix is ``[out, in]`` (GraniteMoE, as ``nn.Linear``) or ``[in, out]`` (``transposed``:
  gpt-oss); fc1's gate and up outputs are ``[gate; up]`` halves or alternate (``alternating``: gpt-oss); megatron
  holds each expert-tensor-parallel rank's ``[gate_r; up_r]`` rows (``StackedGateUp``), fc2 split along its input
  (``StackedDown``); a bias row per expert (``StackedRow``: fc2's, whole on every rank); fc1's gate and up rows in two
  stacks (``StackedGatePair``: DBRX's ``w1`` / ``v1``).
- ``rows_to_megatron`` / ``rows_to_hf``: a tensor with fc1's output rows in the checkpoint's order (a LoRA B of PEFT's
  ``target_parameters``) in megatron's order of an expert whole on its rank (LoRA's experts are), and back.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from loongforge_hf.bridges import transforms as T
from loongforge_hf.bridges.dense import D
from loongforge_hf.bridges.fused_mappings import Expert
from loongforge_hf.bridges.mappings import Mapping, _fmt
from loongforge_hf.bridges.moe import EXPERT, StackedExpert


def routed_stack(bridge, cls, name: str, hf: str, **kwargs) -> Mapping:
    """One projection of a bridge's routed experts stacked on disk in ``hf`` (``cls``: ``StackedGateUp`` /
    ``StackedDown`` / ``StackedRow``, ``name`` megatron's tensor of it): the grouped MLP's stack, or megatron's
    ``SequentialMLP`` experts."""
    experts = f"{D}.mlp.experts"
    if bridge.grouped_experts:
        return StackedExpert(cls(f"{experts}.{name}", hf, **kwargs), f"{experts}.{name}", bridge.num_experts())
    return Expert(cls(f"{experts}.local_experts.{EXPERT}.{name}", hf, **kwargs))


@dataclass(frozen=True)
class _StackRow(Mapping):
    megatron: str
    hf: str
    expert: str = EXPERT
    transposed: bool = False    # an expert's matrix is [in, out] (gpt-oss), not [out, in]
    rows: int = 0               # an expert's matrix is these rows of a 2-D tensor (DBRX), not a row of a 3-D stack

    def hf_names(self, layer):
        return [_fmt(self.hf, layer)]

    def hf_block(self, layer):
        return 0, int(self.expert) * (self.rows or 1)

    def hf_block_rows(self, layer):
        return self.rows or 1

    def _row(self, reader, layer) -> torch.Tensor:
        """This expert's matrix ``[out, in]`` (or bias row)."""
        e, n = int(self.expert), self.rows or 1
        row = reader.get_slice(_fmt(self.hf, layer), dim=0, start=e * n, stop=(e + 1) * n)
        row = row if self.rows else row[0]
        return row.t() if self.transposed and row.dim() == 2 else row

    def _block(self, layer, value: torch.Tensor) -> dict[str, torch.Tensor]:
        """``value`` (``[out, in]`` or a bias row) as this expert's block of the stack."""
        if self.transposed and value.dim() == 2:
            value = value.t()
        return {_fmt(self.hf, layer): value.contiguous() if self.rows else value.contiguous().unsqueeze(0)}


@dataclass(frozen=True)
class StackedGateUp(_StackRow):
    """fc1 (gate and up) of one expert, or its bias -> megatron's ``[gate_r; up_r]``."""

    alternating: bool = False   # gate / up rows alternate (gpt-oss), not [gate; up] halves
    tp_split = "column"

    def _split(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (rows[0::2], rows[1::2]) if self.alternating else rows.chunk(2)

    def _join(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return torch.stack((gate, up), dim=1).flatten(0, 1) if self.alternating else torch.cat((gate, up))

    def load(self, reader, ctx, layer):
        gate, up = self._split(self._row(reader, layer))
        start, stop = T.shard_range(gate.shape[0], rank=ctx.tp_rank, world=ctx.tp_size, name=_fmt(self.hf, layer))
        return torch.cat((gate[start:stop], up[start:stop]))

    def export(self, shards, ctx, layer):
        parts = [T.split_gate_up(s) for s in shards]
        return self._block(layer, self._join(torch.cat([g for g, _ in parts]), torch.cat([u for _, u in parts])))

    def rows_to_megatron(self, rows: torch.Tensor, ctx=None) -> torch.Tensor:
        return torch.cat(self._split(rows))

    def rows_to_hf(self, rows: torch.Tensor, ctx=None) -> torch.Tensor:
        return self._join(*rows.chunk(2))


@dataclass(frozen=True)
class StackedGatePair(_StackRow):
    """fc1 of one expert whose gate rows are in the stack ``hf`` and its up rows in the stack ``up`` (DBRX's ``w1`` /
    ``v1``) -> megatron's ``[gate_r; up_r]``."""

    up: str = ""
    tp_split = "column"

    def hf_names(self, layer):
        return [_fmt(self.hf, layer), _fmt(self.up, layer)]

    def load(self, reader, ctx, layer):
        gate, up = self._row(reader, layer), replace(self, hf=self.up)._row(reader, layer)
        start, stop = T.shard_range(gate.shape[0], rank=ctx.tp_rank, world=ctx.tp_size, name=_fmt(self.hf, layer))
        return torch.cat((gate[start:stop], up[start:stop]))

    def export(self, shards, ctx, layer):
        parts = [T.split_gate_up(s) for s in shards]
        gate, up = torch.cat([g for g, _ in parts]), torch.cat([u for _, u in parts])
        return {**self._block(layer, gate), **replace(self, hf=self.up)._block(layer, up)}


@dataclass(frozen=True)
class StackedDown(_StackRow):
    """fc2 of one expert -> megatron's ``[H, I / tp]`` (split along its input)."""

    tp_split = "row"

    def load(self, reader, ctx, layer):
        row = self._row(reader, layer)
        start, stop = T.shard_range(row.shape[1], rank=ctx.tp_rank, world=ctx.tp_size, name=_fmt(self.hf, layer))
        return row[:, start:stop].contiguous()

    def export(self, shards, ctx, layer):
        return self._block(layer, torch.cat(shards, dim=1))


@dataclass(frozen=True)
class StackedRow(_StackRow):
    """A tensor not split over TP, one row per expert (fc2's bias)."""

    def load(self, reader, ctx, layer):
        return self._row(reader, layer).clone()

    def export(self, shards, ctx, layer):
        return self._block(layer, shards[0])
