"""LoongGRPOTrainer against trl.GRPOTrainer on the transformers model, same GRPOConfig and reward function.

Scenarios (``_grpo_parity.SCENARIOS``), 3 optimizer steps of 2 micro-batches of 4 completions (2 prompts x 4
generations per step, prompts of different lengths: left padding), 6 completion tokens at most: "grpo" with beta 0;
"grpo" with beta 0.1 (a reference model) and num_iterations 2 (old log-probs, clipping); "dapo" with beta 0.05,
num_iterations 2, epsilon_high 0.28 and batch-scaled rewards. Each trainer generates with its own model (transformers'
sampling, seeded as TRL seeds it): the completions are the same because the logits are. Both suppress the pad token
in generation: transformers' embedding (``padding_idx``) gives the pad token's row no gradient, megatron's does, so a
sampled pad token would move the two models apart. At TP=1 in one process, and at TP=2 with sequence parallelism,
PP=2, PP=2 x VPP=2 (megatron's interleaved schedule; the no-grad log-probs through the virtual stages in order),
CP=2 (load-balanced shares of each row's tokens) and DP=2 (against trl.GRPOTrainer under DDP in the same world)
in one two-rank world; LoRA (q, v) with the adapters disabled as the reference against TRL + PEFT at TP=1 (logs
only). TRL 1.16's other loss types (``_grpo_parity.LOSS_SCENARIOS``: "bnpo" with ``delta`` and the off-policy mask,
"dr_grpo" with the bias-corrected KL, "luspo" with sequence-level importance ratios, "cispo", "sapo", "vespo"; 2 steps,
the second a second pass over the first's generation) at DP=2 against TRL under DDP, with TRL's ``cispo_clip_ratio``
/ ``vespo/phi_seq_mean``. A tiny Qwen3-MoE (``_grpo_parity.MOE_SCENARIOS``: loaded without
``output_router_logits``, ``router_aux_loss_coef=0.1`` in the GRPOConfig) at TP=1 and at TP=2 with SP x EP=2: TRL's
router balancing loss in the loss, its ``aux_loss`` metric, the final weights.

Tolerances (fp32): in every log, the loss, grad_norm, kl, entropy, reward metrics and clip ratios within 1e-4
relative or 1e-6 absolute (losses and clip ratios can be 0), the completion lengths and num_tokens exactly; final
weights: each tensor's difference from TRL's within 1% of how far TRL's training moved it (in norm), as the DPO test.

Evaluation (``_grpo_parity.EVAL_SCENARIOS``, "grpo" and "dapo" with the KL and the Qwen3-MoE, at every layout that
runs them): after training, TRL's ``evaluate()`` over 2 prompts x 4 generations (generation, rewards and the loss in
eval mode; for the Qwen3-MoE ``router_aux_loss_coef * aux_loss`` of the evaluation forward in it and
``eval_aux_loss``): every ``eval_*`` metric but the timings against TRL's, as the logs.

Vision GRPO (``_online_vision``: a tiny Qwen2-VL, conversational prompts each holding an image of one of two sizes,
the processor; "grpo" with beta 0.1 (the reference loaded from the checkpoint by each trainer), num_iterations 2, 2
steps, then ``evaluate()``) against trl.GRPOTrainer on transformers' Qwen2-VL at TP=1, TP=2 with SP, PP=2, PP=2 x
VPP=2, CP=2 and DP=2 (against TRL under DDP): every metric TRL logs (but its ``step_time``), the eval metrics and the
final weights as above, the completions each rank scored (token ids) identical to TRL's; LoRA ("all-linear", the
tower's linears too; adapters disabled as the reference) at TP=1 against TRL + PEFT, the adapter folder's tensors
too; what stays refused with images (a text model, a tokenizer).
"""

from __future__ import annotations

import pytest

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing import make_tiny_checkpoint

from loongforge_hf.testing.tiny_vl import make_tiny_qwen2_vl

from ._grpo_parity import (ALL_SCENARIOS, EVAL_SCENARIOS, LOSS_SCENARIOS, MOE_SCENARIOS, SCENARIOS, refusals,
                           refused_vpp_accumulation, run_lora, run_loong, run_trl, saved_tensors)
from ._online_vision import assert_vision_matches, run_loong_vision, run_trl_vision, vision_refusals

NAMES = list(SCENARIOS)
MOE_NAMES = list(MOE_SCENARIOS)
# layout -> (its parallel settings, the scenarios run with it); DP=2 against TRL under DDP, the others against TP=1
TWO_RANK = {"tp2_sp": ({"tensor_parallel_size": 2, "sequence_parallel": True}, ["grpo_kl_iter2", "dapo_kl_iter2"]),
            "pp2": ({"pipeline_parallel_size": 2}, ["grpo_kl_iter2"]),
            "pp2_vpp2": ({"pipeline_parallel_size": 2, "virtual_pipeline_parallel_size": 2}, ["grpo_kl_iter2"]),
            "cp2": ({"context_parallel_size": 2}, ["dapo_kl_iter2"]),
            "dp2": ({}, ["grpo_kl_iter2", *LOSS_SCENARIOS])}
MOE_TP2_SP_EP2 = {"tensor_parallel_size": 2, "sequence_parallel": True, "expert_parallel_size": 2,
                  "expert_tensor_parallel_size": 1}
EXACT = ("completions/mean_length", "completions/clipped_ratio", "num_tokens")
# vision GRPO on the tiny Qwen2-VL: layout -> its parallel settings (DP=2 against TRL under DDP)
VISION_LAYOUTS = {"vision_tp2_sp": {"tensor_parallel_size": 2, "sequence_parallel": True},
                  "vision_pp2": {"pipeline_parallel_size": 2},
                  "vision_pp2_vpp2": {"pipeline_parallel_size": 2, "virtual_pipeline_parallel_size": 2},
                  "vision_cp2": {"context_parallel_size": 2}, "vision_dp2": {}}


def _tp1_world(folder: str, moe_folder: str, vl_folder: str, out_dir: str) -> dict:
    return {"vision_trl": run_trl_vision(vl_folder, out_dir + "/vision-trl", ["vision_grpo"]),
            "vision_tp1": run_loong_vision(vl_folder, out_dir + "/vision-tp1", {}, ["vision_grpo"]),
            "vision_lora": {"trl": run_trl_vision(vl_folder, out_dir + "/vision-lora-trl", ["vision_grpo_lora"]),
                            "loong": run_loong_vision(vl_folder, out_dir + "/vision-lora", {}, ["vision_grpo_lora"])},
            "vision_refusals": vision_refusals(vl_folder, folder, out_dir + "/vision-refused"),
            "trl": run_trl(folder, out_dir + "/trl", NAMES), "loong": run_loong(folder, out_dir + "/tp1", {}, NAMES),
            "refusals": refusals(folder, out_dir + "/refused"), "lora": run_lora(folder, out_dir + "/lora"),
            "moe_trl": run_trl(moe_folder, out_dir + "/moe-trl", MOE_NAMES),
            "moe_tp1": run_loong(moe_folder, out_dir + "/moe-tp1", {}, MOE_NAMES)}


def _two_rank_world(folder: str, moe_folder: str, vl_folder: str, out_dir: str) -> dict:
    out = {name: run_loong(folder, f"{out_dir}/{name}", layout, names) for name, (layout, names) in TWO_RANK.items()}
    out.update({name: run_loong_vision(vl_folder, f"{out_dir}/{name}", layout, ["vision_grpo"])
                for name, layout in VISION_LAYOUTS.items()})
    out["vision_trl_ddp"] = run_trl_vision(vl_folder, out_dir + "/vision-trl-ddp", ["vision_grpo"])
    # NOTE: trl.GRPOTrainer's accelerate runs DDP over this world's gloo group, as under torchrun
    out["trl_ddp"] = run_trl(folder, out_dir + "/trl-ddp", TWO_RANK["dp2"][1])
    out["moe_tp2_sp_ep2"] = run_loong(moe_folder, out_dir + "/moe-tp2", MOE_TP2_SP_EP2, MOE_NAMES)
    out["refused_vpp_accumulation"] = refused_vpp_accumulation(folder, out_dir + "/refused-vpp")
    return out


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("grpo-src") / "llama", "llama")


@pytest.fixture(scope="module")
def moe_src(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("grpo-moe") / "qwen3_moe", "qwen3_moe")


@pytest.fixture(scope="module")
def vl_src(tmp_path_factory):
    return make_tiny_qwen2_vl(tmp_path_factory.mktemp("grpo-vl") / "qwen2_vl")


@pytest.fixture(scope="module")
def tp1(src, moe_src, vl_src, tmp_path_factory):
    return run_distributed(_tp1_world, 1, str(src), str(moe_src), str(vl_src),
                           str(tmp_path_factory.mktemp("grpo-tp1")), timeout=500)[0]


@pytest.fixture(scope="module")
def two_ranks(src, moe_src, vl_src, tmp_path_factory):
    return run_distributed(_two_rank_world, 2, str(src), str(moe_src), str(vl_src),
                           str(tmp_path_factory.mktemp("grpo-2")), timeout=500)


def _assert_logs_match(name: str, ref: list[dict], got: list[dict]) -> None:
    assert len(ref) == len(got) == ALL_SCENARIOS.get(name, {}).get("max_steps", 3)
    for step, (theirs, ours) in enumerate(zip(ref, got)):
        assert sorted(ours) == sorted(theirs), (name, step)
        for key, value in theirs.items():
            if key in EXACT:
                assert ours[key] == value, (name, step, key)
            else:
                assert ours[key] == pytest.approx(value, rel=1e-4, abs=1e-6), (name, step, key)


def _assert_eval_matches(name: str, ref: dict, got: dict) -> None:
    assert ("eval" in ref) == ("eval" in got) == (name in EVAL_SCENARIOS), name
    if "eval" not in ref:
        return
    theirs, ours = ref["eval"], got["eval"]
    assert sorted(ours) == sorted(theirs), (name, set(ours) ^ set(theirs))
    assert "eval_loss" in theirs and "eval_entropy" in theirs, name
    for key, value in theirs.items():
        if key.removeprefix("eval_") in EXACT:
            assert ours[key] == value, (name, key)
        else:
            assert ours[key] == pytest.approx(value, rel=1e-4, abs=1e-6), (name, key)


def _assert_matches(name: str, ref: dict, got: dict, initial: dict) -> None:
    _assert_logs_match(name, ref["logs"], got["logs"])
    _assert_eval_matches(name, ref, got)
    _assert_second_pass_moved(name, ref["logs"][1])
    theirs, ours = ref["weights"], got["weights"]
    assert sorted(ours) == sorted(theirs)
    for key, value in theirs.items():
        moved = float((value - initial[key]).norm())
        assert moved > 0 and float((ours[key] - value).norm()) < 1e-2 * moved, key


def _assert_second_pass_moved(name: str, log: dict) -> None:
    """The second pass over a generation sees ratios away from 1: what the loss type logs of them is not trivial."""
    overrides = ALL_SCENARIOS[name]
    if overrides.get("num_iterations", 1) == 1:
        return
    if overrides.get("beta", 0.0):
        assert log["kl"] > 0
    if overrides["loss_type"] == "cispo":
        assert log["cispo_clip_ratio"] > 0
    elif overrides["loss_type"] == "vespo":
        assert 0 < log["vespo/phi_seq_mean"] < 1
    elif overrides["loss_type"] != "sapo":
        assert log["clip_ratio/region_mean"] > 0


@pytest.mark.parametrize("name", NAMES)
def test_tp1_matches_trl(src, tp1, name):
    _assert_matches(name, tp1["trl"][name], tp1["loong"][name], saved_tensors(str(src)))


@pytest.mark.parametrize("layout,name", [(layout, name) for layout, (_, names) in TWO_RANK.items() for name in names])
def test_two_ranks_match_trl(src, tp1, two_ranks, layout, name):
    ref = two_ranks[0]["trl_ddp"][name] if layout == "dp2" else tp1["trl"][name]
    _assert_matches(name, ref, two_ranks[0][layout][name], saved_tensors(str(src)))
    assert two_ranks[1][layout][name]["logs"] == two_ranks[0][layout][name]["logs"]  # every rank logs the same


@pytest.mark.parametrize("layout", ["tp1", "tp2_sp_ep2"])
def test_moe_router_aux_loss_matches_trl(moe_src, tp1, two_ranks, layout):
    """TRL adds ``router_aux_loss_coef * aux_loss / accumulation steps`` (transformers' balancing loss over the
    policy forward's prompt and completion tokens) to each micro-batch's loss and logs ``aux_loss``, and in
    evaluation ``router_aux_loss_coef * aux_loss`` and ``eval_aux_loss``; here too."""
    runs = [tp1["moe_tp1"]] if layout == "tp1" else [rank["moe_tp2_sp_ep2"] for rank in two_ranks]
    ref = tp1["moe_trl"]["moe_router_aux"]
    _assert_matches("moe_router_aux", ref, runs[0]["moe_router_aux"], saved_tensors(str(moe_src)))
    assert all(log["aux_loss"] > 0 for log in ref["logs"]) and ref["eval"]["eval_aux_loss"] > 0
    assert all(run["moe_router_aux"]["logs"] == runs[0]["moe_router_aux"]["logs"] for run in runs)
    assert all(run["moe_router_aux"]["eval"] == runs[0]["moe_router_aux"]["eval"] for run in runs)


def test_lora_disabled_adapters_match_trl_peft(tp1):
    """LoRA on q / v, beta 0.1 and num_iterations 2: the reference is the policy with its adapters disabled (PEFT's
    ``disable_adapter`` in TRL)."""
    logs = tp1["lora"]
    _assert_logs_match("lora", logs["trl"], logs["loong"])
    assert logs["trl"][1]["kl"] > 0 and logs["trl"][1]["clip_ratio/region_mean"] > 0


def test_refusals(tp1):
    vllm, liger, entropy, quantile = tp1["refusals"]
    assert "use_vllm=True" in vllm
    assert "use_liger_kernel=True" in liger
    assert "entropy_coef=0.1" in entropy
    assert "top_entropy_quantile=0.5" in quantile


def test_virtual_pipeline_accumulation_refused(two_ranks):
    for rank in two_ranks:
        assert "gradient_accumulation_steps=1 with virtual pipeline stages" in rank["refused_vpp_accumulation"]


@pytest.mark.parametrize("layout", ["vision_tp1", *VISION_LAYOUTS])
def test_vision_matches_trl(vl_src, tp1, two_ranks, layout):
    """Image prompts on the tiny Qwen2-VL: generation with the images (the same completions), the policy's, old and
    reference log-probs with them (loss, kl, clip ratios, grad_norm), evaluation, the final weights."""
    runs = [tp1[layout]] if layout == "vision_tp1" else [rank[layout] for rank in two_ranks]
    refs = [rank["vision_trl_ddp"] for rank in two_ranks] if layout == "vision_dp2" else [tp1["vision_trl"]] * 2
    assert_vision_matches("vision_grpo", [ref["vision_grpo"] for ref in refs], [run["vision_grpo"] for run in runs],
                          saved_tensors(str(vl_src)))
    assert refs[0]["vision_grpo"]["logs"][1]["kl"] > 0 and refs[0]["vision_grpo"]["logs"][1]["clip_ratio/low_mean"] > 0


def test_vision_lora_matches_trl_peft(vl_src, tp1):
    """LoRA on every linear of the tiny Qwen2-VL (PEFT's "all-linear": the tower's and merger's too), the adapters
    disabled as the reference: the completions, every logged metric and the adapter folder's tensors against
    trl.GRPOTrainer + PEFT."""
    runs = tp1["vision_lora"]
    assert_vision_matches("vision_grpo_lora", [runs["trl"]["vision_grpo_lora"]], [runs["loong"]["vision_grpo_lora"]],
                          saved_tensors(str(vl_src)))
    assert any(".visual." in key for key in runs["trl"]["vision_grpo_lora"]["weights"])
    assert runs["trl"]["vision_grpo_lora"]["logs"][1]["kl"] > 0


def test_vision_refusals(tp1):
    """With images: a text model and a tokenizer are refused by name, and a processor with a text model."""
    images, processor = tp1["vision_refusals"]
    assert images.startswith("LoongGRPOTrainer does not support") and "an image dataset with the text model" in images
    assert "AutoModelForImageTextToText" in images and "processing_class of type" in images
    assert "a processor with the text model" in processor


def test_positions_from_the_attention_mask_not_refused():
    """OPT counts its positions from the attention mask (transformers' ``cumsum(attention_mask) - 1``) and TRL
    left-pads the prompts: the online trainers derive them so (``absolute_positions.with_mask_positions``; shown
    against TRL in tests/bridges/test_opt_mask_positions.py), so their setup no longer refuses it."""
    from types import SimpleNamespace

    from loongforge_hf.bridges import get_bridge
    from loongforge_hf.integrations.trl_online import refusals
    from loongforge_hf.parallel import ParallelConfig
    from loongforge_hf.testing.tiny_models import _config

    args = SimpleNamespace(gradient_accumulation_steps=1, log_completions=False)
    bridge = get_bridge(_config("opt", architectures=["OPTForCausalLM"]))
    assert refusals(args, SimpleNamespace(parallel=ParallelConfig(), bridge=bridge), None, None, None) == []
