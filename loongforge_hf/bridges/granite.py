"""GraniteForCausalLM (IBM Granite 3.x dense models) and GraniteMoeForCausalLM (Granite 3.x MoE: granite-3.1-1b-a400m,
3b-a800m): the Llama layout with four multipliers.

Choices:
- ``embedding_multiplier``: the embedding's output times it (``layer_outputs.scale_embedding``).
- ``residual_multiplier``: the attention's and the MLP's outputs times it before each residual add (in the modules,
  after ``linear_proj`` / ``linear_fc2`` and LoRA's terms: ``layer_outputs.transformed_attention`` / ``_mlp``).
- ``attention_multiplier``: the softmax scale (megatron's ``softmax_scale``), in place of ``1 / sqrt(head_dim)``.
- ``logits_scaling``: transformers divides the logits by it; here the LM head's input (the final norm's output) is
  multiplied by ``1 / logits_scaling`` (``layer_outputs.scale_final_norm``): the head is linear, so the logits are
  the same up to rounding (fp32: ~1e-7 relative), and the fused loss (``kernels.cross_entropy``) needs no change.
- Attention / MLP biases are refused by the shared dense checks.
- GraniteMoE: every layer a softmax top-k mixture (Mixtral's routing, renormalised over the k chosen; transformers'
  balancing loss and ``router_logits``), the experts stacked on disk (``block_sparse_moe.input_linear.weight``
  ``[E, 2I, H]`` with ``[gate; up]`` rows, ``output_linear.weight`` ``[E, H, I]``: ``stacked_experts.py``), the router
  ``block_sparse_moe.router.layer.weight``. Its residual multiplier scales megatron's own attention and MoE layer
  outputs (``layer_outputs.scale_sublayer_outputs``: the MoE spec keeps megatron's modules). ``moe_names``: the router
  and stacked experts' names under ``block_sparse_moe`` (Granite-MoE SWA keeps transformers 5's: ``granite_swa.py``).
- HyperCLOVAX (``HyperCLOVAXForCausalLM``, NAVER's HyperCLOVA X SEED): Granite with an RMSNorm on the attention's and
  the MLP's outputs before the residual multiplier (``use_post_norm``: ``post_norm1`` / ``post_norm2``, in
  ``transformed_attention`` / ``transformed_mlp``: the norm, then the factor) and ``logits_scaling`` a multiplier,
  not a divisor (the final norm's output times it).
"""

from loongforge_hf.bridges.dense import D, L, DenseBridge
from loongforge_hf.bridges.layer_outputs import (scale_embedding, scale_final_norm, scale_sublayer_outputs,
                                                 transformed_attention, transformed_mlp)
from loongforge_hf.bridges.mappings import Mapping, Replicated
from loongforge_hf.bridges.mixtral import MixtralBridge
from loongforge_hf.bridges.registry import register_bridge
from loongforge_hf.bridges.stacked_experts import StackedDown, StackedGateUp, routed_stack


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


@register_bridge("HyperCLOVAXForCausalLM")
class HyperCLOVAXBridge(GraniteBridge):
    @property
    def post_norms(self) -> bool:
        return bool(getattr(self.hf_config, "use_post_norm", True))

    def attention_module(self) -> type | None:
        return transformed_attention(post_norm=self.post_norms, scale=self._multiplier("residual_multiplier"))

    def mlp_module(self) -> type | None:
        return transformed_mlp(post_norm=self.post_norms, scale=self._multiplier("residual_multiplier"))

    def finish_model(self, model) -> None:
        scale_embedding(model, self._multiplier("embedding_multiplier"))
        scale_final_norm(model, self._multiplier("logits_scaling"))

    def layer_mappings(self) -> list[Mapping]:
        post = [Replicated(f"{D}.self_attention.post_layernorm.weight", f"{L}.post_norm1.weight"),
                Replicated(f"{D}.mlp.post_layernorm.weight", f"{L}.post_norm2.weight")]
        return super().layer_mappings() + (post if self.post_norms else [])

    def layer_shapes(self, layer: int) -> dict[str, tuple[int, ...]]:
        h, p = self.hf_config.hidden_size, f"model.layers.{layer}"
        post = {f"{p}.post_norm1.weight": (h,), f"{p}.post_norm2.weight": (h,)}
        return {**super().layer_shapes(layer), **(post if self.post_norms else {})}


@register_bridge("GraniteMoeForCausalLM")
class GraniteMoeBridge(MixtralBridge):
    _multiplier = GraniteBridge._multiplier
    moe_names = ("router.layer.weight", "input_linear.weight", "output_linear.weight")  # router, [gate; up], down

    def transformer_config_kwargs(self) -> dict:
        return {**super().transformer_config_kwargs(), "softmax_scale": self._multiplier("attention_multiplier")}

    def finish_model(self, model) -> None:
        GraniteBridge.finish_model(self, model)
        scale_sublayer_outputs(model, self._multiplier("residual_multiplier"))

    def moe_mappings(self) -> list[Mapping]:
        s, (router, gate_up, down) = f"{L}.block_sparse_moe", self.moe_names
        return [Replicated(f"{D}.pre_mlp_layernorm.weight", f"{L}.post_attention_layernorm.weight"),
                Replicated(f"{D}.mlp.router.weight", f"{s}.{router}"),
                *(routed_stack(self, cls, name, f"{s}.{hf}") for cls, name, hf in (
                    (StackedGateUp, "linear_fc1.weight", gate_up), (StackedDown, "linear_fc2.weight", down)))]

    def moe_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        h, f, n = self.hf_config.hidden_size, self.expert_ffn_size(), self.num_experts()
        s, (router, gate_up, down) = f"{prefix}.block_sparse_moe", self.moe_names
        return {f"{prefix}.post_attention_layernorm.weight": (h,), f"{s}.{router}": (n, h),
                f"{s}.{gate_up}": (n, 2 * f, h), f"{s}.{down}": (n, h, f)}
