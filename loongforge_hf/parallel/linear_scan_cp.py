"""Context parallelism for the diagonal linear recurrences (Mamba-1's selective scan, ``bridges/mamba1.py``;
RecurrentGemma's RG-LRU, ``bridges/recurrent_gemma_block.py``): each CP rank runs ``h_t = a_t h_{t-1} + b_t`` on its
own tokens and the states cross the chunks, exactly.

Choices:
- megatron's load-balanced chunks (rank r holds chunks r and ``2 * cp - 1 - r``), the conv's halo
  (``recurrent_cp.conv_chunks``) and the all-gather of every chunk's summary in sequence order as Gated DeltaNet's
  and Mamba2's (``recurrent_cp.py``): a rank runs its projections, conv and scan on its ``2c`` tokens only.
- Passing the state, not the sequence: a chunk's states from ``h_in`` are ``h_t = h0_t + P_t h_in`` with ``h0`` the
  scan from zero (``kernels.linear_scan``) and ``P_t = a_1 ... a_t`` (``torch.cumprod``), elementwise: the map is as
  diagonal as the recurrence. Every chunk's ``P_last | h0_last`` (two states' worth, fp32) is all-gathered in one
  call; each rank folds them in sequence order for its chunks' ``h_in`` and adds ``P h_in``. Costs over CP=1: one
  all-gather a layer (besides the conv's), ``P`` (the states' size) kept for the backward.
- The kernels keep their own arithmetic: ``context_parallel_linear_scan`` has ``kernels.linear_scan``'s signature
  and is handed to them as their ``scan`` (``selective_scan``, ``rg_lru``), whose decays already hold the restarts:
  a zero decay at a token (a document's first, RG-LRU's first real token) makes ``P`` zero from there, so the
  tokens after it read no incoming state and the chunk passes on its own.
- Restarts at a chunk's first token: Mamba-1's document ids (``local_documents``: the chunks' starts counted, 0 the
  incoming state's document, ``selective_scan`` restarting where the id changes, the first token too); RG-LRU's
  resets (``resets``: the sequence's first token, each real token masked from the one before it: a document's
  first, the first after padding) read from the mask's rows this rank holds, every key column: no collective.
- The CP group is megatron's, read at each forward (``context_parallel.cp_group_and_size``); cached steps never run
  under CP (generate's cached steps run whole on every rank).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from loongforge_hf.kernels.linear_scan import linear_scan
from loongforge_hf.parallel.context_parallel import cp_token_index
from loongforge_hf.parallel.recurrent_cp import chunk_order, gather_chunks


def context_parallel_linear_scan(a: torch.Tensor, b: torch.Tensor, *, initial: torch.Tensor | None = None,
                                 dim: int = -1, group) -> torch.Tensor:
    """``kernels.linear_scan`` over this CP rank's two chunks of ``a`` / ``b`` along ``dim`` (chunks r and
    ``2 * cp - 1 - r``, in that order) -> their states, as the whole sequence's scan gives them (fp32). Collective
    over ``group``; no ``initial`` (a continued state never runs under CP)."""
    if initial is not None:
        raise ValueError("context_parallel_linear_scan: no initial state under context parallelism.")
    _, order = chunk_order(group)
    dim = dim % a.dim()
    c = a.shape[dim] // 2
    runs = []
    for i in range(2):
        piece = a.narrow(dim, i * c, c)
        h0 = linear_scan(piece, b.narrow(dim, i * c, c), dim=dim)
        runs.append((h0, torch.cumprod(piece.to(h0.dtype), dim)))
    every = gather_chunks([torch.stack((carry.select(dim, -1), h0.select(dim, -1))) for h0, carry in runs], group)
    before = incoming_states(every[:max(order)])
    return torch.cat([h0 + carry * before[j].unsqueeze(dim) for (h0, carry), j in zip(runs, order)], dim=dim)


def incoming_states(finals: list[torch.Tensor]) -> list[torch.Tensor]:
    """The chunks' ``P_last | h0_last`` (``[2, ...]``) in sequence order -> the state each chunk starts from, one more
    than given (the first is zero): ``h_in(j + 1) = P_j h_in(j) + h0_j``."""
    states = [torch.zeros_like(finals[0][0])]
    for final in finals:
        states.append(final[0] * states[-1] + final[1])
    return states


def local_documents(starts: torch.Tensor | None, group, device: torch.device) -> torch.Tensor | None:
    """``read_cp_layout``'s document starts ``[b, s]`` (host, whole sequence; None: none) -> this rank's tokens'
    document ids ``[b, 2c]``: the starts counted over its chunks in local order, 0 for the first chunk's incoming
    document (an id that changes, the first token's too where it is not 0, restarts the scan)."""
    if starts is None:
        return None
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    return starts[:, cp_token_index(starts.shape[1], size, rank)].long().cumsum(-1).to(device)


def resets(mask: torch.Tensor | None, batch: int, seq: int, group, device: torch.device) -> torch.Tensor:
    """This rank's RG-LRU resets ``[b, seq]`` from megatron's mask rows (``[b, 1, seq, seq * cp]``, True = masked;
    None: plain causal): the sequence's first token and each real token masked from the one before it."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    index = cp_token_index(seq * size, size, rank, device=device)
    first = (index == 0).expand(batch, seq)
    if mask is None:
        return first
    rows = mask[:, 0] if mask.dim() == 4 else mask
    local = torch.arange(seq, device=device)
    padded, before = rows[..., local, index], rows[..., local, (index - 1).clamp(min=0)]
    return first | (~padded & before).expand(batch, seq)
