"""Jais2ForCausalLM (Inception's Jais-2 8B / 70B): Llama's attention and rope with LayerNorms, biases on every linear
but the LM head, and Nemotron's ungated squared-ReLU MLP.

Choices:
- The norms (input, post-attention, final) are ``nn.LayerNorm`` with weight and bias (``layer_norm_eps``): megatron's
  ``normalization="LayerNorm"``, our ``kernels.layernorm.LayerNorm`` (sequence parallel as StarCoder2's norms).
- The MLP is ``down_proj(act(up_proj(x)))`` without a gate (``hidden_act``: ``relu2``): megatron's ``MLP`` without
  ``gated_linear_unit`` (``ArceeBridge``'s names).
- ``attention_bias`` (q / k / v / o) and ``mlp_bias`` (up / down), on in the hub's checkpoints: megatron's
  ``add_qkv_bias`` and ``add_bias_linear``, which gives the attention's output projection and the MLP's linears a
  bias together, so the two must agree (refused by name otherwise). ``o_proj``'s and ``down_proj``'s biases whole on
  every rank (added after the row-parallel reduction), ``up_proj``'s split with its rows.
- Rope as Llama's (default, llama3, YaRN), every channel of each head rotated in rotate-half pairs.
"""

from __future__ import annotations

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.arcee import ArceeBridge
from loongforge_hf.bridges.registry import register_bridge
from loongforge_hf.bridges.starcoder2 import BiasedLayerNorms

JAIS2_FIELDS = C.fields_with_eps("layer_norm_eps")


@register_bridge("Jais2ForCausalLM")
class Jais2Bridge(BiasedLayerNorms, ArceeBridge):
    config_fields = JAIS2_FIELDS

    def __init__(self, hf_config) -> None:
        self.qkv_bias = self.mlp_bias = self.bias = bool(getattr(hf_config, "mlp_bias", False))
        super().__init__(hf_config)

    def check_config(self) -> None:
        c = self.hf_config
        if bool(getattr(c, "attention_bias", False)) != self.bias:
            raise C.UnsupportedConfigError(
                f"attention_bias={c.attention_bias} with mlp_bias={c.mlp_bias} is not supported for Jais2ForCausalLM: "
                "megatron's attention output projection has a bias exactly when the MLP's linears do "
                "(add_bias_linear).")
        super().check_config()

    def transformer_config_kwargs(self) -> dict:
        return {**super().transformer_config_kwargs(), "normalization": "LayerNorm", "add_bias_linear": self.bias}
