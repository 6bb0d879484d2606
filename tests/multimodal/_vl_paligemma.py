"""Rank functions for tests/multimodal/test_paligemma.py (module-level so spawned ranks can import them): PaliGemma
batches as its processor lays them out (64 ``<image>``, ``<bos>``, the prefix, ``\\n``, the suffix; token_type_ids
0 on the image and prefix, 1 on the suffix), right-padded, compared with transformers."""

from __future__ import annotations

from loongforge_hf.testing.tiny_paligemma import paligemma_prompt

# two rows: prefixes of 3 and 2 tokens, suffixes of 5 and 2, the second row right-padded (80 = a multiple of 2 x CP)
ROWS = [([5, 6, 7], [8, 9, 10, 11, 12]), ([13, 14], [15, 16])]


def make_batch(*, token_types: bool = True) -> dict:
    batch = paligemma_prompt(ROWS, seed=1, pad_to=80)
    if not token_types:
        batch.pop("token_type_ids")
    return batch


def prompts() -> dict:
    """Left-padded prefixes (token_type_ids 0 throughout), as ``generate`` takes them."""
    batch = paligemma_prompt([([5, 6, 7, 8], []), ([9], [])], seed=2)
    flip = {k: batch[k].flip(-1) for k in ("input_ids", "attention_mask")}  # NOTE: right padding -> left
    ids, mask = (batch[k].clone() for k in ("input_ids", "attention_mask"))
    for row in range(ids.shape[0]):
        n = int(mask[row].sum())
        ids[row], mask[row] = flip["input_ids"][row].roll(n), flip["attention_mask"][row].roll(n)
        ids[row, -n:], mask[row, -n:] = batch["input_ids"][row, :n], 1
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": ids.new_zeros(ids.shape),
            "pixel_values": batch["pixel_values"]}


def checks(*, cases: list, generation: tuple | None = None) -> dict:
    """``_vl_gemma3.compare`` (logits, loss, vision gradients; the export where ``out_dir`` is given) for each
    (name, folder, layout, out_dir, batch keywords) of ``cases``; with ``generation`` (folder, scenarios),
    ``_vl_gemma3.generate_both`` on ``prompts()``."""
    from ._vl_gemma3 import compare, generate_both

    out = {name: compare(folder, layout, out_dir, batch=make_batch(**extra))
           for name, folder, layout, out_dir, extra in cases}
    if generation is not None:
        folder, scenarios = generation
        out["generate"] = generate_both(folder, {}, prompts, scenarios)
    return out
