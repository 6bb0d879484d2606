"""MistralForCausalLM: Llama layout plus an optional sliding attention window (Mistral 7B v0.1: 4096);
MinistralForCausalLM (Ministral-8B): Mistral with the window on the layers ``layer_types`` marks."""

from loongforge_hf.bridges.dense import DenseBridge
from loongforge_hf.bridges.layer_types import check_layer_kinds, layer_windows
from loongforge_hf.bridges.registry import register_bridge


@register_bridge("MistralForCausalLM")
class MistralBridge(DenseBridge):
    supports_sliding_window = True


@register_bridge("MinistralForCausalLM")
class MinistralBridge(MistralBridge):
    per_layer_types = True

    def check_config(self) -> None:
        super().check_config()
        check_layer_kinds(self.hf_config, self.architectures[0])

    def transformer_config_kwargs(self) -> dict:
        kw = super().transformer_config_kwargs()
        kw.pop("window_size", None)
        return {**kw, **layer_windows(self.hf_config)}
