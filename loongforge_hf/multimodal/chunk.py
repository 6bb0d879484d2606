"""One pipeline stage of a vision-language model: megatron's GPTModel, plus the vision tower on the first stage.

Choices:
- ``VisionLanguageChunk(input_ids, position_ids, attention_mask, pixel_values=, image_grid_thw=,
  pixel_values_videos=, video_grid_thw=)`` is what megatron's schedules and DDP see as a model chunk; any attribute it
  lacks is GPTModel's (``set_input_tensor``, ``config``, ``pre_process`` ...), so megatron treats it as the GPTModel
  it wraps, with the tower's parameters added.
- It takes the whole sequence (``input_ids`` [b, s], 3-D ``position_ids`` [3, b, s] (1-D [b, s] for Gemma 3), mask
  [b, 1, s, s] or None). With ``token_type_ids`` (Gemma 3) each image's tokens attend to each other both ways on
  every stage (``image_blocks``, ``kernels.attention.bidirectional_blocks``); PaliGemma's image and prefix are one
  such block (``prefix_blocks``), passing sliding windows (``windowed_blocks`` False); Gemma 4's blocks hold in its
  sliding-window layers only (``block_layers='sliding'``).
  Under context parallelism it keeps this rank's load-balanced share of the tokens and of the mask rows
  (``context_parallel.cp_token_index``); the positions go to megatron whole (its mrope slices them itself).
- First stage: megatron's own embedding (dropout, sequence-parallel scatter included) gives the text embeddings; the
  vision embeddings replace the rows at image / video token positions (transformers' ``masked_scatter``: image
  tokens in order take the images' embeddings in order, video tokens the videos'), and the result is GPTModel's
  ``decoder_input``. Images and videos go through the tower in one call (its attention never crosses an image or a
  frame). Image (video) tokens stay text when no pixel_values (pixel_values_videos) are given, as in transformers.
  An item gives its grid's ``t h w / merge^2`` embeddings, or the tower's own count where its grid rows are not
  patch grids (LLaVA-NeXT's ``(crops, height, width)``, LLaVA-OneVision's and LLaVA-NeXT-Video's videos
  ``(frames, 0, 0)``: ``vision.item_tokens`` / ``item_patches``).
  Each rank replaces only the rows it holds (its CP share, its sequence-parallel part of that); under sequence
  parallelism the gradient of the vision embeddings is summed over the TP group, so the tower gets all of it.
- The vision layouts: replicated tower (every TP rank encodes every image), tower split over TP (``VisionTower`` built
  with the TP group), or encoder data parallel (``encoder_parallel``: each TP rank encodes a share of the images).
  Under CP the CP ranks share out the images and videos the same way (``encode``), the TP split inside a CP share.
- DeepStack (Qwen3-VL): the tower's output carries ``deepstack_count`` more feature blocks beside the embeddings
  (``vision_qwen3.py``); they travel with the embeddings to this rank's rows, and the output hidden states of decoder
  layer ``k`` (global, 0-based) get block ``k`` added at the image / video rows for the duration of the call
  (forward hooks; the rows are the local ones, after the CP share and the sequence-parallel split, as the
  embeddings'). These layers must sit on the first pipeline stage's first chunk, beside the tower
  (``check_deepstack_layers``). ``language_recompute=True`` checkpoints each layer inside its call, the hooks
  outside.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn


def check_deepstack_layers(count: int, num_layers: int, parallel) -> None:
    """Raise (before any collective) where DeepStack's first ``count`` decoder layers are not all on the first
    pipeline stage's first chunk, beside the vision tower."""
    from loongforge_hf.bridges.stage_boundary import stage_layer_ranges

    if not count:
        return
    held = len(stage_layer_ranges(num_layers, parallel)[0])
    if count > held:
        from loongforge_hf.parallel import ParallelLayoutError

        raise ParallelLayoutError(f"DeepStack adds vision features to the outputs of the first {count} decoder "
                                  f"layers, but the first pipeline stage's first chunk holds {held} of the "
                                  f"{num_layers}: use fewer pipeline (or virtual pipeline) stages.")


@contextlib.contextmanager
def deepstack_added(language, where: tuple, features: list[torch.Tensor]):
    """Inside, decoder layer ``k`` (global, 0-based) of ``language`` (a GPTModel) adds ``features[k]`` to its output
    hidden states ``[s, b, h]`` at the rows ``where``."""
    def hook(k):
        def add(module, args, output):
            hidden, *rest = output if isinstance(output, tuple) else (output,)
            hidden = hidden.index_put(where, features[k].to(hidden.dtype), accumulate=True)
            return (hidden, *rest) if isinstance(output, tuple) else hidden
        return add

    handles = [layer.register_forward_hook(hook(layer.layer_number - 1)) for layer in language.decoder.layers
               if layer.layer_number <= len(features)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def image_blocks(token_type_ids: torch.Tensor) -> torch.Tensor:
    """``[b, s]`` block ids of the image tokens (``token_type_ids == 1``: each run of them one block, numbered from 0
    per row), -1 elsewhere: what ``kernels.attention.bidirectional_blocks`` takes (Gemma 3)."""
    is_image = token_type_ids == 1
    starts = is_image & ~torch.nn.functional.pad(is_image, (1, 0))[:, :-1]
    return torch.where(is_image, torch.cumsum(starts.long(), dim=1) - 1, -1)


def prefix_blocks(token_type_ids: torch.Tensor) -> torch.Tensor:
    """``[b, s]`` block ids of PaliGemma's prefix: one block (0) over every ``token_type_ids == 0`` position (the
    image and the prefix text), -1 elsewhere, as transformers' ``block_sequence_ids``."""
    return torch.where(token_type_ids == 0, 0, -1)


class VisionLanguageChunk(nn.Module):
    def __init__(self, language, *, vision=None, image_token_id: int, video_token_id: int | None = None,
                 encoder_group=None, blocks=image_blocks, windowed_blocks: bool = True,
                 block_layers: str = "all") -> None:
        super().__init__()
        self.language = language
        self.blocks_of = blocks  # NOTE: token_type_ids -> bidirectional block ids (image_blocks, prefix_blocks)
        self.windowed_blocks = windowed_blocks  # NOTE: False: a block passes sliding windows (PaliGemma 2)
        self.block_layers = block_layers  # NOTE: 'sliding': blocks in the sliding-window layers only (Gemma 4)
        self.vision = vision
        self.image_token_id = image_token_id
        self.video_token_id = video_token_id
        self.encoder_group = encoder_group  # set: encoder data parallel over this group

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["language"], name)

    def set_input_tensor(self, input_tensor) -> None:
        self.language.set_input_tensor(input_tensor)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        """GPTModel's state (its keys as a text model's) and, on the first stage, the vision tower's under
        ``vision.`` (``vision_weights.vision_sharded_state_dict``): training checkpoints hold both."""
        from loongforge_hf.multimodal.vision_weights import vision_sharded_state_dict

        state = self.language.sharded_state_dict(prefix, sharded_offsets, metadata)
        if self.vision is not None:
            tp_group = self.vision.blocks[0].attn.tp_group if len(self.vision.blocks) else None
            state.update(vision_sharded_state_dict(self.vision, prefix=f"{prefix}vision.", tp_group=tp_group))
        return state

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """The inverse of ``sharded_state_dict``'s keys: ``vision.*`` into the tower, the rest into GPTModel."""
        from torch.nn.modules.module import _IncompatibleKeys

        vision = {k[len("vision."):]: v for k, v in state_dict.items() if k.startswith("vision.")}
        if vision and self.vision is None:
            raise RuntimeError(f"VisionLanguageChunk: {len(vision)} vision tower tensors for a stage without it.")
        results = [("", self.language.load_state_dict({k: v for k, v in state_dict.items()
                                                       if not k.startswith("vision.")}, strict=strict, assign=assign))]
        if self.vision is not None:
            results.append(("vision.", self.vision.load_state_dict(vision, strict=strict, assign=assign)))
        return _IncompatibleKeys([p + k for p, r in results for k in r.missing_keys],
                                 [p + k for p, r in results for k in r.unexpected_keys])

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor | None, *,
                pixel_values: torch.Tensor | None = None, image_grid_thw: torch.Tensor | None = None,
                pixel_values_videos: torch.Tensor | None = None, video_grid_thw: torch.Tensor | None = None,
                image_copies: torch.Tensor | None = None, video_copies: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None):
        from loongforge_hf.kernels.attention import bidirectional_blocks
        from loongforge_hf.parallel.context_parallel import cp_group_and_size, cp_token_index

        _, cp_size, cp_rank = cp_group_and_size()
        index = None
        if cp_size > 1:
            index = cp_token_index(input_ids.shape[1], cp_size, cp_rank, device=input_ids.device)
            if attention_mask is not None:
                attention_mask = attention_mask[:, :, index] if attention_mask.shape[2] > 1 else attention_mask
        decoder_input, added = None, contextlib.nullcontext()
        if self.language.pre_process:
            decoder_input, deepstack = self.embed(input_ids, pixel_values, image_grid_thw, pixel_values_videos,
                                                  video_grid_thw, index=index, image_copies=image_copies,
                                                  video_copies=video_copies)
            if deepstack is not None:
                added = deepstack_added(self.language, *deepstack)
        local_ids = input_ids if index is None else input_ids[:, index]
        blocks = self.blocks_of(token_type_ids) if token_type_ids is not None else None
        with added, bidirectional_blocks(blocks, windowed=self.windowed_blocks, layers=self.block_layers):
            return self.language(local_ids, position_ids, attention_mask, decoder_input=decoder_input)

    def encode(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """Embeddings of every image / video of ``grid_thw`` on this rank; under context parallelism (also in a step
        run whole on every CP rank without gradients) each CP rank encodes its share and the group gathers them, and
        with ``encoder_group`` a share is shared out again over that (TP) group (``encoder_parallel.py``)."""
        from megatron.core import parallel_state as ps

        from loongforge_hf.multimodal.encoder_parallel import encode_images_data_parallel
        from loongforge_hf.parallel.context_parallel import cp_group_and_size

        def share(pixels: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
            if self.encoder_group is not None:
                return encode_images_data_parallel(self.vision, pixels, grid, group=self.encoder_group)
            return self.vision(pixels, grid)

        # NOTE: also in a step run whole on every CP rank (cp_group_and_size gives size 1 there: generate's uncached
        # steps) where nothing takes gradients: the split needs no split of the sequence; with gradients it would need
        # each rank's loss to cover its own tokens, which a whole step's does not
        if ps.get_context_parallel_world_size() > 1 and (cp_group_and_size()[1] > 1 or not torch.is_grad_enabled()):
            return encode_images_data_parallel(self.vision, pixel_values, grid_thw,
                                               group=ps.get_context_parallel_group(), sum_rows=True, encode=share)
        return share(pixel_values, grid_thw)

    # NOTE: the name the existing callers use (images only).
    def encode_images(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> torch.Tensor:
        return self.encode(pixel_values, image_grid_thw)

    def embed(self, input_ids: torch.Tensor, pixel_values: torch.Tensor | None, image_grid_thw: torch.Tensor | None,
              pixel_values_videos: torch.Tensor | None = None, video_grid_thw: torch.Tensor | None = None, *,
              index: torch.Tensor | None = None, image_copies: torch.Tensor | None = None,
              video_copies: torch.Tensor | None = None) -> tuple[torch.Tensor, tuple | None]:
        """``[s_local (/ tp under sequence parallelism), b, h]`` embeddings with images and videos in place, and the
        DeepStack rows and features for ``deepstack_added`` (None without them);
        ``index``: the global positions this rank holds (context parallelism), all when None. ``image_copies`` /
        ``video_copies`` (generate's rows expanded for beams or return sequences): the images (videos) the
        placeholders take, in order, as indices into those given; each given one is encoded once."""
        from loongforge_hf.multimodal.vision import item_tokens

        local_ids = input_ids if index is None else input_ids[:, index]
        embeddings = self.language.embedding(input_ids=local_ids, position_ids=None)
        if pixel_values is None and pixel_values_videos is None:
            if self.vision is not None and torch.is_grad_enabled():
                # NOTE: a micro-batch without images still touches every trainable tower parameter (a zero term):
                # megatron's DDP with overlap_grad_reduce starts a bucket's reduction only once each of its
                # parameters' grad hooks fired in the step's last micro-batch, and records the first step's set as
                # the golden one (param_and_grad_buffer.reset asserts / finish_grad_sync raises otherwise).
                trainable = [p for p in self.vision.parameters() if p.requires_grad]
                if trainable:
                    embeddings = embeddings + 0.0 * sum(p.reshape(-1)[:1].sum() for p in trainable).to(embeddings.dtype)
            return embeddings, None
        if self.vision is None:
            raise ValueError("pixel_values / pixel_values_videos need a model with a vision tower.")
        if pixel_values_videos is not None and video_grid_thw is None:
            raise ValueError("pixel_values_videos without video_grid_thw: videos are supported for the Qwen-VL "
                             "family (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5), whose processors give "
                             "video_grid_thw, and for LLaVA-OneVision and LLaVA-NeXT-Video, whose [videos, "
                             "frames, C, H, W] videos the model's forward turns into patches and grids; not for this "
                             "model's.")
        if pixel_values is not None and image_grid_thw is None:
            raise ValueError("pixel_values need image_grid_thw.")
        pixels = [p for p in (pixel_values, pixel_values_videos) if p is not None]
        grids = [g for p, g in ((pixel_values, image_grid_thw), (pixel_values_videos, video_grid_thw))
                 if p is not None]
        device = pixels[0].device
        grid = torch.cat([g.to(device).reshape(-1, 3) for g in grids])
        vision = self.encode(torch.cat(pixels) if len(pixels) > 1 else pixels[0], grid)
        if image_copies is not None or video_copies is not None:
            vision, image_grid_thw, video_grid_thw = repeat_copies(
                vision, self.vision.merge ** 2, (image_grid_thw if pixel_values is not None else None, image_copies),
                (video_grid_thw if pixel_values_videos is not None else None, video_copies),
                tokens_of=lambda grid: item_tokens(self.vision, grid))
        if self.language.config.sequence_parallel and self.language.config.tensor_model_parallel_size > 1:
            from megatron.core import parallel_state as ps
            from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

            # NOTE: each TP rank splices only the rows of its sequence part, so its gradient reaches only those
            # images' embeddings; summed over the group (this identity's backward) it is the whole one on every rank.
            vision = copy_to_tensor_model_parallel_region(vision, group=ps.get_tensor_model_parallel_group())
        n_image = int(item_tokens(self.vision, image_grid_thw).sum()) if pixel_values is not None else 0
        # NOTE: a kind without inputs keeps its tokens' text embeddings, as transformers does (a placeholder id that
        # generate sampled in an uncached step of a batch without videos, say)
        is_image = (input_ids == self.image_token_id) & (pixel_values is not None)
        is_video = (input_ids == self.video_token_id) & (pixel_values_videos is not None) \
            if self.video_token_id is not None else torch.zeros_like(is_image)
        n_video = vision.shape[0] - n_image
        if int(is_image.sum()) != n_image or int(is_video.sum()) != n_video:
            raise ValueError(f"The input ids hold {int(is_image.sum())} image and {int(is_video.sum())} video "
                             f"tokens but the vision inputs give {n_image} and {n_video} embeddings "
                             f"(image_grid_thw {None if image_grid_thw is None else image_grid_thw.tolist()}, "
                             f"video_grid_thw {None if video_grid_thw is None else video_grid_thw.tolist()}).")
        # row of ``vision`` each vision token takes: images in order, then videos in order
        source = torch.where(is_image, torch.cumsum(is_image.reshape(-1), 0).view_as(input_ids) - 1,
                             n_image + torch.cumsum(is_video.reshape(-1), 0).view_as(input_ids) - 1)
        is_vision = is_image | is_video
        positions = index if index is not None else torch.arange(input_ids.shape[1], device=input_ids.device)
        local = embeddings.shape[0]
        if self.language.config.sequence_parallel:
            from megatron.core import parallel_state as ps

            start = ps.get_tensor_model_parallel_rank() * local
            positions = positions[start:start + local]
        rows = is_vision[:, positions].t()
        where = rows.nonzero(as_tuple=True)
        picked = vision[source[:, positions].t()[where]].to(embeddings.dtype)
        width = embeddings.shape[-1]
        merged = embeddings.index_put(where, picked[:, :width])
        features = list(picked[:, width:].split(width, dim=-1)) if picked.shape[1] > width else []
        return merged, ((where, features) if features else None)


def repeat_copies(features: torch.Tensor, merge2: int, *kinds, tokens_of=None) -> tuple:
    """The encoded ``features`` of the images then the videos as given (``[tokens, h]``, each item its grid's
    ``t h w / merge2`` merged tokens, or ``tokens_of(grid)`` [n] where given: ``vision.item_tokens``) -> (the features
    of their copies, the copies' grids of each kind); ``kinds``: (``grid_thw`` or None, ``copies`` or None: all items
    once) of images, then of videos."""
    pieces, grids, offset = [], [], 0
    for grid, copies in kinds:
        if grid is None:
            grids.append(None)
            continue
        grid_here = grid.to(features.device)
        tokens = tokens_of(grid_here) if tokens_of is not None else grid_here.prod(-1) // merge2
        starts = offset + tokens.cumsum(0) - tokens
        offset += int(tokens.sum())
        if copies is None:
            copies = torch.arange(len(grid), device=features.device)
        copies = copies.to(features.device)
        count = tokens[copies]
        # NOTE: copy j's rows: its item's first row, + 0 .. count[j] - 1
        before = torch.repeat_interleave(count.cumsum(0) - count, count)  # NOTE: rows of the copies before j
        pieces.append(torch.repeat_interleave(starts[copies], count)
                      + torch.arange(int(count.sum()), device=features.device) - before)
        grids.append(grid[copies.to(grid.device)])
    return features.index_select(0, torch.cat(pieces)), *grids
