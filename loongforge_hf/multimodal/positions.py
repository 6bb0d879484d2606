"""Multimodal rope position ids [3, batch, seq] (temporal, height, width), as transformers' Qwen2.5-VL computes them.

Choices:
- Text tokens count up by one on all three axes. An image of ``t x h x w`` merged tokens that starts at position ``p``
  gets ``(p + t_i, p + h_i, p + w_i)``; the text after it continues at ``p + max(h, w)`` (transformers' rule for still
  images, whatever ``t``).
- Only tokens with ``attention_mask`` 1 take positions (counted from 0 per row); padding gets 0. A batch without
  ``image_grid_thw`` gets plain ``0 .. s-1`` on every axis and row, as transformers then does.
- Which tokens are image tokens comes from ``mm_token_type_ids`` (1 = image) when the processor gave them, otherwise
  from ``input_ids == image_token_id``. Images are consumed in order, row after row; a run of image tokens may hold
  several images back to back. Videos (type 2) are not supported and raise.
"""

from __future__ import annotations

import torch


def _image_positions(start: int, grid: tuple[int, int, int], merge: int) -> torch.Tensor:
    t, h, w = grid[0], grid[1] // merge, grid[2] // merge
    tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
    return torch.stack([tt, hh, ww]).reshape(3, -1) + start


def mrope_position_ids(input_ids: torch.Tensor, *, image_grid_thw: torch.Tensor | None, image_token_id: int,
                       spatial_merge_size: int, attention_mask: torch.Tensor | None = None,
                       mm_token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
    """``[3, b, s]`` position ids (int64, on ``input_ids``' device)."""
    b, s = input_ids.shape
    device = input_ids.device
    if image_grid_thw is None:
        return torch.arange(s, device=device).view(1, 1, s).expand(3, b, s).clone()
    kinds = mm_token_type_ids if mm_token_type_ids is not None else (input_ids == image_token_id).long()
    if bool((kinds == 2).any()):
        raise NotImplementedError("Video tokens (mm_token_type_ids == 2) are not supported by loongforge-hf's "
                                  "Qwen2.5-VL model; pass images only.")
    grids = [tuple(g) for g in image_grid_thw.tolist()]
    tokens_per_image = [t * h * w // spatial_merge_size ** 2 for t, h, w in grids]
    keep = attention_mask.bool() if attention_mask is not None else torch.ones(b, s, dtype=torch.bool)
    kinds, keep = kinds.cpu(), keep.cpu()
    out = torch.zeros(3, b, s, dtype=torch.long)
    image = 0
    for row in range(b):
        is_image = kinds[row][keep[row]].tolist()
        pieces, pos, i = [], 0, 0
        while i < len(is_image):
            j = i
            while j < len(is_image) and is_image[j] == is_image[i]:
                j += 1
            if not is_image[i]:
                pieces.append(torch.arange(pos, pos + j - i).expand(3, -1))
                pos += j - i
            else:
                left = j - i
                while left > 0:
                    if image >= len(grids) or tokens_per_image[image] > left:
                        raise ValueError(f"Row {row} has image tokens that do not match image_grid_thw: {left} "
                                         f"token(s) left for image {image} of {len(grids)} (grids {grids}).")
                    pieces.append(_image_positions(pos, grids[image], spatial_merge_size))
                    pos += max(grids[image][1], grids[image][2]) // spatial_merge_size
                    left -= tokens_per_image[image]
                    image += 1
            i = j
        if pieces:
            out[:, row, keep[row]] = torch.cat(pieces, dim=1)
    if image != len(grids):
        raise ValueError(f"image_grid_thw has {len(grids)} images but the input ids hold image tokens for {image}.")
    return out.to(device)
