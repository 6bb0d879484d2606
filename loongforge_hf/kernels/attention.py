"""Core attention for megatron's ``core_attention`` slot, on torch's ``scaled_dot_product_attention``.

Choices:
- Same constructor and forward contract as megatron-core's ``DotProductAttention`` (0.16): query ``[sq, b, h, d]``,
  key / value ``[skv, b, h_kv, d]``, output ``[sq, b, h * d_v]``; packed (``thd``) inputs ``[t, h, d]`` give
  ``[t, h * d_v]``.
- Grouped-query attention goes to SDPA with ``enable_gqa=True``: K/V are never repeated.
- Causal masking without a mask tensor: ``is_causal`` when queries and keys are the same tokens, torch's
  ``causal_lower_right`` bias when the queries are the last tokens of the keys (a KV cache, a context-parallel chunk).
  Only an explicit mask, a sliding window or a query/key offset that is neither of those builds a ``[sq, skv]`` mask.
- Masks follow megatron: a bool ``attention_mask`` is True where attention is *not* allowed (a float one is added to
  the scores); with a causal mask type the causal rule applies as well. Fully masked rows give zeros, not NaN.
- Packed sequences (``PackedSeqParams``, ``qkv_format='thd'``): attention never crosses a document. On CUDA with
  fp16/bf16 and no dropout, ``torch.nn.attention.varlen.varlen_attn`` (for grouped-query attention only where it takes
  ``enable_gqa``); otherwise one SDPA call per document. With ``cu_seqlens_*_padded`` a document spans its padded
  extent; the padding sits at its end, so real tokens never see it.
- Context parallel: inputs are in megatron's load-balanced layout (rank r holds chunks r and 2*cp-1-r of 2*cp, per
  document when packed). K and V are all-gathered over the CP group in one collective whose backward reduce-scatters
  their grads; each local query chunk then attends to the global keys up to its own end, causally aligned. The result
  equals attention over the whole sequence. ``cp_comm_type`` is accepted and does not change this.
- ``apply_query_key_layer_scaling`` divides and re-multiplies the same scores in megatron: the result is unchanged, so
  it is not replayed. ``softmax_type`` other than ``vanilla`` and ``attention_bias`` raise.
- Score soft-capping (Gemma 2's ``attn_logit_softcapping``: ``cap * tanh(scores / cap)`` before the mask and the
  softmax): a ``CoreAttention`` with ``softcap`` set runs every ``sdpa`` call inside its forward (and its KV cache's)
  on materialised scores, as transformers' eager attention (``_softcapped``; no fused kernel takes the cap). The
  context-parallel KV cache's partial attention refuses it.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from megatron.core import parallel_state, tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import is_layer_window_attention
from megatron.core.utils import divide

from loongforge_hf.kernels._saved import standalone
from loongforge_hf.kernels._triton import use_triton

try:
    from torch.nn.attention.varlen import varlen_attn as _varlen_attn
except ImportError:  # torch < 2.10
    _varlen_attn = None
# NOTE: torch 2.11's varlen_attn has no `enable_gqa` (2.13's has): grouped-query calls then take the per-document path.
_VARLEN_KWARGS = frozenset(inspect.signature(_varlen_attn).parameters) if _varlen_attn is not None else frozenset()

CAUSAL_MASK_TYPES = (AttnMaskType.causal, AttnMaskType.padding_causal, AttnMaskType.causal_bottom_right)

# NOTE: the soft-cap of the attention running now (CoreAttention.softcap), read by every sdpa call under it
_SOFTCAP: contextvars.ContextVar[float | None] = contextvars.ContextVar("loongforge_attention_softcap", default=None)


def score_softcap(cap: float | None):
    """Inside, ``sdpa`` soft-caps the attention scores at ``cap``; None: a plain ``nullcontext`` (every attention call
    of a model without a cap goes through here)."""
    return contextlib.nullcontext() if cap is None else _softcap_scope(cap)


@contextlib.contextmanager
def _softcap_scope(cap: float):
    token = _SOFTCAP.set(cap)
    try:
        yield
    finally:
        _SOFTCAP.reset(token)


def _softcapped(query, key, value, attn_mask, *, scale: float, cap: float, dropout_p: float) -> torch.Tensor:
    """transformers' eager attention with soft-capped scores: ``[b, h, sq, d]`` over ``[b, h_kv, skv, d]`` under
    ``attn_mask`` (bool True = may attend, or float added); rows with no allowed key give zeros."""
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scores = torch.tanh(torch.matmul(query, key.transpose(-1, -2)) * scale / cap) * cap
    if attn_mask.dtype == torch.bool:
        scores = scores.masked_fill(~attn_mask, float("-inf"))
    else:
        scores = scores + attn_mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    probs = torch.nan_to_num(probs, nan=0.0).to(query.dtype)  # NOTE: a fully masked row: zeros, as SDPA's
    if dropout_p:
        probs = F.dropout(probs, p=dropout_p)
    return torch.matmul(probs, value)


_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 0 over ``group``; the backward reduce-scatters (sums) the grads back to each rank."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        out = x.new_empty((dist.get_world_size(group) * x.shape[0], *x.shape[1:]))
        _all_gather(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = grad.new_empty((grad.shape[0] // dist.get_world_size(ctx.group), *grad.shape[1:]))
        _reduce_scatter(out, grad.contiguous(), group=ctx.group)
        return out, None


def _cp_global_index(lengths: list[int], cp_size: int, device: torch.device) -> torch.Tensor:
    """For each token of the global sequence(s), in order, its row in the rank-major all-gathered buffer.

    ``lengths`` are the global (padded) lengths of the documents; each is split into ``2 * cp_size`` chunks and rank r
    holds chunks r and ``2 * cp_size - 1 - r`` of every document, documents one after another.
    """
    per_rank = sum(lengths) // cp_size
    pieces, local_offset = [], 0
    for length in lengths:
        chunk = length // (2 * cp_size)
        for j in range(2 * cp_size):
            rank, second = (j, 0) if j < cp_size else (2 * cp_size - 1 - j, 1)
            start = rank * per_rank + local_offset + second * chunk
            pieces.append(torch.arange(start, start + chunk, device=device))
        local_offset += 2 * chunk
    return torch.cat(pieces)


def _pieces_backends(device: torch.device):
    """SDPA backends for calls on slices of a larger tensor whose outputs are concatenated (documents, CP chunks).

    NOTE: on an H200 with torch 2.11, cuDNN's SDPA backward returned wrong dq (off by up to 3.7) for per-document
    calls once an earlier call had built its cached graph for other sequence lengths: it assumes the grad output's
    strides, which slicing a concatenated grad changes. Flash / memory-efficient / math kernels take any strides.
    """
    if device.type != "cuda":
        return contextlib.nullcontext()
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def _slice_mask(mask: torch.Tensor | None, rows: slice, cols: slice) -> torch.Tensor | None:
    if mask is None:
        return None
    return mask[..., rows if mask.shape[-2] != 1 else slice(None), cols if mask.shape[-1] != 1 else slice(None)]


def sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, causal: bool, scale: float,
         dropout_p: float = 0.0, window: tuple[int, int] | None = None, mask: torch.Tensor | None = None,
         q_offset: int | None = None) -> torch.Tensor:
    """Attention of ``query [b, h, sq, d]`` over ``key / value [b, h_kv, skv, d]`` -> ``[b, h, sq, d_v]``.

    Query i sits at key position ``q_offset + i`` (default ``skv - sq``: the queries are the last keys). ``window``
    is megatron's ``(left, right)``: key j is allowed for query at position p when ``p - left <= j <= p + right``
    (a negative bound is unbounded). ``mask`` is megatron's: bool True = not allowed, or float = added to the scores.
    """
    sq, skv = query.shape[-2], key.shape[-2]
    natural = skv - sq
    q_offset = natural if q_offset is None else q_offset
    kwargs = dict(scale=scale, dropout_p=dropout_p, enable_gqa=query.shape[1] != key.shape[1])
    cap = _SOFTCAP.get()
    if cap is None and window is None and mask is None and (not causal or q_offset == natural):
        if not causal:
            return F.scaled_dot_product_attention(query, key, value, **kwargs)
        if sq == skv:
            return F.scaled_dot_product_attention(query, key, value, is_causal=True, **kwargs)
        if sq == 1:  # NOTE: the last query sees every key (a one-token decode step): no mask object to dispatch
            return F.scaled_dot_product_attention(query, key, value, **kwargs)
        return F.scaled_dot_product_attention(query, key, value, attn_mask=causal_lower_right(sq, skv), **kwargs)
    rel = (torch.arange(skv, device=query.device)[None, :]
           - torch.arange(q_offset, q_offset + sq, device=query.device)[:, None])
    allowed = torch.ones(sq, skv, dtype=torch.bool, device=query.device)
    if causal:
        allowed &= rel <= 0
    if window is not None:
        left, right = window
        if left >= 0:
            allowed &= rel >= -left
        if right >= 0:
            allowed &= rel <= right
    if mask is None:
        attn_mask = allowed
    elif mask.dtype == torch.bool:
        attn_mask = allowed & ~mask
    else:
        attn_mask = mask.to(query.dtype).masked_fill(~allowed, float("-inf"))
    if cap is not None:
        return _softcapped(query, key, value, attn_mask, scale=scale, cap=cap, dropout_p=dropout_p)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, **kwargs)


def _cp_chunks(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, cp_rank: int, cp_size: int,
               causal: bool, scale: float, dropout_p: float, window, mask) -> torch.Tensor:
    """This rank's two query chunks ``[b, h, 2c, d]`` against the global keys ``[b, h_kv, 2 * cp * c, d]``."""
    chunk = query.shape[-2] // 2
    outs = []
    for half, j in enumerate((cp_rank, 2 * cp_size - 1 - cp_rank)):
        rows = slice(half * chunk, (half + 1) * chunk)
        # NOTE: under a causal rule chunk j sees nothing past its own end: later keys are not even passed in.
        end = (j + 1) * chunk if causal else key.shape[-2]
        outs.append(sdpa(query[:, :, rows], key[:, :, :end], value[:, :, :end], causal=causal, scale=scale,
                         dropout_p=dropout_p, window=window, mask=_slice_mask(mask, rows, slice(0, end)),
                         q_offset=j * chunk))
    return torch.cat(outs, dim=2)


def _gather_kv(key: torch.Tensor, value: torch.Tensor, group, index: torch.Tensor):
    """All-gather K and V (dim 0) in one collective and put them in global token order."""
    kv = _GatherSequence.apply(torch.cat((key, value), dim=-1), group).index_select(0, index)
    return kv[..., :key.shape[-1]], kv[..., key.shape[-1]:]


def partial_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, allowed: torch.Tensor,
                      scale: float, block: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``query [b, h, sq, d]`` over a share of the keys ``key / value [b, h_kv, n, d]`` under ``allowed``
    (bool, broadcast to ``[b, 1, sq, n]``, True = may attend) -> (``[b, h, sq, d_v]`` fp32, its log-sum-exp
    ``[b, h, sq]`` fp32): what ``merge_partial_attention`` combines over the ranks holding the other shares. A row
    with no allowed key gives zeros and a log-sum-exp of -inf.

    On CUDA in bf16 / fp16 with Triton: flash-decoding's split-key kernels (``_decode_attention_triton``; one token
    over 16k keys, 16 / 8 heads of 128, in a CUDA graph on an H200: 23 µs, the public SDPA without the log-sum-exp
    29 µs, cuDNN's SDPA with its statistics 336 µs, scripts/bench_decode_attention.py). Elsewhere (CPU, fp32, no
    Triton) ``_blocked_partial_attention``."""
    if _SOFTCAP.get() is not None:
        raise ValueError("attention logit soft-capping (Gemma 2) is not supported with a KV cache sharded over "
                         "context-parallel ranks; generate with context_parallel_size=1.")
    kernels = _decode_kernels(query, key, value)
    if kernels is not None:
        return kernels.partial_attention(query, key, value, allowed=allowed, scale=scale)
    return _blocked_partial_attention(query, key, value, allowed=allowed, scale=scale, block=block)


def _decode_kernels(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor):
    """The Triton split-key kernels' module where they take these tensors, else None."""
    if not use_triton(query):
        return None
    from loongforge_hf.kernels import _decode_attention_triton

    return _decode_attention_triton if _decode_attention_triton.usable(query, key, value) else None


def _blocked_partial_attention(query, key, value, *, allowed: torch.Tensor, scale: float, block: int = 512):
    """``partial_attention`` by torch matrix products: the scores computed in the inputs' dtype and softmaxed in fp32
    (transformers' eager attention), the keys taken in blocks of ``block`` (and the rest), each block's result
    combined by its log-sum-exp (``combine_partial_attention``, as flash-decoding splits the keys): one token's
    ``weights @ values`` over all n keys at once is a matrix product of 1-2 rows with an n-long reduction, which
    cuBLAS ran at ~0.66 ms for 16k keys on an H200 inside a CUDA graph (blocks of 512: 0.12-0.30 ms)."""
    b, h, sq, _ = query.shape
    h_kv, n = key.shape[1], key.shape[-2]
    # NOTE: grouped-query heads: query head i reads key head i // (h / h_kv), as SDPA's enable_gqa
    q = query.reshape(b, h_kv, 1, (h // h_kv) * sq, query.shape[-1])
    whole = n // block * block
    # NOTE: (keys, blocks, block length): the whole blocks, then the rest as one block (also where n is 0)
    pieces = ([(slice(0, whole), whole // block, block)] if whole else []) \
        + ([(slice(whole, n), 1, n - whole)] if n > whole or not whole else [])
    outs, lses = [], []
    for keys, count, length in pieces:
        k = key[:, :, keys].unflatten(2, (count, length))  # NOTE: [b, h_kv, blocks, length, d]
        v = value[:, :, keys].unflatten(2, (count, length))
        mask = allowed[..., keys].unflatten(-1, (count, length)).movedim(-2, -3).unsqueeze(-3)
        scores = torch.matmul(q, k.transpose(-1, -2)).float().unflatten(-2, (h // h_kv, sq)) * scale
        scores = scores.masked_fill(~mask, float("-inf"))  # NOTE: [b, h_kv, blocks, g, sq, length]
        lse = torch.logsumexp(scores, dim=-1)
        weights = torch.exp(scores - lse.masked_fill(lse == float("-inf"), 0.0).unsqueeze(-1))
        outs.append(torch.matmul(weights.flatten(3, 4).to(v.dtype), v).float())  # NOTE: [b, h_kv, blocks, g sq, d]
        lses.append(lse.flatten(3, 4))
    out, lse = torch.cat(outs, dim=2).movedim(2, 0), torch.cat(lses, dim=2).movedim(2, 0)
    out = combine_partial_attention(out, lse) if out.shape[0] > 1 else out[0]
    return out.reshape(b, h, sq, value.shape[-1]), torch.logsumexp(lse, dim=0).reshape(b, h, sq)


def sharded_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, allowed: torch.Tensor,
                      scale: float, group) -> torch.Tensor:
    """Attention of ``query [b, h, sq, d]`` (the same on every rank of ``group``) over the keys all ranks of
    ``group`` hold between them, this rank's share ``key / value [b, h_kv, n, d]`` under ``allowed``
    (``partial_attention``) -> ``[b, h, sq, d_v]`` in the query's dtype on every rank (``merge_partial_attention``):
    a KV cache sharded over context parallelism (``kv_cache.CPShard``). With the Triton kernels every rank's splits
    are all-gathered as they are and combined in one kernel (the same split count on every rank)."""
    kernels = _decode_kernels(query, key, value)
    if kernels is not None:
        mine = kernels.split_partials(query, key, value, allowed=allowed, scale=scale)
        every = mine.new_empty((dist.get_world_size(group) * mine.shape[0], *mine.shape[1:]))
        _all_gather(every, mine, group=group)
        return kernels.combine(every, (*query.shape[:3], value.shape[-1]), dtype=query.dtype, with_lse=False)
    out, lse = partial_attention(query, key, value, allowed=allowed, scale=scale)
    return merge_partial_attention(out, lse, group).to(query.dtype)


def merge_partial_attention(out: torch.Tensor, lse: torch.Tensor, group) -> torch.Tensor:
    """The attention over every rank's share of the keys from each rank's ``partial_attention`` (``out [b, h, sq, d]``,
    ``lse [b, h, sq]``, fp32) -> ``[b, h, sq, d]`` fp32 on every rank of ``group``: one all-gather of both, then each
    share weighted by its softmax mass (``exp(lse_r - max lse)``). Rows no rank attends anywhere give zeros."""
    mine = torch.cat((out, lse.unsqueeze(-1)), dim=-1).unsqueeze(0)
    every = mine.new_empty((dist.get_world_size(group), *mine.shape[1:]))
    _all_gather(every, mine.contiguous(), group=group)
    return combine_partial_attention(every[..., :-1], every[..., -1])


def combine_partial_attention(outs: torch.Tensor, lses: torch.Tensor) -> torch.Tensor:
    """``partial_attention``'s results of every share, stacked (``outs [r, b, h, sq, d]``, ``lses [r, b, h, sq]``)
    -> the attention over all the shares' keys ``[b, h, sq, d]``."""
    top = lses.amax(dim=0)
    weights = torch.exp(lses - top.masked_fill(top == float("-inf"), 0.0))  # NOTE: exp(-inf) = 0 for empty shares
    total = weights.sum(dim=0)
    return (weights.unsqueeze(-1) * outs).sum(dim=0) / total.clamp(min=torch.finfo(total.dtype).tiny).unsqueeze(-1)


def dot_product_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, causal: bool,
                          scale: float, dropout_p: float = 0.0, window: tuple[int, int] | None = None,
                          mask: torch.Tensor | None = None, cp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """megatron layout: ``query [sq, b, h, d]``, ``key / value [skv, b, h_kv, d]`` -> ``[sq, b, h, d_v]``.

    With ``cp_group`` (size > 1) the inputs are this rank's load-balanced chunks; under CP, ``mask`` (if any) is
    ``[.., sq_local, skv_global]`` with keys in global order, as megatron's ``get_batch_on_this_cp_rank`` slices it.
    """
    cp_size = dist.get_world_size(cp_group) if cp_group is not None else 1
    q = query.permute(1, 2, 0, 3)
    if cp_size == 1:
        out = sdpa(q, key.permute(1, 2, 0, 3), value.permute(1, 2, 0, 3), causal=causal, scale=scale,
                   dropout_p=dropout_p, window=window, mask=mask)
        return out.permute(2, 0, 1, 3)
    if query.shape[0] % 2 or key.shape[0] != query.shape[0]:
        raise ValueError(f"context parallel attention: local query/key lengths ({query.shape[0]}, {key.shape[0]}) must "
                         "be equal and even (two load-balanced chunks per rank).")
    index = _cp_global_index([key.shape[0] * cp_size], cp_size, key.device)
    k, v = _gather_kv(key, value, cp_group, index)
    with _pieces_backends(query.device):
        out = _cp_chunks(q, k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3), cp_rank=dist.get_rank(cp_group),
                         cp_size=cp_size, causal=causal, scale=scale, dropout_p=dropout_p, window=window, mask=mask)
    return out.permute(2, 0, 1, 3)


def _bounds(params: PackedSeqParams) -> tuple[list[int], list[int]]:
    q = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
    kv = params.cu_seqlens_kv_padded if params.cu_seqlens_kv_padded is not None else params.cu_seqlens_kv
    if q is None:
        raise ValueError("packed attention: PackedSeqParams.cu_seqlens_q is None.")
    return [int(x) for x in q.tolist()], [int(x) for x in (kv if kv is not None else q).tolist()]


def _varlen_usable(query: torch.Tensor, key: torch.Tensor, *, cp_size: int, dropout_p: float) -> bool:
    gqa = query.shape[1] != key.shape[1]
    return (_varlen_attn is not None and _SOFTCAP.get() is None and query.device.type == "cuda" and cp_size == 1
            and dropout_p == 0.0 and query.dtype in (torch.float16, torch.bfloat16) and "window_size" in _VARLEN_KWARGS
            and (not gqa or "enable_gqa" in _VARLEN_KWARGS))


def _varlen(query, key, value, params: PackedSeqParams, *, causal: bool, scale: float, window) -> torch.Tensor:
    """torch's flash-attention varlen kernel; padded documents span their padded extent, as on the torch path."""
    cu_q = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
    cu_kv = params.cu_seqlens_kv_padded if params.cu_seqlens_kv_padded is not None else params.cu_seqlens_kv
    cu_kv = cu_q if cu_kv is None else cu_kv
    padded = params.cu_seqlens_q_padded is not None or params.cu_seqlens_kv_padded is not None
    max_q = params.max_seqlen_q if params.max_seqlen_q is not None and not padded else int(cu_q.diff().max())
    max_kv = params.max_seqlen_kv if params.max_seqlen_kv is not None and not padded else int(cu_kv.diff().max())
    left, right = window if window is not None else (-1, -1)
    gqa = {"enable_gqa": True} if query.shape[1] != key.shape[1] else {}
    return _varlen_attn(query, key, value, cu_q.to(torch.int32), cu_kv.to(torch.int32), max_q, max_kv, scale=scale,
                        window_size=(left, 0) if causal else (left, right), **gqa)


def packed_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, params: PackedSeqParams, *,
                     causal: bool, scale: float, dropout_p: float = 0.0, window: tuple[int, int] | None = None,
                     cp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Packed documents: ``query [t, h, d]``, ``key / value [t_kv, h_kv, d]`` -> ``[t, h, d_v]``, no attention across
    documents. Under context parallelism the ``cu_seqlens`` are global and every document is load-balanced."""
    cp_size = dist.get_world_size(cp_group) if cp_group is not None else 1
    if _varlen_usable(query, key, cp_size=cp_size, dropout_p=dropout_p):
        return _varlen(query, key, value, params, causal=causal, scale=scale, window=window)
    bounds_q, bounds_kv = _bounds(params)
    if bounds_q[-1] != query.shape[0] * cp_size or bounds_kv[-1] != key.shape[0] * cp_size:
        raise ValueError(f"packed attention: cu_seqlens end at {bounds_q[-1]} / {bounds_kv[-1]} tokens but the inputs "
                         f"hold {query.shape[0]} / {key.shape[0]} tokens per rank x {cp_size} context-parallel ranks.")
    with _pieces_backends(query.device):
        return _per_document(query, key, value, bounds_q, bounds_kv, cp_group=cp_group, causal=causal, scale=scale,
                             dropout_p=dropout_p, window=window)


def _per_document(query, key, value, bounds_q: list[int], bounds_kv: list[int], *, cp_group, causal: bool,
                  scale: float, dropout_p: float, window) -> torch.Tensor:
    cp_size = dist.get_world_size(cp_group) if cp_group is not None else 1
    as_bhsd = lambda x: x.permute(1, 0, 2).unsqueeze(0)  # noqa: E731 - [t, h, d] -> [1, h, t, d]
    outs = []
    if cp_size == 1:
        for i in range(len(bounds_q) - 1):
            q_rows, kv_rows = slice(bounds_q[i], bounds_q[i + 1]), slice(bounds_kv[i], bounds_kv[i + 1])
            if q_rows.stop == q_rows.start:
                continue
            outs.append(sdpa(as_bhsd(query[q_rows]), as_bhsd(key[kv_rows]), as_bhsd(value[kv_rows]), causal=causal,
                             scale=scale, dropout_p=dropout_p, window=window))
        return torch.cat(outs, dim=2)[0].permute(1, 0, 2)
    if bounds_q != bounds_kv:
        raise ValueError("packed attention with context parallelism needs the same cu_seqlens for queries and keys.")
    lengths = [b - a for a, b in zip(bounds_q[:-1], bounds_q[1:])]
    if any(n % (2 * cp_size) for n in lengths):
        raise ValueError(f"packed attention: with context_parallel_size={cp_size} every document's (padded) length "
                         f"must be a multiple of {2 * cp_size}; got {lengths}. Pad with cu_seqlens_q_padded.")
    k, v = _gather_kv(key, value, cp_group, _cp_global_index(lengths, cp_size, key.device))
    cp_rank = dist.get_rank(cp_group)
    for i, length in enumerate(lengths):
        if length == 0:
            continue
        local = slice(bounds_q[i] // cp_size, bounds_q[i + 1] // cp_size)
        glob = slice(bounds_q[i], bounds_q[i + 1])
        outs.append(_cp_chunks(as_bhsd(query[local]), as_bhsd(k[glob]), as_bhsd(v[glob]), cp_rank=cp_rank,
                               cp_size=cp_size, causal=causal, scale=scale, dropout_p=dropout_p, window=window,
                               mask=None))
    return torch.cat(outs, dim=2)[0].permute(1, 0, 2)


class CoreAttention(MegatronModule):
    """Drop-in for megatron-core's ``DotProductAttention`` in ``SelfAttentionSubmodules.core_attention``."""

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection: ProcessGroupCollection | None = None) -> None:
        super().__init__(config=config)
        if config.softmax_type != "vanilla":
            raise ValueError(f"loongforge CoreAttention supports softmax_type='vanilla' only, got "
                             f"{config.softmax_type!r}.")
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        self.tp_group = pg_collection.tp
        self.cp_group = getattr(pg_collection, "cp", None)
        if config.context_parallel_size > 1 and self.cp_group is None:
            self.cp_group = parallel_state.get_context_parallel_group()
        if self.cp_group is not None and dist.get_world_size(self.cp_group) == 1:
            self.cp_group = None
        if self.cp_group is not None and dist.get_world_size(self.cp_group) != config.context_parallel_size:
            raise ValueError(f"CoreAttention: the context-parallel group has {dist.get_world_size(self.cp_group)} "
                             f"ranks but config.context_parallel_size={config.context_parallel_size}.")
        tp_size = dist.get_world_size(self.tp_group) if self.tp_group is not None else 1
        self.num_heads_per_partition = divide(config.num_attention_heads, tp_size)
        self.head_dim = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.window = tuple(config.window_size) if is_layer_window_attention(
            config.window_size, config.window_attn_skip_freq, self.layer_number) else None
        self.softcap: float | None = None  # NOTE: set by a bridge whose model soft-caps its scores (Gemma 2)

    def _dropout_context(self, dropout_p: float):
        # NOTE: like megatron, dropout draws from the model-parallel RNG stream unless sequence parallelism already
        # gives each TP rank different tokens.
        if dropout_p > 0 and not self.config.sequence_parallel:
            return tensor_parallel.get_cuda_rng_tracker().fork()
        return contextlib.nullcontext()

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, attn_mask_type: AttnMaskType | None = None,
                attention_bias: torch.Tensor | None = None,
                packed_seq_params: PackedSeqParams | None = None) -> torch.Tensor:
        if attention_bias is not None:
            raise ValueError("loongforge CoreAttention does not take an attention_bias.")
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        causal = mask_type in CAUSAL_MASK_TYPES
        dropout_p = self.dropout_p if self.training else 0.0
        if packed_seq_params is not None and packed_seq_params.qkv_format != "thd":
            raise ValueError(f"loongforge CoreAttention takes packed sequences in 'thd' format, got "
                             f"qkv_format={packed_seq_params.qkv_format!r}.")
        # NOTE: v (and k without a k norm or rope) are views into megatron's fused QKV output; SDPA keeps its
        # inputs for the backward, which would hold the whole buffer (_saved.standalone).
        key, value = standalone(key), standalone(value)
        with self._dropout_context(dropout_p), score_softcap(self.softcap):
            if packed_seq_params is not None:
                if attention_mask is not None:
                    raise ValueError("packed sequences take their masking from cu_seqlens; attention_mask must be "
                                     "None.")
                out = packed_attention(query, key, value, packed_seq_params, causal=causal,
                                       scale=self.softmax_scale, dropout_p=dropout_p, window=self.window,
                                       cp_group=self.cp_group)
                return out.reshape(out.shape[0], -1)
            out = dot_product_attention(query, key, value, causal=causal, scale=self.softmax_scale,
                                        dropout_p=dropout_p, window=self.window, mask=attention_mask,
                                        cp_group=self.cp_group)
        return out.reshape(out.shape[0], out.shape[1], -1)
