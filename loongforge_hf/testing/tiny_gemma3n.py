"""Tiny config of Gemma 3n's text decoder for ``tiny_models._config`` (through ``tiny_recurrent_gemma``): the hub's
layout shrunk, every layer kind present, limits that bind."""

from __future__ import annotations

GEMMA3N_ARCHS = ("gemma3n",)


def gemma3n_config(arch: str, common: dict):
    """transformers' ``Gemma3nTextConfig`` of the tiny ``arch`` (one of ``GEMMA3N_ARCHS``) from ``tiny_models``'
    ``common`` fields."""
    import transformers as tf

    # NOTE: gemma-3n-E2B's layout shrunk: 5 layers (sliding, sliding, full, sliding, full; a window of 6 that binds),
    # the last 2 reusing layers 1 / 2's keys and values, 3 AltUp streams (the active one the second), LAuReL rank 8,
    # per-layer inputs of 8 from a table smaller than the vocabulary (ids past it look up row 0), activation sparsity
    # on the first 2 layers, intermediate sizes per layer, logits capped at 1 (binds), tied embeddings (the hub's)
    kw = {k: v for k, v in common.items() if k not in ("intermediate_size", "num_hidden_layers")}
    cfg = tf.Gemma3nTextConfig(**{**kw, "tie_word_embeddings": True}, num_hidden_layers=5, head_dim=16,
                               intermediate_size=[96, 64, 96, 96, 64], sliding_window=6,
                               layer_types=["sliding_attention", "sliding_attention", "full_attention",
                                            "sliding_attention", "full_attention"],
                               num_kv_shared_layers=2, altup_num_inputs=3, altup_active_idx=1, laurel_rank=8,
                               hidden_size_per_layer_input=8, vocab_size_per_layer_input=180,
                               activation_sparsity_pattern=[0.95, 0.8, 0.0, 0.0, 0.0], final_logit_softcapping=1.0,
                               rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                "full_attention": {"rope_type": "default", "rope_theta": 1e6}})
    cfg.architectures = ["Gemma3nForCausalLM"]
    return cfg
