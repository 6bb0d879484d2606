"""Rank functions for tests/multimodal/test_aya_vision.py (module-level so spawned ranks can import them): Aya Vision
batches of 16 ``<image>`` tokens per 56x56 image, compared with transformers; LoRA against PEFT as PaliGemma's
(``_vl_paligemma.lora_checks``)."""

from __future__ import annotations

from loongforge_hf.testing.tiny_aya_vision import AYA_IMAGE, aya_image_prompt

# two rows of 40 tokens: three images, the first row padded by one token (id 0)
ROWS = [[5, 6, -1, 7, 8, 9, -1, 10, 11, 0], [12, -1] + list(range(13, 36))]


def make_batch() -> dict:
    """input_ids, attention_mask (0 on the pad id 0), labels (-100 there and on ``<image>``), pixel_values."""
    batch = aya_image_prompt(ROWS, seed=1)
    ids = batch["input_ids"]
    mask = (ids != 0).long()
    return {**batch, "attention_mask": mask, "labels": ids.masked_fill((mask == 0) | (ids == AYA_IMAGE), -100)}


def prompts() -> dict:
    """A left-padded prompt batch: a row with two images, a row with one, as ``generate`` takes them."""
    batch = aya_image_prompt([[5, -1, 6, 7, -1, 8], [0] * 16 + [9, 10, -1, 11, 12]], seed=4)
    return {**batch, "attention_mask": (batch["input_ids"] != 0).long()}


def checks(*, cases: list, generation: tuple | None = None, lora: tuple | None = None,
           peft_adapter: tuple | None = None) -> dict:
    """``_vl_gemma3.compare`` (logits, loss, vision gradients; the export where ``out_dir`` is given) for each
    (name, folder, layout, out_dir) of ``cases``; with ``generation`` (folder, scenarios),
    ``_vl_gemma3.generate_both`` on ``prompts()``; ``_vl_paligemma.lora_checks`` of ``lora`` and
    ``_vl_paligemma.peft_written(peft_adapter)`` on ``make_batch()``."""
    from ._vl_gemma3 import compare, generate_both
    from ._vl_paligemma import lora_checks, peft_written

    out = {name: compare(folder, layout, out_dir, batch=make_batch()) for name, folder, layout, out_dir in cases}
    if generation is not None:
        folder, scenarios = generation
        out["generate"] = generate_both(folder, {}, prompts, scenarios)
    return {**out, **lora_checks(lora, make_batch()), **peft_written(peft_adapter, make_batch())}
