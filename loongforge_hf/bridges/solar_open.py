"""SolarOpenForCausalLM (Upstage's Solar Open): Llama's grouped-query attention with GLM-4.5's mixture of experts in
every layer.

Choices:
- Attention is the dense bridges' (``linear_qkv`` fused per KV group): q / k / v biases with ``attention_bias``,
  none on ``o_proj``; ``head_dim`` independent of hidden / heads; no q / k norms. Every channel of a head rotates:
  transformers' Solar Open applies Llama's full-width rotation, so ``partial_rotary_factor`` other than 1 (which
  transformers' rotary table would honour and its attention could not apply) is refused.
- Every layer is sparse (the config has no ``intermediate_size`` nor ``first_k_dense_replace``): DeepSeek-V3's
  experts (``deepseek.DeepseekStyleMoE``, ``deepseek.sigmoid_routing_kwargs``): sigmoid scores with a fixed
  ``e_score_correction_bias``, top-2-sum group scores, ``routed_scaling_factor``, ``n_shared_experts`` always-on
  experts; router weight and bias in fp32 as transformers keeps them; transformers' ``router_logits``, no balancing
  loss (transformers adds none).
"""

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.deepseek import DeepseekStyleMoE, sigmoid_routing_kwargs
from loongforge_hf.bridges.registry import register_bridge


@register_bridge("SolarOpenForCausalLM")
class SolarOpenBridge(DeepseekStyleMoE):
    expert_bias = True
    # NOTE: no intermediate_size (no dense layer): megatron's dense width stays its default, unused
    config_fields = tuple(f for f in C.DENSE_FIELDS if f.hf != "intermediate_size")

    def __init__(self, hf_config) -> None:
        self.qkv_bias = bool(getattr(hf_config, "attention_bias", False))
        super().__init__(hf_config)

    def is_moe_layer(self, layer: int) -> bool:
        return True

    def routing_kwargs(self) -> dict:
        return sigmoid_routing_kwargs(self.hf_config)
