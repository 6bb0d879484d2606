"""Lfm2MoeForCausalLM (Liquid AI's LFM2-MoE: LFM2-8B-A1B): LFM2's conv and attention layers (``lfm2.Lfm2Layers``)
with the first ``num_dense_layers`` MLPs dense and a sigmoid-routed mixture of experts in the others.

Choices:
- Layers, norms, dense MLPs (``intermediate_size`` as it is: transformers' ``Lfm2MoeMLP`` does not adjust it),
  cached generate, context parallelism and refusals as LFM2's (``lfm2.py``).
- MoE layers: ``num_experts`` experts of ``moe_intermediate_size`` (on disk one tensor per expert and projection,
  ``feed_forward.experts.{e}.w1`` (gate), ``w3`` (up), ``w2`` (down), as the hub's files and transformers'
  ``save_pretrained`` write them), no shared expert. Routing through megatron's router: sigmoid scores, the top
  ``num_experts_per_tok`` of the scores plus ``feed_forward.expert_bias`` with ``use_expert_bias`` (fp32, fixed:
  ``moe_router_bias_update_rate=0``, as transformers never updates it), the chosen sigmoid scores renormalised
  (``norm_topk_prob``; megatron renormalises sigmoid top-k exactly when k > 1, so the other pairings are refused),
  times ``routed_scaling_factor``. transformers divides by the sum plus 1e-6, megatron plus 1e-20: a relative
  difference under 1e-6 / k of the sum, below fp32's rounding of the tests' sums, invisible in bf16.
- The router weight in the model's dtype (transformers' ``gate`` is a plain linear); transformers'
  ``router_logits`` output (``output_router_logits``); no balancing loss (transformers' model adds none).
"""

from __future__ import annotations

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.dense import L
from loongforge_hf.bridges.lfm2 import Lfm2Layers
from loongforge_hf.bridges.mappings import Mapping, renamed
from loongforge_hf.bridges.moe import MoEBridge
from loongforge_hf.bridges.registry import register_bridge


@register_bridge("Lfm2MoeForCausalLM")
class Lfm2MoeBridge(Lfm2Layers, MoEBridge):
    sparse_block = "feed_forward"
    expert_projections = ("w1", "w3", "w2")
    expert_bias_name = "expert_bias"
    hf_router_logits = True

    def __init__(self, hf_config) -> None:
        self.expert_bias = bool(hf_config.use_expert_bias)
        super().__init__(hf_config)

    def num_experts(self) -> int:
        return self.hf_config.num_experts

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.hf_config.num_dense_layers

    def routing_kwargs(self) -> dict:
        c = self.hf_config
        if bool(c.norm_topk_prob) != (c.num_experts_per_tok > 1):
            raise C.UnsupportedConfigError(
                f"norm_topk_prob={c.norm_topk_prob} with num_experts_per_tok={c.num_experts_per_tok} is not supported "
                f"for {self.architectures[0]}: megatron renormalises the chosen sigmoid scores exactly when more than "
                "one expert is chosen.")
        return {"moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": self.expert_bias,
                "moe_router_bias_update_rate": 0.0, "moe_router_topk_scaling_factor": c.routed_scaling_factor}

    # ---- tensors --------------------------------------------------------------------------------------------
    def moe_mappings(self) -> list[Mapping]:
        return [renamed(m, f"{L}.post_attention_layernorm.", f"{L}.ffn_norm.") for m in super().moe_mappings()]

    def mlp_mappings(self, layer: int) -> list[Mapping]:
        return self.moe_mappings() if self.is_moe_layer(layer) else self.dense_mlp_mappings()

    def every_mlp_mapping(self) -> list[Mapping]:
        return self.dense_mlp_mappings() + self.moe_mappings()

    def mlp_shapes(self, layer: int) -> dict[str, tuple[int, ...]]:
        prefix = f"model.layers.{layer}"
        if not self.is_moe_layer(layer):
            return self.dense_mlp_shapes(prefix)
        shapes = self.moe_shapes(prefix)
        shapes[f"{prefix}.ffn_norm.weight"] = shapes.pop(f"{prefix}.post_attention_layernorm.weight")
        return shapes
