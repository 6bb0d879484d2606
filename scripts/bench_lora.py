"""Single-device LoRA training speed, side by side: transformers + PEFT, transformers + Liger-Kernel + PEFT,
loongforge-hf's LoRA.

bench_train.py's workloads (a, b, c), checkpoints, token batches, timing, optimizer hyper-parameters and worker
processes; what changes is that only LoRA adapters train.

Choices:
- One ``peft.LoraConfig`` on every stack: r 16, lora_alpha 32, lora_dropout 0, target_modules "all-linear",
  task_type CAUSAL_LM (``--lora-r``, ``--lora-alpha``, ``--lora-targets``: "all-linear" or a comma list of module
  names). On the MoE workload (c) PEFT turns "all-linear" into target_parameters for the routed experts and the router
  (gate_up_proj with r and alpha doubled); loongforge-hf's LoRA applies the same rewrite. Each row shows its trainable
  parameter count as the stack counts it (``get_nb_trainable_parameters``); the script warns when the stacks differ.
  ``--use-dora``: DoRA (``use_dora=True``) on every stack (not with expert or router targets, which PEFT refuses: on
  (c) pass the attention projections as ``--lora-targets``).
- Adapters are created right after ``transformers.set_seed(0)`` on every stack, as TRL and LoongSFTTrainer do:
  PEFT's initial values (B = 0), so the first step's loss is the base model's on every stack and is printed for each;
  the last loss shows whether the adapters trained alike.
- Base weights bf16 and frozen everywhere. transformers stacks: ``peft.get_peft_model`` on the bf16 model (adapters in
  float32, PEFT's ``autocast_adapter_dtype`` default), the forward under bf16 autocast as transformers.Trainer / TRL
  run it with ``bf16=True`` (the fp32 adapters' matmuls then run in bf16; without it they run in fp32, about 1.2x
  slower on (a)), torch AdamW (fused on CUDA) over the trainable parameters only.
  loongforge-hf: the bridge's model (TP=1), ``loongforge_hf.lora.get_peft_model``, then ``MegatronEngine`` as
  LoongTrainer builds it (optimizer_precision "fp32", adamw_kernel "triton"): bf16 adapters, megatron's DDP buffers and
  distributed optimizer over the adapters only, fp32 main weights and moments.
- One step, every stack: forward with labels, backward, gradient clipping at 1.0, AdamW with bench_train.py's
  hyper-parameters, gradients cleared. No activation recompute on any stack (SFTConfig's default
  ``gradient_checkpointing=True`` is not used).
- Reported per row: step time (median), tokens/s, peak memory, tokens/s and peak memory against the transformers +
  PEFT row, first and last loss. No MFU: the frozen base has no weight-gradient GEMMs, so bench_train's count of
  6 FLOPs per parameter and token does not hold.
- A stack that fails or runs out of memory is a row with its status; out of memory at a micro-batch above 1 is
  measured again at micro-batch 1 with as many accumulated (bench_train.py's rule).
- ``--in-process`` (CPU dry runs and tests): the workers run in this process, one after the other; refused with the
  Liger stack, which patches transformers' classes for the rest of the process.

    python scripts/bench_lora.py [--shapes a,c] [--stacks peft,liger,loongforge] [--lora-r 16] [--lora-alpha 32]
                                 [--lora-targets all-linear] [--use-dora] [--steps 10] [--warmup 3] [--profile c]
                                 [--out outputs/bench_lora.json]
    python scripts/bench_lora.py --tiny --device cpu --stacks peft,loongforge --shapes a,c    # a dry run
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _bench_harness as H  # noqa: E402
import bench_train as BT  # noqa: E402

STACKS = ("peft", "liger", "loongforge")
STACK_TITLES = {"peft": "transformers + PEFT (sdpa)", "liger": "transformers + Liger-Kernel + PEFT",
                "loongforge": "loongforge-hf LoRA (TP=1, MegatronEngine)"}
BASELINE = "peft"
LORA_DROPOUT = 0.0


def lora_config(*, r: int, alpha: int, targets: str, dora: bool = False):
    """The ``peft.LoraConfig`` every stack gets; ``targets``: "all-linear" or a comma list of module names."""
    import peft

    target_modules = targets if targets == "all-linear" else [t for t in targets.split(",") if t]
    return peft.LoraConfig(r=r, lora_alpha=alpha, lora_dropout=LORA_DROPOUT, target_modules=target_modules,
                           use_dora=dora, task_type="CAUSAL_LM")


# ---- worker side -----------------------------------------------------------------------------------------------

def adapter(args, info: dict):
    """``adapt(model) -> model`` for bench_train's builders: the stack's ``get_peft_model`` after ``set_seed``; what
    it made goes into ``info``."""

    def adapt(model):
        import transformers

        if args.stack == "loongforge":
            from loongforge_hf.lora import get_peft_model
        else:
            from peft import get_peft_model
        config = lora_config(r=args.lora_r, alpha=args.lora_alpha, targets=args.lora_targets, dora=args.use_dora)
        transformers.set_seed(BT.SEED)  # NOTE: as TRL (and LoongSFTTrainer) right before the adapters
        model = get_peft_model(model, config)
        trainable, total = model.get_nb_trainable_parameters()
        dtypes = sorted({str(p.dtype) for p in model.parameters() if p.requires_grad})
        # NOTE: the config as the stack holds it after PEFT's rewrite of MoE names (target_parameters, patterns)
        held = model.lora_config if args.stack == "loongforge" else model.peft_config["default"]
        info.update(trainable_parameters=trainable, all_parameters=total, adapter_dtypes=dtypes,
                    lora_config={k: (sorted(v) if isinstance(v, set) else v)
                                 for k, v in held.to_dict().items()
                                 if k in ("r", "lora_alpha", "target_modules", "target_parameters",
                                          "rank_pattern", "alpha_pattern", "lora_dropout", "use_dora")})
        return model

    return adapt


def run_stack(args, device: H.Device) -> dict:
    info: dict = {}
    adapt = adapter(args, info)
    if args.stack == "loongforge":
        step, built = BT.build_loongforge(args.folder, device, adapt=adapt)
    else:
        step, built = BT.build_transformers(args.folder, device, liger=args.stack == "liger", adapt=adapt,
                                            autocast=True)
    built.pop("parameters", None)  # NOTE: counted differently by the two builders; info has the stack's own counts
    return BT.time_stack(step, {**built, **info}, args, device)


def worker(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--worker", choices=("run",), required=True)
    p.add_argument("--stack", choices=STACKS, required=True)
    BT.add_worker_args(p)
    p.add_argument("--lora-r", type=int, required=True)
    p.add_argument("--lora-alpha", type=int, required=True)
    p.add_argument("--lora-targets", required=True)
    p.add_argument("--use-dora", action="store_true")
    args = p.parse_args(argv)
    # NOTE: loongforge-hf picks its device backend from this variable; set before anything imports the package.
    os.environ["LOONGFORGE_DEVICE"] = args.device
    device = H.Device(args.device)
    return H.worker_main(lambda: run_stack(args, device), result_path=args.result, device=device)


# ---- parent side -----------------------------------------------------------------------------------------------

HEADER = ["stack", "micro-batch", "trainable params", "step ms", "tokens/s", "peak GiB", "tok/s vs HF+PEFT",
          "peak vs HF+PEFT", "first loss", "last loss"]


def summarize(results: dict) -> list[list]:
    base = results.get(BASELINE, {})
    base_ok = base.get("status") == "ok"
    rows = []
    for stack, r in results.items():
        if r.get("status") != "ok":
            rows.append([STACK_TITLES[stack], "—", "—", "—", f"**{r.get('status')}**", BT._gib(r.get("peak_gib")),
                         "—", "—", "—", "—"])
            continue
        r["tokens_per_s"] = r["tokens_per_step"] / r["median_step_s"]
        speed = f"{r['tokens_per_s'] / (base['tokens_per_step'] / base['median_step_s']):.2f}×" if base_ok else "—"
        memory = f"{r['peak_gib'] / base['peak_gib']:.2f}×" if base_ok and base["peak_gib"] else "—"
        layout = f"{r['micro_batch']}" + (f" × {r['accum']} accum" if r["accum"] > 1 else "")
        if r.get("oom_at"):
            layout += f" (OOM at {r['oom_at']['micro_batch']})"
        rows.append([STACK_TITLES[stack], layout, f"{r['trainable_parameters']:,}", f"{r['median_step_s'] * 1e3:.1f}",
                     f"{r['tokens_per_s']:,.0f}", BT._gib(r["peak_gib"]), speed, memory, f"{r['losses'][0]:.4f}",
                     f"{r['losses'][-1]:.4f}"])
    return rows


def agreement(results: dict) -> list[str]:
    """Lines that say whether the stacks trained the same model: first-step losses, trainable parameter counts."""
    ok = {s: r for s, r in results.items() if r.get("status") == "ok"}
    if not ok:
        return []
    lines = ["first-step loss: " + ", ".join(f"{STACK_TITLES[s]} {r['losses'][0]:.6f}" for s, r in ok.items())]
    if BASELINE in ok:
        ref = ok[BASELINE]["losses"][0]
        lines += [f"  {STACK_TITLES[s]} vs {STACK_TITLES[BASELINE]}: first loss "
                  f"{abs(r['losses'][0] - ref) / abs(ref):.1e} relative difference" for s, r in ok.items()
                  if s != BASELINE]
    counts = {r["trainable_parameters"] for r in ok.values()}
    if len(counts) > 1:
        lines.append("WARNING: the stacks train different numbers of parameters: " + ", ".join(
            f"{STACK_TITLES[s]} {r['trainable_parameters']:,}" for s, r in ok.items()))
    return lines


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    BT.add_run_args(p, STACKS, name="bench_lora", profile="")
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--lora-alpha", type=int, default=32)
    p.add_argument("--lora-targets", default="all-linear",
                   help="'all-linear' or a comma list of module names (e.g. q_proj,k_proj,v_proj,o_proj)")
    p.add_argument("--use-dora", action="store_true", help="DoRA (LoraConfig(use_dora=True)) on every stack")
    p.add_argument("--in-process", action="store_true", help="run the workers in this process (CPU dry runs, "
                   "tests; not with liger)")
    args = p.parse_args(argv)
    shapes = [s for s in args.shapes.split(",") if s]
    stacks = [s for s in args.stacks.split(",") if s]
    unknown = [s for s in shapes if s not in BT.WORKLOADS] + [s for s in stacks if s not in STACKS]
    if unknown:
        p.error(f"unknown shapes/stacks {unknown}; shapes: {sorted(BT.WORKLOADS)}, stacks: {list(STACKS)}")
    if args.in_process and "liger" in stacks:
        p.error("--in-process runs every stack in one process, and Liger patches transformers' classes for good: "
                "leave out liger or run without --in-process")
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    log = Path(args.log) if args.log else out_path.with_suffix(".log")
    log.write_text("")
    report = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join(["python", *sys.argv]),
              "settings": {"steps": args.steps, "warmup": args.warmup, "accum": args.accum, "lr": BT.LR,
                           "betas": BT.BETAS, "eps": BT.EPS, "weight_decay": BT.WEIGHT_DECAY,
                           "max_grad_norm": BT.MAX_GRAD_NORM, "seed": BT.SEED, "tiny": args.tiny,
                           "lora": {"r": args.lora_r, "lora_alpha": args.lora_alpha, "lora_dropout": LORA_DROPOUT,
                                    "target_modules": args.lora_targets, "use_dora": args.use_dora,
                                    "task_type": "CAUSAL_LM"},
                           "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")},
              "workloads": {}}
    run_here = worker if args.in_process else None
    tables = []
    for key in shapes:
        w = BT.WORKLOADS[key]
        cfg, seq, mb = BT.sizes(w, args.tiny)
        entry = {"title": w.title, "config": cfg, "seq": seq, "micro_batch": mb, "results": {}}
        report["workloads"][key] = entry
        kind = "DoRA" if args.use_dora else "LoRA"
        print(f"[{key}] {w.title}{' (tiny)' if args.tiny else ''}: {kind} r={args.lora_r} alpha={args.lora_alpha} "
              f"targets={args.lora_targets}", flush=True)
        folder = BT.ensure_checkpoint(args, w, entry, log, in_process=args.in_process)
        if folder is None:
            H.save_json(report, out_path)
            continue
        for stack in stacks:
            common = [__file__, "--worker", "run", "--shape", key, "--stack", stack, "--folder", str(folder),
                      "--device", args.device, "--steps", str(args.steps), "--warmup", str(args.warmup),
                      "--lora-r", str(args.lora_r), "--lora-alpha", str(args.lora_alpha),
                      "--lora-targets", args.lora_targets] + (["--use-dora"] if args.use_dora else [])
            common += (["--tiny"] if args.tiny else []) + (
                ["--profile"] if stack == "loongforge" and key in args.profile.split(",") else [])
            entry["results"][stack] = BT.measure_worker(common, args=args, label=STACK_TITLES[stack], micro_batch=mb,
                                                        log=log, worker=run_here)
            H.save_json(report, out_path)
        rows = summarize(entry["results"])
        entry["agreement"] = agreement(entry["results"])
        tables.append(f"### ({key}) {w.title}, {kind}\n\n" + H.markdown_table(HEADER, rows) + "\n\n"
                      + "\n".join(entry["agreement"]))
        H.save_json(report, out_path)
        if not args.keep_checkpoints:
            shutil.rmtree(folder, ignore_errors=True)
    BT.finish_report(report, tables, out_path=out_path, log=log, profile_stack="loongforge",
                     profile_title="loongforge LoRA")
    return 0


if __name__ == "__main__":
    if "--worker" in sys.argv:
        sys.exit(worker(sys.argv[1:]))
    sys.exit(main(sys.argv[1:]))
