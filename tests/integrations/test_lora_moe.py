"""LoRA on the mixture-of-experts models Qwen3-MoE and Mixtral, against PEFT on the transformers model.

PEFT (0.21, on transformers 5) rewrites a LoraConfig for these models: names of expert projections or the router
(``"all-linear"`` names them all) become ``target_parameters`` on the 3-D expert stacks and the router, which are
refused here; the attention projections are adapted as on a dense model, in every layer (MoE or dense).

- Targets: the same modules as ``peft.get_peft_model`` (a regex naming one layer's q_proj adapts every layer's, as
  PEFT's rewrite does), the same initial tensors after the same seed (bit for bit).
- Whole model at TP1 (Qwen3-MoE with a dense first layer, Mixtral), TP2 + sequence parallel + EP2 (experts not split
  over TP), EP2 over a dense data-parallel pair, and PP2 (Qwen3-MoE): logits within 1e-4, loss within 1e-5, adapter
  gradients within 1e-5 of PEFT's (fp32, as test_lora.py); PEFT's parameter counts; megatron's DDP holds only the
  trainable tensors, all in its dense buffers (none in the expert ones); the adapter folder loads in
  ``PeftModel.from_pretrained`` and the merged export (the full MoE checkpoint) in transformers with the Loong
  model's logits (1e-4); a PEFT-written adapter (random B) loads onto the Loong model with PEFT's logits and loss.
- LoongSFTTrainer with a LoraConfig on Qwen3-MoE (with and without the router balancing loss): the logged losses of
  trl.SFTTrainer (1e-4 relative), at TP1 and at TP2 + SP + EP2.
- Refused with messages naming the way out: expert or router targets ("all-linear", down_proj, w1/w3,
  target_parameters), multi-latent attention (DeepSeek-V3).
"""

from __future__ import annotations

import pytest
import torch

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing import make_tiny_checkpoint

from ._lora_moe import SFT_SCENARIOS, TWO_RANK_LAYOUTS, one_rank_checks, two_rank_checks, write_peft_adapters

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
    assert [t.hf_module for t in plan.targets] == adapted
    for t, (a, b) in zip(plan.targets, drawn):
        assert torch.equal(a, params[f"base_model.model.{t.hf_module}.lora_A.default.weight"]), t.hf_module
        assert torch.equal(b, params[f"base_model.model.{t.hf_module}.lora_B.default.weight"]), t.hf_module
        assert t.scaling == pytest.approx(ref.get_submodule(f"base_model.model.{t.hf_module}").scaling["default"])
    assert plan.target_modules == sorted(ref.peft_config["default"].target_modules)


@pytest.mark.parametrize("arch, kw, match", [
    ("qwen3_moe", dict(target_modules="all-linear"), "target_parameters=\\['down_proj', 'gate.weight', 'gate_up_proj'"),
    ("qwen3_moe", dict(target_modules=["q_proj", "down_proj"]), "routed experts or the router"),
    ("qwen3_moe", dict(target_modules=["gate_proj"]), "without also targeting up_proj"),
    ("mixtral", dict(target_modules=["q_proj", "w1", "w3"]), "target_parameters=\\['gate_up_proj'\\]"),
    ("mixtral", dict(target_modules=["q_proj"], target_parameters=["gate_up_proj"]), "target_parameters"),
])
def test_expert_and_router_targets_are_refused(setup, arch, kw, match):
    import peft

    from loongforge_hf.lora import LoraConfigError
    from loongforge_hf.lora.plan import plan_lora

    with pytest.raises(LoraConfigError, match=match) as err:
        plan_lora(_bridge(setup[0][arch]), peft.LoraConfig(**kw))
    if "target_parameters" not in kw:
        assert "'q_proj', 'k_proj', 'v_proj', 'o_proj'" in str(err.value) or "PEFT refuses" in str(err.value)


def test_multi_latent_attention_is_refused(tmp_path):
    import peft

    from loongforge_hf.lora import LoraConfigError
    from loongforge_hf.lora.plan import plan_lora

    folder = make_tiny_checkpoint(tmp_path / "dsv3", "deepseek_v3", tokenizer=False)
    with pytest.raises(LoraConfigError, match="multi-latent attention.*Qwen3-MoE and Mixtral"):
        plan_lora(_bridge(str(folder)), peft.LoraConfig(target_modules=["q_a_proj"]))


@pytest.fixture(scope="module")
def one_rank(setup):
    folders, adapters, base = setup
    return run_distributed(one_rank_checks, 1, folders, str(base / "one"), adapters, timeout=500)[0]


@pytest.fixture(scope="module")
def two_ranks(setup):
    folders, adapters, base = setup
    return run_distributed(two_rank_checks, 2, folders["qwen3_moe"], str(base / "two"), adapters["qwen3_moe"],
                           timeout=600)


def _assert_model_matches_peft(ranks: list[dict]) -> None:
    for res in ranks:
        assert tuple(res["counts"]) == tuple(res["peft_counts"]), res
        assert res["logits_diff"] < 1e-4 and res["loss_diff"] < 1e-5, res
        assert res["ddp_holds_trainable_only"] and res["dense_buffers_hold_all"] and res["expert_buffers_empty"], res
        assert res["dense_group_sizes"] == [res["data_parallel_size"]], res
        assert res["unchanged_after_merged_export"], res
        loaded = res["peft_adapter"]
        assert loaded["class"] == "LoongLoraModelForCausalLM" and loaded["trainable"] == 0, loaded
        assert loaded["logits_diff"] < 1e-4 and loaded["loss_diff"] < 1e-5, loaded
        assert tuple(loaded["counts"]) == tuple(res["peft_counts"]), loaded
    assert ranks[0]["adapter_logits_diff"] < 1e-4 and ranks[0]["merged_logits_diff"] < 1e-4, ranks[0]


@pytest.mark.parametrize("arch", ARCHS)
def test_tp1_matches_peft(one_rank, arch):
    _assert_model_matches_peft([one_rank[arch]])


@pytest.mark.parametrize("layout", list(TWO_RANK_LAYOUTS))
def test_two_ranks_match_peft(two_ranks, layout):
    _assert_model_matches_peft([r[layout] for r in two_ranks])
    if layout == "ep2_dp2":
        assert two_ranks[0][layout]["data_parallel_size"] == 2


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
