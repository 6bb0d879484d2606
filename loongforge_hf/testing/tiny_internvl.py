"""Tiny random InternVL checkpoints (``InternVLForConditionalGeneration``) and their processor, written by
``transformers`` itself (no download).

Sizes: a 2-block InternViT (hidden 32, 2 heads, 56x56 tiles of 7-pixel patches: 8x8 patches, pixel-shuffled 2x2 to
16 tokens a tile) under a 4-layer decoder (hidden 64, GQA). Two variants: InternVL3's (a Qwen2 decoder with an
untied head; LayerNorm ViT blocks with q / k / v biases, mean pooling: no final norm) and ``big_vit``: InternViT-6B's
features (RMSNorm blocks, q / k norms, no q / k / v biases, the final LayerNorm) over a Qwen3 decoder (head_dim 16,
q / k norms) with a tied head. Norm weights, biases, layer scales, the class token and the position table are random
(transformers initialises them to 1, 0, 0.1 and 0, which would hide a dropped or misplaced tensor).

The processor is ``InternVLProcessor``'s own code over a word-level tokenizer (``tok4`` ..) with InternVL's
``<img>`` / ``</img>`` / ``<IMG_CONTEXT>`` / ``<video>`` (ids 200 - 203) and Got-OCR 2's PIL image processor (no
torchvision) cutting each picture into up to two 56x56 tiles plus a thumbnail; no video processor.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from loongforge_hf.testing.tiny_vl import MISTRAL3_NAMINGS, TEXT_VOCAB, _randomise, rename_prefixes

IMG_START, IMG_END, IMG_CONTEXT = TEXT_VOCAB, TEXT_VOCAB + 1, TEXT_VOCAB + 2  # <img>, </img>, <IMG_CONTEXT>
TOKENS_PER_TILE = 16
# (text prefix, LM head, vision prefix, projector prefix) of each on-disk naming: Mistral 3's (transformers' llava)
NAMINGS = MISTRAL3_NAMINGS


def tiny_internvl_config(*, big_vit: bool = False, **text_overrides):
    from transformers import InternVLConfig

    text = dict(model_type="qwen3" if big_vit else "qwen2", vocab_size=TEXT_VOCAB + 4, hidden_size=64,
                intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if big_vit:
        text["head_dim"] = 16
    text.update(text_overrides)
    tie = text.pop("tie_word_embeddings", big_vit)
    vision = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, image_size=56,
                  patch_size=7, attention_bias=not big_vit, use_qk_norm=big_vit,
                  norm_type="rms_norm" if big_vit else "layer_norm", use_mean_pooling=not big_vit)
    return InternVLConfig(text_config=text, vision_config=vision, image_token_id=IMG_CONTEXT,
                          image_seq_length=TOKENS_PER_TILE, downsample_ratio=0.5, tie_word_embeddings=tie)


def make_tiny_internvl(folder: str | Path, *, seed: int = 0, naming: str = "hub", big_vit: bool = False,
                       max_shard_size: str = "60KB", **text_overrides) -> Path:
    """Write a tiny random InternVL checkpoint (weights under ``naming``'s prefixes: "hub" or "modules", config,
    tokenizer) and return its folder."""
    from transformers import InternVLForConditionalGeneration

    folder = Path(folder)
    torch.manual_seed(seed)
    model = InternVLForConditionalGeneration(tiny_internvl_config(big_vit=big_vit, **text_overrides))
    _randomise(model.to(torch.float32), scaled=("cls_token", "position_embeddings"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lambda_" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    model.save_pretrained(folder, max_shard_size=max_shard_size)
    if naming != "hub":
        rename_prefixes(folder, dict(zip(NAMINGS["hub"], NAMINGS[naming])))
    make_internvl_tokenizer(folder)
    return folder


def make_internvl_tokenizer(folder: str | Path):
    """A word-level tokenizer with InternVL's special tokens (as its tokenizer names them), saved in ``folder``."""
    from loongforge_hf.testing.tiny_models import make_tiny_tokenizer

    tok = make_tiny_tokenizer(folder, vocab_size=TEXT_VOCAB)
    tokens = {"start_image_token": "<img>", "end_image_token": "</img>", "context_image_token": "<IMG_CONTEXT>",
              "video_token": "<video>"}
    tok.add_special_tokens({"additional_special_tokens": list(tokens.values())})
    tok._set_model_specific_special_tokens(special_tokens=tokens)
    tok.save_pretrained(folder)
    return tok


def internvl_processor_for(folder: str | Path):
    """``InternVLProcessor``'s own code over the tokenizer in ``folder`` and a 56x56-tile Got-OCR 2 image processor
    (at most two tiles and a thumbnail a picture), without the video processor its constructor requires (those need
    torchvision, which the CPU test environment does not install)."""
    from transformers import AutoTokenizer, InternVLProcessor
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil
    from transformers.processing_utils import ProcessorMixin

    class TinyInternVLProcessor(InternVLProcessor):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)
            self.image_seq_length = TOKENS_PER_TILE
            self.start_image_token, self.end_image_token = tokenizer.start_image_token, tokenizer.end_image_token
            self.start_image_token_id = tokenizer.start_image_token_id
            self.end_image_token_id = tokenizer.end_image_token_id
            self.image_token, self.video_token = tokenizer.context_image_token, tokenizer.video_token
            self.image_token_id = tokenizer.context_image_token_id
            self.multimodal_pattern = re.compile(f"(?P<image>{re.escape(self.image_token)})|"
                                                 f"(?P<video>{re.escape(self.video_token)})")

    images = GotOcr2ImageProcessorPil(size={"height": 56, "width": 56}, crop_to_patches=True, min_patches=1,
                                      max_patches=2)
    return TinyInternVLProcessor(image_processor=images, tokenizer=AutoTokenizer.from_pretrained(folder))


def internvl_image_prompt(rows: list[list[int]], *, seed: int = 0) -> dict:
    """``input_ids [b, s]`` as InternVL's processor lays a tile out (``<img>``, 16 ``<IMG_CONTEXT>``, ``</img>``)
    where a row holds -1, other entries text ids (every row the same length), and ``pixel_values [n, 3, 56, 56]``
    (random) when there are tiles."""
    ids = [[t for x in row for t in ([IMG_START] + [IMG_CONTEXT] * TOKENS_PER_TILE + [IMG_END] if x == -1 else [x])]
           for row in rows]
    out = {"input_ids": torch.tensor(ids)}
    count = sum(row.count(-1) for row in rows)
    if count:
        out["pixel_values"] = torch.randn(count, 3, 56, 56, generator=torch.Generator().manual_seed(seed))
    return out
