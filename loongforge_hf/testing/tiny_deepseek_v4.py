"""Tiny DeepSeek-V4 and Beam configs for ``tiny_models._config``. DeepSeek-V4: every attention kind (sliding,
compressed sparse, heavily compressed) and both MLP kinds (hash-routed, top-k routed), compress rates and an indexer
top-k that bind at 16-32 tokens, a SwiGLU limit that clips; the weights transformers initialises to constants made
random (``randomize``). Beam: sliding and rope-less full layers, grouped routing, a logit cap that binds."""

from __future__ import annotations

import torch

V4_ARCHS = ("deepseek_v4", "beam")


def v4_config(arch: str, common: dict):
    """transformers' config of the tiny ``arch`` (one of ``V4_ARCHS``) from ``tiny_models``' ``common`` fields."""
    import transformers as tf

    if arch == "beam":
        # NOTE: Beam's layout shrunk: sliding (rope), full (no rope, query scale), sliding, full; a dense first layer,
        # 8 experts (top 2) in 2 groups of which 1 is kept; a binding window and logit cap
        return tf.BeamConfig(**{**common, "head_dim": 16}, moe_intermediate_size=32, num_experts=8,
                             num_experts_per_tok=2, n_group=2, topk_group=1, routed_scaling_factor=2.5,
                             sliding_window=6, final_logit_softcapping=3.0,
                             layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
                             mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
                             rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                              "full_attention": None}, architectures=["BeamForCausalLM"])
    kw = {k: v for k, v in common.items() if k not in ("intermediate_size", "num_key_value_heads")}
    # NOTE: layers: sliding (hash), CSA (top-k), HCA (hash), CSA (top-k); 3 streams; CSA pools 4 tokens (8-wide
    # overlapping windows), HCA 8; the indexer keeps 3 of up to 8 entries at 32 tokens; a 6-token window
    return tf.DeepseekV4Config(
        **kw, num_key_value_heads=1, head_dim=32, q_lora_rank=32, partial_rotary_factor=0.25,
        moe_intermediate_size=32, num_experts_per_tok=2, n_routed_experts=4, n_shared_experts=1,
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                     "compressed_sparse_attention"],
        mlp_layer_types=["hash_moe", "moe", "hash_moe", "moe"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        hc_mult=3, hc_sinkhorn_iters=5, sliding_window=6, o_groups=2, o_lora_rank=16, index_n_heads=2,
        index_head_dim=16, index_topk=3, swiglu_limit=0.15, architectures=["DeepseekV4ForCausalLM"])


@torch.no_grad()
def randomize(model) -> None:
    """Random values where transformers' init is constant: hyper-connection biases and scales, the compressors'
    position biases, Beam's gate biases, the routers' token-to-expert tables (distinct experts per token)."""
    cfg = model.config
    for name, p in model.named_parameters():
        if name.endswith(("_hc.base", "_hc.scale", "hc_head.hc_base", "hc_head.hc_scale")):
            p.copy_((1.0 if name.endswith("scale") else 0.0) + 0.5 * torch.randn_like(p))
        elif name.endswith(("position_bias", "self_attn.gate_bias")):
            p.copy_(0.5 * torch.randn_like(p))
    for name, b in model.named_buffers():
        if name.endswith("tid2eid"):
            rows = [torch.randperm(cfg.n_routed_experts)[:cfg.num_experts_per_tok] for _ in range(b.shape[0])]
            b.copy_(torch.stack(rows))
