"""GPTNeoXForCausalLM (EleutherAI's Pythia 14M-12B, GPT-NeoX-20B and their fine-tunes): the attention and the MLP side
by side in each layer, LayerNorms with biases, q / k / v fused per head, a quarter of each head rotated.

Choices:
- ``use_parallel_residual`` (on in every hub checkpoint): ``x + attn(ln1(x)) + mlp(ln2(x))``, the spec's
  ``ParallelResidualLayer`` (``kernels/specs.py``: megatron's layer with the pre-MLP norm reading the layer input);
  off, megatron's sequential layer. Both dropouts (``hidden_dropout``) fall on the sublayer outputs before the adds,
  as megatron's bias-dropout-add does, and on the embedding output, as megatron's embedding does.
- ``query_key_value`` is ``[heads, (q, k, v), head_dim]`` row-wise, which is megatron's ``linear_qkv`` layout when
  every head is its own query group (GPT-NeoX has no GQA): it loads as a plain column-parallel weight (each TP rank
  takes whole heads' q, k, v rows), bias likewise, and exports unchanged.
- ``partial_rotary_factor`` (Pythia: 0.25) is megatron's ``rotary_percent``; both rotate the first channels of each
  head in rotate-half pairs.
- Norms are LayerNorms with weight and bias (``layer_norm_eps``); every linear but the LM head has a bias
  (``attention_bias`` must stay on: megatron's output projection's bias follows the MLP's, ``add_bias_linear``). The
  MLP is ``dense_4h_to_h(act(dense_h_to_4h(x)))``: megatron's ungated ``MLP``, ``hidden_act`` ``gelu`` (Pythia) or
  ``gelu_fast`` (GPT-NeoX-20B) as transformers computes them (``config_map``).
- Names: ``gpt_neox.*`` and the LM head as ``embed_out`` (the hub's, which transformers 5 also writes: it renames it
  ``lm_head`` only in memory). Older checkpoints' buffers (``attention.bias``, ``attention.masked_bias``,
  ``attention.rotary_emb.inv_freq``) are not read, as transformers ignores them, and not written back.
"""

from __future__ import annotations

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.dense import DenseBridge
from loongforge_hf.bridges.mappings import (ColumnParallel, Mapping, Replicated,
                                            RowParallel, VocabParallel, biased_mlp_mappings)
from loongforge_hf.bridges.registry import register_bridge

L = "gpt_neox.layers.{layer}"
D = "decoder.layers.{layer}"
NEOX_FIELDS = C.fields_with_eps("layer_norm_eps")


@register_bridge("GPTNeoXForCausalLM")
class GPTNeoXBridge(DenseBridge):
    config_fields = NEOX_FIELDS
    qkv_bias = True

    @property
    def parallel_residual(self) -> str | None:
        return "separate" if getattr(self.hf_config, "use_parallel_residual", True) else None

    @property
    def embedding_dropout(self) -> float:
        """GPT-NeoX drops the embedding output with ``hidden_dropout`` too."""
        return C.dropout_of(self.hf_config, "hidden_dropout")

    def rope_parameters(self) -> dict:
        return C.rope_parameters(self.hf_config, partial_rotary=True, extra_types=self.extra_rope_types)

    def check_config(self) -> None:
        super().check_config()
        if not getattr(self.hf_config, "attention_bias", True):
            raise C.UnsupportedConfigError(
                "attention_bias=False is not supported for GPTNeoXForCausalLM: its MLP keeps biases, and megatron's "
                "attention output projection has a bias exactly when the MLP's linears do (add_bias_linear).")

    def transformer_config_kwargs(self) -> dict:
        return {**super().transformer_config_kwargs(), "normalization": "LayerNorm", "gated_linear_unit": False,
                "add_bias_linear": True, "add_qkv_bias": True,
                "hidden_dropout": C.dropout_of(self.hf_config, "hidden_dropout")}

    # ---- tensors --------------------------------------------------------------------------------------------
    def attention_mappings(self) -> list[Mapping]:
        return [Replicated(f"{D}.input_layernorm.weight", f"{L}.input_layernorm.weight"),
                Replicated(f"{D}.input_layernorm.bias", f"{L}.input_layernorm.bias"),
                ColumnParallel(f"{D}.self_attention.linear_qkv.weight", f"{L}.attention.query_key_value.weight"),
                ColumnParallel(f"{D}.self_attention.linear_qkv.bias", f"{L}.attention.query_key_value.bias"),
                RowParallel(f"{D}.self_attention.linear_proj.weight", f"{L}.attention.dense.weight"),
                Replicated(f"{D}.self_attention.linear_proj.bias", f"{L}.attention.dense.bias")]

    def dense_mlp_mappings(self) -> list[Mapping]:
        return [Replicated(f"{D}.pre_mlp_layernorm.weight", f"{L}.post_attention_layernorm.weight"),
                Replicated(f"{D}.pre_mlp_layernorm.bias", f"{L}.post_attention_layernorm.bias"),
                *biased_mlp_mappings(f"{D}.mlp", f"{L}.mlp.dense_h_to_4h", f"{L}.mlp.dense_4h_to_h")]

    def embedding_mapping(self) -> Mapping:
        return VocabParallel("embedding.word_embeddings.weight", "gpt_neox.embed_in.weight")

    def final_mappings(self) -> list[Mapping]:
        maps: list[Mapping] = [Replicated("decoder.final_layernorm.weight", "gpt_neox.final_layer_norm.weight"),
                               Replicated("decoder.final_layernorm.bias", "gpt_neox.final_layer_norm.bias")]
        if not self.tied:
            maps.append(VocabParallel("output_layer.weight", "embed_out.weight"))
        return maps

    def attention_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        h = self.hf_config.hidden_size
        return {f"{prefix}.input_layernorm.weight": (h,), f"{prefix}.input_layernorm.bias": (h,),
                f"{prefix}.attention.query_key_value.weight": (3 * h, h),
                f"{prefix}.attention.query_key_value.bias": (3 * h,),
                f"{prefix}.attention.dense.weight": (h, h), f"{prefix}.attention.dense.bias": (h,)}

    def dense_mlp_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        h, f, p = self.hf_config.hidden_size, self.hf_config.intermediate_size, prefix
        return {f"{p}.post_attention_layernorm.weight": (h,), f"{p}.post_attention_layernorm.bias": (h,),
                f"{p}.mlp.dense_h_to_4h.weight": (f, h), f"{p}.mlp.dense_h_to_4h.bias": (f,),
                f"{p}.mlp.dense_4h_to_h.weight": (h, f), f"{p}.mlp.dense_4h_to_h.bias": (h,)}

    def layer_shapes(self, layer: int) -> dict[str, tuple[int, ...]]:
        prefix = L.format(layer=layer)
        return {**self.attention_shapes(prefix), **self.dense_mlp_shapes(prefix)}

    def expected_hf_shapes(self) -> dict[str, tuple[int, ...]]:
        c = self.hf_config
        h, v = c.hidden_size, c.vocab_size
        shapes = {"gpt_neox.embed_in.weight": (v, h), "gpt_neox.final_layer_norm.weight": (h,),
                  "gpt_neox.final_layer_norm.bias": (h,)}
        if not self.tied:
            shapes["embed_out.weight"] = (v, h)
        for i in range(c.num_hidden_layers):
            shapes.update(self.layer_shapes(i))
        return shapes
