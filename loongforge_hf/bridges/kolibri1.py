"""Kolibri1ForCausalLM (Aleph Alpha's Kolibri-1): per-head q / k norms, a norm after each sublayer too, rotary
embedding on the sliding-window layers only, and in every layer experts chosen on the router's logits plus a bias,
weighted by the sigmoid of their logits, beside a shared MLP.

Choices:
- Attention: grouped-query, no biases, per-head q / k RMSNorms before the rotation (megatron's ``qk_layernorm``).
  ``layer_types``: the window (``sliding_window``) on the sliding layers, which alone rotate q and k; the full layers
  take no rotary embedding (``smollm3.no_rope_attention``). ``sliding_window=None`` is refused: transformers 5.24's
  model builds a sliding-window mask in every forward and fails without a window. Plain rope or llama3 scaling (an
  attention factor would scale the NoPE layers too: refused).
- Norms (RMSNorm, Llama's numerics): ``input_layernorm`` and ``post_attention_layernorm`` (before the MoE layer) in
  megatron's slots; ``post_attn_norm`` / ``post_ffn_norm`` on disk (transformers' ``post_self_attn_layernorm`` /
  ``post_mlp_layernorm``) on the attention's and the MoE layer's outputs before the residual adds
  (``layer_outputs.transformed_attention`` / ``transformed_moe``, as AFMoE's).
- Every layer sparse: ``num_experts`` experts of ``moe_intermediate_size`` (one tensor per expert on disk, as
  transformers' ``save_pretrained`` writes them) and one always-on MLP of ``shared_expert_intermediate_size``
  (``mlp.shared_experts``, megatron's shared experts, ungated).
- Routing is transformers' ``Kolibri1TopKRouter`` op for op (``logit_bias_route``, in the routers' ``route`` slot,
  ``router_balance.BalanceRouter``): fp32 logits (``moe_router_dtype``: input and weight cast to fp32, as
  transformers computes them; the weight in the model's dtype, as transformers keeps it), the top
  ``num_experts_per_tok`` of the logits plus the expert bias (``moe.router.expert_bias`` on disk, ``[E]`` fp32:
  megatron's ``expert_bias`` buffer, fixed with ``moe_router_bias_update_rate=0`` as transformers never updates it),
  weighted by the sigmoid of the chosen logits, divided by their sum with ``norm_topk_prob``. Neither megatron's
  sigmoid rule (the bias added to the sigmoid scores) nor ``biased_routing``'s (softmax scores) chooses the same
  experts.
- transformers' ``router_logits`` (fp32, every layer); no balancing loss (transformers adds none).
"""

from __future__ import annotations

import types

import torch

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.dense import D, L
from loongforge_hf.bridges.layer_outputs import transformed_attention, transformed_moe
from loongforge_hf.bridges.layer_types import WindowsByLayerType
from loongforge_hf.bridges.mappings import FP32Replicated, Mapping, Replicated
from loongforge_hf.bridges.moe import MoEBridge
from loongforge_hf.bridges.registry import register_bridge
from loongforge_hf.bridges.smollm3 import no_rope_attention

_BIAS = "moe.router.expert_bias"


def logit_bias_route(logits: torch.Tensor, *, topk: int, bias: torch.Tensor, normalize: bool
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(probabilities ``[T, E]``, routing map ``[T, E]`` bool) of transformers' ``Kolibri1TopKRouter`` for the fp32
    router ``logits`` ``[T, E]`` and expert ``bias`` ``[E]``."""
    chosen = torch.topk(logits + bias, k=topk, dim=-1).indices
    weights = logits.gather(1, chosen).sigmoid()
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    probs = torch.zeros_like(logits).scatter(1, chosen, weights)
    return probs, torch.zeros_like(logits, dtype=torch.bool).scatter(1, chosen, True)


def _route(normalize: bool):
    def route(router, logits: torch.Tensor, training: bool) -> tuple[torch.Tensor, torch.Tensor]:
        return logit_bias_route(logits, topk=router.topk, bias=router.expert_bias, normalize=normalize)
    return route


@register_bridge("Kolibri1ForCausalLM")
class Kolibri1Bridge(WindowsByLayerType, MoEBridge):
    qk_norm = True
    extra_rope_types = ()
    shared_experts = "shared_experts"
    hf_router_logits = True                                    # transformers returns them; it adds no aux loss
    # NOTE: megatron applies these in the routing function logit_bias_route replaces (builder refuses them)
    unserved_megatron_fields = ("moe_z_loss_coeff", "moe_expert_capacity_factor", "moe_router_topk_scaling_factor",
                                "moe_router_num_groups", "moe_router_group_topk", "moe_router_fusion",
                                "moe_router_load_balancing_type")

    # ---- config ---------------------------------------------------------------------------------------------
    @property
    def config_fields(self) -> tuple[C.Field, ...]:
        # NOTE: Kolibri1Config has no intermediate_size (no dense layer): megatron's dense width stays its default
        return tuple(f for f in C.DENSE_FIELDS if f.hf != "intermediate_size" or hasattr(self.hf_config, f.hf))

    def check_config(self) -> None:
        c = self.hf_config
        for name in ("num_experts", "num_experts_per_tok", "shared_expert_intermediate_size"):
            if (getattr(c, name, None) or 0) < 1:
                raise C.UnsupportedConfigError(f"{name}={getattr(c, name, None)} is not supported (at least 1).")
        if c.sliding_window is None:
            raise C.UnsupportedConfigError("sliding_window=None is not supported for Kolibri1ForCausalLM: "
                                           "transformers' model needs a window for every forward.")
        if c.num_experts_per_tok > c.num_experts:
            raise C.UnsupportedConfigError(f"num_experts_per_tok={c.num_experts_per_tok} exceeds num_experts="
                                           f"{c.num_experts}.")
        super().check_config()

    def transformer_config_kwargs(self) -> dict:
        # NOTE: transformers keeps gate.weight in the model dtype and computes the logits in fp32 (megatron's
        # router casts input and weight alike); router_fp32 would keep the weight itself in fp32
        return {**super().transformer_config_kwargs(), "moe_router_dtype": "fp32"}

    def num_experts(self) -> int:
        return self.hf_config.num_experts

    def shared_ffn_size(self) -> int:
        return self.hf_config.shared_expert_intermediate_size

    def is_moe_layer(self, layer: int) -> bool:
        return True

    def routing_kwargs(self) -> dict:
        # NOTE: megatron's expert_bias buffer (fixed); logit_bias_route routes in place of megatron's function
        return {"moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
                "moe_router_bias_update_rate": 0.0}

    def attention_module(self) -> type:
        full = frozenset(i for i, kind in enumerate(self.hf_config.layer_types) if kind == "full_attention")
        return no_rope_attention(full, base=transformed_attention(post_norm=True))

    def moe_module(self) -> type:
        return transformed_moe(post_norm=True)

    def finish_model(self, model) -> None:
        from loongforge_hf.bridges.router_balance import balance_router_class

        super().finish_model(model)
        route = _route(bool(self.hf_config.norm_topk_prob))
        for router in model.modules():
            if isinstance(router, balance_router_class()):
                # NOTE: a bound method: a deep copy of the model routes with the copy's bias
                router.route = types.MethodType(route, router)

    # ---- tensors --------------------------------------------------------------------------------------------
    def attention_mappings(self) -> list[Mapping]:
        return [*super().attention_mappings(),
                Replicated(f"{D}.self_attention.post_layernorm.weight", f"{L}.post_attn_norm.weight")]

    def moe_mappings(self) -> list[Mapping]:
        return [*super().moe_mappings(), Replicated(f"{D}.mlp.post_layernorm.weight", f"{L}.post_ffn_norm.weight"),
                FP32Replicated(f"{D}.mlp.router.expert_bias", f"{L}.{_BIAS}")]

    def attention_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        return {**super().attention_shapes(prefix), f"{prefix}.post_attn_norm.weight": (self.hf_config.hidden_size,)}

    def moe_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        return {**super().moe_shapes(prefix), f"{prefix}.post_ffn_norm.weight": (self.hf_config.hidden_size,),
                f"{prefix}.{_BIAS}": (self.num_experts(),)}
