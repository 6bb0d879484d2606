"""Rank functions for test_gemma3_vl_lora.py: LoRA on Gemma 3 image-text (``Gemma3ForConditionalGeneration``) against
PEFT (and TRL) on transformers' model, through the shared ``_vl_lora`` checks with Gemma 3's hand-built batch
(``_vl_gemma3.make_batch``: three images, ``token_type_ids``) and processor-built training rows."""

from __future__ import annotations

import torch

from . import _vl_lora as V
from ._vl_gemma3 import make_batch, train_features

# init_lora_weights=False keeps B random, so every adapter changes the logits. NOTE: scaling 1 (rsLoRA: 2 / sqrt(4)),
# as _vl_lora.CONFIGS says why: on an earlier tiny checkpoint the adapters' gradients differed from PEFT's by up to
# 4.4e-5 of their largest entry at scaling 2 to 4 (fp32 rounding amplified through the attention), 2.5e-5 at 1
CONFIGS = {
    # PEFT matches these names by suffix: the language model's q / v and SigLIP's, two of the three slots of the
    # tower's fused qkv
    "qv": dict(r=4, lora_alpha=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False, use_rslora=True),
    # PEFT's "all-linear": every language and SigLIP linear (not the tied LM head; the projector's matrix is a
    # parameter), a language norm trained whole
    "all_linear": dict(r=4, lora_alpha=4, target_modules="all-linear", init_lora_weights=False,
                       modules_to_save=["post_attention_layernorm"]),
}
# NOTE: within 5e-5 of the tensor's largest entry (measured on this checkpoint: up to 7e-6 at TP1 / CP2, 1.1e-5 with
# the tower split; 2.5e-5 on an earlier one, the language model's adapters and the tower's alike)
GRAD_TOL = 5e-5
SPLIT_SP = {"tensor_parallel_size": 2, "vision_tensor_parallel_size": 2, "sequence_parallel": True}
CASES = {  # name -> (from_pretrained keywords, configs checked, the checkpoint's naming); "tp1*" on one rank
    "tp1": ({}, ("qv", "all_linear"), "transformers"),
    "tp1_hub": ({}, ("qv", "all_linear"), "hub"),
    "tp2": ({"tensor_parallel_size": 2}, ("qv",), "transformers"),
    "tp2_split_sp": (SPLIT_SP, ("qv", "all_linear"), "hub"),
    "pp2": ({"pipeline_parallel_size": 2}, ("all_linear",), "transformers"),
    "cp2": ({"context_parallel_size": 2}, ("all_linear",), "transformers"),
}


def batch_for(folder: str) -> dict:
    return make_batch()


def refusals(folder: str) -> dict:
    """``_vl_lora.refusals`` (a SigLIP norm in modules_to_save, trainable_token_indices) and DoRA on SigLIP's q / k / v
    (fused in the tower), the model unchanged after it."""
    import peft

    import loongforge_hf as lf
    from loongforge_hf.lora import LoraConfigError, get_peft_model

    out = V.refusals(folder, tower_module="layer_norm1")
    model = lf.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    try:
        get_peft_model(model, peft.LoraConfig(target_modules="all-linear", use_dora=True))
        out["tower_dora"] = "not refused"
    except LoraConfigError as err:
        out["tower_dora"] = str(err)
    out["tower_dora_untouched"] = type(model).__name__ == "LoongModelForImageTextToText" and all(
        p.requires_grad for p in model.parameters())
    return out


# transformers 4's module names of Gemma 3 (what PEFT wrote then), oldest first: the module tree's now -> then
LEGACY_NAMES = {"transformers<4.52": (("model.language_model.", "language_model.model."),
                                      ("model.vision_tower.", "vision_tower.vision_model."),
                                      ("model.multi_modal_projector.", "multi_modal_projector.")),
                "transformers 4.52+": (("model.vision_tower.", "model.vision_tower.vision_model."),)}


def legacy_adapter_checks(folder: str, out_dir: str) -> dict:
    """A PEFT-written "all-linear" adapter (random B, scaling 1) with its tensors renamed as PEFT wrote them under
    each of transformers 4's module trees (``LEGACY_NAMES``): logits of ``lf.AutoModelForImageTextToText
    .from_pretrained`` of that folder and of PEFT's ``PeftModel.from_pretrained`` of it (both rename them back)
    against PEFT's with the original folder (differences)."""
    import shutil

    import peft
    import transformers
    from safetensors.torch import load_file, save_file

    import loongforge_hf as lf

    def hf_model():
        return transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)

    batch, original = make_batch(), f"{out_dir}/legacy-original"
    transformers.set_seed(1)
    V.save_naming_base(peft.get_peft_model(hf_model(), peft.LoraConfig(r=2, lora_alpha=2, target_modules="all-linear",
                                                                       init_lora_weights=False)), original, folder)
    tensors = load_file(f"{original}/adapter_model.safetensors")
    out = {}
    with torch.no_grad():
        expected = peft.PeftModel.from_pretrained(hf_model(), original)(**batch).logits
        for i, (era, renames) in enumerate(LEGACY_NAMES.items()):
            renamed = shutil.copytree(original, f"{out_dir}/legacy-{i}")

            def old_name(key: str) -> str:
                for now, then in renames:
                    key = key.replace(f"base_model.model.{now}", f"base_model.model.{then}")
                return key
            save_file({old_name(k): v for k, v in tensors.items()}, f"{renamed}/adapter_model.safetensors",
                      metadata={"format": "pt"})
            theirs = peft.PeftModel.from_pretrained(hf_model(), renamed)(**batch).logits
            ours = lf.AutoModelForImageTextToText.from_pretrained(renamed, dtype=torch.float32)(**batch).logits
            out[era] = {"renamed": sum(old_name(k) != k for k in tensors), "tensors": len(tensors),
                        "peft_diff": float((theirs - expected).abs().max()),
                        "ours_diff": float((ours - expected).abs().max())}
    return out


def generate_checks(folder: str, layout: dict) -> dict:
    """``generate`` (``_vl_gemma3.SCENARIOS``: greedy, uncached, beams; left-padded prompts with images) of our model
    with "all_linear" adapters against PEFT's ``get_peft_model`` on transformers' model (the same seed: random B),
    then of both after ``merge_and_unload`` (``_vl_gemma3.generate_pair``'s results by scenario; the merged ones
    prefixed ``merged_``, with the classes merged)."""
    from ..integrations._lora_checks import lora_pair
    from ._vl_gemma3 import SCENARIOS, generate_pair, prompts

    model, _, ref = lora_pair(folder, layout, CONFIGS["all_linear"], image_text=True)
    with torch.no_grad():
        out = generate_pair(model, ref.eval(), prompts())
        with model.disable_adapter():  # NOTE: the adapters change the tokens, so the checks see them
            base = generate_pair(model, ref, prompts(), {"greedy": SCENARIOS["greedy"]})["greedy"]
        out["adapter_changes_tokens"] = not base["same_sequences"]
        merged, ref_merged = model.merge_and_unload(), ref.merge_and_unload()
        out.update({f"merged_{name}": r for name, r in generate_pair(merged, ref_merged.eval(), prompts(),
                                                                     SCENARIOS).items()})
    out["merged_classes"] = (type(merged).__name__, type(ref_merged).__name__)
    return out


def checks(folders: dict, out_dir: str, ranks: int) -> dict:
    """``model_checks`` of CASES for a world of ``ranks`` (``folders``: checkpoint by naming); then on one rank the
    refusals, SFT against TRL and ``generate_checks``, on two a PEFT-written "all-linear" adapter (hub naming) loaded
    with the tower split (TP2 + SP) and ``generate_checks`` in that layout."""
    out = {f"{case}/{name}": V.model_checks(folders[naming], f"{out_dir}/{case}-{name}", layout, name, CONFIGS,
                                            batch_for=batch_for, grad_tol=GRAD_TOL)
           for case, (layout, names, naming) in CASES.items() if case.startswith("tp1") == (ranks == 1)
           for name in names}
    folder = folders["transformers"]
    if ranks == 1:
        out["refused"] = refusals(folder)
        out["legacy"] = legacy_adapter_checks(folder, out_dir)
        out["sft"] = {"trl": V.sft_losses(folder, out_dir + "/trl", loong=False, features_for=train_features),
                      "loong": V.sft_losses(folder, out_dir + "/loong", loong=True, features_for=train_features)}
        out["generate"] = generate_checks(folder, {})
    else:
        out["generate"] = generate_checks(folders["hub"], SPLIT_SP)
        out["peft_adapter"] = V.peft_adapter_checks(folders["hub"], out_dir, SPLIT_SP, lora_alpha=2,
                                                    saved=("language_model.norm",), batch=make_batch())
    return out
