"""Tiny random Llama 4 image-text checkpoints (``Llama4ForConditionalGeneration``), written by ``transformers`` itself
(no download).

Sizes: a 2-block Llama 4 ViT (hidden 32, 2 heads of 16, 24x24 tiles of 4-pixel patches: 6x6 patches, pixel-shuffled
2x2 to 9 tokens a tile, the adapter and projector 48 wide) under the tiny Llama 4 decoder of ``tiny_models``
(dense and MoE layers alternating, a NoPE layer with its temperature, chunked attention, llama3 rope) with Llama 4's
image tokens appended to the word-level vocabulary. Norm weights, biases, the class token, the position table and the
router are random (transformers initialises norms to 1 and biases to 0, which would hide a dropped tensor).

Prompts are laid out as ``Llama4Processor`` lays out an image (``llama4_image_prompt``): ``<|image_start|>``, for a
picture of more than one tile each tile's 9 ``<|patch|>`` with ``<|tile_x_separator|>`` between a row's tiles and
``<|tile_y_separator|>`` after each row, then ``<|image|>`` and the global tile's 9 ``<|patch|>``, ``<|image_end|>``;
``pixel_values [tiles, 3, 24, 24]`` hold each picture's tiles then its global tile. Its image processor needs
torchvision, which the CPU test environment does not install.
"""

from __future__ import annotations

from pathlib import Path

import torch

from loongforge_hf.testing.tiny_vl import TEXT_VOCAB, _randomise

# <|image_start|>, <|image_end|>, <|image|>, <|patch|> (the image token), <|tile_x_separator|>, <|tile_y_separator|>
IMAGE_START, IMAGE_END, IMAGE, PATCH, TILE_X, TILE_Y = range(TEXT_VOCAB, TEXT_VOCAB + 6)
SPECIAL = ("<|image_start|>", "<|image_end|>", "<|image|>", "<|patch|>", "<|tile_x_separator|>",
           "<|tile_y_separator|>")
TILE, TOKENS_PER_TILE = 24, 9


def tiny_llama4_vl_config(**text_overrides):
    from transformers import Llama4Config

    from loongforge_hf.testing.tiny_models import _config

    text = _config("llama4", vocab_size=TEXT_VOCAB + len(SPECIAL)).to_dict()
    text.update(text_overrides)
    tie = text.setdefault("tie_word_embeddings", False)  # NOTE: transformers ties by the text config's
    vision = dict(hidden_size=32, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, image_size=TILE,
                  patch_size=4, pixel_shuffle_ratio=0.5, projector_input_dim=48, projector_output_dim=48,
                  vision_output_dim=48, rope_parameters={"rope_type": "default", "rope_theta": 100.0})
    return Llama4Config(text_config=text, vision_config=vision, image_token_index=PATCH, boi_token_index=IMAGE_START,
                        eoi_token_index=IMAGE_END, tie_word_embeddings=tie)


def make_tiny_llama4_vl(folder: str | Path, *, seed: int = 0, max_shard_size: str = "60KB",
                        **text_overrides) -> Path:
    """Write a tiny random Llama 4 image-text checkpoint (config, weights in the hub's naming, tokenizer) and return
    its folder."""
    from transformers import Llama4ForConditionalGeneration

    from loongforge_hf.testing.tiny_models import make_tiny_tokenizer

    folder = Path(folder)
    torch.manual_seed(seed)
    model = Llama4ForConditionalGeneration(tiny_llama4_vl_config(**text_overrides))
    with torch.no_grad():
        _randomise(model, scaled=("class_embedding", "positional_embedding_vlm", "router.weight"))
    model.save_pretrained(folder, max_shard_size=max_shard_size)
    tok = make_tiny_tokenizer(folder, vocab_size=TEXT_VOCAB)
    tok.add_special_tokens({"additional_special_tokens": list(SPECIAL)})
    tok.save_pretrained(folder)
    return folder


def llama4_image_prompt(rows: list[list], *, seed: int = 0) -> dict:
    """``input_ids [b, s]`` where a row holds ``(tiles_h, tiles_w)``: a picture cut into that many tiles (``(1, 1)``:
    the global tile alone) laid out as ``Llama4Processor`` lays it (module docstring), other entries text ids (every
    row the same length); ``pixel_values [n, 3, 24, 24]`` (random) when there are pictures."""
    def picture(tiles_h: int, tiles_w: int) -> list[int]:
        ids = [IMAGE_START]
        if tiles_h * tiles_w > 1:
            for _ in range(tiles_h):
                for x in range(tiles_w):
                    ids += [PATCH] * TOKENS_PER_TILE + ([TILE_X] if x < tiles_w - 1 else [])
                ids.append(TILE_Y)
        return ids + [IMAGE] + [PATCH] * TOKENS_PER_TILE + [IMAGE_END]

    ids = [[t for x in row for t in (picture(*x) if isinstance(x, tuple) else [x])] for row in rows]
    out = {"input_ids": torch.tensor(ids)}
    tiles = sum(x[0] * x[1] + (x[0] * x[1] > 1) for row in rows for x in row if isinstance(x, tuple))
    if tiles:
        out["pixel_values"] = torch.randn(tiles, 3, TILE, TILE, generator=torch.Generator().manual_seed(seed))
    return out
