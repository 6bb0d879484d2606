"""LlavaForConditionalGeneration (llava-hf/llava-1.5-7b / 13b-hf, bakLlava, LLaVA-style fine-tunes): a Llama,
Mistral or Qwen2 decoder, a CLIP ViT read at ``vision_feature_layer`` and LLaVA's two-layer MLP projector.

Choices:
- The language model is the causal-LM declaration of ``text_config.model_type`` (``llama``, ``mistral``, ``qwen2``,
  ``qwen3``) with 1-D positions and causal attention everywhere (LLaVA has no rule of its own for image tokens), its
  tensors under the checkpoint's prefix; the LM head is tied to the embedding when the top-level
  ``tie_word_embeddings`` says so (``LlavaConfig`` copies the text config's), as transformers ties it.
- On-disk namings, each as transformers reads it: the hub's (``language_model.model.*``, ``language_model.lm_head``,
  ``vision_tower.vision_model.*``, ``multi_modal_projector.*``: llava-hf's files, and what transformers 4.x wrote),
  transformers 5's (the same with ``vision_tower.*`` for the ViT) and the module names (``model.language_model.*``,
  ``lm_head``, ``model.vision_tower.*``, ``model.multi_modal_projector.*``); the checkpoint's keys decide, and export
  writes the names that were read.
- Images: the processor's ``[n, C, H, W]`` images become the tower's patches and ``(1, h, w)`` grids
  (``vision_inputs``); ``<image>`` tokens (``image_token_id``) take the projector's rows, ``h w`` an image.
- ``vision_feature_layer``: an index or a list of indices into transformers' ``hidden_states`` (0: the embeddings
  after ``pre_layrnorm``, k: after block k; negative from the end), the ViT run only as deep as the deepest; the
  blocks after it and ``post_layernorm`` are loaded, frozen and exported as read (``multimodal.vision_clip``).
- Vision tensors are named like ``multimodal.vision_clip.ClipTower``'s modules; the blocks' tensors are SigLIP's
  (Gemma 3's table: q / k / v split by heads into the fused ``qkv`` rows, ``fc1`` by rows, ``fc2`` and ``out_proj``
  by columns); the class token, the position table, the patch embedding, the norms and the projector are replicated.
- Refused: a vision tower other than CLIP's (``vision_config.model_type``), the ``"full"`` feature strategy (the
  class token kept: ``h w + 1`` tokens an image), feature layers out of range, attention dropout in the ViT, a
  decoder other than those four, non-square images or patches, activations transformers does not know.
"""

from __future__ import annotations

import torch

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.gemma3_vl import Gemma3VLBridge, OuterTableBridge, encoder_layer_shapes
from loongforge_hf.bridges.internvl import TEXT_BRIDGES as INTERNVL_TEXT, decoder_text_bridge
from loongforge_hf.bridges.mistral3_vl import Mistral3TextBridge
from loongforge_hf.bridges.qwen2_5_vl import VL_BRIDGES

TEXT_BRIDGES = {**INTERNVL_TEXT, "mistral": Mistral3TextBridge}
# (text prefix, LM head, vision tower, projector prefix) of the hub's and the module naming; the ViT's tensors are
# under "<vision tower>.vision_model" in the hub's files, under the tower itself in transformers 5's
_NAMINGS = (("language_model.model", "language_model.lm_head", "vision_tower", "multi_modal_projector"),
            ("model.language_model", "lm_head", "model.vision_tower", "model.multi_modal_projector"))


class LlavaBridge(OuterTableBridge):
    """Declaration of ``LlavaForConditionalGeneration``."""

    architectures = ("LlavaForConditionalGeneration",)
    mrope = False
    # NOTE: transformers' module-tree prefixes (PEFT's adapter names), each with the attribute naming it on disk
    module_trees = (("model.language_model.", "text_prefix"), ("lm_head.", "head_prefix"),
                    ("model.vision_tower.", "vision_prefix"), ("model.multi_modal_projector.", "projector_prefix"))
    vision_block_mappings = Gemma3VLBridge.vision_block_mappings  # NOTE: CLIP's encoder layers are SigLIP's
    # NOTE: the tower's model_type, the feature strategy, a tensor the hub's nested naming has under "vision_model"
    tower_type, feature_strategy, nested_probe = "clip_vision_model", "default", "embeddings.class_embedding"

    def __init__(self, hf_config, checkpoint_names=(), shape_of=None) -> None:
        self.hf_config = hf_config
        names = set(checkpoint_names)
        modules = f"{_NAMINGS[1][0]}.embed_tokens.weight" in names
        self.text_prefix, self.head_prefix, tower, self.projector_prefix = _NAMINGS[1 if modules else 0]
        nested = f"{tower}.vision_model.{self.nested_probe}" in names or not names and not modules
        self.vision_prefix = f"{tower}.vision_model" if nested else tower
        self.check_vision_config()
        self.text = self.text_bridge(names, shape_of)

    def text_bridge(self, checkpoint_names: set, shape_of):
        return decoder_text_bridge(self, TEXT_BRIDGES, "LLaVA")

    @property
    def tied(self) -> bool:
        return bool(getattr(self.hf_config, "tie_word_embeddings", False))

    @property
    def vision_merge(self) -> int:
        return 1

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """``vision_feature_layer`` as non-negative ``hidden_states`` indices (0 .. ``num_hidden_layers``)."""
        layer, count = self.hf_config.vision_feature_layer, self.vision_config.num_hidden_layers + 1
        return tuple(k % count for k in ([layer] if isinstance(layer, int) else layer))

    def vision_inputs(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor | None, image_sizes=None):
        """The processor's ``[n, C, H, W]`` images as the tower's patches and grids (``vision.as_image_patches``);
        patches as given where ``grid_thw`` comes with them (generate's later steps, a collated batch)."""
        from loongforge_hf.multimodal.vision import as_image_patches

        if grid_thw is not None or pixel_values.dim() != 4:
            return pixel_values, grid_thw
        return as_image_patches(pixel_values, self.patch)

    @property
    def patch(self) -> int:
        from loongforge_hf.multimodal.vision_clip import square_side

        return square_side(self.vision_config.patch_size, "patch_size")

    def check_vision_config(self) -> None:
        from transformers.activations import ACT2FN

        from loongforge_hf.multimodal.vision_clip import patch_grid_side

        v, hf = self.vision_config, self.hf_config
        if v.model_type != self.tower_type:
            raise C.UnsupportedConfigError(f"{self.architectures[0]} with vision_config.model_type={v.model_type!r} "
                                           f"is not supported: only {self.tower_type!r}.")
        for field, act in (("vision_config.hidden_act", v.hidden_act),
                           ("projector_hidden_act", hf.projector_hidden_act)):
            if act not in ACT2FN:
                raise C.UnsupportedConfigError(f"{field}={act!r} is not an activation transformers knows.")
        if hf.vision_feature_select_strategy != self.feature_strategy:
            raise C.UnsupportedConfigError(f"vision_feature_select_strategy={hf.vision_feature_select_strategy!r} "
                                           f"is not supported: only {self.feature_strategy!r}.")
        layers, count = hf.vision_feature_layer, v.num_hidden_layers
        layers = [layers] if isinstance(layers, int) else list(layers)
        if not layers or any(not isinstance(k, int) or not -count - 1 <= k <= count for k in layers):
            raise C.UnsupportedConfigError(f"vision_feature_layer={hf.vision_feature_layer!r}: each must index the "
                                           f"{count + 1} hidden states of the {count}-block ViT.")
        if getattr(v, "attention_dropout", 0.0):
            raise C.UnsupportedConfigError(f"vision_config.attention_dropout={v.attention_dropout} is not supported.")
        try:
            patch_grid_side(v)
        except ValueError as error:
            raise C.UnsupportedConfigError(str(error)) from None

    # ---- vision tensors ----------------------------------------------------------------------------------------
    def _outer_names(self) -> tuple[dict[str, str], dict[str, str]]:
        """(tower name -> HF name) of the tensors before the blocks, and of those after them."""
        v, e, mp = self.vision_prefix, f"{self.vision_prefix}.embeddings", self.projector_prefix
        before = {"class_embedding": f"{e}.class_embedding", "patch_embed.proj.weight": f"{e}.patch_embedding.weight",
                  "position_embedding": f"{e}.position_embedding.weight"}
        before.update({f"pre_norm.{k}": f"{v}.pre_layrnorm.{k}" for k in ("weight", "bias")})
        after = {f"post_layernorm.{k}": f"{v}.post_layernorm.{k}" for k in ("weight", "bias")}
        keys = ("weight", "bias") if self.hf_config.multimodal_projector_bias else ("weight",)
        after.update({f"projector.{n}.{k}": f"{mp}.{n}.{k}" for n in ("linear_1", "linear_2") for k in keys})
        return before, after

    def vision_shapes(self) -> dict[str, tuple[int, ...]]:
        v, p = self.vision_config, f"{self.vision_prefix}.encoder.layers"
        d, f, side, text = v.hidden_size, v.intermediate_size, self.side, self.hf_config.text_config.hidden_size
        width = d * len(self.feature_layers)
        sizes = {"patch_embed.proj.weight": (d, v.num_channels, self.patch, self.patch),
                 "position_embedding": (side * side + 1, d), "projector.linear_1.weight": (text, width),
                 "projector.linear_1.bias": (text,), "projector.linear_2.weight": (text, text),
                 "projector.linear_2.bias": (text,)}
        before, after = self._outer_names()
        shapes = {hf: sizes.get(n, (d,)) for n, hf in {**before, **after}.items()}
        shapes.update(encoder_layer_shapes(p, v.num_hidden_layers, d, f))
        return shapes

    @property
    def side(self) -> int:
        from loongforge_hf.multimodal.vision_clip import square_side

        return square_side(self.vision_config.image_size, "image_size") // self.patch

    def is_projector(self, vision_param_name: str) -> bool:
        return vision_param_name.startswith("projector.")

    def vision_tower(self, *, tp_group=None, recompute: bool = False):
        from loongforge_hf.multimodal.vision_clip import ClipTower

        hf = self.hf_config
        return ClipTower(self.vision_config, text_hidden=hf.text_config.hidden_size,
                         feature_layers=self.feature_layers, projector_act=hf.projector_hidden_act,
                         projector_bias=bool(hf.multimodal_projector_bias), tp_group=tp_group, recompute=recompute)


VL_BRIDGES.update({arch: LlavaBridge for arch in LlavaBridge.architectures})
