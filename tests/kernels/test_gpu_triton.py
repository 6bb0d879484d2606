"""The Triton kernels on the GPU against their torch paths on the same GPU (``_triton_checks.py``: RMSNorm incl. a
strided q/k-norm view, SwiGLU, RoPE, the linear cross-entropy chunk kernel; odd and training-sized shapes; fp32, bf16
and fp16 with the tolerances stated there), and the fused linear cross-entropy against cross-entropy on fp32
materialised logits (bf16 2e-2, fp32 1e-4: TF32 may be on for fp32 matmuls), with and without an LM head bias (Phi's:
its gradient too)."""

import pytest
import torch

from ._triton_checks import check_all

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_triton_kernels_match_torch_paths_on_cuda():
    import loongforge_hf.kernels._triton as switch

    assert switch.use_triton(torch.empty(1, device="cuda")), "triton is not importable on this GPU machine"
    checked = check_all("cuda", big=True)
    # NOTE: per dtype: 6 norm shapes x 3, 4 GLU shapes x (SwiGLU + 3 clamped), 3 rope, 5 loss cases, 2 with an
    # adapter's low-rank term, 1 token stats
    assert len(checked) == 3 * (6 * 3 + 4 * 4 + 3 + 5 + 2 + 1)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float32, 1e-4)])
def test_linear_cross_entropy_matches_materialised_logits_on_cuda(dtype, tol, bias):
    from loongforge_hf.kernels.cross_entropy import linear_cross_entropy

    g = torch.Generator().manual_seed(0)
    n, h, v, v_real = 1000, 256, 5120, 5003
    hidden = torch.randn(n, h, generator=g).to(dtype).cuda()
    weight = (torch.randn(v, h, generator=g) * 0.05).to(dtype).cuda()
    head_bias = torch.randn(v, generator=g).to(dtype).cuda() if bias else None
    labels = torch.randint(0, v_real, (n,), generator=g).cuda()
    labels[::7] = -100
    a, b = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    c = head_bias.clone().requires_grad_() if bias else None
    loss = linear_cross_entropy(a, b, labels, vocab_size=v_real, bias=c)
    loss.backward()
    a2, b2 = hidden.float().requires_grad_(), weight.float().requires_grad_()
    c2 = head_bias.float().requires_grad_() if bias else None
    logits = a2 @ b2.t() + c2 if bias else a2 @ b2.t()
    ref = torch.nn.functional.cross_entropy(logits[:, :v_real], labels, ignore_index=-100, reduction="sum")
    ref.backward()
    torch.testing.assert_close(loss.float(), ref, atol=tol * n, rtol=tol)
    torch.testing.assert_close(a.grad.float(), a2.grad, atol=tol, rtol=tol)
    torch.testing.assert_close(b.grad.float(), b2.grad, atol=tol, rtol=tol)
    if bias:  # NOTE: a sum over the tokens: bf16's tolerance times sqrt(n)
        torch.testing.assert_close(c.grad.float(), c2.grad, atol=tol * n ** 0.5, rtol=tol)


def _train_kernels_on_and_off(folder: str, out_dir: str) -> dict:
    import transformers

    import loongforge_hf as lf
    from loongforge_hf.kernels._triton import triton_paths
    from loongforge_hf.trainer.engine import MegatronEngine

    args = transformers.TrainingArguments(output_dir=out_dir, learning_rate=1e-3, weight_decay=0.0, max_grad_norm=1.0,
                                          report_to=[])
    ids = torch.randint(4, 200, (2, 64), generator=torch.Generator().manual_seed(3))  # tiny vocabularies: 203
    out = {}
    for on in (True, False):
        with triton_paths(on):
            model = lf.AutoModelForCausalLM.from_pretrained(folder, tensor_parallel_size=1, dtype=torch.bfloat16)
            engine = MegatronEngine(model, args=args, fused_loss=on, fused_adam=on, fused_wgrad=on)
            batch = {"input_ids": ids.to(model.device), "labels": ids.to(model.device)}
            out[on] = [engine.train_step([batch]).loss for _ in range(6)]
            out[f"rope_fusion_{on}"] = bool(model.megatron.config.apply_rope_fusion)
    return {"on": out[True], "off": out[False], "rope_fusion": out["rope_fusion_True"]}


@pytest.mark.parametrize("arch,overrides", [("qwen3", {"tie_word_embeddings": True}), ("llama3", {})])
def test_training_with_all_kernels_on_matches_all_off_in_bf16(tmp_path, arch, overrides):
    """Six bf16 steps on one batch of a tiny model: Triton kernels, fused loss, fused AdamW and the fused weight-grad
    accumulation on vs. all off (torch paths, materialised logits, foreach AdamW, DDP's main_grad add). bf16 rounds
    differently on the two paths, so losses agree within 2e-2 relative, not exactly; both must train."""
    from loongforge_hf.parallel.spawn import run_distributed
    from loongforge_hf.testing.tiny_models import make_tiny_checkpoint

    folder = make_tiny_checkpoint(tmp_path / arch, arch, tokenizer=False, **overrides)
    [r] = run_distributed(_train_kernels_on_and_off, 1, str(folder), str(tmp_path / "out"), timeout=600,
                          env={"LOONGFORGE_DEVICE": "cuda"})
    assert r["rope_fusion"], r
    torch.testing.assert_close(torch.tensor(r["on"]), torch.tensor(r["off"]), atol=0.0, rtol=2e-2,
                               msg=lambda m: f"kernels on vs off: {r}\n{m}")
    assert r["on"][-1] < r["on"][0] and r["off"][-1] < r["off"][0], r
