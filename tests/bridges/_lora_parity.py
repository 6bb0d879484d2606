"""Rank function for the bridges' LoRA checks against PEFT (LongCat-Flash, JetMoE): our model with adapters against
``peft.get_peft_model`` on the transformers model, the same LoraConfig after the same seed (``init_lora_weights=False``
keeps B random, so every adapter moves the logits): logits and loss, every adapter's gradient at this rank's slice of
PEFT's (relative to the largest; the expert stacks' in megatron's orientation), and the adapter folder we write loaded
by ``peft.PeftModel`` (rank 0: its logits against ours)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def _expert_grad_diffs(model, ref_params: dict, chunk: dict) -> dict[str, float]:
    """``_grad_diffs`` of the expert stacks' adapters: this rank's experts of PEFT's factors (megatron's orientation),
    ours summed over the expert-data-parallel replicas, PEFT's times the data-parallel ranks (each feeds the batch)."""
    from megatron.core import parallel_state as ps

    from loongforge_hf.lora.experts import megatron_factors

    dp, ep_rank = ps.get_data_parallel_world_size(), ps.get_expert_model_parallel_rank()
    out = {}
    for t in model.lora_plan.targets:
        if t.kind != "experts":
            continue
        per = t.num_experts // ps.get_expert_model_parallel_world_size()
        ours = [chunk[f"decoder.layers.{t.layer}.mlp.experts.lora.{t.name}.{f}"].grad.clone() for f in "AB"]
        if ps.get_expert_data_parallel_world_size() > 1:
            for g in ours:
                dist.all_reduce(g, group=ps.get_expert_data_parallel_group())
        theirs = megatron_factors(t, *(ref_params[f"base_model.model.{t.hf_module}.lora_{f}.default.weight"].grad
                                       for f in "AB"))
        for f, got, want in zip("AB", ours, theirs):
            want = dp * want[ep_rank * per:(ep_rank + 1) * per]
            out[f"{t.hf_module}.lora_{f}"] = float((got - want).abs().max()) / (float(want.abs().max()) or 1.0)
    return out


def _grad_diffs(model, ref) -> dict[str, float]:
    """{PEFT's factor name: largest difference of our gradient from PEFT's (this rank's slice), relative to its
    largest} for every module adapter; B's rows in megatron's order (``Target.b_to_megatron``)."""
    from collections import defaultdict

    from megatron.core import parallel_state as ps

    from loongforge_hf.bridges.loader import shard_context
    from loongforge_hf.lora.model import _layout_and_slices

    ref_params = dict(ref.named_parameters())
    ctx = shard_context(model.bridge, tp_rank=ps.get_tensor_model_parallel_rank(),
                        tp_size=ps.get_tensor_model_parallel_world_size(), padded_vocab=model.megatron.padded_vocab)
    chunk = dict(model.chunks[0].named_parameters())  # NOTE: one pipeline stage: local layer = global layer
    modules = defaultdict(list)
    for t in model.lora_plan.targets:
        if t.kind != "experts":
            modules[(t.layer, t.megatron_module)].append(t)
    out = _expert_grad_diffs(model, ref_params, chunk)
    for (layer, module), targets in modules.items():
        _, slices = _layout_and_slices(targets, ctx, layer)
        for t in targets:
            ours = [chunk[f"{module.format(layer=layer)}.lora.{t.name}.{f}"].grad for f in "AB"]
            theirs = [ref_params[f"base_model.model.{t.hf_module}.lora_{f}.default.weight"].grad for f in "AB"]
            if t.kind == "row":
                theirs[0] = theirs[0][:, slices[t.name]]
            else:
                theirs[1] = t.b_to_megatron(theirs[1], ctx)[slices[t.name]]
            for f, got, want in zip("AB", ours, theirs):
                out[f"{t.hf_module}.lora_{f}"] = float((got - want).abs().max()) / (float(want.abs().max()) or 1.0)
    return out


def lora_against_peft(folder: str, out_dir: str, layout: dict, lora_kw: dict, inspect=None) -> dict:
    """The checks of the module docstring under ``layout``: differences (absolute for logits and loss, relative for
    the gradients, ``grads``: the worst), the targets' last components, and rank 0's ``adapter_logits``;
    ``inspect(model)``'s dict as ``inspected``."""
    import peft
    import transformers

    import loongforge_hf as lf
    from loongforge_hf.lora import get_peft_model

    ids = torch.randint(4, 203, (2, 12), generator=torch.Generator().manual_seed(1))
    model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **layout)
    transformers.set_seed(5)
    model = get_peft_model(model, peft.LoraConfig(**lora_kw))
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    transformers.set_seed(5)
    ref = peft.get_peft_model(hf, peft.LoraConfig(**lora_kw))
    ours, theirs = model(input_ids=ids, labels=ids), ref(input_ids=ids, labels=ids)
    ours.loss.backward()
    theirs.loss.backward()
    grads = _grad_diffs(model, ref)
    out = {"logits": float((ours.logits - theirs.logits).abs().max()), "loss": float(abs(ours.loss - theirs.loss)),
           "grads": max(grads.values()), "graded": len(grads),
           "targets": sorted({t.hf_module.rsplit(".", 1)[-1] for t in model.lora_plan.targets}),
           "inspected": inspect(model) if inspect is not None else None}
    model.save_pretrained(f"{out_dir}/adapter")  # NOTE: one folder for all ranks (written by the first)
    if dist.get_rank() == 0:
        loaded = peft.PeftModel.from_pretrained(
            transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), f"{out_dir}/adapter")
        with torch.no_grad():
            out["adapter_logits"] = float((loaded(input_ids=ids).logits - ours.logits).abs().max())
    return out
