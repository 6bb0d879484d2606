"""LongCat-Flash's layer pieces (``longcat_flash.py`` declares the bridge): transformers' router (``route``), the
filled routing map megatron's dispatchers take (``full_map``), the shortcut MoE and MLP that pass the MoE output
from the even megatron layer to the odd one, the query scale (a forward hook, kept through LoRA's re-class of the
linear) and the refusal of activation recompute."""

from __future__ import annotations

import functools

import torch


def route(router, logits: torch.Tensor, training: bool, *, topk: int, scale: float):
    """transformers' ``LongcatFlashTopkRouter``: (probabilities, map), both ``[T, E + Z]``."""
    scores = logits.float().softmax(dim=-1)
    chosen = torch.topk(scores + router.expert_bias, k=topk, dim=-1).indices
    probs = torch.zeros_like(scores).scatter(1, chosen, scores.gather(1, chosen) * scale)
    return probs, torch.zeros_like(scores, dtype=torch.bool).scatter(1, chosen, True)


def full_map(routed: torch.Tensor, topk: int) -> torch.Tensor:
    """The routing map ``[T, E]`` of the real experts with each token's zero-expert slots given to its first unchosen
    real experts (at probability 0: their output counts 0 times, exactly): megatron's dispatchers count on ``topk``
    experts a token (the permuted rows, ``tokens * topk``)."""
    unchosen = ~routed
    return routed | (unchosen & (unchosen.cumsum(dim=-1) <= topk - routed.sum(dim=-1, keepdim=True)))


@functools.cache
def moe_class() -> type:
    from megatron.core.transformer.moe.moe_layer import MoELayer

    class ShortcutMoE(MoELayer):
        """megatron's MoE layer that returns its shared expert's output (``mlps.0``) and keeps the routed and zero
        experts' in ``box`` for the next layer's MLP."""

        box = None

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.use_shared_expert = False  # NOTE: computed in forward, returned alone

        def route(self, hidden_states, padding_mask=None):
            probs, routing_map = super().route(hidden_states, padding_mask)
            routed = self.config.num_moe_experts
            self.box.zero = probs[:, routed:].sum(dim=-1)
            return probs[:, :routed].contiguous(), full_map(routing_map[:, :routed], self.config.moe_router_topk)

        def forward(self, hidden_states, intermediate_tensors=None, padding_mask=None):
            routed, _ = super().forward(hidden_states, padding_mask=padding_mask)
            zero = self.box.zero.view(*hidden_states.shape[:-1], 1)  # NOTE: fp32, as transformers' weights
            self.box.shortcut = routed + (hidden_states * zero).to(hidden_states.dtype)
            return self.shared_experts(hidden_states), None

    return ShortcutMoE


@functools.cache
def mlp_class() -> type:
    from loongforge_hf.kernels.specs import SwiGLUMLP

    class ShortcutMLP(SwiGLUMLP):
        """The dense MLP (``mlps.1``) whose output takes the layer pair's MoE output (``box.shortcut``)."""

        box = None

        def forward(self, hidden_states, *args, **kwargs):
            out, bias = super().forward(hidden_states, *args, **kwargs)
            shortcut, self.box.shortcut = self.box.shortcut, None
            return out + shortcut, bias

    return ShortcutMLP


def scale_output(module, args, output, *, scale: float):
    """A linear's ``(output, bias)`` times ``scale`` (a forward hook: kept through LoRA's re-class)."""
    out, bias = output
    return out * scale, None if bias is None else bias * scale


def refuse_recompute(decoder, args) -> None:
    if decoder.training and decoder.config.recompute_granularity is not None:
        raise ValueError("activation checkpointing (recompute) is not supported for LongcatFlashForCausalLM: the MoE "
                         "output passes from one megatron layer to the next beside megatron's layer arguments.")
