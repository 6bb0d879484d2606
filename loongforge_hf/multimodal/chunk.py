"""One pipeline stage of a vision-language model: megatron's GPTModel, plus the vision tower on the first stage.

Choices:
- ``VisionLanguageChunk(input_ids, position_ids, attention_mask, pixel_values=, image_grid_thw=)`` is what megatron's
  schedules and DDP see as a model chunk; any attribute it lacks is GPTModel's (``set_input_tensor``, ``config``,
  ``pre_process`` ...), so megatron treats it as the GPTModel it wraps, with the tower's parameters added.
- First stage: megatron's own embedding (dropout, sequence-parallel scatter included) gives the text embeddings; the
  image embeddings replace the rows at image-token positions (transformers' ``masked_scatter``: image tokens in
  row-major order take the images' embeddings in order) and the result is GPTModel's ``decoder_input``. Under
  sequence parallelism each rank replaces only the rows of its own sequence chunk.
- The vision layouts: replicated tower (every TP rank encodes every image), tower split over TP (``VisionTower`` built
  with the TP group), or encoder data parallel (``encoder_parallel``: each TP rank encodes a share of the images).
"""

from __future__ import annotations

import torch
from torch import nn


class VisionLanguageChunk(nn.Module):
    def __init__(self, language, *, vision=None, image_token_id: int, encoder_group=None) -> None:
        super().__init__()
        self.language = language
        self.vision = vision
        self.image_token_id = image_token_id
        self.encoder_group = encoder_group  # set: encoder data parallel over this group

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["language"], name)

    def set_input_tensor(self, input_tensor) -> None:
        self.language.set_input_tensor(input_tensor)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor | None, *,
                pixel_values: torch.Tensor | None = None, image_grid_thw: torch.Tensor | None = None):
        decoder_input = None
        if self.language.pre_process:
            decoder_input = self.embed(input_ids, pixel_values, image_grid_thw)
        return self.language(input_ids, position_ids, attention_mask, decoder_input=decoder_input)

    def encode_images(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> torch.Tensor:
        if self.encoder_group is not None:
            from loongforge_hf.multimodal.encoder_parallel import encode_images_data_parallel

            return encode_images_data_parallel(self.vision, pixel_values, image_grid_thw, group=self.encoder_group)
        return self.vision(pixel_values, image_grid_thw)

    def embed(self, input_ids: torch.Tensor, pixel_values: torch.Tensor | None,
              image_grid_thw: torch.Tensor | None) -> torch.Tensor:
        """``[s (or s / tp under sequence parallelism), b, h]`` embeddings with the images in place."""
        embeddings = self.language.embedding(input_ids=input_ids, position_ids=None)
        if pixel_values is None:
            return embeddings
        if self.vision is None or image_grid_thw is None:
            raise ValueError("pixel_values need image_grid_thw and a model with a vision tower.")
        images = self.encode_images(pixel_values, image_grid_thw.to(pixel_values.device))
        is_image = input_ids == self.image_token_id
        if int(is_image.sum()) != images.shape[0]:
            raise ValueError(f"The input ids hold {int(is_image.sum())} image tokens but the images give "
                             f"{images.shape[0]} embeddings (image_grid_thw {image_grid_thw.tolist()}).")
        order = (torch.cumsum(is_image.reshape(-1), 0) - 1).view_as(input_ids)
        local, start = embeddings.shape[0], 0
        if self.language.config.sequence_parallel:
            from megatron.core import parallel_state as ps

            start = ps.get_tensor_model_parallel_rank() * local
        rows = is_image[:, start:start + local].t()
        where = rows.nonzero(as_tuple=True)
        picked = images[order[:, start:start + local].t()[where]].to(embeddings.dtype)
        return embeddings.index_put(where, picked)
