"""Tiny random LLaVA-OneVision checkpoints (``LlavaOnevisionForConditionalGeneration``) and their processor, written by
``transformers`` itself (no download).

Sizes: a 3-block SigLIP ViT (hidden 32, 2 heads, 28x28 crops of 7-pixel patches: 16 base tokens,
``vision_feature_layer=-1``, the ``"full"`` strategy; ``post_layernorm`` unused) under ``tiny_llava``'s 4-layer Qwen2
decoder (tied head); LLaVA's projector with biases; ``image_grid_pinpoints`` of one to three 28-pixel tiles a side
(``PINPOINTS``) and ``vision_aspect_ratio="anyres_max_2"``, so a picture whose unpadded map holds more than about
2.4 tiles' features is shrunk: a 20x20 picture takes 2 crops and 36 ``<image>`` tokens (no padding dropped), 20x40
takes 3 and 52 (unpadded), 50x36 takes 5 and 46 (unpadded 8x6, shrunk to 5x4). Norm weights, biases, the position
table and ``image_newline`` are random.

Namings (``naming=``): "hub" (llava-hf's files: ``language_model.model.*``, ``vision_tower.vision_model.*``,
``image_newline``), "modules" (``model.language_model.*``, ``model.vision_tower.*``, ``model.image_newline``).

Inputs: ``tiny_llava``'s word-level tokenizer (``<image>``: id 200), ``<image>`` expanded as
``LlavaOnevisionProcessor``'s own count does, and LLaVA-OneVision's PIL image processor at 28 pixels (the processor
itself needs torchvision for its video processor).
"""

from __future__ import annotations

from pathlib import Path

import torch

from loongforge_hf.testing.tiny_llava import IMAGE, NAMINGS, make_llava_tokenizer, tiny_llava_config
from loongforge_hf.testing.tiny_vl import _randomise, rename_prefixes

PINPOINTS = [[28, 28], [28, 56], [56, 28], [56, 56], [28, 84], [84, 28]]
ASPECT = "anyres_max_2"


def tiny_llava_onevision_config():
    from transformers import LlavaOnevisionConfig

    text = tiny_llava_config("qwen2").text_config.to_dict()
    vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                  num_attention_heads=2, image_size=28, patch_size=7, vision_use_head=False)
    return LlavaOnevisionConfig(text_config=text, vision_config=vision, image_token_index=IMAGE,
                                video_token_index=IMAGE + 1, vision_feature_layer=-1,
                                vision_feature_select_strategy="full", vision_aspect_ratio=ASPECT,
                                image_grid_pinpoints=PINPOINTS, tie_word_embeddings=True)


def make_tiny_llava_onevision(folder: str | Path, *, seed: int = 0, naming: str = "hub",
                              max_shard_size: str = "60KB") -> Path:
    """Write a tiny random LLaVA-OneVision checkpoint (weights under ``naming``'s names, config, tokenizer) and
    return its folder."""
    from transformers import LlavaOnevisionForConditionalGeneration

    folder = Path(folder)
    torch.manual_seed(seed)
    model = LlavaOnevisionForConditionalGeneration(tiny_llava_onevision_config()).to(torch.float32)
    _randomise(model, scaled=("position_embedding",))
    model.save_pretrained(folder, max_shard_size=max_shard_size)
    renames = {**dict(zip(NAMINGS["transformers"], NAMINGS[naming])),
               "image_newline": "model.image_newline" if naming == "modules" else "image_newline"}
    rename_prefixes(folder, renames)
    make_llava_tokenizer(folder)
    return folder


def image_token_count(height: int, width: int) -> int:
    """``<image>`` tokens of a ``height x width`` picture as ``LlavaOnevisionProcessor`` counts them (its own
    ``_get_number_of_features``; the processor object is not built: its video processor needs torchvision)."""
    from types import SimpleNamespace

    from transformers import LlavaOnevisionProcessor

    processor = object.__new__(LlavaOnevisionProcessor)
    processor.__dict__.update(image_processor=SimpleNamespace(image_grid_pinpoints=PINPOINTS), num_image_tokens=16,
                              vision_aspect_ratio=ASPECT)
    return processor._get_number_of_features(height, width, 28, 28)


def llava_onevision_inputs(folder: str | Path, texts: list[str], sizes: list[tuple[int, int]], *, seed: int = 0,
                           padding_side: str = "right", pad_to_multiple_of: int | None = None) -> dict:
    """``texts`` (``<image>`` where a picture goes, as many as the processor expands it to: ``image_token_count``)
    and random pictures of ``sizes`` (height, width) through LLaVA-OneVision's PIL image processor (28-pixel crops,
    ``PINPOINTS``): ``input_ids``, ``attention_mask`` padded to the longest text, ``pixel_values [n, crops, 3, 28,
    28]``, ``image_sizes``."""
    import numpy as np
    from transformers import AutoTokenizer
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
        LlavaOnevisionImageProcessorPil)

    rng = np.random.RandomState(seed)
    counts = iter([image_token_count(h, w) for h, w in sizes])
    expanded = ["".join(part + ("<image>" * next(counts) if k < text.count("<image>") else "")
                        for k, part in enumerate(text.split("<image>"))) for text in texts]
    tokenizer = AutoTokenizer.from_pretrained(folder, padding_side=padding_side)
    out = dict(tokenizer(expanded, padding=True, pad_to_multiple_of=pad_to_multiple_of, return_tensors="pt"))
    if sizes:
        images = LlavaOnevisionImageProcessorPil(size={"height": 28, "width": 28}, image_grid_pinpoints=PINPOINTS)
        pixels = images([rng.randint(0, 256, (h, w, 3), dtype=np.uint8) for h, w in sizes], return_tensors="pt")
        out.update(pixel_values=pixels["pixel_values"], image_sizes=pixels["image_sizes"])
    return out
