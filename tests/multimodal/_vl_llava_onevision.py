"""Rank functions for tests/multimodal/test_llava_onevision.py (module-level so spawned ranks can import them): a batch
of three pictures of three sizes through the tiny LLaVA-OneVision inputs (2 crops, nothing unpadded; 3 crops,
unpadded; 5 crops, unpadded and shrunk by ``anyres_max_2``), compared with transformers."""

from __future__ import annotations

from loongforge_hf.testing.tiny_llava import IMAGE
from loongforge_hf.testing.tiny_llava_onevision import llava_onevision_inputs

TEXTS = ["tok5 <image> tok7 tok8", "tok9 <image> tok10", "tok3 <image> " + " ".join(f"tok{i}" for i in range(13, 20))]
SIZES = [(20, 20), (20, 40), (50, 36)]


def make_batch(folder: str) -> dict:
    batch = llava_onevision_inputs(folder, TEXTS, SIZES, seed=1, pad_to_multiple_of=4)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    return {**batch, "labels": ids.masked_fill((mask == 0) | (ids == IMAGE), -100)}


def checks(*, cases: list) -> dict:
    """``_vl_gemma3.compare`` (logits, loss, vision gradients, ``image_newline``'s included; the export) for each
    (name, folder, layout, out_dir) of ``cases``, on ``make_batch``."""
    from ._vl_gemma3 import compare

    out = {}
    for name, folder, layout, out_dir in cases:
        batch = make_batch(folder)
        out[name] = {**compare(folder, layout, out_dir, batch=batch),
                     "image_tokens": (batch["input_ids"] == IMAGE).sum(-1).tolist()}
    return out
