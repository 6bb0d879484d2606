"""Qwen2.5-VL on the CUDA path (varlen flash attention in the ViT under bf16, SDPA in the language model), against
transformers on the same GPU: images + videos in fp32 (logits, loss, vision gradients) and bf16 (loss), and
MegatronEngine steps on packed batches against the same steps on padded batches; bf16 ``generate`` (KV cache) against
transformers' ``generate``."""

import math

import pytest
import torch

from loongforge_hf.parallel.spawn import run_distributed

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _run(folder: str, out_dir: str) -> dict:
    import transformers

    import loongforge_hf as lf
    from loongforge_hf.trainer.engine import MegatronEngine

    from ._vl_features import VIDEO_SAMPLES, collator, hand_features, packing_features
    from ._vl_parity import vision_grads

    # fp32 means fp32 on both sides: torch lets cuDNN convolutions use TF32 by default
    # (torch.backends.cudnn.allow_tf32), which transformers' Conv3d patch embedding would hit while ours runs the same
    # patch embedding as a plain fp32 matmul.
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    result = {}
    # NOTE: whole seconds per temporal grid here. transformers 5.17 (what the GPU machine has) truncates
    # second_per_grid_ts to an int in get_rope_index (`tokens_per_second * int(next(second_per_grid_ts))`), so its
    # video positions for 0.5 s / 1.5 s grids are not the float ones of later transformers (5.24) and of this project;
    # the fractional case is compared with transformers 5.24 on CPU (tests/multimodal/test_qwen2_5_vl_features.py).
    samples = [[(*piece[:2], float(math.ceil(piece[2]))) if piece[0] == "video" else piece for piece in sample]
               for sample in VIDEO_SAMPLES]
    batch = {k: v.cuda() for k, v in collator(folder, pad_to_multiple_of=4)(hand_features(folder, samples)).items()}
    for dtype in (torch.float32, torch.bfloat16):
        ref = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(folder, dtype=dtype,
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
        del ref, model
    args = transformers.TrainingArguments(output_dir=out_dir, learning_rate=1e-3, weight_decay=0.0, max_grad_norm=1.0,
                                          report_to=[])
    features = packing_features(folder)
    for name, kwargs in (("padded", {}), ("packed", {"packing": True, "max_length": 60})):
        model = lf.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
        engine = MegatronEngine(model, args=args)
        step_batch = collator(folder, **kwargs)(features)
        result[name] = [engine.train_step([step_batch]).loss for _ in range(3)]
        del engine, model
    return result


def test_cuda_videos_packing_and_training_match(tmp_path):
    from loongforge_hf.testing.tiny_vl import make_tiny_qwen2_5_vl

    folder = make_tiny_qwen2_5_vl(tmp_path / "src")
    [r] = run_distributed(_run, 1, str(folder), str(tmp_path / "out"), timeout=600, env={"LOONGFORGE_DEVICE": "cuda"})
    assert r["fp32"]["device"].startswith("cuda"), r
    # fp32 on the same GPU, TF32 off for matmuls and convolutions: summation order only
    assert r["fp32"]["logit_diff"] < 1e-3 and r["fp32"]["grad_diff"] < 1e-3, r
    assert abs(r["fp32"]["loss"] - r["fp32"]["ref_loss"]) < 1e-4, r
    # bf16: flash varlen in the ViT vs transformers' kernels, bf16 rounding throughout
    assert abs(r["bf16"]["loss"] - r["bf16"]["ref_loss"]) < 3e-2, r
    assert r["packed"] == pytest.approx(r["padded"], rel=1e-4), r
    assert r["packed"][-1] < r["packed"][0], r


def _run_fp8(folder: str) -> dict:
    import loongforge_hf as lf

    from ._vl_features import collator, hand_features
    from ._vl_fp8 import IMAGES

    batch = {k: v.cuda() for k, v in collator(folder, pad_to_multiple_of=4)(hand_features(folder, IMAGES)).items()}
    model = lf.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.bfloat16)
    ref = model(**batch)
    ref.loss.backward()
    del model
    # NOTE: the tiny model's widths are multiples of 16, not of 128: row-wise scaling
    model = lf.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.bfloat16, fp8="on",
                                                           fp8_recipe="rowwise")
    out = model(**batch)
    out.loss.backward()
    grads_ok = all(p.grad is not None and bool(torch.isfinite(p.grad).all())
                   for p in model.vision_tower.parameters())
    return {"loss": out.loss.item(), "ref_loss": ref.loss.item(), "swapped": model.megatron.fp8.swapped,
            "grads_ok": grads_ok}


def test_cuda_fp8_vision_and_language(tmp_path):
    """``fp8="on"`` through ``from_pretrained`` on the GPU: the vision tower's linears and the language model's run
    FP8 GEMMs (``torch._scaled_mm``, row-wise), the loss within 3% of the bf16 model's, finite vision gradients."""
    from loongforge_hf.testing.tiny_vl import make_tiny_qwen2_5_vl

    folder = make_tiny_qwen2_5_vl(tmp_path / "src")
    [r] = run_distributed(_run_fp8, 1, str(folder), timeout=600, env={"LOONGFORGE_DEVICE": "cuda"})
    assert "vision.0.blocks.0.attn.qkv" in r["swapped"] and "vision.0.merger.mlp.2" in r["swapped"], r
    assert "0.decoder.layers.0.mlp.linear_fc1" in r["swapped"], r
    assert r["grads_ok"] and r["loss"] == pytest.approx(r["ref_loss"], rel=0.03), r


GENERATE_STEPS = 3  # NOTE: bf16 may break a near tie later on; the first steps' tokens must agree
GENERATE_BF16_ATOL = 3e-2  # NOTE: bf16 rounds to 2^-8 relative; the tiny model's logits stay below 0.6 (fp32, CPU)


def _run_generate_bf16(folder: str, prompts=None) -> dict:
    """transformers' and ours bf16 ``generate`` (dynamic and static cache) on ``prompts()`` (default: the
    checkpoint's processor's left-padded batch, ``_vl_generate.prompt_batch``)."""
    import transformers

    import loongforge_hf as lf

    from ._vl_generate import prompt_batch

    inputs = {k: v.cuda() for k, v in (prompts() if prompts is not None else prompt_batch(folder)).items()}
    kw = dict(max_new_tokens=GENERATE_STEPS, return_dict_in_generate=True, output_scores=True, output_logits=True,
              pad_token_id=0)
    ref = transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.bfloat16,
                                                                   attn_implementation="sdpa").cuda().eval()
    theirs = ref.generate(**inputs, **kw)
    del ref
    model = lf.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.bfloat16)
    ours = model.generate(**inputs, **kw)
    static = model.generate(**inputs, **kw, cache_implementation="static")
    return {"device": str(model.device),
            "graphed": (static.cache.fixed_steps, static.cache.graphed),
            "ours": (ours.sequences.cpu(), torch.stack(ours.scores).float().cpu(),
                     torch.stack(ours.logits).float().cpu()),
            "static": (static.sequences.cpu(), torch.stack(static.scores).float().cpu(),
                       torch.stack(static.logits).float().cpu()),
            "theirs": (theirs.sequences.cpu(), torch.stack(theirs.scores).float().cpu(),
                       torch.stack(theirs.logits).float().cpu())}


def test_cuda_bf16_generate_as_transformers(tmp_path):
    """Cached greedy generate in bf16 on one GPU (images of two sizes, left padding, a text-only row) against
    transformers' generate in bf16 on the same GPU: the first steps' tokens equal, scores and logits within 3e-2; the
    same with the static cache, its decode steps (3-D mRoPE positions) replayed from a CUDA graph."""
    from loongforge_hf.testing.tiny_vl import make_tiny_qwen2_5_vl

    folder = make_tiny_qwen2_5_vl(tmp_path / "src")
    check_generate_bf16(run_distributed(_run_generate_bf16, 1, str(folder), timeout=600,
                                        env={"LOONGFORGE_DEVICE": "cuda"})[0])


def check_generate_bf16(r: dict) -> None:
    """``_run_generate_bf16``'s result: on the GPU, the static cache's decode steps graphed, our tokens (dynamic and
    static cache) transformers', scores and logits within ``GENERATE_BF16_ATOL``."""
    assert r["device"].startswith("cuda"), r
    assert r["graphed"] == (GENERATE_STEPS - 1, True), r["graphed"]
    ref_seq, ref_scores, ref_logits = r["theirs"]
    for which in ("ours", "static"):
        seq, scores, logits = r[which]
        assert torch.equal(seq, ref_seq), (which, seq, ref_seq)
        torch.testing.assert_close(scores, ref_scores, atol=GENERATE_BF16_ATOL, rtol=0, msg=lambda m: f"{which}: {m}")
        torch.testing.assert_close(logits, ref_logits, atol=GENERATE_BF16_ATOL, rtol=0, msg=lambda m: f"{which}: {m}")


def _run_lora_and_resume(folder: str, out_dir: str) -> dict:
    import peft
    import transformers

    import loongforge_hf as lf
    from loongforge_hf.lora import get_peft_model

    from ._vl_checkpoint import train
    from ._vl_lora import CONFIGS, resume_matches_uninterrupted
    from ._vl_parity import make_batch

    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    batch = {k: v.cuda() for k, v in make_batch(folder).items()}
    kw = CONFIGS["all_linear"]
    model = lf.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    transformers.set_seed(5)
    model = get_peft_model(model, peft.LoraConfig(**kw))
    hf = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(folder, dtype=torch.float32,
                                                                         attn_implementation="sdpa").cuda()
    transformers.set_seed(5)
    ref = peft.get_peft_model(hf, peft.LoraConfig(**kw))
    ours, theirs = model(**batch), ref(**batch)
    ours.loss.backward()
    theirs.loss.backward()
    from loongforge_hf.lora.vision import chunk_params

    params, ref_params = chunk_params(model.chunks[0]), dict(ref.named_parameters())
    grad_diff = max(float((params[f"{t.megatron_module}.lora.{t.name}.{f}"].grad
                           - ref_params[f"base_model.model.{t.hf_module}.lora_{f}.default.weight"].grad).abs().max()
                          / ref_params[f"base_model.model.{t.hf_module}.lora_{f}.default.weight"].grad.abs().max())
                    for t in model.lora_plan.targets if t.kind == "vision" for f in "AB")
    valid = batch["attention_mask"].bool()
    result = {"device": str(model.device), "logit_diff": float((ours.logits - theirs.logits).abs()[valid].max()),
              "loss_diff": float((ours.loss - theirs.loss).abs()), "vision_grad_diff": grad_diff}
    del model, ref, hf
    result["lora_resume"] = resume_matches_uninterrupted(folder, f"{out_dir}/lora", {}, {}, use_cpu=False)
    full = train(folder, f"{out_dir}/full", {}, use_cpu=False)
    result["full"] = (full["losses"], train(folder, f"{out_dir}/resumed", {}, resume=f"{out_dir}/full/checkpoint-2",
                                            use_cpu=False)["losses"])
    return result


def test_cuda_lora_and_checkpoint_resume(tmp_path):
    """On one GPU (the ViT's CUDA attention path): LoRA "all-linear" (the tower's adapters too) against PEFT on
    transformers' model on the same GPU in fp32 (TF32 off): logits 1e-3, loss 1e-4, the tower adapters' gradients within
    1e-3 of their largest entry; a LoongSFTTrainer LoRA run and a full fine-tuning LoongTrainer run, each resumed from
    its step-2 checkpoint, log the uninterrupted losses (1e-5 relative)."""
    from loongforge_hf.testing.tiny_vl import make_tiny_qwen2_5_vl

    folder = make_tiny_qwen2_5_vl(tmp_path / "src")
    [r] = run_distributed(_run_lora_and_resume, 1, str(folder), str(tmp_path / "out"), timeout=600,
                          env={"LOONGFORGE_DEVICE": "cuda"})
    assert r["device"].startswith("cuda"), r
    assert r["logit_diff"] < 1e-3 and r["loss_diff"] < 1e-4 and r["vision_grad_diff"] < 1e-3, r
    lora = r["lora_resume"]
    assert lora["resumed"] == pytest.approx(lora["full"], rel=1e-5), lora
    full, resumed = r["full"]
    assert len(full) == 4 and resumed == pytest.approx(full, rel=1e-5), r["full"]
