"""StableLmForCausalLM (Stability AI's StableLM-3B-4E1T, StableLM Zephyr 3B, StableLM 2 1.6B / 12B and their
fine-tunes): Llama's gated MLP and grouped-query attention with LayerNorms, a quarter of each head rotated, and in
StableLM 2 12B per-head q / k norms and the attention and the MLP side by side.

Choices:
- Norms are LayerNorms with weight and bias (``layer_norm_eps``): megatron's ``normalization="LayerNorm"``, our
  ``kernels.layernorm.LayerNorm`` (sequence parallel as StarCoder2's). The MLP is Llama's (``gate_proj`` /
  ``up_proj`` / ``down_proj`` without biases, ``hidden_act``), ``o_proj`` has no bias.
- ``use_qkv_bias`` (StableLM 2 1.6B: on) puts biases on q / k / v only: megatron's ``add_qkv_bias``, fused into
  ``linear_qkv``'s as Qwen2's.
- ``partial_rotary_factor`` (0.25) is megatron's ``rotary_percent``: both rotate the first ``int(head_dim * factor)``
  channels of each head in rotate-half pairs. Plain rope and llama3 scaling; other rope types are refused (no
  StableLM checkpoint uses one).
- ``use_parallel_residual`` (StableLM 2 12B): ``x + attn(ln(x)) + mlp(ln(x))`` with the one ``input_layernorm``
  (transformers builds no ``post_attention_layernorm`` then): the spec's ``SharedNormParallelLayer``
  (``kernels/specs.py``); off, megatron's sequential layer with ``post_attention_layernorm`` as its pre-MLP norm.
- ``qk_layernorm`` (StableLM 2 12B): one ``nn.LayerNorm`` without bias per head over its channels (``q_layernorm.
  norms.{h}``, ``k_layernorm.norms.{h}`` for the KV heads), before the rotation: Cohere's ``per_head_layer_norm`` in
  megatron's q / k norm slots, its ``[heads, head_dim]`` weight stacked from the heads' tensors
  (``per_head_mappings.PerHeadStack``) and split over TP with the heads; megatron's ``qk_layernorm`` stays off (no
  sum of those slices' grads over TP), as Cohere's. Computed in fp32 and rounded once: transformers' ``nn.LayerNorm``
  in fp32 alike, the same up to fp32 rounding in bf16.
- Dropouts: ``hidden_dropout`` drops the MLP's output only, not the attention's (transformers' ``self.dropout`` in
  both layer kinds): megatron's ``hidden_dropout`` (both sublayers) stays 0 and the MLP drops its own output
  (``dropped_mlp``: an ``nn.Dropout`` after ``linear_fc2``, before megatron's add); the embedding output is not
  dropped. ``attention_dropout`` through the shared table.
- Names: Llama's (``model.*``, ``lm_head``; ``tie_word_embeddings`` shares the embedding), the norms' biases beside
  their weights.
"""

from __future__ import annotations

import functools

import torch

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.cohere import per_head_layer_norm
from loongforge_hf.bridges.dense import D, L, DenseBridge
from loongforge_hf.bridges.mappings import Mapping, Replicated
from loongforge_hf.bridges.per_head_mappings import PerHeadStack
from loongforge_hf.bridges.registry import register_bridge

STABLELM_FIELDS = C.fields_with_eps("layer_norm_eps")


@functools.cache
def dropped_mlp(p: float) -> type:
    """The dense spec's ``SwiGLUMLP`` with its output (and ``linear_fc2``'s bias, where it has one) dropped with
    probability ``p`` (``nn.Dropout``, so ``static_cache`` sees that a forward in training mode draws random
    numbers)."""
    from loongforge_hf.kernels.specs import SwiGLUMLP

    class DroppedMLP(SwiGLUMLP):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.output_dropout = torch.nn.Dropout(p)

        def forward(self, *args, **kwargs):
            out, bias = super().forward(*args, **kwargs)
            if bias is not None:  # NOTE: Persimmon's fc2 bias, dropped with the output (StableLM's MLP has none)
                out, bias = out + bias, None
            return self.output_dropout(out), bias

    return DroppedMLP


@register_bridge("StableLmForCausalLM")
class StableLmBridge(DenseBridge):
    config_fields = STABLELM_FIELDS
    extra_rope_types = ()

    def __init__(self, hf_config) -> None:
        self.qkv_bias = bool(getattr(hf_config, "use_qkv_bias", False))
        super().__init__(hf_config)

    @property
    def parallel_residual(self) -> str | None:
        return "shared" if getattr(self.hf_config, "use_parallel_residual", False) else None

    @property
    def per_head_qk_norm(self) -> bool:
        return bool(getattr(self.hf_config, "qk_layernorm", False))

    def rope_parameters(self) -> dict:
        return C.rope_parameters(self.hf_config, partial_rotary=True, extra_types=self.extra_rope_types)

    def transformer_config_kwargs(self) -> dict:
        return {**super().transformer_config_kwargs(), "normalization": "LayerNorm"}

    def qk_module(self) -> tuple[type, type] | None:
        return (per_head_layer_norm("q"), per_head_layer_norm("k")) if self.per_head_qk_norm else None

    def mlp_module(self) -> type | None:
        p = C.dropout_of(self.hf_config, "hidden_dropout")
        return dropped_mlp(p) if p else None

    # ---- tensors --------------------------------------------------------------------------------------------
    def _heads(self) -> tuple[int, int]:
        c = self.hf_config
        return c.num_attention_heads, getattr(c, "num_key_value_heads", None) or c.num_attention_heads

    def attention_mappings(self) -> list[Mapping]:
        maps = [*super().attention_mappings(),
                Replicated(f"{D}.input_layernorm.bias", f"{L}.input_layernorm.bias")]
        if self.per_head_qk_norm:
            heads, kv = self._heads()
            maps += [PerHeadStack(f"{D}.self_attention.q_layernorm.weight",
                                  f"{L}.self_attn.q_layernorm.norms.{{head}}.weight", heads=heads),
                     PerHeadStack(f"{D}.self_attention.k_layernorm.weight",
                                  f"{L}.self_attn.k_layernorm.norms.{{head}}.weight", heads=kv)]
        return maps

    def dense_mlp_mappings(self) -> list[Mapping]:
        maps = super().dense_mlp_mappings()
        if self.parallel_residual:
            return maps[1:]  # NOTE: no post-attention norm: the MLP reads the input norm's output
        return [*maps, Replicated(f"{D}.pre_mlp_layernorm.bias", f"{L}.post_attention_layernorm.bias")]

    def final_mappings(self) -> list[Mapping]:
        return [*super().final_mappings(), Replicated("decoder.final_layernorm.bias", "model.norm.bias")]

    def attention_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        shapes = super().attention_shapes(prefix)
        shapes[f"{prefix}.input_layernorm.bias"] = (self.hf_config.hidden_size,)
        if self.per_head_qk_norm:
            heads, kv = self._heads()
            hd = C.head_dim_of(self.hf_config)
            for which, count in (("q", heads), ("k", kv)):
                shapes.update({f"{prefix}.self_attn.{which}_layernorm.norms.{h}.weight": (hd,) for h in range(count)})
        return shapes

    def dense_mlp_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        shapes = super().dense_mlp_shapes(prefix)
        if self.parallel_residual:
            shapes.pop(f"{prefix}.post_attention_layernorm.weight")
        else:
            shapes[f"{prefix}.post_attention_layernorm.bias"] = (self.hf_config.hidden_size,)
        return shapes

    def expected_hf_shapes(self) -> dict[str, tuple[int, ...]]:
        return {**super().expected_hf_shapes(), "model.norm.bias": (self.hf_config.hidden_size,)}
