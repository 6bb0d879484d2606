"""GraniteForCausalLM (IBM Granite 3.x dense models): the Llama layout with four multipliers.

Choices:
- ``embedding_multiplier``: the embedding's output times it (``layer_outputs.scale_embedding``).
- ``residual_multiplier``: the attention's and the MLP's outputs times it before each residual add (in the modules,
  after ``linear_proj`` / ``linear_fc2`` and LoRA's terms: ``layer_outputs.transformed_attention`` / ``_mlp``).
- ``attention_multiplier``: the softmax scale (megatron's ``softmax_scale``), in place of ``1 / sqrt(head_dim)``.
- ``logits_scaling``: transformers divides the logits by it; here the LM head's input (the final norm's output) is
  multiplied by ``1 / logits_scaling`` (``layer_outputs.scale_final_norm``): the head is linear, so the logits are
  the same up to rounding (fp32: ~1e-7 relative), and the fused loss (``kernels.cross_entropy``) needs no change.
- Attention / MLP biases are refused by the shared dense checks.
"""

from loongforge_hf.bridges.dense import DenseBridge
from loongforge_hf.bridges.layer_outputs import (scale_embedding, scale_final_norm, transformed_attention,
                                                 transformed_mlp)
from loongforge_hf.bridges.registry import register_bridge


@register_bridge("GraniteForCausalLM")
class GraniteBridge(DenseBridge):
    def _multiplier(self, name: str) -> float:
        return float(getattr(self.hf_config, name, 1.0))

    def transformer_config_kwargs(self) -> dict:
        return {**super().transformer_config_kwargs(), "softmax_scale": self._multiplier("attention_multiplier")}

    def attention_module(self) -> type | None:
        return transformed_attention(scale=self._multiplier("residual_multiplier"))

    def mlp_module(self) -> type | None:
        return transformed_mlp(scale=self._multiplier("residual_multiplier"))

    def finish_model(self, model) -> None:
        scale_embedding(model, self._multiplier("embedding_multiplier"))
        scale_final_norm(model, 1.0 / self._multiplier("logits_scaling"))
