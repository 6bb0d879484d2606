"""SmolVLMForConditionalGeneration (HuggingFaceTB/SmolVLM-256M / 500M / 2.2B-Instruct, SmolVLM2) and
Idefics3ForConditionalGeneration (HuggingFaceM4/Idefics3-8B-Llama3): a Llama decoder, a SigLIP ViT and Idefics3's
connector (pixel shuffle, one linear). The two differ in names only (transformers' SmolVLM is Idefics3's code).

Choices:
- The language model is the Llama declaration (``llama.LlamaBridge``, ``text_config.model_type`` "llama", as every
  SmolVLM and Idefics3 on the hub) with 1-D positions and causal attention everywhere (transformers' Idefics3 has no
  rule of its own for image tokens), its tensors under ``model.text_model``; the LM head (``lm_head``) is tied to the
  embedding when the top-level ``tie_word_embeddings`` says so, as transformers ties it.
- One on-disk naming, transformers' module tree, which the hub's checkpoints use and transformers writes:
  ``model.text_model.*``, ``lm_head.weight``, ``model.vision_model.*``, ``model.connector.*``.
- Images: the processor's ``pixel_values [b, n, C, H, W]`` (each picture cut into tiles plus a global image, every
  tile at ``max_image_size``, samples with fewer tiles padded with all-zero images) become the real tiles' patches
  and ``(1, h, w)`` grids (``vision_inputs``): the all-zero images are dropped as transformers drops them, and a
  ``pixel_attention_mask`` that leaves any patch of a real tile without a real pixel is refused (transformers
  would mask the padded patches' keys and stretch the position ids over the real ones; the processor never pads a
  tile, its tiles all being of one size). Only ``<image>`` tokens (``image_token_id``) take the connector's rows;
  ``<fake_token_around_image>``, ``<global-img>`` and ``<row_i_col_j>`` stay text, as in transformers.
- Vision tensors are named like ``multimodal.vision_idefics3.Idefics3Tower``'s modules (SigLIP's blocks as Gemma 3's:
  ``gemma3_vl.Gemma3VLBridge.vision_block_mappings``); under vision tensor parallelism q / k / v are split by heads
  into the fused ``qkv`` rows, ``fc1`` by rows, ``fc2`` and ``out_proj`` by columns; norms, biases added after the
  reduction, the patch embedding, the position table and the connector are replicated.
- Refused (``UnsupportedConfigError``, before any collective): a decoder other than Llama, attention dropout in the
  ViT, an activation transformers does not know, non-integer or non-square ``image_size`` / ``patch_size``, a
  ``scale_factor`` that does not divide the patch grid's side, a ViT width that is not a whole number of heads.
"""

from __future__ import annotations

import torch

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.gemma3_vl import Gemma3VLBridge, OuterTableBridge, siglip_outer_names, siglip_shapes
from loongforge_hf.bridges.internvl import InternVLLlamaText, decoder_text_bridge
from loongforge_hf.bridges.mappings import Mapping
from loongforge_hf.bridges.qwen2_5_vl import VL_BRIDGES


class Idefics3Bridge(OuterTableBridge):
    """Declaration of ``Idefics3ForConditionalGeneration`` and ``SmolVLMForConditionalGeneration``."""

    architectures = ("Idefics3ForConditionalGeneration", "SmolVLMForConditionalGeneration")
    mrope = False
    # NOTE: transformers' module-tree prefixes (PEFT's adapter names) and the attributes holding the checkpoint's
    module_trees = (("model.text_model.", "text_prefix"), ("lm_head.", "head_prefix"),
                    ("model.vision_model.", "vision_prefix"), ("model.connector.", "projector_prefix"))
    text_prefix, head_prefix = "model.text_model", "lm_head"
    vision_prefix, projector_prefix = "model.vision_model", "model.connector"

    def __init__(self, hf_config, checkpoint_names=(), shape_of=None) -> None:
        self.hf_config = hf_config
        self.check_vision_config()
        self.text = self.text_bridge(set(checkpoint_names), shape_of)

    def text_bridge(self, checkpoint_names: set, shape_of):
        return decoder_text_bridge(self, {"llama": InternVLLlamaText}, type(self.hf_config).__name__)

    @property
    def tied(self) -> bool:
        return bool(getattr(self.hf_config, "tie_word_embeddings", False))

    @property
    def vision_merge(self) -> int:
        return int(self.hf_config.scale_factor)

    def vision_inputs(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor | None, image_sizes=None,
                      pixel_attention_mask: torch.Tensor | None = None):
        """The processor's ``[b, n, C, H, W]`` tiles (or ``[n, C, H, W]``) without the all-zero padding images, as
        the tower's patches and grids (``vision.as_image_patches``); None, None when every image is padding;
        patches as given where ``grid_thw`` comes with them (generate's later steps, a collated batch)."""
        from loongforge_hf.multimodal.vision import as_image_patches

        if grid_thw is not None or pixel_values.dim() < 4:
            return pixel_values, grid_thw
        patch = self.vision_config.patch_size
        images = pixel_values.reshape(-1, *pixel_values.shape[-3:])
        real = images.flatten(1).ne(0).any(-1)  # NOTE: transformers' rule: an image of zeros only is padding
        if pixel_attention_mask is not None:
            mask = pixel_attention_mask.reshape(-1, *pixel_attention_mask.shape[-2:])[real].bool()
            h, w = mask.shape[-2] // patch, mask.shape[-1] // patch
            patches = mask[:, :h * patch, :w * patch].reshape(-1, h, patch, w, patch).any(4).any(2)
            if not bool(patches.all()):
                raise ValueError("pixel_attention_mask marks patches of a tile as padding, which is not supported "
                                 "(transformers masks them in the ViT's attention; the processor's tiles are all "
                                 "of one size and never padded): pass tiles at the processor's max_image_size.")
        if not bool(real.any()):
            return None, None
        return as_image_patches(images[real], patch)

    def check_vision_config(self) -> None:
        from transformers.activations import ACT2FN

        v, hf = self.vision_config, self.hf_config
        if v.hidden_act not in ACT2FN:
            raise C.UnsupportedConfigError(f"vision_config.hidden_act={v.hidden_act!r} is not an activation "
                                           "transformers knows.")
        if getattr(v, "attention_dropout", 0.0):
            raise C.UnsupportedConfigError(f"vision_config.attention_dropout={v.attention_dropout} is not supported.")
        if not isinstance(v.image_size, int) or not isinstance(v.patch_size, int):
            raise C.UnsupportedConfigError(f"vision_config: image_size={v.image_size!r} and patch_size="
                                           f"{v.patch_size!r} must be whole numbers (square tiles and patches).")
        side = v.image_size // v.patch_size
        if not isinstance(hf.scale_factor, int) or hf.scale_factor < 1 or side % hf.scale_factor:
            raise C.UnsupportedConfigError(f"scale_factor={hf.scale_factor!r} must be a whole number dividing the "
                                           f"{side}x{side} patch grid.")
        if v.hidden_size % v.num_attention_heads:
            raise C.UnsupportedConfigError(f"vision_config: hidden_size={v.hidden_size} is not a multiple of "
                                           f"num_attention_heads={v.num_attention_heads}.")

    # ---- vision tensors ----------------------------------------------------------------------------------------
    def vision_block_mappings(self) -> list[Mapping]:
        return Gemma3VLBridge.vision_block_mappings(self)  # NOTE: SigLIP's encoder layers, named as Gemma 3's

    def _outer_names(self) -> tuple[dict[str, str], dict[str, str]]:
        """(tower name -> HF name) of the tensors before the blocks, and of those after them."""
        before, after = siglip_outer_names(self.vision_prefix)
        after["projector.proj.weight"] = f"{self.projector_prefix}.modality_projection.proj.weight"
        return before, after

    def vision_shapes(self) -> dict[str, tuple[int, ...]]:
        d, text_hidden = self.vision_config.hidden_size, self.hf_config.text_config.hidden_size
        return siglip_shapes(self, ((text_hidden, d * self.vision_merge ** 2),))

    def is_projector(self, vision_param_name: str) -> bool:
        return vision_param_name.startswith("projector.")

    def vision_tower(self, *, tp_group=None, recompute: bool = False):
        from loongforge_hf.multimodal.vision_idefics3 import Idefics3Tower

        return Idefics3Tower(self.vision_config, text_hidden=self.hf_config.text_config.hidden_size,
                             merge=self.vision_merge, tp_group=tp_group, recompute=recompute)


VL_BRIDGES.update({arch: Idefics3Bridge for arch in Idefics3Bridge.architectures})
