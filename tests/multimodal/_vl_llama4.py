"""Rank functions for tests/multimodal/test_llama4_vl.py (module-level so spawned ranks can import them) and the
transformers reference they are compared with: hand-built Llama 4 batches (each picture's tiles and global view laid
out as ``Llama4Processor`` lays them: ``tiny_llama4_vl.llama4_image_prompt``), random 24x24 tiles.

NOTE: transformers 5.24's ``Llama4ForConditionalGeneration.forward`` reads ``image_outputs`` off its language model's
output, a ``MoeCausalLMOutputWithPast``, which has no such field, and raises AttributeError on every call (generate
included); importing this module gives that output class the attribute (None), in the test processes only. Every
number transformers computes stays its own.
"""

from __future__ import annotations

import torch
from transformers.modeling_outputs import MoeCausalLMOutputWithPast

from loongforge_hf.testing.tiny_llama4_vl import PATCH, llama4_image_prompt

if not hasattr(MoeCausalLMOutputWithPast, "image_outputs"):
    MoeCausalLMOutputWithPast.image_outputs = None

# two rows of 40 tokens: a picture of 2x1 tiles and its global view (3 tiles), a picture of one tile (its global view
# alone); the first row padded by one token
ROWS = [[5, 6, (2, 1), 7, 8, 9, 10, 11, 0], [12, (1, 1)] + list(range(13, 40))]
TEXT_ROWS = [list(range(5, 25)), list(range(30, 50))]


def make_batch(rows=ROWS, *, seed: int = 1) -> dict:
    """input_ids, attention_mask (0 on the pad id 0), labels (-100 there and on ``<|patch|>``), pixel_values
    ``[tiles, 3, 24, 24]``."""
    batch = llama4_image_prompt(rows, seed=seed)
    ids = batch["input_ids"]
    mask = (ids != 0).long()  # NOTE: id 0 is the pad token; the rows' text ids start at 5
    return {**batch, "attention_mask": mask, "labels": ids.masked_fill((mask == 0) | (ids == PATCH), -100)}


def prompts() -> dict:
    """A left-padded prompt batch: a row with a 2x1-tiled picture, a row with a one-tile picture."""
    batch = llama4_image_prompt([[5, (2, 1), 6], [0] * 19 + [7, (1, 1), 8, 9]], seed=4)
    return {**batch, "attention_mask": (batch["input_ids"] != 0).long()}


def compare(folder: str, layout: dict, out_dir: str | None = None, *, batch: dict | None = None,
            auto_class: str = "AutoModelForImageTextToText") -> dict:
    """``_vl_gemma3.compare`` on this file's batches."""
    from ._vl_gemma3 import compare as compare_with

    return compare_with(folder, layout, out_dir, batch=batch, batch_for=make_batch, auto_class=auto_class)


def reloaded_diff(folder: str, exported: str) -> float:
    """transformers' logits on ``make_batch()`` from the export against those from the source folder."""
    import transformers

    batch = make_batch()
    with torch.no_grad():
        want, got = (transformers.AutoModelForImageTextToText.from_pretrained(f, dtype=torch.float32)(**batch).logits
                     for f in (folder, exported))
    return (got - want).abs().max().item()


def world(cases: list, folder: str, generate: dict, exported: str | None = None, lora_dir: str | None = None,
          lora_layouts: tuple = ("tp1",)) -> dict:
    """``compare`` for each (name, folder, layout, out_dir, extra keywords), greedy ``generate`` against
    transformers' under each of ``generate`` (name -> layout), with ``exported`` ``reloaded_diff`` of it and with
    ``lora_dir`` ``lora_checks`` there in ``lora_layouts``: in one world."""
    from ._vl_gemma3 import SCENARIOS, generate_both

    out = {"parity": {name: compare(f, layout, out_dir, **extra) for name, f, layout, out_dir, extra in cases},
           "generate": {name: generate_both(folder, layout, prompts, {"greedy": SCENARIOS["greedy"]})
                        for name, layout in generate.items()}}
    if exported is not None:
        out["reloaded_diff"] = reloaded_diff(folder, exported)
    if lora_dir is not None:
        out["lora"] = lora_checks(folder, lora_dir, lora_layouts)
    return out


# ---- LoRA against PEFT ---------------------------------------------------------------------------------------------

# PEFT's "all-linear" on every tower (the ViT's attention and MLP, the adapter's fc1 / fc2, the projector; the
# language model's attention, dense MLPs and shared experts), the untied LM head and the final norm trained whole,
# random B. NOTE: two modules left out, as loongforge's refusals ask: the router (an nn.Linear whose forward returns
# a tuple, which PEFT's LoRA layer cannot wrap) and the ViT's patch linear (not a megatron layer)
LORA_CONFIGS = {"all_linear": dict(r=4, lora_alpha=4, target_modules="all-linear", init_lora_weights=False,
                                   exclude_modules=["router", "patch_embedding.linear"],
                                   modules_to_save=["lm_head", "language_model.model.norm"]),
                # PEFT's target_parameters on the routed experts' stacks and the router (as on the text model), with
                # q / v of both towers
                "experts": dict(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False,
                                target_parameters=["feed_forward.experts.gate_up_proj",
                                                   "feed_forward.experts.down_proj", "feed_forward.router.weight"])}
# (vision, language) adapters with gradients; whole tensors in the adapter file; parameter adapters (2 MoE layers x
# gate_up_proj, down_proj, router)
LORA_TARGETS = {"all_linear": (2 * 6 + 2 + 1, 4 * 4 + 4 * 3), "experts": (2 * 2, 4 * 2)}
LORA_SAVED = {"all_linear": 2, "experts": 0}
LORA_PARAMS = {"experts": 2 * 3}


SPLIT_SP = {"tensor_parallel_size": 2, "sequence_parallel": True, "vision_tensor_parallel_size": 2}
# layout name -> (from_pretrained keywords, the LORA_CONFIGS run there). NOTE: LoRA on the routed experts needs them
# whole on each rank (expert_tensor_parallel_size=1 beside TP2; at its default, TP's 2, it is refused: lora_checks)
LORA_LAYOUTS = {"tp1": ({}, tuple(LORA_CONFIGS)),
                "tp2_split_sp": (SPLIT_SP, ("all_linear",)),
                "tp2_split_sp_etp1": ({**SPLIT_SP, "expert_tensor_parallel_size": 1}, ("experts",)),
                "ep2": ({"expert_parallel_size": 2}, ("experts",)),
                "tp2_sp_ep2": ({"tensor_parallel_size": 2, "sequence_parallel": True, "expert_parallel_size": 2,
                                "expert_tensor_parallel_size": 1}, ("experts",))}


def lora_checks(folder: str, out_dir: str, layouts: tuple = ("tp1",)) -> dict:
    """``_vl_lora.model_checks`` (logits, loss, adapter gradients, PEFT's counts, adapter and merged files) of each
    of ``LORA_LAYOUTS[layout]``'s configs in each of ``layouts`` on ``make_batch()``; on two ranks also the experts'
    refusal at TP2 + SP with expert_tensor_parallel_size at its default (the message; whether the model is
    untouched)."""
    import torch.distributed as dist

    from . import _vl_lora as V

    out = {f"{layout}/{name}": V.model_checks(folder, f"{out_dir}/{layout}-{name}", LORA_LAYOUTS[layout][0], name,
                                              LORA_CONFIGS, batch_for=lambda _: make_batch(), grad_tol=5e-5)
           for layout in layouts for name in LORA_LAYOUTS[layout][1]}
    if dist.get_world_size() == 2:
        out["refused"] = experts_refusal(folder)
    return out


def experts_refusal(folder: str) -> tuple[str, bool]:
    """(the error of LoRA on the routed experts at TP2 + SP, expert_tensor_parallel_size left at TP's 2; whether the
    model is untouched after it)."""
    import peft

    import loongforge_hf as lf
    from loongforge_hf.lora import LoraConfigError, get_peft_model

    model = lf.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32, **SPLIT_SP)
    try:
        get_peft_model(model, peft.LoraConfig(**LORA_CONFIGS["experts"]))
        message = "not refused"
    except LoraConfigError as err:
        message = str(err)
    return message, type(model).__name__ == "LoongModelForImageTextToText" and all(
        p.requires_grad for p in model.parameters()) and not any("lora" in n for n, _ in model.named_parameters())
