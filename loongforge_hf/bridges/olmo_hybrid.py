"""OlmoHybridForCausalLM (AllenAI's OLMo Hybrid, Olmo-Hybrid-7B): Gated DeltaNet linear-attention layers and OLMo 3
style full-attention layers interleaved (``layer_types``; three of four linear by default).

Choices:
- ``linear_attention`` layers are pre-norm (``input_layernorm`` before the mixer, ``post_attention_layernorm`` before
  the MLP) with our ``GatedDeltaNet`` as the mixer (``gated_deltanet.py``: TP by heads, padding, packed documents,
  context parallelism, cached generate). transformers' layer differs from Qwen3.5's in:
  - separate ``q_proj`` / ``k_proj`` / ``v_proj`` / ``g_proj`` (the gate, Qwen's ``z``) / ``b_proj`` / ``a_proj``:
    one ``in_proj`` of this rank's heads of each (``gated_mappings.HeadSections``), ``o_proj`` as ``out_proj``;
  - the gated norm ``o_norm`` (a plain ``[value_head_dim]`` weight) with eps 1e-5 whatever ``rms_norm_eps`` (FLA's
    default, as transformers hard-codes it);
  - ``linear_allow_neg_eigval`` (the default): ``beta = 2 * sigmoid(b)`` (``GatedDeltaNet``'s ``beta_scale``).
  The conv (no bias, q / k / v channels in order), ``A_log`` / ``dt_bias``, the L2-normalised q / k, value heads
  grouped per key head and the norm's numerics are Qwen3.5's.
- Tensor names are the checkpoint's, as transformers 5 reads and writes them (its ``conversion_mapping`` for
  ``olmo_hybrid``): ``attention_layer_norm`` for the module tree's ``input_layernorm``, ``feedforward_layer_norm`` for
  ``post_attention_layernorm`` (on both kinds of layer: the linear layers' pre-MLP norm, the full layers' post-attention
  norm), the conv as ``q_conv1d`` / ``k_conv1d`` / ``v_conv1d`` (transformers concatenates them into ``conv1d``).
  ``checkpoint_name`` maps PEFT's module-tree names so for the LoRA planner. NOTE: transformers 5.24's own
  ``save_pretrained`` cuts the fused conv into three equal parts (its ``Concatenate``'s reverse is an even ``Chunk``),
  not the key, key and value channels; where the widths differ (the released model's) such a folder fails the shape
  check before any collective, naming the three tensors. Exports here write the hub's split.
- ``full_attention`` layers are OLMo 2's (``olmo2.py``): no input / pre-MLP norms, the attention's and the MLP's
  outputs normalised before the residual adds (``post_attention_layernorm``, ``post_feedforward_layernorm``), q / k
  norms over all heads (``full_width_norm``, split over TP); no sliding windows. The released checkpoints have no
  rotary embedding (``rope_parameters.rope_theta`` None: megatron's ``position_embedding_type="none"``); with a
  ``rope_theta``, plain rope (or llama3 scaling) on every full layer. As OLMo 2's, transformers' norms round once
  in bf16 and the input / post norms here round as Llama's (the same in fp32).
- One megatron ``TransformerLayer`` per HF layer, its slots chosen by kind (``olmo_hybrid_layer``): the linear layers
  keep the spec's input / pre-MLP RMSNorms and MLP, the full layers get ``IdentityOp`` there and the post-normed MLP.
- Cached generate (the full layers' keys and values, the Gated DeltaNets' conv and recurrent states), the static
  cache's refusal, the heads-vs-TP check and the ``mtp.*`` passthrough (transformers skips those tensors) are
  Qwen3.5's (``qwen3_5.py``).
- Refused by name before any collective: what ``qwen3_5.check_linear_attention`` refuses (unknown ``layer_types``,
  value heads not a multiple of key heads, ``hidden_act`` other than silu: the conv's activation too,
  ``attention_bias``), rope types beyond default / llama3 (YaRN's attention factor) and ``partial_rotary_factor``
  (transformers' rotary here rotates whole heads), linear heads that do not split over TP, the static cache. LoRA
  adapts the six in-projections, each its own adapter in its slot of ``in_proj`` (``lora/plan.py``).
"""

from __future__ import annotations

import functools
from dataclasses import replace

from loongforge_hf.bridges.dense import D, L, DenseBridge
from loongforge_hf.bridges.gated_mappings import HeadSections
from loongforge_hf.bridges.layer_outputs import transformed_attention, transformed_mlp
from loongforge_hf.bridges.mappings import (ColumnParallel, Mapping, Replicated, RowParallel, replaced,
                                            with_replaced_names)
from loongforge_hf.bridges.olmo2 import Olmo2Bridge
from loongforge_hf.bridges.qwen3_5 import Qwen3_5Bridge, check_linear_attention
from loongforge_hf.bridges.registry import register_bridge

A = f"{L}.linear_attn"
S = f"{D}.self_attention"
GATED_NORM_EPS = 1e-5  # NOTE: transformers' OlmoHybridGatedDeltaNet builds o_norm with it, whatever rms_norm_eps
# NOTE: transformers' table (conversion_mapping.py, "olmo_hybrid"), module-tree names -> the checkpoint's; the conv's
# three tensors are named in linear_attention_mappings
_NAMES = {".input_layernorm.": ".attention_layer_norm.", ".post_attention_layernorm.": ".feedforward_layer_norm."}


@register_bridge("OlmoHybridForCausalLM")
class OlmoHybridBridge(Olmo2Bridge):
    pre_norms = True  # NOTE: the linear layers'; olmo_hybrid_layer drops them on the full layers
    per_layer_types = True  # NOTE: layer_types checked here
    has_passthrough = True
    check_layout = Qwen3_5Bridge.check_layout
    generation_refusal = Qwen3_5Bridge.generation_refusal
    passthrough_names = Qwen3_5Bridge.passthrough_names
    linear_layers = Qwen3_5Bridge.linear_layers

    def __init__(self, hf_config) -> None:
        super().__init__(hf_config)
        if self.rope_parameters().get("rope_theta") is None:  # NOTE: the released checkpoints' NoPE
            self.position_embedding_type = "none"

    # ---- config ---------------------------------------------------------------------------------------------
    def check_config(self) -> None:
        check_linear_attention(self.hf_config, self.architectures[0])
        super().check_config()

    @property
    def full_layers(self) -> frozenset[int]:
        return frozenset(range(self.hf_config.num_hidden_layers)) - self.linear_layers

    def attention_module(self) -> type:
        from loongforge_hf.bridges.gated_deltanet import hybrid_self_attention

        c = self.hf_config
        return hybrid_self_attention(linear=self.linear_layers, key_heads=c.linear_num_key_heads,
                                     value_heads=c.linear_num_value_heads, key_dim=c.linear_key_head_dim,
                                     value_dim=c.linear_value_head_dim, conv_kernel=c.linear_conv_kernel_dim,
                                     eps=GATED_NORM_EPS, beta_scale=2.0 if c.linear_allow_neg_eigval else 1.0,
                                     attention=transformed_attention(post_norm=True))

    def mlp_module(self) -> type | None:
        return None  # NOTE: the spec's; olmo_hybrid_layer gives the full layers the post-normed one

    def layer_module(self) -> type:
        return olmo_hybrid_layer(self.full_layers)

    # ---- tensors --------------------------------------------------------------------------------------------
    def _linear_sizes(self) -> tuple[int, int, int]:
        """Rows of all key heads' q (or k), of all value heads' v (or gate), and the value heads."""
        c = self.hf_config
        return (c.linear_num_key_heads * c.linear_key_head_dim, c.linear_num_value_heads * c.linear_value_head_dim,
                c.linear_num_value_heads)

    def linear_attention_mappings(self) -> list[Mapping]:
        kd, vd, nv = self._linear_sizes()
        rows = (("q", kd), ("k", kd), ("v", vd), ("g", vd), ("b", nv), ("a", nv))
        return [
            Replicated(f"{D}.input_layernorm.weight", f"{L}.input_layernorm.weight"),
            HeadSections(f"{S}.in_proj.weight", tuple((f"{A}.{n}_proj.weight", (size,)) for n, size in rows)),
            HeadSections(f"{S}.conv_weight", tuple((f"{A}.{n}_conv1d.weight", (size,)) for n, size in rows[:3])),
            ColumnParallel(f"{S}.A_log", f"{A}.A_log"),
            ColumnParallel(f"{S}.dt_bias", f"{A}.dt_bias"),
            Replicated(f"{S}.norm_weight", f"{A}.o_norm.weight"),
            RowParallel(f"{S}.out_proj.weight", f"{A}.o_proj.weight"),
            *DenseBridge.dense_mlp_mappings(self),  # NOTE: the pre-MLP norm, not OLMo 2's post norm
        ]

    def layer_mappings(self) -> list[Mapping]:
        maps = self.attention_mappings() + self.dense_mlp_mappings() + self.linear_attention_mappings()
        return [with_replaced_names(m, _NAMES) for m in maps]

    def mappings_for_layer(self, layer: int) -> list[Mapping]:
        maps = self.linear_attention_mappings() if layer in self.linear_layers \
            else self.attention_mappings() + self.dense_mlp_mappings()
        return [with_replaced_names(m, _NAMES) for m in maps]

    def checkpoint_name(self, name: str) -> str:
        """The checkpoint's name of tensor ``name`` of transformers' module tree (``model.layers.0.input_layernorm
        .weight`` -> ``model.layers.0.attention_layer_norm.weight``)."""
        return replaced(name, _NAMES)

    def linear_attention_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        c, p = self.hf_config, f"{prefix}.linear_attn"
        kd, vd, nv = self._linear_sizes()
        h = c.hidden_size
        return {f"{prefix}.input_layernorm.weight": (h,), f"{p}.q_proj.weight": (kd, h), f"{p}.k_proj.weight": (kd, h),
                f"{p}.v_proj.weight": (vd, h), f"{p}.g_proj.weight": (vd, h), f"{p}.b_proj.weight": (nv, h),
                f"{p}.a_proj.weight": (nv, h), **{f"{p}.{n}_conv1d.weight": (size, 1, c.linear_conv_kernel_dim)
                                                  for n, size in (("q", kd), ("k", kd), ("v", vd))},
                f"{p}.A_log": (nv,), f"{p}.dt_bias": (nv,), f"{p}.o_norm.weight": (c.linear_value_head_dim,),
                f"{p}.o_proj.weight": (h, vd), **DenseBridge.dense_mlp_shapes(self, prefix)}

    def layer_shapes(self, layer: int) -> dict[str, tuple[int, ...]]:
        prefix = f"model.layers.{layer}"
        shapes = self.linear_attention_shapes(prefix) if layer in self.linear_layers \
            else {**self.attention_shapes(prefix), **self.dense_mlp_shapes(prefix)}
        return {replaced(n, _NAMES): shape for n, shape in shapes.items()}


@functools.cache
def olmo_hybrid_layer(full: frozenset[int]) -> type:
    """The layer class: megatron's ``TransformerLayer`` as the spec builds it on the linear layers; on the full layers
    (``full``: 0-based global indices) no input / pre-MLP norm and the MLP's output normalised. megatron's block
    numbers a stage's layers from 1; the layer adds its stage's offset, and so does the choice here."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.transformer_layer import TransformerLayer, get_transformer_layer_offset
    from megatron.core.utils import get_pg_rank

    class OlmoHybridLayer:
        def __new__(cls, config, submodules, layer_number: int = 1, **kwargs):
            pp = (kwargs.get("pg_collection") or ProcessGroupCollection.use_mpu_process_groups()).pp
            offset = get_transformer_layer_offset(config, kwargs.get("vp_stage"), get_pg_rank(pp))
            if layer_number - 1 + offset in full:
                submodules = replace(submodules, input_layernorm=IdentityOp, pre_mlp_layernorm=IdentityOp,
                                     mlp=replace(submodules.mlp, module=transformed_mlp(post_norm=True)))
            return TransformerLayer(config, submodules, layer_number, **kwargs)

    return OlmoHybridLayer
