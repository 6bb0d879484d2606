"""The end-to-end demo: an HF checkpoint in, megatron-core tensor x pipeline parallel training, an HF checkpoint out.

What it does, top to bottom (no download, a minute on a 2-core laptop):
1. writes a tiny random Qwen3-shaped checkpoint with ``transformers`` itself, tokenizer included
   (``outputs/demo/source``);
2. starts 4 ranks — the local GPUs when there are at least 4 (and ``LOONGFORGE_DEVICE`` is not ``cpu``), otherwise
   4 CPU processes over gloo — and loads the checkpoint with
   ``lf.AutoModelForCausalLM.from_pretrained(..., tensor_parallel_size=2, pipeline_parallel_size=2)``: each rank
   reads only its slices;
3. trains 20 steps with ``lf.LoongTrainer`` and plain ``transformers.TrainingArguments`` on a synthetic
   ``datasets.Dataset`` whose sequences follow a fixed cycle of tokens (a pattern the model can learn, so the loss
   visibly drops);
4. exports with ``trainer.save_model(...)`` (``outputs/demo/export``: config.json, safetensors, tokenizer);
5. reloads the export with plain ``transformers.AutoModelForCausalLM.from_pretrained`` and compares its logits with
   the trained loongforge model's on the same batch;
6. continues a prompt (the start of the training cycle) greedily with ``model.generate`` on the trained TP x PP
   model (transformers' generate with loongforge's KV cache) and with plain transformers' ``generate`` on the export.

Run it with ``bash scripts/demo.sh`` (sets up ``.venv`` first) or ``python examples/demo.py --steps 20 --tp 2 --pp 2``.
Under ``torchrun`` (``RANK`` set) the rank body runs directly instead of spawning processes:
``torchrun --nproc-per-node 4 examples/demo.py``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

CYCLE = 16          # the training pattern: token ids 4, 5, ..., 4 + CYCLE - 1, then again from 4
SEQ_LEN = 32
PROMPT = [4, 5, 6, 7, 8]   # the start of the cycle: a trained model continues it with 9, 10, 11, ...
NEW_TOKENS = 8
TRAIN_SAMPLES = 128


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20, help="optimizer steps to train (default 20)")
    p.add_argument("--out", default="outputs/demo", help="where the source checkpoint and the export go")
    p.add_argument("--tp", type=int, default=2, help="tensor_parallel_size (default 2)")
    p.add_argument("--pp", type=int, default=2, help="pipeline_parallel_size (default 2)")
    p.add_argument("--arch", default="qwen3",
                   help="tiny architecture to write (default qwen3; see loongforge_hf.testing.TINY_ARCHS)")
    return p.parse_args(argv)


# ---- data -----------------------------------------------------------------------------------------------------
def cycle_batch(n: int, *, seed: int) -> torch.Tensor:
    """``n`` sequences of the token cycle, each starting at a random phase."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, CYCLE, (n, 1), generator=g)
    return 4 + (starts + torch.arange(SEQ_LEN)) % CYCLE


def train_dataset():
    import datasets

    ids = cycle_batch(TRAIN_SAMPLES, seed=0).tolist()
    return datasets.Dataset.from_dict({"input_ids": ids, "labels": ids})


# ---- what every rank runs ----------------------------------------------------------------------------------------
def rank_main(source: str, out: str, *, tp: int, pp: int, steps: int, on_cpu: bool) -> dict | None:
    """Load with TP x PP, train, export. Rank 0 returns the numbers the summary needs; other ranks return None."""
    import torch.distributed as dist
    import transformers

    import loongforge_hf as lf

    quiet_warnings()
    t0 = time.perf_counter()
    model = lf.AutoModelForCausalLM.from_pretrained(source, tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                                    dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(source)
    probe = cycle_batch(4, seed=1)                       # a held-out batch: loss before/after, logits comparison
    model.eval()
    with torch.no_grad():
        loss_before = float(model(input_ids=probe, labels=probe).loss)
    load_s = time.perf_counter() - t0

    args = transformers.TrainingArguments(
        output_dir=f"{out}/trainer", max_steps=steps, per_device_train_batch_size=4, gradient_accumulation_steps=2,
        learning_rate=3e-3, lr_scheduler_type="constant_with_warmup", warmup_steps=2, weight_decay=0.0,
        logging_steps=max(1, steps // 5), save_strategy="no", report_to=[], disable_tqdm=True, seed=0,
        use_cpu=on_cpu, dataloader_drop_last=True)
    trainer = lf.LoongTrainer(model=model, args=args, train_dataset=train_dataset(), processing_class=tokenizer)
    t1 = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - t1

    export = f"{out}/export"
    trainer.save_model(export)                           # collective: every rank streams its slices, rank 0 writes

    model.eval()
    with torch.no_grad():
        result = model(input_ids=probe, labels=probe)    # every rank gets the full-vocabulary logits
    # every rank of the model calls generate with the same prompt (a collective forward per step)
    prompt = torch.tensor([PROMPT], device=model.device)
    generated = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW_TOKENS,
                               min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    if dist.get_rank() != 0:
        return None
    return {"loss_before": loss_before, "loss_after": float(result.loss), "logits": result.logits.float().cpu(),
            "generated": generated[0, len(PROMPT):].tolist(),
            "probe": probe, "train_losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
            "world_size": dist.get_world_size(), "export": export, "load_s": load_s, "train_s": train_s}


def quiet_warnings() -> None:
    """Hide megatron-core's notes about optional CUDA libraries (Apex, Transformer Engine) and torch's deprecations."""
    import warnings

    warnings.filterwarnings("ignore", module=r"megatron\.")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")


# ---- the parent: source checkpoint, ranks, reload, summary -------------------------------------------------------
def write_source(folder: str, arch: str) -> None:
    from loongforge_hf.testing import make_tiny_checkpoint

    make_tiny_checkpoint(folder, arch)


def choose_devices(nprocs: int) -> tuple[bool, str]:
    """(on_cpu, a sentence saying where the ranks run)."""
    if os.environ.get("LOONGFORGE_DEVICE") == "cpu":
        return True, f"{nprocs} CPU processes over gloo (LOONGFORGE_DEVICE=cpu)"
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus >= nprocs:
        return False, f"{nprocs} local GPUs (nccl)"
    found = f"{gpus} GPU{'s' if gpus != 1 else ''} found, fewer than {nprocs}" if gpus else "no GPU found"
    return True, f"{nprocs} CPU processes over gloo ({found})"


def layout_name(tp: int, pp: int, world: int) -> str:
    return f"TP{tp} x PP{pp} x DP{world // (tp * pp)}"


def reload_and_compare(result: dict) -> float:
    """Max |logits difference| between plain transformers on the export and the trained loongforge model."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    hf = transformers.AutoModelForCausalLM.from_pretrained(result["export"], dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(input_ids=result["probe"]).logits
    return float((ref - result["logits"]).abs().max())


def generate_with_transformers(export: str) -> list[int]:
    """Plain transformers' greedy continuation of ``PROMPT`` on the export."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    prompt = torch.tensor([PROMPT])
    out = hf.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW_TOKENS,
                      min_new_tokens=NEW_TOKENS, do_sample=False,
                      pad_token_id=transformers.AutoTokenizer.from_pretrained(export).pad_token_id)
    return out[0, len(PROMPT):].tolist()


def summarize(result: dict, *, layout: str, where: str, started: float) -> dict:
    diff = reload_and_compare(result)
    reference = generate_with_transformers(result["export"])
    files = sorted(p for p in Path(result["export"]).iterdir() if p.is_file())
    names, size = [p.name for p in files], sum(p.stat().st_size for p in files)
    total_s = time.perf_counter() - started
    print("\n==== loongforge-hf demo ====")
    print(f"layout        {layout} on {where}")
    print(f"loss          {result['loss_before']:.4f} -> {result['loss_after']:.4f} on a held-out batch "
          f"(training log: {', '.join(f'{x:.3f}' for x in result['train_losses'])})")
    print(f"export        {result['export']}: {len(names)} files, {size / 1024:.1f} KiB")
    print(f"              {', '.join(names)}")
    print(f"reload check  transformers.AutoModelForCausalLM on the export vs the trained model: "
          f"max |logits diff| = {diff:.2e}")
    print(f"generate      {PROMPT} -> loongforge {result['generated']}, transformers on the export {reference}"
          f" ({'the same' if result['generated'] == reference else 'DIFFERENT'})")
    print(f"time          load {result['load_s']:.1f}s, train {result['train_s']:.1f}s, total {total_s:.1f}s")
    return {"layout": layout, "where": where, "loss_before": result["loss_before"], "loss_after": result["loss_after"],
            "train_losses": result["train_losses"], "export": result["export"], "files": names, "bytes": size,
            "max_abs_logits_diff": diff, "generated": result["generated"], "generated_by_transformers": reference,
            "seconds": total_s}


def run_as_torchrun_rank(args: argparse.Namespace, source: str, out: str, started: float) -> dict | None:
    """Under torchrun this process is one rank: rank 0 writes the source and, at the end, prints the summary."""
    import torch.distributed as dist

    from loongforge_hf.parallel import init_distributed

    on_cpu = os.environ.get("LOONGFORGE_DEVICE") == "cpu" or not torch.cuda.is_available()
    where = f"{os.environ['WORLD_SIZE']} torchrun ranks ({'CPU, gloo' if on_cpu else 'GPUs, nccl'})"
    if int(os.environ["RANK"]) == 0:
        write_source(source, args.arch)
    init_distributed()                                   # from_pretrained finds the process group already up
    dist.barrier()                                       # the source checkpoint is complete
    result = rank_main(source, out, tp=args.tp, pp=args.pp, steps=args.steps, on_cpu=on_cpu)
    summary = None
    if result is not None:
        summary = summarize(result, layout=layout_name(args.tp, args.pp, result["world_size"]), where=where,
                            started=started)
    dist.barrier()
    return summary


def main(argv: list[str] | None = None) -> dict | None:
    """Run the demo; returns the summary (under torchrun, on rank 0 only)."""
    args = parse_args(argv)
    started = time.perf_counter()
    quiet_warnings()
    out = os.path.abspath(args.out)
    source = os.path.join(out, "source")
    if "RANK" in os.environ:
        return run_as_torchrun_rank(args, source, out, started)

    from loongforge_hf.parallel.spawn import run_distributed

    nprocs = args.tp * args.pp
    on_cpu, where = choose_devices(nprocs)
    print(f"[demo] writing a tiny {args.arch} checkpoint with transformers to {source}")
    write_source(source, args.arch)
    print(f"[demo] training TP{args.tp} x PP{args.pp} for {args.steps} steps on {where}")
    # NOTE: CPU ranks get the cpu backend with CUDA hidden, so a machine with 1-3 GPUs runs the CPU path untouched.
    env = {"LOONGFORGE_DEVICE": "cpu", "CUDA_VISIBLE_DEVICES": ""} if on_cpu else {}
    result = run_distributed(rank_main, nprocs, source, out, tp=args.tp, pp=args.pp, steps=args.steps,
                             on_cpu=on_cpu, env=env, timeout=900)[0]
    return summarize(result, layout=layout_name(args.tp, args.pp, nprocs), where=where, started=started)


if __name__ == "__main__":
    main(sys.argv[1:])
