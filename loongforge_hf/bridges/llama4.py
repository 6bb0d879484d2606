"""Llama4ForCausalLM (the text model of Llama 4 Scout / Maverick, ``Llama4TextConfig``): dense and MoE layers
interleaved, a top-1 sigmoid router that scales the expert's input, a shared expert, NoPE layers with a
position-dependent query temperature, L2 q / k norms and chunked local attention on the rotary layers.

Choices:
- Layers: ``moe_layers`` (from ``interleave_moe_layer_step``) are MoE layers, the rest dense MLPs of
  ``intermediate_size_mlp`` (megatron's ``ffn_hidden_size``); experts and the shared expert are ``intermediate_size``
  wide (``moe_ffn_hidden_size``, ``moe_shared_expert_intermediate_size``, no gate on the shared expert).
- Routing: transformers keeps the top-k logits, sigmoids them and multiplies each expert's *input* by its score,
  unnormalised: megatron's ``score_function="sigmoid"`` (top-k of the sigmoids is top-k of the logits) with
  ``moe_apply_probs_on_input`` (our grouped experts and megatron's ``SequentialMLP`` both take it). megatron
  renormalises sigmoid top-k scores for k > 1 and applies input probs only at k = 1, so ``num_experts_per_tok`` must
  be 1 (every hub checkpoint). transformers' ``router_logits`` as DeepSeek's (``router_logits.py``); its
  ``Llama4ForCausalLM`` adds no balancing loss.
- Experts stacked on disk: ``feed_forward.experts.gate_up_proj`` ``[E, H, 2I]`` (each expert's matrix ``[in, out]``,
  gate then up halves) and ``down_proj`` ``[E, I, H]`` (``stacked_experts.py``, ``transposed``).
- LoRA (PEFT): the stacks and the router as ``target_parameters`` (PEFT's factors on the stacks the other way round:
  ``hf_experts_in_out``, ``lora/param_targets.py``); the router as a module (``"all-linear"`` included) is refused,
  PEFT's LoRA layer failing on its (scores, logits) output.
- Rotary: transformers multiplies channel pairs ``(2i, 2i + 1)`` as complex numbers: megatron's
  ``rotary_interleaved``; default or llama3 scaling (the hub's Scout), other rope types refused.
- The attention (``llama4_attention``, megatron's ``SelfAttention`` with per-layer choices by global layer number):
  - NoPE layers (``no_rope_layers`` 0): no rotary embedding, no q / k norms; with ``attn_temperature_tuning`` the
    queries times ``1 + attn_scale * log1p(floor((p + 1) / floor_scale))``, ``p`` the token's slot in the sequence
    (transformers: its index plus the cached length, not its position id), read from the rotary angles megatron
    hands the layer (``angle / inv_freq[0]``: slots under context parallelism, KV caches and padding alike).
  - rotary layers: ``use_qk_norm`` is an L2 norm without weight (``rms_norm_eps``) on q and k in megatron's q / k
    norm slots, before the rotation where transformers normalises after it: a rotation keeps each head's norm, so
    the result is the same (fp32 rounding apart).
  - ``layer_types`` ``chunked_attention`` layers attend within chunks of ``attention_chunk_size`` positions
    (``kernels.attention.attention_chunks``, counted from a row's first key as transformers counts from the first
    real token / a packed document's start). The static KV cache and the KV cache sharded over context-parallel
    ranks refuse it (the dynamic cache, ``cp_kv_cache="replicated"`` under CP, serve).
- Refused: ``attention_bias`` (a bias on o_proj, which megatron ties to the MLP's), ``num_experts_per_tok`` != 1,
  unknown ``layer_types``, ``no_rope_layers`` shorter than the layers.
"""

from __future__ import annotations

import functools

import torch

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.dense import D, L
from loongforge_hf.bridges.fused_mappings import GatedMLP
from loongforge_hf.bridges.mappings import Mapping, Replicated, RowParallel
from loongforge_hf.bridges.moe import MoEBridge
from loongforge_hf.bridges.registry import register_bridge
from loongforge_hf.bridges.stacked_experts import StackedDown, StackedGateUp, routed_stack

LAYER_TYPES = ("full_attention", "chunked_attention")
F = f"{L}.feed_forward"


class L2Norm(torch.nn.Module):
    """Llama 4's q / k norm: ``x / rms(x)`` over the head's channels in fp32, no weight (megatron's norm slot)."""

    def __init__(self, config=None, hidden_size: int = 0, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x)


class QueryTemperature(torch.nn.Module):
    """A NoPE layer's query scale by slot (module docstring), in the q norm slot; ``slots`` set per forward."""

    def __init__(self, *, floor_scale: float, attn_scale: float) -> None:
        super().__init__()
        self.floor_scale, self.attn_scale = floor_scale, attn_scale
        self.slots: torch.Tensor | None = None

    def forward(self, query: torch.Tensor) -> torch.Tensor:  # NOTE: [s, b, heads, d]
        scales = torch.log1p(torch.floor((self.slots.float() + 1.0) / self.floor_scale)) * self.attn_scale + 1.0
        return (query * scales.view(-1, 1, 1, 1)).to(query.dtype)


def _slots(rotary_pos_emb, first_inv_freq: float) -> torch.Tensor:
    """Each token's slot from megatron's rotary angles ``[s, 1, 1, rot]`` (the first channel's, slot x inv_freq[0])."""
    if isinstance(rotary_pos_emb, tuple):
        rotary_pos_emb = rotary_pos_emb[0]
    if rotary_pos_emb is None:
        raise ValueError("Llama 4 attention temperature: the layer got no rotary angles to read positions from.")
    return torch.round(rotary_pos_emb[:, 0, 0, 0].float() / first_inv_freq)


@functools.cache
def llama4_attention(*, nope: frozenset[int], chunked: frozenset[int], chunk_size: int | None,
                     temperature: tuple[float, float] | None, first_inv_freq: float) -> type:
    """megatron's ``SelfAttention`` with Llama 4's per-layer rules (module docstring): ``nope`` / ``chunked`` are
    0-based global layer indices, ``temperature`` ``(floor_scale, attn_scale)`` or None."""
    from megatron.core.transformer.attention import SelfAttention

    from loongforge_hf.kernels.attention import attention_chunks

    class Llama4SelfAttention(SelfAttention):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            layer = self.layer_number - 1  # NOTE: megatron numbers layers from 1, offset by the stage
            self.nope, self.chunk = layer in nope, chunk_size if layer in chunked else None
            if self.nope:
                self.q_layernorm = QueryTemperature(floor_scale=temperature[0], attn_scale=temperature[1]) \
                    if temperature else None
                self.k_layernorm = None

        def forward(self, *args, **kwargs):
            if self.nope:
                if self.q_layernorm is not None:
                    self.q_layernorm.slots = _slots(kwargs.get("rotary_pos_emb"), first_inv_freq)
                kwargs.update(rotary_pos_emb=None, rotary_pos_cos=None, rotary_pos_sin=None, rotary_pos_cos_sin=None)
            try:
                with attention_chunks(self.chunk):
                    return super().forward(*args, **kwargs)
            finally:
                if self.nope and self.q_layernorm is not None:
                    self.q_layernorm.slots = None

    return Llama4SelfAttention


@register_bridge("Llama4ForCausalLM")
class Llama4Bridge(MoEBridge):
    sparse_block = "feed_forward"
    shared_experts = "shared_expert"
    hf_router_logits = True                                    # transformers returns them; it adds no aux loss
    hf_ignores_aux_loss_coef = True                            # ... whatever router_aux_loss_coef says
    per_layer_types = True                                     # chunked_attention layers (checked here)
    hf_experts_in_out = True                                   # [E, in, out] stacks PEFT reads as [E, out, in]
    extra_rope_types = ()

    # ---- config ---------------------------------------------------------------------------------------------
    def check_config(self) -> None:
        c, arch = self.hf_config, self.architectures[0]
        if getattr(c, "attention_bias", False):
            raise C.UnsupportedConfigError(f"attention_bias=True is not supported for {arch}: it puts a bias on "
                                           "o_proj while the MLP has none (megatron's add_bias_linear ties them).")
        if c.num_experts_per_tok != 1:
            raise C.UnsupportedConfigError(
                f"num_experts_per_tok={c.num_experts_per_tok} is not supported for {arch} (only 1): megatron "
                "renormalises sigmoid top-k scores and scales the experts' input by them at top-1 only.")
        kinds = list(c.layer_types or [])
        unknown = sorted(set(kinds) - set(LAYER_TYPES))
        if unknown:
            raise C.UnsupportedConfigError(f"layer_types {unknown} are not supported for {arch}; supported: "
                                           f"{list(LAYER_TYPES)}.")
        if "chunked_attention" in kinds and not c.attention_chunk_size:
            raise C.UnsupportedConfigError(f"attention_chunk_size={c.attention_chunk_size} with chunked_attention "
                                           "layers.")
        if len(c.no_rope_layers or []) < c.num_hidden_layers:
            raise C.UnsupportedConfigError(f"no_rope_layers has {len(c.no_rope_layers or [])} entries for "
                                           f"{c.num_hidden_layers} layers.")
        if c.attn_temperature_tuning and not c.floor_scale:
            raise C.UnsupportedConfigError(f"floor_scale={c.floor_scale} with attn_temperature_tuning.")
        super().check_config()

    def num_experts(self) -> int:
        return self.hf_config.num_local_experts

    def expert_ffn_size(self) -> int:
        return self.hf_config.intermediate_size

    def shared_ffn_size(self) -> int:
        return self.hf_config.intermediate_size

    def is_moe_layer(self, layer: int) -> bool:
        return layer in set(self.hf_config.moe_layers or [])

    def routing_kwargs(self) -> dict:
        return {"moe_router_score_function": "sigmoid", "moe_apply_probs_on_input": True}

    def transformer_config_kwargs(self) -> dict:
        kw = super().transformer_config_kwargs()
        kw.update(ffn_hidden_size=self.hf_config.intermediate_size_mlp, rotary_interleaved=True)
        return kw

    def qk_module(self) -> type | None:
        return L2Norm if self.hf_config.use_qk_norm else None

    def attention_module(self) -> type:
        from loongforge_hf.kernels.rope import rope_inv_freq

        c, rope = self.hf_config, self.rope_parameters()
        first = float(rope_inv_freq(C.head_dim_of(c), base=rope["rope_theta"], rope_scaling=rope)[0])
        return llama4_attention(
            nope=frozenset(i for i in range(c.num_hidden_layers) if not c.no_rope_layers[i]),
            chunked=frozenset(i for i, kind in enumerate(c.layer_types or []) if kind == "chunked_attention"),
            chunk_size=c.attention_chunk_size,
            temperature=(float(c.floor_scale), float(c.attn_scale)) if c.attn_temperature_tuning else None,
            first_inv_freq=first)

    # ---- tensors --------------------------------------------------------------------------------------------
    def dense_mlp_mappings(self) -> list[Mapping]:
        return [
            Replicated(f"{D}.pre_mlp_layernorm.weight", f"{L}.post_attention_layernorm.weight"),
            GatedMLP(f"{D}.mlp.linear_fc1.weight", gate=f"{F}.gate_proj.weight", up=f"{F}.up_proj.weight"),
            RowParallel(f"{D}.mlp.linear_fc2.weight", f"{F}.down_proj.weight"),
        ]

    def moe_mappings(self) -> list[Mapping]:
        shared = f"{F}.shared_expert"
        return [
            Replicated(f"{D}.pre_mlp_layernorm.weight", f"{L}.post_attention_layernorm.weight"),
            Replicated(f"{D}.mlp.router.weight", f"{F}.router.weight"),
            routed_stack(self, StackedGateUp, "linear_fc1.weight", f"{F}.experts.gate_up_proj", transposed=True),
            routed_stack(self, StackedDown, "linear_fc2.weight", f"{F}.experts.down_proj", transposed=True),
            GatedMLP(f"{D}.mlp.shared_experts.linear_fc1.weight", gate=f"{shared}.gate_proj.weight",
                     up=f"{shared}.up_proj.weight"),
            RowParallel(f"{D}.mlp.shared_experts.linear_fc2.weight", f"{shared}.down_proj.weight"),
        ]

    def dense_mlp_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        h, f, p = self.hf_config.hidden_size, self.hf_config.intermediate_size_mlp, f"{prefix}.feed_forward"
        return {f"{prefix}.post_attention_layernorm.weight": (h,), f"{p}.gate_proj.weight": (f, h),
                f"{p}.up_proj.weight": (f, h), f"{p}.down_proj.weight": (h, f)}

    def moe_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        h, f, n = self.hf_config.hidden_size, self.expert_ffn_size(), self.num_experts()
        p = f"{prefix}.feed_forward"
        return {f"{prefix}.post_attention_layernorm.weight": (h,), f"{p}.router.weight": (n, h),
                f"{p}.experts.gate_up_proj": (n, h, 2 * f), f"{p}.experts.down_proj": (n, f, h),
                f"{p}.shared_expert.gate_proj.weight": (f, h), f"{p}.shared_expert.up_proj.weight": (f, h),
                f"{p}.shared_expert.down_proj.weight": (h, f)}
