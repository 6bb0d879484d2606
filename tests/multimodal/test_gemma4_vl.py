"""Gemma 4 as the hub publishes it (``Gemma4ForConditionalGeneration``: the text model, a vision tower, an audio tower
and their embedders) on text-only batches against transformers' own class (which its ``AutoModelForCausalLM``
gives), fp32 within 1e-4 on a tiny checkpoint (``testing/tiny_gemma4_vl.py``: the Gemma 4 31B-like text model of
test_gemma4.py). One one-rank world: ``lf.AutoModelForCausalLM`` and ``lf.AutoModelForImageTextToText`` (logits,
loss, ``logits_to_keep``, the whole folder exported bit for bit, towers included), a checkpoint without the audio
tower, every gradient (the towers' none, as transformers': their tensors come back unchanged), greedy generate,
three LoongTrainer steps against transformers.Trainer (the towers untouched in the saved model), the refused
inputs (videos, audio, placeholder ids without their input, patches without image_position_ids) by name, and images
through the vision tower (logits, loss, every vision tower / embedder gradient, greedy generate, the export). One
two-rank world: TP2 with sequence parallelism and PP2, logits, loss and bit-exact exports; images at TP2 + SP."""

import pytest

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing.round_trip import check_round_trip, read_all
from loongforge_hf.testing.tiny_gemma4_vl import make_tiny_gemma4_vl

from ._vl_gemma4 import one_rank as _one_rank, two_ranks as _two_ranks

TOL = 1e-4
LAYOUTS = {"tp2_sp": {"tensor_parallel_size": 2, "sequence_parallel": True}, "pp2": {"pipeline_parallel_size": 2}}
TOWERS = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.")
VISION = ("model.vision_tower.", "model.embed_vision.")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(make_tiny_gemma4_vl(tmp_path_factory.mktemp("gemma4_vl") / "src"))


@pytest.fixture(scope="module")
def no_audio(tmp_path_factory):
    return str(make_tiny_gemma4_vl(tmp_path_factory.mktemp("gemma4_vl_no_audio") / "src", audio=False))


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """E2B / E4B's text model shrunk (tests/bridges/test_gemma4.py's ``SMALL``, its per-layer table over the ids of
    the special tokens too) under the image-text model; without the double-wide MLPs (tested on the text model):
    with them this tiny random model amplifies fp32 rounding of the image path past 1e-4 (a 1e-7 relative change of
    transformers' image embedder moves its own logits by 6e-5; theirs are 2e-5 off fp64, ours 1.1e-4)."""
    from tests.bridges.test_gemma4 import SMALL

    return str(make_tiny_gemma4_vl(tmp_path_factory.mktemp("gemma4_vl_small") / "src", audio=False,
                                   **{**SMALL, "vocab_size_per_layer_input": 210, "use_double_wide_mlp": False}))


@pytest.fixture(scope="module")
def one_rank(folder, no_audio, small, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("gemma4_vl_one"))
    return {**run_distributed(_one_rank, 1, folder, no_audio, out, small, timeout=400)[0], "out": out}


@pytest.fixture(scope="module")
def two_ranks(folder, small, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("gemma4_vl_two"))
    return {**run_distributed(_two_ranks, 2, folder, out, LAYOUTS, small, timeout=400)[0], "out": out}


@pytest.mark.parametrize("case", ["tp1", "image_text", "no_audio"])
def test_text_logits_loss_and_whole_export(one_rank, folder, no_audio, case):
    r = one_rank[case]
    assert r["class"] == "LoongModelForImageTextToText" and r["ref_class"] == "Gemma4ForConditionalGeneration", r
    assert r["logit_diff"] < TOL and r["loss_diff"] < TOL and r["keep_diff"] < TOL and r["tower"] is not None, r
    src = no_audio if case == "no_audio" else folder
    check_round_trip(src, f"{one_rank['out']}/{case}")
    carried = [n for n in read_all(src) if n.startswith(TOWERS)]
    assert any(n.startswith("model.vision_tower.") for n in carried), carried
    assert any(n.startswith("model.audio_tower.") for n in carried) == (case != "no_audio"), carried


def test_gradients_and_untouched_towers(one_rank):
    """Text only: every language model gradient, the carried audio tower's none (its tensors come back unchanged).
    The vision tower's are checked with images (test_images_...): here transformers gives None, which the helper
    reads as "unchanged", and ours an exact zero (the no-image micro-batch's zero term, ``chunk.embed``)."""
    grads = one_rank["grads"]
    assert not grads["missing"], grads["missing"]
    checked = {n: d for n, d in grads["diffs"].items() if not n.startswith(VISION)}
    assert max(checked.values()) < TOL, checked
    towers = [n for n in checked if n.startswith(TOWERS)]
    assert towers and "model.language_model.layers.1.self_attn.k_proj.weight" in checked, sorted(checked)


def test_small_model_with_images(one_rank, small):
    """E2B / E4B's text model under images: the placeholders looked up as padding in the per-layer table, the
    projection over the embeddings with images in place (logits, loss, the export bit for bit) and greedy generate
    with the KV cache (the shared keys and values), as transformers'."""
    r = one_rank["small_images"]
    assert r["logit_diff"] < TOL and r["loss_diff"] < TOL, r
    check_round_trip(small, f"{one_rank['out']}/small_images")
    r = one_rank["small_image_generate"]
    assert r["same"] and r["diff"] < TOL, r


def test_greedy_generate(one_rank):
    r = one_rank["generate"]
    assert r["same"] and r["diff"] < TOL, r


def test_images_logits_loss_vision_gradients_and_export(one_rank, folder):
    """Images through the vision tower: logits and loss as transformers' (the bidirectional image blocks of its
    sliding layers matter: without mm_token_type_ids transformers' logits move), every vision tower / embedder
    gradient, the export bit for bit."""
    r = one_rank["images"]
    assert r["logit_diff"] < TOL and r["loss_diff"] < TOL and r["blocks_matter"] > 1e-2, r
    assert r["grads"] == 29 and not r["grad_names"] and r["grad_diff"] < TOL, r
    check_round_trip(folder, f"{one_rank['out']}/images")


def test_images_greedy_generate(one_rank):
    r = one_rank["image_generate"]
    assert r["same"] and r["diff"] < TOL, r


def test_images_tp2_sequence_parallel(two_ranks, folder):
    r = two_ranks["images_tp2_sp"]
    assert r["logit_diff"] < TOL and r["loss_diff"] < TOL, r
    check_round_trip(folder, f"{two_ranks['out']}/images_tp2_sp")


@pytest.mark.parametrize("case", ["images_cp2", "small_images_cp2"])
def test_images_context_parallel(two_ranks, folder, small, case):
    """CP2 with images whose bidirectional blocks cross the two ranks' chunks, the full model and E2B / E4B's text
    model (per-layer inputs, shared KV): logits, loss, every vision tower / embedder gradient (summed over the CP
    ranks, as DDP does) as transformers', the export bit for bit."""
    r = two_ranks[case]
    assert r["logit_diff"] < TOL and r["loss_diff"] < TOL and r["blocks_matter"] > 1e-2, r
    assert r["grads"] == 29 and not r["grad_names"] and r["grad_diff"] < TOL, r
    check_round_trip(small if case.startswith("small") else folder, f"{two_ranks['out']}/{case}")


def test_loong_trainer_text_only(one_rank, folder):
    got = one_rank["train"]
    assert len(got["loong"]) == len(got["hf"]) == 3, got
    assert max(abs(a - b) for a, b in zip(got["loong"], got["hf"])) < 1e-4, got
    src, saved = read_all(folder), read_all(f"{one_rank['out']}/loong/final")
    assert sorted(src) == sorted(saved)
    for name, value in src.items():
        if name.startswith(TOWERS):
            assert saved[name].equal(value), name
    assert not saved["model.language_model.embed_tokens.weight"].equal(src["model.language_model.embed_tokens.weight"])


@pytest.mark.parametrize("name, match", [
    ("pixel_values", "need image_position_ids"), ("image_placeholder", "input_ids hold image_token_id=207"),
    ("pixel_values_videos", "pixel_values_videos \\(videos\\)"), ("input_features", "input_features \\(audio\\)"),
    ("placeholder", "input_ids hold audio_token_id=208")])
@pytest.mark.parametrize("how", ["forward", "generate"])
def test_refused_inputs_by_name(one_rank, name, match, how):
    import re

    got = one_rank["refusals"][f"{how}/{name}"]
    assert got.startswith("ValueError") and re.search(match, got), got


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_parallel_layouts(two_ranks, folder, layout):
    r = two_ranks[layout]
    assert r["logit_diff"] < TOL and r["loss_diff"] < TOL and r["keep_diff"] < TOL, r
    check_round_trip(folder, f"{two_ranks['out']}/{layout}")


def test_bridge_refusals_before_any_collective():
    """The text model's refusals and layout checks hold for the published checkpoint (from the bridge alone, as
    from_pretrained makes it before any collective); the causal-LM registry points to the image-text class."""
    import re

    from loongforge_hf.bridges import UnsupportedConfigError, get_bridge
    from loongforge_hf.bridges.qwen2_5_vl import get_vl_bridge
    from loongforge_hf.bridges.registry import UnsupportedArchitectureError
    from loongforge_hf.parallel.config import ParallelConfig
    from loongforge_hf.testing.tiny_gemma4_vl import tiny_gemma4_vl_config

    small = get_vl_bridge(tiny_gemma4_vl_config(hidden_size_per_layer_input=8))  # NOTE: E2B / E4B's text model
    assert small.image_token_id in small.text.placeholder_ids
    small.check_layout(ParallelConfig(context_parallel_size=2))  # NOTE: run in test_images_context_parallel
    small.check_layout(ParallelConfig(pipeline_parallel_size=2))  # NOTE: run in tests/bridges/test_gemma4.py
    shared = get_vl_bridge(tiny_gemma4_vl_config(hidden_size_per_layer_input=8, num_kv_shared_layers=2))
    with pytest.raises(UnsupportedConfigError, match=re.escape(
            "pipeline_parallel_size=2 is not supported for Gemma4ForConditionalGeneration: layers [2, 3] reuse")):
        shared.check_layout(ParallelConfig(pipeline_parallel_size=2))
    with pytest.raises(UnsupportedConfigError, match="num_global_key_value_heads=2"):
        get_vl_bridge(tiny_gemma4_vl_config()).check_layout(ParallelConfig(tensor_parallel_size=4))
    with pytest.raises(UnsupportedArchitectureError, match="lf.AutoModelForImageTextToText"):
        get_bridge(tiny_gemma4_vl_config())
