"""Tiny config of Meituan's LongCat-Flash for ``tiny_models._config`` (through ``tiny_mla_moe``): two sublayers per
layer, a shortcut MoE with zero (identity) experts among the routed ones, MLA with scaled latents."""

from __future__ import annotations

LONGCAT_ARCHS = ("longcat_flash",)


def longcat_config(arch: str, common: dict):
    """transformers' config of the tiny ``arch`` (one of ``LONGCAT_ARCHS``) from ``tiny_models``' ``common`` fields."""
    import transformers as tf

    # NOTE: 2 layers (4 sublayers); latents of rank 32 / 16 under hidden 64 (scales sqrt(2) and 2); top 3 of 4 routed
    # plus 2 zero experts, scaled by 2.5 (a token's choice often holds a zero expert)
    kw = {k: v for k, v in common.items() if k not in ("num_hidden_layers", "intermediate_size", "num_key_value_heads")}
    return tf.LongcatFlashConfig(**kw, num_layers=2, ffn_hidden_size=96, q_lora_rank=32, kv_lora_rank=16,
                                 qk_nope_head_dim=16, qk_rope_head_dim=8, head_dim=8, v_head_dim=16, moe_topk=3,
                                 n_routed_experts=4, zero_expert_num=2, expert_ffn_hidden_size=32,
                                 routed_scaling_factor=2.5, architectures=["LongcatFlashForCausalLM"])
