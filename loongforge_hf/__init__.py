"""loongforge-hf: Hugging Face checkpoints in, Hugging Face checkpoints out, megatron-core in between."""

from loongforge_hf.modeling import AutoModelForCausalLM, LoongModelForCausalLM
from loongforge_hf.multimodal.modeling import AutoModelForImageTextToText, LoongModelForImageTextToText
from loongforge_hf.parallel import ParallelConfig, ParallelLayoutError
from loongforge_hf.trainer import LoongTrainer, LoongTrainingArguments

__version__ = "0.1.0"

__all__ = ["AutoModelForCausalLM", "AutoModelForImageTextToText", "LoongModelForCausalLM",
           "LoongModelForImageTextToText", "LoongSFTConfig", "LoongSFTTrainer", "LoongTrainer",
           "LoongTrainingArguments", "ParallelConfig", "ParallelLayoutError", "__version__"]


def __getattr__(name: str):
    # NOTE: trl (and the datasets stack it imports) loads only when LoongSFTTrainer / LoongSFTConfig is asked for.
    if name in ("LoongSFTConfig", "LoongSFTTrainer"):
        from loongforge_hf.integrations import trl

        return getattr(trl, name)
    raise AttributeError(f"module 'loongforge_hf' has no attribute {name!r}")
