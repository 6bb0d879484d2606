"""FalconForCausalLM (TII's Falcon-7B / 40B / 180B, Falcon2-11B and their fine-tunes): LayerNorms with biases, q / k /
v fused in one linear, an ungated GELU MLP, the attention and the MLP side by side in every hub checkpoint.

Choices:
- Three layer layouts, as transformers' ``FalconDecoderLayer`` runs them: ``new_decoder_architecture`` (40B / 180B)
  with ``num_ln_in_parallel_attn`` 2 (None reads as 2): ``x + attn(ln_attn(x)) + mlp(ln_mlp(x))``, the spec's
  ``ParallelResidualLayer``; with 1 (Falcon2-11B), and the older layout with ``parallel_attn`` (7B):
  ``x + attn(ln(x)) + mlp(ln(x))`` with one ``input_layernorm``, the spec's ``SharedNormParallelLayer``; the older
  layout without ``parallel_attn``: megatron's sequential layer, ``post_attention_layernorm`` its pre-MLP norm.
  Combinations transformers' forward cannot run (the new layout without ``parallel_attn``, two norms in the older
  layout, ``num_ln_in_parallel_attn`` other than 1 / 2) are refused.
- ``query_key_value`` is megatron's ``linear_qkv`` layout as it is in all three attention kinds: the new layout's
  ``[num_kv_heads groups, (q heads of the group, k, v), head_dim]``, ``multi_query``'s (7B) ``[q of every head, k,
  v]`` (one group), and the older layout without it ``[heads, (q, k, v), head_dim]`` (a group per head; its
  ``num_kv_heads`` must equal the heads, which transformers' forward needs). It loads as ``GroupedQKV`` (each TP
  rank whole groups, or with more TP ranks than KV heads, ``multi_query``'s one included, a replica of one group's
  k / v beside its share of the group's query heads), bias likewise, and exports unchanged; the KV head count is
  ``config_map.kv_heads_of``.
- ``bias`` (off in every hub checkpoint) puts a bias on every linear but the LM head: megatron's ``add_bias_linear``
  and ``add_qkv_bias`` together. Norms are LayerNorms with weight and bias (``layer_norm_epsilon``). The MLP is
  ``dense_4h_to_h(act(dense_h_to_4h(x)))``, ``ffn_hidden_size`` wide: megatron's ungated ``MLP``, ``activation``
  (``gelu``: the exact erf GELU, transformers' ``GELUActivation``) through the shared table.
- Rotary over whole heads (``head_dim`` is ``hidden_size / num_attention_heads``), ``rope_parameters``: plain, llama3,
  linear and YaRN. ``alibi`` (Falcon-RW) is refused: megatron has no ALiBi.
- Dropouts: transformers drops nothing on the rotary path's attention probabilities (megatron's
  ``attention_dropout`` stays 0) nor on the embedding output. Side by side it drops the sum of the two sublayers'
  outputs once with ``hidden_dropout``, where megatron's bias-dropout-add drops each on its own: a ``hidden_dropout``
  above 0 is refused there. Sequential, it drops the attention's output with ``attention_dropout`` and the MLP's
  with ``hidden_dropout``: megatron's ``hidden_dropout`` when the two are equal, refused otherwise.
- ``tie_word_embeddings`` (on in every hub checkpoint: no ``lm_head.weight`` on disk) shares
  ``transformer.word_embeddings`` with the LM head. Names: ``transformer.h.N.{ln_attn, ln_mlp, input_layernorm,
  post_attention_layernorm, self_attention.{query_key_value, dense}, mlp.{dense_h_to_4h, dense_4h_to_h}}``,
  ``transformer.ln_f``, ``lm_head``.
"""

from __future__ import annotations

from dataclasses import replace

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.dense import DenseBridge
from loongforge_hf.bridges.mappings import (ColumnParallel, Mapping, Replicated, RowParallel, VocabParallel,
                                            biased_mlp_mappings)
from loongforge_hf.bridges.packed_mappings import GroupedQKV
from loongforge_hf.bridges.registry import register_bridge

L = "transformer.h.{layer}"
D = "decoder.layers.{layer}"
_RENAMED = {"rms_norm_eps": "layer_norm_epsilon", "hidden_act": "activation", "intermediate_size": "ffn_hidden_size"}
# NOTE: the KV heads (kv_heads_of) and both dropouts are set in transformer_config_kwargs
FALCON_FIELDS = tuple(replace(f, hf=_RENAMED.get(f.hf, f.hf)) for f in C.DENSE_FIELDS
                      if f.hf not in ("num_key_value_heads", "attention_dropout"))


@register_bridge("FalconForCausalLM")
class FalconBridge(DenseBridge):
    config_fields = FALCON_FIELDS
    extra_rope_types = ("linear", "yarn")

    @property
    def norms(self) -> tuple[str, ...]:
        """The HF names of a layer's norms: the attention's, then the MLP's where it has its own."""
        c = self.hf_config
        if c.new_decoder_architecture:
            return ("ln_attn", "ln_mlp") if (c.num_ln_in_parallel_attn or 2) == 2 else ("input_layernorm",)
        return ("input_layernorm",) if c.parallel_attn else ("input_layernorm", "post_attention_layernorm")

    @property
    def parallel_residual(self) -> str | None:
        c = self.hf_config
        if not (c.new_decoder_architecture or c.parallel_attn):
            return None
        return "separate" if len(self.norms) == 2 else "shared"

    @property
    def bias(self) -> bool:
        return bool(self.hf_config.bias)

    def check_config(self) -> None:
        c, arch = self.hf_config, self.architectures[0]
        if c.alibi:
            raise C.UnsupportedConfigError(f"alibi=True is not supported for {arch}: megatron has no ALiBi position "
                                           "biases (only rotary embeddings).")
        ln = c.num_ln_in_parallel_attn
        if c.new_decoder_architecture and not c.parallel_attn:
            raise C.UnsupportedConfigError(
                f"parallel_attn=False with new_decoder_architecture=True is not supported for {arch}: transformers' "
                "layer then builds norms its forward does not use (the new layout always runs side by side).")
        if c.new_decoder_architecture and ln not in (None, 1, 2):
            raise C.UnsupportedConfigError(f"num_ln_in_parallel_attn={ln} is not supported for {arch}: expected 1 "
                                           "(one norm before both sublayers) or 2 (one each), as transformers.")
        if not c.new_decoder_architecture and c.parallel_attn and ln not in (None, 1):
            raise C.UnsupportedConfigError(
                f"num_ln_in_parallel_attn={ln} with new_decoder_architecture=False is not supported for {arch}: "
                "transformers' older layout runs one input_layernorm (its forward fails with two).")
        heads, kv = c.num_attention_heads, C.kv_heads_of(c)
        if c.new_decoder_architecture and (not kv or heads % kv):
            raise C.UnsupportedConfigError(f"num_kv_heads={kv} is not supported for {arch}: it must divide "
                                           f"num_attention_heads={heads}.")
        if not (c.new_decoder_architecture or c.multi_query) and c.num_kv_heads != heads:
            raise C.UnsupportedConfigError(
                f"num_kv_heads={c.num_kv_heads} with multi_query=False is not supported for {arch}: the older layout "
                f"fuses q, k and v for every head, so it must equal num_attention_heads={heads}.")
        hidden, attention = (C.dropout_of(c, n) for n in ("hidden_dropout", "attention_dropout"))
        if self.parallel_residual and hidden:
            raise C.UnsupportedConfigError(
                f"hidden_dropout={hidden} is not supported for {arch} with the attention and the MLP side by side: "
                "transformers drops the sum of their outputs once, megatron each output on its own.")
        if not self.parallel_residual and hidden != attention:
            raise C.UnsupportedConfigError(
                f"attention_dropout={attention} with hidden_dropout={hidden} is not supported for {arch} "
                "(parallel_attn=False): transformers drops the attention's output with attention_dropout and the "
                "MLP's with hidden_dropout, megatron both with one probability; set them equal.")
        self.rope_parameters()
        if c.activation not in C._ACTIVATIONS:
            raise C.UnsupportedConfigError(f"activation={c.activation!r} is not supported for {arch}; supported: "
                                           f"{sorted(C._ACTIVATIONS)}.")

    def transformer_config_kwargs(self) -> dict:
        c = self.hf_config
        dropout = 0.0 if self.parallel_residual else C.dropout_of(c, "hidden_dropout")
        return {**super().transformer_config_kwargs(), "normalization": "LayerNorm", "gated_linear_unit": False,
                "add_bias_linear": self.bias, "add_qkv_bias": self.bias, "num_query_groups": C.kv_heads_of(c),
                "hidden_dropout": dropout, "attention_dropout": 0.0}

    # ---- tensors --------------------------------------------------------------------------------------------
    def attention_mappings(self) -> list[Mapping]:
        a = f"{L}.self_attention"
        maps: list[Mapping] = [
            Replicated(f"{D}.input_layernorm.weight", f"{L}.{self.norms[0]}.weight"),
            Replicated(f"{D}.input_layernorm.bias", f"{L}.{self.norms[0]}.bias"),
            GroupedQKV(f"{D}.self_attention.linear_qkv.weight", f"{a}.query_key_value.weight"),
            RowParallel(f"{D}.self_attention.linear_proj.weight", f"{a}.dense.weight")]
        if self.bias:
            maps += [GroupedQKV(f"{D}.self_attention.linear_qkv.bias", f"{a}.query_key_value.bias"),
                     Replicated(f"{D}.self_attention.linear_proj.bias", f"{a}.dense.bias")]
        return maps

    def dense_mlp_mappings(self) -> list[Mapping]:
        fc1, fc2 = f"{L}.mlp.dense_h_to_4h", f"{L}.mlp.dense_4h_to_h"
        maps: list[Mapping] = []
        if len(self.norms) == 2:
            maps += [Replicated(f"{D}.pre_mlp_layernorm.weight", f"{L}.{self.norms[1]}.weight"),
                     Replicated(f"{D}.pre_mlp_layernorm.bias", f"{L}.{self.norms[1]}.bias")]
        if self.bias:
            return maps + biased_mlp_mappings(f"{D}.mlp", fc1, fc2)
        return maps + [ColumnParallel(f"{D}.mlp.linear_fc1.weight", f"{fc1}.weight"),
                       RowParallel(f"{D}.mlp.linear_fc2.weight", f"{fc2}.weight")]

    def embedding_mapping(self) -> Mapping:
        return VocabParallel("embedding.word_embeddings.weight", "transformer.word_embeddings.weight")

    def final_mappings(self) -> list[Mapping]:
        maps: list[Mapping] = [Replicated("decoder.final_layernorm.weight", "transformer.ln_f.weight"),
                               Replicated("decoder.final_layernorm.bias", "transformer.ln_f.bias")]
        if not self.tied:
            maps.append(VocabParallel("output_layer.weight", "lm_head.weight"))
        return maps

    def layer_shapes(self, layer: int) -> dict[str, tuple[int, ...]]:
        c, p = self.hf_config, L.format(layer=layer)
        h, f, hd = c.hidden_size, c.ffn_hidden_size, C.head_dim_of(c)
        qkv = (c.num_attention_heads + 2 * C.kv_heads_of(c)) * hd
        shapes = {f"{p}.self_attention.query_key_value.weight": (qkv, h), f"{p}.self_attention.dense.weight": (h, h),
                  f"{p}.mlp.dense_h_to_4h.weight": (f, h), f"{p}.mlp.dense_4h_to_h.weight": (h, f)}
        if self.bias:
            shapes.update({f"{p}.self_attention.query_key_value.bias": (qkv,), f"{p}.self_attention.dense.bias": (h,),
                           f"{p}.mlp.dense_h_to_4h.bias": (f,), f"{p}.mlp.dense_4h_to_h.bias": (h,)})
        for norm in self.norms:
            shapes.update({f"{p}.{norm}.weight": (h,), f"{p}.{norm}.bias": (h,)})
        return shapes

    def expected_hf_shapes(self) -> dict[str, tuple[int, ...]]:
        c = self.hf_config
        h, v = c.hidden_size, c.vocab_size
        shapes = {"transformer.word_embeddings.weight": (v, h), "transformer.ln_f.weight": (h,),
                  "transformer.ln_f.bias": (h,)}
        if not self.tied:
            shapes["lm_head.weight"] = (v, h)
        for i in range(c.num_hidden_layers):
            shapes.update(self.layer_shapes(i))
        return shapes
