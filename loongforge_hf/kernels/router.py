"""MoE router top-k: softmax routing probabilities and the routing map in one op, without Transformer Engine.

Choices:
- Same results as megatron-core 0.16's unfused ``moe_utils.topk_routing_with_score_function`` for the softmax score
  function without expert groups, expert bias or router replay (Qwen3-MoE, Mixtral, Qwen2-MoE): the top k of the
  logits, then a softmax over those k (``pre_softmax=False``), or the top k of the softmax over all experts, rounded
  to the logits' dtype first (``pre_softmax=True``); then ``scaling_factor``; a dense ``[T, E]`` probability tensor
  in the logits' dtype (zeros where not routed) and a boolean routing map.
- One autograd op: the forward keeps only the ``[T, k]`` indices and the selected experts' fp32 probabilities, and the
  backward is the softmax's, in fp32, scattered back to ``[T, E]`` (megatron's chain of scatter, gather, multiply,
  cast, softmax and topk backward rounds to the logits' dtype at each step; this rounds once).
- On CUDA with Triton the forward is ``_router_triton.py``: one pass over each row's logits (top k by k rounds of
  "largest value, lowest index among equals"), writing the probabilities, the map, the indices and the fp32
  probabilities at once, where megatron launches topk, softmax, cast, multiply and two scatters. The torch code here
  is the CPU path and the reference; the kernel is probed once per GPU against it (a warning and the torch path
  where it fails). Ties at the k-th place may pick another expert than ``torch.topk`` does (its
  order among equal values is not specified either).
- ``enable_megatron_fused_router()`` points megatron's router at ``topk_softmax`` for the calls it serves (the name
  ``router.py`` imported from ``moe_utils`` is wrapped, as ``moe_permute`` does for the dispatchers); every other
  call (sigmoid scores, groups, expert bias, replay, TE's fused router when ``moe_router_fusion`` is set) goes to
  megatron's function unchanged.
"""

from __future__ import annotations

import functools
import logging

import torch

from loongforge_hf.kernels._saved import needs_autograd
from loongforge_hf.kernels._triton import use_triton

logger = logging.getLogger("loongforge_hf.kernels")


def _topk_softmax_torch(logits: torch.Tensor, topk: int, pre_softmax: bool, scaling_factor: float | None):
    """megatron's unfused expressions, plus the indices and the fp32 probabilities the backward needs."""
    if pre_softmax:
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits)
        probs, idx = torch.topk(scores, k=topk, dim=1)
        psel = probs.float()
    else:
        scores, idx = torch.topk(logits, k=topk, dim=1)
        psel = torch.softmax(scores, dim=-1, dtype=torch.float32)
        probs = psel.type_as(logits)
    if scaling_factor:
        probs = probs * scaling_factor
    dense = torch.zeros_like(logits).scatter(1, idx, probs)
    routing_map = torch.zeros_like(logits, dtype=torch.int).scatter(1, idx, 1).bool()
    return dense, routing_map, idx, psel


@functools.lru_cache(maxsize=None)
def _triton_router_ok(device_index: int) -> bool:
    """Whether the Triton forward compiles and agrees with the torch path on this GPU (probed once per device, as
    ``fp8.blockwise_supported`` probes the block-wise GEMMs); where not, a warning and the torch path."""
    from loongforge_hf.kernels import _router_triton

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 128, generator=g).to(torch.device("cuda", device_index))
    try:
        got = _router_triton.topk_softmax_fwd(logits, 8, False, None)
    except Exception as err:  # noqa: BLE001 - any compile / launch failure means: not on this GPU
        logger.warning("router top-k: the Triton kernel failed on cuda:%d (%s: %s); using the torch path.",
                       device_index, type(err).__name__, err)
        return False
    want = _topk_softmax_torch(logits, 8, False, None)
    ok = bool(torch.equal(got[1], want[1]) and torch.allclose(got[0], want[0], rtol=1e-5, atol=1e-6))
    if not ok:
        logger.warning("router top-k: the Triton kernel disagreed with the torch path on cuda:%d; using the torch "
                       "path.", device_index)
    return ok


def _topk_softmax_forward(logits, topk, pre_softmax, scaling_factor):
    """(probabilities, routing map, selected indices, selected probabilities): the Triton kernel where it runs."""
    if use_triton(logits) and (not logits.is_cuda or _triton_router_ok(logits.device.index or 0)):
        from loongforge_hf.kernels import _router_triton

        return _router_triton.topk_softmax_fwd(logits, topk, pre_softmax, scaling_factor)
    return _topk_softmax_torch(logits, topk, pre_softmax, scaling_factor)


class _TopKSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, topk, pre_softmax, scaling_factor):
        dense, routing_map, idx, psel = _topk_softmax_forward(logits, topk, pre_softmax, scaling_factor)
        ctx.save_for_backward(logits if pre_softmax else None, idx, psel)
        ctx.pre_softmax, ctx.scale = pre_softmax, float(scaling_factor or 1.0)
        ctx.mark_non_differentiable(routing_map)
        return dense, routing_map

    @staticmethod
    def backward(ctx, grad_probs, _grad_map):
        logits, idx, psel = ctx.saved_tensors
        g = grad_probs.float().gather(1, idx) * ctx.scale
        if ctx.pre_softmax:
            s = torch.softmax(logits.float(), dim=-1)
            ds = torch.zeros_like(s).scatter(1, idx, g)
            grad = s * (ds - (ds * s).sum(-1, keepdim=True))
            return grad.to(logits.dtype), None, None, None
        d_sel = psel * (g - (g * psel).sum(-1, keepdim=True))
        grad = torch.zeros(grad_probs.shape, dtype=torch.float32, device=grad_probs.device).scatter(1, idx, d_sel)
        return grad.to(grad_probs.dtype), None, None, None


def topk_softmax(logits: torch.Tensor, topk: int, *, pre_softmax: bool = False,
                 scaling_factor: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(routing probabilities ``[T, E]`` in the logits' dtype, routing map ``[T, E]`` bool) for 2-D ``logits``."""
    if logits.dim() != 2:
        raise ValueError(f"topk_softmax: expects logits [tokens, experts], got shape {tuple(logits.shape)}.")
    if not 0 < topk <= logits.shape[1]:
        raise ValueError(f"topk_softmax: topk={topk} must lie in [1, {logits.shape[1]}] (the number of experts).")
    if not needs_autograd(logits):  # NOTE: inference (generate's decode steps): no Function, nothing kept
        return _topk_softmax_forward(logits, topk, bool(pre_softmax), scaling_factor)[:2]
    return _TopKSoftmax.apply(logits, topk, bool(pre_softmax), scaling_factor)


def _served(score_function, num_groups, group_topk, expert_bias, fused, router_replay) -> bool:
    return (score_function == "softmax" and not group_topk and not num_groups and expert_bias is None and not fused
            and router_replay is None)


def _ours(original):
    def topk_routing_with_score_function(logits, topk, use_pre_softmax=False, num_groups=None, group_topk=None,
                                         scaling_factor=None, score_function="softmax", expert_bias=None,
                                         fused=False, router_replay=None):
        if _served(score_function, num_groups, group_topk, expert_bias, fused, router_replay):
            return topk_softmax(logits, topk, pre_softmax=use_pre_softmax, scaling_factor=scaling_factor)
        return original(logits, topk, use_pre_softmax=use_pre_softmax, num_groups=num_groups, group_topk=group_topk,
                        scaling_factor=scaling_factor, score_function=score_function, expert_bias=expert_bias,
                        fused=fused, router_replay=router_replay)

    topk_routing_with_score_function.loongforge_fused = True
    topk_routing_with_score_function.original = original
    return topk_routing_with_score_function


def enable_megatron_fused_router() -> None:
    """Route megatron's top-k softmax routing through ``topk_softmax`` (process-wide, idempotent; see the module
    docstring for the calls served)."""
    from megatron.core.transformer.moe import router

    if not getattr(router.topk_routing_with_score_function, "loongforge_fused", False):
        router.topk_routing_with_score_function = _ours(router.topk_routing_with_score_function)
