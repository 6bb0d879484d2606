"""NemotronForCausalLM (NVIDIA's Nemotron-3 8B, Nemotron-4 Minitron 4B / 8B, Nemotron-Mini-4B, Mistral-NeMo-Minitron
8B in transformers' format): Llama's attention with an ungated squared-ReLU MLP, LayerNorms whose weight is stored
minus one, and half of each head rotated.

Choices:
- ``NemotronLayerNorm1P`` (input, pre-MLP and final norms): a LayerNorm with weight and bias that scales by
  ``weight + 1`` (``norm_eps``): megatron's ``normalization="LayerNorm"`` with ``layernorm_zero_centered_gamma``, our
  ``kernels.layernorm.LayerNorm`` (which adds the one in the weight's dtype, as transformers does; sequence parallel
  as StarCoder2's norms). The checkpoint's tensors are megatron's as they are (both store ``gamma - 1``).
- The MLP is ``down_proj(relu2(up_proj(x)))`` without a gate: megatron's ``MLP`` without ``gated_linear_unit``,
  ``up_proj`` as its ``linear_fc1`` (``ArceeBridge``'s), ``hidden_act`` (``relu2``) through the shared table.
- ``partial_rotary_factor`` (0.5; transformers' default for Nemotron) is megatron's ``rotary_percent``: both rotate
  the first ``int(head_dim * factor)`` channels of each head in rotate-half pairs. Plain rope and llama3 scaling;
  rope types with an attention factor are refused (no Nemotron checkpoint uses one). ``head_dim`` may differ from
  ``hidden_size / num_attention_heads`` (Minitron-8B's 128 for 48 heads of a 4096-wide model): megatron's
  ``kv_channels``.
- ``attention_bias`` / ``mlp_bias`` (off in every hub checkpoint) are refused by the shared dense checks.
- Names: Llama's (``model.*``, ``lm_head``; ``tie_word_embeddings`` shares the embedding), the norms' biases beside
  their weights.
"""

from __future__ import annotations

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.arcee import ArceeBridge
from loongforge_hf.bridges.dense import D, L
from loongforge_hf.bridges.mappings import Mapping, Replicated
from loongforge_hf.bridges.registry import register_bridge

NEMOTRON_FIELDS = C.fields_with_eps("norm_eps")


@register_bridge("NemotronForCausalLM")
class NemotronBridge(ArceeBridge):
    config_fields = NEMOTRON_FIELDS
    extra_rope_types = ()

    def rope_parameters(self) -> dict:
        return C.rope_parameters(self.hf_config, partial_rotary=True, extra_types=self.extra_rope_types)

    def transformer_config_kwargs(self) -> dict:
        return {**super().transformer_config_kwargs(), "normalization": "LayerNorm",
                "layernorm_zero_centered_gamma": True}

    # ---- tensors --------------------------------------------------------------------------------------------
    def attention_mappings(self) -> list[Mapping]:
        return [*super().attention_mappings(), Replicated(f"{D}.input_layernorm.bias", f"{L}.input_layernorm.bias")]

    def dense_mlp_mappings(self) -> list[Mapping]:
        return [*super().dense_mlp_mappings(),
                Replicated(f"{D}.pre_mlp_layernorm.bias", f"{L}.post_attention_layernorm.bias")]

    def final_mappings(self) -> list[Mapping]:
        return [*super().final_mappings(), Replicated("decoder.final_layernorm.bias", "model.norm.bias")]

    def attention_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        return {**super().attention_shapes(prefix), f"{prefix}.input_layernorm.bias": (self.hf_config.hidden_size,)}

    def dense_mlp_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        return {**super().dense_mlp_shapes(prefix),
                f"{prefix}.post_attention_layernorm.bias": (self.hf_config.hidden_size,)}

    def expected_hf_shapes(self) -> dict[str, tuple[int, ...]]:
        return {**super().expected_hf_shapes(), "model.norm.bias": (self.hf_config.hidden_size,)}
