"""Fill this rank's megatron chunks from an HF checkpoint, reading only this rank's slices.

Choices:
- Everything that can fail on bad input (missing shard, corrupt header, path escaping the folder, wrong shapes) is
  checked by ``CheckpointReader`` and ``validate_shapes`` before the first parameter is touched; the checks are
  local and deterministic, so every rank raises the same error and no collective is left waiting.
- Every megatron parameter must be claimed by exactly one mapping of its layer; a leftover parameter is a bridge bug
  and raises. Buffers that hold checkpoint state (the router's ``expert_bias``) are loaded when a mapping names them;
  other buffers (rotary tables, token counters) are megatron's own.
- Routed experts: a megatron name carries the local expert index; the expert-parallel rank turns it into the global
  one, so each rank reads only the experts it owns, split over the expert-tensor-parallel group.
- The tied LM head of a last pipeline stage is loaded from the embedding (megatron keeps the two in sync).
- Checkpoint tensors the model has no place for but the bridge keeps (DeepSeek's multi-token-prediction layers) are
  not read; a warning says so, and export copies them from the source folder.
"""

from __future__ import annotations

import re
import warnings

import torch
import torch.distributed as dist

from loongforge_hf.bridges.fp8_checkpoint import dequantizing_reader
from loongforge_hf.bridges.fused_mappings import Expert
from loongforge_hf.bridges.mappings import Mapping, ShardContext, VocabParallel


def _pattern_to_regex(pattern: str) -> re.Pattern:
    escaped = re.escape(pattern).replace(re.escape("{layer}"), r"(?P<layer>\d+)")
    return re.compile("^" + escaped.replace(re.escape("{expert}"), r"(?P<expert>\d+)") + "$")


def param_index(bridge, *, tied_output_on_last_stage: bool) -> list[tuple[re.Pattern, Mapping, bool]]:
    """(regex over megatron names, mapping, has a layer index) for every megatron parameter of the bridge."""
    seen: set[str] = set()
    entries = []
    for m in bridge.layer_mappings():
        if m.megatron not in seen:
            seen.add(m.megatron)
            entries.append((_pattern_to_regex(m.megatron), m, True))
    entries.append((_pattern_to_regex(bridge.embedding_mapping().megatron), bridge.embedding_mapping(), False))
    # NOTE: the first stage's tensors beside the token embedding (GPT-2's position table)
    entries += [(_pattern_to_regex(m.megatron), m, False) for m in first_stage_mappings(bridge)]
    entries += [(_pattern_to_regex(m.megatron), m, False) for m in bridge.final_mappings()]
    if tied_output_on_last_stage:
        emb = bridge.embedding_mapping()
        entries.append((_pattern_to_regex("output_layer.weight"), VocabParallel("output_layer.weight", emb.hf),
                        False))
    return entries


def first_stage_mappings(bridge) -> list[Mapping]:
    """The first pipeline stage's mappings beside the token embedding (a learned position table), or []."""
    return list(getattr(bridge, "first_stage_mappings", list)())


def match_param(name: str, index) -> tuple[Mapping, int | None]:
    """The mapping of megatron parameter ``name`` and its local layer index (None outside the layers)."""
    mapping, layer, _ = match_param_full(name, index)
    return mapping, layer


def match_param_full(name: str, index) -> tuple[Mapping, int | None, int | None]:
    """(mapping, local layer or None, local expert or None) for megatron parameter ``name``."""
    for regex, mapping, layered in index:
        m = regex.match(name)
        if m:
            groups = m.groupdict()
            layer = int(groups["layer"]) if layered and "layer" in groups else None
            expert = int(groups["expert"]) if "expert" in groups else None
            return mapping, layer, expert
    raise KeyError(name)


def shard_context(bridge, *, tp_rank: int, tp_size: int, padded_vocab: int, ep_rank: int = 0, ep_size: int = 1,
                  etp_rank: int | None = None, etp_size: int | None = None) -> ShardContext:
    from loongforge_hf.bridges.config_map import head_dim_of, kv_heads_of

    c = bridge.hf_config
    return ShardContext(tp_rank=tp_rank, tp_size=tp_size, num_heads=c.num_attention_heads, num_kv_heads=kv_heads_of(c),
                        head_dim=head_dim_of(c), vocab_size=c.vocab_size, padded_vocab=padded_vocab,
                        ep_rank=ep_rank, ep_size=ep_size, etp_rank=tp_rank if etp_rank is None else etp_rank,
                        etp_size=tp_size if etp_size is None else etp_size)


def expert_parallel_state() -> dict:
    """This rank's expert-parallel and expert-tensor-parallel rank and size (one rank of one without megatron)."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return {"ep_rank": 0, "ep_size": 1, "etp_rank": 0, "etp_size": 1}
    return {"ep_rank": ps.get_expert_model_parallel_rank(), "ep_size": ps.get_expert_model_parallel_world_size(),
            "etp_rank": ps.get_expert_tensor_parallel_rank(),
            "etp_size": ps.get_expert_tensor_parallel_world_size()}


def warn_passthrough(bridge, reader) -> None:
    skipped = bridge.passthrough_names(reader.keys())
    if skipped:
        layers = sorted({".".join(n.split(".")[:3]) for n in skipped})
        kind = getattr(bridge, "passthrough_kind", "multi-token prediction")
        warnings.warn(f"{type(bridge).__name__}: {len(skipped)} checkpoint tensor(s) under {', '.join(layers)} "
                      f"({kind}) are not part of the model and were not loaded; save_pretrained copies "
                      "them unchanged from the source folder.", stacklevel=3)


def _checkpoint_tensors(chunk):
    """Parameters, then buffers (a buffer is loaded only when a mapping names it)."""
    for name, param in chunk.named_parameters():
        yield name, param, True
    for name, buf in chunk.named_buffers():
        yield name, buf, False


def _fill(tensor: torch.Tensor, value: torch.Tensor) -> None:
    """Put ``value`` into ``tensor``: adopt its storage when it can serve as is, else copy (converting dtype/device).

    NOTE: a slice just read in the parameter's dtype and on its device is adopted (``tensor.data = value``), not
    copied: the copy was a third pass over every byte of the model after the read and the transform, and megatron's
    empty parameter goes back untouched. Only a value that owns exactly its storage is adopted, so a view never pins a
    larger tensor; the Parameter object, and what megatron attached to it, stays the same.
    """
    owns_storage = value.is_contiguous() and value.storage_offset() == 0 \
        and value.untyped_storage().nbytes() == value.numel() * value.element_size()
    if value.dtype == tensor.dtype and value.device == tensor.device and owns_storage:
        tensor.data = value
    else:
        tensor.copy_(value)


@torch.no_grad()
def load_into(model, bridge, reader, *, tp_rank: int, tp_size: int, ep_rank: int | None = None,
              ep_size: int | None = None, etp_rank: int | None = None, etp_size: int | None = None) -> None:
    """Copy checkpoint slices into every parameter of ``model.chunks`` (expert ranks default to megatron's state)."""
    reader = dequantizing_reader(reader, bridge=bridge)  # FP8 dequantised, names aliased (fp8_checkpoint.py)
    reader.validate_shapes(bridge.expected_hf_shapes())
    state = expert_parallel_state()
    given = {"ep_rank": ep_rank, "ep_size": ep_size, "etp_rank": etp_rank, "etp_size": etp_size}
    state.update({k: v for k, v in given.items() if v is not None})
    ctx = shard_context(bridge, tp_rank=tp_rank, tp_size=tp_size, padded_vocab=model.padded_vocab, **state)
    expert_ctx = ctx.for_experts()
    num_experts = bridge.num_experts()
    local_experts = num_experts // ctx.ep_size if num_experts else 0
    if not dist.is_initialized() or dist.get_rank() == 0:
        warn_passthrough(bridge, reader)
    for chunk, offset in zip(model.chunks, model.layer_offsets):
        index = param_index(bridge, tied_output_on_last_stage=bridge.tied and chunk.post_process
                            and not chunk.pre_process)
        for name, tensor, is_param in _checkpoint_tensors(chunk):
            try:
                mapping, local_layer, local_expert = match_param_full(name, index)
            except KeyError:
                if not is_param:
                    continue
                raise RuntimeError(f"{type(bridge).__name__} has no mapping for megatron parameter {name!r}") from None
            layer = None if local_layer is None else offset + local_layer
            if layer is not None and mapping.megatron not in {m.megatron for m in bridge.mappings_for_layer(layer)}:
                raise RuntimeError(f"{name!r}: layer {layer} of {type(bridge).__name__} has no such tensor.")
            if isinstance(mapping, Expert) and local_expert is None:  # all local experts stacked (moe.StackedExpert)
                value = mapping.load(reader, ctx, layer)
            elif isinstance(mapping, Expert):
                mapping = mapping.bind(global_expert=ctx.ep_rank * local_experts + local_expert,
                                       local_expert=local_expert)
                value = mapping.load(reader, expert_ctx, layer)
            else:
                value = mapping.load(reader, ctx, layer)
            if tuple(value.shape) != tuple(tensor.shape):
                raise RuntimeError(f"{name}: checkpoint slice has shape {tuple(value.shape)}, megatron parameter "
                                   f"{tuple(tensor.shape)} (bridge {type(bridge).__name__}).")
            if mapping.hf_dtype is not None and tensor.dtype != mapping.hf_dtype and is_param:
                # NOTE: transformers keeps this tensor in hf_dtype whatever the model dtype (DeepSeek's router);
                # megatron's router computes in fp32 anyway (moe_router_dtype), so the parameter keeps it too and
                # the round trip stays exact.
                tensor.data = tensor.data.to(mapping.hf_dtype)
            _fill(tensor, value)
