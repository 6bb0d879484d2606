"""BeamForCausalLM (Reflection's Beam-1.0): AFMoE's layer (gated attention with per-head q / k norms, a norm before
and after each sublayer, rope on the sliding-window layers only, dense first layers, then experts) with a gate bias
per head, a position-dependent query scale on the rope-less layers, depth-scaled residual adds, DeepSeek-V3's grouped
sigmoid routing and soft-capped logits.

Choices:
- ``AfmoeBridge``'s declarations (``afmoe.py``): ``q_proj`` / ``k_proj`` / ``v_proj`` / ``gate_proj`` in megatron's
  gated ``linear_qkv`` (``attention_output_gate``), per-head q / k RMS norms, the window on ``sliding_attention``
  layers, no rotary embedding on ``full_attention`` layers, post norms on the attention's and the MLP's outputs.
  Beam's names: ``pre_feedforward_layernorm`` / ``post_feedforward_layernorm``; experts one tensor per expert, no
  shared expert; dense layers where ``mlp_layer_types`` says ``dense``.
- ``self_attn.gate_bias`` ``[heads]``: added to each head's gate channels before the sigmoid (``BeamSelfAttention``
  ``_apply_output_gate``), split over TP with the heads (in the training checkpoint too: megatron's default would
  key it as replicated, one rank's heads saved for all).
- The ``full_attention`` layers (no rope) scale their normalised queries by ``(1 + (p + 1) / 2048) ** 0.1``
  (transformers' ``compute_attention_scaling``: ``exp(0.1 * log1p(...))`` in fp32, rounded once), ``p`` the token's
  slot, read from megatron's rotary angles as Llama 4's query temperature (``llama4._slots``).
- Residual adds: after layer ``i``'s attention ``out / sqrt(k) + residual * sqrt((k - 1) / k)`` with ``k = 2 (i +
  1)``, after its MLP with ``k + 1`` (transformers' ``depth_scaled_residual_add``): megatron's bias-dropout-add of
  each layer replaced (``_scaled_add``).
- Routing: DeepSeek-V3's (``deepseek.sigmoid_routing_kwargs``: sigmoid scores plus the fixed
  ``e_score_correction_bias``, top-2-sum group scores, ``routed_scaling_factor``: transformers multiplies the summed
  experts, megatron each weight: the same sum in fp32), the router in fp32 as transformers keeps it; its
  ``router_logits``, no balancing loss (transformers adds none).
- ``final_logit_softcapping``: ``layer_outputs.softcap_logits``. Cached generate as AFMoE's (the query scale reads
  each new token's slot from its rotary angle).
- transformers computes the experts' and the dense MLP's SwiGLU in fp32 and rounds once; ours in the model's dtype
  (the same in fp32; one rounding apart in bf16).
- Pipeline and context parallelism as AFMoE's (tested against transformers at PP2: LoongTrainer's step with every
  gradient; at CP2: logits, loss, router logits, every gradient).
- Refused by name: a rope on the full layers, rope types other than default, ``attention_bias``.
"""

from __future__ import annotations

import functools
import math

import torch

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.afmoe import AfmoeBridge
from loongforge_hf.bridges.deepseek import sigmoid_routing_kwargs
from loongforge_hf.bridges.dense import D, L
from loongforge_hf.bridges.mappings import ColumnParallel, Mapping, renamed
from loongforge_hf.bridges.registry import register_bridge

SCALE_SLOTS = 2048.0


@functools.cache
def _query_scaled(norm: type) -> type:
    """``norm``'s class (the q norm) then the query scale by slot (module docstring); ``slots`` set per forward."""

    class QueryScaled(norm):
        slots = None

        def forward(self, query: torch.Tensor) -> torch.Tensor:  # NOTE: [s, b, heads, d]
            query = super().forward(query)
            scales = torch.exp(0.1 * torch.log1p((self.slots.float() + 1.0) / SCALE_SLOTS))
            return (query.float() * scales.view(-1, 1, 1, 1)).to(query.dtype)

    return QueryScaled


@functools.cache
def beam_attention(*, full: frozenset[int]) -> type:
    """megatron's ``SelfAttention`` with AFMoE's post norm and rope-less ``full`` layers (0-based global indices), the
    gate bias and the query scale (module docstring)."""
    from loongforge_hf.bridges.layer_outputs import transformed_attention
    from loongforge_hf.bridges.llama4 import _slots
    from loongforge_hf.bridges.smollm3 import no_rope_attention

    class BeamSelfAttention(no_rope_attention(full, base=transformed_attention(post_norm=True))):
        def __init__(self, config, *args, **kwargs) -> None:
            super().__init__(config, *args, **kwargs)
            heads = config.num_attention_heads // config.tensor_model_parallel_size
            self.gate_bias = torch.nn.Parameter(torch.empty(heads, dtype=config.params_dtype))
            self.full = self.layer_number - 1 in full
            if self.full:
                self.q_layernorm.__class__ = _query_scaled(type(self.q_layernorm))

        def forward(self, *args, **kwargs):
            if self.full:
                # NOTE: the first rotary channel's angle is the slot (its inverse frequency is 1)
                self.q_layernorm.slots = _slots(kwargs.get("rotary_pos_emb"), 1.0)
            try:
                return super().forward(*args, **kwargs)
            finally:
                if self.full:
                    self.q_layernorm.slots = None

        def _apply_output_gate(self, x, gate):
            gate = gate.view(*gate.shape[:-2], self.gate_bias.shape[0], -1) + self.gate_bias[:, None]
            return super()._apply_output_gate(x, gate)

        def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
            # NOTE: megatron's default keys a module's own parameters as replicated over TP (one rank's copy saved
            # for all); gate_bias holds this rank's heads, so it is split along dim 0 as they are
            from megatron.core.transformer.utils import (ensure_metadata_has_dp_cp_group,
                                                         make_sharded_tensors_for_checkpoint)

            state = super().sharded_state_dict(prefix, sharded_offsets, metadata)
            metadata = ensure_metadata_has_dp_cp_group(metadata)
            state.update(make_sharded_tensors_for_checkpoint(
                {"gate_bias": self.gate_bias}, prefix, {"gate_bias": 0}, sharded_offsets, tp_group=self.tp_group,
                dp_cp_group=metadata["dp_cp_group"]))
            return state

    return BeamSelfAttention


def _scaled_add(k: int):
    """megatron's bias-dropout-add slot as ``out / sqrt(k) + residual * sqrt((k - 1) / k)`` (no bias, no dropout)."""
    out_scale, residual_scale = 1.0 / math.sqrt(k), math.sqrt((k - 1) / k)

    def add(output_with_bias, residual, prob):
        output, bias = output_with_bias
        if bias is not None:
            raise ValueError("Beam's residual add takes no bias.")
        return output * out_scale + residual * residual_scale

    return lambda training, fused: add


@register_bridge("BeamForCausalLM")
class BeamBridge(AfmoeBridge):
    shared_experts = None
    expert_bias_name = "gate.e_score_correction_bias"
    router_name = "gate"
    router_fp32 = True

    # ---- config ---------------------------------------------------------------------------------------------
    def check_config(self) -> None:
        c, arch = self.hf_config, self.architectures[0]
        if c.rope_parameters.get("full_attention") is not None:
            raise C.UnsupportedConfigError(f"rope_parameters['full_attention'] is not supported for {arch} (its full "
                                           "layers run without rope).")
        if c.attention_bias:
            raise C.UnsupportedConfigError(f"attention_bias=True is not supported for {arch}.")
        super(AfmoeBridge, self).check_config()

    def rope_parameters(self) -> dict:
        params = dict(self.hf_config.rope_parameters.get("sliding_attention") or {})
        if params.get("rope_type", "default") != "default":
            raise C.UnsupportedConfigError(f"rope_parameters['sliding_attention'] rope_type={params['rope_type']!r} "
                                           f"is not supported for {self.architectures[0]} (default only).")
        return {"rope_type": "default", "rope_theta": params["rope_theta"]}

    def shared_ffn_size(self) -> int | None:
        return None

    def is_moe_layer(self, layer: int) -> bool:
        return self.hf_config.mlp_layer_types[layer] == "sparse"

    def routing_kwargs(self) -> dict:
        return sigmoid_routing_kwargs(self.hf_config, num_experts=self.hf_config.num_experts)

    def attention_module(self) -> type:
        c = self.hf_config
        return beam_attention(full=frozenset(i for i, kind in enumerate(c.layer_types) if kind == "full_attention"))

    def finish_model(self, model) -> None:
        from loongforge_hf.bridges.layer_outputs import softcap_logits

        for layer in model.decoder.layers:
            k = 2 * layer.layer_number  # NOTE: megatron numbers layers from 1: 2 (i + 1)
            layer.self_attn_bda, layer.mlp_bda = _scaled_add(k), _scaled_add(k + 1)
        if self.hf_config.final_logit_softcapping is not None:
            softcap_logits(model, self.hf_config.final_logit_softcapping)

    # ---- tensors --------------------------------------------------------------------------------------------
    def attention_mappings(self) -> list[Mapping]:
        return super().attention_mappings() + [
            ColumnParallel(f"{D}.self_attention.gate_bias", f"{L}.self_attn.gate_bias")]

    def dense_mlp_mappings(self) -> list[Mapping]:
        return [_beam_names(m) for m in super().dense_mlp_mappings()]

    def moe_mappings(self) -> list[Mapping]:
        return [_beam_names(m) for m in super().moe_mappings()]

    def attention_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        return {**super().attention_shapes(prefix),
                f"{prefix}.self_attn.gate_bias": (self.hf_config.num_attention_heads,)}

    def dense_mlp_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        return {_beam_name(n): s for n, s in super().dense_mlp_shapes(prefix).items()}

    def moe_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        return {_beam_name(n): s for n, s in super().moe_shapes(prefix).items()}


_NAMES = {".pre_mlp_layernorm.": ".pre_feedforward_layernorm.", ".post_mlp_layernorm.": ".post_feedforward_layernorm."}


def _beam_name(name: str) -> str:
    for old, new in _NAMES.items():
        name = name.replace(old, new)
    return name


def _beam_names(mapping: Mapping) -> Mapping:
    for old, new in _NAMES.items():
        mapping = renamed(mapping, f"{L}{old}", f"{L}{new}")
    return mapping
