"""GPTNeoXJapaneseForCausalLM (ABEJA's gpt-neox-japanese-2.7b and its fine-tunes): GPT-NeoX's fused per-head q / k / v
run sequentially, no linear biases but one on the last layer's attention output.

Choices:
- GPT-NeoX's bridge (``gpt_neox.py``) with its sequential layer: ``query_key_value`` is ``[heads, (q, k, v),
  head_dim]`` row-wise, megatron's ``linear_qkv`` with a query group per head (a plain column-parallel split),
  LayerNorms with weight and bias (``layer_norm_eps``), part of each head rotated in rotate-half pairs (``rotary_pct``,
  read by transformers as ``partial_rotary_factor``; ``rotary_emb_base`` its ``rope_theta``).
- No linear has a bias (megatron's ``add_bias_linear`` / ``add_qkv_bias`` off) but the last layer's attention output
  (``attention.dense_bias``, added before the dropout and the residual add as megatron's bias-dropout-add adds
  ``linear_proj``'s): that layer's ``linear_proj`` alone is built with a bias (``gptj.last_layer_output_bias``), loaded
  and exported whole on every TP rank.
- The MLP is ``dense_4h_to_h(act(dense_h_to_4h(x)))``, ``int(hidden_size * intermediate_multiple_size)`` wide, no
  biases, ``hidden_act`` through the shared table. ``hidden_dropout`` drops both sublayers' outputs (megatron's
  ``hidden_dropout``), ``attention_dropout`` the probabilities; the embedding output is not dropped.
- Names: ``gpt_neox_japanese.{embed_in, layers.N.{input_layernorm, post_attention_layernorm, attention.{
  query_key_value, dense, dense_bias}, mlp.{dense_h_to_4h, dense_4h_to_h}}, final_layer_norm}``, ``embed_out`` (tied
  to ``embed_in`` by ``tie_word_embeddings``, on in the hub's checkpoint).
"""

from __future__ import annotations

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.gpt_neox import D, GPTNeoXBridge
from loongforge_hf.bridges.gptj import last_layer_output_bias
from loongforge_hf.bridges.mappings import (ColumnParallel, Mapping, Replicated, RowParallel, replaced,
                                            with_replaced_names)
from loongforge_hf.bridges.registry import register_bridge

L = "gpt_neox_japanese.layers.{layer}"
_NAMES = {"gpt_neox.": "gpt_neox_japanese."}
JAPANESE_FIELDS = tuple(f for f in C.fields_with_eps("layer_norm_eps") if f.hf != "intermediate_size")


@register_bridge("GPTNeoXJapaneseForCausalLM")
class GPTNeoXJapaneseBridge(GPTNeoXBridge):
    config_fields = JAPANESE_FIELDS
    qkv_bias = False
    parallel_residual = None
    embedding_dropout = 0.0

    @property
    def ffn_hidden_size(self) -> int:
        return int(self.hf_config.hidden_size * self.hf_config.intermediate_multiple_size)

    def transformer_config_kwargs(self) -> dict:
        return {**super().transformer_config_kwargs(), "add_bias_linear": False, "add_qkv_bias": False,
                "ffn_hidden_size": self.ffn_hidden_size}

    def attention_module(self) -> type | None:
        return last_layer_output_bias(self.hf_config.num_hidden_layers)

    # ---- tensors --------------------------------------------------------------------------------------------
    def _last_bias(self) -> Mapping:
        return Replicated(f"{D}.self_attention.linear_proj.bias", f"{L}.attention.dense_bias")

    def attention_mappings(self) -> list[Mapping]:
        norm = [Replicated(f"{D}.input_layernorm.{p}", f"{L}.input_layernorm.{p}") for p in ("weight", "bias")]
        return [*norm, ColumnParallel(f"{D}.self_attention.linear_qkv.weight", f"{L}.attention.query_key_value.weight"),
                RowParallel(f"{D}.self_attention.linear_proj.weight", f"{L}.attention.dense.weight")]

    def dense_mlp_mappings(self) -> list[Mapping]:
        norm = [Replicated(f"{D}.pre_mlp_layernorm.{p}", f"{L}.post_attention_layernorm.{p}")
                for p in ("weight", "bias")]
        return [*norm, ColumnParallel(f"{D}.mlp.linear_fc1.weight", f"{L}.mlp.dense_h_to_4h.weight"),
                RowParallel(f"{D}.mlp.linear_fc2.weight", f"{L}.mlp.dense_4h_to_h.weight")]

    def layer_mappings(self) -> list[Mapping]:
        return [*super().layer_mappings(), self._last_bias()]

    def mappings_for_layer(self, layer: int) -> list[Mapping]:
        last = layer == self.hf_config.num_hidden_layers - 1
        return [*super().layer_mappings(), *([self._last_bias()] if last else [])]

    def embedding_mapping(self) -> Mapping:
        return with_replaced_names(super().embedding_mapping(), _NAMES)

    def final_mappings(self) -> list[Mapping]:
        return [with_replaced_names(m, _NAMES) for m in super().final_mappings()]

    def layer_shapes(self, layer: int) -> dict[str, tuple[int, ...]]:
        h, f, p = self.hf_config.hidden_size, self.ffn_hidden_size, L.format(layer=layer)
        shapes = {f"{p}.{n}.{w}": (h,) for n in ("input_layernorm", "post_attention_layernorm")
                  for w in ("weight", "bias")}
        shapes.update({f"{p}.attention.query_key_value.weight": (3 * h, h), f"{p}.attention.dense.weight": (h, h),
                       f"{p}.mlp.dense_h_to_4h.weight": (f, h), f"{p}.mlp.dense_4h_to_h.weight": (h, f)})
        if layer == self.hf_config.num_hidden_layers - 1:
            shapes[f"{p}.attention.dense_bias"] = (h,)
        return shapes

    def expected_hf_shapes(self) -> dict[str, tuple[int, ...]]:
        return {replaced(n, _NAMES): shape for n, shape in super().expected_hf_shapes().items()}
