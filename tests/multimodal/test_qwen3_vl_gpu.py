"""Qwen3-VL, Qwen3-VL-MoE and Qwen3.5 image-text on the CUDA path (varlen flash attention in the ViT under bf16, SDPA
in the language model), against transformers on the same GPU: images + videos in fp32 (logits, loss, vision
gradients, DeepStack included) and bf16 (loss); ``fp8="on"`` through ``from_pretrained`` (the ViT's linears, the
mergers' and the language model's; not Qwen3.5's); bf16 ``generate`` with the dynamic and the static cache
(CUDA-graphed decode steps)."""

import pytest
import torch

from loongforge_hf.parallel.spawn import run_distributed

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _run(folder: str, fp8: bool = True) -> dict:
    import transformers

    import loongforge_hf as lf

    from ._vl_parity import vision_grads
    from ._vl_features import collator, hand_features

    # NOTE: fp32 means fp32 on both sides (transformers' Conv3d would take TF32 through cuDNN)
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    batch = {k: v.cuda() for k, v in collator(folder, pad_to_multiple_of=4)(hand_features(folder)).items()}
    result = {}
    for dtype in (torch.float32, torch.bfloat16):
        ref = transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=dtype,
                                                                       attn_implementation="sdpa").cuda()
        exp = ref(**batch)
        exp.loss.backward()
        model = lf.AutoModelForImageTextToText.from_pretrained(folder, dtype=dtype)
        out = model(**batch)
        out.loss.backward()
        name = "fp32" if dtype == torch.float32 else "bf16"
        result[name] = {"device": str(model.device), "loss": out.loss.item(), "ref_loss": exp.loss.item()}
        if dtype == torch.float32:
            ref_grads = {n[len("model.visual."):]: p.grad for n, p in ref.named_parameters()
                         if n.startswith("model.visual.")}
            grads = vision_grads(model)
            valid = batch["attention_mask"].bool()
            result[name].update(logit_diff=(out.logits - exp.logits).abs()[valid].max().item(),
                                grad_diff=max((grads[n] - ref_grads[n]).abs().max().item() for n in ref_grads))
        else:
            bf16_loss = out.loss.item()
        del ref, model
    if not fp8:
        return result
    # NOTE: the tiny model's widths are multiples of 16, not of 128: row-wise scaling
    model = lf.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.bfloat16, fp8="on",
                                                           fp8_recipe="rowwise")
    out = model(**batch)
    out.loss.backward()
    result["fp8"] = {"loss": out.loss.item(), "bf16_loss": bf16_loss, "swapped": model.megatron.fp8.swapped,
                     "grads_ok": all(p.grad is not None and bool(torch.isfinite(p.grad).all())
                                     for p in model.vision_tower.parameters())}
    return result


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_cuda_images_videos_and_fp8_match(tmp_path, moe):
    """Qwen3-VL, and Qwen3-VL-MoE with the hub's expert layout (grouped experts on the GPU)."""
    from loongforge_hf.testing.tiny_vl import make_tiny_qwen3_vl, make_tiny_qwen3_vl_moe

    folder = make_tiny_qwen3_vl_moe(tmp_path / "src", hub_expert_layout=True) if moe \
        else make_tiny_qwen3_vl(tmp_path / "src")
    [r] = run_distributed(_run, 1, str(folder), timeout=600, env={"LOONGFORGE_DEVICE": "cuda"})
    assert r["fp32"]["device"].startswith("cuda"), r
    # fp32 on the same GPU, TF32 off: summation order only
    assert r["fp32"]["logit_diff"] < 1e-3 and r["fp32"]["grad_diff"] < 1e-3, r
    assert abs(r["fp32"]["loss"] - r["fp32"]["ref_loss"]) < 1e-4, r
    # bf16: flash varlen in the ViT vs transformers' kernels, bf16 rounding throughout
    assert abs(r["bf16"]["loss"] - r["bf16"]["ref_loss"]) < 3e-2, r
    fp8 = r["fp8"]
    assert fp8["grads_ok"], fp8
    assert {"vision.0.merger.linear_fc1", "vision.0.deepstack_merger_list.0.linear_fc2",
            "vision.0.blocks.0.mlp.linear_fc1"} <= set(fp8["swapped"]), fp8
    assert abs(fp8["loss"] - fp8["bf16_loss"]) < 0.03 * abs(fp8["bf16_loss"]), fp8


def test_cuda_qwen3_5_images_videos_match(tmp_path):
    """Qwen3.5 image-text (Gated DeltaNet layers beside the gated full-attention one, no DeepStack): images + videos
    in fp32 (logits, loss, vision gradients) and bf16 (loss) against transformers on the same GPU."""
    from loongforge_hf.testing.tiny_vl import make_tiny_qwen3_5_vl

    folder = make_tiny_qwen3_5_vl(tmp_path / "src")
    [r] = run_distributed(_run, 1, str(folder), False, timeout=600, env={"LOONGFORGE_DEVICE": "cuda"})
    assert r["fp32"]["device"].startswith("cuda"), r
    assert r["fp32"]["logit_diff"] < 1e-3 and r["fp32"]["grad_diff"] < 1e-3, r
    assert abs(r["fp32"]["loss"] - r["fp32"]["ref_loss"]) < 1e-4, r
    assert abs(r["bf16"]["loss"] - r["bf16"]["ref_loss"]) < 3e-2, r


def test_cuda_bf16_generate_as_transformers(tmp_path):
    """Cached greedy generate in bf16 on one GPU against transformers' in bf16 on the same GPU: the first steps'
    tokens equal, scores and logits within 3e-2; the same with the static cache, its decode steps (interleaved 3-D
    rope positions) replayed from a CUDA graph."""
    from loongforge_hf.testing.tiny_vl import make_tiny_qwen3_vl

    from .test_qwen2_5_vl_gpu import _run_generate_bf16, check_generate_bf16

    folder = make_tiny_qwen3_vl(tmp_path / "src", seed=1)
    check_generate_bf16(run_distributed(_run_generate_bf16, 1, str(folder), timeout=600,
                                        env={"LOONGFORGE_DEVICE": "cuda"})[0])
