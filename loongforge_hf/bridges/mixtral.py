"""MixtralForCausalLM: Mistral attention, every layer a softmax top-k mixture (always renormalised). On disk the
sparse block is ``block_sparse_moe`` with experts ``w1`` (gate), ``w3`` (up), ``w2`` (down)."""

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.moe import MoEBridge
from loongforge_hf.bridges.registry import register_bridge


@register_bridge("MixtralForCausalLM")
class MixtralBridge(MoEBridge):
    supports_sliding_window = True
    hf_balance_loss = True
    hf_router_logits = True
    sparse_block = "block_sparse_moe"
    expert_projections = ("w1", "w3", "w2")

    def num_experts(self) -> int:
        return self.hf_config.num_local_experts

    def expert_ffn_size(self) -> int:
        return self.hf_config.intermediate_size

    def is_moe_layer(self, layer: int) -> bool:
        return True

    def routing_kwargs(self) -> dict:
        jitter = getattr(self.hf_config, "router_jitter_noise", 0.0)
        if jitter:
            # NOTE: transformers jitters the whole MoE input in training only; megatron's moe_input_jitter_eps jitters
            # the router input alone, in eval too.
            raise C.UnsupportedConfigError(f"router_jitter_noise={jitter} is not supported (only 0).")
        return {"moe_router_score_function": "softmax", "moe_router_pre_softmax": False}
