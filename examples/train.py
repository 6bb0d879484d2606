"""Causal-LM training with loongforge-hf: the script to copy and adapt.

What it does, top to bottom:
1. parses this script's arguments (model, layout, data) and every ``transformers.TrainingArguments`` flag with
   ``HfArgumentParser``;
2. loads the HF checkpoint onto megatron-core with ``lf.AutoModelForCausalLM.from_pretrained`` and the parallel
   sizes given as flags here (``--tensor_parallel_size`` ..., or ``--parallel auto``). A size left out falls back
   to accelerate's ``megatron_lm`` settings when they are in the environment, then to 1: flags win
   (docs/parallelism.md; accelerate's ``MEGATRON_LM`` mode cannot run ``LoongTrainer`` yet, so the configs in
   examples/accelerate/ leave the layout to the flags);
3. builds a ``datasets.Dataset`` from a local text file (``--text_file``, one document per blank-line-separated
   paragraph) or from a few built-in paragraphs, so it runs offline; tokenizes with the model's tokenizer, groups the
   tokens into blocks of ``--block_size`` and holds out ``--eval_fraction`` of the blocks for evaluation;
4. trains with ``lf.LoongTrainer`` and ``DataCollatorForLanguageModeling(mlm=False)``, evaluates when asked
   (``--do_eval`` / ``--eval_strategy steps``), and writes the model in HF format to ``<output_dir>/final``
   (``trainer.save_model``: config.json, safetensors, tokenizer); ``--save_steps`` checkpoints go to
   ``<output_dir>/checkpoint-N`` and ``--resume_from_checkpoint`` continues from one.

Launch it as any transformers script:
    python examples/train.py --model Qwen/Qwen3-0.6B --output_dir outputs/train --max_steps 50
    torchrun --nproc-per-node 8 examples/train.py --model Qwen/Qwen3-8B --tensor_parallel_size 2 \\
        --pipeline_parallel_size 2 --dtype bfloat16 --output_dir outputs/train
    accelerate launch --config_file examples/accelerate/tp2_pp2_dp2_8gpu.yaml examples/train.py \\
        --model Qwen/Qwen3-8B --tensor_parallel_size 2 --pipeline_parallel_size 2 --output_dir outputs/train
On a machine without GPUs add ``--use_cpu`` (the ranks then talk over gloo, and transformers sees all of them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path

import datasets
import torch.distributed as dist
import transformers

import loongforge_hf as lf

BUILTIN_TEXT = """\
The loong is a creature of rivers and rain. Farmers along the valley say that when it turns in its sleep the rivers
rise, and when it wakes the rain comes down for seven days. Children draw it on paper lanterns every spring.

A forge is a place where metal is heated until it glows and is then shaped with a hammer. The smith watches the colour
of the metal: dull red is too cold to work, bright yellow is right, and white means the iron is about to burn.

Training a language model means showing it text and asking it, at every position, to guess the next token. The loss
is the average surprise of those guesses. When the model learns the patterns of the text, the loss goes down.

Large models do not fit on one device. Tensor parallelism splits every weight matrix across devices, pipeline
parallelism gives each device a slice of the layers, and data parallelism gives each replica its own share of the
batch. Expert parallelism places the experts of a mixture-of-experts layer on different devices.

A checkpoint in the Hugging Face format is a folder: a config.json that describes the architecture, one or more
safetensors files with the weights, and the tokenizer files. Any library that reads the format can load the folder.
"""


@dataclass
class ModelArguments:
    model: str = field(metadata={"help": "HF checkpoint: a local folder or a hub id."})
    tensor_parallel_size: int | None = field(default=None, metadata={"help": "TP size (default: accelerate's "
                                                                             "megatron_lm_tp_degree, else 1)."})
    pipeline_parallel_size: int | None = field(default=None, metadata={"help": "PP size (default: accelerate's "
                                                                               "megatron_lm_pp_degree, else 1)."})
    virtual_pipeline_parallel_size: int | None = field(default=None, metadata={"help": "Interleaved PP chunks."})
    context_parallel_size: int | None = field(default=None, metadata={"help": "CP size (default 1)."})
    expert_parallel_size: int | None = field(default=None, metadata={"help": "EP size for MoE models (default 1)."})
    expert_tensor_parallel_size: int | None = field(default=None, metadata={"help": "TP size inside experts."})
    sequence_parallel: bool | None = field(default=None, metadata={"help": "Sequence parallelism (needs TP > 1)."})
    parallel: str | None = field(default=None, metadata={"help": "'auto': choose every size from the world size, the "
                                                                 "model size and device memory (no size flags)."})
    dtype: str = field(default="auto", metadata={"help": "Parameter dtype: auto (the checkpoint's), float32, "
                                                         "bfloat16 or float16."})


@dataclass
class DataArguments:
    text_file: str | None = field(default=None, metadata={"help": "A UTF-8 text file; paragraphs are documents. "
                                                                  "Default: a few built-in paragraphs."})
    block_size: int = field(default=128, metadata={"help": "Tokens per training sequence (capped at the model's "
                                                           "max_position_embeddings)."})
    eval_fraction: float = field(default=0.1, metadata={"help": "Share of blocks held out for evaluation."})


def parse_args(argv: list[str] | None = None):
    parser = transformers.HfArgumentParser((ModelArguments, DataArguments, transformers.TrainingArguments))
    return parser.parse_args_into_dataclasses(args=argv)


def load_model(margs: ModelArguments):
    layout = {name: getattr(margs, name) for name in lf.ParallelConfig.__dataclass_fields__}
    # NOTE: None means "not given here": from_pretrained then takes accelerate's megatron_lm sizes, else 1.
    return lf.AutoModelForCausalLM.from_pretrained(margs.model, dtype=margs.dtype, parallel=margs.parallel, **layout)


def documents(text_file: str | None) -> datasets.Dataset:
    text = Path(text_file).read_text(encoding="utf-8") if text_file else BUILTIN_TEXT
    paragraphs = [" ".join(p.split()) for p in text.split("\n\n") if p.strip()]
    return datasets.Dataset.from_dict({"text": paragraphs})


def lm_blocks(docs: datasets.Dataset, tokenizer, block_size: int) -> datasets.Dataset:
    """Tokenize, append EOS to each document, concatenate, and cut into ``block_size`` blocks (the tail is dropped)."""
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []

    def tokenize(batch):
        return {"input_ids": [ids + eos for ids in tokenizer(batch["text"], add_special_tokens=False)["input_ids"]]}

    def group(batch):
        ids = list(chain.from_iterable(batch["input_ids"]))
        if len(ids) < block_size:
            raise ValueError(f"The text has {len(ids)} tokens, fewer than one block of {block_size}: give more "
                             "text (--text_file) or a smaller --block_size.")
        n = len(ids) // block_size * block_size
        return {"input_ids": [ids[i:i + block_size] for i in range(0, n, block_size)]}

    tokens = docs.map(tokenize, batched=True, remove_columns=docs.column_names, desc="tokenize")
    return tokens.map(group, batched=True, batch_size=len(tokens), desc=f"group into blocks of {block_size}")


def main(argv: list[str] | None = None) -> dict:
    margs, dargs, targs = parse_args(argv)
    transformers.set_seed(targs.seed)

    model = load_model(margs)           # starts torch.distributed (if the launcher has not) and megatron's groups
    world = dist.get_world_size()
    if targs.world_size != world:
        # NOTE: without GPUs, transformers sees the launcher's ranks only with use_cpu=True; otherwise every rank
        # would believe it is alone (each logs and writes trainer_state.json).
        raise SystemExit(f"{world} ranks were launched but transformers sees {targs.world_size}: on a machine "
                         "without GPUs pass --use_cpu.")
    tokenizer = transformers.AutoTokenizer.from_pretrained(margs.model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    block_size = min(dargs.block_size, model.config.max_position_embeddings)

    with targs.main_process_first(desc="dataset"):
        blocks = lm_blocks(documents(dargs.text_file), tokenizer, block_size)
    held_out = math.ceil(dargs.eval_fraction * len(blocks))
    if dargs.eval_fraction > 0 and not 0 < held_out < len(blocks):
        # NOTE: datasets' train_test_split would stop with a message about n_samples and test_size instead
        raise SystemExit(f"The text gives {len(blocks)} block(s) of {block_size} tokens: too few to hold out "
                         f"--eval_fraction {dargs.eval_fraction} for evaluation and keep some for training; give "
                         "more text (--text_file), a smaller --block_size, or --eval_fraction 0.")
    split = blocks.train_test_split(test_size=dargs.eval_fraction, seed=targs.seed) if dargs.eval_fraction > 0 \
        else {"train": blocks, "test": None}

    trainer = lf.LoongTrainer(
        model=model, args=targs, train_dataset=split["train"], eval_dataset=split["test"],
        processing_class=tokenizer,
        data_collator=transformers.DataCollatorForLanguageModeling(tokenizer, mlm=False),
    )
    if trainer.is_world_process_zero():
        p = model.parallel
        print(f"[train] {margs.model}: TP{p.tensor_parallel_size} x PP{p.pipeline_parallel_size} x "
              f"DP{p.data_parallel_size(world)} on {world} rank(s), {len(split['train'])} train blocks of "
              f"{block_size} tokens")

    result = trainer.train(resume_from_checkpoint=targs.resume_from_checkpoint)
    metrics = dict(result.metrics)
    trainer.log_metrics("train", metrics)
    if targs.do_eval and split["test"] is not None:
        eval_metrics = trainer.evaluate()
        eval_metrics["perplexity"] = math.exp(min(eval_metrics["eval_loss"], 50.0))
        trainer.log_metrics("eval", eval_metrics)
        metrics.update(eval_metrics)

    # NOTE: save_model replaces the folder it writes as a whole (all or nothing), so the export goes to a folder of
    # its own: writing --output_dir itself would remove the checkpoint-N folders that save_steps left there.
    trainer.save_model(str(Path(targs.output_dir) / "final"))   # HF format; collective: every rank calls it
    trainer.save_state()
    return metrics


if __name__ == "__main__":
    main()
    if dist.is_initialized():
        dist.destroy_process_group()  # NOTE: a clean shutdown of the process group, as torch asks of every script
