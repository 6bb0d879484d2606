"""Tiny configs of the recurrent hybrids with Mamba2 or short-convolution mixers (LFM2 / LFM2-MoE, Granite 4.0 H,
Bamba, Falcon-H1, Nemotron-H) for ``tiny_models._config``: each layout shrunk, every mixer kind present, limits that
bind."""

from __future__ import annotations

HYBRID_ARCHS = ("lfm2", "lfm2_moe", "granitemoehybrid", "bamba", "falcon_h1", "nemotron_h")


def hybrid_config(arch: str, common: dict):
    """transformers' config of the tiny ``arch`` (one of ``HYBRID_ARCHS``) from ``tiny_models``' ``common`` fields."""
    import transformers as tf

    if arch in ("lfm2", "lfm2_moe"):
        # NOTE: LFM2's layout shrunk: short-conv layers 0, 1, 3 (3 taps) and an attention layer 2 with q / k norms.
        # LFM2: conv biases, an MLP width by block_auto_adjust_ff_dim (2/3 of 120 up to a multiple of 32: 96);
        # LFM2-MoE: a dense first layer, 4 experts (top 2) by sigmoid scores plus a random expert bias, scaled
        kw = dict(**{k: v for k, v in common.items() if k != "rms_norm_eps"}, norm_eps=1e-6, conv_L_cache=3,
                  layer_types=["conv", "conv", "full_attention", "conv"])
        if arch == "lfm2":
            cfg = tf.Lfm2Config(**{**kw, "intermediate_size": 120}, conv_bias=True, block_multiple_of=32)
        else:
            cfg = tf.Lfm2MoeConfig(**kw, num_dense_layers=1, num_experts=4, num_experts_per_tok=2,
                                   moe_intermediate_size=32, routed_scaling_factor=1.5)
    elif arch == "granitemoehybrid":
        # NOTE: Granite 4.0 H's layout shrunk: Mamba2 layers 0, 1, 3 (8 heads of 16 in 2 groups, chunks of 16 tokens,
        # a time-step limit that binds) and an attention layer 2 without rope, 4 experts (top 2) and a shared MLP in
        # every layer, Granite's four multipliers
        cfg = tf.GraniteMoeHybridConfig(**{**common, "intermediate_size": 32}, num_local_experts=4,
                                        num_experts_per_tok=2, shared_intermediate_size=48,
                                        layer_types=["mamba", "mamba", "attention", "mamba"],
                                        position_embedding_type=None, mamba_n_heads=8, mamba_n_groups=2,
                                        mamba_d_state=8, mamba_d_head=16, mamba_d_conv=4, mamba_expand=2,
                                        mamba_chunk_size=16, time_step_limit=(0.0, 1.5), embedding_multiplier=12.0,
                                        residual_multiplier=0.22, attention_multiplier=0.1, logits_scaling=6.0)
    elif arch == "bamba":
        # NOTE: Bamba's layout shrunk: Mamba2 layers 0, 1, 3 as Granite 4.0 H's tiny ones, attention at layer 2 (its
        # hard-coded half-rotary rope), a gated MLP in every layer
        cfg = tf.BambaConfig(**common, attn_layer_indices=[2], mamba_n_heads=8, mamba_n_groups=2, mamba_d_state=8,
                             mamba_d_head=16, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16,
                             time_step_limit=(0.0, 1.5))
    elif arch == "falcon_h1":
        # NOTE: Falcon-H1's layout shrunk: a Mamba2 mixer (8 heads of 12 in 2 groups: mamba_d_ssm 96, not
        # mamba_expand * hidden_size; chunks of 16, a time-step limit that binds; the gated norm before the gate)
        # beside a GQA attention (head_dim 24, not hidden / heads) in every layer, distinct muP multipliers
        cfg = tf.FalconH1Config(**common, head_dim=24, mamba_d_ssm=96, mamba_n_heads=8, mamba_n_groups=2,
                                mamba_d_state=8, mamba_d_conv=4, mamba_chunk_size=16, time_step_limit=(0.0, 1.5),
                                mamba_rms_norm=True, mamba_norm_before_gate=True, embedding_multiplier=5.66,
                                lm_head_multiplier=0.39, key_multiplier=2.5, attention_in_multiplier=0.8,
                                attention_out_multiplier=0.94, ssm_in_multiplier=1.25, ssm_out_multiplier=0.24,
                                mlp_multipliers=[0.88, 0.59], ssm_multipliers=[0.35, 0.25, 0.71, 0.5, 1.4])
    elif arch == "nemotron_h":
        # NOTE: Nemotron-H's layout shrunk (Nemotron 3 Nano's kinds): Mamba2 (8 heads of 16 in 2 groups, chunks of
        # 16), MoE (4 relu2 experts, top 2 by sigmoid scores plus a correction bias, a shared relu2 expert), attention
        # (no rope), a relu2 MLP; Mamba2 again so that each of two pipeline stages holds one
        kw = {k: v for k, v in common.items() if k not in ("num_hidden_layers", "rms_norm_eps")}
        cfg = tf.NemotronHConfig(**kw, head_dim=16, layer_norm_epsilon=1e-6,
                                 layers_block_type=["linear_attention", "moe", "full_attention", "mlp",
                                                    "linear_attention", "moe"],
                                 mamba_num_heads=8, mamba_head_dim=16, n_groups=2, ssm_state_size=8, conv_kernel=4,
                                 chunk_size=16, time_step_min=0.01, n_routed_experts=4, num_experts_per_tok=2,
                                 moe_intermediate_size=32, moe_shared_expert_intermediate_size=48,
                                 routed_scaling_factor=2.5)
    else:
        raise ValueError(f"{arch!r} is not one of {HYBRID_ARCHS}")
    return cfg
