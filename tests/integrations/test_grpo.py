"""LoongGRPOTrainer against trl.GRPOTrainer on the transformers model, same GRPOConfig and reward function.

Scenarios (``_grpo_parity.SCENARIOS``), 3 optimizer steps of 2 micro-batches of 4 completions (2 prompts x 4
generations per step, prompts of different lengths: left padding), 6 completion tokens at most: "grpo" with beta 0;
"grpo" with beta 0.1 (a reference model) and num_iterations 2 (old log-probs, clipping); "dapo" with beta 0.05,
num_iterations 2, epsilon_high 0.28 and batch-scaled rewards. Each trainer generates with its own model (transformers'
sampling, seeded as TRL seeds it): the completions are the same because the logits are. Both suppress the pad token
in generation: transformers' embedding (``padding_idx``) gives the pad token's row no gradient, megatron's does, so a
sampled pad token would move the two models apart. At TP=1 in one process, and at TP=2 with sequence parallelism and
at DP=2 (against trl.GRPOTrainer under DDP in the same world) in one two-rank world; LoRA (q, v) with the adapters
disabled as the reference against TRL + PEFT at TP=1 (logs only).

Tolerances (fp32): in every log, the loss, grad_norm, kl, entropy, reward metrics and clip ratios within 1e-4
relative or 1e-6 absolute (losses and clip ratios can be 0), the completion lengths and num_tokens exactly; final
weights: each tensor's difference from TRL's within 1% of how far TRL's training moved it (in norm), as the DPO test.
"""

from __future__ import annotations

import pytest

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing import make_tiny_checkpoint

from ._grpo_parity import SCENARIOS, refusals, run_lora, run_loong, run_trl, saved_tensors

NAMES = list(SCENARIOS)
TWO_RANK = {"tp2_sp": ({"tensor_parallel_size": 2, "sequence_parallel": True}, ["grpo_kl_iter2", "dapo_kl_iter2"]),
            "dp2": ({}, ["grpo_kl_iter2"])}
EXACT = ("completions/mean_length", "completions/clipped_ratio", "num_tokens")


def _tp1_world(folder: str, out_dir: str) -> dict:
    return {"trl": run_trl(folder, out_dir + "/trl", NAMES), "loong": run_loong(folder, out_dir + "/tp1", {}, NAMES),
            "refusals": refusals(folder, out_dir + "/refused"), "lora": run_lora(folder, out_dir + "/lora")}


def _two_rank_world(folder: str, out_dir: str) -> dict:
    out = {name: run_loong(folder, f"{out_dir}/{name}", layout, names) for name, (layout, names) in TWO_RANK.items()}
    # NOTE: trl.GRPOTrainer's accelerate runs DDP over this world's gloo group, as under torchrun
    out["trl_ddp"] = run_trl(folder, out_dir + "/trl-ddp", TWO_RANK["dp2"][1])
    return out


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("grpo-src") / "llama", "llama")


@pytest.fixture(scope="module")
def tp1(src, tmp_path_factory):
    return run_distributed(_tp1_world, 1, str(src), str(tmp_path_factory.mktemp("grpo-tp1")), timeout=500)[0]


@pytest.fixture(scope="module")
def two_ranks(src, tmp_path_factory):
    return run_distributed(_two_rank_world, 2, str(src), str(tmp_path_factory.mktemp("grpo-2")), timeout=500)


def _assert_logs_match(name: str, ref: list[dict], got: list[dict]) -> None:
    assert len(ref) == len(got) == 3
    for step, (theirs, ours) in enumerate(zip(ref, got)):
        assert sorted(ours) == sorted(theirs), (name, step)
        for key, value in theirs.items():
            if key in EXACT:
                assert ours[key] == value, (name, step, key)
            else:
                assert ours[key] == pytest.approx(value, rel=1e-4, abs=1e-6), (name, step, key)


def _assert_matches(name: str, ref: dict, got: dict, initial: dict) -> None:
    _assert_logs_match(name, ref["logs"], got["logs"])
    if SCENARIOS[name].get("num_iterations", 1) > 1:  # NOTE: the second pass over a generation clips some ratios
        assert ref["logs"][1]["clip_ratio/region_mean"] > 0 and ref["logs"][1]["kl"] > 0
    theirs, ours = ref["weights"], got["weights"]
    assert sorted(ours) == sorted(theirs)
    for key, value in theirs.items():
        moved = float((value - initial[key]).norm())
        assert moved > 0 and float((ours[key] - value).norm()) < 1e-2 * moved, key


@pytest.mark.parametrize("name", NAMES)
def test_tp1_matches_trl(src, tp1, name):
    _assert_matches(name, tp1["trl"][name], tp1["loong"][name], saved_tensors(str(src)))


@pytest.mark.parametrize("layout,name", [(layout, name) for layout, (_, names) in TWO_RANK.items() for name in names])
def test_two_ranks_match_trl(src, tp1, two_ranks, layout, name):
    ref = two_ranks[0]["trl_ddp"][name] if layout == "dp2" else tp1["trl"][name]
    _assert_matches(name, ref, two_ranks[0][layout][name], saved_tensors(str(src)))
    assert two_ranks[1][layout][name]["logs"] == two_ranks[0][layout][name]["logs"]  # every rank logs the same


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
