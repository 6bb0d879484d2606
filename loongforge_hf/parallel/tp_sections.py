"""Parameters whose rows on a tensor-parallel rank are its share of several sections side by side, and how a training
checkpoint keys them so that it can be resumed under another tensor-parallel size.

Choices:
- Our fused projections hold on each TP rank its rows of several HF tensors (or row ranges of one) one after the other:
  a Gated DeltaNet's ``in_proj`` is this rank's q, k, v, z, b and a heads, its conv this rank's q, k and v channels;
  Mamba2's ``in_proj`` this rank's z, x, B, C, dt. megatron's dist-checkpointing reshards a TP-split tensor as the
  concatenation of the ranks' rows, which for these is ``[q0 k0 v0 ..; q1 k1 v1 ..]``: another TP size would read
  the rows in another order. A module declares such a parameter's sections (``declare``: their sizes on this rank,
  in order, along the TP axis); the checkpoint (``sectioned_state``) then writes each section as a tensor of its own
  (key ``{key}.section{i}``, the ranks' shares of it concatenated: the same tensor whatever the TP size), through a
  megatron ``ShardedTensorFactory`` whose merge concatenates a rank's sections again on load. megatron's optimizers
  key their state by the model's factories (``make_sharded_optimizer_tensor``, the distributed optimizer's
  ``fully_reshardable`` format), so AdamW's moments are sectioned alike.
- A section may be replicated over consecutive ranks (``replicas``: Mamba2's B / C rows where TP exceeds its groups,
  ``parallel/kv_replicas.py``): its tensor has one share per ``replicas`` ranks, and the first rank of each writes it
  (megatron's replica id over TP).
- A LoRA adapter's B (and DoRA's magnitude) on a declared column-parallel weight has the weight's rows, hence its
  sections (``sections_of_adapters``), or, one HF target in its slot of the fused rows, the sections of that slot
  (Qwen3.5's ``in_proj_qkv`` adapter: this rank's q, k and v rows; DiffLlama's ``q_proj`` adapter: this rank's
  query rows of each half of the heads); so has B of an adapter on one HF ``[gate; up]``
  linear (Phi-3's ``gate_up_proj``: this rank's gate rows, then its up rows, as megatron's ``linear_fc1``, whose
  weight megatron's own swiglu factory sections).
- KV heads replicated over TP ranks (``parallel/kv_replicas.py``: a rank holds one group, its share of the group's
  query heads, then the group's K and V) are keyed per head instead (``Blocks``): the tensor keeps megatron's own key
  and global shape (q / k / v per KV group, ``[q_g; k_g; v_g]`` for each group g: what a rank holding whole groups
  writes), and each of this rank's heads is one block of it (``head_dim`` rows), K and V written by the group's
  first replica. The same tensor whatever the TP size, so megatron reshards it to and from whole-group layouts.
- Checkpoints written before the sections (no ``tp_sections`` in their ``layout.json``) keyed these tensors whole:
  they are read as they were written (``trainer/checkpoint_layout.py``), under their own TP size only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sections:
    """A parameter's sections along ``axis``: ``sizes`` rows (on this rank, in order), each section's rows shared by
    ``replicas`` consecutive TP ranks (1: split over every rank)."""

    sizes: tuple[int, ...]
    axis: int = 0
    replicas: tuple[int, ...] | None = None

    def replicas_of(self, i: int) -> int:
        return 1 if self.replicas is None else self.replicas[i]


@dataclass(frozen=True)
class Blocks:
    """A parameter's rows along ``axis`` as blocks of ``rows`` rows, each one of ``total`` blocks of the tensor the
    checkpoint keys: local block ``i`` is block ``at[i]`` of it, this rank holding replica ``replica[i]`` of it over
    TP (0: the copy that is written)."""

    rows: int
    total: int
    at: tuple[int, ...]
    replica: tuple[int, ...]
    axis: int = 0


def declare_blocks(param: torch.Tensor, blocks: Blocks) -> None:
    """Mark ``param`` as holding ``blocks`` (module docstring)."""
    if blocks.rows * len(blocks.at) != param.shape[blocks.axis] or len(blocks.at) != len(blocks.replica):
        raise ValueError(f"{len(blocks.at)} blocks of {blocks.rows} rows do not make the {param.shape[blocks.axis]} "
                         f"rows of a {tuple(param.shape)} parameter along dim {blocks.axis}")
    param.tp_blocks = blocks


def blocks_of(param) -> Blocks | None:
    return getattr(param, "tp_blocks", None)


def declare(param: torch.Tensor, sizes, *, axis: int = 0, replicas=None) -> None:
    """Mark ``param`` as holding ``sizes`` rows of consecutive sections along ``axis`` (module docstring)."""
    sizes = tuple(int(s) for s in sizes)
    if sum(sizes) != param.shape[axis]:
        raise ValueError(f"sections {sizes} do not add up to the {param.shape[axis]} rows of a {tuple(param.shape)} "
                         f"parameter along dim {axis}")
    param.tp_sections = Sections(sizes, axis, None if replicas is None else tuple(int(r) for r in replicas))


def declare_rows(linear, sizes, *, replicas=None) -> None:
    """``declare`` a column-parallel linear's weight and bias (if any) as ``sizes`` rows of consecutive sections."""
    for p in (linear.weight, getattr(linear, "bias", None)):
        if isinstance(p, torch.Tensor):
            declare(p, sizes, replicas=replicas)


def sections_of(param) -> Sections | None:
    return getattr(param, "tp_sections", None)


def gate_up_halves(rows: int) -> Sections:
    """This rank's ``[gate; up]`` rows of megatron's ``linear_fc1`` as two sections."""
    return Sections((rows // 2, rows // 2))


def sections_of_adapters(modules) -> dict[int, Sections]:
    """``{id(tensor): Sections}`` for the LoRA factors (B, DoRA's magnitude) of column-parallel ``modules`` whose
    rows are sectioned: the base weight's declared sections, or megatron's ``[gate; up]`` halves of a gated
    ``linear_fc1`` for an adapter holding all of its rows (module docstring)."""
    from loongforge_hf.lora.layers import LoraColumnParallelLinear

    found = {}
    for name, m in modules:
        if not isinstance(m, LoraColumnParallelLinear):
            continue
        rows = m.weight.shape[0]
        gated = getattr(m.config, "gated_linear_unit", False) and name.endswith("linear_fc1")
        base = sections_of(m.weight) or (gate_up_halves(rows) if gated else None)
        if base is None or base.axis != 0:
            continue
        for target, adapter in m.lora.items():
            own = base if adapter.B.shape[0] == rows else _slot_sections(base, getattr(m, "lora_layout", None), target)
            for factor in (adapter.B, adapter.magnitude):
                if factor is not None and own is not None:
                    found[id(factor)] = own
    return found


def _slot_sections(base: Sections, layout, target: str) -> Sections | None:
    """The sections of ``target``'s adapter rows where its slot of a fused layout (``lora.layers.FusedLayout``) is
    whole sections of ``base``: in a one-group layout (Qwen3.5's ``in_proj_qkv`` in the Gated DeltaNet ``in_proj``)
    a run of them; in a layout of several groups (``linear_qkv``'s KV groups) where each section holds whole groups
    (DiffLlama's halves of the heads), the slot's rows of each. None otherwise (its rows are then left to megatron's
    layout: a slot of one section, or refused by name)."""
    if layout is None:
        return None
    names = [n for n, _ in layout.slots]
    start = sum(rows for _, rows in layout.slots[:names.index(target)])
    stop = start + layout.slots[names.index(target)][1]
    if layout.groups != 1:
        group = sum(rows for _, rows in layout.slots)
        if base.replicas is not None or any(size % group for size in base.sizes):
            return None
        return Sections(tuple(size // group * (stop - start) for size in base.sizes), 0)
    edges = [sum(base.sizes[:i]) for i in range(len(base.sizes) + 1)]
    if start not in edges or stop not in edges:
        return None
    first, last = edges.index(start), edges.index(stop)
    return Sections(base.sizes[first:last], 0, None if base.replicas is None else base.replicas[first:last])


def sectioned_state(state: dict, sections: dict[int, Sections | Blocks]) -> dict:
    """``state`` (a sharded state dict, nested) with each ``ShardedTensor`` whose data is a tensor of ``sections``
    replaced by a factory writing its sections as tensors of their own (its blocks as blocks of its tensor). Raises
    where a tensor of ``sections`` is not the data of one (a module keying a copy of it would be saved whole, and
    resharded wrong, silently)."""
    seen: set[int] = set()
    out = _sectioned(state, sections, seen)
    if set(sections) - seen:
        raise RuntimeError(f"{len(set(sections) - seen)} tensors declared with sections (parallel/tp_sections.py) "
                           "are not in the model's sharded state dict as themselves: they cannot be keyed per section")
    return out


def _sectioned(state, sections: dict[int, Sections], seen: set[int]):
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    if isinstance(state, dict):
        return {k: _sectioned(v, sections, seen) for k, v in state.items()}
    if isinstance(state, list):
        return [_sectioned(v, sections, seen) for v in state]
    if isinstance(state, ShardedTensor) and id(state.data) in sections:
        seen.add(id(state.data))
        spec = sections[id(state.data)]
        return _blocks_factory(state, spec) if isinstance(spec, Blocks) else _factory(state, spec)
    return state


def _factory(sh, sections: Sections):
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    if sh.flattened_range is not None:
        raise ValueError(f"{sh.key}: a flattened sharded tensor cannot be sectioned")
    axis = sh.prepend_axis_num + sections.axis  # NOTE: in the global shape; local_shape has no prepended axes
    tp_size = sh.axis_fragmentations[axis]
    tp_rank = sh.global_offset[axis] // sh.local_shape[sections.axis]

    def build(key, data, replica_id, flattened_range):
        if flattened_range is not None:
            raise ValueError(f"{key}: a flattened sharded tensor cannot be sectioned")
        out = {}
        for i, piece in enumerate(torch.split(data, sections.sizes, dim=sections.axis)):
            replicas = sections.replicas_of(i)
            shares = tp_size // replicas
            tp_replica = tp_rank % replicas
            rid = _with_tp_replica(replica_id, tp_replica)
            size = piece.shape[sections.axis]
            out[f"section{i}"] = dataclasses.replace(
                sh, key=f"{key}.section{i}", data=piece, dtype=piece.dtype, local_shape=tuple(piece.shape),
                global_shape=_at(sh.global_shape, axis, size * shares),
                global_offset=_at(sh.global_offset, axis, (tp_rank // replicas) * size),
                axis_fragmentations=_at(sh.axis_fragmentations, axis, shares), replica_id=rid)
        return out

    def merge(loaded: dict) -> torch.Tensor:
        return torch.cat([loaded[f"section{i}"] for i in range(len(sections.sizes))], dim=sections.axis)

    return ShardedTensorFactory(sh.key, sh.data, build, merge, sh.replica_id)


def _blocks_factory(sh, blocks: Blocks):
    """A factory writing ``sh``'s local rows as ``blocks`` of its own tensor (same key; a regular grid of
    ``blocks.total`` blocks along the axis)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    if sh.flattened_range is not None:
        raise ValueError(f"{sh.key}: a flattened sharded tensor cannot be keyed per block")
    axis = sh.prepend_axis_num + blocks.axis

    def build(key, data, replica_id, flattened_range):
        if flattened_range is not None:
            raise ValueError(f"{key}: a flattened sharded tensor cannot be keyed per block")
        out = []
        for piece, at, replica in zip(torch.split(data, blocks.rows, dim=blocks.axis), blocks.at, blocks.replica):
            rid = _with_tp_replica(replica_id, replica)
            out.append(dataclasses.replace(
                sh, key=key, data=piece, dtype=piece.dtype, local_shape=tuple(piece.shape),
                global_shape=_at(sh.global_shape, axis, blocks.total * blocks.rows),
                global_offset=_at(sh.global_offset, axis, at * blocks.rows),
                axis_fragmentations=_at(sh.axis_fragmentations, axis, blocks.total), replica_id=rid))
        return out

    def merge(loaded: list) -> torch.Tensor:
        return torch.cat(loaded, dim=blocks.axis)

    return ShardedTensorFactory(sh.key, sh.data, build, merge, sh.replica_id)


def _with_tp_replica(replica_id, tp_replica: int):
    """megatron's replica id with its TP entry (the second) set to ``tp_replica``."""
    if isinstance(replica_id, tuple) and len(replica_id) >= 2:
        return (replica_id[0], tp_replica, *replica_id[2:])
    return (replica_id, tp_replica)


def _at(values: tuple, i: int, value: int) -> tuple:
    return (*values[:i], value, *values[i + 1:])
