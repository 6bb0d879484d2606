"""Gemma3ForConditionalGeneration (gemma-3-4b / 12b / 27b, pt and it; MedGemma's 4b): the Gemma 3 decoder, a SigLIP
ViT and Gemma 3's pooling projector; the language model's attention bidirectional within each image.

Choices:
- The language model is the Gemma 3 declaration (``gemma.Gemma3Bridge``: sandwich norms, q/k norms, sliding-window
  layers with their own rotary base, the scaled embedding) over ``text_config``, with 1-D positions and its tensors
  under the checkpoint's prefix; the LM head is the embedding (every Gemma 3 ties them: an untied config raises).
- Image tokens attend to every token of their own image, later ones included (transformers' ``token_type_ids``
  mask: ``OR(causal, blockwise)``, in sliding layers under the window): ``bidirectional_images``, applied when
  ``token_type_ids`` are given, as transformers applies it (``kernels.attention.bidirectional_blocks``).
- Three on-disk namings: the hub's (``language_model.model.*``, ``vision_tower.vision_model.*``,
  ``multi_modal_projector.*``), what transformers 5 writes (the same without ``vision_model``) and the module names
  (``model.language_model.*``, ``model.vision_tower.vision_model.*``, ``model.multi_modal_projector.*``); the
  checkpoint's keys decide, and export writes the names that were read.
- Vision tensors are named like ``multimodal.vision_siglip.SiglipTower``'s modules; under vision tensor parallelism
  q / k / v are split by heads into the fused ``qkv`` rows (``QKVRows``), ``fc1`` by rows, ``fc2`` and ``out_proj``
  by columns; norms, biases added after the reduction, the patch embedding, the position table and the projector are
  replicated.
- Refused: SigLIP's pooling head (``vision_use_head``; Gemma 3 reads the last hidden states), attention dropout in
  the ViT, an activation transformers does not know, a token count that is not a square dividing the patch grid.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.gemma import Gemma3Bridge
from loongforge_hf.bridges.mappings import (Mapping, Replicated, RowParallel, ShardContext, _fmt,
                                            _tp_slice, biased_mlp_mappings)
from loongforge_hf.bridges.qwen2_5_vl import VL_BRIDGES, PrefixedText, Qwen2_5_VLBridge

# (text prefix, vision prefix, projector prefix) of each naming, found by its tensors
_NAMINGS = (("language_model.model", "vision_tower.vision_model", "multi_modal_projector"),
            ("language_model.model", "vision_tower", "multi_modal_projector"),
            ("model.language_model", "model.vision_tower.vision_model", "model.multi_modal_projector"),
            ("model.language_model", "model.vision_tower", "model.multi_modal_projector"))


@dataclass(frozen=True)
class QKVRows(Mapping):
    """Three HF tensors (q, k, v projections' weights or biases) as one ``[q_r; k_r; v_r]`` row-stacked tensor per TP
    rank, each split by heads (``vision.VisionAttention``'s fused ``qkv``)."""

    megatron: str
    q: str
    k: str
    v: str
    tp_split = "column"

    def hf_names(self, layer):
        return [_fmt(n, layer) for n in (self.q, self.k, self.v)]

    def load(self, reader, ctx, layer):
        return torch.cat([_tp_slice(reader, name, ctx, dim=0) for name in self.hf_names(layer)])

    def export(self, shards, ctx, layer):
        full = torch.cat([s.reshape(3, s.shape[0] // 3, *s.shape[1:]) for s in shards], dim=1)
        return dict(zip(self.hf_names(layer), full.unbind(0)))


def biased_vit_block_mappings(hf_block: str, norms: tuple[str, str], out_proj: str) -> list[Mapping]:
    """A pre-norm ViT block with biases everywhere (SigLIP's, Llama 4's) -> our tower's ``blocks.{layer}`` names:
    the two norms (HF names ``norms``), q / k / v fused by heads (``QKVRows``), the row-parallel output projection
    ``self_attn.<out_proj>`` (its bias added after the reduction) and the ``mlp.fc1`` / ``mlp.fc2`` MLP."""
    b, p = "blocks.{layer}", hf_block
    maps: list[Mapping] = [Replicated(f"{b}.{n}.{k}", f"{p}.{hf}.{k}") for k in ("weight", "bias")
                           for n, hf in zip(("norm1", "norm2"), norms)]
    maps += [QKVRows(f"{b}.attn.qkv.{k}", *(f"{p}.self_attn.{x}_proj.{k}" for x in "qkv")) for k in ("weight", "bias")]
    maps += [RowParallel(f"{b}.attn.proj.weight", f"{p}.self_attn.{out_proj}.weight"),
             Replicated(f"{b}.attn.proj.bias", f"{p}.self_attn.{out_proj}.bias")]
    return maps + biased_mlp_mappings(f"{b}.mlp", f"{p}.mlp.fc1", f"{p}.mlp.fc2")


def siglip_outer_names(vision_prefix: str) -> tuple[dict[str, str], dict[str, str]]:
    """(tower name -> HF name) of a SigLIP tower's tensors before its blocks (patch and position embeddings), and of
    its post-block norm: what a bridge's ``_outer_names`` adds its projector's names to."""
    e = f"{vision_prefix}.embeddings"
    before = {"patch_embed.proj.weight": f"{e}.patch_embedding.weight",
              "patch_embed.proj.bias": f"{e}.patch_embedding.bias",
              "position_embedding.weight": f"{e}.position_embedding.weight"}
    return before, {f"post_layernorm.{k}": f"{vision_prefix}.post_layernorm.{k}" for k in ("weight", "bias")}


def siglip_shapes(bridge, projector: tuple) -> dict[str, tuple[int, ...]]:
    """HF shapes of ``bridge``'s SigLIP tower (patch embedding, position table, encoder layers, post-LayerNorm: the
    first names of its ``_outer_names``) and of its projector's tensors (``projector``: their shapes, in the order
    ``_outer_names`` gives them after the post-LayerNorm): Gemma 3, SmolVLM / Idefics3."""
    v = bridge.vision_config
    d, side = v.hidden_size, v.image_size // v.patch_size
    before, after = bridge._outer_names()
    shapes = dict(zip(before.values(), ((d, v.num_channels, v.patch_size, v.patch_size), (d,), (side * side, d))))
    shapes.update(encoder_layer_shapes(f"{bridge.vision_prefix}.encoder.layers", v.num_hidden_layers, d,
                                       v.intermediate_size))
    shapes.update(dict(zip(after.values(), ((d,), (d,), *projector))))
    return shapes


def check_siglip_vision(v, reader: str) -> None:
    """Refuse what our SigLIP tower does not run: an activation transformers does not know, the pooling head
    (``vision_use_head``: ``reader`` says what the model reads instead), attention dropout in the ViT."""
    from transformers.activations import ACT2FN

    if v.hidden_act not in ACT2FN:
        raise C.UnsupportedConfigError(f"vision_config.hidden_act={v.hidden_act!r} is not an activation "
                                       "transformers knows.")
    if getattr(v, "vision_use_head", False):
        raise C.UnsupportedConfigError(f"vision_config.vision_use_head=True is not supported: {reader}.")
    if getattr(v, "attention_dropout", 0.0):
        raise C.UnsupportedConfigError(f"vision_config.attention_dropout={v.attention_dropout} is not supported.")


def encoder_layer_shapes(prefix: str, layers: int, d: int, f: int) -> dict[str, tuple[int, ...]]:
    """HF shapes of a SigLIP / CLIP encoder's ``layers`` blocks under ``prefix`` (``{prefix}.{i}.self_attn.q_proj``,
    ...): width ``d``, MLP width ``f``, biases everywhere."""
    shapes = {}
    for i in range(layers):
        for n in ("layer_norm1", "layer_norm2", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                  "self_attn.out_proj", "mlp.fc1", "mlp.fc2"):
            rows, cols = (f, d) if n == "mlp.fc1" else (d, f) if n == "mlp.fc2" else (d, d)
            shapes[f"{prefix}.{i}.{n}.bias"] = (rows,)
            shapes[f"{prefix}.{i}.{n}.weight"] = (rows,) if n.startswith("layer_norm") else (rows, cols)
    return shapes


class OuterTableBridge(Qwen2_5_VLBridge):
    """An image-text bridge whose ViT config names its depth ``num_hidden_layers`` and its heads
    ``num_attention_heads`` (SigLIP's, Pixtral's), its tower's tensors those before the blocks, the blocks' and those
    after them (``_outer_names``: tower name -> HF name)."""

    @property
    def vision_heads(self) -> int:
        return self.vision_config.num_attention_heads

    def _outer_names(self) -> tuple[dict[str, str], dict[str, str]]:
        raise NotImplementedError

    def vision_mapping_table(self) -> dict[str, tuple[Mapping, int | None]]:
        before, after = self._outer_names()
        table = {n: (Replicated(n, hf), None) for n, hf in before.items()}
        for i in range(self.vision_config.num_hidden_layers):
            table.update({m.megatron.format(layer=i): (m, i) for m in self.vision_block_mappings()})
        table.update({n: (Replicated(n, hf), None) for n, hf in after.items()})
        return table

    def vision_shard_context(self, *, tp_rank: int, tp_size: int) -> ShardContext:
        v = self.vision_config
        return ShardContext(tp_rank=tp_rank, tp_size=tp_size, num_heads=v.num_attention_heads,
                            num_kv_heads=v.num_attention_heads, head_dim=v.hidden_size // v.num_attention_heads,
                            vocab_size=0, padded_vocab=0)


class Gemma3VLTextBridge(PrefixedText, Gemma3Bridge):
    """The language model of Gemma 3's image-text models: Gemma 3 under ``text_prefix``."""


class Gemma3VLBridge(OuterTableBridge):
    """Declaration of ``Gemma3ForConditionalGeneration``."""

    architectures = ("Gemma3ForConditionalGeneration",)
    text_bridge_class = Gemma3VLTextBridge
    mrope = False
    bidirectional_images = True
    causal_lm_auto = True
    # NOTE: transformers' module-tree prefixes (PEFT's adapter names) and the attributes holding the checkpoint's
    module_trees = (("model.language_model.", "text_prefix"), ("model.vision_tower.", "vision_prefix"),
                    ("model.multi_modal_projector.", "projector_prefix"))

    def __init__(self, hf_config, checkpoint_names=(), shape_of=None) -> None:
        self.hf_config = hf_config
        names = set(checkpoint_names)
        found = [n for n in _NAMINGS if f"{n[1]}.embeddings.patch_embedding.weight" in names]
        self.text_prefix, self.vision_prefix, self.projector_prefix = found[0] if found else _NAMINGS[1]
        if not self.tied:
            raise C.UnsupportedConfigError("Gemma3ForConditionalGeneration with tie_word_embeddings=False is not "
                                           "supported (every Gemma 3 ties its LM head to the embedding).")
        self.text = self.text_bridge(names, shape_of)
        self.check_vision_config()

    @property
    def tied(self) -> bool:
        return bool(getattr(self.hf_config, "tie_word_embeddings", True))

    @property
    def vision_merge(self) -> int:
        return self.vision_config.image_size // self.vision_config.patch_size // self.tokens_per_side

    @property
    def tokens_per_side(self) -> int:
        return int(round(self.hf_config.mm_tokens_per_image ** 0.5))

    def vision_inputs(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor | None, image_sizes=None):
        """The processor's ``[n, C, H, W]`` images as the tower's patches and grids (``vision.as_image_patches``);
        patches as given where ``grid_thw`` comes with them (generate's later steps, a collated batch)."""
        from loongforge_hf.multimodal.vision import as_image_patches

        if grid_thw is not None or pixel_values.dim() != 4:
            return pixel_values, grid_thw
        return as_image_patches(pixel_values, self.vision_config.patch_size)

    def check_vision_config(self) -> None:
        v, side = self.vision_config, self.vision_config.image_size // self.vision_config.patch_size
        check_siglip_vision(v, "Gemma 3 reads the ViT's last hidden states (the hub's configs set it False)")
        per_side = self.tokens_per_side
        if per_side * per_side != self.hf_config.mm_tokens_per_image or v.image_size % v.patch_size \
                or side % per_side:
            raise C.UnsupportedConfigError(f"mm_tokens_per_image={self.hf_config.mm_tokens_per_image} must be a "
                                           f"square whose side divides the {side}x{side} patch grid.")

    # ---- vision tensors ----------------------------------------------------------------------------------------
    def vision_block_mappings(self) -> list[Mapping]:
        return biased_vit_block_mappings(f"{self.vision_prefix}.encoder.layers.{{layer}}",
                                         ("layer_norm1", "layer_norm2"), "out_proj")

    def _outer_names(self) -> tuple[dict[str, str], dict[str, str]]:
        """(tower name -> HF name) of the tensors before the blocks, and of those after them."""
        mp = self.projector_prefix
        before, after = siglip_outer_names(self.vision_prefix)
        after.update({"projector.norm": f"{mp}.mm_soft_emb_norm.weight",
                      "projector.weight": f"{mp}.mm_input_projection_weight"})
        return before, after

    def vision_shapes(self) -> dict[str, tuple[int, ...]]:
        d, text_hidden = self.vision_config.hidden_size, self.hf_config.text_config.hidden_size
        return siglip_shapes(self, ((d,), (d, text_hidden)))

    def is_projector(self, vision_param_name: str) -> bool:
        return vision_param_name.startswith("projector.")

    def vision_tower(self, *, tp_group=None, recompute: bool = False):
        from loongforge_hf.multimodal.vision_siglip import SiglipTower

        return SiglipTower(self.vision_config, text_hidden=self.hf_config.text_config.hidden_size,
                           tokens_per_image=self.hf_config.mm_tokens_per_image, tp_group=tp_group,
                           recompute=recompute)


VL_BRIDGES.update({arch: Gemma3VLBridge for arch in Gemma3VLBridge.architectures})
