"""Mistral4ForCausalLM (Mistral Small 4): DeepSeek-V3's multi-latent attention with softmax routing and Llama 4's
query scale.

Choices:
- Attention, shared experts, dense first layers (``first_k_dense_replace``, 0 in Mistral Small 4) and the names on
  disk are DeepSeek-V3's (``deepseek.DeepseekBridge``): q_lora_rank, rotary pairs interleaved on disk unless
  ``rope_interleave=False``, plain rope or YaRN. transformers' rotary table covers ``head_dim * partial_rotary_factor``
  dims (``head_dim`` is the whole query head here), which must be ``qk_rope_head_dim``
  (``config_map._check_mla_rotary_dim``).
- Routing: softmax over all experts, top-k, renormalised with ``norm_topk_prob`` (megatron's softmax over the k
  chosen logits: the same probabilities) or not (``moe_router_pre_softmax``), times ``routed_scaling_factor``; no
  expert bias; the router in the model's dtype. Expert groups (``n_group`` / ``topk_group``, scored by their top-2
  softmax scores) only without ``norm_topk_prob``: megatron groups the renormalised path by logits, not scores
  (refused by name). ``router_logits`` as transformers returns them, no balancing loss.
- Routed experts stacked on disk as transformers holds them (it has no per-expert names for Mistral 4):
  ``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` with ``[gate; up]`` rows and ``mlp.experts.down_proj`` ``[E, H, I]``
  (``stacked_experts.py``, GraniteMoE's layout); shared experts and dense layers as DeepSeek's.
- Llama 4's query scale ``1 + llama_4_scaling_beta * log(1 + floor(position / original_max_position_embeddings))``
  is 1 below ``original_max_position_embeddings`` (8192 in Mistral Small 4) and not built: a forward or training
  batch with positions from there on is refused, naming the field (``mistral.Llama4QueryScale``).
"""

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.deepseek import DeepseekBridge
from loongforge_hf.bridges.dense import L
from loongforge_hf.bridges.mappings import Mapping
from loongforge_hf.bridges.mistral import Llama4QueryScale
from loongforge_hf.bridges.moe import grouped_routing_kwargs
from loongforge_hf.bridges.registry import register_bridge
from loongforge_hf.bridges.stacked_experts import StackedDown, StackedGateUp, routed_stack


@register_bridge("Mistral4ForCausalLM")
class Mistral4Bridge(Llama4QueryScale, DeepseekBridge):
    router_fp32 = False                                        # transformers keeps gate.weight in the model dtype

    def __init__(self, hf_config) -> None:
        self.interleaved_rope_on_disk = bool(getattr(hf_config, "rope_interleave", True))
        super().__init__(hf_config)

    def routing_kwargs(self) -> dict:
        c = self.hf_config
        groups = grouped_routing_kwargs(num_experts=c.n_routed_experts, top_k=c.num_experts_per_tok,
                                        n_group=c.n_group, topk_group=c.topk_group, group_score_top=2)
        if groups and c.norm_topk_prob:
            raise C.UnsupportedConfigError(
                f"n_group={c.n_group} / topk_group={c.topk_group} with norm_topk_prob=True is not supported (megatron "
                "picks the groups of the renormalised softmax by logits, this model by softmax scores).")
        return {"moe_router_score_function": "softmax", "moe_router_pre_softmax": not c.norm_topk_prob,
                "moe_router_topk_scaling_factor": c.routed_scaling_factor, **groups}

    def moe_mappings(self) -> list[Mapping]:
        routed = [routed_stack(self, cls, name, f"{L}.mlp.experts.{hf}") for cls, name, hf in (
            (StackedGateUp, "linear_fc1.weight", "gate_up_proj"), (StackedDown, "linear_fc2.weight", "down_proj"))]
        return [m for m in super().moe_mappings() if ".mlp.experts." not in m.megatron] + routed

    def moe_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        h, f, n = self.hf_config.hidden_size, self.expert_ffn_size(), self.num_experts()
        shapes = {k: v for k, v in super().moe_shapes(prefix).items() if ".mlp.experts." not in k}
        return {**shapes, f"{prefix}.mlp.experts.gate_up_proj": (n, 2 * f, h),
                f"{prefix}.mlp.experts.down_proj": (n, h, f)}
