"""Encoder data parallelism: the ranks of a tensor-parallel group (``vision_data_parallel=True``) or of a
context-parallel group (always) share out the images instead of all encoding all.

Choices:
- Images are split into contiguous runs (rank r encodes images ``[a_r, b_r)``), balanced by patch count; every rank
  computes the same split from ``image_grid_thw``, so no sizes need exchanging.
- The embeddings are all-gathered in image order. The ranks of a TP group compute one loss together (the language
  model's input gradient is the same full tensor on each), so the gather's backward hands each rank its own rows of
  that gradient, unscaled.
- A rank's vision gradients then cover its own images only: the full gradient is their sum over the group. The
  tower's trainable parameters pass through an identity whose backward all-reduces (sums) their gradients over the
  group, in one flat buffer. Every rank runs the tower, an empty share included, so each takes part in that
  collective exactly once per backward.
- Context parallelism is different (``sum_rows=True``): each CP rank's loss covers its own share of the tokens, so
  the input gradient differs from rank to rank and the gather's backward sums the rows' gradients over the group
  (a rank's images then get the gradient of every rank's tokens). The tower's gradients need no collective here:
  a rank's cover its own images fully, and megatron's data-parallel reduction runs over DP x CP, which sums them
  (as it summed each CP rank's share of every image's gradient when every rank encoded every image). With
  ``vision_data_parallel`` as well, the CP rank's share is shared out again over its TP group (``encode``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors


def split_images(patches_per_image: list[int], parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ranges of image indices whose patch totals are as even as a contiguous split allows."""
    total = sum(patches_per_image)
    bounds, acc = [0], 0
    cumulative = []
    for n in patches_per_image:
        acc += n
        cumulative.append(acc)
    for k in range(1, parts):
        target = total * k / parts
        # NOTE: the first image index whose end is closest to the target, never before the previous bound.
        best = min(range(bounds[-1], len(patches_per_image) + 1),
                   key=lambda i: abs((cumulative[i - 1] if i else 0) - target))
        bounds.append(best)
    bounds.append(len(patches_per_image))
    return [(bounds[k], bounds[k + 1]) for k in range(parts)]


class _GatherRows(torch.autograd.Function):
    """All-gather rows of different counts over ``group`` (in rank order); backward: this rank's rows of the grad,
    summed over the group first where ``sum_rows``."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, counts: list[int], group, sum_rows: bool = False) -> torch.Tensor:
        rank = dist.get_rank(group)
        ctx.start, ctx.stop = sum(counts[:rank]), sum(counts[:rank + 1])
        ctx.group, ctx.sum_rows = group, sum_rows
        width = max(counts)
        padded = local.new_zeros((width, *local.shape[1:]))
        padded[:local.shape[0]] = local
        out = local.new_empty((len(counts) * width, *local.shape[1:]))
        dist.all_gather_into_tensor(out, padded.contiguous(), group=group)
        return torch.cat([out[r * width:r * width + n] for r, n in enumerate(counts)], dim=0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.sum_rows:
            grad = grad.contiguous()
            dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.start:ctx.stop].contiguous(), None, None, None


class _SumGradsOverGroup(torch.autograd.Function):
    """Identity on ``params``; backward sums their gradients over ``group`` in one all-reduce."""

    @staticmethod
    def forward(ctx, group, *params: torch.Tensor):
        ctx.group = group
        return tuple(p.view_as(p) for p in params)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        flat = _flatten_dense_tensors(list(grads))
        dist.all_reduce(flat, group=ctx.group)
        return (None, *_unflatten_dense_tensors(flat, list(grads)))


def encode_images_data_parallel(tower, pixel_values: torch.Tensor, grid_thw: torch.Tensor, *, group,
                                sum_rows: bool = False, encode=None) -> torch.Tensor:
    """Image embeddings of all images, each encoded by one rank of ``group``, on every rank of it. ``sum_rows``:
    the ranks' losses differ (context parallelism, module docstring); ``encode(pixels, grid)`` encodes a rank's share
    there (default: the tower)."""
    from loongforge_hf.multimodal.vision import item_patches, item_tokens

    size, rank = dist.get_world_size(group), dist.get_rank(group)
    patches, tokens = item_patches(tower, grid_thw).tolist(), item_tokens(tower, grid_thw).tolist()
    ranges = split_images(patches, size)
    first, last = ranges[rank]
    rows = sum(patches[:first]), sum(patches[:last])
    share = (pixel_values[rows[0]:rows[1]], grid_thw[first:last])
    trainable = [(n, p) for n, p in tower.named_parameters() if p.requires_grad] \
        if not sum_rows and torch.is_grad_enabled() else []  # NOTE: the TP case's gradients summed over the group
    if trainable:
        synced = _SumGradsOverGroup.apply(group, *[p for _, p in trainable])
        local = torch.func.functional_call(tower, dict(zip([n for n, _ in trainable], synced)), share, strict=False)
    else:
        local = (encode or tower)(*share)
    counts = [sum(tokens[a:b]) for a, b in ranges]
    return _GatherRows.apply(local, counts, group, sum_rows)
