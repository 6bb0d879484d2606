"""KimiLinearForCausalLM (Moonshot's Kimi-Linear-48B-A3B): Kimi Delta Attention layers and multi-latent attention
layers interleaved (``layer_types``), DeepSeek-V3-style mixture of experts after the first dense layers
(``mlp_layer_types``).

Choices:
- ``linear_attention`` layers: transformers' ``KimiLinearDeltaAttention`` -> our ``KimiDeltaAttention``
  (``kimi_delta_attention.py``: the Gated DeltaNet module with a per-channel decay and a low-rank sigmoid output
  gate) in megatron's self-attention slot. transformers' layer differs from Qwen3.5's Gated DeltaNet in:
  - the decay: ``KimiLinearForgetGate`` gives ``g = -exp(A_log[head]) * softplus(f_b(f_a(x)) + dt_bias)`` per key
    channel (``[heads, head_dim]``; ``A_log`` stored ``[1, 1, heads, 1]``, ``dt_bias`` ``[heads * head_dim]`` kept in
    fp32 by transformers, and so here); the chunked rule takes it per channel (``kernels.gated_delta_rule``);
  - separate ``q_proj`` / ``k_proj`` / ``v_proj`` / ``b_proj`` (one ``in_proj`` of this rank's heads, as OLMo
    Hybrid's), one head count for keys and values (``linear_num_heads``, ``linear_head_dim``), no ``z`` rows;
  - the output gate ``g_b_proj(g_a_proj(x))`` through sigmoid in ``o_norm`` (``KimiLinearRMSNormGated``: all fp32,
    rounded once, eps ``rms_norm_eps``); ``beta = sigmoid(b)``; the conv (no bias, silu, q / k / v channels,
    ``q_conv1d`` / ``k_conv1d`` / ``v_conv1d`` on disk) and the L2-normalised q / k as Qwen3.5's.
- ``full_attention`` layers: transformers' ``KimiLinearAttention`` is DeepSeek's MLA (``deepseek.MultiLatentAttention``:
  ``q_proj`` or ``q_a_proj`` / ``q_a_layernorm`` / ``q_b_proj``, ``kv_a_proj_with_mqa`` / ``kv_a_layernorm`` /
  ``kv_b_proj``, ``o_proj``; softmax scale ``(qk_nope + qk_rope)^-1/2``) without any position embedding: the
  ``qk_rope_head_dim`` channels (the shared key part) are never rotated. megatron's ``MLASelfAttention`` always
  rotates them; ``finish_model`` sets its rotary frequencies to zero (every angle 0: cos 1, sin 0, the identity; its
  pair de-interleave permutes q's and k's channels alike, which leaves the scores as they are).
- MoE: ``KimiLinearTopkRouter`` is DeepSeek-V3's (sigmoid scores plus the fixed ``e_score_correction_bias``, top-2
  sums per group, ``topk_group`` groups, renormalised top k, ``routed_scaling_factor``), ``num_shared_experts``
  always-on experts, dense layers where ``mlp_layer_types`` says ``dense`` (``intermediate_size``). transformers'
  ``router_logits`` as DeepSeek's (``DeepseekStyleMoE``).
- An untied LM head whatever ``tie_word_embeddings`` says: transformers' ``KimiLinearForCausalLM`` ties nothing.
- Tensor names are the checkpoint's, as transformers 5 reads and writes them (its ``conversion_mapping`` for
  ``kimi_linear``): every layer's MLP under ``block_sparse_moe`` (the dense ones too), experts as ``w1`` / ``w3`` /
  ``w2``, the forget gate's tensors in ``self_attn`` (``f_a_proj``, ``f_b_proj``, ``A_log``, ``dt_bias``). The hub's
  checkpoints name the dense layers' MLP ``mlp``: ``checkpoint_aliases`` reads ``model.layers.N.mlp.*`` as
  ``block_sparse_moe`` (``base_model_prefix.py``), as transformers reads both; export writes ``block_sparse_moe``,
  as its ``save_pretrained`` does. A file with both names reads the ``block_sparse_moe`` one, as transformers.
- Cached generate: the MLA layers' keys and values and the KDA layers' conv and recurrent states (``kv_cache.py``),
  as transformers' dynamic cache. Context parallelism: the MLA layers as DeepSeek's, the KDA layers pass the conv's
  tail and the recurrent state between the chunks as every Gated DeltaNet (``parallel/delta_rule_cp.py``: the rule
  as an affine map of the incoming state holds for a per-channel decay too).
- Refused by name before any collective: unknown ``layer_types`` / ``mlp_layer_types`` or the wrong count,
  ``num_key_value_heads`` other than ``num_attention_heads`` (transformers' MLA repeats its per-head keys by that
  ratio), ``hidden_act`` other than silu (the conv's activation), ``attention_bias``, linear heads that do not split
  over TP, the static cache (no recurrent state), and what DeepSeek's MLA and sigmoid routing refuse.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.deepseek import DeepseekStyleMoE, MultiLatentAttention, sigmoid_routing_kwargs
from loongforge_hf.bridges.dense import D, L, DenseBridge
from loongforge_hf.bridges.gated_mappings import HeadSections
from loongforge_hf.bridges.mappings import (ColumnParallel, FP32ColumnParallel, Mapping, Replicated, RowParallel,
                                            _fmt, _tp_slice, replaced, with_replaced_names)
from loongforge_hf.bridges.qwen3_5 import Qwen3_5Bridge
from loongforge_hf.bridges.registry import register_bridge

A, S = f"{L}.self_attn", f"{D}.self_attention"
LAYER_TYPES, MLP_TYPES = ("linear_attention", "full_attention"), ("dense", "sparse")
_NAMES = {".mlp.": ".block_sparse_moe."}  # NOTE: module tree -> checkpoint (transformers' conversion_mapping)


@dataclass(frozen=True)
class HeadScalars(ColumnParallel):
    """One value per head stored ``[1, 1, heads, 1]`` (``A_log``) <-> this rank's heads ``[heads / tp]``."""

    def load(self, reader, ctx, layer):
        return _tp_slice(reader, _fmt(self.hf, layer), ctx, dim=2).reshape(-1)

    def export(self, shards, ctx, layer):
        return {_fmt(self.hf, layer): torch.cat(shards).reshape(1, 1, -1, 1)}

    def export_parts(self, shard, rank, ctx, layer):
        return [(_fmt(self.hf, layer), 2, rank * shard.numel(), shard.reshape(1, 1, -1, 1))]


@register_bridge("KimiLinearForCausalLM")
class KimiLinearBridge(MultiLatentAttention, DeepseekStyleMoE):
    sparse_block = "block_sparse_moe"
    checkpoint_aliases = ((r"^(model\.layers\.\d+)\.mlp\.", r"\1.block_sparse_moe."),)  # NOTE: the hub's dense MLP
    expert_projections = ("w1", "w3", "w2")
    expert_bias = True
    per_layer_types = True  # NOTE: layer_types checked here
    tied = False  # NOTE: transformers never ties the LM head here (_tied_weights_keys = {}), whatever the config says
    generation_refusal = Qwen3_5Bridge.generation_refusal

    @property
    def lora_own_weights(self) -> dict[str, str]:
        """The KDA layers' gate projections LoRA adapts (``lora/own_weights.py``)."""
        from loongforge_hf.bridges.kimi_delta_attention import KimiDeltaAttention

        return KimiDeltaAttention.lora_own_weights

    # ---- config ---------------------------------------------------------------------------------------------
    def check_config(self) -> None:
        c, arch = self.hf_config, self.architectures[0]
        for field, allowed in (("layer_types", LAYER_TYPES), ("mlp_layer_types", MLP_TYPES)):
            kinds = list(getattr(c, field) or [])
            if sorted(set(kinds) - set(allowed)) or len(kinds) != c.num_hidden_layers:
                raise C.UnsupportedConfigError(f"{field}={kinds} is not supported for {arch}: one of {list(allowed)} "
                                               f"per layer ({c.num_hidden_layers} layers).")
        if c.num_key_value_heads != c.num_attention_heads:
            raise C.UnsupportedConfigError(f"num_key_value_heads={c.num_key_value_heads} is not supported for {arch}: "
                                           f"MLA needs num_attention_heads={c.num_attention_heads}.")
        if c.hidden_act != "silu":
            raise C.UnsupportedConfigError(f"hidden_act={c.hidden_act!r} is not supported for {arch} (only 'silu': "
                                           "the linear-attention conv uses it).")
        if c.attention_bias:
            raise C.UnsupportedConfigError(f"attention_bias=True is not supported for {arch}.")
        super().check_config()

    def check_layout(self, layout) -> None:
        """``UnsupportedConfigError`` for a layout the KDA layers cannot run (pure: before any collective)."""
        c, arch = self.hf_config, self.architectures[0]
        if c.linear_num_heads % layout.tensor_parallel_size:
            raise C.UnsupportedConfigError(f"linear_num_heads={c.linear_num_heads} does not split over "
                                           f"tensor_parallel_size={layout.tensor_parallel_size} for {arch}.")

    def num_experts(self) -> int:
        return self.hf_config.num_local_experts

    def is_moe_layer(self, layer: int) -> bool:
        return self.hf_config.mlp_layer_types[layer] == "sparse"

    def routing_kwargs(self) -> dict:
        return sigmoid_routing_kwargs(self.hf_config, num_experts=self.hf_config.num_local_experts)

    @property
    def linear_layers(self) -> frozenset[int]:
        return frozenset(i for i, kind in enumerate(self.hf_config.layer_types) if kind == "linear_attention")

    def layer_module(self) -> type:
        from megatron.core.transformer.multi_latent_attention import MLASelfAttention

        from loongforge_hf.bridges.gated_deltanet import hybrid_self_attention
        from loongforge_hf.bridges.kimi_delta_attention import KimiDeltaAttention

        c = self.hf_config
        heads, dim = c.linear_num_heads, c.linear_head_dim
        return with_self_attention(hybrid_self_attention(
            linear=self.linear_layers, key_heads=heads, value_heads=heads, key_dim=dim, value_dim=dim,
            conv_kernel=c.linear_conv_kernel_dim, eps=c.rms_norm_eps, attention=MLASelfAttention,
            mixer=KimiDeltaAttention))

    def finish_model(self, model) -> None:
        from megatron.core.transformer.multi_latent_attention import MLASelfAttention

        from loongforge_hf.kernels.rope import set_megatron_inv_freq

        super().finish_model(model)
        for module in model.modules():
            if isinstance(module, MLASelfAttention):  # NOTE: NoPE: every rotary angle 0 (module docstring)
                rope = module.rotary_pos_emb
                set_megatron_inv_freq(rope, torch.zeros_like(rope.inv_freq))

    # ---- tensors --------------------------------------------------------------------------------------------
    def linear_attention_mappings(self) -> list[Mapping]:
        c = self.hf_config
        width, heads = c.linear_num_heads * c.linear_head_dim, c.linear_num_heads
        qkv = tuple((f"{A}.{n}_proj.weight", (width,)) for n in "qkv")
        return [
            Replicated(f"{D}.input_layernorm.weight", f"{L}.input_layernorm.weight"),
            HeadSections(f"{S}.in_proj.weight", (*qkv, (f"{A}.b_proj.weight", (heads,)))),
            HeadSections(f"{S}.conv_weight", tuple((f"{A}.{n}_conv1d.weight", (width,)) for n in "qkv")),
            HeadScalars(f"{S}.A_log", f"{A}.A_log"),
            FP32ColumnParallel(f"{S}.dt_bias", f"{A}.dt_bias"),
            Replicated(f"{S}.f_a_weight", f"{A}.f_a_proj.weight"),
            ColumnParallel(f"{S}.f_b_weight", f"{A}.f_b_proj.weight"),
            Replicated(f"{S}.g_a_weight", f"{A}.g_a_proj.weight"),
            ColumnParallel(f"{S}.g_b_weight", f"{A}.g_b_proj.weight"),
            Replicated(f"{S}.norm_weight", f"{A}.o_norm.weight"),
            RowParallel(f"{S}.out_proj.weight", f"{A}.o_proj.weight"),
        ]

    def dense_mlp_mappings(self) -> list[Mapping]:
        return [with_replaced_names(m, _NAMES) for m in DenseBridge.dense_mlp_mappings(self)]

    def layer_mappings(self) -> list[Mapping]:
        return self.attention_mappings() + self.linear_attention_mappings()[1:] + self.dense_mlp_mappings() \
            + self.moe_mappings()

    def mappings_for_layer(self, layer: int) -> list[Mapping]:
        mixer = self.linear_attention_mappings() if layer in self.linear_layers else self.attention_mappings()
        return mixer + (self.moe_mappings() if self.is_moe_layer(layer) else self.dense_mlp_mappings())

    def checkpoint_name(self, name: str) -> str:
        """The checkpoint's name of tensor ``name`` of transformers' module tree."""
        return replaced(name, {**_NAMES, ".forget_gate.": "."})

    def linear_attention_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        c, p = self.hf_config, f"{prefix}.self_attn"
        h, heads, dim = c.hidden_size, c.linear_num_heads, c.linear_head_dim
        width = heads * dim
        return {f"{prefix}.input_layernorm.weight": (h,), **{f"{p}.{n}_proj.weight": (width, h) for n in "qkv"},
                f"{p}.b_proj.weight": (heads, h),
                **{f"{p}.{n}_conv1d.weight": (width, 1, c.linear_conv_kernel_dim) for n in "qkv"},
                f"{p}.A_log": (1, 1, heads, 1), f"{p}.dt_bias": (width,), f"{p}.f_a_proj.weight": (dim, h),
                f"{p}.f_b_proj.weight": (width, dim), f"{p}.g_a_proj.weight": (dim, h),
                f"{p}.g_b_proj.weight": (width, dim), f"{p}.o_norm.weight": (dim,), f"{p}.o_proj.weight": (h, width)}

    def dense_mlp_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        return {replaced(n, _NAMES): s for n, s in DenseBridge.dense_mlp_shapes(self, prefix).items()}

    def layer_shapes(self, layer: int) -> dict[str, tuple[int, ...]]:
        prefix = f"model.layers.{layer}"
        mixer = self.linear_attention_shapes(prefix) if layer in self.linear_layers else self.attention_shapes(prefix)
        mlp = self.moe_shapes(prefix) if self.is_moe_layer(layer) else self.dense_mlp_shapes(prefix)
        return {**mixer, **mlp}


@functools.cache
def with_self_attention(module: type) -> type:
    """megatron's ``TransformerLayer`` whose self-attention slot builds ``module`` (the spec's submodules kept)."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    class KimiLinearLayer:
        def __new__(cls, config, submodules, layer_number: int = 1, **kwargs):
            attention = replace(submodules.self_attention, module=module)
            return TransformerLayer(config, replace(submodules, self_attention=attention), layer_number, **kwargs)

    return KimiLinearLayer
