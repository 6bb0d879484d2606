"""Gemma4ForConditionalGeneration (``model_type`` ``gemma4``: Gemma 4 as the hub publishes it): the Gemma 4 text model
with a vision tower, an audio tower (E2B / E4B) and their multimodal embedders; text on megatron, images through
Gemma 4's vision tower, the audio tower carried.

Choices:
- The language model is the Gemma 4 text declaration (``gemma4.Gemma4Bridge``: its layers, rope tables, refusals and
  layout checks) over ``text_config``, its tensors under ``model.language_model`` (what transformers 5 and the hub's
  checkpoints hold), its LM head the embedding where the config ties them (every published Gemma 4 does). With
  per-layer inputs (E2B / E4B) the image, video and audio placeholders are looked up as padding in the per-layer
  table, the projection reads the embeddings with images in place, as transformers' ``Gemma4Model`` does; under
  pipeline parallelism the first stage (with the vision tower) makes them and the stage boundaries carry them, as
  the text model's (``gemma4_per_layer.py``).
- The vision tower and its embedder (``model.vision_tower.*``, ``model.embed_vision.*``) are
  ``multimodal.vision_gemma4.Gemma4VisionTower``, replicated (``vision_tensor_parallel_size`` above 1 is refused),
  trainable, each tensor mapped one to one and exported as read. Refused by name: clipped linears
  (``use_clipped_linears``), ``standardize``, attention dropout, a rope other than ``axial``, an activation
  transformers does not know.
- Images come as the processor gives them: ``pixel_values [n, max_patches, 3 P P]`` with ``image_position_ids``
  (padding patches at (-1, -1), at the end); ``vision_inputs`` keeps each image's real patches, which must be its
  row-major ``h x w`` grid, and gives ``grid_thw`` rows ``(1, h, w)``. Image tokens take the images' embeddings in
  order, as transformers' ``masked_scatter``.
- With ``text_config.use_bidirectional_attention='vision'`` and ``mm_token_type_ids`` given, each run of image
  tokens (types 1 and 2) attends both ways in the sliding-window layers only, under their window (transformers'
  ``create_masks_for_vision_model``: ``AND(window, OR(causal, blockwise))``; its full-attention layers stay causal):
  ``kernels.attention.bidirectional_blocks(layers='sliding')``; at generate's prefill as transformers.
- The audio tower and its embedder (``model.audio_tower.*``, ``model.embed_audio.*``: every tensor outside the
  language model and the vision tower) are not built; ``save_pretrained`` copies them unchanged from the source
  folder (``passthrough_names``). Videos, audio and precomputed tower outputs are refused by name before any
  collective (``refuse_inputs``), as are input ids holding a video or audio placeholder, or image placeholders
  without ``pixel_values`` (transformers would embed them as padding).
- ``lf.AutoModelForCausalLM`` loads the checkpoint as this image-text model (``causal_lm_auto``), as transformers'
  ``AutoModelForCausalLM`` gives ``Gemma4ForConditionalGeneration``.
"""

from __future__ import annotations

import torch

from loongforge_hf.bridges import config_map as C
from loongforge_hf.bridges.gemma4 import Gemma4Bridge
from loongforge_hf.bridges.mappings import Mapping, Replicated, ShardContext
from loongforge_hf.bridges.qwen2_5_vl import VL_BRIDGES, PrefixedText, Qwen2_5_VLBridge

TEXT_PREFIX = "model.language_model"
VISION_PREFIX = "model.vision_tower"
EMBED_VISION = "model.embed_vision.embedding_projection.weight"
_AUDIO_STEP = "a later step would run Gemma 4's audio tower (Gemma4AudioModel); none is planned yet"
# input -> (what it is, why it is refused)
_REFUSED_INPUTS = {
    "pixel_values_videos": ("videos", "Gemma 4's video frames (num_frames_per_video, video_position_ids) are not "
                                      "wired to its vision tower here yet; images are supported"),
    "input_features": ("audio", _AUDIO_STEP),
    "mm_encoder_outputs": ("precomputed tower outputs", "pass pixel_values (and image_position_ids) instead"),
}
_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")


class Gemma4VLTextBridge(PrefixedText, Gemma4Bridge):
    """The language model of ``Gemma4ForConditionalGeneration``: Gemma 4's text model under ``text_prefix``, every
    checkpoint tensor outside it and outside ``tower_names`` (the vision tower's) carried through."""

    architectures = ("Gemma4ForConditionalGeneration",)  # NOTE: the name the layer-type checks give
    has_passthrough = True
    passthrough_kind = "the audio tower and its embedder"
    tower_names: frozenset = frozenset()

    def first_stage_mappings(self) -> list[Mapping]:
        return [self._name(m) for m in super().first_stage_mappings()]  # NOTE: the per-layer inputs' (E2B / E4B)

    def passthrough_names(self, names) -> list[str]:
        own = set(self.expected_hf_shapes())
        return [n for n in names if not n.startswith(self.text_prefix + ".") and n not in own
                and n not in self.tower_names] + Gemma4Bridge.passthrough_names(self, names)


def gemma4_blocks(mm_token_type_ids: torch.Tensor) -> torch.Tensor:
    """``[b, s]`` block ids of the runs of vision tokens (``mm_token_type_ids`` 1 or 2), numbered from 0 per row,
    -1 elsewhere: transformers' ``get_block_sequence_ids_for_mask``."""
    is_vision = (mm_token_type_ids == 1) | (mm_token_type_ids == 2)
    starts = is_vision & ~torch.nn.functional.pad(is_vision, (1, 0))[:, :-1]
    return torch.where(is_vision, torch.cumsum(starts.long(), dim=1) - 1, -1)


def image_patches(pixel_values: torch.Tensor, image_position_ids: torch.Tensor | None):
    """The processor's ``[n, max_patches, 3 P P]`` patches and ``[n, max_patches, 2]`` (x, y) positions -> (each
    image's real patches, concatenated; ``grid_thw [n, 3]`` = ``(1, h, w)``); the real patches must be the image's
    row-major ``h x w`` grid, the padding (-1, -1) after them."""
    if image_position_ids is None:
        raise ValueError("forward: pixel_values [images, patches, 3 * patch_size^2] need image_position_ids (the "
                         "Gemma 4 processor gives them).")
    if image_position_ids.shape != (*pixel_values.shape[:2], 2):
        raise ValueError(f"image_position_ids has shape {tuple(image_position_ids.shape)}; pixel_values "
                         f"{tuple(pixel_values.shape)} need [{pixel_values.shape[0]}, {pixel_values.shape[1]}, 2].")
    pieces, grid = [], []
    for i, (patches, xy) in enumerate(zip(pixel_values, image_position_ids.to(pixel_values.device))):
        real = int((xy != -1).all(-1).sum())
        w, h = (int(xy[:real, 0].max()) + 1, int(xy[:real, 1].max()) + 1) if real else (0, 0)
        want = torch.stack([torch.arange(w).repeat(h), torch.arange(h).repeat_interleave(w)], dim=-1).to(xy)
        if not real or real != h * w or not torch.equal(xy[:real], want) or bool((xy[real:] != -1).any()):
            raise ValueError(f"image_position_ids of image {i}: its real patches must be the row-major grid of the "
                             "image (x fastest), the (-1, -1) padding after them, as the Gemma 4 processor gives "
                             "them.")
        pieces.append(patches[:real])
        grid.append((1, h, w))
    return torch.cat(pieces), torch.tensor(grid, dtype=torch.long, device=pixel_values.device)


class Gemma4VLBridge(Qwen2_5_VLBridge):
    """Declaration of ``Gemma4ForConditionalGeneration``: the text bridge, the vision tower, the input refusals."""

    architectures = ("Gemma4ForConditionalGeneration",)
    text_bridge_class = Gemma4VLTextBridge
    mrope = False
    causal_lm_auto = True
    token_types_input = "mm_token_type_ids"  # NOTE: the input the bidirectional blocks read (Gemma 3: token_type_ids)
    token_type_blocks = staticmethod(gemma4_blocks)
    block_layers = "sliding"  # NOTE: only the sliding-window layers see an image both ways

    def __init__(self, hf_config, checkpoint_names=(), shape_of=None) -> None:
        self.hf_config = hf_config
        self.text_prefix, self.vision_prefix = TEXT_PREFIX, VISION_PREFIX
        if self.vision_config is None:
            raise C.UnsupportedConfigError("Gemma4ForConditionalGeneration without a vision_config is not supported "
                                           "(load its text model as Gemma4ForCausalLM).")
        self.check_vision_config()
        self.text = self.text_bridge(set(checkpoint_names), shape_of)
        self.text.placeholder_ids = tuple(t for t in (self.image_token_id, self.video_token_id, self.audio_token_id)
                                          if t is not None)
        self.text.tower_names = frozenset(self.vision_hf_shapes())
        carried = self.text.passthrough_names(checkpoint_names)
        self.carried_shapes = {n: tuple(shape_of(n)) for n in carried} if shape_of is not None else {}

    @property
    def tied(self) -> bool:
        return bool(getattr(self.hf_config, "tie_word_embeddings", True))

    @property
    def bidirectional_images(self) -> bool:
        return getattr(self.hf_config.text_config, "use_bidirectional_attention", None) == "vision"

    @property
    def vision_heads(self) -> int:
        return self.vision_config.num_attention_heads

    @property
    def vision_merge(self) -> int:
        return self.vision_config.pooling_kernel_size

    @property
    def audio_token_id(self) -> int | None:
        token = getattr(self.hf_config, "audio_token_id", None)
        return None if token is None else int(token)

    def check_layout(self, layout) -> None:
        self.text.check_layout(layout)

    def check_vision_config(self) -> None:
        """Refuse what the tower does not run, by field."""
        from transformers.activations import ACT2FN

        v = self.vision_config
        rope = (getattr(v, "rope_parameters", None) or {}).get("rope_type", "axial")
        refused = {"use_clipped_linears": bool(getattr(v, "use_clipped_linears", False)),
                   "standardize": bool(getattr(v, "standardize", False)),
                   "attention_dropout": bool(getattr(v, "attention_dropout", 0.0)),
                   "attention_bias": bool(getattr(v, "attention_bias", False)),
                   "rope_parameters.rope_type": rope != "axial",
                   "hidden_activation": v.hidden_activation not in ACT2FN}
        for field, bad in refused.items():
            if bad:
                raise C.UnsupportedConfigError(f"vision_config.{field}={getattr(v, field, rope)!r} is not supported "
                                               "by Gemma 4's vision tower here.")

    def refuse_inputs(self, inputs: dict) -> None:
        """``ValueError`` naming the first input this model does not take (videos, audio, precomputed outputs;
        video / audio placeholders in ``input_ids``, image placeholders without ``pixel_values``); local, before any
        collective."""
        for name, (what, why) in _REFUSED_INPUTS.items():
            if inputs.get(name) is not None:
                raise ValueError(f"forward: {name} ({what}) is not supported for Gemma4ForConditionalGeneration yet: "
                                 f"{why}. Text and image batches are supported.")
        ids = inputs.get("input_ids")
        placeholders = {"video_token_id": self.video_token_id, "audio_token_id": self.audio_token_id}
        if inputs.get("pixel_values") is None:
            placeholders["image_token_id"] = self.image_token_id
        for field, token in placeholders.items():
            if ids is not None and token is not None and bool((ids == token).any()):
                raise ValueError(f"forward: input_ids hold {field}={token} (a placeholder for a tower's output, "
                                 "which transformers embeds as padding until the tower fills it) without its input; "
                                 "Gemma4ForConditionalGeneration here takes text and images (pixel_values).")

    def vision_inputs(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor | None, image_sizes=None,
                      image_position_ids: torch.Tensor | None = None, **kwargs):
        """The processor's patches and positions as the tower's (``image_patches``); as given where ``grid_thw``
        comes with them (generate's later steps, a collated batch)."""
        if grid_thw is not None or pixel_values.dim() != 3:
            return pixel_values, grid_thw
        return image_patches(pixel_values, image_position_ids)

    # ---- vision tensors --------------------------------------------------------------------------------------------
    def vision_mapping_table(self) -> dict[str, tuple[Mapping, int | None]]:
        v, p = self.vision_config, VISION_PREFIX
        table = {"patch_embed.weight": (Replicated("patch_embed.weight", f"{p}.patch_embedder.input_proj.weight"),
                                        None),
                 "position_table": (Replicated("position_table", f"{p}.patch_embedder.position_embedding_table"),
                                    None)}
        hf = f"{p}.encoder.layers.{{layer}}"
        block = [(f"attn.{x}_proj.weight", f"self_attn.{x}_proj.linear.weight") for x in "qkvo"]
        block += [(f"attn.{x}_norm.weight", f"self_attn.{x}_norm.weight") for x in "qk"]
        block += [(f"mlp.{x}_proj.weight", f"mlp.{x}_proj.linear.weight") for x in ("gate", "up", "down")]
        block += [(f"{n}.weight", f"{n}.weight") for n in _NORMS]
        for i in range(v.num_hidden_layers):
            table.update({f"blocks.{i}.{ours}": (Replicated(f"blocks.{{layer}}.{ours}", f"{hf}.{theirs}"), i)
                          for ours, theirs in block})
        table["projector.weight"] = (Replicated("projector.weight", EMBED_VISION), None)
        return table

    def vision_shard_context(self, *, tp_rank: int, tp_size: int) -> ShardContext:
        v = self.vision_config
        return ShardContext(tp_rank=tp_rank, tp_size=tp_size, num_heads=v.num_attention_heads,
                            num_kv_heads=v.num_key_value_heads, head_dim=v.head_dim, vocab_size=0, padded_vocab=0)

    def vision_hf_shapes(self) -> dict[str, tuple[int, ...]]:
        """The vision tower's and its embedder's HF tensor shapes."""
        v, p = self.vision_config, VISION_PREFIX
        d, f, hd = v.hidden_size, v.intermediate_size, v.head_dim
        q, kv = v.num_attention_heads * hd, v.num_key_value_heads * hd
        shapes = {f"{p}.patch_embedder.input_proj.weight": (d, 3 * v.patch_size ** 2),
                  f"{p}.patch_embedder.position_embedding_table": (2, v.position_embedding_size, d),
                  EMBED_VISION: (self.hf_config.text_config.hidden_size, d)}
        per_layer = {"self_attn.q_proj.linear.weight": (q, d), "self_attn.k_proj.linear.weight": (kv, d),
                     "self_attn.v_proj.linear.weight": (kv, d), "self_attn.o_proj.linear.weight": (d, q),
                     "self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,),
                     "mlp.gate_proj.linear.weight": (f, d), "mlp.up_proj.linear.weight": (f, d),
                     "mlp.down_proj.linear.weight": (d, f), **{f"{n}.weight": (d,) for n in _NORMS}}
        for i in range(v.num_hidden_layers):
            shapes.update({f"{p}.encoder.layers.{i}.{n}": s for n, s in per_layer.items()})
        return shapes

    def vision_shapes(self) -> dict[str, tuple[int, ...]]:
        """The tower's shapes, and the carried tensors' as the checkpoint gives them (so none counts as
        unexpected)."""
        return {**self.vision_hf_shapes(), **self.carried_shapes}

    def is_projector(self, vision_param_name: str) -> bool:
        return vision_param_name.startswith("projector.")

    def vision_tower(self, *, tp_group=None, recompute: bool = False):
        import torch.distributed as dist

        from loongforge_hf.multimodal.vision_gemma4 import Gemma4VisionTower

        if tp_group is not None and dist.get_world_size(tp_group) > 1:
            raise C.UnsupportedConfigError("vision_tensor_parallel_size > 1 is not supported for Gemma 4's vision "
                                           "tower (it is replicated); use vision_tensor_parallel_size=1.")
        return Gemma4VisionTower(self.vision_config, text_hidden=self.hf_config.text_config.hidden_size,
                                 recompute=recompute)


VL_BRIDGES.update({arch: Gemma4VLBridge for arch in Gemma4VLBridge.architectures})
