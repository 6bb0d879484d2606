"""A SigLIP tower (``vision_siglip.SiglipTower``) read at one feature layer: the tail Aya Vision's and Aria's towers
share.

Choices:
- The features are transformers' ``hidden_states[k]`` (``feature_layer`` = k, 0 .. ``num_hidden_layers``): the
  output of block k before ``post_layernorm``; only blocks 1 .. k run (``depth``).
- Blocks after k and ``post_layernorm`` are built, loaded, frozen and exported as read, never run
  (``vision_clip.ClipTower``'s ``unused`` / ``touch_unused``: a trainable parameter among them, a LoRA adapter,
  enters the output as a zero term).
- The projector takes the block's output as it is (``head``), with the tower's ``(t, h, w)`` grid.
"""

from __future__ import annotations

import torch

from loongforge_hf.multimodal.vision_clip import ClipTower


class FeatureLayerTower:
    """Mixin, before ``SiglipTower`` in the bases: ``read_at(feature_layer)`` after ``SiglipTower.__init__``."""

    unused, touch_unused = ClipTower.unused, ClipTower.touch_unused

    def read_at(self, feature_layer: int) -> None:
        """Run the blocks up to ``feature_layer`` and freeze the modules after it (``unused``)."""
        self.feature_layers = (feature_layer,)
        for module in self.unused():
            module.requires_grad_(False)

    @property
    def depth(self) -> int:
        return self.feature_layers[0]

    def head(self, x: torch.Tensor, grid: list[tuple[int, int, int]]) -> torch.Tensor:
        """The projector on the feature layer's output, plus the unused modules' zero term."""
        return self.touch_unused(self.projector(x, grid))
