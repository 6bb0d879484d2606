"""PhimoeForCausalLM (Phi-3.5-MoE): Mixtral's layout with LayerNorms, attention biases, an LM-head bias and
sparsemixer top-2 routing.

Choices:
- Norms (input, post-attention, final) are ``nn.LayerNorm`` with weight and bias (``rms_norm_eps`` is their eps):
  megatron's ``normalization="LayerNorm"``, our ``kernels.layernorm.LayerNorm`` in the MoE spec's norm slots.
- ``attention_bias``: biases on q / k / v (fused into ``linear_qkv``'s) and on ``o_proj``, while the experts have
  none: the MoE spec's output projection gets a bias of its own (``specs._biased_linear_proj``; megatron's
  ``add_bias_linear`` stays off). ``lm_head_bias``: ``output_layer.add_output_bias`` (Phi's).
- Routing is transformers' ``sparsemixer`` step by step (``sparsemixer`` below, in the routers' ``route`` slot,
  ``router_balance.BalanceRouter``): always two experts (``num_experts_per_tok`` must be 2); each pick's weight is its
  softmax over the logits within ``2 * router_jitter_noise`` (relative) of the pick's best, not renormalised.
  Eval: the best and the second best logit, gradient by autograd as transformers'. Training: as transformers, each
  pick Gumbel-sampled, its weight scaled to a third unless it is the best or a ``rand > 0.75`` draw, and the logits'
  gradient Heun's-method estimate (``_Multiplier``, transformers' ``PhimoeMultiplier``); the same ops in the same
  order, so one draw sequence gives transformers' result (tested on the function). The draws cover this rank's
  tokens in megatron's [s, b] order, so a forward's noise differs from transformers' per token.
- ``input_jitter_noise`` (training only): the MoE input times two uniform(1 - eps, 1 + eps) draws, as transformers'
  block and router each multiply it in place (a pre-hook on each MoE layer).
- ``router_logits`` and transformers' balancing loss (top 2 of the softmax, ``hf_balance_loss``).
- Rope: default, or ``longrope`` as transformers' PhiMoE runs it: always the short factors' frequencies, cos and sin
  times ``short_mscale`` (``long_mscale`` past ``original_max_position_embeddings``): both must be equal (Phi-3.5-MoE:
  1.243), applied to q and k's rotary channels (``rotary_scale_module``).
- Names: Mixtral's on disk (``block_sparse_moe.gate``, ``experts.{e}.w1 / w3 / w2``), biases beside their weights.
"""

from __future__ import annotations

import torch

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.dense import D, L
from loongforge_hf.bridges.mappings import Mapping, Replicated, VocabParallel
from loongforge_hf.bridges.mixtral import MixtralBridge
from loongforge_hf.bridges.registry import register_bridge


class _Multiplier(torch.autograd.Function):
    """transformers' ``PhimoeMultiplier``: forward ``weight * scale``; backward the sparsemixer estimate of the
    logits' gradient (``weight`` and the rest take none)."""

    @staticmethod
    def forward(ctx, logits, weight, chosen, gates, scale):
        ctx.save_for_backward(weight, chosen, gates)
        return weight * scale

    @staticmethod
    def backward(ctx, grad):
        weight, chosen, gates = ctx.saved_tensors
        grad = grad * weight
        grad_logits = gates * grad.mul(-1)
        grad_logits.scatter_add_(dim=-1, index=chosen, src=grad)
        return grad_logits, None, None, None, None


def _pick(logits: torch.Tensor, candidates: torch.Tensor, eps: float, training: bool, second: bool):
    """(weight ``[T, 1]``, expert ``[T, 1]``) of one sparsemixer pick among ``candidates`` (the logits, earlier picks
    at -inf)."""
    with torch.no_grad():
        best, best_index = candidates.max(dim=-1, keepdim=True)
        far = ((best - logits) / logits.abs().clamp(min=best)) > (2 * eps)
    gates = candidates.masked_fill(far, float("-inf"))
    if training:  # NOTE: Gumbel sampling
        noise = torch.empty_like(gates, memory_format=torch.legacy_contiguous_format).exponential_().log()
        chosen = (gates - noise).max(dim=-1)[1].unsqueeze(-1)
    else:
        chosen = best_index
    gates = torch.softmax(gates, dim=-1)
    weight = gates.gather(dim=-1, index=chosen)
    if not training:
        return weight, chosen
    top = gates.max(dim=-1, keepdim=True)
    draw = torch.rand_like(top[0]).uniform_() if second else torch.rand_like(top[0])
    keep = torch.logical_or(chosen == top[1], draw > 0.75)  # NOTE: Heun's third-order method
    scale = torch.add(0.3333, keep, alpha=0.6667).type_as(gates)
    return _Multiplier.apply(logits, weight, chosen, gates, scale), chosen


def sparsemixer(logits: torch.Tensor, eps: float, training: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights ``[T, 2]``, experts ``[T, 2]``) of transformers' ``sparsemixer`` for router ``logits`` ``[T, E]``."""
    w1, e1 = _pick(logits, logits, eps, training, second=False)
    w2, e2 = _pick(logits, torch.scatter(logits, -1, e1, float("-inf")), eps, training, second=True)
    return torch.cat((w1, w2), dim=-1), torch.cat((e1, e2), dim=-1)


def _route(eps: float):
    def route(logits: torch.Tensor, training: bool) -> tuple[torch.Tensor, torch.Tensor]:
        weights, chosen = sparsemixer(logits, eps, training)
        probs = torch.zeros_like(logits).scatter(1, chosen, weights)
        return probs, torch.zeros_like(logits, dtype=torch.bool).scatter(1, chosen, True)
    return route


def _input_jitter(eps: float):
    def hook(layer, args, kwargs):
        if not layer.training:
            return None
        x = args[0] if args else kwargs["hidden_states"]
        for _ in range(2):  # NOTE: transformers' block, then its router, multiply the same tensor in place
            x = x * torch.empty_like(x).uniform_(1.0 - eps, 1.0 + eps)
        return ((x, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": x})
    return hook


@register_bridge("PhimoeForCausalLM")
class PhimoeBridge(MixtralBridge):
    extra_rope_types = ("longrope",)
    # NOTE: megatron applies these in the routing function sparsemixer replaces (builder refuses them)
    unserved_megatron_fields = ("moe_z_loss_coeff", "moe_expert_capacity_factor", "moe_router_topk_scaling_factor",
                                "moe_router_num_groups", "moe_router_group_topk", "moe_router_fusion",
                                "moe_router_load_balancing_type")

    def __init__(self, hf_config) -> None:
        self.qkv_bias = self.proj_bias = bool(getattr(hf_config, "attention_bias", False))
        self.lm_head_bias = bool(getattr(hf_config, "lm_head_bias", False))
        super().__init__(hf_config)

    # ---- config ---------------------------------------------------------------------------------------------
    def check_config(self) -> None:
        c = self.hf_config
        if c.num_experts_per_tok != 2:
            raise C.UnsupportedConfigError(f"num_experts_per_tok={c.num_experts_per_tok} is not supported for "
                                           "PhimoeForCausalLM: its sparsemixer routes to 2 experts whatever it says.")
        for name in ("router_jitter_noise", "input_jitter_noise"):
            if (getattr(c, name, 0.0) or 0.0) < 0:
                raise C.UnsupportedConfigError(f"{name}={getattr(c, name)} must be >= 0.")
        super().check_config()
        rope = self.rope_parameters()
        if rope["rope_type"] == "longrope" and rope.get("short_mscale") != rope.get("long_mscale"):
            raise C.UnsupportedConfigError(
                f"rope_parameters short_mscale={rope.get('short_mscale')} != long_mscale={rope.get('long_mscale')} "
                "is not supported for PhimoeForCausalLM (one attention factor for every length).")

    def transformer_config_kwargs(self) -> dict:
        return {**super().transformer_config_kwargs(), "normalization": "LayerNorm"}

    def routing_kwargs(self) -> dict:
        # NOTE: the scores megatron would start from; sparsemixer routes in place of megatron's function
        return {"moe_router_score_function": "softmax", "moe_router_pre_softmax": True}

    def qk_module(self) -> type | None:
        from loongforge_hf.kernels.rope import rotary_scale_module

        rope = self.rope_parameters()
        mscale = float(rope.get("short_mscale", 1.0)) if rope["rope_type"] == "longrope" else 1.0
        return None if mscale == 1.0 else rotary_scale_module(mscale, C.head_dim_of(self.hf_config))

    def finish_model(self, model) -> None:
        from megatron.core.transformer.moe.moe_layer import MoELayer

        from loongforge_hf.bridges.router_balance import balance_router_class
        from loongforge_hf.kernels.rope import rope_inv_freq, set_megatron_inv_freq

        super().finish_model(model)
        c, rope = self.hf_config, self.rope_parameters()
        if rope["rope_type"] == "longrope" and getattr(model, "rotary_pos_emb", None) is not None:
            set_megatron_inv_freq(model.rotary_pos_emb, rope_inv_freq(C.head_dim_of(c), base=rope["rope_theta"],
                                                                      rope_scaling=rope))
        route, jitter = _route(float(c.router_jitter_noise or 0.0)), float(c.input_jitter_noise or 0.0)
        for module in model.modules():
            if isinstance(module, balance_router_class()):
                module.route = route
            elif isinstance(module, MoELayer) and jitter:
                module.register_forward_pre_hook(_input_jitter(jitter), with_kwargs=True)

    # ---- tensors --------------------------------------------------------------------------------------------
    def attention_mappings(self) -> list[Mapping]:
        maps = [*super().attention_mappings(), Replicated(f"{D}.input_layernorm.bias", f"{L}.input_layernorm.bias")]
        if self.proj_bias:
            maps.append(Replicated(f"{D}.self_attention.linear_proj.bias", f"{L}.self_attn.o_proj.bias"))
        return maps

    def moe_mappings(self) -> list[Mapping]:
        return [*super().moe_mappings(),
                Replicated(f"{D}.pre_mlp_layernorm.bias", f"{L}.post_attention_layernorm.bias")]

    def final_mappings(self) -> list[Mapping]:
        maps = [*super().final_mappings(), Replicated("decoder.final_layernorm.bias", "model.norm.bias")]
        return maps + ([VocabParallel("output_layer.bias", "lm_head.bias")] if self.lm_head_bias else [])

    def attention_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        h = self.hf_config.hidden_size
        shapes = {**super().attention_shapes(prefix), f"{prefix}.input_layernorm.bias": (h,)}
        if self.proj_bias:
            shapes[f"{prefix}.self_attn.o_proj.bias"] = (h,)
        return shapes

    def moe_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        return {**super().moe_shapes(prefix), f"{prefix}.post_attention_layernorm.bias": (self.hf_config.hidden_size,)}

    def expected_hf_shapes(self) -> dict[str, tuple[int, ...]]:
        c = self.hf_config
        shapes = {**super().expected_hf_shapes(), "model.norm.bias": (c.hidden_size,)}
        if self.lm_head_bias:
            shapes["lm_head.bias"] = (c.vocab_size,)
        return shapes
