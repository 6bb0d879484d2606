"""GlmForCausalLM (THUDM's GLM-4-9B, GLM-4-9B-chat, -1M and their fine-tunes in transformers' format): the Llama
layout with q / k / v biases, gate and up packed in one ``gate_up_proj``, and half of each head rotated in interleaved
pairs. GLM-4-0414's ``Glm4ForCausalLM`` (glm4.py) is this with a norm after the attention and after the MLP.

Choices:
- ``partial_rotary_factor`` (0.5; transformers' default for GLM) is megatron's ``rotary_percent`` and the interleaved
  pairs its ``rotary_interleaved``: transformers' GLM rotates channel pairs ``(2i, 2i + 1)`` of the first
  ``head_dim * factor`` channels of each head by frequency ``i`` (its ``cos[..., :d / 2].repeat_interleave(2)`` and
  its ``rotate_half`` over even / odd channels) and passes the rest through, as megatron's rotary path does with both
  set. Plain rope, llama3 and YaRN scaling (the dense bridges' set).
- ``attention_bias`` (on in every GLM-4 checkpoint) puts biases on q / k / v only (``o_proj`` has none): megatron's
  ``add_qkv_bias``, fused into ``linear_qkv``'s as Qwen2's.
- ``gate_up_proj`` loads into megatron's fused ``linear_fc1`` (``PackedGatedMLP``, as Phi-3's), ``hidden_act``
  through the shared table; RMSNorms (``rms_norm_eps``) before the attention and the MLP, as Llama's.
- Names: Llama's (``model.*``, ``lm_head``; ``tie_word_embeddings`` shares the embedding).
"""

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.dense import D, L, DenseBridge
from loongforge_hf.bridges.mappings import Mapping, Replicated, RowParallel
from loongforge_hf.bridges.packed_mappings import PackedGatedMLP
from loongforge_hf.bridges.registry import register_bridge


@register_bridge("GlmForCausalLM")
class GlmBridge(DenseBridge):
    qkv_bias_always = False  # NOTE: True: q / k / v biases whatever the config says (GLM-4.1V's decoder)

    def __init__(self, hf_config) -> None:
        self.qkv_bias = self.qkv_bias_always or bool(getattr(hf_config, "attention_bias", False))
        super().__init__(hf_config)

    def rope_parameters(self) -> dict:
        return C.rope_parameters(self.hf_config, partial_rotary=True, extra_types=self.extra_rope_types)

    def transformer_config_kwargs(self) -> dict:
        return {**super().transformer_config_kwargs(), "rotary_interleaved": True}

    # ---- tensors --------------------------------------------------------------------------------------------
    def dense_mlp_mappings(self) -> list[Mapping]:
        return [Replicated(f"{D}.pre_mlp_layernorm.weight", f"{L}.post_attention_layernorm.weight"),
                PackedGatedMLP(f"{D}.mlp.linear_fc1.weight", f"{L}.mlp.gate_up_proj.weight",
                               intermediate_size=self.hf_config.intermediate_size),
                RowParallel(f"{D}.mlp.linear_fc2.weight", f"{L}.mlp.down_proj.weight")]

    def dense_mlp_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        h, f = self.hf_config.hidden_size, self.hf_config.intermediate_size
        return {f"{prefix}.post_attention_layernorm.weight": (h,), f"{prefix}.mlp.gate_up_proj.weight": (2 * f, h),
                f"{prefix}.mlp.down_proj.weight": (h, f)}
