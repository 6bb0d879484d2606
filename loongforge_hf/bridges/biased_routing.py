"""Top-k routing on softmax scores plus a fixed expert bias (ERNIE 4.5 MoE's ``e_score_correction_bias``), which
megatron-core 0.16 does not do: ``moe_utils.topk_routing_with_score_function`` adds an expert bias to sigmoid scores
only, and its config refuses ``moe_router_enable_expert_bias`` with softmax scores.

Choices:
- transformers' ``Ernie4_5_MoeTopKRouter`` step by step, in fp32: the softmax over all experts, the top k of it plus
  the bias, the chosen softmax scores divided by ``clamp(their sum, min=norm_min)``. Plain torch ops, so autograd
  gives transformers' gradient: through the chosen scores and their sum; the bias and the choice take none.
- ``attach`` gives each ``router_balance.BalanceRouter`` of a built chunk the bias, a ``[1, E]`` fp32 buffer
  ``expert_bias`` (the checkpoint's shape: loaded and exported as is), and ``norm_min``; the router then routes with
  ``route`` instead of megatron's function. megatron's config keeps ``moe_router_enable_expert_bias`` off, so no
  megatron code counts tokens for the bias or updates it (``finalize_model_grads``): it stays as loaded, as
  transformers never updates it.
- ``unbiased_map``: the experts transformers' balancing loss counts (``load_balancing_loss_func`` takes the top k of
  the softmax alone, without the bias).
"""

from __future__ import annotations

import torch


def route(scores: torch.Tensor, topk: int, bias: torch.Tensor, norm_min: float, dtype: torch.dtype
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(routing probabilities ``[T, E]`` in ``dtype``, routing map ``[T, E]`` bool) for the fp32 softmax ``scores``
    ``[T, E]`` of the router's logits."""
    chosen = torch.topk(scores + bias, k=topk, dim=-1).indices
    weights = scores.gather(1, chosen)
    weights = weights / weights.sum(dim=-1, keepdim=True).clamp(min=norm_min)
    probs = torch.zeros_like(scores).scatter(1, chosen, weights).to(dtype)
    return probs, torch.zeros_like(scores, dtype=torch.bool).scatter(1, chosen, True)


def unbiased_map(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """The ``[T, E]`` map of the top k of the softmax ``scores`` ``[T, E]``, without the bias."""
    chosen = torch.topk(scores, k=topk, dim=-1).indices
    return torch.zeros_like(scores, dtype=torch.bool).scatter(1, chosen, True)


def attach(chunk, *, num_experts: int, norm_min: float) -> None:
    """Give every router of ``chunk`` (a built ``GPTModel``, before its weights load) the bias and ``norm_min``."""
    from loongforge_hf.bridges.router_balance import balance_router_class

    cls = balance_router_class()
    for router in chunk.modules():
        if isinstance(router, cls):
            del router.expert_bias  # NOTE: megatron's TopKRouter sets it to None when its config has no expert bias
            router.register_buffer("expert_bias", torch.zeros(1, num_experts, dtype=torch.float32))
            router.norm_min = float(norm_min)
