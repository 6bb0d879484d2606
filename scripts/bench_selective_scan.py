"""Mamba-1's selective scan (Mamba, Falcon-Mamba, Jamba), forward and backward, side by side on one GPU.

Paths: ``loop`` (transformers' torch path, ``MambaMixer.slow_forward``'s scan: one state update and one
``state . C`` matmul per token; what our ``kernels.selective_scan`` ran until 2026-12-01) and ``scan``
(``kernels.selective_scan`` on ``kernels.linear_scan``: the states by a parallel scan in ``O(log s)`` tensor steps,
its backward by hand). Shape: a Mamba mixer's scan (``--d-inner`` channels, state size ``--state``, the default
Falcon-Mamba-7B's 8192 and 16), bf16 ``x`` / ``z`` / ``B`` / ``C``, fp32 ``dt``, ``--batch`` rows of ``--seq``
tokens. Each path's output and gradients are checked against ``loop`` in fp32 (largest difference relative to the
largest value). Time: median of ``--reps`` forward + backward calls after ``--warmup`` (CUDA events); memory: the
peak allocated during one call beyond its inputs.

    python scripts/bench_selective_scan.py [--seq 1024,2048,4096] [--out outputs/selective_scan.json]
    python scripts/bench_selective_scan.py --device cpu --seq 64 --d-inner 64 --reps 1
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _bench_harness as H  # noqa: E402


def _loop(x, dt, A, B, C, D, z):
    """transformers' ``MambaMixer.slow_forward`` scan, op for op (no cache, no documents)."""
    import torch

    dtype = x.dtype
    decay = torch.exp(A[None, :, None, :] * dt[:, :, :, None])
    inputs = dt[:, :, :, None] * B[:, None, :, :].float() * x[:, :, :, None].float()
    state = torch.zeros(x.shape[0], x.shape[1], A.shape[-1], dtype=torch.float32, device=x.device)
    outputs = []
    for t in range(x.shape[-1]):
        state = decay[:, :, t] * state + inputs[:, :, t]
        outputs.append(torch.matmul(state.to(dtype), C[:, t, :, None].to(dtype))[..., 0])
    y = torch.stack(outputs, dim=-1) + x * D[None, :, None].float()
    return y * torch.nn.functional.silu(z)


def _path(name: str):
    if name == "loop":
        return _loop
    if name == "scan":
        from loongforge_hf.kernels.selective_scan import selective_scan

        return lambda *a: selective_scan(*a)[0]
    raise SystemExit(f"--paths: unknown path {name!r} (loop, scan)")


def _inputs(batch: int, s: int, d: int, n: int, device, dtype, gen):
    import torch

    x, z = (torch.randn(batch, d, s, generator=gen) for _ in range(2))
    dt = torch.nn.functional.softplus(torch.randn(batch, d, s, generator=gen) - 4)  # NOTE: dt_bias-like init
    A = -torch.arange(1, n + 1, dtype=torch.float32).repeat(d, 1)  # NOTE: Mamba's S4D-real A init
    B, C = (torch.randn(batch, s, n, generator=gen) for _ in range(2))
    D = torch.ones(d)
    out = []
    for t in (x, dt, A, B, C, D, z):
        low = t is x or t is z or t is B or t is C
        out.append(t.to(device=device, dtype=dtype if low else torch.float32).requires_grad_(t is not A))
    return out


def _grads(fn, tensors, grad):
    for t in tensors:
        t.grad = None
    out = fn(*tensors)
    out.backward(grad)
    return [out.detach()] + [t.grad for t in tensors if t.requires_grad]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq", default="1024,2048,4096")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--d-inner", type=int, default=8192)
    p.add_argument("--state", type=int, default=16)
    p.add_argument("--paths", default="loop,scan")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a dry run")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    import torch

    device = H.Device(args.device)
    where, dtype = device.device, (torch.bfloat16 if device.is_cuda else torch.float32)
    rows, report = [], {"device": device.describe(), "batch": args.batch, "d_inner": args.d_inner,
                        "state": args.state, "results": {}}
    gen = torch.Generator().manual_seed(0)
    for s in (int(v) for v in args.seq.split(",")):
        tensors = _inputs(args.batch, s, args.d_inner, args.state, where, dtype, gen)
        grad = torch.randn(args.batch, args.d_inner, s, generator=gen).to(where)
        ref_in = [t.detach().float().requires_grad_(t.requires_grad) for t in tensors]
        ref = _grads(_loop, ref_in, grad)
        del ref_in
        for name in args.paths.split(","):
            fn = _path(name)
            r = H.measure_path(lambda fn=fn: _grads(fn, tensors, grad), ref, cuda=device.is_cuda,
                               warmup=args.warmup, reps=args.reps)
            report["results"][f"{name}@{s}"] = r
            rows.append([s, name, f"{r['ms']:.2f}", f"{r['peak_mib']:.0f}", f"{r['max_rel_diff']:.1e}"])
    print(H.markdown_table(["tokens per row", "path", "fwd+bwd ms", "peak MiB", "max rel diff vs fp32 loop"], rows))
    if args.out:
        H.save_json(report, Path(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
