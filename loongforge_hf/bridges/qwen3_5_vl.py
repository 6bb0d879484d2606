"""Qwen3_5ForConditionalGeneration (the hub's Qwen3.5 checkpoints, ``model_type`` ``qwen3_5``): Qwen3.5's hybrid
decoder (Gated DeltaNet and gated full-attention layers) with Qwen3-VL's interleaved multimodal rope, and Qwen3-VL's
ViT without DeepStack; Qwen3_5MoeForConditionalGeneration (``qwen3_5_moe``, the hub's Qwen3.5-MoE checkpoints): the
same with Qwen3.5-MoE's decoder.

Choices:
- The language model is the Qwen3.5 text declaration (``qwen3_5.py``: token mixers, zero-centred norms, its
  refusals) over ``text_config``, its tensors under ``model.language_model`` (what transformers 5 and the hub's
  checkpoints hold; export writes the names read), built with ``position_embedding_type="mrope"`` and Qwen3-VL's
  ``InterleavedMRoPE`` over the rotary channels only: ``partial_rotary_factor`` (0.25) of each head is megatron's
  ``rotary_percent``, and ``mrope_section`` adds up to half of those channels (transformers' ``[11, 11, 10]`` of 64).
- The vision side is Qwen3-VL's declaration (``qwen3_vl.Qwen3VLBridge``: tensor names, TP split, checks, the tower
  ``vision_qwen3.Qwen3VisionTower``) with no DeepStack: ``vision_config`` has no ``deepstack_visual_indexes``, so the
  tower returns the merger's embeddings alone. Video frames as Qwen3-VL's (a timestamp between frames:
  ``frames_apart``).
- The text model's refusals hold for the image-text model, named after this architecture (``check_layout``, at
  load, on every rank before any collective; ``generation_refusal``). Context parallelism composes from parts that
  know nothing of each other: the chunk splices the images by global position and keeps megatron's load-balanced
  share (``multimodal/chunk.py``), megatron's mrope slices the whole 3-D positions by the same rule, and the Gated
  DeltaNet layers pass their states between the ranks' chunks (``parallel/delta_rule_cp.py``), packed samples' starts
  read from the mask rows the chunk keeps. ``generate`` under CP runs without the cache only, as the text model's
  (``kv_cache.patched`` refuses the cached one on every rank before the forward: the split prefill cannot fill the
  layers' states).
- ``lf.AutoModelForCausalLM`` loads the checkpoint as this image-text model (``causal_lm_auto``): transformers'
  ``AutoModelForCausalLM`` loads it too, as ``Qwen3_5ForCausalLM`` (the text model alone, the vision tensors left
  unread); ours gives the same logits on text and saves the whole checkpoint.
- Qwen3.5-MoE: the language model is the Qwen3.5-MoE text declaration (``qwen3_5_moe.py``: routed experts one tensor
  per expert as transformers 5 writes them, the gated shared expert, the balancing loss) under the same prefix; the
  vision side and the refusals are the dense model's. The hub's ``mtp.*`` tensors sit at the top level, beside
  ``model.*``: the text declaration's ``passthrough_names`` (``mtp.``) keeps them for export as the text model's.
"""

from __future__ import annotations

from loongforge_hf.bridges.qwen2_5_vl import VL_BRIDGES, MRopeText
from loongforge_hf.bridges.qwen3_5 import Qwen3_5Bridge
from loongforge_hf.bridges.qwen3_5_moe import Qwen3_5MoeBridge
from loongforge_hf.bridges.qwen3_vl import InterleavedRope, Qwen3VLBridge


class Qwen3_5VLTextBridge(InterleavedRope, MRopeText, Qwen3_5Bridge):
    """The language model of Qwen3.5 image-text for megatron: Qwen3.5 with interleaved mrope, under
    ``text_prefix``."""

    architectures = ("Qwen3_5ForConditionalGeneration",)  # NOTE: the name the text model's refusals give
    family = "Qwen3.5"


class Qwen3_5VLBridge(Qwen3VLBridge):
    """Declaration of ``Qwen3_5ForConditionalGeneration``."""

    architectures = ("Qwen3_5ForConditionalGeneration",)
    text_bridge_class = Qwen3_5VLTextBridge
    causal_lm_auto = True

    def check_layout(self, layout) -> None:
        self.text.check_layout(layout)

    def generation_refusal(self, generation_config) -> str | None:
        return self.text.generation_refusal(generation_config)


class Qwen3_5MoeVLTextBridge(InterleavedRope, MRopeText, Qwen3_5MoeBridge):
    """The language model of Qwen3.5-MoE image-text: Qwen3.5-MoE with interleaved mrope, under ``text_prefix``."""

    architectures = ("Qwen3_5MoeForConditionalGeneration",)  # NOTE: the name the text model's refusals give
    family = "Qwen3.5-MoE"


class Qwen3_5MoeVLBridge(Qwen3_5VLBridge):
    """Declaration of ``Qwen3_5MoeForConditionalGeneration``: the dense model's vision side and refusals, a
    Qwen3.5-MoE language model."""

    architectures = ("Qwen3_5MoeForConditionalGeneration",)
    text_bridge_class = Qwen3_5MoeVLTextBridge


VL_BRIDGES.update({arch: cls for cls in (Qwen3_5VLBridge, Qwen3_5MoeVLBridge) for arch in cls.architectures})
