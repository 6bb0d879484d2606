"""DeepseekV32ForCausalLM (DeepSeek-V3.2): GLM-4.7-Flash's bridge (DeepSeek-V3's multi-latent attention and
experts, dense or sparse by ``mlp_layer_types``) plus DeepSeek Sparse Attention's lightning indexer.

Choices:
- Attention: megatron's ``MLASelfAttention`` (rotary pairs interleaved: V3.2 has no ``rope_interleave``) with the DSA
  core attention in its core-attention slot (``sparse_attention.py``: megatron's indexer and sparse attention with
  transformers' scoring, masks and gradient-free indexer); ``experimental_attention_variant="dsa"`` makes megatron
  hand it the layer input and the normalised query latent.
- The indexer rotates the first ``qk_rope_head_dim`` dims of each index head in halves (transformers'
  ``rotate_half``); megatron's rotates the last ones in pairs. Its ``wq_b`` / ``wk`` rows and ``k_norm`` weight and
  bias are permuted per index head on load (rotary rows last, halves into pairs) and back on export
  (``IndexerRows``: a permutation, the round trip is exact; a LayerNorm does not see the order of its channels).
  ``weights_proj`` stays fp32 (transformers keeps it so); every indexer tensor is whole on each TP rank.
- Context parallelism (megatron's DSA has none): each rank's queries score and attend over the whole sequence's
  index keys, keys and values, all-gathered in order (``SparseAttention._cp_forward``); ``generate`` under CP takes
  ``cp_kv_cache="replicated"`` (the prompt split over CP fills the whole cache on each rank) or ``use_cache=False``.
- Refused by name before any collective: ``attention_bias``, ``attention_dropout``, ``layer_types`` other than
  ``indexed_attention``; the static cache in ``generate``; a KV cache sharded over CP.
- ``generate``'s KV cache (``kv_cache.py``): each layer's ``SparseAttentionCacheLayer`` holds its MLA keys and values
  (after the up projection and rotary embedding, this rank's heads, as DeepSeek-V3's cache) and its indexer's keys
  (whole on every TP rank); a step's index queries score every cached and new index key, so each new token's top-k
  is the uncached one (GLM-5's shared layers reuse that step's top-k of their full layer). Checked against
  transformers for DeepSeek-V3.2, GLM-5, HY-V4 and A.X-K2 (``KV_CACHE_ARCHITECTURES``): a bridge built on these and
  not listed there refuses it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.dense import D, L
from loongforge_hf.bridges.glm4_moe_lite import Glm4MoeLiteBridge
from loongforge_hf.bridges.mappings import FP32Replicated, Mapping, Replicated, _fmt
from loongforge_hf.bridges.registry import register_bridge

I, X = f"{D}.self_attention.core_attention.indexer", f"{L}.self_attn.indexer"
# NOTE: where generate's KV cache is checked against transformers' (a bridge built on these and not listed refuses it)
KV_CACHE_ARCHITECTURES = ("DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM", "HYV4ForCausalLM", "AXK2ForCausalLM")


def indexer_row_order(head_dim: int, rope_dim: int, *, halves: bool, rope_first: bool = True) -> torch.Tensor:
    """For one index head, the HF row each megatron row holds: HF's ``[rotary; rest]`` (``[rest; rotary]`` without
    ``rope_first``: HY-V4's) as megatron's ``[rest; rotary]``, rotary rows in halves ``[a; b]`` made pairs ``a0 b0 a1
    b1 ...`` where ``halves``."""
    half, start = rope_dim // 2, 0 if rope_first else head_dim - rope_dim
    rope = [r for i in range(half) for r in (i, half + i)] if halves else list(range(rope_dim))
    rest = range(rope_dim, head_dim) if rope_first else range(head_dim - rope_dim)
    return torch.tensor(list(rest) + [start + r for r in rope])


@dataclass(frozen=True)
class IndexerRows(Replicated):
    """A replicated indexer tensor whose rows are blocks of ``head_dim`` (one per index head), reordered per block by
    ``indexer_row_order`` on load and back on export."""

    head_dim: int = 0
    rope_dim: int = 0
    halves: bool = True
    rope_first: bool = True

    def _order(self, rows: int) -> torch.Tensor:
        one = indexer_row_order(self.head_dim, self.rope_dim, halves=self.halves, rope_first=self.rope_first)
        return torch.cat([one + b * self.head_dim for b in range(rows // self.head_dim)])

    def load(self, reader, ctx, layer):
        tensor = reader.get(_fmt(self.hf, layer))
        return tensor[self._order(tensor.shape[0])].contiguous()

    def export(self, shards, ctx, layer):
        return {_fmt(self.hf, layer): shards[0][torch.argsort(self._order(shards[0].shape[0]))].contiguous()}

    def export_parts(self, shard, rank, ctx, layer):
        return [(name, 0, 0, t) for name, t in self.export([shard], ctx, layer).items()] if rank == 0 else []


class SparseAttentionBridge:
    """DSA's declarations, for a bridge whose MLA bridge (``Glm4MoeLiteBridge``) follows it in the MRO."""

    indexer_rope_halves = True                                 # DeepSeek-V3.2's indexer: rotate_half
    indexer_rope_first = True                                  # ... of its first qk_rope_head_dim dims
    sparse_attention_options: dict = {}                        # sparse_attention_spec's (HY-V4: sinks, k_norm eps)
    per_layer_types = True                                     # NOTE: layer_types checked here
    kv_cache_shards_over_cp = False                            # NOTE: generate under CP: cp_kv_cache="replicated"
    late_config_fields = ("experimental_attention_variant",)   # NOTE: megatron asserts DSA has no CP; ours does

    def has_indexer(self, layer: int) -> bool:
        return True

    def shared_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.hf_config.num_hidden_layers) if not self.has_indexer(i))

    # ---- config ---------------------------------------------------------------------------------------------
    def check_config(self) -> None:
        c = self.hf_config
        if any(kind != "indexed_attention" for kind in c.layer_types or ()):
            raise C.UnsupportedConfigError(f"layer_types={sorted(set(c.layer_types))} is not supported for "
                                           f"{self.architectures[0]} (only indexed_attention).")
        if getattr(c, "attention_bias", False):
            raise C.UnsupportedConfigError(f"attention_bias=True is not supported for {self.architectures[0]}.")
        if c.attention_dropout:
            raise C.UnsupportedConfigError(f"attention_dropout={c.attention_dropout} is not supported for "
                                           f"{self.architectures[0]} (megatron's sparse attention has no dropout).")
        if c.index_head_dim < c.qk_rope_head_dim:
            raise C.UnsupportedConfigError(f"index_head_dim={c.index_head_dim} is smaller than qk_rope_head_dim="
                                           f"{c.qk_rope_head_dim}.")
        super().check_config()

    def generation_refusal(self, generation_config) -> str | None:
        arch = self.architectures[0]
        if generation_config.use_cache and arch not in KV_CACHE_ARCHITECTURES:
            return (f"a KV cache is not supported for {arch} (the cached sparse attention is checked against "
                    f"transformers for {', '.join(KV_CACHE_ARCHITECTURES)} only); pass use_cache=False.")
        if generation_config.use_cache and generation_config.cache_implementation == "static":
            return (f"cache_implementation='static' is not supported for {arch} (the static cache's fixed-shape "
                    "decode step holds no indexer keys); use the default dynamic cache.")
        return None

    def transformer_config_kwargs(self) -> dict:
        c = self.hf_config
        return {**super().transformer_config_kwargs(), "experimental_attention_variant": "dsa",
                "dsa_indexer_n_heads": c.index_n_heads, "dsa_indexer_head_dim": c.index_head_dim,
                "dsa_indexer_topk": c.index_topk, "dsa_indexer_loss_coeff": 0.0}

    def mla_core_attention(self):
        from loongforge_hf.bridges.sparse_attention import sparse_attention_spec

        return sparse_attention_spec(self.shared_layers(), **self.sparse_attention_options)

    def finish_model(self, model) -> None:
        from loongforge_hf.bridges.sparse_attention import link_shared_layers

        link_shared_layers(model)

    # ---- tensors --------------------------------------------------------------------------------------------
    def indexer_mappings(self) -> list[Mapping]:
        c = self.hf_config
        rows = {"head_dim": c.index_head_dim, "rope_dim": c.qk_rope_head_dim, "halves": self.indexer_rope_halves,
                "rope_first": self.indexer_rope_first}
        return [IndexerRows(f"{I}.linear_wq_b.weight", f"{X}.wq_b.weight", **rows),
                IndexerRows(f"{I}.linear_wk.weight", f"{X}.wk.weight", **rows),
                IndexerRows(f"{I}.k_norm.weight", f"{X}.k_norm.weight", **rows),
                IndexerRows(f"{I}.k_norm.bias", f"{X}.k_norm.bias", **rows),
                FP32Replicated(f"{I}.linear_weights_proj.weight", f"{X}.weights_proj.weight")]

    def layer_mappings(self) -> list[Mapping]:
        return super().layer_mappings() + self.indexer_mappings()

    def mappings_for_layer(self, layer: int) -> list[Mapping]:
        return super().mappings_for_layer(layer) + (self.indexer_mappings() if self.has_indexer(layer) else [])

    def layer_shapes(self, layer: int) -> dict[str, tuple[int, ...]]:
        shapes = super().layer_shapes(layer)
        if self.has_indexer(layer):
            c, x = self.hf_config, f"model.layers.{layer}.self_attn.indexer"
            d = c.index_head_dim
            shapes.update({f"{x}.wq_b.weight": (c.index_n_heads * d, c.q_lora_rank),
                           f"{x}.wk.weight": (d, c.hidden_size), f"{x}.k_norm.weight": (d,), f"{x}.k_norm.bias": (d,),
                           f"{x}.weights_proj.weight": (c.index_n_heads, c.hidden_size)})
        return shapes


@register_bridge("DeepseekV32ForCausalLM")
class DeepseekV32Bridge(SparseAttentionBridge, Glm4MoeLiteBridge):
    pass
