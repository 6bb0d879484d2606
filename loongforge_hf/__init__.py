"""loongforge-hf: Hugging Face checkpoints in, Hugging Face checkpoints out, megatron-core in between."""

from loongforge_hf.modeling import AutoModelForCausalLM, LoongModelForCausalLM
from loongforge_hf.multimodal.modeling import AutoModelForImageTextToText, LoongModelForImageTextToText
from loongforge_hf.parallel import ParallelConfig, ParallelLayoutError
from loongforge_hf.sequence_classification import (AutoModelForSequenceClassification,
                                                   LoongModelForSequenceClassification)
from loongforge_hf.trainer import LoongTrainer, LoongTrainingArguments

__version__ = "0.1.0"

__all__ = ["AutoModelForCausalLM", "AutoModelForImageTextToText", "AutoModelForSequenceClassification",
           "LoongDPOConfig", "LoongDPOTrainer", "LoongGRPOConfig", "LoongGRPOTrainer", "LoongModelForCausalLM",
           "LoongModelForImageTextToText", "LoongModelForSequenceClassification", "LoongRLOOConfig",
           "LoongRLOOTrainer", "LoongRewardConfig", "LoongRewardTrainer", "LoongSFTConfig", "LoongSFTTrainer",
           "LoongTrainer", "LoongTrainingArguments", "ParallelConfig", "ParallelLayoutError", "__version__"]


def __getattr__(name: str):
    # NOTE: trl (and the datasets stack it imports) loads only when a trainer / config of it is asked for.
    if name in ("LoongSFTConfig", "LoongSFTTrainer"):
        from loongforge_hf.integrations import trl

        return getattr(trl, name)
    if name in ("LoongDPOConfig", "LoongDPOTrainer"):
        from loongforge_hf.integrations import trl_dpo

        return getattr(trl_dpo, name)
    if name in ("LoongGRPOConfig", "LoongGRPOTrainer"):
        from loongforge_hf.integrations import trl_grpo

        return getattr(trl_grpo, name)
    if name in ("LoongRLOOConfig", "LoongRLOOTrainer"):
        from loongforge_hf.integrations import trl_rloo

        return getattr(trl_rloo, name)
    if name in ("LoongRewardConfig", "LoongRewardTrainer"):
        from loongforge_hf.integrations import trl_reward

        return getattr(trl_reward, name)
    raise AttributeError(f"module 'loongforge_hf' has no attribute {name!r}")
