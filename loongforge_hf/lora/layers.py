"""LoRA on megatron's tensor-parallel linears: PEFT's math, split the way the base weight is split.

Choices:
- The adapted layers are megatron's own ``ColumnParallelLinear`` / ``RowParallelLinear`` with one method changed:
  ``_forward_impl``, the local matmul megatron runs between its communication ops, adds the adapter's local term.
  Applying LoRA re-classes the existing module (``module.__class__ = LoraColumnParallelLinear``) and adds a child
  ``lora`` (one ``LoraAdapter`` per HF target, keyed by its HF name, e.g. ``q_proj``). The base parameter keeps its
  object, name and megatron attributes, so the bridge, DDP, the optimizer and dist-checkpointing see it unchanged.
- Column-parallel base (``linear_qkv``, ``linear_fc1``): A is replicated, B holds this rank's output rows. One
  fused megatron output carries several HF targets: ``q_proj``'s delta goes to the q rows of every local KV group of
  ``linear_qkv`` (per group: q heads, k head, v head), ``gate_proj``/``up_proj`` to the two halves of this rank's
  ``[gate; up]``. A target not adapted contributes zeros to its rows, so ``q_proj`` alone changes only q.
  TP > 1: ``h = A x`` is computed on every rank and goes through ``copy_to_tensor_model_parallel_region`` (identity
  forward, all-reduce backward) before this rank's B, so A's gradient and the input gradient are the full sums.
  With sequence parallelism ``h`` is computed on the local sequence shard and all-gathered (r columns instead of
  the hidden size); A then enters through ``copy_to_tensor_model_parallel_region`` so its gradient sums the shards.
- Row-parallel base (``linear_proj``, ``linear_fc2``): A holds this rank's input columns, B is replicated. The
  partial ``B (A_r x_r)`` is added to the base's partial output *before* megatron's all-reduce (or reduce-scatter
  under sequence parallelism), which then sums both; B's gradient is partial per rank and is summed by passing B
  through ``copy_to_tensor_model_parallel_region``.
- Dropout is applied to the adapter input, per target, like PEFT. Where the input is the same on every TP rank the
  default generator draws the mask (megatron keeps it in step across TP ranks); where it is split over TP (sequence
  parallel, row-parallel inputs) megatron's model-parallel RNG tracker does, so each shard gets its own mask.
- DoRA (``use_dora``): each adapter also holds a magnitude (``add_magnitude``: split over TP with the rows of a
  column-parallel base, replicated on a row-parallel one); ``lora_output`` then rescales as ``dora.py`` says.
- Adapter parameters carry megatron's tensor-parallel attributes (split factors ``tensor_model_parallel=True``), so
  the gradient norm counts replicated factors once; ``sharded_state_dict`` shards split factors along their TP axis.
- Checkpoints: megatron stacks a layer's tensors over every layer of the model (TransformerBlock passes the layer
  axis, ``(0, layer, num_layers)``, as the first sharded offset). An adapter that only some layers carry
  (``layers_to_transform``, a regex naming some layers) is stacked over the layers that carry it instead
  (``stack_over_adapted_layers``; ``stacked_layers`` set by ``model.attach_lora``), so its global tensor is what
  exists and the optimizer state, sharded like it, too. MoE models (dense and MoE layers: megatron keys each layer
  on its own, no layer axis) keep their keys; their expert and router adapters need nothing of this.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear,
                                                  set_tensor_model_parallel_attributes)
from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                    gather_from_sequence_parallel_region)
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint
from torch import nn


class LoraAdapter(nn.Module):
    """One HF target's adapter on this rank: ``A`` [r, in or in/TP], ``B`` [out/TP or out, r] (``split`` names the
    factor split over TP, None for neither)."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor, *, scaling: float, dropout: float,
                 split: str | None) -> None:
        super().__init__()
        self.A = nn.Parameter(a)
        self.B = nn.Parameter(b)
        self.scaling = scaling
        self.stacked_layers: tuple[int, ...] = ()  # every layer holding this target at this rank (stacking)
        self.stack_suffix = ""  # its checkpoint key's suffix (stacking)
        self.dropout = nn.Dropout(p=dropout) if dropout > 0 else nn.Identity()
        self.register_parameter("magnitude", None)  # DoRA's m (dora.py); None for plain LoRA
        split_factor = {"A": self.A, "B": self.B}.get(split)  # None: both replicated (the router's)
        for p in (self.A, self.B):
            set_tensor_model_parallel_attributes(p, p is split_factor, 0 if split == "B" else 1, 1)

    def add_magnitude(self, m: torch.Tensor, *, split: bool) -> None:
        """DoRA: the magnitude vector ``m`` over this rank's output rows (``split``) or all of them."""
        self.magnitude = nn.Parameter(m)
        set_tensor_model_parallel_attributes(self.magnitude, split, 0, 1)

    def drop(self, x: torch.Tensor, *, input_is_split: bool) -> torch.Tensor:
        if isinstance(self.dropout, nn.Identity) or not self.training:
            return x
        if not input_is_split:
            return self.dropout(x)
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        with get_cuda_rng_tracker().fork():
            return self.dropout(x)


@dataclass(frozen=True)
class FusedLayout:
    """How HF targets share a column-parallel output on one rank: ``groups`` repeats of ``slots`` row blocks.

    ``linear_qkv``: groups = local KV groups, slots (q_proj, heads per group x head_dim), (k_proj, head_dim),
    (v_proj, head_dim). ``linear_fc1``: one group, (gate_proj, rows), (up_proj, rows). A plain linear: one slot.
    """

    groups: int
    slots: tuple[tuple[str, int], ...]

    def interleave(self, pieces: dict[str, torch.Tensor], fill: float = 0.0) -> torch.Tensor:
        """Per-target tensors [..., groups * rows] -> the fused last dimension; absent targets are ``fill``."""
        like = next(iter(pieces.values()))
        lead = like.shape[:-1]
        parts = []
        for name, rows in self.slots:
            piece = pieces.get(name)
            if piece is None:
                piece = like.new_full((*lead, self.groups * rows), fill)
            parts.append(piece.reshape(*lead, self.groups, rows))
        return torch.cat(parts, dim=-1).reshape(*lead, -1)

    def slot(self, fused: torch.Tensor, name: str) -> torch.Tensor:
        """The rows of target ``name`` in ``fused`` [groups * all slots' rows, ...] (the inverse of ``interleave``
        along the first dimension)."""
        names = [n for n, _ in self.slots]
        offset = sum(rows for _, rows in self.slots[:names.index(name)])
        rows = self.slots[names.index(name)][1]
        grouped = fused.reshape(self.groups, -1, *fused.shape[1:])
        return grouped.narrow(1, offset, rows).reshape(self.groups * rows, *fused.shape[1:])


def _tp_size(module) -> int:
    return module.tp_group.size() if module.tp_group is not None else 1


class LoraColumnParallelLinear(ColumnParallelLinear):
    """megatron's ColumnParallelLinear plus LoRA adapters on (slots of) its output rows."""

    lora: nn.ModuleDict
    lora_layout: FusedLayout

    def _forward_impl(self, input, weight, *args, **kwargs):
        out = super()._forward_impl(input, weight, *args, **kwargs)
        return self.lora_output(input, out, bias=kwargs.get("bias"),
                                sequence_parallel=bool(kwargs.get("sequence_parallel")),
                                allreduce_dgrad=bool(kwargs.get("allreduce_dgrad")))

    def lora_output(self, x: torch.Tensor, out: torch.Tensor, *, bias: torch.Tensor | None, sequence_parallel: bool,
                    allreduce_dgrad: bool) -> torch.Tensor:
        """``out``, the base layer's output on ``x`` (``bias`` included if not None), with the adapters' term (none
        inside ``disable_adapter()``, unload.py; the FP8 forward calls this too)."""
        from loongforge_hf.lora import dora

        if self.__dict__.get("lora_disabled"):
            return out
        tp = _tp_size(self)
        if tp > 1 and not sequence_parallel and not allreduce_dgrad:
            # NOTE: megatron then copies the input into the TP region itself, which would sum the adapter's
            # input gradient a second time; none of the linears LoRA targets is built that way.
            raise RuntimeError("LoRA on a ColumnParallelLinear without gradient all-reduce is not supported.")
        pieces, dropped = {}, {}
        for name, adapter in self.lora.items():
            a = adapter.A
            if tp > 1 and sequence_parallel:
                a = copy_to_tensor_model_parallel_region(a, group=self.tp_group)
            xd = adapter.drop(x, input_is_split=tp > 1 and sequence_parallel)
            if xd is not x and adapter.magnitude is not None:
                dropped[name] = xd
            h = F.linear(xd, a)
            if tp > 1:
                h = self._to_full_sequence(h, sequence_parallel)
            pieces[name] = F.linear(h, adapter.B) * adapter.scaling
        delta = self.lora_layout.interleave(pieces)
        if next(iter(self.lora.values())).magnitude is None:
            return out + delta
        scale = dora.column_scale(self)
        if dropped:  # NOTE: PEFT's DoRA rescales W applied to the dropped input then, one product per target
            weight = self.weight.detach()
            base = self.lora_layout.interleave({
                n: F.linear(self._to_full_sequence(xd, sequence_parallel), self.lora_layout.slot(weight, n))
                for n, xd in dropped.items()})
            return out + dora.rescaled(delta, base, scale)
        return dora.rescaled_output(out, delta, scale, bias)

    def _to_full_sequence(self, h: torch.Tensor, sequence_parallel: bool) -> torch.Tensor:
        """``h`` (the rank's input or a product of it with a replicated factor) as this rank's output rows take it:
        the sequence gathered under sequence parallelism, else its gradient summed over the TP ranks."""
        if _tp_size(self) == 1:
            return h
        if sequence_parallel:
            return gather_from_sequence_parallel_region(h, group=self.tp_group)
        return copy_to_tensor_model_parallel_region(h, group=self.tp_group)

    @torch.no_grad()
    def lora_delta_weight(self) -> torch.Tensor:
        """scaling * B @ A for every adapter, in the fused local layout of ``weight`` (float32)."""
        pieces = {n: (a.A.float().t() @ a.B.float().t()) * a.scaling for n, a in self.lora.items()}
        return self.lora_layout.interleave(pieces).t()

    def lora_merge_delta(self) -> torch.Tensor:
        """What merging adds to ``weight`` (float32): ``scaling * B @ A``, or with DoRA ``s * (W + ΔW) - W``."""
        from loongforge_hf.lora import dora

        return dora.merge_delta(self.weight, self.lora_delta_weight(), self.lora, lambda: dora.column_scale(self))

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        axes = {"weight": 0, "bias": 0, **{f"lora.{n}.{f}": 0 for n in self.lora for f in ("B", "magnitude")}}
        out = make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix, axes,
                                                  sharded_offsets, tp_group=self.tp_group,
                                                  dp_cp_group=metadata["dp_cp_group"])
        if self.__dict__.get("lora_vocab_rows"):
            # NOTE: the LM head's B (head.py): rows of the padded vocabulary, whose padding depends on the TP size, as
            # megatron marks the output layer's weight
            for name in self.lora:
                out[f"{prefix}lora.{name}.B"].allow_shape_mismatch = True
        return stack_over_adapted_layers(out, f"{prefix}lora.", self.lora, sharded_offsets)


class LoraRowParallelLinear(RowParallelLinear):
    """megatron's RowParallelLinear plus one LoRA adapter, summed by megatron's own output reduction."""

    lora: nn.ModuleDict

    def _forward_impl(self, input, weight, *args, **kwargs):
        out = super()._forward_impl(input, weight, *args, **kwargs)
        return self.lora_output(input, out)

    def lora_output(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out``, this rank's partial output on its input columns ``x``, with the adapter's partial term (both
        summed over TP by megatron's reduction afterwards); none inside ``disable_adapter()``."""
        from loongforge_hf.lora import dora

        if self.__dict__.get("lora_disabled"):
            return out
        tp = _tp_size(self)
        (adapter,) = self.lora.values()
        b = copy_to_tensor_model_parallel_region(adapter.B, group=self.tp_group) if tp > 1 else adapter.B
        xd = adapter.drop(x, input_is_split=tp > 1)
        delta = F.linear(F.linear(xd, adapter.A), b) * adapter.scaling
        if adapter.magnitude is None:
            return out + delta
        return dora.one_adapter_output(self, out, delta, None if xd is x else xd, None)

    @torch.no_grad()
    def lora_delta_weight(self) -> torch.Tensor:
        (adapter,) = self.lora.values()
        return (adapter.B.float() @ adapter.A.float()) * adapter.scaling

    def lora_merge_delta(self) -> torch.Tensor:
        """What merging adds to ``weight`` (float32; collective over TP with DoRA: the row norms)."""
        from loongforge_hf.lora import dora

        return dora.merge_delta(self.weight, self.lora_delta_weight(), self.lora, lambda: dora.one_adapter_scale(self))

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        axes = {"weight": 1, **{f"lora.{n}.A": 1 for n in self.lora}}
        out = make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix, axes,
                                                  sharded_offsets, tp_group=self.tp_group,
                                                  dp_cp_group=metadata["dp_cp_group"])
        return stack_over_adapted_layers(out, f"{prefix}lora.", self.lora, sharded_offsets)


def stack_over_adapted_layers(sharded: dict, prefix: str, adapters: nn.ModuleDict, sharded_offsets) -> dict:
    """``sharded`` with the adapters' tensors (keys ``{prefix}{name}.A`` / ``.B``) stacked over their
    ``stacked_layers`` rather than every layer of the model (megatron's layer axis, the first of
    ``sharded_offsets``); as it is where no layer axis was given (non-homogeneous layers: a key per layer)."""
    if not sharded_offsets:
        return sharded
    axis, layer, _ = sharded_offsets[0]
    for name, adapter in adapters.items():
        layers = adapter.stacked_layers
        for factor in ("A", "B") if adapter.magnitude is None else ("A", "B", "magnitude"):
            key = f"{prefix}{name}.{factor}"
            t = sharded[key]
            sharded[key] = dataclasses.replace(
                t, key=t.key + adapter.stack_suffix, global_shape=_at(t.global_shape, axis, len(layers)),
                global_offset=_at(t.global_offset, axis, layers.index(layer)),
                axis_fragmentations=_at(t.axis_fragmentations, axis, len(layers)))
    return sharded


def stacking(targets) -> dict[tuple[str, str, int], tuple[tuple[int, ...], str]]:
    """(megatron module, target name, r) -> (the layers whose adapter of that target has rank r, the suffix of its
    checkpoint keys): the suffix is "" where all the target's adapters have one rank, else ``.r{r}``, so that each
    rank's stack has keys of its own (``rank_pattern`` naming some layers' modules)."""
    from collections import defaultdict

    layers, ranks = defaultdict(list), defaultdict(set)
    for t in targets:
        layers[(t.megatron_module, t.name, t.r)].append(t.layer)
        ranks[(t.megatron_module, t.name)].add(t.r)
    return {k: (tuple(sorted(v)), "" if len(ranks[k[:2]]) == 1 else f".r{k[2]}") for k, v in layers.items()}


def _at(values: tuple | None, axis: int, value: int) -> tuple | None:
    return None if values is None else (*values[:axis], value, *values[axis + 1:])


_ADAPTED: dict[type, type] = {}


def _lora_class(cls: type) -> type | None:
    """LoRA's class for megatron linear class ``cls`` (None: not adaptable). A bridge's subclass of a megatron linear
    that changes only what happens around the local matmul says so (``lora_adaptable``: A.X-K2's query up-projection,
    which splits its output into queries and gates after the adapter's term is added): ``cls`` first, then LoRA's
    (made once per class; unloading re-classes to ``__mro__[1]``, ``cls`` again)."""
    for base, lora in ((ColumnParallelLinear, LoraColumnParallelLinear), (RowParallelLinear, LoraRowParallelLinear)):
        if cls is base:
            return lora
        if issubclass(cls, base) and getattr(cls, "lora_adaptable", False):
            if cls not in _ADAPTED:
                _ADAPTED[cls] = type(f"Lora{cls.__name__}", (cls, lora), {})
            return _ADAPTED[cls]
    return None


def check_adaptable(module: nn.Module) -> None:
    """``TypeError`` unless ``module`` is a linear ``attach_adapters`` can adapt (get_peft_model asks for every target
    before it changes anything)."""
    if _lora_class(type(module)) is None:
        raise TypeError(f"LoRA applies to megatron's local ColumnParallelLinear / RowParallelLinear (the default "
                        f"layer spec); got {type(module).__name__} (Transformer Engine layers, e.g. from "
                        "fp8_recipe='te_...', are not supported).")


def attach_adapters(module: nn.Module, adapters: dict[str, LoraAdapter], layout: FusedLayout | None) -> None:
    """Turn megatron linear ``module`` into its LoRA class in place and give it ``adapters``."""
    check_adaptable(module)
    cls = _lora_class(type(module))
    column = issubclass(cls, LoraColumnParallelLinear)
    if not column and len(adapters) != 1:
        raise ValueError(f"a row-parallel linear holds one HF target, got {sorted(adapters)}.")
    module.__class__ = cls
    if column:
        module.lora_layout = layout
    module.lora = nn.ModuleDict(adapters)
