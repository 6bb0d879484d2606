"""Gemma 4's attention per layer type: full-attention layers with their own head size and KV heads
(``global_head_dim`` / ``num_global_key_value_heads``, which transformers keeps in ``per_layer_config``), with
``attention_k_eq_v`` values taken from the key projection, and with ``num_kv_shared_layers`` the last layers reusing
the keys and values of an earlier layer of their type (Gemma 4 E2B / E4B).

Choices:
- megatron builds every layer from one ``TransformerConfig`` (the sliding layers' head size and KV heads, the config's
  global values). A full-attention layer's attention is built from a shallow copy of it with ``kv_channels`` /
  ``num_query_groups`` replaced (``per_type_attention``): its ``linear_qkv`` / ``linear_proj`` shapes, q / k norms and
  core attention follow; the layer, its MLP and the rest of the model keep the shared config.
- Values from keys (transformers' ``use_alternative_attention``, full layers only): the layer's ``linear_qkv`` holds
  ``[q heads, k]`` per KV group, built so (``_fewer_rows``: megatron asks for ``[q, k, v]`` rows, the class drops
  the value rows before anything is allocated); the values are the key projection's output before the k norm and the
  rotation, then normalised per head without a weight (``v_norm``), as transformers computes them. The key rows'
  gradient takes both uses, as ``k_proj``'s does.
- Every layer's values leave ``get_query_key_value_tensors`` normalised per head without a weight (``v_norm``).
- KV sharing (``kv_sharing_modes``: transformers' ``"store"`` layer of a type, the last before the shared ones, and
  its ``"reuse"`` layers): a reusing layer's ``linear_qkv`` holds the query rows alone (no k norm); its
  ``get_query_key_value_tensors`` gives empty keys and values and ``share_keys_and_values`` (forward pre-hooks on
  the core attentions, wired per chunk) hands its core attention the keys and values the storing layer's core
  attention got (after the k norm, v norm and rotation), as transformers' ``shared_kv_states``; the stored pair is
  dropped when the decoder finishes. The keys' gradient from every reusing layer flows back into the storing layer.
  With a KV cache (``kv_cache.py``) a reusing layer caches nothing: it reads the storing layer's cache layer
  (``kv_source``), as transformers' reusing layers read the storing layer's full keys and values. Under a pipeline
  the wiring is per chunk (a stage, or a virtual one) and the pair is not carried across stages: the split keeps
  them on one stage, or the layout is refused by name (``gemma4_small.SmallModelFields.stage_split_problem`` /
  ``check_stage_split``); context parallelism and activation recompute are
  refused (``gemma4.py``).
- Rotary angles: the model's table holds the full layers' angles (their head size) then the sliding layers'
  (``layer_types._two_table_rotary``); each layer takes its own by its head size (``_own_angles``), sliced once per
  forward and layer type (``_AngleCache``: the layers of a type share the contiguous copy).
- ``PerTypeQKV``: the fused q / k / v mapping with the full layers' head size and KV heads, without ``v_proj``
  there with values from keys (``qk_blocks``: ``[q heads, k]`` per KV group) and with ``q_proj`` alone in the
  reusing layers. Each TP rank holds whole KV groups of every layer type (replicated KV heads are refused by the
  bridge's ``check_layout``). LoRA places ``q_proj`` / ``k_proj`` / ``v_proj`` adapters in its slots as in a plain
  ``QKV``'s, with each layer's own heads (``layer_context``; ``lora.model._layout_and_slices``) and no ``v_proj`` slot
  where values come from keys (PEFT finds no ``v_proj`` there either; ``k_proj``'s adapter then feeds the values
  too, as in transformers).
"""

from __future__ import annotations

import copy
import functools
import weakref
from dataclasses import dataclass, replace

import torch

from loongforge_hf.bridges import transforms as T
from loongforge_hf.bridges.fused_mappings import QKV
from loongforge_hf.bridges.mappings import _read_into


def rms_no_weight(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``Gemma4RMSNorm(with_scale=False)``: over the last axis, in fp32, rounded once to ``x``'s dtype."""
    xf = x.float()
    return (xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + eps, -0.5)).type_as(x)


def qk_blocks(*, num_heads: int, num_kv_heads: int, head_dim: int) -> list[tuple[int, int, int, int]]:
    """``transforms.qkv_blocks`` without values: ``(which, row in q / k, row in the fused tensor, rows)`` for the
    ``[q heads of the group, k]`` blocks of each KV group (``which``: 0 for q, 1 for k)."""
    per_group = num_heads // num_kv_heads
    q_rows = per_group * head_dim
    blocks = []
    for g in range(num_kv_heads):
        base = g * (q_rows + head_dim)
        blocks += [(0, g * q_rows, base, q_rows), (1, g * head_dim, base + q_rows, head_dim)]
    return blocks


class _AngleCache:
    """One layer type's angles cut from the side-by-side table of the forward in progress: kept while the same table
    comes back (every layer of a forward, its recompute, a cached step's layers), replaced when another does."""

    def __init__(self) -> None:
        self.table, self.angles = None, {}

    def get(self, emb, head_dim: int, *, full: bool):
        if emb is None:
            return None
        if isinstance(emb, tuple):
            return tuple(self.get(e, head_dim, full=full) for e in emb)
        if self.table is None or self.table() is not emb:
            self.table, self.angles = weakref.ref(emb), {}
        key = (head_dim, full)
        if key not in self.angles:
            self.angles[key] = _own_angles(emb, head_dim, full=full)
        return self.angles[key]


def _own_angles(emb: torch.Tensor, head_dim: int, *, full: bool) -> torch.Tensor:
    """A layer's angles of the two tables laid side by side (the full layers' first, the sliding layers' last)."""
    return (emb[..., :head_dim] if full else emb[..., emb.shape[-1] - head_dim:]).contiguous()


def _fewer_rows(linear: type, dropped: int):
    """Builds ``linear`` (its class kept: LoRA checks it) with ``dropped`` fewer output rows than megatron's
    ``SelfAttention`` asks for (its ``[q, k, v]``): the layers without value rows, or without key and value rows,
    allocate only theirs."""

    def build(input_size: int, output_size: int, *args, **kwargs):
        return linear(input_size, output_size - dropped, *args, **kwargs)

    return build


@functools.cache
def per_type_attention(*, full_layers: frozenset[int], full_heads: tuple[int, int] | None,
                       values_from_keys: bool, reusing_layers: frozenset[int] = frozenset()) -> type:
    """Gemma 4's self-attention (see the module docstring): post norm, v-norm, a layer's own rotary angles;
    ``full_layers`` (0-based global indices) built with ``full_heads`` (head size, KV heads; None: the shared
    config's), their values from the key projection where ``values_from_keys``; ``reusing_layers`` with queries
    alone (their keys and values another layer's: ``share_keys_and_values``)."""
    from loongforge_hf.bridges.layer_outputs import transformed_attention

    angles = _AngleCache()

    class Gemma4Attention(transformed_attention(post_norm=True)):
        def __init__(self, config, submodules, layer_number, *args, **kwargs) -> None:
            full = layer_number - 1 in full_layers  # NOTE: megatron numbers layers from 1, offset by the stage
            if full and full_heads is not None:
                config = copy.copy(config)
                config.kv_channels, config.num_query_groups = full_heads
            reuses = layer_number - 1 in reusing_layers
            kv_rows = config.kv_channels * config.num_query_groups
            dropped = 2 * kv_rows if reuses else kv_rows if full and values_from_keys else 0
            if dropped:
                submodules = replace(submodules, linear_qkv=_fewer_rows(submodules.linear_qkv, dropped),
                                     **({"k_layernorm": None} if reuses else {}))
            super().__init__(config, submodules, layer_number, *args, **kwargs)
            self.linear_qkv_out_dim -= dropped
            self.full_attention = full
            self.values_from_keys = full and values_from_keys and not reuses
            self.reuses_keys_and_values = reuses

        def forward(self, *args, **kwargs):
            if kwargs.get("rotary_pos_emb") is not None:
                kwargs["rotary_pos_emb"] = angles.get(kwargs["rotary_pos_emb"], self.hidden_size_per_attention_head,
                                                      full=self.full_attention)
            return super().forward(*args, **kwargs)

        def get_query_key_value_tensors(self, hidden_states, *args, **kwargs):
            eps = self.config.layernorm_epsilon
            if not self.values_from_keys and not self.reuses_keys_and_values:
                query, key, value, *rest = super().get_query_key_value_tensors(hidden_states, *args, **kwargs)
                return (query, key, rms_no_weight(value, eps), *rest)
            mixed, _ = self.linear_qkv(hidden_states)
            hd, groups = self.hidden_size_per_attention_head, self.num_query_groups_per_partition
            if self.reuses_keys_and_values:  # NOTE: the keys and values come at the core attention
                query = mixed.view(*mixed.shape[:2], -1, hd)
                empty = query.new_empty(*query.shape[:2], 0, hd)
                return (self.q_layernorm(query) if self.q_layernorm is not None else query), empty, empty
            per_group = self.num_attention_heads_per_partition // groups
            mixed = mixed.view(*mixed.shape[:-1], groups, (per_group + 1) * hd)
            query, key = torch.split(mixed, [per_group * hd, hd], dim=3)
            query = query.reshape(*query.shape[:2], -1, hd)
            value = rms_no_weight(key, eps)  # NOTE: before the k norm (and the rotation, applied later)
            if self.q_layernorm is not None:
                query = self.q_layernorm(query)
            if self.k_layernorm is not None:
                key = self.k_layernorm(key)
            return query, key, value

    return Gemma4Attention


@dataclass(frozen=True)
class KVSource:
    """Where a reusing layer's core attention takes its keys and values: the storing layer's core attention (a
    holder, so that module is not registered as a submodule of this one)."""

    module: torch.nn.Module


def share_keys_and_values(chunk, modes: list, kinds: list) -> None:
    """Wire KV sharing into ``chunk``'s layers (module docstring): ``modes`` transformers' ``kv_sharing_modes``,
    ``kinds`` its ``layer_types``, both by global layer index."""
    shared: dict = {}
    storing: dict = {}
    for layer in chunk.decoder.layers:
        i, core = layer.layer_number - 1, layer.self_attention.core_attention
        if modes[i] == "store":
            storing[kinds[i]] = core
            core.register_forward_pre_hook(functools.partial(_store, shared, kinds[i]))
        elif modes[i] == "reuse":
            core.kv_source = KVSource(storing[kinds[i]])
            core.register_forward_pre_hook(functools.partial(_reuse, shared, kinds[i]))
    chunk.decoder.register_forward_hook(lambda *_: shared.clear())


def _store(shared: dict, kind: str, module, args):
    shared[kind] = args[1], args[2]


def _reuse(shared: dict, kind: str, module, args):
    return (args[0], *shared[kind], *args[3:])


@dataclass(frozen=True)
class PerTypeQKV(QKV):
    """``QKV`` whose ``full_layers`` have ``full_heads`` (head size, KV heads; None: the model's) and, with
    ``values_from_keys``, no ``v``: ``[q heads, k]`` per KV group (``qk_blocks``); ``reusing_layers``: ``q`` alone;
    ``v_head_dim``: every layer's value heads that wide (``[q heads, k, v]`` per KV group, MiMo-V2-Flash's, whose
    ``full_layers`` are its sliding layers: they have their own KV heads)."""

    full_layers: frozenset[int] = frozenset()
    full_heads: tuple[int, int] | None = None
    values_from_keys: bool = False
    reusing_layers: frozenset[int] = frozenset()
    v_head_dim: int | None = None

    def layer_context(self, ctx, layer):
        """``ctx`` (a ``ShardContext``) with ``layer``'s own head size and KV heads."""
        if layer in self.full_layers and self.full_heads is not None:
            return replace(ctx, head_dim=self.full_heads[0], num_kv_heads=self.full_heads[1])
        return ctx

    def _fused(self, layer) -> int:
        """How many of q, k, v ``layer``'s fused rows hold."""
        if layer in self.reusing_layers:
            return 1
        return 2 if self.values_from_keys and layer in self.full_layers else 3

    def _plain(self, layer) -> bool:
        """Whether ``layer``'s rows are a plain ``QKV``'s (with its own heads)."""
        return self._fused(layer) == 3 and self.v_head_dim is None

    def _first(self, ctx, rank: int) -> tuple[int, int, int]:
        q, k, _ = self._first_rows(ctx, rank)
        return q, k, ctx.first_kv_head(rank) * (self.v_head_dim or ctx.head_dim)

    def _blocks(self, ctx, layer) -> list[tuple[int, int, int, int]]:
        heads, groups, hd = ctx.num_heads // ctx.tp_size, ctx.local_kv_heads, ctx.head_dim
        if self._fused(layer) == 1:
            return [(0, 0, 0, heads * hd)]
        if self._fused(layer) == 3:
            return T.qkv_blocks(num_heads=heads, num_kv_heads=groups, head_dim=hd, v_head_dim=self.v_head_dim)
        return qk_blocks(num_heads=heads, num_kv_heads=groups, head_dim=hd)

    def hf_names(self, layer):
        return super().hf_names(layer)[:self._fused(layer)]

    def load(self, reader, ctx, layer):
        ctx = self.layer_context(ctx, layer)
        if self._plain(layer):
            return super().load(reader, ctx, layer)
        names, first, blocks = self.hf_names(layer), self._first(ctx, ctx.tp_rank), self._blocks(ctx, layer)
        out = torch.empty(sum(b[3] for b in blocks), *reader.shape(names[0])[1:], dtype=reader.dtype(names[0]))
        for which, src, dst, rows in blocks:
            _read_into(reader, names[which], out[dst:dst + rows], dim=0, start=first[which] + src)
        return out

    def export_parts(self, shard, rank, ctx, layer):
        ctx = self.layer_context(ctx, layer)
        if self._plain(layer):
            return super().export_parts(shard, rank, ctx, layer)
        blocks = self._blocks(ctx, layer)
        rows = sum(b[3] for b in blocks)
        if shard.dim() == 0 or shard.shape[0] != rows:
            raise ValueError(f"{self.megatron.format(layer=layer)}: a TP shard must have {rows} rows "
                             f"({' and '.join('qkv'[:self._fused(layer)])}), got shape {tuple(shard.shape)}.")
        names, first = self.hf_names(layer), self._first(ctx, rank)
        return [(names[which], 0, first[which] + src, shard[dst:dst + n]) for which, src, dst, n in blocks]

    def export(self, shards, ctx, layer):
        if self._plain(layer):
            return super().export(shards, self.layer_context(ctx, layer), layer)
        blocks: dict[str, list] = {}
        for rank, shard in enumerate(shards):
            for name, _, start, block in self.export_parts(shard, rank, ctx, layer):
                blocks.setdefault(name, []).append((start, block))
        return {name: torch.cat([b for _, b in sorted(parts, key=lambda p: p[0])]) for name, parts in blocks.items()}
