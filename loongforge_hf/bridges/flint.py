"""FlintForCausalLM (RecursiveSI's Flint): Qwen3-MoE's attention with a learned sink per head, sliding-window layers
that rotate beside full-attention layers without rotary embedding, and sigmoid-routed experts beside an always-on
shared expert.

Choices:
- Attention: grouped-query with per-head q / k norms before the rotation (megatron's ``qk_layernorm``), no biases.
  The sinks (``self_attn.softmax_offset`` on disk, ``[heads]``, fp32 as transformers keeps them) are megatron's
  learnable softmax offset (``softmax_type="learnable"``), split over TP with the heads, as gpt-oss's.
- ``layer_types``: the window on the sliding layers (megatron's ``window_attn_skip_freq``) and no rotary embedding on
  the full ones (``smollm3.no_rope_attention``), as transformers rotates only the sliding layers. Plain rope or
  llama3 scaling: a rope attention factor (YaRN) would scale the unrotated layers' q / k too, so it is refused.
- MLP: Qwen3-MoE's dense layers (``mlp_only_layers``, ``decoder_sparse_step``); the sparse ones take the top-k of the
  sigmoid of the router's fp32 logits (no expert bias), renormalised (megatron renormalises sigmoid top-k exactly
  when k > 1: ``norm_topk_prob`` otherwise is refused), plus ``mlp.shared_expert`` (``shared_expert_intermediate_size``,
  no gate). transformers' ``router_logits`` and its balancing loss (softmax of the same logits: the same top k).
"""

from loongforge_hf.bridges.deepseek import check_sigmoid_renormalisation
from loongforge_hf.bridges.dense import D, L
from loongforge_hf.bridges.layer_types import WindowsByLayerType
from loongforge_hf.bridges.mappings import FP32ColumnParallel, Mapping
from loongforge_hf.bridges.qwen3_moe import Qwen3MoeBridge
from loongforge_hf.bridges.registry import register_bridge
from loongforge_hf.bridges.smollm3 import no_rope_attention

_SINKS = f"{L}.self_attn.softmax_offset"


@register_bridge("FlintForCausalLM")
class FlintBridge(WindowsByLayerType, Qwen3MoeBridge):
    extra_rope_types = ()
    shared_experts = "shared_expert"
    router_fp32 = True

    def shared_ffn_size(self) -> int:
        return self.hf_config.shared_expert_intermediate_size

    def routing_kwargs(self) -> dict:
        check_sigmoid_renormalisation(self.hf_config)
        return {"moe_router_score_function": "sigmoid"}

    def transformer_config_kwargs(self) -> dict:
        return {**super().transformer_config_kwargs(), "softmax_type": "learnable"}

    def attention_module(self) -> type | None:
        full = frozenset(i for i, kind in enumerate(self.hf_config.layer_types) if kind == "full_attention")
        return no_rope_attention(full) if full else None

    # ---- tensors --------------------------------------------------------------------------------------------
    def attention_mappings(self) -> list[Mapping]:
        return super().attention_mappings() + [
            FP32ColumnParallel(f"{D}.self_attention.core_attention.softmax_offset", _SINKS)]

    def attention_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        return {**super().attention_shapes(prefix),
                f"{prefix}.self_attn.softmax_offset": (self.hf_config.num_attention_heads,)}
