"""PaliGemmaForConditionalGeneration (google/paligemma-3b-*, paligemma2-3b / 10b / 28b-*): a Gemma (PaliGemma) or
Gemma 2 (PaliGemma 2) decoder, a SigLIP ViT and one linear projector; prefix-LM attention.

Choices:
- The language model is the Gemma or Gemma 2 declaration of ``text_config.model_type`` (``gemma.GemmaBridge``,
  ``gemma.Gemma2Bridge``: the scaled embedding, Gemma 2's sandwich norms, sliding layers and soft-capping) with 1-D
  positions counted from 0 (transformers counts from 1: rope scores depend on differences only), its tensors under
  the checkpoint's prefix; the LM head is the embedding (an untied config raises). ``PaliGemmaConfig`` sets
  ``text_config.use_bidirectional_attention``, which the text declarations refuse: its prefix rule is the one below.
- Prefix-LM attention as transformers': with ``token_type_ids`` the image and the prefix (type 0) form one
  bidirectional block (``chunk.prefix_blocks``), the suffix (type 1) attends causally; padding positions are kept
  out of the block (transformers' padding mask cuts it); in Gemma 2's sliding layers the block passes the window
  (transformers' ``OR(AND(window, causal), blockwise)``, unlike Gemma 3's). ``generate`` types its new tokens 1
  (suffix), as transformers' PaliGemma does. Without ``token_type_ids`` attention is causal, as
  transformers' with an ``attention_mask``. The block holds under pipeline parallelism (every stage applies it) and
  context parallelism (a rank's query chunks take every key of the block, those of the other ranks' chunks too:
  ``kernels.attention``), so neither is refused.
- Namings, vision tensors and their tensor parallelism are Gemma 3's (``gemma3_vl.Gemma3VLBridge``, SigLIP's blocks);
  the projector ``multi_modal_projector.linear`` (weight and bias) is replicated (``vision_paligemma.py``).
- Refused (``UnsupportedConfigError``, before any collective): another decoder, an untied head, ``projection_dim``
  other than the text width, SigLIP's pooling head, attention dropout in the ViT, an activation transformers does
  not know, a patch size not dividing the image; from the forward: PaliGemma 1 without ``token_type_ids`` and
  without ``attention_mask`` (transformers' SDPA path then attends both ways everywhere), ``token_type_ids`` with
  packed rows (the one prefix block would span the samples).
"""

from __future__ import annotations

import copy

import torch

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.gemma import Gemma2Bridge, GemmaBridge
from loongforge_hf.bridges.gemma3_vl import Gemma3VLBridge, check_siglip_vision, siglip_shapes
from loongforge_hf.bridges.qwen2_5_vl import VL_BRIDGES, PrefixedText


class PaliGemmaText(PrefixedText, GemmaBridge):
    """PaliGemma's language model: Gemma under ``text_prefix``."""


class PaliGemma2Text(PrefixedText, Gemma2Bridge):
    """PaliGemma 2's language model: Gemma 2 under ``text_prefix``."""


_DECODERS = {"gemma": PaliGemmaText, "gemma2": PaliGemma2Text}


class PaliGemmaBridge(Gemma3VLBridge):
    """Declaration of ``PaliGemmaForConditionalGeneration``."""

    architectures = ("PaliGemmaForConditionalGeneration",)
    causal_lm_auto = False
    generated_token_type = 1  # NOTE: generate's new tokens join the suffix (transformers' PaliGemma)
    windowed_blocks = False  # NOTE: transformers' sliding layers: OR(AND(window, causal), prefix block)

    @staticmethod
    def token_type_blocks(token_type_ids: torch.Tensor) -> torch.Tensor:
        from loongforge_hf.multimodal.chunk import prefix_blocks

        return prefix_blocks(token_type_ids)

    def text_bridge(self, checkpoint_names: set, shape_of):
        text = self.hf_config.text_config
        cls = _DECODERS.get(text.model_type)
        if cls is None:
            raise C.UnsupportedConfigError(f"PaliGemmaForConditionalGeneration with text_config.model_type="
                                           f"{text.model_type!r} is not supported; supported: {sorted(_DECODERS)}.")
        text = copy.copy(text)
        text.use_bidirectional_attention = False  # NOTE: the prefix rule is the token_type_ids blocks (docstring)
        return cls(text, tied=self.tied, text_prefix=self.text_prefix)

    def attention_token_types(self, token_type_ids: torch.Tensor | None, attention_mask: torch.Tensor | None, *,
                              packed: bool = False) -> torch.Tensor | None:
        """``token_type_ids`` with padding positions (``attention_mask`` 0) out of the prefix (type 1)."""
        if token_type_ids is not None and packed:
            raise ValueError("forward: token_type_ids with packed rows (position_ids restarting at 0) are not "
                             "supported for PaliGemma: the prefix block would span the packed samples' prefixes.")
        if token_type_ids is None:
            if attention_mask is None and self.hf_config.text_config.model_type == "gemma":
                raise ValueError("forward: PaliGemma without token_type_ids and without attention_mask is not "
                                 "supported (transformers then attends both ways over the whole sequence); pass the "
                                 "processor's token_type_ids or an attention_mask.")
            return None
        if attention_mask is None:
            return token_type_ids
        return token_type_ids.masked_fill(attention_mask.to(token_type_ids.device) == 0, 1)

    @property
    def vision_merge(self) -> int:
        return 1

    @property
    def tokens_per_side(self) -> int:
        return self.vision_config.image_size // self.vision_config.patch_size

    def check_vision_config(self) -> None:
        v, hf = self.vision_config, self.hf_config
        check_siglip_vision(v, "PaliGemma reads the ViT's last hidden states (PaliGemmaConfig sets it False)")
        if v.image_size % v.patch_size:
            raise C.UnsupportedConfigError(f"vision_config: image_size={v.image_size} is not a multiple of "
                                           f"patch_size={v.patch_size}.")
        if hf.projection_dim != hf.text_config.hidden_size:
            raise C.UnsupportedConfigError(f"projection_dim={hf.projection_dim} must equal text_config.hidden_size="
                                           f"{hf.text_config.hidden_size}.")

    # ---- vision tensors ----------------------------------------------------------------------------------------
    def _outer_names(self) -> tuple[dict[str, str], dict[str, str]]:
        before, after = super()._outer_names()
        mp = self.projector_prefix
        after = {k: v for k, v in after.items() if not k.startswith("projector.")}
        after.update({f"projector.proj.{k}": f"{mp}.linear.{k}" for k in ("weight", "bias")})
        return before, after

    def vision_shapes(self) -> dict[str, tuple[int, ...]]:
        d, text_hidden = self.vision_config.hidden_size, self.hf_config.text_config.hidden_size
        return siglip_shapes(self, ((text_hidden, d), (text_hidden,)))

    def vision_tower(self, *, tp_group=None, recompute: bool = False):
        from loongforge_hf.multimodal.vision_paligemma import PaliGemmaTower

        return PaliGemmaTower(self.vision_config, text_hidden=self.hf_config.text_config.hidden_size,
                              tp_group=tp_group, recompute=recompute)


VL_BRIDGES.update({arch: PaliGemmaBridge for arch in PaliGemmaBridge.architectures})
