"""fla's gated delta rule through ``kernels.fla_delta_rule`` on a GPU against our torch code
(``kernels.gated_delta_rule``, fp32, each document alone): output and the q / k / v / g / beta gradients, largest
difference relative to the largest value within 2e-2 in bf16 and 5e-3 in fp32 (fla's fp32 dots run in TF32); grouped
value heads, packed documents of uneven lengths (one varlen call), a sequence across many chunks. Skipped without the
fla package (it is optional); the gradients are skipped where fla refuses its backward (Hopper with Triton 3.4 - 3.7.0,
``fla_delta_rule.available(backward=True)``), the forward is checked there too. Kimi Delta Attention's decay per key
channel (fla's ``chunk_kda``; equal key and value heads, as Kimi Linear's) the same way, its backward always."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

K_HEADS, V_HEADS, DIM = 2, 4, 64


def _inputs(seq: int, dtype, per_channel: bool = False):
    gen = torch.Generator().manual_seed(seq)
    k_heads = V_HEADS if per_channel else K_HEADS
    q, k = (torch.randn(1, seq, k_heads, DIM, generator=gen) for _ in range(2))
    v = torch.randn(1, seq, V_HEADS, DIM, generator=gen)
    g = -torch.nn.functional.softplus(torch.randn(1, seq, V_HEADS, *((DIM,) if per_channel else ()), generator=gen))
    beta = torch.rand(1, seq, V_HEADS, generator=gen)
    return [x.cuda().to(torch.float32 if x is g else dtype).requires_grad_() for x in (q, k, v, g, beta)]


def _grads(fn, tensors, grad):
    for t in tensors:
        t.grad = None
    out = fn(*tensors)
    out.backward(grad)
    return [out.detach()] + [t.grad for t in tensors]


@pytest.mark.parametrize("per_channel", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float32, 5e-3)])
@pytest.mark.parametrize("bounds", [[0, 300], [0, 17, 90, 91, 250, 400]], ids=["one", "packed"])
def test_fla_matches_the_torch_code(dtype, tol, bounds, per_channel):
    from loongforge_hf.kernels import fla_delta_rule
    from loongforge_hf.kernels.gated_delta_rule import gated_delta_rule

    if not fla_delta_rule.available(torch.device("cuda"), per_channel=per_channel):
        pytest.skip("the fla package (with chunk_kda for the per-channel case) is not installed")
    backward = fla_delta_rule.available(torch.device("cuda"), backward=True, per_channel=per_channel)
    tensors = _inputs(bounds[-1], dtype, per_channel)
    grad = torch.randn(1, bounds[-1], V_HEADS, DIM, device="cuda").to(dtype)
    cu = torch.tensor(bounds, device="cuda")

    def ours(*xs):
        return torch.cat([gated_delta_rule(*(x[:, lo:hi] for x in xs)) for lo, hi in zip(bounds, bounds[1:])], 1)

    want = _grads(ours, [t.detach().float().requires_grad_() for t in tensors], grad.float())
    fla = lambda *xs: fla_delta_rule.gated_delta_rule_varlen(*xs, cu_seqlens=cu)[0]  # noqa: E731
    if backward:
        got = _grads(fla, tensors, grad)
    else:
        with torch.no_grad():
            got = [fla(*tensors)]
    for name, a, b in zip(("out", "dq", "dk", "dv", "dg", "dbeta"), got, want):
        rel = float((a.float() - b).abs().max() / b.abs().max())
        assert rel < tol, (name, rel)
    if not backward:
        pytest.skip("forward checked; fla refuses its gated backward on this GPU / Triton (fla issue #640)")


def _fla_inference(folder: str) -> dict:
    """A Gated DeltaNet / KDA model in bf16 on the GPU without gradients: logits of a left-padded batch and greedy
    cached generate with fla's kernels counted, then with ``LOONGFORGE_DELTA_RULE=torch``, and transformers' (its
    fla path)."""
    import os

    import transformers

    import loongforge_hf as lf
    from loongforge_hf.kernels import fla_delta_rule

    calls = []
    kernel = fla_delta_rule.gated_delta_rule_varlen
    fla_delta_rule.gated_delta_rule_varlen = lambda *a, **k: calls.append(1) or kernel(*a, **k)
    ids = torch.randint(5, 200, (2, 150), generator=torch.Generator().manual_seed(0)).cuda()
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    kw = dict(max_new_tokens=6, do_sample=False, return_dict_in_generate=True)
    out = {}
    model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    for name in ("fla", "torch"):
        os.environ["LOONGFORGE_DELTA_RULE"] = "" if name == "fla" else "torch"
        with torch.no_grad():
            out[name] = (model(input_ids=ids, attention_mask=mask).logits.float().cpu(),
                         model.generate(input_ids=ids, attention_mask=mask, **kw).sequences.cpu())
        out[f"{name}_calls"] = len(calls)
    os.environ.pop("LOONGFORGE_DELTA_RULE")
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).cuda()
    with torch.no_grad():
        out["transformers"] = (ref(input_ids=ids, attention_mask=mask).logits.float().cpu(),
                               ref.generate(input_ids=ids, attention_mask=mask, **kw).sequences.cpu())
    out["real"] = mask.bool().cpu()
    return out


@pytest.mark.parametrize("arch", ["qwen3_5", "kimi_linear"])
def test_inference_takes_fla(tmp_path, arch):
    """Qwen3.5's Gated DeltaNet layers (Kimi Linear's KDA layers: ``chunk_kda``) take fla's kernels in gradient-free
    bf16 forwards (every linear layer of the forward and the prefill counted; decode steps keep the one-token
    recurrence): logits within bf16's resolution (3e-2 of the largest) of our torch code and of transformers on the
    real tokens, the same greedy tokens."""
    from loongforge_hf.kernels import fla_delta_rule
    from loongforge_hf.parallel.spawn import run_distributed
    from loongforge_hf.testing.tiny_models import make_tiny_checkpoint

    if not fla_delta_rule.available(torch.device("cuda"), per_channel=arch == "kimi_linear"):
        pytest.skip("the fla package is not installed")
    folder = make_tiny_checkpoint(tmp_path / arch, arch, tokenizer=False)
    [r] = run_distributed(_fla_inference, 1, str(folder), timeout=600, env={"LOONGFORGE_DEVICE": "cuda"})
    assert r["fla_calls"] > 0 and r["torch_calls"] == r["fla_calls"], (r["fla_calls"], r["torch_calls"])
    real = r["real"]
    for other in ("torch", "transformers"):
        got, want = r["fla"][0][real], r[other][0][real]
        assert (got - want).abs().max() <= 3e-2 * want.abs().max(), (other, (got - want).abs().max())
        assert torch.equal(r["fla"][1], r[other][1]), other
