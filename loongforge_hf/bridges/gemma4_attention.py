"""Gemma 4's attention per layer type: full-attention layers with their own head size and KV heads
(``global_head_dim`` / ``num_global_key_value_heads``, which transformers keeps in ``per_layer_config``) and, with
``attention_k_eq_v``, values taken from the key projection.

Choices:
- megatron builds every layer from one ``TransformerConfig`` (the sliding layers' head size and KV heads, the config's
  global values). A full-attention layer's attention is built from a shallow copy of it with ``kv_channels`` /
  ``num_query_groups`` replaced (``per_type_attention``): its ``linear_qkv`` / ``linear_proj`` shapes, q / k norms and
  core attention follow; the layer, its MLP and the rest of the model keep the shared config.
- Values from keys (transformers' ``use_alternative_attention``, full layers only): the layer's ``linear_qkv`` holds
  ``[q heads, k]`` per KV group (no value rows, rebuilt after megatron's ``[q, k, v]`` one); the values are the key
  projection's output before the k norm and the rotation, then normalised per head without a weight (``v_norm``), as
  transformers computes them. The key rows' gradient takes both uses, as ``k_proj``'s does.
- Every layer's values leave ``get_query_key_value_tensors`` normalised per head without a weight (``v_norm``).
- Rotary angles: the model's table holds the full layers' angles (their head size) then the sliding layers'
  (``layer_types._two_table_rotary``); each layer takes its own by its head size (``_own_angles``).
- ``PerTypeQKV``: the fused q / k / v mapping with the full layers' head size and KV heads, and without ``v_proj``
  there with values from keys (``qk_blocks``: ``[q heads, k]`` per KV group). Each TP rank holds whole KV groups of
  every layer type (replicated KV heads are refused by the bridge's ``check_layout``). LoRA places ``q_proj`` /
  ``k_proj`` / ``v_proj`` adapters in its slots as in a plain ``QKV``'s, with each layer's own heads
  (``layer_context``; ``lora.model._layout_and_slices``) and no ``v_proj`` slot where values come from keys (PEFT
  finds no ``v_proj`` there either; ``k_proj``'s adapter then feeds the values too, as in transformers).
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass, replace

import torch

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


def _own_angles(emb, head_dim: int, *, full: bool):
    """A layer's angles of the two tables laid side by side (the full layers' first, the sliding layers' last)."""
    if emb is None:
        return None
    if isinstance(emb, tuple):
        return tuple(_own_angles(e, head_dim, full=full) for e in emb)
    return (emb[..., :head_dim] if full else emb[..., emb.shape[-1] - head_dim:]).contiguous()


@functools.cache
def per_type_attention(*, full_layers: frozenset[int], full_heads: tuple[int, int] | None,
                       values_from_keys: bool) -> type:
    """Gemma 4's self-attention (see the module docstring): post norm, v-norm, a layer's own rotary angles;
    ``full_layers`` (0-based global indices) built with ``full_heads`` (head size, KV heads; None: the shared
    config's), their values from the key projection where ``values_from_keys``."""
    from loongforge_hf.bridges.layer_outputs import transformed_attention

    class Gemma4Attention(transformed_attention(post_norm=True)):
        def __init__(self, config, submodules, layer_number, *args, **kwargs) -> None:
            full = layer_number - 1 in full_layers  # NOTE: megatron numbers layers from 1, offset by the stage
            if full and full_heads is not None:
                config = copy.copy(config)
                config.kv_channels, config.num_query_groups = full_heads
            super().__init__(config, submodules, layer_number, *args, **kwargs)
            self.full_attention = full
            self.values_from_keys = full and values_from_keys
            if self.values_from_keys:
                # NOTE: megatron built [q, k, v] rows; these layers have no value projection
                self.linear_qkv_out_dim = self.query_projection_size + self.kv_projection_size
                self.linear_qkv = submodules.linear_qkv(
                    self.config.hidden_size, self.linear_qkv_out_dim, config=self.config,
                    init_method=self.config.init_method, gather_output=False, bias=False, skip_bias_add=False,
                    is_expert=False, tp_comm_buffer_name="qkv", tp_group=self.pg_collection.tp)

        def forward(self, *args, **kwargs):
            if kwargs.get("rotary_pos_emb") is not None:
                kwargs["rotary_pos_emb"] = _own_angles(kwargs["rotary_pos_emb"], self.hidden_size_per_attention_head,
                                                       full=self.full_attention)
            return super().forward(*args, **kwargs)

        def get_query_key_value_tensors(self, hidden_states, *args, **kwargs):
            eps = self.config.layernorm_epsilon
            if not self.values_from_keys:
                query, key, value, *rest = super().get_query_key_value_tensors(hidden_states, *args, **kwargs)
                return (query, key, rms_no_weight(value, eps), *rest)
            mixed, _ = self.linear_qkv(hidden_states)
            hd, groups = self.hidden_size_per_attention_head, self.num_query_groups_per_partition
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
class PerTypeQKV(QKV):
    """``QKV`` whose ``full_layers`` have ``full_heads`` (head size, KV heads; None: the model's) and, with
    ``values_from_keys``, no ``v``: ``[q heads, k]`` per KV group (``qk_blocks``)."""

    full_layers: frozenset[int] = frozenset()
    full_heads: tuple[int, int] | None = None
    values_from_keys: bool = False

    def layer_context(self, ctx, layer):
        """``ctx`` (a ``ShardContext``) with ``layer``'s own head size and KV heads."""
        if layer in self.full_layers and self.full_heads is not None:
            return replace(ctx, head_dim=self.full_heads[0], num_kv_heads=self.full_heads[1])
        return ctx

    def _qk_only(self, layer) -> bool:
        return self.values_from_keys and layer in self.full_layers

    def hf_names(self, layer):
        names = super().hf_names(layer)
        return names[:2] if self._qk_only(layer) else names

    def load(self, reader, ctx, layer):
        ctx = self.layer_context(ctx, layer)
        if not self._qk_only(layer):
            return super().load(reader, ctx, layer)
        heads, groups, hd = ctx.num_heads // ctx.tp_size, ctx.local_kv_heads, ctx.head_dim
        names, first = self.hf_names(layer), self._first_rows(ctx, ctx.tp_rank)
        out = torch.empty((heads + groups) * hd, *reader.shape(names[0])[1:], dtype=reader.dtype(names[0]))
        for which, src, dst, rows in qk_blocks(num_heads=heads, num_kv_heads=groups, head_dim=hd):
            _read_into(reader, names[which], out[dst:dst + rows], dim=0, start=first[which] + src)
        return out

    def export_parts(self, shard, rank, ctx, layer):
        ctx = self.layer_context(ctx, layer)
        if not self._qk_only(layer):
            return super().export_parts(shard, rank, ctx, layer)
        heads, groups, hd = ctx.num_heads // ctx.tp_size, ctx.local_kv_heads, ctx.head_dim
        if shard.dim() == 0 or shard.shape[0] != (heads + groups) * hd:
            raise ValueError(f"{self.megatron.format(layer=layer)}: a TP shard must have {(heads + groups) * hd} "
                             f"rows (q and k, no v), got shape {tuple(shard.shape)}.")
        names, first = self.hf_names(layer), self._first_rows(ctx, rank)
        return [(names[which], 0, first[which] + src, shard[dst:dst + rows])
                for which, src, dst, rows in qk_blocks(num_heads=heads, num_kv_heads=groups, head_dim=hd)]

    def export(self, shards, ctx, layer):
        if not self._qk_only(layer):
            return super().export(shards, self.layer_context(ctx, layer), layer)
        blocks: dict[str, list] = {}
        for rank, shard in enumerate(shards):
            for name, _, start, block in self.export_parts(shard, rank, ctx, layer):
                blocks.setdefault(name, []).append((start, block))
        return {name: torch.cat([b for _, b in sorted(parts, key=lambda p: p[0])]) for name, parts in blocks.items()}
