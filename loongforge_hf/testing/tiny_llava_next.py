"""Tiny random LLaVA-NeXT checkpoints (``LlavaNextForConditionalGeneration``) and their processor, written by
``transformers`` itself (no download).

Sizes: LLaVA's tiny ones (``tiny_llava``: a 3-block CLIP ViT of 28x28 crops, 7-pixel patches, 16 base tokens,
``vision_feature_layer=-2``; a 4-layer Llama decoder, or the Qwen2 variant with a tied head, features of hidden
states 0 and 2 and a projector without biases) with ``image_grid_pinpoints`` of one to three 28-pixel tiles a side
(``PINPOINTS``): a 20x40 picture takes 3 crops and 52 ``<image>`` tokens, 40x90 takes 4 and 60, 50x36 takes 5 and 72.
``image_newline`` is random as transformers initialises it.

Namings (``naming=``): "hub" (llava-hf's files: ``language_model.model.*``, ``vision_tower.vision_model.*``,
``image_newline``), "transformers" (what transformers 5 writes: ``vision_tower.*``), "modules"
(``model.language_model.*``, ``lm_head``, ``model.vision_tower.*``, ``model.image_newline``).

The processor is ``LlavaNextProcessor``'s own code over ``tiny_llava``'s word-level tokenizer (``<image>``: id 200)
and LLaVA-NeXT's PIL image processor at 28 pixels (no torchvision).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from loongforge_hf.testing.tiny_llava import IMAGE, NAMINGS, make_llava_tokenizer, tiny_llava_config
from loongforge_hf.testing.tiny_vl import _randomise

PINPOINTS = [[28, 56], [56, 28], [56, 56], [28, 84], [84, 28]]
NEWLINE = {"transformers": "image_newline", "hub": "image_newline", "modules": "model.image_newline"}


def tiny_llava_next_config(variant: str = "llama", **text_overrides):
    from transformers import LlavaNextConfig

    base = tiny_llava_config(variant, **text_overrides)
    return LlavaNextConfig(text_config=base.text_config.to_dict(), vision_config=base.vision_config.to_dict(),
                           image_token_index=IMAGE, vision_feature_layer=base.vision_feature_layer,
                           multimodal_projector_bias=base.multimodal_projector_bias,
                           tie_word_embeddings=base.tie_word_embeddings, image_grid_pinpoints=PINPOINTS,
                           image_seq_length=16)


def make_tiny_llava_next(folder: str | Path, *, seed: int = 0, variant: str = "llama", naming: str = "hub",
                         max_shard_size: str = "60KB") -> Path:
    """Write a tiny random LLaVA-NeXT checkpoint (weights under ``naming``'s names, config, tokenizer) and return its
    folder."""
    from safetensors.torch import load_file, save_file
    from transformers import LlavaNextForConditionalGeneration

    folder = Path(folder)
    torch.manual_seed(seed)
    model = LlavaNextForConditionalGeneration(tiny_llava_next_config(variant)).to(torch.float32)
    _randomise(model, scaled=("class_embedding", "position_embedding"))
    model.save_pretrained(folder, max_shard_size=max_shard_size)
    renames = {**dict(zip(NAMINGS["transformers"], NAMINGS[naming])), NEWLINE["transformers"]: NEWLINE[naming]}

    def rename(name: str) -> str:
        old = next(p for p in renames if name == p or name.startswith(p + "."))
        return renames[old] + name[len(old):]

    for shard in sorted(folder.glob("*.safetensors")):
        save_file({rename(k): v for k, v in load_file(shard).items()}, shard, metadata={"format": "pt"})
    index_file = folder / "model.safetensors.index.json"
    if index_file.exists():
        index = json.loads(index_file.read_text())
        index["weight_map"] = {rename(k): v for k, v in index["weight_map"].items()}
        index_file.write_text(json.dumps(index, indent=2))
    make_llava_tokenizer(folder)
    return folder


def llava_next_processor_for(folder: str | Path, *, padding_side: str = "right"):
    """``LlavaNextProcessor`` over the tokenizer in ``folder`` and LLaVA-NeXT's PIL image processor: 28-pixel crops,
    ``PINPOINTS``."""
    from transformers import AutoTokenizer, LlavaNextProcessor
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    images = LlavaNextImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28},
                                        image_grid_pinpoints=PINPOINTS)
    tokenizer = AutoTokenizer.from_pretrained(folder, padding_side=padding_side)
    return LlavaNextProcessor(image_processor=images, tokenizer=tokenizer, patch_size=7,
                              vision_feature_select_strategy="default", num_additional_image_tokens=1)


def llava_next_inputs(folder: str | Path, texts: list[str], sizes: list[tuple[int, int]], *, seed: int = 0,
                      padding_side: str = "right", pad_to_multiple_of: int | None = None) -> dict:
    """``texts`` (``<image>`` where a picture goes) and random pictures of ``sizes`` (height, width) through the tiny
    processor, padded to the longest text: ``input_ids``, ``attention_mask``, ``pixel_values [n, crops, 3, 28, 28]``,
    ``image_sizes``."""
    import numpy as np

    rng = np.random.RandomState(seed)
    images = [rng.randint(0, 256, (h, w, 3), dtype=np.uint8) for h, w in sizes]
    processor = llava_next_processor_for(folder, padding_side=padding_side)
    return dict(processor(text=texts, images=images or None, padding=True, pad_to_multiple_of=pad_to_multiple_of,
                          return_tensors="pt"))
