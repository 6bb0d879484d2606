"""The gated delta rule (Qwen3.5 / Qwen3-Next linear attention; ``--rule kda``: Kimi Delta Attention's per-channel
form), forward and backward, side by side on one GPU.

Paths: ``transformers`` (transformers' torch fallback: what its model runs without the fla package; it has no
document restarts), ``torch`` (``kernels.gated_delta_rule``: ours without fla, its chunk-to-chunk state pass a Triton
kernel each way; packed documents in one call, ``gated_delta_rule_packed``), ``torch-loop`` (the same
with that pass a torch loop over the chunks, ``LOONGFORGE_TRITON=0``; also the fp32 reference) and ``fla``
(``kernels.fla_delta_rule``: fla's Triton kernels, every row and document in one varlen call). bf16 inputs,
``--batch`` rows of each of ``--seq`` tokens, either one document per row or ``--docs`` equal documents packed per
row. Each path's output and gradients are checked against ``torch-loop`` in fp32 (largest difference relative to the
largest value). Time: median of ``--reps`` forward + backward calls after ``--warmup`` (CUDA events), or forwards
without gradients with ``--forward-only`` (evaluation, a prefill); memory: the peak allocated during one call beyond
its inputs. fla's row says "refused" where fla refuses its gated backward (Hopper with Triton 3.4 - 3.7.0),
"unavailable" where it does not import (or off CUDA); a path out of device memory is a row "oom", not a crash.

Rules (``--rule``):
- ``gdn`` (default): a Qwen3.5 linear-attention layer, 16 key heads and 32 value heads of 128, one log decay per value
  head ``g`` ``[b, s, 32]``; transformers' ``qwen3_5.torch_chunk_gated_delta_rule``.
- ``kda``: a Kimi-Linear-48B-A3B KDA layer (``KimiLinearConfig``'s defaults, the hub config's ``linear_attn_config``:
  32 heads, ``head_dim`` 128, key heads = value heads), a log decay per key channel ``g`` ``[b, s, 32, 128]``;
  transformers' ``kimi_linear.chunk_kimi_delta_attention`` fallback, our per-channel form (its state pass is always
  the torch loop: ``torch`` and ``torch-loop`` are the same code, so the default paths leave ``torch-loop`` out),
  fla's ``chunk_kda``.

    python scripts/bench_gated_delta_rule.py [--rule kda] [--seq 2048,4096,8192] [--docs 8] [--forward-only]
                                             [--out outputs/delta_rule.json]
    python scripts/bench_gated_delta_rule.py --device cpu --paths transformers,torch --seq 128 --reps 1
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _bench_harness as H  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Rule:
    """One form of the rule as a model's layer runs it: its heads, the decay's shape and transformers' fallback."""

    k_heads: int
    v_heads: int
    k_dim: int
    v_dim: int
    per_channel: bool       # g [b, s, v_heads, k_dim] (a decay per key channel) or [b, s, v_heads]
    fallback: str           # "module:function" of transformers' torch fallback
    paths: str              # the default --paths


RULES = {
    "gdn": Rule(16, 32, 128, 128, False, "transformers.models.qwen3_5.modeling_qwen3_5:torch_chunk_gated_delta_rule",
                "transformers,torch,torch-loop,fla"),
    "kda": Rule(32, 32, 128, 128, True, "transformers.models.kimi_linear.modeling_kimi_linear:"
                "chunk_kimi_delta_attention", "transformers,torch,fla"),
}


def _bounds(batch: int, seq: int, docs: int) -> list[list[int]]:
    """Each row's document bounds ``[0, .., seq]``."""
    cuts = [round(seq * i / docs) for i in range(docs + 1)]
    return [cuts for _ in range(batch)]


def _path(name: str, bounds: list[list[int]], rule: Rule):
    """``fn(q, k, v, g, beta) -> [b, s, v_heads, v_dim]`` of one path."""
    import torch

    if name == "transformers":
        module, function = rule.fallback.split(":")
        fallback = getattr(importlib.import_module(module), function)
        # NOTE: with fla installed transformers calls fla's kernel; its own torch code is the wrapped function
        fallback = getattr(fallback, "__wrapped__", fallback)

        def run(q, k, v, g, beta):
            if any(len(b) > 2 for b in bounds):
                raise SystemExit("--paths transformers: its torch fallback has no packed documents (use --docs 1)")
            r = rule.v_heads // rule.k_heads
            if r > 1:
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


def _fla_refusal(device, rule: Rule, *, backward: bool) -> str | None:
    """Why the fla path does not run here (None: it runs)."""
    from loongforge_hf.kernels import fla_delta_rule

    kernel = "chunk_kda" if rule.per_channel else "chunk_gated_delta_rule"
    if not fla_delta_rule.available(device, per_channel=rule.per_channel):
        return f"unavailable: fla's {kernel} needs CUDA and the fla package"
    if backward and not fla_delta_rule.available(device, backward=True, per_channel=rule.per_channel):
        return "refused: fla refuses its gated backward here"
    return None


def _inputs(batch: int, s: int, device, dtype, gen, rule: Rule):
    import torch

    q, k = (torch.randn(batch, s, rule.k_heads, rule.k_dim, generator=gen) for _ in range(2))
    v = torch.randn(batch, s, rule.v_heads, rule.v_dim, generator=gen)
    # NOTE: both models' gates: g = -exp(A_log) * softplus(a + dt_bias) (log decay <= 0; Kimi's per key channel),
    # beta = sigmoid(b)
    g_shape = (batch, s, rule.v_heads) + ((rule.k_dim,) if rule.per_channel else ())
    g = -torch.nn.functional.softplus(torch.randn(*g_shape, generator=gen)) * 0.5
    beta = torch.rand(batch, s, rule.v_heads, generator=gen)
    return [t.to(device=device, dtype=torch.float32 if t is g else dtype).requires_grad_() for t in (q, k, v, g, beta)]


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


def _measure(fn, call, tensors, grad, ref, *, device: H.Device, warmup: int, reps: int) -> dict:
    """One path's difference from the reference, peak MiB and median ms; ``{"status": "oom"}`` out of device memory."""
    try:
        return H.measure_path(lambda: call(fn, tensors, grad), ref, cuda=device.is_cuda, warmup=warmup, reps=reps)
    except Exception as exc:
        if not device.is_oom(exc):
            raise
        return {"status": "oom"}
    finally:
        for t in tensors:
            t.grad = None
        device.empty_cache()


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rule", default="gdn", choices=sorted(RULES),
                   help="gdn: Qwen3.5's decay per head; kda: Kimi Linear's decay per key channel")
    p.add_argument("--seq", default="2048,4096,8192")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--docs", type=int, default=8, help="documents per row in the packed case (1: that case is off)")
    p.add_argument("--paths", default=None, help="default: the rule's (gdn: transformers,torch,torch-loop,fla; "
                                                 "kda: transformers,torch,fla)")
    p.add_argument("--forward-only", action="store_true", help="time forwards without gradients")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a dry run (the fla path needs CUDA)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    rule = RULES[args.rule]
    paths = (args.paths or rule.paths).split(",")
    unknown = [n for n in paths if n not in ("transformers", "torch", "torch-loop", "fla")]
    if unknown:
        p.error(f"--paths: unknown path(s) {unknown} (transformers, torch, torch-loop, fla)")
    import torch

    device = H.Device(args.device)
    where, dtype = device.device, (torch.bfloat16 if device.is_cuda else torch.float32)
    rows, report = [], {"device": device.describe(), "rule": args.rule, "batch": args.batch,
                        "heads": [rule.k_heads, rule.v_heads, rule.k_dim, rule.v_dim], "results": {}}
    gen = torch.Generator().manual_seed(0)
    call = _forward if args.forward_only else _grads
    report["forward_only"] = args.forward_only
    layouts = [("1 document", 1)] + ([(f"{args.docs} documents", args.docs)] if args.docs > 1 else [])
    for s in (int(x) for x in args.seq.split(",")):
        for layout, docs in layouts:
            bounds = _bounds(args.batch, s, docs)
            names = [n for n in paths if not (n == "transformers" and docs > 1)]
            tensors = _inputs(args.batch, s, where, dtype, gen, rule)
            grad = torch.randn(args.batch, s, rule.v_heads, rule.v_dim, generator=gen).to(where, dtype)
            ref_in = [t.detach().float().requires_grad_() for t in tensors]
            try:
                ref = call(_path("torch-loop", bounds, rule), ref_in, grad.float())
            except Exception as exc:
                if not device.is_oom(exc):
                    raise
                ref = None
            del ref_in
            device.empty_cache()
            for name in names:
                refusal = _fla_refusal(where, rule, backward=not args.forward_only) if name == "fla" else None
                if ref is None or refusal:
                    why = refusal or "oom: the fp32 reference is out of device memory"
                    report["results"][f"{name}@{s}/{layout}"] = {"status": why}
                    rows.append([s, layout, name, why.split(":")[0], "", why.split(": ", 1)[-1]])
                    continue
                r = _measure(_path(name, bounds, rule), call, tensors, grad, ref, device=device,
                             warmup=args.warmup, reps=args.reps)
                report["results"][f"{name}@{s}/{layout}"] = r
                rows.append([s, layout, name, "oom", "", "out of device memory"]
                            if r.get("status") == "oom" else
                            [s, layout, name, f"{r['ms']:.2f}", f"{r['peak_mib']:.0f}", f"{r['max_rel_diff']:.1e}"])
            del ref
    timed = "fwd ms" if args.forward_only else "fwd+bwd ms"
    print(H.markdown_table(["tokens per row", "row", "path", timed, "peak MiB", "max rel diff vs fp32"], rows))
    if args.out:
        H.save_json(report, Path(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
