"""Qwen3VLForConditionalGeneration: a Qwen3 decoder with interleaved multimodal rope, a ViT with a learned position
table, and DeepStack (features of intermediate ViT blocks added to the first decoder layers' outputs).

Choices:
- The language model is the Qwen3 declaration (per-head q/k RMSNorm) over ``text_config``, built by megatron with
  ``position_embedding_type="mrope"``; its rotary embedding is swapped for ``InterleavedMRoPE``: Qwen3-VL takes the
  frequency channels of the (temporal, height, width) axes interleaved (channel ``j`` is height's when ``j % 3 == 1``
  and ``j < 3 * mrope_section[1]``, width's when ``j % 3 == 2`` and ``j < 3 * mrope_section[2]``, temporal's
  otherwise), where megatron's ``MultimodalRotaryEmbedding`` takes contiguous sections (Qwen2-VL's layout).
- Tensor names: the hub's checkpoints and transformers 5 write ``model.language_model.*`` / ``model.visual.*``
  (transformers loads no other naming of Qwen3-VL); export writes the names that were read.
- Vision tensors are named like ``multimodal.vision_qwen3.Qwen3VisionTower``'s modules, split over TP as Qwen2.5-VL's
  tower (attention by heads, the fused ``qkv`` rows as three blocks; ``linear_fc1`` by rows, ``linear_fc2`` by
  columns); norms, biases added after the reduction, the patch embedding, the position table and the mergers
  (DeepStack's included, all "projector" for ``freeze_projector``) are replicated.
- A video's frames are separate items of the 3-D positions (the processor puts a timestamp between them): each frame
  takes temporal position ``p`` and the text after it continues at ``p + max(h, w)`` (``frames_apart``).
- Refused: a ViT activation transformers does not know, a non-axial ViT rope, a non-square position table,
  DeepStack indexes outside the ViT or more of them than decoder layers; DeepStack layers outside the first
  pipeline stage are refused at load (``multimodal.chunk.check_deepstack_layers``).
"""

from __future__ import annotations

import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import MultimodalRotaryEmbedding

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.dense import L
from loongforge_hf.bridges.mappings import ColumnParallel, Mapping, Replicated, RowParallel
from loongforge_hf.bridges.qwen2_5_vl import VL_BRIDGES, FusedQKVRows, MRopeText, Qwen2_5_VLBridge, check_vit
from loongforge_hf.bridges.qwen3 import Qwen3Bridge
from loongforge_hf.bridges.qwen3_moe import Qwen3MoeBridge
from loongforge_hf.bridges.stacked_experts import StackedDown, StackedGateUp, routed_stack


def interleaved_axes(mrope_section: list[int], channels: int, device=None) -> torch.Tensor:
    """``[channels]`` axis (0 temporal, 1 height, 2 width) of each frequency channel, Qwen3-VL's interleaving (no
    host sync: a static cache's decode step captures it in a CUDA graph)."""
    j = torch.arange(channels, device=device)
    height = (j % 3 == 1) & (j < 3 * mrope_section[1])
    width = (j % 3 == 2) & (j < 3 * mrope_section[2])
    return height.long() + 2 * width.long()


class InterleavedMRoPE(MultimodalRotaryEmbedding):
    """megatron's multimodal rotary embedding with the axes' channels interleaved (see the module docstring): the
    same ``forward(position_ids [3, b, s], mrope_section)`` -> angles ``[s, b, 1, dim]`` (CP share sliced).
    Subclasses pick the frequency channels' axes otherwise (``channel_axes``: GLM-4.1V's contiguous sections); with
    ``rotary_interleaved`` each frequency turns a channel pair ``(2i, 2i + 1)``, else channels ``i`` and
    ``i + dim / 2``."""

    channel_axes = staticmethod(interleaved_axes)

    def forward(self, position_ids: torch.Tensor, mrope_section: list[int], cp_group=None) -> torch.Tensor:
        from megatron.core.models.common.embeddings.rope_utils import get_pos_emb_on_this_cp_rank

        if self.seq_len_interpolation_factor is not None:
            raise ValueError(f"{type(self).__name__}: seq_len_interpolation_factor is not supported.")
        positions = position_ids.to(device=self.inv_freq.device, dtype=torch.float32)
        freqs = positions[..., None] * self.inv_freq.float()                       # [3, b, s, dim / 2]
        axes = self.channel_axes(mrope_section, freqs.shape[-1], device=freqs.device)
        half = freqs.gather(0, axes.expand(1, *freqs.shape[1:]))[0]                # [b, s, dim / 2]
        full = half.repeat_interleave(2, dim=-1) if self.rotary_interleaved else torch.cat([half, half], dim=-1)
        emb = full[..., None, :].transpose(0, 1).contiguous()
        cp_group = cp_group if cp_group is not None else self.cp_group
        if cp_group is not None and cp_group.size() > 1:
            emb = get_pos_emb_on_this_cp_rank(emb, 0, cp_group)
        return emb


class InterleavedRope:
    """A text bridge whose built model takes ``InterleavedMRoPE`` (or its ``rope_class``) for megatron's multimodal
    rotary embedding."""

    rope_class = InterleavedMRoPE

    def finish_model(self, model) -> None:
        super().finish_model(model)
        if isinstance(getattr(model, "rotary_pos_emb", None), MultimodalRotaryEmbedding):
            model.rotary_pos_emb.__class__ = self.rope_class


class Qwen3VLTextBridge(InterleavedRope, MRopeText, Qwen3Bridge):
    """The language model of Qwen3-VL for megatron: Qwen3 with interleaved mrope, under ``text_prefix``."""

    family = "Qwen3-VL"


class Qwen3VLMoeTextBridge(InterleavedRope, MRopeText, Qwen3MoeBridge):
    """The language model of Qwen3-VL-MoE: Qwen3-MoE (softmax top-k, renormalised) with interleaved mrope, its routed
    experts stacked on disk: ``experts.gate_up_proj`` ``[E, 2I, H]`` (``[gate; up]`` rows) and ``experts.down_proj``
    ``[E, H, I]`` as transformers 5 writes them, or each transposed (``[E, H, 2I]``, ``[E, I, H]``) as the hub's
    checkpoints hold them (``experts_transposed``, from the checkpoint's shapes; export writes the layout read)."""

    family = "Qwen3-VL-MoE"
    experts_transposed = False

    def routing_kwargs(self) -> dict:
        return {"moe_router_score_function": "softmax", "moe_router_pre_softmax": False}

    def moe_mappings(self) -> list[Mapping]:
        norm_and_router = super().moe_mappings()[:2]
        s = f"{L}.mlp.experts"
        return norm_and_router + [routed_stack(self, cls, name, f"{s}.{hf}", transposed=self.experts_transposed)
                                  for cls, name, hf in ((StackedGateUp, "linear_fc1.weight", "gate_up_proj"),
                                                        (StackedDown, "linear_fc2.weight", "down_proj"))]

    def moe_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        h, f, n = self.hf_config.hidden_size, self.expert_ffn_size(), self.num_experts()
        gate_up, down = ((n, h, 2 * f), (n, f, h)) if self.experts_transposed else ((n, 2 * f, h), (n, h, f))
        return {f"{prefix}.post_attention_layernorm.weight": (h,), f"{prefix}.mlp.gate.weight": (n, h),
                f"{prefix}.mlp.experts.gate_up_proj": gate_up, f"{prefix}.mlp.experts.down_proj": down}


def layer_norm_block_mappings(vision_prefix: str, mlp: tuple[str, str] = ("linear_fc1", "linear_fc2")) -> list[Mapping]:
    """One block of a LayerNorm ViT with a fused ``qkv`` and an ungated MLP (Qwen3-VL's, Qwen2-VL's: its HF names
    ``mlp``, the tower's ``linear_fc1`` / ``linear_fc2``), ``{layer}`` the block index."""
    b, p = "blocks.{layer}", f"{vision_prefix}.blocks.{{layer}}"
    maps: list[Mapping] = [Replicated(f"{b}.{n}.{k}", f"{p}.{n}.{k}") for n in ("norm1", "norm2")
                           for k in ("weight", "bias")]
    maps += [FusedQKVRows(f"{b}.attn.qkv.{k}", f"{p}.attn.qkv.{k}") for k in ("weight", "bias")]
    maps += [RowParallel(f"{b}.attn.proj.weight", f"{p}.attn.proj.weight"),
             Replicated(f"{b}.attn.proj.bias", f"{p}.attn.proj.bias")]
    maps += [ColumnParallel(f"{b}.mlp.linear_fc1.{k}", f"{p}.mlp.{mlp[0]}.{k}") for k in ("weight", "bias")]
    maps += [RowParallel(f"{b}.mlp.linear_fc2.weight", f"{p}.mlp.{mlp[1]}.weight"),
             Replicated(f"{b}.mlp.linear_fc2.bias", f"{p}.mlp.{mlp[1]}.bias")]
    return maps


class Qwen3VLBridge(Qwen2_5_VLBridge):
    """Declaration of ``Qwen3VLForConditionalGeneration``."""

    architectures = ("Qwen3VLForConditionalGeneration",)
    text_bridge_class = Qwen3VLTextBridge
    frames_apart = True

    @property
    def deepstack_count(self) -> int:
        return len(getattr(self.vision_config, "deepstack_visual_indexes", None) or ())  # NOTE: Qwen3.5: none

    def check_vision_config(self) -> None:
        v = self.vision_config
        check_vit(v)
        side = int(round(v.num_position_embeddings ** 0.5))
        if side * side != v.num_position_embeddings:
            raise C.UnsupportedConfigError(f"vision_config.num_position_embeddings={v.num_position_embeddings} must "
                                           "be a square (the learned position grid).")
        indexes = list(getattr(v, "deepstack_visual_indexes", None) or ())
        if len(set(indexes)) != len(indexes) or any(not 0 <= i < v.depth for i in indexes):
            raise C.UnsupportedConfigError(f"vision_config.deepstack_visual_indexes={indexes} must be distinct block "
                                           f"indexes of the ViT (depth {v.depth}).")
        if len(indexes) > self.hf_config.text_config.num_hidden_layers:
            raise C.UnsupportedConfigError(f"{len(indexes)} DeepStack features for "
                                           f"{self.hf_config.text_config.num_hidden_layers} decoder layers.")

    # ---- vision tensors ----------------------------------------------------------------------------------------
    def vision_block_mappings(self) -> list[Mapping]:
        return layer_norm_block_mappings(self.vision_prefix)

    def _merger_shapes(self) -> dict[str, tuple[int, ...]]:
        """The mergers' tensors (``merger.*``, ``deepstack_merger_list.{k}.*``) and their shapes."""
        v = self.vision_config
        wide = v.hidden_size * v.spatial_merge_size ** 2
        shapes = {}
        for m in ["merger"] + [f"deepstack_merger_list.{k}" for k in range(self.deepstack_count)]:
            norm = v.hidden_size if m == "merger" else wide  # NOTE: DeepStack's norm follows the 2x2 shuffle
            for layer, shape in (("norm", (norm,)), ("linear_fc1", (wide, wide)),
                                 ("linear_fc2", (v.out_hidden_size, wide))):
                shapes.update({f"{m}.{layer}.weight": shape, f"{m}.{layer}.bias": shape[:1]})
        return shapes

    def vision_mapping_table(self) -> dict[str, tuple[Mapping, int | None]]:
        table = {n: (Replicated(n, f"{self.vision_prefix}.{n}"), None)
                 for n in ("patch_embed.proj.weight", "patch_embed.proj.bias", "pos_embed.weight")}
        for i in range(self.vision_config.depth):
            table.update({m.megatron.format(layer=i): (m, i) for m in self.vision_block_mappings()})
        table.update({n: (Replicated(n, f"{self.vision_prefix}.{n}"), None) for n in self._merger_shapes()})
        return table

    def vision_shapes(self) -> dict[str, tuple[int, ...]]:
        v, p = self.vision_config, self.vision_prefix
        d, f = v.hidden_size, v.intermediate_size
        patch = (d, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size)
        shapes = {f"{p}.patch_embed.proj.weight": patch,
                  f"{p}.patch_embed.proj.bias": (d,), f"{p}.pos_embed.weight": (v.num_position_embeddings, d)}
        for i in range(v.depth):
            b = f"{p}.blocks.{i}"
            shapes.update({f"{b}.norm1.weight": (d,), f"{b}.norm1.bias": (d,), f"{b}.norm2.weight": (d,),
                           f"{b}.norm2.bias": (d,), f"{b}.attn.qkv.weight": (3 * d, d), f"{b}.attn.qkv.bias": (3 * d,),
                           f"{b}.attn.proj.weight": (d, d), f"{b}.attn.proj.bias": (d,),
                           f"{b}.mlp.linear_fc1.weight": (f, d), f"{b}.mlp.linear_fc1.bias": (f,),
                           f"{b}.mlp.linear_fc2.weight": (d, f), f"{b}.mlp.linear_fc2.bias": (d,)})
        shapes.update({f"{p}.{n}": shape for n, shape in self._merger_shapes().items()})
        return shapes

    def is_projector(self, vision_param_name: str) -> bool:
        return vision_param_name.startswith(("merger.", "deepstack_merger_list."))

    def vision_tower(self, *, tp_group=None, recompute: bool = False):
        from loongforge_hf.multimodal.vision_qwen3 import Qwen3VisionTower

        return Qwen3VisionTower(self.vision_config, tp_group=tp_group, recompute=recompute)


class Qwen3VLMoeBridge(Qwen3VLBridge):
    """Declaration of ``Qwen3VLMoeForConditionalGeneration``: Qwen3-VL's vision side, a Qwen3-MoE language model."""

    architectures = ("Qwen3VLMoeForConditionalGeneration",)
    text_bridge_class = Qwen3VLMoeTextBridge

    def text_bridge(self, checkpoint_names: set, shape_of):
        text = super().text_bridge(checkpoint_names, shape_of)
        t = text.hf_config
        moe = [i for i in range(t.num_hidden_layers) if text.is_moe_layer(i)]
        name = f"{self.text_prefix}.layers.{moe[0]}.mlp.experts.gate_up_proj" if moe else None
        if name in checkpoint_names and shape_of is not None:
            # NOTE: as transformers decides: the module's layout when the shape is its, else transposed
            n, h, f = t.num_experts, t.hidden_size, t.moe_intermediate_size
            shape = tuple(shape_of(name))
            text.experts_transposed = shape != (n, 2 * f, h) and shape == (n, h, 2 * f)
        return text


VL_BRIDGES.update({arch: cls for cls in (Qwen3VLBridge, Qwen3VLMoeBridge) for arch in cls.architectures})
