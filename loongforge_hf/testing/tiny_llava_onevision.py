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

Inputs: ``tiny_llava``'s word-level tokenizer (``<image>``: id 200) with ``<video>`` (id 201), ``<image>`` and
``<video>`` expanded as ``LlavaOnevisionProcessor``'s own counts do (a picture of a multi-image sample: 16 + 1; a
video: 4 pooled tokens a frame + 1), LLaVA-OneVision's PIL image processor at 28 pixels, random 28x28 frames as the
video processor gives them (the processor itself needs torchvision for its video processor).
"""

from __future__ import annotations

from pathlib import Path

import torch

from loongforge_hf.testing.tiny_llava import IMAGE, NAMINGS, make_llava_tokenizer, tiny_llava_config
from loongforge_hf.testing.tiny_vl import _randomise, rename_prefixes

PINPOINTS = [[28, 28], [28, 56], [56, 28], [56, 56], [28, 84], [84, 28]]
ASPECT = "anyres_max_2"
VIDEO = IMAGE + 1  # <video>


def tiny_llava_onevision_config():
    from transformers import LlavaOnevisionConfig

    text = tiny_llava_config("qwen2").text_config.to_dict()
    vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                  num_attention_heads=2, image_size=28, patch_size=7, vision_use_head=False)
    return LlavaOnevisionConfig(text_config=text, vision_config=vision, image_token_index=IMAGE,
                                video_token_index=VIDEO, vision_feature_layer=-1,
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
    tokenizer = make_llava_tokenizer(folder)
    tokenizer.add_tokens(["<video>"], special_tokens=True)
    tokenizer.save_pretrained(folder)
    return folder


def _processor():
    """``LlavaOnevisionProcessor`` with the tiny sizes, not built (its video processor needs torchvision): its token
    counts only."""
    from types import SimpleNamespace

    from transformers import LlavaOnevisionProcessor

    processor = object.__new__(LlavaOnevisionProcessor)
    processor.__dict__.update(image_processor=SimpleNamespace(image_grid_pinpoints=PINPOINTS), num_image_tokens=16,
                              vision_aspect_ratio=ASPECT, image_token="<image>", video_token="<video>",
                              vision_feature_select_strategy="full")
    return processor


def image_token_count(height: int, width: int, *, alone: bool = True) -> int:
    """``<image>`` tokens of a ``height x width`` picture as ``LlavaOnevisionProcessor`` counts them (its own
    ``replace_image_token``): the only picture of its sample (``alone``), or one of a multi-image sample."""
    pixels = torch.zeros(1, 1, 3, 28, 28)
    inputs = {"batch_num_images": [1 if alone else 2], "image_sizes": [[height, width]], "pixel_values": pixels}
    return _processor().replace_image_token(inputs, 0).count("<image>")


def video_token_count(frames: int) -> int:
    """``<video>`` tokens of a ``frames``-frame video as ``LlavaOnevisionProcessor.replace_video_token`` counts."""
    return _processor().replace_video_token({"pixel_values_videos": torch.zeros(1, frames, 3, 28, 28)}, 0) \
        .count("<video>")


def llava_onevision_inputs(folder: str | Path, texts: list[str], sizes: list[tuple[int, int]], *, seed: int = 0,
                           padding_side: str = "right", pad_to_multiple_of: int | None = None,
                           frames: int = 0) -> dict:
    """``texts`` (``<image>`` / ``<video>`` where a picture / a video goes, as many as the processor expands it to:
    ``image_token_count``, ``video_token_count``) and random pictures of ``sizes`` (height, width) through
    LLaVA-OneVision's PIL image processor (28-pixel crops, ``PINPOINTS``; the texts' pictures as its samples):
    ``input_ids``, ``attention_mask`` padded to the longest text, ``pixel_values [n, crops, 3, 28, 28]``,
    ``image_sizes``, ``batch_num_images``; with ``<video>`` in the texts, random ``pixel_values_videos [videos,
    frames, 3, 28, 28]``."""
    import numpy as np
    from transformers import AutoTokenizer
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
        LlavaOnevisionImageProcessorPil)

    rng = np.random.RandomState(seed)
    per_text = [text.count("<image>") for text in texts]
    alone = [n == 1 for n in per_text for _ in range(n)]
    counts = iter([image_token_count(h, w, alone=a) for (h, w), a in zip(sizes, alone)])
    videos = sum(text.count("<video>") for text in texts)
    expanded = ["".join(part + ("<image>" * next(counts) if k < text.count("<image>") else "")
                        for k, part in enumerate(text.split("<image>"))) for text in texts]
    expanded = [text.replace("<video>", "<video>" * video_token_count(frames)) for text in expanded]
    tokenizer = AutoTokenizer.from_pretrained(folder, padding_side=padding_side)
    out = dict(tokenizer(expanded, padding=True, pad_to_multiple_of=pad_to_multiple_of, return_tensors="pt"))
    if sizes:
        images = LlavaOnevisionImageProcessorPil(size={"height": 28, "width": 28}, image_grid_pinpoints=PINPOINTS)
        pictures = iter([rng.randint(0, 256, (h, w, 3), dtype=np.uint8) for h, w in sizes])
        pixels = images([[next(pictures) for _ in range(n)] for n in per_text if n], return_tensors="pt")
        out.update(pixel_values=pixels["pixel_values"], image_sizes=pixels["image_sizes"],
                   batch_num_images=pixels["batch_num_images"])
    if videos:
        out["pixel_values_videos"] = torch.randn(videos, frames, 3, 28, 28,
                                                 generator=torch.Generator().manual_seed(seed))
    return out
