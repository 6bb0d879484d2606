"""The HF face of a megatron-core model: ``AutoModelForCausalLM.from_pretrained`` -> ``LoongModelForCausalLM``.

Choices:
- Everything that can be checked locally (architecture, config values, layout vs. model sizes, checkpoint files and
  shapes) is checked before the process group starts, identically on every rank: bad input never hangs a job.
- ``forward`` returns a transformers ``CausalLMOutputWithPast`` on every rank: loss like transformers (labels shifted
  inside, ignore -100, mean over label tokens) and full-vocabulary logits gathered over TP (``return_logits=False``
  skips the gather). Under pipeline parallelism it runs megatron's forward-only schedule and broadcasts the last
  stage's outputs; gradients flow through ``forward`` when pipeline_parallel_size == 1.
- An MoE model (Qwen3-MoE, Mixtral, DeepSeek-V2/V3) returns transformers' ``MoeCausalLMOutputWithPast``. With
  ``output_router_logits`` on (the forward keyword overrides the config's, as in transformers) it holds
  ``router_logits`` (per MoE layer, the router's logits ``[batch * seq, experts]`` of the caller's tokens, on every
  rank: ``bridges/router_logits.py``) and, for Qwen3-MoE and Mixtral (DeepSeek's transformers model computes none),
  ``aux_loss`` (transformers' router load-balancing loss over all MoE layers, in eval mode and without grad too) with
  ``loss = lm loss + coef * aux_loss`` (``router_aux_loss_coef``, 0 included, as transformers). Both are in the
  graph as transformers' are where the forward builds one (``bridges/router_balance.py``); the router logits are
  detached under pipeline parallelism and activation recompute.
- ``save_pretrained`` is collective (every rank calls it); rank 0 writes.
- ``generate`` is transformers' ``GenerationMixin.generate`` with a KV cache of our own (``kv_cache.py``; none under
  context parallelism), collective over the model replica (``generation.py``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from loongforge_hf.generation import GenerationGlue
from loongforge_hf.parallel import ParallelConfig, ParallelLayoutError, accelerate_megatron_layout, read_launch_env
from loongforge_hf.parallel.config import PARALLEL_KWARGS

IGNORE_INDEX = -100

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def _resolve_dtype(dtype: Any, hf_config, reader=None) -> torch.dtype:
    """The parameters' dtype. ``None`` means ``"auto"``, as in transformers 5: the config's dtype, else the dtype of
    the checkpoint's first floating tensor (``reader``: its ``CheckpointReader``), else float32."""
    if dtype is None or dtype == "auto":
        dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
        if dtype is None and reader is not None:
            floats = (torch.bfloat16, torch.float16, torch.float32)
            dtype = next((d for d in map(reader.dtype, reader.keys()) if d in floats), None)
        dtype = dtype or torch.float32
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype={dtype!r} is not supported; use one of {sorted(_DTYPES)} or a torch.dtype.")
        return _DTYPES[dtype]
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype={dtype} is not supported; use torch.float32, torch.bfloat16 or torch.float16.")
    return dtype


# transformers forward keywords this model cannot honour: refused, as they would change what the caller gets
_REFUSED_FORWARD = {"inputs_embeds": "pass input_ids",
                    "output_attentions": "attention weights are not materialised",
                    "output_hidden_states": "hidden states are not returned"}


def _is_loong_cache(cache) -> bool:
    from loongforge_hf.kv_cache import LoongKVCache

    return isinstance(cache, LoongKVCache)


def hf_forward_options(unused: dict, labels) -> dict:
    """transformers' forward keywords beyond the inputs: ``num_items_in_batch`` (the loss is summed over the label
    tokens and divided by it), ``logits_to_keep`` and ``return_dict`` are honoured; ``cache`` (or its older name
    ``past_key_values``) takes the ``LoongKVCache`` that ``generate`` makes (``kv_cache.py``: the given tokens follow
    the cached ones) and is returned in the output; ``use_cache`` has no effect (a cache is never made here); those
    of ``_REFUSED_FORWARD`` with a value that would matter are refused; other keywords are ignored, as transformers'
    models pass unknown ones on to attention kernels that ignore them."""
    bad = sorted(k for k in _REFUSED_FORWARD if unused.get(k) not in (None, False))
    if bad:
        raise TypeError(f"forward: {bad} not supported by loongforge_hf models: "
                        + "; ".join(f"{k}: {_REFUSED_FORWARD[k]}" for k in bad) + ".")
    name = "cache" if unused.get("cache") is not None else "past_key_values"
    cache = unused.get(name)
    if cache is not None and not _is_loong_cache(cache):
        raise TypeError(f"forward: {name}= of type {type(cache).__name__} is not supported: loongforge_hf models take "
                        "only the LoongKVCache their generate() makes (each rank caches its own layers and heads).")
    if cache is not None and labels is not None:
        raise ValueError("forward: labels with a KV cache are not supported; pass one of them.")
    keep = unused.get("logits_to_keep") or 0
    if labels is not None and not (isinstance(keep, int) and keep == 0):
        raise ValueError("forward: logits_to_keep with labels is not supported (the loss needs every position's "
                         "logits); pass one of them.")
    return {"num_items_in_batch": unused.get("num_items_in_batch"), "logits_to_keep": keep,
            "return_dict": unused.get("return_dict", True) is not False, "cache": cache}


def longrope_modules(model) -> list:
    """The LongRoPE rotary embeddings of ``model``'s chunks (Phi-3 with LongRoPE; found once), or []."""
    if getattr(model.bridge, "longrope_switch", None) is None:
        return []
    if "_longrope_modules" not in vars(model):
        model._longrope_modules = [m for c in model.chunks for m in c.modules() if hasattr(m, "long_inv_freq")]
    return model._longrope_modules


def rope_length(input_ids: torch.Tensor, position_ids: torch.Tensor | None, past: int = 0) -> int:
    """The length transformers' LongRoPE picks its frequencies by: the largest position id + 1, else the cached tokens
    plus the given ones."""
    if position_ids is not None and position_ids.numel():
        return int(position_ids.max()) + 1
    return past + input_ids.shape[-1]


def select_longrope_for(model, input_ids: torch.Tensor, position_ids: torch.Tensor | None, past: int = 0) -> None:
    """LongRoPE's short or long frequencies for this forward, as transformers picks them (``rope_length``,
    ``kernels.rope.select_longrope``). Nothing for other models."""
    modules = longrope_modules(model)
    if modules:
        from loongforge_hf.kernels.rope import select_longrope

        select_longrope(modules, rope_length(input_ids, position_ids, past))


def router_outputs(model, routed, run, *, attention_mask, shape: tuple, length: int) -> tuple:
    """``run()`` (a forward: (loss, logits)) with the routers' logits recorded and, where ``routed``
    (``router_balance.forward_outputs``' answer) says so, transformers' balancing loss tallied over ``shape``'s
    tokens (``length``: with the layout's padding): (its result, ``hf_forward_output``'s router keywords)."""
    from loongforge_hf.bridges.router_logits import RouterLogits, recording

    balance, coef = routed if routed is not None else (None, 0.0)  # NOTE: None: no aux loss (DeepSeek)
    tally = None
    if balance is not None:
        # NOTE: the pipelined forward runs without grad (runtime._forward_pipelined): so does the term
        tally = balance.begin(attention_mask, shape, device=model.device, length=length,
                              graph=torch.is_grad_enabled() and model.parallel.pipeline_parallel_size == 1)
    bridge = getattr(model.bridge, "text", model.bridge)  # NOTE: an image-text model's language bridge
    recorder = RouterLogits(model.megatron.config, batch=shape[0], seq=length, given=shape[-1],
                            per_layer=getattr(bridge, "routers_per_layer", 1))
    with recording(model.routers, recorder):
        result = run()
    # NOTE: in the graph: the routers' gradient follows its use
    aux = balance.finish_everywhere(tally) if balance is not None else None
    return result, {"aux_loss": aux, "aux_coef": coef, "router_logits": recorder.collect(model.device)}


def hf_forward_output(loss, logits, labels, options: dict, *, aux_loss=None, aux_coef: float = 0.0,
                      router_logits: tuple | None = None, moe: bool = False):
    """``CausalLMOutputWithPast`` (or its tuple) with ``hf_forward_options``' keywords applied; for a model whose
    transformers class returns ``MoeCausalLMOutputWithPast`` (``moe``) that, with ``aux_loss`` (the router
    load-balancing loss, or None) and a loss that adds ``aux_coef * aux_loss``, as transformers adds it after the
    language-model loss's ``num_items_in_batch`` division, and ``router_logits`` (per MoE layer, or None)."""
    from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast

    num_items = options["num_items_in_batch"]
    if loss is not None and num_items is not None:
        from loongforge_hf.bridges.runtime import shift_labels

        # NOTE: the loss is the mean over this batch's label tokens; transformers divides their sum by num_items
        count = (shift_labels(labels.to(loss.device)) != IGNORE_INDEX).sum()
        loss = loss * count / (num_items.to(loss.device) if torch.is_tensor(num_items) else num_items)
    keep = options["logits_to_keep"]
    if logits is not None and not (isinstance(keep, int) and keep == 0):
        logits = logits[:, -keep:] if isinstance(keep, int) else logits[:, keep.to(logits.device)]
    cache = options.get("cache")
    if aux_loss is None and not moe:
        out = with_cache(CausalLMOutputWithPast, cache, loss=loss, logits=logits)
    else:
        if loss is not None and aux_loss is not None:
            loss = loss + aux_coef * aux_loss.to(loss)
        out = with_cache(MoeCausalLMOutputWithPast, cache, loss=loss, aux_loss=aux_loss, logits=logits,
                         router_logits=router_logits)
    return out if options["return_dict"] else out.to_tuple()


def with_cache(output_class: type, cache, **fields):
    """``output_class(**fields)`` with ``cache`` in the class's cache field: ``cache`` in recent transformers,
    ``past_key_values`` in 5.17 (the oldest we support), whichever it has."""
    import dataclasses

    names = {f.name for f in dataclasses.fields(output_class)}
    return output_class(**fields, **{"cache" if "cache" in names else "past_key_values": cache})


# transformers save_pretrained keywords and the values that change nothing here; others are refused
_SAVE_DEFAULTS = {"safe_serialization": True, "is_main_process": True, "push_to_hub": False, "state_dict": None,
                  "variant": None, "save_function": None, "token": None, "save_peft_format": True}


def refuse_save_options(unused: dict) -> None:
    """``save_pretrained`` keywords of transformers that would change what is written are refused, not ignored."""
    bad = sorted(k for k, v in unused.items() if k not in _SAVE_DEFAULTS or v != _SAVE_DEFAULTS[k])
    if bad:
        raise TypeError(f"save_pretrained: {bad} not supported: the weights come from the megatron model, written as "
                        "safetensors with transformers' file names, on every rank's call (rank 0 writes); use "
                        "push_to_hub() to upload.")


def resolve_parallel(parallel: ParallelConfig | None, sizes: dict) -> ParallelConfig:
    """The layout from ``parallel=`` or the size keywords, over accelerate's megatron_lm defaults."""
    given = {k: v for k, v in sizes.items() if v is not None}
    if parallel is not None:
        if isinstance(parallel, str):
            raise ParallelLayoutError(f"parallel={parallel!r} is not supported; pass 'auto', a ParallelConfig or "
                                      "size keywords.")
        if not isinstance(parallel, ParallelConfig):
            raise TypeError(f"parallel must be a ParallelConfig, got {type(parallel).__name__}.")
        clash = {k: v for k, v in given.items() if getattr(parallel, k) != v}
        if clash:
            raise ParallelLayoutError(f"parallel= and size keywords disagree: {clash} vs {parallel}.")
        return parallel
    return ParallelConfig.from_kwargs({**accelerate_megatron_layout(), **given})


def _auto_layout(hf_config, param_dtype: torch.dtype, bridge) -> ParallelConfig:
    from loongforge_hf.parallel.kv_replicas import check_kv_replication
    from loongforge_hf.parallel.auto import bridge_accepts, choose_layout, model_size_of
    from loongforge_hf.xpu import get_backend

    # NOTE: the bridge's config: attention-free stacks (Mamba2) give it stand-in attention sizes (mamba2_lm.py)
    env, size = read_launch_env(), model_size_of(bridge.hf_config)
    try:  # NOTE: whether the bridge can replicate KV heads (a TP of twice the KV heads stands for any multiple)
        check_kv_replication(bridge, ParallelConfig(tensor_parallel_size=2 * size.num_key_value_heads))
        kv_replication = True
    except ParallelLayoutError:
        kv_replication = False
    layout, reason = choose_layout(size, world_size=env.world_size, local_world_size=env.local_world_size,
                                   device_memory=get_backend().memory_per_device(),
                                   dtype_bytes=torch.finfo(param_dtype).bits // 8, kv_replication=kv_replication,
                                   accepts=bridge_accepts(bridge))
    if env.rank == 0:
        print(reason, flush=True)
    return layout


def _output_requires_grad(module, args, output):
    if torch.is_grad_enabled() and not output.requires_grad:
        output.requires_grad_(True)


class LoongModelForCausalLM(GenerationGlue, nn.Module):
    """A causal LM whose layers are megatron-core modules, laid out by a ``ParallelConfig``; ``generate()`` is
    transformers' (``loongforge_hf/generation.py``)."""

    def __init__(self, *, hf_config, bridge, megatron_model, parallel: ParallelConfig, source: Path | None,
                 config_at_load: dict | None = None, source_variant: str | None = None) -> None:
        """``config_at_load``: the source's config (``to_dict()``) where ``hf_config`` differs from it
        (from_pretrained's config overrides): save_pretrained writes the differences. ``source_variant``: the
        variant of the source's weight files."""
        super().__init__()
        self.config = hf_config
        self.bridge = bridge
        self.megatron = megatron_model
        self.chunks = nn.ModuleList(megatron_model.chunks)
        self.parallel = parallel
        self.source = source
        self.source_variant = source_variant
        from transformers import GenerationConfig

        from loongforge_hf.bridges import router_balance
        from loongforge_hf.bridges.router_logits import recording_routers

        text = getattr(bridge, "text", bridge)  # NOTE: an image-text model's language bridge
        self.routers = recording_routers(self.chunks, text)  # those that record router_logits
        # None: no router tallies the balancing loss
        self.router_balance = router_balance.attach(self.routers, self.chunks, text)

        self._generation_at_load = None  # the source file's, as a diff dict: copied while the config equals it
        if source is not None and (source / "generation_config.json").is_file():
            self.generation_config = GenerationConfig.from_pretrained(source)
            self._generation_at_load = self.generation_config.to_diff_dict()
        else:  # NOTE: as transformers derives one (bos / eos / pad ids) and saves it
            self.generation_config = GenerationConfig.from_model_config(hf_config)
        # save_pretrained writes the fields changed since
        self._config_at_load = config_at_load if config_at_load is not None else hf_config.to_dict()

    def __deepcopy__(self, memo: dict) -> "LoongModelForCausalLM":
        """``copy.deepcopy(model)`` (a reference model, an EMA copy), as for a transformers model: its own
        parameters, buffers and config; the same process groups, which megatron's modules hold and which cannot be
        copied (a communicator; copying one raised ``cannot pickle ... ProcessGroup``)."""
        import copy

        if self._held_by_engine():
            raise TypeError("copy.deepcopy: this model is held by a training engine (megatron's DDP gradient buffers "
                            "and hooks are attached to its parameters); copy it before training starts (as TRL builds "
                            "its reference model), or release the engine first (trainer.engine.release()).")
        if dist.is_available() and dist.is_initialized():
            for group in list(dist.distributed_c10d._world.pg_map):
                memo.setdefault(id(group), group)
        clone = type(self).__new__(type(self))
        memo[id(self)] = clone
        for key, value in self.__dict__.items():
            clone.__dict__[key] = copy.deepcopy(value, memo)
        return clone

    def config_changes(self) -> dict:
        """The fields of ``self.config`` changed since load (``save_pretrained`` writes them into config.json)."""
        from loongforge_hf.bridges.export_files import changed_config_fields

        return changed_config_fields(self.config, self._config_at_load)

    def generation_config_to_write(self):
        """The generation config ``save_pretrained`` writes: None (the source's file is copied) while it equals the
        source's."""
        unchanged = self.generation_config is None or self.generation_config.to_diff_dict() == self._generation_at_load
        return None if unchanged else self.generation_config

    # ---- properties users expect ---------------------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        return self.megatron.config.params_dtype

    def _apply(self, fn, recurse: bool = True):
        """``model.to(dtype)`` / ``.bfloat16()`` / ``.float()`` as in transformers, and megatron's configs kept in
        step: ``params_dtype`` (``model.dtype``, the dtype ``save_pretrained`` writes), ``pipeline_dtype`` (pipeline
        receive buffers) and the bf16 / fp16 flags follow the parameters' new dtype. Refused while a training engine
        holds the model (its gradient buffers and optimizer state keep the old dtype)."""
        before = self.megatron.config.params_dtype
        if fn(torch.empty(0, dtype=before)).dtype == before:  # NOTE: a move to another device, dtype kept
            return super()._apply(fn, recurse)
        if self._held_by_engine():
            raise TypeError("Changing the dtype of a model held by a training engine is not supported (its gradient "
                            "buffers and optimizer state keep the old dtype); load it with from_pretrained(dtype=...).")
        out = super()._apply(fn, recurse)
        dtypes = {p.dtype for p in self.parameters() if p.is_floating_point()}
        if len(dtypes) == 1:
            (dtype,) = dtypes
            for config in self._megatron_configs():
                config.params_dtype = config.pipeline_dtype = dtype
                config.bf16, config.fp16 = dtype == torch.bfloat16, dtype == torch.float16
        return out

    def _held_by_engine(self) -> bool:
        """Whether a training engine (``trainer.engine.MegatronEngine``, not released) wraps this model's chunks."""
        from loongforge_hf.trainer.engine import wrapping_engines

        return any(not e.released for e in wrapping_engines(self.megatron.chunks))

    def _megatron_configs(self) -> list:
        """megatron's config objects of this model (the model's and each chunk's, each once)."""
        configs = {id(c.config): c.config for c in self.chunks} | {id(self.megatron.config): self.megatron.config}
        return list(configs.values())

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def name_or_path(self) -> str:
        return getattr(self.config, "_name_or_path", "") or (str(self.source) if self.source else "")

    # ---- forward -------------------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None, *,
                return_logits: bool = True, **unused: Any):
        from loongforge_hf.bridges import router_balance
        from loongforge_hf.bridges.absolute_positions import check_positions, learned_positions, mask_positions
        from loongforge_hf.bridges.router_logits import asked
        from loongforge_hf.bridges.runtime import forward_causal_lm

        options = hf_forward_options(unused, labels)
        if unused.get("token_type_ids") is not None and getattr(self.bridge, "token_type_embeddings", False):
            raise TypeError(f"forward: token_type_ids are not supported for {self.bridge.architectures[0]} "
                            "(transformers adds their embeddings to the tokens'); pass input_ids alone.")
        past = options["cache"].get_seq_length() if options["cache"] is not None else 0
        select_longrope_for(self, input_ids, position_ids, past)
        if hasattr(self.bridge, "check_sequence_length"):  # NOTE: positions it is not exact from (Mistral 4)
            self.bridge.check_sequence_length(rope_length(input_ids, position_ids, past))
        if hasattr(self.bridge, "check_position_ids"):  # NOTE: the whole batch, before padding or a CP split
            self.bridge.check_position_ids(position_ids)
        if learned_positions(self.bridge):
            check_positions(self.config.max_position_embeddings, length=input_ids.shape[-1], past=past,
                            position_ids=position_ids, arch=self.bridge.architectures[0])
            # NOTE: OPT's default positions, from the mask (checked above as the slots': none past them)
            position_ids = mask_positions(self.bridge, attention_mask, position_ids, past=past,
                                          length=input_ids.shape[-1])
        routed = router_balance.forward_outputs(self, unused.get("output_router_logits"))
        moe = getattr(self.bridge, "hf_router_logits", False)  # NOTE: transformers' MoE output type
        keep = options["logits_to_keep"]  # NOTE: an int: the rows cut before the logits cross ranks (runtime.py)
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
                  "labels": labels, "return_logits": return_logits, "keep": keep if isinstance(keep, int) else 0}
        if options["cache"] is not None:
            from loongforge_hf.kv_cache import forward_with_cache

            if moe and asked(self.config, unused.get("output_router_logits")):
                raise ValueError("forward: output_router_logits with a KV cache is not supported.")
            logits = forward_with_cache(self, options["cache"], input_ids=input_ids, attention_mask=attention_mask,
                                        keep=inputs["keep"], position_ids=position_ids)
            return hf_forward_output(None, logits, labels, options, moe=moe)
        if not (moe and asked(self.config, unused.get("output_router_logits"))):
            return hf_forward_output(*forward_causal_lm(self, **inputs), labels, options, moe=moe)
        multiple = self.parallel.sequence_multiple
        length = -(-input_ids.shape[-1] // multiple) * multiple  # NOTE: as forward_causal_lm pads for the layout
        (loss, logits), router = router_outputs(self, routed, lambda: forward_causal_lm(self, **inputs),
                                                attention_mask=attention_mask, shape=tuple(input_ids.shape),
                                                length=length)
        return hf_forward_output(loss, logits, labels, options, moe=moe, **router)

    # ---- activation checkpointing (what transformers.Trainer calls for `activation_checkpointing=True`) ---------
    supports_gradient_checkpointing = True

    def activation_checkpointing_enable(self, activation_checkpointing_kwargs: dict | None = None, *,
                                        every_n_layers: int = 1, offload: bool = False) -> None:
        """Recompute every decoder layer in the backward with megatron-core's full recompute (granularity "full",
        method "uniform", one layer per checkpoint: only each layer's input is kept).

        ``every_n_layers`` other than 1 and ``offload`` have no exact megatron-core equivalent without Transformer
        Engine and are refused; of the kwargs meant for ``torch.utils.checkpoint`` only ``use_reentrant`` is accepted
        (megatron's recompute is a reentrant autograd function either way; the gradients are the same)."""
        kwargs = dict(activation_checkpointing_kwargs or {})
        kwargs.pop("use_reentrant", None)
        if kwargs:
            raise ValueError(f"activation checkpointing: unsupported checkpoint kwargs {sorted(kwargs)} (megatron-core "
                             "recomputes whole layers; only use_reentrant is accepted).")
        if every_n_layers != 1:
            raise ValueError(f"activation checkpointing: every_n_layers={every_n_layers} is not supported; loongforge "
                             "recomputes every decoder layer (every_n_layers=1).")
        if offload:
            raise ValueError("activation checkpointing: offload=True needs Transformer Engine's CPU offloading, which "
                             "this build does not use.")
        self._set_recompute(True)

    def activation_checkpointing_disable(self) -> None:
        self._set_recompute(False)

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None, **kwargs: Any) -> None:
        """transformers' older name (transformers < 5.20 calls this one)."""
        self.activation_checkpointing_enable(gradient_checkpointing_kwargs, **kwargs)

    def gradient_checkpointing_disable(self) -> None:
        self._set_recompute(False)

    @property
    def is_gradient_checkpointing(self) -> bool:
        return self.megatron.config.recompute_granularity == "full"

    def _set_recompute(self, on: bool) -> None:
        refusal = getattr(self.bridge, "recompute_refusal", None) if on else None
        reason = refusal(self.parallel.pipeline_parallel_size) if refusal is not None else None
        if reason:  # NOTE: a bridge whose layers read state a recompute in the backward would find changed
            raise ValueError(f"activation checkpointing: {reason}")
        for config in self._megatron_configs():
            config.recompute_granularity = "full" if on else None
            config.recompute_method = "uniform" if on else None
            config.recompute_num_layers = 1 if on else None
        # NOTE: megatron's recompute is reentrant: a checkpointed layer gets gradients only if its input requires
        # grad, which a frozen embedding (LoRA, freezing) does not give.
        self.embedding_output_requires_grad("recompute", on)

    def resize_token_embeddings(self, new_num_tokens: int | None = None, pad_to_multiple_of: int | None = None,
                                mean_resizing: bool = True):
        """transformers' ``resize_token_embeddings`` (TRL's ``clone_chat_template`` and users adding tokens call it):
        the embedding and an untied LM head get ``new_num_tokens`` rows (rounded up to ``pad_to_multiple_of``), the
        first ones kept, added ones drawn as transformers draws them (``bridges/vocab_resize.py``);
        ``config.vocab_size`` follows. Collective: every rank calls it. Returns the first pipeline stage's embedding
        module (None on other stages)."""
        from loongforge_hf.bridges.vocab_resize import language_chunks, resize_vocabulary, resized_vocab_size

        text = self.config.get_text_config()
        size = resized_vocab_size(text.vocab_size, new_num_tokens, pad_to_multiple_of)
        if size != text.vocab_size:
            if getattr(self.bridge, "lm_head_bias", False):
                raise NotImplementedError(f"resize_token_embeddings is not supported for {self.bridge.architectures[0]}"
                                          ": its LM head has a bias, whose added rows transformers draws in its own "
                                          "way (not reproduced here).")
            if self._held_by_engine():
                raise TypeError("resize_token_embeddings: this model is held by a training engine (its gradient "
                                "buffers and optimizer state are sized for the current vocabulary); resize before "
                                "creating the trainer, or release the engine first (trainer.engine.release()).")
            resize_vocabulary(self, size, mean_resizing=mean_resizing)
        return next((c.embedding for c in language_chunks(self) if getattr(c, "pre_process", False)), None)

    @property
    def vocab_size(self) -> int:
        """The vocabulary size (``config.vocab_size``; transformers' models and TRL read ``model.vocab_size``)."""
        return self.config.get_text_config().vocab_size

    def enable_input_require_grads(self) -> None:
        """transformers' API (PEFT and custom loops call it with frozen embeddings and checkpointing): the
        embeddings' output requires grad in training."""
        self.embedding_output_requires_grad("user", True)

    def disable_input_require_grads(self) -> None:
        """Undo ``enable_input_require_grads`` (what recompute or CUDA graphs ask for stays)."""
        self.embedding_output_requires_grad("user", False)

    def embedding_output_requires_grad(self, reason: str, on: bool) -> None:
        """Make each chunk's embedding output require grad in training while any ``reason`` asks for it (as
        transformers' ``enable_input_require_grads``): megatron's reentrant recompute (``"recompute"``) and the
        capture warm-up of its CUDA graphs (``"cuda_graphs"``, under LoRA) need the first layer's input to require
        grad, which a frozen embedding does not give. One hook per chunk, removed when no reason is left."""
        for chunk in self.chunks:
            embedding = getattr(chunk, "embedding", None)
            if embedding is None:
                continue
            reasons = chunk.__dict__.setdefault("_loong_input_grad_reasons", set())
            (reasons.add if on else reasons.discard)(reason)
            handle = getattr(chunk, "_loong_input_grad_hook", None)
            if reasons and handle is None:
                chunk._loong_input_grad_hook = embedding.register_forward_hook(_output_requires_grad)
            elif not reasons and handle is not None:
                handle.remove()
                chunk._loong_input_grad_hook = None

    # ---- export --------------------------------------------------------------------------------------------
    def save_pretrained(self, save_directory: str | os.PathLike, *, max_shard_size: int | str = "5GB",
                        dtype: torch.dtype | None = None, side_files_dir: str | os.PathLike | None = None,
                        **unused: Any) -> None:
        """Write a plain HF checkpoint (collective: every rank calls it; rank 0 writes, atomically).
        ``side_files_dir``: a folder (read on rank 0) whose files go into the checkpoint too, in the same atomic swap,
        instead of the source's of those names (LoongTrainer.save_model's tokenizer)."""
        from loongforge_hf.bridges.exporter import export_hf

        refuse_save_options(unused)
        export_hf(self.megatron, self.bridge, self.parallel, Path(save_directory), source=self.source,
                  max_shard_size=max_shard_size, dtype=dtype, config_changes=self.config_changes(),
                  generation_config=self.generation_config_to_write(),
                  side_files_dir=side_files_dir, source_variant=self.source_variant)

    def push_to_hub(self, repo_id: str, *, token: str | None = None, private: bool | None = None,
                    commit_message: str = "Upload model with loongforge-hf", revision: str | None = None,
                    max_shard_size: int | str = "5GB", endpoint: str | None = None) -> str:
        """Export to a temporary folder and upload it with huggingface_hub (collective)."""
        import tempfile

        from loongforge_hf.integrations.hub import push_to_hub_on_rank0

        base = tempfile.mkdtemp(prefix="loongforge-push-") if not dist.is_initialized() or dist.get_rank() == 0 \
            else None
        if dist.is_initialized() and dist.get_world_size() > 1:
            box = [base]
            dist.broadcast_object_list(box, src=0)
            base = box[0]
        folder = Path(base) / "model"
        self.save_pretrained(folder, max_shard_size=max_shard_size)
        try:
            return push_to_hub_on_rank0(folder, repo_id, token=token, private=private, revision=revision,
                                        commit_message=commit_message, endpoint=endpoint)
        finally:
            if not dist.is_initialized() or dist.get_rank() == 0:
                import shutil

                shutil.rmtree(base, ignore_errors=True)

    def num_parameters(self, only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
        """Parameters held by this rank; the rows megatron pads the vocabulary with (to a multiple of 128 x TP) are not
        counted, so one rank of an unsplit model counts what transformers counts. ``exclude_embeddings``: without the
        input embedding (transformers leaves out its ``nn.Embedding`` weights; a tied LM head is that weight, also as
        the last pipeline stage's copy of it)."""
        from megatron.core import parallel_state as ps

        padded, vocab = self.megatron.padded_vocab, self.config.vocab_size
        rows = padded // ps.get_tensor_model_parallel_world_size()
        first = ps.get_tensor_model_parallel_rank() * rows
        pad_rows = max(0, first + rows - max(first, vocab))  # this rank's share of the padding rows
        total = 0
        # NOTE: an LM head's bias (Phi's) is vocabulary-split and padded too, and not an embedding
        vocabulary = ("embedding.word_embeddings.weight", "output_layer.weight", "output_layer.bias")
        # NOTE: a learned position table (GPT-2's wpe) is an nn.Embedding too
        embeddings = (*(vocabulary[:2] if self.bridge.tied else vocabulary[:1]), "embedding.position_embeddings.weight")
        for name, p in self.named_parameters():
            if exclude_embeddings and name.endswith(embeddings):
                continue
            if p.requires_grad or not only_trainable:
                total += p.numel()
                if name.endswith(vocabulary) and p.shape[0] == rows:
                    total -= pad_rows * p[0].numel()
        return total

    # ---- what transformers.Trainer and trl read -------------------------------------------------------------
    @property
    def hf_device_map(self) -> dict:
        """Read first thing by ``transformers.Trainer.__init__``: only LoongTrainer may train this model.

        NOTE: a plain Trainer (or trl.SFTTrainer, trl.DPOTrainer) would shard batches over every process, wrap the
        model in torch DDP over the whole world (overwriting other tensor-parallel ranks' shards) and skip megatron's
        gradient reductions. LoongTrainer marks the model (``model_parallel = True``) before ``Trainer.__init__``.
        """
        if not self.__dict__.get("model_parallel", False):
            raise TypeError("transformers.Trainer, trl.SFTTrainer and trl.DPOTrainer cannot train a loongforge_hf "
                            "model: use loongforge_hf.LoongTrainer (same arguments as transformers.Trainer), "
                            "loongforge_hf.LoongSFTTrainer (same arguments as trl.SFTTrainer, peft_config included) "
                            "or loongforge_hf.LoongDPOTrainer (same arguments as trl.DPOTrainer, peft_config "
                            "included).")
        return {}  # NOTE: an empty map, not None: accelerate's verify_device_map takes len() of it

    def add_model_tags(self, tags: str | list[str]) -> None:
        """Tags for the model card, as ``PreTrainedModel.add_model_tags`` keeps them (trl adds its own)."""
        self.model_tags = list(dict.fromkeys([*(getattr(self, "model_tags", None) or []),
                                              *([tags] if isinstance(tags, str) else tags)]))


def failing_alike(name_or_path):
    """Run the rank-local part of a load (build, read) so that a failure on any rank raises on every rank, with the
    same message naming the rank that failed (collective: the ranks share their outcome when the block ends)."""
    from loongforge_hf.bridges import distribution

    return distribution.failing_alike(
        lambda err: f"{type(err).__name__}: {err}",
        lambda error: RuntimeError(f"from_pretrained({os.fspath(name_or_path)!r}) failed on {error}"))


def keep_hub_name(hf_config, name_or_path) -> None:
    """``config._name_or_path`` as transformers keeps it: the hub id a model was loaded by, not the cache folder it
    was resolved to (exports and adapter configs name the base model by it)."""
    if not Path(name_or_path).expanduser().is_dir():
        hf_config._name_or_path = str(name_or_path)


class AutoModelForCausalLM:
    """``from_pretrained`` like transformers', onto megatron-core parallel modules."""

    def __init__(self) -> None:
        raise EnvironmentError("Use AutoModelForCausalLM.from_pretrained(...).")

    # NOTE: what a task model changes (sequence_classification.py): its model class, its checks, its bridge
    _model_class = LoongModelForCausalLM

    @classmethod
    def _check_task(cls, folder: Path, hf_config=None) -> None:
        """Raise for a checkpoint the task cannot load (with the resolved folder, then with its config too)."""

    @classmethod
    def _task_bridge(cls, hf_config):
        from loongforge_hf.bridges import get_bridge

        return get_bridge(hf_config)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike, *,
                        tensor_parallel_size: int | None = None, pipeline_parallel_size: int | None = None,
                        virtual_pipeline_parallel_size: int | None = None, context_parallel_size: int | None = None,
                        expert_parallel_size: int | None = None, expert_tensor_parallel_size: int | None = None,
                        sequence_parallel: bool | None = None, parallel: ParallelConfig | str | None = None,
                        dtype: Any = None, torch_dtype: Any = None, revision: str | None = None,
                        cache_dir: str | os.PathLike | None = None, local_files_only: bool = False,
                        token: str | None = None, trust_remote_code: bool = False,
                        allow_pickle: bool = False, seed: int = 1234,
                        megatron_config: dict | None = None, fp8: str | None = None, fp8_recipe: str | None = None,
                        **unused: Any) -> LoongModelForCausalLM:
        # NOTE: megatron_config: extra megatron-core TransformerConfig fields (see bridges/builder.py), e.g.
        # {"overlap_moe_expert_parallel_comm": True}; docs/parallelism.md lists the ones that run without TE.
        # ``unused``: transformers' other from_pretrained keywords and config overrides (bridges/load_kwargs.py).
        arguments = {k: v for k, v in locals().items() if k not in ("cls", "pretrained_model_name_or_path", "unused")}
        from loongforge_hf.bridges import moe_graphs, router_balance
        from loongforge_hf.bridges.builder import build_megatron_model, check_megatron_config, interleaved_p2p_settings
        from loongforge_hf.parallel.kv_replicas import check_kv_replication
        from loongforge_hf.bridges.checkpoint_io import CheckpointReader
        from loongforge_hf.bridges.config_map import kv_heads_of
        from loongforge_hf.bridges.embedding_padding import embedding_padding_idx
        from loongforge_hf.bridges.fp8_checkpoint import dequantizing_reader
        from loongforge_hf.bridges.hub import resolve_checkpoint
        from loongforge_hf.bridges.load_kwargs import (check_device, finish_load, load_config, loading_info,
                                                       sort_load_kwargs)
        from loongforge_hf.bridges.loader import load_into
        from loongforge_hf.bridges.moe import whole_experts_layout
        from loongforge_hf.bridges.registry import loads_as_causal_lm
        from loongforge_hf.bridges.stage_boundary import pipeline_split
        from loongforge_hf.lora.load import adapter_base_model, carried_vocabulary, is_adapter_folder, load_adapter
        from loongforge_hf.parallel import initialize_parallel

        # --- local checks: same verdict on every rank, before any collective -------------------------------
        options = sort_load_kwargs(unused, allow_pickle=allow_pickle)
        hub = dict(revision=revision, cache_dir=cache_dir, local_files_only=local_files_only, token=token,
                   allow_pickle=allow_pickle, **options.hub)
        folder = resolve_checkpoint(pretrained_model_name_or_path, **hub)
        cls._check_task(folder)
        if is_adapter_folder(folder):
            # NOTE: as transformers with peft installed: a PEFT adapter (a folder or a hub id) loads its base model
            # (with these same arguments, revision included), then the adapter onto it (frozen, as
            # PeftModel.from_pretrained's default).
            loaded = cls.from_pretrained(adapter_base_model(folder), **arguments, **unused)
            base = loaded[0] if options.output_loading_info else loaded
            vocabulary = carried_vocabulary(folder)
            if vocabulary is not None and vocabulary != base.vocab_size:
                # NOTE: saved after a resize (TRL's chat template clone): the adapter carries the whole embedding
                # and LM head, which overwrite every row the resize makes (PEFT asks the user to resize first)
                base.resize_token_embeddings(vocabulary)
            model = load_adapter(base, folder, allow_pickle=allow_pickle)
            return (model, loaded[1]) if options.output_loading_info else model
        te_recipe = None  # a Transformer Engine FP8 recipe: built into the model (kernels/fp8_te.py)
        if fp8 is not None:  # NOTE: FP8 linear layers, see docs/fp8.md
            from loongforge_hf.kernels.fp8_linear import check_fp8_request, enable_fp8
            from loongforge_hf.kernels.fp8_te import is_te_recipe, te_report

            check_fp8_request(fp8, fp8_recipe)
            te_recipe = fp8_recipe if is_te_recipe(fp8_recipe) else None
        if dtype is not None and torch_dtype is not None and dtype != torch_dtype:
            raise ValueError(f"dtype={dtype} and torch_dtype={torch_dtype} disagree; pass one of them.")
        sizes = dict(zip(PARALLEL_KWARGS, (tensor_parallel_size, pipeline_parallel_size,
                                           virtual_pipeline_parallel_size, context_parallel_size,
                                           expert_parallel_size, expert_tensor_parallel_size, sequence_parallel)))
        auto = isinstance(parallel, str) and parallel == "auto"
        if auto and any(v is not None for v in sizes.values()):
            raise ParallelLayoutError("parallel='auto' picks every size itself; drop the size keywords "
                                      f"{sorted(k for k, v in sizes.items() if v is not None)} or parallel='auto'.")
        layout = None if auto else resolve_parallel(parallel, sizes)

        hf_config, config_on_file = load_config(folder, options, trust_remote_code=trust_remote_code, hub=hub)
        cls._check_task(folder, hf_config)
        if loads_as_causal_lm(hf_config):
            # NOTE: as transformers' AutoModelForCausalLM: a Gemma 3 image-text checkpoint (gemma-3-4b-it ...) loads
            # as its image-text model, which takes text alone as well
            from loongforge_hf.multimodal.modeling import AutoModelForImageTextToText

            if megatron_config or auto:
                raise ValueError(f"{hf_config.architectures[0]} loads as an image-text model: megatron_config and "
                                 "parallel='auto' are not taken there; pass the parallel sizes.")
            return AutoModelForImageTextToText.from_pretrained(
                pretrained_model_name_or_path, **{k: v for k, v in arguments.items() if k != "megatron_config"},
                **unused)
        bridge = cls._task_bridge(hf_config)
        reader = CheckpointReader(folder, allow_pickle=allow_pickle, **options.files)
        try:
            if hasattr(bridge, "see_checkpoint"):  # NOTE: a task head loaded from the checkpoint or drawn afresh
                bridge.see_checkpoint(reader)
            param_dtype = _resolve_dtype(dtype if dtype is not None else torch_dtype, hf_config, reader)
            if auto:
                layout = _auto_layout(hf_config, param_dtype, bridge)
            layout = whole_experts_layout(bridge, layout)
            layout.check_world_size(read_launch_env().world_size)
            heads = getattr(bridge, "layout_heads", None)  # NOTE: attention-free stacks (Mamba2): the mixers' heads
            layout.check_model(num_layers=hf_config.num_hidden_layers,
                               num_attention_heads=heads or hf_config.num_attention_heads,
                               num_key_value_heads=heads or kv_heads_of(hf_config),
                               vocab_size=hf_config.vocab_size, num_experts=bridge.num_experts())
            check_megatron_config(bridge, megatron_config)
            embedding_padding_idx(bridge)  # NOTE: raises on a pad_token_id outside the vocabulary
            check_kv_replication(bridge, layout)
            moe_graphs.check_layout(bridge, hf_config, megatron_config,
                                    expert_parallel_size=layout.expert_parallel_size, dtype=param_dtype, fp8=fp8)
            router_balance.check_layout(hf_config, bridge)
            if hasattr(bridge, "check_layout"):  # NOTE: a layout the architecture cannot run (Qwen3.5: heads vs TP)
                bridge.check_layout(layout)
            pipeline_split(bridge, layout, megatron_config)  # NOTE: a user's first / last stage sizes checked too
            if layout.interleaved_stages:
                interleaved_p2p_settings(layout.pipeline_parallel_size, megatron_config or {})
            dequantizing_reader(reader, bridge=bridge).validate_shapes(bridge.expected_hf_shapes())  # NOTE: MXFP4 too
            info = loading_info(reader, bridge) if options.output_loading_info else None
            # --- collective part ----------------------------------------------------------------------------
            initialize_parallel(layout, seed=seed,
                                cudagraph_rng=(megatron_config or {}).get("cuda_graph_impl") == "local")
            from megatron.core import parallel_state as ps

            # NOTE: each rank builds and loads only its own part (a bad tensor fails on the ranks that read it):
            # the ranks agree on the outcome, so all of them raise, none returns a model whose next collective hangs.
            with failing_alike(pretrained_model_name_or_path):
                check_device(options.device)
                megatron_model = build_megatron_model(bridge, layout, dtype=param_dtype,
                                                      megatron_config=megatron_config, te_fp8_recipe=te_recipe)
                load_into(megatron_model, bridge, reader, tp_rank=ps.get_tensor_model_parallel_rank(),
                          tp_size=ps.get_tensor_model_parallel_world_size())
                if te_recipe is not None:
                    megatron_model.fp8 = te_report(megatron_model.chunks, te_recipe)
                elif fp8 is not None:
                    megatron_model.fp8 = enable_fp8(megatron_model.chunks, fp8, recipe=fp8_recipe)
                moe_graphs.check_built(megatron_model)
        finally:
            reader.close()
        hf_config.dtype = param_dtype
        keep_hub_name(hf_config, pretrained_model_name_or_path)
        model = cls._model_class(hf_config=hf_config, bridge=bridge, megatron_model=megatron_model,
                                 parallel=layout, source=folder, source_variant=options.files.get("variant"),
                                 config_at_load=config_on_file.to_dict() if config_on_file else None)
        # NOTE: eval mode as transformers returns it: no dropout until a trainer calls train()
        return finish_load(model.eval(), options, info)
