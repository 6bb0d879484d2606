"""Qwen2.5-VL against transformers: logits, loss and vision gradients within 1e-4 (fp32) in each layout of the vision
tower and the language model, bit-exact HF round trips, frozen components, and the pure pieces (3-D rope positions,
window layout, encoder data-parallel split, collator) against transformers' own code."""

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from loongforge_hf.parallel import ParallelLayoutError
from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing.tiny_vl import make_tiny_qwen2_5_vl, tiny_vl_config
from loongforge_hf.testing.round_trip import check_round_trip as _check_round_trip, read_all

from ._vl_parity import compare_many, make_batch, train_both

TOL = 1e-4
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "processor_config.json")

LAYOUTS = {  # name: (ranks, from_pretrained keywords)
    "tp1": (1, {}),
    "tp2_vision_replicated": (2, {"tensor_parallel_size": 2}),
    "tp2_encoder_data_parallel": (2, {"tensor_parallel_size": 2, "vision_data_parallel": True,
                                      "vision_recompute": True}),
    "tp2_vision_tp2": (2, {"tensor_parallel_size": 2, "vision_tensor_parallel_size": 2}),
    "pp2": (2, {"pipeline_parallel_size": 2}),
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_tiny_qwen2_5_vl(tmp_path_factory.mktemp("qwen2_5_vl") / "src")


@pytest.fixture(scope="module")
def tied_checkpoint(tmp_path_factory) -> Path:
    """Word embeddings tied to the LM head, as Qwen2.5-VL-3B has them."""
    return make_tiny_qwen2_5_vl(tmp_path_factory.mktemp("qwen2_5_vl_tied") / "src", tie_word_embeddings=True)


def check(result: dict, *, grads: bool) -> None:
    assert result["logits_shape"] == (*result["batch_shape"], 204), result
    assert result["logit_diff"] < TOL, result
    assert result["loss_diff"] < TOL, result
    if grads:
        assert result["grad_diff"] is not None and result["grad_diff"] < TOL, result


def nested_naming_copy(src: Path, dst: Path) -> Path:
    """``src`` with transformers 4.5x's tensor names (``model.language_model.*``, ``model.visual.*``)."""
    dst.mkdir(parents=True)
    renamed = {}
    for name, t in read_all(src).items():
        if name.startswith("visual."):
            name = "model." + name
        elif name.startswith("model."):
            name = "model.language_model." + name[len("model."):]
        renamed[name] = t
    save_file(renamed, str(dst / "model.safetensors"), metadata={"format": "pt"})
    for side in SIDE_FILES:
        shutil.copy(src / side, dst / side)
    return dst


def test_parity_and_round_trip_one_rank(checkpoint, tmp_path):
    """TP1 (vision replicated), and a checkpoint in the nested naming, which export keeps."""
    nested = nested_naming_copy(checkpoint, tmp_path / "nested")
    cases = [("tp1", str(checkpoint), LAYOUTS["tp1"][1], str(tmp_path / "tp1")),
             ("nested", str(nested), {}, str(tmp_path / "nested_out"))]
    results = run_distributed(compare_many, 1, cases, timeout=300)[0]
    check(results["tp1"], grads=True)
    check(results["nested"], grads=True)
    assert results["tp1"]["vision_layout"] == "replicated"
    check_round_trip(checkpoint, tmp_path / "tp1")
    check_round_trip(nested, tmp_path / "nested_out")
    assert "model.language_model.embed_tokens.weight" in read_all(tmp_path / "nested_out")


def test_parity_round_trip_and_freezing_two_ranks(checkpoint, tied_checkpoint, tmp_path):
    """Every two-rank layout in one world: TP2 with the tower replicated, shared out (encoder data parallel, with
    recompute; also with a rank that gets no image), or split (vision TP2); PP2 (forward only, no gradients), also
    with tied word embeddings. Then freeze_vision + freeze_language under
    TP2 with encoder data parallel: only the projector (patch merger) trains; neither a torch optimizer over trainable
    parameters nor LoongTrainer's megatron optimizer sees the rest."""
    names = [n for n, (ranks, _) in LAYOUTS.items() if ranks == 2]
    cases = [(n, str(checkpoint), LAYOUTS[n][1], str(tmp_path / n)) for n in names]
    cases.append(("encoder_data_parallel_one_image", str(checkpoint), LAYOUTS["tp2_encoder_data_parallel"][1],
                  str(tmp_path / "one_image"), "one_image"))
    cases.append(("tied_pp2", str(tied_checkpoint), LAYOUTS["pp2"][1], str(tmp_path / "tied_pp2")))
    frozen = (str(checkpoint), {"tensor_parallel_size": 2, "vision_data_parallel": True})
    per_rank = run_distributed(compare_many, 2, cases, frozen, timeout=400)
    expected_layout = {"tp2_vision_replicated": "replicated", "tp2_encoder_data_parallel": "data_parallel",
                       "tp2_vision_tp2": "tensor_parallel", "pp2": "replicated"}
    for results in per_rank:
        for n in names:
            check(results[n], grads=LAYOUTS[n][1].get("pipeline_parallel_size", 1) == 1)
            assert results[n]["vision_layout"] == expected_layout[n]
        check(results["encoder_data_parallel_one_image"], grads=True)
        check(results["tied_pp2"], grads=False)
        r = results["frozen"]
        assert r["trainable"] and all(".vision.merger." in n for n in r["trainable"]), r["trainable"]
        assert r["got_grad"] == r["trainable"]
        assert r["moved"] == r["trainable"]
        assert r["optimizer_numel"] == r["trainable_numel"]
    for n in names:
        check_round_trip(checkpoint, tmp_path / n)
    check_round_trip(tied_checkpoint, tmp_path / "tied_pp2")
    assert "lm_head.weight" not in read_all(tmp_path / "tied_pp2")


def _engine_takes_model_inputs() -> bool:
    import inspect

    from loongforge_hf.trainer.engine import MegatronEngine

    return "megatron_forward_inputs" in inspect.getsource(MegatronEngine._forward_step_func)


@pytest.mark.skipif(not _engine_takes_model_inputs(),
                    reason="LoongTrainer's forward step does not pass pixel_values / image_grid_thw to the model "
                           "chunks yet (MegatronEngine must call model.megatron_forward_inputs).")
def test_trainer_matches_transformers_trainer(checkpoint, tmp_path):
    """Three steps with the vision tower frozen: LoongTrainer (TP1) logs transformers.Trainer's losses, and the
    frozen tower comes out of save_model bit for bit as it went in."""
    from transformers import AutoConfig

    got = run_distributed(train_both, 1, str(checkpoint), str(tmp_path), timeout=300)[0]
    assert len(got["loong"]) == len(got["hf"]) == 3
    assert got["loong"] == pytest.approx(got["hf"], rel=1e-4)
    assert got["loong"][-1] < got["loong"][0]
    src, out = read_all(checkpoint), read_all(tmp_path / "loong" / "final")
    assert sorted(src) == sorted(out)
    moved = sorted(n for n in src if not torch.equal(src[n], out[n]))
    assert moved and all(not n.startswith("visual.") or n.startswith("visual.merger.") for n in moved), moved
    assert any(n.startswith("visual.merger.") for n in moved)
    assert AutoConfig.from_pretrained(tmp_path / "loong" / "final").architectures == \
        ["Qwen2_5_VLForConditionalGeneration"]


# ---- pure pieces ---------------------------------------------------------------------------------------------------

def _hf_vl_model():
    import transformers

    return transformers.Qwen2_5_VLModel(tiny_vl_config())


def test_mrope_positions_match_transformers():
    from loongforge_hf.multimodal.positions import mrope_position_ids

    model = _hf_vl_model()
    img = model.config.image_token_id
    ids = torch.tensor([[5, 200, img, img, 201, 6, 7, 0, 0, 0, 0],
                        [200, img, img, img, img, img, img, 201, 200, img, img],
                        [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19],
                        [0, 0, 0, 5, 200, img, img, img, img, 201, 6]])
    mask = torch.ones_like(ids)
    mask[0, 7:] = 0
    mask[3, :3] = 0
    grid = torch.tensor([[1, 2, 4], [1, 4, 6], [1, 2, 4], [1, 4, 4]])
    ref, _ = model.get_rope_index(ids, (ids == img).long(), grid, attention_mask=mask)
    ours = mrope_position_ids(ids, image_grid_thw=grid, attention_mask=mask, image_token_id=img,
                              spatial_merge_size=2)
    assert torch.equal(ours, ref)
    assert torch.equal(mrope_position_ids(ids, image_grid_thw=grid, attention_mask=mask,
                                          mm_token_type_ids=(ids == img).long(), image_token_id=-1,
                                          spatial_merge_size=2), ref)
    text = mrope_position_ids(ids[2:3], image_grid_thw=None, image_token_id=img, spatial_merge_size=2)
    assert torch.equal(text, torch.arange(11).expand(3, 1, 11))
    with pytest.raises(ValueError, match="image_grid_thw"):
        mrope_position_ids(ids, image_grid_thw=grid[:3], attention_mask=mask, image_token_id=img,
                           spatial_merge_size=2)


def test_mrope_positions_with_videos_match_transformers():
    """Images and videos mixed, with and without second_per_grid_ts, left padding; and packed rows (document ids)
    give each document the positions it gets alone."""
    from loongforge_hf.multimodal.positions import mrope_position_ids

    model = _hf_vl_model()
    img, vid = model.config.image_token_id, model.config.video_token_id
    ids = torch.tensor([[5, 200, img, img, 201, 200] + [vid] * 8 + [201, 6, 7, 8],
                        [0, 0, 200] + [vid] * 12 + [201, 7, 8],
                        [200] + [vid] * 4 + [201, 9, 200, img, img, img, img, img, img, 201, 10, 11, 12]])
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    kinds = (ids == img).long() + 2 * (ids == vid).long()
    images = torch.tensor([[1, 2, 4], [1, 4, 6]])
    videos = torch.tensor([[2, 4, 4], [3, 4, 4], [2, 2, 4]])
    for seconds in (None, torch.tensor([0.5, 1.5, 2.0])):
        ref, _ = model.get_rope_index(ids, kinds, images, videos, second_per_grid_ts=seconds, attention_mask=mask)
        ours = mrope_position_ids(ids, image_grid_thw=images, video_grid_thw=videos, second_per_grid_ts=seconds,
                                  attention_mask=mask, image_token_id=img, video_token_id=vid, spatial_merge_size=2,
                                  tokens_per_second=model.config.vision_config.tokens_per_second)
        assert torch.equal(ours, ref), seconds
    # rows 0 and 2 packed into one row: each keeps its own positions
    packed = torch.cat([ids[0], ids[2]])[None]
    docs = torch.cat([torch.zeros(ids.shape[1]), torch.ones(ids.shape[1])]).long()[None]
    seconds = torch.tensor([0.5, 2.0])
    got = mrope_position_ids(packed, image_grid_thw=images, video_grid_thw=videos[[0, 2]], second_per_grid_ts=seconds,
                             image_token_id=img, video_token_id=vid, spatial_merge_size=2, document_ids=docs,
                             tokens_per_second=model.config.vision_config.tokens_per_second)
    alone, _ = model.get_rope_index(ids[[0, 2]], kinds[[0, 2]], images, videos[[0, 2]], second_per_grid_ts=seconds)
    assert torch.equal(got[:, 0], torch.cat([alone[:, 0], alone[:, 1]], dim=-1))


def test_vision_layout_matches_transformers():
    from transformers.vision_utils import get_vision_position_ids, get_vision_window_index

    from loongforge_hf.multimodal.vision import vision_layout

    # NOTE: 8x8 merged tokens in windows of 4 tile exactly (transformers then pads a whole empty window); others not.
    for grids, window in (([[1, 4, 6]], 2), ([[1, 16, 16]], 4), ([[1, 6, 10], [2, 4, 4], [1, 2, 2]], 2)):
        grid = torch.tensor(grids)
        ours = vision_layout(grid, merge=2, window=window)
        index, cu = get_vision_window_index(grid, spatial_merge_size=2, window_size=window * 2 * 14, patch_size=14)
        assert torch.equal(ours.restore, torch.argsort(index)), grids
        assert torch.equal(ours.cu_windows, cu.to(torch.int32)), grids
        assert torch.equal(ours.positions, get_vision_position_ids(grid, 2)), grids
        frames = (grid[:, 1] * grid[:, 2]).repeat_interleave(grid[:, 0])
        assert ours.cu_frames.tolist() == [0, *torch.cumsum(frames, 0).tolist()], grids


def test_split_images_balances_contiguous_runs():
    from loongforge_hf.multimodal.encoder_parallel import split_images

    assert split_images([4, 4, 4, 4], 2) == [(0, 2), (2, 4)]
    assert split_images([16, 4, 4, 4, 4], 2) == [(0, 1), (1, 5)]
    assert split_images([8], 2) in ([(0, 0), (0, 1)], [(0, 1), (1, 1)])
    runs = split_images([3, 9, 1, 1, 6, 2], 3)
    assert [i for a, b in runs for i in range(a, b)] == list(range(6))


def test_collator_pads_and_concatenates_images(checkpoint):
    batch = make_batch(str(checkpoint))
    img = 202
    assert batch["input_ids"].shape == (3, 13)
    assert batch["image_grid_thw"].tolist() == [[1, 4, 6], [1, 2, 4], [1, 4, 4]]
    assert batch["pixel_values"].shape == (24 + 8 + 16, 3 * 2 * 14 * 14)
    assert (batch["input_ids"] == img).sum() == (6 + 2 + 4)
    assert batch["attention_mask"].sum(1).tolist() == [13, 13, 4]
    labels, ids = batch["labels"], batch["input_ids"]
    assert (labels[ids == img] == -100).all() and (labels[batch["attention_mask"] == 0] == -100).all()
    keep = (ids != img) & batch["attention_mask"].bool()
    assert torch.equal(labels[keep], ids[keep])
    assert torch.equal(batch["mm_token_type_ids"], (ids == img).long())


def test_bad_layouts_fail_before_any_collective(checkpoint):
    import loongforge_hf as lf

    with pytest.raises(ParallelLayoutError, match="vision_tensor_parallel_size=2 must be 1 or tensor_parallel_size"):
        lf.AutoModelForImageTextToText.from_pretrained(checkpoint, vision_tensor_parallel_size=2)
    with pytest.raises(ParallelLayoutError, match="context_parallel_size"):
        lf.AutoModelForImageTextToText.from_pretrained(checkpoint, context_parallel_size=2)
    with pytest.raises(Exception, match="No loongforge-hf image-text-to-text bridge"):
        from loongforge_hf.bridges.qwen2_5_vl import get_vl_bridge

        get_vl_bridge(type("Config", (), {"architectures": ["LlamaForCausalLM"]})())


def check_round_trip(src, dst):
    _check_round_trip(src, dst, side_files=SIDE_FILES)
