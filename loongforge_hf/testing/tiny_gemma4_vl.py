"""Tiny random Gemma 4 checkpoints as the hub publishes them (``Gemma4ForConditionalGeneration``, ``model_type``
``gemma4``), written by transformers (fp32): the tiny Gemma 4 text model of ``tiny_models`` (Gemma 4 31B's text
layout shrunk, images attending both ways in its sliding layers: ``use_bidirectional_attention='vision'``) under
``model.language_model``, a 2-layer vision tower (16-pixel patches, 3x3 pooling) and a 2-layer
audio tower (clipped linears) with their multimodal embedders (``model.embed_vision``, ``model.embed_audio``).

The text vocabulary is ``TEXT_VOCAB`` ids (``<pad>``, ``<s>``, ``</s>``, ``<unk>``, ``tok4`` ..); the multimodal
placeholders (begin / end of image and audio, image, audio and video tokens) follow it, as Gemma 4's sit at the top
of its vocabulary. Every tower tensor is random (transformers initialises norms to 1 and some tables to 0, which
would hide a tensor dropped or changed on the way through)."""

from __future__ import annotations

from pathlib import Path

import torch

TEXT_VOCAB = 203
# the placeholder ids, after the text vocabulary
SPECIAL = dict(boi_token_id=203, eoi_token_id=204, boa_token_id=205, eoa_token_index=206, image_token_id=207,
               audio_token_id=208, video_token_id=209)


def tiny_gemma4_vl_config(*, audio: bool = True, **text_overrides):
    """``Gemma4Config`` over the tiny Gemma 4 text config (``text_overrides`` applied), a tiny vision tower and, with
    ``audio``, a tiny audio tower."""
    from transformers import Gemma4AudioConfig, Gemma4Config, Gemma4VisionConfig

    from loongforge_hf.testing.tiny_models import _config

    # NOTE: image tokens attend both ways in the sliding layers, as the published 31B / 26B-A4B configs ask
    text = _config("gemma4", vocab_size=TEXT_VOCAB + len(SPECIAL),
                   **{"use_bidirectional_attention": "vision", **text_overrides})
    vision = Gemma4VisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                                num_key_value_heads=2, head_dim=16, patch_size=16, pooling_kernel_size=3,
                                position_embedding_size=64)
    audio_config = Gemma4AudioConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     subsampling_conv_channels=[8, 4], output_proj_dims=48) if audio else None
    config = Gemma4Config(text_config=text.to_dict(), vision_config=vision, audio_config=audio_config, **SPECIAL)
    config.architectures = ["Gemma4ForConditionalGeneration"]
    return config


def make_tiny_gemma4_vl(folder: str | Path, *, seed: int = 0, audio: bool = True,
                        max_shard_size: str = "60KB", **text_overrides) -> Path:
    """Write a tiny random ``Gemma4ForConditionalGeneration`` checkpoint (transformers' names) with a tokenizer and
    return its folder (``text_overrides``: see ``tiny_gemma4_vl_config``)."""
    from transformers import Gemma4ForConditionalGeneration

    from loongforge_hf.testing.tiny_models import make_tiny_tokenizer

    folder = Path(folder)
    torch.manual_seed(seed)
    model = Gemma4ForConditionalGeneration(tiny_gemma4_vl_config(audio=audio, **text_overrides)).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # NOTE: Gemma 4's norms store their weight itself: near 1
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.2 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(0.5 + torch.rand_like(b))
    model.save_pretrained(folder, max_shard_size=max_shard_size)
    make_tiny_tokenizer(folder, vocab_size=TEXT_VOCAB + len(SPECIAL))
    return folder
