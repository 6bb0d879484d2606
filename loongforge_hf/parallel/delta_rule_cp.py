"""Context parallelism for the Gated DeltaNet layers (Qwen3.5, Qwen3-Next, Qwen3.5-MoE; ``bridges/gated_deltanet.py``):
each CP rank runs the conv and the gated delta rule on its own tokens and the states cross the chunks, exactly.

Choices:
- The split is megatron's (``context_parallel``): ``2 * cp`` chunks of ``c`` tokens, rank r holds chunks r and
  ``2 * cp - 1 - r``. A rank runs its projections, conv and delta rule on its ``2c`` tokens only; what crosses chunks
  is small and of fixed size: the conv's last ``conv_kernel - 1`` inputs and the recurrent state. Not chosen:
  all-gathering the sequence and running the recurrence over all of it on every rank (CP x the work, the whole
  sequence's activations on each rank).
- Passing the state, not the sequence: the delta rule is affine in the state a chunk starts from,
  ``S_out = A S_in + B`` and ``o = o0 + Qeff S_in``. One call of ``kernels.gated_delta_rule`` per chunk from the
  state ``[0 | I]`` with the values ``[v | 0]`` (the state's value columns evolve independently) gives ``o0 | Qeff``
  as its output and ``B | A`` as its final state (fp32, ``[Hv, Dk, Dv + Dk]`` per row). ``(A, B)`` of every chunk
  are all-gathered over the CP group; each rank scans them in global chunk order for its chunks' ``S_in``
  (``2 * cp`` small products) and adds ``Qeff S_in``, rounded once to the activations' dtype. Costs over CP=1: the
  kernel's value width is ``Dv + Dk`` (its value-side products about twice), and per layer two all-gathers (the
  conv's tails; the chunks' states, ``2 * cp x b x Hv x Dk x (Dv + Dk)`` fp32, which autograd keeps for the
  backward).
- The conv's halo (the last ``conv_kernel - 1`` inputs before each chunk), the all-gather of the chunks' ``B | A``
  in sequence order and the gradients through both: ``recurrent_cp.py``, shared with Mamba2's ``ssd_cp.py``.
- Padding (tokens zeroed before the conv, ``GatedDeltaNet._split``) is per token and needs nothing more. Packed
  documents: the conv and the recurrence restart at each document start, as without CP; a chunk with a start passes
  on ``A = 0`` and its last document's state as ``B``, its tokens before the first start read ``S_in``, the later
  ones none, and its tail keeps its last document's inputs only. A chunk with starts costs three calls of the rule
  for all its rows and documents however many there are (``_documents``), not one per document. The starts come
  from the mask rows a rank holds
  (``[b, 1, s_local, s]``, every key column): a token masked from the one before it while both are real; those two
  flags of every token are all-gathered once per mask (``read_cp_layout``, kept per mask as without CP).
- The CP group is megatron's, read at each forward (``context_parallel.cp_group_and_size``): the same call decides
  whether the runtime split the inputs, so the layer and its inputs always agree (also inside
  ``whole_sequence_on_every_rank``, generate's cached steps, where it gives none).
- fla's kernels (``kernels.fla_delta_rule``) are not used under CP: ``kernels.gated_delta_rule`` (torch, its state
  pass in Triton on GPUs) runs every chunk, differentiable in the state it starts from.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from loongforge_hf.parallel.context_parallel import cp_token_index
from loongforge_hf.parallel.recurrent_cp import chunk_order, conv_histories, gather_chunks


def read_cp_layout(mask: torch.Tensor, batch: int, seq: int, group):
    """This rank's rows of megatron's mask (``[b, 1, seq, seq * cp]``, True = masked) -> (this rank's real tokens
    ``[b, seq]``, None when all are; the document starts ``[b, seq * cp]`` of the whole sequence, on the host, None
    when no row is packed). Collective over ``group`` (one all-gather of two flags per token)."""
    from loongforge_hf.kernels.attention import _all_gather

    size, rank = dist.get_world_size(group), dist.get_rank(group)
    rows = mask[:, 0] if mask.dim() == 4 else mask
    total = seq * size
    if tuple(rows.shape[-2:]) != (seq, total):
        raise ValueError(f"Gated DeltaNet / Mamba2 layers: attention mask of shape {tuple(mask.shape)} for {seq} "
                         f"tokens of a context-parallel rank ({size} ranks: [b, 1, {seq}, {total}] expected).")
    index = cp_token_index(total, size, rank, device=rows.device)
    local = torch.arange(seq, device=rows.device)
    real = ~rows[..., local, index].expand(batch, seq)
    before = (rows[..., local, (index - 1).clamp(min=0)] & (index > 0)).expand(batch, seq)  # masked from t - 1
    flags = torch.stack((real, before)).to(torch.uint8).contiguous()
    parts = flags.new_empty(size * 2, batch, seq)
    _all_gather(parts, flags, group=group)
    order = torch.cat([cp_token_index(total, size, r) for r in range(size)])
    whole = torch.empty(2, batch, total, dtype=torch.bool)
    whole[..., order] = parts.cpu().view(size, 2, batch, seq).permute(1, 2, 0, 3).reshape(2, batch, total).bool()
    every, masked = whole
    starts = F.pad(masked[:, 1:] & every[:, 1:] & every[:, :-1], (1, 0))
    return (None if bool(real.all()) else real), (starts if bool(starts.any()) else None)


def context_parallel_mix(layer, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *, group,
                         starts: torch.Tensor | None) -> torch.Tensor:
    """The conv and the delta rule of ``layer`` (a ``GatedDeltaNet``) over this CP rank's chunks: ``qkv``
    ``[b, 2c, qkv_size]``, ``g`` / ``beta`` ``[b, 2c, Hv]`` (chunks r and ``2 * cp - 1 - r``, in that order) ->
    ``[b, 2c, Hv, Dv]``, as the whole sequence's run gives for these tokens. ``starts``: ``read_cp_layout``'s."""
    size, order = chunk_order(group)
    batch, local, _ = qkv.shape
    c = local // 2
    cuts = None if starts is None else starts.view(batch, 2 * size, c)
    histories = conv_histories(qkv, cuts, group=group, width=layer.conv_weight.shape[-1] - 1)
    runs = [_chunk(layer, qkv[:, i * c:(i + 1) * c], g[:, i * c:(i + 1) * c], beta[:, i * c:(i + 1) * c],
                   histories[i], None if cuts is None else cuts[:, j]) for i, j in enumerate(order)]
    every = gather_chunks([final for _, _, final in runs], group)
    before = incoming_states(every[:max(order)], value_dim=layer.value_dim)
    out = [o0 + torch.einsum("bshk,bhkv->bshv", q_eff, before[j]) for (o0, q_eff, _), j in zip(runs, order)]
    return torch.cat(out, dim=1).to(qkv.dtype)


def incoming_states(finals: list[torch.Tensor], *, value_dim: int) -> list[torch.Tensor]:
    """The chunks' ``B | A`` (``affine_delta_rule``'s final states ``[b, Hv, Dk, Dv + Dk]``) in sequence order ->
    the state each chunk starts from, one more than given (the first is zero): ``S_in(j + 1) = A_j S_in(j) + B_j``."""
    states = [torch.zeros_like(finals[0][..., :value_dim])] if finals else []
    for final in finals:
        states.append(final[..., value_dim:] @ states[-1] + final[..., :value_dim])
    return states


def _chunk(layer, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, history: torch.Tensor,
           cuts: torch.Tensor | None):
    """One chunk ``[b, c, ..]`` after ``history`` -> (``o0`` ``[b, c, Hv, Dv]``, ``Qeff`` ``[b, c, Hv, Dk]``, the
    final ``B | A`` ``[b, Hv, Dk, Dv + Dk]``), fp32. ``cuts`` ``[b, c]`` (host): document starts in it, or None."""
    if cuts is None or not bool(cuts.any()):
        return _affine(layer, qkv, g, beta, history, carried=True)
    return _documents(layer, qkv, g, beta, history, [row.nonzero().flatten().tolist() for row in cuts])


def _documents(layer, qkv, g, beta, history, starts: list[list[int]]):
    """``_chunk`` for rows whose documents start at ``starts`` (each row's positions in the chunk; a row may have
    none), three calls of the rule for all rows and documents: the conv over the documents laid out one after
    another (``packed_conv_heads``, a row's first document after its ``history``); the tokens before each row's first
    start as the affine map of the incoming state (one call over the longest such prefix); the other documents from
    zero (``gated_delta_rule_packed``); the state a row with a start passes on, its last document's (``A = 0``): one
    run over the chunk from its earliest last start, the tokens before a row's own zeroed (zero tokens keep a zero
    state: no decay, no write)."""
    from loongforge_hf.kernels.gated_delta_rule import gated_delta_rule, gated_delta_rule_packed

    batch, c, _ = qkv.shape
    bounds = [sorted({0, *row, c}) for row in starts]
    q, k, v = layer.packed_conv_heads(qkv, bounds, history)
    position = torch.arange(c, device=qkv.device)
    first, last = ([row[0] if row else c for row in starts], [row[-1] if row else c for row in starts])
    reads = (position < torch.tensor(first, device=qkv.device)[:, None])[..., None, None]  # NOTE: [b, c, 1, 1]
    rest = gated_delta_rule_packed(q, k, v, g, beta, bounds).float()
    longest = max(first)
    if longest:
        o0, q_eff, final = affine_delta_rule(*(t[:, :longest] for t in (q, k, v, g, beta)))
        o0, q_eff = (F.pad(t, (0, 0, 0, 0, 0, c - longest)) for t in (o0, q_eff))
        o0, q_eff = torch.where(reads, o0, rest), q_eff * reads
    else:
        o0, q_eff, final = rest, rest.new_zeros(*q.shape[:2], rest.shape[2], q.shape[-1]), None
    lo = min(last)
    tail = (position[lo:] >= torch.tensor(last, device=qkv.device)[:, None]).float()  # NOTE: [b, c - lo]
    cut = [t[:, lo:] * tail.view(batch, c - lo, *[1] * (t.dim() - 2)).to(t.dtype) for t in (q, k, v, g, beta)]
    _, state = gated_delta_rule(*cut, output_final_state=True)
    passed = torch.cat((state, torch.zeros_like(state[..., :q.shape[-1]])), dim=-1)
    if not all(starts):  # NOTE: a row without a start passes on the prefix call's B | A (its prefix: the chunk)
        whole = torch.tensor([not row for row in starts], device=qkv.device)[:, None, None, None]
        passed = torch.where(whole, final, passed)
    return o0, q_eff, passed


def _affine(layer, qkv, g, beta, history, *, carried: bool):
    """The conv and the delta rule over ``qkv`` ``[b, n, qkv_size]`` as an affine map of the incoming state:
    (``o0``, ``Qeff``, ``B | A``), fp32. Not ``carried`` (a document starting here): from zero, ``Qeff`` and ``A``
    zero."""
    return affine_delta_rule(*layer.conv_heads(qkv, history), g, beta, carried=carried)


def affine_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
                      carried: bool = True):
    """``kernels.gated_delta_rule``'s arguments (``[b, n, heads, dim]``) -> the rule as an affine map of the state it
    starts from (module docstring): ``o0`` ``[b, n, Hv, Dv]``, ``Qeff`` ``[b, n, Hv, Dk]`` and ``B | A``
    ``[b, Hv, Dk, Dv + Dk]``, fp32; the output from ``S_in`` is ``o0 + Qeff S_in``, the final state ``A S_in + B``.
    Not ``carried``: from zero only (``Qeff`` and ``A`` zero)."""
    from loongforge_hf.kernels.gated_delta_rule import gated_delta_rule

    batch, n, heads, dv = v.shape
    dk = k.shape[-1]
    if not carried:
        o0, b = gated_delta_rule(q.float(), k, v, g, beta, output_final_state=True)
        return o0, o0.new_zeros(batch, n, heads, dk), torch.cat((b, b.new_zeros(batch, heads, dk, dk)), dim=-1)
    values = torch.cat((v.float(), v.new_zeros(batch, n, heads, dk, dtype=torch.float32)), dim=-1)
    eye = torch.eye(dk, dtype=torch.float32, device=v.device).expand(batch, heads, dk, dk)
    start = torch.cat((eye.new_zeros(batch, heads, dk, dv), eye), dim=-1)
    out, final = gated_delta_rule(q.float(), k, values, g, beta, initial_state=start, output_final_state=True)
    return out[..., :dv], out[..., dv:], final
