"""Gemma 3 image-text on the CUDA path (the bidirectional image blocks through SDPA with a mask in the language model,
varlen flash attention in the ViT under bf16), against transformers on the same GPU: fp32 (logits, loss, vision
gradients) and bf16 (loss); bf16 ``generate`` with the dynamic and the static cache (CUDA-graphed decode steps)."""

import pytest
import torch

from loongforge_hf.parallel.spawn import run_distributed

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

GENERATE_STEPS = 3  # NOTE: bf16 may break a near tie later on; the first steps' tokens must agree
GENERATE_BF16_ATOL = 3e-2  # NOTE: bf16 rounds to 2^-8 relative; the tiny model's logits stay below 1 (fp32, CPU)


def _run(folder: str) -> dict:
    import transformers

    import loongforge_hf as lf

    from ._vl_gemma3 import _hf_name, make_batch, vision_grads

    # NOTE: fp32 means fp32 on both sides (transformers' Conv2d would take TF32 through cuDNN)
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    batch = {k: v.cuda() for k, v in make_batch().items()}
    result = {}
    for dtype in (torch.float32, torch.bfloat16):
        ref = transformers.Gemma3ForConditionalGeneration.from_pretrained(
            folder, dtype=dtype, attn_implementation="sdpa").cuda()
        exp = ref(**batch)
        exp.loss.backward()
        model = lf.AutoModelForImageTextToText.from_pretrained(folder, dtype=dtype)
        out = model(**batch)
        out.loss.backward()
        name = "fp32" if dtype == torch.float32 else "bf16"
        result[name] = {"device": str(model.device), "loss": out.loss.item(), "ref_loss": exp.loss.item()}
        if dtype == torch.float32:
            ref_grads = {_hf_name(n): p.grad for n, p in ref.named_parameters()
                         if n.startswith(("model.vision_tower.", "model.multi_modal_projector."))}
            grads = vision_grads(model)
            valid = batch["attention_mask"].bool()
            result[name].update(logit_diff=(out.logits - exp.logits).abs()[valid].max().item(),
                                grad_diff=max((grads[n] - ref_grads[n]).abs().max().item() for n in ref_grads))
        del ref, model
    return result


def test_cuda_matches_transformers(tmp_path):
    from loongforge_hf.testing.tiny_vl import make_tiny_gemma3_vl

    folder = make_tiny_gemma3_vl(tmp_path / "src")
    [r] = run_distributed(_run, 1, str(folder), timeout=600, env={"LOONGFORGE_DEVICE": "cuda"})
    assert r["fp32"]["device"].startswith("cuda"), r
    # fp32 on the same GPU, TF32 off: summation order only
    assert r["fp32"]["logit_diff"] < 1e-3 and r["fp32"]["grad_diff"] < 1e-3, r
    assert abs(r["fp32"]["loss"] - r["fp32"]["ref_loss"]) < 1e-4, r
    assert abs(r["bf16"]["loss"] - r["bf16"]["ref_loss"]) < 3e-2, r


def _run_generate_bf16(folder: str) -> dict:
    import transformers

    import loongforge_hf as lf

    from ._vl_gemma3 import prompts

    inputs = {k: v.cuda() for k, v in prompts().items()}
    kw = dict(max_new_tokens=GENERATE_STEPS, return_dict_in_generate=True, output_scores=True, output_logits=True,
              pad_token_id=0)
    ref = transformers.Gemma3ForConditionalGeneration.from_pretrained(
        folder, dtype=torch.bfloat16, attn_implementation="sdpa").cuda().eval()
    theirs = ref.generate(**inputs, **kw)
    del ref
    model = lf.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.bfloat16)
    ours = model.generate(**inputs, **kw)
    static = model.generate(**inputs, **kw, cache_implementation="static")

    def cpu(out):
        return (out.sequences.cpu(), torch.stack(out.scores).float().cpu(), torch.stack(out.logits).float().cpu())

    return {"device": str(model.device), "graphed": (static.cache.fixed_steps, static.cache.graphed),
            "ours": cpu(ours), "static": cpu(static), "theirs": cpu(theirs)}


def test_cuda_bf16_generate_as_transformers(tmp_path):
    """Cached greedy generate in bf16 (two left-padded prompts with images, the image blocks at the prefill) against
    transformers' in bf16 on the same GPU: the first steps' tokens equal, scores and logits within 3e-2; the same
    with the static cache, its decode steps replayed from a CUDA graph."""
    from loongforge_hf.testing.tiny_vl import make_tiny_gemma3_vl

    folder = make_tiny_gemma3_vl(tmp_path / "src", seed=1)
    [r] = run_distributed(_run_generate_bf16, 1, str(folder), timeout=600, env={"LOONGFORGE_DEVICE": "cuda"})
    assert r["device"].startswith("cuda"), r
    assert r["graphed"] == (GENERATE_STEPS - 1, True), r["graphed"]
    ref_seq, ref_scores, ref_logits = r["theirs"]
    for which in ("ours", "static"):
        seq, scores, logits = r[which]
        assert torch.equal(seq, ref_seq), (which, seq, ref_seq)
        torch.testing.assert_close(scores, ref_scores, atol=GENERATE_BF16_ATOL, rtol=0, msg=lambda m: f"{which}: {m}")
        torch.testing.assert_close(logits, ref_logits, atol=GENERATE_BF16_ATOL, rtol=0, msg=lambda m: f"{which}: {m}")
