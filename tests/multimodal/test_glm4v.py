"""GLM-4.1V and GLM-4.5V against transformers' ``Glm4vForConditionalGeneration`` / ``Glm4vMoeForConditionalGeneration``:
logits, loss and vision gradients within 1e-4 (fp32) on images of three sizes (two sizes in one row) and a text-only
row, replicated (two data-parallel replicas) and under TP2 with sequence parallelism and the tower split over TP
(GLM-4.5V: its experts split over TP too); an image sample and a two-frame video sample collated into one batch by
``DataCollatorForImageText`` (TP2 + SP, vs transformers row by row; LoongTrainer's first loss), the same for GLM-4.5V
at PP2, CP2, EP2 and TP2 + SP + EP2 and for GLM-4.1V at CP2 (one more two-rank world); the collated batch itself;
bit-exact HF round trips; greedy ``generate`` (GLM-4.1V) against transformers' with images and with videos; the
sectioned pair mrope against transformers' rotary embedding; refusals."""

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
# the other two-rank layouts of GLM-4.5V (and GLM-4.1V's own rope under CP2): name -> (model, layout)
MORE_LAYOUTS = {"glm4v_moe_pp2": ("glm4v_moe", {"pipeline_parallel_size": 2}),
                "glm4v_moe_cp2": ("glm4v_moe", {"context_parallel_size": 2}),
                "glm4v_moe_ep2": ("glm4v_moe", {"expert_parallel_size": 2}),
                "glm4v_moe_tp2_sp_ep2": ("glm4v_moe", {**TWO_RANKS["tp2_sp_vision_tp2"], "expert_parallel_size": 2,
                                                       "expert_tensor_parallel_size": 1}),
                "glm4v_cp2": ("glm4v", {"context_parallel_size": 2})}


def _glm_features(folder: str, samples=("image", "video")) -> tuple:
    """(the processor, one processor-like feature per sample): built by hand exactly as ``Glm4vProcessor`` lays a
    sample out (transformers' video processor needs torchvision), its own ``create_mm_token_type_ids`` giving the
    types. The tiny tokenizer has no video markers: two of its words stand in for ``<|begin_of_video|>`` /
    ``<|end_of_video|>``, two more for the frames' timestamps. "image": ``<|begin_of_image|>``, 6 image tokens,
    ``<|end_of_image|>``; "video" (and the shorter "video2"): between the markers, per frame ``<|begin_of_image|>``,
    the frame's image tokens, ``<|end_of_image|>``, its timestamp."""
    from transformers import AutoConfig

    from loongforge_hf.testing.tiny_vl import processor_for

    processor, config = processor_for(folder), AutoConfig.from_pretrained(folder)
    words = processor.tokenizer.convert_tokens_to_ids
    processor.video_start_id, processor.video_end_id = words(["tok198", "tok199"])
    begin, end, image = config.image_start_token_id, config.image_end_token_id, config.image_token_id
    v = config.vision_config
    gen = torch.Generator().manual_seed(5)
    layouts = {"image": (["tok5", "tok6"], "image", (1, 4, 6), ["tok7"]),
               "video": (["tok10"], "video", (2, 4, 4), ["tok11", "tok12"]),
               "video2": ([], "video", (2, 2, 4), ["tok13"])}
    features = []
    for name in samples:
        before, kind, (t, h, w), after = layouts[name]
        frame = [begin] + [image] * (h * w // 4) + [end]
        vision = frame if kind == "image" else [processor.video_start_id] + [
            i for k in range(t) for i in frame + words([f"tok{150 + k}"])] + [processor.video_end_id]
        ids = words(before) + vision + words(after)
        pixels, grid = ("pixel_values", "image_grid_thw") if kind == "image" else \
            ("pixel_values_videos", "video_grid_thw")
        features.append({"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long),
                         "mm_token_type_ids": torch.tensor(processor.create_mm_token_type_ids([ids])),
                         pixels: torch.randn(t * h * w, v.in_channels * v.temporal_patch_size * v.patch_size ** 2,
                                             generator=gen),
                         grid: torch.tensor([[t, h, w]])})
    return processor, features


def _collate(folder: str, samples=("image", "video"), **kwargs) -> tuple:
    """(the features, ``DataCollatorForImageText.from_processor``'s collator, their batch)."""
    from transformers import AutoConfig

    from loongforge_hf.integrations.vl_collator import DataCollatorForImageText

    processor, features = _glm_features(folder, samples)
    collate = DataCollatorForImageText.from_processor(processor, AutoConfig.from_pretrained(folder), **kwargs)
    return features, collate, collate(features)


def _generate_and_refuse(folder: str, layout: dict) -> dict:
    """Greedy generate (scores) on a left-padded batch, ours (cached) and transformers'; the same on a left-padded
    batch of two videos (collated), ours cached and uncached; videos without ``mm_token_type_ids`` refused."""
    import transformers

    import loongforge_hf as lf

    from ._vl_generate import SCENARIOS, prompt_batch, run_scenarios

    greedy = {"greedy": SCENARIOS["greedy"]}
    batch = prompt_batch(folder)
    videos = {k: x for k, x in _collate(folder, ("video", "video2"), padding_side="left")[2].items()
              if k != "labels"}
    ref = transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    model = lf.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32, **layout)
    out = {"ref": run_scenarios(ref, batch, greedy)["greedy"], "ours": run_scenarios(model, batch, greedy)["greedy"],
           "videos_ref": run_scenarios(ref, videos, greedy)["greedy"],
           "videos": run_scenarios(model, videos, greedy)["greedy"],
           "videos_uncached": run_scenarios(model, videos, greedy, use_cache=False)["greedy"]}
    try:
        model.generate(**{k: x for k, x in videos.items() if k != "mm_token_type_ids"}, max_new_tokens=1)
        out["no_types"] = ""
    except ValueError as err:
        out["no_types"] = str(err)
    return out


_VIDEO_REFERENCE: dict = {}


def _videos_reference(folder: str) -> tuple:
    """(features, collator, batch, transformers' logits per row, batch loss, vision gradients) for an image sample
    and a video sample collated into one batch (``from_processor``, padded to a multiple of 4: sequence parallelism
    and CP over 2), transformers row by row (its forward refuses images and videos in one batch: its image mask also
    holds the video frames), the batch loss the rows' losses weighted by their label counts; once per process."""
    import transformers

    if folder not in _VIDEO_REFERENCE:
        features, collate, batch = _collate(folder, pad_to_multiple_of=4)
        ref = transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
        rows = [{**f, "labels": batch["labels"][i:i + 1, :f["input_ids"].shape[1]]} for i, f in enumerate(features)]
        counts = [int((r["labels"][0, 1:] != -100).sum()) for r in rows]
        ref_logits, ref_loss = [], 0.0
        for row, count in zip(rows, counts):
            out = ref(**row)
            (out.loss * count / sum(counts)).backward()
            ref_logits.append(out.logits.detach()[0])
            ref_loss += out.loss.item() * count / sum(counts)
        grads = {n[len("model.visual."):]: p.grad for n, p in ref.named_parameters() if n.startswith("model.visual.")}
        _VIDEO_REFERENCE[folder] = (features, collate, batch, ref_logits, ref_loss, grads)
    return _VIDEO_REFERENCE[folder]


def _compare_videos(folder: str, layout: dict, out_dir: str | None = None) -> dict:
    """``_videos_reference``'s batch in ``layout`` against transformers: logits, loss, vision gradients (summed over
    the CP ranks, each holding its share's; not under PP: forward only), the loss LoongTrainer logs for its first
    step on that batch; videos without ``mm_token_type_ids`` refused; the model exported to ``out_dir`` when
    given."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    import loongforge_hf as lf

    from ._vl_parity import vision_grads, vl_training_args

    features, collate, batch, ref_logits, ref_loss, ref_grads = _videos_reference(folder)
    model = lf.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32, **layout)
    out = model(**batch)
    result = {"logit_diff": max((out.logits[i, :len(r)] - r).abs().max().item() for i, r in enumerate(ref_logits)),
              "loss_diff": abs(out.loss.item() - ref_loss), "grad_diff": None, "no_types": ""}
    if model.parallel.pipeline_parallel_size == 1:
        out.loss.backward()
        grads = vision_grads(model)
        if ps.get_context_parallel_world_size() > 1:
            for g in grads.values():
                dist.all_reduce(g, group=ps.get_context_parallel_group())
        result["same_grad_names"] = sorted(grads) == sorted(ref_grads)
        result["grad_diff"] = max((grads[n] - ref_grads[n]).abs().max().item() for n in ref_grads)
    try:
        model(**{k: x for k, x in batch.items() if k != "mm_token_type_ids"})
    except ValueError as err:
        result["no_types"] = str(err)
    if out_dir is not None:
        model.save_pretrained(out_dir, max_shard_size="60KB")
    model = lf.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32, **layout)
    args = vl_training_args(f"{folder}_train")
    args.max_steps = 1
    trainer = lf.LoongTrainer(model=model, args=args, train_dataset=features, data_collator=collate)
    trainer.train()
    return {**result, "trained_loss_diff": abs(trainer.state.log_history[0]["loss"] - ref_loss)}


def _two_ranks(folder: str, moe_folder: str, out_dir: str) -> dict:
    # NOTE: padded to a multiple of 4 tokens (sequence parallelism over 2), the same batch in every layout
    out = compare_many([(f"{model}_{name}", src, layout, f"{out_dir}/{model}_{name}", "default", 4)
                        for model, src in (("glm4v", folder), ("glm4v_moe", moe_folder))
                        for name, layout in LAYOUTS.items()])
    out["generate"] = _generate_and_refuse(folder, LAYOUTS["tp2_sp_vision_tp2"])
    out["videos"] = _compare_videos(folder, LAYOUTS["tp2_sp_vision_tp2"])
    return out


def _more_layouts(folders: dict, out_dir: str) -> dict:
    """``_compare_videos`` in each of ``MORE_LAYOUTS`` (one world, groups rebuilt for each), each exported."""
    return {name: _compare_videos(folders[model], layout, f"{out_dir}/{name}")
            for name, (model, layout) in MORE_LAYOUTS.items()}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("glm4v")
    return {"glm4v": make_tiny_glm4v(out / "src"), "glm4v_moe": make_tiny_glm4v(out / "moe_src", moe=True)}, out


@pytest.fixture(scope="module")
def two_ranks(folders) -> tuple[list, Path, Path]:
    folders, out = folders
    return run_distributed(_two_ranks, 2, *map(str, folders.values()), str(out), timeout=500), folders, out


@pytest.fixture(scope="module")
def more_layouts(folders) -> list:
    folders, out = folders
    return run_distributed(_more_layouts, 2, {k: str(v) for k, v in folders.items()}, str(out), timeout=400)


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
    """Greedy, left-padded, TP2 + SP: images of two sizes and a text-only row; two videos of two frames (4 and 2
    tokens each) collated by ``from_processor``, with the KV cache and without: transformers' tokens, scores within
    1e-5; videos without ``mm_token_type_ids`` refused by name."""
    from tests._generation import assert_same_generation

    for results in two_ranks[0]:
        got = results["generate"]
        assert_same_generation(got["ours"], got["ref"], "greedy", atol=GEN_ATOL)
        assert_same_generation(got["videos"], got["videos_ref"], "videos", atol=GEN_ATOL)
        assert_same_generation(got["videos_uncached"], got["videos_ref"], "videos uncached", atol=GEN_ATOL)
        assert got["no_types"].startswith("generate: mm_token_type_ids: GLM-4.1V"), got["no_types"]


def test_videos_match_transformers(two_ranks):
    """An image sample and a two-frame video sample (frames marked with the image token, told apart by
    ``mm_token_type_ids``) collated by ``from_processor``, TP2 + SP with the tower split: transformers' logits (each
    row alone), batch loss and vision gradients within 1e-4, and LoongTrainer's first logged loss on the batch within
    1e-4 of that loss; without ``mm_token_type_ids`` the videos are refused by name."""
    for results in two_ranks[0]:
        got = results["videos"]
        assert got["logit_diff"] < TOL and got["loss_diff"] < TOL and got["grad_diff"] < TOL, got
        assert got["trained_loss_diff"] < TOL, got
        assert got["same_grad_names"], got
        assert got["no_types"].startswith("mm_token_type_ids: GLM-4.1V marks"), got["no_types"]


def test_more_layouts_match_transformers(more_layouts, folders):
    """GLM-4.5V under PP2 (forward; LoongTrainer's first loss through the pipeline schedule), CP2 (the chunks cut the
    image and the video; vision gradients summed over the CP ranks), EP2 (two experts a rank) and TP2 + SP with the
    tower split and EP2 (expert_tensor_parallel_size=1); GLM-4.1V under CP2: on the image + video batch,
    transformers' logits (each row alone), batch loss and vision gradients within 1e-4, LoongTrainer's first logged
    loss within 1e-4 of that loss, videos without ``mm_token_type_ids`` refused by name; each export bit for bit the
    source checkpoint."""
    folders, out = folders
    for results in more_layouts:
        for name, (model, layout) in MORE_LAYOUTS.items():
            got = results[name]
            assert got["logit_diff"] < TOL and got["loss_diff"] < TOL and got["trained_loss_diff"] < TOL, (name, got)
            if layout.get("pipeline_parallel_size", 1) == 1:
                assert got["same_grad_names"] and got["grad_diff"] < TOL, (name, got)
            assert got["no_types"].startswith("mm_token_type_ids: GLM-4.1V marks"), (name, got["no_types"])
    for name, (model, _) in MORE_LAYOUTS.items():
        check_round_trip(folders[model], out / name, side_files=SIDE_FILES)


def test_collator_builds_glm4v_batches(folders):
    """``from_processor`` on a ``Glm4vProcessor``: an image sample and a longer video sample padded to a multiple of
    4 as transformers' model takes them (ids with the pad id, types 1 / 2 / 0 as the processor gives them, labels
    -100 on image and video tokens and padding, the image's and the video's patches and grids); the same batch from
    features without ``mm_token_type_ids`` (the processor's types recomputed); packed rows give each sample
    transformers' ``get_rope_index`` positions (each frame its own item); types of another length refused by
    name."""
    from dataclasses import replace

    from transformers import Glm4vModel

    folder = str(folders[0]["glm4v"])
    processor, features = _glm_features(folder)
    features, collate, batch = _collate(folder, pad_to_multiple_of=4)
    assert collate.frames_apart and collate.video_markers == (processor.video_start_id, processor.video_end_id)
    lengths = [f["input_ids"].shape[1] for f in features]
    width = -(-max(lengths) // 4) * 4
    assert lengths[0] < lengths[1] < width, lengths

    def pad(x, value):
        return torch.nn.functional.pad(x, (0, width - x.shape[1]), value=value)

    ids = torch.cat([pad(f["input_ids"], collate.pad_token_id) for f in features])
    types = torch.cat([pad(f["mm_token_type_ids"], 0) for f in features])
    assert [types[i].bincount(minlength=3).tolist()[1:] for i in range(2)] == [[6, 0], [0, 8]], types
    expected = {"input_ids": ids, "attention_mask": torch.cat([pad(f["attention_mask"], 0) for f in features]),
                "mm_token_type_ids": types, "labels": ids.masked_fill(types > 0, -100),
                "pixel_values": features[0]["pixel_values"], "image_grid_thw": features[0]["image_grid_thw"],
                "pixel_values_videos": features[1]["pixel_values_videos"],
                "video_grid_thw": features[1]["video_grid_thw"]}
    expected["labels"][expected["attention_mask"] == 0] = -100
    assert sorted(batch) == sorted(expected)
    for key, value in expected.items():
        assert torch.equal(batch[key], value), key
    untyped = collate([{k: x for k, x in f.items() if k != "mm_token_type_ids"} for f in features])
    assert all(torch.equal(untyped[key], value) for key, value in expected.items())
    packed = replace(collate, packing=True)(features)
    ref = Glm4vModel(tiny_glm4v_config())
    start = 0
    for f in features:
        grids = {k: f[k] for k in ("image_grid_thw", "video_grid_thw") if k in f}
        rope, _ = ref.get_rope_index(f["input_ids"], f["mm_token_type_ids"], **grids)
        n = f["input_ids"].shape[1]
        assert torch.equal(packed["position_ids"][1:, 0, start:start + n], rope[:, 0]), f
        start += n
    short = dict(features[0], mm_token_type_ids=features[0]["mm_token_type_ids"][:, 1:])
    with pytest.raises(ValueError, match="mm_token_type_ids: "):
        collate([short, features[1]])


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
