"""Gemma4ForCausalLM with ``enable_moe_block`` (Gemma 4 26B-A4B's text model): every layer's MLP is a dense gated MLP
beside routed experts, each with norms of its own, their sum normalised again before the residual add.

Choices:
- transformers' layer: ``h = x + post_ff(post_ff_1(mlp(pre_ff(x))) + post_ff_2(experts(pre_ff_2(x), router(x))))``,
  the MLP, the router and the experts all reading the residual stream ``x``. The layer's pre-MLP norm slot is
  empty (``pre_mlp_norm=False``: ``specs.py``) and one MoE layer (``gemma4_moe_layer``, in the bridge's
  ``moe_module`` slot: megatron's ``MoELayer`` with a post norm, ``layer_outputs.transformed_moe``) holds the rest:
  the dense MLP as megatron's shared experts (``SharedExpertMLP``, ``intermediate_size``; split over TP as any
  shared expert) between ``dense_pre_norm`` and ``dense_post_norm``; the routed experts (our ``GroupedMLP`` with the
  gated tanh-GELU, ``kernels.geglu``; megatron's ``SequentialMLP`` with ``LOONGFORGE_MOE_GROUPED_GEMM=0``; EP / ETP
  as every MoE bridge's) dispatched from ``experts_pre_norm``'s output, combined, then ``experts_post_norm``; the
  sum through ``post_layernorm``. Under sequence parallelism each rank normalises its own tokens, as the input norms.
- The router (``Gemma4Router``: ``router_balance.BalanceRouter`` with two more parameters, ``scale`` ``[H]`` and
  ``per_expert_scale`` ``[E]``, replicated, reduced over TP under sequence parallelism as the router's weight):
  its input normalised without a weight (``gemma4_attention.rms_no_weight``), times ``scale`` and ``H^-1/2``;
  logits from megatron's gating linear (``router.proj``); an fp32 softmax over all experts; the top
  ``top_k_experts``, renormalised, times their ``per_expert_scale`` (the ``route`` slot, as PhiMoE's), the
  probabilities the experts' outputs are weighted by, as transformers computes them.
- transformers' ``router_logits`` (``output_router_logits``) are its router's softmax probabilities (fp32, every
  layer): the router records those (``hf_router_logits``). transformers adds no balancing loss: none here.
- On disk: ``mlp.{gate,up,down}_proj``, the five feed-forward norms, ``router.{proj.weight,scale,per_expert_scale}``
  and the experts stacked (``experts.gate_up_proj`` ``[E, 2I, H]`` as ``[gate; up]`` halves, ``experts.down_proj``
  ``[E, H, I]``: ``stacked_experts.py``), read expert by expert into the grouped MLP's ``linear_fc1`` /
  ``linear_fc2`` stacks (or ``SequentialMLP``'s per-expert linears).
- megatron's routing options do not apply (the router's own function routes; refused through ``megatron_config``),
  nor ``moe_shared_expert_overlap`` (it would run the dense MLP inside the dispatcher, outside its norms: refused).
"""

from __future__ import annotations

import functools
from dataclasses import replace

import torch

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.dense import D, L
from loongforge_hf.bridges.fused_mappings import GatedMLP
from loongforge_hf.bridges.gemma4 import Gemma4Bridge
from loongforge_hf.bridges.gemma4_attention import rms_no_weight
from loongforge_hf.bridges.mappings import Mapping, Replicated, RowParallel
from loongforge_hf.bridges.moe import MoEBridge
from loongforge_hf.bridges.stacked_experts import StackedDown, StackedGateUp, routed_stack

# megatron's norm in the MoE layer -> transformers' layer norm
_NORMS = {"dense_pre_norm": "pre_feedforward_layernorm", "dense_post_norm": "post_feedforward_layernorm_1",
          "experts_pre_norm": "pre_feedforward_layernorm_2", "experts_post_norm": "post_feedforward_layernorm_2",
          "post_layernorm": "post_feedforward_layernorm"}


@functools.cache
def gemma4_router() -> type:
    from loongforge_hf.bridges.router_balance import balance_router_class

    class Gemma4Router(balance_router_class()):
        """transformers' ``Gemma4TextRouter`` on megatron's router (see the module docstring)."""

        def __init__(self, config, *args, **kwargs) -> None:
            super().__init__(config, *args, **kwargs)
            for name, size in (("scale", config.hidden_size), ("per_expert_scale", config.num_moe_experts)):
                param = torch.nn.Parameter(torch.ones(size, dtype=self.weight.dtype, device=self.weight.device))
                param.sequence_parallel = config.sequence_parallel
                setattr(self, name, param)

        def gating_input(self, input: torch.Tensor) -> torch.Tensor:
            """What the gating linear reads (LoRA's router adapter reads it too: ``lora.experts``)."""
            return rms_no_weight(input, self.config.layernorm_epsilon) * self.scale * self.config.hidden_size ** -0.5

        def gating(self, input: torch.Tensor) -> torch.Tensor:
            return super().gating(self.gating_input(input))

        def routing(self, logits: torch.Tensor, padding_mask=None):
            # NOTE: the probabilities go on as the logits BalanceRouter routes by and records (transformers' output)
            scores = torch.softmax(logits.view(-1, self.config.num_moe_experts), dim=-1, dtype=torch.float32)
            return super().routing(scores, padding_mask=padding_mask)

        def route(self, scores: torch.Tensor, training: bool) -> tuple[torch.Tensor, torch.Tensor]:
            weights, chosen = torch.topk(scores, k=self.topk, dim=-1)
            weights = weights / weights.sum(dim=-1, keepdim=True)
            weights = weights * self.per_expert_scale[chosen]
            probs = torch.zeros_like(scores).scatter(1, chosen, weights)
            return probs, torch.zeros_like(scores, dtype=torch.bool).scatter(1, chosen, True)

    return Gemma4Router


@functools.cache
def gemma4_moe_layer() -> type:
    from loongforge_hf.bridges.layer_outputs import transformed_moe
    from loongforge_hf.kernels.rmsnorm import RMSNorm

    class Gemma4MoELayer(transformed_moe(post_norm=True)):
        """The dense MLP beside the routed experts, with their norms (see the module docstring)."""

        def __init__(self, config, submodules=None, *args, **kwargs) -> None:
            if config.moe_shared_expert_overlap:
                raise ValueError("moe_shared_expert_overlap=True is not supported for Gemma 4's MoE block (the dense "
                                 "MLP runs between norms of its own).")
            super().__init__(config, replace(submodules, router=gemma4_router()), *args, **kwargs)
            for name in _NORMS:
                if name != "post_layernorm":
                    setattr(self, name, RMSNorm(config, config.hidden_size, eps=config.layernorm_epsilon))

        def shared_experts_compute(self, hidden_states: torch.Tensor) -> torch.Tensor:
            return self.dense_post_norm(super().shared_experts_compute(self.dense_pre_norm(hidden_states)))

        def preprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor):
            return super().preprocess(self.experts_pre_norm(hidden_states), probs, routing_map)

        def postprocess(self, output: torch.Tensor, shared_expert_output: torch.Tensor) -> torch.Tensor:
            return self.experts_post_norm(super().postprocess(output, None)) + shared_expert_output

    return Gemma4MoELayer


class Gemma4MoeBridge(MoEBridge, Gemma4Bridge):
    """``Gemma4Bridge`` for a config with ``enable_moe_block`` (``Gemma4Bridge`` makes it for one)."""

    hf_router_logits = True                                    # its router's probabilities; it adds no aux loss
    pre_mlp_norm = False                                       # NOTE: the MoE layer reads the residual stream
    unserved_megatron_fields = ("moe_z_loss_coeff", "moe_expert_capacity_factor", "moe_router_topk_scaling_factor",
                                "moe_router_num_groups", "moe_router_group_topk", "moe_router_fusion",
                                "moe_router_load_balancing_type", "moe_router_enable_expert_bias")

    # ---- config ---------------------------------------------------------------------------------------------
    def check_config(self) -> None:
        c = self.hf_config
        for field in ("num_experts", "top_k_experts", "moe_intermediate_size"):
            if not isinstance(getattr(c, field), int) or getattr(c, field) < 1:
                raise C.UnsupportedConfigError(f"{field}={getattr(c, field)!r}: enable_moe_block needs a positive "
                                               "integer there.")
        if c.top_k_experts > c.num_experts:
            raise C.UnsupportedConfigError(f"top_k_experts={c.top_k_experts} exceeds num_experts={c.num_experts}.")
        super().check_config()

    def num_experts(self) -> int:
        return self.hf_config.num_experts

    def top_k(self) -> int:
        return self.hf_config.top_k_experts

    def shared_ffn_size(self) -> int:
        return self.hf_config.intermediate_size  # NOTE: the dense MLP, as megatron's shared experts

    def is_moe_layer(self, layer: int) -> bool:
        return True

    def routing_kwargs(self) -> dict:
        # NOTE: megatron's equivalent up to per_expert_scale; the router's own function routes (Gemma4Router.route)
        return {"moe_router_score_function": "softmax", "moe_router_pre_softmax": False}

    def moe_module(self) -> type:
        return gemma4_moe_layer()

    # ---- tensors --------------------------------------------------------------------------------------------
    def moe_mappings(self) -> list[Mapping]:
        m = f"{D}.mlp"
        return [*(Replicated(f"{m}.{ours}.weight", f"{L}.{hf}.weight") for ours, hf in _NORMS.items()),
                GatedMLP(f"{m}.shared_experts.linear_fc1.weight", gate=f"{L}.mlp.gate_proj.weight",
                         up=f"{L}.mlp.up_proj.weight"),
                RowParallel(f"{m}.shared_experts.linear_fc2.weight", f"{L}.mlp.down_proj.weight"),
                Replicated(f"{m}.router.weight", f"{L}.router.proj.weight"),
                Replicated(f"{m}.router.scale", f"{L}.router.scale"),
                Replicated(f"{m}.router.per_expert_scale", f"{L}.router.per_expert_scale"),
                routed_stack(self, StackedGateUp, "linear_fc1.weight", f"{L}.experts.gate_up_proj"),
                routed_stack(self, StackedDown, "linear_fc2.weight", f"{L}.experts.down_proj")]

    def layer_mappings(self) -> list[Mapping]:
        return self.attention_mappings() + self.moe_mappings()

    def moe_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        """The tensors a layer has beside Gemma 4's dense one (``layer_shapes``)."""
        h, f, n = self.hf_config.hidden_size, self.expert_ffn_size(), self.num_experts()
        return {**{f"{prefix}.{hf}.weight": (h,) for hf in _NORMS.values()},
                f"{prefix}.router.proj.weight": (n, h), f"{prefix}.router.scale": (h,),
                f"{prefix}.router.per_expert_scale": (n,), f"{prefix}.experts.gate_up_proj": (n, 2 * f, h),
                f"{prefix}.experts.down_proj": (n, h, f)}

    def layer_shapes(self, layer: int) -> dict[str, tuple[int, ...]]:
        # NOTE: Gemma4Bridge's (the full layers' own heads; the dense MLP and its norms), then the MoE block's
        return {**Gemma4Bridge.layer_shapes(self, layer), **self.moe_shapes(f"model.layers.{layer}")}
