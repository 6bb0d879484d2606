"""Glm4ForCausalLM (GLM-4-9B / 32B-0414, GLM-Z1): the Llama layout with q / k / v biases, gate and up packed in one
``gate_up_proj``, half of each head rotated in interleaved pairs, and a norm after the attention and after the MLP
as well as before them.

Choices:
- ``partial_rotary_factor`` (0.5) is megatron's ``rotary_percent`` and the interleaved pairs its
  ``rotary_interleaved``: transformers' GLM-4 rotates channel pairs ``(2i, 2i + 1)`` of the first half of each head by
  frequency ``i`` (its ``cos[..., :d / 2].repeat_interleave(2)``) and passes the rest through, as megatron's own rotary
  path does with both set.
- ``post_self_attn_layernorm`` / ``post_mlp_layernorm`` normalise the attention's and the MLP's outputs before the
  residual adds (``layer_outputs.transformed_attention`` / ``transformed_mlp``, as Gemma 2's post norms);
  ``post_attention_layernorm`` is the pre-MLP norm.
- ``gate_up_proj`` loads into megatron's fused ``linear_fc1`` (``PackedGatedMLP``, as Phi-3's).
"""

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.dense import D, L, DenseBridge
from loongforge_hf.bridges.layer_outputs import transformed_attention, transformed_mlp
from loongforge_hf.bridges.mappings import Mapping, Replicated, RowParallel
from loongforge_hf.bridges.packed_mappings import PackedGatedMLP
from loongforge_hf.bridges.registry import register_bridge


@register_bridge("Glm4ForCausalLM")
class Glm4Bridge(DenseBridge):
    qkv_bias_always = False  # NOTE: True: q / k / v biases whatever the config says (GLM-4.1V's decoder)

    def __init__(self, hf_config) -> None:
        self.qkv_bias = self.qkv_bias_always or bool(getattr(hf_config, "attention_bias", False))
        super().__init__(hf_config)

    def rope_parameters(self) -> dict:
        return C.rope_parameters(self.hf_config, partial_rotary=True, extra_types=self.extra_rope_types)

    def transformer_config_kwargs(self) -> dict:
        return {**super().transformer_config_kwargs(), "rotary_interleaved": True}

    def attention_module(self) -> type | None:
        return transformed_attention(post_norm=True)

    def mlp_module(self) -> type | None:
        return transformed_mlp(post_norm=True)

    # ---- tensors --------------------------------------------------------------------------------------------
    def attention_mappings(self) -> list[Mapping]:
        return super().attention_mappings() + [
            Replicated(f"{D}.self_attention.post_layernorm.weight", f"{L}.post_self_attn_layernorm.weight")]

    def dense_mlp_mappings(self) -> list[Mapping]:
        return [Replicated(f"{D}.pre_mlp_layernorm.weight", f"{L}.post_attention_layernorm.weight"),
                PackedGatedMLP(f"{D}.mlp.linear_fc1.weight", f"{L}.mlp.gate_up_proj.weight",
                               intermediate_size=self.hf_config.intermediate_size),
                RowParallel(f"{D}.mlp.linear_fc2.weight", f"{L}.mlp.down_proj.weight"),
                Replicated(f"{D}.mlp.post_layernorm.weight", f"{L}.post_mlp_layernorm.weight")]

    def attention_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        return {**super().attention_shapes(prefix),
                f"{prefix}.post_self_attn_layernorm.weight": (self.hf_config.hidden_size,)}

    def dense_mlp_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        h, f = self.hf_config.hidden_size, self.hf_config.intermediate_size
        return {f"{prefix}.post_attention_layernorm.weight": (h,), f"{prefix}.mlp.gate_up_proj.weight": (2 * f, h),
                f"{prefix}.mlp.down_proj.weight": (h, f), f"{prefix}.post_mlp_layernorm.weight": (h,)}
