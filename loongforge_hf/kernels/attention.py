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
  it is not replayed. An ``attention_bias`` raises.
- Score rules (``attention_scores``: a context the ``CoreAttention`` forward and its KV caches enter; none set, a
  plain ``nullcontext``, and every call takes the fused paths above). Under one, every ``sdpa`` call runs on
  materialised scores, as transformers' eager attention (``_materialised``; no fused kernel takes them), softmaxed in
  fp32 (transformers softmaxes gpt-oss's in the inputs' dtype), and the varlen kernel is skipped:
  - soft-capping (Gemma 2's ``attn_logit_softcapping``, ``CoreAttention.softcap``): ``cap * tanh(scores / cap)``
    before the mask. Where Triton runs, in fp16 / bf16 (no sinks, bidirectional blocks or chunks), flash-style
    kernels take it without materialising the scores (``softcap_attention``). The context-parallel KV cache's
    partial attention refuses it.
  - attention sinks (megatron's ``softmax_type``, gpt-oss's ``sinks``, ``CoreAttention.sinks``): one more logit per
    query head, after the cap and the mask, in the softmax only (its value is zero): ``softmax([s, sink])[:-1] @ V``,
    i.e. the plain attention times ``sigmoid(lse - sink)``, ``lse`` the log-sum-exp of the row's allowed scores.
    ``learnable``: a parameter ``softmax_offset [heads of this TP rank]`` (megatron's name, split over TP on dim 0,
    zeros at init: a bridge loads the checkpoint's); ``off-by-one``: a sink fixed at 0; ``vanilla``: none. A row
    with no allowed key gives zeros with or without a sink. Each packed document and each context-parallel query
    chunk is one call over every key its queries may see, so its sink is the whole row's. The context-parallel KV
    cache applies it to the merged shares by their total log-sum-exp (``combine_partial_attention``).
- Bidirectional blocks (``bidirectional_blocks``: Gemma 3's images; a context as the score rules): block ids ``[b, S]``
  over the sequence's positions (-1 outside a block); inside, a query may also see every key of its own block, later
  ones included, as transformers' ``OR(causal, blockwise)`` (a sliding window still bounds the keys behind the query:
  ``AND(window, OR(causal, blockwise))``; ``windowed=False``: the whole block past any window, as PaliGemma 2's
  ``OR(AND(window, causal), blockwise)``; ``layers='sliding'``: only in the layers with a sliding window, the others
  causal, as Gemma 4's); a padding / document mask never applies inside a block. Such calls build a
  mask (no fused causal kernel); a context-parallel query chunk then takes every key, not just those up to its end.
  Packed (``thd``) inputs and the context-parallel KV cache's shares refuse them.
- Chunked attention (``attention_chunks``: Llama 4's ``attention_chunk_size`` layers; a context as the score rules):
  a query sees only the keys of its own chunk of ``size`` positions, counted from the first key it may see under the
  causal and padding / document masks (transformers counts them from a row's first real token, a packed document's
  start). Such calls build a mask (no fused kernel, no varlen kernel), but for two: keys that fit in one chunk (the
  rule cuts nothing) and queries and keys the same tokens without a mask (the chunks as one batch of causal SDPA
  calls, ``_causal_chunks``); the static KV cache's fixed step and the
  context-parallel KV cache's shares (``masked_attention``, ``partial_attention``, ``sharded_attention``) refuse it.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import math
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from megatron.core import parallel_state, tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import (ensure_metadata_has_dp_cp_group, is_layer_window_attention,
                                             make_sharded_tensors_for_checkpoint)
from megatron.core.utils import divide

from loongforge_hf.kernels import sink_attention, softcap_attention
from loongforge_hf.kernels._saved import standalone
from loongforge_hf.kernels._triton import use_triton
from loongforge_hf.xpu import get_backend

try:
    from torch.nn.attention.varlen import varlen_attn as _varlen_attn
except ImportError:  # torch < 2.10
    _varlen_attn = None
# NOTE: torch 2.11's varlen_attn has no `enable_gqa` (2.13's has): grouped-query calls then take the per-document path.
_VARLEN_KWARGS = frozenset(inspect.signature(_varlen_attn).parameters) if _varlen_attn is not None else frozenset()

CAUSAL_MASK_TYPES = (AttnMaskType.causal, AttnMaskType.padding_causal, AttnMaskType.causal_bottom_right)

Sinks = torch.Tensor | float  # NOTE: a logit per query head (``[h]``), or one for every head (off-by-one's 0)


class _ScoreRule(NamedTuple):
    softcap: float | None
    sinks: torch.Tensor | float | None


# NOTE: the score rule of the attention running now (module docstring), read by every sdpa call under it
_SCORES: contextvars.ContextVar[_ScoreRule | None] = contextvars.ContextVar("loongforge_attention_scores",
                                                                            default=None)


def attention_scores(*, softcap: float | None = None, sinks: Sinks | None = None):
    """Inside, ``sdpa`` (and the context-parallel KV cache's ``sharded_attention``) soft-cap the scores at ``softcap``
    and add the ``sinks`` logits (``[h]``, one per query head, or a float for all) to the softmax; both None: a plain
    ``nullcontext`` (every attention call of a model without them goes through here)."""
    if softcap is None and sinks is None:
        return contextlib.nullcontext()
    return _scores_scope(_ScoreRule(softcap, sinks))


@contextlib.contextmanager
def _scores_scope(rule: _ScoreRule):
    token = _SCORES.set(rule)
    try:
        yield
    finally:
        _SCORES.reset(token)


# NOTE: the bidirectional blocks of the attention running now (module docstring)
_BLOCKS: contextvars.ContextVar = contextvars.ContextVar("loongforge_attention_blocks", default=None)


class _Blocks(NamedTuple):
    ids: torch.Tensor          # [b, S] block ids, -1 outside
    windowed: bool             # True: a sliding window bounds the block's keys behind the query (Gemma 3)
    sliding_only: bool         # True: blocks in the sliding-window layers only (Gemma 4)
    same: dict                 # (q_offset, sq, skv) -> the [b, sq, skv] mask: built once per forward, not per layer


@contextlib.contextmanager
def bidirectional_blocks(block_ids: torch.Tensor | None, *, windowed: bool = True, layers: str = "all"):
    """Inside, every attention call (``layers='sliding'``: every one with a sliding window) lets a query see all keys
    of its block: ``block_ids [b, S]`` (long, -1 for tokens outside any block) over the key positions ``0 .. S - 1``,
    those behind a sliding window too unless ``windowed``; None: no change."""
    if layers not in ("all", "sliding"):
        raise ValueError(f"bidirectional_blocks: layers={layers!r} must be 'all' or 'sliding'.")
    token = _BLOCKS.set(None if block_ids is None else _Blocks(block_ids, windowed, layers == "sliding", {}))
    try:
        yield
    finally:
        _BLOCKS.reset(token)


def _same_block(q_offset: int, sq: int, skv: int, *, sliding: bool = True) -> torch.Tensor | None:
    """``[b, sq, skv]`` True where query ``q_offset + i`` and key ``j`` sit in one bidirectional block (None without
    blocks, or in a layer without a sliding window (``sliding``) where they are the sliding layers'); positions past
    the block ids are outside every block."""
    blocks = _BLOCKS.get()
    if blocks is None or (blocks.sliding_only and not sliding):
        return None
    key = (q_offset, sq, skv)
    if key not in blocks.same:
        ids = blocks.ids
        padded = F.pad(ids, (0, max(0, q_offset + sq - ids.shape[1], skv - ids.shape[1])), value=-1)
        qb, kb = padded[:, q_offset:q_offset + sq], padded[:, :skv]
        blocks.same[key] = (qb[:, :, None] == kb[:, None, :]) & (qb[:, :, None] >= 0)
    return blocks.same[key]


# NOTE: the chunk size of the chunked attention running now (module docstring)
_CHUNK: contextvars.ContextVar[int | None] = contextvars.ContextVar("loongforge_attention_chunk", default=None)


@contextlib.contextmanager
def attention_chunks(size: int | None):
    """Inside, every attention call lets a query see only the keys of its chunk of ``size`` positions (module
    docstring); None: no change."""
    token = _CHUNK.set(size)
    try:
        yield
    finally:
        _CHUNK.reset(token)


def within_chunks(allowed: torch.Tensor, *, size: int, q_offset: int) -> torch.Tensor:
    """``allowed`` (bool ``[.., sq, skv]``, True = may attend; query i at key position ``q_offset + i``) cut to each
    query's chunk: positions counted from the first key the query may see."""
    sq, skv = allowed.shape[-2:]
    first = allowed.int().argmax(dim=-1, keepdim=True)  # NOTE: a row with no allowed key keeps none
    keys = torch.arange(skv, device=allowed.device)
    queries = torch.arange(q_offset, q_offset + sq, device=allowed.device)[:, None]
    return allowed & (torch.div(keys - first, size, rounding_mode="floor")
                      == torch.div(queries - first, size, rounding_mode="floor"))


def _refuse_chunks(where: str) -> None:
    if _CHUNK.get() is not None:
        raise ValueError(f"chunked attention (Llama 4's attention_chunk_size) is not supported with {where}; generate "
                         "with the dynamic KV cache (and cp_kv_cache='replicated' under context parallelism).")


def _refuse_blocks(where: str) -> None:
    if _BLOCKS.get() is not None:
        raise ValueError(f"bidirectional attention blocks (Gemma 3's images) are not supported with {where}.")


def _sinks_now() -> Sinks | None:
    rule = _SCORES.get()
    return None if rule is None else rule.sinks


def _refuse_softcap() -> None:
    rule = _SCORES.get()
    if rule is not None and rule.softcap is not None:
        raise ValueError("attention logit soft-capping (Gemma 2) is not supported with a KV cache sharded over "
                         "context-parallel ranks; generate with context_parallel_size=1.")


def _materialised(query, key, value, attn_mask, *, scale: float, rule: _ScoreRule, dropout_p: float) -> torch.Tensor:
    """transformers' eager attention under ``rule``: ``[b, h, sq, d]`` over ``[b, h_kv, skv, d]`` under ``attn_mask``
    (bool True = may attend, or float added); the scores soft-capped, masked, then a sink column appended, softmaxed
    in fp32 and the sink's probability dropped. Rows with no allowed key give zeros."""
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale
    if rule.softcap is not None:
        scores = torch.tanh(scores / rule.softcap) * rule.softcap
    if attn_mask.dtype == torch.bool:
        scores = scores.masked_fill(~attn_mask, float("-inf"))
    else:
        scores = scores + attn_mask
    if rule.sinks is None:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
        probs = torch.nan_to_num(probs, nan=0.0)  # NOTE: a fully masked row: zeros, as SDPA's
    else:  # NOTE: a fully masked row puts all its mass on the sink: zeros too
        scores = scores.float()
        if isinstance(rule.sinks, torch.Tensor):
            column = rule.sinks.float().view(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1)
        else:
            column = scores.new_full((*scores.shape[:-1], 1), float(rule.sinks))
        probs = torch.softmax(torch.cat((scores, column), dim=-1), dim=-1)[..., :-1]
    probs = probs.to(query.dtype)
    if dropout_p:
        probs = F.dropout(probs, p=dropout_p)
    return torch.matmul(probs, value)


def _sink_weight(lse: torch.Tensor, sinks: Sinks) -> torch.Tensor:
    """``sigmoid(lse - sink)`` for ``lse [b, h, sq]`` (fp32): the share of a row's softmax mass its keys keep."""
    sink = sinks.float().view(1, -1, 1) if isinstance(sinks, torch.Tensor) else float(sinks)
    return torch.sigmoid(lse - sink)


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
    Under ``attention_scores`` (a soft-cap, sinks) the scores are materialised (``_materialised``), but for sinks on
    CUDA where the flash kernel serves (``sink_attention``) and a soft-cap where its kernels do (``softcap_attention``).
    """
    sq, skv = query.shape[-2], key.shape[-2]
    natural = skv - sq
    q_offset = natural if q_offset is None else q_offset
    kwargs = dict(scale=scale, dropout_p=dropout_p, enable_gqa=query.shape[1] != key.shape[1])
    rule = _SCORES.get()
    same = _same_block(q_offset, sq, skv, sliding=window is not None) if causal else None
    chunk = _CHUNK.get()
    if chunk is not None and skv <= chunk:
        chunk = None  # NOTE: the keys a query may see all lie in its chunk (they span at most skv positions)
    if (rule is None and same is None and window is None and mask is None and chunk is not None and causal
            and sq == skv and q_offset == 0):
        return _causal_chunks(query, key, value, size=chunk, **kwargs)
    if (rule is None and same is None and window is None and mask is None and chunk is None
            and (not causal or q_offset == natural)):
        if not causal:
            return F.scaled_dot_product_attention(query, key, value, **kwargs)
        if sq == skv:
            return F.scaled_dot_product_attention(query, key, value, is_causal=True, **kwargs)
        if sq == 1:  # NOTE: the last query sees every key (a one-token decode step): no mask object to dispatch
            return F.scaled_dot_product_attention(query, key, value, **kwargs)
        return F.scaled_dot_product_attention(query, key, value, attn_mask=causal_lower_right(sq, skv), **kwargs)
    aligned = mask is None and same is None and chunk is None and (not causal or q_offset == natural)
    if aligned and sink_attention.usable(query, key, value, dropout_p=dropout_p, rule=rule):
        return sink_attention.dense(query, key, value, sinks=rule.sinks, causal=causal, scale=scale, window=window)
    if same is None and chunk is None and softcap_attention.usable(query, key, value, mask, dropout_p=dropout_p,
                                                                   rule=rule):
        return softcap_attention.softcap_attention(query, key, value, cap=rule.softcap, scale=scale, causal=causal,
                                                   q_offset=q_offset, window=window, mask=mask)
    rel = (torch.arange(skv, device=query.device)[None, :]
           - torch.arange(q_offset, q_offset + sq, device=query.device)[:, None])
    allowed = torch.ones(sq, skv, dtype=torch.bool, device=query.device)
    behind = torch.ones(sq, skv, dtype=torch.bool, device=query.device)  # NOTE: the window's bound behind the query
    if causal:
        allowed &= rel <= 0
    if window is not None:
        left, right = window
        if left >= 0:
            behind = rel >= -left
        if right >= 0:
            allowed &= rel <= right
    allowed &= behind
    if same is not None:  # NOTE: AND(window, OR(causal, blockwise)); not windowed: OR(AND(window, causal), blockwise)
        allowed = (allowed | (same & behind if _BLOCKS.get().windowed else same)).unsqueeze(1)
        mask = mask & ~same.unsqueeze(1) if mask is not None and mask.dtype == torch.bool else mask
    if mask is None:
        attn_mask = allowed
    elif mask.dtype == torch.bool:
        attn_mask = allowed & ~mask
    else:
        attn_mask = mask.to(query.dtype).masked_fill(~allowed, float("-inf"))
    if chunk is not None:
        if attn_mask.dtype == torch.bool:
            attn_mask = within_chunks(attn_mask, size=chunk, q_offset=q_offset)
        else:
            attn_mask = attn_mask.masked_fill(~within_chunks(attn_mask > float("-inf"), size=chunk, q_offset=q_offset),
                                              float("-inf"))
    if rule is not None:
        return _materialised(query, key, value, attn_mask, scale=scale, rule=rule, dropout_p=dropout_p)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, **kwargs)


def _causal_chunks(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, size: int, **kwargs) -> torch.Tensor:
    """Causal attention within chunks of ``size`` positions, queries and keys the same tokens without a mask: the
    whole chunks as one batch of causal SDPA calls (the fused kernels), the last partial chunk apart; no ``[s, s]``
    mask. The chunks then start at position 0, as ``within_chunks`` counts them without padding or documents."""
    batch, heads, seq = query.shape[:3]
    count = seq // size
    outs = []
    if count:
        def fold(x):  # NOTE: [b, h, count * size, d] -> [b * count, h, size, d]
            return x[:, :, :count * size].unflatten(2, (count, size)).transpose(1, 2).flatten(0, 1)

        out = F.scaled_dot_product_attention(fold(query), fold(key), fold(value), is_causal=True, **kwargs)
        outs.append(out.unflatten(0, (batch, count)).transpose(1, 2).flatten(2, 3))
    if count * size < seq:
        rest = slice(count * size, seq)
        outs.append(F.scaled_dot_product_attention(query[:, :, rest], key[:, :, rest], value[:, :, rest],
                                                   is_causal=True, **kwargs))
    return torch.cat(outs, dim=2)


def masked_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, allowed: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Attention of ``query [b, h, sq, d]`` over ``key / value [b, h_kv, skv, d]`` under ``allowed`` (bool, True = may
    attend, broadcast to ``[b, h, sq, skv]``; every row allows a key) and the score rule of the scope: a static KV
    cache's fixed decode step over its whole buffer."""
    _refuse_chunks("a static KV cache")
    rule = _SCORES.get()
    if rule is None:
        return F.scaled_dot_product_attention(query, key, value, attn_mask=allowed, scale=scale,
                                              enable_gqa=query.shape[1] != key.shape[1])
    return _materialised(query, key, value, allowed, scale=scale, rule=rule, dropout_p=0.0)


def _cp_chunks(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, cp_rank: int, cp_size: int,
               causal: bool, scale: float, dropout_p: float, window, mask) -> torch.Tensor:
    """This rank's two query chunks ``[b, h, 2c, d]`` against the global keys ``[b, h_kv, 2 * cp * c, d]``."""
    chunk = query.shape[-2] // 2
    outs = []
    for half, j in enumerate((cp_rank, 2 * cp_size - 1 - cp_rank)):
        rows = slice(half * chunk, (half + 1) * chunk)
        # NOTE: under a causal rule chunk j sees nothing past its own end (but for bidirectional blocks): later keys
        # are not even passed in.
        end = (j + 1) * chunk if causal and _BLOCKS.get() is None else key.shape[-2]
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
    Triton) ``_blocked_partial_attention``. The scope's sinks are not applied here (a share's log-sum-exp is not the
    row's): ``combine_partial_attention`` applies them; its soft-cap is refused."""
    _refuse_softcap()
    _refuse_blocks("a KV cache sharded over context-parallel ranks")
    _refuse_chunks("a KV cache sharded over context-parallel ranks")
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
    are all-gathered as they are and combined in one kernel (the same split count on every rank). The scope's sinks
    weight the merged result by its total log-sum-exp; its soft-cap is refused."""
    _refuse_softcap()
    _refuse_chunks("a KV cache sharded over context-parallel ranks")
    sinks = _sinks_now()
    kernels = _decode_kernels(query, key, value)
    if kernels is not None:
        mine = kernels.split_partials(query, key, value, allowed=allowed, scale=scale)
        every = mine.new_empty((dist.get_world_size(group) * mine.shape[0], *mine.shape[1:]))
        _all_gather(every, mine, group=group)
        shape = (*query.shape[:3], value.shape[-1])
        if sinks is None:
            return kernels.combine(every, shape, dtype=query.dtype, with_lse=False)
        out, lse = kernels.combine(every, shape)
        return (out * _sink_weight(lse, sinks).unsqueeze(-1)).to(query.dtype)
    out, lse = partial_attention(query, key, value, allowed=allowed, scale=scale)
    return merge_partial_attention(out, lse, group, sinks=sinks).to(query.dtype)


def merge_partial_attention(out: torch.Tensor, lse: torch.Tensor, group, *,
                            sinks: Sinks | None = None) -> torch.Tensor:
    """The attention over every rank's share of the keys from each rank's ``partial_attention`` (``out [b, h, sq, d]``,
    ``lse [b, h, sq]``, fp32) -> ``[b, h, sq, d]`` fp32 on every rank of ``group``: one all-gather of both, then each
    share weighted by its softmax mass (``exp(lse_r - max lse)``; ``sinks``: ``combine_partial_attention``). Rows no
    rank attends anywhere give zeros."""
    mine = torch.cat((out, lse.unsqueeze(-1)), dim=-1).unsqueeze(0)
    every = mine.new_empty((dist.get_world_size(group), *mine.shape[1:]))
    _all_gather(every, mine.contiguous(), group=group)
    return combine_partial_attention(every[..., :-1], every[..., -1], sinks=sinks)


def combine_partial_attention(outs: torch.Tensor, lses: torch.Tensor, *, sinks: Sinks | None = None) -> torch.Tensor:
    """``partial_attention``'s results of every share, stacked (``outs [r, b, h, sq, d]``, ``lses [r, b, h, sq]``)
    -> the attention over all the shares' keys ``[b, h, sq, d]``; with ``sinks`` (``[h]`` or a float) times
    ``sigmoid(lse - sink)``, ``lse`` the log-sum-exp over every share: what a sink column in the softmax gives."""
    top = lses.amax(dim=0)
    shift = top.masked_fill(top == float("-inf"), 0.0)
    weights = torch.exp(lses - shift)  # NOTE: exp(-inf) = 0 for empty shares
    total = weights.sum(dim=0)
    kept = total.clamp(min=torch.finfo(total.dtype).tiny)
    out = (weights.unsqueeze(-1) * outs).sum(dim=0) / kept.unsqueeze(-1)
    if sinks is None:
        return out
    # NOTE: masked_fill, not log(0): a row no share attends gets -inf (weight 0) and no NaN in the backward
    lse = (shift + torch.log(kept)).masked_fill(total == 0, float("-inf"))
    return out * _sink_weight(lse, sinks).unsqueeze(-1)


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
    return (_varlen_attn is not None and _SCORES.get() is None and _CHUNK.get() is None
            and query.device.type == "cuda" and cp_size == 1
            and dropout_p == 0.0 and query.dtype in (torch.float16, torch.bfloat16) and "window_size" in _VARLEN_KWARGS
            and (not gqa or "enable_gqa" in _VARLEN_KWARGS))


def _varlen_bounds(params: PackedSeqParams) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """(cu_seqlens_q, cu_seqlens_kv, max_q, max_kv) for a varlen kernel: padded documents span their padded extent,
    as on the torch path."""
    cu_q = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
    cu_kv = params.cu_seqlens_kv_padded if params.cu_seqlens_kv_padded is not None else params.cu_seqlens_kv
    cu_kv = cu_q if cu_kv is None else cu_kv
    padded = params.cu_seqlens_q_padded is not None or params.cu_seqlens_kv_padded is not None
    max_q = params.max_seqlen_q if params.max_seqlen_q is not None and not padded else int(cu_q.diff().max())
    max_kv = params.max_seqlen_kv if params.max_seqlen_kv is not None and not padded else int(cu_kv.diff().max())
    return cu_q, cu_kv, max_q, max_kv


def _varlen(query, key, value, params: PackedSeqParams, *, causal: bool, scale: float, window) -> torch.Tensor:
    """torch's flash-attention varlen kernel."""
    cu_q, cu_kv, max_q, max_kv = _varlen_bounds(params)
    left, right = window if window is not None else (-1, -1)
    gqa = {"enable_gqa": True} if query.shape[1] != key.shape[1] else {}
    return _varlen_attn(query, key, value, cu_q.to(torch.int32), cu_kv.to(torch.int32), max_q, max_kv, scale=scale,
                        window_size=(left, 0) if causal else (left, right), **gqa)


def packed_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, params: PackedSeqParams, *,
                     causal: bool, scale: float, dropout_p: float = 0.0, window: tuple[int, int] | None = None,
                     cp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Packed documents: ``query [t, h, d]``, ``key / value [t_kv, h_kv, d]`` -> ``[t, h, d_v]``, no attention across
    documents. Under context parallelism the ``cu_seqlens`` are global and every document is load-balanced."""
    _refuse_blocks("packed (thd) sequences")
    cp_size = dist.get_world_size(cp_group) if cp_group is not None else 1
    if _varlen_usable(query, key, cp_size=cp_size, dropout_p=dropout_p):
        return _varlen(query, key, value, params, causal=causal, scale=scale, window=window)
    rule = _SCORES.get()
    if (cp_size == 1 and _CHUNK.get() is None
            and sink_attention.usable(query, key, value, dropout_p=dropout_p, rule=rule)):
        return sink_attention.packed(query, key, value, *_varlen_bounds(params), sinks=rule.sinks, causal=causal,
                                     scale=scale, window=window)
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
        if config.softmax_type not in ("vanilla", "off-by-one", "learnable"):
            raise ValueError(f"loongforge CoreAttention: softmax_type must be 'vanilla', 'off-by-one' or 'learnable', "
                             f"got {config.softmax_type!r}.")
        self.softmax_type = config.softmax_type
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
        if config.softmax_type == "learnable":
            device = torch.device("cpu") if config.use_cpu_initialization else get_backend().device()
            self.softmax_offset = torch.nn.Parameter(torch.zeros(self.num_heads_per_partition,
                                                                 dtype=config.params_dtype, device=device))
            set_tensor_model_parallel_attributes(self.softmax_offset, is_parallel=True, dim=0, stride=1)
        else:
            self.softmax_offset = None

    @property
    def sinks(self) -> Sinks | None:
        """The attention sinks of ``softmax_type`` (module docstring): ``softmax_offset`` (``learnable``), 0.0
        (``off-by-one``) or None (``vanilla``)."""
        if self.softmax_offset is not None:
            return self.softmax_offset
        return 0.0 if self.softmax_type == "off-by-one" else None

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        """``softmax_offset`` (where learnable) split along dim 0 over tensor parallelism, as megatron's
        ``DotProductAttention``; nothing else."""
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix,
                                                   {"softmax_offset": 0}, sharded_offsets, tp_group=self.tp_group,
                                                   dp_cp_group=metadata["dp_cp_group"])

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
        with self._dropout_context(dropout_p), attention_scores(softcap=self.softcap, sinks=self.sinks):
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
