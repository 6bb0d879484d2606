"""LlavaNextForConditionalGeneration (llava-hf/llava-v1.6-mistral-7b-hf, -vicuna-7b / 13b-hf, -34b-hf's CLIP
models, and LLaVA-NeXT-style fine-tunes): LLaVA's decoder, CLIP ViT and projector (``bridges/llava.py``) over
any-resolution crops, the tiles' features unpadded to the picture with ``image_newline`` per row.

Choices:
- Everything LLaVA's bridge declares holds (decoders, namings, ``vision_feature_layer``, the ViT's tensors, the
  refusals: the ``"full"`` strategy among them, which transformers' LLaVA-NeXT cannot unpad either). Added:
  ``image_newline`` (``[text hidden]``; ``image_newline`` in the hub's files, ``model.image_newline`` in the module
  naming), replicated, counted with the projector.
- Images: the processor's ``pixel_values [n, crops, C, H, W]`` (zero crops padding each image to the most) or the
  real crops concatenated ``[sum crops, C, H, W]`` (a collated batch, as transformers takes it too), with
  ``image_sizes [n, 2]``, become the crops' patches and one ``(crops, height, width)`` grid row per image
  (``vision_inputs``; ``multimodal.vision_llava_next``); an image takes as many ``<image>`` tokens as the processor
  expands it to (``vision_item_tokens``: the base image's ``h w``, then ``kept rows x (kept columns + 1)``).
- Refused besides LLaVA's: ``image_grid_pinpoints`` that are not a list of ``[height, width]`` pairs of positive
  multiples of ``vision_config.image_size`` (transformers counts the crops of other sizes one way and lays them out
  another).
- Shared with the bridges built on this one (LLaVA-OneVision, LLaVA-NeXT-Video): the tower's keywords
  (``tower_options``) and their videos' ``[videos, frames, C, H, W]`` as frames' patches and ``(frames, 0, 0)`` rows
  (``frame_video_inputs``); this model itself takes no videos.
"""

from __future__ import annotations

import torch

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.llava import LlavaBridge
from loongforge_hf.bridges.qwen2_5_vl import VL_BRIDGES


class LlavaNextBridge(LlavaBridge):
    """Declaration of ``LlavaNextForConditionalGeneration``."""

    architectures = ("LlavaNextForConditionalGeneration",)

    @property
    def newline_name(self) -> str:
        return "model.image_newline" if self.projector_prefix.startswith("model.") else "image_newline"

    @property
    def pinpoints(self) -> list:
        return [list(p) for p in self.hf_config.image_grid_pinpoints]

    def check_vision_config(self) -> None:
        from loongforge_hf.multimodal.vision_clip import square_side

        super().check_vision_config()
        tile, points = square_side(self.vision_config.image_size, "image_size"), self.hf_config.image_grid_pinpoints
        valid = isinstance(points, (list, tuple)) and len(points) > 0 and all(
            isinstance(p, (list, tuple)) and len(p) == 2 and all(isinstance(x, int) and x > 0 and x % tile == 0
                                                                 for x in p) for p in points)
        if not valid:
            raise C.UnsupportedConfigError(f"image_grid_pinpoints={points!r}: each must be a [height, width] pair of "
                                           f"positive multiples of vision_config.image_size ({tile}).")

    def vision_item_tokens(self, grid_thw: torch.Tensor) -> torch.Tensor:
        """``[n]`` embeddings (``<image>`` tokens) of the images of ``grid_thw`` rows ``(crops, height, width)``."""
        from loongforge_hf.multimodal.vision_llava_next import anyres_counts

        return anyres_counts(grid_thw, pinpoints=self.pinpoints, tile=self.patch * self.side, side=self.side)[1]

    def image_grid(self, sizes: torch.Tensor) -> torch.Tensor:
        """``[n, 3]`` tower rows ``(crops, height, width)`` of pictures of ``sizes [n, 2]`` (height, width)."""
        from loongforge_hf.multimodal.vision_llava_next import anyres_counts

        grid = torch.cat([torch.zeros_like(sizes[:, :1]), sizes], dim=1)
        grid[:, 0] = anyres_counts(grid, pinpoints=self.pinpoints, tile=self.patch * self.side, side=self.side)[0]
        return grid

    def vision_inputs(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor | None, image_sizes=None,
                      **per_sample):
        """The processor's crops and ``image_sizes`` as the tower's patches and ``(crops, height, width)`` rows
        (``image_grid``, which takes ``per_sample``); patches as given where ``grid_thw`` comes with them
        (generate's later steps, a collated batch)."""
        from loongforge_hf.multimodal.vision import as_image_patches

        if grid_thw is not None:
            return pixel_values, grid_thw
        if image_sizes is None or pixel_values.dim() not in (4, 5):
            raise ValueError("LLaVA-NeXT takes pixel_values [images, crops, C, H, W] (or the crops concatenated, "
                             f"[crops, C, H, W]) with image_sizes [images, 2]; got pixel_values of shape "
                             f"{list(pixel_values.shape)}{'' if image_sizes is not None else ' without image_sizes'}.")
        sizes = torch.as_tensor(image_sizes).reshape(-1, 2).to(torch.long)
        grid = self.image_grid(sizes, **per_sample)
        crops = grid[:, 0]
        if pixel_values.dim() == 5:
            if pixel_values.shape[0] != len(sizes) or pixel_values.shape[1] < int(crops.max()):
                raise ValueError(f"pixel_values of shape {list(pixel_values.shape)} do not hold the {crops.tolist()} "
                                 f"crops of the images of image_sizes {sizes.tolist()}.")
            pixel_values = torch.cat([image[:n] for image, n in zip(pixel_values, crops.tolist())])
        elif pixel_values.shape[0] != int(crops.sum()):
            raise ValueError(f"pixel_values hold {pixel_values.shape[0]} crops; the images of image_sizes "
                             f"{sizes.tolist()} take {crops.tolist()}.")
        patches, _ = as_image_patches(pixel_values, self.patch)
        return patches, grid.to(patches.device)

    # ---- vision tensors ----------------------------------------------------------------------------------------
    def _outer_names(self) -> tuple[dict[str, str], dict[str, str]]:
        before, after = super()._outer_names()
        return before, {**after, "image_newline": self.newline_name}

    def vision_shapes(self) -> dict[str, tuple[int, ...]]:
        return {**super().vision_shapes(), self.newline_name: (self.hf_config.text_config.hidden_size,)}

    def is_projector(self, vision_param_name: str) -> bool:
        return super().is_projector(vision_param_name) or vision_param_name == "image_newline"

    def tower_options(self) -> dict:
        """The keywords of ``LlavaNextTower`` (and of the towers built on it) that the config gives."""
        hf = self.hf_config
        return dict(text_hidden=hf.text_config.hidden_size, pinpoints=self.pinpoints,
                    feature_layers=self.feature_layers, projector_act=hf.projector_hidden_act,
                    projector_bias=bool(hf.multimodal_projector_bias))

    def vision_tower(self, *, tp_group=None, recompute: bool = False):
        from loongforge_hf.multimodal.vision_llava_next import LlavaNextTower

        return LlavaNextTower(self.vision_config, tp_group=tp_group, recompute=recompute, **self.tower_options())


def frame_video_inputs(bridge: LlavaNextBridge, pixel_values_videos, model: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A processor's ``pixel_values_videos [videos, frames, C, H, W]`` (frames of ``vision_config.image_size``
    pixels) as the tower's patches and ``(frames, 0, 0)`` rows (LLaVA-OneVision's and LLaVA-NeXT-Video's videos);
    ValueError naming ``model`` otherwise."""
    from loongforge_hf.multimodal.vision import as_image_patches

    tile = bridge.patch * bridge.side
    shape = list(pixel_values_videos.shape) if torch.is_tensor(pixel_values_videos) else None
    if shape is None or len(shape) != 5 or shape[-2:] != [tile, tile] or 0 in shape[:2]:
        raise ValueError(f"{model} takes pixel_values_videos as one [videos, frames, C, {tile}, {tile}] tensor "
                         f"(frames of vision_config.image_size pixels, as its processor resizes them); got "
                         f"{shape if shape is not None else type(pixel_values_videos).__name__}.")
    patches, _ = as_image_patches(pixel_values_videos.flatten(0, 1), bridge.patch)
    grid = torch.tensor([[shape[1], 0, 0]], dtype=torch.long, device=patches.device).expand(shape[0], 3)
    return patches, grid.contiguous()


VL_BRIDGES.update({arch: LlavaNextBridge for arch in LlavaNextBridge.architectures})
