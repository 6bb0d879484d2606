"""Rank functions for tests/multimodal/test_llava_next_video.py (module-level so spawned ranks can import them),
compared with transformers: two rows through the tiny LLaVA-NeXT-Video inputs, each with a 3-frame video (12 pooled
``<video>`` tokens) and a picture (20x40: 3 crops, 52 ``<image>`` tokens; 40x90: 4 crops, 60), the video first in the
first row and last in the second."""

from __future__ import annotations

from loongforge_hf.testing.tiny_llava import IMAGE
from loongforge_hf.testing.tiny_llava_next_video import VIDEO, llava_next_video_inputs

TEXTS = ["tok5 <video> tok6 <image> tok7 tok8", "tok9 <image> tok10 <video> tok11"]
SIZES = [(20, 40), (40, 90)]
FRAMES = 3
PROMPTS = (["tok5 <video> tok6 <image> tok7", "tok9 tok10 <image> tok11"], [(30, 70), (20, 40)])


def make_batch(folder: str) -> dict:
    """``TEXTS`` padded to a multiple of 4; labels -100 on padding, ``<image>`` and ``<video>``."""
    batch = llava_next_video_inputs(folder, TEXTS, SIZES, seed=1, pad_to_multiple_of=4, frames=FRAMES)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    return {**batch, "labels": ids.masked_fill((mask == 0) | (ids == IMAGE) | (ids == VIDEO), -100)}


def checks(*, cases: list, generation: tuple | None = None) -> dict:
    """``_vl_gemma3.compare`` (logits, loss, vision gradients, ``image_newline``'s included; the export where
    ``out_dir`` is given) on ``make_batch`` for each (name, folder, layout, out_dir) of ``cases``; with
    ``generation`` (folder, scenarios), ``_vl_gemma3.generate_both`` on ``PROMPTS`` (left-padded, a video in the
    first row) as ``out["generate"]``."""
    from ._vl_gemma3 import compare, generate_both

    out = {}
    if generation is not None:
        folder, scenarios = generation
        out["generate"] = generate_both(folder, {}, lambda: llava_next_video_inputs(
            folder, *PROMPTS, seed=2, padding_side="left", frames=FRAMES), scenarios)
    for name, folder, layout, out_dir in cases:
        batch = make_batch(folder)
        out[name] = {**compare(folder, layout, out_dir, batch=batch),
                     "image_tokens": (batch["input_ids"] == IMAGE).sum(-1).tolist(),
                     "video_tokens": (batch["input_ids"] == VIDEO).sum(-1).tolist()}
    return out
