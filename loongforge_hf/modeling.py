"""The HF face of a megatron-core model: ``AutoModelForCausalLM.from_pretrained`` -> ``LoongModelForCausalLM``.

Choices:
- Everything that can be checked locally (architecture, config values, layout vs. model sizes, checkpoint files and
  shapes) is checked before the process group starts, identically on every rank: bad input never hangs a job.
- ``forward`` returns a transformers ``CausalLMOutputWithPast`` on every rank: loss like transformers (labels shifted
  inside, ignore -100, mean over label tokens) and full-vocabulary logits gathered over TP (``return_logits=False``
  skips the gather). Under pipeline parallelism it runs megatron's forward-only schedule and broadcasts the last
  stage's outputs; gradients flow through ``forward`` when pipeline_parallel_size == 1.
- ``save_pretrained`` is collective (every rank calls it); rank 0 writes.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from loongforge_hf.parallel import ParallelConfig, ParallelLayoutError, accelerate_megatron_layout, read_launch_env
from loongforge_hf.parallel.config import PARALLEL_KWARGS

IGNORE_INDEX = -100

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def _resolve_dtype(dtype: Any, hf_config) -> torch.dtype:
    if dtype is None:
        return torch.float32
    if dtype == "auto":
        dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None) or torch.float32
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype={dtype!r} is not supported; use one of {sorted(_DTYPES)} or a torch.dtype.")
        return _DTYPES[dtype]
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype={dtype} is not supported; use torch.float32, torch.bfloat16 or torch.float16.")
    return dtype


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


def _auto_layout(hf_config, param_dtype: torch.dtype) -> ParallelConfig:
    from loongforge_hf.parallel.auto import choose_layout, model_size_of
    from loongforge_hf.xpu import get_backend

    env = read_launch_env()
    layout, reason = choose_layout(model_size_of(hf_config), world_size=env.world_size,
                                   local_world_size=env.local_world_size,
                                   device_memory=get_backend().memory_per_device(),
                                   dtype_bytes=torch.finfo(param_dtype).bits // 8)
    if env.rank == 0:
        print(reason, flush=True)
    return layout


class LoongModelForCausalLM(nn.Module):
    """A causal LM whose layers are megatron-core modules, laid out by a ``ParallelConfig``."""

    def __init__(self, *, hf_config, bridge, megatron_model, parallel: ParallelConfig, source: Path | None) -> None:
        super().__init__()
        self.config = hf_config
        self.bridge = bridge
        self.megatron = megatron_model
        self.chunks = nn.ModuleList(megatron_model.chunks)
        self.parallel = parallel
        self.source = source
        self.generation_config = None
        if source is not None and (source / "generation_config.json").is_file():
            from transformers import GenerationConfig

            self.generation_config = GenerationConfig.from_pretrained(source)

    # ---- properties users expect ---------------------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        return self.megatron.config.params_dtype

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
        from transformers.modeling_outputs import CausalLMOutputWithPast

        from loongforge_hf.bridges.runtime import forward_causal_lm

        loss, logits = forward_causal_lm(self, input_ids=input_ids, attention_mask=attention_mask,
                                         position_ids=position_ids, labels=labels, return_logits=return_logits)
        return CausalLMOutputWithPast(loss=loss, logits=logits)

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
        configs = {id(c.config): c.config for c in self.chunks} | {id(self.megatron.config): self.megatron.config}
        for config in configs.values():
            config.recompute_granularity = "full" if on else None
            config.recompute_method = "uniform" if on else None
            config.recompute_num_layers = 1 if on else None
        # NOTE: megatron's recompute is reentrant: a checkpointed layer gets gradients only if its input requires
        # grad, which a frozen embedding (LoRA, freezing) does not give; make the embeddings' output require it.
        for chunk in self.chunks:
            embedding = getattr(chunk, "embedding", None)
            handle = getattr(chunk, "_loong_input_grad_hook", None)
            if on and embedding is not None and handle is None:
                chunk._loong_input_grad_hook = embedding.register_forward_hook(
                    lambda module, args, out: out.requires_grad_(True) if not out.requires_grad else out)
            elif not on and handle is not None:
                handle.remove()
                chunk._loong_input_grad_hook = None

    # ---- export --------------------------------------------------------------------------------------------
    def save_pretrained(self, save_directory: str | os.PathLike, *, max_shard_size: int | str = "5GB",
                        dtype: torch.dtype | None = None, **unused: Any) -> None:
        """Write a plain HF checkpoint (collective: every rank calls it; rank 0 writes, atomically)."""
        from loongforge_hf.bridges.exporter import export_hf

        export_hf(self.megatron, self.bridge, self.parallel, Path(save_directory), source=self.source,
                  max_shard_size=max_shard_size, dtype=dtype)

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

    def num_parameters(self, *, only_trainable: bool = False) -> int:
        """Parameters held by this rank."""
        return sum(p.numel() for p in self.parameters() if p.requires_grad or not only_trainable)

    # ---- what transformers.Trainer and trl read -------------------------------------------------------------
    @property
    def hf_device_map(self) -> dict:
        """Read first thing by ``transformers.Trainer.__init__``: only LoongTrainer may train this model.

        NOTE: a plain Trainer (or trl.SFTTrainer) would shard batches over every process, wrap the model in torch DDP
        over the whole world (overwriting other tensor-parallel ranks' shards) and skip megatron's gradient
        reductions. LoongTrainer marks the model (``model_parallel = True``) before ``Trainer.__init__``.
        """
        if not self.__dict__.get("model_parallel", False):
            raise TypeError("transformers.Trainer and trl.SFTTrainer cannot train a loongforge_hf model: use "
                            "loongforge_hf.LoongTrainer (same arguments as transformers.Trainer) or "
                            "loongforge_hf.LoongSFTTrainer (same arguments as trl.SFTTrainer, peft_config included).")
        return {}  # NOTE: an empty map, not None: accelerate's verify_device_map takes len() of it

    def add_model_tags(self, tags: str | list[str]) -> None:
        """Tags for the model card, as ``PreTrainedModel.add_model_tags`` keeps them (trl adds its own)."""
        self.model_tags = list(dict.fromkeys([*(getattr(self, "model_tags", None) or []),
                                              *([tags] if isinstance(tags, str) else tags)]))


class AutoModelForCausalLM:
    """``from_pretrained`` like transformers', onto megatron-core parallel modules."""

    def __init__(self) -> None:
        raise EnvironmentError("Use AutoModelForCausalLM.from_pretrained(...).")

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
        from transformers import AutoConfig

        from loongforge_hf.bridges import get_bridge
        from loongforge_hf.bridges.builder import (build_megatron_model, check_megatron_config,
                                                   interleaved_p2p_settings)
        from loongforge_hf.bridges.checkpoint_io import CheckpointReader
        from loongforge_hf.bridges.hub import resolve_checkpoint
        from loongforge_hf.bridges.loader import load_into
        from loongforge_hf.parallel import initialize_parallel

        if unused:
            raise TypeError(f"from_pretrained got unexpected keyword arguments: {sorted(unused)}.")
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

        # --- local checks: same verdict on every rank, before any collective -------------------------------
        folder = resolve_checkpoint(pretrained_model_name_or_path, revision=revision, cache_dir=cache_dir,
                                    local_files_only=local_files_only, token=token, allow_pickle=allow_pickle)
        hf_config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
        bridge = get_bridge(hf_config)
        if auto:
            layout = _auto_layout(hf_config, _resolve_dtype(dtype if dtype is not None else torch_dtype, hf_config))
        layout.check_world_size(read_launch_env().world_size)
        layout.check_model(num_layers=hf_config.num_hidden_layers, num_attention_heads=hf_config.num_attention_heads,
                           num_key_value_heads=getattr(hf_config, "num_key_value_heads", None)
                           or hf_config.num_attention_heads,
                           vocab_size=hf_config.vocab_size, num_experts=bridge.num_experts())
        param_dtype = _resolve_dtype(dtype if dtype is not None else torch_dtype, hf_config)
        check_megatron_config(bridge, megatron_config)
        if layout.interleaved_stages:
            interleaved_p2p_settings(layout.pipeline_parallel_size, megatron_config or {})
        reader = CheckpointReader(folder, allow_pickle=allow_pickle)
        try:
            reader.validate_shapes(bridge.expected_hf_shapes())
            # --- collective part ----------------------------------------------------------------------------
            initialize_parallel(layout, seed=seed,
                                cudagraph_rng=(megatron_config or {}).get("cuda_graph_impl") == "local")
            from megatron.core import parallel_state as ps

            megatron_model = build_megatron_model(bridge, layout, dtype=param_dtype, megatron_config=megatron_config,
                                                  te_fp8_recipe=te_recipe)
            load_into(megatron_model, bridge, reader, tp_rank=ps.get_tensor_model_parallel_rank(),
                      tp_size=ps.get_tensor_model_parallel_world_size())
            if te_recipe is not None:
                megatron_model.fp8 = te_report(megatron_model.chunks, te_recipe)
            elif fp8 is not None:
                megatron_model.fp8 = enable_fp8(megatron_model.chunks, fp8, recipe=fp8_recipe)
        finally:
            reader.close()
        hf_config.dtype = param_dtype
        return LoongModelForCausalLM(hf_config=hf_config, bridge=bridge, megatron_model=megatron_model,
                                     parallel=layout, source=folder)
