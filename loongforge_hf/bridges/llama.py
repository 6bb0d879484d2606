"""LlamaForCausalLM: Llama 2, 3, 3.1, 3.2 (llama3 rope scaling is handled by the shared rope code)."""

from loongforge_hf.bridges.dense import DenseBridge
from loongforge_hf.bridges.registry import register_bridge


@register_bridge("LlamaForCausalLM")
class LlamaBridge(DenseBridge):
    pass
