"""DiffLlamaForCausalLM (differential attention on the Llama layout: kajuma/DiffLlama-*): each output pairs query heads
``i`` and ``i + heads / 2``, ``(softmax_i - lambda * softmax_{i + heads/2}) V_i`` over values twice the head size,
normalised per pair.

Choices:
- Values twice the head size: transformers runs each query head over the values of KV head ``j`` and of ``j + kv / 2``
  (``j`` taken modulo ``kv / 2``) and concatenates the two outputs; here the value of each KV head is that
  concatenation (``[v_j, v_{j + kv/2}]``, ``2 * head_dim`` wide), so megatron's attention (and the KV cache) runs
  once over it, as transformers' V-doubling did.
- The pairs: ``o_proj``'s input holds pair ``i``'s ``2 * head_dim`` outputs at columns ``i * 2 * head_dim``; a forward
  pre-hook on megatron's ``linear_proj`` forms ``out_i - lambda * out_{i + heads/2}``, its weightless RMSNorm
  (``rms_norm_eps``) times ``1 - lambda_init`` (``0.8 - 0.6 exp(-0.3 layer)``, by the global layer index), before
  the projection (and LoRA's terms on it). ``lambda = exp(q1 . k1) - exp(q2 . k2) + lambda_init`` from the layer's
  four ``[head_dim]`` parameters, replicated; their gradient is summed over TP (each rank's heads add their share).
- Under TP a rank must hold both heads of its pairs: rank ``r`` of ``T`` takes query heads
  ``[r H / 2T, (r + 1) H / 2T)`` and the same range of the second half, KV heads alike (``HalvesQKV``; at TP1 the
  HF order itself). So ``num_key_value_heads`` must divide by ``2 * tensor_parallel_size``: refused by name otherwise.
- LoRA on ``q_proj`` / ``k_proj`` / ``v_proj``: B's rows (DoRA's magnitude) go to megatron's order as the weight's
  (``HalvesQKV.rows_to_megatron``), each rank's then its slice of both halves; a training checkpoint keys them by
  half (``tp_sections``), so a resume under another TP size reads the rows it needs.
- ``attention_dropout`` (transformers refuses it too) and biases are refused.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges import transforms as T
from loongforge_hf.bridges.dense import D, L, DenseBridge
from loongforge_hf.bridges.fused_mappings import QKV
from loongforge_hf.bridges.mappings import Mapping, Replicated, _read_into
from loongforge_hf.bridges.registry import register_bridge
from loongforge_hf.parallel import tp_sections

_LAMBDAS = ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")


def _hf_row(ctx, rank: int, which: int, src: int) -> int:
    """The HF row of q (``which`` 0), k or v that row ``src`` of TP rank ``rank``'s block holds: the rank's heads are
    a slice of the first half of the heads, then the same slice of the second half."""
    heads = ctx.num_heads if which == 0 else ctx.num_kv_heads
    half = heads // ctx.tp_size // 2
    head, rest = divmod(src, ctx.head_dim)
    first = rank * half + head if head < half else heads // 2 + rank * half + head - half
    return first * ctx.head_dim + rest


@dataclass(frozen=True)
class HalvesQKV(QKV):
    """``QKV`` whose TP rank holds a slice of each half of the heads (the module docstring)."""

    def load(self, reader, ctx, layer):
        heads, groups, hd = ctx.num_heads // ctx.tp_size, ctx.local_kv_heads, ctx.head_dim
        names = self.hf_names(layer)
        out = torch.empty((heads + 2 * groups) * hd, *reader.shape(names[0])[1:], dtype=reader.dtype(names[0]))
        for which, src, dst, rows in T.qkv_blocks(num_heads=heads, num_kv_heads=groups, head_dim=hd):
            _read_into(reader, names[which], out[dst:dst + rows], dim=0, start=_hf_row(ctx, ctx.tp_rank, which, src))
        return out

    def _parts(self, shard, rank, ctx, layer):
        heads, groups, hd = ctx.num_heads // ctx.tp_size, ctx.local_kv_heads, ctx.head_dim
        names = self.hf_names(layer)
        return [(names[which], 0, _hf_row(ctx, rank, which, src), shard[dst:dst + rows])
                for which, src, dst, rows in T.qkv_blocks(num_heads=heads, num_kv_heads=groups, head_dim=hd)]

    def export(self, shards, ctx, layer):
        q, k, v = self.hf_names(layer)
        rows = {q: ctx.num_heads * ctx.head_dim, k: ctx.num_kv_heads * ctx.head_dim, v: ctx.num_kv_heads * ctx.head_dim}
        out = {name: shards[0].new_empty((n, *shards[0].shape[1:])) for name, n in rows.items()}
        for rank, shard in enumerate(shards):
            for name, _, start, block in self._parts(shard, rank, ctx, layer):
                out[name][start:start + block.shape[0]] = block
        return out

    def export_parts(self, shard, rank, ctx, layer):
        return self._parts(shard, rank, ctx, layer)

    @staticmethod
    def _order(ctx, part: int) -> torch.Tensor:
        """The HF rows of q (``part`` 0), k or v in the order megatron holds them, TP rank after TP rank."""
        local = (ctx.num_heads if part == 0 else ctx.num_kv_heads) // ctx.tp_size * ctx.head_dim
        return torch.tensor([_hf_row(ctx, rank, part, src) for rank in range(ctx.tp_size) for src in range(local)])

    def rows_to_megatron(self, rows: torch.Tensor, ctx, part: int = 0) -> torch.Tensor:
        """A tensor with q's (``part`` 0), k's or v's rows (a LoRA B, a DoRA magnitude) in megatron's order, so
        each TP rank's block is its slice of both halves of the heads, as the weight's."""
        return rows[self._order(ctx, part)]

    def rows_to_hf(self, rows: torch.Tensor, ctx, part: int = 0) -> torch.Tensor:
        """The inverse of ``rows_to_megatron``."""
        out = torch.empty_like(rows)
        out[self._order(ctx, part)] = rows
        return out


@functools.cache
def differential_attention(eps: float) -> type:
    """megatron's ``SelfAttention`` with DiffLlama's doubled values and pair combination (the module docstring)."""
    from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region
    from megatron.core.transformer.attention import SelfAttention

    from loongforge_hf.xpu import get_backend

    class DifferentialSelfAttention(SelfAttention):
        def __init__(self, config, *args, **kwargs) -> None:
            super().__init__(config, *args, **kwargs)
            device = torch.device("cpu") if config.use_cpu_initialization else get_backend().device()
            for name in _LAMBDAS:
                self.register_parameter(name, torch.nn.Parameter(
                    torch.zeros(config.kv_channels, dtype=config.params_dtype, device=device)))
            self.lambda_init = 0.8 - 0.6 * math.exp(-0.3 * (self.layer_number - 1))  # NOTE: megatron counts from 1
            self.linear_proj.register_forward_pre_hook(self._combine_pairs)
            # NOTE: the rank's KV groups of the first half of the heads, then those of the second half
            rows = self.linear_qkv.weight.shape[0]
            tp_sections.declare_rows(self.linear_qkv, (rows // 2, rows // 2))

        def get_query_key_value_tensors(self, *args, **kwargs):
            query, key, value, *rest = super().get_query_key_value_tensors(*args, **kwargs)
            first, second = value.chunk(2, dim=-2)  # NOTE: [..., local KV heads, head_dim]: each half's slice
            value = torch.cat((torch.cat((first, first), dim=-2), torch.cat((second, second), dim=-2)), dim=-1)
            return (query, key, value, *rest)

        def _lambda(self, dtype: torch.dtype) -> torch.Tensor:
            q1, k1, q2, k2 = (copy_to_tensor_model_parallel_region(getattr(self, n)) for n in _LAMBDAS)
            one = torch.exp(torch.sum(q1 * k1, dim=-1, dtype=torch.float32)).to(dtype)
            two = torch.exp(torch.sum(q2 * k2, dim=-1, dtype=torch.float32)).to(dtype)
            return one - two + self.lambda_init

        def _combine_pairs(self, module, args):
            outputs = args[0].unflatten(-1, (-1, 2 * self.config.kv_channels))  # NOTE: [..., local heads, 2 hd]
            first, second = outputs.chunk(2, dim=-2)
            pairs = first - self._lambda(first.dtype) * second
            pairs = torch.nn.functional.rms_norm(pairs, (pairs.shape[-1],), eps=eps) * (1 - self.lambda_init)
            return (pairs.flatten(-2), *args[1:])

    return DifferentialSelfAttention


@register_bridge("DiffLlamaForCausalLM")
class DiffLlamaBridge(DenseBridge):
    def check_config(self) -> None:
        super().check_config()
        c = self.hf_config
        if C.kv_heads_of(c) % 2:
            raise C.UnsupportedConfigError(f"num_key_value_heads={C.kv_heads_of(c)} must be even for "
                                           "DiffLlamaForCausalLM (the values of each half of the KV heads).")
        if getattr(c, "attention_dropout", 0.0):
            raise C.UnsupportedConfigError(f"attention_dropout={c.attention_dropout} is not supported for "
                                           "DiffLlamaForCausalLM.")

    def check_layout(self, layout) -> None:
        tp, kv = layout.tensor_parallel_size, C.kv_heads_of(self.hf_config)
        if kv % (2 * tp):
            raise C.UnsupportedConfigError(
                f"tensor_parallel_size={tp} with num_key_value_heads={kv} is not supported for DiffLlamaForCausalLM "
                "(each rank holds a slice of both halves of the KV heads: they must divide by 2 * TP).")

    def attention_module(self) -> type | None:
        return differential_attention(float(self.hf_config.rms_norm_eps))

    def attention_mappings(self) -> list[Mapping]:
        maps = [HalvesQKV(m.megatron, q=m.q, k=m.k, v=m.v) if isinstance(m, QKV) else m
                for m in super().attention_mappings()]
        return maps + [Replicated(f"{D}.self_attention.{n}", f"{L}.self_attn.{n}") for n in _LAMBDAS]

    def attention_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        hd = C.head_dim_of(self.hf_config)
        return {**super().attention_shapes(prefix), **{f"{prefix}.self_attn.{n}": (hd,) for n in _LAMBDAS}}
