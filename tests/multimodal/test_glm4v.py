"""GLM-4.1V and GLM-4.5V against transformers' ``Glm4vForConditionalGeneration`` / ``Glm4vMoeForConditionalGeneration``:
logits, loss and vision gradients within 1e-4 (fp32) on images of three sizes (two sizes in one row) and a text-only
row, replicated (two data-parallel replicas) and under TP2 with sequence parallelism and the tower split over TP
(GLM-4.5V: its experts split over TP too); an image row and a two-frame video row in one batch (TP2 + SP, vs
transformers row by row); bit-exact HF round trips; greedy ``generate`` (cached, GLM-4.1V) against
transformers'; the sectioned pair mrope against transformers' rotary embedding; refusals."""

from pathlib import Path

import pytest
import torch

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing.round_trip import check_round_trip, read_all
from loongforge_hf.testing.tiny_glm4v import make_tiny_glm4v, tiny_glm4v_config

from ._vl_parity import TWO_RANKS, compare_many

TOL = 1e-4
GEN_ATOL = 1e-5  # NOTE: fp32 greedy scores
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "processor_config.json")
LAYOUTS = {"dp2": {}, "tp2_sp_vision_tp2": TWO_RANKS["tp2_sp_vision_tp2"]}


def _generate_and_refuse(folder: str, layout: dict) -> dict:
    """Greedy generate (scores) on a left-padded batch, ours (cached) and transformers'; the error videos raise."""
    import transformers

    import loongforge_hf as lf

    from ._vl_generate import SCENARIOS, prompt_batch, run_scenarios

    greedy = {"greedy": SCENARIOS["greedy"]}
    batch = prompt_batch(folder)
    ref = transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    model = lf.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32, **layout)
    out = {"ref": run_scenarios(ref, batch, greedy)["greedy"], "ours": run_scenarios(model, batch, greedy)["greedy"]}
    videos = dict(batch, pixel_values_videos=batch["pixel_values"], video_grid_thw=batch["image_grid_thw"])
    try:
        model.generate(**videos, max_new_tokens=1)
        out["videos"] = ""
    except ValueError as err:
        out["videos"] = str(err)
    return out


def _video_batch(folder: str) -> tuple[list, dict]:
    """(each row's processor-like features, the right-padded batch): an image row and a video row of two frames built
    by hand as GLM-4.1V's processor lays them out (transformers' video processor needs torchvision): per frame
    ``<|begin_of_image|>``, the frame's image tokens (``mm_token_type_ids`` 2), ``<|end_of_image|>``, a timestamp."""
    from transformers import AutoConfig, AutoTokenizer

    tok, config = AutoTokenizer.from_pretrained(folder), AutoConfig.from_pretrained(folder)
    begin, end, image = config.image_start_token_id, config.image_end_token_id, config.image_token_id
    words = tok.convert_tokens_to_ids
    v = config.vision_config
    gen = torch.Generator().manual_seed(5)

    def patches(t, h, w):
        return torch.randn(t * h * w, v.in_channels * v.temporal_patch_size * v.patch_size ** 2, generator=gen)

    ids0 = words(["tok5", "tok6"]) + [begin] + [image] * 6 + [end] + words(["tok7"])
    row0 = {"input_ids": ids0, "mm_token_type_ids": [0, 0, 0] + [1] * 6 + [0, 0],
            "pixel_values": patches(1, 4, 6), "image_grid_thw": torch.tensor([[1, 4, 6]])}
    frame = [begin] + [image] * 4 + [end]
    ids1 = words(["tok10"]) + frame + words(["tok150"]) + frame + words(["tok151", "tok11", "tok12"])
    row1 = {"input_ids": ids1, "mm_token_type_ids": [0, 0] + [2] * 4 + [0, 0, 0] + [2] * 4 + [0] * 4,
            "pixel_values_videos": patches(2, 4, 4), "video_grid_thw": torch.tensor([[2, 4, 4]])}
    rows = [{k: torch.tensor([x]) if isinstance(x, list) else x for k, x in r.items()} for r in (row0, row1)]
    width = -(-max(len(ids0), len(ids1)) // 4) * 4  # NOTE: sequence parallelism over 2

    def pad(x, value):
        return torch.cat([x, torch.full((1, width - x.shape[1]), value)], dim=1)

    batch = {"input_ids": torch.cat([pad(r["input_ids"], 0) for r in rows]),
             "attention_mask": torch.cat([pad(torch.ones_like(r["input_ids"]), 0) for r in rows]),
             "mm_token_type_ids": torch.cat([pad(r["mm_token_type_ids"], 0) for r in rows]),
             **{k: rows[i][k] for i, keys in ((0, ("pixel_values", "image_grid_thw")),
                                              (1, ("pixel_values_videos", "video_grid_thw"))) for k in keys}}
    batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    return rows, batch


def _compare_videos(folder: str, layout: dict) -> dict:
    """An image row and a video row in one batch, ours against transformers row by row (transformers' forward refuses
    images and videos in one batch: its image mask also holds the video frames): logits, the batch loss (the rows'
    losses weighted by their token counts) and vision gradients."""
    import transformers

    import loongforge_hf as lf

    from ._vl_parity import vision_grads

    rows, batch = _video_batch(folder)
    ref = transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    counts = [r["input_ids"].shape[1] - 1 for r in rows]
    ref_logits, ref_loss = [], 0.0
    for row, count in zip(rows, counts):
        out = ref(**row, labels=row["input_ids"])
        (out.loss * count / sum(counts)).backward()
        ref_logits.append(out.logits.detach()[0])
        ref_loss += out.loss.item() * count / sum(counts)
    ref_grads = {n[len("model.visual."):]: p.grad for n, p in ref.named_parameters() if n.startswith("model.visual.")}
    model = lf.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32, **layout)
    out = model(**batch)
    out.loss.backward()
    grads = vision_grads(model)
    out_plain = {"no_types": ""}
    try:
        model(**{k: x for k, x in batch.items() if k != "mm_token_type_ids"})
    except ValueError as err:
        out_plain["no_types"] = str(err)
    return {"logit_diff": max((out.logits[i, :len(r)] - r).abs().max().item() for i, r in enumerate(ref_logits)),
            "loss_diff": abs(out.loss.item() - ref_loss), "same_grad_names": sorted(grads) == sorted(ref_grads),
            "grad_diff": max((grads[n] - ref_grads[n]).abs().max().item() for n in ref_grads), **out_plain}


def _two_ranks(folder: str, moe_folder: str, out_dir: str) -> dict:
    # NOTE: padded to a multiple of 4 tokens (sequence parallelism over 2), the same batch in every layout
    out = compare_many([(f"{model}_{name}", src, layout, f"{out_dir}/{model}_{name}", "default", 4)
                        for model, src in (("glm4v", folder), ("glm4v_moe", moe_folder))
                        for name, layout in LAYOUTS.items()])
    out["generate"] = _generate_and_refuse(folder, LAYOUTS["tp2_sp_vision_tp2"])
    out["videos"] = _compare_videos(folder, LAYOUTS["tp2_sp_vision_tp2"])
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> tuple[list, Path, Path]:
    out = tmp_path_factory.mktemp("glm4v")
    folders = {"glm4v": make_tiny_glm4v(out / "src"), "glm4v_moe": make_tiny_glm4v(out / "moe_src", moe=True)}
    return run_distributed(_two_ranks, 2, *map(str, folders.values()), str(out), timeout=500), folders, out


def test_parity_and_round_trip(two_ranks):
    """GLM-4.1V and GLM-4.5V, replicated and TP2 + SP with the tower split: transformers' logits, loss and vision
    gradients within 1e-4 on every rank; each export bit for bit the source checkpoint."""
    per_rank, folders, out = two_ranks
    for results in per_rank:
        for model in folders:
            for name in LAYOUTS:
                r = results[f"{model}_{name}"]
                assert r["logits_shape"] == (*r["batch_shape"], 204), r
                assert r["logit_diff"] < TOL and r["loss_diff"] < TOL, (model, name, r)
                assert r["grad_diff"] is not None and r["grad_diff"] < TOL, (model, name, r)
    for model, folder in folders.items():
        assert per_rank[0][f"{model}_tp2_sp_vision_tp2"]["vision_layout"] == "tensor_parallel"
        for name in LAYOUTS:
            check_round_trip(folder, out / f"{model}_{name}", side_files=SIDE_FILES)
    assert "model.visual.embeddings.position_embedding.weight" in read_all(out / "glm4v_dp2")
    assert "model.language_model.layers.1.mlp.experts.3.down_proj.weight" in read_all(out / "glm4v_moe_dp2")


def test_greedy_generate_matches_transformers(two_ranks):
    """Greedy, left-padded (images of two sizes, a text-only row), TP2 + SP: transformers' tokens, scores within
    1e-5; videos refused by name."""
    from tests._generation import assert_same_generation

    for results in two_ranks[0]:
        got = results["generate"]
        assert_same_generation(got["ours"], got["ref"], "greedy", atol=GEN_ATOL)
        assert got["videos"].startswith("pixel_values_videos: generate with GLM-4.1V"), got["videos"]


def test_videos_match_transformers(two_ranks):
    """A batch of an image row and a two-frame video row (frames marked with the image token, told apart by
    ``mm_token_type_ids``), TP2 + SP with the tower split: transformers' logits (each row alone), batch loss and
    vision gradients within 1e-4; without ``mm_token_type_ids`` the videos are refused by name."""
    for results in two_ranks[0]:
        got = results["videos"]
        assert got["logit_diff"] < TOL and got["loss_diff"] < TOL and got["grad_diff"] < TOL, got
        assert got["same_grad_names"], got
        assert got["no_types"].startswith("mm_token_type_ids: GLM-4.1V marks"), got["no_types"]


def test_sectioned_pair_mrope_matches_transformers():
    """``SectionedPairMRoPE``'s angles give transformers' GLM-4.1V cos / sin for 3-D positions (GLM-4.1V-9B's rotary
    half of head_dim 128 with sections (8, 12, 12), and the tiny model's)."""
    from transformers.models.glm4v.modeling_glm4v import Glm4vTextRotaryEmbedding

    from loongforge_hf.bridges.glm4v import SectionedPairMRoPE

    for hidden, heads, section in ((128, 1, [8, 12, 12]), (64, 2, [2, 3, 3])):
        config = tiny_glm4v_config(hidden_size=hidden, num_attention_heads=heads, rope_parameters={
            "rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5, "mrope_section": section})
        ref = Glm4vTextRotaryEmbedding(config.text_config)
        positions = torch.randint(0, 300, (3, 2, 17))
        cos, sin = ref(torch.zeros(1, dtype=torch.float32), positions)
        dim = 2 * sum(section)  # NOTE: the rotary channels, half of each head
        ours = SectionedPairMRoPE.__new__(SectionedPairMRoPE)
        torch.nn.Module.__init__(ours)
        ours.rotary_interleaved, ours.seq_len_interpolation_factor, ours.cp_group = True, None, None
        ours.inv_freq = 1.0 / (1e4 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        angles = ours(positions, section)[:, :, 0].transpose(0, 1)          # [b, s, rotary dim]
        assert torch.allclose(angles.cos(), cos, atol=1e-6) and torch.allclose(angles.sin(), sin, atol=1e-6)


@pytest.mark.parametrize("change, field", [
    (dict(vision_config=dict(out_hidden_size=48)), "vision_config.out_hidden_size=48"),
    (dict(vision_config=dict(image_size=50)), "vision_config.image_size=50"),
    (dict(vision_config=dict(hidden_act="nope")), "vision_config.hidden_act='nope'"),
    (dict(text_config=dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5,
                                            "mrope_section": [2, 3, 4]})), "mrope_section=[2, 3, 4]"),
])
def test_config_refusals(change, field):
    """Configs the bridge cannot reproduce raise at load, naming the field."""
    from transformers import Glm4vConfig

    from loongforge_hf.bridges import config_map as C
    from loongforge_hf.bridges.qwen2_5_vl import get_vl_bridge

    base = {**tiny_glm4v_config().to_dict(), "architectures": ["Glm4vForConditionalGeneration"]}
    for key, value in change.items():
        base[key].update(value)
    with pytest.raises(C.UnsupportedConfigError, match=field.replace("[", r"\[").replace("]", r"\]")):
        get_vl_bridge(Glm4vConfig(**base), ("model.language_model.embed_tokens.weight",))
