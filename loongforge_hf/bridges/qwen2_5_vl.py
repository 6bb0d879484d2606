"""Qwen2_5_VLForConditionalGeneration: a Qwen2 decoder with multimodal rope, a windowed ViT and a patch merger.

Choices:
- The language model is the Qwen2 declaration (bias on q, k, v) over ``text_config``, built by megatron with
  ``position_embedding_type="mrope"`` and ``mrope_section`` from ``rope_parameters``; word embeddings are tied when the
  top-level config says so (Qwen2.5-VL-3B).
- Two on-disk namings exist: the hub's (``model.layers.*``, ``visual.*``, ``lm_head.weight``; transformers 5 writes
  it too) and the one transformers 4.5x wrote (``model.language_model.*``, ``model.visual.*``). The checkpoint's keys
  decide, and export writes the names that were read.
- Vision tensors are named like the modules of ``multimodal.vision.VisionTower`` (``blocks.{layer}.attn.qkv.weight``
  ...). Under ``vision_tensor_parallel_size`` > 1 attention splits by heads (the fused ``qkv`` rows as three blocks),
  the MLP's gate/up by rows and proj/down by columns; norms, biases added after the all-reduce, the patch embedding
  and the merger are replicated.
- The ViT's config deltas we cannot reproduce (another activation, another rope type, non-square merge) raise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges import transforms as T
from loongforge_hf.bridges.mappings import (ColumnParallel, Mapping, Replicated, RowParallel, ShardContext, _fmt,
                                            renamed)
from loongforge_hf.bridges.qwen2 import Qwen2Bridge
from loongforge_hf.bridges.registry import UnsupportedArchitectureError

HUB_NAMES = ("model", "visual")                        # what transformers 5 and the hub's checkpoints use
NESTED_NAMES = ("model.language_model", "model.visual")  # what transformers 4.5x wrote
_ROPE_TYPES = ("default", "mrope")


def check_vit(v, heads_field: str = "num_heads") -> None:
    """What the ViTs with an axial 2-D rope need of ``vision_config`` (its head count in ``heads_field``): an
    activation transformers knows, the axial rope, a head size divisible by 4."""
    from transformers.activations import ACT2FN

    if v.hidden_act not in ACT2FN:
        raise C.UnsupportedConfigError(f"vision_config.hidden_act={v.hidden_act!r} is not an activation "
                                       "transformers knows.")
    rope_type = (getattr(v, "rope_parameters", None) or {}).get("rope_type", "axial")
    if rope_type != "axial":
        raise C.UnsupportedConfigError(f"vision_config.rope_parameters.rope_type={rope_type!r} is not supported "
                                       "(only 'axial').")
    heads = getattr(v, heads_field)
    if v.hidden_size % heads or (v.hidden_size // heads) % 4:
        raise C.UnsupportedConfigError(f"vision_config: hidden_size={v.hidden_size} / {heads_field}={heads} "
                                       "must be a whole head size divisible by 4 (axial rope over h and w).")


class PrefixedText:
    """The language model of an image-text model for megatron: its causal-LM bridge (the next base class) over
    ``text_config``, its tensors under ``text_prefix`` where the causal LM's are under ``model``."""

    def __init__(self, text_config, *, tied: bool, text_prefix: str = "model") -> None:
        self._tied = tied
        self.text_prefix = text_prefix
        super().__init__(text_config)

    @property
    def tied(self) -> bool:
        return self._tied

    def _name(self, mapping: Mapping) -> Mapping:
        return renamed(mapping, "model.", self.text_prefix + ".")

    def layer_mappings(self) -> list[Mapping]:
        return [self._name(m) for m in super().layer_mappings()]

    def mappings_for_layer(self, layer: int) -> list[Mapping]:
        return [self._name(m) for m in super().mappings_for_layer(layer)]

    def embedding_mapping(self) -> Mapping:
        return self._name(super().embedding_mapping())

    def final_mappings(self) -> list[Mapping]:
        return [self._name(m) for m in super().final_mappings()]

    def expected_hf_shapes(self) -> dict[str, tuple[int, ...]]:
        old = "model."
        return {(self.text_prefix + "." + n[len(old):] if n.startswith(old) else n): s
                for n, s in super().expected_hf_shapes().items()}


class MRopeText(PrefixedText):
    """``PrefixedText`` with mrope (Qwen's image-text models)."""

    position_embedding_type = "mrope"
    family = "Qwen2.5-VL"

    def check_config(self) -> None:
        super().check_config()
        self.mrope_section()  # NOTE: at load, before any collective (the builder reads it too)

    def rope_parameters(self) -> dict:
        params = dict(getattr(self.hf_config, "rope_parameters", None) or {})
        # NOTE: older configs say rope_type "mrope"; its frequencies are the default ones.
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in _ROPE_TYPES:
            raise C.UnsupportedConfigError(f"text_config.rope_parameters.rope_type={rope_type!r} is not implemented "
                                           f"for {self.family}; supported: {list(_ROPE_TYPES)}.")
        params["rope_type"] = "default"
        params.setdefault("rope_theta", getattr(self.hf_config, "rope_theta", 10000.0))
        return params

    def mrope_section(self) -> list[int]:
        params = self.rope_parameters()
        section = list(params.get("mrope_section") or [])
        # NOTE: the rotary channels' half: all of head_dim but with partial_rotary_factor (Qwen3.5's 0.25)
        half = int(C.head_dim_of(self.hf_config) * params.get("partial_rotary_factor", 1.0)) // 2
        if len(section) != 3 or sum(section) != half:
            raise C.UnsupportedConfigError(f"text_config.rope_parameters.mrope_section={section} must be three sizes "
                                           f"(temporal, height, width) adding up to head_dim x partial_rotary_factor "
                                           f"/ 2 = {half}.")
        return section

    def transformer_config_kwargs(self) -> dict:
        return {**super().transformer_config_kwargs(), "mrope_section": self.mrope_section()}


class Qwen2_5_VLTextBridge(MRopeText, Qwen2Bridge):
    """The language model of Qwen2.5-VL for megatron: Qwen2 with mrope, under ``text_prefix``."""


@dataclass(frozen=True)
class FusedQKVRows(Mapping):
    """A ``[q; k; v]`` row-stacked tensor (weight or bias) split by heads: rank r holds ``[q_r; k_r; v_r]``."""

    megatron: str
    hf: str
    tp_split = "column"

    def hf_names(self, layer):
        return [_fmt(self.hf, layer)]

    def load(self, reader, ctx, layer):
        name = _fmt(self.hf, layer)
        rows = reader.shape(name)[0] // 3
        start, stop = T.shard_range(rows, rank=ctx.tp_rank, world=ctx.tp_size, name=name)
        return torch.cat([reader.get_slice(name, dim=0, start=i * rows + start, stop=i * rows + stop)
                          for i in range(3)], dim=0)

    def export(self, shards, ctx, layer):
        parts = [s.reshape(3, s.shape[0] // 3, *s.shape[1:]) for s in shards]
        full = torch.cat(parts, dim=1)
        return {_fmt(self.hf, layer): full.reshape(-1, *full.shape[2:])}


class Qwen2_5_VLBridge:
    """Declaration of ``Qwen2_5_VLForConditionalGeneration``: the text bridge, the vision tensor table, the checks."""

    architectures = ("Qwen2_5_VLForConditionalGeneration",)
    text_bridge_class = Qwen2_5_VLTextBridge
    frames_apart = False  # NOTE: True: a video's frames are separate items of the 3-D positions (Qwen3-VL)
    mrope = True  # NOTE: False: the language model takes 1-D positions (Gemma 3)
    bidirectional_images = False  # NOTE: True: an image's tokens attend to each other both ways (Gemma 3)
    causal_lm_auto = False  # NOTE: True: transformers' AutoModelForCausalLM loads it (Gemma 3, Qwen3.5)

    def __init__(self, hf_config, checkpoint_names=(), shape_of=None) -> None:
        """``checkpoint_names`` / ``shape_of(name)``: the checkpoint's tensor names and shapes (the layout it uses)."""
        self.hf_config = hf_config
        names = set(checkpoint_names)
        self.text_prefix, self.vision_prefix = NESTED_NAMES if f"{NESTED_NAMES[0]}.embed_tokens.weight" in names \
            else HUB_NAMES
        self.text = self.text_bridge(names, shape_of)
        self.check_vision_config()

    def text_bridge(self, checkpoint_names: set, shape_of):
        return self.text_bridge_class(self.hf_config.text_config, tied=self.tied, text_prefix=self.text_prefix)

    @property
    def tied(self) -> bool:
        return bool(getattr(self.hf_config, "tie_word_embeddings", False))

    @property
    def vision_config(self):
        return self.hf_config.vision_config

    @property
    def vision_heads(self) -> int:
        return self.vision_config.num_heads

    @property
    def vision_merge(self) -> int:
        """Vision tokens per image side are the tower's patches per side over this."""
        return self.vision_config.spatial_merge_size

    def vision_inputs(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor | None, image_sizes=None):
        """(pixels, grid) as the tower takes them from the processor's: Qwen's are already patches and grids;
        ``image_sizes``: each padded image's size in pixels (Mistral 3's processor gives them), else None."""
        return pixel_values, grid_thw

    @property
    def image_token_id(self) -> int:
        return int(self.hf_config.image_token_id)

    @property
    def video_token_id(self) -> int | None:
        token = getattr(self.hf_config, "video_token_id", None)
        return None if token is None else int(token)

    def check_vision_config(self) -> None:
        v = self.vision_config
        check_vit(v)
        if v.window_size % (v.spatial_merge_size * v.patch_size):
            raise C.UnsupportedConfigError(f"vision_config.window_size={v.window_size} must be a multiple of "
                                           f"spatial_merge_size x patch_size = {v.spatial_merge_size * v.patch_size}.")

    # ---- vision tensors ----------------------------------------------------------------------------------------
    def vision_block_mappings(self) -> list[Mapping]:
        """One ViT block's tensors; ``megatron`` is the name inside ``VisionTower``, ``{layer}`` the block index."""
        b, p = "blocks.{layer}", f"{self.vision_prefix}.blocks.{{layer}}"
        maps: list[Mapping] = [Replicated(f"{b}.norm1.weight", f"{p}.norm1.weight"),
                               Replicated(f"{b}.norm2.weight", f"{p}.norm2.weight")]
        maps += [FusedQKVRows(f"{b}.attn.qkv.{k}", f"{p}.attn.qkv.{k}") for k in ("weight", "bias")]
        maps += [RowParallel(f"{b}.attn.proj.weight", f"{p}.attn.proj.weight"),
                 Replicated(f"{b}.attn.proj.bias", f"{p}.attn.proj.bias")]
        for proj in ("gate_proj", "up_proj"):
            maps += [ColumnParallel(f"{b}.mlp.{proj}.{k}", f"{p}.mlp.{proj}.{k}") for k in ("weight", "bias")]
        maps += [RowParallel(f"{b}.mlp.down_proj.weight", f"{p}.mlp.down_proj.weight"),
                 Replicated(f"{b}.mlp.down_proj.bias", f"{p}.mlp.down_proj.bias")]
        return maps

    def vision_other_mappings(self) -> list[Mapping]:
        """The patch embedding and the merger (the projector into the language model), replicated."""
        names = ["patch_embed.proj.weight", "merger.ln_q.weight", "merger.mlp.0.weight", "merger.mlp.0.bias",
                 "merger.mlp.2.weight", "merger.mlp.2.bias"]
        return [Replicated(n, f"{self.vision_prefix}.{n}") for n in names]

    def vision_mapping_table(self) -> dict[str, tuple[Mapping, int | None]]:
        """VisionTower parameter name -> (mapping, block index or None), in HF file order."""
        table = {m.megatron: (m, None) for m in self.vision_other_mappings()[:1]}
        for i in range(self.vision_config.depth):
            table.update({m.megatron.format(layer=i): (m, i) for m in self.vision_block_mappings()})
        table.update({m.megatron: (m, None) for m in self.vision_other_mappings()[1:]})
        return table

    def vision_shard_context(self, *, tp_rank: int, tp_size: int) -> ShardContext:
        v = self.vision_config
        return ShardContext(tp_rank=tp_rank, tp_size=tp_size, num_heads=v.num_heads, num_kv_heads=v.num_heads,
                            head_dim=v.hidden_size // v.num_heads, vocab_size=0, padded_vocab=0)

    def vision_shapes(self) -> dict[str, tuple[int, ...]]:
        v, p = self.vision_config, self.vision_prefix
        d, f, m2 = v.hidden_size, v.intermediate_size, v.spatial_merge_size ** 2
        patch = (d, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size)
        shapes = {f"{p}.patch_embed.proj.weight": patch,
                  f"{p}.merger.ln_q.weight": (d,), f"{p}.merger.mlp.0.weight": (d * m2, d * m2),
                  f"{p}.merger.mlp.0.bias": (d * m2,), f"{p}.merger.mlp.2.weight": (v.out_hidden_size, d * m2),
                  f"{p}.merger.mlp.2.bias": (v.out_hidden_size,)}
        for i in range(v.depth):
            b = f"{p}.blocks.{i}"
            shapes.update({f"{b}.norm1.weight": (d,), f"{b}.norm2.weight": (d,), f"{b}.attn.qkv.weight": (3 * d, d),
                           f"{b}.attn.qkv.bias": (3 * d,), f"{b}.attn.proj.weight": (d, d),
                           f"{b}.attn.proj.bias": (d,), f"{b}.mlp.gate_proj.weight": (f, d),
                           f"{b}.mlp.gate_proj.bias": (f,), f"{b}.mlp.up_proj.weight": (f, d),
                           f"{b}.mlp.up_proj.bias": (f,), f"{b}.mlp.down_proj.weight": (d, f),
                           f"{b}.mlp.down_proj.bias": (d,)})
        return shapes

    def expected_hf_shapes(self) -> dict[str, tuple[int, ...]]:
        return {**self.text.expected_hf_shapes(), **self.vision_shapes()}

    def is_projector(self, vision_param_name: str) -> bool:
        return vision_param_name.startswith("merger.")

    def vision_tower(self, *, tp_group=None, recompute: bool = False):
        """The tower module for ``vision_config`` (weights empty; ``vision_weights.load_vision`` fills them)."""
        from loongforge_hf.multimodal.vision import VisionTower

        return VisionTower(self.vision_config, tp_group=tp_group, recompute=recompute)


VL_BRIDGES = {arch: Qwen2_5_VLBridge for arch in Qwen2_5_VLBridge.architectures}


def image_text_architectures() -> list[str]:
    """The HF architectures ``lf.AutoModelForImageTextToText`` loads."""
    from . import gemma3_vl, idefics3, internvl, llava, llava_next, mistral3_vl, qwen2_vl  # noqa: F401
    from . import qwen3_5_vl, qwen3_vl  # noqa: F401
    from . import llava_onevision  # noqa: F401
    from . import llava_next_video  # noqa: F401
    from . import llama4_vl  # noqa: F401
    from . import glm4v  # noqa: F401
    from . import aya_vision, gemma4_vl, paligemma  # noqa: F401
    from . import aria_vl  # noqa: F401

    return sorted(VL_BRIDGES)


def get_vl_bridge(hf_config, checkpoint_names=(), shape_of=None) -> Qwen2_5_VLBridge:
    image_text_architectures()  # NOTE: every image-text bridge registered
    for arch in getattr(hf_config, "architectures", None) or []:
        if arch in VL_BRIDGES:
            return VL_BRIDGES[arch](hf_config, checkpoint_names, shape_of)
    named = ", ".join(getattr(hf_config, "architectures", None) or []) or repr(getattr(hf_config, "model_type", None))
    raise UnsupportedArchitectureError(f"No loongforge-hf image-text-to-text bridge for {named}. Supported "
                                       f"architectures: {', '.join(sorted(VL_BRIDGES))}.")
