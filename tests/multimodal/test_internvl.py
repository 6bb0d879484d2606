"""InternVL image-text (``InternVLForConditionalGeneration``: InternViT, pixel-shuffle projector, Qwen2 / Qwen3
decoder) against transformers: logits, loss and vision gradients within 1e-4 (fp32) with three 56x56 tiles in one
batch, in each layout of the vision tower and the language model; both on-disk namings and both ViT kinds (InternVL3's
LayerNorm blocks; InternViT-6B's RMSNorm blocks with q / k norms, split over TP with the heads), bit-exact round
trips; generate; refusals; the processor's samples through the collator and LoongTrainer."""

from pathlib import Path

import pytest
import torch

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing.round_trip import check_round_trip as _check_round_trip, read_all
from loongforge_hf.testing.tiny_internvl import make_tiny_internvl, tiny_internvl_config

from ._vl_internvl import TEXT_ROWS, collate_and_train, make_batch, parity_and_generate
from ._vl_parity import TWO_RANKS, check_generate

TOL = 1e-4
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")
# vision tensors with a gradient: InternVL3's (2 x 18 block tensors, class token, table, patch conv (2), projector
# (6)) and the big ViT's (2 x 15: no q / k / v biases, RMSNorms, q / k norms; the final LayerNorm (2))
GRADS = {"hub": 46, "big": 42}
SPLIT_SP = {"tensor_parallel_size": 2, "sequence_parallel": True, "vision_tensor_parallel_size": 2}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_tiny_internvl(tmp_path_factory.mktemp("internvl") / "src")


@pytest.fixture(scope="module")
def big_vit(tmp_path_factory) -> Path:
    return make_tiny_internvl(tmp_path_factory.mktemp("internvl-big") / "src", naming="modules", big_vit=True)


def check(result: dict, *, grads: int | None) -> None:
    assert result["logits_shape"] == (2, 44, 204), result
    assert result["logit_diff"] < TOL and result["loss_diff"] < TOL, result
    if grads is not None:
        assert result["grad_diff"] is not None and result["grad_diff"] < TOL and result["grads"] == grads, result


def test_parity_round_trip_and_generate_one_rank(checkpoint, big_vit, tmp_path):
    """TP1 in the hub's naming (what transformers 5 writes) and a text-only batch; the big ViT in the module naming
    with a tied head; each exported under its own names. Greedy (cached, uncached) and beam ``generate`` with
    left-padded prompts of two tiles and one: the same tokens, logits and scores within 1e-4."""
    cases = [("tp1", str(checkpoint), {}, str(tmp_path / "tp1"), {}),
             ("text_only", str(checkpoint), {}, None, {"batch": make_batch(TEXT_ROWS)}),
             ("big", str(big_vit), {}, str(tmp_path / "big"), {})]
    got = run_distributed(parity_and_generate, 1, cases, str(checkpoint), {"tp1": {}}, timeout=400)[0]
    results = got["parity"]
    check(results["tp1"], grads=GRADS["hub"])
    check(results["big"], grads=GRADS["big"])
    assert results["text_only"]["logit_diff"] < TOL and results["text_only"]["loss_diff"] < TOL
    for src, out in ((checkpoint, "tp1"), (big_vit, "big")):
        _check_round_trip(src, tmp_path / out, side_files=SIDE_FILES)
    hub, named = read_all(tmp_path / "tp1"), read_all(tmp_path / "big")
    assert "language_model.lm_head.weight" in hub and "vision_tower.embeddings.cls_token" in hub
    assert "model.vision_tower.encoder.layer.1.attention.q_norm.weight" in named
    assert not any("lm_head" in n for n in named)
    check_generate(got["generate"])


def test_parity_round_trip_and_generate_two_ranks(checkpoint, big_vit, tmp_path):
    """TP2 with sequence parallelism and the tower split over TP (q / k / v fused by heads); TP2 with the tower
    encoder-data-parallel and both components recomputed; PP2 (forward); CP2 (a tile spans chunks of both ranks;
    gradients summed over the CP ranks); the big ViT split over TP2 + SP (its q / k norms' mean square summed over
    the group). ``generate`` at TP2 + SP with the tower split."""
    cases = [(n, str(checkpoint), layout, str(tmp_path / n), {}) for n, layout in TWO_RANKS.items()]
    cases.append(("big_split_sp", str(big_vit), SPLIT_SP, str(tmp_path / "big_split_sp"), {}))
    per_rank = run_distributed(parity_and_generate, 2, cases, str(checkpoint), {"tp2_sp": SPLIT_SP}, timeout=600)
    for got in per_rank:
        results = got["parity"]
        for n, layout in TWO_RANKS.items():
            check(results[n], grads=GRADS["hub"] if layout.get("pipeline_parallel_size", 1) == 1 else None)
        check(results["big_split_sp"], grads=GRADS["big"])
        check_generate(got["generate"])
    parity = per_rank[0]["parity"]
    assert parity["tp2_sp_vision_tp2"]["vision_layout"] == parity["big_split_sp"]["vision_layout"] \
        == "tensor_parallel"
    assert parity["tp2_encoder_data_parallel"]["vision_layout"] == "data_parallel"
    for n in TWO_RANKS:
        _check_round_trip(checkpoint, tmp_path / n, side_files=SIDE_FILES)
    _check_round_trip(big_vit, tmp_path / "big_split_sp", side_files=SIDE_FILES)


def test_bad_configs_are_refused():
    """Each refusal raises from the bridge (the first thing ``from_pretrained`` builds, before any collective)."""
    from loongforge_hf.bridges.config_map import UnsupportedConfigError
    from loongforge_hf.bridges.internvl import InternVLBridge

    for top, vision, message in (({"vision_feature_layer": -2}, {}, "vision_feature_layer=-2 is not supported"),
                                 ({"vision_feature_select_strategy": "full"}, {}, "only 'default'"),
                                 ({"projector_hidden_act": "nope"}, {}, "projector_hidden_act='nope'"),
                                 ({"downsample_ratio": 0.4}, {}, "must be 1 / n for a whole n"),
                                 ({"downsample_ratio": 1 / 3}, {}, "dividing the 8x8 patch grid"),
                                 ({}, {"attention_dropout": 0.1}, "attention_dropout=0.1 is not supported"),
                                 ({}, {"hidden_dropout_prob": 0.1}, "hidden_dropout_prob=0.1 is not supported"),
                                 ({}, {"use_mask_token": True}, "use_mask_token=True is not supported"),
                                 ({}, {"norm_type": "batch_norm"}, "norm_type='batch_norm' is not supported"),
                                 ({}, {"patch_size": (7, 8)}, "must be square"),
                                 ({}, {"hidden_act": "nope"}, "hidden_act='nope'")):
        config = tiny_internvl_config()
        for k, value in top.items():
            setattr(config, k, value)
        for k, value in vision.items():
            setattr(config.vision_config, k, value)
        with pytest.raises(UnsupportedConfigError, match=message):
            InternVLBridge(config)
    with pytest.raises(UnsupportedConfigError, match="text_config.model_type='qwen3_moe' is not supported"):
        InternVLBridge(tiny_internvl_config(model_type="qwen3_moe"))


def test_collated_batches_train_as_transformers(checkpoint, tmp_path):
    """Samples through the tiny ``InternVLProcessor`` (pictures of other sizes cut into tiles and a thumbnail:
    1 + 3 + 1 tiles) through DataCollatorForImageText: logits as transformers' on the padded batch; packed (one row,
    2-D positions) as padded; LoongTrainer (ViT frozen) logs transformers.Trainer's three losses, and the frozen ViT
    comes out of save_model bit for bit while the projector moved."""
    got = run_distributed(collate_and_train, 1, str(checkpoint), str(tmp_path), timeout=400)[0]
    collated = got["collated"]
    assert collated["tiles"] == 5 and collated["packed_shape"][0] == 1 and len(collated["positions"]) == 2, collated
    assert collated["padded_diff"] < TOL and collated["packed_diff"] < 1e-5, collated
    assert len(got["loong"]) == len(got["hf"]) == 3
    assert got["loong"] == pytest.approx(got["hf"], rel=1e-4)
    src, out = read_all(checkpoint), read_all(tmp_path / "loong" / "final")
    moved = sorted(n for n in src if not torch.equal(src[n], out[n]))
    assert all(not n.startswith("vision_tower.") for n in moved), moved
    assert any(n.startswith("multi_modal_projector.") for n in moved), moved
