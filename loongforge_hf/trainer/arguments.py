"""``LoongTrainingArguments``: ``transformers.TrainingArguments`` plus the knobs only LoongTrainer has.

LoongTrainer reads every field here with ``getattr(args, name, default)``, so plain ``TrainingArguments`` (and trl's
configs) keep working with the defaults below.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import TrainingArguments


@dataclass
class LoongTrainingArguments(TrainingArguments):
    dp_load_balance: bool = field(default=True, metadata={"help": (
        "Redistribute each optimizer step's samples over the data-parallel ranks so that every rank has about the "
        "same predicted compute (same samples per step, same gradient). Applies when the collator packs "
        "(DataCollatorWithFlattening) and there is more than one data-parallel rank.")})
    dp_balance_refit: bool = field(default=False, metadata={"help": (
        "Refit the balancing cost model (a*L^2 + b*L + c per sample) from each rank's measured forward+backward "
        "time over the first steps, instead of keeping the FLOP estimate from the model config.")})
    dp_balance_refit_steps: int = field(default=8, metadata={"help": (
        "How many measured steps the refit uses (the first training step is not measured: it pays one-time costs).")})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.dp_balance_refit_steps < 1:
            raise ValueError(f"dp_balance_refit_steps must be >= 1, got {self.dp_balance_refit_steps}.")
