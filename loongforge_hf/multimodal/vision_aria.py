"""Aria's vision tower: Idefics3's ViT (``vision_siglip.SiglipTower`` with Idefics3's bucketed position ids) read at
``vision_feature_layer``, then Aria's projector (learned queries cross-attending each tile's patches, LayerNorm, a
GELU MLP into the language model's width); the ViT optionally split over TP.

Choices:
- A tile is an image here (a picture's crops under the processor's ``split_image`` are tiles one after another).
  The processor pads each picture into a square tile (the picture top-left) and marks its pixels in ``pixel_mask``;
  transformers masks the padded patches as keys in the ViT and in the projector, so their outputs never reach the
  language model. Here the padded patches are dropped instead (``tile_patches``): a tile is its real
  ``h x w`` patches (a patch with any real pixel is real, as transformers counts it), whose positions are Idefics3's
  buckets of an ``h x w`` grid (``vision_idefics3.bucketed_positions``: what transformers gives the real patches of
  a padded tile), full attention among them. A ``grid_thw`` row is ``(tile patches, h, w)``: the padded tile's patch
  count decides the number of queries (``projector_patch_to_query_dict``, as transformers keys it on the padded
  tile's length), ``h w`` the patches it takes (``item_patches`` / ``item_tokens``).
- The features are transformers' ``hidden_states[k]`` (``feature_layer`` = k, 0 .. ``num_hidden_layers``): the output
  of block k before ``post_layernorm`` (Idefics3's ViT does not tie the last hidden state to the normed one). Blocks
  after k and ``post_layernorm`` are built, loaded, frozen and exported as read, never run
  (``vision_feature_layer.FeatureLayerTower``).
- The projector is transformers' ``AriaProjector``: the first ``queries`` rows of ``query``, LayerNorm, ``q_proj``; the
  patches LayerNorm (``layer_norm_kv``), ``k_proj`` / ``v_proj``; torch's ``nn.MultiheadAttention`` over them (its own
  in-projection and ``out_proj``, as transformers runs it), ``linear``; then LayerNorm, ``linear_in``, tanh-GELU,
  ``linear_out``; every LayerNorm at torch's default eps (transformers sets none); replicated. Parameter names are
  transformers' (``multi_modal_projector.<name>`` is ``projector.<name>``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loongforge_hf.multimodal.vision import VisionLinear, _cu, run_block
from loongforge_hf.multimodal.vision_feature_layer import FeatureLayerTower
from loongforge_hf.multimodal.vision_idefics3 import bucketed_positions
from loongforge_hf.multimodal.vision_siglip import SiglipTower


def tile_patches(pixel_values: torch.Tensor, pixel_mask: torch.Tensor | None, *, patch: int,
                 queries: dict[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The processor's ``[n, C, H, W]`` tiles and ``[n, H, W]`` ``pixel_mask`` (None: every pixel real) -> (``[sum h w,
    C * P * P]`` the real patches, row-major, channels first in a patch; ``grid_thw [n, 3]`` = ``(H / P * W / P, h,
    w)``). Refused (``ValueError``): a tile size without queries, a mask whose real patches are not a top-left
    rectangle (transformers' positions count them along the first row and column), a tile without a real patch."""
    n, c, height, width = pixel_values.shape
    rows, cols = height // patch, width // patch
    if rows * cols not in queries:
        raise ValueError(f"pixel_values of {height}x{width} pixels give {rows * cols} patches of {patch} pixels; "
                         f"Aria's projector has queries for {sorted(queries)} patches (projector_patch_to_query_dict).")
    if pixel_mask is None:
        real = torch.ones(n, rows, cols, dtype=torch.bool, device=pixel_values.device)
    elif tuple(pixel_mask.shape) != (n, height, width):
        raise ValueError(f"pixel_mask of shape {list(pixel_mask.shape)} does not match pixel_values of shape "
                         f"{list(pixel_values.shape)} (one [H, W] mask a tile).")
    else:
        cut = pixel_mask[:, :rows * patch, :cols * patch].bool()
        real = cut.reshape(n, rows, patch, cols, patch).any(4).any(2)
    pieces, grid = [], []
    for image, mask in zip(pixel_values, real):
        h, w = int(mask[:, 0].sum()), int(mask[0].sum())
        if h == 0 or not bool(mask[:h, :w].all()) or int(mask.sum()) != h * w:
            raise ValueError("pixel_mask: each tile's real patches must be a non-empty top-left rectangle, as Aria's "
                             "processor pads a picture (right and below); got another shape.")
        crop = image[:, :h * patch, :w * patch].reshape(c, h, patch, w, patch)
        pieces.append(crop.permute(1, 3, 0, 2, 4).reshape(h * w, c * patch * patch))
        grid.append((rows * cols, h, w))
    return torch.cat(pieces), torch.tensor(grid, dtype=torch.long, device=pixel_values.device).reshape(n, 3)


class AriaCrossAttention(nn.Module):
    """Queries ``[q, d]`` attending a tile's patches ``[p, d]`` -> ``[q, d]`` (transformers' ``AriaCrossAttention``)."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (VisionLinear(hidden, hidden, bias=False) for _ in range(3))
        self.multihead_attn = nn.MultiheadAttention(hidden, heads, batch_first=True)
        self.linear = VisionLinear(hidden, hidden, bias=True)
        self.layer_norm = nn.LayerNorm(hidden)
        self.layer_norm_kv = nn.LayerNorm(hidden)

    def forward(self, patches: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
        query = self.q_proj(self.layer_norm(queries))[None]
        kv = self.layer_norm_kv(patches)
        out, _ = self.multihead_attn(query, self.k_proj(kv)[None], self.v_proj(kv)[None], need_weights=False)
        return self.linear(out[0])


class AriaFeedForward(nn.Module):
    """``linear_in``, tanh-GELU, ``linear_out`` (no biases)."""

    def __init__(self, hidden: int, inner: int, out: int) -> None:
        super().__init__()
        self.linear_in = VisionLinear(hidden, inner, bias=False)
        self.linear_out = VisionLinear(inner, out, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_out(F.gelu(self.linear_in(x), approximate="tanh"))


class AriaProjector(nn.Module):
    """``[sum h w, d]`` features -> ``[sum queries, text_hidden]``: per tile its queries cross-attend its patches."""

    def __init__(self, vision_hidden: int, text_hidden: int, *, heads: int, queries: dict[int, int]) -> None:
        super().__init__()
        self.queries = dict(queries)
        self.query = nn.Parameter(torch.zeros(max(queries.values()), vision_hidden))
        self.cross_attn = AriaCrossAttention(vision_hidden, heads)
        self.layer_norm = nn.LayerNorm(vision_hidden)
        self.feed_forward = AriaFeedForward(vision_hidden, text_hidden, text_hidden)

    def forward(self, x: torch.Tensor, grid: list[tuple[int, int, int]]) -> torch.Tensor:
        pieces, offset = [], 0
        for tile, h, w in grid:
            pieces.append(self.cross_attn(x[offset:offset + h * w], self.query[:self.queries[tile]]))
            offset += h * w
        attended = torch.cat(pieces) if pieces else x[:0]
        return self.feed_forward(self.layer_norm(attended))


class AriaTower(FeatureLayerTower, SiglipTower):
    """``forward(pixel_values [sum h w, C*P*P], grid_thw [n, 3] of (tile patches, h, w)) -> [sum queries,
    text_hidden]`` tile embeddings."""

    family = "Aria"

    def __init__(self, config, *, text_hidden: int, feature_layer: int, queries: dict[int, int], tp_group=None,
                 recompute: bool = False) -> None:
        side = config.image_size // config.patch_size
        projector = AriaProjector(config.hidden_size, text_hidden, heads=config.num_attention_heads, queries=queries)
        super().__init__(config, text_hidden=text_hidden, tokens_per_image=side * side, tp_group=tp_group,
                         recompute=recompute, projector=projector)
        self.queries = dict(queries)
        self.read_at(feature_layer)

    def item_patches(self, grid_thw: torch.Tensor) -> torch.Tensor:
        return grid_thw[:, 1] * grid_thw[:, 2]

    def item_tokens(self, grid_thw: torch.Tensor) -> torch.Tensor:
        return query_counts(grid_thw, self.queries)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        grid = [tuple(row) for row in grid_thw.tolist()]
        for tile, h, w in grid:
            if tile not in self.queries or not 0 < h * w <= tile:
                raise ValueError(f"Aria's vision tower: grid row {(tile, h, w)} is not (tile patches, real rows, real "
                                 f"columns) of a tile with queries (tiles of {sorted(self.queries)} patches).")
        x = self.patch_embed(pixel_values)
        if grid:
            positions = torch.cat([bucketed_positions(h, w, self.side, x.device) for _, h, w in grid])
            x = x + self.position_embedding(positions).to(x.dtype)
        cu_tiles = _cu([h * w for _, h, w in grid]).to(x.device)
        for block in self.blocks[:self.depth]:
            x = run_block(self, block, x, cu_tiles, None, None)
        return self.head(x, grid)


def query_counts(grid_thw: torch.Tensor, queries: dict[int, int]) -> torch.Tensor:
    """``[n]`` embeddings (``<image>`` tokens) of the tiles of ``grid_thw`` rows ``(tile patches, h, w)``."""
    counts = [queries.get(int(tile), 0) for tile in grid_thw[:, 0].tolist()]
    return torch.tensor(counts, dtype=torch.long, device=grid_thw.device)
