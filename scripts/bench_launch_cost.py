"""Host time per call of a decode step's small kernels, side by side on one GPU: what the host spends queuing each
path's work when nothing waits for the device (a one-token step of a small model is bound by exactly that).

Ops at a decode step's shapes (workload (a)'s Qwen3-0.6B: hidden 1024, 16 query heads of 128, intermediate 3072;
``--batch`` sequences, one token each), bf16, no grad:
- the RMSNorm of the hidden states and the q norm over each head;
- SwiGLU on the gated fc1 output; rope on the queries;
each through ``dispatched`` (what ``kernels.rmsnorm.rms_norm`` / ``swiglu`` / ``rope.rotary_sbhd`` run for it now),
``triton`` (this package's Triton kernel, called directly; CUDA only), ``aten`` (torch's own ops: ``F.rms_norm``
and the weight multiply, ``silu(gate) * up``, rope with ``cos`` / ``sin``) and for the norms ``hf`` (transformers'
RMSNorm expression, op by op). Each result is checked against the HF expression (``max |diff|``).

    python scripts/bench_launch_cost.py [--batch 8] [--reps 3000] [--out outputs/launch_cost.json]
    python scripts/bench_launch_cost.py --device cpu --reps 20 --warmup 2       # a dry run (no triton rows)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _bench_harness as H  # noqa: E402


def _hf_rms_norm(x, weight, eps=1e-6):
    import torch

    xf = x.to(torch.float32)
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _ops(batch: int, device, cuda: bool) -> dict:
    """{op: (reference, {path: call})}."""
    import torch
    import torch.nn.functional as F

    from loongforge_hf.kernels import rmsnorm, rope, swiglu

    g = torch.Generator().manual_seed(0)

    def rand(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=g)).to(torch.bfloat16).to(device)

    hidden, w = rand(batch, 1, 1024), 1 + rand(1024, scale=0.1)
    q, wq = rand(1, batch, 16, 128), 1 + rand(128, scale=0.1)
    fc1, freqs = rand(batch, 1, 2 * 3072), torch.randn(1, 1, 1, 128, generator=g).to(device)
    ops = {}
    for name, x, weight in (("rmsnorm [b, 1, 1024]", hidden, w), ("q norm [1, b, 16, 128]", q, wq)):
        paths = {"dispatched": lambda x=x, weight=weight: rmsnorm.rms_norm(x, weight, 1e-6),
                 "aten": lambda x=x, weight=weight: weight * F.rms_norm(x, (x.shape[-1],), eps=1e-6),
                 "hf": lambda x=x, weight=weight: _hf_rms_norm(x, weight)}
        if cuda:
            from loongforge_hf.kernels import _rmsnorm_triton

            paths["triton"] = lambda x=x, weight=weight: _rmsnorm_triton.forward(x, weight, 1e-6, False)[0]
        ops[name] = (_hf_rms_norm(x, weight), paths)
    gate, up = fc1.chunk(2, -1)
    paths = {"dispatched": lambda: swiglu.swiglu(fc1), "aten": lambda: F.silu(gate) * up}
    if cuda:
        from loongforge_hf.kernels import _swiglu_triton

        paths["triton"] = lambda: _swiglu_triton.forward(fc1)
    ops["swiglu [b, 1, 6144]"] = (F.silu(gate) * up, paths)
    paths = {"dispatched": lambda: rope.rotary_sbhd(q, freqs),
             "aten": lambda: rope.apply_rotary(q, torch.cos(freqs), torch.sin(freqs))}
    if cuda:
        from loongforge_hf.kernels import _rope_triton

        paths["triton"] = lambda: _rope_triton.rotate(q, freqs)
    ops["rope [1, b, 16, 128]"] = (rope.apply_rotary(q.float(), torch.cos(freqs), torch.sin(freqs)), paths)
    return ops


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a dry run (no triton rows)")
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--reps", type=int, default=3000, help="calls timed per path (must fit the launch queue)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    import torch

    device = H.Device(args.device)
    sync = torch.cuda.synchronize if device.is_cuda else (lambda: None)
    report = {"device": device.describe(), "batch": args.batch, "results": {}}
    rows = []
    with torch.no_grad():
        for op, (ref, paths) in _ops(args.batch, device.device, device.is_cuda).items():
            for name, call in paths.items():
                diff = (call().float() - ref.float()).abs().max().item()
                us = H.host_ms(call, synchronize=sync, warmup=args.warmup, reps=args.reps) * 1e3
                report["results"][f"{op}: {name}"] = {"host_us": us, "max_abs_diff": diff}
                rows.append([op, name, f"{us:.1f}", f"{diff:.2e}"])
    print(H.markdown_table(["op", "path", "host µs / call", "max |diff| vs HF"], rows))
    if args.out:
        H.save_json(report, Path(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
