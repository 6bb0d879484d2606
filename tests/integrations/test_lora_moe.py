"""LoRA on the mixture-of-experts models Qwen3-MoE and Mixtral, against PEFT on the transformers model.

PEFT (0.21, on transformers 5) rewrites a LoraConfig for these models: names of expert projections or the router
(``"all-linear"`` names them all) become ``target_parameters`` on the 3-D expert stacks (``gate_up_proj`` with r and
alpha doubled, ``down_proj``) and the router (``gate.weight``), adapted by PEFT's ``ParamWrapper``; the attention
projections are adapted as on a dense model, in every layer (MoE or dense). Both are done here as PEFT does them.

- Targets: the same modules and parameters as ``peft.get_peft_model`` (a regex naming one layer's q_proj adapts every
  layer's, as PEFT's rewrite does), the same initial tensors after the same seed (bit for bit), the same scaling.
- Whole model, for the attention projections (with modules_to_save), "all-linear" (attention, experts, router) and the
  expert projections alone: TP1 (Qwen3-MoE with a dense first layer; Mixtral with attention and with
  q_proj/w1/w2/w3/gate), TP2 + sequence parallel + EP2 (experts not split over TP), EP2 over a dense data-parallel
  pair, PP2 and CP2 x EP2 (Qwen3-MoE; dense gradients summed over the CP ranks, as megatron's DDP sums them): logits
  within 1e-4 (1e-5 where experts or the router are adapted: measured ~1e-6), loss within 1e-5, adapter gradients
  within 1e-5 of PEFT's (fp32, as test_lora.py; expert adapters of this rank's experts); PEFT's parameter counts;
  megatron's DDP holds only the trainable tensors, attention / router adapters in its dense buffers, expert adapters
  in its expert buffers (every layout); the adapter folder loads in ``PeftModel.from_pretrained`` and the merged
  export (the full MoE checkpoint) in transformers with the Loong model's logits (1e-4); a PEFT-written adapter
  (random B) loads onto the Loong model with PEFT's logits and loss.
- LoongSFTTrainer with a LoraConfig on Qwen3-MoE (attention with and without the router balancing loss, and
  "all-linear" with it, whose gradient then reaches the router's adapter): the logged losses of trl.SFTTrainer (1e-4
  relative), at TP1 and at TP2 + SP + EP2; the "all-linear" LoRA checkpoint at TP2 + SP + EP2 resumes exactly.
- LoRA on the routed experts alone (PEFT's target_parameters), where the experts have their own optimizer and
  nothing dense trains (EP2 over two data-parallel ranks; TP2 + SP with expert_tensor_parallel_size=1): the logged
  losses and grad norms (clipped) of the same run in one process, the trained adapter folder loads in PEFT with the
  trained logits, and at EP2 a resumed run logs the uninterrupted run's losses exactly; at EP2 x PP2 (4 processes,
  slow) with the final norm trained too, so the first stage's dense optimizer holds no parameter, a resumed run
  logs the uninterrupted run's losses exactly.
- Refused with messages naming the way out: fused gate/up named by half (PEFT refuses it), lora_dropout with expert
  targets (PEFT refuses it), other parameters, megatron's SequentialMLP experts, experts
  split over expert-tensor parallelism. DeepSeek-V2/V3 (multi-latent attention): test_lora_mla.py.
"""

from __future__ import annotations

import pytest
import torch

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing import make_tiny_checkpoint

from ._lora_moe import (EXPERTS_ONLY_LAYOUTS, ONE_RANK_CASES, SFT_SCENARIOS, TWO_RANK_CASES, TWO_RANK_LAYOUTS,
                        four_rank_checks, one_rank_checks, two_rank_checks, write_peft_adapters)

ARCHS = ("qwen3_moe", "mixtral")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    base = tmp_path_factory.mktemp("lora-moe")
    folders = {arch: str(make_tiny_checkpoint(base / arch, arch)) for arch in ARCHS}
    return folders, write_peft_adapters(folders, str(base)), base


def _bridge(folder: str):
    import transformers

    from loongforge_hf.bridges import get_bridge

    return get_bridge(transformers.AutoConfig.from_pretrained(folder))


@pytest.mark.parametrize("arch, kw", [
    ("qwen3_moe", dict(r=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], layers_to_transform=[0, 2])),
    ("qwen3_moe", dict(r=2, lora_alpha=5, target_modules=r".*layers\.1\.self_attn\.q_proj", use_rslora=True)),
    ("mixtral", dict(r=3, target_modules=["v_proj", "o_proj"], init_lora_weights="gaussian")),
    ("qwen3_moe", dict(r=2, lora_alpha=6, target_modules="all-linear")),
    ("qwen3_moe", dict(r=2, target_modules=["q_proj", "down_proj", "up_proj", "gate_proj"], layers_to_transform=[2])),
    ("qwen3_moe", dict(r=3, use_rslora=True, target_modules=["gate_proj", "up_proj", "down_proj"])),
    ("mixtral", dict(r=2, target_modules=["w1", "w3", "gate"], init_lora_weights="gaussian")),
    ("mixtral", dict(r=2, target_modules=["q_proj"], target_parameters=["model.layers.1.mlp.experts.down_proj"])),
    # per-module / per-parameter ranks and alphas beside the rewrite's own gate_up_proj entry
    ("qwen3_moe", dict(r=2, lora_alpha=4, target_modules=["q_proj", "gate_proj", "up_proj", "down_proj"],
                       rank_pattern={"q_proj": 8, r"layers\.1\.mlp\.experts\.down_proj": 3},
                       alpha_pattern={"o_proj": 1, "down_proj": 7})),
    ("mixtral", dict(r=2, target_modules=["w2", "v_proj"], alpha_pattern={r".*\.down_proj": 8})),
])
def test_targets_and_initial_adapters_are_peft_s(setup, arch, kw):
    import peft
    import transformers

    from loongforge_hf.lora.init import draw_initial_weights
    from loongforge_hf.lora.plan import plan_lora

    folder = setup[0][arch]
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    transformers.set_seed(3)
    ref = peft.get_peft_model(hf, peft.LoraConfig(**kw))
    plan = plan_lora(_bridge(folder), peft.LoraConfig(**kw))
    transformers.set_seed(3)
    drawn = draw_initial_weights(plan.targets, kw.get("init_lora_weights", True))

    params = dict(ref.named_parameters())
    adapted = [n.removeprefix("base_model.model.").removesuffix(".lora_A.default.weight")
               for n in params if n.endswith("lora_A.default.weight")]
    if any(t.kind in ("experts", "router") for t in plan.targets):
        # PEFT creates (and draws) parameter adapters after all module adapters, so its named_parameters order
        # differs; the tensors below, drawn in plan order, pin the creation order
        assert sorted(t.hf_module for t in plan.targets) == sorted(adapted)
    else:
        assert [t.hf_module for t in plan.targets] == adapted
    for t, (a, b) in zip(plan.targets, drawn):
        assert torch.equal(a, params[f"base_model.model.{t.hf_module}.lora_A.default.weight"]), t.hf_module
        assert torch.equal(b, params[f"base_model.model.{t.hf_module}.lora_B.default.weight"]), t.hf_module
        assert t.scaling == pytest.approx(ref.get_submodule(f"base_model.model.{t.hf_module}").scaling["default"])
    assert plan.target_modules == sorted(ref.peft_config["default"].target_modules)


@pytest.mark.parametrize("arch, kw, match", [
    ("qwen3_moe", dict(target_modules=["gate_proj"]), "without also targeting up_proj"),
    ("mixtral", dict(target_modules=["q_proj", "w1"]), "without also targeting w3"),
    ("qwen3_moe", dict(target_modules="all-linear", lora_dropout=0.05), "lora_dropout=0.05 .*set lora_dropout=0"),
    ("qwen3_moe", dict(target_modules=["q_proj"], target_parameters=["post_attention_layernorm.weight"]),
     "cannot carry a LoRA adapter here; supported: 'gate_up_proj'"),
    # NOTE: PEFT's rewrite leaves only expert stacks: its ParamWrapper refuses fan_in_fan_out
    ("qwen3_moe", dict(target_modules=["gate_proj", "up_proj"], fan_in_fan_out=True),
     r"fan_in_fan_out=True\) does not apply to target_parameters"),
])
def test_unsupported_expert_configs_are_refused(setup, arch, kw, match):
    import peft

    from loongforge_hf.lora import LoraConfigError
    from loongforge_hf.lora.plan import plan_lora

    with pytest.raises(LoraConfigError, match=match):
        plan_lora(_bridge(setup[0][arch]), peft.LoraConfig(**kw))


def test_sequential_mlp_experts_are_refused(setup, monkeypatch):
    """megatron's SequentialMLP (LOONGFORGE_MOE_GROUPED_GEMM=0): expert targets refused, attention ones planned."""
    import peft

    from loongforge_hf.lora import LoraConfigError
    from loongforge_hf.lora.plan import plan_lora

    monkeypatch.setenv("LOONGFORGE_MOE_GROUPED_GEMM", "0")
    bridge = _bridge(setup[0]["qwen3_moe"])
    with pytest.raises(LoraConfigError, match="LOONGFORGE_MOE_GROUPED_GEMM=0"):
        plan_lora(bridge, peft.LoraConfig(target_modules=["down_proj", "up_proj", "gate_proj"]))
    assert plan_lora(bridge, peft.LoraConfig(target_modules=["q_proj"])).targets


@pytest.fixture(scope="module")
def one_rank(setup):
    folders, adapters, base = setup
    return run_distributed(one_rank_checks, 1, folders, str(base / "one"), adapters, timeout=500)[0]


@pytest.fixture(scope="module")
def two_ranks(setup):
    folders, adapters, base = setup
    return run_distributed(two_rank_checks, 2, folders["qwen3_moe"], str(base / "two"), adapters, timeout=600)


def _assert_model_matches_peft(ranks: list[dict], *, experts: bool = False) -> None:
    for res in ranks:
        assert tuple(res["counts"]) == tuple(res["peft_counts"]), res
        assert res["logits_diff"] < (1e-5 if experts else 1e-4) and res["loss_diff"] < 1e-5, res
        assert res["ddp_holds_trainable_only"] and res["dense_buffers_hold_all"] and res["expert_buffers_hold"], res
        # expert adapters follow the experts: in megatron's expert buffers, in every layout
        assert (res["expert_adapters"] > 0) == experts, res
        assert res["dense_group_sizes"] == [res["data_parallel_size"]], res
        assert res["unchanged_after_merged_export"], res
        loaded = res["peft_adapter"]
        assert loaded["class"] == "LoongLoraModelForCausalLM" and loaded["trainable"] == 0, loaded
        assert loaded["logits_diff"] < 1e-4 and loaded["loss_diff"] < 1e-5, loaded
        assert tuple(loaded["counts"]) == tuple(res["peft_counts"]), loaded
    assert ranks[0]["adapter_logits_diff"] < 1e-4 and ranks[0]["merged_logits_diff"] < 1e-4, ranks[0]


@pytest.mark.parametrize("case", list(ONE_RANK_CASES))
def test_tp1_matches_peft(one_rank, case):
    _assert_model_matches_peft([one_rank[case]], experts=not case.endswith("/attention"))


@pytest.mark.parametrize("case", list(TWO_RANK_CASES))
@pytest.mark.parametrize("layout", list(TWO_RANK_LAYOUTS))
def test_two_ranks_match_peft(two_ranks, layout, case):
    _assert_model_matches_peft([r[f"{layout}/{case}"] for r in two_ranks], experts=case != "attention")
    if layout == "ep2_dp2":
        assert two_ranks[0][f"{layout}/{case}"]["data_parallel_size"] == 2


def test_expert_layouts_refused(two_ranks):
    """Experts split over expert-tensor parallelism (TP2's default)."""
    for rank in two_ranks:
        refused = rank["refused"]
        assert "pass expert_tensor_parallel_size=1" in refused["etp2"], refused


@pytest.mark.parametrize("layout", list(EXPERTS_ONLY_LAYOUTS))
def test_expert_only_lora_trains_as_one_process(one_rank, two_ranks, layout):
    """LoongSFTTrainer with LoRA on the routed experts alone, at EP2 over two data-parallel ranks and at TP2 + SP with
    the experts whole on each rank (expert_tensor_parallel_size=1): megatron's dense optimizer is a stub, the expert
    one steps; the logged losses and grad norms (clipped at 0.02) are those of one process over the same global
    batches (1e-5 relative; measured: losses equal at EP2 and within 9e-8 at TP2, grad norms within 5e-8), and the
    saved adapter folder loads in PEFT with the trained model's logits (1e-5; measured 3e-7)."""
    ref = one_rank["experts_only"][EXPERTS_ONLY_LAYOUTS[layout][1]]
    assert len(ref["losses"]) == 3 and min(ref["grad_norms"]) > 0.02, ref  # every step clipped
    for rank in two_ranks:
        got = rank["experts_only"][layout]
        assert got["losses"] == pytest.approx(ref["losses"], rel=1e-5), (layout, got["losses"], ref["losses"])
        assert got["grad_norms"] == pytest.approx(ref["grad_norms"], rel=1e-5), (layout, got, ref)
    ours = two_ranks[0]["experts_only"][layout]
    assert tuple(ours["trainable"]) == tuple(ref["trainable"]), (ours["trainable"], ref["trainable"])
    assert ours["adapter_logits_diff"] < 1e-5 and ref["adapter_logits_diff"] < 1e-5, (ours, ref)


def test_expert_only_lora_resume_matches_uninterrupted_run(two_ranks):
    """LoRA on the routed experts alone at EP2 (the dense optimizer a stub): resumed from the step-2 checkpoint, the
    expert optimizer's state read back, steps 3-4 log the uninterrupted run's losses exactly."""
    for rank in two_ranks:
        res = rank["experts_only_resume"]
        assert res["resumed"] == res["full"] and len(res["full"]) == 4, res


def test_expert_parallel_lora_trains_as_data_parallel(two_ranks):
    """LoongSFTTrainer, "all-linear" with the router balancing loss, on two ranks: EP2 (each rank holds half the
    experts and their adapters) logs the losses of DP2 without expert parallelism (1e-5 relative; measured ~1e-6)."""
    for rank in two_ranks:
        dp2, ep2 = (rank["sft_dp2"][name]["lora_all_linear"]["losses"] for name in ("dp2", "ep2_dp2"))
        assert len(dp2) == 3 and ep2 == pytest.approx(dp2, rel=1e-5), (dp2, ep2)


def test_expert_lora_resume_matches_uninterrupted_run(two_ranks):
    """LoongSFTTrainer, "all-linear" (attention, experts, router) at TP2 + SP + EP2: resumed from the step-2
    checkpoint, steps 3-4 log the uninterrupted run's losses exactly."""
    for rank in two_ranks:
        res = rank["resume"]
        assert res["resumed"] == res["full"] and len(res["full"]) == 4, res


@pytest.mark.parametrize("name", list(SFT_SCENARIOS))
def test_sft_matches_trl(one_rank, two_ranks, name):
    """LoongSFTTrainer with the LoraConfig against trl.SFTTrainer (+ PEFT), at TP1 and at TP2 + SP + EP2: every
    logged loss within 1e-4 relative, TRL's token metrics, the saved adapter loads in PEFT with the trained logits."""
    from ._sft_parity import assert_matches

    ref = one_rank["sft"]["trl"][name]
    assert_matches(name, ref, one_rank["sft"]["loong"][name], SFT_SCENARIOS)
    for rank in two_ranks:
        assert rank["sft"][name]["losses"] == two_ranks[0]["sft"][name]["losses"]
    assert_matches(name, ref, two_ranks[0]["sft"][name], SFT_SCENARIOS)


@pytest.mark.slow
def test_expert_lora_resume_with_a_stage_training_nothing_dense(setup):
    """EP2 x PP2, the routed experts and the final norm trained (4 processes): the first stage's dense optimizer holds
    no parameter, as rank 0's; its checkpoint writes and reads back (without the step it borrows, megatron's
    DistributedOptimizer asserts on the first stage while the last enters the save's collectives: a hang), and
    steps 3-4 after the resume log the uninterrupted run's losses exactly."""
    folders, _, base = setup
    for rank in run_distributed(four_rank_checks, 4, folders["qwen3_moe"], str(base / "four"), timeout=400):
        res = rank["resume"]
        assert res["resumed"] == res["full"] and len(res["full"]) == 4, res
