"""Multi-GPU validation (issue 11): dense TP/PP/DP, MoE EP with megatron-core's A2A overlap, DP scaling, and the
TP/PP layout of a model too big for one GPU -- on one host, in one command.

How to run (4 GPUs of one host; our wheels installed as in docs/benchmarks.md; about 9 minutes for everything):

    python3 scripts/validate_multi_gpu.py --out $OUT/multi_gpu.json                 # all groups
    python3 scripts/validate_multi_gpu.py --out $OUT/a.json --only dense,moe,scaling # or split in two calls
    python3 scripts/validate_multi_gpu.py --out $OUT/b.json --only big
    LOONGFORGE_DEVICE=cpu python scripts/validate_multi_gpu.py --smoke --out outputs/smoke.json   # CPU, gloo, tiny

What it does:
- Writes random-init checkpoints with transformers (built on the GPU in bf16, one save_pretrained each, when first
  needed; skipped when --work already holds them): dense Qwen3 ~1.1B (16 layers, hidden 2048, vocab 151936, tied),
  Qwen3-MoE ~2.9B (8 layers, hidden 2048, 64 experts, top-8, moe_intermediate 768, tied) and a Qwen3-8B shape
  (36 layers, hidden 4096, 32/8 heads, intermediate 12288, untied: 8.2B params x 18 B/param of training state).
- Runs the jobs (scripts/_multi_gpu_rank.py) with one torchrun launch per world size (1, 2, 4 processes), the jobs of
  a launch one after another in the same processes; one layout again under `accelerate launch` with the shipped
  examples/accelerate/tp2_pp2_dp2_8gpu.yaml (--num_processes 4); then the runs with extra megatron settings in
  launches of their own; the big model last (its checkpoint written just before). A launch that dies is relaunched
  for the jobs left; one past the budget is killed.
- dense: 1gpu, tp2, pp2, pp2vpp2, dp2, tp2pp2, dp4 (+ tp2pp2 under accelerate): 20 steps, the same 8 x 1024-token
  global batch per step in every layout (micro-batch 2 per rank, gradient accumulation 4 / DP); losses vs 1gpu within
  LOSS_RTOL; the tp2pp2 run is exported with trainer.save_model and reloaded in transformers (logits on a probe).
- moe: EP1, EP2, EP4 (DP = world size for attention), then EP2/EP4 with overlap_moe_expert_parallel_comm (megatron's
  combined 1F1B schedule), EP4 with delay_wgrad_compute on top, fine-grained activation offloading, and
  cpu_offloading (needs Transformer Engine: its assertion is recorded). 10 steps of 8 x 1024 tokens, micro-batch 1
  (so the router's aux loss sees the same tokens in every layout); losses vs EP1 within LOSS_RTOL; tokens/s (median
  of steps after the first 3) and peak memory (max over ranks of torch.cuda.max_memory_allocated). Every MoE run
  computes the loss on materialised logits (MegatronEngine(fused_loss=False)), as the overlap schedule must.
- scaling: DP1/DP2/DP4 of the dense model, micro-batch 4 x 1024 per GPU, 15 steps (median of the last 10).
- big: TP4, TP2xPP2, PP4 of the 8B shape, micro-batch 1 x 1024, gradient accumulation 8, 8 steps (median of the last 5).

Progress lines carry timestamps; --out is rewritten after every launch (the ranks' logs go to <out>_logs/), so a
timeout still leaves results.
--budget-s (default 540) stops starting launches once spent and kills one that runs past it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RANK_SCRIPT = Path(__file__).resolve().parent / "_multi_gpu_rank.py"
ACCELERATE_CONFIG = {"gpu": ROOT / "examples" / "accelerate" / "tp2_pp2_dp2_8gpu.yaml",
                     "cpu": ROOT / "examples" / "accelerate" / "cpu_2proc.yaml"}
GROUPS = ("dense", "scaling", "moe", "big")
# NOTE: bf16 parameters with fp32 main weights and fp32 loss accumulation: different TP/PP/DP/EP reduction orders move
# a loss by a few 1e-5 relative per step (2 H200s: at most 9.2e-5 over 20 steps). 2e-3 is half a bf16 ulp (2^-8) and
# far below what a wrong shard, a dropped gradient or a double-counted token would do to a loss after 20 steps.
LOSS_RTOL = 2e-3

FULL = {
    "dense": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=16,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=4096,
                  tie_word_embeddings=True),
    "moe": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                num_experts=64, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                num_hidden_layers=8, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                max_position_embeddings=4096, tie_word_embeddings=True),
    "big": dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=4096,
                tie_word_embeddings=False),
}
SMOKE = {
    "dense": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=True),
    "moe": dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
                num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                max_position_embeddings=256, tie_word_embeddings=True),
    "big": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=4, head_dim=16, max_position_embeddings=256, tie_word_embeddings=False),
}


def stamp(msg: str) -> None:
    print(time.strftime("[%H:%M:%S]"), msg, flush=True)


def make_checkpoint(folder: Path, kind: str, smoke: bool) -> None:
    """Random init in bf16 on the GPU (the CPU in smoke mode), one save_pretrained."""
    import transformers

    if (folder / "config.json").exists():
        return
    t0 = time.time()
    fields = (SMOKE if smoke else FULL)[kind]
    cfg = (transformers.Qwen3MoeConfig if kind == "moe" else transformers.Qwen3Config)(**fields)
    torch.manual_seed(0)
    device = torch.device("cpu" if smoke or not torch.cuda.is_available() else "cuda:0")
    with device:
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(folder, max_shard_size="5GB")
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    stamp(f"checkpoint {kind}: {params / 1e9:.2f}B parameters written to {folder} in {time.time() - t0:.0f}s")


def job(name, group, kind, world, layout, *, micro, ga, steps, seq, warmup=0, megatron_config=None, export=False,
        launcher="torchrun", fused_loss=True):
    return {"name": name, "group": group, "kind": kind, "world": world, "layout": layout, "micro": micro, "ga": ga,
            "steps": steps, "seq": seq, "warmup": warmup, "megatron_config": megatron_config or {}, "export": export,
            "launcher": launcher, "fused_loss": fused_loss}


def plan(groups: set[str], smoke: bool, ngpu: int) -> list[dict]:
    seq = 32 if smoke else 1024
    s = (lambda full, tiny: tiny if smoke else full)
    jobs: list[dict] = []
    if "dense" in groups:
        steps = s(20, 4)
        # the same global batch (4 micro-batches of 2 x seq) per step in every layout: micro 2, accumulation 4 / DP
        for name, world, layout in [("1gpu", 1, {}), ("tp2", 2, {"tensor_parallel_size": 2}),
                                    ("pp2", 2, {"pipeline_parallel_size": 2}),
                                    ("pp2vpp2", 2, {"pipeline_parallel_size": 2, "virtual_pipeline_parallel_size": 2}),
                                    ("dp2", 2, {}),
                                    ("tp2pp2", 4, {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}),
                                    ("dp4", 4, {})]:
            tp_pp = layout.get("tensor_parallel_size", 1) * layout.get("pipeline_parallel_size", 1)
            jobs.append(job(f"dense_{name}", "dense", "dense", world, layout, micro=2, ga=4 * tp_pp // world,
                            steps=steps, seq=seq, export=name == "tp2pp2"))
        jobs.append(job("dense_tp2pp2_accelerate", "dense", "dense", 4,
                        {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}, micro=2, ga=4, steps=steps,
                        seq=seq, launcher="accelerate"))
    if "scaling" in groups:
        for world in (1, 2, 4):
            jobs.append(job(f"scaling_dp{world}", "scaling", "dense", world, {}, micro=s(4, 2), ga=1,
                            steps=s(15, 4), seq=seq, warmup=s(5, 1)))
    if "moe" in groups:
        # NOTE: loss on materialised logits in every MoE run: the A2A-overlap schedule cannot take the fused loss
        moe = dict(micro=1, steps=s(10, 4), seq=seq, warmup=s(3, 1), fused_loss=False)
        for world in (1, 2, 4):
            jobs.append(job(f"moe_ep{world}", "moe", "moe", world, {"expert_parallel_size": world}, ga=8 // world,
                            **moe))
        overlap = {"overlap_moe_expert_parallel_comm": True}
        offload = {"fine_grained_activation_offloading": True,
                   "offload_modules": ["attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm"]}
        for world in (2, 4):
            jobs.append(job(f"moe_ep{world}_a2a_overlap", "moe", "moe", world, {"expert_parallel_size": world},
                            ga=8 // world, megatron_config=overlap, **moe))
        jobs.append(job("moe_ep4_a2a_overlap_delay_wgrad", "moe", "moe", 4, {"expert_parallel_size": 4}, ga=2,
                        megatron_config={**overlap, "delay_wgrad_compute": True}, **moe))
        jobs.append(job("moe_ep4_act_offload", "moe", "moe", 4, {"expert_parallel_size": 4}, ga=2,
                        megatron_config=offload, **moe))
        jobs.append(job("moe_ep4_cpu_offloading", "moe", "moe", 4, {"expert_parallel_size": 4}, ga=2,
                        megatron_config={"cpu_offloading": True, "cpu_offloading_num_layers": 1}, **moe))
    if "big" in groups:
        for name, layout in [("tp4", {"tensor_parallel_size": 4}),
                             ("tp2pp2", {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}),
                             ("pp4", {"pipeline_parallel_size": 4})]:
            jobs.append(job(f"big_{name}", "big", "big", 4, layout, micro=1, ga=8, steps=s(8, 3), seq=seq,
                            warmup=s(3, 1)))
    return [j for j in jobs if j["world"] <= ngpu]


def _order(j: dict) -> int:
    return {"dense": 0, "scaling": 1, "moe": 2, "big": 3}[j["group"]]


def _launch_key(j: dict) -> tuple:
    """Launch order: plain runs first (torchrun by world size, then accelerate), then the megatron_config knobs
    (they may fail on some ranks only and take their launch down, so a failing knob never costs a plain run), then
    the big model (its checkpoint is written just before; --only big runs it alone)."""
    phase = 2 if j["group"] == "big" else int(bool(j["megatron_config"]))
    return phase, j["launcher"] != "torchrun", j["world"], j["launcher"]


def launch(jobs: list[dict], work: Path, results: Path, *, smoke: bool, deadline: float) -> tuple[int, str]:
    world, launcher = jobs[0]["world"], jobs[0]["launcher"]
    jobs_file = work / f"jobs_{launcher}_{world}_{len(list(work.glob('jobs_*.json')))}.json"
    jobs_file.write_text(json.dumps(jobs, indent=1))
    if launcher == "accelerate":
        cfg = ACCELERATE_CONFIG["cpu" if smoke else "gpu"]
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(cfg),
               "--num_processes", str(world), str(RANK_SCRIPT), str(jobs_file), str(results)]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
               str(RANK_SCRIPT), str(jobs_file), str(results)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONWARNINGS": "ignore"}
    if smoke:
        env.update(LOONGFORGE_DEVICE="cpu", OMP_NUM_THREADS="1")
    stamp(f"launch {launcher} x{world}: {[j['name'] for j in jobs]}")
    log = work / f"{jobs_file.stem}.log"
    killed = threading.Event()

    def kill() -> None:
        # NOTE: torchrun starts each rank in a session of its own: the ranks are found as the launcher's descendants
        # (before the launcher dies and they are re-parented) and killed by pid, then the launcher.
        killed.set()
        for pid in [*_descendants(proc.pid), proc.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        timer = threading.Timer(max(deadline - time.time(), 0.0), kill)
        timer.start()
        try:
            for line in proc.stdout:  # the ranks' progress lines, echoed as they come
                fh.write(line)
                if line[:2] in ("[0", "[1", "[2") or "Error" in line[:120]:
                    print("   ", line.rstrip()[:400], flush=True)
            proc.wait()
        finally:
            timer.cancel()
    if killed.is_set():
        return 124, "killed at the time budget\n" + log.read_text()[-3000:]
    return proc.returncode, log.read_text()[-4000:]


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux /proc), children first."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def run_all(jobs: list[dict], work: Path, results: Path, report: dict, out: Path, *, smoke: bool,
            deadline: float) -> None:
    batches: dict[tuple, list[dict]] = {}
    for j in jobs:
        batches.setdefault(_launch_key(j), []).append(j)
    for key in sorted(batches):
        todo = sorted(batches[key], key=_order)
        while todo:
            if time.time() > deadline:
                for j in todo:
                    report["jobs"][j["name"]] = {"status": "not run", "error": "time budget spent", **_meta(j)}
                break
            for kind, ckpt in sorted({(j["kind"], j["ckpt"]) for j in todo}):
                make_checkpoint(Path(ckpt), kind, smoke)
            rc, tail = launch(todo, work, results, smoke=smoke, deadline=deadline)
            done = [j for j in todo if (results / f"{j['name']}.json").exists()]
            for j in done:
                report["jobs"][j["name"]] = {**json.loads((results / f"{j['name']}.json").read_text()), **_meta(j)}
            todo = [j for j in todo if j not in done]
            if todo:  # the launch ended inside todo[0]: record it, relaunch the rest
                over = time.time() > deadline
                report["jobs"][todo[0]["name"]] = {"status": "killed" if over else "crashed", "log": tail,
                                                   "error": "time budget spent" if over else f"launch exit {rc}",
                                                   **_meta(todo[0])}
                if not over:
                    stamp(f"{todo[0]['name']} ended its launch (exit {rc}); relaunching the {len(todo) - 1} left")
                todo = todo[1:]
            summarize(report)
            out.write_text(json.dumps(report, indent=1))
            logs = out.parent / f"{out.stem}_logs"  # the ranks' full output, beside the report
            logs.mkdir(exist_ok=True)
            for log in work.glob("jobs_*.log"):
                shutil.copy(log, logs / log.name)


def _meta(j: dict) -> dict:
    return {"group": j["group"], "launcher": j["launcher"], "world_size": j["world"], "layout": j["layout"],
            "megatron_config": j["megatron_config"], "fused_loss": j["fused_loss"]}


def summarize(report: dict) -> None:
    jobs = report["jobs"]
    comparisons = {}
    for group, base in (("dense", "dense_1gpu"), ("moe", "moe_ep1")):
        ref = jobs.get(base, {}).get("losses")
        for name, r in jobs.items():
            if r.get("group") != group or not ref or not r.get("losses"):
                continue
            n = min(len(ref), len(r["losses"]))
            diff = max(abs(x - y) / abs(y) for x, y in zip(r["losses"][:n], ref[:n]))
            r["max_rel_loss_diff_vs_" + base] = diff
            comparisons[name] = {"steps": n, "max_rel_diff": diff, "within_rtol": diff <= LOSS_RTOL}
    report["loss_comparisons"] = {"rtol": LOSS_RTOL, **comparisons}
    one = jobs.get("scaling_dp1", {}).get("tokens_per_second_per_gpu")
    report["scaling"] = {name: {"tokens_per_second_per_gpu": r.get("tokens_per_second_per_gpu"),
                                "efficiency_vs_1gpu": (r["tokens_per_second_per_gpu"] / one
                                                       if one and r.get("tokens_per_second_per_gpu") else None)}
                         for name, r in jobs.items() if r.get("group") == "scaling"}
    big = {n: r.get("tokens_per_second_per_gpu") for n, r in jobs.items() if r.get("group") == "big"}
    ran = {n: v for n, v in big.items() if v}
    report["big_best_layout"] = max(ran, key=ran.get) if ran else None
    keys = ("status", "tokens_per_second_median", "peak_memory_gib_max_rank", "max_rel_loss_diff_vs_moe_ep1", "error")
    report["moe_runs"] = {n: {k: r.get(k) for k in keys} for n, r in jobs.items() if r.get("group") == "moe"}


def print_summary(report: dict) -> None:
    stamp("summary")
    for name, r in report["jobs"].items():
        line = f"  {name:34s} {r.get('status'):8s}"
        if r.get("losses"):
            line += f" loss {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}"
        for key, label in (("tokens_per_second_median", "tok/s"), ("tokens_per_second_per_gpu", "tok/s/gpu"),
                           ("peak_memory_gib_max_rank", "peak GiB")):
            if r.get(key) is not None:
                line += f"  {label} {r[key]:,.1f}"
        for key in r:
            if key.startswith("max_rel_loss_diff_vs_"):
                line += f"  rel diff {r[key]:.1e}"
        if r.get("error"):
            line += "  " + r["error"].splitlines()[0][:200]
        print(line, flush=True)
    for name, c in report["loss_comparisons"].items():
        if name != "rtol" and not c["within_rtol"]:
            print(f"  LOSS MISMATCH {name}: {c['max_rel_diff']:.2e} > {LOSS_RTOL}", flush=True)
    for name, r in report["jobs"].items():
        if "export_reload_max_abs_logit_diff" in r:
            print(f"  {name} HF export reloaded in transformers: max |logit diff| "
                  f"{r['export_reload_max_abs_logit_diff']:.4f} (mean |logit| {r['export_logit_scale']:.3f}), "
                  f"argmax agreement {r['export_reload_argmax_agreement']:.3f}", flush=True)
    for name, r in report["scaling"].items():
        if r["tokens_per_second_per_gpu"]:
            print(f"  {name}: {r['tokens_per_second_per_gpu']:,.0f} tokens/s per GPU, "
                  f"{r['efficiency_vs_1gpu'] or 0:.1%} of one GPU's", flush=True)
    print(f"  big model, best layout by tokens/s: {report['big_best_layout']}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    default_out = Path(os.environ["OUT"], "multi_gpu.json") if os.environ.get("OUT") else Path("outputs/multi_gpu.json")
    p.add_argument("--out", type=Path, default=default_out)
    p.add_argument("--work", type=Path, default=None, help="checkpoints and exports (default: /tmp/multi_gpu[_smoke])")
    p.add_argument("--only", default=",".join(GROUPS), help=f"comma-separated subset of {','.join(GROUPS)}")
    p.add_argument("--smoke", action="store_true", help="CPU, gloo, tiny shapes, 4 processes")
    p.add_argument("--budget-s", type=float, default=540.0)
    p.add_argument("--gpus", type=int, default=None, help="processes available (default: GPUs seen, 4 with --smoke)")
    a = p.parse_args()
    start = time.time()
    deadline = start + a.budget_s
    groups = {g.strip() for g in a.only.split(",") if g.strip()}
    if groups - set(GROUPS):
        p.error(f"--only takes {GROUPS}, got {sorted(groups - set(GROUPS))}")
    if a.smoke:
        os.environ["LOONGFORGE_DEVICE"] = "cpu"
    ngpu = a.gpus or (4 if a.smoke else torch.cuda.device_count())
    work = a.work or Path("/tmp/multi_gpu_smoke" if a.smoke else "/tmp/multi_gpu")
    results = work / "results"
    results.mkdir(parents=True, exist_ok=True)
    for old in results.glob("*.json"):
        old.unlink()
    jobs = plan(groups, a.smoke, ngpu)
    import megatron.core
    import transformers

    report = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "smoke": a.smoke, "groups": sorted(groups),
              "device": "cpu (gloo)" if a.smoke else torch.cuda.get_device_name(0), "processes_available": ngpu,
              "torch": torch.__version__, "transformers": transformers.__version__,
              "megatron_core": megatron.core.__version__, "loss_rtol": LOSS_RTOL,
              "shapes": {k: v for k, v in (SMOKE if a.smoke else FULL).items() if k in {j["kind"] for j in jobs}},
              "planned": [j["name"] for j in jobs], "jobs": {}}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(report, indent=1))
    stamp(f"{len(jobs)} jobs on up to {ngpu} processes; budget {a.budget_s:.0f}s")
    for j in jobs:
        j["ckpt"], j["smoke"] = str(work / f"ckpt_{j['kind']}"), a.smoke
    run_all(jobs, work, results, report, a.out, smoke=a.smoke, deadline=deadline)
    summarize(report)
    report["wall_s"] = round(time.time() - start, 1)
    a.out.write_text(json.dumps(report, indent=1))
    print_summary(report)
    stamp(f"done in {report['wall_s']:.0f}s; report: {a.out}")


if __name__ == "__main__":
    main()
