"""Gemma3ForCausalLM (Gemma 3 text models: gemma-3-270m, gemma-3-1b; the causal-LM form of the larger ones' text part):
the Llama tensor layout with Gemma's differences.

Choices:
- Norms store ``weight - 1`` and apply ``1 + weight`` with Gemma's numerics: megatron's
  ``layernorm_zero_centered_gamma`` on our ``RMSNorm`` (input, pre-MLP, q / k, final and the two post norms).
- Each layer normalises its attention output and its MLP output before the residual add (``post_attention_layernorm``,
  ``post_feedforward_layernorm``). megatron's ``TransformerLayer`` has no slot there; the norms live in the attention
  and MLP modules (``layer_outputs.transformed_attention`` / ``transformed_mlp``), applied to their outputs after
  ``linear_proj`` / ``linear_fc2`` (LoRA's terms included), so the layer's residual adds are megatron's own.
- The embedding's output is multiplied by ``sqrt(hidden_size)`` rounded to the weights' dtype, as transformers does
  (``finish_model``: ``layer_outputs.scale_embedding``; NEFTune's hook sees the scaled output, as on transformers'
  ``Gemma3TextScaledWordEmbedding``).
- Sliding-window layers (``layer_types``) get the window through megatron's ``window_attn_skip_freq`` list, read by
  our core attention per layer (and by the KV cache); the scores are scaled by ``query_pre_attn_scalar ** -0.5``
  (megatron's ``softmax_scale``).
- Two rotary bases: full-attention layers rotate with ``rope_parameters['full_attention']`` (default or linear
  scaling), sliding ones with ``['sliding_attention']``. The model's rotary embedding returns both angle tables side
  by side on the last axis (``_layer_type_rotary``; every slicing of it, by context parallelism or a KV cache, is along
  positions) and each layer's attention keeps its half.
- Refused with a message: attention / final logit soft-capping (Gemma 2's, not used by Gemma 3), bidirectional
  attention (EmbeddingGemma), attention biases, layer types other than full / sliding attention.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.dense import D, L, DenseBridge
from loongforge_hf.bridges.layer_outputs import scale_embedding, transformed_attention, transformed_mlp
from loongforge_hf.bridges.mappings import Mapping, Replicated
from loongforge_hf.bridges.registry import register_bridge

LAYER_TYPES = ("full_attention", "sliding_attention")


@functools.cache
def _layer_type_rotary(base: type) -> type:
    class LayerTypeRotary(base):
        """megatron's rotary embedding whose angle table is ``[positions, 1, 1, 2 * rotary_dim]``: the full layers'
        angles (``inv_freq``), then the sliding layers' (``local_inv_freq``)."""

        def get_emb(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
            full = super().get_emb(max_seq_len, offset)
            inv = self.local_inv_freq.to(full.device)
            positions = torch.arange(max_seq_len, device=full.device, dtype=inv.dtype) + offset
            freqs = torch.outer(positions, inv)
            return torch.cat((full, torch.cat((freqs, freqs), dim=-1)[:, None, None, :]), dim=-1)

    return LayerTypeRotary


@register_bridge("Gemma3ForCausalLM")
class Gemma3Bridge(DenseBridge):
    qk_norm = True
    supports_sliding_window = True
    extra_rope_types = ("linear",)

    # ---- config ---------------------------------------------------------------------------------------------
    def check_config(self) -> None:
        c = self.hf_config
        unknown = sorted(set(c.layer_types) - set(LAYER_TYPES))
        if unknown:
            raise C.UnsupportedConfigError(f"layer_types {unknown} are not supported for Gemma3ForCausalLM; "
                                           f"supported: {list(LAYER_TYPES)}.")
        for kind in LAYER_TYPES:
            self.rope_for(kind)
        for name in ("attn_logit_softcapping", "final_logit_softcapping"):
            if getattr(c, name, None) is not None:
                raise C.UnsupportedConfigError(f"{name}={getattr(c, name)} is not supported (logit soft-capping).")
        if getattr(c, "use_bidirectional_attention", False):
            raise C.UnsupportedConfigError("use_bidirectional_attention=True is not supported (causal attention only).")
        if getattr(c, "attention_bias", False):
            raise C.UnsupportedConfigError("attention_bias=True is not supported for Gemma3ForCausalLM.")
        if "sliding_attention" in c.layer_types and not c.sliding_window:
            raise C.UnsupportedConfigError(f"sliding_window={c.sliding_window} with sliding_attention layers.")
        C._act_to_megatron(c.hidden_activation)

    def rope_for(self, layer_type: str) -> dict:
        """The rope parameters of ``layer_type``'s layers (transformers keeps one dict per layer type)."""
        params = dict((self.hf_config.rope_parameters or {}).get(layer_type) or {})
        if "rope_theta" not in params:
            raise C.UnsupportedConfigError(f"rope_parameters[{layer_type!r}] has no rope_theta.")
        return C.rope_parameters(SimpleNamespace(rope_parameters=params), extra_types=self.extra_rope_types)

    def rope_parameters(self) -> dict:
        return self.rope_for("full_attention")

    def qk_module(self) -> type | None:
        return None  # NOTE: default and linear rope have no attention factor

    @property
    def sliding_layers(self) -> frozenset[int]:
        return frozenset(i for i, t in enumerate(self.hf_config.layer_types) if t == "sliding_attention")

    def transformer_config_kwargs(self) -> dict:
        c = self.hf_config
        kw = C.hf_to_megatron(c, tuple(f for f in C.DENSE_FIELDS if f.hf != "hidden_act"))
        kw.update(activation_func=C._act_to_megatron(c.hidden_activation), normalization="RMSNorm",
                  layernorm_zero_centered_gamma=True, gated_linear_unit=True, add_bias_linear=False,
                  add_qkv_bias=False, qk_layernorm=True, hidden_dropout=0.0,
                  softmax_scale=float(c.query_pre_attn_scalar) ** -0.5)
        if self.sliding_layers:
            # NOTE: HF lets a query see itself and the window-1 tokens before it; megatron's (left, right) bounds
            kw.update(window_size=(c.sliding_window - 1, 0),
                      window_attn_skip_freq=[int(i in self.sliding_layers) for i in range(c.num_hidden_layers)])
        return kw

    def attention_module(self) -> type | None:
        return transformed_attention(post_norm=True, sliding_layers=self.sliding_layers)

    def mlp_module(self) -> type | None:
        return transformed_mlp(post_norm=True)

    def finish_model(self, model) -> None:
        from loongforge_hf.kernels.rope import rope_inv_freq, set_megatron_inv_freq

        c = self.hf_config
        if model.pre_process:
            # NOTE: transformers rounds sqrt(hidden_size) to the weights' dtype before the multiply
            dtype = model.embedding.word_embeddings.weight.dtype
            scale_embedding(model, float(torch.tensor(c.hidden_size ** 0.5, dtype=dtype)))
        rope = getattr(model, "rotary_pos_emb", None)
        if rope is None:
            return
        inv = {kind: rope_inv_freq(C.head_dim_of(c), base=self.rope_for(kind)["rope_theta"],
                                   rope_scaling=self.rope_for(kind)) for kind in LAYER_TYPES}
        set_megatron_inv_freq(rope, inv["full_attention"])
        rope.__class__ = _layer_type_rotary(type(rope))
        rope.local_inv_freq = inv["sliding_attention"]

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
