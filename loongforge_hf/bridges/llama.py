"""LlamaForCausalLM: Llama 2, 3, 3.1, 3.2 (llama3 rope scaling is handled by the shared rope code); HeliumForCausalLM
(Kyutai's Helium) and Ernie4_5ForCausalLM (ERNIE 4.5 dense): the Llama layout rotating interleaved channel pairs
(``x[2i], x[2i+1]``, transformers' ``repeat_interleave`` cos / sin): megatron's ``rotary_interleaved``, on its own
rotary path (the fused-rope slot takes rotate-half pairs only); CwmForCausalLM (Meta's Code World Model): the Llama
layout with the window on the layers ``layer_types`` marks (every fourth layer full in the hub's), llama3 rope scaling;
Emu3ForCausalLM (BAAI's Emu3, its text model as transformers saves it: ``emu3_text_model``): the Llama layout whose
layers drop the attention and MLP outputs before the residual adds with ``attention_dropout`` (0.1 in the hub's), as
megatron's bias-dropout-add does with ``hidden_dropout``; the attention probabilities drop with it too, as Llama's.
"""

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.dense import DenseBridge
from loongforge_hf.bridges.layer_types import WindowsByLayerType
from loongforge_hf.bridges.registry import register_bridge


@register_bridge("LlamaForCausalLM")
class LlamaBridge(DenseBridge):
    pass


@register_bridge("HeliumForCausalLM")
class HeliumBridge(DenseBridge):
    def transformer_config_kwargs(self) -> dict:
        return {**super().transformer_config_kwargs(), "rotary_interleaved": True}


@register_bridge("Ernie4_5ForCausalLM")
class Ernie45Bridge(HeliumBridge):
    def check_config(self) -> None:
        super().check_config()
        if getattr(self.hf_config, "use_bias", False):
            raise C.UnsupportedConfigError("use_bias=True (biases on every linear) is not supported.")


@register_bridge("Emu3ForCausalLM")
class Emu3Bridge(LlamaBridge):
    def transformer_config_kwargs(self) -> dict:
        return {**super().transformer_config_kwargs(),
                "hidden_dropout": C.dropout_of(self.hf_config, "attention_dropout")}


@register_bridge("CwmForCausalLM")
class CwmBridge(WindowsByLayerType, LlamaBridge):
    """Llama with windowed layers (``layer_types.WindowsByLayerType``)."""
