"""``generate()`` of Qwen2.5-VL (``loongforge_hf/multimodal/generation.py``) against transformers' own
``Qwen2_5_VLForConditionalGeneration.generate`` on the tiny fp32 checkpoint, and against our ``use_cache=False`` path.

- A left-padded batch from the real processor: two prompts with images of different sizes (6 and 2 merged tokens,
  one row left-padded by 8) and a text-only prompt; greedy (scores and raw logits) and seeded top-k sampling (raw
  logits) give transformers' tokens, and scores / logits within 1e-5 of transformers' and of ``use_cache=False``'s;
  a text-only batch (no images: positions from the attention mask) and a batch with videos (0.5 s and 1.5 s per
  temporal grid), an image and a text-only row (greedy, cached and uncached) too. On every rank of: one rank, TP2
  (vision tower replicated), PP2, and TP2 with sequence parallelism and the tower split over TP (steps padded to 2).
- After the prefill each cached forward runs the new token only (padded to ``sequence_multiple``), where
  ``use_cache=False`` runs the whole sequence so far.
- Refused with a ValueError on every rank alike: beam search / several return sequences with images,
  ``position_ids`` that are not ``[3, b, s]``, ``inputs_embeds``; context parallelism (checked without a world).
  Ranks of one replica passing different ``pixel_values`` raise the replica-mismatch error (the hash covers them).
"""

import pytest

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing.tiny_vl import make_tiny_qwen2_5_vl

from tests._generation import assert_same_generation

from ._vl_generate import NEW_TOKENS, REFUSED, SCENARIOS, generate_many, prompt_batch, transformers_reference

ATOL = 1e-5  # NOTE: fp32; measured differences are below 3e-7
LAYOUTS = {  # name: (ranks, from_pretrained keywords)
    "tp1": (1, {}),
    "tp2": (2, {"tensor_parallel_size": 2}),
    "pp2": (2, {"pipeline_parallel_size": 2}),
    "tp2_sp_vision_tp2": (2, {"tensor_parallel_size": 2, "sequence_parallel": True,
                              "vision_tensor_parallel_size": 2}),
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = make_tiny_qwen2_5_vl(tmp_path_factory.mktemp("vl_generate") / "src")
    return str(folder), transformers_reference(str(folder))


@pytest.fixture(scope="module")
def ranks(checkpoint):
    """{layout: per-rank results}: the one-rank layout in one world, the two-rank layouts in another."""
    found = {}
    for nprocs in (1, 2):
        layouts = [(name, sizes) for name, (n, sizes) in LAYOUTS.items() if n == nprocs]
        per_rank = run_distributed(generate_many, nprocs, checkpoint[0], layouts, timeout=300)
        for name, _ in layouts:
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
        _same(res["text_only"]["greedy"], ref["text_only"]["greedy"], f"{layout} rank {rank} text-only batch")
        _same(res["videos"]["greedy"], ref["videos"]["greedy"], f"{layout} rank {rank} videos cached")
        _same(res["videos_uncached"]["greedy"], ref["videos"]["greedy"], f"{layout} rank {rank} videos uncached")


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_cached_steps_run_one_token(ranks, layout):
    for res in ranks[layout]:
        multiple, prompt = res["multiple"], res["prompt"]
        padded = -(-prompt // multiple) * multiple
        # NOTE: max_new_tokens=4: the prefill, then three one-token steps (padded to the layout's multiple)
        assert res["lengths"]["cached"] == [padded] + [multiple] * 3, res["lengths"]
        assert res["lengths"]["uncached"] == [-(-n // multiple) * multiple for n in range(prompt, prompt + 4)]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_refusals_alike_on_every_rank(ranks, layout):
    results = ranks[layout]
    for name in REFUSED:
        got = results[0]["refused"][name]
        assert got is not None and got[0] == "ValueError", (name, got)
        assert all(res["refused"][name] == got for res in results), name
    assert "num_beams" in results[0]["refused"]["beams"][1]
    assert "[3, batch, seq]" in results[0]["refused"]["position_ids_4d"][1]
    if len(results) > 1:
        assert all(res["mismatch"] is not None and res["mismatch"][0] == "GenerationMismatchError"
                   for res in results)


def test_context_parallel_refused():
    """The refusal is local (no collective): checked on a model object without a world."""
    from types import SimpleNamespace

    from loongforge_hf.multimodal.generation import generation_refusal

    model = SimpleNamespace(parallel=SimpleNamespace(context_parallel_size=2))
    config = SimpleNamespace(num_beams=1, num_return_sequences=1)
    assert "context_parallel_size" in generation_refusal(model, config, {})
    model.parallel.context_parallel_size = 1
    assert generation_refusal(model, config, {}) is None
