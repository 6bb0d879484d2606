"""Gemma 3, Mistral 3, Qwen2-VL, InternVL, LLaVA-1.5, LLaVA-NeXT (-Video), SmolVLM and Llama 4 image-text on the
CUDA path (Gemma 3's bidirectional image blocks through SDPA with a mask in the language model, varlen flash
attention in the ViTs under bf16), against transformers on the same GPU: fp32 (logits, loss, vision gradients) and
bf16 (loss); bf16 ``generate`` with the dynamic and the static cache (CUDA-graphed decode steps)."""

import functools

import pytest
import torch

from loongforge_hf.parallel.spawn import run_distributed

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def gemma3_batch(folder: str) -> dict:
    from ._vl_gemma3 import make_batch

    return make_batch()


def mistral3_batch(folder: str) -> dict:
    from ._vl_mistral3 import make_batch

    return make_batch()


def internvl_batch(folder: str) -> dict:
    from ._vl_internvl import make_batch

    return make_batch()


def llava_batch(folder: str) -> dict:
    from ._vl_llava import make_batch

    return make_batch()


def llava_next_batch(folder: str) -> dict:
    from ._vl_llava_next import make_batch

    return make_batch(folder)


def llava_next_video_batch(folder: str) -> dict:
    from ._vl_llava_next_video import make_batch

    return make_batch(folder)


def smolvlm_batch(folder: str) -> dict:
    from ._vl_idefics3 import make_batch

    return make_batch()


def llama4_batch(folder: str) -> dict:
    from ._vl_llama4 import make_batch  # NOTE: its import lets transformers' Llama 4 forward run (_vl_llama4.py)

    return make_batch()


def paligemma_batch(folder: str) -> dict:
    from ._vl_paligemma import make_batch

    return make_batch()


def aya_vision_batch(folder: str) -> dict:
    from ._vl_aya_vision import make_batch

    return make_batch()


def aria_batch(folder: str) -> dict:
    from ._vl_aria import make_batch

    return make_batch()


def processor_batch(folder: str) -> dict:
    from ._vl_parity import make_batch

    return make_batch(folder)


def _run(folder: str, batch_for=gemma3_batch, attention: str = "sdpa") -> dict:
    """fp32 (logits, loss, vision gradients) and bf16 (loss) on the GPU against transformers' there (its
    ``attention`` implementation)."""
    import transformers

    import loongforge_hf as lf

    from ._vl_gemma3 import VISION_TREES, _hf_name, vision_grads

    # NOTE: fp32 means fp32 on both sides (transformers' convolutions would take TF32 through cuDNN)
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    batch = {k: v.cuda() for k, v in batch_for(folder).items()}
    result = {}
    for dtype in (torch.float32, torch.bfloat16):
        ref = transformers.AutoModelForImageTextToText.from_pretrained(
            folder, dtype=dtype, attn_implementation=attention).cuda()
        # NOTE: pixels in the model's dtype, as a processor's output `.to(model.dtype)` (transformers' Llama 4
        # does not cast them itself)
        inputs = {k: v.to(dtype) if k.startswith("pixel_values") else v for k, v in batch.items()}
        exp = ref(**inputs)
        exp.loss.backward()
        model = lf.AutoModelForImageTextToText.from_pretrained(folder, dtype=dtype)
        out = model(**inputs)
        out.loss.backward()
        name = "fp32" if dtype == torch.float32 else "bf16"
        result[name] = {"device": str(model.device), "loss": out.loss.item(), "ref_loss": exp.loss.item()}
        if dtype == torch.float32:
            ref_grads = {_hf_name(n): p.grad for n, p in ref.named_parameters()
                         if n.startswith((*VISION_TREES, "model.visual.")) and p.grad is not None}
            assert ref_grads, "no vision gradients in transformers' model: its tower's prefix is not listed"
            grads = vision_grads(model)
            valid = batch["attention_mask"].bool()
            result[name].update(logit_diff=(out.logits - exp.logits).abs()[valid].max().item(),
                                grad_diff=max((grads[n] - ref_grads[n]).abs().max().item() for n in ref_grads))
        del ref, model
    return result


@pytest.mark.parametrize("model", ["gemma3", "mistral3", "qwen2_vl", "internvl", "llava", "llava_next",
                                   "llava_next_video", "smolvlm", "llama4", "glm4v", "paligemma2",
                                   "aya_vision", "aria"])
def test_cuda_matches_transformers(tmp_path, model):
    """Gemma 3 (the image blocks), Mistral 3 (images of three sizes), Qwen2-VL (the processor's batch), InternVL
    (InternViT tiles, pixel shuffle), LLaVA-1.5 (CLIP, the penultimate layer), LLaVA-NeXT (any-resolution crops of
    three pictures, unpadded, ``image_newline``), LLaVA-NeXT-Video (videos' pooled frames beside pictures),
    SmolVLM (SigLIP, the connector's pixel shuffle), Llama 4 (its ViT's complex-pair rope, pixel shuffle, the MoE
    decoder) and GLM-4.1V (the processor's batch: the bicubic position grid, the downsample, the sectioned pair
    mrope) and PaliGemma 2 (the prefix block past the sliding window, soft-capping) and Aya Vision (SigLIP read at
    a feature layer, the SwiGLU projector's pixel shuffle, Cohere 2's sliding and no-rope layers) and Aria (tiles
    padded by ``pixel_mask``, the cross-attention projector, the MoE decoder)."""
    from loongforge_hf.testing import (tiny_aria_vl, tiny_aya_vision, tiny_glm4v, tiny_idefics3, tiny_internvl,
                                       tiny_llama4_vl, tiny_llava, tiny_llava_next, tiny_llava_next_video,
                                       tiny_paligemma, tiny_vl)

    writer, batch_for = {"gemma3": (tiny_vl.make_tiny_gemma3_vl, gemma3_batch),
                         "mistral3": (tiny_vl.make_tiny_mistral3, mistral3_batch),
                         "qwen2_vl": (tiny_vl.make_tiny_qwen2_vl, processor_batch),
                         "internvl": (tiny_internvl.make_tiny_internvl, internvl_batch),
                         "llava": (tiny_llava.make_tiny_llava, llava_batch),
                         "llava_next": (tiny_llava_next.make_tiny_llava_next, llava_next_batch),
                         "llava_next_video": (tiny_llava_next_video.make_tiny_llava_next_video,
                                              llava_next_video_batch),
                         "smolvlm": (tiny_idefics3.make_tiny_idefics3, smolvlm_batch),
                         "llama4": (tiny_llama4_vl.make_tiny_llama4_vl, llama4_batch),
                         "glm4v": (tiny_glm4v.make_tiny_glm4v, processor_batch),
                         "paligemma2": (functools.partial(tiny_paligemma.make_tiny_paligemma, gemma2=True),
                                        paligemma_batch),
                         "aya_vision": (tiny_aya_vision.make_tiny_aya_vision, aya_vision_batch),
                         "aria": (tiny_aria_vl.make_tiny_aria_vl, aria_batch)}[model]
    folder = writer(tmp_path / "src")
    # NOTE: transformers 5.24 refuses SDPA for PaliGemma 2's Gemma 2 decoder
    attention = "eager" if model == "paligemma2" else "sdpa"
    [r] = run_distributed(_run, 1, str(folder), batch_for, attention, timeout=600, env={"LOONGFORGE_DEVICE": "cuda"})
    assert r["fp32"]["device"].startswith("cuda"), r
    # fp32 on the same GPU, TF32 off: summation order only
    assert r["fp32"]["logit_diff"] < 1e-3 and r["fp32"]["grad_diff"] < 1e-3, r
    assert abs(r["fp32"]["loss"] - r["fp32"]["ref_loss"]) < 1e-4, r
    assert abs(r["bf16"]["loss"] - r["bf16"]["ref_loss"]) < 3e-2, r


@pytest.mark.parametrize("model", ["gemma3", "internvl", "llava", "llava_next", "smolvlm"])
def test_cuda_bf16_generate_as_transformers(tmp_path, model):
    """Cached greedy generate in bf16 (two left-padded prompts with images; Gemma 3's image blocks at the prefill)
    against transformers' in bf16 on the same GPU: the first steps' tokens equal, scores and logits within 3e-2; the
    same with the static cache, its decode steps replayed from a CUDA graph."""
    from loongforge_hf.testing import tiny_idefics3, tiny_internvl, tiny_llava, tiny_llava_next, tiny_vl

    from . import _vl_gemma3, _vl_idefics3, _vl_internvl, _vl_llava, _vl_llava_next
    from .test_qwen2_5_vl_gpu import _run_generate_bf16, check_generate_bf16

    writer, prompts = {"gemma3": (tiny_vl.make_tiny_gemma3_vl, _vl_gemma3.prompts),
                       "internvl": (tiny_internvl.make_tiny_internvl, _vl_internvl.prompts),
                       "llava": (tiny_llava.make_tiny_llava, _vl_llava.prompts),
                       "llava_next": (tiny_llava_next.make_tiny_llava_next, _vl_llava_next.prompts),
                       "smolvlm": (tiny_idefics3.make_tiny_idefics3, _vl_idefics3.prompts)}[model]
    folder = writer(tmp_path / "src", seed=1)
    if model == "llava_next":  # NOTE: its prompts go through the checkpoint's processor (crops per picture size)
        prompts = functools.partial(prompts, str(folder))
    check_generate_bf16(run_distributed(_run_generate_bf16, 1, str(folder), prompts, timeout=600,
                                        env={"LOONGFORGE_DEVICE": "cuda"})[0])
