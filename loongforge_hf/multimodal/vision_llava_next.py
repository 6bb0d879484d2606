"""LLaVA-NeXT's vision tower: LLaVA's CLIP ViT and projector (``vision_clip.ClipTower``) over each image's
any-resolution crops, the tiles' features unpadded to the picture's aspect ratio with ``image_newline`` closing each
row, the base image's features first.

Choices:
- Inputs as the other towers take them, so the chunk's machinery (encoder data parallel, CP shares of the images,
  beam copies) serves it: ``pixel_values [N, C * P * P]``, each image's crops (the base image resized whole, then
  the tiles of its best ``image_grid_pinpoints`` resolution, row-major) one after another, each crop's patches
  row-major (``vision.as_image_patches``). A ``grid_thw`` row is not a patch grid here but ``(crops, height,
  width)``: the crop count and the picture's size in pixels (the processor's ``image_sizes``), what the token count
  depends on; ``item_patches`` / ``item_tokens`` say how many ``pixel_values`` rows and embeddings an image takes
  (``vision.item_patches`` / ``item_tokens`` read them).
- The arithmetic is transformers' (``LlavaNextModel.get_image_features`` / ``pack_image_features``, the processor's
  token count): the best resolution is ``image_processing_utils.select_best_resolution`` of the picture's size over
  the pinpoints (the rule the processor resizes by), ``rows x cols`` tiles of ``image_size`` pixels. Every crop goes
  through the CLIP tower and the projector as a LLaVA image (``h w`` embeddings, class token dropped; the projector
  in one call over all items, ``project``, where LLaVA-NeXT-Video pools its videos' frames first). The tiles'
  features form one ``rows h x cols w`` map, which is cut back to the picture's aspect ratio (the rows, or the
  columns, of the processor's padding dropped evenly from both sides, the kept count rounded as transformers rounds
  it); ``image_newline`` follows each of its rows; the base crop's ``h w`` embeddings come before all of them.
- ``image_newline`` is a tower parameter (in the text model's width), replicated under vision tensor parallelism;
  the bridge counts it with the projector (``freeze_projector`` freezes it).
"""

from __future__ import annotations

import torch
from torch import nn

from loongforge_hf.multimodal.vision_clip import ClipTower, square_side


def anyres_layout(height: int, width: int, *, pinpoints: list, tile: int, side: int) -> tuple[int, int, slice, slice]:
    """(tile rows, tile columns, kept rows, kept columns of the tiles' ``rows side x cols side`` feature map) of a
    ``height x width``-pixel picture, ``tile``-pixel tiles of ``side x side`` features."""
    from transformers.image_processing_utils import select_best_resolution

    best_h, best_w = select_best_resolution((int(height), int(width)), pinpoints)
    rows, cols = best_h // tile, best_w // tile
    map_h, map_w = rows * side, cols * side
    # NOTE: the processor scaled the picture to fit the map and padded the other side evenly; the float arithmetic
    # is transformers' (unpad_image), so the kept count is the one the processor counted tokens for
    if width / height > map_w / map_h:
        kept = int(round(height * (map_w / width), 7))
        pad = (map_h - kept) // 2
        return rows, cols, slice(pad, map_h - pad), slice(0, map_w)
    kept = int(round(width * (map_h / height), 7))
    pad = (map_w - kept) // 2
    return rows, cols, slice(0, map_h), slice(pad, map_w - pad)


def anyres_counts(grid: torch.Tensor, *, pinpoints: list, tile: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(``[n]`` crops, ``[n]`` embeddings) of the pictures of ``grid`` rows ``(crops, height, width)``: ``1 + rows
    cols`` crops; ``side^2`` base embeddings, then each kept row of the tiles' map with its ``image_newline``."""
    crops, tokens = [], []
    for _, height, width in grid.tolist():
        rows, cols, keep_h, keep_w = anyres_layout(height, width, pinpoints=pinpoints, tile=tile, side=side)
        crops.append(1 + rows * cols)
        tokens.append(side * side + (keep_h.stop - keep_h.start) * (keep_w.stop - keep_w.start + 1))
    as_tensor = dict(dtype=torch.long, device=grid.device)
    return torch.tensor(crops, **as_tensor), torch.tensor(tokens, **as_tensor)


class LlavaNextTower(ClipTower):
    """``forward(pixel_values [N, C*P*P], grid_thw [n, 3] of (crops, height, width)) -> [tokens, text_hidden]``: each
    image's base embeddings, then its unpadded tile rows each closed by ``image_newline``."""

    def __init__(self, config, *, text_hidden: int, pinpoints: list, **clip) -> None:
        super().__init__(config, text_hidden=text_hidden, **clip)
        self.pinpoints = [list(p) for p in pinpoints]
        self.tile = square_side(config.image_size, "image_size")
        self.image_newline = nn.Parameter(torch.zeros(text_hidden))

    def counts(self, grid_thw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return anyres_counts(grid_thw, pinpoints=self.pinpoints, tile=self.tile, side=self.side)

    def item_patches(self, grid_thw: torch.Tensor) -> torch.Tensor:
        return grid_thw[:, 0] * self.side * self.side

    def item_tokens(self, grid_thw: torch.Tensor) -> torch.Tensor:
        return self.counts(grid_thw)[1]

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        crops = grid_thw[:, 0].tolist()
        expected = self.counts(grid_thw)[0].tolist()
        if crops != expected:
            raise ValueError(f"LLaVA-NeXT images of sizes {grid_thw[:, 1:].tolist()} take {expected} crops with "
                             f"image_grid_pinpoints={self.pinpoints}; grid_thw gives {crops}.")
        rows, features = grid_thw.tolist(), self.features(pixel_values, sum(crops))
        if not rows:  # NOTE: an empty share (encoder data parallel): no rows, the parameters still in the graph
            return self.touch_unused(self.projector(features.flatten(0, 1)))
        items = self.project(list(features.split(crops)), rows)
        return self.touch_unused(torch.cat([piece for item, row in zip(items, rows)
                                            for piece in self.pack(item, *row)]))

    def project(self, items: list[torch.Tensor], rows: list) -> list[torch.Tensor]:
        """Each item's ``[crops, tokens, width]`` selected features through the projector (one call for all):
        ``[crops, tokens, text_hidden]``; ``rows``: their ``grid_thw`` rows."""
        out = self.projector(torch.cat([item.flatten(0, 1) for item in items]))
        return [piece.view(*item.shape[:2], -1) for piece, item in zip(out.split([i.shape[0] * i.shape[1]
                                                                                  for i in items]), items)]

    def pack(self, crops: torch.Tensor, count: int, height: int, width: int) -> list[torch.Tensor]:
        """The embeddings of one item of ``grid_thw`` row ``(count, height, width)`` from its ``[count, side^2, d]``
        crops' features: the base crop's, then the kept tile rows each closed by ``image_newline``."""
        kept = self.kept_map(crops[1:], height, width)
        newline = self.image_newline.to(kept.dtype).expand(kept.shape[0], 1, kept.shape[-1])
        return [crops[0], torch.cat([kept, newline], dim=1).reshape(-1, kept.shape[-1])]

    def kept_map(self, tiles: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """``[kept rows, kept columns, d]``: the ``[rows cols, side^2, d]`` tiles' features of a ``height x
        width`` picture as one map, unpadded."""
        side = self.side
        rows, cols, keep_h, keep_w = anyres_layout(height, width, pinpoints=self.pinpoints, tile=self.tile, side=side)
        # NOTE: tile (r, c)'s feature (i, j) sits at (r side + i, c side + j) of the map
        tiles = tiles.reshape(rows, cols, side, side, tiles.shape[-1]).permute(0, 2, 1, 3, 4)
        return tiles.reshape(rows * side, cols * side, tiles.shape[-1])[keep_h, keep_w]
