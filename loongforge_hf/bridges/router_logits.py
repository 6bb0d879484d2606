"""transformers' ``router_logits`` output for the MoE bridges whose HF models return it (``hf_router_logits``:
Qwen3-MoE, Mixtral, DeepSeek-V2/V3): per MoE layer, in layer order, the router's logits before the softmax / sigmoid,
``[batch * seq, experts]`` with the tokens in batch-major order (pads included), on every rank.

Choices:
- Recorded by the bridges' router (``router_balance.BalanceRouter``), which megatron hands each MoE layer's gating
  logits, only while the model's ``forward`` records (``recording``): the trainer's engine runs the chunks without a
  recorder, so training steps neither keep nor gather them.
- Put back together once per forward, for all of a rank's layers at once (``collect``). The ranks that split the tokens
  (tensor-parallel ranks under sequence parallelism, context-parallel ranks: the group megatron's router reduces its
  token statistics over) all-gather their logits and their tokens' global positions, and each row goes to its
  position: megatron's ``[seq, batch]`` order, its load-balanced context-parallel chunks and the sequence-parallel
  split are undone. Then batch-major, the pads the model added for its layout trimmed (``trainer.data.
  pad_model_inputs``). Pipeline parallelism: every stage writes its layers' rows (and a flag) into a ``[layers, ...]``
  buffer of zeros, summed over the pipeline group (one all-reduce; adding zeros is exact), so every rank returns the
  whole tuple, as the model's other outputs under pipeline parallelism.
- The gradient: where the forward builds a graph (no pipeline parallelism) the logits carry it, as transformers' do:
  each rank's own tokens' rows are the router's output, the other ranks' rows are copies without one. An objective
  computed alike on every rank of the group then gives each rank its own tokens' part of the router's gradient, which
  megatron sums over the ranks that split the tokens in training (the model's loss does the same). Detached: the
  pipelined forward (it runs without grad), and layers under activation recompute (megatron runs a checkpointed
  layer's forward without grad; the backward's recompute is not recorded).
- A model with several routers per layer (JetMoE: its attention's, then its MoE layer's) gives ``RouterLogits``
  ``per_layer`` slots, each router its ``router_logits_slot`` (default the last: the MoE layer's), in
  transformers' order; routers besides megatron's declare ``records_router_logits`` (``recording_routers``).
- The dtype is the router's: megatron's ``moe_router_dtype`` (fp32 for routers transformers keeps in fp32), else the
  model's, as transformers' gating linear gives it.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from loongforge_hf.kernels.grouped_mlp import DenseGrad


class RouterLogits:
    """One forward's router logits on this rank: global layer number -> ``[local seq, batch, experts]``."""

    def __init__(self, config, *, batch: int, seq: int, given: int, per_layer: int = 1) -> None:
        """``config``: the model's megatron ``TransformerConfig``; ``seq``: the forward's length padded for the
        layout, ``given``: the caller's; ``per_layer``: the routers of each layer (module docstring)."""
        self.batch, self.seq, self.given = batch, seq, given
        self.experts = config.num_moe_experts
        self.per_layer = per_layer
        self.num_layers = config.num_layers * per_layer
        self.dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(config.moe_router_dtype, config.params_dtype)
        self.layers: dict[int, torch.Tensor] = {}
        self.router = None  # one of the recording routers: its process groups and layout

    def record(self, router, logits: torch.Tensor) -> None:
        if logits.requires_grad:
            # NOTE: megatron-core 0.16.1's router gating backward views its gradient, and one that comes back
            # through the reordering in ``collect`` is a transposed view
            logits = DenseGrad.apply(logits)
        self.experts = logits.shape[-1]  # NOTE: the router's width (LongCat-Flash's zero experts widen it)
        slot = getattr(router, "router_logits_slot", self.per_layer - 1)
        key = (router.layer_number - 1) * self.per_layer + slot + 1
        self.layers[key] = logits.reshape(-1, self.batch, self.experts)
        self.router = router

    def collect(self, device) -> tuple[torch.Tensor, ...]:
        """The tuple transformers returns (collective: every rank of the model, after the forward)."""
        from megatron.core import parallel_state as ps

        numbers = sorted(self.layers)
        rows = self.batch * self.given
        local = None
        if numbers:
            whole = self._whole_sequence(torch.stack([self.layers[n] for n in numbers]))  # [L, s, b, E]
            local = whole[:, :self.given].transpose(1, 2).reshape(len(numbers), rows, self.experts)
        if ps.get_pipeline_model_parallel_world_size() == 1:
            return tuple(local) if local is not None else ()
        # NOTE: a [layers, rows * E + 1] buffer, the last column flags the MoE layers a stage filled in
        buffer = torch.zeros(self.num_layers, rows * self.experts + 1, device=device,
                             dtype=torch.promote_types(self.dtype, torch.float32))
        if local is not None:
            index = torch.tensor(numbers, device=device) - 1
            buffer[index, :-1] = local.detach().reshape(len(numbers), -1).to(buffer.dtype)
            buffer[index, -1] = 1.0
        dist.all_reduce(buffer, group=ps.get_pipeline_model_parallel_group())
        moe = buffer[:, -1] > 0
        return tuple(buffer[moe, :-1].reshape(-1, rows, self.experts).to(self.dtype))

    def _whole_sequence(self, local: torch.Tensor) -> torch.Tensor:
        """``[L, local seq, b, E]`` of every rank that splits the tokens -> ``[L, seq, b, E]`` in sequence order."""
        router = self.router
        group = router.tp_cp_group if router.config.sequence_parallel else router.cp_group
        if group.size() == 1:
            return local
        positions = _token_positions(router, self.seq, device=local.device)
        parts = [torch.empty_like(local) for _ in range(group.size())]
        dist.all_gather(parts, local.detach().contiguous(), group=group)
        where = [torch.empty_like(positions) for _ in range(group.size())]
        dist.all_gather(where, positions, group=group)
        parts[group.rank()] = local  # NOTE: this rank's own tokens keep the router's gradient
        whole = local.new_zeros(local.shape[0], self.seq, *local.shape[2:])
        return whole.index_copy(1, torch.cat(where), torch.cat(parts, dim=1))


def _token_positions(router, seq: int, *, device) -> torch.Tensor:
    """The global sequence positions of this rank's router rows (``context_parallel.local_token_positions`` over
    the router's groups)."""
    from loongforge_hf.parallel.context_parallel import local_token_positions

    sp = router.config.sequence_parallel
    return local_token_positions(seq, cp_size=router.cp_group.size(), cp_rank=router.cp_group.rank(),
                                 sp_size=router.tp_group.size() if sp else 1,
                                 sp_rank=router.tp_group.rank() if sp else 0, device=device)


def asked(config, output_router_logits: bool | None) -> bool:
    """Whether a forward returns them: the forward keyword, else the config's ``output_router_logits``, as in
    transformers."""
    return bool(getattr(config, "output_router_logits", False) if output_router_logits is None
                else output_router_logits)


def recording_routers(chunks, bridge) -> list:
    """The chunks' ``BalanceRouter`` modules of a bridge with ``hf_router_logits`` (none on a stage without MoE
    layers), and its other modules that declare ``records_router_logits`` (JetMoE's attention routers); [] for
    other bridges."""
    if not getattr(bridge, "hf_router_logits", False):
        return []
    from loongforge_hf.bridges.router_balance import balance_router_class

    cls = balance_router_class()
    return [m for chunk in chunks for m in chunk.modules()
            if isinstance(m, cls) or getattr(m, "records_router_logits", False)]


@contextlib.contextmanager
def recording(routers: list, recorder: RouterLogits):
    """Inside, ``routers`` (``BalanceRouter`` modules) hand their logits to ``recorder``."""
    for router in routers:
        router.recorder = recorder
    try:
        yield recorder
    finally:
        for router in routers:
            router.recorder = None
