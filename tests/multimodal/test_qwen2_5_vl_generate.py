"""``generate()`` of Qwen2.5-VL (``loongforge_hf/multimodal/generation.py``) against transformers' own
``Qwen2_5_VLForConditionalGeneration.generate`` on the tiny fp32 checkpoint, and against our ``use_cache=False`` path.

- A left-padded batch from the real processor: two prompts with images of different sizes (6 and 2 merged tokens,
  one row left-padded by 8) and a text-only prompt; greedy (scores and raw logits) and seeded top-k sampling (raw
  logits) give transformers' tokens, and scores / logits within 1e-5 of transformers' and of ``use_cache=False``'s;
  a text-only batch (no images: positions from the attention mask) and a batch with videos (0.5 s and 1.5 s per
  temporal grid), an image and a text-only row (greedy, cached and uncached) too. On every rank of: one rank, TP2
  (vision tower replicated), PP2, TP2 with sequence parallelism and the tower split over TP (steps padded to 2), TP2
  with the tower encoder-data-parallel (each TP rank encodes its share of the images), PP2 x VPP2, CP2 (every step,
  cached or not, runs the whole sequence on both CP ranks but the cached prefill, split over CP).
- Rows expanded before the prefill, each with its own images / videos: beam search (3 beams, 2 returned sequences,
  scores and sequences_scores) and sampling with 2 sequences per prompt, on the image and the video batches, cached
  and uncached, give transformers' tokens and scores / logits within 1e-5, in every layout above (the image batch's
  sampling draws a video placeholder in one row: it stays a text token, as in transformers). How the vision inputs
  are laid out after the expansion is checked on its own too (several images in a row, a row without); a prefill of
  rows expanded for 3 beams encodes each image once (the copies take its features).
- After the prefill each cached forward runs the new token only (padded to TP under sequence parallelism), where
  ``use_cache=False`` runs the whole sequence so far.
- ``cache_implementation="static"`` gives transformers' tokens and scores / logits within 1e-5 in every layout and
  scenario above (images, videos, beams, return sequences); its one-token steps run the fixed-shape decode (3-D
  positions in its buffer) in every layout without a pipeline, with the dynamic cache's step lengths.
- Refused with a ValueError on every rank alike: ``position_ids`` that are not ``[3, b, s]``, ``inputs_embeds``.
  Ranks of one replica passing different ``pixel_values`` raise the
  replica-mismatch error (the hash covers them).
"""

import pytest

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing.tiny_vl import make_tiny_qwen2_5_vl

from tests._generation import assert_refused_alike, assert_same_generation

from ._vl_generate import (EXPANDED, NEW_TOKENS, REFUSED, SCENARIOS, generate_many, prompt_batch,
                           transformers_reference)

ATOL = 1e-5  # NOTE: fp32; measured differences are below 3e-7
LAYOUTS = {  # name: (ranks, from_pretrained keywords)
    "tp1": (1, {}),
    "tp2": (2, {"tensor_parallel_size": 2}),
    "pp2": (2, {"pipeline_parallel_size": 2}),
    "tp2_sp_vision_tp2": (2, {"tensor_parallel_size": 2, "sequence_parallel": True,
                              "vision_tensor_parallel_size": 2}),
    "tp2_encoder_data_parallel": (2, {"tensor_parallel_size": 2, "vision_data_parallel": True}),
    "pp2_vpp2": (2, {"pipeline_parallel_size": 2, "virtual_pipeline_parallel_size": 2}),
    "cp2": (2, {"context_parallel_size": 2}),
}
EXPANDED_LAYOUTS = tuple(LAYOUTS)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = make_tiny_qwen2_5_vl(tmp_path_factory.mktemp("vl_generate") / "src")
    return str(folder), transformers_reference(str(folder))


@pytest.fixture(scope="module")
def ranks(checkpoint):
    """{layout: per-rank results}: the one-rank layout in one world, the two-rank layouts in another."""
    found = {}
    for nprocs in (1, 2):
        layouts = [(name, sizes, name in EXPANDED_LAYOUTS) for name, (n, sizes) in LAYOUTS.items() if n == nprocs]
        per_rank = run_distributed(generate_many, nprocs, checkpoint[0], layouts, timeout=300)
        for name, *_ in layouts:
            found[name] = [res[name] for res in per_rank]
    return found


def _same(got: dict, ref: dict, what: str) -> None:
    assert_same_generation(got, ref, what, atol=ATOL)


def test_prompts_hold_images_of_two_sizes_and_left_padding(checkpoint):
    """The batch is what the test means: two images of different sizes in two rows, the second row left-padded."""
    batch = prompt_batch(checkpoint[0])
    assert batch["image_grid_thw"].tolist() == [[1, 4, 6], [1, 2, 4]]
    assert batch["attention_mask"].sum(-1).tolist() == [13, 5, 4]
    assert (batch["input_ids"] == 202).sum(-1).tolist() == [6, 2, 0]  # NOTE: 202 = <|image_pad|>
    ref = checkpoint[1]["images"]["greedy"]
    assert ref["sequences"].shape == (3, 13 + NEW_TOKENS) and ref["scores"].shape[0] == NEW_TOKENS


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_generate_as_transformers_cached_and_uncached(checkpoint, ranks, layout):
    ref = checkpoint[1]
    for rank, res in enumerate(ranks[layout]):
        for name in SCENARIOS:
            _same(res["cached"][name], ref["images"][name], f"{layout} rank {rank} {name} cached vs transformers")
            _same(res["uncached"][name], ref["images"][name], f"{layout} rank {rank} {name} uncached vs transformers")
            _same(res["cached"][name], res["uncached"][name], f"{layout} rank {rank} {name} cached vs uncached")
            _same(res["static"][name], ref["images"][name], f"{layout} rank {rank} {name} static vs transformers")
        _same(res["text_only"]["greedy"], ref["text_only"]["greedy"], f"{layout} rank {rank} text-only batch")
        _same(res["videos"]["greedy"], ref["videos"]["greedy"], f"{layout} rank {rank} videos cached")
        _same(res["videos_static"]["greedy"], ref["videos"]["greedy"], f"{layout} rank {rank} videos static")
        _same(res["videos_uncached"]["greedy"], ref["videos"]["greedy"], f"{layout} rank {rank} videos uncached")


@pytest.mark.parametrize("layout", EXPANDED_LAYOUTS)
def test_beams_and_return_sequences_as_transformers(checkpoint, ranks, layout):
    ref = checkpoint[1]
    for rank, res in enumerate(ranks[layout]):
        for batch in ("images", "videos"):
            for name in EXPANDED:
                what = f"{layout} rank {rank} {batch} {name}"
                cached, uncached = res[f"{batch}_expanded"][name], res[f"{batch}_expanded_uncached"][name]
                _same(cached, ref[f"{batch}_expanded"][name], f"{what} cached vs transformers")
                _same(uncached, ref[f"{batch}_expanded"][name], f"{what} uncached vs transformers")
                _same(cached, uncached, f"{what} cached vs uncached")
                _same(res[f"{batch}_expanded_static"][name], ref[f"{batch}_expanded"][name], f"{what} static")
                assert cached["sequences"].shape[0] == 2 * res["batch"][batch]  # NOTE: 2 sequences per prompt


def test_expanded_vision_inputs_follow_the_rows():
    """Row 0 holds two images (A: 4 merged tokens, B: 2), row 1 none, row 2 one (C: 1) and a video (V: 2); expanded
    twice the rows take the images A B A B C C and the videos V V (``image_copies`` / ``video_copies``), whose
    features, grids and ``second_per_grid_ts`` follow from the given ones (``repeat_copies``, ``copied_vision``).
    Placeholders that split an image between rows (4 + 1 + 2 tokens for rows of 6 and 1) are refused. Checked without
    a world (``mm_token_type_ids`` as the processor gives them)."""
    from types import SimpleNamespace

    import torch

    from loongforge_hf.multimodal.chunk import repeat_copies
    from loongforge_hf.multimodal.generation import copied_vision, expand_vision_inputs

    model = SimpleNamespace(bridge=SimpleNamespace(vision_merge=2, image_token_id=7, video_token_id=8))
    kinds = torch.tensor([[0, 1, 1, 1, 1, 1, 1, 0], [0, 0, 0, 0, 0, 0, 0, 0], [0, 0, 0, 1, 2, 2, 0, 0]])
    grids = torch.tensor([[1, 4, 4], [1, 2, 4], [1, 2, 2]])
    videos = {"pixel_values_videos": torch.zeros(8, 1), "video_grid_thw": torch.tensor([[2, 2, 2]]),
              "second_per_grid_ts": torch.tensor([0.5])}
    inputs = {"mm_token_type_ids": kinds, "attention_mask": torch.ones_like(kinds), "pixel_values": torch.zeros(28, 1),
              "image_grid_thw": grids, **videos}
    got = expand_vision_inputs(model, torch.zeros_like(kinds), inputs, 2)
    assert set(got) == {"image_copies", "video_copies"}
    assert got["image_copies"].tolist() == [0, 1, 0, 1, 2, 2] and got["video_copies"].tolist() == [0, 0]
    # NOTE: the encoded features (a merged token's value is its index): A 0-3, B 4-5, C 6, then V 7-8
    features = torch.arange(9).unsqueeze(-1).float()
    out, image_grid, video_grid = repeat_copies(features, 4, (grids, got["image_copies"]),
                                                (videos["video_grid_thw"], got["video_copies"]))
    a, b, c, v = [0, 1, 2, 3], [4, 5], [6], [7, 8]
    assert out.squeeze(-1).long().tolist() == a + b + a + b + c + c + v + v
    assert image_grid.tolist() == [[1, 4, 4], [1, 2, 4]] * 2 + [[1, 2, 2]] * 2
    assert video_grid.tolist() == [[2, 2, 2]] * 2
    per_row = copied_vision({**inputs, **got})
    assert torch.equal(per_row["image_grid_thw"], image_grid) and per_row["second_per_grid_ts"].tolist() == [0.5, 0.5]
    assert "image_copies" not in per_row and per_row["pixel_values"] is inputs["pixel_values"]
    with pytest.raises(ValueError, match="into whole images"):
        expand_vision_inputs(model, torch.zeros_like(kinds), dict(inputs, image_grid_thw=grids[[0, 2, 1]]), 2)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_cached_steps_run_one_token(ranks, layout):
    for res in ranks[layout]:
        multiple, prompt = res["multiple"], res["prompt"]
        # NOTE: max_new_tokens=4: the prefill, then three one-token steps (padded to the layout's multiple); under CP
        # the prefill is split over CP (padded to 2 x CP chunks; the chunk takes the whole ids and its share itself)
        padded = -(-prompt // res["prefill_multiple"]) * res["prefill_multiple"]
        assert res["lengths"]["cached"] == [padded] + [multiple] * 3, res["lengths"]
        assert res["lengths"]["static"] == res["lengths"]["cached"], res["lengths"]
        # NOTE: the static cache's one-token steps run the fixed-shape decode (a CUDA graph on GPUs) but under PP
        assert res["static_fixed_steps"] == (0 if layout.startswith("pp2") else 3), res["static_fixed_steps"]
        assert res["lengths"]["uncached"] == [-(-n // multiple) * multiple for n in range(prompt, prompt + 4)]
    # NOTE: two uncached steps encode the images twice: every patch on each rank where the tower is replicated or
    # split over TP; a share per rank where the images are shared out (encoder data parallel over TP, and over CP
    # even in a step run whole on every CP rank), the shares adding up to every patch
    every = ranks[layout][0]["all_patches"]
    seen = [res["patches"] for res in ranks[layout]]
    if layout in ("cp2", "tp2_encoder_data_parallel"):
        assert all(len(p) == 2 and p[0] == p[1] for p in seen) and sum(p[0] for p in seen) == every, seen
        assert all(p[0] < every for p in seen), seen
    else:  # NOTE: under PP the second stage has no tower
        assert all(p == [every, every] for p in seen[:1 if layout.startswith("pp2") else None]), seen
    # NOTE: a prefill of rows expanded for 3 beams encodes each image once (the copies take its features)
    beams = [res["beam_patches"] for res in ranks[layout]]
    if layout in ("cp2", "tp2_encoder_data_parallel"):
        assert sum(p[0] for p in beams) == every and all(len(p) == 1 for p in beams), beams
    else:
        assert all(p == [every] for p in beams[:1 if layout.startswith("pp2") else None]), beams


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_refusals_alike_on_every_rank(ranks, layout):
    results = ranks[layout]
    assert_refused_alike(results, REFUSED)
    assert "[3, batch, seq]" in results[0]["refused"]["position_ids_4d"][1]
    if len(results) > 1:
        assert all(res["mismatch"] is not None and res["mismatch"][0] == "GenerationMismatchError"
                   for res in results)
