"""LoongDPOTrainer against trl.DPOTrainer (with PEFT for LoRA) on the transformers model, same DPOConfig.

Scenarios (``_dpo_parity.SCENARIOS``), 4 optimizer steps of 2 micro-batches of 2 pairs each, "sigmoid" loss, beta 0.1:
full fine-tuning with a reference model passed; LoRA (q, v, down projections) with no reference model (the adapters
disabled are the reference), evaluating after steps 2 and 4; full fine-tuning with ``precompute_ref_log_probs=True``.
All at TP=1; the first two also at TP=2 with sequence parallelism and at PP=2. At DP=2, against trl.DPOTrainer under DDP
in the same two-rank world: the LoRA scenario, and 2-step full fine-tuning runs of each other TRL 1.16 loss type
(``_dpo_parity.LOSS_SCENARIOS``: label smoothing, the f-divergences, RPO as "sigmoid" + weighted "sft"; the ones that
count tokens evaluating after each step).

Tolerances (fp32): in every log, the loss, grad_norm, rewards/chosen, rewards/rejected, rewards/margins, logps/chosen,
logps/rejected and entropy within 1e-4 relative or 2e-5 absolute (rewards start at 0), rewards/accuracies,
mean_token_accuracy and num_tokens exactly; the same for eval_loss and the eval reward metrics. Final weights: every
LoRA adapter tensor within 1e-4 of PEFT's; under full fine-tuning each tensor's difference from TRL's within 1% of how
far TRL's training moved it (in norm): Adam turns the rounding of near-zero gradients into steps of the learning
rate's size, so an absolute bound would have to be loose.
"""

from __future__ import annotations

import pytest

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing import make_tiny_checkpoint

from ._dpo_parity import LOSS_SCENARIOS, METRICS, SCENARIOS, refusals, run_loong, run_trl

NAMES = list(SCENARIOS)
TWO_RANK_NAMES = ["full_ref_model", "lora_disabled_adapters"]
LAYOUTS = {"tp2_sp": {"tensor_parallel_size": 2, "sequence_parallel": True}, "pp2": {"pipeline_parallel_size": 2}}
# at DP=2 against TRL under DDP: LoRA with evaluation, and every loss-type run (full fine-tuning with a ref_model)
ALL_SCENARIOS = {**SCENARIOS, **LOSS_SCENARIOS}
DP_NAMES = ["lora_disabled_adapters", *LOSS_SCENARIOS]


def _tp1_world(folder: str, out_dir: str) -> dict:
    return {"trl": run_trl(folder, out_dir + "/trl", NAMES), "loong": run_loong(folder, out_dir + "/tp1", {}, NAMES),
            "refusals": refusals(folder, out_dir + "/refused")}


def _two_rank_world(folder: str, out_dir: str) -> dict:
    out = {name: run_loong(folder, f"{out_dir}/{name}", layout, TWO_RANK_NAMES) for name, layout in LAYOUTS.items()}
    # NOTE: trl.DPOTrainer's accelerate runs DDP over this world's gloo group, as under torchrun
    out["trl_ddp"] = run_trl(folder, out_dir + "/trl-ddp", DP_NAMES, ALL_SCENARIOS)
    out["dp2"] = run_loong(folder, out_dir + "/dp2", {}, DP_NAMES, ALL_SCENARIOS)
    return out


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("dpo-src") / "llama", "llama")


@pytest.fixture(scope="module")
def tp1(src, tmp_path_factory):
    return run_distributed(_tp1_world, 1, str(src), str(tmp_path_factory.mktemp("dpo-tp1")), timeout=500)[0]


@pytest.fixture(scope="module")
def two_ranks(src, tmp_path_factory):
    return run_distributed(_two_rank_world, 2, str(src), str(tmp_path_factory.mktemp("dpo-2")), timeout=500)


def _initial_weights(folder) -> dict:
    import glob

    from safetensors.torch import load_file

    out = {}
    for f in glob.glob(f"{folder}/*.safetensors"):
        out.update(load_file(f))
    return out


def _assert_matches(name: str, ref: dict, got: dict, initial: dict) -> None:
    overrides, lora, _ = ALL_SCENARIOS[name]
    assert len(ref["logs"]) == len(got["logs"]) == overrides.get("max_steps", 4)
    exact = {"rewards/accuracies", "mean_token_accuracy", "num_tokens"}
    for step, (theirs, ours) in enumerate(zip(ref["logs"], got["logs"])):
        for key, a, b in zip(METRICS, theirs, ours):
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
        assert ours[3] == theirs[3]
        assert ours == pytest.approx(theirs, rel=1e-4, abs=2e-5)
    theirs, ours = ref["weights"], got["weights"]
    assert sorted(ours) == sorted(theirs)
    for key, value in theirs.items():
        if lora:
            assert float((ours[key] - value).abs().max()) < 1e-4, key
        else:
            moved = float((value - initial[key]).norm())
            assert moved > 0 and float((ours[key] - value).norm()) < 1e-2 * moved, key


@pytest.mark.parametrize("name", NAMES)
def test_tp1_matches_trl(src, tp1, name):
    _assert_matches(name, tp1["trl"][name], tp1["loong"][name], _initial_weights(src))


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name", TWO_RANK_NAMES)
def test_two_ranks_match_trl(src, tp1, two_ranks, layout, name):
    _assert_matches(name, tp1["trl"][name], two_ranks[0][layout][name], _initial_weights(src))
    assert two_ranks[1][layout][name]["logs"] == two_ranks[0][layout][name]["logs"]  # every rank logs the same


@pytest.mark.parametrize("name", DP_NAMES)
def test_dp2_matches_trl_ddp(src, two_ranks, name):
    """Two data-parallel ranks against trl.DPOTrainer on the same two processes under DDP: each rank's micro-batches,
    the loss averaged over the ranks, TRL's metrics gathered over them; the loss types of ``LOSS_SCENARIOS`` here."""
    _assert_matches(name, two_ranks[0]["trl_ddp"][name], two_ranks[0]["dp2"][name], _initial_weights(src))
    assert two_ranks[1]["dp2"][name]["logs"] == two_ranks[0]["dp2"][name]["logs"]


def test_unsupported_settings_are_refused(tp1):
    fields = ("loss_type", "use_liger_kernel", "padding_free", "ld_alpha", "use_weighting", "rpo_alpha")
    assert len(tp1["refusals"]) == len(fields)
    for message, field in zip(tp1["refusals"], fields):
        assert message.startswith("LoongDPOTrainer does not support") and field in message
    assert "loss_type=['sigmoid', 'sft']" in tp1["refusals"][-1]  # rpo_alpha: what TRL 1.16 writes instead
