"""One decode token's attention over one rank's share of a CP-sharded KV cache (``attention.partial_attention``:
the output and its log-sum-exp), side by side on one GPU, each captured in a CUDA graph as the static cache's step
runs it.

Paths: ``triton`` (the split-key kernels, ``_decode_attention_triton``), ``blocks`` (torch matrix products over
blocks of 512 keys, combined by log-sum-exp: the path without Triton), and as the floor ``sdpa`` (the public SDPA
with ``enable_gqa`` and a boolean mask, no log-sum-exp: what one GPU's step runs over the whole cache). Shape:
workload (a)'s attention (Qwen3-0.6B: 16 query heads, 8 key heads of 128), bf16, batch ``--batch``, one query row,
``--keys`` keys (comma list), a mask allowing every key but the last. Time: ``--graph-calls`` calls captured in one
graph, the graph replayed ``--reps`` times after ``--warmup`` (CUDA events), median per call in µs. Outputs are
checked against the blocked path in fp32 first (``max |diff|``).

    python scripts/bench_decode_attention.py [--keys 4096,16384,32768] [--batch 1] [--out outputs/decode_attn.json]
    python scripts/bench_decode_attention.py --device cpu --paths blocks,sdpa --keys 64 --reps 1   # a dry run
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _bench_harness as H  # noqa: E402


def _path(name: str):
    """The function of one path (``triton`` imports triton, so only where asked for)."""
    import torch.nn.functional as F

    from loongforge_hf.kernels import attention

    if name == "triton":
        from loongforge_hf.kernels import _decode_attention_triton

        return _decode_attention_triton.partial_attention
    if name == "blocks":
        return attention._blocked_partial_attention
    if name == "sdpa":
        return lambda q, k, v, *, allowed, scale: (F.scaled_dot_product_attention(
            q, k, v, attn_mask=allowed, scale=scale, enable_gqa=True), None)
    raise SystemExit(f"--paths: unknown path {name!r} (triton, blocks, sdpa)")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--keys", default="4096,16384,32768")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--paths", default="triton,blocks,sdpa")
    p.add_argument("--graph-calls", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a dry run (no graph; the triton path only "
                                                    "under TRITON_INTERPRET=1)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    import torch

    from loongforge_hf.kernels.attention import _blocked_partial_attention

    paths = {name: _path(name) for name in args.paths.split(",")}

    device = H.Device(args.device)
    where = device.device
    g = torch.Generator().manual_seed(0)
    h, h_kv, d, scale = 16, 8, 128, 128 ** -0.5
    rows, report = [], {"device": device.describe(), "batch": args.batch, "heads": [h, h_kv, d], "results": {}}
    for n in (int(x) for x in args.keys.split(",")):
        q = torch.randn(args.batch, h, 1, d, generator=g).bfloat16().to(where)
        k, v = (torch.randn(args.batch, h_kv, n, d, generator=g).bfloat16().to(where) for _ in range(2))
        allowed = torch.ones(args.batch, 1, 1, n, dtype=torch.bool, device=where)
        allowed[..., -1] = False
        ref = _blocked_partial_attention(q.float(), k.float(), v.float(), allowed=allowed, scale=scale)[0]
        for name in args.paths.split(","):
            def call(fn=paths[name]):
                return fn(q, k, v, allowed=allowed, scale=scale)

            diff = (call()[0].float() - ref).abs().max().item()
            if device.is_cuda:
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    call()  # NOTE: compiled / warmed outside the capture
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    for _ in range(args.graph_calls):
                        call()
                run = graph.replay
            else:  # NOTE: a dry run: the calls one after the other, the host clock (its numbers mean nothing)
                def run():
                    for _ in range(args.graph_calls):
                        call()
            us = H.median_ms(run, cuda=device.is_cuda, warmup=args.warmup, reps=args.reps) * 1e3 / args.graph_calls
            report["results"][f"{name}@{n}"] = {"us": us, "max_abs_diff": diff}
            rows.append([n, name, f"{us:.1f}", f"{diff:.2e}"])
    timed = "µs / call (graphed)" if device.is_cuda else "µs / call (host clock, dry run)"
    print(H.markdown_table(["keys", "path", timed, "max |diff| vs fp32"], rows))
    if args.out:
        H.save_json(report, Path(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
