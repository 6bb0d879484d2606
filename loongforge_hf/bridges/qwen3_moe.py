"""Qwen3MoeForCausalLM: Qwen3 attention (q/k norms) with softmax top-k experts; ``mlp_only_layers`` and
``decoder_sparse_step`` make some layers dense (those use ``intermediate_size``, experts ``moe_intermediate_size``)."""

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.moe import MoEBridge
from loongforge_hf.bridges.registry import register_bridge


@register_bridge("Qwen3MoeForCausalLM")
class Qwen3MoeBridge(MoEBridge):
    qk_norm = True
    hf_balance_loss = True
    hf_router_logits = True

    def num_experts(self) -> int:
        return self.hf_config.num_experts

    def is_moe_layer(self, layer: int) -> bool:
        c = self.hf_config
        return (layer not in (c.mlp_only_layers or []) and c.num_experts > 0
                and (layer + 1) % c.decoder_sparse_step == 0)

    def routing_kwargs(self) -> dict:
        if self.num_experts() <= 0:
            raise C.UnsupportedConfigError("num_experts=0: use Qwen3ForCausalLM for a model without experts.")
        return {"moe_router_score_function": "softmax", "moe_router_pre_softmax": not self.hf_config.norm_topk_prob}
