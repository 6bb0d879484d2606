"""Qwen3ForCausalLM: RMSNorm on each head's q and k; head_dim independent of hidden_size / heads."""

from loongforge_hf.bridges.dense import DenseBridge
from loongforge_hf.bridges.registry import register_bridge


@register_bridge("Qwen3ForCausalLM")
class Qwen3Bridge(DenseBridge):
    qk_norm = True
