"""loongforge-hf: Hugging Face checkpoints in, Hugging Face checkpoints out, megatron-core in between."""

from loongforge_hf.modeling import AutoModelForCausalLM, LoongModelForCausalLM
from loongforge_hf.multimodal.modeling import AutoModelForImageTextToText, LoongModelForImageTextToText
from loongforge_hf.parallel import ParallelConfig, ParallelLayoutError
from loongforge_hf.trainer import LoongTrainer, LoongTrainingArguments

__version__ = "0.1.0"

__all__ = ["AutoModelForCausalLM", "AutoModelForImageTextToText", "LoongModelForCausalLM",
           "LoongModelForImageTextToText", "LoongSFTTrainer", "LoongTrainer", "LoongTrainingArguments",
           "ParallelConfig", "ParallelLayoutError", "__version__"]


def __getattr__(name: str):
    # NOTE: trl (and the datasets stack it imports) loads only when LoongSFTTrainer is asked for.
    if name == "LoongSFTTrainer":
        from loongforge_hf.integrations.trl import LoongSFTTrainer

        return LoongSFTTrainer
    raise AttributeError(f"module 'loongforge_hf' has no attribute {name!r}")
