"""LoRA on GLM-4.5 (``Glm4MoeForCausalLM``: grouped-query attention with q/k/v biases and half-rotary heads,
DeepSeek-V3's routing, shared experts, a dense first layer) against PEFT and TRL.

PEFT adapts q/k/v/o as plain linears (q/k/v slots of megatron's fused ``linear_qkv`` here, biases untouched) and,
through its rewrite on transformers 5, the routed expert stacks and the router as parameters; the shared experts and
the dense first layer's MLP then carry none, in PEFT as here.

- ``_lora_moe.moe_model_checks`` against ``peft.get_peft_model`` (the same initial values): the attention projections
  with a norm in ``modules_to_save``, and ``"all-linear"`` (attention, routed experts, router), at TP1, TP2 + SP with
  the experts whole (expert_tensor_parallel_size=1), EP2 over a data-parallel pair, PP2 and CP2 x EP2: logits 1e-4
  (1e-5 with expert or router adapters), loss 1e-5, every attention adapter's gradient of layers 1-2 and the expert
  / router adapters' (1e-5), PEFT's counts, megatron's DDP buffers, the adapter folder in PEFT and the merged export
  in transformers, a PEFT-written adapter (random factors) loaded with PEFT's logits and loss.
- LoongSFTTrainer with ``"all-linear"`` over chat messages against trl.SFTTrainer + PEFT (every logged loss 1e-4
  relative, TRL's token metrics) at TP1 and TP2 + SP + EP2.
"""

from __future__ import annotations

import pytest

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing import make_tiny_checkpoint

from ._lora_load import write_peft_adapter
from ._lora_mla import SFT_SCENARIOS
from ._lora_moe import moe_model_checks
from .test_lora_moe import _assert_model_matches_peft

LORA_KW = {"attention": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                             init_lora_weights=False, modules_to_save=["post_attention_layernorm"]),
           "all_linear": dict(r=2, lora_alpha=6, target_modules="all-linear", init_lora_weights=False)}
LAYOUTS = {"tp1": (1, {}),
           "tp2_sp_etp1": (2, {"tensor_parallel_size": 2, "sequence_parallel": True, "expert_tensor_parallel_size": 1}),
           "ep2_dp2": (2, {"expert_parallel_size": 2}), "pp2": (2, {"pipeline_parallel_size": 2}),
           "cp2_ep2": (2, {"context_parallel_size": 2, "expert_parallel_size": 2})}
SFT_LAYOUT = {"tensor_parallel_size": 2, "sequence_parallel": True, "expert_tensor_parallel_size": 1,
              "expert_parallel_size": 2}


def _world(folder: str, adapters: dict, out_dir: str, layouts: list[str]) -> dict:
    from ._sft_parity import run_loong, run_trl

    out = {f"{layout}/{case}": moe_model_checks(folder, f"{out_dir}/{layout}-{case}", LAYOUTS[layout][1],
                                                adapters[case], kw)
           for layout in layouts for case, kw in LORA_KW.items()}
    names = list(SFT_SCENARIOS)
    if layouts == ["tp1"]:
        out["trl"] = run_trl(folder, out_dir + "/trl", names, SFT_SCENARIOS)
        out["sft"] = run_loong(folder, out_dir + "/sft", {}, names, SFT_SCENARIOS)
    else:
        out["sft"] = run_loong(folder, out_dir + "/sft", SFT_LAYOUT, names, SFT_SCENARIOS)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    base = tmp_path_factory.mktemp("lora-glm4-moe")
    folder = str(make_tiny_checkpoint(base / "src", "glm4_moe"))
    adapters = {}
    for case, kw in LORA_KW.items():
        adapters[case] = str(base / f"{case}-peft-adapter")
        write_peft_adapter(folder, adapters[case], kw)
    one = run_distributed(_world, 1, folder, adapters, str(base / "one"), ["tp1"], timeout=500)
    two = run_distributed(_world, 2, folder, adapters, str(base / "two"), [n for n in LAYOUTS if n != "tp1"],
                          timeout=900)
    return one, two


@pytest.mark.parametrize("case", list(LORA_KW))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_matches_peft(results, layout, case):
    one, two = results
    ranks = one if layout == "tp1" else two
    _assert_model_matches_peft([r[f"{layout}/{case}"] for r in ranks], experts=case == "all_linear")


@pytest.mark.parametrize("name", list(SFT_SCENARIOS))
def test_sft_matches_trl(results, name):
    from ._sft_parity import assert_matches

    one, two = results
    ref = one[0]["trl"][name]
    assert_matches(name, ref, one[0]["sft"][name], SFT_SCENARIOS)
    for rank in two:
        assert rank["sft"][name]["losses"] == two[0]["sft"][name]["losses"]
    assert_matches(name, ref, two[0]["sft"][name], SFT_SCENARIOS)
