"""Qwen3.5 image-text (``Qwen3_5ForConditionalGeneration``: Gated DeltaNet and gated full-attention layers, Qwen3-VL's
interleaved mrope over a quarter of each head, Qwen3-VL's ViT without DeepStack) against transformers: logits, loss
and vision gradients within 1e-4 (fp32; measured below 1e-6) on images with a text-only row in one rank and in each
two-rank layout of the tower and the language model (TP2 + SP with the tower split, TP2 with the tower
encoder-data-parallel and both recomputed, PP2, CP2), on videos (a timestamp before each frame) at TP2 + SP and CP2;
packed samples (also at CP2); bit-exact HF round trips; generate with and without the cache (without it at CP2, where
the cached one is refused); LoongTrainer against transformers.Trainer; ``lf.AutoModelForCausalLM`` on the checkpoint;
refusals (the static cache, the cache under CP) on every rank.
Qwen3.5-MoE image-text (``Qwen3_5MoeForConditionalGeneration``, routed experts one tensor per expert, a gated shared
expert) in the same worlds: logits, loss and vision gradients at TP1, EP2, CP2 and TP2 + SP (the tower split, the
experts over EP2 with ETP1), logits and loss at PP2, bit-exact round trips, and with
``output_router_logits`` (coefficient 0.3) the loss, ``aux_loss``, ``router_logits`` and the routers' gradients
against transformers' (1e-5).
LoRA against PEFT on transformers' model (``_vl_qwen3_5_lora.py``): "all-linear" (the tower's linears, the Gated
DeltaNet in-projections, the gated q_proj; MoE: the shared expert and its gate) and a language-only regex, at TP1 and
TP2 + SP with the tower split (MoE: EP2, ETP1). Two worlds: one rank, two ranks."""

from pathlib import Path

import pytest

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing.round_trip import check_round_trip as _check_round_trip, read_all
from loongforge_hf.testing.tiny_vl import (make_tiny_qwen3_5_moe_vl, make_tiny_qwen3_5_vl, tiny_qwen3_5_moe_vl_config,
                                           tiny_qwen3_5_vl_config)

from tests._generation import assert_same_generation

from ._vl_parity import TWO_RANKS
from ._vl_qwen3_5 import generate_reference, one_rank, two_ranks
from ._vl_qwen3_5_lora import ONE_RANK as LORA_ONE_RANK, TWO_RANKS as LORA_TWO_RANKS

TOL = 1e-4
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "processor_config.json")
LAYOUTS = TWO_RANKS
GENERATE_LAYOUTS = {"tp2_sp_vision_tp2": TWO_RANKS["tp2_sp_vision_tp2"], "pp2": TWO_RANKS["pp2"]}
# NOTE: TP2 + SP with the tower split and the experts split over the TP ranks (EP2, ETP1), as the text model's
MOE_TWO_RANKS = {"moe_ep2": {"expert_parallel_size": 2}, "moe_cp2": {"context_parallel_size": 2},
                 "moe_tp2_sp_ep2": {**TWO_RANKS["tp2_sp_vision_tp2"], "expert_parallel_size": 2,
                                    "expert_tensor_parallel_size": 1},
                 "moe_pp2": {"pipeline_parallel_size": 2}}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_tiny_qwen3_5_vl(tmp_path_factory.mktemp("qwen3_5_vl") / "src")


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory) -> Path:
    return make_tiny_qwen3_5_moe_vl(tmp_path_factory.mktemp("qwen3_5_moe_vl") / "src", output_router_logits=True,
                                    router_aux_loss_coef=0.3)


@pytest.fixture(scope="module")
def reference(checkpoint) -> dict:
    return generate_reference(str(checkpoint))


@pytest.fixture(scope="module")
def moe_reference(moe_checkpoint) -> dict:
    return generate_reference(str(moe_checkpoint), output_router_logits=False)


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("qwen3_5_vl_out")


@pytest.fixture(scope="module")
def one(checkpoint, moe_checkpoint, out) -> dict:
    cases = [("tp1", str(checkpoint), {}, str(out / "tp1")), ("moe_tp1", str(moe_checkpoint), {}, str(out / "moe_tp1"))]
    return run_distributed(one_rank, 1, cases, str(checkpoint), str(out / "train"), str(moe_checkpoint),
                           timeout=400)[0]


@pytest.fixture(scope="module")
def two(checkpoint, moe_checkpoint, out) -> list:
    cases = [(n, str(checkpoint), layout, str(out / n), "default", 4) for n, layout in LAYOUTS.items()]
    cases += [(n, str(moe_checkpoint), layout, str(out / n), "default", 4) for n, layout in MOE_TWO_RANKS.items()]
    return run_distributed(two_ranks, 2, cases, str(checkpoint), GENERATE_LAYOUTS, str(moe_checkpoint), timeout=600)


def check(result: dict, *, grads: bool) -> None:
    assert result["logits_shape"] == (*result["batch_shape"], 204), result
    assert result["logit_diff"] < TOL and result["loss_diff"] < TOL, result
    if grads:
        assert result["grad_diff"] is not None and result["grad_diff"] < TOL, result


def check_videos(r: dict) -> None:
    assert r["same_grad_names"] and r["shape"] == (*r["batch_shape"], 204), r
    assert r["logit_diff"] < TOL and r["loss_diff"] < TOL and r["grad_diff"] < TOL, r


def test_parity_one_rank(one):
    """Images (two rows, a text-only third); the video samples packed in one row give the logits they give padded
    (the Gated DeltaNet recurrence restarts per sample)."""
    check(one["tp1"], grads=True)
    packed = one["packed"]
    assert packed["rows"][0] == 1 and packed["position_rows"][0] == 4 and packed["logit_diff"] < 1e-5, packed


def test_parity_two_ranks(two):
    """Each layout on images; videos and images mixed at TP2 + SP with the tower split and at CP2; at CP2 the video
    samples packed in one row give the logits they give padded."""
    for results in two:
        for n, layout in LAYOUTS.items():
            check(results[n], grads=layout.get("pipeline_parallel_size", 1) == 1)
        check_videos(results["videos_tp2_sp"])
        check_videos(results["videos_cp2"])
        packed = results["packed_cp2"]
        assert packed["rows"] == (1, 60) and packed["position_rows"][0] == 4 and packed["logit_diff"] < 1e-5, packed
    assert two[0]["tp2_sp_vision_tp2"]["vision_layout"] == "tensor_parallel"
    assert two[0]["tp2_encoder_data_parallel"]["vision_layout"] == "data_parallel"


def test_round_trips(one, two, checkpoint, out):
    """Every layout's export is the checkpoint bit for bit, under transformers' names."""
    for n in ("tp1", *LAYOUTS):
        _check_round_trip(checkpoint, out / n, side_files=SIDE_FILES)
    names = read_all(out / "tp1")
    assert "model.language_model.layers.0.linear_attn.in_proj_qkv.weight" in names
    assert "model.visual.pos_embed.weight" in names and not any("deepstack" in n for n in names)


def test_moe_parity_and_round_trips(one, two, moe_checkpoint, out):
    """Qwen3.5-MoE image-text at TP1, EP2, CP2, TP2 + SP (the tower split, the experts over EP2 / ETP1) and PP2
    (forward) (images and a text-only row, the balancing loss in the loss); each
    export is the checkpoint bit for bit, its routed experts one tensor per expert as transformers writes them."""
    check(one["moe_tp1"], grads=True)
    for results in two:
        for n, layout in MOE_TWO_RANKS.items():
            check(results[n], grads=layout.get("pipeline_parallel_size", 1) == 1)
    for n in ("moe_tp1", *MOE_TWO_RANKS):
        _check_round_trip(moe_checkpoint, out / n, side_files=SIDE_FILES)
    names = read_all(out / "moe_tp1")
    assert "model.language_model.layers.3.mlp.experts.3.gate_proj.weight" in names
    assert "model.language_model.layers.0.mlp.shared_expert_gate.weight" in names


def test_moe_router_outputs_and_balance_loss(one, two):
    """text_config.output_router_logits with router_aux_loss_coef 0.3: the loss (language model + 0.3 x aux),
    ``aux_loss``, ``router_logits`` (one per layer) and the routers' gradients equal transformers' at TP1 and EP2."""
    runs = [("tp1", one["moe_router"])] + [(f"ep2 rank {i}", got["moe_router_ep2"]) for i, got in enumerate(two)]
    for name, r in runs:
        assert r["router_layers"] == (4, 4) and r["aux"] > 1.0, (name, r)
        for key in ("loss_diff", "aux_diff", "router_logit_diff", "router_grad_diff", "logit_diff"):
            assert r[key] < 1e-5, (name, key, r)


def test_generate_as_transformers(one, two, reference):
    """Greedy with and without the cache (images of two sizes, one row left-padded, and a text-only row) gives
    transformers' tokens (its own cache) with scores and logits within 1e-4, on one rank, at TP2 + SP with the tower
    split and at PP2; the static cache is refused on every rank, naming the way out."""
    runs = [("tp1", one["generate"])] + [(f"{n} rank {r}", got["generate"][n]) for r, got in enumerate(two)
                                         for n in GENERATE_LAYOUTS]
    for what, got in runs:
        for cache in ("uncached", "cached"):
            assert_same_generation(got[cache], reference, f"{what} {cache}", atol=TOL)
        refusal = got["static_refusal"] or ""
        assert "cache_implementation='static' is not supported for Qwen3_5ForConditionalGeneration" in refusal \
            and "dynamic cache" in refusal, (what, refusal)


def test_moe_generate_as_transformers(one, moe_reference):
    """Qwen3.5-MoE: greedy with and without the cache gives transformers' tokens, scores and logits within 1e-4 (one
    rank); the static cache is refused naming the class."""
    got = one["moe_generate"]
    for cache in ("uncached", "cached"):
        assert_same_generation(got[cache], moe_reference, f"moe {cache}", atol=TOL)
    assert "cache_implementation='static' is not supported for Qwen3_5MoeForConditionalGeneration" in \
        (got["static_refusal"] or ""), got["static_refusal"]


def test_trainer_matches_transformers_trainer(one, checkpoint, out):
    """Three steps with the ViT frozen (the merger trains): LoongTrainer (TP1) logs transformers.Trainer's losses;
    the frozen ViT comes out of save_model bit for bit."""
    got = one["train"]
    assert len(got["loong"]) == len(got["hf"]) == 3
    assert got["loong"] == pytest.approx(got["hf"], rel=1e-4)
    assert got["loong"][-1] < got["loong"][0]
    src, saved = read_all(checkpoint), read_all(out / "train" / "loong" / "final")
    assert sorted(src) == sorted(saved)
    moved = sorted(n for n in src if not src[n].equal(saved[n]))
    assert all(not n.startswith("model.visual.") or n.startswith("model.visual.merger.") for n in moved), moved
    assert any(n.startswith("model.visual.merger.") for n in moved)
    assert any(n.startswith("model.language_model.layers.0.linear_attn.") for n in moved)


def test_causal_lm_loader_gives_the_image_text_model(one):
    """transformers' AutoModelForCausalLM loads the checkpoint's text model; ours the image-text model, with the same
    logits on a left-padded text batch."""
    got = one["causal_lm"]
    assert got["classes"] == ("LoongModelForImageTextToText", "Qwen3_5ForCausalLM"), got
    assert got["logit_diff"] < TOL, got


def test_context_parallel_generate(two, reference):
    """CP2: greedy without the cache gives transformers' tokens, scores and logits within 1e-4 on both ranks; the
    cached generate is refused on both (its split prefill cannot fill the Gated DeltaNet states), naming the way
    out."""
    for rank, got in enumerate(two):
        cp = got["generate_cp2"]
        assert_same_generation(cp["uncached"], reference, f"cp2 rank {rank} uncached", atol=TOL)
        assert "cannot carry the states of recurrent (Gated DeltaNet / Mamba2) layers; under context parallelism " \
            "generate with use_cache=False" in (cp["cached_refusal"] or ""), (rank, cp["cached_refusal"])


# NOTE: the adapted HF modules: ViT blocks x 4 + the merger's 2; per Gated DeltaNet layer (3) in_proj_qkv / z / b / a,
# out_proj, the full-attention layer's q / k / v / o, per layer the MLP's 3 (MoE: the shared expert's 3 and its gate)
LORA_TARGETS = {"dense/all_linear": 2 * 4 + 2 + 3 * 5 + 4 + 4 * 3, "dense/language_regex": 3 * 5 + 4 + 4 * 3,
                "moe/all_linear": 2 * 4 + 2 + 3 * 5 + 4 + 4 * 4}
# NOTE: each adapter factor's gradient within 1e-4 of its largest entry, but in_proj_a's (the decay's input) within
# 2e-3: layer 0's differs from PEFT's by up to 9.6e-4 (3e-4 on text alone). Conditioning, not a bug: the tiny
# checkpoint's layer-0 log decays are g ~ -15..-21 a token, so dL/dg is ~1e-9 on most tokens and the chunked form's
# reverse running sum of the decays' gradient leaves an fp32 rounding residue of 1.6e-9 on every earlier token.
# On layer 0's captured inputs and output gradient, dL/dg of our fp32 rule and of transformers' fp32 torch chunked
# rule are bit-identical and both 7.8e-5 (of its largest entry) off an fp64 token-by-token recurrence; in the model
# each side's rounding residue follows its own fp32 inputs. (PEFT "in fp64" is 1e-5 off only because transformers'
# rule casts to fp32: that comparison shares the rounding.)
LORA_GRAD_TOL, IN_PROJ_A_GRAD_TOL = 1e-4, 2e-3


@pytest.mark.parametrize("case", [f"{k}/{lay}/{n}" for k, lay, _, n in LORA_ONE_RANK + LORA_TWO_RANKS])
def test_lora_matches_peft(one, two, case):
    """LoRA (random B) against PEFT on transformers' model, images and a text-only row: logits and loss within 1e-5
    (fp32), PEFT's parameter counts, every adapter's A and B gradient (the tower's as each rank holds them, the
    language model's gathered at HF shape), ``adapter_config.json``'s target_modules as PEFT writes them, the adapter
    folder in ``PeftModel.from_pretrained`` and the merged export in transformers with our logits (1e-5), the model
    unchanged by the merged export."""
    ranks = [one["lora"][case]] if "/tp1/" in case else [r["lora"][case] for r in two]
    key, _, name = case.split("/")
    for res in ranks:
        assert tuple(res["counts"]) == tuple(res["peft_counts"]), res
        assert res["logits_diff"] < 1e-5 and res["loss_diff"] < 1e-5 and res["unchanged_after_merged_export"], res
        assert len(res["targets"]) == LORA_TARGETS[f"{key}/{name}"] and len(res["grads"]) == 2 * len(res["targets"])
        assert (name == "all_linear") == any(t.startswith("model.visual.") for t in res["targets"]), res["targets"]
        for factor, diff in res["grads"].items():
            assert diff < (IN_PROJ_A_GRAD_TOL if ".in_proj_a." in factor else LORA_GRAD_TOL), (factor, diff)
    rank0 = ranks[0]
    assert rank0["adapter_logits_diff"] < 1e-5 and rank0["merged_logits_diff"] < 1e-5, rank0
    ours, theirs = rank0["target_modules"]
    assert ours == theirs, (ours, theirs)


def test_bad_configs_are_refused():
    from loongforge_hf.bridges.config_map import UnsupportedConfigError
    from loongforge_hf.bridges.qwen3_5_vl import Qwen3_5MoeVLBridge, Qwen3_5VLBridge

    for change, message in (({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor":
                                                  0.25, "mrope_section": [4, 6, 6]}},
                             r"mrope_section=\[4, 6, 6\] must be three sizes .* = 8"),
                            ({"layer_types": ["linear_attention", "sliding_attention", "full_attention",
                                              "linear_attention"]}, "layer_types"),):
        with pytest.raises(UnsupportedConfigError, match=message):
            Qwen3_5VLBridge(tiny_qwen3_5_vl_config(**change))
    with pytest.raises(UnsupportedConfigError, match="num_experts=0 is not supported for "
                                                     "Qwen3_5MoeForConditionalGeneration"):
        Qwen3_5MoeVLBridge(tiny_qwen3_5_moe_vl_config(num_experts=0))
    config = tiny_qwen3_5_vl_config()
    config.vision_config.num_position_embeddings = 15
    with pytest.raises(UnsupportedConfigError, match="must be a square"):
        Qwen3_5VLBridge(config)
