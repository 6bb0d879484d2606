"""Mistral3ForConditionalGeneration (Mistral-Small-3.1-24B-Instruct-2503, 3.2-24B-Instruct-2506 and their
fine-tunes): a Mistral decoder, a Pixtral ViT and Mistral 3's projector with its patch merger.

Choices:
- The language model is the Mistral declaration (``mistral.MistralBridge``: Llama's layout, an optional sliding
  window) over ``text_config``, with 1-D positions and causal attention everywhere (Mistral 3 has no
  ``token_type_ids`` rule), its tensors under the checkpoint's prefix; the LM head is tied to the embedding when
  the top-level ``tie_word_embeddings`` says so, as transformers ties it. Ministral 3's checkpoints (a ``ministral3``
  ``text_config``: YaRN with ``mscale`` / ``mscale_all_dim``, Llama 4's query scale) refuse sequences that reach the
  query scale (``mistral.Llama4QueryScale``: not built), in the forward and the trainer's batch check.
- Two on-disk namings: the hub's, which transformers 5 writes too (``language_model.model.*``,
  ``language_model.lm_head.weight``, ``vision_tower.*``, ``multi_modal_projector.*``), and the module names
  (``model.language_model.*``, ``lm_head.weight``, ``model.vision_tower.*``, ``model.multi_modal_projector.*``);
  the checkpoint's keys decide, and export writes the names that were read.
- Images: the processor's padded ``[n, C, H, W]`` ``pixel_values`` and ``image_sizes [n, 2]`` become each image's
  real patches and its ``(1, h, w)`` grid (``vision_inputs``); only ``[IMG]`` tokens (``image_token_index``) take
  the projector's rows, ``[IMG_BREAK]`` / ``[IMG_END]`` stay text, as in transformers.
- Vision tensors are named like ``multimodal.vision_pixtral.PixtralTower``'s modules; under vision tensor
  parallelism q / k / v are split by heads into the fused ``qkv`` rows (``QKVRows``), gate / up by rows, down and
  ``o_proj`` by columns; norms, the patch convolution and the projector are replicated.
- Refused: a ``vision_feature_layer`` other than -1 (the hub's: the last block), attention dropout in the ViT, a
  rope other than Pixtral's axial one, a head size not divisible by 4, an activation transformers does not know.
"""

from __future__ import annotations

import torch

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.gemma3_vl import OuterTableBridge, QKVRows
from loongforge_hf.bridges.mappings import ColumnParallel, Mapping, Replicated, RowParallel, renamed
from loongforge_hf.bridges.mistral import Llama4QueryScale, MistralBridge
from loongforge_hf.bridges.qwen2_5_vl import VL_BRIDGES, PrefixedText, check_vit

# (text prefix, LM head, vision prefix, projector prefix) of each naming, found by its tensors
_NAMINGS = (("language_model.model", "language_model.lm_head", "vision_tower", "multi_modal_projector"),
            ("model.language_model", "lm_head", "model.vision_tower", "model.multi_modal_projector"))


class HeadPrefixedText(PrefixedText):
    """``PrefixedText`` whose LM head is named ``head_prefix`` (llava's namings: ``language_model.lm_head`` on the
    hub, ``lm_head`` in the module tree); Mistral 3's and InternVL's."""

    def __init__(self, text_config, *, tied: bool, text_prefix: str = "model", head_prefix: str = "lm_head") -> None:
        self.head_prefix = head_prefix
        super().__init__(text_config, tied=tied, text_prefix=text_prefix)

    def _name(self, mapping: Mapping) -> Mapping:
        return renamed(super()._name(mapping), "lm_head.", self.head_prefix + ".")

    def expected_hf_shapes(self) -> dict[str, tuple[int, ...]]:
        old = "lm_head."
        return {(self.head_prefix + "." + n[len(old):] if n.startswith(old) else n): s
                for n, s in super().expected_hf_shapes().items()}


class Mistral3TextBridge(HeadPrefixedText, Llama4QueryScale, MistralBridge):
    """The language model of Mistral 3: Mistral under ``text_prefix``, its LM head named ``head_prefix``; Ministral 3's
    (``text_config.model_type`` ``ministral3``: YaRN and Llama 4's query scale) refuses positions that reach the scale
    (``Llama4QueryScale``)."""


class Mistral3VLBridge(OuterTableBridge):
    """Declaration of ``Mistral3ForConditionalGeneration``."""

    architectures = ("Mistral3ForConditionalGeneration",)
    text_bridge_class = Mistral3TextBridge
    mrope = False
    # NOTE: transformers' module-tree prefixes (PEFT's adapter names) and the attributes holding the checkpoint's
    module_trees = (("model.language_model.", "text_prefix"), ("lm_head.", "head_prefix"),
                    ("model.vision_tower.", "vision_prefix"), ("model.multi_modal_projector.", "projector_prefix"))

    def __init__(self, hf_config, checkpoint_names=(), shape_of=None) -> None:
        self.hf_config = hf_config
        names = set(checkpoint_names)
        found = [n for n in _NAMINGS if f"{n[2]}.patch_conv.weight" in names]
        self.text_prefix, self.head_prefix, self.vision_prefix, self.projector_prefix = \
            found[0] if found else _NAMINGS[0]
        self.text = self.text_bridge(names, shape_of)
        self.check_vision_config()

    def check_sequence_length(self, longest: int) -> None:
        """The language model's (Ministral 3's query scale), called by the forward and the trainer."""
        self.text.check_sequence_length(longest)

    def text_bridge(self, checkpoint_names: set, shape_of):
        return self.text_bridge_class(self.hf_config.text_config, tied=self.tied, text_prefix=self.text_prefix,
                                      head_prefix=self.head_prefix)

    @property
    def tied(self) -> bool:
        return bool(getattr(self.hf_config, "tie_word_embeddings", True))

    @property
    def vision_merge(self) -> int:
        return int(self.hf_config.spatial_merge_size)

    def vision_inputs(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor | None, image_sizes=None):
        """The processor's padded ``[n, C, H, W]`` images cropped to ``image_sizes`` as the tower's patches and
        grids (``vision.as_image_patches``); patches as given where ``grid_thw`` comes with them
        (generate's later steps, a collated batch already converted)."""
        from loongforge_hf.multimodal.vision import as_image_patches

        if grid_thw is not None or pixel_values.dim() != 4:
            return pixel_values, grid_thw
        return as_image_patches(pixel_values, self.vision_config.patch_size, image_sizes)

    def check_vision_config(self) -> None:
        from transformers.activations import ACT2FN

        v, hf = self.vision_config, self.hf_config
        check_vit(v, "num_attention_heads")
        if hf.projector_hidden_act not in ACT2FN:
            raise C.UnsupportedConfigError(f"projector_hidden_act={hf.projector_hidden_act!r} is not an activation "
                                           "transformers knows.")
        if hf.vision_feature_layer != -1:
            raise C.UnsupportedConfigError(f"vision_feature_layer={hf.vision_feature_layer!r} is not supported: only "
                                           "-1 (the last ViT block's output, as the hub's checkpoints use).")
        if getattr(v, "attention_dropout", 0.0):
            raise C.UnsupportedConfigError(f"vision_config.attention_dropout={v.attention_dropout} is not supported.")
        if self.vision_merge < 1:
            raise C.UnsupportedConfigError(f"spatial_merge_size={self.vision_merge} must be at least 1.")

    # ---- vision tensors ----------------------------------------------------------------------------------------
    def vision_block_mappings(self) -> list[Mapping]:
        b, p = "blocks.{layer}", f"{self.vision_prefix}.transformer.layers.{{layer}}"
        maps: list[Mapping] = [Replicated(f"{b}.norm1.weight", f"{p}.attention_norm.weight"),
                               Replicated(f"{b}.norm2.weight", f"{p}.ffn_norm.weight"),
                               QKVRows(f"{b}.attn.qkv.weight", *(f"{p}.attention.{x}_proj.weight" for x in "qkv")),
                               RowParallel(f"{b}.attn.proj.weight", f"{p}.attention.o_proj.weight")]
        maps += [ColumnParallel(f"{b}.mlp.{n}.weight", f"{p}.feed_forward.{n}.weight")
                 for n in ("gate_proj", "up_proj")]
        maps.append(RowParallel(f"{b}.mlp.down_proj.weight", f"{p}.feed_forward.down_proj.weight"))
        return maps

    def _outer_names(self) -> tuple[dict[str, str], dict[str, str]]:
        """(tower name -> HF name) of the tensors before the blocks, and of those after them."""
        v, mp = self.vision_prefix, self.projector_prefix
        before = {"patch_embed.proj.weight": f"{v}.patch_conv.weight", "pre_norm.weight": f"{v}.ln_pre.weight"}
        after = {"projector.norm.weight": f"{mp}.norm.weight",
                 "projector.merger.weight": f"{mp}.patch_merger.merging_layer.weight"}
        for k in ("weight", "bias") if self.hf_config.multimodal_projector_bias else ("weight",):
            after.update({f"projector.{n}.{k}": f"{mp}.{n}.{k}" for n in ("linear_1", "linear_2")})
        return before, after

    def vision_shapes(self) -> dict[str, tuple[int, ...]]:
        v, p = self.vision_config, f"{self.vision_prefix}.transformer.layers"
        d, f, text_hidden = v.hidden_size, v.intermediate_size, self.hf_config.text_config.hidden_size
        before, after = self._outer_names()
        shapes = dict(zip(before.values(), ((d, v.num_channels, v.patch_size, v.patch_size), (d,))))
        for i in range(v.num_hidden_layers):
            shapes.update({f"{p}.{i}.attention_norm.weight": (d,), f"{p}.{i}.ffn_norm.weight": (d,),
                           f"{p}.{i}.feed_forward.gate_proj.weight": (f, d),
                           f"{p}.{i}.feed_forward.up_proj.weight": (f, d),
                           f"{p}.{i}.feed_forward.down_proj.weight": (d, f)})
            shapes.update({f"{p}.{i}.attention.{x}_proj.weight": (d, d) for x in "qkvo"})
        merge2 = self.vision_merge ** 2
        sizes = {"projector.norm.weight": (d,), "projector.merger.weight": (d, d * merge2),
                 "projector.linear_1.weight": (text_hidden, d), "projector.linear_1.bias": (text_hidden,),
                 "projector.linear_2.weight": (text_hidden, text_hidden), "projector.linear_2.bias": (text_hidden,)}
        shapes.update({hf: sizes[n] for n, hf in after.items()})
        return shapes

    def is_projector(self, vision_param_name: str) -> bool:
        return vision_param_name.startswith("projector.")

    def vision_tower(self, *, tp_group=None, recompute: bool = False):
        from loongforge_hf.multimodal.vision_pixtral import PixtralTower

        hf = self.hf_config
        return PixtralTower(self.vision_config, text_config=hf.text_config, merge=self.vision_merge,
                            projector_act=hf.projector_hidden_act, projector_bias=bool(hf.multimodal_projector_bias),
                            tp_group=tp_group, recompute=recompute)


VL_BRIDGES.update({arch: Mistral3VLBridge for arch in Mistral3VLBridge.architectures})
