"""Tiny configs of the MLA mixture-of-experts decoders bridged on DeepSeek's (A.X-K1, A.X-K2) for
``tiny_models._config``: each layout shrunk, every layer kind present, limits that bind."""

from __future__ import annotations

from loongforge_hf.testing.tiny_longcat import LONGCAT_ARCHS, longcat_config

MLA_MOE_ARCHS = ("axk1", "axk2", *LONGCAT_ARCHS)


def mla_moe_config(arch: str, common: dict, mla: dict):
    """transformers' config of the tiny ``arch`` (one of ``MLA_MOE_ARCHS``) from ``tiny_models``' ``common`` fields
    and its MLA shapes ``mla``."""
    import transformers as tf

    if arch == "axk1":
        # NOTE: A.X-K1: GLM-4.7-Flash's layout (dense / sparse by mlp_layer_types, grouped sigmoid routing) with the
        # MoE layers' post_mlp_layernorm; rotary halves on disk (rope_interleave=False) and rms_norm_eps 1e-5, so the
        # reordering and the latent norms' own 1e-6 both bind
        mla = {k: v for k, v in mla.items() if k != "first_k_dense_replace"}
        return tf.AXK1Config(**{**common, **mla, "rms_norm_eps": 1e-5}, q_lora_rank=32, n_routed_experts=8,
                             n_shared_experts=1, num_experts_per_tok=4, n_group=4, topk_group=2,
                             routed_scaling_factor=2.5, norm_topk_prob=True, rope_interleave=False,
                             mlp_layer_types=["dense", "sparse", "dense", "sparse"])
    if arch == "axk2":
        # NOTE: A.X-K2-Light's layout: DSA keeping the top 4 keys (tests run 12 tokens), gated norms of rank 8, the
        # gated query projection, no expert groups; rms_norm_eps 1e-5 (the latent norms keep 1e-6)
        mla = {k: v for k, v in mla.items() if k != "first_k_dense_replace"}
        return tf.AXK2Config(**{**common, **mla, "rms_norm_eps": 1e-5}, q_lora_rank=32, n_routed_experts=8,
                             n_shared_experts=1, num_experts_per_tok=4, routed_scaling_factor=2.5, norm_topk_prob=True,
                             index_topk=4, index_head_dim=16, index_n_heads=4, gated_norm_rank=8,
                             mlp_layer_types=["dense", "sparse", "dense", "sparse"])
    if arch in LONGCAT_ARCHS:  # NOTE: LongCat-Flash: tiny_longcat.py
        return longcat_config(arch, common)
    raise ValueError(f"unknown MLA MoE arch {arch!r}; known: {MLA_MOE_ARCHS}")
