"""A KV cache for ``generate()``: a ``transformers.Cache`` whose layers our core attention writes into.

Choices:
- Where: at the core-attention level, not megatron-core's ``inference_context``. megatron's static inference context
  preallocates ``[max_seq, max_batch]`` buffers, keeps the keys before the rotary embedding and rotates every cached
  key again on each step, turns the causal mask off after the prefill (``AttnMaskType.no_mask``), and must be threaded
  through every call of our runtime (one-stage, pipelined, interleaved): it knows neither transformers' left-padding
  masks nor beam reordering, nor the padding our runtime adds for sequence parallelism. Our ``CoreAttention`` gets
  the keys after the rotary embedding already; caching them there keeps megatron's attention module, the schedules
  and the runtime as they are.
- What: ``LoongKVCache`` is a ``transformers.Cache`` of ``DynamicLayer``s (transformers' default dynamic layer: keys
  and values ``[batch, kv heads, seq, head dim]`` grown by concatenation), one per core attention of this rank, in
  module order over its pipeline stage(s) / virtual chunks. Each rank holds its own tensor-parallel share of the KV
  heads. transformers' generate drives it as it drives ``DynamicCache``: ``get_seq_length``, ``reorder_cache`` (beam
  search), ``batch_repeat_interleave``. It is made per generate call (``for_model``); a cache passed in is refused.
- Gated DeltaNet layers (Qwen3.5's linear attention: a recurrent state, no keys), Mamba2 layers (Granite 4.0 H's: a
  conv and an SSM state) and LFM2's short-conv layers (a conv state): after the attentions' layers the cache holds one
  of transformers' ``LinearAttentionLayer`` per such layer of this rank (as transformers' dynamic cache does for
  Qwen3.5, Granite 4.0 H and LFM2: the conv and the recurrent state; beam search reorders them, ``restart`` zeroes
  them); a cached step gives each layer its states through an instance ``forward`` too (``bridges/gated_deltanet.py``:
  ``CachedStep``, with the step's new tokens and which of them transformers' mask marks as padding;
  ``bridges/mamba2.py``, ``bridges/short_conv.py``). Their steps
  have no CP split (under context parallelism the split prefill cannot fill their states: ``patched`` refuses it,
  so such models generate without the cache there) nor a fixed-shape form (the static cache is refused).
- An attention whose class names a ``kv_cache_layer`` (DeepSeek Sparse Attention's ``SparseAttention``: keys,
  values and its indexer's keys) counts as a core attention here, gets a layer of that class, and during a cached
  step runs its class's forward with ``cached=(its layer, the step)`` (``own_cached_attention``); it computes its
  attention over the cache itself (no CP-sharded cache).
- How a step runs (``forward_with_cache``): the new tokens are right-padded to ``sequence_multiple`` (sequence
  parallelism) as the uncached forward pads them; while the step runs, ``attached`` gives each core attention of the
  model an instance ``forward`` (the class's stays: no cost outside generate) that appends the first ``given`` new
  keys / values (never the padding) to its cache layer and attends the new queries over cache + new keys, causally
  (query i at slot ``past + i``), with transformers' 2-D padding mask over all slots: cached padding keys of
  left-padded rows stay masked. The new padding keys take part in that step only (after every real query, so
  causality hides them) and are dropped.
- A core attention with its own rule over the keys (Doge's dynamic mask, ``bridges/doge_layers.py``) defines
  ``attend_over_cache(query, keys, values, *, past, mask)`` (``[b, h, s, d]`` each, ``mask`` as ``_Step.mask``):
  a cached step hands it the cached and new keys in place of ``sdpa``; a cache sharded over CP refuses it.
- Rotary positions (text models): megatron's ``GPTModel`` does not read ``position_ids`` for the 1-D rotary
  embedding; it rotates the tokens of a forward by their slot ``0..s-1`` in the (left-padded) sequence, and so does
  the uncached generate.
  Cached steps keep that: ``attached`` sets every ``RotaryEmbedding`` of the chunks (GPTModel's, MLA's) to start at
  ``offset = past``, so a new token is rotated by its slot in the whole sequence, as it would be without the cache.
  Attention depends on the distance between positions only, which equals transformers' (position ids counted from
  the first real token). Image-text models (mRoPE) are different: megatron's ``MultimodalRotaryEmbedding`` does read
  the ``[3, b, s]`` position ids (no ``RotaryEmbedding``, so ``attached`` leaves it alone); their generate passes
  each step's positions (``multimodal/generation.py``) and runs the step through ``cached_step``.
- Context parallelism: the cache is sharded over the CP group (``CPShard``): rank r holds the keys and values of the
  slots ``s`` with ``s % CP == r`` (round robin, so the prompt's and each new token's spread evenly: a rank holds
  1 / CP of the cache). The prefill (the first cached forward, the prompt) is split over the CP group as the forward
  without a cache is (``split_prefill_step``: 2 x CP load-balanced chunks, each rank's rotary rows and logits as
  there): each attention all-gathers the keys and values in global order (as ``kernels/attention.py`` does under
  CP), keeps its share of the prompt's (not the layout's padding) in its cache and attends its own query chunks over
  them all (transformers' padding mask over the keys). A later cached step of one token cannot be split into 2 x CP
  load-balanced chunks, so it runs the whole step's tokens on every rank of the CP group
  (``context_parallel.whole_sequence_on_every_rank``: no CP split of the inputs, no CP gather of the logits, the
  modules that take their CP share themselves hold no CP group); each attention adds the new tokens of its slots to
  its share, attends the queries over its share (outputs and their log-sum-exps) and one all-gather over the group
  merges the shares, which equals attention over the whole cache (``kernels.attention.sharded_attention``: on a GPU
  the Triton split-key kernels, every rank's splits combined in one kernel). megatron's 1-D rotary embedding counts
  a CP rank's rotary length times CP and takes its CP share of the table: ``attached`` gives it the whole sequence's
  rows instead (the 3-D one of image-text models reads positions: it only loses its CP group). The static cache's
  buffers hold a rank's share too (``static_cache.py``). ``generate(cp_kv_cache="replicated")``
  (``shard_over_cp=False``) keeps the whole cache on every CP rank instead: the prefill writes all the prompt's keys
  there and the decode steps attend over it without a merge. ``cached_forward`` picks the step; image-text models go
  through it too (``multimodal/generation.py``).
  ``forward`` refuses labels with a cache.
"""

from __future__ import annotations

import contextlib
import functools
import types
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache, DynamicLayer, LinearAttentionLayer

from loongforge_hf.parallel.context_parallel import cp_group_and_size, cp_group_holders, whole_sequence_on_every_rank


class LoongKVCache(Cache):
    """transformers' ``Cache`` of one ``DynamicLayer`` per core attention on this rank (see the module docstring)."""

    def __init__(self, chunks, layer=DynamicLayer, layers: list | None = None, shard_over_cp: bool = True) -> None:
        # NOTE: the modules are found once, when generate makes the cache (a walk over every module of the model
        # each step cost more than a decode step's attention)
        self.chunks = list(chunks)
        self.attentions, self.rotary_embeddings = core_attentions(self.chunks), _rotary_embeddings(self.chunks)
        self.recurrent = recurrent_mixers(self.chunks)
        self.kv_sources = kv_sources(self.attentions)
        if layers is not None and len(layers) != len(self.attentions):
            raise ValueError(f"KV cache: {len(layers)} layers for {len(self.attentions)} attentions.")
        # NOTE: an attention with a cache layer of its own (own_cached_attention) gets one of that class
        layers = list(layers) if layers is not None else [getattr(type(a), "kv_cache_layer", layer)()
                                                          for a in self.attentions]
        # NOTE: the Gated DeltaNets' / Mamba2 layers' states after the attentions' layers (module docstring)
        super().__init__(layers=layers + [LinearAttentionLayer() for _ in self.recurrent])
        # NOTE: what a step run whole on every CP rank strips of its CP group (context_parallel.py)
        self.cp_holders = cp_group_holders(self.chunks) \
            if any(getattr(a, "cp_group", None) is not None for a in self.attentions) else []
        self.filled = 0  # NOTE: tokens cached, counted on the host (a static layer's own count is a device tensor)
        # NOTE: this rank's share of the cache under CP (module docstring); None: the whole cache on every CP rank
        self.shard = cp_shard() if shard_over_cp else None

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.filled

    def restart(self) -> None:
        """Empty the cache (static buffers kept, zeroed): the next step prefills the whole sequence again."""
        for layer in self.layers:
            layer.reset()
        self.filled = 0

    def fixed_step(self, model, *, input_ids: torch.Tensor, attention_mask,
                   position_ids: torch.Tensor | None = None) -> torch.Tensor | None:
        """The logits of a step this cache runs at a fixed shape, or None: the step runs through ``cached_step``
        (always, for this dynamic cache; ``static_cache.LoongStaticCache`` runs its one-token decode steps).
        ``position_ids``: an image-text model's ``[3, b, new]`` mRoPE positions, a model with learned absolute
        positions' ``[b, new]`` (rotary text models: None)."""
        return None

    @classmethod
    def for_model(cls, model, *, shard_over_cp: bool = True) -> "LoongKVCache":
        """A cache for ``model``'s core attentions on this rank, in order over its chunks."""
        return cls(model.chunks, shard_over_cp=shard_over_cp)


@dataclass(frozen=True)
class CPShard:
    """A rank's share of the cache under context parallelism: the slots ``s`` with ``s % size == rank`` (round robin:
    the prompt's and each generated token's keys spread evenly)."""

    group: object
    size: int
    rank: int

    def count(self, slots: int) -> int:
        """How many of the slots ``0 .. slots - 1`` are this rank's."""
        return len(range(self.rank, slots, self.size))

    def first(self, start: int) -> int:
        """The offset from ``start`` of this rank's first slot at or after it."""
        return (self.rank - start) % self.size


def cp_shard() -> CPShard | None:
    """This rank's ``CPShard`` of the CP group, or None without context parallelism."""
    group, size, rank = cp_group_and_size()
    return CPShard(group, size, rank) if size > 1 else None


@dataclass(frozen=True)
class _Step:
    """One cached forward: ``past`` tokens cached, ``given`` new ones run (``padded`` with the layout's padding),
    ``mask``: ``[b, 1, 1, past + padded]`` True where a key is padding, or None."""

    past: int
    given: int
    padded: int
    mask: torch.Tensor | None
    cp: int = 1  # NOTE: the context-parallel size: the step runs whole on each of those ranks
    # NOTE: under a CP-sharded cache, per attention window the keys each query may see (``_share_allowed``), made by
    # the step's first attention of that window and read by the others
    share_allowed: dict = field(default_factory=dict, compare=False)


def core_attentions(chunks) -> list:
    """This rank's core attention modules, in order over its chunks (one per layer): ours, and those that keep their
    own cache layer (``kv_cache_layer``, ``own_cached_attention``)."""
    from loongforge_hf.kernels.attention import CoreAttention

    return [m for chunk in chunks for m in chunk.modules()
            if isinstance(m, CoreAttention) or hasattr(type(m), "kv_cache_layer")]


def kv_sources(attentions) -> list[int | None]:
    """For each core attention, the index of the one whose keys and values it reuses (its ``kv_source``: Gemma 4's
    KV-shared layers, ``bridges/gemma4_attention.py``), or None: such a layer caches nothing and reads that one's
    cache layer, filled by then in the same step."""
    where = {id(a): i for i, a in enumerate(attentions)}
    return [where[id(a.kv_source.module)] if getattr(a, "kv_source", None) is not None else None
            for a in attentions]


def recurrent_mixers(chunks) -> list:
    """This rank's Gated DeltaNet, Mamba2, Mamba-1 (Zamba's multi-head one too) and LFM2 short-conv layers
    (``bridges/gated_deltanet.py``, ``bridges/mamba2.py``, ``bridges/mamba1.py``, ``bridges/zamba_mixer.py``,
    ``bridges/short_conv.py``), MiniMax's lightning-attention layers
    (``bridges/lightning_attention.py``) and RecurrentGemma's recurrent blocks (``bridges/recurrent_gemma_block.py``),
    in order over its chunks."""
    from loongforge_hf.bridges.gated_deltanet import GatedDeltaNet
    from loongforge_hf.bridges.lightning_attention import LightningAttention
    from loongforge_hf.bridges.mamba1 import MambaMixer
    from loongforge_hf.bridges.mamba2 import Mamba2Mixer
    from loongforge_hf.bridges.recurrent_gemma_block import RecurrentBlock
    from loongforge_hf.bridges.short_conv import ShortConvMixer
    from loongforge_hf.bridges.zamba_mixer import ZambaMixer

    return [m for chunk in chunks for m in chunk.modules()
            if isinstance(m, (GatedDeltaNet, Mamba2Mixer, MambaMixer, ShortConvMixer, LightningAttention,
                              RecurrentBlock, ZambaMixer))]


def refuse_megatron_state_inputs(kind: str, inference_context, packed_seq_params) -> None:
    """A recurrent mixer's (``kind``: "Gated DeltaNet", "Mamba2") refusal of megatron's inference context (generate
    keeps its states here) and THD packed sequences (documents are packed into rows)."""
    if inference_context is not None:
        raise ValueError(f"{kind} layers do not take megatron's inference_context: generate() keeps their states in "
                         "its own cache (loongforge_hf.kv_cache).")
    if packed_seq_params is not None:
        raise ValueError(f"{kind} layers do not take THD packed_seq_params; pack documents into rows (position ids "
                         "restarting at 0).")


def _rotary_embeddings(chunks) -> list:
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding

    return [m for chunk in chunks for m in chunk.modules() if isinstance(m, (RotaryEmbedding, YarnRotaryEmbedding))]


def _cached_attention(module, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                      packed_seq_params=None, *, cache: LoongKVCache, index: int, step: _Step):
    """Stands in for ``CoreAttention.forward`` during a cached step: ``query [sq, b, h, d]``, ``key / value
    [sq, b, h_kv, d]`` of the new (padded) tokens -> ``[sq, b, h * d_v]`` over cache + new keys."""
    from loongforge_hf.kernels.attention import CAUSAL_MASK_TYPES, attention_scores, sdpa

    mask_type = attn_mask_type if attn_mask_type is not None else module.attn_mask_type
    if attention_bias is not None or packed_seq_params is not None or mask_type not in CAUSAL_MASK_TYPES:
        raise ValueError("KV cache: causal attention without attention_bias or packed sequences only.")
    k, v = key.permute(1, 2, 0, 3), value.permute(1, 2, 0, 3)  # [b, h_kv, s, d]
    if cache.shard is not None:
        if getattr(module, "attend_over_cache", None) is not None:
            raise ValueError("KV cache: this attention's own rule over the cache (attend_over_cache) does not take "
                             "a cache sharded over context parallelism.")
        # NOTE: a soft-cap is refused there; sinks weight the merged shares
        with attention_scores(softcap=module.softcap, sinks=module.sinks):
            return _sharded_attention(module, query, k, v, cache=cache, index=index, step=step)
    source = cache.kv_sources[index]
    if source is None:
        keys, values = cache.update(k[:, :, :step.given], v[:, :, :step.given], index)
    else:  # NOTE: k / v are the source's new keys and values (its core attention's, handed on by a pre-hook)
        keys, values = cache.layers[source].keys, cache.layers[source].values
    # NOTE: a static layer returns its whole buffer: the filled slots only (a dynamic layer's keys are those)
    keys, values = keys[:, :, :step.past + step.given], values[:, :, :step.past + step.given]
    if step.padded > step.given:  # NOTE: the layout's padding: seen by this step only, never cached
        keys = torch.cat((keys, k[:, :, step.given:]), dim=2)
        values = torch.cat((values, v[:, :, step.given:]), dim=2)
    attend = getattr(module, "attend_over_cache", None)
    if attend is not None:  # NOTE: a core attention's own rule over the whole cache (Doge's dynamic mask)
        out = attend(query.permute(1, 2, 0, 3), keys, values, past=step.past, mask=step.mask)
        return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)
    with attention_scores(softcap=module.softcap, sinks=module.sinks):
        out = sdpa(query.permute(1, 2, 0, 3), keys, values, causal=True, scale=module.softmax_scale,
                   window=module.window, mask=step.mask)
    return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)


def _sharded_attention(module, query, k, v, *, cache: LoongKVCache, index: int, step: _Step) -> torch.Tensor:
    """``_cached_attention`` under context parallelism with the cache sharded over the CP group (``CPShard``): this
    rank's new keys / values ``k / v [b, h_kv, padded, d]`` (slots ``past ..``) join its share, the queries (the
    whole step's, on every CP rank) attend over the share, and the group merges the shares' results."""
    from loongforge_hf.kernels.attention import sharded_attention

    shard = cache.shard
    k, v = k[:, :, shard.first(step.past)::shard.size], v[:, :, shard.first(step.past)::shard.size]
    filled = shard.count(step.past + step.given)
    kept = filled - shard.count(step.past)  # NOTE: its new tokens, not the layout's padding (never cached)
    keys, values = cache.update(k[:, :, :kept], v[:, :, :kept], index)
    keys, values = keys[:, :, :filled], values[:, :, :filled]
    if kept < k.shape[2]:
        keys, values = torch.cat((keys, k[:, :, kept:]), dim=2), torch.cat((values, v[:, :, kept:]), dim=2)
    allowed = step.share_allowed.get(module.window)
    if allowed is None:
        allowed = step.share_allowed[module.window] = _share_allowed(step, shard, module.window, query.device)
    out = sharded_attention(query.permute(1, 2, 0, 3), keys, values, allowed=allowed, scale=module.softmax_scale,
                            group=shard.group)
    return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)


def _share_allowed(step: _Step, shard: CPShard, window, device) -> torch.Tensor:
    """``[b | 1, 1, padded, keys]``: which of this rank's keys (its slots up to ``past + padded``) each query of the
    step may see: causal, megatron's window ``(left, right)``, transformers' padding mask."""
    slots = torch.arange(shard.rank, step.past + step.padded, shard.size, device=device)  # NOTE: the keys' slots
    places = torch.arange(step.past, step.past + step.padded, device=device)[:, None]  # NOTE: the queries'
    allowed = slots[None, :] <= places
    if window is not None and window[0] >= 0:
        allowed &= slots[None, :] >= places - window[0]
    return allowed[None, None] if step.mask is None else allowed[None, None] & ~step.mask[..., slots]


@contextlib.contextmanager
def patched(chunks, cache: LoongKVCache, attention_forward, rope_forward, recurrent_step=None):
    """Inside, the core attention number ``i`` of ``cache`` (made for ``chunks``) runs ``attention_forward(i)`` as its
    ``forward`` (a function of the module's forward arguments), each of its rotary embeddings
    ``rope_forward(i, rope)`` and its Gated DeltaNet / Mamba2 layer number ``j`` its own forward with
    ``cached=recurrent_step(j)``
    (instance attributes, removed at the end; the class's stay)."""
    if len(chunks) != len(cache.chunks) or any(a is not b for a, b in zip(chunks, cache.chunks)):
        raise ValueError("KV cache: the cache was made for another model's attention layers; use a cache made by "
                         "this model's generate().")
    if cache.recurrent and recurrent_step is None:
        raise ValueError("KV cache: this step cannot carry the states of recurrent (Gated DeltaNet / Mamba2) layers; "
                         "under context parallelism generate with use_cache=False (or with context_parallel_size=1).")
    for index, module in enumerate(cache.attentions):
        module.forward = types.MethodType(attention_forward(index), module)
    for index, rope in enumerate(cache.rotary_embeddings):
        rope.forward = rope_forward(index, rope)
    for index, module in enumerate(cache.recurrent):
        module.forward = functools.partial(type(module).forward, module, cached=recurrent_step(index))
    try:
        yield
    finally:
        for module in (*cache.attentions, *cache.rotary_embeddings, *cache.recurrent):
            del module.forward


def attached(chunks, cache: LoongKVCache, step: _Step):
    """Inside, the core attentions of ``chunks`` (the cache's) read and extend ``cache`` and their rotary embeddings
    start at slot ``step.past`` (``patched``)."""
    def rope_forward(index, rope):
        return functools.partial(type(rope).forward, rope, offset=step.past) if step.cp == 1 \
            else functools.partial(_whole_sequence_rope, rope, step.past, step.cp)

    def attention_forward(index):
        own = hasattr(type(cache.attentions[index]), "kv_cache_layer")
        return functools.partial(own_cached_attention if own else _cached_attention, cache=cache, index=index,
                                 step=step)

    return patched(chunks, cache, attention_forward, rope_forward, functools.partial(_recurrent_step, cache, step))


def own_cached_attention(module, *args, cache: LoongKVCache, index: int, step: _Step, prefill: bool = False,
                         **kwargs):
    """Stands in for the forward of an attention that keeps its own cache layer (its class's ``kv_cache_layer``, a
    ``transformers`` cache layer class: DeepSeek Sparse Attention's, ``bridges/sparse_attention.py``) during a
    cached step: its class's forward with ``cached=(its cache layer, the step)`` (``_Step``: ``past`` cached slots,
    ``given`` new tokens of the ``padded`` ones the step runs, the key padding ``mask``); with ``prefill``, in the
    prompt split over CP (``split_prefill_step``), ``prefill=(its cache layer, the step)``."""
    if cache.shard is not None:
        raise ValueError(f"KV cache: {type(module).__name__} does not take a cache sharded over context parallelism "
                         "(generate with cp_kv_cache='replicated').")
    return type(module).forward(module, *args, **{"prefill" if prefill else "cached": (cache.layers[index], step)},
                                **kwargs)


def _recurrent_step(cache: LoongKVCache, step: _Step, index: int):
    """The ``CachedStep`` of ``cache``'s Gated DeltaNet / Mamba2 layer number ``index`` (its states after the
    attentions' layers):
    the step's new tokens, those transformers' mask marks as padding."""
    from loongforge_hf.bridges.recurrent_common import CachedStep

    real = None if step.mask is None else ~step.mask[:, 0, 0, step.past:step.past + step.given]
    return CachedStep(cache=cache, index=len(cache.attentions) + index, given=step.given, real=real)


@contextlib.contextmanager
def whole_sequence_ropes(chunks, cp: int):
    """Inside, the 1-D rotary embeddings of ``chunks`` give the rows of a step run whole on every CP rank from slot 0
    (an uncached generate step of an image-text model with 1-D rope: Gemma 3)."""
    ropes = _rotary_embeddings(chunks)
    for rope in ropes:
        rope.forward = functools.partial(_whole_sequence_rope, rope, 0, cp)
    try:
        yield
    finally:
        for rope in ropes:
            del rope.forward


def _whole_sequence_rope(rope, past: int, cp: int, max_seq_len: int, *args, **kwargs):
    """A rotary embedding's rows for a cached step run whole on every CP rank: megatron asks for ``tokens x CP``
    rows (a CP rank's share times CP); ``packed_seq=True`` is what skips its CP slicing of the table."""
    return type(rope).forward(rope, max_seq_len // cp, offset=past, packed_seq=True)


def check_step_mask(attention_mask: torch.Tensor, *, batch: int, length: int) -> None:
    """A cached step's ``attention_mask`` is transformers' 2-D one over the cached and the new tokens."""
    if attention_mask.dim() != 2 or tuple(attention_mask.shape) != (batch, length):
        raise ValueError(f"forward with a KV cache: attention_mask must be [batch, cached + new tokens] = "
                         f"[{batch}, {length}], got {list(attention_mask.shape)}.")


def _key_padding_mask(attention_mask, *, batch: int, past: int, given: int, padded: int, device) -> torch.Tensor | None:
    """``[b, 1, 1, past + padded]`` True where a key is padding (transformers' 2-D mask, 1 = token, over the cached
    and the given tokens; the layout's padding after them), or None when nothing is padding."""
    if attention_mask is None:
        return None
    check_step_mask(attention_mask, batch=batch, length=past + given)
    if bool(attention_mask.bool().all()):
        return None  # NOTE: the layout's padding keys come after every real query: causality hides them
    keys = torch.nn.functional.pad(attention_mask.to(device).bool(), (0, padded - given), value=False)
    return ~keys[:, None, None, :]


@contextlib.contextmanager
def cached_step(model, cache: LoongKVCache, *, input_ids: torch.Tensor, attention_mask):
    """Inside, ``model``'s chunks run ``input_ids`` (``[b, given]``, the tokens after the ``cache.get_seq_length()``
    cached ones) over the cache and add their keys and values to it; yields the ids right-padded to the layout's
    ``sequence_multiple``, to be run with no attention mask (the cached attention masks padding keys itself)."""
    from loongforge_hf.trainer.data import pad_model_inputs

    batch, given = input_ids.shape
    past = cache.get_seq_length()
    # NOTE: the whole sequence on every CP rank (module docstring): padded for sequence parallelism only
    padded_ids = pad_model_inputs(input_ids, None, None, None, multiple=model.parallel.whole_sequence_multiple)[0]
    step = _Step(past=past, given=given, padded=padded_ids.shape[-1],
                 mask=_key_padding_mask(attention_mask, batch=batch, past=past, given=given,
                                        padded=padded_ids.shape[-1], device=model.device),
                 cp=model.parallel.context_parallel_size)
    whole = whole_sequence_on_every_rank(cache.cp_holders) if step.cp > 1 else contextlib.nullcontext()
    with attached(model.chunks, cache, step), whole:
        yield padded_ids
    cache.filled += given


def forward_with_cache(model, cache: LoongKVCache, *, input_ids: torch.Tensor, attention_mask, keep: int,
                       position_ids: torch.Tensor | None = None):
    """The logits (``[b, given, V]``, the last ``keep`` positions when ``keep`` > 0) of ``input_ids``, the tokens
    after the ``cache.get_seq_length()`` cached ones, on every rank; their keys and values join the cache.
    ``position_ids``: the new tokens' (generate's), read by a model with learned absolute positions or a rotation by
    position ids only (``bridges.absolute_positions.reads_positions``: default ``past ..``); other rotary models
    rotate by slot (module docstring)."""
    from loongforge_hf.bridges.absolute_positions import reads_positions, step_positions
    from loongforge_hf.bridges.runtime import forward_padded, keep_rows

    rows = keep_rows(input_ids.shape[-1], keep)
    batch, given = input_ids.shape
    if reads_positions(model.bridge):
        position_ids = step_positions(position_ids, batch=batch, past=cache.get_seq_length(), given=given,
                                      padded=given, device=model.device)
    else:
        position_ids = None

    def positions(ids):  # NOTE: the new tokens' and the layout's padding after them
        if position_ids is None:
            return None
        return step_positions(position_ids, batch=batch, past=0, given=given, padded=ids.shape[-1],
                              device=model.device)

    return cached_forward(model, cache, input_ids=input_ids, attention_mask=attention_mask,
                          position_ids=position_ids,
                          run=lambda ids: forward_padded(model, input_ids=ids, attention_mask=None,
                                                         position_ids=positions(ids), labels=None,
                                                         return_logits=True, rows=rows)[1])


def cached_forward(model, cache: LoongKVCache, *, input_ids: torch.Tensor, attention_mask, run,
                   position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """A cached forward of ``input_ids`` (the tokens after the cached ones): the cache's fixed-shape step where it
    runs one (``LoongKVCache.fixed_step``), else ``run(padded_ids)`` (the model's forward of the padded ids, with no
    attention mask, to the kept rows' logits) inside the step the cache is at: the prefill split over CP under
    context parallelism (``split_prefill_step``), else ``cached_step``. ``position_ids``: an image-text model's
    ``[3, b, new]``, or a model with learned absolute positions' ``[b, new]`` (for the fixed step)."""
    logits = cache.fixed_step(model, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
    if logits is not None:
        return logits
    step = split_prefill_step if cache.filled == 0 and model.parallel.context_parallel_size > 1 else cached_step
    with step(model, cache, input_ids=input_ids, attention_mask=attention_mask) as padded_ids:
        return run(padded_ids)


@contextlib.contextmanager
def split_prefill_step(model, cache: LoongKVCache, *, input_ids: torch.Tensor, attention_mask):
    """Inside, ``model``'s chunks run the prompt ``input_ids`` split over the CP group (the caller runs the forward
    on the yielded ids, right-padded to the layout's ``sequence_multiple``, with no attention mask: the attentions
    mask the padding keys themselves); its keys and values fill ``cache`` on every CP rank."""
    from loongforge_hf.trainer.data import pad_model_inputs

    batch, given = input_ids.shape
    padded_ids = pad_model_inputs(input_ids, None, None, None, multiple=model.parallel.sequence_multiple)[0]
    step = _Step(past=0, given=given, padded=padded_ids.shape[-1],
                 mask=_key_padding_mask(attention_mask, batch=batch, past=0, given=given,
                                        padded=padded_ids.shape[-1], device=model.device))

    def attention_forward(index):  # NOTE: an attention keeping its own cache layer fills it itself
        if hasattr(type(cache.attentions[index]), "kv_cache_layer"):
            return functools.partial(own_cached_attention, cache=cache, index=index, step=step, prefill=True)
        return functools.partial(_split_prefill_attention, cache=cache, index=index, step=step)

    with patched(model.chunks, cache, attention_forward,
                 lambda index, rope: type(rope).forward.__get__(rope)):  # NOTE: the rope as without a cache
        yield padded_ids
    cache.filled += given


def _split_prefill_attention(module, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                             packed_seq_params=None, *, cache: LoongKVCache, index: int, step: _Step):
    """Stands in for ``CoreAttention.forward`` in ``split_prefill_step``: ``query / key / value [2c, b, h, d]``, this CP
    rank's two load-balanced chunks -> ``[2c, b, h * d_v]``; the prompt's keys and values of every rank join the
    cache."""
    import torch.distributed as dist

    from loongforge_hf.kernels.attention import (CAUSAL_MASK_TYPES, _cp_chunks, _cp_global_index, _gather_kv,
                                                 attention_scores)

    mask_type = attn_mask_type if attn_mask_type is not None else module.attn_mask_type
    if attention_bias is not None or packed_seq_params is not None or mask_type not in CAUSAL_MASK_TYPES:
        raise ValueError("KV cache: causal attention without attention_bias or packed sequences only.")
    group = module.cp_group
    cp_size = dist.get_world_size(group)
    keys, values = _gather_kv(key, value, group, _cp_global_index([step.padded], cp_size, key.device))
    keys, values = keys.permute(1, 2, 0, 3), values.permute(1, 2, 0, 3)  # NOTE: [b, h_kv, padded, d], global order
    # NOTE: the prompt's keys and values: this rank's share of them (CPShard), or all of them (replicated)
    share = slice(cache.shard.rank, step.given, cache.shard.size) if cache.shard is not None else slice(step.given)
    cache.update(keys[:, :, share], values[:, :, share], index)
    with attention_scores(softcap=module.softcap, sinks=module.sinks):
        out = _cp_chunks(query.permute(1, 2, 0, 3), keys, values, cp_rank=dist.get_rank(group), cp_size=cp_size,
                         causal=True, scale=module.softmax_scale, dropout_p=0.0, window=module.window,
                         mask=step.mask)
    return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)
