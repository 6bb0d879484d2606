"""Glm4MoeLiteForCausalLM (GLM-4.7-Flash): DeepSeek-V3's multi-latent attention and mixture of experts, GLM's names.

Choices:
- Everything but two fields is DeepSeek-V3's bridge (``deepseek.DeepseekV3Bridge``): MLA with q_lora_rank, rotary
  pairs interleaved on disk unless ``rope_interleave=False``, sigmoid routing with a fixed ``e_score_correction_bias``,
  top-2-sum groups, ``routed_scaling_factor``, shared experts, the router in fp32, ``router_logits``, the checkpoint's
  multi-token-prediction layers (``model.layers.{num_hidden_layers}.*``) passed through.
- Dense or sparse per layer from ``mlp_layer_types`` (any pattern; transformers reads no ``first_k_dense_replace``).
- ``rms_norm_eps`` (1e-5 in GLM-4.7-Flash) for the layer and final norms; the q / kv latent norms keep 1e-6, as
  transformers builds them (``specs.LatentRMSNorm``).
"""

from loongforge_hf.bridges.deepseek import DeepseekV3Bridge
from loongforge_hf.bridges.layer_types import check_mlp_layer_types
from loongforge_hf.bridges.registry import register_bridge


@register_bridge("Glm4MoeLiteForCausalLM")
class Glm4MoeLiteBridge(DeepseekV3Bridge):
    def check_config(self) -> None:
        check_mlp_layer_types(self.hf_config)
        super().check_config()

    def is_moe_layer(self, layer: int) -> bool:
        return self.hf_config.mlp_layer_types[layer] == "sparse"
