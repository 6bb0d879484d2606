"""Tiny configs of Granite SWA / Granite-MoE SWA (sinks, sliding windows, NoPE layers), HyperCLOVAX (Granite with
peri-layer norms), BitNet (sub-layer norms, relu2) and DiffLlama (differential attention) for
``tiny_models._config``: each layout shrunk, every layer kind present, limits that bind."""

from __future__ import annotations

from loongforge_hf.testing.tiny_doge import DOGE_ARCHS, doge_config

# NOTE: Doge's (dynamic-mask attention, CDMoE) in tiny_doge.py
DENSE_SMALL_ARCHS = ("granite_swa", "granitemoe_swa", "hyperclovax", "bitnet", "diffllama", *DOGE_ARCHS)

# NOTE: Granite's four multipliers, none of them 1 (granite-3.1-2b's kind); weights drawn 5x wider than transformers'
# default, or the small softmax scale leaves the attention near uniform and the NoPE layer moves the logits by 4e-6
_MULTIPLIERS = dict(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.1, logits_scaling=6.0,
                    initializer_range=0.1)
# NOTE: a binding 5-token window on layers 1 and 3, full layers 0 and 2 (one of each on each pipeline stage); layer 2
# without rotary embedding (layer_rope_theta 0), the others at one base
_SWA = dict(sliding_window=5, layer_types=["full_attention", "sliding_attention"] * 2,
            layer_rope_theta=[10000.0, 10000.0, 0, 10000.0])


def dense_small_config(arch: str, common: dict):
    """transformers' config of the tiny ``arch`` (one of ``DENSE_SMALL_ARCHS``) from ``tiny_models``' ``common``
    fields."""
    import transformers as tf

    if arch in DOGE_ARCHS:
        return doge_config(arch, common)
    if arch == "granite_swa":
        # NOTE: granite-swash's tied embeddings; sinks randomised in make_tiny_checkpoint
        cfg = tf.GraniteSWAConfig(**{**common, "tie_word_embeddings": True}, **_MULTIPLIERS, **_SWA)
    elif arch == "granitemoe_swa":
        # NOTE: 4 experts (top 2) in every layer beside a shared MLP of 48
        cfg = tf.GraniteMoeSWAConfig(**{**common, "intermediate_size": 48}, num_local_experts=4,
                                     num_experts_per_tok=2, shared_intermediate_size=48, **_MULTIPLIERS, **_SWA)
    elif arch == "hyperclovax":
        # NOTE: head_dim 24 (not hidden / heads), post norms, logits multiplied by logits_scaling
        cfg = tf.HyperCLOVAXConfig(**{**common, "head_dim": 24}, **{**_MULTIPLIERS, "logits_scaling": 0.5},
                                   use_post_norm=True)
    elif arch == "bitnet":
        # NOTE: relu2 (BitNet's), sub-norms before o_proj and down_proj
        cfg = tf.BitNetConfig(**common)
    elif arch == "diffllama":
        # NOTE: 8 query heads over 4 KV heads (two per half: TP2 splits each half), lambdas drawn wider than
        # transformers' default (0.1)
        cfg = tf.DiffLlamaConfig(**{**common, "num_attention_heads": 8, "num_key_value_heads": 4}, lambda_std_dev=0.5)
    else:
        raise ValueError(f"unknown tiny arch {arch!r}; known: {DENSE_SMALL_ARCHS}")
    return cfg
