"""Tiny configs of SmallDoge's Doge (dynamic-mask attention, learned residual scales; ``doge_moe``: cross-domain
experts by product keys) for ``tiny_models._config``, and ``randomize`` for what transformers initialises to constants
(``A`` zeros, the residual scales ones)."""

from __future__ import annotations

from pathlib import Path

DOGE_ARCHS = ("doge", "doge_moe")


def doge_config(arch: str, common: dict):
    """transformers' config of the tiny ``arch`` (one of ``DOGE_ARCHS``) from ``tiny_models``' ``common`` fields."""
    import transformers as tf

    # NOTE: Doge-320M's layout shrunk: 4 heads of 16 over 2 KV heads; keep_window_size 24 (the hub's 2048 against
    # 2048 positions), binding at the tests' 40 tokens; initializer_range 0.1 so that the dynamic biases and the
    # router's logits spread (no near ties); doge_moe: 16 retrieval experts (4 x 4 product keys), top 4
    kw = dict(keep_window_size=24, initializer_range=0.1, architectures=["DogeForCausalLM"])
    if arch == "doge":  # NOTE: the hub's dynamic rope (plain up to max_position_embeddings)
        return tf.DogeConfig(**common, **kw, rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0,
                                                              "factor": 4.0, "original_max_position_embeddings": 128})
    if arch == "doge_moe":
        return tf.DogeConfig(**common, **kw, is_moe=True, num_experts=16, num_experts_per_tok=4)
    raise ValueError(f"unknown Doge tiny arch {arch!r}; known: {DOGE_ARCHS}")


def randomize(folder: str | Path, *, seed: int = 0) -> None:
    """Rewrite the checkpoint in ``folder`` with ``self_attn.A`` drawn from N(0, 1) and the residual scales from
    1 + N(0, 0.3) (transformers' zeros and ones would leave the dynamic bias flat and the scales unchecked)."""
    import torch
    from safetensors.torch import load_file, save_file

    gen = torch.Generator().manual_seed(seed)
    for shard in sorted(Path(folder).glob("*.safetensors")):
        tensors = load_file(str(shard))
        for name, t in tensors.items():
            if name.endswith("self_attn.A"):
                tensors[name] = torch.randn(t.shape, generator=gen).to(t.dtype)
            elif name.endswith(("input_residual", "post_attention_residual")):
                tensors[name] = (1.0 + 0.3 * torch.randn(t.shape, generator=gen)).to(t.dtype)
        save_file(tensors, str(shard), metadata={"format": "pt"})
