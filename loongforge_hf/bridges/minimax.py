"""MiniMaxForCausalLM (MiniMax-Text-01, MiniMax-M1): lightning-attention layers and softmax-attention layers
interleaved (``layer_types``), a softmax top-k mixture of experts in every layer, scaled residuals around a
normalised stream.

Choices:
- ``linear_attention`` layers: transformers' ``MiniMaxLightningAttention`` -> our ``LightningAttention``
  (``lightning_attention.py``: TP by heads, the decay tables loaded from the checkpoint) in megatron's self-attention
  slot; ``full_attention`` layers: megatron's ``SelfAttention`` with Mixtral's tensors (GQA, rope, no biases; a
  ``sliding_window`` as Mixtral's).
- The layer: transformers' decoder layer takes its residual *after* each norm and scales both branches,
  ``h = a1 * n1 + b1 * attn(n1)`` with ``n1 = input_layernorm(x)``, then ``out = a2 * n2 + b2 * mlp(n2)`` with
  ``n2 = post_attention_layernorm(h)``; ``a1`` / ``b1`` are ``linear_attn_alpha_factor`` / ``beta`` or
  ``full_attn_alpha_factor`` / ``beta`` by the layer's kind, ``a2`` / ``b2`` ``mlp_alpha_factor`` / ``beta``.
  ``MiniMaxLayer`` is megatron's ``TransformerLayer`` with its two norms moved before the residual (megatron's
  ``attention_norm`` / ``mlp_norm``; its own norm slots identities) and both residual adds scaled
  (``scaled_residual`` in the bias-dropout-add slots).
- MoE: Mixtral's (softmax over all experts, top k renormalised; ``block_sparse_moe``, experts ``w1`` / ``w3`` / ``w2``
  on disk, as transformers' conversion for ``minimax`` reads and writes them), transformers' ``router_logits`` and
  balancing loss; ``router_jitter_noise`` refused as Mixtral's.
- Cached generate: the softmax layers' keys and values and the lightning layers' ``k^T v`` states (``kv_cache.py``),
  as transformers' ``MiniMaxCache`` holds them.
- Refused by name before any collective: unknown ``layer_types`` or the wrong count, ``hidden_act`` other than silu
  (the lightning layers' activation), ``block_size`` < 1, the static cache (no lightning state in its fixed-shape
  step: ``generation_refusal``).
- Context parallelism: the lightning layers pass their ``k^T v`` state between the chunks
  (``LightningAttention._mix_cp``), the softmax layers are megatron's; ``generate`` under CP runs without the cache
  (the split prefill cannot fill the lightning states: ``kv_cache.patched`` refuses it by name).
"""

from __future__ import annotations

import functools
from dataclasses import replace

import torch.nn.functional as F

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.dense import D, L
from loongforge_hf.bridges.gated_mappings import HeadSections
from loongforge_hf.bridges.mappings import ColumnParallel, Mapping, RowParallel
from loongforge_hf.bridges.mixtral import MixtralBridge
from loongforge_hf.bridges.recurrent_common import mixer_on_layers
from loongforge_hf.bridges.registry import register_bridge

A, S = f"{L}.self_attn", f"{D}.self_attention"
LAYER_TYPES = ("linear_attention", "full_attention")
_NORMS = {"input_layernorm": "attention_norm", "pre_mlp_layernorm": "mlp_norm"}


class HeadColumns(ColumnParallel):
    """Split with the heads along dim 1 (``diagonal_decay`` ``[1, heads, block, block]``)."""

    split_dim = 1


@register_bridge("MiniMaxForCausalLM")
class MiniMaxBridge(MixtralBridge):
    per_layer_types = True  # NOTE: layer_types checked here

    # ---- config ---------------------------------------------------------------------------------------------
    def check_config(self) -> None:
        c, arch = self.hf_config, self.architectures[0]
        kinds = list(c.layer_types or [])
        if sorted(set(kinds) - set(LAYER_TYPES)) or len(kinds) != c.num_hidden_layers:
            raise C.UnsupportedConfigError(f"layer_types={kinds} is not supported for {arch}: one of "
                                           f"{list(LAYER_TYPES)} per layer ({c.num_hidden_layers} layers).")
        if c.hidden_act != "silu":
            raise C.UnsupportedConfigError(f"hidden_act={c.hidden_act!r} is not supported for {arch} (only 'silu': "
                                           "the lightning layers' activation).")
        if c.block_size < 1:
            raise C.UnsupportedConfigError(f"block_size={c.block_size} is not supported for {arch} (at least 1).")
        super().check_config()

    def generation_refusal(self, generation_config) -> str | None:
        if generation_config.use_cache and generation_config.cache_implementation == "static":
            return (f"cache_implementation='static' is not supported for {self.architectures[0]}: the static cache's "
                    "fixed-shape decode step keeps no lightning-attention state; use the default dynamic cache.")
        return None

    @property
    def linear_layers(self) -> frozenset[int]:
        return frozenset(i for i, kind in enumerate(self.hf_config.layer_types) if kind == "linear_attention")

    def layer_module(self) -> type:
        c = self.hf_config
        scales = tuple((float(getattr(c, f"{k}_alpha_factor")), float(getattr(c, f"{k}_beta_factor")))
                       for k in ("full_attn", "linear_attn", "mlp"))
        return minimax_layer(linear=self.linear_layers, scales=scales, num_layers=c.num_hidden_layers,
                             heads=c.num_attention_heads, head_dim=C.head_dim_of(c), block_size=c.block_size)

    # ---- tensors --------------------------------------------------------------------------------------------
    def attention_mappings(self) -> list[Mapping]:
        return [_moved_norm(m) for m in super().attention_mappings()]

    def moe_mappings(self) -> list[Mapping]:
        return [_moved_norm(m) for m in super().moe_mappings()]

    def linear_attention_mappings(self) -> list[Mapping]:
        width = self.hf_config.num_attention_heads * C.head_dim_of(self.hf_config)
        return [
            _moved_norm(self.attention_mappings()[0]),
            HeadSections(f"{S}.in_proj.weight", ((f"{A}.qkv_proj.weight", (3 * width,)),
                                                 (f"{A}.output_gate.weight", (width,)))),
            ColumnParallel(f"{S}.norm_weight", f"{A}.norm.weight"),
            RowParallel(f"{S}.out_proj.weight", f"{A}.out_proj.weight"),
            ColumnParallel(f"{S}.slope_rate", f"{A}.slope_rate"),
            ColumnParallel(f"{S}.query_decay", f"{A}.query_decay"),
            ColumnParallel(f"{S}.key_decay", f"{A}.key_decay"),
            HeadColumns(f"{S}.diagonal_decay", f"{A}.diagonal_decay"),
        ]

    def layer_mappings(self) -> list[Mapping]:
        return self.attention_mappings() + self.linear_attention_mappings()[1:] + self.moe_mappings()

    def mappings_for_layer(self, layer: int) -> list[Mapping]:
        mixer = self.linear_attention_mappings() if layer in self.linear_layers else self.attention_mappings()
        return mixer + self.moe_mappings()

    def linear_attention_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        c, p = self.hf_config, f"{prefix}.self_attn"
        h, heads, block = c.hidden_size, c.num_attention_heads, c.block_size
        width = heads * C.head_dim_of(c)
        return {f"{prefix}.input_layernorm.weight": (h,), f"{p}.qkv_proj.weight": (3 * width, h),
                f"{p}.output_gate.weight": (width, h), f"{p}.norm.weight": (width,), f"{p}.out_proj.weight": (h, width),
                f"{p}.slope_rate": (heads, 1, 1), f"{p}.query_decay": (heads, block, 1),
                f"{p}.key_decay": (heads, block, 1), f"{p}.diagonal_decay": (1, heads, block, block)}

    def layer_shapes(self, layer: int) -> dict[str, tuple[int, ...]]:
        prefix = f"model.layers.{layer}"
        mixer = self.linear_attention_shapes(prefix) if layer in self.linear_layers else self.attention_shapes(prefix)
        return {**mixer, **self.moe_shapes(prefix)}


def _moved_norm(mapping: Mapping) -> Mapping:
    """``mapping`` with megatron's norm slot names replaced by ``MiniMaxLayer``'s (``attention_norm``, ``mlp_norm``)."""
    for old, new in _NORMS.items():
        if mapping.megatron.endswith(f".{old}.weight"):
            return replace(mapping, megatron=mapping.megatron.replace(f".{old}.", f".{new}."))
    return mapping


def scaled_residual(alpha: float, beta: float):
    """A bias-dropout-add slot's factory: ``residual * alpha + dropout(x + bias) * beta`` (transformers' order)."""
    def factory(training: bool, fused: bool):
        def add(x_with_bias, residual, prob: float):
            x, bias = x_with_bias
            if bias is not None:
                x = x + bias
            return residual * alpha + F.dropout(x, p=prob, training=training) * beta

        return add

    return factory


@functools.cache
def minimax_layer(*, linear: frozenset[int], scales: tuple, num_layers: int, heads: int, head_dim: int,
                  block_size: int) -> type:
    """megatron's ``TransformerLayer`` as MiniMax's decoder layer (module docstring): ``LightningAttention`` on the
    layers in ``linear`` (0-based global indices), megatron's ``SelfAttention`` elsewhere; ``scales``: the (alpha,
    beta) pairs of the full-attention, lightning-attention and MLP residuals."""
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from loongforge_hf.bridges.lightning_attention import LightningAttention

    class MiniMaxLayer(TransformerLayer):
        def __init__(self, config, submodules, layer_number: int = 1, **kwargs) -> None:
            mixer = mixer_on_layers(linear, LightningAttention, submodules.self_attention.module,
                                    num_layers=num_layers, heads=heads, head_dim=head_dim, block_size=block_size)
            submodules = replace(submodules, self_attention=replace(submodules.self_attention, module=mixer))
            super().__init__(config, submodules, layer_number, **kwargs)
            self.attention_norm, self.input_layernorm = self.input_layernorm, IdentityOp()
            self.mlp_norm, self.pre_mlp_layernorm = self.pre_mlp_layernorm, IdentityOp()
            # NOTE: self.layer_number is global (offset by the pipeline stage), the argument this stage's
            self.self_attn_bda = scaled_residual(*scales[1 if self.layer_number - 1 in linear else 0])
            self.mlp_bda = scaled_residual(*scales[2])

        def _forward_attention(self, hidden_states, *args, **kwargs):
            # NOTE: the residual is the normed input; the MLP's residual the normed attention output
            hidden, context = super()._forward_attention(self.attention_norm(hidden_states), *args, **kwargs)
            return self.mlp_norm(hidden), context

    return MiniMaxLayer
