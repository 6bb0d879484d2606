"""``generate()`` for image-text models (Qwen2.5-VL): what ``LoongModelForImageTextToText`` adds to the text models'
glue (``loongforge_hf/generation.py``: transformers' ``GenerationMixin``, replica checks, KV cache).

Choices:
- Inputs as transformers' ``Qwen2_5_VLForConditionalGeneration.generate`` takes them: ``input_ids``,
  ``attention_mask`` (left padding), ``pixel_values`` / ``image_grid_thw``, ``pixel_values_videos`` /
  ``video_grid_thw`` / ``second_per_grid_ts``, ``mm_token_type_ids``. They are hashed with the rest of the call for
  the replica check (tensors by value). With the KV cache the vision inputs enter at the prefill only
  (transformers' generate drops ``pixel_values`` / ``pixel_values_videos`` after it); without it every step
  re-encodes them, as transformers does.
- Positions: the prompt's ``[3, b, s]`` mRoPE positions are computed once, before the prefill
  (``generation_positions``: ``rope_position_ids``, per row over the tokens the attention mask keeps, padding 0), and
  transformers' generate extends them per step as it extends its own (each axis: the row's last position + 1, so a
  new token continues after the prompt's text position, the ``rope_deltas`` rule), and slices each step's share
  (the new token with the cache). A batch without image / video grids gets the attention mask's cumulative count on
  all three axes, as transformers then uses. NOTE: transformers computes 3-D positions only when
  ``mm_token_type_ids`` are passed (the processor returns them) and otherwise gives vision tokens text positions;
  here vision tokens always get their 3-D positions (from the ids when ``mm_token_type_ids`` are missing), as the
  forward and training do.
- Beam search and ``num_return_sequences`` > 1 (``expand_vision_inputs``, from the model's
  ``_expand_inputs_for_generation``): transformers' generate repeats each row in place before the prefill (beams or
  return sequences, whichever is more; dim 0 of every per-row tensor, dim 1 of the ``[3, b, s]`` positions, which it
  prepares before the expansion). The vision inputs are per image / video / patch, not per row: each row's share is
  found from its placeholder tokens (``mm_token_type_ids`` when given, else the image / video token ids; kept by the
  attention mask) against the grids' merged-token counts, and repeated as a group: ``image_copies`` /
  ``video_copies`` list the images (videos) of the expanded rows in their order, as indices into those given, which
  stay as given. The tower encodes each given image once and the copies take its features
  (``chunk.repeat_copies``), as transformers encodes once and repeats the features. Placeholders that split an image
  between rows raise a ValueError. The KV cache reorders its rows for beam search (``kv_cache.py``).
- A step (``generation_forward``) runs the language model on ``[3, b, s]`` positions that megatron's
  ``MultimodalRotaryEmbedding`` reads as they are; with the cache through ``kv_cache.cached_step`` (the new tokens
  over the cached keys and values), without it over the whole sequence with transformers' padding mask. Either way
  the tokens are right-padded to TP under sequence parallelism (causality keeps the pads out of real tokens) and
  only the kept positions' logits are gathered and sent over the pipeline. The normal forward (training,
  evaluation) is not involved.
- Context parallelism: the cached prefill is split over CP as the text models' is (``kv_cache.split_prefill_step``:
  the chunk takes its CP share of the padded prompt, each CP rank keeps its share of the prompt's keys and values,
  computes its own of the kept rows' logits and encodes its share of the images, as in training); every other step,
  cached or not, runs the whole sequence on every CP rank (``context_parallel.whole_sequence_on_every_rank``, as the
  text models' cached steps: ``kv_cache.py``; an uncached step shares the images out over CP all the same:
  ``chunk.encode``; a 1-D rope (Gemma 3) then gives the whole sequence's rows: ``kv_cache.whole_sequence_ropes``).
- ``cache_implementation="static"``: the prefill as above, then each one-token step runs the static cache's
  fixed-shape decode (``static_cache.py``; a CUDA graph on GPUs, kept across calls) with the token's ``[3, b, 1]``
  positions copied into its position buffer (megatron's ``MultimodalRotaryEmbedding`` computes the rows inside the
  step); not under a pipeline (those steps run as with the dynamic cache).
- GLM-4.1V / GLM-4.5V videos (frames marked with the image token, ``mm_token_type_ids`` 2): each step that takes
  ``pixel_values_videos`` (the prefill; every uncached step) turns the frames' placeholders into video tokens first
  (``bridge.mark_video_tokens``, as the forward does); their positions are transformers' ``get_rope_index``'s, each
  frame its own item (``frames_apart``), and decode steps continue after them as above (transformers' ``rope_deltas``
  give the same where the prompt ends in text). Beam copies find each row's videos from ``mm_token_type_ids`` 2.
- Refused (ValueError, on every rank alike before any collective): ``mm_encoder_outputs`` (pass the pixels),
  ``position_ids`` other than ``[3, batch, seq]``, GLM-4V videos without ``mm_token_type_ids``.
- A placeholder id sampled into the sequence (say a video token in a batch without videos) stays a text token in
  the uncached steps, as in transformers (``chunk.py`` splices only the kinds given); one of a kind the batch has
  (an image token among images) makes the uncached step's placeholders outnumber the grids and raises there, as
  transformers' own uncached step does.
"""

from __future__ import annotations

import contextlib

import torch

VISION_INPUTS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
PER_ITEM_INPUTS = VISION_INPUTS + ("second_per_grid_ts",)  # NOTE: one entry per image / video / patch, not per row
COPIES = ("image_copies", "video_copies")  # NOTE: generate's expanded rows' images / videos (expand_vision_inputs)


def generation_positions(model, input_ids: torch.Tensor, model_kwargs: dict) -> torch.Tensor:
    """The prompt's ``[3, b, s]`` mRoPE positions (see the module docstring); ``[b, s]`` text positions for a model
    without mRoPE (Gemma 3)."""
    mask = model_kwargs.get("attention_mask")
    mrope = model.bridge.mrope
    if not mrope or (model_kwargs.get("image_grid_thw") is None and model_kwargs.get("video_grid_thw") is None):
        if mask is None:
            text = torch.arange(input_ids.shape[1], device=input_ids.device).expand(input_ids.shape)
        else:
            text = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
        return text.unsqueeze(0).expand(3, -1, -1).clone() if mrope else text.clone()
    return model.rope_position_ids(input_ids, image_grid_thw=model_kwargs.get("image_grid_thw"), attention_mask=mask,
                                   mm_token_type_ids=model_kwargs.get("mm_token_type_ids"),
                                   video_grid_thw=model_kwargs.get("video_grid_thw"),
                                   second_per_grid_ts=model_kwargs.get("second_per_grid_ts"))


def generation_refusal(model, config, kwargs: dict) -> str | None:
    """Why this image-text generate call is refused, or None (see the module docstring)."""
    if kwargs.get("mm_encoder_outputs") is not None:
        return "mm_encoder_outputs is not supported: pass pixel_values / pixel_values_videos."
    if kwargs.get("pixel_values_videos") is not None and kwargs.get("mm_token_type_ids") is None \
            and hasattr(model.bridge, "mark_video_tokens"):
        return ("mm_token_type_ids: GLM-4.1V / GLM-4.5V mark a video's frames with the image token; pass the "
                "processor's mm_token_type_ids (2: video) with pixel_values_videos.")
    positions = kwargs.get("position_ids")
    if not model.bridge.mrope:
        if positions is not None and positions.dim() != 2:
            return (f"position_ids of shape {list(positions.shape)} are not supported: pass [batch, seq] positions, "
                    "or none.")
        return None
    if positions is not None and (positions.dim() != 3 or positions.shape[0] != 3):
        return (f"position_ids of shape {list(positions.shape)} are not supported: pass [3, batch, seq] mRoPE "
                "positions, or none (they are computed from the inputs).")
    return None


# (name, pixels, per-item inputs a row's copies take: grids first, mm_token_type_ids code) of each vision kind
_KINDS = (("image", "pixel_values", ("image_grid_thw",), 1),
          ("video", "pixel_values_videos", ("video_grid_thw", "second_per_grid_ts"), 2))


def expand_vision_inputs(model, input_ids: torch.Tensor, model_kwargs: dict, expand_size: int) -> dict:
    """``image_copies`` / ``video_copies`` for the batch with each row repeated ``expand_size`` times in place (row
    ``r`` becomes rows ``r * expand_size ..``): the images (videos) the expanded rows' placeholders take, in order, as
    indices into those of ``model_kwargs`` (each row's repeated as a group; see the module docstring). ``input_ids``
    and ``model_kwargs`` are the batch before expansion."""
    merge = model.bridge.vision_merge ** 2
    kinds, mask = model_kwargs.get("mm_token_type_ids"), model_kwargs.get("attention_mask")
    expanded = {}
    for name, pixels_key, (grid_key, *_), code in _KINDS:
        pixels, grid = model_kwargs.get(pixels_key), model_kwargs.get(grid_key)
        if pixels is None or grid is None or len(grid) == 0:
            continue
        token_id = model.bridge.image_token_id if code == 1 else model.bridge.video_token_id
        tokens = (kinds == code) if kinds is not None else (input_ids == token_id)
        if mask is not None:
            tokens = tokens & mask.bool()
        per_row = tokens.long().sum(-1).cpu()  # this kind's placeholder tokens per row
        # NOTE: a bridge whose grid rows are not patch grids counts each item's embeddings itself (LLaVA-NeXT's)
        count = getattr(model.bridge, "vision_item_tokens", None)
        tokens = count(grid.cpu()) if count is not None else grid.prod(-1).cpu() // merge
        item_end, row_end = tokens.cumsum(0), per_row.cumsum(0)
        # NOTE: the rows must split the items where the placeholders do (the same check on every rank: the inputs
        # are the same over the replica)
        if row_end[-1] != item_end[-1] or not set(row_end.tolist()) <= set(item_end.tolist()) | {0}:
            raise ValueError(f"generate: the {name} placeholder tokens per row {per_row.tolist()} do not split "
                             f"{grid_key} {grid.tolist()} into whole {name}s.")
        cut = torch.searchsorted(item_end, row_end, right=True)  # one past each row's last item
        starts = torch.cat([torch.zeros(1, dtype=torch.long), cut[:-1]])
        items = [i for first, stop in zip(starts.tolist(), cut.tolist())
                 for _ in range(expand_size) for i in range(first, stop)]
        expanded[f"{name}_copies"] = torch.tensor(items, dtype=torch.long, device=grid.device)
    return expanded


def copied_vision(vision: dict) -> dict:
    """``vision`` (generate's vision inputs) with each kind's grids and ``second_per_grid_ts`` taken for its copies
    (``image_copies`` / ``video_copies``): the per-row view that the positions are computed from."""
    vision = dict(vision)
    for name, _, per_item, _ in _KINDS:
        copies = vision.pop(f"{name}_copies", None)
        for key in per_item if copies is not None else ():
            value = vision.get(key)
            if value is not None:
                vision[key] = value[copies.to(value.device)] if torch.is_tensor(value) else \
                    [value[i] for i in copies.tolist()]
    return vision


def generation_forward(model, *, cache, input_ids: torch.Tensor, attention_mask, position_ids: torch.Tensor | None,
                       vision: dict, keep: int) -> torch.Tensor:
    """The logits ``[b, given, V]`` (the last ``keep`` positions when ``keep`` > 0) of one generate step on every
    rank: with ``cache``, ``input_ids`` are the tokens after the cached ones and join the cache; without it, the
    whole sequence."""
    import torch.nn.functional as F

    from loongforge_hf.bridges.output_layer import KeptRows, head_rows
    from loongforge_hf.bridges.runtime import keep_rows, megatron_attention_mask
    from loongforge_hf.parallel.context_parallel import (cp_group_holders, pipeline_sequence_length,
                                                         whole_sequence_on_every_rank)
    from loongforge_hf.trainer.data import pad_model_inputs

    device = model.device
    input_ids = input_ids.to(device)
    if vision.get("pixel_values_videos") is not None and hasattr(model.bridge, "mark_video_tokens"):
        input_ids = model.bridge.mark_video_tokens(input_ids, vision.get("mm_token_type_ids"))  # NOTE: GLM-4V's
    batch, given = input_ids.shape
    if position_ids is None:
        if cache is not None and cache.get_seq_length() > 0:
            raise ValueError("forward with a KV cache after the prefill needs the new tokens' [3, batch, new] "
                             "position_ids (generate passes them).")
        position_ids = generation_positions(model, input_ids, {"attention_mask": attention_mask,
                                                               **copied_vision(vision)})
    mrope = model.bridge.mrope
    if tuple(position_ids.shape) != ((3, batch, given) if mrope else (batch, given)):
        raise ValueError(f"position_ids must be [{'3, ' if mrope else ''}{batch}, {given}] positions, got "
                         f"{list(position_ids.shape)}.")
    # NOTE: padded for sequence parallelism only: under context parallelism every CP rank runs the whole sequence
    # (context_parallel.whole_sequence_on_every_rank), as the text models' cached steps do (kv_cache.py), but for the
    # cached prefill, split over CP as they split it (kv_cache.cached_forward)
    multiple = model.parallel.whole_sequence_multiple
    rows = keep_rows(given, keep)
    vocab = model.config.text_config.vocab_size
    inputs = {name: vision.get(name) for name in VISION_INPUTS + COPIES}
    if inputs["pixel_values"] is not None:
        inputs["pixel_values"], inputs["image_grid_thw"] = model.bridge.vision_inputs(
            inputs["pixel_values"], inputs["image_grid_thw"], image_sizes=vision.get("image_sizes"))
    if model.bridge.bidirectional_images and (cache is None or cache.get_seq_length() == 0):
        # NOTE: as transformers: an image's tokens see each other at the prefill (and in every uncached step)
        from loongforge_hf.multimodal.modeling import attention_token_types

        types = vision.get(getattr(model.bridge, "token_types_input", "token_type_ids"))  # NOTE: Gemma 4's mm_ ones
        inputs["token_type_ids"] = attention_token_types(model.bridge, types, attention_mask)

    def run(ids, mask):
        positions = F.pad(position_ids.to(device), (0, ids.shape[-1] - given))  # NOTE: the pads' never reach a token
        # NOTE: the kept rows' logits on every rank (a CP share of them on each rank in the split prefill)
        kept = KeptRows(rows, ids.shape[-1], vocab_size=vocab,
                        sequence_parallel=model.megatron.config.sequence_parallel, device=device)
        with head_rows(model.chunks, kept.head):
            if model.parallel.pipeline_parallel_size == 1:
                return kept.logits(model.chunks[0](ids, positions, mask, **inputs))
            from loongforge_hf.bridges.runtime import _forward_pipelined

            return _forward_pipelined(model.bound_chunks(inputs), ids, positions, mask,
                                      lambda out: (None, kept.logits(out)), True, False,
                                      seq=pipeline_sequence_length(ids.shape[-1]), rows=rows.stop - rows.start)[1]

    if cache is not None:
        from loongforge_hf.kv_cache import cached_forward

        # NOTE: 1-D rope (Gemma 3) rotates by the cache's slots, as for text models: no positions for the cache
        return cached_forward(model, cache, input_ids=input_ids, attention_mask=attention_mask,
                              position_ids=position_ids if mrope else None, run=lambda ids: run(ids, None))
    ids, attention_mask, _, _ = pad_model_inputs(
        input_ids, attention_mask.to(device) if attention_mask is not None else None, None, None, multiple=multiple)
    cp = model.parallel.context_parallel_size
    whole = contextlib.ExitStack()
    if cp > 1:
        from loongforge_hf.kv_cache import whole_sequence_ropes

        whole.enter_context(whole_sequence_on_every_rank(cp_group_holders(model.chunks)))
        if not mrope:  # NOTE: megatron's 1-D rope would take a CP share of its rows
            whole.enter_context(whole_sequence_ropes(model.chunks, cp))
    with whole:
        return run(ids, megatron_attention_mask(attention_mask, ids.shape[-1]) if attention_mask is not None else None)
