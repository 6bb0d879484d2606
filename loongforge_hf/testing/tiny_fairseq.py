"""Tiny configs of the fairseq-born decoders on OPT's bridge (BioGPT, XGLM) for ``tiny_models._config``: each hub
layout shrunk, with what sets it apart from OPT's (a scaled token embedding; XGLM's sinusoidal positions)."""

from __future__ import annotations

FAIRSEQ_ARCHS = ("biogpt", "xglm")


def fairseq_config(arch: str, common: dict):
    """transformers' config of the tiny ``arch`` (one of ``FAIRSEQ_ARCHS``) from ``tiny_models``' ``common`` fields."""
    import transformers as tf

    ids = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if arch == "biogpt":
        # NOTE: BioGPT's layout shrunk: learned positions offset by 2, the token embedding times sqrt(64), GELU,
        # biases everywhere, the head tied
        cfg = tf.BioGptConfig(vocab_size=203, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                              intermediate_size=96, hidden_act="gelu", hidden_dropout_prob=0.0,
                              attention_probs_dropout_prob=0.0, activation_dropout=0.0, layerdrop=0.0,
                              max_position_embeddings=common["max_position_embeddings"], scale_embedding=True,
                              tie_word_embeddings=True, **ids)
    elif arch == "xglm":
        # NOTE: XGLM-564M's layout shrunk: sinusoidal positions offset by 2, the token embedding times sqrt(64), GELU,
        # biases everywhere, the head tied
        cfg = tf.XGLMConfig(vocab_size=203, max_position_embeddings=common["max_position_embeddings"], d_model=64,
                            ffn_dim=96, num_layers=4, attention_heads=4, activation_function="gelu", dropout=0.0,
                            attention_dropout=0.0, activation_dropout=0.0, layerdrop=0.0, scale_embedding=True,
                            tie_word_embeddings=True, **ids)
    else:
        raise ValueError(f"unknown fairseq tiny arch {arch!r}; known: {FAIRSEQ_ARCHS}")
    return cfg
