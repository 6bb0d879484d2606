"""Vision tower weights: this rank's slices from an HF checkpoint in, full HF tensors out to the writer rank.

Choices:
- The bridge's table names every tower parameter; loading fills each from its mapping (a TP slice under vision tensor
  parallelism) and fails on a parameter the table lacks or an entry no parameter takes.
- Export runs on the ranks that hold the tower for the writer (first pipeline stage, first data-parallel replica, so
  global rank 0's tensor-parallel group): split tensors are gathered on rank 0 one at a time, which yields each full
  tensor in HF file order; other ranks yield nothing.
"""

from __future__ import annotations

import re
from typing import Iterator

import torch
import torch.distributed as dist

from loongforge_hf.bridges.distribution import gather_to_first


def _group_rank_size(group) -> tuple[int, int]:
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


@torch.no_grad()
def load_vision(tower, bridge, reader, *, tp_group=None) -> None:
    tp_rank, tp_size = _group_rank_size(tp_group)
    ctx = bridge.vision_shard_context(tp_rank=tp_rank, tp_size=tp_size)
    table = bridge.vision_mapping_table()
    params = dict(tower.named_parameters())
    if set(params) != set(table):
        raise RuntimeError(f"{type(bridge).__name__}: vision parameters without a mapping "
                           f"{sorted(set(params) - set(table))}, mappings without a parameter "
                           f"{sorted(set(table) - set(params))}.")
    for name, param in params.items():
        mapping, layer = table[name]
        value = mapping.load(reader, ctx, layer)
        if tuple(value.shape) != tuple(param.shape):
            raise RuntimeError(f"vision parameter {name}: checkpoint slice has shape {tuple(value.shape)}, the module "
                               f"{tuple(param.shape)}.")
        param.copy_(value.to(dtype=param.dtype, device=param.device))


def vision_export_tensors(tower, bridge, *, tp_group=None, holds: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) on the first rank of ``tp_group`` when ``holds``; the others only send."""
    if not holds or tower is None:
        return
    tp_rank, tp_size = _group_rank_size(tp_group)
    ctx = bridge.vision_shard_context(tp_rank=tp_rank, tp_size=tp_size)
    params = dict(tower.named_parameters())
    for name, (mapping, layer) in bridge.vision_mapping_table().items():
        local = params[name].detach()
        if mapping.tp_split is not None and tp_size > 1:
            shards = gather_to_first(local, group=tp_group)
        else:
            shards = [local]
        if tp_rank == 0:
            yield from mapping.export(shards, ctx, layer).items()


# tensors whose rows are ``attn.qkv``'s [q; k; v] (its weight, bias and a LoRA adapter's B): split per block
_QKV_ROWS = re.compile(r"^blocks\.\d+\.attn\.qkv\.(weight|bias|lora\.[^.]+\.B)$")


def vision_sharded_state_dict(tower, *, prefix: str, tp_group=None) -> dict:
    """The tower's parameters (LoRA adapters included) as megatron dist-checkpointing tensors keyed
    ``{prefix}{name}``, at the tower's HF shapes whatever its layout, so a checkpoint resumes under another TP size or
    vision layout: whole tensors are replicas over the TP and data-parallel ranks (rank (0, 0, 0) of them writes);
    a split tower's split tensors (megatron's ``tensor_model_parallel`` attributes: ``vision.py``, LoRA factors) are
    shards along their ``partition_dim``, tensors of the fused ``qkv`` rows a [3, rows, ...] view (in every layout)
    split on its second axis (the q, k, v blocks each split by heads)."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing import ShardedTensor

    tp_rank, tp_size = _group_rank_size(tp_group)
    dp_rank = ps.get_data_parallel_rank(with_context_parallel=True)
    whole = (0, ps.get_tensor_model_parallel_rank(), dp_rank)  # a replica on every TP rank of an unsplit tower
    out = {}
    for name, param in tower.named_parameters():
        key = f"{prefix}{name}"
        split = tp_size > 1 and getattr(param, "tensor_model_parallel", False)
        if _QKV_ROWS.match(name):  # NOTE: the same global shape in every layout
            out[key] = _qkv_factory(key, param, tp_rank if split else 0, tp_size if split else 1,
                                    (0, 0, dp_rank) if split else whole)
        elif split:
            out[key] = ShardedTensor.from_rank_offsets(key, param, (param.partition_dim, tp_rank, tp_size),
                                                       replica_id=(0, 0, dp_rank))
        else:
            out[key] = ShardedTensor.from_rank_offsets(key, param, replica_id=whole)
    return out


def _qkv_factory(key: str, param, tp_rank: int, tp_size: int, replica_id: tuple):
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    def build(k, t, replica, flattened_range):
        blocks = t.reshape(3, t.shape[0] // 3, *t.shape[1:])
        return ShardedTensor.from_rank_offsets(k, blocks, (1, tp_rank, tp_size), replica_id=replica)

    def merge(blocks):
        return blocks.reshape(-1, *blocks.shape[2:])

    return ShardedTensorFactory(key, param, build, merge, replica_id)
