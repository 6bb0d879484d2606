"""Tiny random LLaVA-NeXT-Video checkpoints (``LlavaNextVideoForConditionalGeneration``) and their inputs, written by
``transformers`` itself (no download).

Sizes: LLaVA-NeXT's tiny ones (``tiny_llava_next``: a 3-block CLIP ViT of 28x28 crops, 7-pixel patches, 16 base
tokens, ``vision_feature_layer=-2``; a 4-layer Llama decoder; ``image_grid_pinpoints`` of one to three 28-pixel tiles
a side, so a 20x40 picture takes 3 crops and 52 ``<image>`` tokens) with ``<video>`` (id 201) and
``spatial_pool_mode`` (``"average"``, or ``pool_mode=``) over a stride of 2: a frame's 4x4 map pools to 4 tokens.
``image_newline`` is random as transformers initialises it; the hub's naming (``language_model.model.*``,
``vision_tower.vision_model.*``, ``image_newline``).

Inputs: ``tiny_llava``'s word-level tokenizer with ``<video>`` added, ``<video>`` expanded as
``LlavaNextVideoProcessor.replace_video_token`` counts, pictures through ``LlavaNextProcessor`` (LLaVA-NeXT's PIL image
processor at 28 pixels), random 28x28 frames as the video processor gives them (it needs torchvision).
"""

from __future__ import annotations

from pathlib import Path

import torch

from loongforge_hf.testing.tiny_llava import IMAGE, NAMINGS, make_llava_tokenizer
from loongforge_hf.testing.tiny_llava_next import PINPOINTS, llava_next_inputs, tiny_llava_next_config
from loongforge_hf.testing.tiny_vl import _randomise, rename_prefixes

VIDEO = IMAGE + 1  # <video>


def tiny_llava_next_video_config(pool_mode: str = "average"):
    from transformers import LlavaNextVideoConfig

    base = tiny_llava_next_config()
    return LlavaNextVideoConfig(text_config=base.text_config.to_dict(), vision_config=base.vision_config.to_dict(),
                                image_token_index=IMAGE, video_token_index=VIDEO,
                                vision_feature_layer=base.vision_feature_layer, image_grid_pinpoints=PINPOINTS,
                                spatial_pool_mode=pool_mode, spatial_pool_stride=2, image_seq_length=16,
                                video_seq_length=4)


def make_tiny_llava_next_video(folder: str | Path, *, seed: int = 0, pool_mode: str = "average",
                               max_shard_size: str = "60KB") -> Path:
    """Write a tiny random LLaVA-NeXT-Video checkpoint (the hub's names, config, tokenizer) and return its folder."""
    from transformers import LlavaNextVideoForConditionalGeneration

    folder = Path(folder)
    torch.manual_seed(seed)
    model = LlavaNextVideoForConditionalGeneration(tiny_llava_next_video_config(pool_mode)).to(torch.float32)
    _randomise(model, scaled=("class_embedding", "position_embedding"))
    model.save_pretrained(folder, max_shard_size=max_shard_size)
    rename_prefixes(folder, {**dict(zip(NAMINGS["transformers"], NAMINGS["hub"])), "image_newline": "image_newline"})
    tokenizer = make_llava_tokenizer(folder)
    tokenizer.add_tokens(["<video>"], special_tokens=True)
    tokenizer.save_pretrained(folder)
    return folder


def video_token_count(frames: int) -> int:
    """``<video>`` tokens of a ``frames``-frame video of 28x28 frames as ``LlavaNextVideoProcessor`` counts them."""
    from transformers import LlavaNextVideoProcessor

    processor = object.__new__(LlavaNextVideoProcessor)  # NOTE: not built: its video processor needs torchvision
    processor.__dict__.update(patch_size=7, video_token="<video>")
    return processor.replace_video_token({"pixel_values_videos": torch.zeros(1, frames, 3, 28, 28)}, 0) \
        .count("<video>")


def llava_next_video_inputs(folder: str | Path, texts: list[str], sizes: list[tuple[int, int]], *, seed: int = 0,
                            padding_side: str = "right", pad_to_multiple_of: int | None = None,
                            frames: int = 0) -> dict:
    """``texts`` (``<image>`` / ``<video>`` where a picture / a video goes) and random pictures of ``sizes`` (height,
    width) through the tiny ``LlavaNextProcessor``, each ``<video>`` expanded to ``video_token_count(frames)``:
    ``input_ids``, ``attention_mask``, ``pixel_values [n, crops, 3, 28, 28]``, ``image_sizes``; with ``<video>`` in
    the texts, random ``pixel_values_videos [videos, frames, 3, 28, 28]``."""
    videos = sum(text.count("<video>") for text in texts)
    expanded = [text.replace("<video>", "<video>" * video_token_count(frames)) for text in texts] if videos else texts
    out = llava_next_inputs(folder, expanded, sizes, seed=seed, padding_side=padding_side,
                            pad_to_multiple_of=pad_to_multiple_of)
    if videos:
        out["pixel_values_videos"] = torch.randn(videos, frames, 3, 28, 28,
                                                 generator=torch.Generator().manual_seed(seed))
    return out
