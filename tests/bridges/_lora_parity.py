"""Rank function for the bridges' LoRA checks against PEFT (LongCat-Flash, JetMoE): our model with adapters against
``peft.get_peft_model`` on the transformers model, the same LoraConfig after the same seed (``init_lora_weights=False``
keeps B random, so every adapter moves the logits): logits and loss, every adapter's gradient at this rank's slice of
PEFT's (relative to the largest; the expert stacks' in megatron's orientation), and the adapter folder we write loaded
by ``peft.PeftModel`` (rank 0: its logits against ours)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def _grad_diffs(model, ref) -> dict[str, float]:
    """{PEFT's factor name: largest difference of our gradient from PEFT's (this rank's slice), relative to its
    largest} for every adapter: module adapters (``module_adapter_grads``) and expert stacks' (ours summed over the
    expert-data-parallel replicas, PEFT's times the data-parallel ranks: ``expert_adapter_grads``)."""
    from ..integrations._lora_grads import expert_adapter_grads, module_adapter_grads, whole_adapter_grads

    ref_params = dict(ref.named_parameters())
    per_param = {"experts": expert_adapter_grads, "router": whole_adapter_grads}
    pairs = [(t.hf_module, *grads) for t in model.lora_plan.targets if t.kind in per_param
             for grads in per_param[t.kind](model, ref_params, t)]
    pairs += module_adapter_grads(model, ref, [t for t in model.lora_plan.targets if t.kind not in per_param])
    return {f"{name}.lora_{f}": float((got - want).abs().max()) / (float(want.abs().max()) or 1.0)
            for name, f, got, want in pairs}


def lora_against_peft(folder: str, out_dir: str, layout: dict, lora_kw: dict, inspect=None,
                      scale_saved: float | None = None) -> dict:
    """The checks of the module docstring under ``layout``: differences (absolute for logits and loss, relative for
    the gradients, ``grads``: the worst), the targets' last components, and rank 0's ``adapter_logits``;
    ``inspect(model)``'s dict as ``inspected``. ``scale_saved``: after the gradients, the ``modules_to_save``
    tensors (our trainable ones outside the adapters) multiplied by it, so the folder's copies of them must reach
    PEFT's modules under PEFT's names (``saved_moved``: how far that moved our logits)."""
    import peft
    import transformers

    from ..integrations._lora_checks import lora_pair

    ids = torch.randint(4, 203, (2, 12), generator=torch.Generator().manual_seed(1))
    model, _, ref = lora_pair(folder, layout, lora_kw)
    ours, theirs = model(input_ids=ids, labels=ids), ref(input_ids=ids, labels=ids)
    ours.loss.backward()
    theirs.loss.backward()
    grads = _grad_diffs(model, ref)
    logits, moved = ours.logits.detach(), None
    if scale_saved is not None:
        with torch.no_grad():
            for n, p in model.named_parameters():
                if p.requires_grad and ".lora." not in n:
                    p.mul_(scale_saved)
            logits = model(input_ids=ids).logits
        moved = float((logits - ours.logits.detach()).abs().max())
    out = {"saved_moved": moved, "logits": float((ours.logits - theirs.logits).abs().max()),
           "loss": float(abs(ours.loss - theirs.loss)),
           "grads": max(grads.values()), "graded": len(grads),
           "targets": sorted({t.hf_module.rsplit(".", 1)[-1] for t in model.lora_plan.targets}),
           "inspected": inspect(model) if inspect is not None else None}
    model.save_pretrained(f"{out_dir}/adapter")  # NOTE: one folder for all ranks (written by the first)
    if dist.get_rank() == 0:
        loaded = peft.PeftModel.from_pretrained(
            transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), f"{out_dir}/adapter")
        with torch.no_grad():
            out["adapter_logits"] = float((loaded(input_ids=ids).logits - logits).abs().max())
    return out
