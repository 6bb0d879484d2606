"""Declarative HF <-> megatron tensor mappings, one class per way a tensor is laid out under tensor parallelism.

Choices:
- A mapping names one megatron parameter (``{layer}`` stands for the layer index) and the HF tensor(s) it is made of.
- ``load`` reads only this rank's slice of each HF tensor (``CheckpointReader.get_slice``) and applies the pure
  transform from ``transforms.py``; fused and padded tensors are read block by block straight into their place
  (``get_slice(out=...)``; the block layout comes from ``transforms.py``), so a rank's bytes are copied once, by the
  read. ``export`` receives every TP rank's shard in rank order and returns full HF tensors; ``export_parts`` says
  which blocks of which HF tensors one rank's shard holds, so the exporter can write each shard as it arrives without
  assembling the full tensor. Neither touches a process group: gathering is ``distribution.py``'s job.
- Vocabulary tensors are padded with zero rows up to ``ShardContext.padded_vocab`` on load and truncated on export.
- Fused tensors (``QKV``, ``GatedMLP``), interleaved rotary rows (``RopeColumnParallel``) and routed experts
  (``Expert``) live in ``fused_mappings.py``, built on ``Mapping`` and the read helpers here.
- ``hf_dtype`` pins the dtype transformers keeps a tensor in whatever the model's dtype (DeepSeek's router in fp32).
- More TP ranks than KV heads: each rank holds one replica of one HF KV head (``ShardContext.kv_replicas``); the q / k /
  v mappings read a head's rows on each of its replicas and export it from the first.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from loongforge_hf.bridges import transforms as T
from loongforge_hf.bridges.checkpoint_io import CheckpointReader


@dataclass(frozen=True, kw_only=True)
class ShardContext:
    tp_rank: int
    tp_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    padded_vocab: int
    ep_rank: int = 0
    ep_size: int = 1
    etp_rank: int = 0
    etp_size: int = 1

    def for_experts(self) -> "ShardContext":
        """The context an expert's tensors are split in: the expert-tensor-parallel rank and size stand for TP."""
        return replace(self, tp_rank=self.etp_rank, tp_size=self.etp_size)

    @property
    def kv_replicas(self) -> int:
        """How many TP ranks hold each KV head: ``tp_size / num_kv_heads`` where TP exceeds the KV heads (each rank
        then holds one replica of one head, ``parallel/kv_replicas.py``), else 1."""
        return max(1, self.tp_size // self.num_kv_heads)

    @property
    def local_kv_heads(self) -> int:
        """The KV heads (megatron's query groups) of one TP rank."""
        return max(1, self.num_kv_heads // self.tp_size)

    def first_kv_head(self, rank: int) -> int:
        """The first HF KV head TP rank ``rank`` holds."""
        return rank * self.local_kv_heads // self.kv_replicas


def _fmt(pattern: str, layer: int | None) -> str:
    return pattern.format(layer=layer) if layer is not None else pattern


def _tp_slice(reader, name: str, ctx: "ShardContext", *, dim: int) -> torch.Tensor:
    """This TP rank's even share of HF tensor ``name`` along ``dim``, read from disk alone."""
    start, stop = T.shard_range(reader.shape(name)[dim], rank=ctx.tp_rank, world=ctx.tp_size, name=name)
    return reader.get_slice(name, dim=dim, start=start, stop=stop)


def _read_into(reader, name: str, out: torch.Tensor, *, dim: int, start: int) -> None:
    """Rows ``start:start + out.shape[dim]`` of ``name`` along ``dim``, read straight into ``out``.

    NOTE: only ``CheckpointReader`` reads into a given tensor; a wrapper (e.g. the FP8 dequantising reader) returns
    its own tensor, copied into place here."""
    stop = start + out.shape[dim]
    if isinstance(reader, CheckpointReader):
        reader.get_slice(name, dim=dim, start=start, stop=stop, out=out)
    else:
        out.copy_(reader.get_slice(name, dim=dim, start=start, stop=stop))


Part = tuple[str, int, int, torch.Tensor]  # (HF name, dim, start along dim, the block)


def streams_export(mapping: "Mapping") -> bool:
    """Whether ``mapping.export_parts`` describes what its ``export`` does (both defined by the same class, so a
    subclass that changes ``export`` alone falls back to whole-tensor export)."""
    def owner(attr: str) -> type:
        return next(c for c in type(mapping).__mro__ if attr in c.__dict__)

    return owner("export_parts") is not Mapping and owner("export_parts") is owner("export")


class Mapping:
    megatron: str
    tp_split: str | None = None  # "column" | "row" | None: how the megatron parameter is split over TP
    hf_dtype: torch.dtype | None = None  # the dtype transformers keeps this tensor in, whatever the model's

    def hf_names(self, layer: int | None) -> list[str]:
        raise NotImplementedError

    def load(self, reader, ctx: ShardContext, layer: int | None) -> torch.Tensor:
        raise NotImplementedError

    def export(self, shards: list[torch.Tensor], ctx: ShardContext, layer: int | None) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def hf_block(self, layer: int | None) -> tuple[int, int] | None:
        """``(dim, index)`` where ``export`` gives one block of a larger HF tensor (one expert of gpt-oss's stacked
        experts: its tensor of length 1 along ``dim`` at ``index``; the exporter plans the whole tensor once); None
        where it gives whole tensors."""
        return None

    def hf_block_rows(self, layer: int | None) -> int:
        """The length along ``hf_block``'s dim of the block ``export`` gives: 1 (one expert of a stack), or an
        expert's rows of a 2-D tensor that concatenates the experts' matrices (DBRX's ``w1``)."""
        return 1

    def export_parts(self, shard: torch.Tensor, rank: int, ctx: ShardContext, layer: int | None) -> list[Part]:
        """The blocks of HF tensors that TP rank ``rank``'s ``shard`` holds: ``(HF name, dim, start, block)``, each
        ``block`` the HF tensor's rows ``start:start + block.shape[dim]`` along ``dim`` (all of every other dim).

        Over the ranks of the group the blocks cover each tensor of ``hf_names`` exactly once, as ``export`` would
        build it; a mapping whose ``tp_split`` is None takes rank 0's shard alone (the others are not sent). Blocks
        are views of ``shard`` where possible (no copy).
        """
        raise NotImplementedError


@dataclass(frozen=True)
class Replicated(Mapping):
    megatron: str
    hf: str

    def hf_names(self, layer):
        return [_fmt(self.hf, layer)]

    def load(self, reader, ctx, layer):
        return reader.get(_fmt(self.hf, layer))

    def export(self, shards, ctx, layer):
        return {_fmt(self.hf, layer): shards[0]}

    def export_parts(self, shard, rank, ctx, layer):
        return [(_fmt(self.hf, layer), 0, 0, shard)] if rank == 0 else []


@dataclass(frozen=True)
class ColumnParallel(Mapping):
    """Split along the output dimension (dim 0): megatron's ColumnParallelLinear weight or bias; a subclass's
    ``split_dim`` where that dimension sits elsewhere in the tensor (MiniMax's ``[1, heads, ...]`` decay tables)."""

    megatron: str
    hf: str
    tp_split = "column"
    split_dim = 0

    def hf_names(self, layer):
        return [_fmt(self.hf, layer)]

    def load(self, reader, ctx, layer):
        return _tp_slice(reader, _fmt(self.hf, layer), ctx, dim=self.split_dim)

    def export(self, shards, ctx, layer):
        return {_fmt(self.hf, layer): torch.cat(shards, dim=self.split_dim)}

    def export_parts(self, shard, rank, ctx, layer):
        d = self.split_dim
        return [(_fmt(self.hf, layer), d, rank * shard.shape[d], shard)]


@dataclass(frozen=True)
class RowParallel(Mapping):
    """Split along the input dimension (dim 1): megatron's RowParallelLinear weight."""

    megatron: str
    hf: str
    tp_split = "row"

    def hf_names(self, layer):
        return [_fmt(self.hf, layer)]

    def load(self, reader, ctx, layer):
        return _tp_slice(reader, _fmt(self.hf, layer), ctx, dim=1)

    def export(self, shards, ctx, layer):
        return {_fmt(self.hf, layer): torch.cat(shards, dim=1)}

    def export_parts(self, shard, rank, ctx, layer):
        return [(_fmt(self.hf, layer), 1, rank * shard.shape[1], shard)]


@dataclass(frozen=True)
class VocabParallel(Mapping):
    """Embedding / LM-head rows, padded to ``padded_vocab`` and split over TP."""

    megatron: str
    hf: str
    tp_split = "column"

    def hf_names(self, layer):
        return [self.hf]

    def load(self, reader, ctx, layer):
        per_rank = ctx.padded_vocab // ctx.tp_size
        start, stop = ctx.tp_rank * per_rank, (ctx.tp_rank + 1) * per_rank
        real_stop = min(stop, ctx.vocab_size)
        out = torch.empty(per_rank, *reader.shape(self.hf)[1:], dtype=reader.dtype(self.hf))
        real = max(0, real_stop - start)
        if real:
            _read_into(reader, self.hf, out[:real], dim=0, start=start)
        out[real:].zero_()  # NOTE: the padding rows (pad_vocab's zeros), without a second copy of the real ones
        return out

    def export(self, shards, ctx, layer):
        return {self.hf: T.truncate_vocab(torch.cat(shards, dim=0), ctx.vocab_size)}

    def export_parts(self, shard, rank, ctx, layer):
        start = rank * shard.shape[0]
        keep = min(shard.shape[0], ctx.vocab_size - start)
        return [(self.hf, 0, start, shard[:keep])] if keep > 0 else []


@dataclass(frozen=True)
class FP32Replicated(Replicated):
    """A replicated tensor transformers keeps in float32 whatever the model dtype (``_keep_in_fp32_modules``)."""

    hf_dtype = torch.float32


@dataclass(frozen=True)
class FP32ColumnParallel(ColumnParallel):
    """A column-parallel tensor transformers keeps in float32 whatever the model dtype (Flint's sinks, Kimi Linear's
    ``dt_bias``)."""

    hf_dtype = torch.float32


def biased_mlp_mappings(megatron: str, fc1: str, fc2: str) -> list[Mapping]:
    """An ungated MLP's two linears with biases (megatron's ``{megatron}.linear_fc1`` / ``linear_fc2``, HF's ``fc1`` /
    ``fc2`` module names): ``fc1`` split by rows over TP with its bias, ``fc2`` row-parallel with its bias whole on
    every rank (megatron adds it after the row-parallel reduction)."""
    return [ColumnParallel(f"{megatron}.linear_fc1.weight", f"{fc1}.weight"),
            ColumnParallel(f"{megatron}.linear_fc1.bias", f"{fc1}.bias"),
            RowParallel(f"{megatron}.linear_fc2.weight", f"{fc2}.weight"),
            Replicated(f"{megatron}.linear_fc2.bias", f"{fc2}.bias")]


def renamed(mapping: Mapping, old: str, new: str) -> Mapping:
    """``mapping`` with every HF name starting with ``old`` (and not already with ``new``) starting with ``new``
    instead, in the mappings it wraps too (a routed expert's) and in tuples of names (``HeadSections``' parts)."""
    if old == new:
        return mapping
    values = {f.name: _renamed_value(getattr(mapping, f.name), old, new) for f in fields(mapping)
              if f.name != "megatron"}
    return replace(mapping, **values)


def _renamed_value(value, old: str, new: str):
    if isinstance(value, Mapping):
        return renamed(value, old, new)
    if isinstance(value, tuple):
        return tuple(_renamed_value(v, old, new) for v in value)
    if isinstance(value, str) and value.startswith(old) and not value.startswith(new):
        return new + value[len(old):]
    return value


def replaced(name: str, table: dict[str, str]) -> str:
    """``name`` with each ``old`` substring of ``table`` replaced by its ``new``, in the table's order."""
    for old, new in table.items():
        name = name.replace(old, new)
    return name


def with_replaced_names(mapping: Mapping, table: dict[str, str]) -> Mapping:
    """``mapping`` with ``replaced`` HF names (transformers' names that differ by a module's: HunYuan's q / k norms,
    Apertus's norms, EXAONE 3's layout), in the mappings it wraps too and in tuples of names."""
    def value(v):
        if isinstance(v, Mapping):
            return with_replaced_names(v, table)
        if isinstance(v, tuple):
            return tuple(value(x) for x in v)
        return replaced(v, table) if isinstance(v, str) else v

    return replace(mapping, **{f.name: value(getattr(mapping, f.name)) for f in fields(mapping)
                               if f.name != "megatron"})
