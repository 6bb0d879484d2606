"""The HF face of a vision-language model: ``AutoModelForImageTextToText.from_pretrained`` ->
``LoongModelForImageTextToText``.

Choices:
- The language model is megatron-core (tensor / pipeline / virtual pipeline parallel, sequence parallel), built and
  loaded by the same bridge machinery as a causal LM; the vision tower lives on the first pipeline stage in one of three
  layouts: replicated (``vision_tensor_parallel_size=1``), split over the LLM's TP group
  (``vision_tensor_parallel_size=tensor_parallel_size``), or encoder data parallel (``vision_data_parallel=True``).
- ``forward`` takes what the processor returns (``input_ids``, ``attention_mask``, ``pixel_values``,
  ``image_grid_thw``, ``pixel_values_videos``, ``video_grid_thw``, ``second_per_grid_ts``, ``mm_token_type_ids``) and
  returns a transformers ``CausalLMOutputWithPast`` on every rank: loss with transformers' semantics and
  full-vocabulary logits. 3-D rope positions are computed from the inputs as transformers does unless
  ``position_ids`` are given: [3, b, s], or transformers' packed form [4, b, s] whose first row holds the text
  positions, restarting at 0 where a packed sample starts (attention then stays inside each sample, as
  ``integrations.vl_collator`` packs them). 2-D ``position_ids`` that restart mark packed samples too; the 3-D
  positions are then computed per sample. Gradients flow when pipeline_parallel_size == 1. Models with 1-D rope
  (Gemma 3, Mistral 3, InternVL: ``bridge.mrope`` False) take 2-D positions as text models do; whole images
  ``[n, C, H, W]`` (with Mistral 3's ``image_sizes``; InternVL's tiles; Idefics3's ``[b, n, C, H, W]`` tiles with
  their ``pixel_attention_mask``; LLaVA-NeXT's ``[n, crops, C, H, W]`` crops with ``image_sizes``, and
  LLaVA-OneVision's with ``batch_num_images``; Aria's tiles with their ``pixel_mask``, for a bridge that says
  ``takes_pixel_mask``) become the tower's patches and grids (``bridge.vision_inputs``), as
  do LLaVA-OneVision's videos ``pixel_values_videos [v, frames, C, H, W]`` (``bridge.video_inputs``); another
  model refuses ``batch_num_images`` above 1. GLM-4.1V's video placeholders (image tokens that
  ``mm_token_type_ids`` marks 2) become video tokens first (``bridge.mark_video_tokens``), in ``generate``'s steps
  too. Gemma 3's ``token_type_ids`` make each image's tokens attend both ways (``chunk.image_blocks``), as in
  transformers (Gemma 4's ``mm_token_type_ids``, with its processor's ``image_position_ids``: ``bridges.gemma4_vl``).
- Context parallelism (``context_parallel_size``): the language model runs on megatron's load-balanced share of the
  sequence on each CP rank (``parallel.context_parallel``); the sequence length must be a multiple of 2 x CP. The
  returned loss and logits are the whole sequence's; each rank's gradient is its share's (megatron's DDP sums them).
  LoongTrainer's step asks ``megatron_local_labels`` which labels this rank scores.
- Recompute per component: ``vision_recompute`` checkpoints each ViT block (torch.utils.checkpoint),
  ``language_recompute`` checkpoints each decoder layer the same way (megatron's own full recompute needs CUDA RNG
  state and would restore megatron's TP RNG tracker; these models train without dropout, which is checked).
- Freezing a component sets ``requires_grad=False`` on its parameters, so megatron's DDP and optimizer (and any torch
  optimizer over trainable parameters) never see them: vision = patch embedding and ViT blocks, projector = the
  patch merger, language = the megatron model.
- ``generate`` is transformers' ``GenerationMixin.generate`` as for text models (``loongforge_hf/generation.py``, KV
  cache included) with Qwen2.5-VL's inputs and mRoPE positions (``multimodal/generation.py``): its steps run through
  ``generation_forward``, not through the forward's training path; beam search and ``num_return_sequences`` repeat
  each row with its own images and videos (``_expand_inputs_for_generation``; each image encoded once).
- ``save_pretrained`` writes the whole HF folder through the causal-LM exporter, the tower's tensors streamed after the
  language model's.
"""

from __future__ import annotations

import contextvars
import os
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from loongforge_hf.modeling import (LoongModelForCausalLM, _resolve_dtype, failing_alike, hf_forward_options,
                                    hf_forward_output, keep_hub_name, refuse_save_options, resolve_parallel,
                                    rope_length, router_outputs)
from loongforge_hf.parallel import ParallelLayoutError, read_launch_env
from loongforge_hf.parallel.config import PARALLEL_KWARGS


class _WithInputs(nn.Module):
    """A chunk called as ``chunk(input_ids, position_ids, mask)`` by a schedule, with the image inputs bound."""

    def __init__(self, chunk: nn.Module, inputs: dict) -> None:
        super().__init__()
        self.chunk = chunk
        self.inputs = inputs

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["chunk"], name)

    def forward(self, input_ids, position_ids, attention_mask):
        return self.chunk(input_ids, position_ids, attention_mask, **self.inputs)


def _refuse_vision_overrides(config, unused: dict) -> None:
    """transformers' per-call ``vision_feature_layer`` / ``vision_feature_select_strategy`` (LLaVA's forward and
    generate take them): the config's are built into the tower here, so another value is refused, not ignored."""
    for name in ("vision_feature_layer", "vision_feature_select_strategy", "vision_aspect_ratio"):
        value = unused.get(name)
        if value is not None and value != getattr(config, name, None):
            raise ValueError(f"forward: {name}={value!r} differs from the checkpoint config's "
                             f"{getattr(config, name, None)!r}, which the vision tower is built for; set it in the "
                             "config before from_pretrained.")


def _refuse_inputs(bridge, inputs: dict) -> None:
    """The bridge's refusal of inputs its model does not take (``bridge.refuse_inputs``: Gemma 4's images and audio
    while its towers are carried), local, before any collective; nothing for other bridges."""
    if hasattr(bridge, "refuse_inputs"):
        bridge.refuse_inputs(inputs)


def _sample_images(bridge, counts) -> dict:
    """``vision_inputs``' keywords for transformers' ``batch_num_images`` (images per sample): none where absent or
    all 1; LLaVA-OneVision's multi-image samples (``bridge.multi_image_samples``) take them, other models refuse."""
    if counts is None or all(int(n) == 1 for n in torch.as_tensor(counts).reshape(-1).tolist()):
        return {}
    if not getattr(bridge, "multi_image_samples", False):
        raise ValueError(f"forward: batch_num_images={torch.as_tensor(counts).tolist()}: multi-image samples that "
                         "encode their images otherwise are LLaVA-OneVision's; this model takes one image a sample.")
    return {"batch_num_images": counts}


def _tower_inputs(bridge, get) -> dict:
    """``pixel_values`` / ``image_grid_thw`` / ``pixel_values_videos`` / ``video_grid_thw`` as the tower takes them,
    from the processor's (``get``: input name -> value): images through ``bridge.vision_inputs`` (with
    ``image_sizes``, ``pixel_attention_mask`` and ``batch_num_images`` where given), LLaVA-OneVision's videos
    without ``video_grid_thw`` through ``bridge.video_inputs``."""
    out = {name: get(name) for name in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")}
    if out["pixel_values"] is not None:
        out["pixel_values"], out["image_grid_thw"] = bridge.vision_inputs(
            out["pixel_values"], out["image_grid_thw"], image_sizes=get("image_sizes"),
            **_pixel_mask(get("pixel_attention_mask")), **_tile_mask(bridge, get("pixel_mask")),
            **_sample_images(bridge, get("batch_num_images")),
            **_patch_positions(get("image_position_ids")))
    if out["pixel_values_videos"] is not None and out["video_grid_thw"] is None and hasattr(bridge, "video_inputs"):
        out["pixel_values_videos"], out["video_grid_thw"] = bridge.video_inputs(out["pixel_values_videos"])
    return out


class LoongModelForImageTextToText(LoongModelForCausalLM):
    """A vision-language model: megatron-core language model, vision tower beside it."""

    def __init__(self, *, hf_config, bridge, language_model, chunks, parallel, source: Path | None,
                 vision_layout: str, config_at_load: dict | None = None) -> None:
        super().__init__(hf_config=hf_config, bridge=bridge, megatron_model=replace(language_model, chunks=chunks),
                         parallel=parallel, source=source, config_at_load=config_at_load)
        self.language_model = language_model
        self.vision_layout = vision_layout
        self._generating = False  # NOTE: True inside generate (see generate)

    @property
    def vision_tower(self):
        return self.chunks[0].vision

    # ---- generate (multimodal/generation.py) ---------------------------------------------------------------------
    def generate(self, inputs: torch.Tensor | None = None, generation_config=None, **kwargs: Any):
        """transformers' ``generate`` as ``Qwen2_5_VLForConditionalGeneration`` runs it (images and videos at the
        prefill, mRoPE positions continued per row), collective over the model replica; see
        ``loongforge_hf.multimodal.generation``."""
        # NOTE: forward runs generate's steps through generation_forward (padded to the layout, mRoPE positions
        # given) while this is set, with or without the KV cache; a plain forward call never does
        _refuse_inputs(self.bridge, {**kwargs, "input_ids": kwargs.get("input_ids", inputs)})
        if kwargs.get("pixel_values") is not None or kwargs.get("pixel_values_videos") is not None:
            # NOTE: the tower's patches and grids from the start (Gemma 3's and Mistral 3's processors give
            # [n, C, H, W] images, Mistral 3's with image_sizes; LLaVA-OneVision's videos [v, frames, C, H, W]), so
            # beam copies and each step's inputs are per patch and per grid as for Qwen's
            given = {**kwargs, **{k: kwargs.pop(k, None) for k in ("image_sizes", "pixel_attention_mask",
                                                                   "batch_num_images", "image_position_ids",
                                                                   "pixel_mask")}}
            kwargs.update({k: v for k, v in _tower_inputs(self.bridge, given.get).items() if v is not None})
        self._generating = True  # NOTE: after the inputs' checks: a refused input leaves the model as it was
        try:
            return super().generate(inputs, generation_config, **kwargs)
        finally:
            self._generating = False

    def generation_refusal(self, generation_config, kwargs: dict) -> str | None:
        from loongforge_hf.multimodal.generation import generation_refusal

        # NOTE: the bridge's own first (Qwen3.5's, from its text model)
        return super().generation_refusal(generation_config, kwargs) or \
            generation_refusal(self, generation_config, kwargs)

    def _prepare_position_ids_for_generation(self, inputs_tensor: torch.Tensor, model_kwargs: dict) -> torch.Tensor:
        from loongforge_hf.multimodal.generation import generation_positions

        ids = model_kwargs.get("input_ids")
        return generation_positions(self, ids if ids is not None and ids.shape[1] > 0 else inputs_tensor,
                                    model_kwargs)

    def _update_model_kwargs_for_generation(self, outputs, model_kwargs: dict, is_encoder_decoder: bool = False,
                                            num_new_tokens: int = 1) -> dict:
        types = model_kwargs.get("token_type_ids")
        model_kwargs = super()._update_model_kwargs_for_generation(outputs, model_kwargs, is_encoder_decoder,
                                                                   num_new_tokens)
        fill = getattr(self.bridge, "generated_token_type", None)
        if types is not None and fill is not None:  # NOTE: PaliGemma's: generated tokens are suffix (1), as its own
            model_kwargs["token_type_ids"] = torch.cat([types, types.new_full((types.shape[0], num_new_tokens), fill)],
                                                       dim=-1)
        return model_kwargs

    def _expand_inputs_for_generation(self, expand_size: int = 1, is_encoder_decoder: bool = False,
                                      input_ids: torch.Tensor | None = None, **model_kwargs: Any):
        from loongforge_hf.multimodal.generation import PER_ITEM_INPUTS, expand_vision_inputs

        if expand_size == 1:
            return input_ids, model_kwargs
        # NOTE: transformers repeats every tensor along dim 0 (and [3, b, s] positions along dim 1); the vision
        # inputs are per image / video / patch instead: they stay as given, and image_copies / video_copies say which
        # of them the expanded rows take
        vision = {k: model_kwargs.pop(k) for k in PER_ITEM_INPUTS if k in model_kwargs}
        copies = expand_vision_inputs(self, input_ids, {**model_kwargs, **vision}, expand_size)
        input_ids, model_kwargs = super()._expand_inputs_for_generation(
            expand_size=expand_size, is_encoder_decoder=is_encoder_decoder, input_ids=input_ids, **model_kwargs)
        return input_ids, {**model_kwargs, **vision, **copies}

    def bound_chunks(self, inputs: dict) -> SimpleNamespace:
        """This model as the pipelined runtime takes it, its chunks called with the vision ``inputs`` bound."""
        return SimpleNamespace(chunks=[_WithInputs(c, inputs) for c in self.chunks], device=self.device,
                               dtype=self.dtype, config=self.config.text_config, megatron=self.megatron,
                               parallel=self.parallel)

    # ---- inputs --------------------------------------------------------------------------------------------------
    def rope_position_ids(self, input_ids: torch.Tensor, *, image_grid_thw=None, attention_mask=None,
                          mm_token_type_ids=None, video_grid_thw=None, second_per_grid_ts=None,
                          document_ids=None) -> torch.Tensor:
        from loongforge_hf.multimodal.positions import mrope_position_ids

        if not self.bridge.mrope:  # NOTE: 1-D positions (Gemma 3), as transformers' forward takes them: 0 .. s - 1
            return torch.arange(input_ids.shape[1], device=input_ids.device).expand(input_ids.shape)
        vision = self.bridge.vision_config
        return mrope_position_ids(input_ids, image_grid_thw=image_grid_thw, attention_mask=attention_mask,
                                  mm_token_type_ids=mm_token_type_ids, image_token_id=self.bridge.image_token_id,
                                  spatial_merge_size=vision.spatial_merge_size, video_grid_thw=video_grid_thw,
                                  video_token_id=self.bridge.video_token_id,
                                  # NOTE: Qwen2-VL's bridge says video_time_scaled=False: no time scaling
                                  second_per_grid_ts=second_per_grid_ts
                                  if getattr(self.bridge, "video_time_scaled", True) else None,
                                  tokens_per_second=getattr(vision, "tokens_per_second", 1),
                                  document_ids=document_ids, frames_apart=self.bridge.frames_apart)

    def megatron_forward_inputs(self, batch: dict) -> tuple[tuple, dict]:
        """(args, kwargs) for one model chunk from a collated batch: what a training step passes to each chunk."""
        from loongforge_hf.bridges.runtime import is_packed, megatron_attention_mask

        device = self.device

        def get(name):
            value = batch.get(name)
            return value.to(device) if isinstance(value, torch.Tensor) else value

        input_ids, attention_mask = get("input_ids"), get("attention_mask")
        _refuse_inputs(self.bridge, batch)
        kwargs = _tower_inputs(self.bridge, get)  # NOTE: first: its refusals come before the positions' checks
        if kwargs["pixel_values_videos"] is not None and hasattr(self.bridge, "mark_video_tokens"):
            input_ids = self.bridge.mark_video_tokens(input_ids, get("mm_token_type_ids"))  # NOTE: GLM-4.1V
        position_ids, text_positions = get("position_ids"), None
        if position_ids is not None and position_ids.dim() == 3 and position_ids.shape[0] == 4:
            text_positions, position_ids = position_ids[0], position_ids[1:]
        elif position_ids is not None and position_ids.dim() == 2:
            text_positions, position_ids = position_ids, None if self.bridge.mrope else position_ids
        if position_ids is None:
            documents = torch.cumsum((text_positions == 0).long(), dim=-1) if is_packed(text_positions) else None
            position_ids = self.rope_position_ids(input_ids, image_grid_thw=get("image_grid_thw"),
                                                  attention_mask=attention_mask,
                                                  mm_token_type_ids=get("mm_token_type_ids"),
                                                  video_grid_thw=get("video_grid_thw"),
                                                  second_per_grid_ts=get("second_per_grid_ts"),
                                                  document_ids=documents)
        mask = megatron_attention_mask(attention_mask, input_ids.shape[1], text_positions)
        if self.bridge.bidirectional_images:  # NOTE: as transformers, only where token_type_ids are given
            types = get(getattr(self.bridge, "token_types_input", "token_type_ids"))  # NOTE: Gemma 4: mm_token_type_ids
            kwargs["token_type_ids"] = attention_token_types(self.bridge, types, attention_mask,
                                                             packed=is_packed(text_positions))
        return (input_ids, position_ids.to(device), mask), kwargs

    def megatron_local_labels(self, labels: torch.Tensor) -> torch.Tensor:
        """The shifted labels of the tokens this rank's chunks score: its context-parallel share (all without CP)."""
        from loongforge_hf.parallel.context_parallel import cp_group_and_size, cp_token_index

        _, cp_size, cp_rank = cp_group_and_size()
        if cp_size == 1:
            return labels
        return labels[:, cp_token_index(labels.shape[1], cp_size, cp_rank, device=labels.device)].contiguous()

    # ---- forward -------------------------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                pixel_values: torch.Tensor | None = None, image_grid_thw: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                mm_token_type_ids: torch.Tensor | None = None, pixel_values_videos: torch.Tensor | None = None,
                video_grid_thw: torch.Tensor | None = None, second_per_grid_ts: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, image_sizes: torch.Tensor | None = None, *,
                return_logits: bool = True, **unused: Any):
        from loongforge_hf.bridges import router_balance
        from loongforge_hf.bridges.output_layer import full_logits
        from loongforge_hf.bridges.router_logits import asked
        from loongforge_hf.bridges.runtime import IGNORE_INDEX, shift_labels, token_losses
        from loongforge_hf.parallel.context_parallel import (cp_gather_sequence, cp_group_and_size, cp_loss,
                                                             cp_token_index)

        options = hf_forward_options(unused, labels)
        _refuse_vision_overrides(self.config, unused)
        # NOTE: generate checked its prompt; the ids it samples are not refused
        _refuse_inputs(self.bridge, {**unused, "input_ids": None if self._generating else input_ids,
                                     "pixel_values": pixel_values, "pixel_values_videos": pixel_values_videos})
        if hasattr(self.bridge, "check_sequence_length"):  # NOTE: positions it is not exact from (Ministral 3)
            past = options["cache"].get_seq_length() if options["cache"] is not None else 0
            self.bridge.check_sequence_length(rope_length(input_ids, position_ids, past))
        if options["cache"] is not None or self._generating:
            from loongforge_hf.multimodal.generation import generation_forward

            keep = options["logits_to_keep"]
            given = {"pixel_values": pixel_values, "image_grid_thw": image_grid_thw, "image_sizes": image_sizes,
                     "pixel_values_videos": pixel_values_videos, "video_grid_thw": video_grid_thw,
                     "pixel_attention_mask": unused.get("pixel_attention_mask"),
                     "batch_num_images": unused.get("batch_num_images"),
                     "image_position_ids": unused.get("image_position_ids"), "pixel_mask": unused.get("pixel_mask")}
            vision = {**_tower_inputs(self.bridge, given.get), "mm_token_type_ids": mm_token_type_ids,
                      "second_per_grid_ts": second_per_grid_ts, "image_copies": unused.get("image_copies"),
                      "video_copies": unused.get("video_copies"),
                      "token_type_ids": token_type_ids, "image_sizes": image_sizes}
            logits = generation_forward(self, cache=options["cache"], input_ids=input_ids,
                                        attention_mask=attention_mask, position_ids=position_ids, vision=vision,
                                        keep=keep if isinstance(keep, int) else 0)
            return hf_forward_output(None, logits, labels, options)
        batch = {"input_ids": input_ids, "attention_mask": attention_mask, "pixel_values": pixel_values,
                 "image_grid_thw": image_grid_thw, "position_ids": position_ids,
                 "mm_token_type_ids": mm_token_type_ids, "pixel_values_videos": pixel_values_videos,
                 "video_grid_thw": video_grid_thw, "second_per_grid_ts": second_per_grid_ts,
                 "token_type_ids": token_type_ids, "image_sizes": image_sizes,
                 "pixel_attention_mask": unused.get("pixel_attention_mask"),
                 "batch_num_images": unused.get("batch_num_images"),
                 "image_position_ids": unused.get("image_position_ids"), "pixel_mask": unused.get("pixel_mask")}
        args, inputs = self.megatron_forward_inputs(batch)
        input_ids, position_ids, mask = args
        vocab = self.config.text_config.vocab_size
        seq = input_ids.shape[1]
        shifted = shift_labels(labels.to(self.device)) if labels is not None else None
        cp_group, cp_size, cp_rank = cp_group_and_size()

        def finish(local_logits):
            loss = None
            if shifted is not None:
                count = (shifted != IGNORE_INDEX).sum()
                if cp_size == 1:
                    per_token = token_losses(local_logits, shifted, vocab_size=vocab)
                    loss = per_token.sum() / count.clamp(min=1)
                else:
                    index = cp_token_index(seq, cp_size, cp_rank, device=shifted.device)
                    per_token = token_losses(local_logits, shifted[:, index].contiguous(), vocab_size=vocab)
                    loss = cp_loss(per_token.sum(), count, cp_group)
            logits = None
            if return_logits:
                logits = full_logits(local_logits, vocab_size=vocab)
                if cp_size > 1:
                    logits = cp_gather_sequence(logits.detach(), seq, cp_group, dim=1)
            return loss, logits

        def run():
            if self.parallel.pipeline_parallel_size == 1:
                return finish(self.chunks[0](*args, **inputs))
            from loongforge_hf.bridges.runtime import _forward_pipelined

            return _forward_pipelined(self.bound_chunks(inputs), input_ids, position_ids, mask, finish,
                                      return_logits, labels is not None)

        # NOTE: a MoE language model (Qwen3-VL-MoE) returns transformers' MoE outputs; with output_router_logits
        # (its text_config's, or the keyword) the router logits and the balancing loss, as its transformers class
        routed = router_balance.forward_outputs(self, unused.get("output_router_logits"))
        moe = getattr(self.bridge.text, "hf_router_logits", False)
        if not (moe and asked(self.config.get_text_config(), unused.get("output_router_logits"))):
            return hf_forward_output(*run(), labels, options, moe=moe)
        (loss, logits), router = router_outputs(self, routed, run, attention_mask=attention_mask,
                                                shape=tuple(input_ids.shape), length=seq)
        return hf_forward_output(loss, logits, labels, options, moe=True, **router)

    # ---- export --------------------------------------------------------------------------------------------------
    def save_pretrained(self, save_directory: str | os.PathLike, *, max_shard_size: int | str = "5GB",
                        dtype: torch.dtype | None = None, side_files_dir: str | os.PathLike | None = None,
                        **unused: Any) -> None:
        """Write a plain HF checkpoint, vision tower included (collective: every rank calls it; rank 0 writes);
        ``side_files_dir`` as ``LoongModelForCausalLM.save_pretrained``."""
        from megatron.core import parallel_state as ps

        from loongforge_hf.bridges.exporter import export_hf
        from loongforge_hf.multimodal.vision_weights import vision_export_tensors

        holds = ps.get_pipeline_model_parallel_rank() == 0 and ps.get_data_parallel_rank(with_context_parallel=True) \
            == 0
        group = ps.get_tensor_model_parallel_group() if self.vision_layout == "tensor_parallel" else None

        def extra():
            return vision_export_tensors(self.vision_tower, self.bridge, tp_group=group, holds=holds)

        refuse_save_options(unused)
        export_hf(self.language_model, self.bridge.text, self.parallel, Path(save_directory), source=self.source,
                  max_shard_size=max_shard_size, dtype=dtype, extra_tensors=extra, config_changes=self.config_changes(),
                  generation_config=self.generation_config_to_write(),
                  side_files_dir=side_files_dir)


def attention_token_types(bridge, token_type_ids, attention_mask, *, packed: bool = False):
    """``token_type_ids`` as the chunk's block rule takes them: PaliGemma's with padding out of its prefix
    (``bridge.attention_token_types``; packed rows refused there), others' as given."""
    if not hasattr(bridge, "attention_token_types"):
        return token_type_ids
    return bridge.attention_token_types(token_type_ids, attention_mask, packed=packed)


def _patch_positions(positions: torch.Tensor | None) -> dict:
    """``vision_inputs``' keywords for ``image_position_ids`` (Gemma 4's processor gives them): none without."""
    return {} if positions is None else {"image_position_ids": positions}


def _pixel_mask(mask: torch.Tensor | None) -> dict:
    """``vision_inputs``' keywords for a ``pixel_attention_mask`` (Idefics3's processors give one): none without."""
    return {} if mask is None else {"pixel_attention_mask": mask}


def _tile_mask(bridge, mask: torch.Tensor | None) -> dict:
    """``vision_inputs``' keywords for a ``pixel_mask`` (Aria's processor gives one) where the bridge takes it
    (``takes_pixel_mask``): none without, or for other bridges (as before: transformers' other models have none)."""
    return {"pixel_mask": mask} if mask is not None and getattr(bridge, "takes_pixel_mask", False) else {}


def _vision_layout(*, vision_tensor_parallel_size: int, vision_data_parallel: bool, tensor_parallel_size: int,
                   vision_config, vision_heads: int) -> str:
    """'replicated' | 'tensor_parallel' | 'data_parallel', or ``ParallelLayoutError``."""
    vtp = vision_tensor_parallel_size
    if vtp not in (1, tensor_parallel_size):
        raise ParallelLayoutError(f"vision_tensor_parallel_size={vtp} must be 1 or tensor_parallel_size "
                                  f"({tensor_parallel_size}).")
    if vtp > 1 and vision_data_parallel:
        raise ParallelLayoutError("vision_data_parallel=True shares the images out over the tensor-parallel group; "
                                  "it needs vision_tensor_parallel_size=1.")
    if vtp > 1:
        for field, value in (("the vision tower's attention heads", vision_heads),
                             ("vision_config.intermediate_size", vision_config.intermediate_size)):
            if value % vtp:
                raise ParallelLayoutError(f"{field} ({value}) is not divisible by vision_tensor_parallel_size={vtp}.")
        return "tensor_parallel"
    return "data_parallel" if vision_data_parallel and tensor_parallel_size > 1 else "replicated"


class AutoModelForImageTextToText:
    """``from_pretrained`` like transformers', onto a megatron-core language model and a vision tower."""

    def __init__(self) -> None:
        raise EnvironmentError("Use AutoModelForImageTextToText.from_pretrained(...).")

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike, *,
                        tensor_parallel_size: int | None = None, pipeline_parallel_size: int | None = None,
                        virtual_pipeline_parallel_size: int | None = None, context_parallel_size: int | None = None,
                        expert_parallel_size: int | None = None, expert_tensor_parallel_size: int | None = None,
                        sequence_parallel: bool | None = None, parallel=None, vision_tensor_parallel_size: int = 1,
                        vision_data_parallel: bool = False, vision_recompute: bool = False,
                        language_recompute: bool = False,
                        freeze_vision: bool = False, freeze_projector: bool = False, freeze_language: bool = False,
                        dtype: Any = None, torch_dtype: Any = None, revision: str | None = None,
                        cache_dir: str | os.PathLike | None = None, local_files_only: bool = False,
                        token: str | None = None, trust_remote_code: bool = False, allow_pickle: bool = False,
                        seed: int = 1234, fp8: str | None = None, fp8_recipe: str | None = None,
                        **unused: Any) -> LoongModelForImageTextToText:
        # NOTE: ``unused``: transformers' other from_pretrained keywords and config overrides (bridges/load_kwargs.py)
        arguments = {k: v for k, v in locals().items() if k not in ("cls", "pretrained_model_name_or_path", "unused")}
        from loongforge_hf.bridges import router_balance
        from loongforge_hf.bridges.builder import build_megatron_model
        from loongforge_hf.parallel.kv_replicas import check_kv_replication
        from loongforge_hf.bridges.checkpoint_io import CheckpointReader
        from loongforge_hf.bridges.embedding_padding import embedding_padding_idx
        from loongforge_hf.bridges.hub import resolve_checkpoint
        from loongforge_hf.bridges.load_kwargs import (check_device, finish_load, load_config, loading_info,
                                                       sort_load_kwargs)
        from loongforge_hf.bridges.loader import load_into
        from loongforge_hf.bridges.qwen2_5_vl import get_vl_bridge
        from loongforge_hf.lora.load import adapter_base_model, is_adapter_folder, load_adapter
        from loongforge_hf.multimodal.chunk import VisionLanguageChunk, check_deepstack_layers, image_blocks
        from loongforge_hf.multimodal.vision_weights import load_vision
        from loongforge_hf.parallel import initialize_parallel
        from loongforge_hf.xpu import get_backend

        options = sort_load_kwargs(unused, allow_pickle=allow_pickle)
        if fp8 is not None:  # NOTE: FP8 linear layers of the language model and the vision tower, see docs/fp8.md
            from loongforge_hf.kernels.fp8 import Fp8Error
            from loongforge_hf.kernels.fp8_linear import check_fp8_request
            from loongforge_hf.kernels.fp8_te import is_te_recipe

            if is_te_recipe(fp8_recipe):
                raise Fp8Error(f"fp8_recipe={fp8_recipe!r}: Transformer Engine recipes are offered for text models "
                               "(AutoModelForCausalLM); a vision-language model's vision tower has no TE linears. "
                               "Use fp8_recipe='blockwise' (or None) here, see docs/fp8.md.")
            check_fp8_request(fp8, fp8_recipe)
        if dtype is not None and torch_dtype is not None and dtype != torch_dtype:
            raise ValueError(f"dtype={dtype} and torch_dtype={torch_dtype} disagree; pass one of them.")
        sizes = dict(zip(PARALLEL_KWARGS, (tensor_parallel_size, pipeline_parallel_size,
                                           virtual_pipeline_parallel_size, context_parallel_size,
                                           expert_parallel_size, expert_tensor_parallel_size, sequence_parallel)))
        layout = resolve_parallel(parallel, sizes)

        # --- local checks: same verdict on every rank, before any collective -------------------------------
        hub = dict(revision=revision, cache_dir=cache_dir, local_files_only=local_files_only, token=token,
                   allow_pickle=allow_pickle, **options.hub)
        folder = resolve_checkpoint(pretrained_model_name_or_path, **hub)
        if is_adapter_folder(folder):
            # NOTE: as AutoModelForCausalLM's: a PEFT adapter loads its base model with these same arguments, then
            # the adapter onto it (frozen, as PeftModel.from_pretrained's default)
            loaded = cls.from_pretrained(adapter_base_model(folder), **arguments, **unused)
            base = loaded[0] if options.output_loading_info else loaded
            model = load_adapter(base, folder, allow_pickle=allow_pickle)
            return (model, loaded[1]) if options.output_loading_info else model
        hf_config, config_on_file = load_config(folder, options, trust_remote_code=trust_remote_code, hub=hub)
        reader = CheckpointReader(folder, allow_pickle=allow_pickle, **options.files)
        try:
            bridge = get_vl_bridge(hf_config, reader.keys(), reader.shape)
            text = hf_config.text_config
            layout.check_world_size(read_launch_env().world_size)
            layout.check_model(num_layers=text.num_hidden_layers, num_attention_heads=text.num_attention_heads,
                               num_key_value_heads=text.num_key_value_heads or text.num_attention_heads,
                               vocab_size=text.vocab_size, num_experts=bridge.text.num_experts())
            router_balance.check_layout(text, bridge.text)
            embedding_padding_idx(bridge.text)  # NOTE: raises on a pad_token_id outside the vocabulary
            check_kv_replication(bridge.text, layout)
            if hasattr(bridge, "check_layout"):  # NOTE: a layout the architecture cannot run (Qwen3.5: heads vs TP)
                bridge.check_layout(layout)
            check_deepstack_layers(getattr(bridge, "deepstack_count", 0), text.num_hidden_layers, layout)
            vision_layout = _vision_layout(vision_tensor_parallel_size=vision_tensor_parallel_size,
                                           vision_data_parallel=vision_data_parallel,
                                           tensor_parallel_size=layout.tensor_parallel_size,
                                           vision_config=bridge.vision_config, vision_heads=bridge.vision_heads)
            param_dtype = _resolve_dtype(dtype if dtype is not None else torch_dtype, hf_config, reader)
            reader.validate_shapes(bridge.expected_hf_shapes())
            info = loading_info(reader, bridge) if options.output_loading_info else None
            # --- collective part ----------------------------------------------------------------------------
            initialize_parallel(layout, seed=seed)
            from megatron.core import parallel_state as ps

            tp_group = ps.get_tensor_model_parallel_group() if layout.tensor_parallel_size > 1 else None
            towers = {}
            # NOTE: a rank-local failure (the language model's or, on the first stage, the tower's part) raises on
            # every rank alike (see modeling.failing_alike)
            with failing_alike(pretrained_model_name_or_path):
                check_device(options.device)
                language = build_megatron_model(bridge.text, layout, dtype=param_dtype)
                if language_recompute:
                    _recompute_every_layer(language)
                load_into(language, bridge.text, reader, tp_rank=ps.get_tensor_model_parallel_rank(),
                          tp_size=ps.get_tensor_model_parallel_world_size())
                for i, chunk in enumerate(language.chunks):
                    # NOTE: a bridge without a tower (Gemma 4's, carried as checkpoint tensors) builds none
                    if chunk.pre_process and getattr(bridge, "has_vision_tower", True):
                        # NOTE: the tower's modules initialise from the global CPU generator before their weights
                        # are loaded; transformers' load draws none, so neither does ours (seeded runs after a load)
                        with torch.random.fork_rng(devices=[]):
                            towers[i] = bridge.vision_tower(recompute=vision_recompute, tp_group=tp_group
                                                            if vision_layout == "tensor_parallel" else None)
                        towers[i].to(device=get_backend().device(), dtype=param_dtype)
                        load_vision(towers[i], bridge, reader,
                                    tp_group=tp_group if vision_layout == "tensor_parallel" else None)
            chunks = [VisionLanguageChunk(chunk, vision=towers.get(i), image_token_id=bridge.image_token_id,
                                          blocks=getattr(bridge, "token_type_blocks", image_blocks),
                                          windowed_blocks=getattr(bridge, "windowed_blocks", True),
                                          block_layers=getattr(bridge, "block_layers", "all"),
                                          video_token_id=bridge.video_token_id,
                                          encoder_group=tp_group if vision_layout == "data_parallel" else None)
                      for i, chunk in enumerate(language.chunks)]
        finally:
            reader.close()
        _freeze(chunks, bridge, vision=freeze_vision, projector=freeze_projector, language=freeze_language)
        hf_config.dtype = param_dtype
        # NOTE: LoongTrainer reads these from model.config; Qwen2.5-VL keeps them in text_config only. Set alike on
        # the config as loaded (config overrides), they are no change for save_pretrained to write.
        for config in (hf_config, config_on_file):
            if config is not None:
                config.vocab_size, config.max_position_embeddings = text.vocab_size, text.max_position_embeddings
        model = LoongModelForImageTextToText(hf_config=hf_config, bridge=bridge, language_model=language,
                                             chunks=chunks, parallel=layout, source=folder,
                                             vision_layout=vision_layout,
                                             config_at_load=config_on_file.to_dict() if config_on_file else None)
        if fp8 is not None:
            from loongforge_hf.kernels.fp8_linear import enable_fp8

            model.megatron.fp8 = enable_fp8(
                language.chunks, fp8, recipe=fp8_recipe, towers=[c.vision for c in chunks if c.vision is not None])
        keep_hub_name(hf_config, pretrained_model_name_or_path)
        # NOTE: eval mode as transformers returns it: no dropout until a trainer calls train()
        return finish_load(model.eval(), options, info)


def _recompute_every_layer(language) -> None:
    """Activation checkpointing of each decoder layer in training (non-reentrant ``torch.utils.checkpoint``)."""
    for chunk in language.chunks:
        config = chunk.config
        if config.hidden_dropout or config.attention_dropout:
            # NOTE: the recomputation would draw other dropout masks from megatron's TP RNG tracker.
            raise ValueError("language_recompute=True needs hidden_dropout = attention_dropout = 0 (got "
                             f"{config.hidden_dropout}, {config.attention_dropout}).")
        for layer in chunk.decoder.layers:
            layer.forward = _checkpointed(layer, layer.forward)


def _checkpointed(layer, forward):
    def run(*args, **kwargs):
        if layer.training and torch.is_grad_enabled():
            # NOTE: the recomputation (in the backward) runs in the context variables of the forward: the attention's
            # bidirectional image blocks (Gemma 3) are set only for the forward's duration
            context = contextvars.copy_context()
            return torch.utils.checkpoint.checkpoint(lambda *a, **k: context.run(forward, *a, **k), *args,
                                                     use_reentrant=False, **kwargs)
        return forward(*args, **kwargs)
    return run


def _freeze(chunks, bridge, *, vision: bool, projector: bool, language: bool) -> None:
    for chunk in chunks:
        if language:
            chunk.language.requires_grad_(False)
        if chunk.vision is None:
            continue
        for name, param in chunk.vision.named_parameters():
            if (projector if bridge.is_projector(name) else vision):
                param.requires_grad_(False)
