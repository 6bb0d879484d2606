"""DeepSeek Sparse Attention (DSA: DeepSeek-V3.2, GLM-5) as transformers runs it: megatron-core's ``DSAIndexer`` and
``DSAttention`` (``transformer/experimental_attention_variant/dsa.py``, 0.16.1), with the pieces where megatron's
computation is not transformers' replaced.

Choices:
- megatron's lightning indexer builds what transformers' ``indexer`` holds under megatron's names (``linear_wq_b``,
  ``linear_wk``, ``k_norm``, ``linear_weights_proj``), its rotary table (plain rope or YaRN, as megatron's MLA) and
  the top-k (``min(index_topk, keys)`` per query: at sequences no longer than ``index_topk`` every causal key stays,
  as in transformers); those are used as they are. Replaced, each because it is not what transformers computes:
  - the Hadamard rotation of q and k (``rotate_activation``: bf16 only, ``fast_hadamard_transform``): transformers
    has none. It is orthogonal, so it changes the scores' rounding, not their exact values; without it the fp32
    scores are transformers' own (and bf16 ones are not rounded differently);
  - the per-head weights: transformers keeps ``weights_proj`` in fp32 (``_keep_in_fp32_modules``) and feeds it the
    fp32 input; here too (its parameter loads in fp32, ``FP32Replicated``). The softmax scale goes before the ReLU,
    as in transformers (megatron folds it into the weights: the same in exact arithmetic);
  - ``k_norm``: a LayerNorm with transformers' eps 1e-6 whatever ``rms_norm_eps`` is (megatron passes that: 1e-5 in
    GLM-5); HY-V4's takes ``rms_norm_eps`` (``sparse_attention_spec(key_norm_eps=None)``: megatron's);
  - the linears: megatron's spec asks the backend for a duplicated (unsplit) linear, which only Transformer Engine
    provides: ``IndexerLinear``, a plain one. The indexer is whole on every TP rank and reads the sequence gathered
    under SP (megatron's code), so every TP rank picks the same keys.
- Masks: megatron's ``DSAttention`` reads causality alone when the layer's mask type is causal, which drops padding
  and packed documents (megatron's boolean mask, ``runtime.megatron_attention_mask``). Here the index scores take
  -inf at every masked key, and the attention is megatron's ``unfused_dsa_fn`` without a mask, its masked variant
  (``masked_sparse_attention``) with one: masked scores at the dtype's finite minimum, as transformers fills them, so
  a row with no key left (a left pad) stays finite.
- Training as transformers: its indexer runs under ``torch.no_grad``, so it passes no gradient back and its weights
  get none. Here the indexer runs without gradient and its parameters are frozen (``requires_grad=False``: the
  optimizer leaves them as they are, no weight decay); megatron's indexer KL loss is not computed.
- GLM-5's ``indexer_types``: a ``"shared"`` layer has no indexer and reuses the top-k of the last ``"full"`` layer
  before it in the chunk (``link_shared_layers``), kept by that layer's module from its forward to theirs; megatron's
  full recompute replays a shared layer before the full one it reads (the backward runs the layers in reverse), so it
  reads the same top-k.
- Sinks (HY-V4, ``sparse_attention_spec(sinks=True)``): one learned logit per head (fp32, this rank's heads under
  TP) joins each query's softmax as an extra column and is dropped after it, as transformers' eager attention with
  ``s_aux``; such a layer always takes the masked path.
- generate's KV cache (``kv_cache.own_cached_attention``): ``SparseAttention`` keeps its own cache layer
  (``SparseAttentionCacheLayer``: transformers' dynamic layer of the MLA keys and values after the up projection and
  rotary embedding, as DeepSeek-V3's cache, plus the indexer's keys, whole on every TP rank; transformers caches the
  latents and expands them each step, the same keys). A cached step runs the new tokens' index queries over every
  cached and new index key (rotated from slot ``past``), causal from that slot with transformers' padding mask, and
  keeps the top ``min(index_topk, keys)``: the uncached selection. A shared layer reuses that step's top-k of its full
  layer. The attention is ``masked_sparse_attention`` over cache + new keys; the layout's padding keys (sequence
  parallelism) join that step only; sinks (HY-V4) join its softmax as without the cache. The class's forward runs
  (the cache step passes ``cached=``), so a re-classed attention (A.X-K2's) keeps its own forward.
- Context parallelism (megatron's DSA has none: ``late_config_fields`` sets the variant after its config check):
  each rank's queries (its load-balanced share) score the whole sequence's index keys (the indexer's input and query
  latent all-gathered over CP in sequence order, after the SP gather; the rotary table unsliced) and attend over the
  whole sequence's keys and values (all-gathered, their gradient summed back to each rank's share), with the causal
  mask of their global positions. generate's prompt split over CP (``kv_cache.split_prefill_step``) fills the layer's
  cache with the whole prompt's keys, values and index keys on every CP rank; a cache sharded over CP is refused.
- Refused by name: packed THD sequences (``packed_seq_params``; packed rows with position ids are masks and run).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.experimental_attention_variant.dsa import (DSAIndexer, DSAIndexerSubmodules,
                                                                          DSAttention, DSAttentionSubmodules,
                                                                          unfused_dsa_fn)
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module

from loongforge_hf.bridges.sparse_attention_cache import SparseAttentionCacheLayer

INDEXER_KEY_NORM_EPS = 1e-6  # transformers' nn.LayerNorm(index_head_dim, eps=1e-6)


class IndexerLinear(torch.nn.Module):
    """A linear whole on every rank (megatron's ``parallel_mode="duplicated"``), returning megatron's (output, bias)."""

    def __init__(self, input_size: int, output_size: int, *, config, bias: bool = False, **_unused) -> None:
        super().__init__()
        if bias:
            raise ValueError("the DSA indexer's linears have no bias.")
        self.weight = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype))

    def forward(self, x: torch.Tensor):
        return F.linear(x, self.weight), None


class IndexerKeyNorm(torch.nn.LayerNorm):
    """The indexer's key LayerNorm with transformers' eps (``fixed_eps``; None: the one megatron passes)."""

    fixed_eps: float | None = INDEXER_KEY_NORM_EPS

    def __init__(self, config, hidden_size: int, eps: float | None = None) -> None:
        super().__init__(hidden_size, eps=eps if self.fixed_eps is None else self.fixed_eps, dtype=config.params_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.to(self.weight.dtype)).to(x.dtype)  # NOTE: in fp32 where loaded so (HY-V4's)


class LightningIndexer(DSAIndexer):
    """megatron's indexer scoring as transformers does (see the module docstring)."""

    def forward_with_scores(self, x, qr, mask=None, packed_seq_params=None):
        """``x`` ``[s(/TP), b, h]``, ``qr`` ``[s(/TP), b, q_lora_rank]``, ``mask`` ``[b or 1, s, s]`` fp32 (-inf:
        masked) -> index scores ``[b, s, s]`` (fp32) and the top-k key indices ``[b, s, k]``."""
        _refuse_packed(packed_seq_params)
        q, k, weights = self.queries_and_keys(x, qr)
        return self.top_k(q, k, weights, mask)

    def queries_and_keys(self, x, qr, cp_group=None):
        """The index queries ``[s, b, heads, d]``, keys ``[s, b, d]`` (rotated from the rotary table's first row:
        slot ``past`` in a cached step, ``kv_cache.attached``) and fp32 head weights ``[s, b, heads]`` of the
        sequence (gathered under SP; and over ``cp_group``, into sequence order, where given)."""
        from loongforge_hf.parallel.context_parallel import cp_gather_sequence

        seq = self.rotary_pos_emb.get_rotary_seq_len(None, None, x, self.config, None)
        whole = cp_group is not None  # NOTE: packed_seq=True: megatron's table without its CP slice
        if self.config.rope_type == "rope":
            rotary, mscale = self.rotary_pos_emb(seq, packed_seq=whole), 1.0
        else:
            rotary, mscale = self.rotary_pos_emb(seq, packed_seq=whole)
        if self.config.sequence_parallel and self.pg_collection.tp.size() > 1:
            x = gather_from_sequence_parallel_region(x, group=self.pg_collection.tp)
            qr = gather_from_sequence_parallel_region(qr, group=self.pg_collection.tp)
        if whole:  # NOTE: after the TP gather: SP splits each CP rank's share
            x, qr = (cp_gather_sequence(t, seq, cp_group, dim=0) for t in (x, qr))
        s, b, _ = x.shape
        q, _ = self.linear_wq_b(qr)
        q = self._apply_rope(q.reshape(s, b, self.index_n_heads, self.index_head_dim), rotary, mscale)
        k, _ = self.linear_wk(x)
        k = self._apply_rope(self.k_norm(k).reshape(s, b, 1, self.index_head_dim), rotary, mscale).reshape(s, b, -1)
        # NOTE: no Hadamard rotation (transformers has none); fp32 weights on the fp32 input, scale before the ReLU
        weights = F.linear(x.float(), self.linear_weights_proj.weight.float()) * self.index_n_heads ** -0.5
        return q, k, weights

    def top_k(self, q, k, weights, mask=None):
        """Queries ``[sq, b, heads, d]`` over keys ``[skv, b, d]`` (``mask`` ``[b or 1, sq, skv]`` fp32, -inf:
        masked) -> index scores ``[b, sq, skv]`` (fp32) and the top ``min(index_topk, skv)`` keys ``[b, sq, k]``."""
        scores = torch.relu(torch.einsum("sbhd,tbd->sbht", q.float(), k.float()) * self.softmax_scale)
        index_scores = torch.einsum("sbh,sbht->bst", weights, scores)
        if mask is not None:
            index_scores = index_scores + mask
        return index_scores, index_scores.topk(min(self.index_topk, k.shape[0]), dim=-1).indices


class SparseAttention(DSAttention):
    """megatron's DSA core attention with transformers' masks and gradients; on a ``shared`` layer (GLM-5) without an
    indexer of its own. ``shared_layers``: the 0-based layers that reuse an earlier layer's top-k."""

    kv_cache_layer = SparseAttentionCacheLayer  # NOTE: generate's cache (kv_cache.own_cached_attention)

    def __init__(self, config, submodules: DSAttentionSubmodules, layer_number: int, attn_mask_type,
                 attention_type: str, attention_dropout=None, softmax_scale=None, k_channels=None, v_channels=None,
                 cp_comm_type: str = "p2p", pg_collection=None, shared_layers: tuple[int, ...] = (),
                 sinks: bool = False) -> None:
        MegatronModule.__init__(self, config=config)  # NOTE: DSAttention.__init__ always builds an indexer
        self.layer_number = layer_number
        self.softmax_scale = softmax_scale if softmax_scale is not None else (k_channels or config.kv_channels) ** -0.5
        self.shared = layer_number - 1 in shared_layers
        self.indexer = None if self.shared else build_module(submodules.indexer, config=config,
                                                             pg_collection=pg_collection)
        for p in self.parameters():
            p.requires_grad_(False)  # NOTE: transformers' indexer runs under no_grad: no gradient, no update
        self.sinks = _sinks(config, pg_collection) if sinks else None
        self.tp_group = pg_collection.tp if pg_collection is not None else None
        self.source: list[SparseAttention] = []  # NOTE: a list, not a submodule: the full layer a shared one reads
        self.topk: torch.Tensor | None = None

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """megatron's, with the sinks (this rank's heads) split along dim 0 over TP: its default keys a module's own
        parameters as replicated, one rank's heads saved for all."""
        from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint

        state = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        if self.sinks is not None:
            metadata = ensure_metadata_has_dp_cp_group(metadata)
            state.update(make_sharded_tensors_for_checkpoint({"sinks": self.sinks}, prefix, {"sinks": 0},
                                                             sharded_offsets, tp_group=self.tp_group,
                                                             dp_cp_group=metadata["dp_cp_group"]))
        return state

    def forward(self, query, key, value, attention_mask, x, qr, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, cached=None, prefill=None):
        """``cached``: (this layer's ``SparseAttentionCacheLayer``, the step) in generate's cached steps
        (``kv_cache.own_cached_attention``); ``prefill``: the same in its prompt split over CP
        (``kv_cache.split_prefill_step``)."""
        from loongforge_hf.parallel.context_parallel import cp_group_and_size

        _refuse_packed(packed_seq_params)
        if attention_bias is not None:
            raise ValueError("DSA attention takes no attention_bias.")
        if cached is not None:
            return self._cached_forward(query, key, value, x, qr, *cached)
        group = cp_group_and_size()[0]
        if group is not None:
            return self._cp_forward(query, key, value, attention_mask, x, qr, group, prefill)
        sq, skv = query.shape[0], key.shape[0]
        mask = None if attention_mask is None else attention_mask.expand(-1, 1, sq, skv).squeeze(1)
        if self.shared:
            topk = self._source_topk()
        else:
            causal = torch.ones(sq, skv, dtype=torch.bool, device=query.device).triu(1)
            with torch.no_grad():
                topk = self._select(*self.indexer.queries_and_keys(x.detach(), qr.detach()),
                                    causal[None] if mask is None else mask | causal[None])
        if mask is None and self.sinks is None:
            return unfused_dsa_fn(query, key, value, topk, self.softmax_scale)
        if mask is None:
            mask = torch.ones(sq, skv, dtype=torch.bool, device=query.device).triu(1).expand(query.shape[1], -1, -1)
        return masked_sparse_attention(query, key, value, topk, mask, self.softmax_scale, sinks=self.sinks)

    def _cp_forward(self, query, key, value, attention_mask, x, qr, group, prefill=None):
        """Under context parallelism ``query / key / value`` ``[s / CP, b, heads, d]`` are this rank's load-balanced
        share (``attention_mask`` ``[b, 1, s / CP, s]``: its query rows). Its queries attend over the whole
        sequence's keys and values (all-gathered in order, their gradient summed back to each rank's share), each
        keeping the top-k its index query picks over the whole sequence's index keys, as without CP. ``prefill``:
        the prompt's keys, values and index keys fill the cache layer, ``step.mask`` masks the padding keys."""
        from loongforge_hf.parallel.context_parallel import cp_whole_sequence

        whole, rows = cp_whole_sequence(torch.cat((key, value), dim=-1), group)
        key, value = whole.split((key.shape[-1], value.shape[-1]), dim=-1)
        s, b = key.shape[0], query.shape[1]
        masked = (torch.arange(s, device=query.device)[None, :] > rows[:, None])[None]  # NOTE: causal, [1, sq, s]
        if prefill is not None and prefill[1].mask is not None:
            masked = masked | prefill[1].mask[:, 0]
        elif prefill is None and attention_mask is not None:
            masked = masked | attention_mask.expand(-1, 1, rows.numel(), s).squeeze(1)
        masked = masked.expand(b, -1, -1)
        if self.shared:
            topk = self._source_topk()
        else:
            with torch.no_grad():
                q, index_keys, weights = self.indexer.queries_and_keys(x.detach(), qr.detach(), cp_group=group)
                topk = self._select(q.index_select(0, rows), index_keys, weights.index_select(0, rows), masked)
        if prefill is not None:
            layer, step = prefill
            layer.update(key[:step.given].permute(1, 2, 0, 3), value[:step.given].permute(1, 2, 0, 3))
            if not self.shared:
                layer.update_index_keys(index_keys[:step.given].transpose(0, 1))
        return masked_sparse_attention(query, key, value, topk, masked, self.softmax_scale, sinks=self.sinks)

    def _select(self, q, index_keys, weights, masked) -> torch.Tensor:
        """The top-k keys ``[b, sq, k]`` of index queries ``q`` over ``index_keys`` (``indexer.top_k``; ``masked``
        ``[b or 1, sq, skv]`` bool, True: masked), kept for the shared layers that reuse them."""
        additive = torch.zeros(masked.shape, device=masked.device).masked_fill(masked, float("-inf"))
        self.topk = self.indexer.top_k(q, index_keys, weights, mask=additive)[1]
        return self.topk

    def _source_topk(self) -> torch.Tensor:
        if not self.source or self.source[0].topk is None:
            raise RuntimeError(f"layer {self.layer_number - 1}: a shared DSA layer needs the top-k of an earlier "
                               "full layer in the same chunk (link_shared_layers).")
        return self.source[0].topk

    def _cached_forward(self, query, key, value, x, qr, layer, step):
        """A cached generate step: the ``step.padded`` new tokens' ``query / key / value`` ``[padded, b, heads, d]``
        (slots ``past ..``); the first ``given`` keys, values and index keys join ``layer``, the layout's padding
        after them is seen by this step only (causality hides it from every real query). Each query's top-k is
        chosen over every cached and new index key, as without the cache."""
        if not isinstance(layer, SparseAttentionCacheLayer):
            raise ValueError(f"DSA attention caches in a SparseAttentionCacheLayer, not {type(layer).__name__} (the "
                             "static cache is not supported).")
        past, given, sq, b = step.past, step.given, query.shape[0], query.shape[1]
        keys, values = layer.update(key[:given].permute(1, 2, 0, 3), value[:given].permute(1, 2, 0, 3))
        keys = torch.cat((keys.permute(2, 0, 1, 3), key[given:]))  # NOTE: [past + padded, b, heads, d]
        values = torch.cat((values.permute(2, 0, 1, 3), value[given:]))
        slots = torch.arange(past + sq, device=query.device)
        masked = (slots[None, :] > slots[past:, None])[None]  # NOTE: [1, sq, slots], causal from slot past
        masked = masked.expand(b, -1, -1) if step.mask is None else masked | step.mask[:, 0]
        if self.shared:
            topk = self._source_topk()
        else:
            with torch.no_grad():
                q, k, weights = self.indexer.queries_and_keys(x.detach(), qr.detach())
                index_keys = torch.cat((layer.update_index_keys(k[:given].transpose(0, 1)), k[given:].transpose(0, 1)),
                                       dim=1)
                topk = self._select(q, index_keys.transpose(0, 1), weights, masked)
        return masked_sparse_attention(query, keys, values, topk, masked, self.softmax_scale, sinks=self.sinks)


def masked_sparse_attention(query, key, value, topk_indices, mask, softmax_scale: float,
                            sinks: torch.Tensor | None = None) -> torch.Tensor:
    """megatron's ``unfused_dsa_fn`` with a boolean mask ``[b, sq, skv]`` (True: masked; causality included) and
    masked scores at the finite fp32 minimum (transformers'); ``sinks`` ``[heads]``: an extra softmax column per head.
    ``[sq, b, heads, d]`` in, ``[sq, b, heads * dv]`` out."""
    sq, b = query.shape[:2]
    scores = torch.einsum("sbhd,tbhd->bhst", query.float(), key.float()) * softmax_scale
    kept = torch.zeros(mask.shape, dtype=torch.bool, device=mask.device).scatter_(-1, topk_indices, True)
    scores = scores.masked_fill((mask | ~kept).unsqueeze(1), torch.finfo(scores.dtype).min)
    if sinks is not None:
        scores = torch.cat([scores, sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)], dim=-1)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32)[..., :key.shape[0]].to(value.dtype)
    return torch.einsum("bhst,tbhd->sbhd", probs, value).reshape(sq, b, -1)


def _sinks(config, pg_collection) -> torch.nn.Parameter:
    """This rank's heads' sink logits (fp32), split over TP with the heads."""
    from megatron.core import parallel_state as ps

    tp = pg_collection.tp.size() if pg_collection is not None else ps.get_tensor_model_parallel_world_size()
    sinks = torch.nn.Parameter(torch.zeros(config.num_attention_heads // tp, dtype=torch.float32))
    sinks.tensor_model_parallel, sinks.partition_dim, sinks.partition_stride = True, 0, 1
    return sinks


def _refuse_packed(packed_seq_params) -> None:
    if packed_seq_params is not None:
        raise ValueError("DSA attention does not take THD packed_seq_params; pack documents into rows (position ids "
                         "restarting at 0) instead.")


def sparse_attention_spec(shared_layers: tuple[int, ...] = (), *, key_norm_eps: float | None = INDEXER_KEY_NORM_EPS,
                          sinks: bool = False) -> ModuleSpec:
    """The MLA core-attention slot's spec: ``SparseAttention`` with ``LightningIndexer`` (``key_norm_eps``: the
    indexer's key norm's, None for megatron's; ``sinks``: a learned sink logit per head)."""
    norm = IndexerKeyNorm if key_norm_eps == INDEXER_KEY_NORM_EPS else \
        type("IndexerKeyNorm", (IndexerKeyNorm,), {"fixed_eps": key_norm_eps})
    indexer = ModuleSpec(module=LightningIndexer, submodules=DSAIndexerSubmodules(
        linear_wq_b=IndexerLinear, linear_wk=IndexerLinear, k_norm=norm, linear_weights_proj=IndexerLinear))
    return ModuleSpec(module=SparseAttention, submodules=DSAttentionSubmodules(indexer=indexer),
                      params={"shared_layers": tuple(shared_layers), "sinks": sinks})


def link_shared_layers(chunk) -> None:
    """Each shared layer of ``chunk`` reads the top-k of the last full layer before it."""
    last = None
    for module in chunk.modules():
        if isinstance(module, SparseAttention):
            if module.shared:
                if last is None:
                    raise ValueError(f"layer {module.layer_number - 1} is a shared DSA layer with no full layer "
                                     "before it in its pipeline stage.")
                module.source[:] = [last]
            else:
                last = module
