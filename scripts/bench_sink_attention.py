"""gpt-oss's attention with sinks, forward and backward, side by side on one GPU: time and peak memory.

Paths: ``transformers`` (transformers' own ``eager_attention_forward`` of gpt-oss: what its model runs without a hub
kernel; fp32-free, scores in the input dtype, an additive mask), ``materialised`` (ours without the flash kernel:
``attention._materialised``, transformers' math with an fp32 softmax) and ``flash`` (``kernels.sink_attention``:
torch's flash kernel, the sink applied through its log-sum-exp). Shape: gpt-oss-20b's attention (64 query heads,
8 key heads of 64), bf16, batch ``--batch``, ``--seq`` tokens (comma list), causal, on a full layer and a sliding one
(128-token window). Each path's output and its q / k / v / sink gradients are checked against transformers' in fp32
first (largest difference relative to the largest value). Time: median of ``--reps`` forward + backward calls after
``--warmup`` (CUDA events); memory: the peak allocated during one call beyond its inputs.

    python scripts/bench_sink_attention.py [--seq 2048,4096,8192] [--out outputs/sink_attn.json]
    python scripts/bench_sink_attention.py --device cpu --paths transformers,materialised --seq 64 --reps 1  # dry run
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _bench_harness as H  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, WINDOW = 64, 8, 64, 128


def _allowed(s: int, window: int | None, device):
    import torch

    rel = torch.arange(s, device=device)[None, :] - torch.arange(s, device=device)[:, None]
    allowed = rel <= 0
    if window is not None:
        allowed &= rel > -window
    return allowed


def _path(name: str):
    """``fn(q, k, v, sinks, *, window, scale) -> [b, h, s, d]`` of one path."""
    import torch

    from loongforge_hf.kernels import attention, sink_attention

    if name == "transformers":
        from types import SimpleNamespace

        from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

        def run(q, k, v, sinks, *, window, scale):
            mask = torch.zeros(q.shape[-2], k.shape[-2], dtype=q.dtype, device=q.device)
            mask = mask.masked_fill(~_allowed(q.shape[-2], window, q.device), torch.finfo(q.dtype).min)
            module = SimpleNamespace(num_key_value_groups=q.shape[1] // k.shape[1], sinks=sinks, training=False)
            return eager_attention_forward(module, q, k, v, mask[None, None], scaling=scale)[0].transpose(1, 2)
        return run
    if name == "materialised":
        def run(q, k, v, sinks, *, window, scale):
            rule = attention._ScoreRule(None, sinks)
            return attention._materialised(q, k, v, _allowed(q.shape[-2], window, q.device), scale=scale, rule=rule,
                                           dropout_p=0.0)
        return run
    if name == "flash":
        def run(q, k, v, sinks, *, window, scale):
            return sink_attention.dense(q, k, v, sinks=sinks, causal=True, scale=scale,
                                        window=None if window is None else (window - 1, 0))
        return run
    raise SystemExit(f"--paths: unknown path {name!r} (transformers, materialised, flash)")


def _inputs(batch: int, s: int, device, dtype, g):
    import torch

    q = torch.randn(batch, HEADS, s, HEAD_DIM, generator=g)
    k, v = (torch.randn(batch, KV_HEADS, s, HEAD_DIM, generator=g) for _ in range(2))
    sinks = torch.randn(HEADS, generator=g)
    return [t.to(device=device, dtype=dtype).requires_grad_() for t in (q, k, v, sinks)]


def _grads(fn, tensors, grad, *, window, scale):
    for t in tensors:
        t.grad = None
    out = fn(*tensors, window=window, scale=scale)
    out.backward(grad)
    return [out.detach()] + [t.grad for t in tensors]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq", default="2048,4096,8192")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--paths", default="transformers,materialised,flash")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a dry run (the flash path needs CUDA)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    import torch

    device = H.Device(args.device)
    where, dtype = device.device, (torch.bfloat16 if device.is_cuda else torch.float32)
    paths = {name: _path(name) for name in args.paths.split(",")}
    scale = HEAD_DIM ** -0.5
    rows, report = [], {"device": device.describe(), "batch": args.batch, "heads": [HEADS, KV_HEADS, HEAD_DIM],
                        "results": {}}
    g = torch.Generator().manual_seed(0)
    for s in (int(x) for x in args.seq.split(",")):
        for layer, window in (("full", None), ("sliding", WINDOW)):
            tensors = _inputs(args.batch, s, where, dtype, g)
            grad = torch.randn(args.batch, HEADS, s, HEAD_DIM, generator=g).to(where, dtype)
            ref_in = [t.detach().float().requires_grad_() for t in tensors]
            ref = _grads(_path("transformers"), ref_in, grad.float(), window=window, scale=scale)
            del ref_in
            measure_paths(paths, tensors, grad, ref, window=window, scale=scale, device=device, args=args,
                          where=(s, layer), report=report, rows=rows)
    finish(report, rows, args.out)
    return 0


def measure_paths(paths: dict, tensors, grad, ref, *, window, scale, device, args, where, report, rows) -> None:
    """Each path's forward + backward on ``tensors``: its largest difference from ``ref`` (relative), the peak
    memory of one call beyond its inputs, the median time; into ``report["results"]`` and ``rows``."""
    s, layer = where
    for name, fn in paths.items():
        r = H.measure_path(lambda fn=fn: _grads(fn, tensors, grad, window=window, scale=scale), ref,
                           cuda=device.is_cuda, warmup=args.warmup, reps=args.reps)
        report["results"][f"{name}@{s}/{layer}"] = r
        rows.append([s, layer, name, f"{r['ms']:.2f}", f"{r['peak_mib']:.0f}", f"{r['max_rel_diff']:.1e}"])


def finish(report: dict, rows: list, out: str | None) -> None:
    print(H.markdown_table(["tokens", "layer", "path", "fwd+bwd ms", "peak MiB", "max rel diff vs fp32"], rows))
    if out:
        H.save_json(report, Path(out))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
