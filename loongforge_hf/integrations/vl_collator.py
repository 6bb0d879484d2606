"""Batching image+text samples that a Hugging Face processor prepared one at a time.

Choices:
- A feature is what ``processor(text=[...], images=[...], return_tensors="pt")`` returns for one sample (a leading
  batch dimension of 1 is dropped), or the same as lists: ``input_ids``, optional ``attention_mask``,
  ``mm_token_type_ids``, ``labels``, and for samples with images ``pixel_values`` [patches, C*T*P*P] and
  ``image_grid_thw`` [images, 3].
- Text columns are padded to the longest sample (optionally to a multiple of ``pad_to_multiple_of``), on the right by
  default; the images of all samples are concatenated in sample order, which is the order the model consumes them.
- Labels default to the input ids; padding, and image tokens when ``mask_image_labels`` (the usual choice: the model
  never has to predict a placeholder), are set to -100. Labels a sample brings are kept as they are, padding aside.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

IGNORE_INDEX = -100


def _row(value) -> torch.Tensor:
    t = torch.as_tensor(value)
    return t[0] if t.dim() == 2 and t.shape[0] == 1 else t


@dataclass(kw_only=True)
class DataCollatorForImageText:
    pad_token_id: int
    image_token_id: int | None = None
    video_token_id: int | None = None
    padding_side: str = "right"
    pad_to_multiple_of: int | None = None
    mask_image_labels: bool = True

    def __post_init__(self) -> None:
        if self.padding_side not in ("left", "right"):
            raise ValueError(f"padding_side must be 'left' or 'right', got {self.padding_side!r}.")

    @classmethod
    def from_processor(cls, processor, **kwargs) -> "DataCollatorForImageText":
        tok = processor.tokenizer
        return cls(pad_token_id=tok.pad_token_id, image_token_id=getattr(processor, "image_token_id", None),
                   video_token_id=getattr(processor, "video_token_id", None), **kwargs)

    def _pad(self, rows: list[torch.Tensor], length: int, value: int) -> torch.Tensor:
        out = torch.full((len(rows), length), value, dtype=rows[0].dtype)
        for i, r in enumerate(rows):
            if self.padding_side == "right":
                out[i, :r.numel()] = r
            else:
                out[i, length - r.numel():] = r
        return out

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        if not features:
            raise ValueError("DataCollatorForImageText got no features.")
        ids = [_row(f["input_ids"]).long() for f in features]
        length = max(r.numel() for r in ids)
        if self.pad_to_multiple_of:
            length = -(-length // self.pad_to_multiple_of) * self.pad_to_multiple_of
        masks = [_row(f["attention_mask"]).long() if f.get("attention_mask") is not None
                 else torch.ones_like(r) for f, r in zip(features, ids)]
        batch = {"input_ids": self._pad(ids, length, self.pad_token_id), "attention_mask": self._pad(masks, length, 0)}
        if all(f.get("mm_token_type_ids") is not None for f in features):
            batch["mm_token_type_ids"] = self._pad([_row(f["mm_token_type_ids"]).long() for f in features], length, 0)
        labels = []
        for f, r in zip(features, ids):
            if f.get("labels") is not None:
                labels.append(_row(f["labels"]).long())
                continue
            lab = r.clone()
            if self.mask_image_labels:
                for token in (self.image_token_id, self.video_token_id):
                    if token is not None:
                        lab[lab == token] = IGNORE_INDEX
            labels.append(lab)
        batch["labels"] = self._pad(labels, length, IGNORE_INDEX)
        batch["labels"][batch["attention_mask"] == 0] = IGNORE_INDEX
        with_images = [f for f in features if f.get("pixel_values") is not None]
        if with_images:
            batch["pixel_values"] = torch.cat([torch.as_tensor(f["pixel_values"]) for f in with_images], dim=0)
            batch["image_grid_thw"] = torch.cat([torch.as_tensor(f["image_grid_thw"]).reshape(-1, 3)
                                                 for f in with_images], dim=0)
        return batch
