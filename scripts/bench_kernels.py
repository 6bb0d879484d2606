"""RoPE and RMSNorm kernels alone, side by side, on the tensors of bench_train.py's shape (a) (Qwen3-0.6B: 16 q heads,
8 kv heads, head_dim 128, hidden 1024, seq 4096, micro-batch 4, bf16): our Triton kernels, the torch eager paths they
replace (the reference), and Liger-Kernel's rope / rms_norm where ``liger_kernel`` is importable.

Rows:
- ``rope_qk``: q ``[4096, 4, 16, 128]`` and k ``[4096, 4, 8, 128]`` as strided views of one fused QKV output
  ``[4096, 4, 4096]`` (megatron's ``[s, b, heads, d]``), rotated by angles ``[4096, 1, 1, 128]`` fp32; ours and torch
  rotate q then k (megatron calls the slot once per tensor), Liger rotates both in one call on transformers'
  ``[b, heads, s, d]`` layout (its own tensors, same sizes) with ``cos``/``sin`` ``[1, s, d]`` bf16.
- ``rmsnorm_hidden``: ``[16384, 1024]`` rows (input / pre-MLP / final norm).
- ``rmsnorm_qnorm``: q-norm over head_dim 128 of q ``[4096, 4, 16, 128]``, a strided view of the fused QKV output
  (``reshape`` of it would copy).
Each is timed forward (with autograd recording, as in training) and backward (``torch.autograd.grad`` of the output
w.r.t. the inputs, graph kept, so no grad accumulation is timed). CUDA events, median of ``--reps`` after ``--warmup``
(``_bench_harness.median_ms``). GB/s counts the least traffic of each pass (bf16 elements read and written, plus the
fp32 cos/sin tables of rope, read once per tensor, and the fp32 per-row rstd of RMSNorm; not the weight or its fp32
partial sums); ``of_peak`` is that over ``--peak-gbs`` (3350, an H100 SXM's HBM3). Our rope reads the fp32 angles and
computes cos/sin in the kernel (the tables' 4 MB are counted all the same: under 5% of the pass).

    python3 scripts/bench_kernels.py [--check] [--out outputs/bench_kernels.json]
    python3 scripts/bench_kernels.py --device cpu --tiny        # a dry run: torch paths only, host clock

``--check`` first compares ours with the torch reference on the same tensors (outputs and grads; bf16 tolerances of
tests/kernels/_triton_checks.py) and exits non-zero on a mismatch, after writing the JSON.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _bench_harness as H  # noqa: E402

from loongforge_hf.kernels._triton import triton_paths, use_triton  # noqa: E402
from loongforge_hf.kernels.rmsnorm import rms_norm  # noqa: E402
from loongforge_hf.kernels.rope import rotary_sbhd  # noqa: E402
from tests.kernels._triton_checks import TOL, two_ulps  # noqa: E402

# shape (a): seq, micro-batch, q heads, kv heads, head_dim, hidden; the fused QKV row is q + k + v heads of head_dim
FULL = dict(s=4096, b=4, hq=16, hkv=8, d=128, hidden=1024)
TINY = dict(s=64, b=2, hq=4, hkv=2, d=32, hidden=96)


def _liger():
    try:
        import liger_kernel  # noqa: F401
    except ImportError:
        return None
    return True


def _fused_qkv(cfg, device, dtype, g):
    width = (cfg["hq"] + 2 * cfg["hkv"]) * cfg["d"]
    qkv = torch.randn(cfg["s"], cfg["b"], width, device=device, generator=g).to(dtype).requires_grad_()
    d, hq, hkv = cfg["d"], cfg["hq"], cfg["hkv"]
    q = qkv[..., :hq * d].unflatten(-1, (hq, d))
    k = qkv[..., hq * d:(hq + hkv) * d].unflatten(-1, (hkv, d))
    return qkv, q, k


def _angles(cfg, device):
    d = cfg["d"]
    inv_freq = 1.0 / (1000000.0 ** (torch.arange(0, d, 2, device=device, dtype=torch.float32) / d))
    f = torch.arange(cfg["s"], device=device, dtype=torch.float32)[:, None] * inv_freq[None]
    return torch.cat((f, f), -1)


def _time_pair(forward, inputs, grads, *, cuda, warmup, reps):
    """(forward ms, backward ms) of ``forward()`` -> outputs, the backward being the grads w.r.t. ``inputs``."""
    fwd = H.median_ms(forward, cuda=cuda, warmup=warmup, reps=reps)
    outs = forward()
    outs = outs if isinstance(outs, (tuple, list)) else (outs,)

    def backward():
        torch.autograd.grad(outs, inputs, grads, retain_graph=True)

    bwd = H.median_ms(backward, cuda=cuda, warmup=warmup, reps=reps)
    return fwd, bwd


def _cell(ms, moved, peak_gbs):
    gbs = moved / ms / 1e6
    return {"ms": round(ms, 4), "GB/s": round(gbs, 1), "of_peak": round(gbs / peak_gbs, 3)}


def bench_rope(cfg, device, dtype, g, args, impls):
    qkv, q, k = _fused_qkv(cfg, device, dtype, g)
    freqs = _angles(cfg, device)[:, None, None, :]
    dq, dk = torch.randn(q.shape, device=device, generator=g).to(dtype), torch.randn(
        k.shape, device=device, generator=g).to(dtype)
    elems = q.numel() + k.numel()
    moved = 2 * elems * q.element_size() + 2 * 2 * freqs.numel() * 4   # read x, write y; cos, sin once per tensor
    cuda = device.type == "cuda"
    row = {"name": "rope_qk", "q": list(q.shape), "k": list(k.shape), "qkv": list(qkv.shape),
           "bytes_per_pass": moved}

    def ours():
        return rotary_sbhd(q, freqs), rotary_sbhd(k, freqs)

    for label in impls:
        if label == "liger":
            from liger_kernel.ops.rope import LigerRopeFunction

            s, b, d = cfg["s"], cfg["b"], cfg["d"]

            # NOTE: transformers' layout: [b, s, heads, d] projections seen as [b, heads, s, d], grads likewise
            def hf_layout(heads):
                return torch.randn(b, s, heads, d, device=device, generator=g).to(dtype).transpose(1, 2)

            lq, lk = hf_layout(cfg["hq"]).requires_grad_(), hf_layout(cfg["hkv"]).requires_grad_()
            cos, sin = freqs[:, 0, 0].cos()[None].to(dtype), freqs[:, 0, 0].sin()[None].to(dtype)
            fwd, bwd = _time_pair(lambda: LigerRopeFunction.apply(lq, lk, cos, sin), [lq, lk],
                                  [hf_layout(cfg["hq"]), hf_layout(cfg["hkv"])], cuda=cuda,
                                  warmup=args.warmup, reps=args.reps)
        else:
            with triton_paths(label != "torch"):
                fwd, bwd = _time_pair(ours, [q, k], [dq, dk], cuda=cuda, warmup=args.warmup, reps=args.reps)
        row[label] = {"fwd": _cell(fwd, moved, args.peak_gbs), "bwd": _cell(bwd, moved, args.peak_gbs)}
    check = None
    if args.check and "ours" in impls:
        outs = {}
        for label in ("ours", "torch"):
            with triton_paths(label == "ours"):
                y = ours()
                outs[label] = list(y) + list(torch.autograd.grad(y, [q, k], [dq, dk]))
        atol, rtol = max(TOL[dtype][0], two_ulps(qkv), two_ulps(dq)), TOL[dtype][1]
        check = _compare("rope_qk", outs["ours"], outs["torch"], [(atol, rtol)] * 4)
    return row, check


def bench_rmsnorm(name, cfg, x_src, device, dtype, g, args, impls):
    if x_src == "hidden":
        x = torch.randn(cfg["s"] * cfg["b"], cfg["hidden"], device=device, generator=g).mul(3).to(dtype)
        x.requires_grad_()
    else:
        _, x, _ = _fused_qkv(cfg, device, dtype, g)   # NOTE: the view keeps its fused QKV base alive
    n = x.shape[-1]
    rows = x.numel() // n
    w = (1 + 0.1 * torch.randn(n, device=device, generator=g)).to(dtype).requires_grad_()
    dy = torch.randn(x.shape, device=device, generator=g).to(dtype)
    e = x.element_size()
    moved_fwd = 2 * x.numel() * e + 4 * rows           # read x, write y, write rstd
    moved_bwd = 3 * x.numel() * e + 4 * rows           # read x, dy, rstd, write dx
    cuda = device.type == "cuda"
    row = {"name": name, "x": list(x.shape), "strided": not x.is_contiguous(), "rows": rows,
           "bytes_fwd": moved_fwd, "bytes_bwd": moved_bwd}

    def ours():
        return rms_norm(x, w, 1e-6)

    for label in impls:
        note = None
        if label == "liger":
            from liger_kernel.transformers.rms_norm import LigerRMSNorm

            norm = LigerRMSNorm(n, eps=1e-6).to(device=device, dtype=dtype)
            with torch.no_grad():
                norm.weight.copy_(w)
            try:
                norm(x)
                lx = x
            except RuntimeError as exc:   # NOTE: a strided view it cannot flatten: timed on a contiguous copy
                lx = x.detach().contiguous().requires_grad_()
                note = f"strided input refused ({str(exc).splitlines()[0][:120]}); timed on a contiguous copy"
            fwd, bwd = _time_pair(lambda: norm(lx), [lx, norm.weight], [dy.clone()], cuda=cuda, warmup=args.warmup,
                                  reps=args.reps)
        else:
            with triton_paths(label != "torch"):
                fwd, bwd = _time_pair(ours, [x, w], [dy], cuda=cuda, warmup=args.warmup, reps=args.reps)
        row[label] = {"fwd": _cell(fwd, moved_fwd, args.peak_gbs), "bwd": _cell(bwd, moved_bwd, args.peak_gbs)}
        if note:
            row[label]["note"] = note
    check = None
    if args.check and "ours" in impls:
        outs = {}
        for label in ("ours", "torch"):
            with triton_paths(label == "ours"):
                y = ours()
                outs[label] = [y] + list(torch.autograd.grad(y, [x, w], dy))
        atol, rtol = TOL[dtype]
        check = _compare(name, outs["ours"], outs["torch"], [(atol, rtol)] * 2 + [(atol * math.sqrt(rows), rtol)])
    return row, check


def _compare(name, ours, ref, tols):
    """Each pair within ``atol + rtol * |ref|`` (torch.testing's rule); the largest error of each."""
    result = {"name": name, "ok": True, "tensors": []}
    for i, (a, b, (atol, rtol)) in enumerate(zip(ours, ref, tols)):
        a, b = a.detach().float(), b.detach().float()
        err = (a - b).abs()
        bad = int((err > atol + rtol * b.abs()).sum())
        ok = a.shape == b.shape and bad == 0 and bool(torch.isfinite(a).all())
        result["tensors"].append({"index": i, "max_abs_err": float(err.max()) if err.numel() else 0.0,
                                  "atol": atol, "rtol": rtol, "mismatched": bad, "ok": ok})
        result["ok"] &= ok
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true", help="compare ours with the torch reference first")
    p.add_argument("--impls", default="ours,torch,liger", help="which of ours,torch,liger to time")
    p.add_argument("--peak-gbs", type=float, default=3350.0, help="the device's memory bandwidth, GB/s")
    H.add_micro_args(p, name="bench_kernels", warmup=5, reps=20)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    cfg = TINY if args.tiny else FULL
    dtype = torch.bfloat16
    impls = [i for i in args.impls.split(",") if i]
    skipped = {}
    if "ours" in impls and not use_triton(torch.empty(0, device=device)):
        impls.remove("ours")
        skipped["ours"] = "Triton kernels do not run here (needs CUDA + triton, or TRITON_INTERPRET=1)"
    if "liger" in impls and (device.type != "cuda" or _liger() is None):
        impls.remove("liger")
        skipped["liger"] = "liger_kernel not importable" if _liger() is None else "Liger-Kernel needs CUDA"
    name = H.device_name(device)
    print(f"device: {name}; torch {torch.__version__}; timing {', '.join(impls)}"
          + "".join(f"; {k} skipped: {v}" for k, v in skipped.items()), flush=True)
    g = torch.Generator(device=device).manual_seed(0)
    rows, checks = [], []
    for fn in (lambda: bench_rope(cfg, device, dtype, g, args, impls),
               lambda: bench_rmsnorm("rmsnorm_hidden", cfg, "hidden", device, dtype, g, args, impls),
               lambda: bench_rmsnorm("rmsnorm_qnorm", cfg, "qnorm", device, dtype, g, args, impls)):
        row, check = fn()
        rows.append(row)
        if check is not None:
            checks.append(check)
            worst = max(t["max_abs_err"] for t in check["tensors"])
            print(f"check {check['name']}: {'ok' if check['ok'] else 'MISMATCH'} (largest abs error {worst:.3g})",
                  flush=True)
        for label in impls:
            for pass_ in ("fwd", "bwd"):
                c = row[label][pass_]
                print(f"{row['name']:15} {pass_} {label:6} {c['ms']:9.4f} ms {c['GB/s']:8.1f} GB/s "
                      f"{c['of_peak']:6.3f} of peak" + (f"  ({row[label]['note']})" if row[label].get("note") else ""),
                      flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    result = {"device": name, "torch": torch.__version__, "versions": H.versions("triton", "liger-kernel"),
              "tiny": args.tiny, "shape": cfg, "dtype": str(dtype), "peak_gbs": args.peak_gbs, "impls": impls,
              "skipped": skipped, "rows": rows, "checks": checks}
    out = Path(args.out)
    H.save_json(result, out)
    print(f"wrote {out}")
    return 0 if all(c["ok"] for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
