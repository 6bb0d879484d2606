"""Mistral 3 image-text (``Mistral3ForConditionalGeneration``: Pixtral ViT, patch-merging projector, Mistral decoder)
against transformers: logits, loss and vision gradients within 1e-4 (fp32; measured below 1e-6) with three images
of three sizes padded into one batch (``image_sizes``), in each layout of the vision tower and the language model;
both on-disk namings, bit-exact round trips; generate; refusals; the pure pieces (patches, rope) against
transformers' own."""

from pathlib import Path

import pytest
import torch

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing.round_trip import check_round_trip as _check_round_trip, read_all
from loongforge_hf.testing.tiny_vl import make_tiny_mistral3, tiny_mistral3_config

from ._vl_parity import TWO_RANKS
from ._vl_mistral3 import TEXT_ROWS, collate_and_train, compare_many, generate_both, generate_layouts, make_batch

TOL = 1e-4
# Ministral 3's text model (its hub checkpoints are Mistral 3 image-text ones): YaRN with an mscale ratio (attention
# factor 1.06) and Llama 4's query scale from position 64 on (not built: longer sequences refused)
MINISTRAL3 = {"model_type": "ministral3", "rope_parameters": {
    "rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0, "original_max_position_embeddings": 64,
    "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.5, "llama_4_scaling_beta": 0.1}}
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_tiny_mistral3(tmp_path_factory.mktemp("mistral3") / "src")


def check(result: dict, *, grads: bool) -> None:
    assert result["logits_shape"] == (2, 36, 204), result
    assert result["logit_diff"] < TOL and result["loss_diff"] < TOL, result
    if grads:  # NOTE: 2 x 9 block tensors, patch conv, ln_pre, projector norm, merger, linear_1, linear_2 (+ biases)
        assert result["grad_diff"] is not None and result["grad_diff"] < TOL and result["grads"] >= 24, result


def test_parity_and_round_trip_one_rank(checkpoint, tmp_path):
    """TP1 in the hub's naming (what transformers 5 writes), a text-only batch, and the module naming with a tied
    head and the projector's biases (``multimodal_projector_bias``); each exported under its own names. Ministral 3
    (``MINISTRAL3``): the same checks, and 65 positions refused by name."""
    modules = make_tiny_mistral3(tmp_path / "modules", naming="modules", projector_bias=True,
                                 tie_word_embeddings=True)
    ministral3 = make_tiny_mistral3(tmp_path / "ministral3", **MINISTRAL3)
    cases = [("tp1", str(checkpoint), {}, str(tmp_path / "tp1"), {}),
             ("text_only", str(checkpoint), {}, None, {"batch": make_batch(TEXT_ROWS)}),
             ("modules", str(modules), {}, str(tmp_path / "modules_out"), {}),
             ("ministral3", str(ministral3), {}, str(tmp_path / "ministral3_out"), {"refused_length": 65})]
    results = run_distributed(compare_many, 1, cases, timeout=400)[0]
    check(results["tp1"], grads=True)
    check(results["modules"], grads=True)
    check(results["ministral3"], grads=True)
    assert "llama_4_scaling_beta=0.1" in results["ministral3"]["refused"] and "'ministral3'" in \
        results["ministral3"]["refused"], results["ministral3"]["refused"]
    _check_round_trip(ministral3, tmp_path / "ministral3_out", side_files=SIDE_FILES)
    assert results["modules"]["grads"] == results["tp1"]["grads"] + 2, results
    assert results["text_only"]["logit_diff"] < TOL and results["text_only"]["loss_diff"] < TOL
    for src, out in ((checkpoint, "tp1"), (modules, "modules_out")):
        _check_round_trip(src, tmp_path / out, side_files=SIDE_FILES)
    hub, named = read_all(tmp_path / "tp1"), read_all(tmp_path / "modules_out")
    assert "language_model.lm_head.weight" in hub and "vision_tower.ln_pre.weight" in hub
    assert "model.multi_modal_projector.linear_1.bias" in named and not any("lm_head" in n for n in named)


def test_parity_and_round_trip_two_ranks(checkpoint, tmp_path):
    """TP2 with sequence parallelism and the tower split over TP (q / k / v fused by heads); TP2 with the tower
    encoder-data-parallel and both components recomputed; PP2 (forward); CP2 (an image spans chunks of both
    ranks; gradients summed over the CP ranks)."""
    cases = [(n, str(checkpoint), layout, str(tmp_path / n), {}) for n, layout in TWO_RANKS.items()]
    per_rank = run_distributed(compare_many, 2, cases, timeout=600)
    for results in per_rank:
        for n, layout in TWO_RANKS.items():
            check(results[n], grads=layout.get("pipeline_parallel_size", 1) == 1)
    assert per_rank[0]["tp2_sp_vision_tp2"]["vision_layout"] == "tensor_parallel"
    assert per_rank[0]["tp2_encoder_data_parallel"]["vision_layout"] == "data_parallel"
    for n in TWO_RANKS:
        _check_round_trip(checkpoint, tmp_path / n, side_files=SIDE_FILES)


def test_generate_matches_transformers(checkpoint):
    """Greedy with and without the KV cache and beam search (each row's images copied with it), left-padded prompts
    with images of three sizes: the same tokens, logits and scores within 1e-4."""
    got = run_distributed(generate_both, 1, str(checkpoint), {}, timeout=400)[0]
    for name, r in got.items():
        assert r["same_sequences"] and r["max_diff"] < TOL and r["steps"] >= 4, (name, r)


GENERATE_LAYOUTS = {"tp2_sp": {"tensor_parallel_size": 2, "sequence_parallel": True,
                               "vision_tensor_parallel_size": 2},
                    "pp2": {"pipeline_parallel_size": 2}, "cp2": {"context_parallel_size": 2}}


def test_generate_matches_transformers_two_ranks(checkpoint):
    """The same scenarios at TP2 + SP with the tower split, PP2 and CP2 (the cached prefill split over the CP ranks,
    an image across its chunks)."""
    per_rank = run_distributed(generate_layouts, 2, str(checkpoint), GENERATE_LAYOUTS, timeout=600)
    assert [sorted(got) for got in per_rank] == [sorted(GENERATE_LAYOUTS)] * 2, per_rank
    for got in per_rank:
        for layout, scenarios in got.items():
            for name, r in scenarios.items():
                assert r["same_sequences"] and r["max_diff"] < TOL and r["steps"] >= 4, (layout, name, r)


# ---- pure pieces ---------------------------------------------------------------------------------------------------

def test_patches_and_rope_match_transformers():
    """``as_image_patches`` through the patch matmul equals transformers' convolution cropped to ``image_sizes``;
    ``PixtralRotary`` equals ``PixtralVisionRotaryEmbedding`` (rows and columns on different frequencies)."""
    from transformers.models.pixtral.modeling_pixtral import PixtralVisionModel, PixtralVisionRotaryEmbedding

    from loongforge_hf.multimodal.vision import PatchEmbed
    from loongforge_hf.multimodal.vision_pixtral import PixtralRotary, as_image_patches

    config = tiny_mistral3_config().vision_config
    torch.manual_seed(0)
    ref = PixtralVisionModel(config).eval()
    pixels, sizes = torch.randn(2, 3, 32, 40), torch.tensor([[32, 24], [16, 40]])
    patches, grid = as_image_patches(pixels, config.patch_size, sizes)
    assert grid.tolist() == [[1, 8, 6], [1, 4, 10]]
    embed = PatchEmbed(config)
    embed.proj.weight.data.copy_(ref.patch_conv.weight)
    conv = ref.patch_conv(pixels)
    want = torch.cat([conv[0, :, :8, :6].flatten(1).t(), conv[1, :, :4, :10].flatten(1).t()])
    assert torch.allclose(embed(patches), want, atol=1e-5)
    positions = torch.stack(torch.meshgrid(torch.arange(5), torch.arange(7), indexing="ij"), -1).reshape(-1, 2)
    cos, sin = PixtralRotary(16, config.rope_parameters["rope_theta"])(positions)
    ref_cos, ref_sin = PixtralVisionRotaryEmbedding(config)(torch.zeros(1, dtype=torch.float32), positions)
    assert torch.allclose(cos, ref_cos, atol=1e-6) and torch.allclose(sin, ref_sin, atol=1e-6)
    with pytest.raises(ValueError, match="does not fit pixel_values"):
        as_image_patches(pixels, config.patch_size, torch.tensor([[36, 24], [16, 40]]))


def test_bad_configs_are_refused():
    from loongforge_hf.bridges.config_map import UnsupportedConfigError
    from loongforge_hf.bridges.mistral3_vl import Mistral3VLBridge

    for top, vision, message in (({"vision_feature_layer": -2}, {}, "vision_feature_layer=-2 is not supported"),
                                 ({"vision_feature_layer": [-1, -2]}, {}, "is not supported: only -1"),
                                 ({"projector_hidden_act": "nope"}, {}, "projector_hidden_act='nope'"),
                                 ({}, {"attention_dropout": 0.1}, "attention_dropout=0.1 is not supported"),
                                 ({}, {"rope_parameters": {"rope_type": "default", "rope_theta": 1.0}},
                                  "rope_type='default' is not supported"),
                                 ({}, {"num_attention_heads": 16}, "must be a whole head size divisible by 4")):
        config = tiny_mistral3_config()
        for k, value in top.items():
            setattr(config, k, value)
        for k, value in vision.items():
            setattr(config.vision_config, k, value)
        with pytest.raises(UnsupportedConfigError, match=message):
            Mistral3VLBridge(config)


def test_collated_batches_train_as_transformers(checkpoint, tmp_path):
    """Samples as Pixtral's processor gives them (each image at its own size, with ``image_sizes``) through
    DataCollatorForImageText: images padded to the largest, logits as transformers'; packed (one row, 2-D
    positions) as padded; LoongTrainer (ViT frozen) logs transformers.Trainer's three losses, and the frozen ViT
    comes out of save_model bit for bit while the projector moved."""
    got = run_distributed(collate_and_train, 1, str(checkpoint), str(tmp_path), timeout=400)[0]
    collated = got["collated"]
    assert collated["pixels"] == (3, 3, 32, 32) and collated["image_sizes"] == [[16, 32], [24, 24], [32, 32]], \
        collated
    assert collated["packed_shape"][0] == 1 and len(collated["positions"]) == 2, collated
    assert collated["padded_diff"] < TOL and collated["packed_diff"] < 1e-5, collated
    assert len(got["loong"]) == len(got["hf"]) == 3
    assert got["loong"] == pytest.approx(got["hf"], rel=1e-4)
    src, out = read_all(checkpoint), read_all(tmp_path / "loong" / "final")
    moved = sorted(n for n in src if not torch.equal(src[n], out[n]))
    assert all(not n.startswith("vision_tower.") for n in moved), moved
    assert any(n.startswith("multi_modal_projector.") for n in moved), moved
