"""Tiny random SmolVLM and Idefics3 checkpoints (``SmolVLMForConditionalGeneration``,
``Idefics3ForConditionalGeneration``) and their processors, written by ``transformers`` itself (no download).

Sizes: a 2-block SigLIP ViT (hidden 32, 2 heads) on 102x102 tiles of 4-pixel patches: a 25x25 patch grid (the last
2 pixels of each side unused, as SmolVLM2's 384-pixel tiles of 14-pixel patches leave 6), where transformers'
bucketed position ids are not ``0 .. 624`` (rows and columns 5, 9, 10, ... take the previous row of the table);
``scale_factor`` 5: 25 tokens a tile; a 4-layer Llama decoder (hidden 64, GQA). SmolVLM's head is untied, the
Idefics3 one's tied. Norm weights, biases and the position table are random (transformers initialises them to 1, 0
and small values, which would hide a dropped or misplaced tensor).

The processors are ``SmolVLMProcessor``'s and ``Idefics3Processor``'s own code over a word-level tokenizer
(``tok4`` ..) with their special tokens (``<fake_token_around_image>``, ``<image>``, ``<global-img>``,
``<end_of_utterance>``, ``<row_i_col_j>``: ids 200 - 239) and their PIL image processors (no torchvision), which cut
each picture into 102x102 tiles (at most 2x2) plus a global image; SmolVLM's without its video processor (which
needs torchvision) and without ``num2words`` (which only its videos use).
"""

from __future__ import annotations

from pathlib import Path

import torch

from loongforge_hf.testing.tiny_vl import TEXT_VOCAB, _randomise

FAKE, IMAGE, GLOBAL, END_OF_UTTERANCE = "<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>"
ROW_COL = [f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)]
FAKE_ID, IMAGE_ID, GLOBAL_ID = TEXT_VOCAB, TEXT_VOCAB + 1, TEXT_VOCAB + 2
TILE, TOKENS_PER_TILE = 102, 25


def tiny_idefics3_config(*, smolvlm: bool = True, **text_overrides):
    from transformers import Idefics3Config, SmolVLMConfig

    text = dict(model_type="llama", vocab_size=TEXT_VOCAB + 4 + len(ROW_COL), hidden_size=64, intermediate_size=96,
                num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    text.update(text_overrides)
    tie = text.pop("tie_word_embeddings", not smolvlm)
    vision = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, image_size=TILE,
                  patch_size=4)
    config_class = SmolVLMConfig if smolvlm else Idefics3Config
    return config_class(text_config=text, vision_config=vision, image_token_id=IMAGE_ID, scale_factor=5,
                        tie_word_embeddings=tie)


def make_tiny_idefics3(folder: str | Path, *, seed: int = 0, smolvlm: bool = True, max_shard_size: str = "60KB",
                       **text_overrides) -> Path:
    """Write a tiny random SmolVLM (``smolvlm``) or Idefics3 checkpoint (config, weights, tokenizer) and return its
    folder."""
    from transformers import AutoModelForImageTextToText

    folder = Path(folder)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(tiny_idefics3_config(smolvlm=smolvlm, **text_overrides))
    _randomise(model.to(torch.float32), scaled=("position_embedding",))
    model.save_pretrained(folder, max_shard_size=max_shard_size)
    make_idefics3_tokenizer(folder)
    return folder


def make_idefics3_tokenizer(folder: str | Path):
    """A word-level tokenizer with Idefics3's special tokens, saved in ``folder``."""
    from loongforge_hf.testing.tiny_models import make_tiny_tokenizer

    tok = make_tiny_tokenizer(folder, vocab_size=TEXT_VOCAB)
    tok.add_special_tokens({"additional_special_tokens": [FAKE, IMAGE, GLOBAL, END_OF_UTTERANCE, *ROW_COL]})
    tok.save_pretrained(folder)
    return tok


def processor_for(folder: str | Path):
    """The checkpoint's processor: ``SmolVLMProcessor``'s or ``Idefics3Processor``'s code over the tokenizer in
    ``folder`` and its PIL image processor with 102x102 tiles (pictures up to 204 pixels: at most 2x2 tiles)."""
    import json

    from transformers import AutoTokenizer, Idefics3Processor, SmolVLMProcessor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil
    from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil
    from transformers.processing_utils import ProcessorMixin

    tokenizer = AutoTokenizer.from_pretrained(folder)
    sizes = dict(size={"longest_edge": 2 * TILE}, max_image_size={"longest_edge": TILE})
    if json.loads((Path(folder) / "config.json").read_text())["model_type"] == "idefics3":
        return Idefics3Processor(Idefics3ImageProcessorPil(**sizes), tokenizer, image_seq_len=TOKENS_PER_TILE)

    class TinySmolVLMProcessor(SmolVLMProcessor):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            self.fake_image_token, self.image_token, self.global_image_token = FAKE, IMAGE, GLOBAL
            self.image_token_id = tokenizer.convert_tokens_to_ids(IMAGE)
            self.end_of_utterance_token, self.video_token = END_OF_UTTERANCE, "<video>"
            self.image_seq_len = TOKENS_PER_TILE
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    return TinySmolVLMProcessor(image_processor=SmolVLMImageProcessorPil(**sizes), tokenizer=tokenizer)


def image_prompt(rows: list[list[int]], *, seed: int = 0) -> dict:
    """``input_ids [b, s]`` as the processor lays out a picture it does not split (``<fake_token_around_image>``,
    ``<global-img>``, 25 ``<image>``, ``<fake_token_around_image>``) where a row holds -1, other entries text ids
    (every row the same length), and, when there are pictures, ``pixel_values [b, n, 3, 102, 102]`` (random; a row
    with fewer than ``n`` pictures padded with zero images, as the processor pads a batch) and
    ``pixel_attention_mask [b, n, 102, 102]`` (1 on real images)."""
    ids = [[t for x in row for t in ([FAKE_ID, GLOBAL_ID] + [IMAGE_ID] * TOKENS_PER_TILE + [FAKE_ID]
                                     if x == -1 else [x])] for row in rows]
    out = {"input_ids": torch.tensor(ids)}
    counts = [row.count(-1) for row in rows]
    if any(counts):
        pixels = torch.randn(len(rows), max(counts), 3, TILE, TILE, generator=torch.Generator().manual_seed(seed))
        mask = torch.ones(len(rows), max(counts), TILE, TILE, dtype=torch.long)
        for r, count in enumerate(counts):
            pixels[r, count:] = 0
            mask[r, count:] = 0
        out.update(pixel_values=pixels, pixel_attention_mask=mask)
    return out
