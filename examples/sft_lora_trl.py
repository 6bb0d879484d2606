"""LoRA fine-tuning with ``peft.LoraConfig`` and ``lf.LoongSFTTrainer``: examples/sft_trl.py plus adapters.

What it adds to examples/sft_trl.py (same flags, same built-in in-memory dataset, ``--model tiny`` to run offline):
1. a ``peft.LoraConfig`` from ``--lora_r``, ``--lora_alpha``, ``--lora_dropout``, ``--lora_target_modules``
   (HF module names: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, or all-linear),
   ``--lora_modules_to_save`` and ``--use_rslora``, passed as ``peft_config=`` exactly as to ``trl.SFTTrainer``:
   the adapters go onto megatron's tensor-parallel layers and only they train;
2. ``trainer.model.print_trainable_parameters()``;
3. ``trainer.save_model(<output_dir>/adapter)``: a PEFT adapter folder that
   ``peft.PeftModel.from_pretrained(transformers_model, folder)`` loads as it is, and with ``--merged_export``
   ``model.save_pretrained(<output_dir>/merged, merged=True)``: a plain HF checkpoint with the adapters merged.

    python examples/sft_lora_trl.py --model tiny --output_dir outputs/sft-lora --max_steps 10 --use_cpu
    torchrun --nproc-per-node 8 examples/sft_lora_trl.py --model Qwen/Qwen3-8B --tensor_parallel_size 2 \\
        --dtype bfloat16 --bf16 --lora_target_modules all-linear --output_dir outputs/sft-lora --merged_export
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import peft

import loongforge_hf as lf
from sft_trl import builtin_dataset, check_world, load_model, load_tokenizer, parse_args, resolve_model


@dataclass
class LoraArguments:
    lora_r: int = field(default=16, metadata={"help": "Adapter rank."})
    lora_alpha: float = field(default=32, metadata={"help": "Scaling numerator (scaling = alpha / r)."})
    lora_dropout: float = field(default=0.0, metadata={"help": "Dropout on the adapter input."})
    lora_target_modules: list[str] = field(default_factory=lambda: ["all-linear"],
                                           metadata={"help": "HF module names, or all-linear."})
    lora_modules_to_save: list[str] | None = field(
        default=None, metadata={"help": "Also train these whole modules (norms, embed_tokens, lm_head)."})
    use_rslora: bool = field(default=False, metadata={"help": "scaling = alpha / sqrt(r)."})
    merged_export: bool = field(default=False, metadata={"help": "Also write the merged model in HF format."})


def lora_config(largs: LoraArguments) -> peft.LoraConfig:
    targets = largs.lora_target_modules
    return peft.LoraConfig(r=largs.lora_r, lora_alpha=largs.lora_alpha, lora_dropout=largs.lora_dropout,
                           target_modules="all-linear" if targets == ["all-linear"] else targets,
                           modules_to_save=largs.lora_modules_to_save, use_rslora=largs.use_rslora,
                           task_type="CAUSAL_LM")


def main(argv: list[str] | None = None) -> dict:
    margs, largs, args = parse_args(argv, extra=(LoraArguments,))
    folder = resolve_model(margs.model, args.output_dir)
    model = load_model(margs, folder)
    check_world(args)
    trainer = lf.LoongSFTTrainer(model=model, args=args, train_dataset=builtin_dataset(margs.dataset_format),
                                 processing_class=load_tokenizer(folder), peft_config=lora_config(largs))
    trainer.model.print_trainable_parameters()
    result = trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    trainer.log_metrics("train", result.metrics)
    out = Path(args.output_dir)
    trainer.save_model(str(out / "adapter"))                   # PEFT adapter folder + tokenizer (collective)
    if largs.merged_export:
        trainer.model.save_pretrained(out / "merged", merged=True)   # plain HF checkpoint (collective)
    return {"train_loss": result.training_loss, "adapter": str(out / "adapter"),
            "merged": str(out / "merged") if largs.merged_export else None}


if __name__ == "__main__":
    main()
