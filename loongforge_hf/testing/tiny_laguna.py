"""Tiny config of Poolside's Laguna for ``tiny_models._config``: per-layer head counts, a softplus output gate per
head, full-attention layers rotating half of each head beside windowed layers rotating all of it (a rope theta per
layer type), a dense first layer, then sigmoid-routed experts with a bias beside a shared expert."""

from __future__ import annotations

LAGUNA_ARCHS = ("laguna",)


def laguna_config(arch: str, common: dict):
    """transformers' config of the tiny ``arch`` (one of ``LAGUNA_ARCHS``) from ``tiny_models``' ``common`` fields."""
    import transformers as tf

    # NOTE: 4, 8, 2 and 6 query heads of 24 (not hidden_size / heads) over 2 KV heads (every count splits over TP 2);
    # a 5-token window on layers 1 and 2 (binding at the tests' lengths); top 2 of 8 experts, scaled by 2.5, beside a
    # shared expert
    return tf.LagunaConfig(**common, head_dim=24, num_attention_heads_per_layer=[4, 8, 2, 6],
                           layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"],
                           sliding_window=5, mlp_layer_types=["dense", "sparse", "sparse", "sparse"], num_experts=8,
                           num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                           moe_routed_scaling_factor=2.5)
