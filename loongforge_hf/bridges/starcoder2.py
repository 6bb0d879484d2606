"""Starcoder2ForCausalLM (BigCode's StarCoder2-3B / 7B / 15B and their fine-tunes): grouped-query attention with a
sliding window, LayerNorms with biases, biases on every linear but the LM head and an MLP without a gate.

Choices:
- The norms (input, post-attention, final) are LayerNorms with weight and bias (``norm_epsilon``): megatron's
  ``normalization="LayerNorm"``, built as our ``kernels.layernorm.LayerNorm`` (``F.layer_norm``, ``nn.LayerNorm``'s
  op; sequence parallel) by the dense spec (``kernels.specs.norm_class``).
- ``use_bias`` (biases on q / k / v / o, ``c_fc`` and ``c_proj``) is megatron's ``add_bias_linear`` (and
  ``add_qkv_bias``): the q / k / v biases fused into ``linear_qkv``'s like Qwen2's, ``c_fc``'s split with its rows
  over TP, ``o_proj``'s and ``c_proj``'s whole on every rank (megatron adds them after the row-parallel reduction).
- The MLP is ``c_proj(act(c_fc(x)))``: megatron's ``MLP`` without ``gated_linear_unit``, ``c_fc`` as its
  ``linear_fc1``, ``c_proj`` as its ``linear_fc2``; ``hidden_act`` (``gelu_pytorch_tanh``) through the shared table.
- ``sliding_window``: transformers masks every layer with it (StarCoder2-3B / 7B: 4096 of 16384 positions), as
  Mistral's; megatron's ``window_size`` on every layer (``DenseBridge``).
- Dropouts: ``residual_dropout`` drops the attention and MLP outputs before each residual add (megatron's
  ``hidden_dropout``, the bias added first in both), ``embedding_dropout`` the embedding output: the builder sets the
  embedding's own dropout to it (``embedding_dropout``; megatron would use ``hidden_dropout``), so the two may differ
  (the hub's checkpoints set both to 0.1). ``attention_dropout`` through the shared table.
- ``tie_word_embeddings`` (its default) shares the embedding with the LM head (``DenseBridge.tied``).
"""

from __future__ import annotations

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.arcee import PlainMLP
from loongforge_hf.bridges.dense import D, L, DenseBridge
from loongforge_hf.bridges.mappings import ColumnParallel, Mapping, Replicated
from loongforge_hf.bridges.registry import register_bridge

# NOTE: StarCoder2 names the norms' eps ``norm_epsilon`` (its norms are LayerNorms); the rest of the table is Llama's
STARCODER2_FIELDS = C.fields_with_eps("norm_epsilon")


class BiasedLayerNorms:
    """What a dense bridge with LayerNorms (weight and bias) and, where ``self.bias``, biases on every linear but the
    LM head maps beyond its base (StarCoder2; Jais 2 on Arcee's): the norms' biases, ``o_proj``'s, and those of the
    MLP's ``mlp_names`` (fc1 split with its rows over TP, fc2 whole on every rank)."""

    def attention_mappings(self) -> list[Mapping]:
        maps = [*super().attention_mappings(), Replicated(f"{D}.input_layernorm.bias", f"{L}.input_layernorm.bias")]
        if self.bias:
            maps.append(Replicated(f"{D}.self_attention.linear_proj.bias", f"{L}.self_attn.o_proj.bias"))
        return maps

    def dense_mlp_mappings(self) -> list[Mapping]:
        fc1, fc2 = self.mlp_names
        maps = [*super().dense_mlp_mappings(),
                Replicated(f"{D}.pre_mlp_layernorm.bias", f"{L}.post_attention_layernorm.bias")]
        if self.bias:
            maps += [ColumnParallel(f"{D}.mlp.linear_fc1.bias", f"{L}.mlp.{fc1}.bias"),
                     Replicated(f"{D}.mlp.linear_fc2.bias", f"{L}.mlp.{fc2}.bias")]
        return maps

    def final_mappings(self) -> list[Mapping]:
        return [*super().final_mappings(), Replicated("decoder.final_layernorm.bias", "model.norm.bias")]

    def attention_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        h = self.hf_config.hidden_size
        shapes = {**super().attention_shapes(prefix), f"{prefix}.input_layernorm.bias": (h,)}
        if self.bias:
            shapes[f"{prefix}.self_attn.o_proj.bias"] = (h,)
        return shapes

    def dense_mlp_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        (fc1, fc2), h, f = self.mlp_names, self.hf_config.hidden_size, self.hf_config.intermediate_size
        shapes = {**super().dense_mlp_shapes(prefix), f"{prefix}.post_attention_layernorm.bias": (h,)}
        if self.bias:
            shapes.update({f"{prefix}.mlp.{fc1}.bias": (f,), f"{prefix}.mlp.{fc2}.bias": (h,)})
        return shapes

    def expected_hf_shapes(self) -> dict[str, tuple[int, ...]]:
        return {**super().expected_hf_shapes(), "model.norm.bias": (self.hf_config.hidden_size,)}


@register_bridge("Starcoder2ForCausalLM")
class Starcoder2Bridge(BiasedLayerNorms, PlainMLP, DenseBridge):
    mlp_names = ("c_fc", "c_proj")
    supports_sliding_window = True
    config_fields = STARCODER2_FIELDS

    @property
    def qkv_bias(self) -> bool:
        return self.bias

    @property
    def bias(self) -> bool:
        """Biases on every linear but the LM head (``use_bias``)."""
        return bool(getattr(self.hf_config, "use_bias", True))

    @property
    def embedding_dropout(self) -> float:
        return C.dropout_of(self.hf_config, "embedding_dropout")

    def transformer_config_kwargs(self) -> dict:
        return {**super().transformer_config_kwargs(), "normalization": "LayerNorm", "add_bias_linear": self.bias,
                "add_qkv_bias": self.bias, "hidden_dropout": C.dropout_of(self.hf_config, "residual_dropout")}
