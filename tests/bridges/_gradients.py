"""Rank function for test_gradients.py: every parameter's gradient of a loongforge model, written as an HF
checkpoint through the bridge's own export and read back by transformers, against transformers' gradients of the
same loss."""

from __future__ import annotations

import torch
import torch.distributed as dist


def _reduce_as_megatron(model) -> None:
    """The sums megatron's DDP and ``finalize_model_grads`` make after a backward, on the raw ``.grad``: replicated
    parameters that see only this rank's sequence-parallel tokens (norms, router) or heads (q / k norms) over TP;
    every dense parameter
    over the context-parallel ranks; experts that see only their own tokens over the expert-data-parallel group
    (the engine's ``allreduce=False``); then the engine's sum over the replicas of a KV head (more TP ranks than KV
    heads, ``parallel/kv_replicas.py``)."""
    from megatron.core import parallel_state as ps

    from loongforge_hf.parallel.kv_replicas import sum_replica_grads

    tp_group = ps.get_tensor_model_parallel_group()
    expert_dp, cp = ps.get_expert_data_parallel_world_size(), ps.get_context_parallel_world_size()
    for chunk in model.chunks:
        for name, p in chunk.named_parameters():
            if p.grad is None:
                continue
            if ".mlp.experts." in f".{name}":
                if expert_dp > 1:
                    dist.all_reduce(p.grad, group=ps.get_expert_data_parallel_group())
                continue
            # NOTE: megatron's finalize_model_grads: by attribute, and q/k norms by name (each rank's heads)
            qk_norm = model.megatron.config.qk_layernorm and ("q_layernorm" in name or "k_layernorm" in name)
            split = getattr(p, "sequence_parallel", False) and model.megatron.config.sequence_parallel
            if (split or qk_norm) and ps.get_tensor_model_parallel_world_size() > 1:
                dist.all_reduce(p.grad, group=tp_group)
            if cp > 1:  # each context-parallel rank holds its share of the sequence
                dist.all_reduce(p.grad, group=ps.get_context_parallel_group())
    sum_replica_grads(model.chunks)


def gradient_checks(cases: list[tuple[str, str, dict]]) -> dict:
    """Per case (name, checkpoint folder, layout): the largest difference between our gradient and transformers' of
    every HF tensor, relative to the largest gradient of that tensor (rank 0; others return {})."""
    import transformers

    import loongforge_hf as lf

    ids = torch.randint(4, 203, (2, 12), generator=torch.Generator().manual_seed(2))
    out = {}
    for name, folder, layout in cases:
        model = lf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **layout)
        model(input_ids=ids, labels=ids).loss.backward()
        _reduce_as_megatron(model)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.grad)
        grads_dir = f"{folder}-grads-{name}"
        model.save_pretrained(grads_dir)
        if dist.get_rank() != 0:
            continue
        # NOTE: transformers reads the folder into its own layout (e.g. transformers 5's fused expert stacks)
        ours = dict(transformers.AutoModelForCausalLM.from_pretrained(grads_dir, dtype=torch.float32)
                    .named_parameters())
        hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        hf(input_ids=ids, labels=ids).loss.backward()
        diffs, missing = {}, []
        for n, p in hf.named_parameters():
            if n not in ours:
                missing.append(n)
                continue
            if p.grad is None:  # NOTE: no gradient (ERNIE 4.5's e_score_correction_bias, a fixed bias): ours unchanged
                diffs[n] = 0.0 if torch.equal(ours[n].detach(), p.detach()) else float("inf")
                continue
            scale = float(p.grad.abs().max()) or 1.0
            diffs[n] = float((ours[n].detach() - p.grad).abs().max()) / scale
        out[name] = {"diffs": diffs, "missing": missing}
    return out
