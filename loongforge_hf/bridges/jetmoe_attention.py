"""JetMoE's mixture of attention heads (transformers' ``JetMoeAttention`` / ``JetMoeMoA``) as megatron's
``SelfAttention`` with its two projection slots replaced, and JetMoE's MoE layer (megatron's ``MoELayer`` plus the
output bias).

Choices:
- The query and output projections are experts: a replicated router (``[E, H]``, logits in fp32, the top k of them,
  softmax over the k chosen, in the model's dtype as transformers' ``JetMoeTopKGating``) picks k experts per token;
  slot ``j``'s query is expert ``e_j``'s ``query`` projection (``[E, kv_heads * head_dim, H]``), all slots attend to
  one shared key / value projection (``kv``, transformers' ``kv_proj``: ``[k; v]`` rows, megatron's
  ``ColumnParallelLinear``, so LoRA adapts it as any column-parallel linear), and each slot's attention
  output goes through expert ``e_j``'s ``output`` projection (``[E, H, kv_heads * head_dim]``), times its gate,
  summed over the slots, plus ``bias`` (added by megatron's bias-dropout-add, as a row-parallel linear's bias).
- Heads: megatron sees ``k * kv_heads`` query heads in ``kv_heads`` groups, group ``h`` holding slot ``j`` at head
  ``h * k + j`` (transformers tiles the keys over the slots: the same pairs); rope, the causal / padding masks,
  packed documents, the KV cache and context parallelism are megatron's attention and our ``CoreAttention``.
- Tensor parallelism splits the KV heads: rank ``r`` holds its heads' rows of every expert's ``query``, their
  ``k`` / ``v`` rows of ``kv`` and their columns of every expert's ``output`` (summed over the ranks as a
  row-parallel linear: all-reduce, or reduce-scatter under sequence parallelism, which all-gathers the tokens once
  at the input). Every rank routes all its tokens alike; the gates pass a copy-to-tensor-parallel region (their
  gradient summed over the ranks' heads) and the router reads the gathered tokens without the reduce-scatter in the
  backward: the router's gradient is whole on every rank, as a replicated weight's.
- Experts run as transformers' loop over experts on their tokens (one linear per expert).
- transformers' ``router_logits`` and balancing loss count this router beside the MoE layer's, first in each layer
  (``router_logits.RouterLogits``' ``per_layer`` slots): the attention's ``linear_qkv`` is a recording router
  (``records_router_logits``) that hands the forward's recorder and balance tally (``router_balance``) the logits of
  this rank's own tokens, as megatron's MoE router sees them. Under sequence parallelism it reads every token, so
  its own rows are split off with megatron's scatter-to-sequence-parallel region (its backward all-gathers their
  gradient): the router's gradient of ``router_logits`` and of the balancing loss stays whole on every rank.
- Checkpoints (``sharded_state_dict``): the query and output stacks split by heads over TP as held, the router and
  the output bias replicated, ``kv`` as megatron's linear (and LoRA's adapter on it) shards itself.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import torch
import torch.nn.functional as F

from loongforge_hf.bridges.own_weights import adapted
from loongforge_hf.parallel import tp_sections


def _parameter(config, *shape: int, split_dim: int | None, bias: bool = False) -> torch.nn.Parameter:
    """A parameter of this rank's ``shape`` (normal with the config's std, zeros for a ``bias``), split over TP along
    ``split_dim`` (None: replicated; a ``bias`` is added to each rank's own tokens, so summed over TP under SP)."""
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    from loongforge_hf.xpu import get_backend

    device = torch.device("cpu") if config.use_cpu_initialization else get_backend().device()
    param = torch.nn.Parameter(torch.empty(*shape, dtype=config.params_dtype, device=device))
    with torch.no_grad():
        param.zero_() if bias else param.normal_(0.0, config.init_method_std)
    if split_dim is not None:
        set_tensor_model_parallel_attributes(param, True, split_dim, 1)
    if bias:
        param.sequence_parallel = config.sequence_parallel
    return param


def _tp(tp_group) -> tuple[int, object]:
    """(size, group) of the tensor-parallel group megatron hands the slot, else the global one."""
    if tp_group is None:
        from megatron.core import parallel_state as ps

        tp_group = ps.get_tensor_model_parallel_group(check_initialized=False)
    return (tp_group.size() if tp_group is not None else 1), tp_group


def _sharded(tensors: dict, axes: dict, tp_group, prefix: str, sharded_offsets: tuple, metadata: dict | None):
    """megatron's sharded tensors of ``tensors`` (split over TP along ``axes[name]``, else replicated)."""
    from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint

    metadata = ensure_metadata_has_dp_cp_group(metadata)
    return make_sharded_tensors_for_checkpoint(tensors, prefix, axes, sharded_offsets, tp_group=tp_group,
                                               dp_cp_group=metadata["dp_cp_group"])


class Routing:
    """One forward's routing: each (token, slot) pair sorted by expert (``order``), the experts' pair counts and
    the slots' gates ``[tokens, k]``."""

    def __init__(self, top: torch.Tensor, gates: torch.Tensor, experts: int) -> None:
        flat = top.reshape(-1)
        self.order = flat.argsort(stable=True)
        self.counts = torch.bincount(flat, minlength=experts).tolist()
        self.gates, self.k = gates, top.shape[-1]


def _per_expert(rows: torch.Tensor, weight: torch.Tensor, routing: Routing) -> torch.Tensor:
    """``rows`` (sorted by expert) each through its expert's linear ``weight[e]``."""
    parts = rows.split(routing.counts)
    return torch.cat([F.linear(p, weight[e]) for e, p in enumerate(parts)], dim=0)


def _kv_linear(input_size: int, output_size: int, config, tp_group):
    """The shared key / value projection: megatron's ``ColumnParallelLinear`` (this rank's heads' ``[k; v]`` rows;
    LoRA adapts it as any column-parallel linear)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    return ColumnParallelLinear(input_size, output_size, config=config, init_method=config.init_method, bias=False,
                                gather_output=False, tp_group=tp_group)


class MoAQueryKV(torch.nn.Module):
    """The ``linear_qkv`` slot: router, query experts and the shared ``kv`` of this rank's KV heads; returns
    ``(query [s, b, k * heads, d], key, value [s, b, heads, d], routing)``."""

    records_router_logits = True  # NOTE: router_logits.recording_routers: a router beside the MoE layers'
    # NOTE: transformers' router.layer linear, which LoRA adapts: whole on every rank, its gradient whole there
    # (lora/own_weights.py)
    lora_own_weights = {"router": "whole"}
    balance = None  # the model's router_balance.RouterBalance (router_balance.attach)
    recorder = None  # the forward's router_logits.RouterLogits while it records
    router_logits_slot = 0  # NOTE: transformers runs the attention's router first in each layer

    def __init__(self, input_size: int, output_size: int, *, config, tp_group=None, experts: int, top_k: int,
                 **_: object) -> None:
        super().__init__()
        self.config, self.experts, self.top_k = config, experts, top_k
        self.tp_size, self.tp_group = _tp(tp_group)
        self.layer_number = self.cp_group = self.tp_cp_group = None  # set by the attention (moa_attention)
        self.heads = config.num_query_groups // self.tp_size
        self.head_dim, rows = config.kv_channels, config.num_query_groups // self.tp_size * config.kv_channels
        self.router = _parameter(config, experts, input_size, split_dim=None)
        self.query = _parameter(config, experts, rows, input_size, split_dim=1)
        self.kv = _kv_linear(input_size, 2 * config.num_query_groups * config.kv_channels, config, self.tp_group)
        tp_sections.declare_rows(self.kv, (rows, rows))  # NOTE: this rank's key heads' rows, then their values'

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """Checkpoint tensors: ``query`` split by heads over TP (its rows), ``router`` replicated, ``kv`` as its
        megatron linear (with its LoRA adapter) gives them."""
        from megatron.core.transformer.utils import sharded_state_dict_default

        out = _sharded({"router": self.router, "query": self.query}, {"query": 1}, self.tp_group, prefix,
                       sharded_offsets, metadata)
        return {**out, **sharded_state_dict_default(self.kv, f"{prefix}kv.", sharded_offsets, metadata,
                                                    tp_group=self.tp_group)}

    def _inputs(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the tokens for the projections, the tokens for the router): see the module docstring."""
        from megatron.core.tensor_parallel import mappings as M

        if self.tp_size == 1:
            return hidden, hidden
        if self.config.sequence_parallel:
            return (M.gather_from_sequence_parallel_region(hidden, group=self.tp_group),
                    M.gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False,
                                                           group=self.tp_group))
        return M.copy_to_tensor_model_parallel_region(hidden, group=self.tp_group), hidden

    def forward(self, hidden: torch.Tensor):
        from megatron.core.tensor_parallel import mappings as M

        x, routed = self._inputs(hidden)
        s, b, h = x.shape
        logits = adapted(self, "router", routed, F.linear(routed, self.router)).float().reshape(s * b, self.experts)
        top_logits, top = logits.topk(self.top_k, dim=-1)
        gates = self._hand_out(logits, top, torch.softmax(top_logits, dim=-1).type_as(x), s)
        if self.tp_size > 1:
            gates = M.copy_to_tensor_model_parallel_region(gates, group=self.tp_group)
        routing = Routing(top, gates, self.experts)
        flat = x.reshape(s * b, h)
        sorted_q = _per_expert(flat[routing.order // self.top_k], self.query, routing)
        query = torch.empty_like(sorted_q).index_copy(0, routing.order, sorted_q)
        query = query.view(s, b, self.top_k, self.heads, self.head_dim).transpose(2, 3)
        kv, _ = self.kv(hidden)  # NOTE: megatron's linear gathers the tokens (SP) or copies them itself
        key, value = kv.view(s, b, 2, self.heads, self.head_dim).unbind(2)
        return query.reshape(s, b, self.heads * self.top_k, self.head_dim), key, value, routing

    def _hand_out(self, logits: torch.Tensor, top: torch.Tensor, gates: torch.Tensor, s: int) -> torch.Tensor:
        """Hand this rank's own tokens' logits to the forward's recorder and balance tally (module docstring); the
        gates (with the tally's gradient hand-in)."""
        tally = self.balance is not None and self.balance.tally is not None
        if self.recorder is None and not tally:
            return gates
        own, own_top = logits, top
        if self.config.sequence_parallel and self.tp_size > 1:
            from megatron.core.tensor_parallel import mappings as M

            own = M.scatter_to_sequence_parallel_region(logits.view(s, -1, self.experts), group=self.tp_group)
            rows = own.shape[0] * own.shape[1]
            own, own_top = own.reshape(rows, self.experts), top[self.tp_group.rank() * rows:][:rows]
        if self.recorder is not None:
            self.recorder.record(self, own)
        if tally:
            counted = torch.zeros_like(own, dtype=torch.bool).scatter_(1, own_top, True)
            gates = self.balance.take(self, own, counted, gates)
        return gates


class MoAOutput(torch.nn.Module):
    """The ``linear_proj`` slot: each slot's heads through its expert's ``weight`` (this rank's columns), times the
    gate, summed over slots and ranks; returns ``(output, bias)`` (``routing`` set by the attention first)."""

    def __init__(self, input_size: int, output_size: int, *, config, tp_group=None, experts: int, **_: object):
        super().__init__()
        self.config = config
        self.tp_size, self.tp_group = _tp(tp_group)
        cols = config.num_query_groups // self.tp_size * config.kv_channels
        self.weight = _parameter(config, experts, output_size, cols, split_dim=2)
        self.bias = _parameter(config, output_size, split_dim=None, bias=True)
        self.routing: Routing | None = None

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """Checkpoint tensors: ``weight`` split by heads over TP (its columns), ``bias`` replicated."""
        return _sharded({"weight": self.weight, "bias": self.bias}, {"weight": 2}, self.tp_group, prefix,
                        sharded_offsets, metadata)

    def forward(self, attended: torch.Tensor):
        from megatron.core.tensor_parallel import mappings as M

        routing, self.routing = self.routing, None
        s, b, _ = attended.shape
        k, d = routing.k, self.config.kv_channels
        slots = attended.view(s * b, -1, k, d).transpose(1, 2).reshape(s * b * k, -1)
        out = _per_expert(slots[routing.order], self.weight, routing) * routing.gates.reshape(-1)[routing.order, None]
        out = out.new_zeros(s * b, out.shape[-1]).index_add(0, routing.order // k, out).view(s, b, -1)
        if self.tp_size > 1:
            out = (M.reduce_scatter_to_sequence_parallel_region(out, group=self.tp_group)
                   if self.config.sequence_parallel else
                   M.reduce_from_tensor_model_parallel_region(out, group=self.tp_group))
        return out, self.bias


@functools.cache
def moa_attention(*, experts: int, top_k: int) -> type:
    """megatron's ``SelfAttention`` with JetMoE's mixture of attention heads (module docstring)."""
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.spec_utils import ModuleSpec

    class MoASelfAttention(SelfAttention):
        def __init__(self, config, submodules, *args, **kwargs) -> None:
            submodules = replace(submodules,
                                 linear_qkv=functools.partial(MoAQueryKV, experts=experts, top_k=top_k),
                                 linear_proj=ModuleSpec(module=MoAOutput, params={"experts": experts}))
            super().__init__(config, submodules, *args, **kwargs)
            from megatron.core import parallel_state as ps

            router = self.linear_qkv
            router.layer_number, router.cp_group = self.layer_number, self.pg_collection.cp
            router.tp_cp_group = getattr(self.pg_collection, "tp_cp", None) or \
                ps.get_tensor_and_context_parallel_group()

        def get_query_key_value_tensors(self, hidden_states, key_value_states=None, output_gate=False,
                                        split_qkv=True):
            query, key, value, self.linear_proj.routing = self.linear_qkv(hidden_states)
            return query, key, value

    return MoASelfAttention


@functools.cache
def biased_moe_layer() -> type:
    """megatron's ``MoELayer`` with transformers' ``JetMoeMoE.bias`` ``[H]`` after the experts, returned as the
    layer's bias (megatron's bias-dropout-add adds it to each rank's own tokens)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    class BiasedMoELayer(MoELayer):
        def __init__(self, config, *args, **kwargs) -> None:
            super().__init__(config, *args, **kwargs)
            self.bias = _parameter(config, config.hidden_size, split_dim=None, bias=True)

        def forward(self, *args, **kwargs):
            output, bias = super().forward(*args, **kwargs)
            return output, self.bias if bias is None else bias + self.bias

    return BiasedMoELayer
