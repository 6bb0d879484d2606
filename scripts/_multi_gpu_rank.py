"""The rank side of scripts/validate_multi_gpu.py: run a list of training jobs in one launched world.

Each job loads a checkpoint with ``loongforge_hf.AutoModelForCausalLM.from_pretrained`` (its layout and any extra
megatron ``TransformerConfig`` fields via ``megatron_config``), trains it with ``LoongTrainer`` on random tokens and
rank 0 writes ``<results>/<job>.json`` as soon as the job ends, so a launch that dies or times out keeps what ran.
An exception raised on every rank (a config assertion) is recorded and the next job runs; anything else ends the
launch and the driver relaunches the jobs left (skipping the one that died).

    python -m torch.distributed.run --nproc-per-node N scripts/_multi_gpu_rank.py JOBS_JSON RESULTS_DIR
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch


class TokenRows(torch.utils.data.Dataset):
    """Fixed random token rows; a plain torch Dataset (no pyarrow), so nothing needs pickling."""

    def __init__(self, ids: torch.Tensor) -> None:
        self.ids = ids

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _stamp(msg: str) -> None:
    if int(os.environ.get("RANK", 0)) == 0:
        print(time.strftime("[%H:%M:%S]"), msg, flush=True)


def _device_stats(device) -> tuple[float | None, int]:
    """(peak allocated GiB on this rank or None off-GPU, local rank)."""
    if device.type != "cuda":
        return None, 0
    return torch.cuda.max_memory_allocated(device) / 2**30, device.index


def _max_over_ranks(value: float | None, device) -> float | None:
    import torch.distributed as dist

    if value is None:
        return None
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def run_job(job: dict, work: Path) -> dict:
    import transformers

    import loongforge_hf as lf

    smoke = job["smoke"]
    t0 = time.time()
    model = lf.AutoModelForCausalLM.from_pretrained(job["ckpt"], dtype=torch.bfloat16,
                                                    megatron_config=job.get("megatron_config") or None,
                                                    **job["layout"])
    load_s = time.time() - t0
    device = model.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    layout = model.parallel
    model_parallel = layout.tensor_parallel_size * layout.pipeline_parallel_size * layout.context_parallel_size
    dp = int(os.environ.get("WORLD_SIZE", 1)) // model_parallel
    micro, ga, steps, seq = job["micro"], job["ga"], job["steps"], job["seq"]
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (micro * ga * dp * steps, seq), generator=g)
    args = transformers.TrainingArguments(
        output_dir=str(work / "trainer" / job["name"]), per_device_train_batch_size=micro,
        gradient_accumulation_steps=ga, max_steps=steps, learning_rate=1e-4, warmup_steps=2, logging_steps=1,
        seed=0, report_to=[], save_strategy="no", bf16=not smoke, use_cpu=smoke, disable_tqdm=True,
        dataloader_drop_last=True,
        # NOTE: LoongTrainer sets ddp_timeout on the process groups: the launch's short timeout (see main) holds
        ddp_timeout=int(float(os.environ.get("MULTI_GPU_COLLECTIVE_TIMEOUT_S", 180))))
    trainer = lf.LoongTrainer(model=model, args=args, train_dataset=TokenRows(ids))
    if not job.get("fused_loss", True):
        from loongforge_hf.trainer.engine import MegatronEngine

        # NOTE: megatron's combined 1F1B schedule (A2A overlap) runs the output layer itself, so the engine computes
        # the loss on materialised logits there; runs compared with it take the same loss path.
        trainer.engine = MegatronEngine(model, args=args, fused_loss=False)
    t1 = time.time()
    trainer.train()
    train_s = time.time() - t1
    logs = [h for h in trainer.state.log_history if "loss" in h]
    tps = [h.get("tokens_per_second") for h in logs]
    timed = [x for x in tps[job.get("warmup", 0):] if x is not None]
    world = int(os.environ.get("WORLD_SIZE", 1))
    peak, _ = _device_stats(device)
    result = {"layout": job["layout"], "megatron_config": job.get("megatron_config") or {}, "world_size": world,
              "fused_loss": job.get("fused_loss", True),
              "micro_batch": micro, "grad_accum": ga, "seq": seq, "dp": dp, "steps": steps,
              "global_tokens_per_step": micro * ga * dp * seq,
              "losses": [h["loss"] for h in logs], "tokens_per_second": tps,
              "tokens_per_second_median": statistics.median(timed) if timed else None,
              "tokens_per_second_per_gpu": statistics.median(timed) / world if timed else None,
              "timed_steps": len(timed), "peak_memory_gib_max_rank": _max_over_ranks(peak, device),
              "load_s": round(load_s, 1), "train_s": round(train_s, 1)}
    if job.get("export"):
        result.update(export_and_reload(job, work, trainer, model, ids))
    del trainer, model
    return result


def export_and_reload(job: dict, work: Path, trainer, model, ids: torch.Tensor) -> dict:
    """HF export of the trained model, reloaded in plain transformers on rank 0; logits compared on a probe."""
    import torch.distributed as dist
    import transformers

    export = work / f"export_{job['name']}"
    t0 = time.time()
    trainer.save_model(str(export))
    save_s = time.time() - t0
    probe = ids[:1, :64]
    with torch.no_grad():
        ours = model(input_ids=probe.to(model.device)).logits.float()
    out: dict = {"export_dir": str(export), "export_s": round(save_s, 1)}
    if int(os.environ.get("RANK", 0)) == 0:
        hf = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.bfloat16).to(model.device).eval()
        with torch.no_grad():
            ref = hf(input_ids=probe.to(model.device)).logits.float()
        out.update(export_reload_max_abs_logit_diff=float((ref - ours).abs().max()),
                   export_reload_mean_abs_logit_diff=float((ref - ours).abs().mean()),
                   export_reload_argmax_agreement=float((ref.argmax(-1) == ours.argmax(-1)).float().mean()),
                   export_logit_scale=float(ref.abs().mean()))
        del hf
    dist.barrier()
    return out


def main() -> None:
    jobs_file, results = Path(sys.argv[1]), Path(sys.argv[2])
    jobs = json.loads(jobs_file.read_text())
    from loongforge_hf.parallel import init_distributed

    # NOTE: a collective that hangs (a job failing on some ranks only) ends the launch after this many seconds
    # instead of eating the whole budget; the driver then relaunches the jobs left.
    init_distributed(timeout_s=float(os.environ.get("MULTI_GPU_COLLECTIVE_TIMEOUT_S", 180)))
    rank = int(os.environ.get("RANK", 0))
    launcher = "accelerate" if any(k.startswith("ACCELERATE_") for k in os.environ) else "torchrun"
    for job in jobs:
        _stamp(f"job {job['name']} ({job['group']}, {launcher}, world {os.environ.get('WORLD_SIZE')}) starts")
        try:
            result = run_job(job, results.parent)
            result["status"] = "ok"
        except Exception as e:  # noqa: BLE001 - recorded; the next job runs (same exception on every rank)
            result = {"status": "error", "error": f"{type(e).__name__}: {e}"[:4000],
                      "traceback": traceback.format_exc()[-6000:]}
        result.update(name=job["name"], group=job["group"], launcher=launcher)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        if rank == 0:
            (results / f"{job['name']}.json").write_text(json.dumps(result, indent=1))
        losses = result.get("losses") or []
        _stamp(f"job {job['name']} {result['status']}: losses {[round(x, 4) for x in losses[:3]]}..."
               f"{[round(x, 4) for x in losses[-2:]]} tokens/s {result.get('tokens_per_second_median')} "
               f"peak GiB {result.get('peak_memory_gib_max_rank')} {result.get('error', '')[:300]}")


if __name__ == "__main__":
    main()
