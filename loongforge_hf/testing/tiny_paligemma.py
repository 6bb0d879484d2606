"""Tiny random PaliGemma checkpoints written by transformers (fp32): a 4-layer Gemma (PaliGemma 1) or Gemma 2
(PaliGemma 2: sliding layers, soft-capping) decoder under a 2-block SigLIP ViT of 56x56 images in 7-pixel patches
(64 ``<image>`` tokens an image, no pooling), and batches laid out as PaliGemma's processor lays them out."""

from __future__ import annotations

from pathlib import Path

import torch

from loongforge_hf.testing.tiny_vl import TEXT_VOCAB, _randomise, make_vl_tokenizer

PALIGEMMA_IMAGE = TEXT_VOCAB  # id of ``<image>``
IMAGE_TOKENS = 64  # (56 / 7)^2 patches, one token each


def tiny_paligemma_config(*, gemma2: bool = False, **text_overrides):
    """PaliGemma 1 (Gemma) or 2 (Gemma 2: layers 0 and 2 sliding with a window of 8, soft-capped scores and logits)."""
    from transformers import PaliGemmaConfig

    text = dict(model_type="gemma2" if gemma2 else "gemma", vocab_size=TEXT_VOCAB + 4, hidden_size=64,
                intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if gemma2:
        text.update(query_pre_attn_scalar=16, sliding_window=8, attn_logit_softcapping=50.0,
                    final_logit_softcapping=30.0, layer_types=["sliding_attention", "full_attention"] * 2)
    text.update(text_overrides)
    vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=2, image_size=56, patch_size=7, layer_norm_eps=1e-6, vision_use_head=False)
    return PaliGemmaConfig(text_config=text, vision_config=vision, image_token_index=PALIGEMMA_IMAGE,
                           projection_dim=64, hidden_size=64)


def make_tiny_paligemma(folder: str | Path, *, seed: int = 0, gemma2: bool = False,
                        max_shard_size: str = "60KB") -> Path:
    """Write a tiny random PaliGemma checkpoint (transformers' names) with a tokenizer and return its folder."""
    from transformers import PaliGemmaForConditionalGeneration

    folder = Path(folder)
    torch.manual_seed(seed)
    model = PaliGemmaForConditionalGeneration(tiny_paligemma_config(gemma2=gemma2)).to(torch.float32)
    _randomise(model, scaled=("position_embedding", "multi_modal_projector"))
    with torch.no_grad():  # NOTE: Gemma's RMSNorms store weight - 1: around 0 (the ViT's LayerNorms around 1)
        for name, p in model.named_parameters():
            if "norm" in name and name.startswith("model.language_model."):
                p.copy_(0.1 * torch.randn_like(p))
    model.save_pretrained(folder, max_shard_size=max_shard_size)
    make_vl_tokenizer(folder)
    return folder


def paligemma_prompt(rows: list[tuple[list[int], list[int]]], *, seed: int = 0, pad_to: int | None = None) -> dict:
    """PaliGemma's processor's layout of (prefix, suffix) text ids per row: 64 ``<image>``, ``<bos>``, the prefix,
    ``\\n`` (id 4 here), then the suffix; ``token_type_ids`` 0 on the image and the prefix, 1 on the suffix; rows
    right-padded with id 0 (``attention_mask`` 0, ``token_type_ids`` 0) to ``pad_to`` or the longest; labels -100
    but on the suffix; one random 56x56 image a row."""
    rows_ids, types = [], []
    for prefix, suffix in rows:
        head = [PALIGEMMA_IMAGE] * IMAGE_TOKENS + [1] + prefix + [4]
        rows_ids.append(head + suffix)
        types.append([0] * len(head) + [1] * len(suffix))
    length = pad_to or max(map(len, rows_ids))
    ids = torch.tensor([r + [0] * (length - len(r)) for r in rows_ids])
    token_types = torch.tensor([t + [0] * (length - len(t)) for t in types])
    mask = torch.tensor([[1] * len(r) + [0] * (length - len(r)) for r in rows_ids])
    pixels = torch.randn(len(rows), 3, 56, 56, generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": token_types, "pixel_values": pixels,
            "labels": ids.masked_fill(token_types == 0, -100)}
