"""Tiny config of LaraMini (Gated DeltaNet, windowed rotary and NoPE full attention, experts) for
``tiny_models._config`` (through ``tiny_classic.classic_config``): the hub layout shrunk, with every layer kind
present."""

from __future__ import annotations

LARA_ARCHS = ("lara_mini",)


def lara_config(arch: str, common: dict):
    """transformers' config of the tiny ``arch`` (one of ``LARA_ARCHS``) from ``tiny_models``' ``common`` fields."""
    import transformers as tf

    if arch != "lara_mini":
        raise ValueError(f"unknown LaraMini tiny arch {arch!r}; known: {LARA_ARCHS}")
    # NOTE: Lara-4-Mini's layout shrunk: Gated DeltaNet layers 0 and 2 (2 key heads serving 4 value heads of another
    # size), a binding 5-token window on the rotary layer 1, the full layer 3 without rotary embedding, the top 2
    # of 4 experts (softmax, renormalised) beside an ungated shared expert, the head tied
    kw = {k: v for k, v in common.items() if k not in ("intermediate_size", "tie_word_embeddings")}
    cfg = tf.LaraMiniConfig(**kw, head_dim=16, tie_word_embeddings=True, linear_num_key_heads=2,
                            linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
                            linear_conv_kernel_dim=4, sliding_window=5, num_experts=4, num_experts_per_tok=2,
                            moe_intermediate_size=32, shared_expert_intermediate_size=48,
                            layer_types=["linear_attention", "sliding_attention", "linear_attention",
                                         "full_attention"])
    cfg.architectures = ["LaraMiniForCausalLM"]
    return cfg
