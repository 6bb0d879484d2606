"""Multi-GPU validation (issue 11): the same training run under several layouts on one host, losses compared.

Writes a Qwen3-shaped checkpoint with transformers (random init, bf16), then for each layout runs
`torchrun --nproc-per-node N scripts/validate_multi_gpu.py --rank-body ...`: LoongTrainer on NCCL, same global batch
(8 sequences of 1024 random tokens per step, fixed seed), 20 steps. Prints the per-layout losses, the largest
relative difference to the single-GPU run, and checks that the TP2 export reloads in transformers with the trained
model's logits. Results go to --out (JSON).

    python scripts/validate_multi_gpu.py --out outputs/multi_gpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

LAYOUTS = {"1gpu": (1, {}), "tp2": (2, {"tensor_parallel_size": 2}), "pp2": (2, {"pipeline_parallel_size": 2}),
           "dp2": (2, {}), "tp2pp2": (4, {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}), "dp4": (4, {})}
GLOBAL_BATCH, SEQ, STEPS = 8, 1024, 20


def make_checkpoint(folder: Path) -> None:
    import transformers

    if (folder / "config.json").exists():
        return
    cfg = transformers.Qwen3Config(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=16,
                                   num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                                   max_position_embeddings=4096, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(folder)


class _TokenRows(torch.utils.data.Dataset):
    def __init__(self, ids: torch.Tensor) -> None:
        self.ids = ids

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def rank_body(folder: str, out: str, layout: dict, export: str | None) -> None:
    import transformers

    import loongforge_hf as lf

    model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, **layout)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 151936, (GLOBAL_BATCH * STEPS, SEQ), generator=g)
    ds = _TokenRows(ids)
    dp = int(os.environ["WORLD_SIZE"]) // (layout.get("tensor_parallel_size", 1) * layout.get("pipeline_parallel_size", 1))
    args = transformers.TrainingArguments(output_dir=out, per_device_train_batch_size=GLOBAL_BATCH // dp, max_steps=STEPS,
                                          learning_rate=1e-4, warmup_steps=2, logging_steps=1, seed=0, report_to=[],
                                          save_strategy="no", bf16=True, disable_tqdm=True)
    trainer = lf.LoongTrainer(model=model, args=args, train_dataset=ds)
    t0 = time.time()
    trainer.train()
    wall = time.time() - t0
    logs = [h for h in trainer.state.log_history if "loss" in h]
    result = {"losses": [h["loss"] for h in logs], "tokens_per_second": [h.get("tokens_per_second") for h in logs],
              "wall_s": wall}
    if export:
        trainer.save_model(export)
        with torch.no_grad():
            result["probe_logits"] = model(input_ids=ids[:1, :64]).logits.float()[0, -1, :8].tolist()
    if int(os.environ["RANK"]) == 0:
        Path(out, "result.json").write_text(json.dumps(result))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="outputs/multi_gpu.json")
    p.add_argument("--work", default="outputs/multi_gpu")
    p.add_argument("--rank-body", nargs=4, metavar=("FOLDER", "OUT", "LAYOUT_JSON", "EXPORT"))
    a = p.parse_args()
    if a.rank_body:
        folder, out, layout, export = a.rank_body
        rank_body(folder, out, json.loads(layout), None if export == "-" else export)
        return
    work = Path(a.work)
    ckpt = work / "ckpt"
    make_checkpoint(ckpt)
    ngpu = torch.cuda.device_count()
    report = {"gpu": torch.cuda.get_device_name(0), "gpus": ngpu, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "layouts": {}}
    for name, (n, layout) in LAYOUTS.items():
        if n > ngpu:
            continue
        out = work / name
        export = str(work / "export_tp2") if name == "tp2" else "-"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", __file__,
               "--rank-body", str(ckpt), str(out), json.dumps(layout), export]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            report["layouts"][name] = {"error": proc.stderr[-3000:]}
            print(name, "FAILED", proc.stderr[-3000:], flush=True)
            continue
        report["layouts"][name] = json.loads((out / "result.json").read_text())
        print(name, [round(x, 4) for x in report["layouts"][name]["losses"]], flush=True)
    base = report["layouts"].get("1gpu", {}).get("losses")
    for name, r in report["layouts"].items():
        if base and "losses" in r:
            r["max_rel_diff_vs_1gpu"] = max(abs(x - y) / abs(y) for x, y in zip(r["losses"], base))
            print(f"{name}: max relative loss difference vs 1 GPU over {len(base)} steps = "
                  f"{r['max_rel_diff_vs_1gpu']:.4f}", flush=True)
    tp2 = report["layouts"].get("tp2", {})
    if "probe_logits" in tp2:
        import transformers

        hf = transformers.AutoModelForCausalLM.from_pretrained(work / "export_tp2", dtype=torch.bfloat16).cuda()
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, 151936, (GLOBAL_BATCH * STEPS, SEQ), generator=g)[:1, :64].cuda()
        with torch.no_grad():
            ref = hf(input_ids=ids).logits.float()[0, -1, :8].tolist()
        report["export_reload_max_abs_logit_diff"] = max(abs(x - y) for x, y in zip(ref, tp2["probe_logits"]))
        print("TP2 export reloaded in transformers; max |logit diff| on a probe:",
              report["export_reload_max_abs_logit_diff"], flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
