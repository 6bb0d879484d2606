"""LoRA / DoRA on Qwen3-VL (``lf.AutoModelForImageTextToText`` + ``loongforge_hf.lora.get_peft_model``) against PEFT on
transformers' ``Qwen3VLForConditionalGeneration``.

- The tower's linears by name (ViT attention ``qkv`` / ``attn.proj``, MLP ``linear_fc1`` / ``linear_fc2``, names the
  patch merger's and the DeepStack mergers' linears share) with the language model's q/v (rsLoRA); PEFT's
  "all-linear" with the LM head and the language norms in ``modules_to_save``; its DoRA; DoRA on the language model's
  attention. The same seed on both sides (init_lora_weights=False: random B, so every adapter moves the logits):
  logits and loss within 1e-5 (fp32), every adapter's gradient within 2e-5 of its largest entry (one pipeline stage;
  the language model's as each TP rank holds them, the tower's whole or, split, as each rank holds them), PEFT's
  parameter counts, ``adapter_config.json``'s ``target_modules`` as PEFT writes them, the adapter folder in
  ``PeftModel.from_pretrained`` and the merged export in transformers with our logits (1e-5), the model unchanged by
  the merged export; at TP1, TP2 with the tower split (``vision_tensor_parallel_size=2``) and sequence parallelism,
  PP2 (the tower and DeepStack's layers on the first stage), CP2 (each rank's gradients summed as megatron's DDP
  sums them) and TP2 with encoder data parallelism (each TP rank encodes a share of the images, DeepStack's features
  with them).
- A PEFT-written "all-linear" adapter (scaling 1, ``_vl_lora.qwen3_checks`` says why) loaded with the tower split
  (TP2 + SP): ``from_pretrained`` of its folder, ``load_adapter``, ``disable_adapter`` and ``merge_and_unload``
  against PEFT's. A PEFT-written DoRA adapter on every linear at TP2 (the tower whole): logits, loss, the tower's
  A / B / magnitude gradients, merge_and_unload; refused on a split tower, nothing changed.
- LoongSFTTrainer with "all-linear" LoRA against trl.SFTTrainer + PEFT, 3 steps: the logged losses.
- Refused with messages, nothing changed: modules_to_save in the tower, trainable_token_indices.
"""

from __future__ import annotations

import pytest

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing.tiny_vl import make_tiny_qwen3_vl

from ._vl_lora import GRAD_TOL, QWEN3_CASES, check_peft_adapter, qwen3_checks

# ViT blocks x (qkv, attn.proj, linear_fc1, linear_fc2) + the merger's 2 + 2 DeepStack mergers x 2 (tiny_vl: depth 3)
TOWER_TARGETS = 3 * 4 + 2 + 2 * 2


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(make_tiny_qwen3_vl(tmp_path_factory.mktemp("vl3-lora") / "vl"))


@pytest.fixture(scope="module")
def one_rank(checkpoint, tmp_path_factory):
    return run_distributed(qwen3_checks, 1, checkpoint, str(tmp_path_factory.mktemp("vl3-lora-one")), 1,
                           timeout=500)[0]


@pytest.fixture(scope="module")
def two_ranks(checkpoint, tmp_path_factory):
    return run_distributed(qwen3_checks, 2, checkpoint, str(tmp_path_factory.mktemp("vl3-lora-two")), 2,
                           timeout=600)


def _assert_matches_peft(ranks: list[dict], name: str) -> None:
    for res in ranks:
        assert tuple(res["counts"]) == tuple(res["peft_counts"]), res
        assert res["logits_diff"] < 1e-5 and res["loss_diff"] < 1e-5, res
        assert res["unchanged_after_merged_export"]
        if "grads_checked" in res:
            expected_vision = 0 if name == "language_dora" else TOWER_TARGETS
            assert res["grads_checked"]["vision"] == expected_vision, res["grads_checked"]
            assert res["grads_checked"]["language"] >= 8, res["grads_checked"]
    rank0 = ranks[0]
    assert rank0["adapter_logits_diff"] < 1e-5 and rank0["merged_logits_diff"] < 1e-5, rank0
    ours, peft_s = rank0["target_modules"]
    assert sorted(ours) == sorted(peft_s), (ours, peft_s)


@pytest.mark.parametrize("name", QWEN3_CASES["tp1"][1])
def test_tp1_matches_peft(one_rank, name):
    _assert_matches_peft([one_rank[f"tp1/{name}"]], name)


@pytest.mark.parametrize("layout,name", [(layout, name) for layout, (_, names) in QWEN3_CASES.items()
                                         if layout != "tp1" for name in names])
def test_two_ranks_match_peft(two_ranks, layout, name):
    _assert_matches_peft([r[f"{layout}/{name}"] for r in two_ranks], name)
    if layout == "pp2":
        assert all("grads_checked" not in r[f"{layout}/{name}"] for r in two_ranks)


def test_peft_written_adapter_on_a_split_tower(two_ranks):
    """A PEFT-written "all-linear" adapter (random B; language norm and LM head whole) at TP2 + SP with the tower
    split: ``from_pretrained(adapter folder)`` frozen with PEFT's logits, ``load_adapter(is_trainable=True)``,
    ``disable_adapter`` the base model's logits, ``merge_and_unload`` PEFT's merged logits as a plain image-text model
    (1e-5; merged 3e-5, as test_qwen2_5_vl_lora.py says why)."""
    for r in two_ranks:
        check_peft_adapter(r["peft_adapter"])


def test_peft_written_dora_adapter_on_the_whole_tower(two_ranks):
    """A PEFT-written "all-linear" DoRA adapter (factors and magnitudes moved, so the rescaling is not 1) at TP2 with
    the tower whole on each rank: logits and loss of PEFT's model (1e-5), the tower adapters' A, B and magnitude
    gradients (the DeepStack mergers' included) within 2e-5 of their largest entry, merge_and_unload's logits (3e-5);
    with the tower split it is refused and the model left as it was."""
    for r in two_ranks:
        res = r["peft_dora"]
        assert res["adapter_effect"] > 1e-2, res
        assert res["logits_diff"] < 1e-5 and res["loss_diff"] < 1e-5, res
        assert res["tower_grads_compared"] == 3 * TOWER_TARGETS and res["tower_grad_rel_diff"] < GRAD_TOL, res
        assert res["merged_diff"] < 3e-5, res
        assert "not supported with the tower split" in res["split_tower"] and res["split_tower_untouched"], res


def test_sft_matches_trl(one_rank):
    """LoongSFTTrainer with "all-linear" LoRA (PEFT's initialisation, the tower's linears included) against
    trl.SFTTrainer + PEFT on transformers' model, the same SFTConfig, rows and collator: 3 logged losses (1e-4 rel)."""
    ref, got = one_rank["sft"]["trl"], one_rank["sft"]["loong"]
    assert len(ref) == len(got) == 3 and ref[0] != ref[-1], (ref, got)
    assert got == pytest.approx(ref, rel=1e-4), (ref, got)


def test_refused_on_the_image_text_model(one_rank):
    """modules_to_save in the vision tower (its merger's norm) and trainable_token_indices: refused with messages,
    nothing changed."""
    refused = one_rank["refused"]
    assert "modules_to_save" in refused["tower_saved"] and "vision tower" in refused["tower_saved"], refused
    assert "trainable_token_indices is not supported on image-text models" in refused["tokens"], refused


def test_lora_checkpoint_resumes_in_another_layout(two_ranks):
    """A LoongSFTTrainer checkpoint with adapters on the tower (the DeepStack mergers' included) and the language
    model, written at TP2 + SP with the tower split (step 2), resumed at PP2 (the tower whole): the uninterrupted
    run's losses (1e-5 relative)."""
    res = two_ranks[0]["resume"]
    assert len(res["full"]) == 4 and res["full"][2] != res["full"][3], res
    assert res["resumed"] == pytest.approx(res["full"], rel=1e-5), res
    assert {"adapter_config.json", "adapter_model.safetensors", "megatron"} <= set(res["files"]), res["files"]


def test_generate_matches_peft(one_rank):
    """``generate`` of the adapted model ("all-linear", the tower's and DeepStack's adapters included): PEFT's tokens,
    scores within 1e-5."""
    same, diff = one_rank["generate"]
    assert same and diff < 1e-5, one_rank["generate"]
