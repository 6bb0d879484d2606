"""InternVLForConditionalGeneration (transformers' InternVL port: OpenGVLab/InternVL3-1B / 2B / 8B / 14B / 38B-hf,
InternVL3.5-*-HF with a dense decoder): a Qwen2, Qwen3 or Llama decoder, an InternViT and InternVL's pixel-shuffle
projector.

Choices:
- The language model is the causal-LM declaration of ``text_config.model_type`` (``qwen2``: ``Qwen2Bridge``,
  ``qwen3``: ``Qwen3Bridge``, ``llama``: ``LlamaBridge``) with 1-D positions and causal attention everywhere
  (transformers' InternVL has no rule of its own for image tokens), its tensors under the checkpoint's prefix; the LM
  head is tied to the embedding when the top-level ``tie_word_embeddings`` says so, as transformers ties it.
- Two on-disk namings, Mistral 3's (transformers' llava renaming): the hub's, which transformers 5 writes too
  (``language_model.model.*``, ``language_model.lm_head.weight``, ``vision_tower.*``, ``multi_modal_projector.*``),
  and the module names (``model.language_model.*``, ``lm_head.weight``, ``model.vision_tower.*``,
  ``model.multi_modal_projector.*``); the checkpoint's keys decide, and export writes the names that were read.
- Images: the processor's ``[n, C, H, W]`` tiles (each picture cut into tiles plus a thumbnail, a video's frames)
  become the tower's patches and ``(1, h, w)`` grids (``vision_inputs``); only ``<IMG_CONTEXT>`` tokens
  (``image_token_id``) take the projector's rows, ``<img>`` / ``</img>`` stay text, as in transformers.
- Vision tensors are named like ``multimodal.vision_internvl.InternViTTower``'s modules; under vision tensor
  parallelism q / k / v are split by heads into the fused ``qkv`` rows (``QKVRows``), the q / k norms' weights with
  them, ``fc1`` by rows, ``fc2`` and ``projection_layer`` by columns; the other norms, the layer scales, biases added
  after the reduction, the class token, the position table, the patch embedding and the projector are replicated.
- Refused: ``vision_feature_layer`` other than -1, ``vision_feature_select_strategy`` other than "default" (the hub's
  configs), a decoder other than those three (InternVL3.5's MoE and GPT-OSS ones among them), dropout in the ViT, the
  mask token (``use_mask_token``: a tensor the forward never reads), non-square images or patches, a
  ``downsample_ratio`` whose inverse is not a whole number dividing the patch grid, unknown activations or norms.
"""

from __future__ import annotations

import torch

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.gemma3_vl import OuterTableBridge, QKVRows
from loongforge_hf.bridges.llama import LlamaBridge
from loongforge_hf.bridges.mappings import ColumnParallel, Mapping, Replicated, RowParallel, biased_mlp_mappings
from loongforge_hf.bridges.mistral3_vl import _NAMINGS as LLAVA_NAMINGS, HeadPrefixedText
from loongforge_hf.bridges.qwen2 import Qwen2Bridge
from loongforge_hf.bridges.qwen2_5_vl import VL_BRIDGES
from loongforge_hf.bridges.qwen3 import Qwen3Bridge


class InternVLQwen2Text(HeadPrefixedText, Qwen2Bridge):
    """InternVL3's language model: Qwen2 (Qwen2.5) under ``text_prefix``, its LM head named ``head_prefix``."""


class InternVLQwen3Text(HeadPrefixedText, Qwen3Bridge):
    """InternVL3.5's dense language model: Qwen3 under ``text_prefix``, its LM head named ``head_prefix``."""


class InternVLLlamaText(HeadPrefixedText, LlamaBridge):
    """A Llama language model under ``text_prefix``, its LM head named ``head_prefix``."""


TEXT_BRIDGES = {"qwen2": InternVLQwen2Text, "qwen3": InternVLQwen3Text, "llama": InternVLLlamaText}


def decoder_text_bridge(bridge, decoders: dict, model: str):
    """``bridge``'s language model: the class ``decoders`` gives for its ``text_config.model_type``, under the
    bridge's text / head prefixes (InternVL, LLaVA, Idefics3: one image-text class over several decoders); refused
    naming ``model`` for another decoder."""
    text = bridge.hf_config.text_config
    cls = decoders.get(text.model_type)
    if cls is None:
        raise C.UnsupportedConfigError(f"{model} with text_config.model_type={text.model_type!r} is not supported; "
                                       f"supported decoders: {sorted(decoders)}.")
    return cls(text, tied=bridge.tied, text_prefix=bridge.text_prefix, head_prefix=bridge.head_prefix)


class InternVLBridge(OuterTableBridge):
    """Declaration of ``InternVLForConditionalGeneration``."""

    architectures = ("InternVLForConditionalGeneration",)
    mrope = False
    # NOTE: transformers' module-tree prefixes (PEFT's adapter names) and the attributes holding the checkpoint's
    module_trees = (("model.language_model.", "text_prefix"), ("lm_head.", "head_prefix"),
                    ("model.vision_tower.", "vision_prefix"), ("model.multi_modal_projector.", "projector_prefix"))

    def __init__(self, hf_config, checkpoint_names=(), shape_of=None) -> None:
        self.hf_config = hf_config
        names = set(checkpoint_names)
        found = [n for n in LLAVA_NAMINGS if f"{n[2]}.embeddings.cls_token" in names]
        self.text_prefix, self.head_prefix, self.vision_prefix, self.projector_prefix = \
            found[0] if found else LLAVA_NAMINGS[0]
        self.check_vision_config()
        self.text = self.text_bridge(names, shape_of)

    def text_bridge(self, checkpoint_names: set, shape_of):
        return decoder_text_bridge(self, TEXT_BRIDGES, "InternVL")

    @property
    def tied(self) -> bool:
        return bool(getattr(self.hf_config, "tie_word_embeddings", True))

    @property
    def vision_merge(self) -> int:
        return int(round(1 / self.hf_config.downsample_ratio))

    def vision_inputs(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor | None, image_sizes=None):
        """The processor's ``[n, C, H, W]`` tiles as the tower's patches and grids (``vision.as_image_patches``);
        patches as given where ``grid_thw`` comes with them (generate's later steps, a collated batch)."""
        from loongforge_hf.multimodal.vision import as_image_patches

        if grid_thw is not None or pixel_values.dim() != 4:
            return pixel_values, grid_thw
        return as_image_patches(pixel_values, self.vision_config.patch_size[0])

    def check_vision_config(self) -> None:
        from transformers.activations import ACT2FN

        v, hf = self.vision_config, self.hf_config
        for field, act in (("vision_config.hidden_act", v.hidden_act),
                           ("projector_hidden_act", hf.projector_hidden_act)):
            if act not in ACT2FN:
                raise C.UnsupportedConfigError(f"{field}={act!r} is not an activation transformers knows.")
        if hf.vision_feature_layer != -1:
            raise C.UnsupportedConfigError(f"vision_feature_layer={hf.vision_feature_layer!r} is not supported: only "
                                           "-1 (the last ViT block's output, as the hub's checkpoints use).")
        if hf.vision_feature_select_strategy != "default":
            raise C.UnsupportedConfigError(f"vision_feature_select_strategy={hf.vision_feature_select_strategy!r} "
                                           "is not supported: only 'default' (the class token dropped).")
        for field in ("hidden_dropout_prob", "attention_dropout", "projection_dropout"):
            if getattr(v, field, 0.0):
                raise C.UnsupportedConfigError(f"vision_config.{field}={getattr(v, field)} is not supported.")
        if v.norm_type not in ("layer_norm", "rms_norm"):
            raise C.UnsupportedConfigError(f"vision_config.norm_type={v.norm_type!r} is not supported.")
        if v.use_mask_token:
            raise C.UnsupportedConfigError("vision_config.use_mask_token=True is not supported (a mask token for "
                                           "masked image modelling, which InternVL's forward never uses).")
        image, patch = tuple(v.image_size), tuple(v.patch_size)
        if image[0] != image[1] or patch[0] != patch[1] or image[0] % patch[0] or v.hidden_size % \
                v.num_attention_heads:
            raise C.UnsupportedConfigError(f"vision_config: image_size={list(image)} and patch_size={list(patch)} "
                                           "must be square, the patches tiling the image, and hidden_size a "
                                           "multiple of num_attention_heads.")
        merge, side = self.vision_merge, image[0] // patch[0]
        if abs(merge * hf.downsample_ratio - 1) > 1e-9 or side % merge:
            raise C.UnsupportedConfigError(f"downsample_ratio={hf.downsample_ratio} must be 1 / n for a whole n "
                                           f"dividing the {side}x{side} patch grid.")

    # ---- vision tensors ----------------------------------------------------------------------------------------
    def vision_block_mappings(self) -> list[Mapping]:
        v = self.vision_config
        b, p = "blocks.{layer}", f"{self.vision_prefix}.encoder.layer.{{layer}}"
        norm_keys = ("weight", "bias") if v.norm_type == "layer_norm" else ("weight",)
        maps: list[Mapping] = [Replicated(f"{b}.{n}.{k}", f"{p}.layernorm_{hf}.{k}")
                               for n, hf in (("norm1", "before"), ("norm2", "after")) for k in norm_keys]
        maps += [QKVRows(f"{b}.attn.qkv.{k}", *(f"{p}.attention.{x}_proj.{k}" for x in "qkv"))
                 for k in (("weight", "bias") if v.attention_bias else ("weight",))]
        if v.use_qk_norm:
            maps += [ColumnParallel(f"{b}.attn.{x}_norm.weight", f"{p}.attention.{x}_norm.weight") for x in "qk"]
        maps += [RowParallel(f"{b}.attn.proj.weight", f"{p}.attention.projection_layer.weight"),
                 Replicated(f"{b}.attn.proj.bias", f"{p}.attention.projection_layer.bias")]
        maps += biased_mlp_mappings(f"{b}.mlp", f"{p}.mlp.fc1", f"{p}.mlp.fc2")
        return maps + [Replicated(f"{b}.lambda_{i}", f"{p}.lambda_{i}") for i in (1, 2)]

    def _outer_names(self) -> tuple[dict[str, str], dict[str, str]]:
        """(tower name -> HF name) of the tensors before the blocks, and of those after them."""
        v, e, mp = self.vision_config, f"{self.vision_prefix}.embeddings", self.projector_prefix
        before = {"cls_token": f"{e}.cls_token", "patch_embed.proj.weight": f"{e}.patch_embeddings.projection.weight",
                  "patch_embed.proj.bias": f"{e}.patch_embeddings.projection.bias"}
        if v.use_absolute_position_embeddings:
            before["position_embedding"] = f"{e}.position_embeddings"
        after = {} if v.use_mean_pooling else {f"post_norm.{k}": f"{self.vision_prefix}.layernorm.{k}"
                                               for k in ("weight", "bias")}
        after.update({f"projector.norm.{k}": f"{mp}.layer_norm.{k}" for k in ("weight", "bias")})
        after.update({f"projector.{n}.{k}": f"{mp}.{n}.{k}"
                      for n in ("linear_1", "linear_2") for k in ("weight", "bias")})
        return before, after

    def vision_shapes(self) -> dict[str, tuple[int, ...]]:
        v = self.vision_config
        d, f, patch, text = v.hidden_size, v.intermediate_size, v.patch_size[0], self.hf_config.text_config.hidden_size
        width, cells = d * self.vision_merge ** 2, (v.image_size[0] // patch) ** 2 + 1
        sizes = {"cls_token": (1, 1, d), "patch_embed.proj.weight": (d, v.num_channels, patch, patch),
                 "position_embedding": (1, cells, d), "projector.norm.weight": (width,),
                 "projector.norm.bias": (width,), "projector.linear_1.weight": (text, width),
                 "projector.linear_1.bias": (text,), "projector.linear_2.weight": (text, text),
                 "projector.linear_2.bias": (text,)}
        before, after = self._outer_names()
        shapes = {hf: sizes.get(n, (d,)) for n, hf in {**before, **after}.items()}
        norm_keys = ("weight", "bias") if v.norm_type == "layer_norm" else ("weight",)
        for i in range(v.num_hidden_layers):
            p = f"{self.vision_prefix}.encoder.layer.{i}"
            shapes.update({f"{p}.layernorm_{x}.{k}": (d,) for x in ("before", "after") for k in norm_keys})
            shapes.update({f"{p}.attention.{x}_proj.weight": (d, d) for x in "qkv"})
            shapes.update({f"{p}.attention.{x}_proj.bias": (d,) for x in ("qkv" if v.attention_bias else "")})
            shapes.update({f"{p}.attention.{x}_norm.weight": (d,) for x in ("qk" if v.use_qk_norm else "")})
            shapes.update({f"{p}.attention.projection_layer.weight": (d, d), f"{p}.attention.projection_layer.bias":
                           (d,), f"{p}.mlp.fc1.weight": (f, d), f"{p}.mlp.fc1.bias": (f,), f"{p}.mlp.fc2.weight":
                           (d, f), f"{p}.mlp.fc2.bias": (d,), f"{p}.lambda_1": (d,), f"{p}.lambda_2": (d,)})
        return shapes

    def is_projector(self, vision_param_name: str) -> bool:
        return vision_param_name.startswith("projector.")

    def vision_tower(self, *, tp_group=None, recompute: bool = False):
        from loongforge_hf.multimodal.vision_internvl import InternViTTower

        hf = self.hf_config
        return InternViTTower(self.vision_config, text_hidden=hf.text_config.hidden_size, merge=self.vision_merge,
                              projector_act=hf.projector_hidden_act, tp_group=tp_group, recompute=recompute)


VL_BRIDGES.update({arch: InternVLBridge for arch in InternVLBridge.architectures})
