"""PersimmonForCausalLM (Adept's Persimmon-8B base / chat and their fine-tunes): GPT-NeoX's fused per-head q / k / v
and LayerNorms with biases, run sequentially, with LayerNorms on q and k and a squared-ReLU MLP.

Choices:
- GPT-NeoX's bridge (``gpt_neox.py``) with its sequential layer (``use_parallel_residual`` off): ``query_key_value``
  is ``[heads, (q, k, v), head_dim]`` row-wise, megatron's ``linear_qkv`` with a query group per head, loaded as a
  plain column-parallel weight and bias; every linear but the LM head has a bias.
- ``partial_rotary_factor`` (Persimmon-8B: 0.5) is megatron's ``rotary_percent`` (rotate-half pairs of the first
  channels of each head). Plain rope and llama3 scaling; other rope types are refused.
- ``qk_layernorm`` (on in the hub's checkpoints): one ``nn.LayerNorm`` over each head's channels, shared by the heads,
  with weight and bias, before the rotation: Phi's (our ``LayerNorm`` in megatron's q / k norm slots, their gradients
  summed over TP by megatron's ``qk_layernorm``).
- ``hidden_act`` ``relu2`` through the shared table. ``hidden_dropout`` drops the MLP's output (with its bias) only,
  not the attention's: StableLM's ``dropped_mlp``; megatron's ``hidden_dropout`` stays 0 and the embedding output is
  not dropped. ``attention_dropout`` through the shared table.
- Names: ``model.embed_tokens``, ``model.layers.N.{input_layernorm, post_attention_layernorm, self_attn.{
  query_key_value, dense, q_layernorm, k_layernorm}, mlp.{dense_h_to_4h, dense_4h_to_h}}``, ``model.final_layernorm``,
  ``lm_head`` (``tie_word_embeddings`` shares the embedding), GPT-NeoX's mapped through one name table.
"""

from __future__ import annotations

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.gpt_neox import D, GPTNeoXBridge
from loongforge_hf.bridges.mappings import Mapping, Replicated, replaced, with_replaced_names
from loongforge_hf.bridges.registry import register_bridge
from loongforge_hf.bridges.stablelm import dropped_mlp

L = "model.layers.{layer}"
# NOTE: GPT-NeoX's HF names -> Persimmon's, in this order
_NAMES = {"gpt_neox.layers.": "model.layers.", ".attention.": ".self_attn.",
          "gpt_neox.embed_in.": "model.embed_tokens.", "gpt_neox.final_layer_norm.": "model.final_layernorm.",
          "embed_out.": "lm_head."}


@register_bridge("PersimmonForCausalLM")
class PersimmonBridge(GPTNeoXBridge):
    parallel_residual = None
    embedding_dropout = 0.0
    extra_rope_types = ()

    @property
    def qk_norm(self) -> bool:
        return bool(getattr(self.hf_config, "qk_layernorm", True))

    def qk_module(self) -> type | None:
        from loongforge_hf.kernels.layernorm import LayerNorm

        return LayerNorm if self.qk_norm else None

    def mlp_module(self) -> type | None:
        p = C.dropout_of(self.hf_config, "hidden_dropout")
        return dropped_mlp(p) if p else None

    def transformer_config_kwargs(self) -> dict:
        return {**super().transformer_config_kwargs(), "hidden_dropout": 0.0}

    # ---- tensors --------------------------------------------------------------------------------------------
    def attention_mappings(self) -> list[Mapping]:
        maps = [with_replaced_names(m, _NAMES) for m in super().attention_mappings()]
        if self.qk_norm:
            maps += [Replicated(f"{D}.self_attention.{q}_layernorm.{p}", f"{L}.self_attn.{q}_layernorm.{p}")
                     for q in ("q", "k") for p in ("weight", "bias")]
        return maps

    def dense_mlp_mappings(self) -> list[Mapping]:
        return [with_replaced_names(m, _NAMES) for m in super().dense_mlp_mappings()]

    def embedding_mapping(self) -> Mapping:
        return with_replaced_names(super().embedding_mapping(), _NAMES)

    def final_mappings(self) -> list[Mapping]:
        return [with_replaced_names(m, _NAMES) for m in super().final_mappings()]

    def layer_shapes(self, layer: int) -> dict[str, tuple[int, ...]]:
        shapes = super().layer_shapes(layer)
        if self.qk_norm:
            hd = C.head_dim_of(self.hf_config)
            shapes.update({f"gpt_neox.layers.{layer}.attention.{q}_layernorm.{p}": (hd,)
                           for q in ("q", "k") for p in ("weight", "bias")})
        return shapes

    def expected_hf_shapes(self) -> dict[str, tuple[int, ...]]:
        return {replaced(n, _NAMES): shape for n, shape in super().expected_hf_shapes().items()}
