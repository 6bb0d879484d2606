"""Tiny Hunyuan V4 (HY-V4) config for ``tiny_models._config``: multi-latent attention with DeepSeek Sparse
Attention's indexer (a top-k that binds at 12 tokens, a layer reusing an earlier top-k), sinks and an output gate,
3 hyper-connection streams, a dense first layer then experts with a SwiGLU limit that clips; the weights transformers
initialises to constants made random (``randomize``)."""

from __future__ import annotations

import torch

HY_V4_ARCHS = ("hy_v4",)


def hy_v4_config(arch: str, common: dict):
    """transformers' config of the tiny ``arch`` (one of ``HY_V4_ARCHS``) from ``tiny_models``' ``common`` fields."""
    import transformers as tf

    kw = {k: v for k, v in common.items() if k != "num_key_value_heads"}
    # NOTE: layers: full indexer, shared, full, shared; dense then sparse MLPs; 8 experts (top 2) in one group
    return tf.HYV4Config(
        **{**kw, "rms_norm_eps": 1e-5}, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
        routed_scaling_factor=2.5, index_topk=4, index_head_dim=16, index_n_heads=4,
        indexer_types=["full", "shared", "full", "shared"], mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
        hc_mult=3, hc_magnitude=1.5, swiglu_limit=0.15, architectures=["HYV4ForCausalLM"])


@torch.no_grad()
def randomize(model) -> None:
    """Random values where transformers' init is constant: hyper-connection biases and scales, the sinks."""
    for name, p in model.named_parameters():
        if name.endswith(("_hc.base", "_hc.scale", "hc_head.hc_base", "hc_head.hc_scale")):
            p.copy_((1.0 if name.endswith("scale") else 0.0) + 0.5 * torch.randn_like(p))
        elif name.endswith("self_attn.sinks"):
            p.copy_(torch.randn_like(p))
