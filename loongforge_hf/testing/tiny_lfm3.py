"""Tiny config of LFM3 (Lfm3ForCausalLM) for ``tiny_models._config``: every layer kind present, limits that bind."""

from __future__ import annotations

LFM3_ARCHS = ("lfm3",)


def lfm3_config(arch: str, common: dict):
    """transformers' config of the tiny ``arch`` (one of ``LFM3_ARCHS``) from ``tiny_models``' ``common`` fields."""
    import transformers as tf

    # NOTE: LFM3's layout shrunk: short-conv layers 0, 2, 5 (3 taps, biased), sliding-window layers 1 and 4 (a
    # window of 5 tokens: it binds on the tests' rows) and a full-attention layer 3 whose proportional rope rotates
    # half of each 16-channel head; the per-head output gate and the sandwich norms on; tied embeddings (LFM3's)
    kw = {k: v for k, v in common.items() if k not in ("rms_norm_eps", "num_hidden_layers", "tie_word_embeddings")}
    return tf.Lfm3Config(**kw, num_hidden_layers=6, norm_eps=1e-6, head_dim=16, conv_L_cache=3, conv_bias=True,
                         sliding_window=5, tie_word_embeddings=True,
                         layer_types=["conv", "sliding_attention", "conv", "full_attention", "sliding_attention",
                                      "conv"],
                         rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                          "full_attention": {"rope_type": "proportional", "rope_theta": 100000.0,
                                                             "partial_rotary_factor": 0.5}})
