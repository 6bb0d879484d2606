"""Reward models: lf.AutoModelForSequenceClassification against transformers' classifier, and LoongRewardTrainer
against trl.RewardTrainer on the transformers model, same RewardConfig.

Classifier (tiny Llama and Qwen3 causal checkpoints, loaded with a fresh score head) at TP=1, TP=2 with sequence
parallelism, PP=2, CP=2 (the pooled position on one rank's load-balanced share, gathered over the CP group) and PP=2
x VPP=2 (the virtual stages in order): the pooled logits of four rows (full, right-, left- and both-side padded)
within 1e-5 of transformers' (its score set to ours); the loss of num_labels=1 (regression) and num_labels=3 (single-
and multi-label, problem_type inferred as transformers infers it) within 1e-5; loading info (score.weight missing,
lm_head.weight unexpected) and the fresh score's spread (initializer_range); the export (num_labels=3) loads in
transformers with architectures = [the sequence-classification class], its backbone tensors bit-exact with the
source's and its score with ours, transformers' logits on it within 1e-5, and our reload of it (its own score).

The fresh head (both worlds, float32; one rank, bfloat16): after torch.manual_seed(s) it is bit for bit the head
transformers' classifier draws after the same seed, and torch's default generator ends where transformers' does; a
rank seeded elsewhere holds rank 0's draw.

Trainer (a tiny Llama classifier written by transformers, num_labels=1): 4 optimizer steps of 2 micro-batches of 2
pairs; an explicit-prompt dataset, an implicit-prompt one with a margin column, center_rewards_coefficient and
evaluation after steps 2 and 4, and LoRA (LoraConfig(task_type="SEQ_CLS", target_modules="all-linear"): PEFT's
score head in modules_to_save) with evaluation. At TP=1, TP=2 with SP, PP=2, CP=2 and PP=2 x VPP=2 (megatron's
interleaved schedule) against TRL (+ PEFT) at one process;
at DP=2 against TRL under DDP in the same two-rank world. In every log loss, grad_norm,
min / mean / max reward, accuracy and margin within 1e-4 relative or 2e-5 absolute, num_tokens exactly; the eval
metrics the same; final weights: each tensor's difference from TRL's within 1% of how far TRL's training moved it
(in norm), as test_dpo.py; LoRA: the adapter folder's tensors (factors and score) within 1e-4 of PEFT's, its
adapter_config.json PEFT's, and PEFT's classifier loaded with it (transformers' AutoModelForSequenceClassification
+ PeftModel.from_pretrained) gives the trained model's logits within 1e-5.
MoE: a tiny Qwen3-MoE whose config asks for the router balancing loss (output_router_logits, router_aux_loss_coef
0.5), which transformers' classifier neither returns nor adds and trl.RewardTrainer does not add (unlike its DPO /
GRPO trainers): the classifier checks above (the forward asked for router logits too: logits only, as transformers')
and the "explicit" training run vs TRL at TP=1 and TP=2 with SP x EP=2 (ETP 1).
Resume: the TP=2 + SP run checkpoints at step 2; a run resumed from it at TP=2 + SP and at PP=2 logs steps 3-4 as the
uninterrupted run did (exactly / within 1e-5).
"""

from __future__ import annotations

import pytest

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing import make_tiny_checkpoint

from ._reward_parity import (LORA, METRICS, SCENARIOS, bf16_head, classifier_checks, make_classifier, refusals,
                             resume_loong, run_loong, run_trl, saved_tensors)

ARCHS = ("llama", "qwen3")
NAMES = list(SCENARIOS)
LAYOUTS = {"tp2_sp": {"tensor_parallel_size": 2, "sequence_parallel": True}, "pp2": {"pipeline_parallel_size": 2}}
# NOTE: classifier checks and training runs only (the resume test runs in LAYOUTS)
MORE_LAYOUTS = {"cp2": {"context_parallel_size": 2},
                "pp2_vpp2": {"pipeline_parallel_size": 2, "virtual_pipeline_parallel_size": 2}}
CHECKPOINT = {"explicit": {"save_strategy": "steps", "save_steps": 2}}  # NOTE: the TP2 run's, resumed from step 2
# NOTE: the Qwen3-MoE's two-rank layout: the experts split over the TP ranks (EP2, ETP1)
MOE_LAYOUT = {"tensor_parallel_size": 2, "sequence_parallel": True, "expert_parallel_size": 2,
              "expert_tensor_parallel_size": 1}
# NOTE: a config that asks for the router balancing loss, which transformers' classifier and TRL's RewardTrainer
# leave out
MOE_ROUTER = {"output_router_logits": True, "router_aux_loss_coef": 0.5}


def _one_rank(causal: dict, classifier: str, moe: tuple[str, str], out_dir: str) -> dict:
    return {"classifier": classifier_checks(causal, out_dir + "/cls", {}), "bf16_head": bf16_head(causal["llama"]),
            "trl": run_trl(classifier, out_dir + "/trl", NAMES), "loong": run_loong(classifier, out_dir + "/tp1", {},
                                                                                    NAMES),
            "moe": classifier_checks({"qwen3_moe": moe[0]}, out_dir + "/moe-cls", {})["qwen3_moe"],
            "moe_trl": run_trl(moe[1], out_dir + "/moe-trl", NAMES[:1]),
            "moe_train": run_loong(moe[1], out_dir + "/moe-tp1", {}, NAMES[:1])}


def _two_ranks(causal: dict, classifier: str, moe: tuple[str, str], out_dir: str) -> dict:
    out = {name: classifier_checks(causal, f"{out_dir}/{name}", layout)
           for name, layout in {**LAYOUTS, **MORE_LAYOUTS}.items()}
    out["moe"] = classifier_checks({"qwen3_moe": moe[0]}, out_dir + "/moe-cls", MOE_LAYOUT)["qwen3_moe"]
    out["moe_train"] = run_loong(moe[1], out_dir + "/moe-train", MOE_LAYOUT, NAMES[:1])
    out["refusals"] = refusals(causal["llama"], {})
    out["tp2_sp_train"] = run_loong(classifier, out_dir + "/tp2-train", LAYOUTS["tp2_sp"], NAMES, extra=CHECKPOINT)
    for name, layout in {"pp2": LAYOUTS["pp2"], **MORE_LAYOUTS}.items():
        out[f"{name}_train"] = run_loong(classifier, f"{out_dir}/{name}-train", layout, NAMES)
    for name, layout in LAYOUTS.items():  # NOTE: the TP2 + SP run's step-2 checkpoint, in the same / another layout
        out[f"resume_{name}"] = resume_loong(classifier, out_dir + "/tp2-train/explicit/checkpoint-2",
                                             f"{out_dir}/resume-{name}", layout)
    # NOTE: trl.RewardTrainer's accelerate runs DDP over this world's gloo group, as under torchrun
    out["trl_ddp"] = run_trl(classifier, out_dir + "/trl-ddp", NAMES[:1])
    out["dp2"] = run_loong(classifier, out_dir + "/dp2", {}, NAMES[:1])
    return out


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    base = tmp_path_factory.mktemp("reward-src")
    causal = {arch: str(make_tiny_checkpoint(base / arch, arch)) for arch in ARCHS}
    moe = str(make_tiny_checkpoint(base / "qwen3_moe", "qwen3_moe", **MOE_ROUTER))
    return causal, make_classifier(causal["llama"], str(base / "llama-cls")), (moe, make_classifier(
        moe, str(base / "qwen3_moe-cls")))


@pytest.fixture(scope="module")
def one_rank(sources, tmp_path_factory):
    return run_distributed(_one_rank, 1, *sources, str(tmp_path_factory.mktemp("reward-1")), timeout=600)[0]


@pytest.fixture(scope="module")
def two_ranks(sources, tmp_path_factory):
    return run_distributed(_two_ranks, 2, *sources, str(tmp_path_factory.mktemp("reward-2")), timeout=600)


def _assert_classifier(res: dict, source: str) -> None:
    for labels in (1, 3):
        diff, scale = res[f"logits{labels}"]
        assert scale > 1e-2 and diff < 1e-5, (labels, diff)
        assert res[f"info{labels}"] == (["score.weight"], ["lm_head.weight"])
        assert 0.01 < res[f"score_std{labels}"] < 0.03  # NOTE: the tiny configs' initializer_range is 0.02
        # NOTE: the fresh head is transformers' own draw after the same seed, and the default generator ends where
        # transformers' does
        assert res[f"score_as_transformers{labels}"] and res[f"rng_after{labels}"], labels
    problems = {"loss1_0": "regression", "loss3_0": "single_label_classification",
                "loss3_1": "multi_label_classification"}
    for key, problem in problems.items():
        ours, theirs, found = res[key]
        assert found == problem and ours == pytest.approx(theirs, rel=1e-5, abs=1e-6), key
    assert res["reloaded"] == 0.0


def _assert_export(res: dict, arch: str) -> None:
    assert res["architectures"] == [{"llama": "LlamaForSequenceClassification",
                                     "qwen3": "Qwen3ForSequenceClassification",
                                     "qwen3_moe": "Qwen3MoeForSequenceClassification"}[arch]]
    assert "score.weight" in res["export_names"] and "lm_head.weight" not in res["export_names"]
    assert res["backbone_exact"] and res["score_exact"]
    assert res["export_logits"] < 1e-5


@pytest.mark.parametrize("layout", ["tp1", "tp2_sp_ep2"])
def test_moe_classifier_matches_transformers(sources, one_rank, two_ranks, layout):
    """A Qwen3-MoE whose config asks for the router balancing loss: logits and losses as transformers' classifier,
    which neither returns router logits nor adds the loss (nor do we)."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(sources[2][0])
    assert (config.output_router_logits, config.router_aux_loss_coef) == (True, 0.5)
    res = one_rank["moe"] if layout == "tp1" else two_ranks[0]["moe"]
    _assert_classifier(res, sources[2][0])
    _assert_export(res, "qwen3_moe")
    for labels in (1, 3):
        assert res[f"outputs{labels}"] == (["logits"], ["logits"])
    if layout != "tp1":
        assert two_ranks[1]["moe"]["logits1"] == res["logits1"]


@pytest.mark.parametrize("arch", ARCHS)
def test_classifier_matches_transformers_tp1(sources, one_rank, arch):
    res = one_rank["classifier"][arch]
    _assert_classifier(res, sources[0][arch])
    _assert_export(res, arch)


@pytest.mark.parametrize("layout", [*LAYOUTS, *MORE_LAYOUTS])
@pytest.mark.parametrize("arch", ARCHS)
def test_classifier_matches_transformers_two_ranks(sources, two_ranks, layout, arch):
    _assert_classifier(two_ranks[0][layout][arch], sources[0][arch])
    _assert_export(two_ranks[0][layout][arch], arch)
    assert two_ranks[1][layout][arch]["logits1"] == two_ranks[0][layout][arch]["logits1"]  # every rank alike
    # NOTE: rank 1 seeded elsewhere: its head is rank 0's draw, transformers' for rank 0's seed
    assert two_ranks[1][layout][arch]["score_as_transformers1"] and two_ranks[1][layout][arch]["score_as_transformers3"]


def test_fresh_head_bf16_as_transformers(one_rank):
    assert one_rank["bf16_head"]


def test_refusals(two_ranks):
    for rank in two_ranks:
        labels, embeds, generate, no_pad, trainer, causal, ia3, lora_task, vpp = rank["refusals"]
        assert "num_labels=3" in labels and "ValueError" in labels  # NOTE: TRL's own check
        assert "inputs_embeds" in embeds
        assert "does not generate" in generate
        assert no_pad == "Cannot handle batch sizes > 1 if no padding token is defined."  # NOTE: transformers'
        assert "only loongforge_hf.LoongRewardTrainer" in trainer
        assert "AutoModelForSequenceClassification" in causal and "LoongModelForCausalLM" in causal
        assert "peft_config of type IA3Config (LoRA only)" in ia3
        assert "LoraConfig(task_type=None) on a sequence classifier: use task_type='SEQ_CLS'" in lora_task
        assert "gradient_accumulation_steps=1 with virtual pipeline stages" in vpp


def _assert_matches(name: str, ref: dict, got: dict, initial: dict) -> None:
    overrides, _ = SCENARIOS[name]
    assert len(ref["logs"]) == len(got["logs"]) == overrides.get("max_steps", 4)
    for step, (theirs, ours) in enumerate(zip(ref["logs"], got["logs"])):
        for key, a, b in zip(METRICS, theirs, ours):
            if key == "num_tokens":
                assert b == a, (name, step, key)
            else:
                assert b == pytest.approx(a, rel=1e-4, abs=2e-5), (name, step, key)
    assert any(log[5] not in (0.0, 1.0) for log in ref["logs"])  # NOTE: accuracies that a sign flip would change
    evals = len(ref["logs"]) // overrides["eval_steps"] if overrides.get("eval_strategy") else 0
    assert len(got["eval_logs"]) == len(ref["eval_logs"]) == evals
    for theirs, ours in zip(ref["eval_logs"], got["eval_logs"]):
        assert ours == pytest.approx(theirs, rel=1e-4, abs=2e-5)
    theirs, ours = ref["weights"], got["weights"]
    assert sorted(ours) == sorted(theirs)
    if name in LORA:  # NOTE: PEFT's adapter folder: the factors and the score head (modules_to_save) whole
        assert ours["base_model.model.score.weight"].shape == initial["score.weight"].shape
        assert float((theirs["base_model.model.score.weight"] - initial["score.weight"]).abs().max()) > 1e-3
        for key, value in theirs.items():
            assert float((ours[key] - value).abs().max()) < 1e-4, key
        assert got["adapter_config"] == ref["adapter_config"]
        diff, scale = got["peft_logits"]
        assert scale > 1e-2 and diff < 1e-5, diff
        return
    for key, value in theirs.items():
        moved = float((value - initial[key]).norm())
        assert moved > 0 and float((ours[key] - value).norm()) < 1e-2 * moved, key


@pytest.mark.parametrize("name", NAMES)
def test_trainer_tp1_matches_trl(sources, one_rank, name):
    _assert_matches(name, one_rank["trl"][name], one_rank["loong"][name], saved_tensors(sources[1]))


@pytest.mark.parametrize("name", NAMES)
def test_trainer_tp2_sp_matches_trl(sources, one_rank, two_ranks, name):
    _assert_matches(name, one_rank["trl"][name], two_ranks[0]["tp2_sp_train"][name], saved_tensors(sources[1]))
    assert two_ranks[1]["tp2_sp_train"][name]["logs"] == two_ranks[0]["tp2_sp_train"][name]["logs"]


@pytest.mark.parametrize("layout", ["tp1", "tp2_sp_ep2"])
def test_moe_trainer_matches_trl(sources, one_rank, two_ranks, layout):
    """A Qwen3-MoE classifier whose config asks for the router balancing loss: trl.RewardTrainer adds none (unlike
    its DPO / GRPO trainers), nor does LoongRewardTrainer; every metric and the final weights (experts and routers
    included) as TRL's."""
    name = NAMES[0]
    got = one_rank["moe_train"] if layout == "tp1" else two_ranks[0]["moe_train"]
    _assert_matches(name, one_rank["moe_trl"][name], got[name], saved_tensors(sources[2][1]))
    assert any(".experts." in k for k in one_rank["moe_trl"][name]["weights"])
    if layout != "tp1":
        assert two_ranks[1]["moe_train"][name]["logs"] == got[name]["logs"]


def test_trainer_dp2_matches_trl_ddp(sources, two_ranks):
    name = NAMES[0]
    _assert_matches(name, two_ranks[0]["trl_ddp"][name], two_ranks[0]["dp2"][name], saved_tensors(sources[1]))
    assert two_ranks[1]["dp2"][name]["logs"] == two_ranks[0]["dp2"][name]["logs"]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("layout", ["pp2", *MORE_LAYOUTS])
def test_trainer_pp2_cp2_vpp2_match_trl(sources, one_rank, two_ranks, layout, name):
    _assert_matches(name, one_rank["trl"][name], two_ranks[0][f"{layout}_train"][name], saved_tensors(sources[1]))
    assert two_ranks[1][f"{layout}_train"][name]["logs"] == two_ranks[0][f"{layout}_train"][name]["logs"]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_trainer_resumes_mid_run(two_ranks, layout):
    """Steps 3-4 of a run resumed from the TP2 + SP run's step-2 checkpoint (megatron's sharded state: the score head,
    AdamW's moments) equal the uninterrupted run's: exactly in the same layout, within 1e-5 at PP2 (other reduction
    orders); num_tokens counts from the resume, as TRL's does (it does not restore its count)."""
    full = two_ranks[0]["tp2_sp_train"]["explicit"]["logs"]
    resumed = two_ranks[0][f"resume_{layout}"]
    assert sorted(resumed) == [3, 4] and two_ranks[1][f"resume_{layout}"] == resumed
    for step in (3, 4):
        for key, a, b in zip(METRICS, full[step - 1], resumed[step]):
            if key == "num_tokens":
                assert b == a - full[1][METRICS.index(key)], step
            elif layout == "tp2_sp":
                assert b == a, (layout, step, key)
            else:
                assert b == pytest.approx(a, rel=1e-5, abs=1e-7), (layout, step, key)
