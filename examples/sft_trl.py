"""Supervised fine-tuning with trl's ``SFTConfig`` and ``lf.LoongSFTTrainer``: the script to copy and adapt.

What it does, top to bottom:
1. parses this script's arguments (model, layout, dataset format) and every ``trl.SFTConfig`` flag with
   ``HfArgumentParser``;
2. loads the HF checkpoint onto megatron-core with ``lf.AutoModelForCausalLM.from_pretrained`` and the parallel sizes
   given here (``--tensor_parallel_size`` ...). ``--model tiny`` writes a tiny random Llama (tokenizer included) with
   transformers itself first, so the script runs with no download;
3. builds an in-memory ``datasets.Dataset`` from a few built-in conversations, in one of TRL's formats
   (``--dataset_format messages | prompt_completion | text``); a tokenizer without a chat template gets a minimal one
   with generation markers, so ``--assistant_only_loss`` works;
4. trains with ``lf.LoongSFTTrainer`` exactly as with ``trl.SFTTrainer`` (same SFTConfig: ``--packing``,
   ``--completion_only_loss``, ``--assistant_only_loss``, ``--max_length`` ...), and writes the fine-tuned model in HF
   format to ``<output_dir>/final``.

Launch it as any trl script (add ``--use_cpu`` on a machine without GPUs):
    python examples/sft_trl.py --model tiny --output_dir outputs/sft --max_steps 10 --use_cpu
    torchrun --nproc-per-node 8 examples/sft_trl.py --model Qwen/Qwen3-8B --tensor_parallel_size 2 \\
        --dtype bfloat16 --bf16 --output_dir outputs/sft --max_steps 100
LoRA: examples/sft_lora_trl.py (same flags plus the LoRA ones).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import datasets
import torch.distributed as dist
import transformers
import trl

import loongforge_hf as lf

CONVERSATIONS = [
    ("What is a forge?", "A workshop where metal is heated until it glows and is then shaped with a hammer."),
    ("How does a smith know the iron is ready?", "By its colour: bright yellow is right, dull red is too cold."),
    ("What is tensor parallelism?", "Splitting every weight matrix of a model across several devices."),
    ("What is pipeline parallelism?", "Giving each device a consecutive slice of the model's layers."),
    ("What does data parallelism do?", "It gives each model replica its own share of every batch."),
    ("What is a Hugging Face checkpoint?", "A folder with config.json, safetensors weights and tokenizer files."),
    ("What does the training loss measure?", "The average surprise of the model's next-token guesses."),
    ("What is LoRA?", "Training two small matrices per layer whose product is added to the frozen weight."),
]

# NOTE: for tokenizers without a chat template (the tiny model's): TRL's assistant_only_loss needs generation markers.
FALLBACK_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'assistant' %}{% generation %}"
    "{{ message['content'] + eos_token }}{% endgeneration %}{% else %}{{ message['role'] + ': ' + "
    "message['content'] + '\\n' }}{% endif %}{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
)


@dataclass
class ModelArguments:
    model: str = field(metadata={"help": "HF checkpoint (local folder or hub id), or 'tiny' for a random tiny Llama."})
    tensor_parallel_size: int | None = field(default=None, metadata={"help": "TP size (default 1)."})
    pipeline_parallel_size: int | None = field(default=None, metadata={"help": "PP size (default 1)."})
    context_parallel_size: int | None = field(default=None, metadata={"help": "CP size (default 1)."})
    sequence_parallel: bool | None = field(default=None, metadata={"help": "Sequence parallelism (needs TP > 1)."})
    dtype: str = field(default="auto", metadata={"help": "auto (the checkpoint's), float32, bfloat16 or float16."})
    dataset_format: str = field(default="messages", metadata={"help": "messages, prompt_completion or text."})


def resolve_model(name: str, output_dir: str) -> str:
    """``name`` itself, or for 'tiny' a tiny random Llama written once under ``output_dir`` (rank 0 writes)."""
    if name != "tiny":
        return name
    from loongforge_hf.testing import make_tiny_checkpoint

    folder = Path(output_dir) / "tiny-llama"
    if int(os.environ.get("RANK", "0")) == 0 and not folder.is_dir():
        staging = folder.with_name(f".tiny-llama-{os.getpid()}")
        make_tiny_checkpoint(staging, "llama")
        os.replace(staging, folder)          # complete or absent: the other ranks wait for the folder
    while not folder.is_dir():
        time.sleep(0.2)
    return str(folder)


def load_model(margs: ModelArguments, folder: str):
    layout = {k: getattr(margs, k) for k in ("tensor_parallel_size", "pipeline_parallel_size",
                                             "context_parallel_size", "sequence_parallel")}
    return lf.AutoModelForCausalLM.from_pretrained(folder, dtype=margs.dtype, **layout)


def load_tokenizer(folder: str):
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    if tokenizer.chat_template is None:
        tokenizer.chat_template = FALLBACK_CHAT_TEMPLATE
    return tokenizer


def builtin_dataset(fmt: str) -> datasets.Dataset:
    """The built-in conversations in one of TRL's dataset formats."""
    if fmt == "messages":
        return datasets.Dataset.from_list([{"messages": [{"role": "user", "content": q},
                                                         {"role": "assistant", "content": a}]}
                                           for q, a in CONVERSATIONS])
    if fmt == "prompt_completion":
        return datasets.Dataset.from_list([{"prompt": f"Question: {q}\nAnswer:", "completion": f" {a}"}
                                           for q, a in CONVERSATIONS])
    if fmt == "text":
        return datasets.Dataset.from_list([{"text": f"Question: {q}\nAnswer: {a}"} for q, a in CONVERSATIONS])
    raise SystemExit(f"--dataset_format {fmt!r}: use messages, prompt_completion or text.")


def parse_args(argv: list[str] | None = None, extra: tuple = ()):
    parser = transformers.HfArgumentParser((ModelArguments, *extra, trl.SFTConfig))
    return parser.parse_args_into_dataclasses(args=argv)


def check_world(args) -> None:
    world = dist.get_world_size()
    if args.world_size != world:
        # NOTE: without GPUs, transformers sees the launcher's ranks only with use_cpu=True.
        raise SystemExit(f"{world} ranks were launched but transformers sees {args.world_size}: on a machine "
                         "without GPUs pass --use_cpu.")


def main(argv: list[str] | None = None) -> dict:
    margs, args = parse_args(argv)
    folder = resolve_model(margs.model, args.output_dir)
    model = load_model(margs, folder)     # starts torch.distributed (if the launcher has not) and megatron's groups
    check_world(args)
    trainer = lf.LoongSFTTrainer(model=model, args=args, train_dataset=builtin_dataset(margs.dataset_format),
                                 processing_class=load_tokenizer(folder))
    result = trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    trainer.log_metrics("train", result.metrics)
    trainer.save_model(str(Path(args.output_dir) / "final"))   # HF format; collective: every rank calls it
    return {"train_loss": result.training_loss, "final": str(Path(args.output_dir) / "final")}


if __name__ == "__main__":
    main()
