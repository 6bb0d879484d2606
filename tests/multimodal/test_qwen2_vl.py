"""Qwen2-VL against transformers' ``Qwen2VLForConditionalGeneration``: logits, loss and vision gradients within 1e-4
(fp32) on images of different sizes and on a hand-built video batch (``second_per_grid_ts`` given and ignored, as
transformers ignores it), in each layout of the vision tower and the language model; bit-exact HF round trips in
both namings; greedy ``generate`` (cached and uncached) against transformers'; LoongTrainer against
transformers.Trainer; "all-linear" LoRA (the tower's ``fc1`` / ``fc2`` included) against PEFT; the tower and the
3-D positions against transformers' own code; refusals."""

from pathlib import Path

import pytest
import torch

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing.round_trip import check_round_trip as _check_round_trip, read_all
from loongforge_hf.testing.tiny_vl import make_tiny_qwen2_vl, tiny_qwen2_vl_config

from ._vl_features import compare_videos
from ._vl_parity import TWO_RANKS, compare_many, train_both
from .test_qwen2_5_vl import SIDE_FILES, nested_naming_copy

TOL = 1e-4
GEN_ATOL = 1e-5  # NOTE: fp32 greedy scores
# ViT blocks x (qkv, attn.proj, fc1, fc2) + the merger's mlp.0 and mlp.2 (tiny_vl: depth 2)
TOWER_TARGETS = 2 * 4 + 2


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_tiny_qwen2_vl(tmp_path_factory.mktemp("qwen2_vl") / "src")


def check(result: dict, *, grads: bool) -> None:
    assert result["logits_shape"] == (*result["batch_shape"], 204), result
    assert result["logit_diff"] < TOL, result
    assert result["loss_diff"] < TOL, result
    if grads:
        assert result["grad_diff"] is not None and result["grad_diff"] < TOL, result


def check_videos(r: dict) -> None:
    assert r["same_grad_names"] and r["shape"] == (*r["batch_shape"], 204), r
    assert r["logit_diff"] < TOL and r["loss_diff"] < TOL and r["grad_diff"] < TOL, r


def check_round_trip(src, dst):
    _check_round_trip(src, dst, side_files=SIDE_FILES)


def greedy_against_transformers(folder: str) -> dict:
    """Greedy generate (scores) on the image batch and the video batch: ours cached and uncached, transformers'."""
    import transformers

    import loongforge_hf as lf

    from ._vl_generate import SCENARIOS, prompt_batch, run_scenarios, video_batch

    greedy = {"greedy": SCENARIOS["greedy"]}
    ref = transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    model = lf.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    out = {}
    for name, batch in (("images", prompt_batch(folder)), ("videos", video_batch(folder))):
        out[name] = {"ref": run_scenarios(ref, batch, greedy)["greedy"],
                     "cached": run_scenarios(model, batch, greedy)["greedy"],
                     "uncached": run_scenarios(model, batch, greedy, use_cache=False)["greedy"]}
    return out


def seconds_ignored(folder: str) -> float:
    """Our logits on the video batch with ``second_per_grid_ts`` (1.5 s and 0.5 s) against without: the largest
    difference (transformers' Qwen2-VL ignores them too)."""
    import loongforge_hf as lf

    from ._vl_features import collator, hand_features

    model = lf.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    timed, plain = (collator(folder)(hand_features(folder, seconds=s)) for s in (True, False))
    assert "second_per_grid_ts" in timed and "second_per_grid_ts" not in plain
    with torch.no_grad():
        return (model(**timed).logits - model(**plain).logits).abs().max().item()


def _one_rank(folder: str, tied: str, nested: str, out_dir: str) -> dict:
    from ._vl_lora import model_checks

    cases = [(name, src, {}, f"{out_dir}/{name}") for name, src in (("tp1", folder), ("tied", tied),
                                                                    ("nested", nested))]
    out = compare_many(cases)
    out["videos"] = compare_videos(folder, {})
    out["seconds_ignored"] = seconds_ignored(folder)
    out["generate"] = greedy_against_transformers(folder)
    out["lora"] = model_checks(folder, f"{out_dir}/lora", {}, "all_linear")
    out["trainer"] = train_both(folder, f"{out_dir}/train")
    return out


@pytest.fixture(scope="module")
def one_rank(checkpoint, tmp_path_factory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("qwen2_vl_one")
    tied = make_tiny_qwen2_vl(out / "tied_src", tie_word_embeddings=True)
    nested = nested_naming_copy(checkpoint, out / "nested_src")
    return run_distributed(_one_rank, 1, str(checkpoint), str(tied), str(nested), str(out), timeout=500)[0], out


def test_parity_and_round_trips_one_rank(checkpoint, one_rank):
    """TP1 on images of three sizes (hub naming, tied embeddings as Qwen2-VL-2B, transformers 4.5x's nested naming)
    and on videos mixed with an image (whose ``second_per_grid_ts``, given, change nothing); export writes the names
    that were read, bit for bit."""
    results, out = one_rank
    for name in ("tp1", "tied", "nested"):
        check(results[name], grads=True)
    check_videos(results["videos"])
    assert results["seconds_ignored"] == 0.0
    check_round_trip(checkpoint, out / "tp1")
    check_round_trip(out / "tied_src", out / "tied")
    check_round_trip(out / "nested_src", out / "nested")
    assert "visual.merger.ln_q.bias" in read_all(out / "tp1")
    assert "model.language_model.embed_tokens.weight" in read_all(out / "nested")
    assert "lm_head.weight" not in read_all(out / "tied")


def test_greedy_generate_matches_transformers(one_rank):
    """Greedy, left-padded: images of two sizes and a text-only row; videos, an image and a text-only row. Cached and
    uncached give transformers' tokens, scores within 1e-5."""
    from tests._generation import assert_same_generation

    for batch, got in one_rank[0]["generate"].items():
        for mode in ("cached", "uncached"):
            assert_same_generation(got[mode], got["ref"], f"{batch}/{mode}", atol=GEN_ATOL)


def test_lora_matches_peft(one_rank):
    """"all-linear" LoRA (random B, scaling 1; the tower's qkv, proj, fc1, fc2 and the merger's linears, the LM head
    and language norms trained whole) against PEFT: logits and loss within 1e-5, every adapter's gradient within 2e-5
    of its largest entry, PEFT's counts and target_modules, the adapter folder in PEFT and the merged export in
    transformers within 1e-5 of our logits."""
    r = one_rank[0]["lora"]
    assert tuple(r["counts"]) == tuple(r["peft_counts"]), r
    assert r["logits_diff"] < 1e-5 and r["loss_diff"] < 1e-5, r
    assert r["grads_checked"]["vision"] == TOWER_TARGETS and r["grads_checked"]["language"] >= 8, r
    assert r["adapter_logits_diff"] < 1e-5 and r["merged_logits_diff"] < 1e-5, r
    assert r["unchanged_after_merged_export"]
    ours, theirs = r["target_modules"]
    assert sorted(ours) == sorted(theirs), (ours, theirs)
    assert r["adapter_tensors"][1], r["adapter_tensors"]


def test_trainer_matches_transformers_trainer(checkpoint, one_rank):
    """Three steps with the ViT frozen (the merger trains): LoongTrainer (TP1) logs transformers.Trainer's losses;
    the frozen ViT comes out of save_model bit for bit."""
    got, out = one_rank[0]["trainer"], one_rank[1]
    assert len(got["loong"]) == len(got["hf"]) == 3
    assert got["loong"] == pytest.approx(got["hf"], rel=1e-4)
    assert got["loong"][-1] < got["loong"][0]
    src, saved = read_all(checkpoint), read_all(out / "train" / "loong" / "final")
    assert sorted(src) == sorted(saved)
    moved = sorted(n for n in src if not torch.equal(src[n], saved[n]))
    assert all(not n.startswith("visual.") or n.startswith("visual.merger.") for n in moved), moved
    assert any(n.startswith("visual.merger.") for n in moved)


def _two_ranks(cases, folder):
    out = compare_many(cases)
    out["videos_tp2_sp"] = compare_videos(folder, TWO_RANKS["tp2_sp_vision_tp2"])
    return out


def test_parity_and_round_trip_two_ranks(checkpoint, tmp_path):
    """TP2 with sequence parallelism and the tower split over TP (videos too); TP2 with the tower
    encoder-data-parallel and both components recomputed; PP2 (forward); CP2 (gradients summed over the CP ranks)."""
    cases = [(n, str(checkpoint), layout, str(tmp_path / n), "default", 4) for n, layout in TWO_RANKS.items()]
    per_rank = run_distributed(_two_ranks, 2, cases, str(checkpoint), timeout=600)
    for results in per_rank:
        for n, layout in TWO_RANKS.items():
            check(results[n], grads=layout.get("pipeline_parallel_size", 1) == 1)
        check_videos(results["videos_tp2_sp"])
    assert per_rank[0]["tp2_sp_vision_tp2"]["vision_layout"] == "tensor_parallel"
    assert per_rank[0]["tp2_encoder_data_parallel"]["vision_layout"] == "data_parallel"
    for n in TWO_RANKS:
        check_round_trip(checkpoint, tmp_path / n)


# ---- pure pieces ---------------------------------------------------------------------------------------------------

def test_vision_tower_matches_transformers_on_odd_grids():
    """The tower (LayerNorm blocks, quick-GELU fc1 / fc2, full attention per frame, LayerNorm merger) against
    transformers' Qwen2-VL ViT in fp32 within 1e-5, on 1x1 .. 10x6 merged grids and videos of 2 and 3 frames."""
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

    from loongforge_hf.bridges.qwen2_vl import tower_config
    from loongforge_hf.multimodal.vision_qwen2 import Qwen2VisionTower

    config = tiny_qwen2_vl_config().vision_config
    torch.manual_seed(0)
    ref = Qwen2VisionTransformerPretrainedModel._from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.2 * torch.randn_like(p))
    tower = Qwen2VisionTower(tower_config(config))
    renamed = {k.replace(".mlp.fc", ".mlp.linear_fc"): v for k, v in ref.state_dict().items()}
    tower.load_state_dict(renamed)
    grid = torch.tensor([[1, 2, 2], [2, 20, 12], [1, 4, 6], [3, 2, 8]])
    pixels = torch.randn(int(grid.prod(-1).sum()), 3 * 2 * 14 * 14)
    want = ref(pixels, grid_thw=grid).pooler_output
    got = tower(pixels, grid)
    assert got.shape == want.shape == (int(grid.prod(-1).sum()) // 4, 64)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()


def test_video_positions_match_transformers():
    """Images and videos mixed, left padding: a video's frames at ``p + t`` (no time scaling), as transformers'
    Qwen2-VL ``get_rope_index``; the model's positions ignore ``second_per_grid_ts``."""
    import transformers

    from loongforge_hf.bridges.qwen2_vl import Qwen2VLBridge
    from loongforge_hf.multimodal.positions import mrope_position_ids

    model = transformers.Qwen2VLModel(tiny_qwen2_vl_config())
    img, vid = model.config.image_token_id, model.config.video_token_id
    ids = torch.tensor([[5, 200, img, img, 201, 200] + [vid] * 8 + [201, 6, 7, 8],
                        [0, 0, 200] + [vid] * 12 + [201, 7, 8],
                        [200] + [vid] * 4 + [201, 9, 200, img, img, img, img, img, img, 201, 10, 11, 12]])
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    kinds = (ids == img).long() + 2 * (ids == vid).long()
    images, videos = torch.tensor([[1, 2, 4], [1, 4, 6]]), torch.tensor([[2, 4, 4], [3, 4, 4], [2, 2, 4]])
    ref, _ = model.get_rope_index(ids, kinds, images, videos, attention_mask=mask)
    ours = mrope_position_ids(ids, image_grid_thw=images, video_grid_thw=videos, attention_mask=mask,
                              image_token_id=img, video_token_id=vid, spatial_merge_size=2)
    assert torch.equal(ours, ref)
    # NOTE: Qwen2.5-VL's time scaling would move them, so the model must not pass second_per_grid_ts on
    scaled = mrope_position_ids(ids, image_grid_thw=images, video_grid_thw=videos, attention_mask=mask,
                                image_token_id=img, video_token_id=vid, spatial_merge_size=2,
                                second_per_grid_ts=torch.tensor([1.0, 0.5, 1.0]))
    assert not torch.equal(scaled, ref)
    assert Qwen2VLBridge.video_time_scaled is False


def test_collator_from_processor(checkpoint):
    from transformers import AutoConfig

    from loongforge_hf.integrations.vl_collator import DataCollatorForImageText
    from loongforge_hf.testing.tiny_vl import processor_for

    processor = processor_for(checkpoint)
    assert type(processor).__mro__[1].__name__ == "Qwen2VLProcessor"
    collator = DataCollatorForImageText.from_processor(processor, AutoConfig.from_pretrained(checkpoint))
    assert (collator.image_token_id, collator.video_token_id, collator.spatial_merge_size) == (202, 203, 2)
    assert collator.tokens_per_second == 1.0 and not collator.frames_apart and collator.mrope


def test_bad_configs_are_refused():
    from loongforge_hf.bridges.config_map import UnsupportedConfigError
    from loongforge_hf.bridges.qwen2_5_vl import get_vl_bridge, image_text_architectures
    from loongforge_hf.bridges.qwen2_vl import Qwen2VLBridge

    assert "Qwen2VLForConditionalGeneration" in image_text_architectures()
    config = tiny_qwen2_vl_config()
    config.architectures = ["Qwen2VLForConditionalGeneration"]
    assert type(get_vl_bridge(config)) is Qwen2VLBridge
    for change, message in (({"hidden_act": "nope"}, "not an activation"),
                            ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, "only 'axial'"),
                            ({"num_heads": 16}, "divisible by 4"),
                            ({"head_dim": 8}, "head_dim=8 differs")):
        config = tiny_qwen2_vl_config()
        for k, v in change.items():
            setattr(config.vision_config, k, v)
        with pytest.raises(UnsupportedConfigError, match=message):
            Qwen2VLBridge(config)
    for text, message in (({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0,
                                                "mrope_section": [2, 3, 3]}}, "rope_type='yarn'"),
                          ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                                "mrope_section": [2, 3, 2]}}, "mrope_section"),
                          ({"use_sliding_window": True, "sliding_window": 8}, "use_sliding_window")):
        with pytest.raises(UnsupportedConfigError, match=message):
            Qwen2VLBridge(tiny_qwen2_vl_config(**text)).text.transformer_config_kwargs()
