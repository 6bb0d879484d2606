"""LoongRLOOTrainer against trl.RLOOTrainer on the transformers model, same RLOOConfig and reward function.

Scenarios (``_rloo_parity.SCENARIOS``), optimizer steps of 2 micro-batches of 4 completions (2 prompts x 4
generations per step, prompts of different lengths), 6 completion tokens at most: beta 0 (2 steps); beta 0.1 (the KL
penalty in the reward, from a reference model) with num_iterations 2 (old log-probs, clipped ratios) and epsilon_high
0.28 (3 steps: a second generation); normalised advantages with clipped rewards and beta 0.05 (2 steps); LoRA (q, v)
with the adapters disabled as the reference against TRL + PEFT (logs and completions); a tiny Qwen3-MoE with
``router_aux_loss_coef=0.1`` (TRL's router balancing loss in the loss, its ``aux_loss`` metric). Each trainer
generates with its own model (transformers' sampling, seeded as TRL seeds it); the pad token is suppressed as in the
GRPO test. At TP=1 in one process (all of them), and at TP=2 with sequence parallelism, PP=2, PP=2 x VPP=2
(megatron's interleaved schedule; the no-grad log-probs through the virtual stages in order; the KL scenario, LoRA
and the Qwen3-MoE, whose first virtual stage has no MoE layer), CP=2 and DP=2 (against trl.RLOOTrainer under DDP in
the same world) in one two-rank world.

Evaluation (``_rloo_parity.EVAL_SCENARIOS``, at every layout): after training, TRL's ``evaluate()`` over 2 prompts x 4
generations (generation, rewards, the KL penalty and the loss in eval mode), its ``eval_*`` metrics as the logs; for
the Qwen3-MoE with TRL's router balancing loss in the evaluation loss and its ``eval_aux_loss``.

Shown: every metric TRL logs (but its ``step_time``) within 1e-4 relative or 1e-6 absolute, the completion lengths
and num_tokens exactly; the completions each rank scored identical to TRL's (its rank's under DDP); final weights:
each tensor's difference from TRL's within 1% of how far TRL's training moved it (in norm), as the GRPO test.

Vision RLOO (``_online_vision``: a tiny Qwen2-VL, conversational prompts each holding an image of one of two sizes,
the processor; beta 0.1 with the reference loaded from the checkpoint, num_iterations 2, 2 steps) against
trl.RLOOTrainer on transformers' Qwen2-VL at TP=1 and TP=2 with SP: the same checks (completions, every metric, final
weights).
"""

from __future__ import annotations

import pytest

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing import make_tiny_checkpoint

from loongforge_hf.testing.tiny_vl import make_tiny_qwen2_vl

from ._grpo_parity import saved_tensors
from ._online_vision import assert_vision_matches, run_loong_vision, run_trl_vision
from ._rloo_parity import (ALL_SCENARIOS, EVAL_SCENARIOS, LORA_SCENARIOS, MOE_SCENARIOS, SCENARIOS, refusals,
                           run_loong, run_trl)

NAMES = list(SCENARIOS)
MOE_NAMES = list(MOE_SCENARIOS)
# layout -> (its parallel settings, the scenarios run with it); DP=2 against TRL under DDP, the others against TP=1
TWO_RANK = {"tp2_sp": ({"tensor_parallel_size": 2, "sequence_parallel": True}, ["rloo_kl_iter2"]),
            "pp2": ({"pipeline_parallel_size": 2}, ["rloo_kl_iter2"]),
            "pp2_vpp2": ({"pipeline_parallel_size": 2, "virtual_pipeline_parallel_size": 2},
                         ["rloo_kl_iter2", "rloo_lora"]),
            "cp2": ({"context_parallel_size": 2}, ["rloo_kl_iter2"]),
            "dp2": ({}, ["rloo_kl_iter2", "rloo_norm_clip"])}
EXACT = ("completions/mean_length", "completions/min_length", "completions/max_length", "completions/clipped_ratio",
         "completions/mean_terminated_length", "completions/min_terminated_length",
         "completions/max_terminated_length", "num_tokens")


VISION_TP2_SP = {"tensor_parallel_size": 2, "sequence_parallel": True}


def _tp1_world(folder: str, moe_folder: str, vl_folder: str, out_dir: str) -> dict:
    names = NAMES + list(LORA_SCENARIOS)
    return {"vision_trl": run_trl_vision(vl_folder, out_dir + "/vision-trl", ["vision_rloo"]),
            "vision_tp1": run_loong_vision(vl_folder, out_dir + "/vision-tp1", {}, ["vision_rloo"]),
            "trl": run_trl(folder, out_dir + "/trl", names), "loong": run_loong(folder, out_dir + "/tp1", {}, names),
            "moe_trl": run_trl(moe_folder, out_dir + "/moe-trl", MOE_NAMES),
            "moe_loong": run_loong(moe_folder, out_dir + "/moe-tp1", {}, MOE_NAMES),
            "refusals": refusals(folder, out_dir + "/refused")}


def _two_rank_world(folder: str, moe_folder: str, vl_folder: str, out_dir: str) -> dict:
    out = {name: run_loong(folder, f"{out_dir}/{name}", layout, names) for name, (layout, names) in TWO_RANK.items()}
    out["vision_tp2_sp"] = run_loong_vision(vl_folder, out_dir + "/vision-tp2-sp", VISION_TP2_SP, ["vision_rloo"])
    # NOTE: trl.RLOOTrainer's accelerate runs DDP over this world's gloo group, as under torchrun
    out["trl_ddp"] = run_trl(folder, out_dir + "/trl-ddp", TWO_RANK["dp2"][1])
    out["moe_pp2_vpp2"] = run_loong(moe_folder, out_dir + "/moe-pp2-vpp2", TWO_RANK["pp2_vpp2"][0], MOE_NAMES)
    return out


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("rloo-src") / "llama", "llama")


@pytest.fixture(scope="module")
def moe_src(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("rloo-moe") / "qwen3_moe", "qwen3_moe")


@pytest.fixture(scope="module")
def vl_src(tmp_path_factory):
    return make_tiny_qwen2_vl(tmp_path_factory.mktemp("rloo-vl") / "qwen2_vl")


@pytest.fixture(scope="module")
def tp1(src, moe_src, vl_src, tmp_path_factory):
    return run_distributed(_tp1_world, 1, str(src), str(moe_src), str(vl_src),
                           str(tmp_path_factory.mktemp("rloo-tp1")), timeout=500)[0]


@pytest.fixture(scope="module")
def two_ranks(src, moe_src, vl_src, tmp_path_factory):
    return run_distributed(_two_rank_world, 2, str(src), str(moe_src), str(vl_src),
                           str(tmp_path_factory.mktemp("rloo-2")), timeout=500)


def _assert_log_matches(where: tuple, theirs: dict, ours: dict) -> None:
    assert sorted(ours) == sorted(theirs), (where, set(ours) ^ set(theirs))
    for key, value in theirs.items():
        if key.removeprefix("eval_") in EXACT:
            assert ours[key] == value, (where, key)
        else:
            assert ours[key] == pytest.approx(value, rel=1e-4, abs=1e-6), (where, key)


def _assert_matches(name: str, ref: dict, got: dict, initial: dict | None) -> None:
    assert got["completions"] == ref["completions"], name
    assert len(ref["logs"]) == len(got["logs"]) == ALL_SCENARIOS[name].get("max_steps", 3)
    for step, (theirs, ours) in enumerate(zip(ref["logs"], got["logs"])):
        _assert_log_matches((name, step), theirs, ours)
    assert ("eval" in ref) == ("eval" in got) == (name in EVAL_SCENARIOS), name
    if "eval" in ref:
        assert {"eval_loss", "eval_kl", "eval_entropy", "eval_reward"} <= set(ref["eval"])
        _assert_log_matches((name, "eval"), ref["eval"], got["eval"])
    if initial is None:
        return
    theirs, ours = ref["weights"], got["weights"]
    assert sorted(ours) == sorted(theirs)
    for key, value in theirs.items():
        moved = float((value - initial[key]).norm())
        assert moved > 0 and float((ours[key] - value).norm()) < 1e-2 * moved, key


@pytest.mark.parametrize("name", NAMES)
def test_tp1_matches_trl(src, tp1, name):
    _assert_matches(name, tp1["trl"][name], tp1["loong"][name], saved_tensors(str(src)))
    logs = tp1["trl"][name]["logs"]
    if SCENARIOS[name].get("num_iterations", 1) > 1:  # NOTE: the second pass sees ratios away from 1
        assert logs[1]["clip_ratio/region_mean"] > 0


@pytest.mark.parametrize("layout,name", [(layout, name) for layout, (_, names) in TWO_RANK.items() for name in names])
def test_two_ranks_match_trl(src, tp1, two_ranks, layout, name):
    if layout == "dp2":
        for rank in (0, 1):  # NOTE: each rank generated and scored its own rows, as TRL's rank did
            assert two_ranks[rank][layout][name]["completions"] == two_ranks[rank]["trl_ddp"][name]["completions"]
        ref = two_ranks[0]["trl_ddp"][name]
    else:
        ref = tp1["trl"][name]
        assert two_ranks[1][layout][name]["completions"] == ref["completions"]
    initial = None if name in LORA_SCENARIOS else saved_tensors(str(src))  # NOTE: LoRA: logs and completions
    _assert_matches(name, ref, two_ranks[0][layout][name], initial)
    assert two_ranks[1][layout][name]["logs"] == two_ranks[0][layout][name]["logs"]  # every rank logs the same


def test_lora_disabled_adapters_match_trl_peft(tp1):
    """LoRA on q / v, beta 0.1: the reference is the policy with its adapters disabled (PEFT's in TRL); logs and
    completions."""
    _assert_matches("rloo_lora", tp1["trl"]["rloo_lora"], tp1["loong"]["rloo_lora"], None)
    assert tp1["trl"]["rloo_lora"]["logs"][1]["clip_ratio/region_mean"] > 0


@pytest.mark.parametrize("layout", ["tp1", "pp2_vpp2"])
def test_moe_router_aux_loss_matches_trl(moe_src, tp1, two_ranks, layout):
    """TRL adds ``router_aux_loss_coef * aux_loss`` to each micro-batch's loss (Trainer then divides by the
    accumulation steps) and to the evaluation loss, and logs ``aux_loss`` / ``eval_aux_loss``; here too."""
    name = "rloo_moe_router_aux"
    ref = tp1["moe_trl"][name]
    runs = [tp1["moe_loong"]] if layout == "tp1" else [rank["moe_pp2_vpp2"] for rank in two_ranks]
    assert all(run[name]["completions"] == ref["completions"] for run in runs)
    _assert_matches(name, ref, runs[0][name], saved_tensors(str(moe_src)))
    assert all(log["aux_loss"] > 0 for log in ref["logs"]) and ref["eval"]["eval_aux_loss"] > 0
    assert all(run[name]["logs"] == runs[0][name]["logs"] and run[name]["eval"] == runs[0][name]["eval"]
               for run in runs)


def test_logged_metrics(tp1):
    """What TRL logs (its step_time aside) is there, each step; kl where TRL generated."""
    logs = tp1["trl"]["rloo_kl_iter2"]["logs"]
    assert {"loss", "grad_norm", "reward", "reward_std", "entropy", "clip_ratio/low_min", "clip_ratio/high_max",
            "completions/mean_length", "num_tokens"} <= set(logs[0])
    # NOTE: TRL logs kl where it generated: 0 at the first generation (policy = reference), not at the second
    assert logs[0]["kl"] == 0 and logs[2]["kl"] != 0


def test_refusals(tp1):
    vllm, sync = tp1["refusals"]
    assert "LoongRLOOTrainer does not support: use_vllm=True" in vllm
    assert "sync_ref_model=True" in sync


@pytest.mark.parametrize("layout", ["vision_tp1", "vision_tp2_sp"])
def test_vision_matches_trl(vl_src, tp1, two_ranks, layout):
    """Image prompts on the tiny Qwen2-VL: generation with the images (the same completions), the old and reference
    log-probs with them (the KL penalty in the reward), the policy's (loss, clip ratios, grad_norm), the weights."""
    runs = [tp1[layout]] if layout == "vision_tp1" else [rank[layout] for rank in two_ranks]
    ref = tp1["vision_trl"]["vision_rloo"]
    assert_vision_matches("vision_rloo", [ref] * len(runs), [run["vision_rloo"] for run in runs],
                          saved_tensors(str(vl_src)))
    assert ref["logs"][1]["clip_ratio/region_mean"] > 0
