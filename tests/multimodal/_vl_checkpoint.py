"""Rank functions for test_qwen2_5_vl_checkpoint.py: LoongTrainer checkpoints of Qwen2.5-VL, vision tower included."""

from __future__ import annotations

import os
import shutil

import torch
import torch.distributed as dist

from ._vl_features import collator
from ._vl_parity import train_features, vl_training_args


def train(folder: str, out_dir: str, layout: dict, resume: str | None = None, use_cpu: bool = True) -> dict:
    """LoongTrainer, every parameter trained (tower and projector too), 4 steps of 2 samples, a checkpoint at step 2
    (or resumed from ``resume``, a copy of one): the logged losses and the trained vision tower's export on rank 0."""
    import transformers

    import loongforge_hf as lf

    args = transformers.TrainingArguments(**{**vl_training_args(out_dir).to_dict(), "hub_token": None, "max_steps": 4,
                                             "save_strategy": "steps", "save_steps": 2, "use_cpu": use_cpu})
    model = lf.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32, **layout)
    trainer = lf.LoongTrainer(model=model, args=args, train_dataset=train_features(folder),
                              data_collator=collator(folder, pad_to_multiple_of=4))
    trainer.train(resume_from_checkpoint=resume)
    model.save_pretrained(f"{out_dir}/final")
    return {"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
            "checkpoint_files": sorted(os.listdir(f"{out_dir}/checkpoint-2")) if resume is None else None}


def clipped_tower_training(folder: str, out_dir: str, layout: dict) -> list[tuple[float, float]]:
    """LoongTrainer with the language model frozen (the tower and projector trained) and the gradients clipped at
    0.05 (below their norm): the logged (loss, grad_norm) of 3 steps."""
    import transformers

    import loongforge_hf as lf

    args = transformers.TrainingArguments(**{**vl_training_args(out_dir).to_dict(), "hub_token": None,
                                             "max_grad_norm": 0.05})
    model = lf.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32, freeze_language=True,
                                                           **layout)
    trainer = lf.LoongTrainer(model=model, args=args, train_dataset=train_features(folder),
                              data_collator=collator(folder, pad_to_multiple_of=4))
    trainer.train()
    return [(h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h]


def copy_checkpoint(src: str, dst: str) -> str:
    """A copy of ``src`` (rank 0 copies, every rank waits): each resume starts from the same files."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        shutil.copytree(src, dst)
    if dist.is_initialized():
        dist.barrier()
    return dst


def two_rank_runs(folder: str, out_dir: str) -> dict:
    """Uninterrupted at TP2 with the tower split over TP; resumed from its step-2 checkpoint at TP2 with the tower
    split, at TP2 with the tower replicated, and at PP2."""
    split = {"tensor_parallel_size": 2, "vision_tensor_parallel_size": 2}
    out = {"full": train(folder, f"{out_dir}/full", split)}
    for name, layout in (("tp2_split", split), ("tp2_replicated", {"tensor_parallel_size": 2}),
                         ("pp2", {"pipeline_parallel_size": 2})):
        resume = copy_checkpoint(f"{out_dir}/full/checkpoint-2", f"{out_dir}/{name}-from")
        out[name] = train(folder, f"{out_dir}/{name}", layout, resume=resume)
    out["clipped_split"] = clipped_tower_training(folder, f"{out_dir}/clipped", split)
    return out


def one_rank_resume(folder: str, out_dir: str, checkpoint: str) -> dict:
    return {**train(folder, f"{out_dir}/tp1", {}, resume=copy_checkpoint(checkpoint, f"{out_dir}/tp1-from")),
            "clipped": clipped_tower_training(folder, f"{out_dir}/clipped", {})}
