"""One linear layer's forward + backward, bf16 against FP8 (``kernels.fp8.fp8_linear``), with a breakdown.

For the GEMM shapes of bench_train's workloads (M = tokens per micro-batch, N x K = the layer's weight):
  a  Qwen3-0.6B, 4 x 4096 tokens: qkv 4096x1024, proj 1024x2048, fc1 6144x1024, fc2 1024x3072
  b  Llama-3-8B, 8192 tokens:     qkv 6144x4096, proj 4096x4096, fc1 28672x4096, fc2 4096x14336
  c  Qwen3-30B-A3B, one expert:   fc1 1536x2048, fc2 2048x768 at 512 tokens (the average share) and 17 tokens
it times, per recipe (``blockwise`` where the GPU runs it, and ``rowwise``):
  total     ``fp8_linear`` forward + backward through autograd (what training runs), against ``x @ w.T`` in bf16
  host      the same call's host time with nothing waited for: what queuing it costs the CPU (launches, python)
  parts     each kernel the FP8 path launches, alone: quantisations of x, w, dy, x^T, dy^T (block-wise: w and w^T,
            quant_w_dual, which is what training runs, next to w alone and an fp8 transpose of it), the three scaled
            GEMMs;
            the bf16 GEMMs likewise (fwd, dgrad, wgrad); quant_sum / gemm_sum add up what fp8_linear runs
With ``--grouped``, also the routed experts of a MoE layer as one module (``kernels.fp8_grouped``): the gated MLP of
all local experts forward + backward in bf16 (``grouped_mlp.grouped_gated_mlp``, ``torch._grouped_mm``) against
FP8 (``fp8_grouped_gated_mlp``, ``torch._scaled_grouped_mm``, row-wise), and the fc1 forward GEMM alone in each:
  c   Qwen3-30B-A3B: 128 experts, hidden 2048, moe_intermediate 768, 65,536 routed rows (8,192 tokens x top-8)
  dsv3  DeepSeek-V3 experts of one EP8 rank: 32 experts, hidden 7168, moe_intermediate 2048, 32,768 routed rows
token counts per expert drawn at random around the mean (some experts empty).
Timing: CUDA events around each call, median of --reps after --warmup (on CPU, wall clock: a dry run only).
The recipe ``enable_fp8`` picks on this GPU (``fp8_recipe=None``) is printed and written to the JSON.

    python scripts/bench_fp8_linear.py [--shapes a,b,c] [--reps 20] [--out outputs/bench_fp8_linear.json]
    python scripts/bench_fp8_linear.py --shapes "" --grouped c,dsv3     # grouped experts only
    python scripts/bench_fp8_linear.py --device cpu --tiny          # a dry run (tiny shapes, emulated GEMMs)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _bench_harness as H  # noqa: E402

from loongforge_hf.kernels import fp8 as F8  # noqa: E402

SHAPES = {  # workload -> [(layer, M, N, K)]
    "a": [("qkv", 16384, 4096, 1024), ("proj", 16384, 1024, 2048), ("fc1", 16384, 6144, 1024),
          ("fc2", 16384, 1024, 3072)],
    "b": [("qkv", 8192, 6144, 4096), ("proj", 8192, 4096, 4096), ("fc1", 8192, 28672, 4096),
          ("fc2", 8192, 4096, 14336)],
    "c": [("expert fc1", 512, 1536, 2048), ("expert fc2", 512, 2048, 768), ("expert fc1", 17, 1536, 2048),
          ("expert fc2", 17, 2048, 768)],
}
TINY = {"a": [("qkv", 64, 256, 128), ("fc2", 37, 128, 256)], "b": [("fc1", 48, 384, 128)],
        "c": [("expert fc1", 17, 256, 128), ("expert fc2", 0, 128, 128)]}
GROUPED = {"c": (128, 2048, 768, 65536), "dsv3": (32, 7168, 2048, 32768)}  # experts, hidden, intermediate, rows
GROUPED_TINY = {"c": (6, 64, 32, 80), "dsv3": (4, 128, 64, 64)}


class Timer:
    def __init__(self, device: torch.device, warmup: int, reps: int) -> None:
        self.cuda, self.warmup, self.reps = device.type == "cuda", warmup, reps

    def __call__(self, fn) -> float:
        """Median milliseconds of ``fn()``."""
        return H.median_ms(fn, cuda=self.cuda, warmup=self.warmup, reps=self.reps)

    def host(self, fn) -> float:
        """Host milliseconds per call of ``fn()`` with nothing waited for (what it costs the CPU to queue)."""
        sync = torch.cuda.synchronize if self.cuda else (lambda: None)
        return H.host_ms(fn, synchronize=sync, warmup=self.warmup, reps=self.reps)


def _fwd_bwd(fn, dy, *leaves):
    """A callable running ``fn(*leaves)`` forward and backward (``dy``), the leaves' grads cleared first."""
    def run():
        for t in leaves:
            t.grad = None
        fn(*leaves).backward(dy)
    return run


def _rounded(out: dict) -> dict:
    return {key: ({kk: round(vv, 4) if isinstance(vv, float) else vv for kk, vv in val.items()}
                  if isinstance(val, dict) else val) for key, val in out.items()}


def bench_shape(m: int, n: int, k: int, recipes: list[str], timer: Timer, device: torch.device) -> dict:
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(m, k, device=device, generator=g).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(n, k, device=device, generator=g) * 0.02).to(torch.bfloat16).requires_grad_()
    dy = torch.randn(m, n, device=device, generator=g).to(torch.bfloat16)
    xd, wd = x.detach(), w.detach()
    flops = 6.0 * m * n * k
    out = {"m": m, "n": n, "k": k}
    with torch.no_grad():
        bf16 = {"fwd_gemm": timer(lambda: xd @ wd.t()), "dgrad_gemm": timer(lambda: dy @ wd),
                "wgrad_gemm": timer(lambda: dy.t() @ xd)}
    run = _fwd_bwd(lambda a, b: a @ b.t(), dy, x, w)
    bf16["total"], bf16["host_total"] = timer(run), timer.host(run)
    out["bf16"] = bf16
    for recipe in recipes:
        parts = {}
        with torch.no_grad():
            if m:
                xp, dyp = F8._pad_rows(xd), F8._pad_rows(dy)
                if F8.is_blockwise(recipe):
                    xq, dyq = F8.quantize_tiles(xp, check_finite=False), F8.quantize_tiles(dyp, check_finite=False)
                    wq, wt = F8.quantize_blocks_dual(wd)
                    parts["quant_x"] = timer(lambda: F8.quantize_tiles(xp, check_finite=False))
                    parts["quant_w"] = timer(lambda: F8.quantize_blocks(wd, check_finite=False))
                    parts["transpose_w"] = timer(lambda: F8.transpose_blocks(wq))
                    parts["quant_w_dual"] = timer(lambda: F8.quantize_blocks_dual(wd))
                    parts["quant_dy"] = timer(lambda: F8.quantize_tiles(dyp, check_finite=False))
                else:
                    xq, wq = F8.quantize_rows(xp, check_finite=False), F8.quantize_rows(wd, check_finite=False)
                    dyq, wt = F8.quantize_rows(dyp, check_finite=False), F8.quantize_rows(wd.t(), check_finite=False)
                    parts["quant_x"] = timer(lambda: F8.quantize_rows(xp, check_finite=False))
                    parts["quant_w"] = timer(lambda: F8.quantize_rows(wd, check_finite=False))
                    parts["quant_wT"] = timer(lambda: F8.quantize_rows(wd.t(), check_finite=False))
                    parts["quant_dy"] = timer(lambda: F8.quantize_rows(dyp, check_finite=False))
                # the weight gradient's operands as the recipe scales them
                kind_dy, kind_x = F8.WGRAD_KINDS[recipe]
                dytq, xtq = F8.quantize_transposed(dy, kind_dy), F8.quantize_transposed(xd, kind_x)
                parts["quant_dyT"] = timer(lambda: F8.quantize_transposed(dy, kind_dy))
                parts["quant_xT"] = timer(lambda: F8.quantize_transposed(xd, kind_x))
                parts["fwd_gemm"] = timer(lambda: F8.scaled_matmul(xq, wq))
                parts["dgrad_gemm"] = timer(lambda: F8.scaled_matmul(dyq, wt))
                parts["wgrad_gemm"] = timer(lambda: F8.scaled_matmul(dytq, xtq))
                # NOTE: the quantisations fp8_linear runs: block-wise quantises w and w.T together (quant_w_dual)
                unused = ("quant_w", "transpose_w") if F8.is_blockwise(recipe) else ()
                parts["quant_sum"] = sum(v for key, v in parts.items()
                                         if not key.endswith("_gemm") and key not in unused)
                parts["gemm_sum"] = sum(v for key, v in parts.items() if key.endswith("_gemm"))
        run = _fwd_bwd(lambda a, b, r=recipe: F8.fp8_linear(a, b, recipe=r), dy, x, w)
        parts["total"], parts["host_total"] = timer(run), timer.host(run)
        parts["speedup_vs_bf16"] = round(bf16["total"] / parts["total"], 3) if parts["total"] else None
        if m:
            parts["gemm_speedup_vs_bf16"] = round(
                (bf16["fwd_gemm"] + bf16["dgrad_gemm"] + bf16["wgrad_gemm"]) / parts["gemm_sum"], 3)
        out[recipe] = parts
    out["bf16"]["tflops"] = round(flops / bf16["total"] / 1e9, 1) if bf16["total"] else None
    return _rounded(out)


def expert_counts(experts: int, rows: int, device: torch.device) -> torch.Tensor:
    """Tokens per expert summing to ``rows``: around the mean, a few experts empty (seeded)."""
    g = torch.Generator().manual_seed(0)
    weight = torch.rand(experts, generator=g) + 0.5
    weight[torch.randperm(experts, generator=g)[:max(1, experts // 16)]] = 0
    counts = (weight / weight.sum() * rows).floor().long()
    counts[int(weight.argmax())] += rows - int(counts.sum())
    return counts.to(device)


def bench_grouped(experts: int, hidden: int, inter: int, rows: int, timer: Timer, device: torch.device) -> dict:
    from loongforge_hf.kernels import fp8_grouped as FG
    from loongforge_hf.kernels.grouped_mlp import grouped_gated_mlp

    g = torch.Generator(device=device).manual_seed(0)
    counts = expert_counts(experts, rows, device)
    x = torch.randn(rows, hidden, device=device, generator=g).to(torch.bfloat16).requires_grad_()
    fc1 = (torch.randn(experts, 2 * inter, hidden, device=device, generator=g) * 0.02).to(torch.bfloat16)
    fc2 = (torch.randn(experts, hidden, inter, device=device, generator=g) * 0.02).to(torch.bfloat16)
    fc1.requires_grad_(), fc2.requires_grad_()
    dy = torch.randn(rows, hidden, device=device, generator=g).to(torch.bfloat16)
    out = {"experts": experts, "hidden": hidden, "intermediate": inter, "rows": rows}

    for name, mlp in (("bf16", grouped_gated_mlp), ("fp8", FG.fp8_grouped_gated_mlp)):
        run = _fwd_bwd(lambda a, b, c, mlp=mlp: mlp(a, b, c, counts), dy, x, fc1, fc2)
        out[name] = {"total": timer(run), "host_total": timer.host(run)}
    with torch.no_grad():
        xd, w1 = x.detach(), fc1.detach()
        if device.type == "cuda":
            offs = torch.cumsum(counts, 0).to(torch.int32)
            out["bf16"]["fc1_fwd_gemm"] = timer(lambda: torch._grouped_mm(xd, w1.transpose(-2, -1), offs=offs))
        lay = FG.Layout(counts, rows)
        ops = FG._forward_operands(xd, w1, lay)
        out["fp8"]["fc1_fwd_operands"] = timer(lambda: FG._forward_operands(xd, w1, lay))
        out["fp8"]["fc1_fwd_gemm"] = timer(lambda: FG.scaled_grouped_mm(*ops, lay.offs))
    out["fp8"]["speedup_vs_bf16"] = round(out["bf16"]["total"] / out["fp8"]["total"], 3)
    return _rounded(out)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="a,b,c")
    p.add_argument("--recipes", default="", help="comma list (default: all where block-wise runs, else rowwise)")
    p.add_argument("--grouped", default="", help="comma list of grouped-expert shapes: c, dsv3 (default: none)")
    H.add_micro_args(p, name="bench_fp8_linear", warmup=5, reps=20)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", device.index or 0)  # NOTE: set_device needs an index ("cuda" has none)
        torch.cuda.set_device(device)
        supported = F8.blockwise_supported(device.index or 0)
        name = H.device_name(device)
    else:
        supported, name = True, "cpu (emulated block-wise GEMMs; timings mean nothing)"
    in_use = "blockwise" if supported else "rowwise"
    recipes = [r for r in args.recipes.split(",") if r] or (list(F8.RECIPES) if supported else ["rowwise"])
    for r in recipes:
        F8.check_recipe(r)
    print(f"device: {name}; torch {torch.__version__}; block-wise scaled_mm supported: {supported}; "
          f"enable_fp8 picks: {in_use}", flush=True)
    timer = Timer(device, args.warmup, args.reps)
    table = TINY if args.tiny else SHAPES
    rows = []
    for workload in [w for w in args.shapes.split(",") if w]:
        for layer, m, n, k in table[workload]:
            r = bench_shape(m, n, k, recipes, timer, device)
            r.update(workload=workload, layer=layer)
            rows.append(r)
            line = (f"({workload}) {layer:<11} {m:>6}x{n:>5}x{k:>5}  bf16 {r['bf16']['total']:8.3f} ms "
                    f"(host {r['bf16']['host_total']:.3f})")
            for recipe in recipes:
                q = r[recipe]
                line += f" | {recipe} {q['total']:8.3f} ms x{q['speedup_vs_bf16']} (host {q['host_total']:.3f})"
                if m:
                    line += f" (quant {q['quant_sum']:.3f} gemm {q['gemm_sum']:.3f}, gemm x{q['gemm_speedup_vs_bf16']})"
            print(line, flush=True)
            for recipe in recipes:
                if m:
                    parts = [f"{key} {val:.3f}" for key, val in r[recipe].items() if isinstance(val, float)]
                    print(f"      {recipe}: " + ", ".join(parts))
    grouped = []
    for workload in [w for w in args.grouped.split(",") if w]:
        r = bench_grouped(*(GROUPED_TINY if args.tiny else GROUPED)[workload], timer, device)
        r.update(workload=workload)
        grouped.append(r)
        b, f = r["bf16"], r["fp8"]
        print(f"(grouped {workload}) {r['experts']} experts {r['hidden']}/{r['intermediate']}, {r['rows']} rows: "
              f"bf16 {b['total']:8.3f} ms (host {b['host_total']:.3f}) | fp8 {f['total']:8.3f} ms "
              f"x{f['speedup_vs_bf16']} (host {f['host_total']:.3f}); fc1 forward GEMM bf16 "
              f"{b.get('fc1_fwd_gemm', float('nan')):.3f} fp8 {f['fc1_fwd_gemm']:.3f} ms, its FP8 operands "
              f"{f['fc1_fwd_operands']:.3f} ms", flush=True)
    result = {"device": name, "torch": torch.__version__, "blockwise_supported": supported, "recipe_in_use": in_use,
              "recipes": recipes, "warmup": args.warmup, "reps": args.reps, "rows": rows, "grouped": grouped}
    out = Path(args.out)
    H.save_json(result, out)
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
