"""Tiny configs of Zyphra's Mamba hybrids with shared transformer blocks (Zamba, Zamba2) for ``tiny_models._config``
(through ``tiny_mamba.py``): the hub's layout shrunk, every option that sets it apart on."""

from __future__ import annotations

ZAMBA_ARCHS = ("zamba", "zamba2")


def zamba_config(arch: str, common: dict):
    """transformers' config of the tiny ``arch`` (one of ``ZAMBA_ARCHS``) from ``tiny_models``' ``common`` fields."""
    import transformers as tf

    ids = dict(bos_token_id=common["bos_token_id"], eos_token_id=common["eos_token_id"],
               pad_token_id=common["pad_token_id"])
    if arch == "zamba":
        # NOTE: Zamba-7B's layout shrunk: multi-head Mamba-1 layers (2 heads of 64 channels, a 16-wide state, a
        # time-step rank of 4), two of them hybrid with the one shared block (4 heads of 2 * 64 / 4 channels), tied
        return tf.ZambaConfig(vocab_size=common["vocab_size"], hidden_size=64, num_hidden_layers=5,
                              layers_block_type=["mamba", "hybrid", "mamba", "mamba", "hybrid"], intermediate_size=48,
                              num_attention_heads=4, num_key_value_heads=4, n_mamba_heads=2, mamba_d_state=16,
                              mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4, max_position_embeddings=128,
                              rms_norm_eps=1e-6, tie_word_embeddings=True, **ids)
    if arch != "zamba2":
        raise ValueError(f"{arch!r} is not one of {ZAMBA_ARCHS}")
    # NOTE: Zamba2's layout shrunk: Mamba2 layers (8 heads of 16 in 2 groups, chunks of 16 tokens, a time-step floor
    # that binds), three of them hybrid, the shared blocks (two, re-used in turn: 0, 1, 0) with their per-use q / k / v
    # and MLP adapters, rope in the shared attention (4 heads of 2 * 64 / 4 channels), tied embeddings (the hub's)
    return tf.Zamba2Config(vocab_size=common["vocab_size"], hidden_size=64, num_hidden_layers=5,
                           layers_block_type=["mamba", "hybrid", "mamba", "hybrid", "hybrid"], mamba_d_state=8,
                           mamba_d_conv=4, mamba_expand=2, mamba_ngroups=2, n_mamba_heads=8, chunk_size=16,
                           time_step_min=1.2, time_step_max=1.5, intermediate_size=48, num_attention_heads=4,
                           num_key_value_heads=4, num_mem_blocks=2, use_shared_attention_adapter=True,
                           adapter_rank=8, use_mem_rope=True, max_position_embeddings=128,
                           rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, rms_norm_eps=1e-6,
                           tie_word_embeddings=True, **ids)
