"""OlmoForCausalLM (AllenAI's OLMo-1B / 7B, OLMo-7B-0424 / 0724 and their fine-tunes in transformers' format): the
Llama layout with norms that have no parameters, and q / k / v clamped after their projections.

Choices:
- ``OlmoLayerNorm`` (input, pre-MLP and final norms): a LayerNorm with neither weight nor bias, eps 1e-5 (fixed: the
  config has no field for it), computed in fp32 and rounded once: megatron's ``normalization="LayerNorm"`` built as
  our ``kernels.layernorm.LayerNormWithoutParameters`` (``norm_weight = False``). No norm tensor is read or written.
- ``clip_qkv`` (OLMo-7B-0424 / 0724: 8.0): transformers clamps the q, k and v projections' outputs to
  ``[-clip_qkv, clip_qkv]`` before the rotation; megatron has no such option, so the attention is megatron's
  ``SelfAttention`` with its q / k / v clamped as they leave ``get_query_key_value_tensors`` (``clipped_attention``:
  after ``linear_qkv`` and any LoRA terms on it, before the rotary embedding, the KV cache and the core attention).
  The clamp is elementwise, so clamping the split heads equals clamping each projection; its gradient is the
  clamp's (zero where it bound), as transformers'. Refused where that method would apply a q / k norm slot module
  before the clamp (a rope type with an attention factor, YaRN: transformers clamps before it).
- ``attention_bias=True`` is refused: OLMo puts it on o_proj as well, while the MLP has none, and megatron's output
  projection has a bias exactly when the MLP's linears do (``add_bias_linear``). No OLMo checkpoint sets it.
- Rope: transformers' OLMo rotates in fp32 (cos / sin in fp32, q / k rounded back after); megatron in the
  activations' dtype: the same in fp32, one bf16 rounding apart in bf16.
- Names: Llama's (``model.*``, ``lm_head``; ``tie_word_embeddings`` shares the embedding); no ``*layernorm*`` or
  ``model.norm`` tensors.
"""

from __future__ import annotations

import functools

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.dense import DenseBridge
from loongforge_hf.bridges.mappings import Mapping, VocabParallel
from loongforge_hf.bridges.registry import register_bridge

# NOTE: OLMo's norms take a fixed eps (OlmoLayerNorm's 1e-5); its config has no rms_norm_eps
OLMO_FIELDS = tuple(f for f in C.DENSE_FIELDS if f.hf != "rms_norm_eps")
OLMO_NORM_EPS = 1e-5


@functools.cache
def clipped_attention(clip: float) -> type:
    """megatron's ``SelfAttention`` whose q / k / v are clamped to ``[-clip, clip]`` after their projection."""
    import torch
    from megatron.core.transformer.attention import SelfAttention

    class ClippedSelfAttention(SelfAttention):
        def get_query_key_value_tensors(self, *args, **kwargs):
            # NOTE: (query, key, value), or (mixed_qkv, split sizes) with split_qkv=False: clamp every tensor
            return tuple(t.clamp(min=-clip, max=clip) if isinstance(t, torch.Tensor) else t
                         for t in super().get_query_key_value_tensors(*args, **kwargs))

    return ClippedSelfAttention


def _without_norms(maps: list[Mapping]) -> list[Mapping]:
    """The Llama mappings less the input / pre-MLP norms' weights (OLMo's norms have none)."""
    return [m for m in maps if not m.megatron.endswith(("input_layernorm.weight", "pre_mlp_layernorm.weight"))]


@register_bridge("OlmoForCausalLM")
class OlmoBridge(DenseBridge):
    config_fields = OLMO_FIELDS
    norm_weight = False

    def check_config(self) -> None:
        if getattr(self.hf_config, "attention_bias", False):
            raise C.UnsupportedConfigError(
                "attention_bias=True is not supported for OlmoForCausalLM: it puts a bias on o_proj while the MLP has "
                "none, and megatron's attention output projection has a bias exactly when the MLP's linears do "
                "(add_bias_linear).")
        super().check_config()
        clip = getattr(self.hf_config, "clip_qkv", None)
        if clip is None:
            return
        if isinstance(clip, bool) or not isinstance(clip, (int, float)) or not clip > 0:
            raise C.UnsupportedConfigError(f"clip_qkv={clip!r}: expected None or a positive number.")
        if self.qk_module() is not None:
            raise C.UnsupportedConfigError(
                f"clip_qkv={clip} with rope_parameters.rope_type={self.rope_parameters()['rope_type']!r} is not "
                "supported: its attention factor would scale q / k before the clamp (transformers clamps first).")

    def transformer_config_kwargs(self) -> dict:
        return {**super().transformer_config_kwargs(), "normalization": "LayerNorm",
                "layernorm_epsilon": OLMO_NORM_EPS}

    def attention_module(self) -> type | None:
        clip = getattr(self.hf_config, "clip_qkv", None)
        return None if clip is None else clipped_attention(float(clip))

    # ---- tensors --------------------------------------------------------------------------------------------
    def attention_mappings(self) -> list[Mapping]:
        return _without_norms(super().attention_mappings())

    def dense_mlp_mappings(self) -> list[Mapping]:
        return _without_norms(super().dense_mlp_mappings())

    def final_mappings(self) -> list[Mapping]:
        return [] if self.tied else [VocabParallel("output_layer.weight", "lm_head.weight")]

    def attention_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        shapes = super().attention_shapes(prefix)
        shapes.pop(f"{prefix}.input_layernorm.weight")
        return shapes

    def dense_mlp_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        shapes = super().dense_mlp_shapes(prefix)
        shapes.pop(f"{prefix}.post_attention_layernorm.weight")
        return shapes

    def expected_hf_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = super().expected_hf_shapes()
        shapes.pop("model.norm.weight")
        return shapes
