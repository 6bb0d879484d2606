"""Dots1ForCausalLM (rednote's dots.llm1): Qwen3's grouped-query attention with DeepSeek-V3's mixture of experts.

Choices:
- Attention is Qwen3's (``linear_qkv`` fused per KV group, per-head q / k norms, megatron's ``qk_layernorm``;
  ``head_dim`` independent of hidden / heads). ``attention_bias=True`` is refused (transformers' Qwen3 attention would
  put a bias on ``o_proj`` too).
- The MoE layers are DeepSeek-V3's (``deepseek.DeepseekStyleMoE``, ``deepseek.sigmoid_routing_kwargs``): sigmoid
  scores with a fixed ``e_score_correction_bias``, top-2-sum group scores where ``n_group`` > 1 (the hub's: none),
  ``routed_scaling_factor``, always-on ``shared_experts``; the first ``first_k_dense_replace`` layers dense
  (``intermediate_size``); router weight and bias in fp32 as transformers keeps them; transformers' ``router_logits``
  output, no balancing loss (transformers adds none).
- Sliding-window layers as transformers derives them (``layer_types``: layers from ``max_window_layers`` on, when
  ``sliding_window`` is set; the hub's models have none): the window on those layers only (megatron's
  ``window_attn_skip_freq``), as Ministral's.
"""

from loongforge_hf.bridges.deepseek import DeepseekStyleMoE, sigmoid_routing_kwargs
from loongforge_hf.bridges.layer_types import WindowsByLayerType
from loongforge_hf.bridges.registry import register_bridge


@register_bridge("Dots1ForCausalLM")
class Dots1Bridge(WindowsByLayerType, DeepseekStyleMoE):
    qk_norm = True
    expert_bias = True

    def routing_kwargs(self) -> dict:
        return sigmoid_routing_kwargs(self.hf_config)
