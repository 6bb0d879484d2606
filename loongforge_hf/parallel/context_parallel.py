"""Context parallelism around megatron-core's model chunks: which tokens a CP rank holds, and the loss and logits put
back together. Used by the text models (``bridges.runtime``, ``trainer.engine``) and by the language model of a
vision-language model (``multimodal``).

Choices:
- megatron's load balancing: the sequence is cut into ``2 * cp`` equal chunks and rank r holds chunks r and
  ``2 * cp - 1 - r`` (what ``get_batch_on_this_cp_rank`` does), so causal attention costs every rank the same.
  ``cp_token_index`` gives those global token positions in local order. megatron's rotary embedding takes the same
  chunks of its global table; attention masks keep all key columns (``[.., s_local, s]``, ``cp_local_mask``).
- A vision-language model embeds the whole sequence and splices the images in by global position before anything is
  dropped, so an image cut by a chunk boundary lands in the right rows on both ranks; its 3-D rope positions stay
  global (megatron's ``MultimodalRotaryEmbedding`` slices its cos/sin with the same rule).
- Loss: each rank sums the losses of its own tokens, divided by the label count of the whole sequence. The value
  returned is the sum over the CP group (the full loss), the gradient each rank backpropagates is that of its own
  share; summed over the group (megatron's DDP reduces over data x context parallel ranks) it is the full gradient.
- Logits are all-gathered over the group and put back in sequence order; where only some positions' logits are
  asked for (generate: ``logits_to_keep``), each rank computes its own of them and the group adds them up
  (``cp_local_rows``, ``cp_gather_rows``): a long prompt's full logits are never gathered.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

_WHOLE: list = []  # NOTE: non-empty inside whole_sequence_on_every_rank()


def cp_group_and_size():
    """(group, size, rank) of the context-parallel group of this rank; (None, 1, 0) without CP, and inside
    ``whole_sequence_on_every_rank``."""
    from megatron.core import parallel_state as ps

    size = ps.get_context_parallel_world_size()
    if size == 1 or _WHOLE:
        return None, 1, 0
    return ps.get_context_parallel_group(), size, ps.get_context_parallel_rank()


def cp_group_holders(chunks) -> list:
    """The modules of ``chunks`` that take their CP share themselves: our core attention, megatron's 3-D rotary
    embedding (each holds a ``cp_group``)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import MultimodalRotaryEmbedding

    from loongforge_hf.kernels.attention import CoreAttention

    return [m for chunk in chunks for m in chunk.modules()
            if isinstance(m, (CoreAttention, MultimodalRotaryEmbedding)) and getattr(m, "cp_group", None) is not None]


@contextlib.contextmanager
def whole_sequence_on_every_rank(holders: list):
    """Inside, every rank of the CP group runs the whole sequence (generate's steps, ``kv_cache.py``): the helpers
    here split and gather nothing, and ``holders`` (``cp_group_holders``, found once by the caller: a walk over the
    model's modules costs more than a decode step) hold no CP group. ``pipeline_sequence_length`` gives megatron's
    schedules the length they divide by CP."""
    held = [(m, m.cp_group) for m in holders]
    for module, _ in held:
        module.cp_group = None
    _WHOLE.append(True)
    try:
        yield
    finally:
        _WHOLE.pop()
        for module, group in held:
            module.cp_group = group


def pipeline_sequence_length(seq: int) -> int:
    """The sequence length to give megatron's pipeline schedules for ``seq`` positions on every rank: they divide it
    by the CP size, which inside ``whole_sequence_on_every_rank`` must leave all of it."""
    from megatron.core import parallel_state as ps

    return seq * ps.get_context_parallel_world_size() if _WHOLE else seq


def cp_token_index(seq: int, cp_size: int, cp_rank: int, device=None) -> torch.Tensor:
    """Global positions of this rank's tokens, in local order (chunks ``r`` and ``2 * cp - 1 - r``)."""
    if seq % (2 * cp_size):
        raise ValueError(f"context_parallel_size={cp_size}: the sequence length {seq} must be a multiple of "
                         f"{2 * cp_size} (pad the batch, e.g. pad_to_multiple_of={2 * cp_size} in the collator).")
    chunk = seq // (2 * cp_size)
    first, second = cp_rank * chunk, (2 * cp_size - 1 - cp_rank) * chunk
    return torch.cat([torch.arange(first, first + chunk, device=device),
                      torch.arange(second, second + chunk, device=device)])


def local_token_positions(seq: int, *, cp_size: int, cp_rank: int, sp_size: int = 1, sp_rank: int = 0,
                          device=None) -> torch.Tensor:
    """Global sequence positions of the rows this rank holds in megatron's ``[s, ...]`` activations: its
    context-parallel share (``cp_token_index``), then, under sequence parallelism over ``sp_size`` ranks, its
    contiguous part of that."""
    positions = cp_token_index(seq, cp_size, cp_rank, device=device) if cp_size > 1 \
        else torch.arange(seq, device=device)
    if sp_size > 1:
        chunk = positions.numel() // sp_size
        positions = positions[sp_rank * chunk:(sp_rank + 1) * chunk]
    return positions


def cp_local_rows(seq: int, rows: slice, cp_size: int, cp_rank: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(the local indices of this rank's positions that fall in ``rows``, their places in ``rows``)."""
    positions = cp_token_index(seq, cp_size, cp_rank, device=device)
    local = ((positions >= rows.start) & (positions < rows.stop)).nonzero().flatten()
    return local, positions[local] - rows.start


def cp_gather_rows(local: torch.Tensor, places: torch.Tensor, count: int, group) -> torch.Tensor:
    """``local`` ``[b, k, ..]`` (this rank's rows, at ``places`` of ``count``, ``cp_local_rows``) -> ``[b, count, ..]``
    on every rank (no gradient): each row comes from the one rank that holds it (a sum over the group of zeros and
    that rank's values, exact)."""
    out = local.new_zeros(local.shape[0], count, *local.shape[2:])
    out[:, places.to(out.device)] = local
    dist.all_reduce(out, group=group)
    return out


def cp_whole_sequence(local: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor]:
    """``local`` ``[s / cp, ...]`` (this rank's load-balanced chunks along dim 0) of every rank of ``group`` -> (the
    whole sequence ``[s, ...]`` in order, its gradient summed back to each rank's rows; the positions of this rank's
    rows in it, in local order)."""
    from loongforge_hf.kernels.attention import _cp_global_index, _GatherSequence

    cp, rank, share = dist.get_world_size(group), dist.get_rank(group), local.shape[0]
    index = _cp_global_index([share * cp], cp, local.device)  # NOTE: each global position's row in the gathered buffer
    return (_GatherSequence.apply(local, group).index_select(0, index),
            torch.argsort(index)[rank * share:(rank + 1) * share])


def cp_loss(local_sum: torch.Tensor, count: torch.Tensor, group) -> torch.Tensor:
    """Full-sequence mean loss whose gradient on this rank is that of its own tokens' share."""
    own = local_sum / count.clamp(min=1)
    total = own.detach().clone()
    dist.all_reduce(total, group=group)
    return own + (total - own.detach())


def cp_gather_sequence(local: torch.Tensor, seq: int, group, *, dim: int = 1) -> torch.Tensor:
    """``local`` [.., s / cp, ..] of every rank -> [.., s, ..] in sequence order (no gradient)."""
    size = dist.get_world_size(group)
    parts = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(parts, local.contiguous(), group=group)
    index = torch.cat([cp_token_index(seq, size, r, device=local.device) for r in range(size)])
    out = torch.empty((*local.shape[:dim], seq, *local.shape[dim + 1:]), dtype=local.dtype, device=local.device)
    out.index_copy_(dim, index, torch.cat(parts, dim=dim))
    return out


def cp_local_inputs(input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor | None,
                    labels: torch.Tensor | None = None):
    """``(input_ids, position_ids, mask, labels)`` ``[b, s]`` (mask ``[b, 1, s, s]``) -> this context-parallel rank's
    share: its tokens, their global positions, its query rows of the mask and its labels; unchanged without CP."""
    _, cp_size, cp_rank = cp_group_and_size()
    if cp_size == 1:
        return input_ids, position_ids, mask, labels
    index = cp_token_index(input_ids.shape[1], cp_size, cp_rank, device=input_ids.device)
    return (input_ids[:, index], position_ids[:, index], cp_local_mask(mask, index),
            labels[:, index] if labels is not None else None)


def cp_local_mask(mask: torch.Tensor | None, index: torch.Tensor) -> torch.Tensor | None:
    """A megatron mask ``[b, 1, s, s]`` (True = masked) -> this rank's query rows ``[b, 1, s_local, s]``."""
    if mask is None or mask.shape[-2] == 1:
        return mask
    return mask.index_select(-2, index)
