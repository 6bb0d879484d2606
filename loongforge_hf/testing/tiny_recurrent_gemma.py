"""Tiny config of RecurrentGemma (Griffin's recurrent blocks and local attention) for ``tiny_models._config``: the
hub's layout shrunk, every layer kind present, limits that bind."""

from __future__ import annotations

from loongforge_hf.testing.tiny_gemma3n import GEMMA3N_ARCHS, gemma3n_config

RECURRENT_GEMMA_ARCHS = ("recurrent_gemma", *GEMMA3N_ARCHS)  # NOTE: Gemma 3n's text decoder in tiny_gemma3n.py


def recurrent_gemma_config(arch: str, common: dict):
    """transformers' config of the tiny ``arch`` (one of ``RECURRENT_GEMMA_ARCHS``) from ``tiny_models``' ``common``
    fields."""
    import transformers as tf

    if arch in GEMMA3N_ARCHS:
        return gemma3n_config(arch, common)
    # NOTE: recurrentgemma-2b's layout shrunk: recurrent layers 0, 1, 3 and local MQA attention at layer 2 (a window of
    # 8 and half-rotary heads of 12), an RG-LRU wider than the model (64 channels in 4 heads of 16) with a 4-tap conv,
    # hidden 48 (sqrt(48) is not a bf16 number: transformers' bf16 normalizer shows), logits capped at 2 (binds),
    # tied embeddings (the hub's)
    kw = {k: v for k, v in common.items() if k not in ("max_position_embeddings", "num_key_value_heads")}
    return tf.RecurrentGemmaConfig(**{**kw, "hidden_size": 48, "tie_word_embeddings": True}, num_key_value_heads=1,
                                   lru_width=64, attention_window_size=8, conv1d_width=4, logits_soft_cap=2.0,
                                   block_types=["recurrent", "recurrent", "attention"])
