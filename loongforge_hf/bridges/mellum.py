"""MellumForCausalLM (JetBrains' Mellum 2): Qwen3-MoE's attention and experts with sliding-window layers, a rope
base per layer type and dense layers where ``mlp_layer_types`` says so.

Choices:
- Attention: grouped-query with per-head q / k norms before the rotation (megatron's ``qk_layernorm``), no biases.
  ``layer_types``: the window on the sliding layers only (megatron's ``window_attn_skip_freq``), each layer type with
  its own rope parameters (``layer_types.LayerTypes``: two rotary tables side by side, each layer taking its own;
  plain or linear rope, whole heads).
- MLP: ``mlp_layer_types`` (``layer_types.check_mlp_layer_types``): dense layers a gated MLP of ``intermediate_size``,
  sparse ones Qwen3-MoE's (``qwen3_moe.py``): softmax top-k over ``num_experts`` experts of ``moe_intermediate_size``,
  renormalised where ``norm_topk_prob``, no shared experts; transformers' ``router_logits`` and its balancing loss
  (``output_router_logits``).
- Multi-token-prediction tensors in a checkpoint (``mtp.*``, which transformers ignores) are not built: skipped on
  load and copied unchanged on export.
"""

from loongforge_hf.bridges.layer_outputs import transformed_attention
from loongforge_hf.bridges.layer_types import LayerTypes, check_mlp_layer_types, layer_windows
from loongforge_hf.bridges.qwen3_moe import Qwen3MoeBridge
from loongforge_hf.bridges.registry import register_bridge


@register_bridge("MellumForCausalLM")
class MellumBridge(LayerTypes, Qwen3MoeBridge):
    supports_sliding_window = True
    has_passthrough = True

    def check_config(self) -> None:
        check_mlp_layer_types(self.hf_config)
        self.check_layer_types()
        super().check_config()

    def is_moe_layer(self, layer: int) -> bool:
        return self.hf_config.mlp_layer_types[layer] == "sparse"

    def transformer_config_kwargs(self) -> dict:
        kw = super().transformer_config_kwargs()
        kw.pop("window_size", None)
        return {**kw, **layer_windows(self.hf_config)}

    def attention_module(self) -> type:
        return transformed_attention(sliding_layers=self.sliding_layers)

    def finish_model(self, model) -> None:
        self.set_rotary_tables(model)

    def passthrough_names(self, names) -> list[str]:
        """The checkpoint's multi-token-prediction tensors (``mtp.*``), not built."""
        return [n for n in names if n.startswith("mtp.")]
