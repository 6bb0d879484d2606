"""Tiny config of MiniMax (Text-01 / M1) for ``tiny_models._config``: lightning-attention and softmax-attention layers
interleaved, every mixer kind present, blocks shorter than the tests' sequences, residual scalings other than 1."""

from __future__ import annotations

MINIMAX_ARCHS = ("minimax",)


def minimax_config(arch: str, common: dict):
    """transformers' config of the tiny ``arch`` (one of ``MINIMAX_ARCHS``) from ``tiny_models``' ``common`` fields."""
    import transformers as tf

    # NOTE: MiniMax-Text-01's layout shrunk: lightning layers 0, 2, 3 (blocks of 5 tokens, so the tests' sequences
    # cross blocks and end inside one) and a softmax-attention layer 1 (GQA, rope), 4 experts (top 2) in every layer;
    # alpha / beta factors away from 1 and from each other (the hub's models scale the residual by about 3.6)
    return tf.MiniMaxConfig(**{**common, "intermediate_size": 48}, head_dim=16, num_local_experts=4,
                            num_experts_per_tok=2, block_size=5,
                            layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
                            full_attn_alpha_factor=1.5, full_attn_beta_factor=0.9, linear_attn_alpha_factor=0.7,
                            linear_attn_beta_factor=1.1, mlp_alpha_factor=1.3, mlp_beta_factor=0.8)
