"""Rank functions for test_qwen3_5_vl.py: the parity worlds (images, videos, packing, text through
``lf.AutoModelForCausalLM``, generate, context parallelism; Qwen3.5-MoE's router outputs; LoRA against PEFT,
``_vl_qwen3_5_lora.py``), each a dict of numbers the tests read."""

import torch

from tests._generation import _plain

from ._vl_features import compare_videos
from ._vl_generate import SCENARIOS, prompt_batch
from ._vl_parity import compare_many, train_both
from ._vl_qwen3 import compare_router_outputs, packed_against_padded
from ._vl_qwen3_5_lora import ONE_RANK as LORA_ONE_RANK, TWO_RANKS as LORA_TWO_RANKS, world_checks as lora_checks

GENERATE = SCENARIOS["greedy"]  # NOTE: scores and raw logits of 6 greedy steps


def generate_reference(folder: str, **extra) -> dict:
    """transformers' greedy generate (its own cache) on the image batch (``extra``: more generate keywords)."""
    import transformers

    model = transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    return _plain(model.generate(**prompt_batch(folder), **GENERATE, **extra))


def generate_ours(folder: str, layout: dict, **extra) -> dict:
    """Ours: greedy with and without the cache (the Gated DeltaNet states in it) on the same batch (``extra``: more
    generate keywords); the static cache's error (None when it runs)."""
    import loongforge_hf as lf

    model = lf.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32, **layout)
    out = {name: _plain(model.generate(**prompt_batch(folder), use_cache=name == "cached", **GENERATE, **extra))
           for name in ("cached", "uncached")}
    try:
        model.generate(**prompt_batch(folder), max_new_tokens=2, cache_implementation="static")
        out["static_refusal"] = None
    except ValueError as err:
        out["static_refusal"] = str(err)
    return out


def generate_cp(folder: str, layout: dict) -> dict:
    """Under context parallelism: greedy without the cache on the same batch, and the cached generate's error (None
    when it runs): the split prefill cannot fill the Gated DeltaNet states."""
    import loongforge_hf as lf

    model = lf.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32, **layout)
    out = {"uncached": _plain(model.generate(**prompt_batch(folder), use_cache=False, **GENERATE))}
    try:
        model.generate(**prompt_batch(folder), max_new_tokens=2)
        out["cached_refusal"] = None
    except ValueError as err:
        out["cached_refusal"] = str(err)
    return out


def causal_lm_text(folder: str) -> dict:
    """``lf.AutoModelForCausalLM`` on the image-text checkpoint against ``transformers.AutoModelForCausalLM`` (its
    text model, ``Qwen3_5ForCausalLM``) on a left-padded text batch: both classes and the logits' difference."""
    import transformers

    import loongforge_hf as lf

    ids = torch.randint(4, 200, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    ours = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        diff = (ours(input_ids=ids, attention_mask=mask).logits - ref(input_ids=ids, attention_mask=mask).logits)
    return {"classes": (type(ours).__name__, type(ref).__name__), "logit_diff": diff.abs()[mask.bool()].max().item()}


def one_rank(cases: list, folder: str, out_dir: str, moe_folder: str) -> dict:
    out = compare_many(cases)
    out["moe_router"] = compare_router_outputs(moe_folder, {})
    out["packed"] = packed_against_padded(folder)
    out["causal_lm"] = causal_lm_text(folder)
    out["generate"] = generate_ours(folder, {})
    # NOTE: without router logits (the checkpoint asks for them): transformers' generate fails computing the
    # balancing loss on its cached steps (a mask longer than the step's tokens)
    out["moe_generate"] = generate_ours(moe_folder, {}, output_router_logits=False)
    out["train"] = train_both(folder, out_dir)
    out["lora"] = lora_checks({"dense": folder, "moe": moe_folder}, f"{out_dir}-lora", LORA_ONE_RANK)
    return out


def two_ranks(cases: list, folder: str, generate_layouts: dict, moe_folder: str) -> dict:
    out = compare_many(cases)
    out["moe_router_ep2"] = compare_router_outputs(moe_folder, {"expert_parallel_size": 2})
    out["videos_tp2_sp"] = compare_videos(folder, {"tensor_parallel_size": 2, "sequence_parallel": True,
                                                   "vision_tensor_parallel_size": 2})
    cp2 = {"context_parallel_size": 2}
    out["videos_cp2"] = compare_videos(folder, cp2)
    out["packed_cp2"] = packed_against_padded(folder, cp2, multiple=4)
    out["generate_cp2"] = generate_cp(folder, cp2)
    out["generate"] = {name: generate_ours(folder, layout) for name, layout in generate_layouts.items()}
    out["lora"] = lora_checks({"dense": folder, "moe": moe_folder}, f"{folder}-lora-two", LORA_TWO_RANKS)
    return out
