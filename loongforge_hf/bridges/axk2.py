"""AXK2ForCausalLM (SK Telecom's A.X-K2): DeepSeek-V3.2's bridge (MLA with DeepSeek Sparse Attention's lightning
indexer, DeepSeek-V3's experts, dense or sparse by ``mlp_layer_types``) with gated norms and a gated query projection.

Choices:
- Gated norms (transformers' ``AXK2GatedRMSNorm``): the RMSNorm's output ``y`` times ``sigmoid(W_up silu(W_down y))``,
  the gate in fp32 and the product rounded once to the activations' dtype, as transformers: ``input_layernorm`` of
  every layer and ``post_attention_layernorm`` of the MoE layers (megatron's ``pre_mlp_layernorm`` slot), the dense
  layers' a plain RMSNorm. Our ``RMSNorm`` in those slots is re-classed after the build (``_gated_norm``) and given
  the two low-rank weights (``gate_down`` ``[rank, H]``, ``gate_up`` ``[H, rank]``): whole on every TP rank and marked
  ``sequence_parallel`` like the norm's weight, so megatron sums their gradients over TP under SP.
- Query: transformers' ``q_gate_proj`` (``q_b_proj`` on disk) reads the normalised and the raw query latent side by
  side (``2 * q_lora_rank``) and gives, per head, the query (``qk_nope + qk_rope`` rows) and a gate on that head's
  attention output (``v_head_dim`` rows). In megatron's MLA: the query latent norm returns ``[norm(q); q]``
  (``_with_raw_latent``), ``linear_q_up_proj`` takes that width (its weight rebuilt ``[heads / TP * (qk + v),
  2 * q_lora_rank]``, split over TP by heads like megatron's own) and hands MLA the query rows, keeping the gate
  rows for ``linear_proj``, whose forward pre-hook multiplies its input (this rank's heads) by their sigmoid (fp32,
  rounded once) first. The DSA indexer reads the normalised half, as transformers' ``q_resid``.
- Everything else is DeepSeek-V3.2's bridge: rotary pairs on disk (transformers' A.X-K2 always rotates interleaved
  pairs), the indexer's rotary halves, sigmoid routing with a fixed ``e_score_correction_bias`` renormalised (its
  ``+ 1e-20``: megatron's expression too) and scaled; expert groups (top-2 sums) where ``n_group`` is set, none
  where it is ``None`` (A.X-K2-Light); context parallelism. Refused as there: the static cache in ``generate``,
  ``attention_bias``, ``attention_dropout``. LoRA on ``o_proj``: megatron's ``linear_proj`` (the gate a
  pre-hook), its adapter reading the gated input as PEFT's. LoRA on ``q_gate_proj`` (PEFT's name; ``q_b_proj`` on disk,
  ``checkpoint_name``): the re-classed up-projection is ``lora_adaptable``, its adapter's rows (each head's query
  and gate rows, as the weight's) added before the split, so the gates carry the adapter's term as in PEFT.
- ``generate``'s KV cache is DeepSeek-V3.2's (``sparse_attention.SparseAttentionCacheLayer``): a cached step runs
  the re-classed core attention's forward (``kv_cache.own_cached_attention`` calls the class's), so its indexer
  reads the normalised half there too, and the gate rows of the step's own tokens gate ``linear_proj`` as without
  the cache. Greedy and beam search give transformers' tokens with its cache.
- On disk: transformers writes the gated norms as ``{norm}.norm.weight`` / ``{norm}.W_down.weight`` /
  ``{norm}.W_up.weight`` and the experts one tensor each (the hub's layout); read and written so.
"""

from __future__ import annotations

import functools
import types
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.deepseek_v32 import DeepseekV32Bridge
from loongforge_hf.bridges.dense import D, L
from loongforge_hf.bridges.mappings import Mapping, Replicated, _fmt
from loongforge_hf.bridges.registry import register_bridge

_TP_ATTRS = ("tensor_model_parallel", "partition_dim", "partition_stride", "allreduce", "sequence_parallel")


def _gate_maps(megatron_norm: str, hf_norm: str) -> list[Mapping]:
    return [Replicated(f"{D}.{megatron_norm}.gate_down", f"{L}.{hf_norm}.W_down.weight"),
            Replicated(f"{D}.{megatron_norm}.gate_up", f"{L}.{hf_norm}.W_up.weight")]


@dataclass(frozen=True)
class PreMLPNorm(Replicated):
    """megatron's ``pre_mlp_layernorm`` weight: ``hf`` on the dense layers, ``gated_hf`` (the gated norm's own
    weight) on ``gated_layers``; one mapping for every layer, as the loader indexes megatron's names."""

    gated_hf: str = ""
    gated_layers: frozenset[int] = frozenset()

    def _hf(self, layer) -> str:
        return _fmt(self.gated_hf if layer in self.gated_layers else self.hf, layer)

    def hf_names(self, layer):
        return [self._hf(layer)]

    def load(self, reader, ctx, layer):
        return reader.get(self._hf(layer))

    def export(self, shards, ctx, layer):
        return {self._hf(layer): shards[0]}

    def export_parts(self, shard, rank, ctx, layer):
        return [(self._hf(layer), 0, 0, shard)] if rank == 0 else []


@functools.cache
def _gated_norm(base: type) -> type:
    class GatedNorm(base):
        """``base``'s output ``y`` times ``sigmoid(gate_up @ silu(gate_down @ y))`` (A.X-K2's gated RMSNorm)."""

        def forward(self, x):
            y = super().forward(x)
            gate = F.linear(F.silu(F.linear(y, self.gate_down)), self.gate_up)
            return (y * torch.sigmoid(gate.float())).to(y.dtype)

    return GatedNorm


@functools.cache
def _with_raw_latent(base: type) -> type:
    class NormedAndRawLatent(base):
        """``[norm(q); q]``: the normalised query latent with the raw one beside it."""

        def forward(self, x):
            return torch.cat([super().forward(x), x], dim=-1)

    return NormedAndRawLatent


@functools.cache
def _gate_splitting(base: type) -> type:
    class GateSplittingUpProj(base):
        """The query rows of each head, the gate rows kept in ``box`` for the output projection."""

        lora_adaptable = True  # NOTE: LoRA's term is added in _forward_impl, before the split (lora/layers.py)

        def forward(self, x, *args, **kwargs):
            out, bias = super().forward(x, *args, **kwargs)
            lead = out.shape[:-1]
            query, gate = out.view(*lead, -1, self.q_rows + self.gate_rows).split([self.q_rows, self.gate_rows], -1)
            self.box.gate = gate.reshape(*lead, -1)
            return query.reshape(*lead, -1), bias

    return GateSplittingUpProj


def gated_input(module, args, *, box):
    """A forward pre-hook of ``linear_proj``: its input (each head's attention output) times the sigmoid of the gate
    ``box`` holds (fp32, rounded once), the gate then dropped."""
    gate, box.gate = box.gate, None
    x = args[0]
    return ((x * torch.sigmoid(gate.float())).to(x.dtype), *args[1:])


@functools.cache
def _normed_half_to_indexer(base: type, q_lora_rank: int) -> type:
    class NormedHalfIndexer(base):
        """DSA's core attention with the normalised half of ``qr`` (the latent norm's ``[norm(q); q]``)."""

        def forward(self, *args, qr, **kwargs):
            return super().forward(*args, qr=qr[..., :q_lora_rank], **kwargs)

    return NormedHalfIndexer


def _reclass(module, cls: type, **attrs) -> None:
    module.__class__ = cls
    for name, value in attrs.items():
        object.__setattr__(module, name, value)  # NOTE: plain attributes, never submodules


def _gate_norm(norm, hidden: int, rank: int) -> None:
    w = norm.weight
    for name, shape in (("gate_down", (rank, hidden)), ("gate_up", (hidden, rank))):
        p = torch.nn.Parameter(torch.empty(shape, dtype=w.dtype, device=w.device))
        p.sequence_parallel = getattr(w, "sequence_parallel", False)  # NOTE: grads summed over TP as the weight's
        norm.register_parameter(name, p)
    norm.__class__ = _gated_norm(type(norm))


def _gate_query(attention, c) -> None:
    """``attention``'s query latent norm, up projection, output projection and DSA core attention for A.X-K2."""
    box = types.SimpleNamespace(gate=None)
    heads = attention.num_attention_heads_per_partition
    q_rows, up = c.qk_nope_head_dim + c.qk_rope_head_dim, attention.linear_q_up_proj
    old = up.weight
    new = torch.nn.Parameter(torch.empty(heads * (q_rows + c.v_head_dim), 2 * c.q_lora_rank, dtype=old.dtype,
                                         device=old.device))
    for attr in _TP_ATTRS:
        if hasattr(old, attr):
            setattr(new, attr, getattr(old, attr))
    up.weight = new
    up.input_size, up.output_size_per_partition = 2 * c.q_lora_rank, new.shape[0]
    _reclass(up, _gate_splitting(type(up)), box=box, q_rows=q_rows, gate_rows=c.v_head_dim)
    # NOTE: a pre-hook, not a re-class: linear_proj stays megatron's RowParallelLinear, which LoRA's layers take
    attention.linear_proj.register_forward_pre_hook(functools.partial(gated_input, box=box))
    _reclass(attention.q_layernorm, _with_raw_latent(type(attention.q_layernorm)))
    core = attention.core_attention
    _reclass(core, _normed_half_to_indexer(type(core), c.q_lora_rank))


@register_bridge("AXK2ForCausalLM")
class AXK2Bridge(DeepseekV32Bridge):
    def __init__(self, hf_config) -> None:
        super().__init__(hf_config)
        self.interleaved_rope_on_disk = True  # NOTE: transformers' A.X-K2 always rotates interleaved pairs

    def check_config(self) -> None:
        c = self.hf_config
        if not c.q_lora_rank or not getattr(c, "gated_norm_rank", 0):
            raise C.UnsupportedConfigError(f"q_lora_rank={c.q_lora_rank}, gated_norm_rank="
                                           f"{getattr(c, 'gated_norm_rank', None)}: AXK2ForCausalLM needs both.")
        super().check_config()

    def finish_model(self, model) -> None:
        super().finish_model(model)
        c = self.hf_config
        for layer in model.decoder.layers:
            _gate_norm(layer.input_layernorm, c.hidden_size, c.gated_norm_rank)
            if self.is_moe_layer(layer.layer_number - 1):  # NOTE: megatron numbers layers from 1
                _gate_norm(layer.pre_mlp_layernorm, c.hidden_size, c.gated_norm_rank)
            _gate_query(layer.self_attention, c)

    # ---- tensors --------------------------------------------------------------------------------------------
    def checkpoint_name(self, name: str) -> str:
        """The checkpoint's name of tensor ``name`` of transformers' module tree (LoRA's planner), which renames
        ``q_b_proj`` to ``q_gate_proj`` and the gated norms' ``W_down`` / ``W_up`` to ``mlp.fc1`` / ``mlp.fc2``."""
        from loongforge_hf.bridges.load_kwargs import module_tree_names

        return module_tree_names(self).get(name, name)

    def attention_mappings(self) -> list[Mapping]:
        norm = f"{D}.input_layernorm.weight"
        maps = [Replicated(norm, f"{L}.input_layernorm.norm.weight") if m.megatron == norm else m
                for m in super().attention_mappings()]
        return maps + _gate_maps("input_layernorm", "input_layernorm")

    def _pre_mlp_norm(self, maps: list[Mapping]) -> list[Mapping]:
        moe = frozenset(i for i in range(self.hf_config.num_hidden_layers) if self.is_moe_layer(i))
        norm = PreMLPNorm(f"{D}.pre_mlp_layernorm.weight", f"{L}.post_attention_layernorm.weight",
                          gated_hf=f"{L}.post_attention_layernorm.norm.weight", gated_layers=moe)
        return [norm if m.megatron == norm.megatron else m for m in maps]

    def dense_mlp_mappings(self) -> list[Mapping]:
        return self._pre_mlp_norm(super().dense_mlp_mappings())

    def moe_mappings(self) -> list[Mapping]:
        return self._pre_mlp_norm(super().moe_mappings()) + _gate_maps("pre_mlp_layernorm", "post_attention_layernorm")

    def _gated_shapes(self, prefix: str, norm: str) -> dict[str, tuple[int, ...]]:
        h, r = self.hf_config.hidden_size, self.hf_config.gated_norm_rank
        return {f"{prefix}.{norm}.norm.weight": (h,), f"{prefix}.{norm}.W_down.weight": (r, h),
                f"{prefix}.{norm}.W_up.weight": (h, r)}

    def attention_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        c = self.hf_config
        shapes = super().attention_shapes(prefix)
        del shapes[f"{prefix}.input_layernorm.weight"]
        rows = c.num_attention_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim)
        shapes[f"{prefix}.self_attn.q_b_proj.weight"] = (rows, 2 * c.q_lora_rank)
        return {**shapes, **self._gated_shapes(prefix, "input_layernorm")}

    def moe_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        shapes = super().moe_shapes(prefix)
        del shapes[f"{prefix}.post_attention_layernorm.weight"]
        return {**shapes, **self._gated_shapes(prefix, "post_attention_layernorm")}
