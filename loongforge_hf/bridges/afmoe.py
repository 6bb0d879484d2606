"""AfmoeForCausalLM (Arcee's Trinity: Trinity-Nano, -Mini, -Large): gated attention with per-head q / k norms, a norm
before and after each sublayer, rotary embedding on the sliding-window layers only, dense first layers, then
sigmoid-routed experts with an expert bias beside shared experts.

Choices:
- Attention: ``q_proj`` / ``k_proj`` / ``v_proj`` and ``gate_proj`` (a sigmoid gate per head channel on the attention
  output, before ``o_proj``): megatron's ``attention_output_gate``, the gates fused into ``linear_qkv`` beside each KV
  group's queries (``gated_mappings.GatedQKV`` with ``gate``), as Qwen3.5's; megatron applies the gate in fp32 and
  rounds once, transformers in the activations' dtype (the same in fp32). Per-head q / k RMSNorms before the rotation
  (megatron's ``qk_layernorm``); GQA; no biases (``attention_bias`` refused).
- ``layer_types``: the window (``sliding_window``) on the sliding layers, which alone rotate q and k (rotate-half
  pairs, every channel); the full layers take no rotary embedding (``smollm3.no_rope_attention``). Plain rope or
  llama3 scaling (a rope attention factor would scale the full layers too: refused).
- Norms (RMSNorm, ``rms_norm_eps``): ``input_layernorm`` and ``pre_mlp_layernorm`` in megatron's slots;
  ``post_attention_layernorm`` and ``post_mlp_layernorm`` on the attention's and the MLP's / MoE layer's outputs
  before the residual adds (``layer_outputs.transformed_attention`` / ``transformed_mlp`` / ``transformed_moe``, as
  Gemma 2's and FlexOlmo's). transformers keeps the norms' weights in fp32 and rounds once after the weight multiply;
  ours round the normalised input first (Llama's numerics): the same in fp32, one bf16 rounding apart in bf16.
- ``mup_enabled``: the embedding's output times ``sqrt(hidden_size)`` (``layer_outputs.scale_embedding``: one
  rounding of the product, as transformers' multiply by a float).
- The first ``num_dense_layers`` layers a gated MLP of ``intermediate_size``; the others ``num_experts`` experts of
  ``moe_intermediate_size`` (one tensor per expert on disk, as transformers' ``save_pretrained`` writes them) and
  ``num_shared_experts`` always-on ones as one MLP (``mlp.shared_experts``, megatron's ``SharedExpertMLP``).
- Routing (``mlp.router.gate``, the model's dtype): sigmoid scores, the top ``num_experts_per_tok`` of the scores plus
  ``mlp.expert_bias`` (fp32, fixed: ``moe_router_bias_update_rate=0``, as transformers never updates it), the chosen
  unbiased scores divided by their sum plus 1e-20 (megatron's expression too), times ``route_scale``
  (``moe_router_topk_scaling_factor``). megatron renormalises only when k > 1: ``num_experts_per_tok=1`` is refused.
- transformers' ``router_logits`` (every MoE layer; transformers' are fp32, ours in the model's dtype: the same in
  fp32); no balancing loss (transformers adds none).
"""

from __future__ import annotations

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.dense import D, L
from loongforge_hf.bridges.fused_mappings import QKV
from loongforge_hf.bridges.gated_mappings import GatedQKV
from loongforge_hf.bridges.layer_outputs import (scale_embedding, transformed_attention, transformed_mlp,
                                                 transformed_moe)
from loongforge_hf.bridges.layer_types import WindowsByLayerType
from loongforge_hf.bridges.mappings import Mapping, Replicated, renamed
from loongforge_hf.bridges.moe import MoEBridge
from loongforge_hf.bridges.registry import register_bridge
from loongforge_hf.bridges.smollm3 import no_rope_attention

_POST_MLP = Replicated(f"{D}.mlp.post_layernorm.weight", f"{L}.post_mlp_layernorm.weight")


@register_bridge("AfmoeForCausalLM")
class AfmoeBridge(WindowsByLayerType, MoEBridge):
    qk_norm = True
    extra_rope_types = ()
    shared_experts = "shared_experts"
    expert_bias = True
    expert_bias_name = "expert_bias"
    router_name = "router.gate"
    hf_router_logits = True                                    # transformers returns them; it adds no aux loss

    # ---- config ---------------------------------------------------------------------------------------------
    def check_config(self) -> None:
        c = self.hf_config
        if (c.num_shared_experts or 0) < 1:
            raise C.UnsupportedConfigError(f"num_shared_experts={c.num_shared_experts} is not supported (at least 1).")
        if (c.num_experts_per_tok or 0) < 2:
            raise C.UnsupportedConfigError(
                f"num_experts_per_tok={c.num_experts_per_tok} is not supported for AfmoeForCausalLM (at least 2): "
                "transformers renormalises the chosen sigmoid scores, megatron only when more than one is chosen.")
        if c.route_scale is None:
            raise C.UnsupportedConfigError("route_scale=None is not supported (transformers multiplies by it).")
        super().check_config()

    def num_experts(self) -> int:
        return self.hf_config.num_experts

    def shared_ffn_size(self) -> int:
        return self.hf_config.moe_intermediate_size * self.hf_config.num_shared_experts

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= (self.hf_config.num_dense_layers or 0)

    def routing_kwargs(self) -> dict:
        return {"moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
                "moe_router_bias_update_rate": 0.0, "moe_router_topk_scaling_factor": float(self.hf_config.route_scale)}

    def transformer_config_kwargs(self) -> dict:
        return {**super().transformer_config_kwargs(), "attention_output_gate": True}

    def attention_module(self) -> type:
        full = frozenset(i for i, kind in enumerate(self.hf_config.layer_types) if kind == "full_attention")
        return no_rope_attention(full, base=transformed_attention(post_norm=True))

    def mlp_module(self) -> type:
        return transformed_mlp(post_norm=True)

    def moe_module(self) -> type:
        return transformed_moe(post_norm=True)

    def finish_model(self, model) -> None:
        if self.hf_config.mup_enabled:
            scale_embedding(model, self.hf_config.hidden_size ** 0.5)

    # ---- tensors --------------------------------------------------------------------------------------------
    def attention_mappings(self) -> list[Mapping]:
        maps = [GatedQKV(m.megatron, q=m.q, k=m.k, v=m.v, gate=f"{L}.self_attn.gate_proj.weight")
                if isinstance(m, QKV) else m for m in super().attention_mappings()]
        return maps + [Replicated(f"{D}.self_attention.post_layernorm.weight", f"{L}.post_attention_layernorm.weight")]

    def dense_mlp_mappings(self) -> list[Mapping]:
        return [*(renamed(m, f"{L}.post_attention_layernorm.", f"{L}.pre_mlp_layernorm.")
                  for m in super().dense_mlp_mappings()), _POST_MLP]

    def moe_mappings(self) -> list[Mapping]:
        maps = (renamed(m, f"{L}.post_attention_layernorm.", f"{L}.pre_mlp_layernorm.") for m in super().moe_mappings())
        return [*maps, _POST_MLP]

    def attention_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        c = self.hf_config
        return {**super().attention_shapes(prefix), f"{prefix}.post_attention_layernorm.weight": (c.hidden_size,),
                f"{prefix}.self_attn.gate_proj.weight": (c.num_attention_heads * C.head_dim_of(c), c.hidden_size)}

    def _sandwiched(self, shapes: dict, prefix: str) -> dict[str, tuple[int, ...]]:
        h = shapes.pop(f"{prefix}.post_attention_layernorm.weight")
        return {**shapes, f"{prefix}.pre_mlp_layernorm.weight": h, f"{prefix}.post_mlp_layernorm.weight": h}

    def dense_mlp_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        return self._sandwiched(super().dense_mlp_shapes(prefix), prefix)

    def moe_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        return self._sandwiched(super().moe_shapes(prefix), prefix)
