"""OlmoeForCausalLM (AllenAI's OLMoE-1B-7B-0924 / -0125 and their -Instruct): the Llama layout (pre-norm layers) with
OLMo 2's q / k norms over all heads and a softmax top-k mixture of experts in every layer.

Choices:
- q / k norms over the whole projection (``q_norm`` ``[heads * head_dim]``, ``k_norm`` ``[kv heads * head_dim]``), as
  OLMo 2's: ``olmo2.full_width_norm`` in megatron's q / k norm slots, split over TP like the heads (each rank's sum of
  squares added up over the group), megatron's ``qk_layernorm`` off. OLMoE's norm rounds as Llama's (the normalised
  input to the input dtype, then the weight multiply): ``round_first``. transformers sizes ``q_norm`` by
  ``hidden_size``, so a ``head_dim`` other than ``hidden_size / heads`` is refused.
- ``clip_qkv`` (q and k clamped after their norms, v after its projection) is refused: the hub's OLMoE checkpoints
  set none. ``attention_bias`` and sliding windows are refused by the shared dense checks; rope: plain or llama3
  (an attention factor, YaRN's, would need the norm slots these norms take).
- Every layer sparse: ``num_experts`` experts of ``intermediate_size``, top ``num_experts_per_tok`` of the softmax
  (renormalised with ``norm_topk_prob``, off in the hub's models: megatron's ``moe_router_pre_softmax``), the router
  in the model's dtype; no shared experts. Qwen3-MoE's routing, transformers' ``router_logits`` and balancing loss
  (``output_router_logits``, ``router_aux_loss_coef``).
- On disk the experts are one tensor per expert and projection (``mlp.experts.{e}.gate_proj.weight``: the hub's files,
  and what transformers' ``save_pretrained`` writes from its stacked ``gate_up_proj``), read and written so.
"""

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.moe import MoEBridge
from loongforge_hf.bridges.olmo2 import FullWidthQKNorms
from loongforge_hf.bridges.registry import register_bridge


@register_bridge("OlmoeForCausalLM")
class OlmoeBridge(FullWidthQKNorms, MoEBridge):
    extra_rope_types = ()
    hf_balance_loss = True
    hf_router_logits = True

    # ---- config ---------------------------------------------------------------------------------------------
    def check_config(self) -> None:
        c = self.hf_config
        if getattr(c, "clip_qkv", None) is not None:
            raise C.UnsupportedConfigError(f"clip_qkv={c.clip_qkv} is not supported (only None, as the hub's OLMoE).")
        if C.head_dim_of(c) * c.num_attention_heads != c.hidden_size:
            raise C.UnsupportedConfigError(f"head_dim={C.head_dim_of(c)} is not supported: OLMoE's q_norm spans "
                                           f"hidden_size={c.hidden_size}, so head_dim must be hidden_size / heads.")
        super().check_config()

    def num_experts(self) -> int:
        return self.hf_config.num_experts

    def expert_ffn_size(self) -> int:
        return self.hf_config.intermediate_size

    def is_moe_layer(self, layer: int) -> bool:
        return True

    def routing_kwargs(self) -> dict:
        if self.num_experts() <= 0:
            raise C.UnsupportedConfigError(f"num_experts={self.num_experts()}: OLMoE needs at least one expert.")
        return {"moe_router_score_function": "softmax", "moe_router_pre_softmax": not self.hf_config.norm_topk_prob}
