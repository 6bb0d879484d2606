"""Rank functions for LoRA on the recurrent hybrids' mixers against PEFT (called from the bridges' own worlds:
tests/bridges/test_lfm2.py, test_mamba_hybrids.py).

``hybrid_lora_checks`` (one layout): ``peft.get_peft_model`` on the transformers model and ours from the same seed,
with B random (``init_lora_weights=False``): the logits (1e-4) and the loss (1e-5) on a left-padded batch; every
adapter's A and B gradient at HF shape (gathered over TP, B's rows back in the checkpoint's order: the row sections
of LFM2's conv / Mamba2's ``in_proj``, ``Target.b_to_hf``) against PEFT's (relative to each tensor's largest, on the
layers of this rank's pipeline stage); the adapter folder loaded with ``PeftModel.from_pretrained`` and the merged
export in transformers, both giving our logits (``_lora_checks.export_checks``). ``check_matches_peft`` reads the
results of one layout's ranks.

The Gated DeltaNet models (tests/bridges/test_qwen3_5.py, test_olmo_hybrid.py) run ``"all-linear"``
(``ALL_LINEAR``): each HF in-projection its own adapter in its slot of megatron's ``in_proj`` (Qwen3.5's
``in_proj_qkv`` / ``z`` / ``b`` / ``a``, OLMo Hybrid's ``q`` / ``k`` / ``v`` / ``g`` / ``b`` / ``a_proj``; Qwen3-Next's
``in_proj_qkvz`` / ``in_proj_ba``, regrouped per key head, by name), Qwen3.5's gated ``q_proj`` (each head's query and
gate rows) beside ``k_proj`` / ``v_proj``.
"""

from __future__ import annotations

import torch

ALL_LINEAR = dict(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max()) / (float(want.abs().max()) or 1.0)


def _adapter_grads(model, ref) -> dict[str, float]:
    """PEFT name of each adapter factor of this stage -> its gradient's difference from PEFT's (relative)."""
    from megatron.core import parallel_state as ps

    from loongforge_hf.bridges.builder import layer_owners

    from ._lora_checks import _gather_full, lora_shard_context

    owners, ctx = layer_owners(model.megatron.config, model.parallel), lora_shard_context(model)
    theirs, out = dict(ref.named_parameters()), {}
    for t in model.lora_plan.targets:
        pp, vp, local = owners[t.layer]
        if pp != ps.get_pipeline_model_parallel_rank():
            continue
        adapter = model.chunks[vp or 0].get_submodule(t.megatron_module.format(layer=local)).lora[t.name]
        a = _gather_full(adapter.A.grad, 1 if t.kind == "row" else None)
        b = adapter.B.grad if t.kind in ("row", "replicated") else t.b_to_hf(_gather_full(adapter.B.grad, 0), ctx)
        for factor, grad in (("A", a), ("B", b)):
            out[f"{t.hf_module}.lora_{factor}"] = _relative(
                grad, theirs[f"base_model.model.{t.hf_module}.lora_{factor}.default.weight"].grad)
    return out


def hybrid_lora_checks(folder: str, out_dir: str, layout: dict, lora_kw: dict) -> dict:
    """LoRA with ``lora_kw`` at ``layout`` against PEFT (see the module docstring): {"logits", "loss": largest
    differences, "grads": {factor: relative difference}, "adapter_logits_diff" / "merged_logits_diff" (rank 0),
    "unchanged_after_merged_export", "targets": the adapted HF modules, "not_reshardable": the modules a training
    checkpoint cannot resume under another TP size (checkpoint_layout.sectioned_modules)}."""
    from ._lora_checks import export_checks, lora_pair

    ids = torch.randint(4, 203, (2, 24), generator=torch.Generator().manual_seed(7))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    kw = dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    from loongforge_hf.trainer.checkpoint_layout import declared_sections, sectioned_modules

    model, _, ref = lora_pair(folder, layout, lora_kw)
    ours, theirs = model(**kw), ref(**kw)
    chunks = list(model.chunks)
    out = {"logits": float((ours.logits - theirs.logits).detach().abs()[mask.bool()].max()),
           "loss": float((ours.loss - theirs.loss).detach().abs()),
           "targets": sorted(t.hf_module for t in model.lora_plan.targets),
           "not_reshardable": sectioned_modules(chunks, declared=declared_sections(chunks))}
    ours.loss.backward()
    theirs.loss.backward()
    out["grads"] = _adapter_grads(model, ref)
    model.zero_grad(set_to_none=True)
    return {**out, **export_checks(model, folder, out_dir, ids, model(input_ids=ids).logits.detach())}


def check_matches_peft(ranks: list[dict], *, targets: int, tol: float = 1e-4) -> None:
    """Each rank's ``hybrid_lora_checks`` result: logits within ``tol``, loss within 1e-5, the model unchanged by the
    merged export, every factor's gradient of the ``targets`` adapted modules within ``tol`` (relative); on rank 0
    the adapter folder in PEFT and the merged folder in transformers give our logits within ``tol``."""
    for res in ranks:
        assert res["logits"] < tol and res["loss"] < 1e-5 and res["unchanged_after_merged_export"], res
        assert len(res["targets"]) == targets, res["targets"]
        worst = max(res["grads"].items(), key=lambda kv: kv[1])
        assert len(res["grads"]) == 2 * targets and worst[1] < tol, (worst, res["grads"])
    assert ranks[0]["adapter_logits_diff"] < tol and ranks[0]["merged_logits_diff"] < tol, ranks[0]
