"""``generate(cache_implementation="static")``: a preallocated KV cache whose one-token decode steps run at a fixed
shape, replayed as one device graph (a CUDA graph on NVIDIA GPUs, through the backend: ``xpu/``).

Why: a decode step of a small model is bound by the host. Each step walks megatron-core's modules in Python and
launches a few hundred kernels (~43 ms a step for a 0.6B model on an H200 against ~29 ms for transformers' eager
model; ``docs/benchmarks.md``); a CUDA graph launches the whole step at once. transformers offers the same trade
behind the same switch (its ``StaticCache`` with ``torch.compile``'s CUDA graphs).

Choices:
- ``LoongStaticCache`` is the dynamic ``LoongKVCache`` (``kv_cache.py``: the core attentions and rotary embeddings
  of this rank, the host count of cached tokens, beam reordering) with transformers' ``StaticLayer`` per attention
  instead: ``[batch, kv heads, max_cache_len, head dim]`` buffers made at the prefill, written in place at the
  layer's device-side count, never reallocated; beam search reorders them in place (the graph keeps their
  addresses). ``max_cache_len`` is transformers': the generation's ``max_length - 1``.
- The prefill and, where the fixed step does not apply, every step run as with the dynamic cache (``cached_step``):
  the new keys are written into the buffers and attention reads the filled slots only.
- The fixed step (``FixedDecode``): a one-token step whose tensors never change shape or address. Its inputs are
  copied into static buffers first: the token ids, the rotary position (``past``) and, per attention window, a
  ``[b, 1, 1, max_cache_len]`` mask of the keys the query may see (transformers' padding mask over the filled
  slots, the window's left bound; unfilled slots never). Inside, each core attention writes its key and value at
  the layer's count and attends the query over the whole buffer under that mask (attention sinks, gpt-oss's, on
  materialised scores: ``kernels.attention.masked_attention``), and each rotary embedding returns its table row
  of that position (the table is computed once, at the first step, by the embedding itself); an
  image-text model's ``[3, b, 1]`` mRoPE positions (from generate) are copied into a position buffer instead and
  its multimodal rotary embedding computes the rows inside the step (``multimodal/generation.py``). Under
  sequence parallelism the step is the token and ``tensor_parallel_size - 1`` placeholders after it (megatron splits
  the sequence over the TP ranks): only the token's key and value are written, the placeholders' queries attend
  under the token's mask and their logits are dropped. Under context parallelism the step runs whole on every CP
  rank (``context_parallel.whole_sequence_on_every_rank``, as the dynamic cache's steps) and the buffers hold the
  rank's share of the slots (``kv_cache.CPShard``, round robin) and one scratch slot: each rank writes the token's
  key and value at its own slot for it, or at the scratch slot where the token is another rank's (the same ops
  every step, as a graph needs), attends over its share, and the shares are merged by one all-gather over the CP
  group (captured with the step). Not under a pipeline
  (``pipeline_parallel_size == 1``): its stages pass activations at data-dependent times.
- The graph (``Backend.capture``: the CUDA backend's CUDA graphs): on GPUs, with tensor parallelism over NCCL too (its
  all-reduces and the logits' all-gather are captured with the step; every rank of the group captures and replays the
  same sequence of collectives), also with mixture-of-experts layers at expert parallel 1 whose step has fixed shapes
  (``moe_permute.fixed_shape_moe``: the sync-free allgather dispatcher, every expert local, bf16 grouped experts on
  ``torch._grouped_mm``), not with expert parallelism or other MoE layers (data-dependent shapes or host reads: fp32
  experts loop over the counts on the host) nor a Transformer Engine FP8 recipe (its scaling state lives on the host)
  nor dropout in training mode (megatron's RNG tracker switches generator states; where nothing draws, its forks
  are skipped in the step: sequence parallelism forks around every block); why a GPU run gets no graph is logged at
  INFO. The first fixed step runs for real first
  (``Backend.run_before_capture``: a side stream; its output is returned; lazy initialisations, NCCL's first use and
  Triton autotuning happen here) and is then captured; each later step copies its inputs into the buffers and
  replays the graph. A capture that fails logs a warning with the reason and the steps run eagerly (same results).
  Where a GPU run gets no graph (``graph_refusal``: a mixture-of-experts model other than the above, expert
  parallelism, TE's FP8, dropout in training mode) the decode steps run as the dynamic cache's over the static
  buffers instead (``cached_step``: the eager fixed step fills and applies a mask over every slot each step,
  measured slower), logged at INFO.
  Elsewhere (CPU, gloo) the fixed step runs eagerly, which is what the CPU tests check against transformers. Module
  hooks run at the warm-up and the capture, not at the replays (as with any CUDA graph).
- Kept from one call to the next (``Kept``, on the model), as transformers keeps its compiled step and its CUDA
  graphs: the cache's buffers (a later call reuses them where they are long enough: ``max_length - 1`` of that call,
  or transformers' ``generation_config.max_cache_len``, a floor; longer ones replace them) and the fixed step with
  its graph, replayed at once by a later call with the same batch over the same buffers where the model's host state
  (``host_state``: what a capture reads on the host and a replay never again) is unchanged; otherwise a new step is
  made and captured. The weights are read by address, so a graph kept across an optimizer step replays with the new
  values. The cache a call returns shares its buffers with the next call's. ``model.free_static_cache()`` frees them.
- Refused (``generation.py``): with expert parallelism (``synced_gpus``: a finished rank's extra forwards would
  outgrow the buffers).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os

import torch
from transformers.cache_utils import StaticLayer

from loongforge_hf.kv_cache import LoongKVCache, check_step_mask, cp_shard, patched
from loongforge_hf.parallel.context_parallel import whole_sequence_on_every_rank

logger = logging.getLogger(__name__)


class _StaticLayer(StaticLayer):
    """transformers' ``StaticLayer``, reordered in place for beam search (a captured graph reads these buffers), made
    anew at a prefill whose batch, heads, dtype or device differ from a kept layer's (``Kept``)."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self.is_initialized and (tuple(key_states.shape[:2]) != (self.batch_size, self.num_heads)
                                    or key_states.dtype != self.keys.dtype or key_states.device != self.keys.device):
            self.lazy_initialization(key_states, value_states)  # NOTE: new buffers; no kept graph reads them
        return super().update(key_states, value_states, *args, **kwargs)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_initialized:
            index = beam_idx.to(self.keys.device)
            self.keys.copy_(self.keys.index_select(0, index))
            self.values.copy_(self.values.index_select(0, index))


class Kept:
    """What a model keeps of its last static-cache generate for the next one (``model._static_cache_kept``): the
    cache's layers (their buffers) and the fixed step (its buffers and device graph). It holds neither the model nor
    a cache."""

    def __init__(self, layers: list, max_cache_len: int, shard_over_cp: bool = True) -> None:
        self.layers = layers
        self.max_cache_len = max_cache_len
        self.shard_over_cp = shard_over_cp  # NOTE: whether its buffers hold a CP rank's share (kv_cache.CPShard)
        self.decode: FixedDecode | None = None

    def __deepcopy__(self, memo) -> None:
        return None  # NOTE: a copied model (copy.deepcopy) makes its own: a graph cannot be copied, nor shared


class LoongStaticCache(LoongKVCache):
    """``LoongKVCache`` with preallocated buffers and fixed-shape decode steps (see the module docstring)."""

    def __init__(self, chunks, max_cache_len: int, kept: Kept | None = None, shard_over_cp: bool = True) -> None:
        shard = cp_shard() if shard_over_cp else None
        # NOTE: under CP a rank's buffers hold its share of the slots and a scratch slot, where its fixed step writes
        # the key and value of a token of another rank (the step's ops and addresses are the same every step)
        self.slots = shard.count(max_cache_len) + 1 if shard is not None else max_cache_len
        super().__init__(chunks, layer=functools.partial(_StaticLayer, self.slots),
                         layers=kept.layers if kept is not None else None, shard_over_cp=shard_over_cp)
        self.kept = kept if kept is not None else Kept(self.layers, max_cache_len, shard_over_cp)
        self.max_cache_len = self.kept.max_cache_len
        self.decode: FixedDecode | None = None
        self.fixed_steps = 0  # NOTE: decode steps run by FixedDecode (tests check where it applies)
        self.eager_refusal: str | None = None  # NOTE: why no decode step of this call runs at the fixed shape
        self.reused_kept_step = False  # NOTE: whether this call's steps ran the fixed step kept from a past call

    @classmethod
    def for_model(cls, model, max_cache_len: int, *, shard_over_cp: bool = True) -> "LoongStaticCache":
        """A cache of ``max_cache_len`` slots or more: the layers (and the fixed step, where the model's host state
        allows it) of the model's last static-cache generate where they are long enough (and sharded over CP alike),
        else new ones, kept."""
        kept = model.__dict__.get("_static_cache_kept")
        # NOTE: LoongKVCache checks the layer count
        if kept is not None and kept.max_cache_len >= max_cache_len and kept.shard_over_cp == shard_over_cp:
            for layer in kept.layers:
                layer.reset()
            return cls(model.chunks, kept.max_cache_len, kept, shard_over_cp=shard_over_cp)
        model.__dict__["_static_cache_kept"] = None  # NOTE: the old buffers and graph go before new ones are made
        cache = cls(model.chunks, max(max_cache_len, kept.max_cache_len if kept is not None else 0),
                    shard_over_cp=shard_over_cp)
        model.__dict__["_static_cache_kept"] = cache.kept
        return cache

    def fixed_step(self, model, *, input_ids: torch.Tensor, attention_mask,
                   position_ids: torch.Tensor | None = None) -> torch.Tensor | None:
        """The ``[b, 1, V]`` logits of a one-token decode step run by ``FixedDecode``, or None where it does not apply
        (the caller runs the step as with the dynamic cache)."""
        if input_ids.shape[-1] != 1 or self.filled == 0 or not fixed_step_applies(model) or self.eager_refusal:
            return None
        if self.decode is None:
            refusal = graph_refusal(model, draws_random=_draws_random(model)) if _backend_has_graphs() else None
            if refusal is not None:
                # NOTE: on a backend with device graphs a step that is not captured runs as the dynamic cache's over
                # these buffers: faster than the fixed step run eagerly (it fills and applies a mask over every slot
                # each step; workload (c)'s MoE, 8 x 512 -> 64 on an H200: 771 against 643 ms a call)
                self.eager_refusal = refusal
                logger.info("generate: the static cache's decode steps run as the dynamic cache's over its buffers, "
                            "not as a device graph: %s.", refusal)
                return None
            mrope = position_ids is not None and position_ids.dim() == 3  # NOTE: [b, 1]: learned absolute positions
            self.decode = self._kept_or_new_decode(model, batch=input_ids.shape[0], mrope=mrope)
        logits = self.decode(model, self, input_ids, attention_mask, position_ids)
        self.filled += 1
        self.fixed_steps += 1
        return logits

    def _kept_or_new_decode(self, model, *, batch: int, mrope: bool) -> "FixedDecode":
        """The kept fixed step where it was made for these buffers, this batch and the model's present host state
        (``host_state``), else a new one, kept."""
        kept = self.kept.decode
        if kept is not None and kept.batch == batch and kept.mrope == mrope \
                and kept.buffers == _buffer_addresses(self.layers) and kept.state == host_state(model):
            self.reused_kept_step = True
            return kept
        self.kept.decode = None  # NOTE: its graph's memory goes first
        self.kept.decode = FixedDecode(model, self, batch=batch, mrope=mrope)
        return self.kept.decode

    @property
    def graphed(self) -> bool:
        """Whether this cache's decode steps replay a captured device graph."""
        return self.decode is not None and self.decode.replay is not None

    @property
    def is_compileable(self) -> bool:
        # NOTE: False: transformers then passes the 2-D padding mask (not its 4-D masks) and compiles nothing
        return False


def fixed_step_applies(model) -> bool:
    """Whether a one-token step of ``model`` can run at a fixed shape (no pipeline; no soft-capped attention scores,
    which the fixed step's attention does not compute: those steps run as the dynamic cache's)."""
    return model.parallel.pipeline_parallel_size == 1 and getattr(model.bridge, "attention_softcap", None) is None


def graph_refusal(model, *, draws_random: bool) -> str | None:
    """Why the fixed step of ``model`` (``draws_random``: ``_draws_random(model)``) is not captured as a device
    graph, or None."""
    if not _backend_has_graphs():
        from loongforge_hf.xpu import get_backend

        return f"the {get_backend().name} backend has no device graphs"
    if model.parallel.expert_parallel_size > 1:
        return "expert parallelism"
    if model.parallel.tensor_parallel_size > 1:
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        backend = dist.get_backend(ps.get_tensor_model_parallel_group())
        if backend != "nccl":  # NOTE: NCCL's collectives can be captured (after a first eager call: the warm-up)
            return f"tensor-parallel collectives over {backend!r} cannot be captured"
    from loongforge_hf.kernels.moe_permute import unfixed_moe_layers

    if unfixed_moe_layers(model.chunks):
        return ("mixture-of-experts layers that dispatch tokens at data-dependent shapes or read counts on the host "
                "(a graph needs expert parallel 1 and bf16 grouped experts: moe_permute.fixed_shape_moe)")
    if getattr(model.megatron.config, "fp8", None):
        return "Transformer Engine FP8 keeps its scaling state on the host"
    if draws_random:
        return "the model is in training mode with dropout (megatron's RNG tracker switches generator states)"
    return None


def _draws_random(model) -> bool:
    """Whether a forward of ``model`` draws random numbers: a module in training mode with a dropout above zero."""
    config = model.megatron.config
    modules = [m for chunk in model.chunks for m in chunk.modules()]
    if not any(m.training for m in modules):
        return False
    return config.hidden_dropout > 0 or config.attention_dropout > 0 or any(
        isinstance(m, torch.nn.Dropout) and m.p > 0 for m in modules)


@contextlib.contextmanager
def _no_rng_fork():
    """Inside, megatron's CUDA RNG tracker forks nothing (for a model that draws no random number: a fork swaps the
    device generator's state, around every block under sequence parallelism, which a graph capture refuses)."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    tracker = get_cuda_rng_tracker()
    tracker.fork = lambda *args, **kwargs: contextlib.nullcontext()
    try:
        yield
    finally:
        del tracker.fork


def _backend_has_graphs() -> bool:
    from loongforge_hf.xpu import get_backend

    return get_backend().supports_graphs


class FixedDecode:
    """One-token decode steps over ``cache``'s buffers at a fixed shape; a CUDA graph where ``graph_refusal`` says
    none (module docstring). NOTE: it holds neither the model nor a cache (both are passed to each call): the model
    keeps it (``Kept``) and no reference cycle holds the model, a cache or the graph's memory pool."""

    def __init__(self, model, cache: LoongStaticCache, *, batch: int, mrope: bool = False) -> None:
        device = model.device
        width = model.parallel.whole_sequence_multiple  # NOTE: the token, then placeholders under SP
        self.batch, self.mrope = batch, mrope
        self.buffers = _buffer_addresses(cache.layers)  # NOTE: the cache buffers its steps (and graph) write
        self.state: tuple | None = None  # NOTE: the model's host state after the first step (host_state)
        self.ids = torch.zeros(batch, width, dtype=torch.long, device=device)
        # NOTE: the chunk's position ids: unread by a rotary text model (its rotary rows are the table's), an
        # image-text model's [3, b, w] mRoPE positions (the token's from generate; the placeholders' 0), a model with
        # learned absolute positions' [b, w] (the token's, the placeholders' after it)
        self.positions = torch.zeros(*((3,) if mrope else ()), batch, width, dtype=torch.long, device=device)
        self.position = torch.zeros(width, dtype=torch.long, device=device)  # NOTE: the placeholders' rows too
        self.steps = torch.arange(width, device=device)  # NOTE: a learned position's offsets: token, placeholders
        self.allowed = {window: torch.zeros(batch, 1, 1, cache.slots, dtype=torch.bool, device=device)
                        for window in {_window(a) for a in cache.attentions}}
        # NOTE: under CP (cache.shard): the buffer slot this rank writes the token's key and value at (its own slot
        # or the scratch one)
        self.write_at = torch.zeros(1, dtype=torch.long, device=device)
        # NOTE: each rotary embedding's output for every slot, by its own forward (the offset patch is not on here), or
        # its decode_table where each row's frequencies depend on the step (LongRoPE's); packed_seq=True: the whole
        # table on every CP rank (megatron would take this rank's CP chunks of it)
        whole = {"packed_seq": True} if model.parallel.context_parallel_size > 1 else {}
        self.tables = [rope.decode_table(cache.max_cache_len, **whole) if hasattr(rope, "decode_table")
                       else type(rope).forward(rope, cache.max_cache_len, **whole) for rope in cache.rotary_embeddings]
        self.draws_random = _draws_random(model)
        # NOTE: graph_refusal was asked by LoongStaticCache.fixed_step: on a backend with graphs a refused model
        # never gets here, so whether the backend has graphs is the answer
        self.capture = _backend_has_graphs()
        self.replay = None  # NOTE: the captured step's replay, once captured
        self.logits: torch.Tensor | None = None

    def __call__(self, model, cache: LoongStaticCache, input_ids: torch.Tensor, attention_mask,
                 position_ids: torch.Tensor | None = None) -> torch.Tensor:
        self._fill(cache, input_ids, attention_mask, position_ids)
        if self.replay is not None:
            self.replay()
            return self.logits.clone()
        logits = self._warm_up_and_capture(model, cache) if self.capture else self._run(model, cache)
        if self.state is None:  # NOTE: after the first step: what it set up lazily is in the state a reuse compares
            self.state = host_state(model)
        return logits

    def _fill(self, cache: LoongStaticCache, input_ids: torch.Tensor, attention_mask,
              position_ids: torch.Tensor | None) -> None:
        past, batch = cache.filled, self.ids.shape[0]
        if tuple(input_ids.shape) != (batch, 1):
            raise ValueError(f"static KV cache: a decode step of {list(input_ids.shape)} tokens after a prefill of "
                             f"batch {batch}; each generate call makes its steps for its own batch.")
        if past + 1 > cache.max_cache_len:
            raise ValueError(f"static KV cache: {past + 1} tokens exceed the cache's max_cache_len "
                             f"{cache.max_cache_len} (the generation's max_length - 1).")
        if attention_mask is not None:
            check_step_mask(attention_mask, batch=batch, length=past + 1)
        if self.mrope:
            if position_ids is None or tuple(position_ids.shape) != (3, batch, 1):
                raise ValueError(f"static KV cache: an image-text decode step needs [3, {batch}, 1] mRoPE "
                                 f"position_ids, got {None if position_ids is None else list(position_ids.shape)}.")
            self.positions[:, :, :1].copy_(position_ids, non_blocking=True)
        elif position_ids is not None:
            # NOTE: learned absolute positions (GPT-2's; bridges/absolute_positions.py): the token's position from
            # generate, the placeholders' after it
            self.positions.copy_(position_ids.to(self.positions.device).reshape(batch, 1) + self.steps,
                                 non_blocking=True)
        self.ids[:, :1].copy_(input_ids, non_blocking=True)
        self.position.fill_(past)
        shard = cache.shard
        local = shard.count if shard is not None else int  # NOTE: how many of the first n slots this rank holds
        if shard is not None:
            self.write_at.fill_(past // shard.size if past % shard.size == shard.rank else cache.slots - 1)
            if attention_mask is not None:
                attention_mask = attention_mask[:, shard.rank::shard.size]  # NOTE: its slots' columns
        for window, allowed in self.allowed.items():
            allowed.zero_()
            if attention_mask is None:
                allowed[..., :local(past + 1)] = True
            else:
                allowed[:, 0, 0, :local(past + 1)].copy_(attention_mask.to(allowed.device).bool(), non_blocking=True)
            if window is not None and window[0] >= 0 and past - window[0] > 0:
                allowed[..., :local(past - window[0])] = False  # NOTE: megatron's window: keys p - left .. p

    def _run(self, model, cache: LoongStaticCache) -> torch.Tensor:
        from loongforge_hf.bridges.output_layer import full_logits

        whole = whole_sequence_on_every_rank(cache.cp_holders) if model.parallel.context_parallel_size > 1 \
            else contextlib.nullcontext()
        forks = contextlib.nullcontext() if self.draws_random else _no_rng_fork()
        with _fixed_attached(self, model, cache), whole, forks:
            out = model.chunks[0](self.ids, self.positions, None)
        # NOTE: the token's logits, not SP's placeholders'
        return full_logits(out[:, :1], vocab_size=model.config.get_text_config().vocab_size)

    def _warm_up_and_capture(self, model, cache: LoongStaticCache) -> torch.Tensor:
        from loongforge_hf.xpu import get_backend

        backend = get_backend()
        # NOTE: the real step: its keys and values are in the cache after it; the capture records without running
        logits = backend.run_before_capture(lambda: self._run(model, cache))
        try:
            self.replay, self.logits = backend.capture(lambda: self._run(model, cache))
        except Exception as err:  # noqa: BLE001 - any capture failure: the steps run eagerly instead
            logger.warning("generate: the static cache's decode step could not be captured as a device graph (%s: "
                           "%s); it runs eagerly.", type(err).__name__, err)
            self.capture, self.replay, self.logits = False, None, None
        return logits


def _buffer_addresses(layers) -> tuple:
    return tuple((layer.keys.data_ptr(), layer.values.data_ptr()) if layer.is_initialized else None
                 for layer in layers)


def host_state(model) -> tuple:
    """What a captured step read on the host, which its replays never read again: per module of the model's chunks
    its class and attributes (scalars and the training flag by value; parameters, buffers and tensor attributes by
    address, shape, dtype and strides; hooks, submodules and other objects by identity), megatron's model config
    (its fields, the same way), the tensor-parallel group
    (NCCL's communicator is in the graph) and the global switches kernels read (autocast, TF32, float32 matmul
    precision, ``LOONGFORGE_*`` variables). A kept graph is replayed only where this is unchanged: in-place updates
    of the weights (an optimizer step) keep it; new weight tensors, a dtype or device move, LoRA attached, a hook
    registered, a mode switched do not."""
    from megatron.core import parallel_state as ps

    state = [torch.is_autocast_enabled(), torch.get_float32_matmul_precision(),
             torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
             id(ps.get_tensor_model_parallel_group()),
             tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("LOONGFORGE_"))),
             _attributes_key(vars(model.megatron.config))]
    for chunk in model.chunks:
        for module in chunk.modules():
            state.append((type(module), _attributes_key(vars(module))))
    return tuple(state)


_SCALARS = frozenset({type(None), bool, int, float, str, torch.dtype, torch.device})


def _attributes_key(attributes: dict, depth: int = 0) -> tuple:
    # NOTE: scalars inline (most attributes are): a function call per value made the walk of a Qwen3-0.6B-shaped
    # model (~12k attributes and dict entries) take 11-15 ms on a CPU core against 9 ms (generate walks once a call)
    scalars = _SCALARS
    return tuple((name, value if type(value) in scalars else _value_key(value, depth))
                 for name, value in attributes.items())


def _value_key(value, depth: int = 0):
    if type(value) in _SCALARS:
        return value
    if isinstance(value, torch.Tensor):
        return ("tensor", value.data_ptr(), tuple(value.shape), value.dtype, tuple(value.stride()))
    if isinstance(value, (tuple, list)) and depth < 2 and len(value) <= 64:
        return (type(value), tuple(_value_key(v, depth + 1) for v in value))
    if isinstance(value, dict) and depth < 2 and len(value) <= 64:
        return (type(value), _attributes_key(value, depth + 1) if value else ())
    return ("object", id(value))


def _window(attention) -> tuple[int, int] | None:
    window = attention.window
    return tuple(window) if window is not None else None


def _fixed_attention(module, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                     packed_seq_params=None, *, layer: _StaticLayer, allowed: torch.Tensor, decode: FixedDecode,
                     shard, reuses: bool = False):
    """``CoreAttention.forward`` in a fixed step: ``query / key / value [w, b, h, d]`` of the new token (and the
    placeholders after it under SP); the token's key and value are written at the layer's count and every query
    attends over the whole buffer under ``allowed``. Under CP (``shard``) the key and value go to this rank's slot
    for the token (``decode.write_at``: the scratch slot where the token is another rank's), the queries attend over
    this rank's share and the CP group merges the shares (``kernels.attention.sharded_attention``). ``reuses``:
    ``layer`` is another attention's, written this step already (``kv_cache.kv_sources``)."""
    from loongforge_hf.kernels.attention import attention_scores, masked_attention, sharded_attention

    if attention_bias is not None or packed_seq_params is not None:
        raise ValueError("KV cache: causal attention without attention_bias or packed sequences only.")
    q = query.permute(1, 2, 0, 3)
    # NOTE: attention sinks (gpt-oss) apply here on materialised scores; soft-capped models never get here
    # (fixed_step_applies), and the CP-sharded attention refuses a cap
    with attention_scores(softcap=module.softcap, sinks=module.sinks):
        if shard is not None:
            # NOTE: written where decode.write_at says; the layer's own count is not read again before the next
            # prefill resets it (cache.filled counts the tokens)
            layer.keys.index_copy_(2, decode.write_at, key[:1].permute(1, 2, 0, 3))
            layer.values.index_copy_(2, decode.write_at, value[:1].permute(1, 2, 0, 3))
            out = sharded_attention(q, layer.keys, layer.values, allowed=allowed, scale=module.softmax_scale,
                                    group=shard.group)
        else:
            keys, values = (layer.keys, layer.values) if reuses \
                else layer.update(key[:1].permute(1, 2, 0, 3), value[:1].permute(1, 2, 0, 3))
            out = masked_attention(q, keys, values, allowed=allowed, scale=module.softmax_scale)
    return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)


def _table_row(table, position: torch.Tensor, *args, **kwargs):
    if isinstance(table, tuple):  # NOTE: YaRN's (embedding, mscale)
        return (table[0].index_select(0, position), *table[1:])
    return table.index_select(0, position)


def _own_or_source(cache: LoongStaticCache, index: int) -> int:
    source = cache.kv_sources[index]
    return index if source is None else source


def _fixed_attached(decode: FixedDecode, model, cache: LoongStaticCache):
    """Inside, the core attentions and rotary embeddings of ``cache`` run ``decode``'s fixed step
    (``kv_cache.patched``)."""
    return patched(model.chunks, cache,
                   lambda index: functools.partial(_fixed_attention,
                                                   layer=cache.layers[_own_or_source(cache, index)],
                                                   allowed=decode.allowed[_window(cache.attentions[index])],
                                                   decode=decode, shard=cache.shard,
                                                   reuses=cache.kv_sources[index] is not None),
                   lambda index, rope: functools.partial(_table_row, decode.tables[index], decode.position))
