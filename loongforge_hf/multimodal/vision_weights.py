"""Vision tower weights: this rank's slices from an HF checkpoint in, full HF tensors out to the writer rank.

Choices:
- The bridge's table names every tower parameter; loading fills each from its mapping (a TP slice under vision tensor
  parallelism) and fails on a parameter the table lacks or an entry no parameter takes.
- Export runs on the ranks that hold the tower for the writer (first pipeline stage, first data-parallel replica, so
  global rank 0's tensor-parallel group): split tensors are gathered on rank 0 one at a time, which yields each full
  tensor in HF file order; other ranks yield nothing.
"""

from __future__ import annotations

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
