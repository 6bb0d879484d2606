"""AyaVisionForConditionalGeneration (CohereLabs/aya-vision-8b / 32b and fine-tunes): a Cohere 2 or Cohere decoder,
a SigLIP ViT read at ``vision_feature_layer`` and Aya Vision's projector (pixel shuffle, LayerNorm, SwiGLU MLP).

Choices:
- The language model is the Cohere 2 (``cohere.Cohere2Bridge``: sliding and no-rope full layers) or Cohere
  (``cohere.CohereBridge``) declaration of ``text_config.model_type``, with 1-D positions and causal attention
  everywhere (Aya Vision has no rule of its own for image tokens), its tensors under the checkpoint's prefix, through
  ``internvl.decoder_text_bridge`` as LLaVA's. The LM head is tied to the embedding when the top-level
  ``tie_word_embeddings`` says so (every hub checkpoint), as transformers ties it. ``text_config.logit_scale`` is
  not applied: transformers' ``AyaVisionForConditionalGeneration`` runs its own ``lm_head`` on the decoder's hidden
  states, never Cohere's scaled head.
- Namings are LLaVA's (``llava.LlavaBridge``): the hub's (``language_model.model.*``,
  ``vision_tower.vision_model.*``, ``multi_modal_projector.*``), transformers 5's (``vision_tower.*`` for the ViT)
  and the module names (``model.language_model.*``, ``lm_head``, ...); the checkpoint's keys decide, export writes
  the names that were read. Images as LLaVA's: the processor's ``[n, C, H, W]`` tiles, each an image of
  ``(image_size / patch_size / downsample_factor)^2`` ``<image>`` tokens.
- Vision tensors are named like ``multimodal.vision_aya.AyaVisionTower``'s modules (SigLIP's blocks as Gemma 3's:
  q / k / v split by heads into the fused ``qkv`` rows, ``fc1`` by rows, ``fc2`` and ``out_proj`` by columns); the
  patch embedding, the position table, the norms and the projector are replicated.
- Refused (``UnsupportedConfigError``, before any collective): a tower other than SigLIP's, the ``"default"``
  feature strategy (it drops the first patch: SigLIP has no class token, and the shuffle's square grid breaks), a
  list of feature layers (the projector's width is one layer's), a layer out of range, SigLIP's pooling head, a
  vision config tying the last hidden state to the normed one, attention dropout in the ViT, an activation
  transformers does not know, a patch size not dividing the image or a ``downsample_factor`` not dividing the patch
  grid, an odd ``alignment_intermediate_size``, a decoder other than Cohere 2 / Cohere.
"""

from __future__ import annotations

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.cohere import Cohere2Bridge, CohereBridge
from loongforge_hf.bridges.gemma3_vl import check_siglip_vision, siglip_outer_names, siglip_shapes
from loongforge_hf.bridges.internvl import decoder_text_bridge
from loongforge_hf.bridges.llava import LlavaBridge
from loongforge_hf.bridges.mistral3_vl import HeadPrefixedText
from loongforge_hf.bridges.qwen2_5_vl import VL_BRIDGES


class UnscaledLogits:
    """A Cohere declaration whose logits are not scaled (transformers' Aya Vision head: see the docstring)."""

    def finish_model(self, model) -> None:
        super(CohereBridge, self).finish_model(model)  # NOTE: Cohere's finish without its scale_logits


class AyaVisionCohere2Text(UnscaledLogits, HeadPrefixedText, Cohere2Bridge):
    """Aya Vision 8B's language model: Cohere 2 under ``text_prefix``, its LM head ``head_prefix``."""


class AyaVisionCohereText(UnscaledLogits, HeadPrefixedText, CohereBridge):
    """Aya Vision 32B's language model: Cohere under ``text_prefix``, its LM head ``head_prefix``."""


TEXT_BRIDGES = {"cohere2": AyaVisionCohere2Text, "cohere": AyaVisionCohereText}


class AyaVisionBridge(LlavaBridge):
    """Declaration of ``AyaVisionForConditionalGeneration``."""

    architectures = ("AyaVisionForConditionalGeneration",)
    tower_type, feature_strategy, nested_probe = "siglip_vision_model", "full", "embeddings.patch_embedding.weight"

    def text_bridge(self, checkpoint_names: set, shape_of):
        return decoder_text_bridge(self, TEXT_BRIDGES, "AyaVisionForConditionalGeneration")

    @property
    def vision_merge(self) -> int:
        return int(self.hf_config.downsample_factor)

    @property
    def intermediate(self) -> int:
        hf = self.hf_config
        return getattr(hf, "alignment_intermediate_size", None) or hf.text_config.hidden_size

    def check_vision_config(self) -> None:
        v, hf = self.vision_config, self.hf_config
        if v.model_type != self.tower_type:
            raise C.UnsupportedConfigError(f"{self.architectures[0]} with vision_config.model_type={v.model_type!r} "
                                           f"is not supported: only {self.tower_type!r}.")
        if hf.vision_feature_select_strategy != self.feature_strategy:
            raise C.UnsupportedConfigError(f"vision_feature_select_strategy={hf.vision_feature_select_strategy!r} "
                                           "is not supported: only 'full' (SigLIP has no class token to drop).")
        layer, count = hf.vision_feature_layer, v.num_hidden_layers
        if not isinstance(layer, int) or not -count - 1 <= layer <= count:
            raise C.UnsupportedConfigError(f"vision_feature_layer={layer!r} is not supported: one index into the "
                                           f"{count + 1} hidden states of the {count}-block ViT.")
        check_siglip_vision(v, "Aya Vision reads a hidden state of the ViT's blocks")
        if getattr(v, "tie_last_hidden_states", None):
            raise C.UnsupportedConfigError(f"vision_config.tie_last_hidden_states={v.tie_last_hidden_states!r} is "
                                           "not supported.")
        if not isinstance(v.image_size, int) or not isinstance(v.patch_size, int) or v.image_size % v.patch_size:
            raise C.UnsupportedConfigError(f"vision_config: image_size={v.image_size!r} must be a whole multiple of "
                                           f"patch_size={v.patch_size!r}.")
        side, merge = v.image_size // v.patch_size, hf.downsample_factor
        if not isinstance(merge, int) or merge < 1 or side % merge:
            raise C.UnsupportedConfigError(f"downsample_factor={merge!r} must be a whole number dividing the "
                                           f"{side}x{side} patch grid.")
        if self.intermediate % 2 or v.hidden_size % v.num_attention_heads:
            raise C.UnsupportedConfigError(f"alignment_intermediate_size={self.intermediate} must be even (SwiGLU's "
                                           "halves) and vision_config.hidden_size a multiple of num_attention_heads.")

    # ---- vision tensors ----------------------------------------------------------------------------------------
    def _outer_names(self) -> tuple[dict[str, str], dict[str, str]]:
        """(tower name -> HF name) of the tensors before the blocks, and of those after them."""
        mp = self.projector_prefix
        before, after = siglip_outer_names(self.vision_prefix)
        after.update({f"projector.{n}.{k}": f"{mp}.{n}.{k}" for n in ("layernorm", "linear_1", "linear_2")
                      for k in ("weight", "bias")})
        return before, after

    def vision_shapes(self) -> dict[str, tuple[int, ...]]:
        width = self.vision_config.hidden_size * self.vision_merge ** 2
        inner, text = self.intermediate, self.hf_config.text_config.hidden_size
        return siglip_shapes(self, ((width,), (width,), (inner, width), (inner,), (text, inner // 2), (text,)))

    def vision_tower(self, *, tp_group=None, recompute: bool = False):
        from loongforge_hf.multimodal.vision_aya import AyaVisionTower

        hf = self.hf_config
        return AyaVisionTower(self.vision_config, text_hidden=hf.text_config.hidden_size, merge=self.vision_merge,
                              feature_layer=self.feature_layers[0], intermediate=self.intermediate,
                              eps=hf.adapter_layer_norm_eps, tp_group=tp_group, recompute=recompute)


VL_BRIDGES.update({arch: AyaVisionBridge for arch in AyaVisionBridge.architectures})
