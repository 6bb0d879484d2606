"""Tiny configs of the Mamba family (the pure stacks Mamba2, Mamba, Falcon-Mamba; Jamba) for ``tiny_models._config``:
each layout shrunk, every layer kind present, limits that bind."""

from __future__ import annotations

from loongforge_hf.testing.tiny_zamba import ZAMBA_ARCHS, zamba_config

# NOTE: Zamba and Zamba2 in tiny_zamba.py
MAMBA_ARCHS = ("mamba2", "mamba", "falcon_mamba", "jamba", *ZAMBA_ARCHS)


def mamba_config(arch: str, common: dict):
    """transformers' config of the tiny ``arch`` (one of ``MAMBA_ARCHS``) from ``tiny_models``' ``common`` fields."""
    import transformers as tf

    if arch in ZAMBA_ARCHS:
        return zamba_config(arch, common)
    base = dict(vocab_size=common["vocab_size"], hidden_size=common["hidden_size"], num_hidden_layers=3,
                bos_token_id=common["bos_token_id"], eos_token_id=common["eos_token_id"],
                pad_token_id=common["pad_token_id"], tie_word_embeddings=False)
    if arch == "mamba2":
        # NOTE: Mamba-2's block shrunk: 8 heads of 16 (expand 2) in 2 groups, chunks of 16 tokens, a time-step limit
        # that binds, a conv bias
        cfg = tf.Mamba2Config(**base, num_heads=8, head_dim=16, n_groups=2, state_size=8, conv_kernel=4, expand=2,
                              chunk_size=16, time_step_limit=(0.0, 1.5), layer_norm_epsilon=1e-6)
    elif arch in ("mamba", "falcon_mamba"):
        # NOTE: Mamba-1's block shrunk: d_inner 128 (expand 2), a 16-wide state, a time-step rank of 4 (hidden / 16),
        # a conv bias, tied embeddings (the hub's); Falcon-Mamba's weightless norms over dt / B / C
        cls = tf.MambaConfig if arch == "mamba" else tf.FalconMambaConfig
        cfg = cls(**{**base, "tie_word_embeddings": True}, state_size=16, conv_kernel=4, expand=2,
                  layer_norm_epsilon=1e-6)
    elif arch == "jamba":
        # NOTE: Jamba's layout shrunk: Mamba layers 0, 1, 3 (d_inner 128, a 16-wide state, a time-step rank of 4)
        # and attention at layer 2 (GQA, no rope); experts (4, top 2) on layers 1 and 3, gated MLPs on 0 and 2
        cfg = tf.JambaConfig(**{k: v for k, v in common.items() if k != "max_position_embeddings"},
                             num_experts=4, num_experts_per_tok=2, expert_layer_period=2, expert_layer_offset=1,
                             attn_layer_period=4, attn_layer_offset=2, mamba_d_state=16, mamba_d_conv=4,
                             mamba_expand=2, mamba_dt_rank=4)
    else:
        raise ValueError(f"{arch!r} is not one of {MAMBA_ARCHS}")
    return cfg
