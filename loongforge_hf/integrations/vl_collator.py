"""Batching image/video+text samples that a Hugging Face processor prepared one at a time.

Choices:
- A feature is what ``processor(text=[...], images=[...], videos=[...], return_tensors="pt")`` returns for one sample
  (a leading batch dimension of 1 is dropped), or the same as lists: ``input_ids``, optional ``attention_mask``,
  ``mm_token_type_ids``, ``labels``, and for samples with images ``pixel_values`` [patches, C*T*P*P] and
  ``image_grid_thw`` [images, 3], with videos ``pixel_values_videos``, ``video_grid_thw`` and optionally
  ``second_per_grid_ts``.
- Padded batches (the default): text columns are padded to the longest sample (optionally to a multiple of
  ``pad_to_multiple_of``), on the right by default; the images (and videos) of all samples are concatenated in sample
  order, which is the order the model consumes them.
- Packed batches (``packing=True``): samples are laid end to end in one row (a new row starts when ``max_length``
  would be passed; rows are padded to the longest, and to ``pad_to_multiple_of``). There is no ``attention_mask``;
  ``position_ids`` are transformers' packed Qwen2.5-VL form [4, rows, length]: row 0 counts text positions from 0 in
  every sample (attention stays inside a sample), rows 1-3 are each sample's own 3-D rope positions, computed alone
  (so a packed sample sees exactly what it would see unpacked). Padding takes position 0 (a one-token document of its
  own) and label -100. The first label of each sample is -100, so no sample's last token learns to predict the next
  sample's first.
- Labels default to the input ids; padding, and image / video tokens when ``mask_image_labels`` (the usual choice:
  the model never has to predict a placeholder), are set to -100. Labels a sample brings are kept as they are, padding
  aside.
- Gemma 3 (``mrope=False``; ``from_processor`` sets it for a ``Gemma3Processor``): ``pixel_values`` are whole images
  ``[n, C, H, W]`` without grids, ``token_type_ids`` (1 on image tokens: the model's bidirectional image blocks) are
  padded or packed like ``mm_token_type_ids``, and packed rows take 2-D ``position_ids`` [rows, length] counting from
  0 in every sample (the model's rope is 1-D).
- Mistral 3 (``mrope=False`` too; ``from_processor`` sets it for a ``PixtralProcessor``): each sample's padded
  images ``[n, C, H, W]`` come with ``image_sizes [n, 2]``; images of different sizes are padded bottom-right with
  zeros to the largest, as Pixtral's image processor pads a batch, and ``image_sizes`` are concatenated with them.
- InternVL (``mrope=False`` too; ``from_processor`` sets it for an ``InternVLProcessor``): each sample's tiles
  ``[n, C, H, W]`` (all at the configured size) are concatenated; only ``<IMG_CONTEXT>`` tokens are image tokens.
  LLaVA's images (a ``LlavaProcessor``) the same way, its ``<image>`` tokens the image tokens.
- LLaVA-NeXT (``mrope=False`` too; ``from_processor`` sets it for a ``LlavaNextProcessor``): each sample's crops
  ``[n, crops, C, H, W]`` come with ``image_sizes [n, 2]``; samples with fewer crops are padded with zero crops to
  the most, as its image processor pads a batch, and ``image_sizes`` are concatenated with them.
- SmolVLM / Idefics3 (``mrope=False`` too; ``from_processor`` sets it for a ``SmolVLMProcessor`` or an
  ``Idefics3Processor``): each sample's tiles ``[1, n, C, H, W]`` and ``pixel_attention_mask [1, n, H, W]`` are
  joined into one ``[1, sum n, ...]`` (transformers' forward drops all-zero padding tiles wherever they sit and
  takes the rest in order); only ``<image>`` tokens are image tokens.
- Aria (``mrope=False`` too; ``from_processor`` sets it for an ``AriaProcessor``): tiles ``[n, C, H, W]`` as
  InternVL's, each sample's ``pixel_mask [n, H, W]`` (its pictures' pixels in the padded tiles) concatenated with
  them; ``num_crops`` is not a model input and is dropped.
- LLaVA-OneVision (``mrope=False`` too; ``from_processor`` sets it, and ``video_token_id``, for a
  ``LlavaOnevisionProcessor``): images as LLaVA-NeXT's, and each sample's ``batch_num_images`` (its image count; one
  sample with more than one image takes base crops only) concatenated over the samples with images, as the
  processor gives a batch of them; a sample without it counts its ``pixel_values``. Videos ``pixel_values_videos
  [videos, frames, C, H, W]`` (no grid) are concatenated along dim 0, so all videos of a batch must have the same
  frame count and size (transformers' one tensor): other shapes are refused, naming the field. LLaVA-NeXT-Video
  (a ``LlavaNextVideoProcessor``) the same way: LLaVA-NeXT's crops, these videos.
- GLM-4.1V / GLM-4.5V (``from_processor`` sets ``video_markers`` and ``frames_apart`` for a ``Glm4vProcessor``):
  its processor marks a video's frames with the image token (between ``<|begin_of_video|>`` and
  ``<|end_of_video|>``, a timestamp after each frame), so ``mm_token_type_ids`` (2: video, 1: image, 0: text) are the
  only thing that tells them apart: padded batches always carry them (a feature without them gets its processor's:
  image tokens between the markers 2, other image tokens 1); ``pixel_values_videos [patches, C*T*P*P]`` and
  ``video_grid_thw`` are concatenated as images are; packed rows give each frame its own 3-D position item.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

IGNORE_INDEX = -100
_VISION_KEYS = (("pixel_values", "image_grid_thw"), ("pixel_values_videos", "video_grid_thw"))


def _row(value) -> torch.Tensor:
    t = torch.as_tensor(value)
    return t[0] if t.dim() == 2 and t.shape[0] == 1 else t


def _join_tiles(pieces: list[torch.Tensor]) -> torch.Tensor:
    """Idefics3's per-sample ``[1, n, ...]`` tiles (or their pixel masks) as one ``[1, sum n, ...]``."""
    return torch.cat([p.reshape(-1, *p.shape[2:]) for p in pieces])[None]


def _cat_crops(pieces: list[torch.Tensor]) -> torch.Tensor:
    """LLaVA-NeXT's per-sample ``[n, crops, C, H, W]`` concatenated along dim 0, padded with zero crops to the most
    (its image processor's batch padding)."""
    most = max(p.shape[1] for p in pieces)
    return torch.cat([torch.nn.functional.pad(p, (0, 0, 0, 0, 0, 0, 0, most - p.shape[1])) for p in pieces])


def _cat_videos(pieces: list[torch.Tensor]) -> torch.Tensor:
    """LLaVA-OneVision's / LLaVA-NeXT-Video's per-sample ``[videos, frames, C, H, W]`` concatenated along dim 0 (one
    tensor: transformers' ``get_video_features`` reshapes it whole, so frame counts and sizes must agree)."""
    shapes = [tuple(p.shape[1:]) for p in pieces]
    if len(set(shapes)) > 1:
        raise ValueError(f"pixel_values_videos: videos of [frames, C, H, W] {sorted(set(shapes))} cannot be batched "
                         "(LLaVA-OneVision and LLaVA-NeXT-Video take one [videos, frames, C, H, W] tensor); sample "
                         "the same number of frames per video, or put such videos in batches of their own.")
    return torch.cat(pieces, dim=0)


def _images_a_sample(feature: dict) -> torch.Tensor:
    """A feature's ``batch_num_images`` (its ``pixel_values``' image count where absent), checked against them."""
    images = torch.as_tensor(feature["pixel_values"]).shape[0]
    given = feature.get("batch_num_images")
    counts = torch.tensor([images]) if given is None else torch.as_tensor(given).reshape(-1).long()
    if int(counts.sum()) != images or bool((counts < 0).any()):
        raise ValueError(f"batch_num_images={counts.tolist()} does not add up to the {images} images of the "
                         "sample's pixel_values.")
    return counts


def _cat_images(pieces: list[torch.Tensor]) -> torch.Tensor:
    """Concatenated along dim 0; whole images ``[n, C, H, W]`` of different sizes padded bottom-right with zeros to
    the largest first (Pixtral's image processor's batch padding)."""
    if pieces[0].dim() == 4 and len({p.shape[-2:] for p in pieces}) > 1:
        height, width = max(p.shape[-2] for p in pieces), max(p.shape[-1] for p in pieces)
        pieces = [torch.nn.functional.pad(p, (0, width - p.shape[-1], 0, height - p.shape[-2])) for p in pieces]
    return torch.cat(pieces, dim=0)


@dataclass(kw_only=True)
class DataCollatorForImageText:
    pad_token_id: int
    image_token_id: int | None = None
    video_token_id: int | None = None
    padding_side: str = "right"
    pad_to_multiple_of: int | None = None
    mask_image_labels: bool = True
    packing: bool = False
    max_length: int | None = None          # packing: longest row
    spatial_merge_size: int | None = None  # packing: to compute each sample's 3-D positions
    tokens_per_second: float = 1.0         # packing: vision_config.tokens_per_second (video time positions)
    frames_apart: bool = False             # packing: a video's frames are separate position items (Qwen3-VL)
    mrope: bool = True                     # False: 1-D positions, token_type_ids, whole images (Gemma 3)
    video_markers: tuple[int, int] | None = None  # GLM-4V: a video's (begin, end) ids; image tokens between: frames

    def __post_init__(self) -> None:
        if self.padding_side not in ("left", "right"):
            raise ValueError(f"padding_side must be 'left' or 'right', got {self.padding_side!r}.")
        if self.packing and self.mrope and (self.spatial_merge_size is None or self.image_token_id is None):
            raise ValueError("packing=True needs spatial_merge_size and image_token_id (from_processor sets both) "
                             "to compute each sample's 3-D rope positions.")

    @classmethod
    def from_processor(cls, processor, config=None, **kwargs) -> "DataCollatorForImageText":
        """From a Qwen2.5-VL, Qwen3-VL, GLM-4.1V / GLM-4.5V, Gemma 3, Mistral 3 (Pixtral), InternVL, LLaVA (-NeXT,
        -NeXT-Video, -OneVision), SmolVLM, Idefics3 or Aria processor; ``config`` (the model's) supplies
        ``tokens_per_second`` for videos."""
        from transformers import (AriaProcessor, Gemma3Processor, Glm4vProcessor, Idefics3Processor, InternVLProcessor,
                                  LlavaNextProcessor, LlavaNextVideoProcessor, LlavaOnevisionProcessor, LlavaProcessor,
                                  Qwen3VLProcessor, SmolVLMProcessor)

        tok = processor.tokenizer
        if isinstance(processor, (LlavaOnevisionProcessor, LlavaNextVideoProcessor)) \
                or getattr(config, "model_type", None) in ("llava_onevision", "llava_next_video"):
            return cls(pad_token_id=tok.pad_token_id, image_token_id=processor.image_token_id,
                       video_token_id=processor.video_token_id, mrope=False, **kwargs)
        # NOTE: by name: PixtralProcessor is a placeholder where torchvision is missing
        if type(processor).__name__ == "PixtralProcessor" \
                or isinstance(processor, (InternVLProcessor, LlavaProcessor, LlavaNextProcessor, Idefics3Processor,
                                          SmolVLMProcessor, AriaProcessor)) \
                or getattr(config, "model_type", None) in ("mistral3", "internvl", "llava", "llava_next", "idefics3",
                                                           "smolvlm", "aria"):
            return cls(pad_token_id=tok.pad_token_id, image_token_id=processor.image_token_id, mrope=False, **kwargs)
        image = getattr(processor, "image_processor", None)
        if isinstance(processor, Gemma3Processor) or getattr(config, "model_type", None) == "gemma3":
            # NOTE: its image_token_id is the begin-of-image id it expands; the image tokens are the tokenizer's
            return cls(pad_token_id=tok.pad_token_id, image_token_id=tok.image_token_id, mrope=False, **kwargs)
        glm = isinstance(processor, Glm4vProcessor) or getattr(config, "model_type", None) in ("glm4v", "glm4v_moe")
        defaults = {"spatial_merge_size": getattr(image, "merge_size", None),
                    "frames_apart": glm or isinstance(processor, Qwen3VLProcessor)
                    or getattr(config, "model_type", None) in ("qwen3_vl", "qwen3_vl_moe")}
        if glm:  # NOTE: ids the tokenizer lacks are never in input_ids (the tiny test processor's -1)
            defaults["video_markers"] = tuple(getattr(processor, f"video_{end}_id", -1) for end in ("start", "end"))
        vision = getattr(config, "vision_config", None)
        if vision is not None and getattr(vision, "tokens_per_second", None) is not None:
            defaults["tokens_per_second"] = vision.tokens_per_second
        return cls(pad_token_id=tok.pad_token_id, image_token_id=getattr(processor, "image_token_id", None),
                   video_token_id=getattr(processor, "video_token_id", None), **{**defaults, **kwargs})

    def _pad(self, rows: list[torch.Tensor], length: int, value: int) -> torch.Tensor:
        out = torch.full((len(rows), length), value, dtype=rows[0].dtype)
        for i, r in enumerate(rows):
            if self.padding_side == "right":
                out[i, :r.numel()] = r
            else:
                out[i, length - r.numel():] = r
        return out

    def _labels(self, feature: dict, ids: torch.Tensor) -> torch.Tensor:
        if feature.get("labels") is not None:
            return _row(feature["labels"]).long()
        lab = ids.clone()
        if self.mask_image_labels:
            for token in (self.image_token_id, self.video_token_id):
                if token is not None:
                    lab[lab == token] = IGNORE_INDEX
        return lab

    def _token_types(self, feature: dict, ids: torch.Tensor) -> torch.Tensor:
        """The feature's ``mm_token_type_ids``, else its processor's (see the module docstring)."""
        if feature.get("mm_token_type_ids") is not None:
            kinds = _row(feature["mm_token_type_ids"]).long()
            if kinds.shape != ids.shape:
                raise ValueError(f"mm_token_type_ids: {list(kinds.shape)} values for input_ids of {list(ids.shape)}.")
            return kinds
        kinds = torch.zeros_like(ids)
        if self.image_token_id is not None:
            kinds[ids == self.image_token_id] = 1
        if self.video_token_id is not None:
            kinds[ids == self.video_token_id] = 2
        if self.video_markers is not None:  # NOTE: GLM-4V's Glm4vProcessor.create_mm_token_type_ids
            begin, end = self.video_markers
            inside = (ids == begin).long().cumsum(0) > (ids == end).long().cumsum(0)
            kinds[(ids == self.image_token_id) & inside] = 2
        return kinds

    def _length(self, length: int) -> int:
        if self.pad_to_multiple_of:
            length = -(-length // self.pad_to_multiple_of) * self.pad_to_multiple_of
        return length

    @staticmethod
    def _vision(features: list[dict], batch: dict) -> dict:
        for pixels, grid in _VISION_KEYS:
            having = [f for f in features if f.get(pixels) is not None]
            if having:
                stacks = [torch.as_tensor(f[pixels]) for f in having]
                crops = stacks[0].dim() == 5 and all(f.get("image_sizes") is not None for f in having)
                if pixels == "pixel_values_videos" and stacks[0].dim() == 5:  # NOTE: LLaVA-OneVision's
                    batch[pixels] = _cat_videos(stacks)
                else:
                    batch[pixels] = _cat_crops(stacks) if crops else _join_tiles(stacks) if stacks[0].dim() == 5 \
                        else _cat_images(stacks)
                if all(f.get(grid) is not None for f in having):  # NOTE: none for Gemma 3's whole images
                    batch[grid] = torch.cat([torch.as_tensor(f[grid]).reshape(-1, 3) for f in having], dim=0)
        having = [f for f in features if f.get("pixel_values") is not None]
        if having and all(f.get("pixel_attention_mask") is not None for f in having):  # NOTE: Idefics3's
            batch["pixel_attention_mask"] = _join_tiles([torch.as_tensor(f["pixel_attention_mask"]) for f in having])
        if having and all(f.get("pixel_mask") is not None for f in having):  # NOTE: Aria's [n, H, W] tile masks
            batch["pixel_mask"] = torch.cat([torch.as_tensor(f["pixel_mask"]) for f in having])
        if any(f.get("batch_num_images") is not None for f in having):  # NOTE: LLaVA-OneVision's
            batch["batch_num_images"] = torch.cat([_images_a_sample(f) for f in having])
        if having and all(f.get("image_sizes") is not None for f in having):  # NOTE: Mistral 3's, LLaVA-NeXT's
            batch["image_sizes"] = torch.cat([torch.as_tensor(f["image_sizes"]).reshape(-1, 2) for f in having])
        videos = [f for f in features if f.get("pixel_values_videos") is not None]
        if videos and all(f.get("second_per_grid_ts") is not None for f in videos):
            batch["second_per_grid_ts"] = torch.cat([torch.as_tensor(f["second_per_grid_ts"], dtype=torch.float32)
                                                     .reshape(-1) for f in videos])
        return batch

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        if not features:
            raise ValueError("DataCollatorForImageText got no features.")
        if self.packing:
            return self._pack(features)
        ids = [_row(f["input_ids"]).long() for f in features]
        length = self._length(max(r.numel() for r in ids))
        masks = [_row(f["attention_mask"]).long() if f.get("attention_mask") is not None
                 else torch.ones_like(r) for f, r in zip(features, ids)]
        batch = {"input_ids": self._pad(ids, length, self.pad_token_id), "attention_mask": self._pad(masks, length, 0)}
        # NOTE: GLM-4V's always: nothing else tells a video's frames from images
        if self.video_markers is not None or all(f.get("mm_token_type_ids") is not None for f in features):
            batch["mm_token_type_ids"] = self._pad([self._token_types(f, r) for f, r in zip(features, ids)], length, 0)
        if all(f.get("token_type_ids") is not None for f in features):
            batch["token_type_ids"] = self._pad([_row(f["token_type_ids"]).long() for f in features], length, 0)
        batch["labels"] = self._pad([self._labels(f, r) for f, r in zip(features, ids)], length, IGNORE_INDEX)
        batch["labels"][batch["attention_mask"] == 0] = IGNORE_INDEX
        return self._vision(features, batch)

    # ---- packing ---------------------------------------------------------------------------------------------------
    def _sample_positions(self, feature: dict, ids: torch.Tensor, kinds: torch.Tensor) -> torch.Tensor:
        from loongforge_hf.multimodal.positions import mrope_position_ids

        if not self.mrope:
            return torch.arange(ids.numel())[None]

        def grid(name):
            return torch.as_tensor(feature[name]).reshape(-1, 3) if feature.get(name) is not None else None

        seconds = feature.get("second_per_grid_ts")
        return mrope_position_ids(ids[None], image_grid_thw=grid("image_grid_thw"),
                                  video_grid_thw=grid("video_grid_thw"), mm_token_type_ids=kinds[None],
                                  image_token_id=self.image_token_id, video_token_id=self.video_token_id,
                                  spatial_merge_size=self.spatial_merge_size,
                                  second_per_grid_ts=None if seconds is None
                                  else torch.as_tensor(seconds, dtype=torch.float32).reshape(-1),
                                  tokens_per_second=self.tokens_per_second, frames_apart=self.frames_apart)[:, 0]

    def _pack(self, features: list[dict]) -> dict[str, torch.Tensor]:
        rows: list[list[tuple]] = [[]]
        used = 0
        for f in features:
            if f.get("attention_mask") is not None and not bool(_row(f["attention_mask"]).bool().all()):
                raise ValueError("packing=True takes unpadded samples (attention_mask all ones).")
            ids = _row(f["input_ids"]).long()
            n = ids.numel()
            if self.max_length is not None and n > self.max_length:
                raise ValueError(f"A sample of {n} tokens does not fit max_length={self.max_length}; truncate it "
                                 "before packing (cutting inside an image would break it).")
            if self.max_length is not None and used + n > self.max_length and rows[-1]:
                rows.append([])
                used = 0
            kinds = _row(f["token_type_ids"]).long() if not self.mrope and f.get("token_type_ids") is not None \
                else self._token_types(f, ids)
            lab = self._labels(f, ids).clone()
            lab[0] = IGNORE_INDEX
            rows[-1].append((ids, lab, kinds, torch.arange(n)[None].expand(1, n),
                             self._sample_positions(f, ids, kinds)))
            used += n
        cat = [[torch.cat([s[k] for s in row], dim=-1) for k in range(5)] for row in rows]
        length = self._length(max(c[0].numel() for c in cat))
        kinds_key = "mm_token_type_ids" if self.mrope else "token_type_ids"
        out = {"input_ids": torch.full((len(rows), length), self.pad_token_id, dtype=torch.long),
               "labels": torch.full((len(rows), length), IGNORE_INDEX, dtype=torch.long),
               kinds_key: torch.zeros(len(rows), length, dtype=torch.long),
               "position_ids": torch.zeros(4 if self.mrope else 1, len(rows), length, dtype=torch.long)}
        for i, (ids, lab, kinds, text, rope) in enumerate(cat):
            n = ids.numel()
            out["input_ids"][i, :n], out["labels"][i, :n], out[kinds_key][i, :n] = ids, lab, kinds
            out["position_ids"][0, i, :n] = text[0]
            if self.mrope:
                out["position_ids"][1:, i, :n] = rope
        if not self.mrope:
            out["position_ids"] = out["position_ids"][0]
        return self._vision(features, out)


class PadToMultiple:
    """Another collator, then its batch right-padded to a length that divides by ``multiple``: token columns of the
    input ids' shape get ``pad_id`` (``input_ids``), -100 (``labels``) or 0 (masks, token types), images are left as
    they are. For TRL's vision collator (``integrations/trl.py``), which refuses ``pad_to_multiple_of`` on
    prompt-completion data. The pads carry no loss and, being last, change no real token's output."""

    _FILL = {"labels": IGNORE_INDEX, "attention_mask": 0, "completion_mask": 0, "assistant_masks": 0,
             "token_type_ids": 0, "mm_token_type_ids": 0}

    def __init__(self, collator, multiple: int, pad_id: int) -> None:
        self.collator, self.multiple, self.pad_id = collator, multiple, pad_id

    def __getattr__(self, name: str):
        if name == "collator":  # NOTE: not set yet (copy / unpickling): no recursion through __getattr__
            raise AttributeError(name)
        return getattr(self.collator, name)

    def __call__(self, examples):
        batch = self.collator(examples)
        ids = batch["input_ids"]
        extra = -ids.shape[-1] % self.multiple
        if extra:
            for key, value in list(batch.items()):
                fill = self.pad_id if key == "input_ids" else self._FILL.get(key)
                if fill is not None and isinstance(value, torch.Tensor) and value.shape == ids.shape:
                    batch[key] = torch.nn.functional.pad(value, (0, extra), value=fill)
        return batch
