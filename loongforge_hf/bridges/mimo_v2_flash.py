"""MiMoV2FlashForCausalLM (Xiaomi's MiMo-V2-Flash, 309B-A15B): hybrid sliding-window / full attention with value
heads narrower than query / key heads, attention sinks on the sliding layers, and DeepSeek-V3's routing without
shared experts.

Choices:
- Attention per layer type (``layer_types``): megatron's shared config is the full layers' (``num_key_value_heads``
  KV heads, ``softmax_type="learnable"`` for the sinks); a sliding layer's attention is built from a shallow copy of
  it with twice the KV heads, a full layer's with ``softmax_type="vanilla"`` (no sinks), as transformers' per-layer
  ``MiMoV2FlashAttention`` (``mimo_attention``). The window on the sliding layers only (``layer_types.layer_windows``).
- Value heads of ``v_head_dim`` channels (query / key heads ``head_dim``): per KV group ``linear_qkv`` holds ``[q heads,
  k, v]`` with the value rows that narrow (``gemma4_attention.PerTypeQKV(v_head_dim=...)``, its "full" layers being
  the sliding ones here: they have their own KV heads), and ``linear_proj`` takes ``heads * v_head_dim`` inputs
  (``_fewer_inputs``); our SDPA ``CoreAttention`` sizes its output from the values. The values are
  multiplied by ``attention_value_scale`` as they leave ``get_query_key_value_tensors`` (transformers: after
  ``v_proj``, before the attention). The softmax scale is ``head_dim ** -0.5``, megatron's default for it.
- The sinks (``self_attn.attention_sink_bias`` ``[heads]`` on disk, transformers' ``sinks``; sliding layers only)
  are megatron's learnable softmax offset (``core_attention.softmax_offset``) split over TP with the heads, as
  gpt-oss's (``gpt_oss.py``).
- Rope per layer type (``layer_types.LayerTypes``: two side-by-side tables, each layer taking its own), each with its
  ``rope_theta`` and the same ``partial_rotary_factor`` (the first ``int(head_dim * factor)`` channels rotate in
  rotate-half pairs, megatron's ``rotary_percent``; 0.334 where a type names none, as transformers); default rope
  only (the hub's).
- The MLP of each layer by ``mlp_layer_types``: ``dense`` (``intermediate_size``) or ``sparse``: ``n_routed_experts``
  experts of ``moe_intermediate_size`` (one tensor per expert on disk, as transformers' ``save_pretrained`` writes
  them), no shared experts, DeepSeek-V3's routing (``deepseek.sigmoid_routing_kwargs``: sigmoid scores plus a fixed
  ``e_score_correction_bias``, top-2-sum group scores, renormalised, ``routed_scaling_factor``), router weight and
  bias in fp32 as transformers keeps them; transformers' ``router_logits``, no balancing loss (it adds none).
- Multi-token-prediction tensors in the checkpoint (``model.mtp.*``, which transformers ignores) are not built:
  skipped on load and copied unchanged on export.
- Context parallelism: our core attention's (``kernels/attention.py``: K and V gathered together, each as wide as
  it is), sinks and the window on the sliding layers.
- LoRA on ``q_proj`` / ``k_proj`` / ``v_proj``: ``linear_qkv`` slots with the value heads' own width
  (``lora.model._layout_and_slices``).
- Refused by name, before any collective: a tensor-parallel size that does not divide a layer type's KV heads (each
  rank holds whole KV heads of both types), attention biases, rope types other than default, partial rotary factors
  that differ by type.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import replace

import torch

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.deepseek import sigmoid_routing_kwargs
from loongforge_hf.bridges.dense import D, L
from loongforge_hf.bridges.gemma4_attention import PerTypeQKV, _fewer_rows
from loongforge_hf.bridges.layer_outputs import transformed_attention
from loongforge_hf.bridges.layer_types import LayerTypes, check_mlp_layer_types, layer_windows
from loongforge_hf.bridges.mappings import ColumnParallel, Mapping
from loongforge_hf.bridges.moe import MoEBridge
from loongforge_hf.bridges.registry import register_bridge

DEFAULT_PARTIAL_ROTARY = 0.334  # NOTE: transformers' MiMo, where a layer type's rope_parameters name no factor
_SINKS = f"{D}.self_attention.core_attention.softmax_offset"


@functools.cache
def _fewer_inputs(linear: type, dropped: int) -> type:
    """``linear`` built with ``dropped`` fewer input columns than megatron's ``SelfAttention`` asks for (its
    ``heads * kv_channels``): the output projection over narrower value heads. A class, as megatron's
    ``build_module`` takes for ``linear_proj``; the instance is re-classed to ``linear`` (LoRA checks the class)."""

    class FewerInputs(linear):
        def __init__(self, input_size: int, *args, **kwargs) -> None:
            super().__init__(input_size - dropped, *args, **kwargs)
            self.__class__ = linear

    return FewerInputs


@functools.cache
def mimo_attention(*, sliding_layers: frozenset[int], sliding_kv_heads: int, v_head_dim: int,
                   value_scale: float) -> type:
    """megatron's ``SelfAttention`` as MiMo-V2-Flash's (module docstring): ``sliding_layers`` (0-based global
    indices) with ``sliding_kv_heads`` KV heads, sinks and the second rotary table; values ``v_head_dim`` wide,
    times ``value_scale``."""

    class MiMoV2FlashAttention(transformed_attention(sliding_layers=sliding_layers)):
        def __init__(self, config, submodules, layer_number, *args, **kwargs) -> None:
            config = copy.copy(config)
            if layer_number - 1 in sliding_layers:  # NOTE: megatron numbers layers from 1, offset by the stage
                config.num_query_groups = sliding_kv_heads
            else:
                config.softmax_type = "vanilla"
            narrower = config.kv_channels - v_head_dim
            dropped = narrower * config.num_query_groups
            submodules = replace(submodules, linear_qkv=_fewer_rows(submodules.linear_qkv, dropped),
                                 linear_proj=_fewer_inputs(submodules.linear_proj,
                                                           narrower * config.num_attention_heads))
            super().__init__(config, submodules, layer_number, *args, **kwargs)
            self.linear_qkv_out_dim -= dropped
            self.val_hidden_size = v_head_dim

        def get_query_key_value_tensors(self, hidden_states, *args, **kwargs):
            mixed, _ = self.linear_qkv(hidden_states)
            hd, groups = self.hidden_size_per_attention_head, self.num_query_groups_per_partition
            per_group = self.num_attention_heads_per_partition // groups
            mixed = mixed.view(*mixed.shape[:-1], groups, (per_group + 1) * hd + v_head_dim)
            query, key, value = torch.split(mixed, [per_group * hd, hd, v_head_dim], dim=3)
            query = query.reshape(*query.shape[:2], -1, hd)
            return query, key, (value * value_scale if value_scale != 1.0 else value)

    return MiMoV2FlashAttention


@register_bridge("MiMoV2FlashForCausalLM")
class MiMoV2FlashBridge(LayerTypes, MoEBridge):
    default_rope_only = True
    extra_rope_types = ()
    partial_rotary = True
    supports_sliding_window = True
    expert_bias = True
    router_fp32 = True
    hf_router_logits = True                                    # transformers returns them; it adds no aux loss
    has_passthrough = True

    # ---- config ---------------------------------------------------------------------------------------------
    def check_config(self) -> None:
        c = self.hf_config
        check_mlp_layer_types(c)
        self.check_layer_types()
        factors = {kind: self.rope_for(kind)["partial_rotary_factor"] for kind in ("full_attention",
                                                                                   "sliding_attention")}
        if len(set(factors.values())) > 1:
            raise C.UnsupportedConfigError(f"rope_parameters: partial_rotary_factor {factors} differs between layer "
                                           "types; MiMoV2FlashForCausalLM takes one for both.")
        if not 0 < c.v_head_dim <= C.head_dim_of(c):
            raise C.UnsupportedConfigError(f"v_head_dim={c.v_head_dim} is not supported (1 to head_dim="
                                           f"{C.head_dim_of(c)}).")
        super().check_config()

    def check_layout(self, layout) -> None:
        """``UnsupportedConfigError`` where a layer type's KV heads do not split over TP (pure, before any
        collective)."""
        tp, kv = layout.tensor_parallel_size, C.kv_heads_of(self.hf_config)
        if kv % tp:
            raise C.UnsupportedConfigError(
                f"num_key_value_heads={kv} (the full-attention layers' KV heads; the sliding layers have {2 * kv}) "
                f"does not split over tensor_parallel_size={tp} for MiMoV2FlashForCausalLM (replicated KV heads are "
                "not supported there); use a tensor_parallel_size that divides it.")

    def rope_for(self, layer_type: str) -> dict:
        params = super().rope_for(layer_type)
        return {**params, "partial_rotary_factor": params.get("partial_rotary_factor", DEFAULT_PARTIAL_ROTARY)}

    @property
    def value_scale(self) -> float:
        scale = self.hf_config.attention_value_scale
        return 1.0 if scale is None else float(scale)

    def num_experts(self) -> int:
        return self.hf_config.n_routed_experts

    def is_moe_layer(self, layer: int) -> bool:
        return self.hf_config.mlp_layer_types[layer] == "sparse"

    def routing_kwargs(self) -> dict:
        return sigmoid_routing_kwargs(self.hf_config)

    def transformer_config_kwargs(self) -> dict:
        kw = super().transformer_config_kwargs()
        kw.pop("window_size", None)
        kw.update(layer_windows(self.hf_config))
        if self.sliding_layers:
            kw["softmax_type"] = "learnable"
        return kw

    def attention_module(self) -> type | None:
        c = self.hf_config
        return mimo_attention(sliding_layers=self.sliding_layers, sliding_kv_heads=2 * C.kv_heads_of(c),
                              v_head_dim=c.v_head_dim, value_scale=self.value_scale)

    def finish_model(self, model) -> None:
        self.set_rotary_tables(model)

    # ---- tensors --------------------------------------------------------------------------------------------
    def attention_mappings(self) -> list[Mapping]:
        c = self.hf_config
        qkv = PerTypeQKV(f"{D}.self_attention.linear_qkv.weight", q=f"{L}.self_attn.q_proj.weight",
                         k=f"{L}.self_attn.k_proj.weight", v=f"{L}.self_attn.v_proj.weight",
                         full_layers=self.sliding_layers, full_heads=(C.head_dim_of(c), 2 * C.kv_heads_of(c)),
                         v_head_dim=c.v_head_dim)
        maps = [qkv if m.megatron == qkv.megatron else m for m in super().attention_mappings()]
        return maps + [ColumnParallel(_SINKS, f"{L}.self_attn.attention_sink_bias")]

    def mappings_for_layer(self, layer: int) -> list[Mapping]:
        maps = super().mappings_for_layer(layer)
        return maps if layer in self.sliding_layers else [m for m in maps if m.megatron != _SINKS]

    def layer_shapes(self, layer: int) -> dict[str, tuple[int, ...]]:
        c, p = self.hf_config, f"model.layers.{layer}.self_attn"
        hd, vd, h, n = C.head_dim_of(c), c.v_head_dim, c.hidden_size, c.num_attention_heads
        kv = C.kv_heads_of(c) * (2 if layer in self.sliding_layers else 1)
        shapes = {**super().layer_shapes(layer), f"{p}.k_proj.weight": (kv * hd, h),
                  f"{p}.v_proj.weight": (kv * vd, h), f"{p}.o_proj.weight": (h, n * vd)}
        if layer in self.sliding_layers:
            shapes[f"{p}.attention_sink_bias"] = (n,)
        return shapes

    def passthrough_names(self, names) -> list[str]:
        """The checkpoint's multi-token-prediction tensors (``model.mtp.*``), not built."""
        return [n for n in names if n.startswith("model.mtp.")]
