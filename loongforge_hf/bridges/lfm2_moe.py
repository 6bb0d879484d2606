"""Lfm2MoeForCausalLM (Liquid AI's LFM2-MoE: LFM2-8B-A1B): LFM2's conv and attention layers (``lfm2.Lfm2Layers``)
with the first ``num_dense_layers`` MLPs dense and a sigmoid-routed mixture of experts in the others.

Choices:
- Layers, norms, dense MLPs (``intermediate_size`` as it is: transformers' ``Lfm2MoeMLP`` does not adjust it),
  cached generate, context parallelism and refusals as LFM2's (``lfm2.py``).
- MoE layers: ``num_experts`` experts of ``moe_intermediate_size`` (on disk one tensor per expert and projection,
  ``feed_forward.experts.{e}.w1`` (gate), ``w3`` (up), ``w2`` (down), as the hub's files and transformers'
  ``save_pretrained`` write them), no shared expert. Routing is transformers' ``Lfm2MoeTopKRouter`` op for op
  (``sigmoid_route``, in the routers' ``route`` slot, ``router_balance.BalanceRouter``): sigmoid scores in the
  logits' dtype, the top ``num_experts_per_tok`` of the scores plus ``feed_forward.expert_bias`` with
  ``use_expert_bias`` (fp32, fixed: megatron's ``expert_bias`` buffer with ``moe_router_bias_update_rate=0``, as
  transformers never updates it), the chosen scores divided by their sum plus 1e-6 with ``norm_topk_prob`` (megatron's
  function adds 1e-20, and renormalises exactly when k > 1), times ``routed_scaling_factor``: the same probabilities
  and gradients bit for bit, any ``norm_topk_prob`` and k.
- The router weight in the model's dtype (transformers' ``gate`` is a plain linear); transformers'
  ``router_logits`` output (``output_router_logits``); no balancing loss (transformers' model adds none).
"""

from __future__ import annotations

import types

import torch

from loongforge_hf.bridges.dense import L
from loongforge_hf.bridges.lfm2 import Lfm2Layers
from loongforge_hf.bridges.mappings import Mapping, renamed
from loongforge_hf.bridges.moe import MoEBridge
from loongforge_hf.bridges.registry import register_bridge


def sigmoid_route(logits: torch.Tensor, *, topk: int, bias: torch.Tensor | None, normalize: bool, scale: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(probabilities ``[T, E]`` in the logits' dtype, routing map ``[T, E]`` bool) of transformers'
    ``Lfm2MoeTopKRouter`` for router ``logits`` ``[T, E]`` and the fp32 expert ``bias`` ``[E]`` (None: no bias)."""
    scores = logits.sigmoid()
    if bias is None:
        weights, chosen = torch.topk(scores, k=topk, dim=-1)
    else:
        chosen = torch.topk(scores + bias, k=topk, dim=-1).indices
        weights = scores.gather(1, chosen).type_as(logits)
    if normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-6)
    weights = weights * scale
    probs = torch.zeros_like(logits).scatter(1, chosen, weights)
    return probs, torch.zeros_like(logits, dtype=torch.bool).scatter(1, chosen, True)


def _route(*, normalize: bool, scale: float):
    def route(router, logits: torch.Tensor, training: bool) -> tuple[torch.Tensor, torch.Tensor]:
        return sigmoid_route(logits, topk=router.topk, bias=router.expert_bias, normalize=normalize, scale=scale)
    return route


@register_bridge("Lfm2MoeForCausalLM")
class Lfm2MoeBridge(Lfm2Layers, MoEBridge):
    sparse_block = "feed_forward"
    expert_projections = ("w1", "w3", "w2")
    expert_bias_name = "expert_bias"
    hf_router_logits = True
    # NOTE: megatron applies these in the routing function sigmoid_route replaces (builder refuses them)
    unserved_megatron_fields = ("moe_z_loss_coeff", "moe_expert_capacity_factor", "moe_router_topk_scaling_factor",
                                "moe_router_num_groups", "moe_router_group_topk", "moe_router_fusion",
                                "moe_router_load_balancing_type")

    def __init__(self, hf_config) -> None:
        self.expert_bias = bool(hf_config.use_expert_bias)
        super().__init__(hf_config)

    def num_experts(self) -> int:
        return self.hf_config.num_experts

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.hf_config.num_dense_layers

    def routing_kwargs(self) -> dict:
        # NOTE: the scores megatron would start from and its expert_bias buffer; sigmoid_route routes in its place
        return {"moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": self.expert_bias,
                "moe_router_bias_update_rate": 0.0}

    def finish_model(self, model) -> None:
        from loongforge_hf.bridges.router_balance import balance_router_class

        super().finish_model(model)
        c = self.hf_config
        route = _route(normalize=bool(c.norm_topk_prob), scale=float(c.routed_scaling_factor))
        for router in model.modules():
            if isinstance(router, balance_router_class()):
                # NOTE: a bound method: a deep copy of the model routes with the copy's bias
                router.route = types.MethodType(route, router)

    # ---- tensors --------------------------------------------------------------------------------------------
    def moe_mappings(self) -> list[Mapping]:
        return [renamed(m, f"{L}.post_attention_layernorm.", f"{L}.ffn_norm.") for m in super().moe_mappings()]

    def mlp_mappings(self, layer: int) -> list[Mapping]:
        return self.moe_mappings() if self.is_moe_layer(layer) else self.dense_mlp_mappings()

    def every_mlp_mapping(self) -> list[Mapping]:
        return self.dense_mlp_mappings() + self.moe_mappings()

    def mlp_shapes(self, layer: int) -> dict[str, tuple[int, ...]]:
        prefix = f"model.layers.{layer}"
        if not self.is_moe_layer(layer):
            return self.dense_mlp_shapes(prefix)
        shapes = self.moe_shapes(prefix)
        shapes[f"{prefix}.ffn_norm.weight"] = shapes.pop(f"{prefix}.post_attention_layernorm.weight")
        return shapes
