"""GLM-4.1V and GLM-4.5V against transformers' ``Glm4vForConditionalGeneration`` / ``Glm4vMoeForConditionalGeneration``:
logits, loss and vision gradients within 1e-4 (fp32) on images of three sizes (two sizes in one row) and a text-only
row, replicated (two data-parallel replicas) and under TP2 with sequence parallelism and the tower split over TP
(GLM-4.5V: its experts split over TP too); bit-exact HF round trips; greedy ``generate`` (cached, GLM-4.1V) against
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
        model(**videos)
        out["videos"] = ""
    except ValueError as err:
        out["videos"] = str(err)
    return out


def _two_ranks(folder: str, moe_folder: str, out_dir: str) -> dict:
    # NOTE: padded to a multiple of 4 tokens (sequence parallelism over 2), the same batch in every layout
    out = compare_many([(f"{model}_{name}", src, layout, f"{out_dir}/{model}_{name}", "default", 4)
                        for model, src in (("glm4v", folder), ("glm4v_moe", moe_folder))
                        for name, layout in LAYOUTS.items()])
    out["generate"] = _generate_and_refuse(folder, LAYOUTS["tp2_sp_vision_tp2"])
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
        assert got["videos"].startswith("pixel_values_videos: GLM-4.1V's videos"), got["videos"]


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
