"""ExaoneMoeForCausalLM (LG's K-EXAONE): EXAONE 4.0's attention in pre-norm layers with DeepSeek-V3's mixture of
experts.

Choices:
- Layers are pre-norm (``input_layernorm``, ``post_attention_layernorm`` before the MLP: OLMoE's layout, not EXAONE
  4.0's post norms); per-head q / k norms before the rotation (megatron's ``qk_layernorm``); GQA; no biases.
- ``layer_types`` (three sliding layers to one full in K-EXAONE): the window on the sliding layers (megatron's
  ``window_attn_skip_freq``) and no rotary embedding on the full ones (``smollm3.no_rope_attention``), as
  transformers rotates only the sliding layers whenever ``sliding_window`` is not None (always, in its strict
  config: a window of 0 with only full layers rotates none). Plain rope or llama3 scaling: a rope attention factor
  (YaRN) would scale the unrotated full layers' q / k too in our q / k norm slots, so it is refused.
- ``mlp_layer_types`` says which layers are dense (a gated MLP of ``intermediate_size``) and which sparse:
  ``num_experts`` experts of ``moe_intermediate_size`` (one tensor per expert on disk, as transformers'
  ``save_pretrained`` writes them) beside ``num_shared_experts`` always-on ones as one MLP (``mlp.shared_experts``).
- Routing is DeepSeek-V3's (``deepseek.sigmoid_routing_kwargs``): sigmoid scores plus a fixed
  ``e_score_correction_bias`` (on disk beside the gate: ``mlp.e_score_correction_bias``, as MiniMax-M2's), top-2-sum
  group scores, renormalised, times ``routed_scaling_factor``; router weight and bias in fp32 as transformers keeps
  them; transformers' ``router_logits``, no balancing loss (transformers adds none).
- Multi-token-prediction tensors in the checkpoint (``mtp.*``, which transformers ignores) are not built: skipped on
  load and copied unchanged on export.
"""

from types import SimpleNamespace

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.deepseek import sigmoid_routing_kwargs
from loongforge_hf.bridges.layer_types import WindowsByLayerType, check_mlp_layer_types
from loongforge_hf.bridges.moe import MoEBridge
from loongforge_hf.bridges.registry import register_bridge
from loongforge_hf.bridges.smollm3 import no_rope_attention


@register_bridge("ExaoneMoeForCausalLM")
class ExaoneMoeBridge(WindowsByLayerType, MoEBridge):
    qk_norm = True
    extra_rope_types = ()
    shared_experts = "shared_experts"
    expert_bias = True
    expert_bias_name = "e_score_correction_bias"
    router_fp32 = True
    hf_router_logits = True                                    # transformers returns them; it adds no aux loss
    has_passthrough = True

    # ---- config ---------------------------------------------------------------------------------------------
    def check_config(self) -> None:
        c = self.hf_config
        check_mlp_layer_types(c)
        if (c.num_shared_experts or 0) < 1:
            raise C.UnsupportedConfigError(f"num_shared_experts={c.num_shared_experts} is not supported (at least 1).")
        super().check_config()

    def num_experts(self) -> int:
        return self.hf_config.num_experts

    def shared_ffn_size(self) -> int:
        return self.hf_config.moe_intermediate_size * self.hf_config.num_shared_experts

    def is_moe_layer(self, layer: int) -> bool:
        return self.hf_config.mlp_layer_types[layer] == "sparse"

    def routing_kwargs(self) -> dict:
        c = self.hf_config
        return sigmoid_routing_kwargs(SimpleNamespace(
            n_routed_experts=c.num_experts, num_experts_per_tok=c.num_experts_per_tok, n_group=c.n_group,
            topk_group=c.topk_group, norm_topk_prob=c.norm_topk_prob, routed_scaling_factor=c.routed_scaling_factor))

    def attention_module(self) -> type | None:
        c = self.hf_config
        full = frozenset(i for i, kind in enumerate(c.layer_types or []) if kind == "full_attention")
        return no_rope_attention(full) if c.sliding_window is not None and full else None

    def passthrough_names(self, names) -> list[str]:
        """The checkpoint's multi-token-prediction tensors (``mtp.*``), not built."""
        return [n for n in names if n.startswith("mtp.")]
