"""``generate()`` speed on one device, side by side: transformers' ``generate`` with its default dynamic KV cache and
(on a GPU) with ``cache_implementation="static"`` (its decode step compiled by torch.compile, CUDA graphs), and
loongforge-hf's with its dynamic KV cache, with its static cache (decode steps replayed from a CUDA graph), and with
``use_cache=False`` (every step over the whole sequence).

Choices:
- The model is bench_train.py's workload (a) (Qwen3-0.6B shape), random bf16 weights written once by transformers
  (``bench_train.write_checkpoint``); ``--shape c`` takes workload (c) instead (Qwen3-30B-A3B cut to 4 layers: 128
  experts, top-8; a mixture-of-experts decode step; bf16 at EP 1, so our static cache captures it too) and ``--shape
  b`` workload (b); ``--tiny`` shrinks it (same code paths) for dry runs.
- Inputs: ``--batch`` rows of ``--prompt`` random token ids (no padding), greedy, exactly ``--new`` new tokens
  (``min_new_tokens`` = ``max_new_tokens``: eos never stops a row early), the same ids for every stack.
- Time: ``_bench_harness.median_ms`` over ``--reps`` whole generate calls after ``--warmup`` (CUDA events on a GPU,
  the host clock on CPU: a dry run only, its numbers mean nothing). Reported per stack: median ms per call, new
  tokens per second (batch x new / time), the allocator's peak during the timed calls, and the share of generated
  tokens equal to transformers' (bf16: kernels that differ in summation order may flip a near tie, so this is a
  sanity check, not a parity test; the tests do parity in fp32).
- Our static cache keeps its buffers and captured decode step from one call to the next (``static_cache.Kept``):
  the warm-up call captures, the timed ones replay (reported: ``kept_step_reused`` of one more call), as
  transformers' compiled step is compiled in its warm-up call. Its row says whether the steps replayed a CUDA graph
  (``graphed``; a CPU run's does not).
- One process, stacks one after the other; loongforge-hf runs on one rank (TP=1), as ``python script.py`` starts it.
- ``--tensor-parallel-size N`` under ``torchrun --nproc-per-node N``: every stack on the N ranks, transformers with
  its own tensor parallelism (``tp_plan="auto"``), loongforge-hf with ``tensor_parallel_size=N``; the same prompts on
  every rank (one seed), rank 0 reports its times (each call ends with all ranks' tokens: the collectives hold them
  together).
- ``--context-parallel-size N`` under ``torchrun --nproc-per-node N`` (TP 1): loongforge-hf with
  ``context_parallel_size=N`` (the prefill split over the N ranks, the KV cache sharded over them: ``kv_cache.py``),
  transformers (no context parallelism) on each rank alone, one GPU's worth, as the reference: what CP buys a long
  prompt in time and in each GPU's peak memory. ``--skip-no-cache`` leaves out ``use_cache=False`` (a whole-sequence
  forward per new token: minutes at long prompts). ``--cp-kv-cache sharded,replicated`` runs our cached stacks once
  per layout of the KV cache over CP (``generate(cp_kv_cache=...)``: each rank's share, merged per layer, or the
  whole cache on every rank); default ``sharded``. ``--compare-lean-linears`` adds our KV cache with megatron's own
  linear forwards (``LOONGFORGE_LEAN_LINEARS=0``; by default generate runs them without megatron's autograd
  machinery, ``loongforge_hf/lean_linear.py``).

    python scripts/bench_generate.py [--batch 8] [--prompt 512] [--new 128] [--reps 3] [--warmup 1]
                                     [--out outputs/bench_generate.json]
    torchrun --nproc-per-node 2 scripts/bench_generate.py --tensor-parallel-size 2 [...]
    torchrun --nproc-per-node 2 scripts/bench_generate.py --context-parallel-size 2 --batch 1 --prompt 32768 [...]
    python scripts/bench_generate.py --tiny --device cpu --reps 1 --warmup 0       # a dry run
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _bench_harness as H  # noqa: E402
import bench_train as BT  # noqa: E402

STACKS = {"transformers": "transformers generate (DynamicCache)",
          "transformers_static": "transformers generate (StaticCache, torch.compile)",
          "loongforge_cache": "loongforge-hf, KV cache",
          "loongforge_static": "loongforge-hf, static cache",
          "loongforge_no_cache": "loongforge-hf, use_cache=False",
          "loongforge_cache_megatron_linears": "loongforge-hf, KV cache, megatron's linear forwards"}


def _measure(model, ids, args, device: H.Device, **extra) -> dict:
    kwargs = _generate_kwargs(ids, args, **extra)
    out = {}

    def call():
        out["tokens"] = model.generate(**kwargs)[:, ids.shape[1]:]

    device.reset_peak()
    ms = H.median_ms(call, cuda=device.is_cuda, warmup=args.warmup, reps=args.reps)
    return {"ms": ms, "new_tokens_per_s": ids.shape[0] * args.new / (ms / 1e3),
            "peak_gib": device.peak() / H.GIB, "tokens": out["tokens"].cpu()}


def _generate_kwargs(ids, args, **extra) -> dict:
    """The same greedy generation of exactly ``args.new`` tokens for every stack."""
    import torch

    return dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new, min_new_tokens=args.new,
                do_sample=False, **extra)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--shape", default="a", choices=sorted(BT.WORKLOADS), help="bench_train.py's workload (model)")
    p.add_argument("--skip-compile", action="store_true", help="leave out transformers' compiled static-cache run")
    p.add_argument("--checkpoint", default=None, help="folder for the random checkpoint (default: a temporary one)")
    p.add_argument("--out", default=None)
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="under torchrun with as many processes")
    p.add_argument("--context-parallel-size", type=int, default=1, help="under torchrun with as many processes")
    p.add_argument("--skip-no-cache", action="store_true", help="leave out loongforge-hf's use_cache=False run")
    p.add_argument("--compare-lean-linears", action="store_true",
                   help="also run our KV cache with megatron's own linear forwards (LOONGFORGE_LEAN_LINEARS=0)")
    p.add_argument("--cp-kv-cache", default="sharded",
                   help="under --context-parallel-size: comma-separated layouts of the KV cache, sharded,replicated")
    args = p.parse_args(argv)

    import torch
    import torch.distributed as dist
    import transformers

    import loongforge_hf as lf

    tp, cp = args.tensor_parallel_size, args.context_parallel_size
    world = tp * cp
    if tp > 1 and cp > 1:
        raise SystemExit("--tensor-parallel-size and --context-parallel-size: one of them at a time.")
    if world > 1:
        if int(os.environ.get("WORLD_SIZE", "1")) != world:
            raise SystemExit(f"{world} ranks: launch with torchrun --nproc-per-node {world}.")
        if args.device == "cuda":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank = dist.get_rank() if world > 1 else 0
    device = H.Device(args.device)
    workload = BT.WORKLOADS[args.shape]
    if args.checkpoint is None and world > 1:
        raise SystemExit("more than one rank needs --checkpoint (a folder every rank reads).")
    name = ("tiny" if args.shape == "a" else f"tiny_{args.shape}") if args.tiny else args.shape
    folder = Path(args.checkpoint or tempfile.mkdtemp(prefix="bench_generate_")) / name
    if rank == 0 and not folder.is_dir():
        BT.write_checkpoint(workload, tiny=args.tiny, folder=folder, device=device)
    if world > 1:
        dist.barrier()
    vocab = BT.sizes(workload, args.tiny)[0]["vocab_size"]
    ids = torch.randint(3, vocab, (args.batch, args.prompt), generator=torch.Generator().manual_seed(BT.SEED))
    ids = ids.to(device.device)
    results = {}
    if tp > 1:  # NOTE: transformers' own tensor parallelism (DTensor) places the shards itself
        ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, tp_plan="auto").eval()
    else:  # NOTE: under --context-parallel-size each rank runs transformers alone
        ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).to(device.device).eval()
    results["transformers"] = _measure(ref, ids, args, device)
    if device.is_cuda and not args.skip_compile:
        # NOTE: transformers' fast path: its static cache with the decode step compiled (CUDA graphs); the compile
        # happens in the warm-up call(s)
        try:
            results["transformers_static"] = _measure(ref, ids, args, device, cache_implementation="static")
        except Exception as err:  # noqa: BLE001 - reported: the other stacks still run
            print(f"transformers static cache + torch.compile failed: {type(err).__name__}: {err}")
    del ref
    if "transformers_static" in results:
        # NOTE: the compiled step (its guards, its CUDA graphs' memory pool) keeps transformers' model and static
        # cache alive after ``del``: without this our rows' peak memory counted them too (6 GiB on workload (c))
        torch._dynamo.reset()
    gc.collect()
    device.empty_cache()
    ours = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, tensor_parallel_size=tp,
                                                   context_parallel_size=cp)
    layouts = args.cp_kv_cache.split(",") if cp > 1 else [None]
    for layout in layouts:
        extra, suffix = ({"cp_kv_cache": layout}, f"_{layout}") if layout else ({}, "")
        results[f"loongforge_cache{suffix}"] = _measure(ours, ids, args, device, **extra)
        static = results[f"loongforge_static{suffix}"] = _measure(ours, ids, args, device,
                                                                  cache_implementation="static", **extra)
        # NOTE: whether the timed calls replayed the graph kept from the call before (static_cache.Kept): one more
        kept = ours.generate(**_generate_kwargs(ids, args, cache_implementation="static", **extra),
                             return_dict_in_generate=True).cache
        static["kept_step_reused"] = kept.reused_kept_step
        # NOTE: whether its decode steps replay a device graph (not on CPU, nor where graph_refusal refuses one)
        static["graphed"] = kept.graphed
        del kept
    if args.compare_lean_linears:
        saved = os.environ.get("LOONGFORGE_LEAN_LINEARS")
        os.environ["LOONGFORGE_LEAN_LINEARS"] = "0"
        try:
            results["loongforge_cache_megatron_linears"] = _measure(ours, ids, args, device)
        finally:
            if saved is None:
                del os.environ["LOONGFORGE_LEAN_LINEARS"]
            else:
                os.environ["LOONGFORGE_LEAN_LINEARS"] = saved
    if not args.skip_no_cache:
        results["loongforge_no_cache"] = _measure(ours, ids, args, device, use_cache=False)
    theirs = results["transformers"]["tokens"]
    rows = []
    for key, r in results.items():
        r["same_tokens_as_transformers"] = float((r.pop("tokens") == theirs).float().mean())
        stack, _, layout = key.rpartition("_")
        name = STACKS[key] if key in STACKS else f"{STACKS[stack]} (CP KV cache {layout})"
        if "graphed" in r:
            name = name.replace("static cache", f"static cache ({'CUDA graph' if r['graphed'] else 'no graph'})")
        rows.append([name, f"{r['ms']:.1f}", f"{r['new_tokens_per_s']:.1f}", f"{r['peak_gib']:.2f}",
                     f"{r['same_tokens_as_transformers']:.3f}"])
    report = {"device": device.describe(), "workload": workload.title, "tiny": args.tiny, "batch": args.batch,
              "prompt": args.prompt, "new": args.new, "reps": args.reps, "tensor_parallel_size": tp,
              "context_parallel_size": cp,
              "results": results}
    if rank != 0:
        return 0
    header = ["stack", "ms / generate", "new tokens/s", "peak GiB", "tokens = transformers'"]
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
