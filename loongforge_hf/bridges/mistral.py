"""MistralForCausalLM: Llama layout plus an optional sliding attention window (Mistral 7B v0.1: 4096)."""

from loongforge_hf.bridges.dense import DenseBridge
from loongforge_hf.bridges.registry import register_bridge


@register_bridge("MistralForCausalLM")
class MistralBridge(DenseBridge):
    supports_sliding_window = True
