"""Llama4ForConditionalGeneration (meta-llama/Llama-4-Scout-17B-16E-Instruct, Llama-4-Maverick-17B-128E-Instruct and
their fine-tunes): the Llama 4 decoder, its ViT with the pixel-shuffle adapter, and a linear projector.

Choices:
- The language model is the Llama 4 declaration (``llama4.Llama4Bridge``: dense and MoE layers, NoPE layers with
  their temperature, chunked attention, L2 q / k norms) over ``text_config``, with 1-D positions and causal attention
  everywhere (transformers has no rule of its own for image tokens), its tensors under ``language_model.model`` and
  its LM head ``language_model.lm_head``; the head is tied to the embedding when ``text_config.tie_word_embeddings``
  says so, as transformers ties it (the text model's own setting, not the top-level one; the hub's do not tie).
- One on-disk naming, the hub's, which transformers 5 writes too (its module tree has the same names):
  ``language_model.*``, ``vision_model.*``, ``multi_modal_projector.linear_1.weight``.
- ``lf.AutoModelForCausalLM`` loads the checkpoint as this image-text model (``causal_lm_auto``), as transformers'
  ``AutoModelForCausalLM`` loads it (as its text model).
- Images: the processor's ``[n, C, H, W]`` tiles (each picture's tiles, then its global view) become the tower's
  patches and ``(1, h, w)`` grids (``vision_inputs``); only ``<|patch|>`` tokens (``image_token_index``) take the
  projector's rows, ``<|image|>``, the tile separators and ``<|image_start|>`` / ``<|image_end|>`` stay text, as in
  transformers.
- Vision tensors are named like ``multimodal.vision_llama4.Llama4VisionTower``'s modules; under vision tensor
  parallelism q / k / v are split by heads into the fused ``qkv`` rows (``QKVRows``), ``fc1`` by rows, ``fc2`` and
  ``o_proj`` by columns; norms, biases added after the reduction, the class token, the position table, the patch
  embedding, the adapter and the projector are replicated. ``freeze_vision`` freezes the ViT with its adapter
  (transformers' ``vision_model``); the projector is ``multi_modal_projector``.
- Refused: dropout in the ViT or the adapter, non-square images or patches, a ``pixel_shuffle_ratio`` whose inverse
  is not a whole number dividing the patch grid, adapter widths transformers' own modules could not chain
  (``intermediate_size`` = ``hidden_size / pixel_shuffle_ratio^2``, ``projector_input_dim`` =
  ``projector_output_dim`` = ``vision_output_dim``), a head size not divisible by 4 (the 2-D rope's quarters);
  LoRA on the patch embedding's linear (``"all-linear"`` matches it), which the LoRA planner finds no tower linear for.
"""

from __future__ import annotations

import torch

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.gemma3_vl import OuterTableBridge, biased_vit_block_mappings
from loongforge_hf.bridges.llama4 import Llama4Bridge
from loongforge_hf.bridges.mappings import Mapping
from loongforge_hf.bridges.mistral3_vl import HeadPrefixedText
from loongforge_hf.bridges.qwen2_5_vl import VL_BRIDGES


class Llama4VLTextBridge(HeadPrefixedText, Llama4Bridge):
    """The language model of Llama 4's image-text model: Llama 4 under ``text_prefix``, its LM head named
    ``head_prefix``."""


class Llama4VLBridge(OuterTableBridge):
    """Declaration of ``Llama4ForConditionalGeneration``."""

    architectures = ("Llama4ForConditionalGeneration",)
    text_bridge_class = Llama4VLTextBridge
    mrope = False
    causal_lm_auto = True
    text_prefix, head_prefix = "language_model.model", "language_model.lm_head"
    vision_prefix, projector_prefix = "vision_model", "multi_modal_projector"
    # NOTE: transformers' module-tree prefixes (PEFT's adapter names) and the attributes holding the checkpoint's
    module_trees = (("language_model.model.", "text_prefix"), ("language_model.lm_head.", "head_prefix"),
                    ("vision_model.", "vision_prefix"), ("multi_modal_projector.", "projector_prefix"))

    def __init__(self, hf_config, checkpoint_names=(), shape_of=None) -> None:
        self.hf_config = hf_config
        self.check_vision_config()
        self.text = self.text_bridge(set(checkpoint_names), shape_of)

    def text_bridge(self, checkpoint_names: set, shape_of):
        return self.text_bridge_class(self.hf_config.text_config, tied=self.tied, text_prefix=self.text_prefix,
                                      head_prefix=self.head_prefix)

    @property
    def tied(self) -> bool:
        return bool(getattr(self.hf_config.text_config, "tie_word_embeddings", False))

    @property
    def vision_merge(self) -> int:
        return int(round(1 / self.vision_config.pixel_shuffle_ratio))

    @property
    def patch(self) -> int:
        from loongforge_hf.multimodal.vision_clip import square_side

        return square_side(self.vision_config.patch_size, "patch_size")

    @property
    def side(self) -> int:
        from loongforge_hf.multimodal.vision_clip import square_side

        return square_side(self.vision_config.image_size, "image_size") // self.patch

    def vision_inputs(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor | None, image_sizes=None):
        """The processor's ``[n, C, H, W]`` tiles as the tower's patches and grids (``vision.as_image_patches``);
        patches as given where ``grid_thw`` comes with them (generate's later steps, a collated batch)."""
        from loongforge_hf.multimodal.vision import as_image_patches

        if grid_thw is not None or pixel_values.dim() != 4:
            return pixel_values, grid_thw
        return as_image_patches(pixel_values, self.patch)

    def check_vision_config(self) -> None:
        from loongforge_hf.multimodal.vision_clip import patch_grid_side

        v = self.vision_config
        for field in ("attention_dropout", "projector_dropout"):
            if getattr(v, field, 0.0):
                raise C.UnsupportedConfigError(f"vision_config.{field}={getattr(v, field)} is not supported.")
        try:
            side = patch_grid_side(v, heads=False)
        except ValueError as error:
            raise C.UnsupportedConfigError(str(error)) from None
        merge = self.vision_merge
        if abs(merge * v.pixel_shuffle_ratio - 1) > 1e-9 or side % merge:
            raise C.UnsupportedConfigError(f"vision_config.pixel_shuffle_ratio={v.pixel_shuffle_ratio} must be 1 / n "
                                           f"for a whole n dividing the {side}x{side} patch grid.")
        if v.intermediate_size != v.hidden_size * merge * merge or \
                not v.projector_input_dim == v.projector_output_dim == v.vision_output_dim:
            raise C.UnsupportedConfigError(
                f"vision_config: intermediate_size={v.intermediate_size} must be hidden_size / pixel_shuffle_ratio^2 "
                f"= {v.hidden_size * merge * merge} (the adapter's fc1 reads the shuffled features) and "
                f"projector_input_dim={v.projector_input_dim}, projector_output_dim={v.projector_output_dim}, "
                f"vision_output_dim={v.vision_output_dim} equal (the adapter's and the projector's widths chain).")
        heads = v.num_attention_heads
        if v.hidden_size % heads or (v.hidden_size // heads) % 4:
            raise C.UnsupportedConfigError(f"vision_config: hidden_size={v.hidden_size} / num_attention_heads="
                                           f"{heads} must be a whole head size divisible by 4 (2-D rope).")

    # ---- vision tensors ----------------------------------------------------------------------------------------
    def vision_block_mappings(self) -> list[Mapping]:
        return biased_vit_block_mappings(f"{self.vision_prefix}.model.layers.{{layer}}",
                                         ("input_layernorm", "post_attention_layernorm"), "o_proj")

    def _outer_names(self) -> tuple[dict[str, str], dict[str, str]]:
        """(tower name -> HF name) of the tensors before the blocks, and of those after them."""
        v = self.vision_prefix
        before = {"patch_embed.weight": f"{v}.patch_embedding.linear.weight",
                  "class_embedding": f"{v}.class_embedding", "position_embedding": f"{v}.positional_embedding_vlm"}
        before.update({f"pre_norm.{k}": f"{v}.layernorm_pre.{k}" for k in ("weight", "bias")})
        after = {f"post_norm.{k}": f"{v}.layernorm_post.{k}" for k in ("weight", "bias")}
        after.update({f"adapter.{n}.weight": f"{v}.vision_adapter.mlp.{n}.weight" for n in ("fc1", "fc2")})
        after["projector.weight"] = f"{self.projector_prefix}.linear_1.weight"
        return before, after

    def vision_shapes(self) -> dict[str, tuple[int, ...]]:
        v, p, d = self.vision_config, f"{self.vision_prefix}.model.layers", self.vision_config.hidden_size
        sizes = {"patch_embed.weight": (d, v.num_channels * self.patch * self.patch), "class_embedding": (d,),
                 "position_embedding": (self.side * self.side + 1, d),
                 "adapter.fc1.weight": (v.projector_input_dim, v.intermediate_size),
                 "adapter.fc2.weight": (v.projector_output_dim, v.projector_output_dim),
                 "projector.weight": (self.hf_config.text_config.hidden_size, v.vision_output_dim)}
        before, after = self._outer_names()
        shapes = {hf: sizes.get(n, (d,)) for n, hf in {**before, **after}.items()}
        for i in range(v.num_hidden_layers):
            b, f = f"{p}.{i}", v.intermediate_size
            shapes.update({f"{b}.{n}.{k}": (d,) for n in ("input_layernorm", "post_attention_layernorm")
                           for k in ("weight", "bias")})
            shapes.update({f"{b}.self_attn.{x}_proj.{k}": (d, d) if k == "weight" else (d,) for x in "qkvo"
                           for k in ("weight", "bias")})
            shapes.update({f"{b}.mlp.fc1.weight": (f, d), f"{b}.mlp.fc1.bias": (f,), f"{b}.mlp.fc2.weight": (d, f),
                           f"{b}.mlp.fc2.bias": (d,)})
        return shapes

    def is_projector(self, vision_param_name: str) -> bool:
        return vision_param_name.startswith("projector.")

    def vision_tower(self, *, tp_group=None, recompute: bool = False):
        from loongforge_hf.multimodal.vision_llama4 import Llama4VisionTower

        return Llama4VisionTower(self.vision_config, text_hidden=self.hf_config.text_config.hidden_size,
                                 merge=self.vision_merge, side=self.side, patch=self.patch, tp_group=tp_group,
                                 recompute=recompute)


VL_BRIDGES.update({arch: Llama4VLBridge for arch in Llama4VLBridge.architectures})
