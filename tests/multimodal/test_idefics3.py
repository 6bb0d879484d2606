"""SmolVLM and Idefics3 image-text (``SmolVLMForConditionalGeneration``, ``Idefics3ForConditionalGeneration``: SigLIP
ViT with bucketed position ids, pixel-shuffle connector, Llama decoder) against transformers, in two launches (one
rank, two ranks) whose checks the tests below read:

- logits, loss and vision gradients within 1e-4 (fp32) with three 102x102 tiles in one batch (``pixel_values
  [2, 2, 3, 102, 102]`` with a zero padding image), in each layout of the vision tower and the language model;
  bit-exact round trips; greedy (cached, uncached) and beam ``generate``;
- LoRA against PEFT on transformers' model: ``target_modules=["q_proj", "v_proj"]`` (rsLoRA; in the language model
  and in SigLIP, where they are two of the three blocks of the tower's fused ``qkv``) and PEFT's "all-linear" (the
  language model's and SigLIP's linears and the connector's ``modality_projection.proj``) with a language norm in
  ``modules_to_save``; the same seed on both sides (random B): logits and loss within 1e-5, every adapter's gradient
  within 5e-5 of its largest entry, PEFT's parameter counts, ``target_modules`` and the adapter file's tensor names
  and shapes, the adapter folder in ``PeftModel.from_pretrained`` and the merged export in transformers;
- refusals; the processor's samples through the collator and LoongTrainer."""


import pytest
import torch

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing.round_trip import check_round_trip as _check_round_trip, read_all
from loongforge_hf.testing.tiny_idefics3 import make_tiny_idefics3, tiny_idefics3_config

from ._vl_idefics3 import LORA_CASES, TEXT_ROWS, checks, make_batch
from ._vl_parity import TWO_RANKS, check_generate, check_lora_vs_peft

TOL = 1e-4
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")
GRADS = 38  # vision tensors with a gradient: 2 x 16 block tensors, patch conv (2), table, post norm (2), connector
SPLIT_SP = {"tensor_parallel_size": 2, "sequence_parallel": True, "vision_tensor_parallel_size": 2}
# LoRA: adapted linears per config (SigLIP's and the connector's, the language model's: 4 layers); tensors trained
# whole
TARGETS = {"qv": (2 * 2, 4 * 2), "all_linear": (2 * 6 + 1, 4 * 7)}
SAVED = {"qv": 0, "all_linear": 4}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("idefics3")
    return {"smolvlm": make_tiny_idefics3(root / "smolvlm"), "idefics3": make_tiny_idefics3(root / "idefics3",
                                                                                            smolvlm=False),
            "out": root / "out"}


@pytest.fixture(scope="module")
def one_rank(folders) -> dict:
    """TP1: SmolVLM (untied head) with images and a text-only batch, Idefics3 (tied head), each exported; generate;
    LoRA; refusals; the collator and training."""
    smolvlm, idefics3, out = (str(folders[k]) for k in ("smolvlm", "idefics3", "out"))
    cases = [("smolvlm", smolvlm, {}, f"{out}/smolvlm", {}),
             ("text_only", smolvlm, {}, None, {"batch": make_batch(TEXT_ROWS)}),
             ("idefics3", idefics3, {}, f"{out}/idefics3", {})]
    return run_distributed(checks, 1, smolvlm, f"{out}/one", 1, cases, {"tp1": {}}, timeout=600)[0]


@pytest.fixture(scope="module")
def two_ranks(folders) -> list:
    """TP2 + SP with the tower split, TP2 with the tower encoder-data-parallel and recompute, PP2, CP2 (SmolVLM);
    Idefics3 at TP2 + SP with the tower split; generate and LoRA at TP2 + SP with the tower split."""
    smolvlm, idefics3, out = (str(folders[k]) for k in ("smolvlm", "idefics3", "out"))
    cases = [(n, smolvlm, layout, f"{out}/{n}", {}) for n, layout in TWO_RANKS.items()]
    cases.append(("idefics3_split_sp", idefics3, SPLIT_SP, f"{out}/idefics3_split_sp", {}))
    return run_distributed(checks, 2, smolvlm, f"{out}/two", 2, cases, {"tp2_sp": SPLIT_SP}, timeout=600)


def check(result: dict, *, grads: bool = True) -> None:
    assert result["logits_shape"] == (2, 64, 240), result
    assert result["logit_diff"] < TOL and result["loss_diff"] < TOL, result
    if grads:
        assert result["grad_diff"] is not None and result["grad_diff"] < TOL and result["grads"] == GRADS, result


def test_parity_round_trip_and_generate_one_rank(folders, one_rank):
    """Both models at TP1, each exported under the names it was read (the untied head written, the tied one not);
    greedy (cached, uncached) and beam ``generate`` with left-padded prompts of two tiles and one (its pixel_values
    padded with a zero image): the same tokens, logits and scores within 1e-4."""
    results, out = one_rank["parity"], folders["out"]
    check(results["smolvlm"])
    check(results["idefics3"])
    assert results["text_only"]["logit_diff"] < TOL and results["text_only"]["loss_diff"] < TOL
    for name in ("smolvlm", "idefics3"):
        _check_round_trip(folders[name], out / name, side_files=SIDE_FILES)
    assert "lm_head.weight" in read_all(out / "smolvlm")
    assert not any("lm_head" in n for n in read_all(out / "idefics3"))
    check_generate(one_rank["generate"])


def test_parity_round_trip_and_generate_two_ranks(folders, two_ranks):
    """Every two-rank layout (PP2: forward only; CP2: a tile spans chunks of both ranks, gradients summed over the
    CP ranks) and Idefics3 at TP2 + SP with the tower split, against transformers; round trips; ``generate`` at
    TP2 + SP with the tower split."""
    for got in two_ranks:
        results = got["parity"]
        for n, layout in TWO_RANKS.items():
            check(results[n], grads=layout.get("pipeline_parallel_size", 1) == 1)
        check(results["idefics3_split_sp"])
        check_generate(got["generate"])
    parity = two_ranks[0]["parity"]
    assert parity["tp2_sp_vision_tp2"]["vision_layout"] == parity["idefics3_split_sp"]["vision_layout"] \
        == "tensor_parallel"
    assert parity["tp2_encoder_data_parallel"]["vision_layout"] == "data_parallel"
    for n in TWO_RANKS:
        _check_round_trip(folders["smolvlm"], folders["out"] / n, side_files=SIDE_FILES)
    _check_round_trip(folders["idefics3"], folders["out"] / "idefics3_split_sp", side_files=SIDE_FILES)


def test_lora_matches_peft(one_rank, two_ranks):
    """"qv" and "all-linear" at TP1, "all-linear" at TP2 + SP with the tower split (its adapters split)."""
    check_lora_vs_peft([one_rank], {c: names for c, (_, names) in LORA_CASES[1].items()}, targets=TARGETS,
                       saved=SAVED)
    check_lora_vs_peft(two_ranks, {c: names for c, (_, names) in LORA_CASES[2].items()}, targets=TARGETS,
                       saved=SAVED)


def test_bad_configs_and_inputs_are_refused(one_rank):
    """Each config refusal raises from the bridge (the first thing ``from_pretrained`` builds, before any
    collective); a tile with padded patches and a tile of another size raise from the forward."""
    from loongforge_hf.bridges.config_map import UnsupportedConfigError
    from loongforge_hf.bridges.idefics3 import Idefics3Bridge

    for top, vision, message in (({"scale_factor": 3}, {}, "must be a whole number dividing the 25x25"),
                                 ({}, {"attention_dropout": 0.1}, "attention_dropout=0.1 is not supported"),
                                 ({}, {"hidden_act": "nope"}, "hidden_act='nope'"),
                                 ({}, {"patch_size": [4, 4]}, "must be whole numbers"),
                                 ({}, {"num_attention_heads": 3}, "not a multiple of num_attention_heads=3")):
        config = tiny_idefics3_config()
        for k, value in top.items():
            setattr(config, k, value)
        for k, value in vision.items():
            setattr(config.vision_config, k, value)
        with pytest.raises(UnsupportedConfigError, match=message):
            Idefics3Bridge(config)
    with pytest.raises(UnsupportedConfigError, match="text_config.model_type='qwen2' is not supported"):
        Idefics3Bridge(tiny_idefics3_config(model_type="qwen2"))
    got = one_rank["refusals"]
    assert got["padded"].startswith("ValueError: pixel_attention_mask marks patches"), got
    assert got["small"].startswith("ValueError: Idefics3's vision tower takes 102x102 images"), got


def test_collated_batches_train_as_transformers(folders, one_rank):
    """Samples through the tiny ``SmolVLMProcessor`` (pictures cut into 2x2 or 2x1 tiles and a global image) through
    DataCollatorForImageText (the tiles joined into ``pixel_values [1, 13, 3, 102, 102]``): logits as transformers'
    on the padded batch; packed (one row, 2-D positions) as padded; LoongTrainer (ViT frozen) logs
    transformers.Trainer's three losses, and the frozen ViT comes out of save_model bit for bit while the connector
    moved."""
    got = one_rank["train"]
    collated = got["collated"]
    assert collated["pixels"] == (1, 13, 3, 102, 102), collated
    assert collated["packed_shape"][0] == 1 and len(collated["positions"]) == 2, collated
    assert collated["padded_diff"] < TOL and collated["packed_diff"] < 1e-5, collated
    assert len(got["loong"]) == len(got["hf"]) == 3
    assert got["loong"] == pytest.approx(got["hf"], rel=1e-4)
    src, out = read_all(folders["smolvlm"]), read_all(folders["out"] / "one" / "train" / "loong" / "final")
    moved = sorted(n for n in src if not torch.equal(src[n], out[n]))
    assert all(not n.startswith("model.vision_model.") for n in moved), moved
    assert "model.connector.modality_projection.proj.weight" in moved, moved
