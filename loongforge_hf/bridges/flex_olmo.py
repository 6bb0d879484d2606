"""FlexOlmoForCausalLM (AllenAI's FlexOlmo-7x7B): OLMo 2's layer (no input / pre-MLP norms, the attention's and the
MLP's outputs normalised before the residual adds, q / k norms over all heads) with OLMoE's mixture of experts in
every layer.

Choices:
- Attention: OLMo 2's (``olmo2.py``): ``post_attention_layernorm`` on its output (``transformed_attention``), q / k
  norms over the whole projection with OLMo 2's numerics (one rounding: ``full_width_norm`` without
  ``round_first``), split over TP like the heads.
- MoE: OLMoE's (``olmoe.py``): ``num_experts`` experts of ``intermediate_size``, top ``num_experts_per_tok`` of the
  softmax (renormalised with ``norm_topk_prob``), one tensor per expert on disk, transformers' ``router_logits`` and
  balancing loss; its output normalised by ``post_feedforward_layernorm`` before the residual add
  (``layer_outputs.transformed_moe``, megatron's ``MoELayer`` otherwise).
- The post norms use Llama's numerics (the normalised input rounded before the weight multiply), as OLMo 2's here:
  the same in fp32, one bf16 rounding apart in bf16. Refused as OLMoE's: ``clip_qkv``, ``attention_bias``, sliding
  windows; rope plain or llama3.
"""

from loongforge_hf.bridges.dense import D, L
from loongforge_hf.bridges.layer_outputs import transformed_attention, transformed_moe
from loongforge_hf.bridges.mappings import Mapping, Replicated
from loongforge_hf.bridges.olmo2 import full_width_norm
from loongforge_hf.bridges.olmoe import OlmoeBridge
from loongforge_hf.bridges.registry import register_bridge


@register_bridge("FlexOlmoForCausalLM")
class FlexOlmoBridge(OlmoeBridge):
    pre_norms = False

    def qk_module(self) -> tuple[type, type]:
        return full_width_norm("q"), full_width_norm("k")

    def attention_module(self) -> type:
        return transformed_attention(post_norm=True)

    def moe_module(self) -> type:
        return transformed_moe(post_norm=True)

    # ---- tensors --------------------------------------------------------------------------------------------
    def attention_mappings(self) -> list[Mapping]:
        return [*(m for m in super().attention_mappings() if not m.megatron.endswith(".input_layernorm.weight")),
                Replicated(f"{D}.self_attention.post_layernorm.weight", f"{L}.post_attention_layernorm.weight")]

    def moe_mappings(self) -> list[Mapping]:
        return [*(m for m in super().moe_mappings() if not m.megatron.endswith(".pre_mlp_layernorm.weight")),
                Replicated(f"{D}.mlp.post_layernorm.weight", f"{L}.post_feedforward_layernorm.weight")]

    def attention_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        shapes = super().attention_shapes(prefix)
        norm = shapes.pop(f"{prefix}.input_layernorm.weight")
        return {**shapes, f"{prefix}.post_attention_layernorm.weight": norm}

    def moe_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        shapes = super().moe_shapes(prefix)
        norm = shapes.pop(f"{prefix}.post_attention_layernorm.weight")
        return {**shapes, f"{prefix}.post_feedforward_layernorm.weight": norm}
