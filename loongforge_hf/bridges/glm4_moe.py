"""Glm4MoeForCausalLM (GLM-4.5, GLM-4.5-Air, GLM-4.6): grouped-query attention with DeepSeek-V3's mixture of experts.

Choices:
- Attention is the dense bridges' (``linear_qkv`` fused per KV group): q / k / v biases with ``attention_bias``,
  per-head q / k norms with ``use_qk_norm``, ``head_dim`` independent of hidden / heads, and partial rotary
  (``partial_rotary_factor``, 0.5 in GLM-4.5) as megatron's ``rotary_percent``: both rotate the first channels of each
  head in rotate-half pairs and pass the rest through.
- The MoE layers are DeepSeek-V3's (``deepseek.DeepseekStyleMoE``, ``deepseek.sigmoid_routing_kwargs``): sigmoid
  scores with a fixed ``e_score_correction_bias``, top-2-sum group scores, ``routed_scaling_factor``, always-on
  ``shared_experts``; the first ``first_k_dense_replace`` layers dense (``intermediate_size``); router weight and
  bias in fp32 as transformers keeps them; transformers' ``router_logits`` output.
- Multi-token-prediction layers in the checkpoint (``num_nextn_predict_layers``: ``model.layers.{num_hidden_layers +
  i}.*``) are not built: skipped on load and copied unchanged on export, as DeepSeek-V3's.
"""

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.deepseek import DeepseekStyleMoE, sigmoid_routing_kwargs
from loongforge_hf.bridges.registry import register_bridge


@register_bridge("Glm4MoeForCausalLM")
class Glm4MoeBridge(DeepseekStyleMoE):
    expert_bias = True

    def __init__(self, hf_config) -> None:
        self.qkv_bias = bool(getattr(hf_config, "attention_bias", False))
        self.qk_norm = bool(getattr(hf_config, "use_qk_norm", False))
        super().__init__(hf_config)

    def rope_parameters(self) -> dict:
        return C.rope_parameters(self.hf_config, partial_rotary=True, extra_types=self.extra_rope_types)

    def routing_kwargs(self) -> dict:
        return sigmoid_routing_kwargs(self.hf_config)
