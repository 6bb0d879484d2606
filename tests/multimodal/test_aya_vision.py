"""Aya Vision image-text (``AyaVisionForConditionalGeneration``: SigLIP ViT read at ``vision_feature_layer``, the
pixel-shuffle / LayerNorm / SwiGLU projector, a Cohere 2 decoder whose ``logit_scale`` transformers does not apply)
against transformers, one launch per world size:

- logits, loss and vision gradients within 1e-4 (fp32) on two rows (three images of 16 ``<image>`` tokens, one row
  right-padded): feature layer -2 (a block and ``post_layernorm`` unused) at TP1; the hub's -1 (the last block
  before ``post_layernorm``) at TP2 + SP with the tower split over TP, at PP2 (forward) and at CP2 (an image across
  the load-balanced chunks; gradients summed over the CP ranks); bit-exact round trips;
- LoRA against PEFT (``_vl_paligemma.LORA_CONFIGS``): the language model's linears at TP1, PP2 and CP2, PEFT's
  "all-linear" at TP1 and at TP2 + SP with the tower split (logits, loss, adapter gradients, the adapter folder in
  PEFT, the merged export in transformers: ``_vl_parity.check_lora_vs_peft``); a PEFT-written "all-linear" adapter
  loaded at PP2;
- greedy ``generate`` (cached and uncached, left-padded prompts) at TP1;
- the refusals, before any collective."""

import pytest

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing.round_trip import check_round_trip
from loongforge_hf.testing.tiny_aya_vision import make_tiny_aya_vision, tiny_aya_vision_config

from ._vl_aya_vision import checks
from ._vl_gemma3 import SCENARIOS
from ._vl_lora import check_peft_adapter
from ._vl_parity import check_lora_vs_peft

TOL = 1e-4
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")
# vision tensors with a gradient: patch conv (2), table, 16 per block run, projector (6)
GRADS = {"layer_-2": 3 + 2 * 16 + 6, "split": 3 + 3 * 16 + 6, "cp2": 3 + 3 * 16 + 6}
SPLIT_SP = {"tensor_parallel_size": 2, "sequence_parallel": True, "vision_tensor_parallel_size": 2}
PP2, CP2 = {"pipeline_parallel_size": 2}, {"context_parallel_size": 2}
# LoRA per world size: case -> (layout, _vl_paligemma.LORA_CONFIGS names); adapted linears per config (SigLIP's
# 3 x 6 and the projector's 2, the language model's 4 x 7), none trained whole; on the hub's feature layer -1
LORA_CASES = {1: {"tp1": ({}, ("language", "all_linear"))},
              2: {"pp2": (PP2, ("language",)), "cp2": (CP2, ("language",)), "split": (SPLIT_SP, ("all_linear",))}}
LORA_TARGETS, LORA_SAVED = {"language": (0, 28), "all_linear": (20, 28)}, {"language": 0, "all_linear": 0}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("aya_vision")
    return {"layer_-2": make_tiny_aya_vision(root / "layer_-2"),
            "layer_-1": make_tiny_aya_vision(root / "layer_-1", feature_layer=-1), "out": root / "out"}


@pytest.fixture(scope="module")
def one_rank(folders) -> dict:
    folder, out = str(folders["layer_-2"]), folders["out"]
    scenarios = {k: SCENARIOS[k] for k in ("greedy", "uncached")}
    return run_distributed(checks, 1, cases=[("layer_-2", folder, {}, f"{out}/layer_-2")],
                           generation=(folder, scenarios), timeout=600,
                           lora=(str(folders["layer_-1"]), f"{out}/lora", LORA_CASES[1]))[0]


@pytest.fixture(scope="module")
def two_ranks(folders) -> list:
    folder, out = str(folders["layer_-1"]), folders["out"]
    cases = [("split", folder, SPLIT_SP, f"{out}/split"), ("pp2", folder, PP2, f"{out}/pp2"),
             ("cp2", folder, CP2, None)]
    return run_distributed(checks, 2, cases=cases, lora=(folder, f"{out}/lora", LORA_CASES[2]),
                           peft_adapter=(folder, f"{out}/peft-pp2", PP2), timeout=600)


def check(result: dict, name: str) -> None:
    assert result["logits_shape"] == (2, 40, 204), result
    assert result["logit_diff"] < TOL and result["loss_diff"] < TOL, result
    if name != "pp2":  # NOTE: no vision gradients across pipeline stages
        assert result["grad_diff"] is not None and result["grad_diff"] < TOL and result["grads"] == GRADS[name], \
            result


def test_parity_round_trip_and_generate_one_rank(folders, one_rank):
    check(one_rank["layer_-2"], "layer_-2")
    check_round_trip(folders["layer_-2"], folders["out"] / "layer_-2", side_files=SIDE_FILES)
    got = one_rank["generate"]
    assert set(got) == {"greedy", "uncached"}, got
    for result in got.values():
        assert result["same_sequences"] and result["max_diff"] < TOL and result["steps"] >= 4, got


def test_parity_and_round_trip_tp2_sp_split_tower(folders, two_ranks):
    for rank in two_ranks:
        check(rank["split"], "split")
        assert rank["split"]["vision_layout"] == "tensor_parallel", rank["split"]
    check_round_trip(folders["layer_-1"], folders["out"] / "split", side_files=SIDE_FILES)


def test_parity_pp2_and_cp2(folders, two_ranks):
    for rank in two_ranks:
        check(rank["pp2"], "pp2")
        check(rank["cp2"], "cp2")
    check_round_trip(folders["layer_-1"], folders["out"] / "pp2", side_files=SIDE_FILES)


def test_lora_matches_peft(one_rank, two_ranks):
    for ranks, cases in (([one_rank], LORA_CASES[1]), (two_ranks, LORA_CASES[2])):
        check_lora_vs_peft(ranks, {case: names for case, (_, names) in cases.items()}, targets=LORA_TARGETS,
                           saved=LORA_SAVED, no_grads=("pp2",))


def test_peft_written_adapter_loads_at_pp2(two_ranks):
    """A PEFT-written "all-linear" adapter: ``from_pretrained`` of its folder, ``load_adapter``, ``disable_adapter``
    and ``merge_and_unload`` with PEFT's logits (``_vl_lora.check_peft_adapter``)."""
    for rank in two_ranks:
        check_peft_adapter(rank["peft_adapter"])


def test_bad_configs_are_refused():
    from loongforge_hf.bridges.aya_vision import AyaVisionBridge
    from loongforge_hf.bridges.config_map import UnsupportedConfigError

    for top, vision, text, message in (
            ({"vision_feature_select_strategy": "default"}, {}, {}, "vision_feature_select_strategy='default'"),
            ({"vision_feature_layer": [-1, -2]}, {}, {}, r"vision_feature_layer=\[-1, -2\]"),
            ({"vision_feature_layer": 4}, {}, {}, "vision_feature_layer=4"),
            ({"downsample_factor": 3}, {}, {}, "downsample_factor=3"),
            ({"alignment_intermediate_size": 95}, {}, {}, "alignment_intermediate_size=95"),
            ({}, {"vision_use_head": True}, {}, "vision_use_head=True"),
            ({}, {"attention_dropout": 0.1}, {}, "attention_dropout=0.1"),
            ({}, {"patch_size": 5}, {}, "patch_size=5"),
            ({}, {"model_type": "clip_vision_model"}, {}, "vision_config.model_type='clip_vision_model'"),
            ({}, {}, {"model_type": "llama"}, "text_config.model_type='llama'")):
        config = tiny_aya_vision_config()
        for obj, changes in ((config, top), (config.vision_config, vision), (config.text_config, text)):
            for k, value in changes.items():
                setattr(obj, k, value)
        with pytest.raises(UnsupportedConfigError, match=message):
            AyaVisionBridge(config)
