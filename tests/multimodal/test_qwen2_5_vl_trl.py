"""LoongSFTTrainer on TRL's own image-text dataset flow against trl.SFTTrainer on transformers' Qwen2.5-VL.

The dataset is what TRL's vision-language SFT takes: conversations whose user turns hold an image (``messages`` with
``{"type": "image"}`` entries, an ``images`` column of PIL images), the processor as ``processing_class``. TRL keeps
such a dataset untokenized and its vision collator applies the chat template and the processor batch by batch. Full fine-tuning and LoRA ("all-linear": the language model and the vision tower)
at TP1 against trl.SFTTrainer (+ PEFT), and LoRA at TP2 + SP, TP2 with the tower split, CP2 and PP2 (batches padded to
``max_length``): every logged loss within 1e-5 relative (fp32), both ranks logging the same. Before, LoongSFTTrainer
refused this dataset for lacking an ``input_ids`` column."""

from __future__ import annotations

import pytest

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing.tiny_vl import make_tiny_qwen2_5_vl

from ._vl_trl import TWO_RANK_LAYOUTS, one_rank, two_ranks


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("vl-trl")
    folder = str(make_tiny_qwen2_5_vl(base / "vl"))
    return (run_distributed(one_rank, 1, folder, str(base / "one"), timeout=500)[0],
            run_distributed(two_ranks, 2, folder, str(base / "two"), timeout=600))


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_tp1_matches_trl(runs, kind):
    one, _ = runs
    ref, got = one[f"trl/{kind}"], one[f"loong/{kind}"]
    assert len(ref) == 3 and ref[0] != ref[-1], ref
    assert got == pytest.approx(ref, rel=1e-5), (ref, got)


@pytest.mark.parametrize("layout", list(TWO_RANK_LAYOUTS))
def test_two_ranks_match_trl(runs, layout):
    one, two = runs
    assert two[0][layout] == two[1][layout], two
    assert two[0][layout] == pytest.approx(one["trl/lora"], rel=1e-5), (layout, two[0][layout], one["trl/lora"])
