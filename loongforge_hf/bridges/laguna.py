"""LagunaForCausalLM (Poolside's Laguna): grouped-query attention with a head count of its own in each layer and a
softplus output gate per head, full-attention layers rotating part of each head beside sliding-window layers with
their own rope, a dense first layer, then sigmoid-routed experts with a fixed bias beside a shared expert.

Choices:
- Heads per layer (``num_attention_heads_per_layer``; KV heads and head size shared): megatron's shared config holds
  the first layer's; each layer's attention is built from a shallow copy of it with its own ``num_attention_heads``
  (``laguna_attention``), so its ``linear_qkv`` / ``linear_proj`` / core attention follow, as Gemma 4's per-type heads
  (``gemma4_attention.per_type_attention``). Each layer's heads must be a multiple of ``num_key_value_heads`` and TP
  must divide the KV heads (so every layer's heads split too: each rank holds whole KV groups); else refused naming
  the field, before any collective.
- The output gate (``g_proj``: one row per head, ``gating`` true or ``"per-head"``; one per head channel otherwise,
  as transformers reads the field): megatron's ``attention_output_gate`` slot with fewer rows than its sigmoid gate
  per channel, fused into ``linear_qkv``: a rank's rows are its query heads, their gate rows, its keys, its values
  (``LagunaQKV``, per layer a ``gated_mappings.KeyHeadGroups`` over the KV groups, which LoRA's slots follow too);
  ``softplus`` in fp32, rounded to the activations' dtype, times each head's output before ``o_proj``, as
  transformers computes it. q / k norms per head before the rotation (megatron's ``qk_layernorm``); no biases
  (``attention_bias`` refused).
- ``layer_types``: the window (``sliding_window``) on the sliding layers only (``layer_types.layer_windows``). Rope per
  layer type (``layer_types.LayerTypes``: the full layers' table, then the sliding layers', side by side), each with
  its ``rope_theta`` and ``partial_rotary_factor`` (the first ``int(head_dim * factor)`` channels rotate in
  rotate-half pairs); a layer cuts its own type's angles by their width (``gemma4_attention._AngleCache``). Default
  rope only (the hub's), as MiMo-V2-Flash's.
- MLP by ``mlp_layer_types``: ``dense`` (``intermediate_size``) or ``sparse``: ``num_experts`` experts of
  ``moe_intermediate_size`` (one tensor per expert on disk, as transformers' ``save_pretrained`` writes them) beside
  ``mlp.shared_expert`` (``shared_expert_intermediate_size``, no gate).
- Routing (``mlp.gate``): sigmoid of the fp32 logits, the top ``num_experts_per_tok`` of the scores plus
  ``mlp.experts.e_score_correction_bias`` (megatron's ``expert_bias``, fixed; the model's dtype on disk as
  transformers keeps it), the chosen unbiased scores renormalised (megatron renormalises sigmoid top-k only when
  k > 1: ``num_experts_per_tok=1`` refused), times ``moe_routed_scaling_factor``. Router logit soft-capping
  (``moe_router_logit_softcapping`` > 0) and ``moe_apply_router_weight_on_input`` are refused.
- transformers' ``router_logits`` and its balancing loss (``router_aux_loss_coef``, softmax of the same logits,
  unbiased top k: ``router_balance``).
- LoRA (``checkpoint_name``: the shared expert's name on disk, ``mlp.shared_expert``, for transformers'
  ``mlp.shared_experts``).
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.dense import D, L
from loongforge_hf.bridges.fused_mappings import QKV
from loongforge_hf.bridges.gated_mappings import KeyHeadGroups
from loongforge_hf.bridges.gemma4_attention import _AngleCache, _fewer_rows
from loongforge_hf.bridges.layer_types import LAYER_TYPES, LayerTypes, check_mlp_layer_types, layer_windows
from loongforge_hf.bridges.mappings import FP32Replicated, Mapping, Replicated, _fmt
from loongforge_hf.bridges.moe import MoEBridge
from loongforge_hf.bridges.registry import register_bridge
from loongforge_hf.parallel import tp_sections


@functools.cache
def laguna_attention(*, heads: tuple[int, ...], gate_width: int, sliding_layers: frozenset[int],
                     rotary_widths: tuple[int, int]) -> type:
    """megatron's ``SelfAttention`` as Laguna's (module docstring): layer ``i`` (0-based, global) with ``heads[i]``
    query heads and ``gate_width`` gate rows per head; ``rotary_widths``: the full and the sliding layers' angles."""
    from megatron.core.transformer.attention import SelfAttention

    angles = _AngleCache()

    class LagunaAttention(SelfAttention):
        def __init__(self, config, submodules, layer_number, *args, **kwargs) -> None:
            config = copy.copy(config)
            config.num_attention_heads = heads[layer_number - 1]  # NOTE: megatron numbers layers from 1
            # NOTE: megatron sizes its gate a row per head channel; Laguna's may have one per head
            dropped = (config.kv_channels - gate_width) * config.num_attention_heads
            submodules = replace(submodules, linear_qkv=_fewer_rows(submodules.linear_qkv, dropped))
            super().__init__(config, submodules, layer_number, *args, **kwargs)
            self.linear_qkv_out_dim -= dropped
            self.sliding = layer_number - 1 in sliding_layers
            n, groups = self.num_attention_heads_per_partition, self.num_query_groups_per_partition
            hd = self.hidden_size_per_attention_head
            tp_sections.declare_rows(self.linear_qkv, (n * hd, n * gate_width, groups * hd, groups * hd))

        def forward(self, *args, **kwargs):
            if kwargs.get("rotary_pos_emb") is not None:
                kwargs["rotary_pos_emb"] = angles.get(kwargs["rotary_pos_emb"], rotary_widths[self.sliding],
                                                      full=not self.sliding)
            return super().forward(*args, **kwargs)

        def get_query_key_value_tensors(self, hidden_states, key_value_states=None, output_gate=False,
                                        split_qkv=True):
            mixed, _ = self.linear_qkv(hidden_states)
            hd, n, groups = (self.hidden_size_per_attention_head, self.num_attention_heads_per_partition,
                             self.num_query_groups_per_partition)
            query, gate, key, value = torch.split(mixed, [n * hd, n * gate_width, groups * hd, groups * hd], dim=-1)
            query = query.reshape(*query.shape[:-1], n, hd)
            key, value = (t.reshape(*t.shape[:-1], groups, hd) for t in (key, value))
            if self.q_layernorm is not None:
                query = self.q_layernorm(query)
            if self.k_layernorm is not None:
                key = self.k_layernorm(key)
            return query, key, value, gate

        def _apply_output_gate(self, x, gate):
            n = self.num_attention_heads_per_partition
            gate = F.softplus(gate.float()).to(x.dtype)  # NOTE: transformers rounds the gate, then multiplies
            return (x.view(*x.shape[:-1], n, -1) * gate.reshape(*x.shape[:-1], n, -1)).view(x.shape)

    return LagunaAttention


@dataclass(frozen=True)
class LagunaQKV(Mapping):
    """``q_proj``, ``g_proj``, ``k_proj``, ``v_proj`` -> megatron's ``linear_qkv``: per TP rank its queries, their gate
    rows, its keys, its values (whole KV groups per rank), with layer ``i``'s ``heads[i]`` query heads."""

    megatron: str
    q: str
    gate: str
    k: str
    v: str
    heads: tuple[int, ...]
    kv_heads: int
    head_dim: int
    gate_width: int
    tp_split = "column"

    def for_layer(self, layer: int) -> KeyHeadGroups:
        """The mapping of ``layer``'s tensors, its sections fixed (the exporter's and LoRA's)."""
        per, hd = self.heads[layer] // self.kv_heads, self.head_dim
        return KeyHeadGroups(self.megatron, parts=((self.q, (per * hd,)), (self.gate, (per * self.gate_width,)),
                                                   (self.k, (hd,)), (self.v, (hd,))), groups=self.kv_heads)

    def hf_names(self, layer):
        return [_fmt(name, layer) for name in (self.q, self.gate, self.k, self.v)]

    def load(self, reader, ctx, layer):
        return self.for_layer(layer).load(reader, ctx, layer)

    def export(self, shards, ctx, layer):
        return self.for_layer(layer).export(shards, ctx, layer)


@register_bridge("LagunaForCausalLM")
class LagunaBridge(LayerTypes, MoEBridge):
    default_rope_only = True
    extra_rope_types = ()
    partial_rotary = True
    supports_sliding_window = True
    qk_norm = True
    shared_experts = "shared_expert"
    expert_bias = True
    expert_bias_name = "experts.e_score_correction_bias"
    hf_balance_loss = True
    hf_router_logits = True

    # ---- config ---------------------------------------------------------------------------------------------
    @property
    def heads(self) -> tuple[int, ...]:
        return tuple(self.hf_config.num_attention_heads_per_layer or ())

    @property
    def gate_width(self) -> int:
        gating = self.hf_config.gating
        return 1 if gating is True or gating == "per-head" else C.head_dim_of(self.hf_config)

    def check_config(self) -> None:
        c = self.hf_config
        kv = C.kv_heads_of(c)
        if len(self.heads) != c.num_hidden_layers or any(n <= 0 or n % kv for n in self.heads):
            raise C.UnsupportedConfigError(
                f"num_attention_heads_per_layer={list(self.heads)}: expected a multiple of num_key_value_heads={kv} "
                f"for each of the {c.num_hidden_layers} layers.")
        for field in ("attention_bias", "moe_apply_router_weight_on_input"):
            if getattr(c, field):
                raise C.UnsupportedConfigError(f"{field}={getattr(c, field)} is not supported for LagunaForCausalLM.")
        if c.moe_router_logit_softcapping:
            raise C.UnsupportedConfigError(f"moe_router_logit_softcapping={c.moe_router_logit_softcapping} is not "
                                           "supported for LagunaForCausalLM (megatron's router has no soft cap).")
        if (c.num_experts_per_tok or 0) < 2:
            raise C.UnsupportedConfigError(
                f"num_experts_per_tok={c.num_experts_per_tok} is not supported for LagunaForCausalLM (at least 2): "
                "transformers renormalises the chosen sigmoid scores, megatron only when more than one is chosen.")
        check_mlp_layer_types(c)
        self.check_layer_types()
        super().check_config()

    def check_layout(self, layout) -> None:
        """``UnsupportedConfigError`` where TP does not divide the KV heads (pure, before any collective): each rank
        holds whole KV groups, so whole query heads of every layer (``check_config``: each layer's heads a multiple
        of the KV heads)."""
        tp, kv = layout.tensor_parallel_size, C.kv_heads_of(self.hf_config)
        if kv % tp:
            raise C.UnsupportedConfigError(
                f"num_key_value_heads={kv} does not split over tensor_parallel_size={tp} for LagunaForCausalLM (each "
                f"rank holds whole KV groups and their query heads, num_attention_heads_per_layer={list(self.heads)}; "
                "replicated KV heads are not supported there); use a tensor_parallel_size that divides it.")

    def rotary_width(self, layer_type: str) -> int:
        """The rotated channels of a ``layer_type`` head (pairs: transformers' ``cos`` width)."""
        dim = int(C.head_dim_of(self.hf_config) * self.rope_for(layer_type).get("partial_rotary_factor", 1.0))
        return 2 * ((dim + 1) // 2)

    def num_experts(self) -> int:
        return self.hf_config.num_experts

    def shared_ffn_size(self) -> int:
        return self.hf_config.shared_expert_intermediate_size

    def is_moe_layer(self, layer: int) -> bool:
        return self.hf_config.mlp_layer_types[layer] == "sparse"

    def routing_kwargs(self) -> dict:
        return {"moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
                "moe_router_bias_update_rate": 0.0,
                "moe_router_topk_scaling_factor": float(self.hf_config.moe_routed_scaling_factor)}

    def transformer_config_kwargs(self) -> dict:
        kw = super().transformer_config_kwargs()
        kw.pop("window_size", None)
        return {**kw, **layer_windows(self.hf_config), "num_attention_heads": self.heads[0],
                "attention_output_gate": True}

    def attention_module(self) -> type:
        return laguna_attention(heads=self.heads, gate_width=self.gate_width, sliding_layers=self.sliding_layers,
                                rotary_widths=tuple(self.rotary_width(kind) for kind in LAYER_TYPES))

    def finish_model(self, model) -> None:
        self.set_rotary_tables(model)

    # ---- tensors --------------------------------------------------------------------------------------------
    def attention_mappings(self) -> list[Mapping]:
        c, a = self.hf_config, f"{L}.self_attn"
        qkv = LagunaQKV(f"{D}.self_attention.linear_qkv.weight", q=f"{a}.q_proj.weight", gate=f"{a}.g_proj.weight",
                        k=f"{a}.k_proj.weight", v=f"{a}.v_proj.weight", heads=self.heads, kv_heads=C.kv_heads_of(c),
                        head_dim=C.head_dim_of(c), gate_width=self.gate_width)
        return [qkv if isinstance(m, QKV) else m for m in super().attention_mappings()]

    def mappings_for_layer(self, layer: int) -> list[Mapping]:
        # NOTE: the layer's own KeyHeadGroups (its sections fixed): the exporter's and LoRA's (rows per part per rank)
        return [m.for_layer(layer) if isinstance(m, LagunaQKV) else m for m in super().mappings_for_layer(layer)]

    def checkpoint_name(self, name: str) -> str:
        """The checkpoint's name of tensor ``name`` of transformers' module tree (LoRA's planner)."""
        return name.replace(".mlp.shared_experts.", ".mlp.shared_expert.")

    def moe_mappings(self) -> list[Mapping]:
        # NOTE: transformers keeps the expert bias in the model's dtype (a parameter), not in fp32
        return [Replicated(m.megatron, m.hf) if isinstance(m, FP32Replicated) and m.megatron.endswith("expert_bias")
                else m for m in super().moe_mappings()]

    def layer_shapes(self, layer: int) -> dict[str, tuple[int, ...]]:
        c, p = self.hf_config, f"model.layers.{layer}.self_attn"
        rows, h = self.heads[layer] * C.head_dim_of(c), c.hidden_size
        return {**super().layer_shapes(layer), f"{p}.q_proj.weight": (rows, h), f"{p}.o_proj.weight": (h, rows),
                f"{p}.g_proj.weight": (self.heads[layer] * self.gate_width, h)}
