"""Tiny random checkpoints in the hub's on-disk format, written by ``transformers`` itself (no download).

Sizes are chosen to exercise what the bridges must get right: GQA (heads != KV heads), head_dim != hidden/heads for
Qwen3, several safetensors shards, vocab not a multiple of 128 (so padding is tested), odd layer counts on request.
"""

from __future__ import annotations

from pathlib import Path

import torch

TINY_ARCHS = ("llama", "llama3", "qwen2", "qwen3", "mistral")


def _config(arch: str, **overrides):
    import transformers as tf

    common = dict(vocab_size=203, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if arch == "llama":
        cfg = tf.LlamaConfig(**common, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    elif arch == "llama3":
        cfg = tf.LlamaConfig(**common, rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0,
                                                        "factor": 8.0, "low_freq_factor": 1.0,
                                                        "high_freq_factor": 4.0,
                                                        "original_max_position_embeddings": 32})
    elif arch == "qwen2":
        cfg = tf.Qwen2Config(**common)
    elif arch == "qwen3":
        cfg = tf.Qwen3Config(**{**common, "head_dim": 24})
    elif arch == "mistral":
        cfg = tf.MistralConfig(**{**common, "sliding_window": 6})
    else:
        raise ValueError(f"unknown tiny arch {arch!r}; known: {TINY_ARCHS}")
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def make_tiny_tokenizer(folder: str | Path, vocab_size: int = 203):
    """A word-level tokenizer over ``tok0 .. tokN`` saved next to the model (transformers' on-disk format)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    for i in range(4, vocab_size):
        vocab[f"tok{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")
    fast.save_pretrained(folder)
    return fast


def make_tiny_checkpoint(folder: str | Path, arch: str = "qwen3", *, seed: int = 0, max_shard_size: str = "100KB",
                         tokenizer: bool = True, dtype: torch.dtype = torch.float32, **overrides) -> Path:
    """Write a tiny random ``arch`` checkpoint with ``transformers`` (several shards) and return its folder."""
    from transformers import AutoModelForCausalLM

    folder = Path(folder)
    cfg = _config(arch, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    with torch.no_grad():
        # NOTE: random norm weights (HF initialises them to 1), so a bridge that drops a norm cannot pass.
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    model.save_pretrained(folder, max_shard_size=max_shard_size)
    if tokenizer:
        make_tiny_tokenizer(folder, vocab_size=cfg.vocab_size)
    return folder
