"""MoE token permute / unpermute: megatron's ``moe_permute_fusion`` slot filled without Transformer Engine.

Choices:
- Same results as megatron-core 0.16's unfused ``moe_utils.permute`` / ``unpermute`` (tokens grouped by expert,
  ascending token index inside an expert, as a masked_select over the transposed routing map gives), gradients of
  the tokens and of the probs included. The permutation is one ``[T, E]`` int32 row map (the permuted row of each
  (token, expert) pair, -1 where the token does not go to the expert), built on the device from a cumulative sum
  of the transposed routing map: no host sync. ``num_out_tokens`` (the number of permuted rows) comes from the caller,
  known on the host as in megatron's dispatchers; without it the routed pairs are counted (one host sync, as
  megatron's masked_select has). A smaller ``num_out_tokens`` drops the last rows; it must not be larger than the
  number of routed pairs.
- Unpermute has no atomics: each output token is the fp32 sum of its permuted rows (times their probs), rounded once.
  megatron's unfused path scatter-adds in the output dtype (bf16 rounds at each add) or, with probs, multiplies in
  the probs' dtype first; permute's backward (an ``index_add_`` there) is the same gather-sum here.
- Permute's backward = that gather-sum of the permuted grad (and the permuted probs' grad back to ``[T, E]``, zeros
  where not routed); unpermute's backward = the output grad to each permuted row (times the prob, fp32, one
  rounding) and the probs' grad, the fp32 dot of the output grad and the permuted row of each routed pair.
- On CUDA with Triton the data movement is ``_moe_permute_triton.py`` (one program per token and hidden block); the
  torch code here is the CPU path and the reference (same math: fp32 ``index_add_``).
- ``enable_megatron_fused_permute(config)`` points megatron's dispatchers at these functions, as
  ``rope.enable_megatron_fused_rope`` does for the rotary embedding: it sets ``config.moe_permute_fusion`` and
  replaces the ``permute`` / ``unpermute`` / ``sort_chunks_by_idxs`` names that ``token_dispatcher`` imported from
  ``moe_utils`` with wrappers sending ``fused=True`` calls here (megatron's drop-and-pad path and the chunk sort stay
  megatron's unfused code). Only where megatron would otherwise have no fused kernels (no TE) and only for the
  paths served: the ``allgather`` dispatcher, and the ``alltoall`` one with one local expert per rank (with more,
  ``moe_permute_fusion`` keeps the chunk sort's split sizes on the device, which the unfused sort reads back to the
  host) on CUDA (the flag puts its chunk indices on ``cuda``); no token dropping, capacity or router padding.
- Where every expert is local (expert parallel 1, the layout ``bridges.specs`` gives the ``allgather`` dispatcher),
  the dispatch needs no host sync at all: each token goes to exactly ``topk`` experts, so the permuted row count is
  ``tokens * topk``, known on the host. megatron's ``dispatch_postprocess`` still reads the token counts back
  (``.cpu()``) and selects the probabilities with a ``masked_select`` (a data-dependent size): two syncs per MoE
  layer, each leaving the GPU idle until the host has queued work again (~15 ms of a 95 ms step of workload (c)).
  ``SyncFreeAllGatherDispatcher`` keeps the counts on the device (the grouped experts take them there) and permutes
  the probabilities with the tokens, in the same order ``masked_select`` gives.
- ``fixed_shape_moe(layer)``: whether a built MoE layer's forward and backward run at fixed shapes with no host read
  (this dispatcher with every expert local, and grouped experts on ``torch._grouped_mm``, which reads its offsets on
  the device), i.e. can be captured in a CUDA graph: the static cache's decode step (``static_cache.graph_refusal``)
  and megatron's per-layer training graphs (``bridges/moe_graphs.check_built``) ask it.
"""

from __future__ import annotations

import torch

from loongforge_hf.kernels._saved import needs_autograd
from loongforge_hf.kernels._triton import use_triton


def _row_map(routing_map: torch.Tensor, num_rows: int) -> torch.Tensor:
    """``[T, E]`` int32: the permuted row of each routed (token, expert) pair, -1 elsewhere and past ``num_rows``."""
    routed = routing_map.bool().T.contiguous().view(-1)
    rows = torch.cumsum(routed, 0, dtype=torch.int32) - 1
    rows = torch.where(routed & (rows < num_rows), rows, -1)
    return rows.view(routing_map.shape[1], routing_map.shape[0]).T.contiguous()


def _pairs(row_map: torch.Tensor, num_rows: int) -> torch.Tensor:
    """int64 ``[num_rows]``: the flat (token * E + expert) index of each permuted row (torch path)."""
    flat = row_map.view(-1).long()
    target = torch.where(flat >= 0, flat, num_rows)
    pairs = torch.zeros(num_rows + 1, dtype=torch.long, device=row_map.device)
    pairs.scatter_(0, target, torch.arange(flat.numel(), device=row_map.device))
    return pairs[:num_rows]


def _gather_sum(x: torch.Tensor, row_map: torch.Tensor, probs: torch.Tensor | None, out_dtype: torch.dtype
                ) -> torch.Tensor:
    if use_triton(x):
        from loongforge_hf.kernels import _moe_permute_triton

        return _moe_permute_triton.gather_sum(x, row_map, probs, out_dtype)
    tokens, experts = row_map.shape
    pairs = _pairs(row_map, x.shape[0])
    terms = x.float()
    if probs is not None:
        terms = terms * probs.reshape(-1).index_select(0, pairs).float().unsqueeze(-1)
    out = torch.zeros((tokens, x.shape[1]), dtype=torch.float32, device=x.device)
    return out.index_add_(0, pairs // experts, terms).to(out_dtype)


def _scatter(x: torch.Tensor, row_map: torch.Tensor, num_rows: int, probs: torch.Tensor | None, *, scale: bool,
             copy_probs: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    if use_triton(x):
        from loongforge_hf.kernels import _moe_permute_triton

        return _moe_permute_triton.scatter(x, row_map, num_rows, probs, scale=scale, copy_probs=copy_probs)
    experts = row_map.shape[1]
    pairs = _pairs(row_map, num_rows)
    out = x.index_select(0, pairs // experts)
    permuted_probs = probs.reshape(-1).index_select(0, pairs) if probs is not None else None
    if scale:
        out = (out.float() * permuted_probs.float().unsqueeze(-1)).to(x.dtype)
    return out, permuted_probs if copy_probs else None


def _unpermuted_probs_grad(grad: torch.Tensor, row_map: torch.Tensor) -> torch.Tensor:
    """``[T, E]``: the grad of each routed pair's permuted prob, 0 where not routed."""
    rows = row_map.long()
    taken = grad.index_select(0, rows.clamp(min=0).view(-1)).view(rows.shape)
    return torch.where(rows >= 0, taken, torch.zeros((), dtype=grad.dtype, device=grad.device))


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tokens, probs, row_map, num_rows):
        ctx.save_for_backward(row_map)
        ctx.tokens_dtype = tokens.dtype
        return _scatter(tokens, row_map, num_rows, probs, scale=False, copy_probs=probs is not None)

    @staticmethod
    def backward(ctx, grad_out, grad_probs):
        (row_map,) = ctx.saved_tensors
        grad_tokens = grad_probs_full = None
        if ctx.needs_input_grad[0] and grad_out is not None:
            grad_tokens = _gather_sum(grad_out, row_map, None, ctx.tokens_dtype)
        if ctx.needs_input_grad[1] and grad_probs is not None:
            grad_probs_full = _unpermuted_probs_grad(grad_probs, row_map)
        return grad_tokens, grad_probs_full, None, None


class _Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, permuted, probs, row_map):
        ctx.save_for_backward(permuted if probs is not None else None, probs, row_map)
        ctx.num_rows = permuted.shape[0]
        return _gather_sum(permuted, row_map, probs, permuted.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        permuted, probs, row_map = ctx.saved_tensors
        if probs is None:
            grad_x, _ = _scatter(grad_out, row_map, ctx.num_rows, None, scale=False, copy_probs=False)
            return grad_x, None, None
        if use_triton(grad_out):
            from loongforge_hf.kernels import _moe_permute_triton

            grad_x, grad_p = _moe_permute_triton.scatter_with_prob_grads(grad_out, permuted, row_map, probs)
        else:
            grad_x, _ = _scatter(grad_out, row_map, ctx.num_rows, probs, scale=True, copy_probs=False)
            pairs = _pairs(row_map, ctx.num_rows)
            dots = (grad_out.float().index_select(0, pairs // row_map.shape[1]) * permuted.float()).sum(-1)
            grad_p = torch.zeros(row_map.numel(), dtype=torch.float32, device=grad_out.device)
            grad_p = grad_p.index_copy_(0, pairs, dots).view(row_map.shape).to(probs.dtype)
        return grad_x.to(permuted.dtype), grad_p if ctx.needs_input_grad[1] else None, None


def permute(tokens: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor | None = None,
            num_out_tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Tokens ``[T, H]`` grouped by expert: (permuted tokens ``[num_out_tokens, H]``, permuted probs
    ``[num_out_tokens]`` or None, the ``[T, E]`` row map that ``unpermute`` takes)."""
    if num_out_tokens is None:
        num_out_tokens = int(routing_map.sum())
    row_map = _row_map(routing_map, int(num_out_tokens))
    if not needs_autograd(tokens, probs):  # NOTE: inference: no Function
        out, out_probs = _scatter(tokens, row_map, int(num_out_tokens), probs, scale=False,
                                  copy_probs=probs is not None)
        return out, out_probs, row_map
    out, out_probs = _Permute.apply(tokens, probs, row_map, int(num_out_tokens))
    return out, out_probs, row_map


def unpermute(permuted_tokens: torch.Tensor, row_map: torch.Tensor, restore_shape: torch.Size,
              probs: torch.Tensor | None = None, routing_map: torch.Tensor | None = None) -> torch.Tensor:
    """Each token's permuted rows summed back (times ``probs [T, E]`` when given): ``restore_shape`` ``[T, H]``.
    ``routing_map`` is accepted for megatron's signature; the row map already holds it."""
    if tuple(restore_shape) != (row_map.shape[0], permuted_tokens.shape[-1]):
        raise ValueError(f"unpermute: restore_shape {tuple(restore_shape)} does not match the row map "
                         f"({row_map.shape[0]} tokens) and hidden size {permuted_tokens.shape[-1]}")
    if not needs_autograd(permuted_tokens, probs):  # NOTE: inference
        return _gather_sum(permuted_tokens, row_map, probs, permuted_tokens.dtype)
    return _Unpermute.apply(permuted_tokens, probs, row_map)


def _dispatcher_paths_served(config) -> bool:
    if (config.moe_pad_expert_input_to_capacity or config.moe_expert_capacity_factor is not None
            or getattr(config, "moe_router_padding_for_quantization", False)):
        return False
    if config.moe_token_dispatcher_type == "allgather":
        return True
    if config.moe_token_dispatcher_type == "alltoall":
        from loongforge_hf.xpu import get_backend

        return get_backend().name == "cuda" and config.num_moe_experts == config.expert_model_parallel_size
    return False


def _fused_to_ours(original_permute, original_unpermute, original_sort_chunks):
    def permute_(tokens, routing_map, probs=None, num_out_tokens=None, fused=False, drop_and_pad=False):
        if not fused or drop_and_pad:
            return original_permute(tokens, routing_map, probs=probs, num_out_tokens=num_out_tokens, fused=False,
                                    drop_and_pad=drop_and_pad)
        return permute(tokens, routing_map, probs, None if num_out_tokens is None else int(num_out_tokens))

    def unpermute_(permuted_tokens, sorted_indices, restore_shape, probs=None, routing_map=None, fused=False,
                   drop_and_pad=False):
        if not fused or drop_and_pad:
            return original_unpermute(permuted_tokens, sorted_indices, restore_shape, probs=probs,
                                      routing_map=routing_map, fused=False, drop_and_pad=drop_and_pad)
        return unpermute(permuted_tokens, sorted_indices, restore_shape, probs, routing_map)

    def sort_chunks_by_idxs_(input, split_sizes, sorted_idxs, probs=None, fused=False):
        return original_sort_chunks(input, split_sizes, sorted_idxs, probs=probs, fused=False)

    for wrapper in (permute_, unpermute_, sort_chunks_by_idxs_):
        wrapper.loongforge_fused = True
    return permute_, unpermute_, sort_chunks_by_idxs_


def _sync_free_dispatcher():
    from megatron.core.transformer.moe import token_dispatcher

    class SyncFreeAllGatherDispatcher(token_dispatcher.MoEAllGatherTokenDispatcher):
        """megatron's allgather dispatcher; where every expert is local and the permutation is ours, its
        ``dispatch_postprocess`` without host syncs (the token counts stay on the device)."""

        sync_free = True

        def runs_sync_free(self) -> bool:
            """Whether this dispatcher's own path applies: every expert local and this module's permutation."""
            return (self.num_local_experts == self.config.num_moe_experts and self.config.moe_permute_fusion
                    and getattr(token_dispatcher.permute, "loongforge_fused", False))

        def dispatch_postprocess(self, hidden_states, probs):
            if not self.runs_sync_free():
                return super().dispatch_postprocess(hidden_states, probs)
            self.hidden_shape_before_permute = hidden_states.shape
            self.local_map = self.routing_map
            # NOTE: megatron's top-k routing (no capacity, no dropping: ``_dispatcher_paths_served``) sends each
            # token to exactly ``topk`` distinct experts.
            rows = self.local_map.shape[0] * self.config.moe_router_topk
            tokens_per_expert = self.local_map.sum(dim=0)
            permuted, self.local_probs, self.reversed_local_input_permutation_mapping = permute(
                hidden_states, self.local_map, probs, rows)
            self.routing_map = None
            return permuted, tokens_per_expert, self.local_probs

    return SyncFreeAllGatherDispatcher


def te_fills_permute() -> bool:
    """Whether Transformer Engine's fused permutation fills megatron's slot (``moe_utils`` defines it only where TE
    imports): then megatron's own dispatchers run, not ``SyncFreeAllGatherDispatcher``."""
    from megatron.core.transformer.moe import moe_utils

    return getattr(moe_utils, "fused_permute", None) is not None


def enable_megatron_fused_permute(config) -> bool:
    """Route the MoE token permutation of this config's dispatcher through ``permute`` / ``unpermute`` (or TE's
    fused kernels where TE filled the slot). False, changing nothing, for dispatcher paths not served (see the
    module docstring)."""
    from megatron.core.transformer.moe import moe_layer, token_dispatcher

    if not config.num_moe_experts or not _dispatcher_paths_served(config):
        return False
    te_fused = te_fills_permute()
    if not te_fused and not getattr(token_dispatcher.permute, "loongforge_fused", False):
        (token_dispatcher.permute, token_dispatcher.unpermute,
         token_dispatcher.sort_chunks_by_idxs) = _fused_to_ours(
            token_dispatcher.permute, token_dispatcher.unpermute, token_dispatcher.sort_chunks_by_idxs)
    if not te_fused and not getattr(moe_layer.MoEAllGatherTokenDispatcher, "sync_free", False):
        # NOTE: MoELayer builds its dispatcher from the name it imported; the subclass falls back to megatron's
        # method wherever it does not apply.
        moe_layer.MoEAllGatherTokenDispatcher = _sync_free_dispatcher()
    config.moe_permute_fusion = True
    return True


def fixed_shape_moe(layer) -> bool:
    """Whether megatron MoE layer ``layer`` runs at fixed shapes with no host read, so that it can be captured:
    megatron's allgather dispatcher as ``SyncFreeAllGatherDispatcher`` with every expert local and this module's
    permutation (T x top-k permuted rows, the counts left on the device), and this package's grouped experts on
    ``torch._grouped_mm`` (bf16 on CUDA, 16-byte aligned: offsets read on the device; the per-expert loop reads the
    counts on the host), no FP8 or adapter forward swapped in."""
    from loongforge_hf.kernels import grouped_mlp

    dispatcher, experts = layer.token_dispatcher, layer.experts
    if not (getattr(dispatcher, "sync_free", False) and dispatcher.runs_sync_free()
            and type(experts) is grouped_mlp.GroupedMLP and "forward" not in experts.__dict__):
        return False
    fc1, fc2 = experts.linear_fc1.weight, experts.linear_fc2.weight
    return grouped_mlp.grouped_mm_supported(fc1.new_empty(1, fc1.shape[-1]), fc1, fc2)


def unfixed_moe_layers(chunks) -> list[str]:
    """The MoE layers of ``chunks`` (megatron model chunks) that ``fixed_shape_moe`` does not pass, by name."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    return [f"chunk {i} {name}" for i, chunk in enumerate(chunks) for name, m in chunk.named_modules()
            if isinstance(m, MoELayer) and not fixed_shape_moe(m)]
