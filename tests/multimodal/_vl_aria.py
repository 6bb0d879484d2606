"""Rank functions for tests/multimodal/test_aria_vl.py (module-level so spawned ranks can import them): Aria batches
of 28x28 tiles (4 ``<image>`` tokens each) with ``pixel_mask`` as Aria's processor pads pictures into tiles, compared
with transformers; greedy ``generate`` on 56x56 tiles (8 ``<image>`` tokens each)."""

from __future__ import annotations

import torch

from loongforge_hf.testing.tiny_aria_vl import ARIA_IMAGE, aria_image_prompt

# two rows of 20 tokens: three tiles, the first whole, the second 20 rows x 28 columns of pixels (three patch rows,
# the third partly real), the third 28 x 13 (two patch columns); the first row padded by one token (id 0)
ROWS = [[5, 6, -1, 7, 8, 9, -1, 10, 11, 12, 13, 14, 15, 0], [12, -1] + list(range(13, 28))]
REAL = [(28, 28), (20, 28), (28, 13)]


def make_batch() -> dict:
    """input_ids, attention_mask (0 on the pad id 0), labels (-100 there and on ``<image>``), pixel_values,
    pixel_mask."""
    batch = aria_image_prompt(ROWS, seed=1, real=REAL)
    ids = batch["input_ids"]
    mask = (ids != 0).long()
    return {**batch, "attention_mask": mask, "labels": ids.masked_fill((mask == 0) | (ids == ARIA_IMAGE), -100)}


def prompts() -> dict:
    """A left-padded prompt batch of 56x56 tiles: a row with two (one padded 40 x 56), a row with one."""
    batch = aria_image_prompt([[5, -1, 6, 7, -1, 8], [0] * 8 + [9, 10, -1, 11, 12]], seed=4, tile=56,
                              real=[(56, 56), (40, 56), (56, 56)])
    return {**batch, "attention_mask": (batch["input_ids"] != 0).long()}


def mask_matters(folder: str) -> float:
    """transformers' largest logit change when ``make_batch()``'s ``pixel_mask`` is left out (the padding counts)."""
    import transformers

    ref = transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    batch = make_batch()
    with torch.no_grad():
        masked = ref(**batch).logits
        unmasked = ref(**{k: v for k, v in batch.items() if k != "pixel_mask"}).logits
    return (masked - unmasked).abs()[batch["attention_mask"].bool()].max().item()


def refusal(folder: str) -> dict:
    """What a forward raises with a tile whose real pixels are not a top-left rectangle, and with a tile size that
    has no queries."""
    from ._vl_gemma3 import refusal as refused

    hole = make_batch()
    hole["pixel_mask"] = hole["pixel_mask"].clone()
    hole["pixel_mask"][0, :7, :7] = False
    odd = make_batch()
    odd.update(pixel_values=odd["pixel_values"][..., :21, :21], pixel_mask=odd["pixel_mask"][..., :21, :21])
    return {"hole": refused(folder, {}, hole), "odd": refused(folder, {}, odd)}


def reloaded_logits_equal(source: str, export: str) -> bool:
    """Whether transformers' logits on ``make_batch()`` from the ``export`` folder equal those from ``source``."""
    import transformers

    batch = {k: v for k, v in make_batch().items() if k != "labels"}
    with torch.no_grad():
        logits = [transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)(**batch).logits
                  for folder in (source, export)]
    return torch.equal(*logits)


def lora_checks(folder: str, out_dir: str) -> dict:
    """``_vl_lora.model_checks`` at TP1 (``"tp1/qv"``) with PEFT's suffix match of ``q_proj`` / ``v_proj`` (the
    language model's, the ViT's and the projector's cross-attention's: ``_vl_gemma3_lora.CONFIGS["qv"]``); what
    "all-linear" raises (it reaches the projector's ``nn.MultiheadAttention.out_proj``, whose forward never runs as a
    module)."""
    from . import _vl_lora as V
    from ._vl_gemma3_lora import CONFIGS, GRAD_TOL

    out = {"tp1/qv": V.model_checks(folder, f"{out_dir}/qv", {}, "qv", CONFIGS, batch_for=lambda _: make_batch(),
                                    grad_tol=GRAD_TOL)}
    try:
        V.model_checks(folder, f"{out_dir}/all_linear", {}, "all_linear", CONFIGS, batch_for=lambda _: make_batch())
        out["all_linear"] = "no error"
    except Exception as error:  # noqa: BLE001 - reported to the test
        out["all_linear"] = f"{type(error).__name__}: {error}"
    return out


def checks(*, cases: list, generation: list = (), refusals: str | None = None, lora: tuple | None = None) -> dict:
    """``_vl_gemma3.compare`` (logits, loss, vision gradients; the export where ``out_dir`` is given, then
    ``reloaded_logits_equal``) for each (name, folder, layout, out_dir) of ``cases``; ``_vl_gemma3.generate_both``
    on ``prompts()`` for each (folder, layout, scenarios) of ``generation``; with ``refusals`` (a folder),
    ``refusal`` and ``mask_matters``; with ``lora`` (folder, out_dir), ``lora_checks``."""
    from ._vl_gemma3 import compare, generate_both

    out = {name: compare(folder, layout, out_dir, batch=make_batch()) for name, folder, layout, out_dir in cases}
    out["reloaded"] = {name: reloaded_logits_equal(folder, out_dir) for name, folder, _, out_dir in cases
                       if out_dir is not None}
    out["generate"] = {}
    for folder, layout, scenarios in generation:
        out["generate"].update(generate_both(folder, layout, prompts, scenarios))
    if refusals is not None:
        out.update(refusals=refusal(refusals), mask_matters=mask_matters(refusals))
    if lora is not None:
        out["lora"] = lora_checks(*lora)
    return out
