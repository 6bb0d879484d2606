"""Our LoRA adapters' gradients beside PEFT's, sliced as this rank holds them: the pairing that the bridges' LoRA
checks (tests/bridges/_lora_parity.py) and the MoE models' (_lora_moe.py) compare, each with its own tolerance.

One pipeline stage: megatron's local layer numbers are the global ones."""

from __future__ import annotations

from collections import defaultdict
from typing import Iterator

import torch
import torch.distributed as dist


def _peft_grads(ref_params: dict, target) -> list[torch.Tensor]:
    """PEFT's A and B gradients of ``target``'s HF module."""
    return [ref_params[f"base_model.model.{target.hf_module}.lora_{f}.default.weight"].grad for f in "AB"]


def module_adapter_grads(model, ref, targets, *, magnitudes: bool = False
                         ) -> Iterator[tuple[str, str, torch.Tensor, torch.Tensor]]:
    """(PEFT's module name, factor "A" / "B", our gradient, PEFT's) for every module adapter (a linear's: q / k / v
    slots of linear_qkv or MLA's projections, column, row) among ``targets``: a column adapter's A replicated and B
    split by rows (in megatron's order, ``Target.b_to_megatron``: rotary rows in pairs where the checkpoint keeps
    halves), a row adapter's A split by columns and B replicated. ``magnitudes``: DoRA's magnitude too (factor "m",
    split as B's rows)."""
    from megatron.core import parallel_state as ps

    from loongforge_hf.bridges.loader import shard_context
    from loongforge_hf.lora.model import _layout_and_slices

    ref_params = dict(ref.named_parameters())
    ctx = shard_context(model.bridge, tp_rank=ps.get_tensor_model_parallel_rank(),
                        tp_size=ps.get_tensor_model_parallel_world_size(), padded_vocab=model.megatron.padded_vocab)
    chunk = dict(model.chunks[0].named_parameters())
    modules = defaultdict(list)
    for t in targets:
        modules[(t.layer, t.megatron_module)].append(t)
    for (layer, module), grouped in modules.items():
        _, slices = _layout_and_slices(grouped, ctx, layer)
        for t in grouped:
            ours = [chunk[f"{module.format(layer=layer)}.lora.{t.name}.{f}"].grad for f in "AB"]
            theirs = _peft_grads(ref_params, t)
            if t.kind == "row":
                theirs[0] = theirs[0][:, slices[t.name]]
            else:
                theirs[1] = t.b_to_megatron(theirs[1], ctx)[slices[t.name]]
            if magnitudes:
                ours.append(chunk[f"{module.format(layer=layer)}.lora.{t.name}.magnitude"].grad)
                m = ref_params[f"base_model.model.{t.hf_module}.lora_magnitude_vector.default.weight"].grad
                theirs.append(m if t.kind == "row" else t.b_to_megatron(m[:, None], ctx)[slices[t.name]][:, 0])
            for f, got, want in zip("ABm", ours, theirs):
                yield t.hf_module, f, got, want


def expert_adapter_grads(model, ref_params: dict, target) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(factor, our gradient, PEFT's) of an expert stack's adapter: ours summed over the expert-data-parallel
    replicas (TP ranks with the experts whole and EP1 each see their own tokens), PEFT's this rank's experts in
    megatron's orientation (B's rows in its order, gpt-oss's [gate; up]; Llama 4's factors swapped) times the
    data-parallel ranks (each feeds the same batch and routes it to this rank's experts)."""
    from megatron.core import parallel_state as ps

    from loongforge_hf.lora.experts import megatron_factors

    per = target.num_experts // ps.get_expert_model_parallel_world_size()
    rank = ps.get_expert_model_parallel_rank()
    chunk = dict(model.chunks[0].named_parameters())
    ours = [chunk[f"decoder.layers.{target.layer}.mlp.experts.lora.{target.name}.{f}"].grad.clone() for f in "AB"]
    if ps.get_expert_data_parallel_world_size() > 1:
        for g in ours:
            dist.all_reduce(g, group=ps.get_expert_data_parallel_group())
    dp = ps.get_data_parallel_world_size()
    theirs = [dp * g[rank * per:(rank + 1) * per] for g in megatron_factors(target, *_peft_grads(ref_params, target))]
    return list(zip("AB", ours, theirs))


def whole_adapter_grads(model, ref_params: dict, target) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(factor, our gradient, PEFT's) of a replicated adapter on a whole weight (the router's, Qwen2-MoE's
    ``shared_expert_gate``): ours summed over the tensor-parallel ranks under sequence parallelism (each saw its
    token shard's part until megatron sums them)."""
    from megatron.core import parallel_state as ps

    chunk = dict(model.chunks[0].named_parameters())
    module = target.megatron_module.format(layer=target.layer)
    ours = [chunk[f"{module}.lora.{target.name}.{f}"].grad.clone() for f in "AB"]
    if model.megatron.config.sequence_parallel:
        for g in ours:
            dist.all_reduce(g, group=ps.get_tensor_model_parallel_group())
    return list(zip("AB", ours, _peft_grads(ref_params, target)))
