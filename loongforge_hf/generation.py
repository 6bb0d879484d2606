"""``generate()`` for loongforge models: transformers' own ``GenerationMixin`` driving the collective ``forward``.

Choices:
- transformers does the generating: its ``GenerationMixin`` (5.24) handles the generation config, logits processors
  and warpers, stopping criteria, greedy / sampling / beam search, ``num_return_sequences``, eos / pad handling, left
  padding (position ids from the attention mask) and ``return_dict_in_generate`` with ``scores`` / ``logits``.
  ``GenerationGlue`` only supplies what the mixin reads from a ``PreTrainedModel``.
- A KV cache (``kv_cache.py``), as transformers' models use their default ``DynamicCache``: generate makes a
  ``LoongKVCache`` per call (``use_cache=True``, the default), the prefill runs the prompt once and each later step
  runs ``forward`` on the new token only, over the cached keys and values; beam search reorders it through
  transformers' ``reorder_cache``. Each rank caches its own attention heads (TP) of the layers of its own pipeline
  stage(s) and virtual chunks. ``use_cache=False`` runs every step over the whole sequence so far instead (O(n^2) in
  the generated length). Under context parallelism the prefill is split over CP as in training and fills every CP
  rank's cache; the later cached forwards run the whole sequence on every CP rank (a one-token step cannot be split
  into 2 x CP load-balanced chunks; ``kv_cache.py``), the uncached ones are split over CP as in training.
  ``cache_implementation="static"`` makes a ``LoongStaticCache`` instead (``static_cache.py``: preallocated
  buffers, fixed-shape decode steps replayed as a device graph on GPUs, both kept by the model for the next call);
  refused with expert parallelism (``synced_gpus``).
- Refused with a ValueError before any forward, on every rank alike: a cache passed in (``cache`` /
  ``past_key_values``: generate makes its own), ``cache_implementation`` other than ``"dynamic"`` / ``"static"``,
  ``prefill_chunk_size``, assisted decoding (``assistant_model``, ``prompt_lookup_num_tokens``), the modes
  transformers moved to the hub (DoLa, contrastive, group and constrained beam search), ``custom_generate``,
  ``inputs_embeds``, ``output_attentions`` and ``output_hidden_states``; and what a model class adds
  (``generation_refusal``: image-text models, ``multimodal/generation.py``).
- Eval mode (no dropout) and no grad for the call; the caller's mode comes back after. megatron's linear layers run
  without their autograd machinery for the call (``lean_linear.lean_linears``: the same ops and collectives; a
  one-token step spent most of its host time in that machinery). NOTE: transformers' generate
  leaves the mode alone, so a transformers model in training mode with dropout in its config generates with dropout;
  here it never does (dropout would draw from the generator sampling uses, differently on each pipeline stage).
- ``forward`` is collective over one model replica: the tensor x context x pipeline parallel ranks of a data-parallel
  rank. Its ranks must call generate with the same inputs and settings: a hash of them is compared over the replica
  first, and a mismatch raises the same error on all of them (one rank stopping early would hang the others).
  Identical logits on every rank (``forward`` gathers and broadcasts them) then give identical decisions: greedy and
  beam search are deterministic; for sampling, the replica's ranks draw from a copy of its first rank's state of the
  generator ``torch.multinomial`` uses (the default generator of the inputs' device), so every rank samples what a
  one-process transformers run seeded as that first rank samples. After, ranks that started in the first rank's
  state end in its state (ranks in step stay in step); the others get their own states back.
- Data-parallel ranks are separate replicas: they may pass different prompts, lengths and settings, and each stops on
  its own. Under expert parallelism the MoE all-to-all spans data-parallel ranks, so every rank must run as many
  forwards: generate turns on transformers' ``synced_gpus`` (a finished rank keeps running forward until every rank of
  the job is done; every rank must call generate), and refuses ``synced_gpus=False``.
"""

from __future__ import annotations

import contextlib
import hashlib
from typing import Any

import torch
import torch.distributed as dist
from transformers.generation import GenerationMixin
from transformers.generation.configuration_utils import GenerationMode

from loongforge_hf.lean_linear import lean_linears

_MODES = (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE, GenerationMode.BEAM_SEARCH, GenerationMode.BEAM_SAMPLE)
_OWN_CACHE = ("generate makes its own KV cache per call (a LoongKVCache: each rank holds its own layers and heads); "
              "pass use_cache=False for none")
_REFUSED_KWARGS = {"cache": _OWN_CACHE, "past_key_values": _OWN_CACHE, "assistant_model": "no assisted decoding",
                   "custom_generate": "only transformers' own decoding loops run here",
                   "inputs_embeds": "pass input_ids",
                   "output_attentions": "attention weights are not materialised",
                   "output_hidden_states": "hidden states are not returned",
                   "cache_implementation": "loongforge's own caches are 'dynamic' (the default, kv_cache.py) and "
                                           "'static' (static_cache.py)",
                   "prefill_chunk_size": "the prompt is run in one forward"}

# NOTE: read from the generation config the call resolves (the keywords override its fields)
_CONFIG_FIELDS = ("output_attentions", "output_hidden_states", "cache_implementation", "prefill_chunk_size")


class GenerationMismatchError(ValueError):
    """The ranks of one model replica called generate with different inputs or settings."""


class GenerationGlue(GenerationMixin):
    """transformers' ``GenerationMixin`` on a loongforge model (see the module docstring)."""

    main_input_name = "input_ids"
    _supported_generation_modes = _MODES

    @classmethod
    def can_generate(cls) -> bool:
        return True

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return True  # NOTE: ours stands in for transformers' DynamicCache (_prepare_cache_for_generation)

    def _prepare_cache_for_generation(self, generation_config, model_kwargs: dict, generation_mode, batch_size: int,
                                      max_cache_length: int) -> None:
        if not generation_config.use_cache:  # NOTE: a cache passed in was refused before (_local_verdict)
            return
        sharded = self.__dict__.get("_cp_kv_cache", "sharded") == "sharded"
        if generation_config.cache_implementation == "static":
            from loongforge_hf.static_cache import LoongStaticCache

            # NOTE: transformers' max_cache_len: a floor for the buffers, so later calls up to it reuse them
            length = max(max_cache_length, generation_config.max_cache_len or 0)
            model_kwargs["cache"] = LoongStaticCache.for_model(self, max_cache_len=length, shard_over_cp=sharded)
        else:
            from loongforge_hf.kv_cache import LoongKVCache

            model_kwargs["cache"] = LoongKVCache.for_model(self, shard_over_cp=sharded)

    def free_static_cache(self) -> None:
        """Frees what the last ``generate(cache_implementation="static")`` kept for the next call: the cache's
        buffers and the fixed decode step with its device graph (``static_cache.Kept``)."""
        self.__dict__.pop("_static_cache_kept", None)

    def is_remote_code(self) -> bool:
        return False

    def _supports_logits_to_keep(self) -> bool:
        return True  # NOTE: forward takes it (**kwargs): each step gathers and sends the last position's logits only

    def _valid_auto_compile_criteria(self, model_kwargs: dict, generation_config) -> bool:
        return False  # NOTE: the forward runs megatron's collectives; it is not compiled

    @contextlib.contextmanager
    def _optimize_model_for_decode(self):
        yield  # NOTE: transformers switches its own experts kernels here; megatron's stay

    def prepare_inputs_for_generation(self, input_ids: torch.Tensor, **kwargs: Any) -> dict:
        switch = getattr(self.bridge, "longrope_switch", None)
        cache = kwargs.get("cache")
        if switch is not None and cache is not None and input_ids.shape[1] > switch \
                and 0 < cache.get_seq_length() <= switch:
            # NOTE: transformers' Phi-3 (LongRoPE): the step whose sequence first passes the switch to the long
            # factors runs the whole sequence again with them, the cached keys (short factors) dropped
            cache.restart()
            kwargs["next_sequence_length"] = None
        inputs = super().prepare_inputs_for_generation(input_ids, **kwargs)
        if inputs.get("cache") is not None:
            # NOTE: generate returns no router logits; the cached forward refuses to record them
            inputs["output_router_logits"] = False
            return inputs
        mask = inputs.get("attention_mask")
        if mask is not None and mask.shape[-1] > input_ids.shape[-1]:
            # NOTE: synced_gpus: a rank whose sequences are done keeps running forward on the same input_ids while
            # transformers keeps growing its attention mask; those outputs are dropped, the shapes must still agree
            inputs["attention_mask"] = mask[:, :input_ids.shape[-1]]
        return inputs

    def generation_refusal(self, generation_config, kwargs: dict) -> str | None:
        """Why a model class refuses this call beyond the refusals above (None: it runs), from this rank's resolved
        generation config and keyword arguments alone; a subclass adds its own (image-text models), a bridge its
        own (``bridge.generation_refusal``: Qwen3.5's, no static cache)."""
        refusal = getattr(getattr(self, "bridge", None), "generation_refusal", None)
        return refusal(generation_config) if refusal is not None else None

    def generate(self, inputs: torch.Tensor | None = None, generation_config=None, *, cp_kv_cache: str = "sharded",
                 **kwargs: Any):
        """transformers' ``GenerationMixin.generate`` (same arguments and outputs), collective over the model
        replica, with a KV cache unless ``use_cache=False``; see ``loongforge_hf.generation``. ``cp_kv_cache``
        (context parallelism only): ``"sharded"`` (each CP rank holds 1 / CP of the cache) or ``"replicated"``
        (each holds all of it; a decode step then runs as on one GPU, without the shares' merge)."""
        refusal, sampling = _local_verdict(self, generation_config, kwargs, cp_kv_cache)
        if cp_kv_cache not in ("sharded", "replicated") and refusal is None:
            refusal = f"cp_kv_cache must be 'sharded' or 'replicated', got {cp_kv_cache!r}."
        if self.parallel.expert_parallel_size > 1 and kwargs.get("synced_gpus") is None:
            kwargs["synced_gpus"] = True
        _check_same_on_replica(self, _signature(self, inputs, generation_config,
                                                {**kwargs, "cp_kv_cache": cp_kv_cache}))
        if refusal:
            raise ValueError(f"generate: {refusal}")
        was_training = self.training
        self.eval()
        self.__dict__["_cp_kv_cache"] = cp_kv_cache  # NOTE: read by _prepare_cache_for_generation, this call only
        try:
            with torch.no_grad(), _replica_rng(self, _sampling_device(self, inputs, kwargs), sampling), \
                    lean_linears(self):
                return super().generate(inputs, generation_config, **kwargs)
        finally:
            self.__dict__.pop("_cp_kv_cache", None)
            self.train(was_training)


def _local_verdict(model, generation_config, kwargs: dict, cp_kv_cache: str = "sharded") -> tuple[str | None, bool]:
    """(why this call is refused or None, whether it samples), from this rank's arguments alone."""
    # NOTE: `is` tests: a tensor (inputs_embeds) has no truth value to compare with
    bad = sorted(k for k in _REFUSED_KWARGS if k not in _CONFIG_FIELDS and kwargs.get(k) is not None
                 and kwargs.get(k) is not False)
    if bad:
        return "; ".join(f"{k} is not supported: {_REFUSED_KWARGS[k]}" for k in bad) + ".", False
    if model.parallel.expert_parallel_size > 1 and kwargs.get("synced_gpus") is False:
        return ("synced_gpus=False is not supported with expert_parallel_size > 1: the experts' all-to-all spans "
                "data-parallel ranks, which must all run the same number of forwards."), False
    try:
        config, _ = model._prepare_generation_config(generation_config, **kwargs)
        mode = config.get_generation_mode(kwargs.get("assistant_model"))
    except Exception as err:  # NOTE: transformers' own verdict, raised on every rank after the replica agrees
        return f"{type(err).__name__}: {err}", False
    if mode not in _MODES:
        return (f"generation mode {mode.value!r} is not supported; loongforge_hf models run "
                f"{[m.value for m in _MODES]}."), False
    for field in _CONFIG_FIELDS:
        value = getattr(config, field, None)
        if value not in (None, False) and not (field == "cache_implementation" and value in ("dynamic", "static")):
            return f"{field}={value!r} is not supported: {_REFUSED_KWARGS[field]}.", False
    if config.cache_implementation == "static" and config.use_cache and (
            model.parallel.expert_parallel_size > 1 or kwargs.get("synced_gpus")):
        return ("cache_implementation='static' is not supported with expert parallelism or synced_gpus: a rank "
                "whose sequences are done keeps running forward steps, past the static cache's length; use the "
                "default dynamic cache."), False
    refusal = model.generation_refusal(config, kwargs)
    if refusal:
        return refusal, False
    bridge = getattr(model, "bridge", None)
    if config.use_cache and cp_kv_cache == "sharded" and model.parallel.context_parallel_size > 1 and \
            not getattr(bridge, "kv_cache_shards_over_cp", True):
        return (f"cp_kv_cache='sharded' is not supported for {bridge.architectures[0]} (its attention keeps its own "
                "cache layer, whole on each CP rank); pass cp_kv_cache='replicated' or "
                "use_cache=False."), False
    return None, bool(config.do_sample)


def _signature(model, inputs, generation_config, kwargs: dict) -> int:
    """A 63-bit hash of this rank's generate arguments (tensors by value) and the model's generation config."""
    digest = hashlib.sha256()

    def add(name: str, value) -> None:
        digest.update(name.encode())
        if torch.is_tensor(value):
            value = value.detach().cpu().contiguous()
            digest.update(f"{tuple(value.shape)}{value.dtype}".encode())
            digest.update(value.view(torch.uint8).numpy().tobytes() if value.numel() else b"")
        elif isinstance(value, (str, int, float, bool, type(None))) or (
                isinstance(value, (list, tuple)) and all(isinstance(v, (str, int, float, bool)) for v in value)):
            digest.update(repr(value).encode())
        elif hasattr(value, "to_json_string"):  # a GenerationConfig
            digest.update(value.to_json_string(use_diff=False).encode())
        else:  # NOTE: callables and processors: their kind only
            digest.update(type(value).__qualname__.encode())

    add("inputs", inputs)
    add("generation_config", generation_config)
    add("model.generation_config", model.generation_config)
    for key in sorted(kwargs):
        add(key, kwargs[key])
    return int.from_bytes(digest.digest()[:8], "little") >> 1


def replica_groups() -> list:
    """Process groups whose ranks, taken together, span one model replica (TP x CP, then PP): a reduction over each
    in turn reaches every rank of the replica."""
    from megatron.core import parallel_state as ps

    return [ps.get_tensor_and_context_parallel_group(), ps.get_pipeline_model_parallel_group()]


def _check_same_on_replica(model, signature: int) -> None:
    """Raise ``GenerationMismatchError`` on every rank of the replica when their signatures differ."""
    if not dist.is_initialized():
        return
    groups = [g for g in replica_groups() if dist.get_world_size(g) > 1]
    if not groups:
        return
    both = torch.tensor([signature, -signature], dtype=torch.int64, device=model.device)
    for group in groups:
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    high, low = both[0].item(), -both[1].item()
    if high != low:
        raise GenerationMismatchError(
            "generate: the ranks of one model replica (its tensor, context and pipeline parallel ranks) passed "
            "different inputs or generation settings (prompts, attention mask, max_new_tokens, generation config, "
            "...); forward is collective over them, so they must call generate with the same arguments. Data-"
            "parallel ranks may differ.")


def _sampling_device(model, inputs, kwargs: dict) -> torch.device:
    """The device whose generator ``torch.multinomial`` draws from: that of the prompt (transformers samples
    there), else the model's."""
    prompt = inputs if inputs is not None else kwargs.get("input_ids")
    return prompt.device if torch.is_tensor(prompt) else model.device


def _get_rng(device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return torch.get_rng_state()
    return torch.get_device_module(device.type).get_rng_state(device)


def _set_rng(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cpu":
        torch.set_rng_state(state)
    else:
        torch.get_device_module(device.type).set_rng_state(state, device)


@contextlib.contextmanager
def _replica_rng(model, device: torch.device, sampling: bool):
    """Inside, every rank of the replica holds its first rank's generator state for ``device`` (only when
    ``sampling``). At the end a rank that started with that state keeps where the draws left it (as the first rank
    does: ranks in step stay in step, e.g. a trainer's shuffle after a sampling generate); one that started
    elsewhere gets its own state back."""
    groups = [g for g in replica_groups() if dist.get_world_size(g) > 1] \
        if sampling and dist.is_initialized() else []
    if not groups:
        yield
        return
    own = _get_rng(device)
    state = own.to(model.device, copy=True)  # NOTE: own is kept; broadcast writes into state
    for group in reversed(groups):  # NOTE: PP first (from stage 0), then TP x CP: all get the replica's first rank's
        dist.broadcast(state, src=dist.get_process_group_ranks(group)[0], group=group)
    kept = all(dist.get_rank(g) == 0 for g in groups) or torch.equal(own, state.cpu())
    _set_rng(device, state.cpu())
    try:
        yield
    finally:
        if not kept:
            _set_rng(device, own)
