"""Tiny random Aya Vision checkpoints written by transformers (fp32): a 4-layer Cohere 2 decoder (three sliding
layers with a window of 8, one full layer without rope; ``logit_scale`` 0.25, which Aya Vision does not apply) under a
3-block SigLIP ViT of 56x56 images in 7-pixel patches read at ``vision_feature_layer`` -2 (block 2 and
``post_layernorm`` unused) or -1 (the hub's: the last block's output before ``post_layernorm``), pixel-shuffled by 2
(16 ``<image>`` tokens an image), and batches of ``<image>`` runs."""

from __future__ import annotations

from pathlib import Path

import torch

from loongforge_hf.testing.tiny_llava import llava_image_prompt, make_llava_tokenizer
from loongforge_hf.testing.tiny_vl import TEXT_VOCAB, _randomise

AYA_IMAGE = TEXT_VOCAB  # id of ``<image>``
IMAGE_TOKENS = 16  # (56 / 7 / 2)^2


def tiny_aya_vision_config(**overrides):
    """The config; ``overrides``: top-level fields (``vision_feature_layer`` -2 unless given)."""
    from transformers import AyaVisionConfig

    text = dict(model_type="cohere2", vocab_size=TEXT_VOCAB + 4, hidden_size=64, intermediate_size=96,
                num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                layer_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0, logit_scale=0.25,
                sliding_window=8, layer_types=["sliding_attention"] * 3 + ["full_attention"])
    vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                  num_attention_heads=2, image_size=56, patch_size=7, layer_norm_eps=1e-6, vision_use_head=False)
    top = dict(image_token_index=AYA_IMAGE, downsample_factor=2, alignment_intermediate_size=96,
               vision_feature_layer=-2, adapter_layer_norm_eps=1e-5)
    return AyaVisionConfig(text_config=text, vision_config=vision, **{**top, **overrides})


def make_tiny_aya_vision(folder: str | Path, *, seed: int = 0, feature_layer: int = -2,
                         max_shard_size: str = "60KB") -> Path:
    """Write a tiny random Aya Vision checkpoint (transformers 5's names) with a tokenizer and return its folder."""
    from transformers import AyaVisionForConditionalGeneration

    folder = Path(folder)
    torch.manual_seed(seed)
    config = tiny_aya_vision_config(vision_feature_layer=feature_layer)
    model = AyaVisionForConditionalGeneration(config).to(torch.float32)
    _randomise(model, scaled=("position_embedding", "multi_modal_projector"))
    model.save_pretrained(folder, max_shard_size=max_shard_size)
    make_llava_tokenizer(folder)
    return folder


def aya_image_prompt(rows: list[list[int]], *, seed: int = 0) -> dict:
    """``input_ids [b, s]`` with 16 ``<image>`` tokens where a row holds -1 (other entries text ids, every row the
    same length) and ``pixel_values [n, 3, 56, 56]`` (random) when there are images."""
    batch = llava_image_prompt(rows, seed=seed)
    if "pixel_values" in batch:
        count = batch["pixel_values"].shape[0]
        batch["pixel_values"] = torch.randn(count, 3, 56, 56, generator=torch.Generator().manual_seed(seed))
    return batch
