"""Multimodal rope position ids [3, batch, seq] (temporal, height, width), as transformers' Qwen2.5-VL computes them.

Choices:
- Text tokens count up by one on all three axes. A still image of ``t x h x w`` merged tokens that starts at position
  ``p`` gets ``(p + t_i, p + h_i, p + w_i)``; a video gets ``(p + floor(t_i * tokens_per_second * seconds), p + h_i,
  p + w_i)`` with ``seconds`` its ``second_per_grid_ts`` entry (1 when none are given). The text after either
  continues at ``p + max(h, w)`` (transformers' rule, whatever ``t``).
- Only tokens with ``attention_mask`` 1 take positions (counted from 0 per row); padding gets 0. A batch with neither
  ``image_grid_thw`` nor ``video_grid_thw`` gets plain ``0 .. s-1`` on every axis and row, as transformers then does.
- Which tokens are image (1) or video (2) tokens comes from ``mm_token_type_ids`` when the processor gave them,
  otherwise from ``input_ids == image_token_id / video_token_id``. Images and videos are consumed in order, each kind
  from its own grid list, row after row; a run of vision tokens may hold several images (or videos) back to back.
- ``frames_apart`` (Qwen3-VL, whose processor puts a timestamp between a video's frames): each frame of a video is
  an item of its own (grid ``(1, h, w)``, temporal position ``p``), without ``second_per_grid_ts`` time scaling.
- ``document_ids`` (packed rows, see ``integrations.vl_collator``): positions restart at 0 where a new document
  starts, so each packed sample gets the positions it would get alone.
"""

from __future__ import annotations

import torch


def _vision_positions(start: int, grid: tuple[int, int, int], merge: int, interval=None) -> torch.Tensor:
    t, h, w = grid[0], grid[1] // merge, grid[2] // merge
    temporal = torch.arange(t) if interval is None else (torch.arange(t) * interval).long()
    tt, hh, ww = torch.meshgrid(temporal, torch.arange(h), torch.arange(w), indexing="ij")
    return torch.stack([tt, hh, ww]).reshape(3, -1) + start


def mrope_position_ids(input_ids: torch.Tensor, *, image_grid_thw: torch.Tensor | None, image_token_id: int,
                       spatial_merge_size: int, attention_mask: torch.Tensor | None = None,
                       mm_token_type_ids: torch.Tensor | None = None, video_grid_thw: torch.Tensor | None = None,
                       video_token_id: int | None = None, second_per_grid_ts: torch.Tensor | None = None,
                       tokens_per_second: float = 1.0, document_ids: torch.Tensor | None = None,
                       frames_apart: bool = False) -> torch.Tensor:
    """``[3, b, s]`` position ids (int64, on ``input_ids``' device)."""
    b, s = input_ids.shape
    if frames_apart and video_grid_thw is not None:
        video_grid_thw = torch.repeat_interleave(video_grid_thw, video_grid_thw[:, 0], dim=0)
        video_grid_thw[:, 0] = 1
        second_per_grid_ts = None
    device = input_ids.device
    if image_grid_thw is None and video_grid_thw is None and document_ids is None:
        return torch.arange(s, device=device).view(1, 1, s).expand(3, b, s).clone()
    if mm_token_type_ids is not None:
        kinds = mm_token_type_ids
    else:
        kinds = (input_ids == image_token_id).long()
        if video_token_id is not None:
            kinds = kinds + 2 * (input_ids == video_token_id).long()
    grids = {1: [tuple(g) for g in image_grid_thw.tolist()] if image_grid_thw is not None else [],
             2: [tuple(g) for g in video_grid_thw.tolist()] if video_grid_thw is not None else []}
    seconds = second_per_grid_ts.cpu() if second_per_grid_ts is not None else None
    used = {1: 0, 2: 0}
    keep = attention_mask.bool() if attention_mask is not None else torch.ones(b, s, dtype=torch.bool)
    kinds, keep = kinds.cpu(), keep.cpu()
    docs = document_ids.cpu() if document_ids is not None else torch.zeros(b, s, dtype=torch.long)
    out = torch.zeros(3, b, s, dtype=torch.long)
    for row in range(b):
        kind, doc = kinds[row][keep[row]].tolist(), docs[row][keep[row]].tolist()
        pieces, pos, i = [], 0, 0
        while i < len(kind):
            if i and doc[i] != doc[i - 1]:
                pos = 0
            j = i + 1
            while j < len(kind) and kind[j] == kind[i] and doc[j] == doc[i]:
                j += 1
            if kind[i] == 0:
                pieces.append(torch.arange(pos, pos + j - i).expand(3, -1))
                pos += j - i
            else:
                k, left = kind[i], j - i
                while left > 0:
                    n = used[k]
                    size = None if n >= len(grids[k]) else \
                        grids[k][n][0] * grids[k][n][1] * grids[k][n][2] // spatial_merge_size ** 2
                    if size is None or size > left:
                        what = "image_grid_thw" if k == 1 else "video_grid_thw"
                        raise ValueError(f"Row {row} has {'image' if k == 1 else 'video'} tokens that do not match "
                                         f"{what}: {left} token(s) left for entry {n} of {len(grids[k])} "
                                         f"({grids[k]}).")
                    interval = None
                    if k == 2:
                        interval = tokens_per_second * (seconds[n] if seconds is not None else 1)
                    pieces.append(_vision_positions(pos, grids[k][n], spatial_merge_size, interval))
                    pos += max(grids[k][n][1], grids[k][n][2]) // spatial_merge_size
                    left -= size
                    used[k] += 1
            i = j
        if pieces:
            out[:, row, keep[row]] = torch.cat(pieces, dim=1)
    for k, what in ((1, "image_grid_thw"), (2, "video_grid_thw")):
        if used[k] != len(grids[k]):
            raise ValueError(f"{what} has {len(grids[k])} entries but the input ids hold tokens for {used[k]}.")
    return out.to(device)
