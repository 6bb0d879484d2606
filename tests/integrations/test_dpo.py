"""LoongDPOTrainer against trl.DPOTrainer (with PEFT for LoRA) on the transformers model, same DPOConfig.

Scenarios (``_dpo_parity.SCENARIOS``), 4 optimizer steps of 2 micro-batches of 2 pairs each, "sigmoid" loss, beta 0.1:
full fine-tuning with a reference model passed; LoRA (q, v, down projections) with no reference model (the adapters
disabled are the reference), evaluating after steps 2 and 4; full fine-tuning with ``precompute_ref_log_probs=True``.
All at TP=1; the first two also at TP=2 with sequence parallelism, at PP=2, at CP=2 (load-balanced chunks of
right-padded rows) and at PP=2 x VPP=2 (an evaluation batch through the virtual stages one by one). (With the
precomputed reference the first step's rewards are rounding noise around 0, so its reward accuracy depends on how
the layout rounds: not compared beyond TP=1; it reads the reference through the same forward as evaluation.) At
DP=2, against trl.DPOTrainer under DDP in the same two-rank world: the LoRA scenario, and 2-step full fine-tuning
runs of each other TRL 1.16 loss type (``_dpo_parity.LOSS_SCENARIOS``: label smoothing, the f-divergences, RPO as
"sigmoid" + weighted "sft"; WPO's ``use_weighting`` with "sigmoid" + "ipo"; LD-DPO's ``ld_alpha`` with "sigmoid" +
"sft"; the ones that count tokens evaluating after each step). WPO also at TP=2 with sequence parallelism (its
``log sum_v p_v^2`` reduced over the vocabulary shards) against TRL at one process. A tiny Qwen3-MoE
(``_dpo_parity.MOE_SCENARIOS``: loaded without ``output_router_logits``, ``router_aux_loss_coef=0.1`` in the
DPOConfig, evaluating after steps 2 and 4) at TP=1, at TP=2 with SP x EP=2 and at CP=2: TRL's router balancing
loss in the logged and evaluation losses, its ``aux_loss`` / ``eval_aux_loss`` metrics, the final weights.
``padding_free=True`` (``_dpo_parity.PACKED_SCENARIOS``: each micro-batch's rows packed into one; LoRA, evaluation,
WPO and LD-DPO) at TP=1 and TP=2 with SP, and the Qwen3-MoE's at TP=1, against trl.DPOTrainer with the same config
(TRL 1.16 warns and pads: the same numbers), refused at CP=2 and PP=2; ``use_liger_kernel=True`` at TP=1 against
TRL's run without it. Vision DPO (``_dpo_vision``: a tiny Qwen2-VL, TRL's conversational image dataset, its vision
collator and the processor; full fine-tuning with the reference loaded from the checkpoint, LoRA on the language
model's and the tower's attention with evaluation) at TP=1 and TP=2 with SP, LoRA at PP=2, PP=2 x VPP=2 and CP=2
(there with ``padding_free=True``: padded, as TRL pads it); a tiny Gemma 3 (the collator's ``token_type_ids``), full
fine-tuning at TP=1 and TP=2 with SP; what stays refused with images.

Tolerances (fp32): in every log, the loss, grad_norm, rewards/chosen, rewards/rejected, rewards/margins, logps/chosen,
logps/rejected and entropy within 1e-4 relative or 2e-5 absolute (rewards start at 0), rewards/accuracies,
mean_token_accuracy and num_tokens exactly; the same for eval_loss and the eval reward metrics. Final weights: every
LoRA adapter tensor within 1e-4 of PEFT's; under full fine-tuning each tensor's difference from TRL's within 1% of how
far TRL's training moved it (in norm): Adam turns the rounding of near-zero gradients into steps of the learning
rate's size, so an absolute bound would have to be loose. A separate, unrotated key bias (Gemma 3's tower), whose
gradient is zero but for rounding: both runs' moved less than 1e-3 in norm.
"""

from __future__ import annotations

import pytest

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing import make_tiny_checkpoint
from loongforge_hf.testing.tiny_vl import make_tiny_gemma3_vl, make_tiny_qwen2_vl

from ._dpo_parity import (LOSS_SCENARIOS, METRICS, MOE_SCENARIOS, PACKED_SCENARIOS, SCENARIOS, packed_refusal,
                          refusals, run_loong, run_trl, saved_tensors)
from ._dpo_vision import VISION_REFUSED, VISION_SCENARIOS, run_loong_vision, run_trl_vision, vision_refusals

NAMES = list(SCENARIOS)
TWO_RANK_NAMES = ["full_ref_model", "lora_disabled_adapters"]
# layout -> (its parallel settings, the scenarios run with it)
LAYOUTS = {"tp2_sp": ({"tensor_parallel_size": 2, "sequence_parallel": True}, [*TWO_RANK_NAMES, "wpo", "padding_free"]),
           "pp2": ({"pipeline_parallel_size": 2}, TWO_RANK_NAMES),
           "cp2": ({"context_parallel_size": 2}, TWO_RANK_NAMES),
           "pp2_vpp2": ({"pipeline_parallel_size": 2, "virtual_pipeline_parallel_size": 2}, TWO_RANK_NAMES)}
# at DP=2 against TRL under DDP: LoRA with evaluation, and every loss-type run (full fine-tuning with a ref_model)
ALL_SCENARIOS = {**SCENARIOS, **LOSS_SCENARIOS, **MOE_SCENARIOS, **PACKED_SCENARIOS, **VISION_SCENARIOS}
TP1_TRL_NAMES = [*NAMES, "wpo", "padding_free"]  # NOTE: the references of WPO's and the packed TP=2 + SP runs
# padding_free=True refused at these layouts (pipeline stages: one length per step; CP: each row's share of tokens)
PACKED_REFUSED = {"cp2": {"context_parallel_size": 2}, "pp2": {"pipeline_parallel_size": 2}}
DP_NAMES = ["lora_disabled_adapters", *LOSS_SCENARIOS]
MOE_NAMES = ["moe_router_aux"]
MOE_TP1_NAMES = [*MOE_NAMES, "moe_padding_free"]
MOE_TWO_RANKS = {"moe_tp2_sp_ep2": {"tensor_parallel_size": 2, "sequence_parallel": True, "expert_parallel_size": 2,
                                    "expert_tensor_parallel_size": 1},
                 "moe_cp2": {"context_parallel_size": 2}}
# the tiny Qwen2-VL (vision DPO): layout -> (its parallel settings, the scenarios run with it)
VISION_NAMES = ["vision_full", "vision_lora"]
VISION_LAYOUTS = {"vision_tp2_sp": ({"tensor_parallel_size": 2, "sequence_parallel": True}, VISION_NAMES),
                  "vision_cp2": ({"context_parallel_size": 2}, ["vision_padding_free"]),
                  "vision_pp2": ({"pipeline_parallel_size": 2}, ["vision_lora"]),
                  "vision_pp2_vpp2": ({"pipeline_parallel_size": 2, "virtual_pipeline_parallel_size": 2},
                                      ["vision_lora"])}


def _tp1_world(folder: str, moe_folder: str, vl_folder: str, gemma3_folder: str, out_dir: str) -> dict:
    return {"vision_trl": run_trl_vision(vl_folder, out_dir + "/vision-trl", VISION_NAMES),
            "gemma3_trl": run_trl_vision(gemma3_folder, out_dir + "/gemma3-trl", ["vision_full"]),
            "gemma3_tp1": run_loong_vision(gemma3_folder, out_dir + "/gemma3-tp1", {}, ["vision_full"]),
            "vision_tp1": run_loong_vision(vl_folder, out_dir + "/vision-tp1", {}, VISION_NAMES),
            "vision_refusals": vision_refusals(vl_folder, folder, out_dir + "/vision-refused"),
            "trl": run_trl(folder, out_dir + "/trl", TP1_TRL_NAMES, ALL_SCENARIOS),
            "loong": run_loong(folder, out_dir + "/tp1", {}, NAMES),
            "refusals": refusals(folder, out_dir + "/refused"),
            "packed": run_loong(folder, out_dir + "/packed", {}, list(PACKED_SCENARIOS), ALL_SCENARIOS),
            "moe_trl": run_trl(moe_folder, out_dir + "/moe-trl", MOE_TP1_NAMES, MOE_SCENARIOS),
            "moe_tp1": run_loong(moe_folder, out_dir + "/moe-tp1", {}, MOE_TP1_NAMES, MOE_SCENARIOS)}


def _two_rank_world(folder: str, moe_folder: str, vl_folder: str, gemma3_folder: str, out_dir: str) -> dict:
    out = {name: run_loong(folder, f"{out_dir}/{name}", layout, names, ALL_SCENARIOS)
           for name, (layout, names) in LAYOUTS.items()}
    out["gemma3_tp2_sp"] = run_loong_vision(gemma3_folder, f"{out_dir}/gemma3", VISION_LAYOUTS["vision_tp2_sp"][0],
                                            ["vision_full"])
    out.update({name: run_loong_vision(vl_folder, f"{out_dir}/{name}", layout, names)
                for name, (layout, names) in VISION_LAYOUTS.items()})
    for name, layout in MOE_TWO_RANKS.items():
        out[name] = run_loong(moe_folder, f"{out_dir}/{name}", layout, MOE_NAMES, MOE_SCENARIOS)
    # NOTE: trl.DPOTrainer's accelerate runs DDP over this world's gloo group, as under torchrun
    out["packed_refusals"] = {name: packed_refusal(folder, f"{out_dir}/refused-{name}", layout)
                              for name, layout in PACKED_REFUSED.items()}
    out["trl_ddp"] = run_trl(folder, out_dir + "/trl-ddp", DP_NAMES, ALL_SCENARIOS)
    out["dp2"] = run_loong(folder, out_dir + "/dp2", {}, DP_NAMES, ALL_SCENARIOS)
    return out


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("dpo-src") / "llama", "llama")


@pytest.fixture(scope="module")
def moe_src(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("dpo-moe") / "qwen3_moe", "qwen3_moe")


@pytest.fixture(scope="module")
def vl_src(tmp_path_factory):
    return make_tiny_qwen2_vl(tmp_path_factory.mktemp("dpo-vl") / "qwen2_vl")


@pytest.fixture(scope="module")
def gemma3_src(tmp_path_factory):
    return make_tiny_gemma3_vl(tmp_path_factory.mktemp("dpo-gemma3") / "gemma3")


@pytest.fixture(scope="module")
def tp1(src, moe_src, vl_src, gemma3_src, tmp_path_factory):
    return run_distributed(_tp1_world, 1, str(src), str(moe_src), str(vl_src), str(gemma3_src),
                           str(tmp_path_factory.mktemp("dpo-tp1")), timeout=500)[0]


@pytest.fixture(scope="module")
def two_ranks(src, moe_src, vl_src, gemma3_src, tmp_path_factory):
    return run_distributed(_two_rank_world, 2, str(src), str(moe_src), str(vl_src), str(gemma3_src),
                           str(tmp_path_factory.mktemp("dpo-2")), timeout=500)


def _initial_weights(folder) -> dict:
    return saved_tensors(str(folder))


def _assert_matches(name: str, ref: dict, got: dict, initial: dict) -> None:
    overrides, lora, _ = ALL_SCENARIOS[name]
    assert len(ref["logs"]) == len(got["logs"]) == overrides.get("max_steps", 4)
    exact = {"rewards/accuracies", "mean_token_accuracy", "num_tokens"}
    moe = name in MOE_SCENARIOS  # NOTE: TRL's aux_loss after METRICS, eval_aux_loss after the eval metrics
    for step, (theirs, ours) in enumerate(zip(ref["logs"], got["logs"])):
        assert len(theirs) == len(ours) == len(METRICS) + moe, (name, step)
        for key, a, b in zip(METRICS + ("aux_loss",), theirs, ours):
            if key in exact:
                assert b == a, (name, step, key)
            else:
                assert b == pytest.approx(a, rel=1e-4, abs=2e-5), (name, step, key)
    assert any(log[3] > 0 for log in ref["logs"])  # some reward accuracy: the rewards moved apart
    # evaluation during training (LoRA after steps 2 and 4; some loss types after each step): the loss and TRL's
    # reward metrics
    evals = len(ref["logs"]) // overrides["eval_steps"] if overrides.get("eval_strategy") else 0
    assert len(got["eval_logs"]) == len(ref["eval_logs"]) == evals
    for theirs, ours in zip(ref["eval_logs"], got["eval_logs"]):
        assert len(theirs) == len(ours) == 7 + moe
        assert ours[3] == theirs[3]
        assert ours == pytest.approx(theirs, rel=1e-4, abs=2e-5)
    theirs, ours = ref["weights"], got["weights"]
    assert sorted(ours) == sorted(theirs)
    for key, value in theirs.items():
        if lora:
            assert float((ours[key] - value).abs().max()) < 1e-4, key
        elif key.startswith("vision_tower.") and key.endswith("self_attn.k_proj.bias"):
            # NOTE: a key bias on its own and unrotated (Gemma 3's SigLIP) adds q.b to every score of a row: its
            # gradient is zero but for rounding, which Adam turns into random steps; both stay put (the other tensors
            # move 1e-2-0.3)
            moved = [float((weights[key] - initial[key]).norm()) for weights in (theirs, ours)]
            assert max(moved) < 1e-3, (key, moved)
        else:
            moved = float((value - initial[key]).norm())
            assert moved > 0 and float((ours[key] - value).norm()) < 1e-2 * moved, key


@pytest.mark.parametrize("name", NAMES)
def test_tp1_matches_trl(src, tp1, name):
    _assert_matches(name, tp1["trl"][name], tp1["loong"][name], _initial_weights(src))


@pytest.mark.parametrize("layout,name", [(layout, name) for layout, (_, names) in LAYOUTS.items() for name in names])
def test_two_ranks_match_trl(src, tp1, two_ranks, layout, name):
    _assert_matches(name, tp1["trl"][name], two_ranks[0][layout][name], _initial_weights(src))
    assert two_ranks[1][layout][name]["logs"] == two_ranks[0][layout][name]["logs"]  # every rank logs the same


def _assert_moe_matches(moe_src, ref: dict, runs: list[dict]) -> None:
    """TRL adds ``router_aux_loss_coef * aux_loss`` (transformers' balancing loss over the chosen and rejected rows of
    the policy's forward, weighted by the attention mask) to each micro-batch's DPO loss, in training and evaluation,
    and logs ``aux_loss``; here too, with the routers trained by it."""
    _assert_matches("moe_router_aux", ref, runs[0]["moe_router_aux"], _initial_weights(moe_src))
    assert all(log[-1] > 0 for log in ref["logs"] + ref["eval_logs"])  # the aux_loss metrics
    assert all(run["moe_router_aux"]["logs"] == runs[0]["moe_router_aux"]["logs"] for run in runs)


def test_moe_router_aux_loss_matches_trl(moe_src, tp1):
    _assert_moe_matches(moe_src, tp1["moe_trl"]["moe_router_aux"], [tp1["moe_tp1"]])


@pytest.mark.parametrize("layout", list(MOE_TWO_RANKS))
def test_moe_router_aux_loss_two_ranks_match_trl(moe_src, tp1, two_ranks, layout):
    """At CP=2 the balancing term counts once per context-parallel group as the DPO loss does (see the engine)."""
    _assert_moe_matches(moe_src, tp1["moe_trl"]["moe_router_aux"], [rank[layout] for rank in two_ranks])


@pytest.mark.parametrize("name", DP_NAMES)
def test_dp2_matches_trl_ddp(src, two_ranks, name):
    """Two data-parallel ranks against trl.DPOTrainer on the same two processes under DDP: each rank's micro-batches,
    the loss averaged over the ranks, TRL's metrics gathered over them; the loss types of ``LOSS_SCENARIOS`` here."""
    _assert_matches(name, two_ranks[0]["trl_ddp"][name], two_ranks[0]["dp2"][name], _initial_weights(src))
    assert two_ranks[1]["dp2"][name]["logs"] == two_ranks[0]["dp2"][name]["logs"]


def test_padding_free_matches_trl(src, tp1):
    """Each micro-batch's rows packed into one (restarting position_ids; TRL 1.16 pads instead: same numbers) with
    LoRA, evaluation, WPO and LD-DPO, at TP=1 (TP=2 + SP: test_two_ranks_match_trl)."""
    _assert_matches("padding_free", tp1["trl"]["padding_free"], tp1["packed"]["padding_free"], _initial_weights(src))
    assert tp1["packed"]["padding_free"]["batch_rows"] == 1


def test_use_liger_kernel_matches_trl(src, tp1):
    """TRL 1.16 with use_liger_kernel swaps in Liger's layer kernels only (its DPO loss and fused LM head stay TRL's):
    the numbers of its run without them (liger_kernel is not installed here, and its kernels are Triton's)."""
    _assert_matches("liger", tp1["trl"]["full_ref_model"], tp1["packed"]["liger"], _initial_weights(src))


def test_moe_padding_free_matches_trl(moe_src, tp1):
    """The Qwen3-MoE's packed rows: TRL's router balancing loss (over the real tokens) in the losses and metrics."""
    _assert_matches("moe_padding_free", tp1["moe_trl"]["moe_padding_free"], tp1["moe_tp1"]["moe_padding_free"],
                    _initial_weights(moe_src))
    assert tp1["moe_tp1"]["moe_padding_free"]["batch_rows"] == 1


@pytest.mark.parametrize("layout", list(PACKED_REFUSED))
def test_padding_free_refused_by_layout(two_ranks, layout):
    field = {"cp2": "context_parallel_size", "pp2": "pipeline_parallel_size"}[layout]
    for rank in two_ranks:
        message = rank["packed_refusals"][layout]
        assert message.startswith("LoongDPOTrainer does not support") and f"padding_free=True with {field}" in message


def test_unsupported_settings_are_refused(tp1):
    fields = ("loss_type", "liger_kernel_config", "use_weighting", "rpo_alpha")
    assert len(tp1["refusals"]) == len(fields)
    for message, field in zip(tp1["refusals"], fields):
        assert message.startswith("LoongDPOTrainer does not support") and field in message
    assert "loss_type=['sigmoid', 'sft']" in tp1["refusals"][-1]  # rpo_alpha: what TRL 1.16 writes instead
    assert "'sft'" in tp1["refusals"][2]  # use_weighting with "sft": TRL 1.16's weighting fails on it


@pytest.mark.parametrize("layout,name", [("vision_tp1", name) for name in VISION_NAMES]
                         + [(layout, name) for layout, (_, names) in VISION_LAYOUTS.items() for name in names])
def test_vision_matches_trl(vl_src, tp1, two_ranks, layout, name):
    """An image dataset (conversational prompts with an image of one of two sizes, TRL's vision collator) on the tiny
    Qwen2-VL against trl.DPOTrainer on transformers' model: full fine-tuning (each trainer loading its reference from
    the checkpoint) and LoRA on the language model's and the tower's attention (evaluating); at CP=2 with
    ``padding_free=True``, which TRL 1.16 and LoongDPOTrainer both answer with padded batches (TRL's reference: its
    LoRA run)."""
    runs = [tp1[layout]] if layout == "vision_tp1" else [rank[layout] for rank in two_ranks]
    _assert_matches(name, tp1["vision_trl"][name.replace("padding_free", "lora")], runs[0][name],
                    _initial_weights(vl_src))
    assert all(run[name]["logs"] == runs[0][name]["logs"] for run in runs)


@pytest.mark.parametrize("layout", ["gemma3_tp1", "gemma3_tp2_sp"])
def test_vision_gemma3_matches_trl(gemma3_src, tp1, two_ranks, layout):
    """Gemma 3: TRL's vision collator adds ``token_type_ids`` (the image tokens attend to each other both ways):
    full fine-tuning on the tiny Gemma 3 against trl.DPOTrainer on transformers' model, at TP=1 and TP=2 with SP."""
    runs = [tp1[layout]] if layout == "gemma3_tp1" else [rank[layout] for rank in two_ranks]
    _assert_matches("vision_full", tp1["gemma3_trl"]["vision_full"], runs[0]["vision_full"],
                    _initial_weights(gemma3_src))
    assert all(run["vision_full"]["logs"] == runs[0]["vision_full"]["logs"] for run in runs)


def test_vision_refusals(tp1):
    """What stays refused with an image dataset, as TRL 1.16 refuses it (``precompute_ref_log_probs``,
    ``truncation_mode='keep_end'``, the vision collator's ``pad_to_multiple_of``), and a text model with it."""
    messages = tp1["vision_refusals"]
    assert len(messages) == len(VISION_REFUSED) + 1
    for message, (_, field) in zip(messages, VISION_REFUSED):
        assert message.startswith("LoongDPOTrainer does not support") and f"{field}" in message, message
        assert "with an image dataset" in message, message
    assert "an image dataset with the text model" in messages[-1] and "AutoModelForImageTextToText" in messages[-1]
