"""Qwen3_5MoeForCausalLM (the text model of Qwen3.5-MoE, ``Qwen3_5MoeTextConfig``): Qwen3.5's token mixers (Gated
DeltaNet and gated full-attention layers, ``layer_types``) with a mixture of experts in every layer.

Choices:
- Token mixers, norms, rope, context parallelism and refusals are ``Qwen3_5Bridge``'s (linear heads that do not
  split over TP, the static cache, ``attention_bias``, ``hidden_act`` other than silu, unknown ``layer_types``).
- The MLP is ``Qwen3MoeBridge``'s softmax top-k experts plus Qwen2-MoE's always-on ``shared_expert`` scaled per token
  by ``sigmoid(shared_expert_gate(x))`` (megatron's gated shared experts); transformers' balancing loss
  (``output_router_logits``, ``router_aux_loss_coef``) and ``router_logits`` as Qwen3-MoE's.
- Every layer is sparse and the router always renormalises its top k (the config has no ``mlp_only_layers``,
  ``decoder_sparse_step`` or ``norm_topk_prob``): ``moe_router_pre_softmax=False``.
- Experts on disk one tensor per expert and projection (``mlp.experts.{e}.gate_proj`` ...), as transformers 5 writes
  them (its ``qwen2_moe`` conversion stacks them on load and splits them again on save).
- The hub checkpoints' multi-token-prediction tensors (``mtp.*``) pass through as Qwen3.5's.
"""

from __future__ import annotations

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.mappings import Mapping
from loongforge_hf.bridges.qwen3_5 import Qwen3_5Bridge
from loongforge_hf.bridges.qwen3_moe import Qwen3MoeBridge
from loongforge_hf.bridges.registry import register_bridge


@register_bridge("Qwen3_5MoeForCausalLM")
class Qwen3_5MoeBridge(Qwen3_5Bridge, Qwen3MoeBridge):
    shared_experts = "shared_expert"

    @property
    def config_fields(self) -> tuple[C.Field, ...]:
        # NOTE: Qwen3_5MoeTextConfig has no intermediate_size (no dense layer; Qwen3-Next's has, for its dense
        # layers): without it megatron's dense width stays its default, unused
        return tuple(f for f in C.DENSE_FIELDS if f.hf != "intermediate_size" or hasattr(self.hf_config, f.hf))
    shared_expert_gate = "shared_expert_gate"

    def shared_ffn_size(self) -> int:
        return self.hf_config.shared_expert_intermediate_size

    def is_moe_layer(self, layer: int) -> bool:
        return True

    def renormalises_top_k(self) -> bool:
        return True

    def routing_kwargs(self) -> dict:
        if self.num_experts() <= 0:
            raise C.UnsupportedConfigError(f"num_experts={self.num_experts()} is not supported for "
                                           f"{self.architectures[0]} (a model without experts).")
        return {"moe_router_score_function": "softmax", "moe_router_pre_softmax": not self.renormalises_top_k()}

    # ---- tensors --------------------------------------------------------------------------------------------
    def mlp_mappings(self, layer: int) -> list[Mapping]:
        return self.moe_mappings() if self.is_moe_layer(layer) else self.dense_mlp_mappings()

    def layer_mappings(self) -> list[Mapping]:
        return Qwen3_5Bridge.layer_mappings(self) + self.moe_mappings()

    def mappings_for_layer(self, layer: int) -> list[Mapping]:
        mixer = self.linear_attention_mappings() if layer in self.linear_layers else self.attention_mappings()
        return mixer + self.mlp_mappings(layer)

    def layer_shapes(self, layer: int) -> dict[str, tuple[int, ...]]:
        prefix = f"model.layers.{layer}"
        mixer = self.linear_attention_shapes(prefix) if layer in self.linear_layers else self.attention_shapes(prefix)
        mlp = self.moe_shapes(prefix) if self.is_moe_layer(layer) else self.dense_mlp_shapes(prefix)
        return {**mixer, **mlp}
