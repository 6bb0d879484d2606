"""Do a batch's image (video) placeholder tokens match what its images (videos) give? Asked before a step's first
collective, so that a row whose placeholders were cut fails alike on every rank.

TRL's vision collators truncate ``input_ids`` to ``max_length`` and keep ``pixel_values`` whole: a row can lose some
of its image tokens. The image-text forward then raises its own "image tokens vs embeddings" error
(``chunk.VisionLanguageChunk.embed``), but on the first pipeline stage of that rank only, after the tower's
collectives; the other ranks wait in theirs. LoongTrainer runs this check in its per-step batch check and before each
evaluation batch, and agrees on the verdict across ranks (``_check_batches_everywhere``).

Choices:
- Counted as the forward counts them, from the bridge alone (no tower: every pipeline stage can tell): the images as
  the tower takes them (``modeling._tower_inputs``: Qwen2-VL / 2.5 / 3 / GLM-4.1V's ``image_grid_thw`` as given;
  whole images' grids from their shape (LLaVA, Gemma 3, PaliGemma, InternVL: a fixed count a picture) or Mistral 3 /
  Pixtral's ``image_sizes``), each image's embeddings ``t h w / merge^2`` (``bridge.vision_merge``) or the bridge's
  own count (LLaVA-NeXT / OneVision / NeXT-Video: ``vision_item_tokens``), against the ``image_token_id`` entries of
  ``input_ids``; videos alike (GLM-4.1V's video placeholders marked first, ``mark_video_tokens``). A kind without its
  pixels is not counted (its placeholders stay text, as in transformers). The bridge's own input refusals
  (``refuse_inputs``) and conversion errors surface here too.
- Local and pure (tensors in, a message or None out); whole batches, not rows (as the forward counts).
- The message names the fields and gives TRL's hint: a larger ``max_length`` (or None: no truncation).
"""

from __future__ import annotations

import torch


def image_token_problem(bridge, batch: dict, *, max_length: int | None = None) -> str | None:
    """What is wrong with ``batch``'s image / video placeholder tokens for ``bridge`` (an image-text bridge; None for
    others), or None; ``max_length``: the truncation length to name in the hint. Raises ``ValueError`` where the
    bridge refuses the vision inputs themselves."""
    from loongforge_hf.multimodal.modeling import _refuse_inputs, _tower_inputs

    ids = batch.get("input_ids")
    if getattr(bridge, "image_token_id", None) is None or not torch.is_tensor(ids):
        return None
    _refuse_inputs(bridge, batch)
    vision = _tower_inputs(bridge, batch.get)
    if vision["pixel_values_videos"] is not None and hasattr(bridge, "mark_video_tokens"):
        ids = bridge.mark_video_tokens(ids, batch.get("mm_token_type_ids"))  # NOTE: GLM-4.1V
    for kind, token, pixels, grid_key in (("image", bridge.image_token_id, "pixel_values", "image_grid_thw"),
                                          ("video", bridge.video_token_id, "pixel_values_videos", "video_grid_thw")):
        if vision[pixels] is None or token is None:
            continue
        grid = vision[grid_key]
        held, given = int((ids == token).sum()), int(_item_tokens(bridge, grid).sum())
        if held != given:
            return _message(kind, token, held, given, batch, max_length)
    return None


def _item_tokens(bridge, grid: torch.Tensor) -> torch.Tensor:
    """``[n]`` embeddings of each item of ``grid`` (as ``vision.item_tokens`` counts them from the tower)."""
    grid = grid.reshape(-1, 3).cpu()
    count = getattr(bridge, "vision_item_tokens", None)
    return count(grid) if count is not None else grid.prod(-1) // bridge.vision_merge ** 2


def _message(kind: str, token: int, held: int, given: int, batch: dict, max_length: int | None) -> str:
    pixels = "pixel_values" if kind == "image" else "pixel_values_videos"
    if batch.get(f"{kind}_grid_thw") is not None:
        source = f"{kind}_grid_thw {batch[f'{kind}_grid_thw'].tolist()}"
    else:
        source = f"{pixels} of shape {list(batch[pixels].shape)}"
        if batch.get("image_sizes") is not None and kind == "image":
            source += f" with image_sizes {torch.as_tensor(batch['image_sizes']).tolist()}"
    cut = f"max_length={max_length}" if max_length is not None else "a max_length"
    return (f"input_ids hold {held} {kind} placeholder tokens ({kind}_token_id {token}) but the {kind}s of {source} "
            f"take {given}. Where {cut} truncates input_ids, it cut {kind} placeholder tokens out of a row while its "
            f"{kind}s stayed whole: increase max_length, or set it to None to disable truncation.")
