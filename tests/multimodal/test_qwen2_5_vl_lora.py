"""LoRA on Qwen2.5-VL (``lf.AutoModelForImageTextToText`` + ``loongforge_hf.lora.get_peft_model``) against PEFT on
transformers' ``Qwen2_5_VLForConditionalGeneration``.

- The language model's q/v projections (rsLoRA), DoRA on its q/v/o projections, and PEFT's "all-linear" (the language
  model's linears and the vision tower's: ViT ``qkv`` / ``proj`` / MLP, the patch merger's two linears) with the LM head
  and the language norms in ``modules_to_save``, after the same seed (init_lora_weights=False: random B, so every
  adapter moves the logits): logits and loss within 1e-5 (fp32), every adapter's gradient within 2e-5 of its largest
  entry (one pipeline stage; the language model's as each TP rank holds them, the tower's whole), PEFT's parameter
  counts, ``adapter_config.json``'s ``target_modules`` as PEFT writes them ("all-linear" condensed to ``attn.proj``,
  ``mlp.0`` ...), the adapter folder in ``PeftModel.from_pretrained`` and the merged export in transformers with our
  logits (1e-5), the model unchanged by the merged export; at TP1, TP2 (tower replicated, the default), PP2 (tower on
  the first stage), CP2 (each rank's gradients, of its sequence share and its share of the images, summed as megatron's
  DDP sums them) and TP2 with encoder data parallelism (each TP rank encodes a share of the images; the tower's
  adapters' gradients summed over TP as the tower's own).
- A PEFT-written adapter loaded at TP2 (``from_pretrained`` of its folder, ``load_adapter``), ``disable_adapter`` and
  ``merge_and_unload`` against PEFT's.
- The tower split over TP (``vision_tensor_parallel_size=2``): "all-linear" as above, the tower's adapters split as
  its weights (gradients as each rank holds them). Refused with messages, nothing changed: modules_to_save in the
  tower, trainable_token_indices.
- LoongSFTTrainer with "all-linear" LoRA (PEFT's initialisation) against trl.SFTTrainer + PEFT on the transformers
  model, same SFTConfig, rows and collator, 3 steps: logged losses within 1e-4 relative; a checkpoint written at
  TP2 with the tower split (its adapters split) resumes at PP2 (the tower whole) with the uninterrupted losses.
"""

from __future__ import annotations

import pytest

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing.tiny_vl import make_tiny_qwen2_5_vl

from ._vl_lora import CONFIGS, GRAD_TOL, check_peft_adapter, one_rank_checks, two_rank_checks


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(make_tiny_qwen2_5_vl(tmp_path_factory.mktemp("vl-lora") / "vl"))


@pytest.fixture(scope="module")
def one_rank(checkpoint, tmp_path_factory):
    return run_distributed(one_rank_checks, 1, checkpoint, str(tmp_path_factory.mktemp("vl-lora-one")),
                           timeout=500)[0]


@pytest.fixture(scope="module")
def two_ranks(checkpoint, tmp_path_factory):
    return run_distributed(two_rank_checks, 2, checkpoint, str(tmp_path_factory.mktemp("vl-lora-two")), timeout=600)


def _assert_matches_peft(ranks: list[dict], name: str) -> None:
    for res in ranks:
        assert tuple(res["counts"]) == tuple(res["peft_counts"]), res
        assert res["logits_diff"] < 1e-5 and res["loss_diff"] < 1e-5, res
        assert res["unchanged_after_merged_export"]
        if "grads_checked" in res:
            expected_vision = 2 * 5 + 2 if name.startswith("all_linear") else 0  # 2 ViT blocks x 5, the merger's 2
            assert res["grads_checked"]["vision"] == expected_vision, res["grads_checked"]
            assert res["grads_checked"]["language"] >= 8, res["grads_checked"]
    rank0 = ranks[0]
    assert rank0["adapter_logits_diff"] < 1e-5 and rank0["merged_logits_diff"] < 1e-5, rank0
    ours, peft_s = rank0["target_modules"]
    assert sorted(ours) == sorted(peft_s), (ours, peft_s)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_tp1_matches_peft(one_rank, name):
    _assert_matches_peft([one_rank[name]], name)


@pytest.mark.parametrize("layout", ["tp2", "pp2", "cp2", "tp2_encoder_dp"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_two_ranks_match_peft(two_ranks, layout, name):
    _assert_matches_peft([r[f"{layout}/{name}"] for r in two_ranks], name)
    if layout == "pp2":
        assert all("grads_checked" not in r[f"{layout}/{name}"] for r in two_ranks)


def test_split_tower_splits_its_adapters(two_ranks):
    """The tower split over TP: B's rows of qkv (in each q, k, v block) and of gate / up, A's columns of proj and
    down on each rank, the merger's whole; gradients against PEFT's as each rank holds them."""
    _assert_matches_peft([r["tp2_split_tower/all_linear"] for r in two_ranks], "all_linear")


def test_sft_matches_trl(one_rank):
    ref, got = one_rank["sft"]["trl"], one_rank["sft"]["loong"]
    assert len(ref) == len(got) == 3 and ref[0] != ref[-1], (ref, got)
    assert got == pytest.approx(ref, rel=1e-4), (ref, got)


def test_lora_checkpoint_resumes_in_another_layout(two_ranks):
    """A LoongSFTTrainer checkpoint with adapters on the tower and the language model, written at TP2 with the tower
    split (step 2), resumed at PP2 (the tower whole): the uninterrupted run's losses (1e-5 relative)."""
    res = two_ranks[0]["resume"]
    assert len(res["full"]) == 4 and res["full"][2] != res["full"][3], res
    assert res["resumed"] == pytest.approx(res["full"], rel=1e-5), res
    assert {"adapter_config.json", "adapter_model.safetensors", "megatron"} <= set(res["files"]), res["files"]


def test_peft_written_adapter_loads_unloads_and_merges(two_ranks):
    """A PEFT-written "all-linear" adapter (random B; norms and LM head whole) at TP2: ``from_pretrained(adapter
    folder)`` gives a frozen LoRA model with PEFT's logits, ``load_adapter(is_trainable=True)`` PEFT's trainable count,
    ``disable_adapter`` the base model's logits and ``merge_and_unload`` PEFT's merged logits, as a plain image-text
    model again (1e-5; merged 3e-5: the merged weights are W + scaling * B @ A rounded in fp32, multiplied once, where
    PEFT multiplies W and the adapter apart: 1.1e-5 measured on an AMD EPYC host, below 1e-5 on others)."""
    for r in two_ranks:
        check_peft_adapter(r["peft_adapter"])


def test_peft_written_dora_adapter_on_the_whole_tower(two_ranks):
    """A PEFT-written "all-linear" DoRA adapter (factors and magnitudes moved, so the rescaling is not 1) at TP2 with
    the tower whole on each rank: logits (1e-5) and loss (1e-5) of PEFT's model, the tower adapters' A, B and
    magnitude gradients within 2e-5 of their largest entry, merge_and_unload's logits (3e-5, as merging above); on a
    tower split over TP it is refused and the model left as it was."""
    for r in two_ranks:
        res = r["peft_dora"]
        assert res["adapter_effect"] > 1e-2, res
        assert res["logits_diff"] < 1e-5 and res["loss_diff"] < 1e-5, res
        assert res["tower_grads_compared"] == 3 * (2 * 5 + 2) and res["tower_grad_rel_diff"] < GRAD_TOL, res
        assert res["merged_diff"] < 3e-5, res
        assert "not supported with the tower split" in res["split_tower"] and res["split_tower_untouched"], res


def test_refused_on_the_image_text_model(one_rank):
    """modules_to_save in the vision tower and trainable_token_indices: refused with messages, nothing changed."""
    refused = one_rank["refused"]
    assert "modules_to_save" in refused["tower_saved"] and "vision tower" in refused["tower_saved"], refused
    assert "trainable_token_indices is not supported on image-text models" in refused["tokens"], refused


def test_generate_matches_peft(one_rank):
    """``generate`` of the adapted model (tower adapters included): PEFT's tokens, scores within 1e-5."""
    same, diff = one_rank["generate"]
    assert same and diff < 1e-5, one_rank["generate"]
