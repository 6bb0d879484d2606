"""Tiny config of JetMoE (mixture of attention heads and a mixture of experts in every layer) for
``tiny_models._config``."""

from __future__ import annotations

JETMOE_ARCHS = ("jetmoe",)


def jetmoe_config(arch: str, common: dict):
    """transformers' config of the tiny ``arch`` (one of ``JETMOE_ARCHS``) from ``tiny_models``' ``common`` fields."""
    import transformers as tf

    # NOTE: jetmoe-8b's layout shrunk: 4 attention experts (top 2) of 2 KV heads of 16 around one shared key / value
    # projection, 4 MLP experts (top 2); its final-norm epsilon (1e-5: the layers' norms keep transformers' 1e-6);
    # initializer_range 0.1 so that the routers' logits spread (transformers' 0.01 makes the gates nearly uniform)
    kw = {k: v for k, v in common.items() if k not in ("num_attention_heads", "rms_norm_eps", "intermediate_size")}
    return tf.JetMoeConfig(**kw, kv_channels=16, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                           rms_norm_eps=1e-5, initializer_range=0.1)
