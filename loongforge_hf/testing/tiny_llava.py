"""Tiny random LLaVA checkpoints (``LlavaForConditionalGeneration``) and their processor, written by ``transformers``
itself (no download).

Sizes: a 3-block CLIP ViT (hidden 32, 2 heads, 28x28 images of 7-pixel patches: 16 image tokens, the class token
dropped) under a 4-layer decoder (hidden 64, GQA). Three variants: llava-1.5's (a Llama decoder, an untied head,
``vision_feature_layer=-2``: block 1's output; block 2 and ``post_layernorm`` unused), ``"mistral"``
(bakLlava's decoder, the same ViT) and ``"qwen2"`` (a Qwen2 decoder with a tied head; ``vision_feature_layer=[0, -2]``:
the pre-LayerNorm's output and block 1's concatenated, block 2 unused; a projector without biases). Norm weights,
biases, the class token and the position table are random (transformers initialises them to 1, 0 or small values,
which would hide a dropped or misplaced tensor).

Namings (``naming=``): "hub" (llava-hf's files: ``language_model.model.*``, ``vision_tower.vision_model.*``),
"transformers" (what transformers 5 writes: ``vision_tower.*``), "modules" (``model.language_model.*``, ``lm_head``,
``model.vision_tower.*``), "modules_nested" (the same with ``model.vision_tower.vision_model.*``, as a transformers
4.x ``state_dict()`` names them).

The processor is ``LlavaProcessor``'s own code over a word-level tokenizer (``tok4`` ..) with ``<image>`` (id 200)
and CLIP's PIL image processor (resize the shortest edge to 28, centre crop; no torchvision).
"""

from __future__ import annotations

from pathlib import Path

import torch

from loongforge_hf.testing.tiny_vl import TEXT_VOCAB, _randomise, rename_prefixes

IMAGE = TEXT_VOCAB  # <image>
TOKENS_PER_IMAGE = 16
# (text prefix, LM head, vision prefix, projector prefix) of each on-disk naming
NAMINGS = {"transformers": ("language_model.model", "language_model.lm_head", "vision_tower", "multi_modal_projector"),
           "hub": ("language_model.model", "language_model.lm_head", "vision_tower.vision_model",
                   "multi_modal_projector"),
           "modules": ("model.language_model", "lm_head", "model.vision_tower", "model.multi_modal_projector"),
           "modules_nested": ("model.language_model", "lm_head", "model.vision_tower.vision_model",
                              "model.multi_modal_projector")}


def tiny_llava_config(variant: str = "llama", **text_overrides):
    from transformers import LlavaConfig

    text = dict(model_type=variant, vocab_size=TEXT_VOCAB + 4, hidden_size=64, intermediate_size=96,
                num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                tie_word_embeddings=variant == "qwen2", rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    if variant == "mistral":
        text["sliding_window"] = None
    text.update(text_overrides)
    vision = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                  num_attention_heads=2, image_size=28, patch_size=7, projection_dim=16)
    return LlavaConfig(text_config=text, vision_config=vision, image_token_index=IMAGE,
                       image_seq_length=TOKENS_PER_IMAGE, vision_feature_layer=[0, -2] if variant == "qwen2" else -2,
                       multimodal_projector_bias=variant != "qwen2")


def make_tiny_llava(folder: str | Path, *, seed: int = 0, variant: str = "llama", naming: str = "hub",
                    max_shard_size: str = "60KB", **text_overrides) -> Path:
    """Write a tiny random LLaVA checkpoint (weights under ``naming``'s prefixes, config, tokenizer) and return its
    folder."""
    from transformers import LlavaForConditionalGeneration

    folder = Path(folder)
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(tiny_llava_config(variant, **text_overrides)).to(torch.float32)
    _randomise(model, scaled=("class_embedding", "position_embedding"))
    model.save_pretrained(folder, max_shard_size=max_shard_size)
    if naming != "transformers":
        rename_prefixes(folder, dict(zip(NAMINGS["transformers"], NAMINGS[naming])))
    make_llava_tokenizer(folder)
    return folder


def make_llava_tokenizer(folder: str | Path):
    """A word-level tokenizer with ``<image>`` (id 200), saved in ``folder``."""
    from loongforge_hf.testing.tiny_models import make_tiny_tokenizer

    tok = make_tiny_tokenizer(folder, vocab_size=TEXT_VOCAB)
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    tok.save_pretrained(folder)
    return tok


def llava_processor_for(folder: str | Path):
    """``LlavaProcessor`` over the tokenizer in ``folder`` and CLIP's PIL image processor at 28x28 pixels."""
    from transformers import AutoTokenizer, LlavaProcessor
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    images = CLIPImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    return LlavaProcessor(image_processor=images, tokenizer=AutoTokenizer.from_pretrained(folder), patch_size=7,
                          vision_feature_select_strategy="default", num_additional_image_tokens=1)


def llava_image_prompt(rows: list[list[int]], *, seed: int = 0) -> dict:
    """``input_ids [b, s]`` with 16 ``<image>`` tokens where a row holds -1, other entries text ids (every row the
    same length), and ``pixel_values [n, 3, 28, 28]`` (random) when there are images."""
    ids = [[t for x in row for t in ([IMAGE] * TOKENS_PER_IMAGE if x == -1 else [x])] for row in rows]
    out = {"input_ids": torch.tensor(ids)}
    count = sum(row.count(-1) for row in rows)
    if count:
        out["pixel_values"] = torch.randn(count, 3, 28, 28, generator=torch.Generator().manual_seed(seed))
    return out
