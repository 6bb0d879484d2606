"""Qwen2MoeForCausalLM (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2 attention (q/k/v biases) with Qwen3-MoE's softmax top-k
experts (``decoder_sparse_step`` / ``mlp_only_layers``, ``norm_topk_prob``, transformers' balancing loss) plus one
always-on ``shared_expert`` scaled per token by ``sigmoid(shared_expert_gate(x))``: megatron's shared experts with
``moe_shared_expert_gate`` (its ``gate_weight`` [1, H], the same sigmoid of the same product)."""

from loongforge_hf.bridges.qwen3_moe import Qwen3MoeBridge
from loongforge_hf.bridges.registry import register_bridge


@register_bridge("Qwen2MoeForCausalLM")
class Qwen2MoeBridge(Qwen3MoeBridge):
    qk_norm = False
    shared_experts = "shared_expert"
    shared_expert_gate = "shared_expert_gate"

    def __init__(self, hf_config) -> None:
        self.qkv_bias = bool(getattr(hf_config, "qkv_bias", True))
        super().__init__(hf_config)

    def shared_ffn_size(self) -> int:
        return self.hf_config.shared_expert_intermediate_size
