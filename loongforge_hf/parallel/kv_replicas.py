"""More tensor-parallel ranks than KV heads: each HF key / value head replicated on ``tp / kv`` ranks.

Choices:
- megatron-core splits attention by whole query groups (``num_query_groups % tp == 0``). With ``tp = r * kv`` (MQA:
  Falcon-7B, StarCoder; GQA: Qwen2.5-7B's 4 KV heads at TP 8) the model is built with ``num_query_groups = tp``
  (``query_groups``): TP rank ``t`` holds one group, a replica of HF KV head ``t // r``, with the query heads that
  use that head in transformers (``repeat_kv``), so the forward is the HF model's. The bridges' q / k / v mappings
  read each replica from its head's rows and export a head from its first replica (``ShardContext.kv_replicas``).
- Training: the replicas of one HF head stay equal. Each replica's weight (and bias) gradient holds only its own
  query heads' share; the gradient of the HF tensor is their sum. ``sum_replica_grads`` sums the K / V rows of
  ``linear_qkv``'s gradient over the replicas once per step, after megatron's ``finalize_model_grads`` (the engine's
  finalize, which megatron's schedule calls before the optimizer step; a hand-written loop calls it after its
  backward), where megatron sums the sequence-parallel norms' gradients over TP: after the data-parallel
  reduce(-scatter), on the grad buffer (the TP ranks of one data-parallel rank own the same range of it, so the sum
  is right where the optimizer reads it). Equal gradients into equal weights and AdamW states keep the replicas
  equal. Not a gradient hook: megatron's fused weight-gradient GEMM adds into ``main_grad`` without calling one, and
  a hook would reduce once per micro-batch, not once per step.
- One all-reduce over the TP group for every layer: each rank puts its K / V rows in the slot of its HF head of a
  ``kv``-slot buffer (zeros elsewhere); no extra process groups (communicators) are made. With one KV head (MQA) it
  sends exactly the rows; with ``kv`` heads ``kv`` times them.
- Gradient norm (clipping, logging): each HF head counts once. megatron counts a tensor-parallel parameter's rows on
  every rank; ``replica_grad_sq`` is the squared norm of what the non-first replicas repeat (their K / V rows, over
  the part this rank's optimizer holds), which the engine takes off before summing over ranks.
- LoRA's K / V adapters (``k_proj`` / ``v_proj`` slots of ``linear_qkv``) on a replicated head: A is replicated over
  TP as on any column-parallel target (its gradient, summed over the TP ranks, takes every replica's share), B's
  rows (and DoRA's magnitude) are the head's replica, marked as the weight's K / V rows (``mark_adapter_replicas``).
  A packed q / k / v linear's adapter (Phi-3's ``qkv_proj``, Falcon's ``query_key_value``, GPTBigCode's ``c_attn``)
  holds the weight's rows (``packed_mappings``' ``rows_to_megatron`` replicates the head's), so its B and magnitude
  carry the weight's ``kv_replica`` and blocks.
- Parameters holding replicas carry a ``kv_replica`` attribute (``KVReplica``, set by ``mark_replicas`` at build),
  and are keyed in a training checkpoint head by head (``head_blocks``) as the tensor megatron's whole-group layout
  writes, so a resume under another TP size reads the heads it needs (``parallel/tp_sections.py``).
- Mamba2's groups the same way (``bridges/mamba2.py``: Granite 4.0 H's one group at TP 2 or more): each of the
  ``groups`` B / C projections and conv channels replicated on ``tp / groups`` ranks, marked by ``mark_rows`` (the
  same ``KVReplica``, a group for a head), their gradients summed and counted once by the same two functions (one
  all-reduce per distinct number of heads / groups). ``sum_over_replicas``: a forward sum over the ranks sharing a
  group (the gated norm's mean square over a group's channels spread over them), differentiable.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist

from loongforge_hf.parallel import tp_sections

_QKV_NAMES = ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias")


@dataclass(frozen=True)
class KVReplica:
    """What one rank's ``linear_qkv`` weight or bias holds of a replicated KV head."""

    head: int               # the HF KV head
    heads: int              # HF KV heads
    replicas: int           # TP ranks holding each head
    first: bool             # whether this rank holds the head's first replica (the one exported and counted)
    rows: tuple[int, int]   # the K / V rows (dim 0) of the local tensor


def replicas_of(num_key_value_heads: int, tensor_parallel_size: int) -> int:
    """How many TP ranks hold each KV head (1: whole heads per rank)."""
    kv, tp = num_key_value_heads, tensor_parallel_size
    return tp // kv if tp > kv and tp % kv == 0 else 1


def query_groups(num_key_value_heads: int, tensor_parallel_size: int) -> int:
    """megatron's ``num_query_groups`` for a model with ``num_key_value_heads`` at ``tensor_parallel_size``: the KV
    heads, or one group per TP rank when each head is replicated."""
    return num_key_value_heads * replicas_of(num_key_value_heads, tensor_parallel_size)


def check_kv_replication(bridge, parallel) -> None:
    """Refuse (pure, before any collective) a tensor-parallel size above the KV heads where the attention splits a
    tensor by KV heads other than through the q / k / v mappings that give each rank its replica of a head
    (``parallel/kv_replicas.py``): a ``linear_qkv`` of another layout (Qwen3.5's gated q projection), k norms split
    over TP (per head, or over all heads)."""
    from loongforge_hf.bridges.fused_mappings import QKV
    from loongforge_hf.bridges.packed_mappings import GroupedQKV, PackedQKV
    from loongforge_hf.parallel.config import ParallelLayoutError

    kv, tp = bridge.transformer_config_kwargs().get("num_query_groups"), parallel.tensor_parallel_size
    if not kv or replicas_of(kv, tp) == 1:
        return
    for layer in range(bridge.hf_config.num_hidden_layers):
        for m in bridge.mappings_for_layer(layer):
            qkv = m.megatron.endswith(("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"))
            if m.tp_split == "column" and (qkv and not isinstance(m, (QKV, PackedQKV, GroupedQKV))
                                           or "self_attention.k_layernorm." in m.megatron):
                raise ParallelLayoutError(
                    f"tensor_parallel_size={tp} is more than the {kv} KV heads of {bridge.architectures[0]}: each "
                    f"rank would hold a replica of one head, which {m.megatron.format(layer=layer)} "
                    f"({type(m).__name__}) cannot be split into; use a tensor_parallel_size of at most {kv} that "
                    "divides it.")


def mark_replicas(chunks, *, num_key_value_heads: int, head_dim: int, tp_rank: int, tp_size: int) -> int:
    """Set ``kv_replica`` on each ``linear_qkv`` weight and bias of ``chunks`` where heads are replicated; returns how
    many were marked. A rank holds one group, its K / V rows last (megatron's ``[q heads, k, v]``)."""
    r = replicas_of(num_key_value_heads, tp_size)
    if r == 1:
        return 0
    marked = 0
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            if name.endswith(_QKV_NAMES):
                rows = param.shape[0]
                param.kv_replica = KVReplica(head=tp_rank // r, heads=num_key_value_heads, replicas=r,
                                             first=tp_rank % r == 0, rows=(rows - 2 * head_dim, rows))
                tp_sections.declare_blocks(param, head_blocks(rows // head_dim - 2, num_key_value_heads, r,
                                                              tp_rank, head_dim))
                marked += 1
    return marked


def mark_adapter_replicas(module, targets, tp_rank: int) -> None:
    """Mark the B (and DoRA magnitude) of the K / V adapters (``k_proj`` / ``v_proj`` slots; a packed q / k / v
    adapter's K / V rows) on a ``linear_qkv`` holding a replicated KV head (its weight's ``kv_replica``) as replicas
    of that head: each replica's gradient
    holds only its own query heads' share, so they are summed and counted once as the weight's K / V rows
    (``sum_replica_grads``, ``replica_grad_sq``), and a training checkpoint keys them by head (``tp_sections.
    Blocks``: the tensor ranks holding whole heads write). ``tp_rank``: this rank's TP rank."""
    weight = getattr(module, "weight", None)
    info = getattr(weight, "kv_replica", None)
    if info is None:
        return
    for t in targets:
        if t.kind == "column":  # NOTE: a packed q / k / v linear's adapter: B's rows are the weight's
            for factor in (module.lora[t.name].B, module.lora[t.name].magnitude):
                if factor is not None:
                    factor.kv_replica = info
                    tp_sections.declare_blocks(factor, tp_sections.blocks_of(weight))
            continue
        if t.kind != "qkv" or t.slot == 0:
            continue
        adapter = module.lora[t.name]
        for factor in (adapter.B, adapter.magnitude):
            if factor is not None:
                rows = factor.shape[0]
                factor.kv_replica = dataclasses.replace(info, rows=(0, rows))
                tp_sections.declare_blocks(factor, tp_sections.Blocks(rows=rows, total=info.heads, at=(info.head,),
                                                                      replica=(tp_rank % info.replicas,)))


def head_blocks(q_heads: int, num_key_value_heads: int, replicas: int, tp_rank: int, head_dim: int):
    """Where this rank's ``q_heads`` query heads, K and V (one replicated group) sit in megatron's ``linear_qkv`` of
    whole groups, ``[q_g; k_g; v_g]`` per KV group g, as ``tp_sections.Blocks`` of one head each (the checkpoint's
    keying: the same tensor whatever the TP size). Rank ``t`` holds group ``t // replicas``, its share
    ``t % replicas`` of the group's query heads, and replica ``t % replicas`` of its K and V."""
    group, share = divmod(tp_rank, replicas)
    width = q_heads * replicas + 2  # NOTE: one group's blocks: its query heads, then K, then V
    start = group * width
    at = tuple(start + share * q_heads + i for i in range(q_heads)) + (start + width - 2, start + width - 1)
    return tp_sections.Blocks(rows=head_dim, total=num_key_value_heads * width, at=at,
                              replica=(0,) * q_heads + (share, share))


def mark_rows(param, rows: tuple[int, int], *, groups: int, tp_rank: int, tp_size: int) -> None:
    """Set ``kv_replica`` on ``param`` where its ``rows`` (dim 0) hold a replica of one of ``groups`` groups (TP rank
    ``t`` holds group ``t // (tp_size / groups)``); nothing where each rank holds whole groups of its own."""
    r = replicas_of(groups, tp_size)
    if r > 1:
        param.kv_replica = KVReplica(head=tp_rank // r, heads=groups, replicas=r, first=tp_rank % r == 0, rows=rows)


class _SlotSum(torch.autograd.Function):
    """All-reduce (sum) of slot buffers over the TP group, backward the same (each rank's use of the sum differs)."""

    @staticmethod
    def forward(ctx, slots: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        slots = slots.clone()
        dist.all_reduce(slots, group=group)
        return slots

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def sum_over_replicas(x: torch.Tensor, *, groups: int, tp_rank: int, tp_size: int, tp_group) -> torch.Tensor:
    """``x`` summed over the TP ranks that hold replicas of this rank's group (of ``groups``; collective over the
    TP group, differentiable), as ``sum_replica_grads`` sums gradients: one slot per group in one all-reduce."""
    r = replicas_of(groups, tp_size)
    if r == 1:
        return x
    slots = x.new_zeros(groups, *x.shape)
    slots[tp_rank // r] = x
    return _SlotSum.apply(slots, tp_group)[tp_rank // r]


def _grad(param) -> torch.Tensor | None:
    """The gradient megatron's optimizer reads: DDP's ``main_grad`` where the parameter has one, else ``.grad``."""
    main = getattr(param, "main_grad", None)
    return main if main is not None else param.grad


def replicated_params(modules) -> list:
    """The trainable parameters of ``modules`` (chunks, DDP-wrapped or not) holding replicated KV heads (or Mamba2
    groups)."""
    return [p for m in modules for p in m.parameters() if p.requires_grad and getattr(p, "kv_replica", None)]


@torch.no_grad()
def sum_replica_grads(modules, tp_group=None) -> None:
    """Sum the K / V rows of every replicated ``linear_qkv`` gradient (and Mamba2's B / C rows) over the replicas of
    its head (group) (collective over the TP group; every TP rank holds the same parameters, so all join or none).
    ``tp_group``: megatron's."""
    params = [p for p in replicated_params(modules) if _grad(p) is not None]
    if not params:
        return
    if tp_group is None:
        from megatron.core import parallel_state as ps

        tp_group = ps.get_tensor_model_parallel_group()
    for heads in sorted({p.kv_replica.heads for p in params}):  # NOTE: KV heads, Mamba2 groups: the same on all ranks
        _sum_rows([p for p in params if p.kv_replica.heads == heads], tp_group)


def _sum_rows(params, tp_group) -> None:
    """``sum_replica_grads`` for parameters replicating one of the same number of heads (or groups)."""
    info = params[0].kv_replica
    rows = [_grad(p)[p.kv_replica.rows[0]:p.kv_replica.rows[1]] for p in params]
    flat = torch.cat([r.reshape(-1) for r in rows])
    # NOTE: one slot per HF head: the TP-wide sum of a slot is the sum over that head's replicas
    slots = flat.new_zeros(info.heads, flat.numel())
    slots[info.head] = flat
    dist.all_reduce(slots, group=tp_group)
    offset = 0
    for r in rows:
        r.copy_(slots[info.head, offset:offset + r.numel()].view_as(r))
        offset += r.numel()


def _owned(part, param, held: set[int]) -> tuple[int, int] | None:
    """The flat range of ``param`` whose gradient optimizer ``part`` reads (the distributed optimizer: this
    data-parallel rank's shard of it), or None where the part does not hold it (``held``: the ids of the parameters
    a non-distributed part's torch optimizer steps)."""
    gbuf_map = getattr(part, "model_param_gbuf_map", None)
    if gbuf_map is not None:  # NOTE: megatron's DistributedOptimizer
        if param not in gbuf_map:
            return None
        r = part._get_model_param_range_map(param)["param"]
        return r.start, r.end
    return (0, param.numel()) if id(param) in held else None


def _held(part) -> set[int]:
    torch_opt = getattr(part, "optimizer", None)
    return set() if torch_opt is None else {id(p) for g in torch_opt.param_groups for p in g["params"]}


@torch.no_grad()
def replica_grad_sq(parts, modules, device: torch.device) -> torch.Tensor:
    """The squared l2 norm (fp32, shape ``[1]``) of the K / V gradient rows this rank's non-first replicas hold in
    optimizer ``parts``: megatron's gradient norm counts each replica; taken off, each HF head counts once."""
    total = torch.zeros(1, dtype=torch.float32, device=device)
    params = [p for p in replicated_params(modules) if not p.kv_replica.first and _grad(p) is not None]
    if not params:
        return total
    held = [_held(part) for part in parts]
    for param in params:
        info, grad = param.kv_replica, _grad(param)
        width = param[0].numel() if param.dim() > 1 else 1
        kv_start, kv_stop = info.rows[0] * width, info.rows[1] * width
        for part, ids in zip(parts, held):
            owned = _owned(part, param, ids)
            if owned is None:
                continue
            start, stop = max(owned[0], kv_start), min(owned[1], kv_stop)
            if start < stop:
                total += grad.reshape(-1)[start:stop].float().square().sum().to(device)
    return total
