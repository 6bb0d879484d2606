"""One AdamW step: torch's fused AdamW vs kernels.adamw.LoongAdamW on the parameter shapes of bench_train.py's
workloads.

The parameters are those of the transformers model of each workload (built on the meta device from
``bench_train.hf_config``; only the shapes are used), allocated on the device in bf16 ("model" precision: bf16
weights, grads and moments) and in fp32, with random grads. Each optimizer is timed alone (CUDA events, median of
``--reps`` after ``--warmup`` steps), with and without ``grad_scale`` (``MegatronEngine`` always sets it: the 1/tokens
and clipping factor). GB/s counts the minimum traffic of the update, 7 tensor elements per parameter (read p, g, m, v;
write p, m, v); torch's fused kernel also writes the unscaled grads back when ``grad_scale`` is set (8 elements).

    python3 scripts/bench_optimizer.py [--shapes a,b,c] [--dtypes bf16,fp32] [--out outputs/bench_optimizer.json]
    python3 scripts/bench_optimizer.py --tiny --device cpu       # a dry run (torch paths on CPU)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _bench_harness as H  # noqa: E402
from bench_train import BETAS, EPS, LR, WORKLOADS, hf_config  # noqa: E402

from loongforge_hf.kernels.adamw import LoongAdamW  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def shapes(key: str, tiny: bool) -> list[torch.Size]:
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config(WORKLOADS[key], tiny))
    return [p.shape for p in model.parameters()]


def bench(params: list[torch.Tensor], cls, *, grad_scale: bool, device: torch.device, warmup: int,
          reps: int) -> float:
    opt = cls(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=0.1, fused=True)

    def step():
        if grad_scale:
            opt.grad_scale = torch.tensor(4096.0, device=device)
        opt.step()

    try:
        return H.median_ms(step, cuda=device.type == "cuda", warmup=warmup, reps=reps)
    finally:
        opt.state.clear()


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="a,b,c")
    p.add_argument("--dtypes", default="bf16,fp32")
    H.add_micro_args(p, name="bench_optimizer", warmup=3, reps=10)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    name = H.device_name(device)
    print(f"device: {name}; torch {torch.__version__}")
    rows = []
    for key in args.shapes.split(","):
        sh = shapes(key, args.tiny)
        numel = sum(s.numel() for s in sh)
        for dname in args.dtypes.split(","):
            dtype = DTYPES[dname]
            g = torch.Generator(device=device).manual_seed(0)
            params = [(torch.randn(s, device=device, generator=g) * 0.02).to(dtype) for s in sh]
            for t in params:
                t.grad = (torch.randn(t.shape, device=device, generator=g) * 1e-3).to(dtype)
            moved = 7 * numel * params[0].element_size()
            for grad_scale in (True, False):
                row = {"shape": key, "dtype": dname, "grad_scale": grad_scale, "tensors": len(sh),
                       "parameters": numel}
                for label, cls in (("torch_fused", torch.optim.AdamW), ("loong", LoongAdamW)):
                    ms = bench(params, cls, grad_scale=grad_scale, device=device, warmup=args.warmup,
                               reps=args.reps)
                    row[label] = {"ms": round(ms, 3), "GB/s": round(moved / ms / 1e6, 1)}
                row["speedup"] = round(row["torch_fused"]["ms"] / row["loong"]["ms"], 3)
                rows.append(row)
                print(f"({key}) {dname} grad_scale={grad_scale!s:5} {len(sh):4} tensors {numel / 1e9:.3f} B params: "
                      f"torch fused {row['torch_fused']['ms']:8.3f} ms {row['torch_fused']['GB/s']:7.1f} GB/s | "
                      f"LoongAdamW {row['loong']['ms']:8.3f} ms {row['loong']['GB/s']:7.1f} GB/s | "
                      f"x{row['speedup']}", flush=True)
            del params
            if device.type == "cuda":
                torch.cuda.empty_cache()
    result = {"device": name, "torch": torch.__version__, "tiny": args.tiny, "rows": rows}
    H.save_json(result, Path(args.out))
    return result


if __name__ == "__main__":
    main()
