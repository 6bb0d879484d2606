"""LoongSFTTrainer on TRL's own image-text dataset flow against trl.SFTTrainer on transformers' Qwen2.5-VL.

The dataset is what TRL's vision-language SFT takes: conversations whose user turns hold an image (``messages`` with
``{"type": "image"}`` entries, an ``images`` column of PIL images), the processor as ``processing_class``. TRL keeps
such a dataset untokenized and its vision collator applies the chat template and the processor batch by batch. Full
fine-tuning and LoRA ("all-linear": the language model and the vision tower) at TP1 against trl.SFTTrainer (+ PEFT),
and LoRA at TP2 + SP, TP2 with the tower split, CP2 and PP2 (batches padded to ``max_length``); prompt / completion
conversations (loss on the completion) with LoRA at TP1, TP2 + SP and CP2: every logged loss and eval loss (4
conversations after each step) within 1e-5 relative (fp32), both ranks logging the same. Before, LoongSFTTrainer
refused these datasets for lacking an ``input_ids`` column (and TRL's collator refused the padding prompt-completion
data needs under SP / CP). At DP2, images whose placeholder tokens ``max_length`` cut on one rank only: evaluation
and training fail on both ranks with the same DataError naming the fields (no hang in a collective), for
conversations too, where the processor inside TRL's collator raises on one rank."""

from __future__ import annotations

import pytest

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing.tiny_vl import make_tiny_qwen2_5_vl

from ._vl_trl import PROMPT_COMPLETION_LAYOUTS, TWO_RANK_LAYOUTS, one_rank, two_ranks


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("vl-trl")
    folder = str(make_tiny_qwen2_5_vl(base / "vl"))
    return (run_distributed(one_rank, 1, folder, str(base / "one"), timeout=500)[0],
            run_distributed(two_ranks, 2, folder, str(base / "two"), timeout=600))


@pytest.mark.parametrize("kind", ["full", "lora", "prompt_completion"])
def test_tp1_matches_trl(runs, kind):
    one, _ = runs
    ref, got = one[f"trl/{kind}"], one[f"loong/{kind}"]
    assert len(ref["loss"]) == len(ref["eval_loss"]) == 3 and ref["loss"][0] != ref["loss"][-1], ref
    for key in ("loss", "eval_loss"):
        assert got[key] == pytest.approx(ref[key], rel=1e-5), (key, ref, got)


@pytest.mark.parametrize("layout", list(TWO_RANK_LAYOUTS))
def test_two_ranks_match_trl(runs, layout):
    one, two = runs
    assert two[0][layout] == two[1][layout], two
    for key in ("loss", "eval_loss"):
        assert two[0][layout][key] == pytest.approx(one["trl/lora"][key], rel=1e-5), (layout, key, two[0][layout])


@pytest.mark.parametrize("layout", PROMPT_COMPLETION_LAYOUTS)
def test_prompt_completion_padded_after_trls_collator(runs, layout):
    """TRL's vision collator refuses pad_to_multiple_of on prompt-completion data (NotImplementedError): under
    sequence and context parallelism the batch is right-padded after it (``vl_collator.PadToMultiple``)."""
    one, two = runs
    got = two[0][f"prompt_completion/{layout}"]
    assert got == two[1][f"prompt_completion/{layout}"]
    for key in ("loss", "eval_loss"):
        assert got[key] == pytest.approx(one["trl/prompt_completion"][key], rel=1e-5), (layout, key, got)


@pytest.mark.parametrize("stage", ["evaluate", "train"])
def test_cut_image_tokens_fail_alike_on_both_ranks(runs, stage):
    """Rank 1's rows lose 2 of each image's 4 placeholders to max_length=18 (TRL's vision collator truncates
    input_ids, not the images): before any forward both ranks raise, rank 0 naming rank 1's error (without the
    check, rank 1's forward raised alone and rank 0 waited in a collective)."""
    _, two = runs
    (kind0, said0), (kind1, said1) = two[0]["cut_image"][stage], two[1]["cut_image"][stage]
    assert kind0 == kind1 == "DataError" and said0 == f"(on rank 1) {said1}", (said0, said1)
    assert said1.startswith("input_ids hold 4 image placeholder tokens (image_token_id 202) but the images of "
                            "image_grid_thw [[1, 4, 4], [1, 4, 4]] take 8."), said1
    assert "max_length=18" in said1 and "increase max_length" in said1, said1


@pytest.mark.parametrize("stage", ["evaluate", "train"])
def test_processor_refusing_cut_image_tokens_fails_alike_on_both_ranks(runs, stage):
    """The same cut on conversations (``messages``): there the processor inside TRL's collator raises on rank 1 only
    (its image-token count check); both ranks raise the collator's error as a DataError before any collective
    (without the check, rank 1's fetch raised alone and rank 0 waited in the step's first collective)."""
    _, two = runs
    (kind0, said0), (kind1, said1) = two[0]["cut_image/messages"][stage], two[1]["cut_image/messages"][stage]
    assert kind0 == kind1 == "DataError" and said0 == f"(on rank 1) {said1}", (said0, said1)
    where = {"evaluate": "the data collator", "train": "fetching a training batch"}[stage]
    assert said1.startswith(f"{where} raised ValueError: Mismatch in `image` token count between text and "
                            "`input_ids`. Got ids=[2, 2] and text=[4, 4]."), said1
