"""LoRA on megatron-core parallel layers, configured with ``peft.LoraConfig`` and exported in PEFT's format."""

from loongforge_hf.lora.load import load_adapter
from loongforge_hf.lora.model import LoongLoraModelForCausalLM, get_peft_model
from loongforge_hf.lora.plan import LoraConfigError

__all__ = ["LoongLoraModelForCausalLM", "LoraConfigError", "get_peft_model", "load_adapter"]
