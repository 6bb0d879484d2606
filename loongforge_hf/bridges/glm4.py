"""Glm4ForCausalLM (GLM-4-9B / 32B-0414, GLM-Z1): the Llama layout with q / k / v biases, gate and up packed in one
``gate_up_proj``, half of each head rotated in interleaved pairs, and a norm after the attention and after the MLP
as well as before them: GLM-4-9B's ``GlmForCausalLM`` (glm.py) with two more norms.

Choices:
- Rotary, biases and ``gate_up_proj`` as ``GlmBridge``'s: ``partial_rotary_factor`` (0.5) is megatron's
  ``rotary_percent`` and the interleaved pairs its ``rotary_interleaved``.
- ``post_self_attn_layernorm`` / ``post_mlp_layernorm`` normalise the attention's and the MLP's outputs before the
  residual adds (``layer_outputs.transformed_attention`` / ``transformed_mlp``, as Gemma 2's post norms);
  ``post_attention_layernorm`` is the pre-MLP norm.
"""

from loongforge_hf.bridges.dense import D, L
from loongforge_hf.bridges.glm import GlmBridge
from loongforge_hf.bridges.layer_outputs import transformed_attention, transformed_mlp
from loongforge_hf.bridges.mappings import Mapping, Replicated
from loongforge_hf.bridges.registry import register_bridge


@register_bridge("Glm4ForCausalLM")
class Glm4Bridge(GlmBridge):
    def attention_module(self) -> type | None:
        return transformed_attention(post_norm=True)

    def mlp_module(self) -> type | None:
        return transformed_mlp(post_norm=True)

    # ---- tensors --------------------------------------------------------------------------------------------
    def attention_mappings(self) -> list[Mapping]:
        return super().attention_mappings() + [
            Replicated(f"{D}.self_attention.post_layernorm.weight", f"{L}.post_self_attn_layernorm.weight")]

    def dense_mlp_mappings(self) -> list[Mapping]:
        return super().dense_mlp_mappings() + [
            Replicated(f"{D}.mlp.post_layernorm.weight", f"{L}.post_mlp_layernorm.weight")]

    def attention_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        return {**super().attention_shapes(prefix),
                f"{prefix}.post_self_attn_layernorm.weight": (self.hf_config.hidden_size,)}

    def dense_mlp_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        return {**super().dense_mlp_shapes(prefix),
                f"{prefix}.post_mlp_layernorm.weight": (self.hf_config.hidden_size,)}
