"""AriaForConditionalGeneration (rhymes-ai/Aria and fine-tunes): Aria's MoE decoder, Idefics3's ViT read at
``vision_feature_layer`` and Aria's projector (learned queries cross-attending each tile's patches, then an MLP).

Choices:
- The language model is the Aria text declaration (``aria.AriaTextBridge``: Llama attention, every layer a mixture of
  experts beside shared experts, the experts stacked on disk) over ``text_config``, with 1-D positions and causal
  attention everywhere (Aria has no rule of its own for image tokens), its tensors under the checkpoint's prefix
  (``internvl.decoder_text_bridge``); the LM head is tied to the embedding only where ``tie_word_embeddings`` says so
  (the hub's does not).
- Namings are LLaVA's (``llava.LlavaBridge``): the hub's and the one transformers writes (``language_model.model.*``,
  ``language_model.lm_head``, ``vision_tower.*`` or ``vision_tower.vision_model.*``, ``multi_modal_projector.*``)
  and the module names (``model.language_model.*``, ``lm_head``, ...); the checkpoint's keys decide, export writes
  the names that were read.
- Images: the processor's ``[n, C, H, W]`` tiles with their ``pixel_mask [n, H, W]`` become each tile's real patches
  and ``(tile patches, h, w)`` grid rows (``multimodal.vision_aria.tile_patches``: the padded patches, which
  transformers masks, are dropped); a tile gives ``projector_patch_to_query_dict[tile patches]`` ``<image>`` tokens
  (``vision_item_tokens``), whatever its picture's size. ``image_sizes`` are not Aria's and are refused.
- Vision tensors are named like ``multimodal.vision_aria.AriaTower``'s modules (SigLIP's blocks as Gemma 3's: q / k / v
  split by heads into the fused ``qkv`` rows, ``fc1`` by rows, ``fc2`` and ``out_proj`` by columns); the patch
  embedding, the position table, the norms and the projector are replicated.
- Refused (``UnsupportedConfigError``, before any collective): a tower other than Idefics3's, a list of feature
  layers (transformers indexes its hidden states with one) or a layer out of range, attention dropout in the ViT, an
  activation transformers does not know, non-square or non-dividing image / patch sizes, a ViT width that is not a
  whole number of heads, a ``projector_patch_to_query_dict`` with a patch or query count that is not positive, a
  decoder other than Aria's. Elsewhere, by name: a ``pixel_mask`` whose real patches are no top-left rectangle and
  a tile size without queries (``vision_inputs``); LoRA on the projector's ``nn.MultiheadAttention.out_proj``
  (PEFT's "all-linear" reaches it; that module's forward reads it as a weight: ``lora.vision``); TRL's online
  trainers, whose per-row image slicing drops ``pixel_mask`` (``integrations.trl_online.vision_problems``).
"""

from __future__ import annotations

import torch

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.aria import AriaTextBridge
from loongforge_hf.bridges.gemma3_vl import encoder_layer_shapes, siglip_outer_names
from loongforge_hf.bridges.internvl import decoder_text_bridge
from loongforge_hf.bridges.llava import LlavaBridge
from loongforge_hf.bridges.mistral3_vl import HeadPrefixedText
from loongforge_hf.bridges.qwen2_5_vl import VL_BRIDGES

_PROJECTOR = ("query", "cross_attn.q_proj.weight", "cross_attn.k_proj.weight", "cross_attn.v_proj.weight",
              "cross_attn.multihead_attn.in_proj_weight", "cross_attn.multihead_attn.in_proj_bias",
              "cross_attn.multihead_attn.out_proj.weight", "cross_attn.multihead_attn.out_proj.bias",
              "cross_attn.linear.weight", "cross_attn.linear.bias", "cross_attn.layer_norm.weight",
              "cross_attn.layer_norm.bias", "cross_attn.layer_norm_kv.weight", "cross_attn.layer_norm_kv.bias",
              "layer_norm.weight", "layer_norm.bias", "feed_forward.linear_in.weight", "feed_forward.linear_out.weight")


class AriaVLText(HeadPrefixedText, AriaTextBridge):
    """Aria's language model: its MoE decoder under ``text_prefix``, its LM head ``head_prefix``."""


class AriaVLBridge(LlavaBridge):
    """Declaration of ``AriaForConditionalGeneration``."""

    architectures = ("AriaForConditionalGeneration",)
    tower_type, nested_probe = "idefics3_vision", "embeddings.patch_embedding.weight"
    takes_pixel_mask = True  # NOTE: modeling._tower_inputs hands the processor's pixel_mask to vision_inputs

    def text_bridge(self, checkpoint_names: set, shape_of):
        return decoder_text_bridge(self, {"aria_text": AriaVLText}, "AriaForConditionalGeneration")

    @property
    def queries(self) -> dict[int, int]:
        return {int(k): int(v) for k, v in self.hf_config.projector_patch_to_query_dict.items()}

    def vision_inputs(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor | None, image_sizes=None,
                      pixel_mask: torch.Tensor | None = None):
        """The processor's ``[n, C, H, W]`` tiles and ``pixel_mask`` as the tower's real patches and grids
        (``vision_aria.tile_patches``); patches as given where ``grid_thw`` comes with them (generate's later steps,
        a collated batch)."""
        from loongforge_hf.multimodal.vision_aria import tile_patches

        if image_sizes is not None:
            raise ValueError("image_sizes are not an input of AriaForConditionalGeneration (its processor marks "
                             "each tile's picture with pixel_mask).")
        if grid_thw is not None or pixel_values.dim() != 4:
            return pixel_values, grid_thw
        return tile_patches(pixel_values, pixel_mask, patch=self.patch, queries=self.queries)

    def vision_item_tokens(self, grid_thw: torch.Tensor) -> torch.Tensor:
        """``[n]`` ``<image>`` tokens of the tiles of ``grid_thw`` rows ``(tile patches, h, w)``."""
        from loongforge_hf.multimodal.vision_aria import query_counts

        return query_counts(grid_thw, self.queries)

    def check_vision_config(self) -> None:
        from transformers.activations import ACT2FN

        from loongforge_hf.multimodal.vision_clip import patch_grid_side

        v, hf = self.vision_config, self.hf_config
        if v.model_type != self.tower_type:
            raise C.UnsupportedConfigError(f"AriaForConditionalGeneration with vision_config.model_type="
                                           f"{v.model_type!r} is not supported: only {self.tower_type!r}.")
        layer, count = hf.vision_feature_layer, v.num_hidden_layers
        if not isinstance(layer, int) or not -count - 1 <= layer <= count:
            raise C.UnsupportedConfigError(f"vision_feature_layer={layer!r} is not supported: one index into the "
                                           f"{count + 1} hidden states of the {count}-block ViT.")
        if v.hidden_act not in ACT2FN:
            raise C.UnsupportedConfigError(f"vision_config.hidden_act={v.hidden_act!r} is not an activation "
                                           "transformers knows.")
        if getattr(v, "attention_dropout", 0.0):
            raise C.UnsupportedConfigError(f"vision_config.attention_dropout={v.attention_dropout} is not supported.")
        try:
            patch_grid_side(v)
        except ValueError as error:
            raise C.UnsupportedConfigError(str(error)) from None
        if not self.queries or any(k < 1 or n < 1 for k, n in self.queries.items()):
            raise C.UnsupportedConfigError(f"projector_patch_to_query_dict={hf.projector_patch_to_query_dict!r}: each "
                                           "key must be a tile's (positive) patch count, each value a positive "
                                           "number of queries.")

    # ---- vision tensors ----------------------------------------------------------------------------------------
    def _outer_names(self) -> tuple[dict[str, str], dict[str, str]]:
        """(tower name -> HF name) of the tensors before the blocks, and of those after them."""
        before, after = siglip_outer_names(self.vision_prefix)
        after.update({f"projector.{n}": f"{self.projector_prefix}.{n}" for n in _PROJECTOR})
        return before, after

    def vision_shapes(self) -> dict[str, tuple[int, ...]]:
        v = self.vision_config
        d, side, text = v.hidden_size, self.side, self.hf_config.text_config.hidden_size
        sizes = {"patch_embed.proj.weight": (d, v.num_channels, self.patch, self.patch),
                 "position_embedding.weight": (side * side, d), "projector.query": (max(self.queries.values()), d),
                 "projector.cross_attn.multihead_attn.in_proj_weight": (3 * d, d),
                 "projector.cross_attn.multihead_attn.in_proj_bias": (3 * d,),
                 "projector.feed_forward.linear_in.weight": (text, d),
                 "projector.feed_forward.linear_out.weight": (text, text)}
        sizes.update({f"projector.cross_attn.{n}.weight": (d, d) for n in ("q_proj", "k_proj", "v_proj", "linear",
                                                                           "multihead_attn.out_proj")})
        before, after = self._outer_names()
        shapes = {hf: sizes.get(n, (d,)) for n, hf in {**before, **after}.items()}
        shapes.update(encoder_layer_shapes(f"{self.vision_prefix}.encoder.layers", v.num_hidden_layers, d,
                                           v.intermediate_size))
        return shapes

    def vision_tower(self, *, tp_group=None, recompute: bool = False):
        from loongforge_hf.multimodal.vision_aria import AriaTower

        return AriaTower(self.vision_config, text_hidden=self.hf_config.text_config.hidden_size,
                         feature_layer=self.feature_layers[0], queries=self.queries, tp_group=tp_group,
                         recompute=recompute)


VL_BRIDGES.update({arch: AriaVLBridge for arch in AriaVLBridge.architectures})
