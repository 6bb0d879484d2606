"""Qwen2VLForConditionalGeneration (Qwen2-VL-2B / 7B / 72B and their fine-tunes): a Qwen2 decoder with multimodal
rope, a ViT of LayerNorm blocks with full attention per frame, and a patch merger.

Choices:
- The language model is Qwen2.5-VL's: the Qwen2 declaration (bias on q, k, v) over ``text_config`` with megatron's
  contiguous-section mrope (``mrope_section`` from ``rope_parameters``), word embeddings tied when the top-level
  config says so (Qwen2-VL-2B). Video frames take temporal positions ``p + t`` with no time scaling (Qwen2-VL has no
  ``tokens_per_second``; a ``second_per_grid_ts`` given is ignored, as transformers ignores it).
- On-disk names as Qwen2.5-VL's: the hub's (``model.layers.*``, ``visual.*``, ``lm_head.weight``), which
  transformers 5 writes too, or transformers 4.5x's (``model.language_model.*``, ``model.visual.*``); the checkpoint's
  keys decide, and export writes the names that were read.
- Qwen2-VL's vision config names the ViT width ``embed_dim`` and the merger's output width ``hidden_size``, its MLP
  width ``embed_dim * mlp_ratio``; ``vision_config`` here is a view with the Qwen3-VL tower's names (``hidden_size``
  the ViT width, ``intermediate_size``, ``out_hidden_size``), which the tower, the layout checks and the shard
  context read (``tower_config``).
- Vision tensors are named like ``multimodal.vision_qwen2.Qwen2VisionTower``'s modules; transformers' MLP ``fc1`` /
  ``fc2`` are the tower's ``linear_fc1`` / ``linear_fc2``. Under ``vision_tensor_parallel_size`` > 1 attention splits
  by heads (the fused ``qkv`` rows as three blocks), ``fc1`` by rows and ``fc2`` by columns; norms, biases added after
  the reduction, the patch embedding and the merger (LayerNorm ``ln_q``, ``mlp.0``, ``mlp.2``) are replicated.
- Refused: a ViT activation transformers does not know, a non-axial ViT rope, a head size that is not a whole
  multiple of 4 (axial rope over h and w), a ``head_dim`` other than ``embed_dim / num_heads`` (transformers' rope
  would take it, its attention not); on the text side what Qwen2.5-VL's refuses (another rope type, a bad
  ``mrope_section``, an active sliding window).
"""

from __future__ import annotations

from types import SimpleNamespace

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.mappings import Mapping, Replicated
from loongforge_hf.bridges.qwen2 import Qwen2Bridge
from loongforge_hf.bridges.qwen2_5_vl import VL_BRIDGES, MRopeText, Qwen2_5_VLBridge, check_vit


class Qwen2VLTextBridge(MRopeText, Qwen2Bridge):
    """The language model of Qwen2-VL for megatron: Qwen2 with mrope, under ``text_prefix``."""

    family = "Qwen2-VL"


def tower_config(v) -> SimpleNamespace:
    """Qwen2-VL's vision config ``v`` under the Qwen3-VL tower's field names (see the module docstring)."""
    return SimpleNamespace(hidden_size=v.embed_dim, intermediate_size=int(v.embed_dim * v.mlp_ratio),
                           out_hidden_size=v.hidden_size, num_heads=v.num_heads, depth=v.depth,
                           hidden_act=v.hidden_act, patch_size=v.patch_size, temporal_patch_size=v.temporal_patch_size,
                           in_channels=v.in_channels, spatial_merge_size=v.spatial_merge_size,
                           rope_parameters=dict(getattr(v, "rope_parameters", None) or {}))


class Qwen2VLBridge(Qwen2_5_VLBridge):
    """Declaration of ``Qwen2VLForConditionalGeneration``: the text bridge, the vision tensor table, the checks."""

    architectures = ("Qwen2VLForConditionalGeneration",)
    text_bridge_class = Qwen2VLTextBridge
    video_time_scaled = False  # NOTE: no tokens_per_second: a video's frame t sits at temporal position p + t

    @property
    def vision_config(self) -> SimpleNamespace:
        return tower_config(self.hf_config.vision_config)

    def check_vision_config(self) -> None:
        check_vit(self.vision_config)  # NOTE: the view's hidden_size is embed_dim
        v = self.hf_config.vision_config
        head_dim = getattr(v, "head_dim", None)
        if head_dim and head_dim != v.embed_dim // v.num_heads:
            raise C.UnsupportedConfigError(f"vision_config.head_dim={head_dim} differs from embed_dim / num_heads = "
                                           f"{v.embed_dim // v.num_heads} (transformers' attention takes the latter).")

    # ---- vision tensors ----------------------------------------------------------------------------------------
    def vision_block_mappings(self) -> list[Mapping]:
        from loongforge_hf.bridges.qwen3_vl import layer_norm_block_mappings

        return layer_norm_block_mappings(self.vision_prefix, ("fc1", "fc2"))

    def vision_other_mappings(self) -> list[Mapping]:
        """The patch embedding (first) and the merger, replicated."""
        names = ["patch_embed.proj.weight", "merger.ln_q.weight", "merger.ln_q.bias", "merger.mlp.0.weight",
                 "merger.mlp.0.bias", "merger.mlp.2.weight", "merger.mlp.2.bias"]
        return [Replicated(n, f"{self.vision_prefix}.{n}") for n in names]

    def vision_shapes(self) -> dict[str, tuple[int, ...]]:
        v, p = self.vision_config, self.vision_prefix
        d, f, wide = v.hidden_size, v.intermediate_size, v.hidden_size * v.spatial_merge_size ** 2
        shapes = {f"{p}.patch_embed.proj.weight": (d, v.in_channels, v.temporal_patch_size, v.patch_size,
                                                   v.patch_size),
                  f"{p}.merger.ln_q.weight": (d,), f"{p}.merger.ln_q.bias": (d,),
                  f"{p}.merger.mlp.0.weight": (wide, wide), f"{p}.merger.mlp.0.bias": (wide,),
                  f"{p}.merger.mlp.2.weight": (v.out_hidden_size, wide), f"{p}.merger.mlp.2.bias": (v.out_hidden_size,)}
        for i in range(v.depth):
            b = f"{p}.blocks.{i}"
            shapes.update({f"{b}.norm1.weight": (d,), f"{b}.norm1.bias": (d,), f"{b}.norm2.weight": (d,),
                           f"{b}.norm2.bias": (d,), f"{b}.attn.qkv.weight": (3 * d, d), f"{b}.attn.qkv.bias": (3 * d,),
                           f"{b}.attn.proj.weight": (d, d), f"{b}.attn.proj.bias": (d,),
                           f"{b}.mlp.fc1.weight": (f, d), f"{b}.mlp.fc1.bias": (f,),
                           f"{b}.mlp.fc2.weight": (d, f), f"{b}.mlp.fc2.bias": (d,)})
        return shapes

    def vision_tower(self, *, tp_group=None, recompute: bool = False):
        from loongforge_hf.multimodal.vision_qwen2 import Qwen2VisionTower

        return Qwen2VisionTower(self.vision_config, tp_group=tp_group, recompute=recompute)


VL_BRIDGES.update({arch: Qwen2VLBridge for arch in Qwen2VLBridge.architectures})
