"""Rank functions for test_qwen3_vl_moe_lora.py: LoRA on Qwen3-VL-MoE (attention, the dense layer's MLP, the tower,
and PEFT's ``target_parameters`` on the routed expert stacks and the router) against PEFT on transformers'
``Qwen3VLMoeForConditionalGeneration``."""

from __future__ import annotations

import json

import torch
import torch.distributed as dist

from ._vl_lora import model_checks, save_naming_base
from ._vl_parity import make_batch

EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
# init_lora_weights=False keeps B random, so every adapter changes the logits
CONFIGS = {
    # the language model's attention and its dense layer's MLP (layer 1) as modules, the routed experts' stacks as
    # parameters (no PEFT rewrite for this model: gate_proj / up_proj / down_proj name the dense MLP's linears only)
    "attention_mlp_experts": dict(r=4, lora_alpha=8, init_lora_weights=False, target_parameters=EXPERTS,
                                  target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                  "down_proj"]),
    # every linear (the tower's too; scaling 1, as _vl_lora.CONFIGS["all_linear"] says why), the experts and the
    # router (rsLoRA), the language norms trained whole
    "all_linear_experts_router": dict(r=4, lora_alpha=2, use_rslora=True, init_lora_weights=False,
                                      target_modules="all-linear", target_parameters=[*EXPERTS, "mlp.gate.weight"],
                                      modules_to_save=["post_attention_layernorm"]),
}
# layout name -> (the checkpoint's experts in the hub's transposed layout, from_pretrained keywords, world size)
LAYOUTS = {
    "tp1": (False, {}, 1),
    "tp1_hub_layout": (True, {}, 1),
    "ep2_hub_layout": (True, {"expert_parallel_size": 2}, 2),
    "tp2_sp_etp1": (False, {"tensor_parallel_size": 2, "sequence_parallel": True, "expert_tensor_parallel_size": 1},
                    2),
    "pp2_hub_layout": (True, {"pipeline_parallel_size": 2}, 2),
}
STACKS = "model.language_model.layers.{layer}.mlp.experts.{name}"


def _written_stacks(folder: str) -> dict[str, tuple[int, ...]]:
    """Shapes of layer 0's expert stacks in a checkpoint folder."""
    from loongforge_hf.testing.round_trip import read_all

    tensors = read_all(folder)
    return {n: tuple(tensors[STACKS.format(layer=0, name=n)].shape) for n in ("gate_up_proj", "down_proj")}


def moe_lora_checks(folder: str, out_dir: str, layout: dict, name: str) -> dict:
    """``_vl_lora.model_checks`` (logits, loss, every adapter's gradient, PEFT's counts, the adapter folder in PEFT and
    the merged export in transformers) of ``CONFIGS[name]``; on rank 0 also ``adapter_config.json``'s
    target_parameters against PEFT's, and the merged export's expert stacks against the checkpoint's (its layout)."""
    out = model_checks(folder, out_dir, layout, name, CONFIGS)
    if dist.get_rank() == 0:
        out["target_parameters"] = [sorted(json.load(open(f"{out_dir}/{d}/adapter_config.json"))["target_parameters"])
                                    for d in ("adapter", "peft")]
        out["stacks"] = (_written_stacks(f"{out_dir}/merged"), _written_stacks(folder))
    return out


def peft_written_checks(folder: str, out_dir: str, layout: dict) -> dict:
    """A PEFT-written adapter of ``CONFIGS["all_linear_experts_router"]`` (every factor moved off its initial value)
    loaded here: ``from_pretrained`` of its folder (frozen) against ``PeftModel.from_pretrained``; then
    ``load_adapter(is_trainable=True)``, ``disable_adapter`` and ``merge_and_unload`` against PEFT's (differences of
    logits)."""
    import peft
    import transformers

    import loongforge_hf as lf
    from loongforge_hf.lora import load_adapter

    batch = make_batch(folder, pad_to_multiple_of=4)
    adapter = f"{out_dir}/peft-written"
    if dist.get_rank() == 0:
        hf = transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
        transformers.set_seed(1)
        model = peft.get_peft_model(hf, peft.LoraConfig(**CONFIGS["all_linear_experts_router"]))
        g = torch.Generator().manual_seed(8)
        with torch.no_grad():
            for p in model.parameters():
                if p.requires_grad:
                    p.add_(0.05 * torch.randn(p.shape, generator=g))
        save_naming_base(model, adapter, folder)
    dist.barrier()
    with torch.no_grad():
        ref = peft.PeftModel.from_pretrained(
            transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32), adapter)
        expected = ref(**batch).logits
        with ref.disable_adapter():
            expected_base = ref(**batch).logits
        frozen = lf.AutoModelForImageTextToText.from_pretrained(adapter, dtype=torch.float32, **layout)
        out = {"class": type(frozen).__name__, "trainable": sum(p.requires_grad for p in frozen.parameters()),
               "adapter_effect": float((expected - expected_base).abs().max()),
               "logits_diff": float((frozen(**batch).logits - expected).abs().max())}
        del frozen
        model = load_adapter(lf.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32, **layout),
                             adapter, is_trainable=True)
        out["counts"], out["peft_counts"] = model.get_nb_trainable_parameters(), ref.get_nb_trainable_parameters()
        with model.disable_adapter():
            out["disabled_diff"] = float((model(**batch).logits - expected_base).abs().max())
        merged = model.merge_and_unload()
        out["merged_class"] = type(merged).__name__
        out["merged_diff"] = float((merged(**batch).logits - expected).abs().max())
    return out


def refusals(folder: str) -> dict:
    """What LoRA on the image-text MoE model refuses at TP2 + SP (the messages), the model unchanged after each: the
    routed experts with expert_tensor_parallel_size left at TP's 2, a tower parameter in target_parameters."""
    import peft

    import loongforge_hf as lf
    from loongforge_hf.lora import LoraConfigError, get_peft_model

    model = lf.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32, tensor_parallel_size=2,
                                                           sequence_parallel=True)
    out = {}
    for name, kw in {"experts_split": CONFIGS["attention_mlp_experts"],
                     "tower_parameter": dict(target_modules=["q_proj"], target_parameters=["attn.qkv.weight"])}.items():
        try:
            get_peft_model(model, peft.LoraConfig(**kw))
            out[name] = "not refused"
        except LoraConfigError as err:
            out[name] = str(err)
        out[f"{name}_untouched"] = type(model).__name__ == "LoongModelForImageTextToText" and all(
            p.requires_grad for p in model.parameters()) and not any("lora" in n for n, _ in model.named_parameters())
    return out


def world_checks(folders: dict, out_dir: str, layouts: list[str], peft_written: list[str]) -> dict:
    """``moe_lora_checks`` of every config in each of ``layouts`` (``folders``: hub layout -> checkpoint),
    ``peft_written_checks`` in each of ``peft_written``; on two ranks the refusals."""
    out = {f"{layout}/{name}": moe_lora_checks(folders[LAYOUTS[layout][0]], f"{out_dir}/{layout}-{name}",
                                               LAYOUTS[layout][1], name)
           for layout in layouts for name in CONFIGS}
    out.update({f"{layout}/peft_written": peft_written_checks(folders[LAYOUTS[layout][0]], f"{out_dir}/{layout}",
                                                              LAYOUTS[layout][1]) for layout in peft_written})
    if dist.get_world_size() == 2:
        out["refused"] = refusals(folders[False])
    return out
