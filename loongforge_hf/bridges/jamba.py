"""JambaForCausalLM (AI21's Jamba): Mamba-1 layers with attention every ``attn_layer_period`` layers (at
``attn_layer_offset``), after each mixer a gated silu MLP or, every ``expert_layer_period`` layers (at
``expert_layer_offset``), a softmax top-k mixture of experts.

Choices:
- Mamba layers (``linear_attention``): ``mamba.*`` -> our ``MambaMixer`` (``mamba1.py``) in megatron's self-attention
  slot, with Jamba's RMS norms over dt / B / C (weights, ``rms_norm_eps``); ``mamba1_layers.py`` holds the tensor
  table, the layouts and the refusals (TP splits ``d_inner = mamba_expand * hidden_size``; CP passes the states).
- Attention layers: megatron's ``SelfAttention`` (GQA) without rotary embedding (transformers' Jamba attention has
  none: megatron's ``position_embedding_type="none"``), no biases.
- MLP: ``feed_forward.{gate,up,down}_proj`` after ``pre_ff_layernorm`` (the dense spec's gated MLP); MoE layers:
  ``feed_forward.router`` and per-expert ``feed_forward.experts.{e}.*`` (``moe.py``'s table), softmax over all
  experts, the top-k probabilities not renormalised (megatron's ``moe_router_pre_softmax``); transformers'
  ``router_logits`` (MoE layers only) and its Mixtral load-balancing loss (``router_balance.py``).
- Cached generate: a KV layer per attention layer, then a state layer per Mamba layer (``kv_cache.py``).
- Refused before any collective: ``mamba_proj_bias``, ``hidden_act`` other than silu, ``num_experts`` below 2 (no
  MoE layer: megatron's MoE config needs experts), and what ``mamba1_layers.py`` refuses.
"""

from __future__ import annotations

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.dense import D, L
from loongforge_hf.bridges.fused_mappings import GatedMLP
from loongforge_hf.bridges.mamba1_layers import Mamba1Layers
from loongforge_hf.bridges.mappings import Mapping, Replicated, RowParallel
from loongforge_hf.bridges.moe import MoEBridge
from loongforge_hf.bridges.registry import register_bridge

FINAL_NORM = "model.final_layernorm.weight"
PRE_FF = f"{L}.pre_ff_layernorm.weight"


@register_bridge("JambaForCausalLM")
class JambaBridge(Mamba1Layers, MoEBridge):
    per_layer_types = True  # NOTE: Mamba layers (linear_attention) among the full-attention ones
    position_embedding_type = "none"
    hf_balance_loss = True
    hf_router_logits = True
    sparse_block = "feed_forward"
    router_name = "router"
    mamba_inner_field = "mamba_expand"

    # ---- config ---------------------------------------------------------------------------------------------
    def check_config(self) -> None:
        c, arch = self.hf_config, self.architectures[0]
        C.refuse_set_fields(c, arch, (("mamba_proj_bias", "biases of the Mamba in_proj / out_proj"),))
        if c.hidden_act != "silu":
            raise C.UnsupportedConfigError(f"hidden_act={c.hidden_act!r} is not supported for {arch} (only 'silu': "
                                           "the Mamba conv and gate use it).")
        if c.num_experts < 2:
            raise C.UnsupportedConfigError(f"num_experts={c.num_experts} is not supported for {arch} (no MoE "
                                           "layer; 2 or more experts).")
        super().check_config()

    def rope_parameters(self) -> dict:
        return {"rope_type": "default", "rope_theta": 10000.0}  # NOTE: unused: the attention has no rotary

    def qk_module(self) -> None:
        return None

    def num_experts(self) -> int:
        return self.hf_config.num_experts

    def expert_ffn_size(self) -> int:
        return self.hf_config.intermediate_size

    def is_moe_layer(self, layer: int) -> bool:
        return self.hf_config.layers_num_experts[layer] > 1

    def routing_kwargs(self) -> dict:
        return {"moe_router_score_function": "softmax", "moe_router_pre_softmax": True}

    def mamba_dims(self) -> dict:
        c = self.hf_config
        return dict(d_inner=c.mamba_expand * c.hidden_size, d_state=c.mamba_d_state, dt_rank=int(c.mamba_dt_rank),
                    conv_kernel=c.mamba_d_conv, conv_bias=bool(c.mamba_conv_bias), rms_eps=c.rms_norm_eps,
                    norm_weights=True)

    # ---- tensors --------------------------------------------------------------------------------------------
    def dense_mlp_mappings(self) -> list[Mapping]:
        f = f"{L}.feed_forward"
        return [Replicated(f"{D}.pre_mlp_layernorm.weight", PRE_FF),
                GatedMLP(f"{D}.mlp.linear_fc1.weight", gate=f"{f}.gate_proj.weight", up=f"{f}.up_proj.weight"),
                RowParallel(f"{D}.mlp.linear_fc2.weight", f"{f}.down_proj.weight")]

    def moe_mappings(self) -> list[Mapping]:
        return [Replicated(f"{D}.pre_mlp_layernorm.weight", PRE_FF), *super().moe_mappings()[1:]]

    def layer_mappings(self) -> list[Mapping]:
        return self.attention_mappings() + self.mamba_mappings()[1:] + self.dense_mlp_mappings() + \
            self.moe_mappings()[1:]

    def mappings_for_layer(self, layer: int) -> list[Mapping]:
        mixer = self.mamba_mappings() if layer in self.mamba_layers else self.attention_mappings()
        return mixer + (self.moe_mappings() if self.is_moe_layer(layer) else self.dense_mlp_mappings())

    def final_mappings(self) -> list[Mapping]:
        return [Replicated("decoder.final_layernorm.weight", FINAL_NORM), *super().final_mappings()[1:]]

    def layer_shapes(self, layer: int) -> dict[str, tuple[int, ...]]:
        prefix, h, f = f"model.layers.{layer}", self.hf_config.hidden_size, self.hf_config.intermediate_size
        mixer = self.mamba_shapes(prefix) if layer in self.mamba_layers else self.attention_shapes(prefix)
        if self.is_moe_layer(layer):
            mlp = self.moe_shapes(prefix)
            mlp.pop(f"{prefix}.post_attention_layernorm.weight")
        else:
            p = f"{prefix}.feed_forward"
            mlp = {f"{p}.gate_proj.weight": (f, h), f"{p}.up_proj.weight": (f, h), f"{p}.down_proj.weight": (h, f)}
        return {**mixer, **mlp, f"{prefix}.pre_ff_layernorm.weight": (h,)}

    def expected_hf_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = super().expected_hf_shapes()
        shapes[FINAL_NORM] = shapes.pop("model.norm.weight")
        return shapes
