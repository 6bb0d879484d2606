"""Tiny configs of Kolibri-1 and Aria's text model for ``tiny_models._config``: every layer a mixture of experts beside
shared experts, each model's own router, limits that bind."""

from __future__ import annotations

KOLIBRI_ARIA_ARCHS = ("kolibri1", "aria_text")


def kolibri_aria_config(arch: str, common: dict):
    """transformers' config of the tiny ``arch`` (one of ``KOLIBRI_ARIA_ARCHS``) from ``tiny_models``' ``common``."""
    import transformers as tf

    if arch == "kolibri1":
        # NOTE: Kolibri-1's layout shrunk: per-head q / k norms, norms after each sublayer too, a binding 5-token
        # window on layers 0, 1, 3 (the only ones rotated), the full layer 2 without rotary embedding; 8 experts
        # (top 3: the top of the logits plus a random bias, weighted by their sigmoid, renormalised) and a shared MLP
        kw = {k: v for k, v in common.items() if k != "intermediate_size"}  # NOTE: Kolibri1Config has none
        return tf.Kolibri1Config(**kw, head_dim=16, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=3,
                                 shared_expert_intermediate_size=48, norm_topk_prob=True, sliding_window=5,
                                 layer_types=["sliding_attention", "sliding_attention", "full_attention",
                                              "sliding_attention"],
                                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    # NOTE: Aria's text model shrunk: 8 experts (top 2: softmax over the chosen logits) of 32 beside 2 shared ones
    # (one MLP of 2 x 32), stored stacked and transposed ([E, H, 2F] / [E, F, H]) as transformers writes them
    return tf.AriaTextConfig(**{**common, "intermediate_size": 32}, moe_num_experts=8, moe_topk=2,
                             moe_num_shared_experts=2)
