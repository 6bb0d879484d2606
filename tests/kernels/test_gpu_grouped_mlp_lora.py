"""LoRA on the routed experts through ``torch._grouped_mm`` on CUDA (bf16): the grouped path against the per-expert
loop and against fp32 on the CPU, forward and the gradients of x, A and B; the grouped GEMMs its backward runs (none
for the frozen expert stacks); the path choice (the adapters' rank must be 16-byte aligned too); and a tiny
Qwen3-MoE with PEFT's "all-linear" LoRA taking the grouped path with the loop path's logits and gradients.

Tolerances:
- grouped vs the bf16 loop, elementwise: atol = rtol = 3e-2 (both accumulate in fp32 and round to bf16 at the same
  points, the low-rank product ``t @ A.T`` included; as ``test_gpu_grouped_mlp.py``).
- both vs fp32 on the CPU (same bf16-valued operands): ``||a - ref|| / ||ref|| < 1e-2`` per tensor and, for the
  adapter gradients, per expert that received tokens (``test_gpu_grouped_mlp.py`` says why not elementwise).
- the model (bf16, grouped vs loop): logits, loss and every adapter gradient ``||a - b|| / ||b|| < 1e-2``. The model
  has one dense and one MoE layer, so the routing cannot differ between the two paths (it is computed before any
  expert ran); only the experts' rounding does.
Measured on an H100 (torch 2.11, cu130): grouped and loop equal bit for bit, in the kernel cases and the model; both
5e-3 to 7e-3 from fp32. The bounds leave room for GEMM back ends that sum in another order.
"""

import pytest
import torch

import loongforge_hf.kernels.grouped_mlp as grouped_module
from loongforge_hf.kernels.grouped_mlp import LowRank, grouped_gated_mlp, grouped_mm_supported
from loongforge_hf.parallel.spawn import run_distributed

from ._op_count import GroupedMmCount

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no _grouped_mm")]

ATOL, RTOL = 3e-2, 3e-2   # grouped vs the bf16 loop, elementwise
NORM_RTOL = 1e-2          # bf16 vs fp32, and the model's two paths: ||a - ref|| / ||ref||


def _norm_rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.float() - ref.float()).norm() / ref.float().norm()).item()


def _operands(counts, hidden, ffn, r, which, seed=0):
    """x, fc1, fc2, probs, the output gradient and (A, B) per adapted projection, all fp32 on the CPU."""
    g = torch.Generator().manual_seed(seed)
    t, e = sum(counts), len(counts)
    ops = [torch.randn(t, hidden, generator=g), torch.randn(e, 2 * ffn, hidden, generator=g) / hidden ** 0.5,
           torch.randn(e, hidden, ffn, generator=g) / ffn ** 0.5, torch.rand(t, generator=g),
           torch.randn(t, hidden, generator=g)]
    factors = [(torch.randn(e, r, inp, generator=g) / inp ** 0.5, torch.randn(e, out, r, generator=g) / r ** 0.5)
               if name in which else None
               for name, out, inp in (("fc1", 2 * ffn, hidden), ("fc2", hidden, ffn))]
    return ops, factors


def _run(device, dtype, operands, counts, use_grouped_mm):
    """Output and the gradients of x and each adapter's A and B (the expert stacks frozen, as under LoRA)."""
    (x, fc1, fc2, probs, grad), factors = ([o.to(device) for o in operands[0]], operands[1])
    x = x.to(dtype).requires_grad_()
    fc1, fc2 = fc1.to(dtype), fc2.to(dtype)
    adapters = tuple(None if f is None else LowRank(f[0].to(device, dtype).requires_grad_(),
                                                    f[1].to(device, dtype).requires_grad_(), s)
                     for f, s in zip(factors, (2.0, 0.5)))
    out = grouped_gated_mlp(x, fc1, fc2, torch.tensor(counts, device=device), probs, adapters=adapters,
                            use_grouped_mm=use_grouped_mm)
    out.backward(grad.to(dtype))
    leaves = [x, *(t for a in adapters if a is not None for t in (a.A, a.B))]
    return [t.float().cpu() for t in (out.detach(), *(leaf.grad for leaf in leaves))]


CASES = [([37, 0, 129, 5, 0, 64, 1, 20], 256, 96, 16), ([0] * 3 + [300], 128, 64, 8), ([11] * 16, 64, 32, 32)]


@pytest.mark.parametrize("which", ["fc1", "fc2", "fc1+fc2"])
@pytest.mark.parametrize("counts,hidden,ffn,r", CASES, ids=["odd-with-empty", "one-busy-expert", "even"])
def test_lora_grouped_mm_matches_loop_and_fp32(counts, hidden, ffn, r, which):
    operands = _operands(counts, hidden, ffn, r, which)
    grouped = _run("cuda", torch.bfloat16, operands, counts, None)
    loop = _run("cuda", torch.bfloat16, operands, counts, False)
    bf16_valued = ([o.to(torch.bfloat16).float() if i < 3 else o for i, o in enumerate(operands[0])],
                   [None if f is None else tuple(t.to(torch.bfloat16).float() for t in f) for f in operands[1]])
    ref = _run("cpu", torch.float32, bf16_valued, counts, False)
    names = ["out", "d_x"] + [f"d{f}_{p}" for p in ("fc1", "fc2") if p in which for f in "AB"]
    for i, (name, a, b, c) in enumerate(zip(names, grouped, loop, ref)):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL, msg=lambda m, n=name: f"{n} vs loop: {m}")
        for path, t in (("grouped", a), ("loop", b)):
            err = _norm_rel(t, c)
            assert err < NORM_RTOL, f"{name} ({path}) vs fp32: {err:.2e}"
            if i >= 2:  # adapter gradients: each expert that got tokens on its own
                for e, n in enumerate(counts):
                    if n:
                        err = _norm_rel(t[e], c[e])
                        assert err < NORM_RTOL, f"{name}[expert {e}] ({path}) vs fp32: {err:.2e}"
    for g in grouped[2:]:  # an expert without tokens: a zero adapter gradient
        for e, n in enumerate(counts):
            if n == 0:
                assert torch.count_nonzero(g[e]) == 0


def test_lora_path_choice_and_no_gradient_of_frozen_experts():
    """Grouped by default for bf16 with aligned ranks: 6 grouped GEMMs forward (3 per adapted projection), 10
    backward (per projection 1 for the frozen stack, its input's gradient only, and 2 for each of A and B); the
    loop for fp32 adapters. A rank that is not 16-byte aligned (r=4 in bf16) is padded, still grouped, and gives the
    loop's result."""
    counts = [3, 0, 5, 8]
    (x, fc1, fc2, probs, grad), factors = _operands(counts, 64, 32, 8, "fc1+fc2")
    x = x.cuda().bfloat16().requires_grad_()
    fc1, fc2 = fc1.cuda().bfloat16(), fc2.cuda().bfloat16()
    adapters = tuple(LowRank(a.cuda().bfloat16().requires_grad_(), b.cuda().bfloat16().requires_grad_(), 1.0)
                     for a, b in factors)
    assert grouped_mm_supported(x, fc1, fc2, adapters=adapters)
    with GroupedMmCount() as forward:
        out = grouped_gated_mlp(x, fc1, fc2, torch.tensor(counts, device="cuda"), probs.cuda(), adapters=adapters)
    with GroupedMmCount() as backward:
        out.backward(grad.cuda().bfloat16())
    assert (forward.calls, backward.calls) == (6, 10)
    assert all(a.A.grad is not None and a.B.grad is not None for a in adapters) and x.grad is not None

    narrow = LowRank(adapters[1].A[:, :4].detach(), adapters[1].B[:, :, :4].detach(), 1.0)
    assert grouped_mm_supported(x, fc1, fc2, adapters=(adapters[0], narrow))
    args = (x.detach(), fc1, fc2, torch.tensor(counts, device="cuda"), probs.cuda())
    padded = grouped_gated_mlp(*args, adapters=(adapters[0], narrow)).float()
    loop = grouped_gated_mlp(*args, adapters=(adapters[0], narrow), use_grouped_mm=False).float()
    assert (padded - loop).norm() <= 1e-2 * loop.norm()
    assert grouped_mm_supported(x, fc1, fc2, adapters=(adapters[0], None))
    wide = tuple(LowRank(a.A.detach().float(), a.B.detach().float(), 1.0) for a in adapters)
    assert not grouped_mm_supported(x, fc1, fc2, adapters=wide)  # fp32 adapters


def _model_paths(folder: str, rank: int) -> dict:
    """A bf16 Qwen3-MoE with "all-linear" LoRA on this GPU: logits, loss and adapter gradients on the default path
    (recording which expert path ran) and on the loop (``grouped_mm_supported`` answering False)."""
    import peft

    import loongforge_hf as lf
    from loongforge_hf.lora import get_peft_model
    from loongforge_hf.lora.experts import LoraGroupedMLP

    torch.manual_seed(5)
    model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    model = get_peft_model(model, peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear",
                                                  init_lora_weights=False))
    experts = [m for m in model.modules() if isinstance(m, LoraGroupedMLP)]
    ids = torch.randint(4, 203, (2, 24), generator=torch.Generator().manual_seed(1)).to(model.device)
    real = {name: getattr(grouped_module, name) for name in ("_grouped", "expert_loop", "grouped_mm_supported")}
    calls = {"grouped": [], "loop": 0}

    def grouped(*args, **kwargs):
        calls["grouped"].append([a is not None for a in args[5]])
        return real["_grouped"](*args, **kwargs)

    def loop(*args, **kwargs):
        calls["loop"] += 1
        return real["expert_loop"](*args, **kwargs)

    def step():
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.requires_grad}
        return out.logits.detach().float(), out.loss.detach().float(), grads

    grouped_module._grouped, grouped_module.expert_loop = grouped, loop
    try:
        logits, loss, grads = step()
        default_calls = {"grouped": calls["grouped"], "loop": calls["loop"]}
        calls.update(grouped=[], loop=0)
        grouped_module.grouped_mm_supported = lambda *a, **k: False
        ref_logits, ref_loss, ref_grads = step()
    finally:
        for name, fn in real.items():
            setattr(grouped_module, name, fn)
    stacks = [w for m in experts for w in (m.linear_fc1.weight, m.linear_fc2.weight)]
    # NOTE: plain values back to the parent (tensors would travel through file descriptors of an exited child)
    return {"device": str(model.device), "adapted_stacks": [sorted(m.lora) for m in experts],
            "experts_frozen": all(not w.requires_grad and w.grad is None for w in stacks),
            "default_calls": default_calls, "forced_loop_calls": dict(calls),
            "logits": _norm_rel(logits, ref_logits), "loss": abs(loss - ref_loss).item() / ref_loss.abs().item(),
            "grads": {n: _norm_rel(g, ref_grads[n]) for n, g in grads.items()},
            "expert_adapter_grads": sum(".experts.lora." in n for n in grads)}


def test_qwen3_moe_all_linear_lora_takes_grouped_path(tmp_path):
    """PEFT's "all-linear" at r=8 (gate_up_proj r=16): both expert stacks adapted, the MoE layer runs ``_grouped``
    with both adapters (no loop), the frozen stacks get no gradient; logits, loss and every adapter gradient as on
    the loop path."""
    from loongforge_hf.testing import make_tiny_checkpoint

    folder = make_tiny_checkpoint(tmp_path / "moe", "qwen3_moe", tokenizer=False, num_hidden_layers=2)
    [r] = run_distributed(_model_paths, 1, str(folder), 8, timeout=300, env={"LOONGFORGE_DEVICE": "cuda"})
    assert r["device"].startswith("cuda"), r
    assert r["adapted_stacks"] == [["down_proj", "gate_up_proj"]], r
    assert r["default_calls"] == {"grouped": [[True, True]], "loop": 0}, r
    assert r["forced_loop_calls"] == {"grouped": [], "loop": 1}, r
    assert r["experts_frozen"] and r["expert_adapter_grads"] == 4, r
    assert r["logits"] < NORM_RTOL and r["loss"] < NORM_RTOL, r
    bad = {n: e for n, e in r["grads"].items() if not e < NORM_RTOL}
    assert not bad, bad
