"""DeepSeek-V4's / HY-V4's routed experts (clamped SwiGLU), forward and backward, side by side on one GPU.

Paths: ``hf-eager`` (transformers' ``DeepseekV4Experts``, its expert-by-expert loop), ``hf-grouped_mm``
(transformers' ``experts_implementation="grouped_mm"``: one ``torch._grouped_mm`` per projection, the clamp in its
``_apply_gate``), ``loop`` (``kernels.grouped_mlp`` one GEMM pair per expert: how megatron's ``SequentialMLP`` runs
the experts, which the bridges used before 2026-12-01) and ``grouped`` (``kernels.grouped_mlp`` on
``torch._grouped_mm`` with ``kernels.clamped_glu.ClampedGLU``: the bridges' default since). Ours include the
permutation of the rows by expert and the weighted sum back per token (megatron's dispatcher does them at EP1).
Shape: ``--experts`` experts of ``--hidden`` x ``--ffn`` (default DeepSeek-V4-Flash's 256 x 4096 x 2048, top
``--top-k`` 6, ``swiglu_limit`` 10), ``--tokens`` tokens routed by softmax scores of random logits; the weights are
shared by every path (transformers' stacks are megatron's layout). Each path's output and gradients (input, routing
weights, both stacks) are compared with ``hf-eager``'s in the same dtype (largest difference relative to the
largest value). Time: median of ``--reps`` forward + backward calls after ``--warmup`` (CUDA events); memory: the
peak allocated during one call beyond its inputs.

    python scripts/bench_clamped_experts.py [--tokens 4096,8192] [--out outputs/clamped_experts.json]
    python scripts/bench_clamped_experts.py --device cpu --tiny --reps 1
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _bench_harness as H  # noqa: E402
from bench_sink_attention import _rel_diff  # noqa: E402

PATHS = ("hf-eager", "hf-grouped_mm", "loop", "grouped")


def _hf_experts(args, implementation: str, device, dtype):
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Experts

    config = DeepseekV4Config(hidden_size=args.hidden, intermediate_size=args.ffn, moe_intermediate_size=args.ffn,
                              n_routed_experts=args.experts, num_local_experts=args.experts,
                              num_experts_per_tok=args.top_k, swiglu_limit=args.limit)
    config._experts_implementation = implementation
    with device:
        return DeepseekV4Experts(config).to(dtype)


def _ours(use_grouped_mm: bool, limit: float):
    """Permute the (token, slot) rows by expert, ``grouped_gated_mlp`` with the clamped SwiGLU, sum back per token."""
    import torch
    import torch.nn.functional as F

    from types import SimpleNamespace

    from loongforge_hf.kernels.clamped_glu import ClampedGLU
    from loongforge_hf.kernels.grouped_mlp import grouped_gated_mlp

    activation = ClampedGLU(SimpleNamespace(gated_linear_unit=True, activation_func=F.silu,
                                            activation_func_clamp_value=limit, glu_linear_offset=0.0))

    def run(module, x, indices, weights):
        flat = indices.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=module.gate_up_proj.shape[0])
        token = order // indices.shape[1]
        rows = grouped_gated_mlp(x[token], module.gate_up_proj, module.down_proj, counts, weights.flatten()[order],
                                 activation=activation, use_grouped_mm=use_grouped_mm)
        return torch.zeros_like(x).index_add(0, token, rows)

    return run


def _call(path: str, modules: dict, limit: float):
    if path.startswith("hf-"):
        module = modules[path]
        return lambda x, indices, weights: module(x, indices, weights)
    run = _ours(path == "grouped", limit)
    return lambda x, indices, weights: run(modules["hf-eager"], x, indices, weights)


def _grads(fn, module, x, indices, weights, grad):
    for t in (x, weights, module.gate_up_proj, module.down_proj):
        t.grad = None
    out = fn(x, indices, weights)
    out.backward(grad)
    return [out.detach(), x.grad, weights.grad, module.gate_up_proj.grad, module.down_proj.grad]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", default="4096,8192")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=2048)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--top-k", type=int, default=6)
    p.add_argument("--limit", type=float, default=10.0)
    p.add_argument("--paths", default=",".join(PATHS))
    H.add_micro_args(p, name="clamped_experts", warmup=2, reps=5)
    args = p.parse_args(argv)
    if args.tiny:
        args.tokens, args.hidden, args.ffn, args.experts, args.top_k, args.limit = "64,100", 32, 16, 8, 2, 1.0
    import torch

    paths = args.paths.split(",")
    if any(path not in PATHS for path in paths):
        raise SystemExit(f"--paths: unknown path in {paths} ({', '.join(PATHS)})")
    device = H.Device(args.device)
    where, dtype = device.device, (torch.bfloat16 if device.is_cuda else torch.float32)
    if "grouped" in paths and not hasattr(torch, "_grouped_mm"):
        raise SystemExit("the grouped path needs torch._grouped_mm (torch >= 2.8)")
    modules = {"hf-eager": _hf_experts(args, "eager", where, dtype)}
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # NOTE: weights as a trained model's scale, so that some fc1 entries cross the limit
        modules["hf-eager"].gate_up_proj.copy_(torch.randn(modules["hf-eager"].gate_up_proj.shape, generator=gen)
                                               * 2 * args.limit / args.hidden ** 0.5)
        modules["hf-eager"].down_proj.copy_(torch.randn(modules["hf-eager"].down_proj.shape, generator=gen)
                                            / args.ffn ** 0.5)
    if "hf-grouped_mm" in paths:  # NOTE: the same parameters, another forward
        modules["hf-grouped_mm"] = _hf_experts(args, "grouped_mm", torch.device("meta"), dtype)
        modules["hf-grouped_mm"].gate_up_proj = modules["hf-eager"].gate_up_proj
        modules["hf-grouped_mm"].down_proj = modules["hf-eager"].down_proj
    report = {"device": device.describe(), "shape": {k: getattr(args, k) for k in ("hidden", "ffn", "experts",
                                                                                     "top_k", "limit")},
              "dtype": str(dtype), "results": {}}
    rows = []
    for tokens in (int(v) for v in args.tokens.split(",")):
        x = torch.randn(tokens, args.hidden, generator=gen).to(where, dtype).requires_grad_()
        logits = torch.randn(tokens, args.experts, generator=gen)
        top, indices = torch.topk(logits.softmax(-1), args.top_k, dim=-1)
        indices = indices.to(where)
        weights = (top / top.sum(-1, keepdim=True)).to(where, dtype).requires_grad_()
        grad = torch.randn(tokens, args.hidden, generator=gen).to(where, dtype)
        ref = [t.clone() for t in _grads(_call("hf-eager", modules, args.limit), modules["hf-eager"], x, indices,
                                         weights, grad)]
        for path in paths:
            fn = _call(path, modules, args.limit)

            def step(fn=fn):
                return _grads(fn, modules["hf-eager"], x, indices, weights, grad)

            diff = _rel_diff(step(), ref)
            peak_mib = H.call_peak_mib(step, cuda=device.is_cuda)
            ms = H.median_ms(step, cuda=device.is_cuda, warmup=args.warmup, reps=args.reps)
            report["results"][f"{path}@{tokens}"] = {"ms": ms, "peak_mib": peak_mib, "max_rel_diff": diff}
            rows.append([tokens, path, f"{ms:.2f}", f"{peak_mib:.0f}", f"{diff:.1e}"])
    print(H.markdown_table(["tokens", "path", "fwd+bwd ms", "peak MiB", "max rel diff vs hf-eager"], rows))
    if args.out:
        H.save_json(report, Path(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
