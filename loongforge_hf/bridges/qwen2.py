"""Qwen2ForCausalLM (Qwen2, Qwen2.5): bias on q, k and v projections."""

from loongforge_hf.bridges.dense import DenseBridge
from loongforge_hf.bridges.registry import register_bridge


@register_bridge("Qwen2ForCausalLM")
class Qwen2Bridge(DenseBridge):
    qkv_bias = True
