"""LoRA on Qwen3-VL-MoE (``lf.AutoModelForImageTextToText`` + ``loongforge_hf.lora.get_peft_model``) against PEFT on
transformers' ``Qwen3VLMoeForConditionalGeneration``, the routed experts adapted through PEFT's ``target_parameters``
(``mlp.experts.gate_up_proj`` / ``mlp.experts.down_proj``; PEFT has no config rewrite for this model).

- The language model's attention and its dense layer's MLP as modules with both expert stacks; "all-linear" (the
  tower's linears too) with the stacks and the router (``mlp.gate.weight``), rsLoRA, the language norms trained
  whole. The same seed on both sides (init_lora_weights=False: random B): logits and loss within 1e-5 (fp32), every
  adapter's gradient within 2e-5 of its largest entry (the tower's, the language model's as each TP rank holds them,
  the routers' and each expert-parallel rank's experts' of every MoE layer), PEFT's parameter counts,
  ``adapter_config.json``'s ``target_modules`` and ``target_parameters`` as PEFT writes them, the adapter folder in
  ``PeftModel.from_pretrained`` and the merged export in transformers with our logits (1e-5), the merged export's
  expert stacks in the checkpoint's layout, the model unchanged by the merged export.
- The experts in both on-disk layouts: transformers 5's ``[E, 2I, H]`` / ``[E, H, I]`` stacks and the hub's
  transposed ones (transformers' module holds ``[E, 2I, H]`` either way, so PEFT's adapters and ours have the same
  shapes and names); at TP1 (both layouts), EP2 (hub layout), TP2 + SP with the experts whole
  (expert_tensor_parallel_size=1) and PP2 (hub layout; logits, loss and exports only).
- A PEFT-written adapter (attention, tower, experts, router; every factor moved) loaded at TP1, EP2 and TP2 + SP:
  ``from_pretrained`` of its folder (frozen) with PEFT's logits, ``load_adapter(is_trainable=True)`` with PEFT's
  counts, ``disable_adapter`` the base model's logits, ``merge_and_unload`` PEFT's merged logits (1e-5).
- Refused with messages, nothing changed: the routed experts split over expert-tensor parallelism (TP2 + SP with
  expert_tensor_parallel_size left at 2), a tower parameter in ``target_parameters``.
"""

from __future__ import annotations

import pytest

from loongforge_hf.parallel.spawn import run_distributed
from loongforge_hf.testing.tiny_vl import make_tiny_qwen3_vl_moe

from ._vl_moe_lora import CONFIGS, LAYOUTS, world_checks

# tiny_vl: 4 decoder layers, layer 1 dense (mlp_only_layers); ViT depth 3 with 2 DeepStack mergers
LANGUAGE_TARGETS = 4 * 4 + 3            # q/k/v/o of every layer, the dense layer's gate/up/down
TOWER_TARGETS = 3 * 4 + 2 + 2 * 2       # ViT blocks x (qkv, attn.proj, linear_fc1, linear_fc2), the mergers'
# MoE layers x parameter targets x (A, B)
PARAM_FACTORS = {"attention_mlp_experts": 3 * 2 * 2, "all_linear_experts_router": 3 * 3 * 2}
ONE_RANK = [n for n, (_, _, world) in LAYOUTS.items() if world == 1]
TWO_RANKS = [n for n, (_, _, world) in LAYOUTS.items() if world == 2]
PEFT_WRITTEN = ["tp1", "ep2_hub_layout", "tp2_sp_etp1"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("vl3-moe-lora")
    return {hub: str(make_tiny_qwen3_vl_moe(base / f"hub{int(hub)}", hub_expert_layout=hub)) for hub in (False, True)}


@pytest.fixture(scope="module")
def results(folders, tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("vl3-moe-lora-out")
    one = run_distributed(world_checks, 1, folders, str(base / "one"), ONE_RANK,
                          [n for n in PEFT_WRITTEN if n in ONE_RANK], timeout=400)
    two = run_distributed(world_checks, 2, folders, str(base / "two"), TWO_RANKS,
                          [n for n in PEFT_WRITTEN if n in TWO_RANKS], timeout=500)
    return {"one": one, "two": two}


def _ranks(results, layout):
    return results["one" if LAYOUTS[layout][2] == 1 else "two"]


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_matches_peft(results, layout, name):
    ranks = [r[f"{layout}/{name}"] for r in _ranks(results, layout)]
    for res in ranks:
        assert tuple(res["counts"]) == tuple(res["peft_counts"]), res
        assert res["logits_diff"] < 1e-5 and res["loss_diff"] < 1e-5, res
        assert res["unchanged_after_merged_export"], res
        if LAYOUTS[layout][1].get("pipeline_parallel_size", 1) == 1:
            assert res["grads_checked"] == {
                "vision": TOWER_TARGETS if name == "all_linear_experts_router" else 0,
                "language": LANGUAGE_TARGETS, "params": PARAM_FACTORS[name]}, res["grads_checked"]
        else:
            assert "grads_checked" not in res
    rank0 = ranks[0]
    assert rank0["adapter_logits_diff"] < 1e-5 and rank0["merged_logits_diff"] < 1e-5, rank0
    ours, theirs = rank0["target_modules"]
    assert sorted(ours) == sorted(theirs), (ours, theirs)
    ours, theirs = rank0["target_parameters"]
    assert ours == theirs == sorted(CONFIGS[name]["target_parameters"]), (ours, theirs)
    merged, read = rank0["stacks"]
    assert merged == read, (merged, read)   # NOTE: the merged export keeps the layout read
    hub = LAYOUTS[layout][0]
    assert read["gate_up_proj"] == ((4, 64, 96) if hub else (4, 96, 64)), read


@pytest.mark.parametrize("layout", PEFT_WRITTEN)
def test_peft_written_adapter(results, layout):
    for rank in _ranks(results, layout):
        res = rank[f"{layout}/peft_written"]
        assert res["class"] == "LoongLoraModelForImageTextToText" and res["trainable"] == 0, res
        assert res["merged_class"] == "LoongModelForImageTextToText", res
        assert tuple(res["counts"]) == tuple(res["peft_counts"]), res
        assert res["adapter_effect"] > 1e-2, res
        assert max(res["logits_diff"], res["disabled_diff"], res["merged_diff"]) < 1e-5, res


def test_refused_with_messages(results):
    for rank in results["two"]:
        refused = rank["refused"]
        assert "expert_tensor_parallel_size=1" in refused["experts_split"], refused
        assert "Qwen3VLMoeForConditionalGeneration" in refused["tower_parameter"] and \
            "model.visual.blocks.0.attn.qkv.weight" in refused["tower_parameter"], refused
        assert refused["experts_split_untouched"] and refused["tower_parameter_untouched"], refused
