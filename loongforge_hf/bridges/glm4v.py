"""Glm4vForConditionalGeneration (GLM-4.1V-9B-Thinking and its fine-tunes): a GLM-4 decoder with multimodal rope over
interleaved channel pairs, a ViT of RMSNorm blocks with a learned position grid, a downsampling convolution and a gated
patch merger; Glm4vMoeForConditionalGeneration (GLM-4.5V): the same ViT over the GLM-4.5 mixture-of-experts decoder.

Choices:
- The language model is the GLM-4 declaration (``glm4.py``: ``gate_up_proj``, the post-attention and post-MLP norms,
  half of each head rotated in interleaved pairs) over ``text_config``, always with q / k / v biases (transformers'
  GLM-4.1V attention has them whatever the config says), built with ``position_embedding_type="mrope"``. Its rotary
  embedding is ``SectionedPairMRoPE``: the rotary frequencies take the (temporal, height, width) positions in
  contiguous sections (``mrope_section``, adding up to half the rotary channels), each frequency turning a channel
  pair ``(2i, 2i + 1)`` (transformers' ``repeat_interleave(2)``), where megatron's ``MultimodalRotaryEmbedding``
  repeats the sections in halves.
- GLM-4.5V's language model is the GLM-4.5 declaration (``glm4_moe.py``: DeepSeek-V3's routing and shared experts,
  the first ``first_k_dense_replace`` layers dense, per-expert tensors as transformers and the hub write them) with
  megatron's own ``MultimodalRotaryEmbedding``: transformers' GLM-4.5V rotates in rotate-half pairs, the sections
  repeated in halves, as megatron does.
- 3-D positions as Qwen2-VL's for images (``multimodal.positions``; transformers' ``get_rope_index`` gives the same:
  ``p + h_i``, ``p + w_i``, the text after at ``p + max(h, w)``), the image tokens from the processor's
  ``mm_token_type_ids``.
- Videos as transformers takes them: the processor marks a video's frames with the image token (a timestamp between
  frames) and ``mm_token_type_ids`` 2; ``mark_video_tokens`` turns those placeholders into ``video_token_id`` before
  the splice (their text embeddings are replaced either way), so the videos' embeddings fill them in order. The
  tower encodes each frame as an image; each frame is its own 3-D position item (``frames_apart``, temporal position
  ``p``: transformers' ``get_rope_index`` splits ``video_grid_thw`` per frame). Image and video rows may share a
  batch (transformers' forward refuses that: its image mask also holds the video frames). ``generate`` marks them the
  same way at each step that takes videos (``multimodal.generation``).
- Tensor names: ``model.language_model.*`` / ``model.visual.*`` / ``lm_head``, as transformers 5 and the hub write
  them (export writes the names read).
- Vision tensors are named like ``multimodal.vision_glm4v.Glm4vVisionTower``'s modules; under
  ``vision_tensor_parallel_size`` > 1 attention splits by heads (the fused ``qkv`` rows as three blocks), the blocks'
  ``gate_proj`` / ``up_proj`` by rows and ``down_proj`` by columns; norms, the position grid, the patch embedding,
  the downsample and the merger are replicated. "Projector" (``freeze_projector``): the downsample and the merger.
- ``vision_config`` is a view of GLM-4.1V's with the tower's names (``tower_config``): ``intermediate_size`` the
  blocks' MLP width (GLM's ``out_hidden_size``), ``merger_size`` the merger's (GLM's ``intermediate_size``).
- Refused: videos without ``mm_token_type_ids`` (nothing else tells their frames from images; in ``generate`` too),
  a ViT activation transformers does not know, a non-axial ViT rope, a head size that is not a whole multiple of 4,
  a ``head_dim`` other than ``hidden_size / num_heads``, an ``image_size`` that is not a whole number of patches, an
  ``out_hidden_size`` other than the decoder's ``hidden_size``; on the text side what the GLM-4 (GLM-4.5) and
  Qwen2.5-VL text declarations refuse (another rope type, a bad ``mrope_section``).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.glm4 import Glm4Bridge
from loongforge_hf.bridges.glm4_moe import Glm4MoeBridge
from loongforge_hf.bridges.mappings import ColumnParallel, Mapping, Replicated, RowParallel
from loongforge_hf.bridges.qwen2_5_vl import VL_BRIDGES, FusedQKVRows, MRopeText, Qwen2_5_VLBridge, check_vit
from loongforge_hf.bridges.qwen3_vl import InterleavedMRoPE, InterleavedRope


def sectioned_axes(mrope_section: list[int], channels: int, device=None) -> torch.Tensor:
    """``[channels]`` axis (0 temporal, 1 height, 2 width) of each frequency channel: contiguous sections (no host
    sync, as ``qwen3_vl.interleaved_axes``)."""
    j = torch.arange(channels, device=device)
    return (j >= mrope_section[0]).long() + (j >= mrope_section[0] + mrope_section[1]).long()


class SectionedPairMRoPE(InterleavedMRoPE):
    """GLM-4.1V's multimodal rotary embedding: contiguous sections, each frequency on a channel pair (megatron's
    ``rotary_interleaved``, which the bridge sets)."""

    channel_axes = staticmethod(sectioned_axes)


class Glm4vTextBridge(InterleavedRope, MRopeText, Glm4Bridge):
    """The language model of GLM-4.1V for megatron: GLM-4 with sectioned pair mrope, under ``text_prefix``."""

    family = "GLM-4.1V"
    rope_class = SectionedPairMRoPE
    qkv_bias_always = True


class Glm4vMoeTextBridge(MRopeText, Glm4MoeBridge):
    """The language model of GLM-4.5V for megatron: GLM-4.5 with mrope, under ``text_prefix``."""

    family = "GLM-4.5V"


def tower_config(v) -> SimpleNamespace:
    """GLM-4.1V's vision config ``v`` under the tower's field names (see the module docstring)."""
    return SimpleNamespace(hidden_size=v.hidden_size, intermediate_size=v.out_hidden_size,
                           out_hidden_size=v.out_hidden_size, merger_size=v.intermediate_size, num_heads=v.num_heads,
                           depth=v.depth, hidden_act=v.hidden_act, patch_size=v.patch_size, image_size=v.image_size,
                           temporal_patch_size=v.temporal_patch_size, in_channels=v.in_channels,
                           spatial_merge_size=v.spatial_merge_size, rms_norm_eps=v.rms_norm_eps,
                           attention_bias=bool(v.attention_bias),
                           rope_parameters=dict(getattr(v, "rope_parameters", None) or {}))


class Glm4vBridge(Qwen2_5_VLBridge):
    """Declaration of ``Glm4vForConditionalGeneration``: the text bridge, the vision tensor table, the checks."""

    architectures = ("Glm4vForConditionalGeneration",)
    text_bridge_class = Glm4vTextBridge
    frames_apart = True  # NOTE: a timestamp between a video's frames: each frame its own 3-D position item

    def mark_video_tokens(self, input_ids: torch.Tensor, mm_token_type_ids: torch.Tensor | None) -> torch.Tensor:
        """``input_ids`` with the video placeholders (image tokens that ``mm_token_type_ids`` marks 2) as
        ``video_token_id``, so the splice gives them the videos' embeddings; text embeddings of those rows are
        replaced either way."""
        if mm_token_type_ids is None:
            raise ValueError("mm_token_type_ids: GLM-4.1V marks a video's frames with the image token; the processor's "
                             "mm_token_type_ids (2: video) tell them from images and are needed with "
                             "pixel_values_videos.")
        kinds = mm_token_type_ids.to(input_ids.device)
        if kinds.shape != input_ids.shape or bool(((kinds == 2) & (input_ids != self.image_token_id)).any()):
            raise ValueError(f"mm_token_type_ids: shape {tuple(kinds.shape)} and its video tokens (2) must match "
                             f"input_ids {tuple(input_ids.shape)}'s image tokens (id {self.image_token_id}).")
        return torch.where(kinds == 2, self.video_token_id, input_ids)

    @property
    def vision_config(self) -> SimpleNamespace:
        return tower_config(self.hf_config.vision_config)

    def check_vision_config(self) -> None:
        v = self.vision_config
        check_vit(v)
        head_dim = getattr(self.hf_config.vision_config, "head_dim", None)
        if head_dim and head_dim != v.hidden_size // v.num_heads:
            raise C.UnsupportedConfigError(f"vision_config.head_dim={head_dim} differs from hidden_size / num_heads "
                                           f"= {v.hidden_size // v.num_heads} (transformers' attention takes the "
                                           "latter).")
        if v.image_size % v.patch_size:
            raise C.UnsupportedConfigError(f"vision_config.image_size={v.image_size} is not a whole number of "
                                           f"patch_size={v.patch_size} patches (the learned position grid).")
        hidden = self.hf_config.text_config.hidden_size
        if v.out_hidden_size != hidden:
            raise C.UnsupportedConfigError(f"vision_config.out_hidden_size={v.out_hidden_size} must equal "
                                           f"text_config.hidden_size={hidden} (the merger feeds the decoder).")

    # ---- vision tensors ----------------------------------------------------------------------------------------
    def vision_block_mappings(self) -> list[Mapping]:
        b, p = "blocks.{layer}", f"{self.vision_prefix}.blocks.{{layer}}"
        maps: list[Mapping] = [Replicated(f"{b}.{n}.weight", f"{p}.{n}.weight") for n in ("norm1", "norm2")]
        maps += [FusedQKVRows(f"{b}.attn.qkv.{k}", f"{p}.attn.qkv.{k}")
                 for k in ("weight", "bias")[:1 + self.vision_config.attention_bias]]
        maps += [RowParallel(f"{b}.attn.proj.weight", f"{p}.attn.proj.weight")]
        maps += [ColumnParallel(f"{b}.mlp.{n}.weight", f"{p}.mlp.{n}.weight") for n in ("gate_proj", "up_proj")]
        return maps + [RowParallel(f"{b}.mlp.down_proj.weight", f"{p}.mlp.down_proj.weight")]

    def _other_shapes(self) -> tuple[dict, dict]:
        """(before the blocks, after them): the replicated tensors' names (inside the tower) and shapes."""
        v = self.vision_config
        d, out, m = v.hidden_size, v.out_hidden_size, v.spatial_merge_size
        side = v.image_size // v.patch_size
        before = {"patch_embed.proj.weight": (d, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size),
                  "patch_embed.proj.bias": (d,), "post_conv_layernorm.weight": (d,),
                  "embeddings.position_embedding.weight": (side * side, d)}
        after = {"post_layernorm.weight": (d,), "downsample.weight": (out, d, m, m), "downsample.bias": (out,),
                 "merger.proj.weight": (out, out), "merger.post_projection_norm.weight": (out,),
                 "merger.post_projection_norm.bias": (out,), "merger.gate_proj.weight": (v.merger_size, out),
                 "merger.up_proj.weight": (v.merger_size, out), "merger.down_proj.weight": (out, v.merger_size)}
        return before, after

    def vision_mapping_table(self) -> dict[str, tuple[Mapping, int | None]]:
        before, after = self._other_shapes()
        table = {n: (Replicated(n, f"{self.vision_prefix}.{n}"), None) for n in before}
        for i in range(self.vision_config.depth):
            table.update({m.megatron.format(layer=i): (m, i) for m in self.vision_block_mappings()})
        table.update({n: (Replicated(n, f"{self.vision_prefix}.{n}"), None) for n in after})
        return table

    def vision_shapes(self) -> dict[str, tuple[int, ...]]:
        v, p = self.vision_config, self.vision_prefix
        d, f = v.hidden_size, v.intermediate_size
        before, after = self._other_shapes()
        shapes = {f"{p}.{n}": s for n, s in {**before, **after}.items()}
        for i in range(v.depth):
            b = f"{p}.blocks.{i}"
            shapes.update({f"{b}.norm1.weight": (d,), f"{b}.norm2.weight": (d,), f"{b}.attn.qkv.weight": (3 * d, d),
                           f"{b}.attn.proj.weight": (d, d), f"{b}.mlp.gate_proj.weight": (f, d),
                           f"{b}.mlp.up_proj.weight": (f, d), f"{b}.mlp.down_proj.weight": (d, f)})
            if v.attention_bias:
                shapes[f"{b}.attn.qkv.bias"] = (3 * d,)
        return shapes

    def is_projector(self, vision_param_name: str) -> bool:
        return vision_param_name.startswith(("downsample.", "merger."))

    def vision_tower(self, *, tp_group=None, recompute: bool = False):
        from loongforge_hf.multimodal.vision_glm4v import Glm4vVisionTower

        return Glm4vVisionTower(self.vision_config, tp_group=tp_group, recompute=recompute)


class Glm4vMoeBridge(Glm4vBridge):
    """Declaration of ``Glm4vMoeForConditionalGeneration``: GLM-4.1V's vision side, a GLM-4.5 language model."""

    architectures = ("Glm4vMoeForConditionalGeneration",)
    text_bridge_class = Glm4vMoeTextBridge


VL_BRIDGES.update({arch: cls for cls in (Glm4vBridge, Glm4vMoeBridge) for arch in cls.architectures})
