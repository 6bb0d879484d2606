"""GemmaForCausalLM (Gemma, CodeGemma), Gemma2ForCausalLM (Gemma 2) and Gemma3ForCausalLM (Gemma 3 text models:
gemma-3-270m, gemma-3-1b; the causal-LM form of the larger ones' text part): the Llama tensor layout with Gemma's
differences.

Choices (Gemma: the zero-centred norms and the scaled embedding; Gemma 2 and 3: all of them):
- Norms store ``weight - 1`` and apply ``1 + weight`` with Gemma's numerics: megatron's
  ``layernorm_zero_centered_gamma`` on our ``RMSNorm`` (input, pre-MLP, q / k, final and the two post norms).
- Each layer normalises its attention output and its MLP output before the residual add (``post_attention_layernorm``,
  ``post_feedforward_layernorm``). megatron's ``TransformerLayer`` has no slot there; the norms live in the attention
  and MLP modules (``layer_outputs.transformed_attention`` / ``transformed_mlp``), applied to their outputs after
  ``linear_proj`` / ``linear_fc2`` (LoRA's terms included), so the layer's residual adds are megatron's own.
- The embedding's output is multiplied by ``sqrt(hidden_size)`` rounded to the weights' dtype, as transformers does
  (``finish_model``: ``layer_outputs.scale_embedding``; NEFTune's hook sees the scaled output, as on transformers'
  ``Gemma3TextScaledWordEmbedding``).
- Sliding-window layers (``layer_types``) and two rotary bases: full-attention layers rotate with
  ``rope_parameters['full_attention']`` (default or linear scaling), sliding ones with ``['sliding_attention']``
  (``layer_types.LayerTypes``); the scores are scaled by ``query_pre_attn_scalar ** -0.5`` (``softmax_scale``).
- Gemma 2: one rotary base; its scores soft-capped (``attn_logit_softcapping``: ``CoreAttention.softcap``, computed
  on materialised scores as transformers' eager attention, the only one transformers runs Gemma 2 with) and its
  logits soft-capped (``final_logit_softcapping``: the output layer's logits, and the fused loss of the training step,
  ``kernels.cross_entropy``'s ``softcap``). A static cache's decode steps run as the dynamic cache's (the fixed step's
  attention takes no cap); a KV cache sharded over context parallelism is refused.
- VaultGemma (VaultGemmaForCausalLM, Google's differentially private VaultGemma 1B): Gemma 2 without the two post
  norms, its pre-MLP norm named ``pre_feedforward_layernorm`` (megatron's own attention and MLP modules).
- Refused with a message: bidirectional attention (EmbeddingGemma), attention biases, layer types other than full /
  sliding attention; soft-capping on Gemma 3 (transformers' Gemma 3 applies none by default).
"""

from __future__ import annotations

import torch

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.dense import D, L, DenseBridge
from loongforge_hf.bridges.layer_outputs import (scale_embedding, softcap_logits, transformed_attention,
                                                 transformed_mlp)
from loongforge_hf.bridges.layer_types import LayerTypes, check_layer_kinds, layer_windows
from loongforge_hf.bridges.mappings import Mapping, Replicated
from loongforge_hf.bridges.registry import register_bridge


def scale_gemma_embedding(chunk, hidden_size: int) -> None:
    """The embedding's output times ``sqrt(hidden_size)``, rounded to the weights' dtype first as transformers does."""
    if chunk.pre_process:
        dtype = chunk.embedding.word_embeddings.weight.dtype
        scale_embedding(chunk, float(torch.tensor(hidden_size ** 0.5, dtype=dtype)))


@register_bridge("GemmaForCausalLM")
class GemmaBridge(DenseBridge):
    """Gemma: the Llama layout with zero-centred norms and the scaled embedding (tied to the LM head)."""

    def check_config(self) -> None:
        super().check_config()
        if getattr(self.hf_config, "use_bidirectional_attention", False):
            raise C.UnsupportedConfigError("use_bidirectional_attention=True is not supported (causal attention only).")

    def transformer_config_kwargs(self) -> dict:
        return {**super().transformer_config_kwargs(), "layernorm_zero_centered_gamma": True}

    def finish_model(self, model) -> None:
        scale_gemma_embedding(model, self.hf_config.hidden_size)


class _SandwichNorms(DenseBridge):
    """Gemma 2 / 3: zero-centred norms, a norm before and after the attention and the MLP, the scaled embedding,
    ``query_pre_attn_scalar``, sliding-window layers."""

    supports_sliding_window = True
    per_layer_types = True
    zero_centred_norms = True  # NOTE: norms store ``weight - 1`` (Gemma 4's store the weight: ``gemma4.py``)

    def check_config(self) -> None:
        c = self.hf_config
        if getattr(c, "use_bidirectional_attention", False):
            raise C.UnsupportedConfigError("use_bidirectional_attention=True is not supported (causal attention only).")
        if getattr(c, "attention_bias", False):
            raise C.UnsupportedConfigError(f"attention_bias=True is not supported for {self.architectures[0]}.")
        C._act_to_megatron(c.hidden_activation)

    def transformer_config_kwargs(self) -> dict:
        c = self.hf_config
        kw = C.hf_to_megatron(c, tuple(f for f in C.DENSE_FIELDS if f.hf != "hidden_act"))
        kw.update(activation_func=C._act_to_megatron(c.hidden_activation), normalization="RMSNorm",
                  layernorm_zero_centered_gamma=self.zero_centred_norms, gated_linear_unit=True,
                  add_bias_linear=False, add_qkv_bias=False, qk_layernorm=self.qk_norm, hidden_dropout=0.0,
                  softmax_scale=self.softmax_scale(), **layer_windows(c))
        return kw

    def softmax_scale(self) -> float:
        return float(self.hf_config.query_pre_attn_scalar) ** -0.5

    def mlp_module(self) -> type | None:
        return transformed_mlp(post_norm=True)

    # ---- tensors --------------------------------------------------------------------------------------------
    def attention_mappings(self) -> list[Mapping]:
        return super().attention_mappings() + [
            Replicated(f"{D}.self_attention.post_layernorm.weight", f"{L}.post_attention_layernorm.weight")]

    def dense_mlp_mappings(self) -> list[Mapping]:
        _, fc1, fc2 = super().dense_mlp_mappings()
        return [Replicated(f"{D}.pre_mlp_layernorm.weight", f"{L}.pre_feedforward_layernorm.weight"), fc1, fc2,
                Replicated(f"{D}.mlp.post_layernorm.weight", f"{L}.post_feedforward_layernorm.weight")]

    def attention_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        h = self.hf_config.hidden_size
        return {**super().attention_shapes(prefix), f"{prefix}.post_attention_layernorm.weight": (h,)}

    def dense_mlp_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        shapes = super().dense_mlp_shapes(prefix)
        h = shapes.pop(f"{prefix}.post_attention_layernorm.weight")
        return {**shapes, f"{prefix}.pre_feedforward_layernorm.weight": h,
                f"{prefix}.post_feedforward_layernorm.weight": h}


@register_bridge("Gemma2ForCausalLM")
class Gemma2Bridge(_SandwichNorms):
    def check_config(self) -> None:
        super().check_config()
        self.rope_parameters()
        check_layer_kinds(self.hf_config, self.architectures[0])
        # NOTE: read by the static cache (its fixed decode step takes no cap)
        self.attention_softcap = getattr(self.hf_config, "attn_logit_softcapping", None)

    def attention_module(self) -> type | None:
        return transformed_attention(post_norm=True)

    def finish_model(self, model) -> None:
        from loongforge_hf.kernels.attention import CoreAttention

        scale_gemma_embedding(model, self.hf_config.hidden_size)
        for module in model.modules():
            if isinstance(module, CoreAttention):
                module.softcap = self.attention_softcap
        cap = getattr(self.hf_config, "final_logit_softcapping", None)
        if cap is not None:
            softcap_logits(model, cap)


@register_bridge("Gemma3ForCausalLM")
class Gemma3Bridge(LayerTypes, _SandwichNorms):
    qk_norm = True

    def check_config(self) -> None:
        super().check_config()
        self.check_layer_types()
        for name in ("attn_logit_softcapping", "final_logit_softcapping"):
            if getattr(self.hf_config, name, None) is not None:
                raise C.UnsupportedConfigError(f"{name}={getattr(self.hf_config, name)} is not supported "
                                               "(logit soft-capping).")

    def attention_module(self) -> type | None:
        return transformed_attention(post_norm=True, sliding_layers=self.sliding_layers)

    def finish_model(self, model) -> None:
        scale_gemma_embedding(model, self.hf_config.hidden_size)
        self.set_rotary_tables(model)


@register_bridge("VaultGemmaForCausalLM")
class VaultGemmaBridge(Gemma2Bridge):
    """Gemma 2 without the post-attention and post-feedforward norms."""

    def attention_module(self) -> type | None:
        return None

    def mlp_module(self) -> type | None:
        return None

    def attention_mappings(self) -> list[Mapping]:
        return [m for m in super().attention_mappings() if not m.megatron.endswith(".post_layernorm.weight")]

    def dense_mlp_mappings(self) -> list[Mapping]:
        return [m for m in super().dense_mlp_mappings() if not m.megatron.endswith(".post_layernorm.weight")]

    def attention_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        return {k: v for k, v in super().attention_shapes(prefix).items()
                if not k.endswith("post_attention_layernorm.weight")}

    def dense_mlp_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        return {k: v for k, v in super().dense_mlp_shapes(prefix).items()
                if not k.endswith("post_feedforward_layernorm.weight")}
