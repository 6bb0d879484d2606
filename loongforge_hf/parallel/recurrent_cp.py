"""What the recurrent layers' context parallelism shares (Gated DeltaNet's ``delta_rule_cp.py``, Mamba2's
``ssd_cp.py``, LFM2's short conv: ``conv_chunks``): which chunks a rank holds, every chunk's summary all-gathered in
sequence order, the causal conv's halo.

Choices:
- The split is megatron's (``context_parallel``): ``2 * cp`` chunks of ``c`` tokens, rank r holds chunks r and
  ``2 * cp - 1 - r``, in that order (``chunk_order``). What crosses the chunks is small and of fixed size: a summary
  per chunk (the conv's last inputs, the recurrence's state or its affine map), all-gathered over the CP group in
  one call (``gather_chunks``: every rank's pair, put in sequence order by ``chunk_slot``) and folded by each rank
  in sequence order up to its own chunks.
- Gradients by autograd through the all-gather (``kernels.attention``'s ``_GatherSequence``: the backward
  reduce-scatters, i.e. sums each chunk's gradients from every rank, as every rank's loss share reads every earlier
  chunk's summary).
- The conv's halo (``conv_histories``): each chunk's last ``min(c, width)`` inputs are all-gathered; each rank folds
  them in sequence order into the history each chunk starts with (a chunk shorter than the kernel passes on part of
  the one before it too: the short prompts of an uncached generate), zeros before the first chunk. Packed
  documents: a chunk's tail keeps its last document's inputs only, and a chunk starting a document starts from
  zeros.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def chunk_order(group) -> tuple[int, tuple[int, int]]:
    """(the CP size, the global indices of this rank's two chunks in local order)."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    return size, (rank, 2 * size - 1 - rank)


def chunk_slot(chunk: int, size: int) -> int:
    """Where chunk ``chunk``'s entry sits in an all-gather of every rank's (chunk r, chunk 2cp-1-r) pair."""
    return 2 * chunk if chunk < size else 2 * (2 * size - 1 - chunk) + 1


def gather_chunks(mine: list[torch.Tensor], group) -> list[torch.Tensor]:
    """This rank's two chunks' summaries (same shapes, in local order) -> every chunk's, in sequence order
    (differentiable: the backward sums each one's gradients from every rank)."""
    from loongforge_hf.kernels.attention import _GatherSequence

    size = dist.get_world_size(group)
    every = _GatherSequence.apply(torch.stack(mine), group)
    return [every[chunk_slot(j, size)] for j in range(2 * size)]


def conv_histories(inputs: torch.Tensor, cuts: torch.Tensor | None, *, group, width: int) -> list[torch.Tensor]:
    """The conv's history (its ``width`` inputs before the chunk, ``[b, channels, width]``) of each of this rank's
    chunks of ``inputs`` ``[b, 2c, channels]``: every chunk's tail all-gathered, folded in sequence order; zero at a
    document start. ``cuts`` ``[b, 2 * cp, c]`` (host): the document starts of every chunk, or None."""
    size, order = chunk_order(group)
    batch, local, channels = inputs.shape
    c = local // 2
    keep = min(c, width)
    tails = []
    for i, j in enumerate(order):
        tail = inputs[:, (i + 1) * c - keep:(i + 1) * c]
        if cuts is not None:  # NOTE: the inputs of the chunk's last document only (no start after them)
            count = cuts[:, j].int()
            later = count.flip(-1).cumsum(-1).flip(-1) - count
            tail = tail * (later[:, c - keep:] == 0).to(tail)[..., None]
        tails.append(tail)
    every = gather_chunks(tails, group)
    history, out = inputs.new_zeros(batch, width, channels), {}
    for j in range(max(order) + 1):
        fresh = None if cuts is None else cuts[:, j].to(inputs.device)  # NOTE: [b, c] document starts
        out[j] = history if fresh is None else history * (~fresh[:, 0]).to(history)[:, None, None]
        if fresh is not None:
            history = history * (~fresh.any(-1)).to(history)[:, None, None]
        history = torch.cat((history, every[j]), dim=1)
        history = history[:, history.shape[1] - width:]
    return [out[j].transpose(1, 2) for j in order]


def conv_chunks(inputs: torch.Tensor, starts: torch.Tensor | None, *, group, width: int, conv) -> torch.Tensor:
    """A causal conv with no state beyond its ``width`` taps back (LFM2's short conv) over this rank's two chunks of
    ``inputs`` ``[b, 2c, channels]``: ``conv(chunk, history=, documents=)`` of each after its halo
    (``conv_histories``), with the chunk's document ids where a document starts in it. ``starts``:
    ``delta_rule_cp.read_cp_layout``'s ``[b, s]`` (host) or None."""
    size, order = chunk_order(group)
    batch, local, _ = inputs.shape
    c = local // 2
    cuts = None if starts is None else starts.view(batch, 2 * size, c)
    histories = conv_histories(inputs, cuts, group=group, width=width)
    out = []
    for i, j in enumerate(order):
        documents = None
        if cuts is not None and bool(cuts[:, j].any()):
            documents = cuts[:, j].long().cumsum(-1).to(inputs.device)
        out.append(conv(inputs[:, i * c:(i + 1) * c], history=histories[i], documents=documents))
    return torch.cat(out, dim=1)
