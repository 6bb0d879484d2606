"""``generate()`` of Qwen3-VL (``loongforge_hf/multimodal/generation.py``) against transformers' own
``Qwen3VLForConditionalGeneration.generate`` on the tiny fp32 checkpoint, and against our ``use_cache=False`` path
(the rank functions are Qwen2.5-VL's: ``_vl_generate.py``).

- A left-padded batch from the real processor (16-pixel patches): two prompts with images of different sizes (6 and 2
  merged tokens, one row left-padded by 8) and a text-only prompt; greedy (scores and raw logits) and seeded top-k
  sampling (raw logits) give transformers' tokens, and scores / logits within 1e-5 of transformers' and of
  ``use_cache=False``'s; a text-only batch and a batch with videos in the processor's layout (each frame after its
  timestamp, in its own ``<|vision_start|> .. <|vision_end|>``: per-frame positions), an image and a text-only row
  (greedy, cached and uncached) too. DeepStack adds the tower's intermediate features to the first two decoder
  layers' outputs at the prefill (and at every uncached step). On every rank of: one rank, TP2 with sequence
  parallelism and the tower split over TP (steps padded to 2), PP2 (DeepStack's layers on the first stage), CP2
  (every step, cached or not, runs the whole sequence on both CP ranks but the cached prefill, split over CP).
- Rows expanded before the prefill, each with its own images / videos: beam search (3 beams, 2 returned sequences,
  scores and sequences_scores) and sampling with 2 sequences per prompt, on the image and the video batches, cached
  and uncached, give transformers' tokens and scores / logits within 1e-5, in every layout above; a prefill of rows
  expanded for 3 beams encodes each image once.
- After the prefill each cached forward runs the new token only (padded to TP under sequence parallelism), where
  ``use_cache=False`` runs the whole sequence so far.
- ``cache_implementation="static"`` gives transformers' tokens and scores / logits within 1e-5 in every layout and
  scenario above; its one-token steps run the fixed-shape decode (3-D positions in its buffer, interleaved mRoPE
  computed inside the step) in every layout without a pipeline, with the dynamic cache's step lengths.
- Refused with a ValueError on every rank alike: ``position_ids`` that are not ``[3, b, s]``, ``inputs_embeds``.
  Ranks of one replica passing different ``pixel_values`` raise the replica-mismatch error.
"""

import pytest

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing.tiny_vl import make_tiny_qwen3_vl

from tests._generation import assert_refused_alike, assert_same_generation

from ._vl_generate import (EXPANDED, NEW_TOKENS, REFUSED, SCENARIOS, generate_many, prompt_batch,
                           transformers_reference, video_batch)

ATOL = 1e-5  # NOTE: fp32
LAYOUTS = {  # name: (ranks, from_pretrained keywords)
    "tp1": (1, {}),
    "tp2_sp_vision_tp2": (2, {"tensor_parallel_size": 2, "sequence_parallel": True,
                              "vision_tensor_parallel_size": 2}),
    "pp2": (2, {"pipeline_parallel_size": 2}),
    "cp2": (2, {"context_parallel_size": 2}),
}
IMAGE_PAD, VIDEO_PAD = 202, 203


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    # NOTE: seed 1: with the default weights (seed 0) beam search draws an image placeholder after the text-only row,
    # which an uncached step (ours and transformers') refuses as one placeholder more than the images give
    folder = make_tiny_qwen3_vl(tmp_path_factory.mktemp("qwen3_vl_generate") / "src", seed=1)
    return str(folder), transformers_reference(str(folder))


@pytest.fixture(scope="module")
def ranks(checkpoint):
    """{layout: per-rank results}: the one-rank layout in one world, the two-rank layouts in another."""
    found = {}
    for nprocs in (1, 2):
        layouts = [(name, sizes, True) for name, (n, sizes) in LAYOUTS.items() if n == nprocs]
        per_rank = run_distributed(generate_many, nprocs, checkpoint[0], layouts, timeout=300)
        for name, *_ in layouts:
            found[name] = [res[name] for res in per_rank]
    return found


def _same(got: dict, ref: dict, what: str) -> None:
    assert_same_generation(got, ref, what, atol=ATOL)


def test_batches_are_what_the_test_means(checkpoint):
    """Images of two sizes in two rows (the second left-padded), 16-pixel patches; videos in Qwen3-VL's per-frame
    layout (a timestamp, then the frame between its own vision start / end), without ``second_per_grid_ts``."""
    folder = checkpoint[0]
    batch = prompt_batch(folder)
    assert batch["image_grid_thw"].tolist() == [[1, 4, 6], [1, 2, 4]]
    assert batch["pixel_values"].shape == (32, 3 * 2 * 16 * 16)
    assert batch["attention_mask"].sum(-1).tolist() == [13, 5, 4]
    assert (batch["input_ids"] == IMAGE_PAD).sum(-1).tolist() == [6, 2, 0]
    ref = checkpoint[1]["images"]["greedy"]
    assert ref["sequences"].shape == (3, 13 + NEW_TOKENS) and ref["scores"].shape[0] == NEW_TOKENS
    videos = video_batch(folder)
    assert "second_per_grid_ts" not in videos
    assert videos["video_grid_thw"].tolist() == [[2, 4, 4], [3, 2, 4]]
    assert videos["pixel_values_videos"].shape == (2 * 16 + 3 * 8, 3 * 2 * 16 * 16)
    ids, kinds = videos["input_ids"], videos["mm_token_type_ids"]
    assert ((kinds == 2) == (ids == VIDEO_PAD)).all() and ((kinds == 1) == (ids == IMAGE_PAD)).all()
    # NOTE: row 1 (left-padded): <|vision_start|>, then three frames of 2 merged tokens, each after its timestamp
    row = ids[1][videos["attention_mask"][1].bool()].tolist()
    frame = [IMAGE_PAD - 2] + [VIDEO_PAD] * 2 + [IMAGE_PAD - 1]
    assert row[0] == IMAGE_PAD - 2 and row[3:7] == frame and row[9:13] == frame and row[15:19] == frame, row
    assert row[19] == IMAGE_PAD - 1 and (ids == VIDEO_PAD).sum(-1).tolist() == [8, 6, 0]


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


@pytest.mark.parametrize("layout", list(LAYOUTS))
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


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_cached_steps_run_one_token(ranks, layout):
    for res in ranks[layout]:
        multiple, prompt = res["multiple"], res["prompt"]
        # NOTE: max_new_tokens=4: the prefill (split over CP under CP), then three one-token steps
        padded = -(-prompt // res["prefill_multiple"]) * res["prefill_multiple"]
        assert res["lengths"]["cached"] == [padded] + [multiple] * 3, res["lengths"]
        assert res["lengths"]["static"] == res["lengths"]["cached"], res["lengths"]
        assert res["static_fixed_steps"] == (0 if layout.startswith("pp2") else 3), res["static_fixed_steps"]
        assert res["lengths"]["uncached"] == [-(-n // multiple) * multiple for n in range(prompt, prompt + 4)]
    # NOTE: two uncached steps encode the images twice (each CP rank its share); a prefill of rows expanded for 3
    # beams encodes each image once
    every = ranks[layout][0]["all_patches"]
    seen, beams = [res["patches"] for res in ranks[layout]], [res["beam_patches"] for res in ranks[layout]]
    if layout == "cp2":
        assert all(len(p) == 2 and p[0] == p[1] < every for p in seen) and sum(p[0] for p in seen) == every, seen
        assert sum(p[0] for p in beams) == every and all(len(p) == 1 for p in beams), beams
    else:  # NOTE: under PP the second stage has no tower
        first = 1 if layout.startswith("pp2") else None
        assert all(p == [every, every] for p in seen[:first]), seen
        assert all(p == [every] for p in beams[:first]), beams


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_refusals_alike_on_every_rank(ranks, layout):
    results = ranks[layout]
    assert_refused_alike(results, REFUSED)
    assert "[3, batch, seq]" in results[0]["refused"]["position_ids_4d"][1]
    if len(results) > 1:
        assert all(res["mismatch"] is not None and res["mismatch"][0] == "GenerationMismatchError"
                   for res in results)
