"""HunYuanMoEV1ForCausalLM (Tencent's Hunyuan-A13B): HunYuan's attention (per-head q / k norms after the rotary
embedding, rotation by ``position_ids``, NTK-alpha rope: ``hunyuan_v1_dense.HunYuanAttention``) and in every layer a
softmax top-k mixture of experts beside an always-on shared MLP.

Choices:
- Attention, rope and the refused ``attention_bias``: ``hunyuan_v1_dense.py``.
- Experts: ``num_experts`` experts of ``intermediate_size`` (transformers builds them, and the shared MLP, from it),
  top ``moe_topk``, softmax renormalised over the chosen (megatron's ``pre_softmax=False``: the softmax over the k
  chosen logits), router ``gate.wg`` in fp32 as transformers makes it; ``shared_mlp`` as megatron's shared experts
  (no gate). A per-layer ``moe_topk`` list must hold one value. transformers' ``router_logits``,
  no balancing loss (its ``HunYuanMoEV1ForCausalLM`` adds none).
"""

from __future__ import annotations

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.hunyuan_v1_dense import HunYuanAttention
from loongforge_hf.bridges.moe import MoEBridge
from loongforge_hf.bridges.registry import register_bridge


def _one_value(c, field: str) -> int:
    value = getattr(c, field)
    if isinstance(value, (list, tuple)):
        if len(set(value)) != 1:
            raise C.UnsupportedConfigError(f"{field}={list(value)} is not supported (one value for every layer).")
        return int(value[0])
    return int(value)


@register_bridge("HunYuanMoEV1ForCausalLM")
class HunYuanMoEV1Bridge(HunYuanAttention, MoEBridge):
    shared_experts = "shared_mlp"
    router_fp32 = True
    router_name = "gate.wg"
    hf_router_logits = True                                    # transformers returns them; it adds no aux loss

    # ---- config ---------------------------------------------------------------------------------------------
    def check_config(self) -> None:
        if self.num_experts() < 1:
            raise C.UnsupportedConfigError(f"num_experts={self.hf_config.num_experts}: HunYuan-MoE needs experts.")
        self.top_k()
        super().check_config()

    def num_experts(self) -> int:
        return self.hf_config.num_experts

    def top_k(self) -> int:
        return _one_value(self.hf_config, "moe_topk")

    def expert_ffn_size(self) -> int:
        return self.hf_config.intermediate_size

    def shared_ffn_size(self) -> int:
        return self.hf_config.intermediate_size

    def is_moe_layer(self, layer: int) -> bool:
        return True

    def routing_kwargs(self) -> dict:
        return {"moe_router_score_function": "softmax", "moe_router_pre_softmax": False}
