"""PaliGemma image-text (``PaliGemmaForConditionalGeneration``: SigLIP ViT, a linear projector, Gemma or Gemma 2
with prefix-LM attention) against transformers, one launch per world size:

- logits, loss and vision gradients within 1e-4 (fp32) on two rows (64 ``<image>`` tokens, a prefix seen both ways,
  a causal suffix, one row right-padded): PaliGemma 1 (Gemma) and 2 (Gemma 2: sliding layers, soft-capping) at TP1,
  PaliGemma 1 without token_type_ids (causal, as transformers' with an attention_mask); PaliGemma 2 at TP2 + SP with
  the tower split over TP, at PP2 (forward; the prefix block on both stages) and at CP2 (the 69-token prefix block
  spans all four load-balanced chunks, past the sliding window of 8; gradients summed over the CP ranks); bit-exact
  round trips;
- LoRA against PEFT on PaliGemma 2 (unpadded rows: ``_vl_paligemma.FULL_ROWS`` says why): the language model's
  linears at TP1, PP2 and CP2, PEFT's "all-linear" at TP1 and at TP2 + SP with the tower split (logits, loss,
  adapter gradients, the adapter folder in PEFT, the merged export in transformers:
  ``_vl_parity.check_lora_vs_peft``); a PEFT-written "all-linear" adapter loaded at CP2;
- greedy (cached and uncached) and beam search ``generate`` (PaliGemma 2, left-padded prefixes);
- the refusals, before any collective."""

import pytest

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing.round_trip import check_round_trip
from loongforge_hf.testing.tiny_paligemma import make_tiny_paligemma, tiny_paligemma_config

from ._vl_gemma3 import SCENARIOS
from ._vl_lora import check_peft_adapter
from ._vl_paligemma import checks
from ._vl_parity import check_lora_vs_peft

TOL = 1e-4
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")
GRADS = 39  # vision tensors with a gradient: patch conv (2), table, 2 x 16 block tensors, post norm (2), projector (2)
SPLIT_SP = {"tensor_parallel_size": 2, "sequence_parallel": True, "vision_tensor_parallel_size": 2}
PP2, CP2 = {"pipeline_parallel_size": 2}, {"context_parallel_size": 2}
# LoRA per world size: case -> (layout, _vl_paligemma.LORA_CONFIGS names); adapted linears per config (SigLIP's
# 2 x 6 and the projector's, the language model's 4 x 7), none trained whole
LORA_CASES = {1: {"tp1": ({}, ("language", "all_linear"))},
              2: {"pp2": (PP2, ("language",)), "cp2": (CP2, ("language",)), "split": (SPLIT_SP, ("all_linear",))}}
LORA_TARGETS, LORA_SAVED = {"language": (0, 28), "all_linear": (13, 28)}, {"language": 0, "all_linear": 0}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("paligemma")
    return {"pg1": make_tiny_paligemma(root / "pg1"), "pg2": make_tiny_paligemma(root / "pg2", gemma2=True),
            "out": root / "out"}


@pytest.fixture(scope="module")
def one_rank(folders) -> dict:
    pg1, pg2, out = (str(folders[k]) for k in ("pg1", "pg2", "out"))
    cases = [("pg1", pg1, {}, f"{out}/pg1", {}), ("pg2", pg2, {}, f"{out}/pg2", {}),
             ("pg1_causal", pg1, {}, None, {"token_types": False})]
    return run_distributed(checks, 1, cases=cases, generation=(pg2, SCENARIOS), timeout=600,
                           lora=(pg2, f"{out}/lora", LORA_CASES[1]))[0]


@pytest.fixture(scope="module")
def two_ranks(folders) -> list:
    pg2, out = str(folders["pg2"]), folders["out"]
    cases = [("split", pg2, SPLIT_SP, f"{out}/split", {}), ("pp2", pg2, PP2, f"{out}/pp2", {}),
             ("cp2", pg2, CP2, None, {})]
    return run_distributed(checks, 2, cases=cases, lora=(pg2, f"{out}/lora", LORA_CASES[2]),
                           peft_adapter=(pg2, f"{out}/peft-cp2", CP2), timeout=600)


def check(result: dict) -> None:
    assert result["logits_shape"] == (2, 80, 204), result
    assert result["logit_diff"] < TOL and result["loss_diff"] < TOL, result
    assert result["grad_diff"] is not None and result["grad_diff"] < TOL and result["grads"] == GRADS, result


def test_parity_round_trip_and_generate_one_rank(folders, one_rank):
    for name in ("pg1", "pg2", "pg1_causal"):
        check(one_rank[name])
    for name in ("pg1", "pg2"):
        check_round_trip(folders[name], folders["out"] / name, side_files=SIDE_FILES)
    got = one_rank["generate"]
    assert set(got) == set(SCENARIOS), got
    for result in got.values():
        assert result["same_sequences"] and result["max_diff"] < TOL and result["steps"] >= 4, got


def test_parity_and_round_trip_tp2_sp_split_tower(folders, two_ranks):
    for rank in two_ranks:
        check(rank["split"])
        assert rank["split"]["vision_layout"] == "tensor_parallel", rank["split"]
    check_round_trip(folders["pg2"], folders["out"] / "split", side_files=SIDE_FILES)


def test_parity_pp2_and_cp2(folders, two_ranks):
    """PP2 (logits and loss; no vision gradients across stages) and CP2 with the prefix block across the chunks."""
    for rank in two_ranks:
        check(rank["cp2"])
        assert rank["pp2"]["logits_shape"] == (2, 80, 204), rank["pp2"]
        assert rank["pp2"]["logit_diff"] < TOL and rank["pp2"]["loss_diff"] < TOL, rank["pp2"]
    check_round_trip(folders["pg2"], folders["out"] / "pp2", side_files=SIDE_FILES)


def test_lora_matches_peft(one_rank, two_ranks):
    for ranks, cases in (([one_rank], LORA_CASES[1]), (two_ranks, LORA_CASES[2])):
        check_lora_vs_peft(ranks, {case: names for case, (_, names) in cases.items()}, targets=LORA_TARGETS,
                           saved=LORA_SAVED, no_grads=("pp2",))


def test_peft_written_adapter_loads_at_cp2(two_ranks):
    """A PEFT-written "all-linear" adapter: ``from_pretrained`` of its folder, ``load_adapter``, ``disable_adapter``
    and ``merge_and_unload`` with PEFT's logits (``_vl_lora.check_peft_adapter``)."""
    for rank in two_ranks:
        check_peft_adapter(rank["peft_adapter"])


def test_bad_configs_and_inputs_are_refused():
    import torch

    from loongforge_hf.bridges.config_map import UnsupportedConfigError
    from loongforge_hf.bridges.paligemma import PaliGemmaBridge

    for top, vision, text, message in (({"projection_dim": 32}, {}, {}, "projection_dim=32 must equal"),
                                       ({"tie_word_embeddings": False}, {}, {}, "tie_word_embeddings=False"),
                                       ({}, {"vision_use_head": True}, {}, "vision_use_head=True"),
                                       ({}, {"attention_dropout": 0.1}, {}, "attention_dropout=0.1"),
                                       ({}, {"patch_size": 5}, {}, "not a multiple of patch_size=5"),
                                       ({}, {}, {"model_type": "llama"}, "text_config.model_type='llama'")):
        config = tiny_paligemma_config()
        for obj, changes in ((config, top), (config.vision_config, vision), (config.text_config, text)):
            for k, value in changes.items():
                setattr(obj, k, value)
        with pytest.raises(UnsupportedConfigError, match=message):
            PaliGemmaBridge(config)
    bridge = PaliGemmaBridge(tiny_paligemma_config())
    with pytest.raises(ValueError, match="without token_type_ids and without attention_mask"):
        bridge.attention_token_types(None, None)
    with pytest.raises(ValueError, match="token_type_ids with packed rows"):
        bridge.attention_token_types(torch.zeros(1, 4, dtype=torch.long), None, packed=True)
    types = bridge.attention_token_types(torch.tensor([[0, 0, 1, 0]]), torch.tensor([[1, 1, 1, 0]]))
    assert types.tolist() == [[0, 0, 1, 1]]
