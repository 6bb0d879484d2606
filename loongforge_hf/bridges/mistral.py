"""MistralForCausalLM: Llama layout plus an optional sliding attention window (Mistral 7B v0.1: 4096);
MinistralForCausalLM (Ministral-8B): Mistral with the window on the layers ``layer_types`` marks."""

from loongforge_hf.bridges.dense import DenseBridge
from loongforge_hf.bridges.layer_types import WindowsByLayerType
from loongforge_hf.bridges.registry import register_bridge


@register_bridge("MistralForCausalLM")
class MistralBridge(DenseBridge):
    supports_sliding_window = True


@register_bridge("MinistralForCausalLM")
class MinistralBridge(WindowsByLayerType, MistralBridge):
    pass
