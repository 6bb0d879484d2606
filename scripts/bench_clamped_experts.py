"""DeepSeek-V4's / HY-V4's routed experts (clamped SwiGLU), forward and backward, side by side on one GPU.

Paths: ``hf-eager`` (transformers' ``DeepseekV4Experts``, its expert-by-expert loop over the stacked weights),
``hf-grouped_mm`` (transformers' ``experts_implementation="grouped_mm"``: one ``torch._grouped_mm`` per projection,
the clamp in its ``_apply_gate``), ``sequential`` (one weight pair per expert, a GEMM pair per expert and the clamp in
torch ops: how megatron's ``SequentialMLP`` runs them, which the bridges used before 2026-12-01) and ``grouped``
(``kernels.grouped_mlp`` on ``torch._grouped_mm`` with ``kernels.clamped_glu.ClampedGLU``, the Triton SwiGLU kernel
with the clamp on CUDA: the bridges' default since). ``sequential`` and ``grouped`` include the permutation of the
rows by expert and the weighted sum back per token (megatron's dispatcher does them at EP1). Shape: ``--experts``
experts of ``--hidden`` x ``--ffn`` (default DeepSeek-V4-Flash's 256 x 4096 x 2048, top ``--top-k`` 6,
``swiglu_limit`` 10), ``--tokens`` tokens routed by softmax scores of random logits; the weights are the same for
every path (transformers' stacks are megatron's layout; ``sequential`` holds copies). Each path's output and gradients
(input, routing weights, both stacks) are compared with ``hf-eager``'s in the same dtype (largest difference relative
to the largest value). Time: median of ``--reps`` forward + backward calls after ``--warmup`` (CUDA events); memory:
the peak allocated during one call beyond its inputs.

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

PATHS = ("hf-eager", "hf-grouped_mm", "sequential", "grouped")


def _hf_experts(args, implementation: str, device, dtype):
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Experts

    config = DeepseekV4Config(hidden_size=args.hidden, intermediate_size=args.ffn, moe_intermediate_size=args.ffn,
                              n_routed_experts=args.experts, num_local_experts=args.experts,
                              num_experts_per_tok=args.top_k, swiglu_limit=args.limit)
    config._experts_implementation = implementation
    with device:
        return DeepseekV4Experts(config).to(dtype)


def _permuted(x, indices, weights, experts: int):
    """megatron's dispatcher at EP1: the (token, slot) rows sorted by expert, their tokens, probabilities and counts."""
    import torch

    order = torch.argsort(indices.flatten(), stable=True)
    token = order // indices.shape[1]
    return x[token], token, weights.flatten()[order], torch.bincount(indices.flatten(), minlength=experts)


class _Grouped:
    """``grouped_gated_mlp`` with the clamped SwiGLU on transformers' stacks."""

    def __init__(self, module, limit: float) -> None:
        import torch.nn.functional as F

        from types import SimpleNamespace

        from loongforge_hf.kernels.clamped_glu import ClampedGLU

        self.module = module
        self.activation = ClampedGLU(SimpleNamespace(gated_linear_unit=True, activation_func=F.silu,
                                                     activation_func_clamp_value=limit, glu_linear_offset=0.0))

    def __call__(self, x, indices, weights):
        import torch

        from loongforge_hf.kernels.grouped_mlp import grouped_gated_mlp

        fc1, fc2 = self.module.gate_up_proj, self.module.down_proj
        rows, token, probs, counts = _permuted(x, indices, weights, fc1.shape[0])
        out = grouped_gated_mlp(rows, fc1, fc2, counts, probs, activation=self.activation, use_grouped_mm=True)
        return torch.zeros_like(x).index_add(0, token, out)

    def weight_grads(self):
        return [self.module.gate_up_proj.grad, self.module.down_proj.grad]


class _Sequential:
    """One weight pair per expert (copies of the stacks' rows), a GEMM pair per expert, the clamp in torch ops."""

    def __init__(self, module, limit: float) -> None:
        import torch

        self.limit = limit
        self.fc1 = [torch.nn.Parameter(w.detach().clone()) for w in module.gate_up_proj]
        self.fc2 = [torch.nn.Parameter(w.detach().clone()) for w in module.down_proj]

    def __call__(self, x, indices, weights):
        import torch
        import torch.nn.functional as F

        rows, token, probs, counts = _permuted(x, indices, weights, len(self.fc1))
        outs = []
        for e, (h, p) in enumerate(zip(rows.split(counts.tolist()), probs.split(counts.tolist()))):
            gate, up = F.linear(h, self.fc1[e]).chunk(2, dim=-1)
            act = F.silu(gate.clamp(max=self.limit)) * up.clamp(min=-self.limit, max=self.limit)
            outs.append(F.linear(act * p.unsqueeze(-1).to(act.dtype), self.fc2[e]))
        return torch.zeros_like(x).index_add(0, token, torch.cat(outs))

    def weight_grads(self):
        import torch

        return [torch.stack([w.grad if w.grad is not None else torch.zeros_like(w) for w in ws])
                for ws in (self.fc1, self.fc2)]

    def zero_grad(self):
        for w in (*self.fc1, *self.fc2):
            w.grad = None


class _HF:
    def __init__(self, module) -> None:
        self.module = module

    def __call__(self, x, indices, weights):
        return self.module(x, indices, weights)

    def weight_grads(self):
        return [self.module.gate_up_proj.grad, self.module.down_proj.grad]


def _grads(path, x, indices, weights, grad, stacks):
    for t in (x, weights, *stacks):
        t.grad = None
    if hasattr(path, "zero_grad"):
        path.zero_grad()
    out = path(x, indices, weights)
    out.backward(grad)
    return [out.detach(), x.grad, weights.grad, *path.weight_grads()]


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
    eager = _hf_experts(args, "eager", where, dtype)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # NOTE: weights as a trained model's scale, so that some fc1 entries cross the limit
        eager.gate_up_proj.copy_(torch.randn(eager.gate_up_proj.shape, generator=gen) * 2 * args.limit
                                 / args.hidden ** 0.5)
        eager.down_proj.copy_(torch.randn(eager.down_proj.shape, generator=gen) / args.ffn ** 0.5)
    runs = {"hf-eager": _HF(eager)}
    if "hf-grouped_mm" in paths:  # NOTE: the same parameters, another forward
        grouped_mm = _hf_experts(args, "grouped_mm", torch.device("meta"), dtype)
        grouped_mm.gate_up_proj, grouped_mm.down_proj = eager.gate_up_proj, eager.down_proj
        runs["hf-grouped_mm"] = _HF(grouped_mm)
    if "sequential" in paths:
        runs["sequential"] = _Sequential(eager, args.limit)
    if "grouped" in paths:
        runs["grouped"] = _Grouped(eager, args.limit)
    stacks = (eager.gate_up_proj, eager.down_proj)
    shape = {k: getattr(args, k) for k in ("hidden", "ffn", "experts", "top_k", "limit")}
    report = {"device": device.describe(), "shape": shape, "dtype": str(dtype), "results": {}}
    rows = []
    for tokens in (int(v) for v in args.tokens.split(",")):
        x = torch.randn(tokens, args.hidden, generator=gen).to(where, dtype).requires_grad_()
        logits = torch.randn(tokens, args.experts, generator=gen)
        top, indices = torch.topk(logits.softmax(-1), args.top_k, dim=-1)
        indices = indices.to(where)
        weights = (top / top.sum(-1, keepdim=True)).to(where, dtype).requires_grad_()
        grad = torch.randn(tokens, args.hidden, generator=gen).to(where, dtype)
        ref = [t.clone() for t in _grads(runs["hf-eager"], x, indices, weights, grad, stacks)]
        for path in paths:
            r = H.measure_path(lambda run=runs[path]: _grads(run, x, indices, weights, grad, stacks), ref,
                               cuda=device.is_cuda, warmup=args.warmup, reps=args.reps)
            report["results"][f"{path}@{tokens}"] = r
            rows.append([tokens, path, f"{r['ms']:.2f}", f"{r['peak_mib']:.0f}", f"{r['max_rel_diff']:.1e}"])
    print(H.markdown_table(["tokens", "path", "fwd+bwd ms", "peak MiB", "max rel diff vs hf-eager"], rows))
    if args.out:
        H.save_json(report, Path(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
