"""Mamba2's state-space scan (SSD, "state-space duality": the mixer of IBM Granite 4.0 H's Mamba2 layers) in torch,
chunked, fp32.

Choices:
- Per head a state ``S`` of ``[head_dim, d_state]``, zero at the start unless ``initial_state`` is given. Token ``t``
  decays it by ``exp(dt_t * A)`` (``A < 0`` per head, ``dt_t > 0`` per token and head), adds ``dt_t x_t B_t^T`` and
  reads ``y_t = S_t C_t + D x_t``. ``B`` / ``C`` have ``groups`` heads, head ``h`` reading group
  ``h // (heads / groups)`` (transformers' ``repeat_interleave``).
- The chunked form of transformers' ``mamba2_chunk_scan`` torch path (granitemoehybrid / mamba2 / bamba, 5.24),
  op for op, so the numbers are the same: inside a chunk the "attention" form ``(C B^T * L) x`` with
  ``L[l, s] = exp(sum_{s < k <= l} dt_k A)``; each chunk's end state from its tokens; the states' pass between
  chunks as one matrix product of decays; each token's read of its chunk's start state. Inputs are discretised
  (``dt``, after softplus and the time-step limit) by the caller; everything runs in fp32 and the output is fp32.
- Packed documents (``documents``: ``[b, s]`` non-decreasing document ids; None: one document a row): the state
  restarts at each document's first token. Exactly as running each document alone: the intra-chunk weights, the
  chunk states, the pass between chunks and the reads of a chunk's start state are masked to pairs of positions in
  the same document (ids never decrease, so equal ids at both ends mean no document starts between them).
- ``initial_state`` ``[b, heads, head_dim, d_state]`` continues a row's first document; ``output_final_state``
  returns the state after the last token (fp32), as a cached generate's prefill needs.
- ``ssd_step``: one token from a state (a cached generate's decode step), as transformers'
  ``mamba2_selective_state_update`` torch path: ``S' = exp(dt A) S + dt x B^T``, ``y = S' C + D x``, fp32.
- No Triton kernel: the scan's few large einsums are already batched over chunks; autograd differentiates them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def segment_sum(x: torch.Tensor) -> torch.Tensor:
    """``[..., T]`` -> ``[..., T, T]``: ``out[l, s] = sum(x[s + 1 .. l])`` for ``s <= l``, ``-inf`` above the
    diagonal (transformers' stable masked cumsum)."""
    size = x.size(-1)
    x = x[..., None].expand(*x.size(), size)
    below = torch.tril(torch.ones(size, size, device=x.device, dtype=torch.bool), diagonal=-1)
    total = torch.cumsum(x.masked_fill(~below, 0), dim=-2)
    return total.masked_fill(~torch.tril(torch.ones(size, size, device=x.device, dtype=torch.bool)), -torch.inf)


def _chunks(x: torch.Tensor, pad: int, chunk_size: int) -> torch.Tensor:
    """``[b, s, ...]`` padded with ``pad`` zero tokens -> ``[b, chunks, chunk_size, ...]``."""
    x = F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad))
    return x.reshape(x.shape[0], -1, chunk_size, *x.shape[2:])


def ssd_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, *,
             chunk_size: int, D: torch.Tensor | None = None, initial_state: torch.Tensor | None = None,
             output_final_state: bool = False, documents: torch.Tensor | None = None):
    """``x`` ``[b, s, heads, head_dim]``, ``dt`` ``[b, s, heads]`` (discretised), ``A`` ``[heads]`` (negative),
    ``B`` / ``C`` ``[b, s, groups, d_state]``, ``D`` ``[heads]`` -> ``y`` ``[b, s, heads, head_dim]`` (fp32), and the
    final state with ``output_final_state`` (see the module docstring)."""
    batch, seq, heads, head_dim = x.shape
    x = x.float()
    B = B.float().repeat_interleave(heads // B.shape[2], dim=2, output_size=heads)
    C = C.float().repeat_interleave(heads // C.shape[2], dim=2, output_size=heads)
    pad = (chunk_size - seq % chunk_size) % chunk_size
    skip = D[..., None] * F.pad(x, (0, 0, 0, 0, 0, pad)) if D is not None else None
    x = x * dt[..., None].float()
    A = A.to(x.dtype) * dt.float()
    x, A, B, C = [_chunks(t, pad, chunk_size) for t in (x, A, B, C)]
    A = A.permute(0, 3, 1, 2)                                                      # [b, h, c, l]
    A_cumsum = torch.cumsum(A, dim=-1)
    same, state_doc = _document_masks(documents, pad, chunk_size)

    # 1. inside each chunk: the attention-like form
    L = torch.exp(segment_sum(A))
    M = torch.einsum("bclhn,bcshn->bclsh", C, B) * L.permute(0, 2, 3, 4, 1)
    if same is not None:
        M = M * same[..., None]
    Y_diag = torch.einsum("bclsh,bcshp->bclhp", M, x)

    # 2. each chunk's end state from its own tokens (its last document's, when packed)
    decay_states = torch.exp(A_cumsum[:, :, :, -1:] - A_cumsum)
    B_decay = B * decay_states.permute(0, -2, -1, 1)[..., None]
    if same is not None:
        B_decay = B_decay * same[:, :, -1, :, None, None]
    states = torch.einsum("bclhn,bclhp->bchpn", B_decay, x)

    # 3. the states' pass between chunks (index 0: the state coming in)
    previous = initial_state[:, None].to(states) if initial_state is not None else torch.zeros_like(states[:, :1])
    states = torch.cat([previous, states], dim=1)
    decay_chunk = torch.exp(segment_sum(F.pad(A_cumsum[:, :, :, -1], (1, 0)))).transpose(1, 3)  # [b, z, c, h]
    if state_doc is not None:
        decay_chunk = decay_chunk * (state_doc[:, :, None] == state_doc[:, None, :])[..., None]
    new_states = torch.einsum("bzch,bzhpn->bchpn", decay_chunk, states)
    states, final_state = new_states[:, :-1], new_states[:, -1]

    # 4. each token's read of its chunk's start state
    state_decay_out = torch.exp(A_cumsum)
    if state_doc is not None:
        own = (documents_in_chunks(documents, pad, chunk_size) == state_doc[:, :-1, None])  # [b, c, l]
        state_decay_out = state_decay_out * own[:, None]
    Y_off = torch.einsum("bclhn,bchpn->bclhp", C, states) * state_decay_out.permute(0, 2, 3, 1)[..., None]

    y = (Y_diag + Y_off).contiguous().reshape(batch, -1, heads, head_dim)
    if skip is not None:
        y = y + skip
    y = y[:, :seq]
    return (y, final_state) if output_final_state else y


def ssd_step(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
             C: torch.Tensor, *, D: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One token: ``state`` ``[b, heads, head_dim, d_state]``, ``x`` ``[b, heads, head_dim]``, ``dt`` ``[b, heads]``
    (discretised), ``A`` ``[heads]``, ``B`` / ``C`` ``[b, groups, d_state]``, ``D`` ``[heads]`` -> (``y``
    ``[b, heads, head_dim]``, the new state), both fp32."""
    heads = x.shape[1]
    x, dt = x.float(), dt.float()[..., None, None]                                 # dt: [b, h, 1, 1]
    B = B.float().repeat_interleave(heads // B.shape[1], dim=1, output_size=heads)[:, :, None]
    C = C.float().repeat_interleave(heads // C.shape[1], dim=1, output_size=heads)
    state = state.float() * torch.exp(dt * A.float()[:, None, None]) + dt * B * x[..., None]
    y = torch.einsum("bhpn,bhn->bhp", state, C)
    if D is not None:
        y = y + x * D.float()[:, None]
    return y, state


def documents_in_chunks(documents: torch.Tensor, pad: int, chunk_size: int) -> torch.Tensor:
    """``[b, s]`` document ids -> ``[b, chunks, chunk_size]``, the padding in the last document."""
    documents = F.pad(documents, (0, pad), mode="replicate") if pad else documents
    return documents.reshape(documents.shape[0], -1, chunk_size)


def _document_masks(documents: torch.Tensor | None, pad: int, chunk_size: int):
    """(``[b, c, l, s]`` whether tokens ``l`` and ``s`` of a chunk share a document; ``[b, c + 1]`` the document of
    each state between chunks: the incoming one continues the first token's, then each chunk's last token's), or
    (None, None) for rows of one document each."""
    if documents is None:
        return None, None
    docs = documents_in_chunks(documents, pad, chunk_size)
    same = (docs[:, :, :, None] == docs[:, :, None, :]).float()
    state_doc = torch.cat([docs[:, :1, 0], docs[:, :, -1]], dim=1)
    return same, state_doc
