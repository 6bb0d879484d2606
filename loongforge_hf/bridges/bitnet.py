"""BitNetForCausalLM (Microsoft's BitNet b1.58 as plain weights: the ``-bf16`` master weights, or a model trained from
scratch): the Llama layout with a relu² gate and two sub-layer RMSNorms, on the attention's output before ``o_proj``
(``self_attn.attn_sub_norm``, over all heads) and on the MLP's gated product before ``down_proj``
(``mlp.ffn_sub_norm``, over the whole width).

Choices:
- The sub-norms normalise the inputs of megatron's row-parallel ``linear_proj`` / ``linear_fc2``: a forward pre-hook
  on that linear (so LoRA, which re-classes the linear in place, adapts the normalised input, as PEFT's adapter on
  ``o_proj`` / ``down_proj`` sees it); each norm is its attention's / MLP's ``sub_norm``. Under TP a rank holds its
  heads' (its MLP columns') channels and that slice of the weight, and the sum of squares is added up over the TP
  group, forward and backward (``olmo2.full_width_norm("width")``), with Llama's rounding as transformers'.
- The MLP: transformers' ``down(sub_norm(relu2(gate) * up))``, megatron's gated MLP with relu² (``hidden_act``).
- ``quantization_config`` (transformers' BitNet quantisation: packed ternary weights, or weights and activations
  quantised on the fly by ``AutoBitLinear``) is refused by name: megatron's linears compute with the plain weights.
"""

from __future__ import annotations

import functools

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.dense import D, L, DenseBridge
from loongforge_hf.bridges.mappings import ColumnParallel, Mapping
from loongforge_hf.bridges.olmo2 import full_width_norm
from loongforge_hf.bridges.registry import register_bridge


@functools.cache
def sub_normed(base: type, linear: str) -> type:
    """``base`` (megatron's ``SelfAttention`` or the dense MLP) with an RMSNorm, ``sub_norm``, on the input of its
    row-parallel ``linear`` (``linear_proj`` / ``linear_fc2``) over that input's whole width."""

    class SubNormed(base):
        def __init__(self, config, *args, **kwargs) -> None:
            super().__init__(config, *args, **kwargs)
            width = (config.num_attention_heads * config.kv_channels if linear == "linear_proj"
                     else config.ffn_hidden_size)
            self.sub_norm = full_width_norm("width", round_first=True)(config, width, eps=config.layernorm_epsilon)
            getattr(self, linear).register_forward_pre_hook(self._normalise_input)

        def _normalise_input(self, module, args):
            return (self.sub_norm(args[0]), *args[1:])

    SubNormed.__name__ = f"SubNormed{base.__name__}"
    return SubNormed


@register_bridge("BitNetForCausalLM")
class BitNetBridge(DenseBridge):
    def check_config(self) -> None:
        super().check_config()
        quantization = getattr(self.hf_config, "quantization_config", None)
        if quantization:
            raise C.UnsupportedConfigError(
                f"quantization_config={quantization!r} is not supported for BitNetForCausalLM (ternary weights / "
                "quantised activations); load the plain (bf16) weights.")

    def attention_module(self) -> type | None:
        from megatron.core.transformer.attention import SelfAttention

        return sub_normed(SelfAttention, "linear_proj")

    def mlp_module(self) -> type | None:
        from loongforge_hf.kernels.specs import SwiGLUMLP

        return sub_normed(SwiGLUMLP, "linear_fc2")

    def layer_mappings(self) -> list[Mapping]:
        return super().layer_mappings() + [
            ColumnParallel(f"{D}.self_attention.sub_norm.weight", f"{L}.self_attn.attn_sub_norm.weight"),
            ColumnParallel(f"{D}.mlp.sub_norm.weight", f"{L}.mlp.ffn_sub_norm.weight")]

    def layer_shapes(self, layer: int) -> dict[str, tuple[int, ...]]:
        c, p = self.hf_config, f"model.layers.{layer}"
        return {**super().layer_shapes(layer), f"{p}.self_attn.attn_sub_norm.weight": (c.hidden_size,),
                f"{p}.mlp.ffn_sub_norm.weight": (c.intermediate_size,)}
