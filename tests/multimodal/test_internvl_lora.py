"""LoRA on InternVL image-text (``lf.AutoModelForImageTextToText`` + ``loongforge_hf.lora.get_peft_model``) against
PEFT on transformers' ``InternVLForConditionalGeneration``: ``target_modules=["q_proj", "v_proj"]`` (rsLoRA; in the
language model and in InternViT, where they are two of the three blocks of the tower's fused ``qkv``) and PEFT's
"all-linear" (the language model's and InternViT's linears and the projector's two) with a language norm in
``modules_to_save``; the same seed on both sides (random B). Logits and loss within 1e-5 (fp32), every adapter's
gradient within 5e-5 of its largest entry, PEFT's parameter counts, ``target_modules`` and the adapter file's tensor
names and shapes as PEFT writes them, the adapter folder in ``PeftModel.from_pretrained`` and the merged export in
transformers with our logits (1e-5; merged 3e-5); at TP1 and at TP2 + SP with the tower split (both ViT kinds: the
big one's q / k norms split with the heads)."""

from __future__ import annotations

import pytest

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing.tiny_internvl import make_tiny_internvl

from ._vl_internvl import LORA_CASES, lora_checks

# adapted linears per config: (InternViT's and the projector's, the language model's: 4 layers); tensors trained whole
TARGETS = {"qv": (2 * 2, 4 * 2), "all_linear": (2 * 6 + 2, 4 * 7)}
SAVED = {"qv": 0, "all_linear": 4}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("internvl-lora")
    return {"hub": str(make_tiny_internvl(root / "hub")),
            "big": str(make_tiny_internvl(root / "big", naming="modules", big_vit=True))}


@pytest.mark.parametrize("ranks", [1, 2])
def test_lora_matches_peft(folders, tmp_path, ranks):
    per_rank = run_distributed(lora_checks, ranks, folders, str(tmp_path), ranks, timeout=600)
    for case, (_, _, names) in LORA_CASES[ranks].items():
        for name in names:
            for res in (r[f"{case}/{name}"] for r in per_rank):
                assert tuple(res["counts"]) == tuple(res["peft_counts"]), res
                assert res["logits_diff"] < 1e-5 and res["loss_diff"] < 1e-5, res
                assert res["unchanged_after_merged_export"]
                checked = res["grads_checked"]
                assert (checked["vision"], checked["language"]) == TARGETS[name], (case, name, res)
            rank0 = per_rank[0][f"{case}/{name}"]
            assert rank0["adapter_logits_diff"] < 1e-5 and rank0["merged_logits_diff"] < 3e-5, rank0
            ours, theirs = rank0["target_modules"]
            assert sorted(ours) == sorted(theirs), (ours, theirs)
            assert rank0["adapter_tensors"] == (2 * sum(TARGETS[name]) + SAVED[name], True), rank0["adapter_tensors"]
