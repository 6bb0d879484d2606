"""Gemma 2's soft-capped attention, forward and backward, side by side on one GPU: time and peak memory.

Paths: ``transformers`` (transformers' own ``eager_attention_forward`` of Gemma 2: what its model runs for the cap,
SDPA having none; scores in the input dtype, an additive mask), ``materialised`` (ours without the kernels:
``attention._materialised``, transformers' math with an fp32 softmax) and ``kernel`` (``kernels.softcap_attention``:
Triton flash-style kernels, no materialised scores). Shape: Gemma-2-9B's attention (16 query heads, 8 key heads of
256, cap 50), bf16, batch ``--batch``, ``--seq`` tokens (comma list), causal, on a full layer and a sliding one
(``--window`` tokens; Gemma 2's is 4096). Each path's output and q / k / v gradients are checked against
transformers' in fp32 first (largest difference relative to the largest value). Time: median of ``--reps`` forward +
backward calls after ``--warmup`` (CUDA events); memory: the peak allocated during one call beyond its inputs.

    python scripts/bench_softcap_attention.py [--seq 2048,4096,8192] [--out outputs/softcap_attn.json]
    python scripts/bench_softcap_attention.py --device cpu --paths transformers,materialised --seq 64 --reps 1
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _bench_harness as H  # noqa: E402
from bench_sink_attention import _allowed, _grads, finish, measure_paths  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, CAP = 16, 8, 256, 50.0


def _path(name: str):
    """``fn(q, k, v, *, window, scale) -> [b, h, s, d]`` of one path."""
    import torch

    from loongforge_hf.kernels import attention, softcap_attention

    if name == "transformers":
        from types import SimpleNamespace

        from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

        def run(q, k, v, *, window, scale):
            mask = torch.zeros(q.shape[-2], k.shape[-2], dtype=q.dtype, device=q.device)
            mask = mask.masked_fill(~_allowed(q.shape[-2], window, q.device), torch.finfo(q.dtype).min)
            module = SimpleNamespace(num_key_value_groups=q.shape[1] // k.shape[1], training=False)
            return eager_attention_forward(module, q, k, v, mask[None, None], scaling=scale,
                                           softcap=CAP)[0].transpose(1, 2)
        return run
    if name == "materialised":
        def run(q, k, v, *, window, scale):
            return attention._materialised(q, k, v, _allowed(q.shape[-2], window, q.device), scale=scale,
                                           rule=attention._ScoreRule(CAP, None), dropout_p=0.0)
        return run
    if name == "kernel":
        def run(q, k, v, *, window, scale):
            return softcap_attention.softcap_attention(q, k, v, cap=CAP, scale=scale, causal=True, q_offset=0,
                                                       window=None if window is None else (window - 1, 0))
        return run
    raise SystemExit(f"--paths: unknown path {name!r} (transformers, materialised, kernel)")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq", default="2048,4096,8192")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--window", type=int, default=4096)
    p.add_argument("--paths", default="transformers,materialised,kernel")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a dry run (the kernel path needs Triton)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    import torch

    device = H.Device(args.device)
    where, dtype = device.device, (torch.bfloat16 if device.is_cuda else torch.float32)
    paths = {name: _path(name) for name in args.paths.split(",")}
    scale = HEAD_DIM ** -0.5
    rows, report = [], {"device": device.describe(), "batch": args.batch, "heads": [HEADS, KV_HEADS, HEAD_DIM],
                        "cap": CAP, "window": args.window, "results": {}}
    g = torch.Generator().manual_seed(0)
    for s in (int(x) for x in args.seq.split(",")):
        for layer, window in (("full", None), ("sliding", args.window)):
            q = torch.randn(args.batch, HEADS, s, HEAD_DIM, generator=g)
            k, v = (torch.randn(args.batch, KV_HEADS, s, HEAD_DIM, generator=g) for _ in range(2))
            tensors = [t.to(device=where, dtype=dtype).requires_grad_() for t in (q, k, v)]
            grad = torch.randn(args.batch, HEADS, s, HEAD_DIM, generator=g).to(where, dtype)
            ref_in = [t.detach().float().requires_grad_() for t in tensors]
            ref = _grads(_path("transformers"), ref_in, grad.float(), window=window, scale=scale)
            del ref_in
            measure_paths(paths, tensors, grad, ref, window=window, scale=scale, device=device, args=args,
                          where=(s, layer), report=report, rows=rows)
    finish(report, rows, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
