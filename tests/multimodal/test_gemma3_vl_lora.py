"""LoRA on Gemma 3 image-text (``lf.AutoModelForImageTextToText`` + ``loongforge_hf.lora.get_peft_model``) against PEFT
on transformers' ``Gemma3ForConditionalGeneration``.

- ``target_modules=["q_proj", "v_proj"]`` (rsLoRA; PEFT matches them in the language model and in SigLIP, where they
  are two of the three blocks of the tower's fused ``qkv``) and PEFT's "all-linear" (the language model's linears and
  SigLIP's q / k / v / out_proj / fc1 / fc2; not the tied LM head nor the projector's matrix, a parameter) with a
  language norm in ``modules_to_save``. The same seed on both sides (init_lora_weights=False: random B, so every
  adapter moves the logits): logits and loss within 1e-5 (fp32), every adapter's gradient within 5e-5 of its largest
  entry (``_vl_gemma3_lora.GRAD_TOL`` says why; one pipeline stage; the language model's and a split tower's as each
  TP rank holds them), PEFT's parameter counts, ``adapter_config.json``'s ``target_modules`` and the adapter file's
  tensor names (the module tree's: ``model.vision_tower.encoder.layers.N.self_attn.q_proj.lora_A.weight``, whatever
  the checkpoint's naming) and shapes as PEFT writes them, the adapter folder in ``PeftModel.from_pretrained`` and
  the merged export in transformers with our logits (1e-5; merged 3e-5, as test_qwen2_5_vl_lora.py says why), the
  model unchanged by the merged export; at TP1 (the checkpoint as transformers writes it and as the hub names it),
  TP2, TP2 + SP with the tower split (``vision_tensor_parallel_size=2``, hub naming), PP2, CP2 (each rank's gradients
  summed as megatron's DDP sums them).
- A PEFT-written "all-linear" adapter on the hub-named checkpoint, loaded with the tower split (TP2 + SP):
  ``from_pretrained`` of its folder, ``load_adapter``, ``disable_adapter`` and ``merge_and_unload`` against PEFT's.
- ``generate`` with "all-linear" adapters (greedy cached and uncached, beams; prompts with images) against PEFT's
  model, and after ``merge_and_unload`` of both: the same tokens; at TP1 and TP2 + SP with the tower split.
- LoongSFTTrainer with "all-linear" LoRA against trl.SFTTrainer + PEFT, 3 steps on the processor's rows: the losses.
- Refused with messages, nothing changed: a SigLIP norm in modules_to_save, trainable_token_indices, DoRA on SigLIP's
  fused q / k / v.
"""

from __future__ import annotations

import pytest

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing.tiny_vl import make_tiny_gemma3_vl

from ._vl_gemma3_lora import CASES, checks
from ._vl_lora import check_peft_adapter

# adapted linears per config: (SigLIP's: 2 blocks, language model's: 4 layers); tensors trained whole (4 layers' norm)
TARGETS = {"qv": (2 * 2, 4 * 2), "all_linear": (2 * 6, 4 * 7)}
SAVED = {"qv": 0, "all_linear": 4}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma3-lora")
    return {naming: str(make_tiny_gemma3_vl(root / naming, naming=naming)) for naming in ("transformers", "hub")}


@pytest.fixture(scope="module")
def one_rank(folders, tmp_path_factory):
    return run_distributed(checks, 1, folders, str(tmp_path_factory.mktemp("gemma3-lora-one")), 1, timeout=500)[0]


@pytest.fixture(scope="module")
def two_ranks(folders, tmp_path_factory):
    return run_distributed(checks, 2, folders, str(tmp_path_factory.mktemp("gemma3-lora-two")), 2, timeout=600)


def _assert_matches_peft(ranks: list[dict], name: str) -> None:
    for res in ranks:
        assert tuple(res["counts"]) == tuple(res["peft_counts"]), res
        assert res["logits_diff"] < 1e-5 and res["loss_diff"] < 1e-5, res
        assert res["unchanged_after_merged_export"]
        if "grads_checked" in res:
            vision, language = TARGETS[name]
            assert (res["grads_checked"]["vision"], res["grads_checked"]["language"]) == (vision, language), res
    rank0 = ranks[0]
    assert rank0["adapter_logits_diff"] < 1e-5 and rank0["merged_logits_diff"] < 3e-5, rank0
    ours, peft_s = rank0["target_modules"]
    assert sorted(ours) == sorted(peft_s), (ours, peft_s)
    assert rank0["adapter_tensors"] == (2 * sum(TARGETS[name]) + SAVED[name], True), rank0["adapter_tensors"]


@pytest.mark.parametrize("case,name", [(c, n) for c, (_, names, _) in CASES.items() if c.startswith("tp1")
                                       for n in names])
def test_tp1_matches_peft(one_rank, case, name):
    _assert_matches_peft([one_rank[f"{case}/{name}"]], name)


@pytest.mark.parametrize("case,name", [(c, n) for c, (_, names, _) in CASES.items() if not c.startswith("tp1")
                                       for n in names])
def test_two_ranks_match_peft(two_ranks, case, name):
    _assert_matches_peft([r[f"{case}/{name}"] for r in two_ranks], name)
    assert all(("grads_checked" in r[f"{case}/{name}"]) == (case != "pp2") for r in two_ranks)


def _assert_generate_matches_peft(res: dict) -> None:
    assert res["adapter_changes_tokens"], res
    assert res["merged_classes"] == ("LoongModelForImageTextToText", "Gemma3ForConditionalGeneration"), res
    for name in ("greedy", "uncached", "beam"):
        for r in (res[name], res[f"merged_{name}"]):
            assert r["same_sequences"] and r["max_diff"] < 1e-4 and r["steps"] >= 4, (name, res)


def test_generate_matches_peft(one_rank, two_ranks):
    """Image-text ``generate`` with "all-linear" adapters (random B: the adapters change the greedy tokens) against
    PEFT's ``get_peft_model`` on transformers' model, greedy with and without the KV cache and beam search on
    left-padded prompts with images (test_gemma3_vl.py's); then both after ``merge_and_unload`` (ours a plain
    image-text model again): the same tokens, logits / scores within 1e-4; at TP1 and at TP2 + SP with the tower
    split (hub naming)."""
    _assert_generate_matches_peft(one_rank["generate"])
    for r in two_ranks:
        _assert_generate_matches_peft(r["generate"])


def test_peft_written_adapter_on_a_split_tower(two_ranks):
    """A PEFT-written "all-linear" adapter (random B, scaling 1; the language model's final norm whole) on the
    hub-named checkpoint at TP2 + SP with the tower split: ``from_pretrained(adapter folder)`` frozen with PEFT's
    logits, ``load_adapter(is_trainable=True)``, ``disable_adapter`` the base model's logits, ``merge_and_unload``
    PEFT's merged logits as a plain image-text model (1e-5; merged 3e-5)."""
    for r in two_ranks:
        check_peft_adapter(r["peft_adapter"])


def test_sft_matches_trl(one_rank):
    """LoongSFTTrainer with "all-linear" LoRA (PEFT's initialisation, SigLIP's linears included) against
    trl.SFTTrainer + PEFT on transformers' model, the same SFTConfig, rows and collator: 3 logged losses (1e-4 rel)."""
    ref, got = one_rank["sft"]["trl"], one_rank["sft"]["loong"]
    assert len(ref) == len(got) == 3 and ref[0] != ref[-1], (ref, got)
    assert got == pytest.approx(ref, rel=1e-4), (ref, got)


def test_refused_on_the_image_text_model(one_rank):
    """A SigLIP norm in modules_to_save, trainable_token_indices and DoRA on SigLIP's fused q / k / v: refused with
    messages, nothing changed."""
    refused = one_rank["refused"]
    assert "modules_to_save" in refused["tower_saved"] and "vision tower" in refused["tower_saved"], refused
    assert "trainable_token_indices is not supported on image-text models" in refused["tokens"], refused
    assert "fused linear" in refused["tower_dora"] and refused["tower_dora_untouched"], refused


def test_adapter_with_transformers_4_names_loads(one_rank):
    """A PEFT-written "all-linear" adapter renamed as PEFT wrote it under transformers 4 (``language_model.model.*`` /
    ``vision_tower.vision_model.*``, or ``model.vision_tower.vision_model.*``): ``from_pretrained`` of its folder
    renames it as PEFT's ``PeftModel.from_pretrained`` does, with the original adapter's logits (1e-5)."""
    for era, res in one_rank["legacy"].items():
        assert 0 < res["renamed"] <= res["tensors"] == 2 * sum(TARGETS["all_linear"]), (era, res)
        assert res["peft_diff"] < 1e-5 and res["ours_diff"] < 1e-5, (era, res)
