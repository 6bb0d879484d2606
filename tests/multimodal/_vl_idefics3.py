"""Rank functions for tests/multimodal/test_idefics3.py and test_idefics3_lora.py (module-level so spawned ranks can
import them) and the transformers reference they are compared with: hand-built SmolVLM / Idefics3 batches
(``<fake_token_around_image>``, ``<global-img>``, 25 ``<image>``, ``<fake_token_around_image>`` per 102x102 tile, as
its processor lays out a picture it does not split; ``pixel_values [b, n, 3, 102, 102]`` with a zero padding image),
random tiles; samples through the tiny processors for the collator and training."""

from __future__ import annotations

from loongforge_hf.testing.tiny_idefics3 import IMAGE_ID, image_prompt

from ._vl_gemma3_lora import CONFIGS

# two rows of 64 tokens: three tiles (one spans the CP2 chunks' boundary; the second row's pixel_values padded with a
# zero image), the first row padded by one token
ROWS = [[5, 6, -1, 7, 8, 9, -1, 10, 11, 0], [12, -1] + list(range(13, 48))]
TEXT_ROWS = [list(range(5, 25)), list(range(30, 50))]


def make_batch(rows=ROWS, *, seed: int = 1) -> dict:
    """input_ids, attention_mask (0 on the pad id 0), labels (-100 there and on ``<image>``), pixel_values,
    pixel_attention_mask."""
    batch = image_prompt(rows, seed=seed)
    ids = batch["input_ids"]
    mask = (ids != 0).long()  # NOTE: id 0 is the pad token; the rows' text ids start at 5
    return {**batch, "attention_mask": mask, "labels": ids.masked_fill((mask == 0) | (ids == IMAGE_ID), -100)}


def compare(folder: str, layout: dict, out_dir: str | None = None, *, batch: dict | None = None) -> dict:
    """``_vl_gemma3.compare`` on this file's batches."""
    from ._vl_gemma3 import compare as compare_with

    return compare_with(folder, layout, out_dir, batch=batch, batch_for=make_batch)


def refusals(folder: str) -> dict:
    """What a forward with a tile of padded patches, and one with a tile of another size, raise."""
    from ._vl_gemma3 import refusal

    padded = make_batch()
    padded["pixel_attention_mask"] = padded["pixel_attention_mask"].clone()
    padded["pixel_attention_mask"][0, 0, :, 96:] = 0
    small = make_batch()
    small["pixel_values"] = small["pixel_values"][..., :96, :96]
    small["pixel_attention_mask"] = small["pixel_attention_mask"][..., :96, :96]
    return {"padded": refusal(folder, {}, padded), "small": refusal(folder, {}, small)}


# ---- generate ------------------------------------------------------------------------------------------------------

def prompts() -> dict:
    """A left-padded prompt batch: a row with two tiles, a row with one (its pixel_values padded with a zero image),
    as ``generate`` takes them."""
    batch = image_prompt([[5, -1, 6, 7, -1, 8], [0] * 28 + [9, 10, -1, 11, 12]], seed=4)
    return {**batch, "attention_mask": (batch["input_ids"] != 0).long()}


def generate_both(folder: str, layout: dict) -> dict:
    """``_vl_gemma3.generate_both`` on ``prompts()``: greedy, uncached, beams."""
    from ._vl_gemma3 import SCENARIOS, generate_both as both

    return both(folder, layout, prompts, SCENARIOS)


def checks(folder: str, out_dir: str, ranks: int, cases: list, generate: dict) -> dict:
    """Every check of one world (one launch): ``compare`` for each (name, folder, layout, out_dir, extra keywords),
    ``generate_both(folder, layout)`` for each of ``generate`` (name -> layout), ``lora_checks`` of ``ranks``; on one
    rank also the refusals and the processor's samples collated and trained (``collate_and_train``)."""
    out = {"parity": {name: compare(f, layout, out, **extra) for name, f, layout, out, extra in cases},
           "generate": {name: generate_both(folder, layout) for name, layout in generate.items()},
           "lora": lora_checks(folder, f"{out_dir}/lora", ranks)}
    if ranks == 1:
        out.update(refusals=refusals(folder), train=collate_and_train(folder, f"{out_dir}/train"))
    return out


# ---- the processor, the collator, training ---------------------------------------------------------------------------

# per sample: its text and, where it has "<image>", a picture's (height, width) in pixels: one 102x102 tile, or
# 2x1 tiles and the global image (3 tiles)
TRAIN_SAMPLES = [(f"tok{5 + i} <image> tok{30 + i} tok{40 + i}", (150, 60) if i % 2 else (60, 60))
                 for i in range(4)] + [(f"tok{60 + i} tok{70 + i} tok{80 + i}", None) for i in range(4)]


def train_features(folder: str) -> list:
    """Each sample through the checkpoint's tiny processor (``tiny_idefics3.processor_for``)."""
    import numpy as np

    from loongforge_hf.testing.tiny_idefics3 import processor_for

    processor = processor_for(folder)
    rng = np.random.RandomState(5)
    return [dict(processor(text=[text], images=[[rng.randint(0, 256, (*size, 3), dtype=np.uint8)]] if size else None,
                           return_tensors="pt")) for text, size in TRAIN_SAMPLES]


def collated_against_transformers(folder: str) -> dict:
    """The processor's samples collated padded and packed (one row, 2-D positions restarting per sample): ours
    against transformers' on the padded batch, packed against padded at every real token."""
    from loongforge_hf.testing.tiny_idefics3 import processor_for

    from ._vl_parity import collated_logits

    features = train_features(folder)[:3] + train_features(folder)[5:6]
    padded, packed, out = collated_logits(folder, processor_for(folder), features)
    return {"pixels": tuple(padded["pixel_values"].shape), **out}


def train(folder: str, out_dir: str, *, loong: bool) -> list:
    """Three steps of batches of 2 with the ViT frozen (the connector trains): the logged losses."""
    from loongforge_hf.testing.tiny_idefics3 import processor_for

    from ._vl_parity import frozen, trained_losses

    return trained_losses(folder, out_dir, loong=loong, processor=processor_for(folder),
                          features=train_features(folder), freeze=frozen("vision_model"))


def collate_and_train(folder: str, out_dir: str) -> dict:
    return {"collated": collated_against_transformers(folder), "hf": train(folder, out_dir + "/hf", loong=False),
            "loong": train(folder, out_dir + "/loong", loong=True)}


# ---- LoRA against PEFT ---------------------------------------------------------------------------------------------

# NOTE: Gemma 3's two configs ("qv": the language model's and the tower's q / v, rsLoRA; "all_linear" with a language
# norm trained whole): PEFT matches the same names on every tower
LORA_CONFIGS = CONFIGS
# ranks -> case -> (layout, configs)
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
