"""The gated delta rule (Qwen3.5 / Qwen3-Next linear attention), forward and backward, side by side on one GPU.

Paths: ``transformers`` (transformers' torch fallback ``torch_chunk_gated_delta_rule``: what its Qwen3.5 model runs
without the fla package; it has no document restarts), ``torch`` (``kernels.gated_delta_rule``: ours without fla,
its chunk-to-chunk state pass a Triton kernel each way; packed documents in one call,
``gated_delta_rule_packed``), ``torch-loop`` (the same
with that pass a torch loop over the chunks, ``LOONGFORGE_TRITON=0``; also the fp32 reference) and ``fla``
(``kernels.fla_delta_rule``: fla's Triton kernels, every row and document in one varlen call). Shape: a Qwen3.5
linear-attention layer (16 key heads and 32 value heads of 128), bf16 inputs,
``--batch`` rows of each of ``--seq`` tokens, either one document per row or ``--docs`` equal documents packed per
row. Each path's output and gradients are checked against ``torch-loop`` in fp32 (largest difference relative to the
largest value). Time: median of ``--reps`` forward + backward calls after ``--warmup`` (CUDA events), or forwards
without gradients with ``--forward-only`` (evaluation, a prefill); memory: the peak allocated during one call beyond
its inputs. fla's row says "refused" where fla refuses its gated backward (Hopper with Triton 3.4 - 3.7.0).

    python scripts/bench_gated_delta_rule.py [--seq 2048,4096,8192] [--docs 8] [--forward-only]
                                             [--out outputs/delta_rule.json]
    python scripts/bench_gated_delta_rule.py --device cpu --paths transformers,torch --seq 128 --reps 1
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _bench_harness as H  # noqa: E402
from bench_sink_attention import _rel_diff  # noqa: E402

K_HEADS, V_HEADS, K_DIM, V_DIM = 16, 32, 128, 128


def _bounds(batch: int, seq: int, docs: int) -> list[list[int]]:
    """Each row's document bounds ``[0, .., seq]``."""
    cuts = [round(seq * i / docs) for i in range(docs + 1)]
    return [cuts for _ in range(batch)]


def _path(name: str, bounds: list[list[int]]):
    """``fn(q, k, v, g, beta) -> [b, s, v_heads, v_dim]`` of one path."""
    import torch

    if name == "transformers":
        from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

        fallback = getattr(torch_chunk_gated_delta_rule, "__wrapped__", torch_chunk_gated_delta_rule)

        def run(q, k, v, g, beta):
            if any(len(b) > 2 for b in bounds):
                raise SystemExit("--paths transformers: its torch fallback has no packed documents (use --docs 1)")
            r = V_HEADS // K_HEADS
            q, k = (x.repeat_interleave(r, dim=2) for x in (q, k))
            return fallback(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)[0]
        return run
    if name in ("torch", "torch-loop"):
        from loongforge_hf.kernels._triton import triton_paths
        from loongforge_hf.kernels.gated_delta_rule import gated_delta_rule, gated_delta_rule_packed

        def run(q, k, v, g, beta):
            with triton_paths(name == "torch"):
                if any(len(b) > 2 for b in bounds):
                    return gated_delta_rule_packed(q, k, v, g, beta, bounds)
                return gated_delta_rule(q, k, v, g, beta)
        return run
    if name == "fla":
        from loongforge_hf.kernels.fla_delta_rule import gated_delta_rule_varlen

        def run(q, k, v, g, beta):
            seq = q.shape[1]
            starts = [row * seq + c for row, cuts in enumerate(bounds) for c in cuts[:-1]] + [len(bounds) * seq]
            cu = torch.tensor(starts, device=q.device)
            flat = [x.reshape(1, -1, *x.shape[2:]) for x in (q, k, v, g, beta)]
            return gated_delta_rule_varlen(*flat, cu_seqlens=cu)[0].reshape(*v.shape)
        return run
    raise SystemExit(f"--paths: unknown path {name!r} (transformers, torch, torch-loop, fla)")


def _fla_trains(device) -> bool:
    from loongforge_hf.kernels import fla_delta_rule

    return fla_delta_rule.available(device, backward=True)


def _inputs(batch: int, s: int, device, dtype, gen):
    import torch

    q, k = (torch.randn(batch, s, K_HEADS, K_DIM, generator=gen) for _ in range(2))
    v = torch.randn(batch, s, V_HEADS, V_DIM, generator=gen)
    # NOTE: Qwen3.5's gates: g = -exp(A_log) * softplus(a + dt_bias) (log decay <= 0), beta = sigmoid(b)
    g = -torch.nn.functional.softplus(torch.randn(batch, s, V_HEADS, generator=gen)) * 0.5
    beta = torch.rand(batch, s, V_HEADS, generator=gen)
    return [t.to(device=device, dtype=dtype if t.dim() == 4 or t is beta else torch.float32).requires_grad_()
            for t in (q, k, v, g, beta)]


def _forward(fn, tensors, grad):
    import torch

    with torch.no_grad():
        return [fn(*tensors)]


def _grads(fn, tensors, grad):
    for t in tensors:
        t.grad = None
    out = fn(*tensors)
    out.backward(grad)
    return [out.detach()] + [t.grad for t in tensors]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq", default="2048,4096,8192")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--docs", type=int, default=8, help="documents per row in the packed case (1: that case is off)")
    p.add_argument("--paths", default="transformers,torch,torch-loop,fla")
    p.add_argument("--forward-only", action="store_true", help="time forwards without gradients")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a dry run (the fla path needs CUDA)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    import torch

    device = H.Device(args.device)
    where, dtype = device.device, (torch.bfloat16 if device.is_cuda else torch.float32)
    rows, report = [], {"device": device.describe(), "batch": args.batch,
                        "heads": [K_HEADS, V_HEADS, K_DIM, V_DIM], "results": {}}
    gen = torch.Generator().manual_seed(0)
    call = _forward if args.forward_only else _grads
    report["forward_only"] = args.forward_only
    layouts = [("1 document", 1)] + ([(f"{args.docs} documents", args.docs)] if args.docs > 1 else [])
    for s in (int(x) for x in args.seq.split(",")):
        for layout, docs in layouts:
            bounds = _bounds(args.batch, s, docs)
            names = [n for n in args.paths.split(",") if not (n == "transformers" and docs > 1)]
            tensors = _inputs(args.batch, s, where, dtype, gen)
            grad = torch.randn(args.batch, s, V_HEADS, V_DIM, generator=gen).to(where, dtype)
            ref_in = [t.detach().float().requires_grad_() for t in tensors]
            ref = call(_path("torch-loop", bounds), ref_in, grad.float())
            del ref_in
            for name in names:
                if name == "fla" and not args.forward_only and not _fla_trains(where):
                    rows.append([s, layout, name, "refused", "", "fla refuses its gated backward here"])
                    continue
                fn = _path(name, bounds)
                diff = _rel_diff(call(fn, tensors, grad), ref)
                peak_mib = H.call_peak_mib(lambda fn=fn: call(fn, tensors, grad), cuda=device.is_cuda)
                ms = H.median_ms(lambda fn=fn: call(fn, tensors, grad), cuda=device.is_cuda, warmup=args.warmup,
                                 reps=args.reps)
                report["results"][f"{name}@{s}/{layout}"] = {"ms": ms, "peak_mib": peak_mib, "max_rel_diff": diff}
                rows.append([s, layout, name, f"{ms:.2f}", f"{peak_mib:.0f}", f"{diff:.1e}"])
    timed = "fwd ms" if args.forward_only else "fwd+bwd ms"
    print(H.markdown_table(["tokens per row", "row", "path", timed, "peak MiB", "max rel diff vs fp32"], rows))
    if args.out:
        H.save_json(report, Path(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
