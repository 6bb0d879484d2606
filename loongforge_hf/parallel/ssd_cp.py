"""Context parallelism for the Mamba2 layers (Granite 4.0 H; ``bridges/mamba2.py``): each CP rank runs the conv and
the SSD scan on its own tokens and the states cross the chunks, exactly.

Choices:
- megatron's load-balanced chunks (rank r holds chunks r and ``2 * cp - 1 - r``), the conv's halo and the all-gather
  of every chunk's summary in sequence order as Gated DeltaNet's (``recurrent_cp.py``): a rank runs its
  projections, conv and scan on its ``2c`` tokens only. Not chosen: all-gathering the sequence (CP x the work).
- Passing the state, not the sequence: per head the scan is ``S_t = exp(dt_t A) S_{t-1} + dt_t x_t B_t^T``,
  ``y_t = C_t S_t + D x_t``, so a chunk's run from ``S_in`` is ``y = y0 + Ceff S_in`` with ``Ceff_t = C_t exp(sum_{k
  <= t} dt_k A)`` and ``S_out = a S_in + S0`` with ``a = exp(sum dt A)``, one scalar per row and head (not the
  delta rule's ``Dk``-wide map): ``y0`` and ``S0`` are one call of ``kernels.ssd.ssd_scan`` from zero
  (``affine_ssd``). Every chunk's ``S0 | a`` (``b x heads x (head_dim * d_state + 1)``, fp32) is all-gathered in one
  call; each rank scans them in sequence order for its chunks' ``S_in`` (``incoming_states``) and adds
  ``Ceff S_in``. Costs over CP=1: per layer two all-gathers (the conv's tails, the chunks' states) and one small
  einsum per chunk.
- The scan's own chunks (``chunk_size`` tokens) restart at each CP chunk's first token: the same sums grouped
  otherwise (fp32, about 1e-6 apart).
- Padding (tokens zeroed before and after the conv, ``Mamba2Mixer._split`` / ``conv_heads``) is per token and needs
  nothing more. Packed documents: the conv and the scan restart at each document start, as without CP
  (``ssd_scan``'s ``documents``: each chunk's ids count its starts up to the token); a chunk with a start passes on
  ``a = 0`` and its last document's state, its tokens before the first start read ``S_in``, the later ones none;
  its conv tail keeps its last document's inputs only. The starts are ``delta_rule_cp.read_cp_layout``'s (the
  mask's rows; one all-gather of two flags per token, once per mask).
- The CP group is megatron's, read at each forward (``context_parallel.cp_group_and_size``) as Gated DeltaNet's:
  generate's cached steps run the whole sequence on every rank and never come here.
"""

from __future__ import annotations

import torch

from loongforge_hf.kernels.ssd import ssd_scan
from loongforge_hf.parallel.recurrent_cp import chunk_order, conv_histories, gather_chunks


def context_parallel_scan(layer, xbc: torch.Tensor, dt: torch.Tensor, *, real: torch.Tensor | None, group,
                          starts: torch.Tensor | None) -> torch.Tensor:
    """The conv and the scan of ``layer`` (a ``Mamba2Mixer``) over this CP rank's chunks: ``xbc``
    ``[b, 2c, conv_dim]`` and the raw time steps ``dt`` ``[b, 2c, heads]`` (chunks r and ``2 * cp - 1 - r``, in
    that order; padding zeroed), ``real`` ``[b, 2c]`` (None: all real) -> ``y`` ``[b, 2c, heads, head_dim]`` (fp32),
    as the whole sequence's scan gives for these tokens. ``starts``: ``read_cp_layout``'s ``[b, s]`` (host) or None."""
    size, order = chunk_order(group)
    batch, local, _ = xbc.shape
    c = local // 2
    cuts = None if starts is None else starts.view(batch, 2 * size, c)
    histories = conv_histories(xbc, cuts, group=group, width=layer.conv_weight.shape[-1] - 1)
    A = -torch.exp(layer.A_log.float())
    runs = []
    for i, j in enumerate(order):
        part = slice(i * c, (i + 1) * c)
        documents = None
        if cuts is not None and bool(cuts[:, j].any()):
            documents = cuts[:, j].long().cumsum(-1).to(xbc.device)
        x, B, C = layer.conv_heads(xbc[:, part], None if real is None else real[:, part], documents=documents,
                                   history=histories[i])
        runs.append(affine_ssd(x, layer.time_steps(dt[:, part]), A, B, C, chunk_size=layer.chunk_size, D=layer.D,
                               documents=documents))
    before = incoming_states(gather_chunks([final for _, _, final in runs], group)[:max(order)],
                             head_dim=layer.head_dim)
    out = [y0 + torch.einsum("bshn,bhpn->bshp", c_eff, before[j]) for (y0, c_eff, _), j in zip(runs, order)]
    return torch.cat(out, dim=1)


def incoming_states(finals: list[torch.Tensor], *, head_dim: int) -> list[torch.Tensor]:
    """The chunks' ``S0 | a`` (``affine_ssd``'s ``[b, heads, head_dim * d_state + 1]``) in sequence order -> the
    state each chunk starts from ``[b, heads, head_dim, d_state]``, one more than given (the first is zero):
    ``S_in(j + 1) = a_j S_in(j) + S0_j``."""
    b, heads, width = finals[0].shape
    states = [finals[0].new_zeros(b, heads, head_dim, (width - 1) // head_dim)]
    for final in finals:
        states.append(final[..., -1:, None] * states[-1] + final[..., :-1].unflatten(-1, states[0].shape[-2:]))
    return states


def affine_ssd(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, *,
               chunk_size: int, D: torch.Tensor | None = None, documents: torch.Tensor | None = None):
    """``kernels.ssd.ssd_scan``'s arguments (``dt`` discretised) -> the scan as an affine map of the state it starts
    from (module docstring): ``y0`` ``[b, n, heads, head_dim]``, ``Ceff`` ``[b, n, heads, d_state]`` and ``S0 | a``
    ``[b, heads, head_dim * d_state + 1]``, fp32; from ``S_in`` the output is ``y0 + Ceff S_in``, the final state
    ``a S_in + S0``. ``documents`` ``[b, n]``: the document starts up to each token (0: the incoming state's
    document, the tokens that read it), or None (no start)."""
    heads = x.shape[2]
    y0, state = ssd_scan(x, dt, A, B, C, chunk_size=chunk_size, D=D, output_final_state=True, documents=documents)
    decay = torch.cumsum(dt.float() * A.float(), dim=1)                          # [b, n, heads]
    c_eff = C.float().repeat_interleave(heads // C.shape[2], dim=2, output_size=heads) * decay.exp()[..., None]
    passed = decay[:, -1].exp()
    if documents is not None:  # NOTE: ids never decrease: a row's last id is 0 only where it has no start
        reads = documents == 0
        c_eff, passed = c_eff * reads[..., None, None], passed * reads[:, -1:]
    return y0, c_eff, torch.cat((state.flatten(2), passed[..., None]), dim=-1)
