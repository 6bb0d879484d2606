"""LoongTrainer: a drop-in transformers.Trainer on megatron-core schedules."""

from loongforge_hf.trainer.arguments import LoongTrainingArguments
from loongforge_hf.trainer.loong_trainer import LoongTrainer

__all__ = ["LoongTrainer", "LoongTrainingArguments"]
