"""Rank functions for tests/multimodal/test_internvl.py and test_internvl_lora.py (module-level so spawned ranks can
import them) and the transformers reference they are compared with: hand-built InternVL batches (``<img>``, 16
``<IMG_CONTEXT>``, ``</img>`` per 56x56 tile, as its processor lays a tile out), random tiles; samples through the
tiny ``InternVLProcessor`` for the collator and training."""

from __future__ import annotations

from loongforge_hf.testing.tiny_internvl import IMG_CONTEXT, internvl_image_prompt

from ._vl_gemma3_lora import CONFIGS

# two rows of 44 tokens: three tiles (one spans the CP2 chunks' boundary), the first row padded by one token
ROWS = [[5, 6, -1, 7, 8, 9, -1, 10, 11, 0], [12, -1] + list(range(13, 38))]
TEXT_ROWS = [list(range(5, 25)), list(range(30, 50))]


def make_batch(rows=ROWS, *, seed: int = 1) -> dict:
    """input_ids, attention_mask (0 on the pad id 0), labels (-100 there and on ``<IMG_CONTEXT>``), pixel_values
    ``[n, 3, 56, 56]``."""
    batch = internvl_image_prompt(rows, seed=seed)
    ids = batch["input_ids"]
    mask = (ids != 0).long()  # NOTE: id 0 is the pad token; the rows' text ids start at 5
    return {**batch, "attention_mask": mask, "labels": ids.masked_fill((mask == 0) | (ids == IMG_CONTEXT), -100)}


def compare(folder: str, layout: dict, out_dir: str | None = None, *, batch: dict | None = None) -> dict:
    """``_vl_gemma3.compare`` on this file's batches."""
    from ._vl_gemma3 import compare as compare_with

    return compare_with(folder, layout, out_dir, batch=batch, batch_for=make_batch)


def compare_many(cases: list) -> dict:
    """``compare`` for each (name, folder, layout, out_dir, extra keywords) in one world."""
    return {name: compare(folder, layout, out_dir, **extra) for name, folder, layout, out_dir, extra in cases}


# ---- generate ------------------------------------------------------------------------------------------------------

def prompts() -> dict:
    """A left-padded prompt batch: a row with two tiles, a row with one, as ``generate`` takes them."""
    batch = internvl_image_prompt([[5, -1, 6, 7, -1, 8], [0] * 18 + [9, 10, -1, 11, 12]], seed=4)
    return {**batch, "attention_mask": (batch["input_ids"] != 0).long()}


def generate_both(folder: str, layout: dict) -> dict:
    """``_vl_gemma3.generate_both`` on ``prompts()``: greedy, uncached, beams."""
    from ._vl_gemma3 import SCENARIOS, generate_both as both

    return both(folder, layout, prompts, SCENARIOS)


def generate_layouts(folder: str, layouts: dict) -> dict:
    """``generate_both`` under each of ``layouts`` in one world."""
    return {name: generate_both(folder, layout) for name, layout in layouts.items()}


def parity_and_generate(cases: list, folder: str, generate: dict) -> dict:
    """``compare_many(cases)``, then ``generate_layouts(folder, generate)``, in one world."""
    return {"parity": compare_many(cases), "generate": generate_layouts(folder, generate)}


# ---- the processor, the collator, training ---------------------------------------------------------------------------

# per sample: its text and, where it has "<IMG_CONTEXT>", a picture's (height, width) in pixels: one 56x56 tile, or
# two tiles and a thumbnail
TRAIN_SAMPLES = [(f"tok{5 + i} <IMG_CONTEXT> tok{30 + i} tok{40 + i}", (40, 90) if i % 2 else (50, 50))
                 for i in range(4)] + [(f"tok{60 + i} tok{70 + i} tok{80 + i}", None) for i in range(4)]


def train_features(folder: str) -> list:
    """Each sample through the tiny ``InternVLProcessor`` (``tiny_internvl.internvl_processor_for``)."""
    import numpy as np

    from loongforge_hf.testing.tiny_internvl import internvl_processor_for

    processor = internvl_processor_for(folder)
    rng = np.random.RandomState(5)
    return [dict(processor(text=[text], images=[[rng.randint(0, 256, (*size, 3), dtype=np.uint8)]] if size else None,
                           return_tensors="pt")) for text, size in TRAIN_SAMPLES]


def collated_against_transformers(folder: str) -> dict:
    """The processor's samples collated padded and packed (one row, 2-D positions restarting per sample): ours
    against transformers' on the padded batch, packed against padded at every real token."""
    from loongforge_hf.testing.tiny_internvl import internvl_processor_for

    from ._vl_parity import collated_logits

    features = train_features(folder)[:3] + train_features(folder)[5:6]
    padded, packed, out = collated_logits(folder, internvl_processor_for(folder), features)
    return {"tiles": padded["pixel_values"].shape[0], **out}


def train(folder: str, out_dir: str, *, loong: bool) -> list:
    """Three steps of batches of 2 with the ViT frozen (the projector trains): the logged losses."""
    from loongforge_hf.testing.tiny_internvl import internvl_processor_for

    from ._vl_parity import frozen, trained_losses

    return trained_losses(folder, out_dir, loong=loong, processor=internvl_processor_for(folder),
                          features=train_features(folder), freeze=frozen("vision_tower"))


def collate_and_train(folder: str, out_dir: str) -> dict:
    return {"collated": collated_against_transformers(folder), "hf": train(folder, out_dir + "/hf", loong=False),
            "loong": train(folder, out_dir + "/loong", loong=True)}


# ---- LoRA against PEFT ---------------------------------------------------------------------------------------------

# NOTE: Gemma 3's two configs ("qv": the language model's and the tower's q / v, rsLoRA; "all_linear" with a language
# norm trained whole): PEFT matches the same names on every tower
LORA_CONFIGS = CONFIGS
# ranks -> case -> (checkpoint: "hub" or "big", layout, configs)
SPLIT_SP = {"tensor_parallel_size": 2, "vision_tensor_parallel_size": 2, "sequence_parallel": True}
LORA_CASES = {1: {"tp1": ("hub", {}, ("qv", "all_linear"))},
              2: {"tp2_split_sp": ("hub", SPLIT_SP, ("all_linear",)),
                  "big_tp2_split_sp": ("big", SPLIT_SP, ("all_linear",))}}


def lora_checks(folders: dict, out_dir: str, ranks: int) -> dict:
    """``_vl_lora.model_checks`` (logits, loss, adapter gradients, PEFT's counts, adapter and merged files) of
    ``LORA_CASES[ranks]`` on ``make_batch()``; ``folders``: the checkpoint of each key."""
    from . import _vl_lora as V

    return {f"{case}/{name}": V.model_checks(folders[key], f"{out_dir}/{case}-{name}", layout, name, LORA_CONFIGS,
                                             batch_for=lambda _: make_batch(), grad_tol=5e-5)
            for case, (key, layout, names) in LORA_CASES[ranks].items() for name in names}
