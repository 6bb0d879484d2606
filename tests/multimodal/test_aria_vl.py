"""Aria image-text (``AriaForConditionalGeneration``: Idefics3's ViT read at ``vision_feature_layer``, the learned-query
cross-attention projector, Aria's MoE decoder) against transformers, in one 2-rank launch:

- logits, loss and vision gradients within 1e-4 (fp32) on two rows (three 28x28 tiles of 4 ``<image>`` tokens, two
  of them padded as Aria's processor pads pictures, their ``pixel_mask`` given; one row right-padded): feature layer
  -2 (a block and ``post_layernorm`` unused) with the language model at TP1 (two data-parallel ranks); the hub's -1
  at TP2 + SP with the tower split over TP, at CP2 (gradients summed over the CP ranks), at EP2, at TP2 + SP
  with the tiles shared out over the TP ranks (encoder data parallel) and at PP2 (forward); bit-exact round trips
  of the TP1 and TP2 exports, which transformers loads with equal logits;
- LoRA against PEFT at TP1 (q / v of the language model, the ViT and the projector's cross-attention: logits, loss,
  adapter gradients, the adapter folder in PEFT, the merged export in transformers); "all-linear" refused by name;
- ``generate`` on left-padded prompts of 56x56 tiles (8 ``<image>`` tokens each): greedy (cached) at TP2 + SP,
  beams and greedy without cache at TP1, sequences equal and logits / scores within 1e-4;
- the input refusals (a mask that is no top-left rectangle, a tile size without queries) and that the mask matters
  (transformers' logits change without it); the config refusals, before any collective; the processor's tiles and
  masks (a 300x900 picture padded into a 490-pixel tile) and the collator keeping ``pixel_mask``; TRL's online
  trainers refused (they would drop ``pixel_mask``)."""

import pytest
import torch

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing.round_trip import check_round_trip
from loongforge_hf.testing.tiny_aria_vl import QUERIES, make_tiny_aria_vl, tiny_aria_vl_config

from ._vl_aria import checks
from ._vl_gemma3 import SCENARIOS
from ._vl_parity import check_lora_vs_peft

TOL = 1e-4
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")
# vision tensors with a gradient: patch conv (2), table, 16 per block run, projector (18)
GRADS = {"layer_-2": 3 + 2 * 16 + 18, **{name: 3 + 3 * 16 + 18 for name in ("split", "cp2", "ep2", "encoder_dp")}}
SPLIT_SP = {"tensor_parallel_size": 2, "sequence_parallel": True, "vision_tensor_parallel_size": 2}
MORE = {"cp2": {"context_parallel_size": 2}, "ep2": {"expert_parallel_size": 2}, "pp2": {"pipeline_parallel_size": 2},
        "encoder_dp": {"tensor_parallel_size": 2, "sequence_parallel": True, "vision_data_parallel": True}}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("aria_vl")
    return {"layer_-2": make_tiny_aria_vl(root / "layer_-2", feature_layer=-2),
            "layer_-1": make_tiny_aria_vl(root / "layer_-1"), "out": root / "out"}


@pytest.fixture(scope="module")
def two_ranks(folders) -> list:
    minus1, minus2, out = str(folders["layer_-1"]), str(folders["layer_-2"]), folders["out"]
    cases = [("layer_-2", minus2, {}, f"{out}/layer_-2"), ("split", minus1, SPLIT_SP, f"{out}/split"),
             *((name, minus1, layout, None) for name, layout in MORE.items())]
    generation = [(minus1, SPLIT_SP, {"greedy": SCENARIOS["greedy"]}),
                  (minus1, {}, {k: SCENARIOS[k] for k in ("beam", "uncached")})]
    return run_distributed(checks, 2, cases=cases, generation=generation, refusals=minus1,
                           lora=(minus1, f"{out}/lora"), timeout=600)


def check(result: dict, name: str) -> None:
    assert result["logits_shape"] == (2, 20, 204), result
    assert result["logit_diff"] < TOL and result["loss_diff"] < TOL, result
    if name != "pp2":  # NOTE: no vision gradients across pipeline stages
        assert result["grad_diff"] is not None and result["grad_diff"] < TOL and result["grads"] == GRADS[name], \
            result


@pytest.mark.parametrize("name", ["layer_-2", "split"])
def test_parity_and_round_trip(folders, two_ranks, name):
    for rank in two_ranks:
        check(rank[name], name)
    assert two_ranks[0]["split"]["vision_layout"] == "tensor_parallel", two_ranks[0]["split"]
    source = folders["layer_-1" if name == "split" else name]
    check_round_trip(source, folders["out"] / name, side_files=SIDE_FILES)


def test_parity_cp2_ep2_pp2_encoder_data_parallel(two_ranks):
    for rank in two_ranks:
        for name in MORE:
            check(rank[name], name)
        assert rank["encoder_dp"]["vision_layout"] == "data_parallel", rank["encoder_dp"]


def test_exports_reload_in_transformers_with_equal_logits(two_ranks):
    for rank in two_ranks:
        assert rank["reloaded"] == {"layer_-2": True, "split": True}, rank["reloaded"]


def test_lora_matches_peft_and_all_linear_is_refused(two_ranks):
    """q / v adapters on the language model (2 layers), the ViT (3 blocks) and the projector's cross-attention
    against PEFT (``_vl_parity.check_lora_vs_peft``); "all-linear" reaches the projector's
    ``nn.MultiheadAttention.out_proj``, which that module's forward uses as a weight, not as a module: refused by
    name (PEFT's adapter there would not enter the forward either)."""
    check_lora_vs_peft(two_ranks, {"tp1": ("qv",)}, targets={"qv": (8, 4)}, saved={"qv": 0})
    for rank in two_ranks:
        refused = rank["lora"]["all_linear"]
        assert refused.startswith("LoraConfigError") and "multihead_attn.out_proj" in refused, refused


def test_generate_with_images(two_ranks):
    for rank in two_ranks:
        got = rank["generate"]
        assert set(got) == {"greedy", "beam", "uncached"}, got
        for result in got.values():
            assert result["same_sequences"] and result["max_diff"] < TOL and result["steps"] >= 4, got


def test_pixel_mask_matters_and_bad_masks_are_refused(two_ranks):
    for rank in two_ranks:
        assert rank["mask_matters"] > 1e-3, rank["mask_matters"]
        assert "ValueError" in rank["refusals"]["hole"] and "top-left rectangle" in rank["refusals"]["hole"], rank
        assert "ValueError" in rank["refusals"]["odd"] and "projector_patch_to_query_dict" in rank["refusals"]["odd"]


def test_tile_patches_drop_padding():
    """The real patches of a padded tile, row-major, and its (tile patches, h, w) row; without a mask the whole tile."""
    from loongforge_hf.multimodal.vision_aria import query_counts, tile_patches

    pixels = torch.randn(2, 3, 28, 28)
    mask = torch.zeros(2, 28, 28, dtype=torch.bool)
    mask[0], mask[1, :15, :8] = True, True  # NOTE: a partly real patch is real: 3 rows, 2 columns
    patches, grid = tile_patches(pixels, mask, patch=7, queries=QUERIES)
    assert grid.tolist() == [[16, 4, 4], [16, 3, 2]] and patches.shape == (16 + 6, 3 * 49)
    assert torch.equal(patches[16 + 3], pixels[1, :, 7:14, 7:14].reshape(-1))  # NOTE: row 1, column 1
    assert query_counts(grid, QUERIES).tolist() == [4, 4]
    whole, grid = tile_patches(pixels, None, patch=7, queries=QUERIES)
    assert grid.tolist() == [[16, 4, 4]] * 2 and torch.equal(whole[:16], patches[:16])


def test_processor_tiles_and_collator(folders):
    """Aria's processor pads a 300x900 picture into a 490-pixel tile (resized to 336 x 490, its shortest side at
    ``min_image_size``), its real pixels top-left: 24 x 35 real patches of the tile's 1225, 128 ``<image>`` tokens;
    the collator (``from_processor``) keeps each sample's ``pixel_mask``."""
    import numpy as np

    from loongforge_hf.integrations.vl_collator import DataCollatorForImageText
    from loongforge_hf.multimodal.vision_aria import tile_patches
    from loongforge_hf.testing.tiny_aria_vl import aria_processor_for

    processor = aria_processor_for(folders["layer_-1"])
    rng = np.random.RandomState(0)
    samples = [dict(processor(text=[f"tok5 <image> tok{6 + i}"], return_tensors="pt", max_image_size=490,
                              images=[[rng.randint(0, 256, size, dtype=np.uint8)]]))
               for i, size in enumerate(((300, 900, 3), (490, 490, 3)))]
    patches, grid = tile_patches(samples[0]["pixel_values"], samples[0]["pixel_mask"], patch=14,
                                 queries={1225: 128, 4900: 256})
    assert grid.tolist() == [[1225, 24, 35]] and patches.shape == (24 * 35, 3 * 14 * 14)
    assert int((samples[0]["input_ids"] == processor.image_token_id).sum()) == 128
    batch = DataCollatorForImageText.from_processor(processor)(samples)
    assert torch.equal(batch["pixel_mask"], torch.cat([s["pixel_mask"] for s in samples]))
    assert batch["pixel_values"].shape == (2, 3, 490, 490) and batch["input_ids"].shape[0] == 2


def test_online_trainers_refuse_aria():
    """TRL's online trainers (GRPO, RLOO: ``trl_online.vision_rows``) would drop ``pixel_mask``: refused by name."""
    from types import SimpleNamespace

    from loongforge_hf.bridges.aria_vl import AriaVLBridge
    from loongforge_hf.integrations.trl_online import vision_problems

    model = SimpleNamespace(vision_layout="replicated", bridge=AriaVLBridge(tiny_aria_vl_config()))
    problems = vision_problems(model, None, None)
    assert len(problems) == 1 and problems[0].startswith("AriaForConditionalGeneration") and "pixel_mask" in \
        problems[0], problems


def test_bad_configs_are_refused():
    from loongforge_hf.bridges.aria_vl import AriaVLBridge
    from loongforge_hf.bridges.config_map import UnsupportedConfigError

    for top, vision, text, message in (
            ({"vision_feature_layer": [-1, -2]}, {}, {}, r"vision_feature_layer=\[-1, -2\]"),
            ({"vision_feature_layer": 4}, {}, {}, "vision_feature_layer=4"),
            ({"projector_patch_to_query_dict": {16: 0}}, {}, {}, "projector_patch_to_query_dict"),
            ({}, {"attention_dropout": 0.1}, {}, "attention_dropout=0.1"),
            ({}, {"patch_size": 5}, {}, "patch_size=5"),
            ({}, {"model_type": "siglip_vision_model"}, {}, "vision_config.model_type='siglip_vision_model'"),
            ({}, {}, {"model_type": "llama"}, "text_config.model_type='llama'"),
            ({}, {}, {"hidden_act": "gelu"}, "hidden_act='gelu'")):
        config = tiny_aria_vl_config()
        for obj, changes in ((config, top), (config.vision_config, vision), (config.text_config, text)):
            for k, value in changes.items():
                setattr(obj, k, value)
        with pytest.raises(UnsupportedConfigError, match=message):
            AriaVLBridge(config)
