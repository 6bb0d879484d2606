"""Which megatron layer spec a bridge's model is built from.

Choices:
- Dense decoders: our kernels' spec (``kernels/specs.py``): SDPA core attention (no materialised scores, GQA
  without repeated K/V, sliding windows, packed documents, context parallel) and our RMSNorm (HF numerics, sequence
  parallel), with megatron's parallel linears.
- MoE and MLA decoders: megatron's decoder block spec from the config (``moe_layer_freq`` says which layers are
  sparse, ``multi_latent_attention`` picks ``MLASelfAttention``), megatron's local linear, attention, MoE and MLA
  modules, sliced to the layers this pipeline stage (and virtual stage) builds. Two slots are swapped:
  - every norm (input, pre-MLP, q/k or MLA latent, final) is our ``kernels.rmsnorm.RMSNorm``: megatron's local
    torch norm refuses sequence parallelism, which megatron's MoE layer requires in training with TP > 1;
  - MLA's core attention is ``MLADotProductAttention``: megatron's local ``DotProductAttention`` sizes its output
    from ``kv_channels`` and does not take the query/key and value head sizes MLA passes (``k_channels``,
    ``v_channels``; only Transformer Engine's attention does).
  And one more with ``bridge.grouped_experts`` (the default, see ``moe.py``): the routed experts of every MoE layer are
  our ``kernels.grouped_mlp.GroupedMLP`` instead of megatron's ``SequentialMLP``.
"""

from __future__ import annotations

from dataclasses import replace

_LAYER_NORMS = ("input_layernorm", "pre_mlp_layernorm")
_ATTENTION_NORMS = ("q_layernorm", "k_layernorm", "kv_layernorm")


def _mla_core_attention():
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class MLADotProductAttention(DotProductAttention):
        """megatron's local attention with query/key head size ``k_channels`` and value head size ``v_channels``."""

        def __init__(self, *args, k_channels: int | None = None, v_channels: int | None = None, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            if v_channels is not None:
                # NOTE: stands in for dot_product_attention.py:78 (megatron-core 0.16.1), which sizes the output
                # [sq, b, heads * kv_channels]; MLA's context has heads * v_head_dim features.
                self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition

    return MLADotProductAttention


def _grouped_experts(mlp_spec):
    """An MoE layer's spec with ``GroupedMLP`` as its routed experts; any other MLP spec unchanged."""
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.spec_utils import ModuleSpec

    from loongforge_hf.kernels.grouped_mlp import GroupedMLP

    if getattr(mlp_spec, "module", None) is not MoELayer:
        return mlp_spec
    return replace(mlp_spec, submodules=replace(mlp_spec.submodules, experts=ModuleSpec(module=GroupedMLP)))


def _swap_modules(block_spec, *, grouped_experts: bool = False):
    """``block_spec`` with our RMSNorm in every norm slot and MLA's core attention replaced (see the docstring)."""
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    from loongforge_hf.kernels.rmsnorm import RMSNorm

    mla_core = _mla_core_attention()
    layers = []
    for spec in block_spec.layer_specs:
        attention = spec.submodules.self_attention
        att_sub = attention.submodules
        norms = {n: RMSNorm for n in _ATTENTION_NORMS
                 if hasattr(att_sub, n) and getattr(att_sub, n) not in (None, IdentityOp)}
        if attention.module is MLASelfAttention:
            norms["core_attention"] = mla_core
        attention = replace(attention, submodules=replace(att_sub, **norms))
        slots = {n: RMSNorm for n in _LAYER_NORMS if getattr(spec.submodules, n) is not IdentityOp}
        if grouped_experts:
            slots["mlp"] = _grouped_experts(spec.submodules.mlp)
        layers.append(replace(spec, submodules=replace(spec.submodules, self_attention=attention, **slots)))
    return replace(block_spec, layer_specs=layers, layer_norm=RMSNorm)


def layer_spec_for(bridge, config, *, vp_stage: int | None = None):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    if bridge.num_experts() is None and not getattr(config, "multi_latent_attention", False):
        from loongforge_hf.kernels.specs import get_block_spec, get_layer_spec

        return get_block_spec(config, get_layer_spec(qk_norm=bridge.qk_norm), vp_stage=vp_stage)
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm",
                                       vp_stage=vp_stage)
    return _swap_modules(block, grouped_experts=getattr(bridge, "grouped_experts", False))
