"""Rank functions for test_qwen3_5_vl.py's LoRA checks: Qwen3.5 image-text (and Qwen3.5-MoE's) with
``loongforge_hf.lora.get_peft_model`` against PEFT on transformers' model, the same LoraConfig after the same seed
(init_lora_weights=False: random B, so every adapter moves the logits).

- PEFT's ``"all-linear"``: the tower's linears (ViT ``qkv`` / ``attn.proj`` / ``linear_fc1`` / ``linear_fc2``, the
  merger's), each Gated DeltaNet in-projection (``in_proj_qkv`` / ``z`` / ``b`` / ``a``) in its slot of megatron's
  ``in_proj``, ``out_proj``, the gated ``q_proj`` beside ``k_proj`` / ``v_proj``, ``o_proj``, the MLPs (MoE: the shared
  expert and its gate; PEFT 0.21 names no routed expert nor router here: no config rewrite for this model).
- A language-only regex (the users' other recipe): every language linear, none of the tower's.

Checked per layout (``lora_checks``, as ``_vl_lora.model_checks``): logits and loss, every adapter's A and B gradient
(``adapter_grads``), PEFT's counts, the adapter folder in ``PeftModel.from_pretrained`` and the merged export in
transformers with our logits.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# NOTE: scaling 1 on the tower: _vl_lora.CONFIGS["all_linear"] says why
ALL_LINEAR = dict(r=4, lora_alpha=4, target_modules="all-linear", init_lora_weights=False)
# every language linear (the regex users write to leave the tower whole), rsLoRA
LANGUAGE_REGEX = dict(r=4, lora_alpha=4, use_rslora=True, init_lora_weights=False,
                      target_modules=r".*language_model.*\.(in_proj_\w+|out_proj|[qkvo]_proj|gate_proj|up_proj"
                                     r"|down_proj|shared_expert_gate)")
CONFIGS = {"all_linear": ALL_LINEAR, "language_regex": LANGUAGE_REGEX}


def _relative(got: torch.Tensor | None, want: torch.Tensor | None) -> float:
    if want is None:  # NOTE: the tower's factors on a text-only batch: PEFT's none, ours none or zero
        return 0.0 if got is None or not got.any() else float("inf")
    return float((got - want).abs().max()) / (float(want.abs().max()) or 1.0)


def adapter_grads(model, ref) -> dict[str, float]:
    """PEFT name of each adapter factor (one pipeline stage) -> its gradient's difference from PEFT's, relative to
    PEFT's largest entry: the tower's whole or, split, as this rank holds them; the language model's gathered over TP
    at HF shape, B's rows back in the checkpoint's order (``Target.b_to_hf``: the in_proj slots, the gated q_proj);
    the MoE shared expert's gate whole (summed over the TP ranks under SP)."""
    from megatron.core import parallel_state as ps

    from loongforge_hf.lora.vision import chunk_params, local_factors, tower_split

    from ..integrations._lora_checks import _gather_full, lora_shard_context

    ctx, ours, theirs = lora_shard_context(model), chunk_params(model.chunks[0]), dict(ref.named_parameters())
    rank, world = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    out = {}
    for t in model.lora_plan.targets:
        module = t.megatron_module.format(layer=t.layer)
        a, b = (ours[f"{module}.lora.{t.name}.{f}"].grad for f in "AB")
        want = [theirs[f"base_model.model.{t.hf_module}.lora_{f}.default.weight"].grad for f in "AB"]
        if t.kind == "vision":
            if model.vision_layout == "tensor_parallel":
                want = list(local_factors(tower_split(t), *want, rank, world))
        elif t.kind == "shared_gate":  # NOTE: replicated; under SP each rank's tokens, summed as megatron sums them
            if model.megatron.config.sequence_parallel:
                a, b = a.clone(), b.clone()
                for g in (a, b):
                    dist.all_reduce(g, group=ps.get_tensor_model_parallel_group())
        elif t.kind == "row":
            a = _gather_full(a, 1)
        else:
            b = t.b_to_hf(_gather_full(b, 0), ctx)
        for factor, got, w in zip("AB", (a, b), want):
            out[f"{t.hf_module}.lora_{factor}"] = _relative(got, w)
    return out


def lora_checks(folder: str, out_dir: str, layout: dict, name: str) -> dict:
    """LoRA of ``CONFIGS[name]`` at ``layout`` against PEFT on one image batch (a text-only row in it): {"counts",
    "peft_counts", "logits_diff", "loss_diff", "grads": {factor: relative difference} (one pipeline stage), "targets":
    the adapted HF modules, "unchanged_after_merged_export"; rank 0: "adapter_logits_diff" (the adapter folder in
    PEFT), "merged_logits_diff" (the merged export in transformers), "target_modules" (ours, PEFT's as written)}."""
    from ..integrations._lora_checks import lora_pair
    from ._vl_lora import export_checks, padded_batch

    batch = padded_batch(folder)
    model, _, ref = lora_pair(folder, layout, CONFIGS[name], image_text=True)
    ours, theirs = model(**batch), ref(**batch)
    out = {"counts": model.get_nb_trainable_parameters(), "peft_counts": ref.get_nb_trainable_parameters(),
           "logits_diff": float((ours.logits - theirs.logits).detach().abs().max()),
           "loss_diff": float((ours.loss - theirs.loss).detach().abs()),
           "targets": sorted(t.hf_module for t in model.lora_plan.targets)}
    if model.parallel.pipeline_parallel_size == 1:
        ours.loss.backward()
        theirs.loss.backward()
        out["grads"] = adapter_grads(model, ref)
        model.zero_grad(set_to_none=True)
    out.update(export_checks(model, ref, folder, out_dir, batch, ours.logits.detach()))
    if "target_modules" in out:
        out["target_modules"] = [w if isinstance(w, str) else sorted(w) for w in out["target_modules"]]
    return out


# (checkpoint, layout name, from_pretrained keywords, config) per world: TP1; TP2 + SP with the tower split (MoE:
# the experts over EP2, ETP1, as test_qwen3_5_vl.MOE_TWO_RANKS)
SPLIT_SP = {"tensor_parallel_size": 2, "sequence_parallel": True, "vision_tensor_parallel_size": 2}
ONE_RANK = [("dense", "tp1", {}, "all_linear"), ("dense", "tp1", {}, "language_regex"),
            ("moe", "tp1", {}, "all_linear")]
TWO_RANKS = [("dense", "tp2_sp", SPLIT_SP, "all_linear"),
             ("moe", "tp2_sp_ep2", {**SPLIT_SP, "expert_parallel_size": 2, "expert_tensor_parallel_size": 1},
              "all_linear")]


def world_checks(folders: dict, out_dir: str, cases: list) -> dict:
    """``lora_checks`` of each (checkpoint key in ``folders``, layout name, layout, config name) in ``cases``."""
    return {f"{key}/{layout_name}/{name}": lora_checks(folders[key], f"{out_dir}/{key}-{layout_name}-{name}", layout,
                                                       name)
            for key, layout_name, layout, name in cases}
