"""Gemma4ForConditionalGeneration (``model_type`` ``gemma4``: Gemma 4 as the hub publishes it): the Gemma 4 text model
with a vision tower, an audio tower (E2B / E4B) and their multimodal embedders; text on megatron, the towers carried.

Choices:
- The language model is the Gemma 4 text declaration (``gemma4.Gemma4Bridge``: its layers, rope tables, refusals and
  layout checks) over ``text_config``, its tensors under ``model.language_model`` (what transformers 5 and the hub's
  checkpoints hold), its LM head the embedding where the config ties them (every published Gemma 4 does).
- The towers and embedders (``model.vision_tower.*``, ``model.audio_tower.*``, ``model.embed_vision.*``,
  ``model.embed_audio.*``: every tensor outside the language model) are not built: no tower module, nothing to train
  or freeze; ``save_pretrained`` copies them unchanged from the source folder (``passthrough_names``), so an export
  holds the whole checkpoint, bit for bit where training left the language model as it was.
- Text-only batches give transformers' logits and loss (its text path is the language model's, causal: the vision
  blocks of ``use_bidirectional_attention='vision'`` need ``mm_token_type_ids`` over images). Images, videos and
  audio are refused by name before any collective (``refuse_inputs``), as are input ids holding a placeholder
  (image / video / audio token), which transformers would embed as padding for the tower's output to replace.
- ``lf.AutoModelForCausalLM`` loads the checkpoint as this image-text model (``causal_lm_auto``), as transformers'
  ``AutoModelForCausalLM`` gives ``Gemma4ForConditionalGeneration``.
"""

from __future__ import annotations

import torch

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.gemma4 import Gemma4Bridge
from loongforge_hf.bridges.mappings import Mapping, ShardContext
from loongforge_hf.bridges.qwen2_5_vl import VL_BRIDGES, PrefixedText, Qwen2_5_VLBridge

TEXT_PREFIX = "model.language_model"
# input -> (what it is, the step that would run it): refused until that step lands
_VISION_STEP = "the next step, Gemma 4's vision tower (Gemma4VisionModel) on loongforge's vision pieces, adds them"
_REFUSED_INPUTS = {
    "pixel_values": ("images", _VISION_STEP),
    "pixel_values_videos": ("videos", _VISION_STEP),
    "input_features": ("audio", "a later step would run Gemma 4's audio tower (Gemma4AudioModel); none is planned "
                                "yet"),
    "mm_encoder_outputs": ("precomputed tower outputs", "the vision / audio tower steps would add them"),
}


class Gemma4VLTextBridge(PrefixedText, Gemma4Bridge):
    """The language model of ``Gemma4ForConditionalGeneration``: Gemma 4's text model under ``text_prefix``, every
    other checkpoint tensor carried through."""

    architectures = ("Gemma4ForConditionalGeneration",)  # NOTE: the name the layer-type checks give
    has_passthrough = True
    passthrough_kind = "the vision / audio towers and their embedders"

    def passthrough_names(self, names) -> list[str]:
        own = set(self.expected_hf_shapes())
        return [n for n in names if not n.startswith(self.text_prefix + ".") and n not in own]


class Gemma4VLBridge(Qwen2_5_VLBridge):
    """Declaration of ``Gemma4ForConditionalGeneration``: the text bridge, no tower, the input refusals."""

    architectures = ("Gemma4ForConditionalGeneration",)
    text_bridge_class = Gemma4VLTextBridge
    mrope = False
    causal_lm_auto = True
    has_vision_tower = False  # NOTE: the towers' tensors are the text bridge's passthrough

    def __init__(self, hf_config, checkpoint_names=(), shape_of=None) -> None:
        self.hf_config = hf_config
        self.text_prefix = TEXT_PREFIX
        self.text = self.text_bridge(set(checkpoint_names), shape_of)
        carried = self.text.passthrough_names(checkpoint_names)
        self.carried_shapes = {n: tuple(shape_of(n)) for n in carried} if shape_of is not None else {}

    @property
    def tied(self) -> bool:
        return bool(getattr(self.hf_config, "tie_word_embeddings", True))

    @property
    def vision_heads(self) -> int:
        v = self.vision_config
        return v.num_attention_heads if v is not None else 1

    @property
    def audio_token_id(self) -> int | None:
        token = getattr(self.hf_config, "audio_token_id", None)
        return None if token is None else int(token)

    def check_layout(self, layout) -> None:
        self.text.check_layout(layout)

    def check_vision_config(self) -> None:
        """Nothing: the towers are not built."""

    def refuse_inputs(self, inputs: dict) -> None:
        """``ValueError`` naming the first input this model does not take yet (images, videos, audio; placeholder
        tokens in ``input_ids``), with the step that would add it; local, before any collective."""
        for name, (what, step) in _REFUSED_INPUTS.items():
            if inputs.get(name) is not None:
                raise ValueError(f"forward: {name} ({what}) is not supported for Gemma4ForConditionalGeneration yet: "
                                 f"its towers are carried through unchanged, not run; {step}. Text-only batches are "
                                 "supported.")
        ids = inputs.get("input_ids")
        placeholders = {"image_token_id": self.image_token_id, "video_token_id": self.video_token_id,
                        "audio_token_id": self.audio_token_id}
        for field, token in placeholders.items():
            if ids is not None and token is not None and bool((ids == token).any()):
                raise ValueError(f"forward: input_ids hold {field}={token} (a placeholder for a tower's output, "
                                 "which transformers embeds as padding until the tower fills it); "
                                 "Gemma4ForConditionalGeneration here takes text-only batches.")

    def vision_inputs(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor | None, image_sizes=None, **kwargs):
        self.refuse_inputs({"pixel_values": pixel_values})

    # ---- the towers' tensors: carried ----------------------------------------------------------------------------
    def vision_mapping_table(self) -> dict[str, tuple[Mapping, int | None]]:
        return {}

    def vision_shard_context(self, *, tp_rank: int, tp_size: int) -> ShardContext:
        return ShardContext(tp_rank=tp_rank, tp_size=tp_size, num_heads=1, num_kv_heads=1, head_dim=1,
                            vocab_size=0, padded_vocab=0)

    def vision_shapes(self) -> dict[str, tuple[int, ...]]:
        """The carried tensors' shapes as the checkpoint gives them (listed so none counts as unexpected)."""
        return dict(self.carried_shapes)

    def is_projector(self, vision_param_name: str) -> bool:
        return False

    def vision_tower(self, *, tp_group=None, recompute: bool = False):
        raise C.UnsupportedConfigError("Gemma4ForConditionalGeneration's vision tower is carried, not built.")


VL_BRIDGES.update({arch: Gemma4VLBridge for arch in Gemma4VLBridge.architectures})
