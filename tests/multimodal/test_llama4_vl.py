"""Llama 4 image-text (``Llama4ForConditionalGeneration``: Llama 4 ViT with 2-D rope, pixel-shuffle adapter, linear
projector, the Llama 4 MoE decoder) against transformers: logits, loss and vision gradients within 1e-4 (fp32) with
a picture cut into tiles and a one-tile picture in one batch, a text-only batch through ``lf.AutoModelForCausalLM``;
TP1, TP2 + SP with the tower split over TP or encoder data parallel, PP2, CP2; bit-exact round trips that
transformers loads back; greedy generate; LoRA against PEFT at TP1 (the routed experts and the router through
target_parameters too), and at TP2 + SP, EP2, TP2 + SP + EP2 in the two-rank world; refusals."""

from pathlib import Path

import pytest

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing.round_trip import check_round_trip, read_all
from loongforge_hf.testing.tiny_llama4_vl import make_tiny_llama4_vl, tiny_llama4_vl_config

from ._vl_llama4 import (LORA_LAYOUTS, LORA_PARAMS, LORA_SAVED, LORA_TARGETS, SPLIT_SP, TEXT_ROWS, make_batch,
                         world)
from ._vl_parity import check_generate, check_lora_vs_peft

TOL = 1e-4
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")
# vision tensors with a gradient: patch linear, class token, table, pre-norm (2), 2 x 16 block tensors, post-norm
# (2), the adapter's fc1 / fc2, the projector's linear_1
GRADS = 42
# the two-rank layouts (``_vl_parity.TWO_RANKS``' with sequence parallelism wherever TP2 meets the MoE decoder)
TWO_RANKS = {"tp2_split_sp": SPLIT_SP,
             "tp2_sp_encoder_data_parallel": {"tensor_parallel_size": 2, "sequence_parallel": True,
                                              "vision_data_parallel": True, "vision_recompute": True,
                                              "language_recompute": True},
             "pp2": {"pipeline_parallel_size": 2}, "cp2": {"context_parallel_size": 2}}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_tiny_llama4_vl(tmp_path_factory.mktemp("llama4_vl") / "src")


def check(result: dict, *, grads: bool = True) -> None:
    assert result["logits_shape"] == (2, 40, 206), result
    assert result["logit_diff"] < TOL and result["loss_diff"] < TOL, result
    if grads:
        assert result["grad_diff"] is not None and result["grad_diff"] < TOL and result["grads"] == GRADS, result


@pytest.fixture(scope="module")
def one_rank(checkpoint, tmp_path_factory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("llama4_vl_one_rank")
    cases = [("tp1", str(checkpoint), {}, str(out / "tp1"), {}),
             ("text_only", str(checkpoint), {}, None,
              {"batch": make_batch(TEXT_ROWS), "auto_class": "AutoModelForCausalLM"})]
    return run_distributed(world, 1, cases, str(checkpoint), {"tp1": {}}, str(out / "tp1"), str(out / "lora"),
                           timeout=400)[0], out


def test_parity_round_trip_and_generate_one_rank(checkpoint, one_rank):
    """TP1: 4 tiles (a 2x1-tiled picture with its global view, a one-tile picture) as transformers; a text-only batch
    through ``lf.AutoModelForCausalLM`` (the image-text model, as transformers' auto class loads the checkpoint);
    the export bit-exact, transformers' logits from it equal; greedy ``generate`` with left-padded prompts: the same
    tokens, logits within 1e-4."""
    got, tmp_path = one_rank
    results = got["parity"]
    check(results["tp1"])
    text = results["text_only"]
    assert text["class"] == "LoongModelForImageTextToText", text
    assert text["logit_diff"] < TOL and text["loss_diff"] < TOL, text
    check_round_trip(checkpoint, tmp_path / "tp1", side_files=SIDE_FILES)
    assert got["reloaded_diff"] == 0.0
    names = read_all(tmp_path / "tp1")
    assert "vision_model.vision_adapter.mlp.fc1.weight" in names and "language_model.lm_head.weight" in names
    check_generate(got["generate"])


def test_lora_matches_peft(one_rank):
    """PEFT's "all-linear" (router and patch linear left out; LM head and final norm whole) at TP1 with random
    adapters against PEFT on transformers' model: trainable counts, logits and loss within 1e-5, the 15 tower and 28
    language adapters' gradients within 5e-5 of their largest entry, the saved adapter's logits in PEFT, the merged
    export's in transformers. PEFT's ``target_parameters`` on the routed experts' stacks and the router
    (``language_model.model.layers.N.feed_forward...``; PEFT's A / B the other way round on Llama 4's ``[E, in, out]``
    stacks) with q / v of both towers: the same checks, the 6 parameter adapters' gradients within 2e-5."""
    check_lora_vs_peft([one_rank[0]], {"tp1": LORA_LAYOUTS["tp1"][1]}, targets=LORA_TARGETS, saved=LORA_SAVED,
                       params=LORA_PARAMS)


@pytest.fixture(scope="module")
def two_ranks(checkpoint, tmp_path_factory) -> tuple[list, Path]:
    out = tmp_path_factory.mktemp("llama4_vl_two_ranks")
    cases = [(n, str(checkpoint), layout, str(out / n), {}) for n, layout in TWO_RANKS.items()]
    lora = tuple(n for n in LORA_LAYOUTS if n != "tp1")
    return run_distributed(world, 2, cases, str(checkpoint), {}, None, str(out / "lora"), lora, timeout=600), out


def test_parity_and_round_trip_two_ranks(checkpoint, two_ranks):
    """TP2 with sequence parallelism and the tower split over TP (q / k / v fused by heads); TP2 + SP with the tower
    encoder-data-parallel and both components recomputed; PP2 (forward); CP2 (the tiled picture spans both ranks'
    chunks; gradients summed over the CP ranks); each exported bit for bit."""
    per_rank, tmp_path = two_ranks
    for got in per_rank:
        results = got["parity"]
        for n, layout in TWO_RANKS.items():
            check(results[n], grads=layout.get("pipeline_parallel_size", 1) == 1)
        assert results["tp2_split_sp"]["vision_layout"] == "tensor_parallel"
        assert results["tp2_sp_encoder_data_parallel"]["vision_layout"] == "data_parallel"
    for n in TWO_RANKS:
        check_round_trip(checkpoint, tmp_path / n, side_files=SIDE_FILES)


def test_lora_matches_peft_two_ranks(two_ranks):
    """``test_lora_matches_peft``'s checks beyond TP1: "all-linear" at TP2 + SP with the tower split (each rank's
    slices of the language adapters' gradients, the tower's adapters split by heads / rows); the routed experts'
    stacks and the router through ``target_parameters`` at TP2 + SP + the tower split with
    expert_tensor_parallel_size=1, at EP2 (each rank its two experts' adapters) and at TP2 + SP + EP2; the same
    config with expert_tensor_parallel_size left at TP's 2 refused by name, the model untouched."""
    per_rank, _ = two_ranks
    check_lora_vs_peft(per_rank, {n: names for n, (_, names) in LORA_LAYOUTS.items() if n != "tp1"},
                       targets=LORA_TARGETS, saved=LORA_SAVED, params=LORA_PARAMS)
    for got in per_rank:
        message, untouched = got["lora"]["refused"]
        assert message.startswith("LoRA on the routed experts needs them whole on each rank: pass "
                                  "expert_tensor_parallel_size=1 (got 2;") and untouched, got["lora"]["refused"]


def test_bad_configs_are_refused():
    """Each refusal raises from the bridge (the first thing ``from_pretrained`` builds, before any collective)."""
    from loongforge_hf.bridges.config_map import UnsupportedConfigError
    from loongforge_hf.bridges.llama4_vl import Llama4VLBridge

    for vision, message in (({"attention_dropout": 0.1}, "attention_dropout=0.1 is not supported"),
                            ({"projector_dropout": 0.1}, "projector_dropout=0.1 is not supported"),
                            ({"pixel_shuffle_ratio": 0.4}, "must be 1 / n for a whole n"),
                            ({"pixel_shuffle_ratio": 0.25}, "dividing the 6x6 patch grid"),
                            ({"patch_size": (4, 3)}, "must be square"),
                            ({"image_size": 26}, "must be a multiple of patch_size"),
                            ({"intermediate_size": 96}, "intermediate_size=96 must be"),
                            ({"vision_output_dim": 40}, "vision_output_dim=40 equal"),
                            ({"num_attention_heads": 16}, "must be a whole head size divisible by 4")):
        config = tiny_llama4_vl_config()
        for k, value in vision.items():
            setattr(config.vision_config, k, value)
        with pytest.raises(UnsupportedConfigError, match=message):
            Llama4VLBridge(config)
    with pytest.raises(UnsupportedConfigError, match="num_experts_per_tok=2 is not supported"):
        Llama4VLBridge(tiny_llama4_vl_config(num_experts_per_tok=2))
