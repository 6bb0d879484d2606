"""Mappings for HF tensors stored transposed: transformers' ``Conv1D`` (GPT-2's ``c_attn``, ``c_proj``, ``c_fc``)
keeps its weight ``[in, out]``, where ``nn.Linear`` and megatron's linears keep ``[out, in]``.

Choices:
- ``Transposed`` wraps the mapping the tensor would have as an ``nn.Linear`` weight (``ColumnParallel``,
  ``RowParallel``, ``PackedQKV`` ...): that mapping reads through ``TransposedReader``, which shows each 2-D tensor it
  names as ``[out, in]`` (a slice along one dim of the view is a slice along the other of the file: a TP rank still
  reads only its own columns), and its exported tensors and blocks are transposed back (``export_parts``' blocks
  swap their dim). 1-D tensors (biases) pass through unchanged, so one wrapper serves a weight and its bias alike.
- A LoRA B's rows (``rows_to_megatron`` / ``rows_to_hf``) follow the output features, which a transposed weight keeps
  in its columns: PEFT's ``lora_B`` of a ``Conv1D`` is ``[out, r]`` as for a linear, so the inner mapping's
  permutation applies as it is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loongforge_hf.bridges.mappings import Mapping


class TransposedReader:
    """``reader`` with the 2-D tensors in ``names`` seen transposed (the rest as they are)."""

    def __init__(self, reader, names) -> None:
        self.reader = reader
        self.names = frozenset(names)

    def __getattr__(self, attr):  # NOTE: keys, dtype, folder ... of the wrapped reader
        return getattr(self.reader, attr)

    def _flipped(self, name: str) -> bool:
        return name in self.names and len(self.reader.shape(name)) == 2

    def shape(self, name: str) -> tuple[int, ...]:
        shape = tuple(self.reader.shape(name))
        return shape[::-1] if self._flipped(name) else shape

    def get(self, name: str) -> torch.Tensor:
        value = self.reader.get(name)
        return value.t().contiguous() if self._flipped(name) else value

    def get_slice(self, name: str, *, dim: int, start: int, stop: int, out: torch.Tensor | None = None
                  ) -> torch.Tensor:
        if not self._flipped(name):
            return self.reader.get_slice(name, dim=dim, start=start, stop=stop, out=out)
        value = self.reader.get_slice(name, dim=1 - dim % 2, start=start, stop=stop).t()
        return value.contiguous() if out is None else out.copy_(value)


@dataclass(frozen=True)
class Transposed(Mapping):
    """``inner`` (the mapping of the tensor as an ``nn.Linear`` weight) for a checkpoint that stores it ``[in, out]``
    (transformers' ``Conv1D``)."""

    inner: Mapping

    @property
    def megatron(self) -> str:  # type: ignore[override]
        return self.inner.megatron

    @property
    def tp_split(self) -> str | None:  # type: ignore[override]
        return self.inner.tp_split

    def hf_names(self, layer):
        return self.inner.hf_names(layer)

    def load(self, reader, ctx, layer):
        return self.inner.load(TransposedReader(reader, self.inner.hf_names(layer)), ctx, layer)

    def export(self, shards, ctx, layer):
        return {name: _back(t) for name, t in self.inner.export(shards, ctx, layer).items()}

    def export_parts(self, shard, rank, ctx, layer):
        return [(name, 1 - dim if block.dim() == 2 else dim, start, _back(block))
                for name, dim, start, block in self.inner.export_parts(shard, rank, ctx, layer)]

    def rows_to_megatron(self, rows: torch.Tensor, ctx) -> torch.Tensor:
        permute = getattr(self.inner, "rows_to_megatron", None)
        return rows if permute is None else permute(rows, ctx)

    def rows_to_hf(self, rows: torch.Tensor, ctx) -> torch.Tensor:
        permute = getattr(self.inner, "rows_to_hf", None)
        return rows if permute is None else permute(rows, ctx)


def _back(tensor: torch.Tensor) -> torch.Tensor:
    """A 2-D tensor in the checkpoint's ``[in, out]`` layout (a view: the writer copies it), a 1-D one as it is."""
    return tensor.t() if tensor.dim() == 2 else tensor
