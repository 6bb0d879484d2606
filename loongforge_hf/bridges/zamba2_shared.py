"""Zamba2's (and Zamba's) shared transformer blocks and the layer that calls them: megatron's ``TransformerLayer``
with the bridge's Mamba mixer in the self-attention slot and, on the hybrid layers, one of ``num_mem_blocks`` blocks
whose weights every use shares, with the use's own adapters (Zamba2's) and linear.

Choices:
- megatron has no tie between layers: each shared block is built once, held (registered) by the layer of its first
  use, and called from its other uses through the model's ``SharedBlocks`` holder (not registered there), so the block
  has one parameter set and autograd sums its gradient over the uses. The holder also keeps the decoder's input (the
  token embeddings, transformers' ``original_hidden_states``) for the forward, as Gemma 4's per-layer stream: a
  pre-hook on the decoder keeps it, a forward hook drops it.
- A hybrid layer (transformers' ``Zamba2HybridLayer``): ``t = linear(block(x, embeddings))``; the Mamba mixer reads
  ``norm(x + t)`` (a pre-hook on the input norm adds ``t``), the residual is ``x``.
- The block (``Zamba2AttentionDecoderLayer``): RMSNorm over ``concat(x, embeddings)`` (2 H); q / k / v column-parallel
  from 2 H, plus the use's adapters (``B(A(x))``: ``A`` replicated on this rank's tokens, ``B`` column-parallel like
  the projection it adds to); rope on q / k where ``use_mem_rope`` (megatron's rotary table, ``head_dim`` =
  2 H / heads); the use's own causal ``CoreAttention`` (``kernels.attention``, held by the hybrid layer: generate's
  KV cache gives each use its own keys and values, as transformers' cache keeps one slot per hybrid layer) scaled
  by ``(head_dim / 2) ** -0.5`` under megatron's mask (an additive bias at the dtype's minimum, as transformers'
  sdpa path: a padded query gets no NaN); ``o_proj``
  row-parallel; RMSNorm; ``gate_up_proj`` column-parallel (each rank's gate and up rows) plus the use's adapter,
  ``act(gate) * up``, ``down_proj`` row-parallel.
- The per-use linear and the adapters' ``A`` act on this rank's tokens (replicated, their gradients summed over TP
  under sequence parallelism: ``sequence_parallel``).
- Training checkpoints key the blocks' and adapters' tensors as their linears split them (``_ShardedChildren``):
  megatron's default would key a plain module's tensors as replicated and save one TP rank's shard for all.
  ``gate_up_proj`` and its adapters' ``up`` (a rank's gate rows, then its up rows) are keyed per section
  (``_gate_up_sections``), so a resume under another TP size reads them right.
- The embeddings and the block pass beside megatron's layer arguments: activation recompute is refused
  (``refuse_recompute``), as are pipelines (the embeddings live on the first stage) in ``zamba2.py``. Zamba's blocks
  (``mlp_adapters`` off, no q / k / v adapters, no rope) are the same module.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class SharedSizes:
    """The shared blocks' sizes: ``hidden`` (H), ``heads`` / ``kv_heads`` of ``head_dim`` (2 H / heads),
    ``intermediate``, ``rank`` (the adapters'), ``qkv_adapters`` (``use_shared_attention_adapter``), ``rope``,
    ``activation``, ``eps``, ``mlp_adapters`` (Zamba2's; Zamba's blocks have none)."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    rank: int
    qkv_adapters: bool
    rope: bool
    activation: str
    eps: float
    mlp_adapters: bool = True


def _replicated(in_features: int, out_features: int, config) -> torch.nn.Linear:
    """A linear on this rank's tokens (no bias, not initialised: the checkpoint fills it)."""
    linear = torch.nn.utils.skip_init(torch.nn.Linear, in_features, out_features, bias=False,
                                      dtype=config.params_dtype)
    linear.weight.sequence_parallel = bool(config.sequence_parallel)
    return linear


def _column(in_features: int, out_features: int, config, tp_group):
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    return ColumnParallelLinear(in_features, out_features, config=config, init_method=config.init_method, bias=False,
                                gather_output=False, skip_bias_add=True, tp_group=tp_group)


def _row(in_features: int, out_features: int, config, tp_group):
    from megatron.core.tensor_parallel.layers import RowParallelLinear

    return RowParallelLinear(in_features, out_features, config=config, init_method=config.output_layer_init_method,
                             bias=False, input_is_parallel=True, skip_bias_add=True, tp_group=tp_group)


def _gate_up_sections(linear) -> None:
    """A column-parallel ``gate_up_proj`` (or its adapter's ``up``) holds this rank's gate rows, then its up rows:
    two sections in a training checkpoint (``parallel/tp_sections.py``)."""
    from loongforge_hf.parallel import tp_sections

    rows = linear.weight.shape[0]
    tp_sections.declare_rows(linear, (rows // 2, rows // 2))


class _ShardedChildren(torch.nn.Module):
    """A module (with a ``tp_group``) whose training-checkpoint keys are its children's own (megatron's default keys a
    plain module's tensors as replicated over TP: one rank's column / row-parallel shard saved for every rank)."""

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        from megatron.core.transformer.utils import sharded_state_dict_default

        state = {}
        for name, child in self.named_children():
            state.update(sharded_state_dict_default(child, f"{prefix}{name}.", sharded_offsets, metadata,
                                                    tp_group=self.tp_group))
        return state


class Adapter(_ShardedChildren):
    """One use's low-rank term ``up(down(x))``: ``down`` replicated, ``up`` column-parallel."""

    def __init__(self, in_features: int, rank: int, out_features: int, config, tp_group) -> None:
        super().__init__()
        self.tp_group = tp_group
        self.down, self.up = _replicated(in_features, rank, config), _column(rank, out_features, config, tp_group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(self.down(x))[0]


class UseAdapters(_ShardedChildren):
    """A hybrid layer's own adapters: q / k / v and ``gate_up_proj``'s (where the model has them)."""

    def __init__(self, config, sizes: SharedSizes, tp_group) -> None:
        super().__init__()
        self.tp_group = tp_group
        two_h = 2 * sizes.hidden
        if sizes.qkv_adapters:
            self.q, self.k, self.v = (Adapter(two_h, sizes.rank, two_h, config, tp_group) for _ in range(3))
        if sizes.mlp_adapters:
            self.gate_up = Adapter(sizes.hidden, sizes.rank, 2 * sizes.intermediate, config, tp_group)
            _gate_up_sections(self.gate_up.up)


class SharedBlock(_ShardedChildren):
    """One shared transformer block, this TP rank's heads and MLP columns (see the module docstring)."""

    def __init__(self, config, sizes: SharedSizes, tp_group) -> None:
        from loongforge_hf.kernels.rmsnorm import RMSNorm

        super().__init__()
        self.config, self.sizes, self.tp_group = config, sizes, tp_group
        tp = config.tensor_model_parallel_size
        h, two_h, d = sizes.hidden, 2 * sizes.hidden, sizes.head_dim
        self.heads, self.kv_heads = sizes.heads // tp, sizes.kv_heads // tp
        self.input_layernorm = RMSNorm(config, two_h, eps=sizes.eps)
        self.q_proj = _column(two_h, sizes.heads * d, config, tp_group)
        self.k_proj = _column(two_h, sizes.kv_heads * d, config, tp_group)
        self.v_proj = _column(two_h, sizes.kv_heads * d, config, tp_group)
        self.o_proj = _row(sizes.heads * d, h, config, tp_group)
        self.pre_ff_layernorm = RMSNorm(config, h, eps=sizes.eps)
        self.gate_up_proj = _column(h, 2 * sizes.intermediate, config, tp_group)
        self.down_proj = _row(sizes.intermediate, h, config, tp_group)
        _gate_up_sections(self.gate_up_proj)

    def forward(self, hidden: torch.Tensor, embeddings: torch.Tensor, adapters: UseAdapters, *, attention,
                attention_mask: torch.Tensor | None, rotary_pos_emb: torch.Tensor | None) -> torch.Tensor:
        """``hidden`` / ``embeddings`` ``[s, b, H]`` (this rank's tokens) -> the block's output ``[s, b, H]``;
        ``attention``: the use's core attention (its own KV cache slot in generate)."""
        x = self.input_layernorm(torch.cat([hidden, embeddings], dim=-1))
        q, k, v = (proj(x)[0] for proj in (self.q_proj, self.k_proj, self.v_proj))
        if self.sizes.qkv_adapters:
            q, k, v = q + adapters.q(x), k + adapters.k(x), v + adapters.v(x)
        out = self.o_proj(self._attention(q, k, v, attention, attention_mask, rotary_pos_emb))[0]
        x = self.pre_ff_layernorm(out)
        gate_up = self.gate_up_proj(x)[0]
        if self.sizes.mlp_adapters:
            gate_up = gate_up + adapters.gate_up(x)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(_activation(self.sizes.activation)(gate) * up)[0]

    def _attention(self, q, k, v, attention, mask, rotary_pos_emb) -> torch.Tensor:
        """q / k / v ``[s, b, heads * head_dim]`` (all tokens, this rank's heads) -> ``[s, b, heads * head_dim]``."""
        from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb

        s, b, d = q.shape[0], q.shape[1], self.sizes.head_dim
        q, k, v = q.view(s, b, -1, d), k.view(s, b, -1, d), v.view(s, b, -1, d)
        if self.sizes.rope:
            q = apply_rotary_pos_emb(q, rotary_pos_emb, config=self.config)
            k = apply_rotary_pos_emb(k, rotary_pos_emb, config=self.config)
        if mask is not None:
            # NOTE: additive, so that a padded query (masked from every key) takes a uniform softmax, not NaN
            mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(mask, torch.finfo(q.dtype).min)
        return attention(q, k, v, mask)


def _core_attention(config, sizes: SharedSizes, layer_number: int, pg_collection):
    """A use's causal core attention (``kernels.attention.CoreAttention``), scaled by ``(head_dim / 2) ** -0.5`` as
    transformers' Zamba / Zamba2: found by ``kv_cache.core_attentions``, so the use gets a KV cache slot of its own."""
    from megatron.core.transformer.enums import AttnMaskType

    from loongforge_hf.kernels.attention import CoreAttention

    return CoreAttention(config, layer_number, AttnMaskType.causal, "self",
                         softmax_scale=1.0 / math.sqrt(sizes.head_dim / 2), pg_collection=pg_collection)


def _activation(name: str):
    from transformers.activations import ACT2FN

    return ACT2FN[name]


class SharedBlocks:
    """The model's holder (not a module): the blocks by index and the decoder's input of the running forward."""

    def __init__(self) -> None:
        self.blocks: dict[int, SharedBlock] = {}
        self.embeddings: torch.Tensor | None = None


def zamba2_layer(*, hybrid: tuple[int, ...], num_blocks: int, sizes: SharedSizes) -> type:
    """The layer class: megatron's ``TransformerLayer`` without the MLP's slots, the hybrid layers (0-based global
    indices, ``hybrid``; use ``u`` calls block ``u % num_blocks``) with their block, adapters and linear."""
    from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from loongforge_hf.bridges.recurrent_common import tp_group_of

    class Zamba2Layer(TransformerLayer):
        def __init__(self, config, submodules, layer_number: int = 1, **kwargs) -> None:
            submodules = replace(submodules, pre_mlp_layernorm=IdentityOp, mlp=IdentityOp, mlp_bda=IdentityFuncOp)
            super().__init__(config, submodules, layer_number, **kwargs)
            index = self.layer_number - 1
            self.use = hybrid.index(index) if index in hybrid else None
            self.shared: SharedBlocks | None = None  # NOTE: set by attach_shared_blocks
            self._added = None
            if self.use is None:
                return
            tp_group = tp_group_of(kwargs.get("pg_collection"))
            if self.use < num_blocks:
                self.shared_block = SharedBlock(config, sizes, tp_group)
            self.adapters = UseAdapters(config, sizes, tp_group)
            self.shared_attention = _core_attention(config, sizes, self.layer_number, kwargs.get("pg_collection"))
            self.linear = _replicated(sizes.hidden, sizes.hidden, config)
            self.input_layernorm.register_forward_pre_hook(self._add_block_output)

        def _add_block_output(self, module, args):
            return (args[0] + self._added,) + tuple(args[1:])

        def _forward_attention(self, hidden_states, attention_mask=None, *args, **kwargs):
            if self.use is None:
                return super()._forward_attention(hidden_states, attention_mask, *args, **kwargs)
            block = self.shared.blocks[self.use % num_blocks]
            out = block(hidden_states, self.shared.embeddings, self.adapters, attention=self.shared_attention,
                        attention_mask=attention_mask, rotary_pos_emb=kwargs.get("rotary_pos_emb"))
            self._added = self.linear(out)
            try:
                return super()._forward_attention(hidden_states, attention_mask, *args, **kwargs)
            finally:
                self._added = None

    return Zamba2Layer


def attach_shared_blocks(chunk) -> None:
    """Give ``chunk``'s layers (a whole model: no pipeline) the holder of the shared blocks and the embeddings."""
    holder = SharedBlocks()
    for layer in chunk.decoder.layers:
        layer.shared = holder
        if hasattr(layer, "shared_block"):
            holder.blocks[layer.use] = layer.shared_block

    def keep(module, args, kwargs):
        holder.embeddings = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]

    def drop(*_):
        holder.embeddings = None

    chunk.decoder.register_forward_pre_hook(refuse_recompute)
    chunk.decoder.register_forward_pre_hook(keep, with_kwargs=True)
    chunk.decoder.register_forward_hook(drop)


def refuse_recompute(decoder, args) -> None:
    if decoder.training and decoder.config.recompute_granularity is not None:
        raise ValueError("activation checkpointing (recompute) is not supported for Zamba / Zamba2: the shared "
                         "blocks and the embeddings they read pass beside megatron's layer arguments, which a "
                         "recomputed layer would not take gradients through.")
