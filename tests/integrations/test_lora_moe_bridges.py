"""LoRA on GLM-4.5, Qwen2-MoE, gpt-oss, ERNIE 4.5 MoE, OLMoE and Llama 4 against PEFT and TRL.

- GLM-4.5 (``Glm4MoeForCausalLM``: grouped-query attention with q/k/v biases and half-rotary heads, DeepSeek-V3's
  routing, shared experts, a dense first layer): PEFT adapts q/k/v/o as plain linears (q/k/v slots of megatron's
  fused ``linear_qkv``, biases untouched) and, through its rewrite on transformers 5, the routed expert stacks and the
  router as parameters; the shared experts and the dense first layer's MLP then carry none, in PEFT as here.
- Qwen2-MoE (``Qwen2MoeForCausalLM``): PEFT's ``"all-linear"`` adapts the attention, the shared expert's linears and
  its ``shared_expert_gate`` (an ``nn.Linear(H, 1)``; megatron's raw ``gate_weight``, adapted by ``lora/experts.py``),
  the dense first layer's MLP, and not the routed experts (3-D parameters PEFT does not rewrite for this model).
- gpt-oss (``GptOssForCausalLM``): ``"all-linear"`` on its attention plus ``target_parameters`` on the expert stacks
  (``[E, in, out]`` in transformers, gate and up in alternating columns; biases and the clamped GLU in the forward)
  and the router, as PEFT's ``ParamWrapper`` adapts them.
- ERNIE 4.5 MoE (``Ernie4_5_MoeForCausalLM``): ``"all-linear"`` (attention, dense layers, shared experts) plus
  ``target_parameters`` on the expert stacks and the fp32 router, whose routing adds a fixed expert bias.
- OLMoE (``OlmoeForCausalLM``): q/k/v/o adapted in front of its q / k norms over all heads (split over TP with the
  heads); ``"all-linear"``, through PEFT's rewrite on transformers 5 (as GLM-4.5's), adapts the attention, the
  routed expert stacks and the router.
- Llama 4 (``Llama4ForCausalLM``): ``"all-linear"`` without the router (attention, the dense layers' MLPs, the shared
  experts) plus ``target_parameters`` on the expert stacks (``[E, in, out]``, which PEFT reads as ``[E, out, in]``:
  its A on the stacks' output side) and the router's weight, whose top-1 sigmoid score scales the expert's input;
  DoRA on the same linears.
  The router as a module (PEFT's ``"all-linear"`` picks it: an ``nn.Linear`` returning scores and logits, on which
  PEFT's forward fails) is refused, naming the way out.

Checks (``_lora_moe.moe_model_checks`` against ``peft.get_peft_model``, the same initial values): the attention
projections with a norm in ``modules_to_save`` (at TP1 and TP2 + SP), and ``"all-linear"``, at TP1, TP2 + SP with the
experts whole (expert_tensor_parallel_size=1), EP2 over a data-parallel pair, PP2 and CP2 x EP2: logits 1e-4 (1e-5
with expert or router adapters), loss 1e-5, every attention / shared-expert adapter's gradient of layers 1-2 and the
expert / router / shared-gate adapters' of layer 1 (1e-5), PEFT's counts, megatron's DDP buffers, the adapter folder
in PEFT and the merged export in transformers, a PEFT-written adapter (random factors) loaded with PEFT's logits and
loss. LoongSFTTrainer with ``"all-linear"`` over chat messages against trl.SFTTrainer + PEFT (every logged loss 1e-4
relative, TRL's token metrics) at TP1 and TP2 + SP + EP2. Qwen2-MoE with ``lora_dropout`` at TP2 + SP: the replicated
factors (the shared gate's A and B among them, summed over the token shards as megatron sums them) get equal gradients
on both TP ranks. An "all-linear" Qwen2-MoE run at TP2 + SP + EP2 resumed from its step-2 checkpoint logs the
uninterrupted run's losses exactly.
"""

from __future__ import annotations

import pytest

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing import make_tiny_checkpoint

from ._lora_load import write_peft_adapter
from ._lora_mla import SFT_SCENARIOS
from ._lora_moe import moe_model_checks
from .test_lora_moe import _assert_model_matches_peft

ATTENTION = dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], init_lora_weights=False,
                 modules_to_save=["post_attention_layernorm"])
ALL_LINEAR = dict(r=2, lora_alpha=6, target_modules="all-linear", init_lora_weights=False)
# model -> {case: (LoraConfig kwargs, whether it adapts routed experts / the router)}
# NOTE: gpt-oss: PEFT's "all-linear" adapts its attention only; the experts' stacks ([E, in, out], gate / up
# alternating, with biases and the clamped GLU) and the router as target_parameters (the OpenAI cookbook's recipe)
GPT_OSS_PARAMS = dict(ALL_LINEAR, target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj",
                                                     "mlp.router.weight"])
# NOTE: ERNIE 4.5 MoE: "all-linear" (attention, the dense layers' and the shared experts' linears) plus the expert
# stacks and the fp32 router (routed on softmax + its fixed expert bias) as target_parameters
ERNIE_PARAMS = dict(ALL_LINEAR, target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj",
                                                   "mlp.gate.weight"])
# NOTE: Llama 4: "all-linear" less the router (an nn.Linear returning scores and logits: PEFT's LoRA layer fails on
# it), plus the expert stacks and the router's weight as target_parameters
LLAMA4_PARAMS = dict(ALL_LINEAR, exclude_modules=["router"], target_parameters=[
    "feed_forward.experts.gate_up_proj", "feed_forward.experts.down_proj", "feed_forward.router.weight"])
# DoRA on the same linears (PEFT refuses it on parameter targets)
LLAMA4_DORA = dict(ALL_LINEAR, exclude_modules=["router"], use_dora=True)
MODELS = {"glm4_moe": {"attention": (ATTENTION, False), "all_linear": (ALL_LINEAR, True)},
          "qwen2_moe": {"attention": (ATTENTION, False), "all_linear": (ALL_LINEAR, False)},
          "gpt_oss": {"all_linear_experts": (GPT_OSS_PARAMS, True)},
          "ernie4_5_moe": {"all_linear_experts": (ERNIE_PARAMS, True)},
          "olmoe": {"attention": (ATTENTION, False), "all_linear": (ALL_LINEAR, True)},
          "llama4": {"all_linear_experts": (LLAMA4_PARAMS, True), "dora": (LLAMA4_DORA, False)}}
CASES = [(m, c) for m, cases in MODELS.items() for c in cases]
LAYOUTS = {"tp1": (1, {}),
           "tp2_sp_etp1": (2, {"tensor_parallel_size": 2, "sequence_parallel": True, "expert_tensor_parallel_size": 1}),
           "ep2_dp2": (2, {"expert_parallel_size": 2}), "pp2": (2, {"pipeline_parallel_size": 2}),
           "cp2_ep2": (2, {"context_parallel_size": 2, "expert_parallel_size": 2})}
# NOTE: the attention-only cases (a subset of their model's all-linear one) at TP1 and TP2 + SP only (CI time)
RUNS = [(layout, model, case) for layout in LAYOUTS for model, case in CASES
        if case != "attention" or layout in ("tp1", "tp2_sp_etp1")]
# NOTE: Llama 4's SFT LoRA as its model check's; no balancing loss (the reference's TRL 1.16 cannot compute one for
# Llama 4, whose transformers model adds none: test_sft.py)
SFT_BY_MODEL = {"llama4": {"lora_all_linear": (SFT_SCENARIOS["lora_all_linear"][0], {
    **SFT_SCENARIOS["lora_all_linear"][1], "router_aux_loss_coef": 0.0}, {
    **SFT_SCENARIOS["lora_all_linear"][2], **{k: LLAMA4_PARAMS[k] for k in ("exclude_modules", "target_parameters")}})}}
SFT_LAYOUT = {"tensor_parallel_size": 2, "sequence_parallel": True, "expert_tensor_parallel_size": 1,
              "expert_parallel_size": 2}


def _world(folders: dict, adapters: dict, out_dir: str, layouts: list[str]) -> dict:
    from ._lora_checks import dropout_keeps_replicas_in_step
    from ._sft_parity import run_loong, run_trl

    out = {f"{layout}/{model}/{case}": moe_model_checks(folders[model], f"{out_dir}/{layout}-{model}-{case}",
                                                        LAYOUTS[layout][1], adapters[(model, case)],
                                                        MODELS[model][case][0])
           for layout, model, case in RUNS if layout in layouts}
    names = list(SFT_SCENARIOS)
    for model, folder in folders.items():
        scenarios = SFT_BY_MODEL.get(model, SFT_SCENARIOS)
        if layouts == ["tp1"]:
            out[f"trl/{model}"] = run_trl(folder, f"{out_dir}/trl-{model}", names, scenarios)
            out[f"sft/{model}"] = run_loong(folder, f"{out_dir}/sft-{model}", {}, names, scenarios)
        else:
            out[f"sft/{model}"] = run_loong(folder, f"{out_dir}/sft-{model}", SFT_LAYOUT, names, scenarios)
    if layouts != ["tp1"]:
        from ._sft_parity import resume_matches_uninterrupted

        out["dropout"] = dropout_keeps_replicas_in_step(folders["qwen2_moe"], LAYOUTS["tp2_sp_etp1"][1])
        # NOTE: a checkpoint holding the shared-expert gate's adapter (megatron dist-checkpointing) resumes exactly
        out["resume"] = resume_matches_uninterrupted(folders["qwen2_moe"], out_dir + "/resume", SFT_LAYOUT,
                                                     dict(r=4, lora_alpha=8, target_modules="all-linear"))
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    base = tmp_path_factory.mktemp("lora-moe-bridges")
    folders = {model: str(make_tiny_checkpoint(base / model, model)) for model in MODELS}
    adapters = {}
    for model, case in CASES:
        adapters[(model, case)] = str(base / f"{model}-{case}-peft-adapter")
        write_peft_adapter(folders[model], adapters[(model, case)], MODELS[model][case][0])
    one = run_distributed(_world, 1, folders, adapters, str(base / "one"), ["tp1"], timeout=600)
    two = run_distributed(_world, 2, folders, adapters, str(base / "two"), [n for n in LAYOUTS if n != "tp1"],
                          timeout=1200)
    return one, two


@pytest.mark.parametrize("layout, model, case", RUNS, ids=["-".join(run) for run in RUNS])
def test_matches_peft(results, layout, model, case):
    one, two = results
    ranks = one if layout == "tp1" else two
    _assert_model_matches_peft([r[f"{layout}/{model}/{case}"] for r in ranks], experts=MODELS[model][case][1])


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("name", list(SFT_SCENARIOS))
def test_sft_matches_trl(results, name, model):
    from ._sft_parity import assert_matches

    one, two = results
    scenarios = SFT_BY_MODEL.get(model, SFT_SCENARIOS)
    ref = one[0][f"trl/{model}"][name]
    assert_matches(name, ref, one[0][f"sft/{model}"][name], scenarios)
    for rank in two:
        assert rank[f"sft/{model}"][name]["losses"] == two[0][f"sft/{model}"][name]["losses"]
    assert_matches(name, ref, two[0][f"sft/{model}"][name], scenarios)


def test_shared_gate_dropout_keeps_tp_replicas_in_step(results):
    names = results[1][0]["dropout"]
    assert any(n.endswith("shared_expert_gate.A") for n in names) and \
        any(n.endswith("shared_expert_gate.B") for n in names), names


def test_shared_gate_lora_resume_matches_uninterrupted_run(results):
    """Qwen2-MoE, "all-linear" (the shared expert's gate included) at TP2 + SP + EP2: resumed from the step-2
    checkpoint, steps 3-4 log the uninterrupted run's losses exactly."""
    for rank in results[1]:
        res = rank["resume"]
        assert res["resumed"] == res["full"] and len(res["full"]) == 4, res


def test_dora_on_the_shared_expert_gate_refused_naming_the_way_out(tmp_path):
    """Qwen2-MoE: "all-linear" DoRA names the shared_expert_gate (megatron's raw gate weight): refused with a
    message; excluding the gate, the rest plans."""
    import peft
    import transformers

    from loongforge_hf.bridges import get_bridge
    from loongforge_hf.lora.plan import LoraConfigError, plan_lora

    folder = make_tiny_checkpoint(tmp_path / "qwen2_moe", "qwen2_moe", tokenizer=False)
    bridge = get_bridge(transformers.AutoConfig.from_pretrained(folder))
    with pytest.raises(LoraConfigError, match=r"use_dora=True on shared_expert_gate .*exclude_modules"):
        plan_lora(bridge, peft.LoraConfig(r=2, target_modules="all-linear", use_dora=True))
    plan = plan_lora(bridge, peft.LoraConfig(r=2, target_modules="all-linear", use_dora=True,
                                             exclude_modules=["shared_expert_gate"]))
    assert plan.targets and not any(t.kind == "shared_gate" for t in plan.targets)


def test_llama4_router_as_a_module_refused_naming_the_way_out(tmp_path):
    """Llama 4: PEFT's "all-linear" (or "router" by name) wraps Llama4Router, an nn.Linear returning routing scores
    and logits, and PEFT's forward then fails: refused, naming target_parameters and exclude_modules; done so, the
    plan holds the attention, dense-MLP and shared-expert linears and the experts / router as parameters."""
    import peft
    import transformers

    from loongforge_hf.bridges import get_bridge
    from loongforge_hf.lora.plan import LoraConfigError, plan_lora

    folder = make_tiny_checkpoint(tmp_path / "llama4", "llama4", tokenizer=False)
    bridge = get_bridge(transformers.AutoConfig.from_pretrained(folder))
    message = r"layers.1.feed_forward.router.*Llama4Router.*target_parameters=\['feed_forward.router.weight'\].*" \
        r"exclude_modules=\['router'\]"
    for targets in ("all-linear", ["q_proj", "router"]):
        with pytest.raises(LoraConfigError, match=message):
            plan_lora(bridge, peft.LoraConfig(r=2, target_modules=targets))
    plan = plan_lora(bridge, peft.LoraConfig(**{**LLAMA4_PARAMS, "init_lora_weights": True}))
    modules = {t.hf_module.split(".layers.")[1].split(".", 1)[1] for t in plan.targets}
    assert modules == {f"self_attn.{p}_proj" for p in "qkvo"} | {f"feed_forward.{p}_proj" for p in
                                                                 ("gate", "up", "down")} | \
        {f"feed_forward.shared_expert.{p}_proj" for p in ("gate", "up", "down")} | \
        {"feed_forward.experts", "feed_forward.experts.base_layer", "feed_forward.router"}, modules
    assert {t.layer for t in plan.targets if t.kind in ("experts", "router")} == {1, 3}
    assert all(t.factors_swapped for t in plan.targets if t.kind == "experts")
