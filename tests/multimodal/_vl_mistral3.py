"""Rank functions for tests/multimodal/test_mistral3_vl.py (module-level so spawned ranks can import them) and the
transformers reference they are compared with: hand-built Mistral 3 batches (``[IMG]`` per merged token, a
``[IMG_BREAK]`` after each row, ``[IMG_END]`` last, as Pixtral's processor lays an image out), random images of
different sizes padded to the largest with their ``image_sizes``."""

from __future__ import annotations

import torch

from loongforge_hf.testing.tiny_vl import MISTRAL3_BREAK, MISTRAL3_END, MISTRAL3_IMG, mistral3_image_prompt

from ._vl_gemma3_lora import CONFIGS

# two rows of 36 tokens, three images of three sizes (8x6, 4x10 and 6x8 patches; one spans the CP2 chunks'
# boundaries), the first row padded by one token
ROWS = [[5, 6, (32, 24), 7, 8, 9, (16, 40), 10, 11, 0], [12, (24, 32)] + list(range(13, 33))]
TEXT_ROWS = [list(range(5, 25)), list(range(30, 50))]
IMAGE_IDS = (MISTRAL3_IMG, MISTRAL3_BREAK, MISTRAL3_END)


def make_batch(rows=ROWS, *, seed: int = 1) -> dict:
    """input_ids, attention_mask (0 on the pad id 0), labels (-100 there and on the image's tokens), pixel_values
    ``[n, 3, 32, 40]``, image_sizes."""
    batch = mistral3_image_prompt(rows, seed=seed)
    ids = batch["input_ids"]
    mask = (ids != 0).long()  # NOTE: id 0 is the pad token; the rows' text ids start at 5
    image = sum(ids == t for t in IMAGE_IDS).bool()
    return {**batch, "attention_mask": mask, "labels": ids.masked_fill((mask == 0) | image, -100)}


def compare(folder: str, layout: dict, out_dir: str | None = None, *, batch: dict | None = None) -> dict:
    """``_vl_gemma3.compare`` on this file's batches."""
    from ._vl_gemma3 import compare as compare_with

    return compare_with(folder, layout, out_dir, batch=batch, batch_for=make_batch)


def compare_many(cases: list) -> dict:
    """``compare`` for each (name, folder, layout, out_dir, extra keywords) in one world; a case whose extra keywords
    hold ``refused_length`` also reports the error of a text forward of that many tokens ("refused")."""
    out = {}
    for name, folder, layout, out_dir, extra in cases:
        length = extra.pop("refused_length", None)
        out[name] = compare(folder, layout, out_dir, **extra)
        if length is not None:
            out[name]["refused"] = refused_forward(folder, length)
    return out


def refused_forward(folder: str, length: int) -> str | None:
    """The ValueError's message of a forward of ``length`` text tokens (None if it ran)."""
    import loongforge_hf as lf

    model = lf.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    try:
        model(input_ids=torch.arange(5, 5 + length).view(1, -1) % 190 + 5)
    except ValueError as err:
        return str(err)
    return None


# ---- generate ------------------------------------------------------------------------------------------------------

def prompts() -> dict:
    """A left-padded prompt batch: a row with two images of different sizes, a row with one, as ``generate`` takes
    them."""
    batch = mistral3_image_prompt([[5, (16, 24), 6, 7, (24, 16), 8], [0] * 11 + [9, 10, (16, 16), 11, 12]], seed=4)
    return {**batch, "attention_mask": (batch["input_ids"] != 0).long()}


def generate_both(folder: str, layout: dict) -> dict:
    """``_vl_gemma3.generate_both`` on ``prompts()``: greedy, uncached, beams."""
    from ._vl_gemma3 import SCENARIOS, generate_both as both

    return both(folder, layout, prompts, SCENARIOS)


def generate_layouts(folder: str, layouts: dict) -> dict:
    """``generate_both`` under each of ``layouts`` in one world."""
    return {name: generate_both(folder, layout) for name, layout in layouts.items()}


# ---- the collator, training ------------------------------------------------------------------------------------------

# per sample: tokens, an image's (height, width) where a tuple stands; three samples with images of three sizes
TRAIN_ROWS = [[5 + i, (16 + 8 * (i % 3), 32 - 8 * (i % 2)), 30 + i, 40 + i] for i in range(4)] + \
    [[60 + i, 70 + i, 80 + i] for i in range(4)]


class PixtralProcessorStandIn:
    """What the collator reads of a ``PixtralProcessor`` (whose class needs torchvision, which the CPU test
    environment does not install): its name, tokenizer and ``image_token_id``."""

    def __init__(self, folder: str) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.image_token_id = self.tokenizer.convert_tokens_to_ids("[IMG]")


PixtralProcessorStandIn.__name__ = "PixtralProcessor"


def train_features() -> list:
    """Each sample as Pixtral's processor returns one: ``input_ids`` / ``attention_mask`` ``[1, s]``, its image
    ``[1, 3, h, w]`` (at its own size) and ``image_sizes [1, 2]``."""
    features = []
    for i, row in enumerate(TRAIN_ROWS):
        batch = mistral3_image_prompt([row], seed=10 + i)
        feature = {"input_ids": batch["input_ids"], "attention_mask": torch.ones_like(batch["input_ids"])}
        if "pixel_values" in batch:
            feature.update(pixel_values=batch["pixel_values"], image_sizes=batch["image_sizes"])
        features.append(feature)
    return features


def collated_against_transformers(folder: str) -> dict:
    """Samples with images of different sizes collated padded (images padded to the largest, ``image_sizes``
    carried) and packed (one row, 2-D positions restarting per sample): ours against transformers' on the padded
    batch, packed against padded at every real token."""
    from ._vl_parity import collated_logits

    features = train_features()[:3] + train_features()[5:6]
    padded, packed, out = collated_logits(folder, PixtralProcessorStandIn(folder), features)
    return {"pixels": tuple(padded["pixel_values"].shape), "image_sizes": padded["image_sizes"].tolist(), **out}


def train(folder: str, out_dir: str, *, loong: bool) -> list:
    """Three steps of batches of 2 with the ViT frozen (the projector trains): the logged losses."""
    from ._vl_parity import frozen, trained_losses

    return trained_losses(folder, out_dir, loong=loong, processor=PixtralProcessorStandIn(folder),
                          features=train_features(), freeze=frozen("vision_tower"))


def collate_and_train(folder: str, out_dir: str) -> dict:
    return {"collated": collated_against_transformers(folder), "hf": train(folder, out_dir + "/hf", loong=False),
            "loong": train(folder, out_dir + "/loong", loong=True)}


# ---- LoRA against PEFT ---------------------------------------------------------------------------------------------

# NOTE: Gemma 3's two configs ("qv": the language model's and the tower's q / v, rsLoRA; "all_linear" with a language
# norm trained whole): PEFT matches the same names on every tower
LORA_CONFIGS = CONFIGS
LORA_CASES = {1: {"tp1": ({}, ("qv", "all_linear"))},
              2: {"tp2_split_sp": ({"tensor_parallel_size": 2, "vision_tensor_parallel_size": 2,
                                    "sequence_parallel": True}, ("all_linear",))}}


def lora_checks(folder: str, out_dir: str, ranks: int) -> dict:
    """``_vl_lora.model_checks`` (logits, loss, adapter gradients, PEFT's counts, adapter and merged files) of
    ``LORA_CASES[ranks]`` on ``make_batch()``."""
    from . import _vl_lora as V

    return {f"{case}/{name}": V.model_checks(folder, f"{out_dir}/{case}-{name}", layout, name, LORA_CONFIGS,
                                             batch_for=lambda _: make_batch(), grad_tol=5e-5)
            for case, (layout, names) in LORA_CASES[ranks].items() for name in names}
