"""``LoongTrainingArguments``: ``transformers.TrainingArguments`` plus the knobs only LoongTrainer has.

The knobs are defined once, in ``LoongArgumentsMixin``, which both ``LoongTrainingArguments`` and
``loongforge_hf.integrations.trl.LoongSFTConfig`` (trl's SFTConfig plus the same knobs) put in front of their base
config: the mixin's fields come after the base's (all have defaults, so the base's positional order is kept), and
its ``__post_init__`` runs the base's, then validates the knobs.

LoongTrainer reads every field here with ``getattr(args, name, default)``, so plain ``TrainingArguments`` (and trl's
configs) keep working with the defaults below.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from transformers import TrainingArguments

ADAMW_KERNELS = ("torch", "triton")


@dataclass
class LoongArgumentsMixin:
    """LoongTrainer's own knobs; put it before a ``TrainingArguments`` dataclass in the bases."""

    dp_load_balance: bool = field(default=True, metadata={"help": (
        "Redistribute each optimizer step's samples over the data-parallel ranks so that every rank has about the "
        "same predicted compute (same samples per step, same gradient). Applies when the collator packs without "
        "padding (DataCollatorWithFlattening, or TRL's SFT collator with padding_free / bfd packing) and there is "
        "more than one data-parallel rank.")})
    dp_balance_refit: bool = field(default=False, metadata={"help": (
        "Refit the balancing cost model (a*L^2 + b*L + c per sample) from each rank's measured forward+backward "
        "time over the first steps, instead of keeping the FLOP estimate from the model config.")})
    dp_balance_refit_steps: int = field(default=8, metadata={"help": (
        "How many measured steps the refit uses (the first training step is not measured: it pays one-time costs).")})

    optimizer_precision: str = field(default="fp32", metadata={"help": (
        "Precision of the optimizer state. 'fp32' (default): fp32 gradient buffer and megatron's distributed "
        "optimizer with fp32 main weights and fp32 AdamW moments, sharded over the data-parallel ranks (18 bytes "
        "per parameter of a bf16 model before sharding: 2 weight + 4 grad + 4 main weight + 8 moments). 'model': "
        "weights, gradients and AdamW moments all in the model's dtype, torch AdamW stepping the model's own "
        "parameters (8 bytes per parameter in bf16), what transformers.Trainer does on a model loaded with "
        "dtype=torch.bfloat16; every data-parallel rank then holds the full optimizer state instead of a shard.")})

    adamw_kernel: str = field(default="triton", metadata={"help": (
        "The AdamW step on CUDA. 'triton' (default): loongforge_hf.kernels.adamw.LoongAdamW, torch's AdamW update "
        "and state (checkpoints interchangeable) with one Triton kernel per tensor of >= 64Ki elements, at the "
        "memory-bandwidth bound (torch's fused AdamW where Triton does not import); on an H100 it took a 3.1 "
        "B-parameter MoE step (bench_train.py shape c, optimizer_precision='model') from 103.5 to 94.2 ms. 'torch': "
        "torch's fused AdamW. Off CUDA both run torch's AdamW.")})

    def __post_init__(self) -> None:
        super().__post_init__()
        from loongforge_hf.trainer.engine import OPTIMIZER_PRECISIONS

        if self.optimizer_precision not in OPTIMIZER_PRECISIONS:
            raise ValueError(f"optimizer_precision must be one of {', '.join(map(repr, OPTIMIZER_PRECISIONS))}, "
                             f"got {self.optimizer_precision!r}.")
        if self.adamw_kernel not in ADAMW_KERNELS:
            raise ValueError(f"adamw_kernel must be one of {', '.join(map(repr, ADAMW_KERNELS))}, "
                             f"got {self.adamw_kernel!r}.")
        if self.dp_balance_refit_steps < 1:
            raise ValueError(f"dp_balance_refit_steps must be >= 1, got {self.dp_balance_refit_steps}.")


LOONG_FIELDS = tuple(f.name for f in fields(LoongArgumentsMixin))


@dataclass
class LoongTrainingArguments(LoongArgumentsMixin, TrainingArguments):
    """``transformers.TrainingArguments`` plus ``LoongArgumentsMixin``'s knobs."""
