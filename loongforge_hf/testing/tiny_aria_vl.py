"""Tiny random Aria image-text checkpoints written by transformers (fp32): a 2-layer Aria MoE decoder (8 experts of
32, top 2, two shared) under Idefics3's ViT (3 blocks, 56x56 images in 7-pixel patches, an 8x8 position table) read
at ``vision_feature_layer`` -1 (the hub's: the last block's output before ``post_layernorm``) or -2, and Aria's
projector (learned queries cross-attending the patches: 4 for a 28x28 tile, 8 for a 56x56 one, as the hub's 128 /
256 for 490 / 980 pixels); batches of ``<image>`` runs with ``pixel_mask`` as Aria's processor pads tiles (the
picture top-left, zeros right and below)."""

from __future__ import annotations

from pathlib import Path

import torch

from loongforge_hf.testing.tiny_llava import make_llava_tokenizer
from loongforge_hf.testing.tiny_vl import TEXT_VOCAB, _randomise

ARIA_IMAGE = TEXT_VOCAB  # id of ``<image>``
QUERIES = {16: 4, 64: 8}  # patches of a tile -> its <image> tokens (projector_patch_to_query_dict)


def tiny_aria_vl_config(**overrides):
    """The config; ``overrides``: top-level fields (``vision_feature_layer`` -1 unless given)."""
    from transformers import AriaConfig

    text = dict(model_type="aria_text", vocab_size=TEXT_VOCAB + 4, hidden_size=64, intermediate_size=32,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0, moe_num_experts=8, moe_topk=2,
                moe_num_shared_experts=2)
    vision = dict(model_type="idefics3_vision", hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                  num_attention_heads=2, image_size=56, patch_size=7, layer_norm_eps=1e-6)
    top = dict(image_token_index=ARIA_IMAGE, projector_patch_to_query_dict=dict(QUERIES), vision_feature_layer=-1)
    return AriaConfig(text_config=text, vision_config=vision, **{**top, **overrides})


def make_tiny_aria_vl(folder: str | Path, *, seed: int = 0, feature_layer: int = -1,
                      max_shard_size: str = "60KB") -> Path:
    """Write a tiny random Aria checkpoint (transformers' names) with a tokenizer and return its folder."""
    from transformers import AriaForConditionalGeneration

    folder = Path(folder)
    torch.manual_seed(seed)
    model = AriaForConditionalGeneration(tiny_aria_vl_config(vision_feature_layer=feature_layer)).to(torch.float32)
    with torch.no_grad():
        _randomise(model, scaled=("position_embedding", "multi_modal_projector.query", "router"))
    model.save_pretrained(folder, max_shard_size=max_shard_size)
    make_llava_tokenizer(folder)
    return folder


def aria_image_prompt(rows: list[list[int]], *, seed: int = 0, tile: int = 28,
                      real: list[tuple[int, int]] | None = None) -> dict:
    """``input_ids [b, s]`` with an image's ``<image>`` tokens (``QUERIES``) where a row holds -1 (other entries
    text ids, every row the same length); ``pixel_values [n, 3, tile, tile]`` (random) and ``pixel_mask
    [n, tile, tile]`` when there are images: image i real over its top-left ``real[i]`` (height, width) pixels
    (all when None), zeros elsewhere, as Aria's processor pads a picture into its tile."""
    tokens = QUERIES[(tile // 7) ** 2]
    ids = [[t for x in row for t in ([ARIA_IMAGE] * tokens if x == -1 else [x])] for row in rows]
    out = {"input_ids": torch.tensor(ids)}
    count = sum(row.count(-1) for row in rows)
    if count:
        pixels = torch.randn(count, 3, tile, tile, generator=torch.Generator().manual_seed(seed))
        mask = torch.zeros(count, tile, tile, dtype=torch.bool)
        for i, (h, w) in enumerate(real or [(tile, tile)] * count):
            mask[i, :h, :w] = True
        out.update(pixel_values=pixels * mask[:, None], pixel_mask=mask)
    return out


def aria_processor_for(folder: str | Path):
    """``AriaProcessor`` over the tokenizer in ``folder`` (``<image>`` its image token) and Aria's PIL image
    processor (490-pixel tiles, the smaller of the two sizes it takes: 1225 patches of 14, 128 ``<image>`` tokens)."""
    from transformers import AriaProcessor, AutoTokenizer
    from transformers.models.aria.image_processing_pil_aria import AriaImageProcessorPil

    tokenizer = AutoTokenizer.from_pretrained(folder, extra_special_tokens={"image_token": "<image>"})
    return AriaProcessor(image_processor=AriaImageProcessorPil(max_image_size=490), tokenizer=tokenizer,
                         size_conversion={490: 128, 980: 256})
