"""``model.generate`` against transformers' own ``generate`` on the same tiny checkpoint (fp32, Qwen2 with attention
dropout 0.3, a left-padded batch of prompts of three lengths from the tokenizer), both with their KV cache (the
default; ``tests/test_generation_cache.py`` checks ours against ``use_cache=False`` and that it runs one token a step).

- Greedy, eos stopping (one row stops early, the others pad after it), sampling (top-k, top-p, temperature after
  ``transformers.set_seed``: the same tokens and processed logits), beam search (2 beams, 2 sequences returned,
  scores, beam indices) and beam sampling give transformers' tokens, and scores / logits within 1e-5, at TP1, TP2
  and PP2 (every rank alike).
- The model in training mode generates as in eval mode (no dropout) and is back in training mode after.
- Sampling when the ranks' generators are in step: every rank's ends where transformers' does (ranks stay in step:
  a trainer's shuffle after it agrees); when they differ: every rank draws the first rank's numbers, the first rank's
  generator ends where transformers' does, the other ranks' get their own state back.
- Refused options raise a ValueError naming them on every rank; ranks of one replica passing different settings
  raise the same mismatch error instead of hanging.
- Data-parallel ranks generate different prompts with different lengths and settings, each as transformers, also
  under expert parallelism (EP2 across them, Qwen3-MoE), where the ranks' forwards stay in step.
- Image-text models: ``tests/multimodal/test_qwen2_5_vl_generate.py``.
- A LoRA model generates as PEFT's model on transformers (TP1, TP2), with the dynamic and the static cache.
"""

import pytest
import torch

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing import make_tiny_checkpoint

from ._generation import (PROMPTS, REFUSED, SCENARIOS, assert_refused_alike, data_parallel_run, generation_run,
                          transformers_reference)

ATOL = 1e-5
LAYOUTS = {"tp1": (1, {}), "tp2": (2, {"tensor_parallel_size": 2}), "pp2": (2, {"pipeline_parallel_size": 2})}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = make_tiny_checkpoint(tmp_path_factory.mktemp("gen") / "qwen2", "qwen2", attention_dropout=0.3)
    return folder, transformers_reference(str(folder))


@pytest.fixture(scope="module", params=list(LAYOUTS))
def ranks(request, checkpoint):
    nprocs, layout = LAYOUTS[request.param]
    return request.param, run_distributed(generation_run, nprocs, str(checkpoint[0]), layout,
                                          lora=request.param != "pp2", timeout=240)


def _same(got: dict, ref: dict, what: str) -> None:
    assert torch.equal(got["sequences"], ref["sequences"]), (what, got["sequences"], ref["sequences"])
    assert set(got) == set(ref), what
    for key in set(ref) - {"sequences"}:
        torch.testing.assert_close(got[key], ref[key], atol=ATOL, rtol=0, msg=lambda m: f"{what} {key}: {m}")


def test_eos_stops_some_rows(checkpoint):
    ref = checkpoint[1]
    new = ref["eos"]["sequences"][:, -SCENARIOS["eos"]["max_new_tokens"]:]
    stopped = [bool((row == SCENARIOS["eos"]["eos_token_id"]).any()) for row in new]
    assert stopped == [False, True, False], new
    assert new[1, -1] == 0 and not torch.equal(ref["eos"]["sequences"], ref["greedy"]["sequences"])


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_generate_as_transformers(checkpoint, ranks, scenario):
    layout, results = ranks
    for rank, res in enumerate(results):
        _same(res["eval"][scenario], checkpoint[1][scenario], f"{layout} rank {rank} {scenario}")


def test_training_mode_generates_without_dropout_and_stays(checkpoint, ranks):
    for res in ranks[1]:
        assert (res["training_before"], res["training_after"]) == (False, True)
        _same(res["train_mode"], checkpoint[1]["greedy"], "training mode")


def test_sampling_uses_the_first_ranks_generator(checkpoint, ranks):
    results = ranks[1]
    for rank, res in enumerate(results):
        _same(res["sample_desynced"], checkpoint[1]["sample"], f"rank {rank}")
        assert torch.equal(res["rng_in_step"], checkpoint[1]["rng_after_sample"]), rank
        before, after = res["rng"]
        if rank == 0:
            assert torch.equal(after, checkpoint[1]["rng_after_sample"])
        else:
            assert torch.equal(after, before)


def test_refused_options_raise_on_every_rank(ranks):
    results = ranks[1]
    assert_refused_alike(results, REFUSED)
    assert "output_attentions" in results[0]["refused"]["output_attentions"][1]
    assert "'static'" in results[0]["refused"]["offloaded_cache"][1]


def test_replica_mismatch_raises_on_every_rank(ranks):
    layout, results = ranks
    if len(results) == 1:
        pytest.skip("one rank")
    assert all(res["mismatch"] is not None and res["mismatch"][0] == "GenerationMismatchError" for res in results)
    assert len({res["mismatch"] for res in results}) == 1


def test_lora_generates_as_peft(ranks):
    layout, results = ranks
    if "lora" not in results[0]:
        pytest.skip("LoRA checked at TP1 and TP2")
    for res in results:
        ours, peft, static = res["lora"]
        assert torch.equal(ours, peft)
        assert torch.equal(static, peft)  # NOTE: the static cache's fixed-shape steps run the adapters too


DP_PROMPTS = [PROMPTS[:2], PROMPTS[1:] + ["tok20"]]
# NOTE: as many generate calls on each rank (expert parallelism needs it), with different settings
DP_SCENARIOS = [{"greedy": dict(max_new_tokens=3), "sample": SCENARIOS["sample"],
                 "beam": {**SCENARIOS["beam"], "max_new_tokens": 2}},
                {"greedy": dict(max_new_tokens=9), "sample": {**SCENARIOS["sample"], "top_k": 5},
                 "beam": SCENARIOS["beam"]}]


def _check_data_parallel(folder, layout: dict) -> None:
    results = run_distributed(data_parallel_run, 2, str(folder), layout, DP_PROMPTS, DP_SCENARIOS, timeout=180)
    for rank, res in enumerate(results):
        ref = transformers_reference(str(folder), DP_PROMPTS[rank], DP_SCENARIOS[rank])
        for name in DP_SCENARIOS[rank]:
            _same(res[name], ref[name], f"{layout} rank {rank} {name}")


def test_data_parallel_ranks_generate_their_own_prompts(checkpoint):
    _check_data_parallel(checkpoint[0], {})


def test_expert_parallel_ranks_generate_their_own_prompts(tmp_path):
    """EP2 over the two data-parallel ranks: the experts' all-to-all runs as long as the longest rank generates."""
    _check_data_parallel(make_tiny_checkpoint(tmp_path / "moe", "qwen3_moe"), {"expert_parallel_size": 2})
