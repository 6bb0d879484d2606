"""An expert stack's LoRA adapter at PEFT's shape on rank 0: every expert-parallel rank's experts put back together.

Choices:
- Expert ``g`` of a layer lives on expert-parallel rank ``g // (E / EP)``; on the layer's pipeline stage the first
  expert-data-parallel replica of each expert-parallel rank sends its ``A [local, r, in]`` and ``B [local, out, r]``
  to global rank 0 (experts are whole on each rank: expert_tensor_parallel_size is 1 for adapted experts).
- Rank 0 concatenates them by expert and writes PEFT's layout: A ``[E * r, in]`` (expert-major rows), B
  ``[out, r * E]`` (``[out, r, E]`` flattened: expert-minor columns; its rows in the checkpoint's order,
  ``Target.b_to_hf``: gpt-oss's gate and up alternating; Llama 4's factors the other way round:
  ``experts.peft_factors``).
- Collective: every rank calls it for every expert target, in the plan's order (as the other adapter tensors).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from loongforge_hf.bridges.distribution import recv_tensor, send_tensor
from loongforge_hf.lora.experts import peft_factors


def _senders() -> tuple[dict[tuple[int, int], int], bool]:
    """((pipeline rank, expert-parallel rank) -> global rank that sends those experts, whether this rank sends)."""
    from megatron.core import parallel_state as ps

    mine = (ps.get_pipeline_model_parallel_rank(), ps.get_expert_model_parallel_rank(),
            ps.get_expert_tensor_parallel_rank(), ps.get_expert_data_parallel_rank())
    everyone = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    senders = {(pp, ep): r for r, (pp, ep, etp, edp) in enumerate(everyone) if etp == 0 and edp == 0}
    return senders, mine[2] == 0 and mine[3] == 0


def expert_adapter_tensors(model, targets, streamer, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """{PEFT name: tensor} of the expert targets among ``targets`` on rank 0 (empty elsewhere); collective."""
    from megatron.core import parallel_state as ps

    targets = [t for t in targets if t.kind == "experts"]
    if not targets:
        return {}
    senders, sends = _senders()
    ep_size = ps.get_expert_model_parallel_world_size()
    out: dict[str, torch.Tensor] = {}
    for t in targets:
        owner_pp, vp, local = streamer.owners[t.layer]
        vp = vp or 0
        per = t.num_experts // ep_size
        base = f"decoder.layers.{local}.mlp.experts.lora.{t.name}"
        width_in, width_out = (t.out_features, t.in_features) if t.factors_swapped else (t.in_features, t.out_features)
        shapes = {"A": (per, t.r, width_in), "B": (per, width_out, t.r)}  # NOTE: megatron's (experts.megatron_factors)
        mine = {}
        if owner_pp == streamer.pp_rank and sends:
            mine = {f: streamer.params[vp][f"{base}.{f}"].detach().to(dtype) for f in shapes}
            if streamer.rank != 0:
                for f in shapes:
                    send_tensor(mine[f], dst=0)
        if streamer.rank != 0:
            continue
        parts = {"A": [], "B": []}
        for ep in range(ep_size):
            src = senders[(owner_pp, ep)]
            for f, shape in shapes.items():
                parts[f].append(mine[f] if src == 0 else recv_tensor(shape, dtype, src=src, device=streamer.device))
        a, b = torch.cat(parts["A"]).cpu(), torch.cat(parts["B"]).cpu()
        prefix = f"base_model.model.{t.hf_module}"
        out[f"{prefix}.lora_A.weight"], out[f"{prefix}.lora_B.weight"] = peft_factors(t, a, b, streamer.ctx)
    return out
