"""Qwen3-VL against transformers' ``Qwen3VLForConditionalGeneration``: logits, loss and vision gradients within
1e-4 (fp32; measured below 3e-7) in each layout of the vision tower and the language model, images and videos
(a timestamp token before each frame, per-frame 3-D positions), DeepStack's features added to the first decoder
layers, bit-exact HF round trips, LoongTrainer against transformers.Trainer, packing, the
interleaved multimodal rope and the learned position grid against transformers' own code, and refusals."""

from pathlib import Path

import pytest
import torch

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing.round_trip import check_round_trip as _check_round_trip, read_all
from loongforge_hf.testing.tiny_vl import make_tiny_qwen3_vl, tiny_qwen3_vl_config

from ._vl_parity import TWO_RANKS, compare_many, train_both
from ._vl_features import compare_videos
from ._vl_qwen3 import load_error, packed_against_padded

TOL = 1e-4
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "processor_config.json")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_tiny_qwen3_vl(tmp_path_factory.mktemp("qwen3_vl") / "src")


@pytest.fixture(scope="module")
def tied_checkpoint(tmp_path_factory) -> Path:
    """Word embeddings tied to the LM head, as Qwen3-VL-2B / 4B have them."""
    return make_tiny_qwen3_vl(tmp_path_factory.mktemp("qwen3_vl_tied") / "src", tie_word_embeddings=True)


def check(result: dict, *, grads: bool) -> None:
    assert result["logits_shape"] == (*result["batch_shape"], 204), result
    assert result["logit_diff"] < TOL, result
    assert result["loss_diff"] < TOL, result
    if grads:
        assert result["grad_diff"] is not None and result["grad_diff"] < TOL, result


def check_round_trip(src, dst):
    _check_round_trip(src, dst, side_files=SIDE_FILES)


def test_parity_videos_and_round_trip_one_rank(checkpoint, tied_checkpoint, tmp_path):
    """TP1 on images, also with tied embeddings; videos and images mixed; the video samples packed in one row give
    the logits they give padded."""
    cases = [("tp1", str(checkpoint), {}, str(tmp_path / "tp1")),
             ("tied", str(tied_checkpoint), {}, str(tmp_path / "tied"))]
    results = run_distributed(_one_rank, 1, cases, str(checkpoint), timeout=400)[0]
    for name in ("tp1", "tied"):
        check(results[name], grads=True)
    videos = results["videos"]
    assert videos["same_grad_names"] and videos["shape"] == (*videos["batch_shape"], 204), videos
    assert videos["logit_diff"] < TOL and videos["loss_diff"] < TOL and videos["grad_diff"] < TOL, videos
    packed = results["packed"]
    assert packed["rows"][0] == 1 and packed["position_rows"][0] == 4, packed
    assert packed["logit_diff"] < 1e-5, packed
    check_round_trip(checkpoint, tmp_path / "tp1")
    check_round_trip(tied_checkpoint, tmp_path / "tied")
    assert "model.language_model.embed_tokens.weight" in read_all(tmp_path / "tp1")
    assert "lm_head.weight" not in read_all(tmp_path / "tied")


def _one_rank(cases, folder):
    out = compare_many(cases)
    out["videos"] = compare_videos(folder, {})
    out["packed"] = packed_against_padded(folder)
    return out


def _two_ranks(cases, folder, deepstack_folder):
    out = compare_many(cases)
    out["videos_cp2"] = compare_videos(folder, {"context_parallel_size": 2})
    out["videos_tp2_sp"] = compare_videos(folder, TWO_RANKS["tp2_sp_vision_tp2"])
    out["deepstack_pp2"] = load_error(deepstack_folder, {"pipeline_parallel_size": 2})
    return out


def test_parity_and_round_trip_two_ranks(checkpoint, tmp_path):
    """TP2 with sequence parallelism and the tower split over TP; TP2 with the tower encoder-data-parallel and both
    components recomputed; PP2 (forward); CP2 (gradients summed over the CP ranks); videos at CP2 and TP2 + SP.
    DeepStack into 3 decoder layers of 4 under PP2 (2 layers on the first stage) is refused on both ranks."""
    deepstack = make_tiny_qwen3_vl(tmp_path / "deepstack3", deepstack_visual_indexes=[0, 1, 2])
    cases = [(n, str(checkpoint), layout, str(tmp_path / n), "default", 4) for n, layout in TWO_RANKS.items()]
    per_rank = run_distributed(_two_ranks, 2, cases, str(checkpoint), str(deepstack), timeout=600)
    for results in per_rank:
        for n, layout in TWO_RANKS.items():
            check(results[n], grads=layout.get("pipeline_parallel_size", 1) == 1)
        for key in ("videos_cp2", "videos_tp2_sp"):
            r = results[key]
            assert r["same_grad_names"] and r["logit_diff"] < TOL and r["loss_diff"] < TOL \
                and r["grad_diff"] < TOL, (key, r)
        assert results["deepstack_pp2"].startswith("ParallelLayoutError: DeepStack adds vision features to the "
                                                   "outputs of the first 3 decoder layers"), results["deepstack_pp2"]
    assert per_rank[0]["tp2_sp_vision_tp2"]["vision_layout"] == "tensor_parallel"
    for n in TWO_RANKS:
        check_round_trip(checkpoint, tmp_path / n)


def test_trainer_matches_transformers_trainer(checkpoint, tmp_path):
    """Three steps with the ViT frozen (the mergers, DeepStack's included, train): LoongTrainer (TP1) logs
    transformers.Trainer's losses; the frozen ViT comes out of save_model bit for bit."""
    got = run_distributed(train_both, 1, str(checkpoint), str(tmp_path), timeout=300)[0]
    assert len(got["loong"]) == len(got["hf"]) == 3
    assert got["loong"] == pytest.approx(got["hf"], rel=1e-4)
    assert got["loong"][-1] < got["loong"][0]
    src, out = read_all(checkpoint), read_all(tmp_path / "loong" / "final")
    assert sorted(src) == sorted(out)
    moved = sorted(n for n in src if not torch.equal(src[n], out[n]))
    projector = ("model.visual.merger.", "model.visual.deepstack_merger_list.")
    assert all(not n.startswith("model.visual.") or n.startswith(projector) for n in moved), moved
    assert any(n.startswith(projector[1]) for n in moved) and any(n.startswith(projector[0]) for n in moved)


# ---- pure pieces ---------------------------------------------------------------------------------------------------

def test_interleaved_mrope_matches_transformers():
    """``InterleavedMRoPE``'s angles give transformers' Qwen3-VL cos / sin for 3-D positions (Qwen3-VL-8B's
    head_dim 128 and sections (24, 20, 20), and the tiny model's)."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    from loongforge_hf.bridges.qwen3_vl import InterleavedMRoPE

    for head_dim, section in ((128, [24, 20, 20]), (16, [2, 3, 3])):
        config = tiny_qwen3_vl_config(head_dim=head_dim, rope_parameters={
            "rope_type": "default", "rope_theta": 5e6, "mrope_section": section, "mrope_interleaved": True}).text_config
        ref = Qwen3VLTextRotaryEmbedding(config)
        positions = torch.randint(0, 300, (3, 2, 17))
        cos, sin = ref(torch.zeros(1, dtype=torch.float32), positions)
        ours = InterleavedMRoPE.__new__(InterleavedMRoPE)
        torch.nn.Module.__init__(ours)
        ours.rotary_interleaved, ours.seq_len_interpolation_factor, ours.cp_group = False, None, None
        ours.inv_freq = 1.0 / (5e6 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        angles = ours(positions, section)[:, :, 0].transpose(0, 1)          # [b, s, head_dim]
        assert torch.allclose(angles.cos(), cos, atol=1e-6) and torch.allclose(angles.sin(), sin, atol=1e-6)


def test_frame_positions_match_transformers():
    """Per-frame 3-D positions (``frames_apart``) equal transformers' Qwen3-VL ``get_rope_index``: images and
    videos with timestamps between frames, left padding."""
    import transformers

    from loongforge_hf.multimodal.positions import mrope_position_ids

    model = transformers.Qwen3VLModel(tiny_qwen3_vl_config())
    img, vid = model.config.image_token_id, model.config.video_token_id
    frame = [50, 200] + [vid] * 4 + [201]          # timestamp, start, 4x4 / 4 tokens, end
    ids = torch.tensor([[5, 200, img, img, 201] + frame * 3 + [6, 7],
                        [0] * 12 + [200, img, img, img, img, img, img, 201] + frame + [8]])
    mask = (ids != 0).long()
    kinds = (ids == img).long() + 2 * (ids == vid).long()
    images, videos = torch.tensor([[1, 2, 4], [1, 4, 6]]), torch.tensor([[3, 4, 4], [1, 4, 4]])
    ref, _ = model.get_rope_index(ids, kinds, images, videos.clone(), attention_mask=mask)
    ours = mrope_position_ids(ids, image_grid_thw=images, video_grid_thw=videos.clone(), attention_mask=mask,
                              mm_token_type_ids=kinds, image_token_id=img, video_token_id=vid, spatial_merge_size=2,
                              frames_apart=True)
    assert torch.equal(ours, ref)


def test_vision_tower_matches_transformers_on_odd_grids():
    """The tower (learned grid resampled to 1x1 .. 10x6 merged grids, frames, DeepStack features) against
    transformers' ``Qwen3VLVisionModel`` in fp32 within 1e-5."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    from loongforge_hf.multimodal.vision_qwen3 import Qwen3VisionTower

    config = tiny_qwen3_vl_config().vision_config
    torch.manual_seed(0)
    ref = Qwen3VLVisionModel._from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.2 * torch.randn_like(p))
    tower = Qwen3VisionTower(config)
    tower.load_state_dict(ref.state_dict())
    grid = torch.tensor([[1, 2, 2], [2, 20, 12], [1, 4, 6], [3, 2, 8]])
    pixels = torch.randn(int(grid.prod(-1).sum()), 3 * 2 * 16 * 16)
    out = ref(pixels, grid_thw=grid)
    want = torch.cat([out.pooler_output, *out.deepstack_features], dim=-1)
    got = tower(pixels, grid)
    assert got.shape == want.shape == (int(grid.prod(-1).sum()) // 4, 64 * 3)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()


def test_bad_configs_are_refused(tmp_path):
    from loongforge_hf.bridges.config_map import UnsupportedConfigError
    from loongforge_hf.bridges.qwen3_vl import Qwen3VLBridge

    for change, message in (({"num_position_embeddings": 15}, "must be a square"),
                            ({"deepstack_visual_indexes": [0, 3]}, "distinct block indexes"),
                            ({"hidden_act": "nope"}, "not an activation")):
        config = tiny_qwen3_vl_config()
        for k, v in change.items():
            setattr(config.vision_config, k, v)
        with pytest.raises(UnsupportedConfigError, match=message):
            Qwen3VLBridge(config)
    config = tiny_qwen3_vl_config(num_hidden_layers=1)
    with pytest.raises(UnsupportedConfigError, match="2 DeepStack features for 1 decoder layers"):
        Qwen3VLBridge(config)


def test_causal_lm_loader_points_to_the_image_text_one(checkpoint):
    import loongforge_hf as lf
    from loongforge_hf.bridges.registry import UnsupportedArchitectureError

    with pytest.raises(UnsupportedArchitectureError, match="Qwen3VLForConditionalGeneration is an image-text model: "
                                                           "load it with lf.AutoModelForImageTextToText"):
        lf.AutoModelForCausalLM.from_pretrained(checkpoint)
