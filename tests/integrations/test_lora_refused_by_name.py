"""LoRA refusals that say what is wrong and what can be targeted instead, from the pure planner (no world, before any
model is built): A.X-K2's ``q_b_proj`` (the checkpoint's name of ``q_gate_proj``) and its gated norms'
gates, DeepSeek-V4's grouped ``o_a_proj`` (PEFT's layer fails on it), HY-V4's and the DSA models' indexers (no
gradient reaches them). The ``exclude_modules`` each message suggests with
``'all-linear'`` plans. Parity of LoRA on the accepted modules vs PEFT: test_lora*.py (DeepSeek-V4's and HY-V4's,
A.X-K2's: tests/bridges/test_deepseek_v4.py, test_hy_v4.py)."""

import ast
import re

import peft
import pytest

from loongforge_hf.bridges.registry import get_bridge
from loongforge_hf.lora.plan import LoraConfigError, plan_lora
from loongforge_hf.testing.tiny_models import _config

NAMES = {"axk2": "AXK2ForCausalLM", "deepseek_v4": "DeepseekV4ForCausalLM",
         "hy_v4": "HYV4ForCausalLM"}


def _refusal(arch: str, target_modules) -> str:
    bridge = get_bridge(_config(arch, architectures=[NAMES[arch]]))
    with pytest.raises(LoraConfigError) as err:
        plan_lora(bridge, peft.LoraConfig(r=4, target_modules=target_modules))
    return str(err.value)


def _suggested(arch: str, message: str) -> list[str]:
    """The leaves of the targets planned with the message's ``'all-linear'`` and ``exclude_modules``."""
    excluded = ast.literal_eval(re.search(r"'all-linear' with exclude_modules=(\[[^\]]*\])", message).group(1))
    bridge = get_bridge(_config(arch, architectures=[NAMES[arch]]))
    plan = plan_lora(bridge, peft.LoraConfig(r=4, target_modules="all-linear", exclude_modules=excluded))
    return sorted({t.hf_module.rsplit(".", 1)[-1] for t in plan.targets})


def test_axk2_checkpoint_name_gated_norm_gates_and_indexer_refused_by_name():
    """q_b_proj (the checkpoint's name of transformers' q_gate_proj, which names no module of transformers' tree)
    refused pointing at q_gate_proj; 'all-linear' refused naming the gated norms' gates (fc1 / fc2: W_down / W_up on
    disk) and the DSA indexer's linears; q_gate_proj and o_proj plan (compared with PEFT in
    tests/bridges/test_hy_v4.py)."""
    message = _refusal("axk2", ["q_b_proj"])
    assert message.startswith("target_modules=['q_b_proj'] match no module of AXK2ForCausalLM (q_b_proj: the "
                              "checkpoint's name of A.X-K2's gated query up-projection; transformers' module, which "
                              "PEFT targets, is q_gate_proj); targetable: "), message
    message = _refusal("axk2", "all-linear")
    assert "(fc1, fc2: the gated norms' low-rank gate (W_down / W_up on disk)" in message, message
    assert "weights_proj, wk, wq_b: DeepSeek Sparse Attention's lightning indexer" in message, message
    assert "exclude_modules=['fc1', 'fc2', 'weights_proj', 'wk', 'wq_b']" in message
    assert _suggested("axk2", message) == ["down_proj", "gate_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj",
                                           "q_a_proj", "q_gate_proj", "up_proj"]
    plan = plan_lora(get_bridge(_config("axk2", architectures=[NAMES["axk2"]])),
                     peft.LoraConfig(r=4, target_modules=["q_gate_proj", "o_proj"]))
    assert sorted({(t.hf_module.rsplit(".", 1)[-1], t.kind, t.slot_name) for t in plan.targets}) == [
        ("o_proj", "row", None), ("q_gate_proj", "column", "q_b_proj")]


@pytest.mark.parametrize("arch", ["deepseek_v32", "glm_moe_dsa"])
def test_dsa_indexer_refused_by_name(arch):
    names = {"deepseek_v32": "DeepseekV32ForCausalLM", "glm_moe_dsa": "GlmMoeDsaForCausalLM"}
    bridge = get_bridge(_config(arch, architectures=[names[arch]]))
    with pytest.raises(LoraConfigError) as err:
        plan_lora(bridge, peft.LoraConfig(r=4, target_modules=["wk"]))
    assert "(wk: DeepSeek Sparse Attention's lightning indexer only picks the top-k keys" in str(err.value)


def test_deepseek_v4_grouped_output_projection_refused_by_name():
    """o_a_proj (PEFT's layer fails on transformers' grouped linear) and 'all-linear' refused naming it; the rest of
    the attention's linears (the compressors' and the indexer's too) and the shared experts plan."""
    why = "(o_a_proj: DeepSeek-V4's grouped output projection (DeepseekV4GroupedLinear) maps each head group on its own"
    for target_modules in (["o_a_proj"], "all-linear"):
        message = _refusal("deepseek_v4", target_modules)
        assert why in message and message.endswith("or 'all-linear' with exclude_modules=['o_a_proj']."), message
    assert _suggested("deepseek_v4", message) == ["down_proj", "gate_proj", "kv_proj", "o_b_proj", "q_a_proj",
                                                  "q_b_proj", "up_proj", "weights_proj"]


def test_hy_v4_indexer_refused_by_name():
    message = _refusal("hy_v4", "all-linear")
    assert "(weights_proj, wk, wq_b: HY-V4's lightning indexer only picks the top-k keys" in message, message
    assert _suggested("hy_v4", message) == ["down_proj", "gate_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj",
                                            "q_a_proj", "q_b_proj", "up_proj"]


def test_router_linear_with_dropout_refused():
    """A router that is a plain linear (HunYuan-MoE's gate.wg) is a target, its adapter added to the router's weight:
    lora_dropout, which PEFT applies to the module's input, is refused naming the way out."""
    bridge = get_bridge(_config("hunyuan_v1_moe", architectures=["HunYuanMoEV1ForCausalLM"]))
    plan = plan_lora(bridge, peft.LoraConfig(r=4, target_modules=["wg"]))
    assert {(t.kind, t.name) for t in plan.targets} == {("router", "router")}
    with pytest.raises(LoraConfigError, match=r"lora_dropout=0.1 with LoRA on the router's linear \(\['wg'\]\).*"
                                              r"exclude_modules=\['wg'\]"):
        plan_lora(bridge, peft.LoraConfig(r=4, target_modules=["q_proj", "wg"], lora_dropout=0.1))


@pytest.mark.parametrize("arch, name", [("mamba", "MambaForCausalLM"), ("falcon_mamba", "FalconMambaForCausalLM"),
                                        ("jamba", "JambaForCausalLM")])
def test_mamba_dt_proj_refused_by_name(arch, name):
    """Mamba-1's dt_proj: transformers' mixers read ``dt_proj.weight`` themselves, so PEFT's adapter there changes
    nothing and takes no gradient (checked on transformers' model with a non-zero B: the logits need no gradient,
    the adapter's factors being its only trainable tensors, and are the base model's within 1e-5; Falcon-Mamba's move
    1.4e-6 under PEFT's wrapping); refused naming why, and
    'all-linear' without it plans x_proj (own_weights.py; compared with PEFT in test_lora_new_bridges.py)."""
    import torch
    import transformers

    config = _config(arch, architectures=[name])
    with pytest.raises(LoraConfigError) as err:
        plan_lora(get_bridge(config), peft.LoraConfig(r=4, target_modules="all-linear"))
    assert "(dt_proj: transformers' Mamba mixers read dt_proj.weight themselves" in str(err.value), str(err.value)
    excluded = ast.literal_eval(re.search(r"exclude_modules=(\[[^\]]*\])", str(err.value)).group(1))
    plan = plan_lora(get_bridge(config), peft.LoraConfig(r=4, target_modules="all-linear", exclude_modules=excluded))
    assert excluded == ["dt_proj"] and ("x_proj", "row") in {(t.name, t.kind) for t in plan.targets}

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(3, 200, (1, 8))
    before = model(input_ids=ids).logits
    adapted = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["dt_proj"], init_lora_weights=False))
    logits = adapted(input_ids=ids).logits
    trainable = {n for n, p in adapted.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable) and torch.allclose(logits, before, rtol=0, atol=1e-5)
    assert not logits.requires_grad
