"""Fill this rank's megatron chunks from an HF checkpoint, reading only this rank's slices.

Choices:
- Everything that can fail on bad input (missing shard, corrupt header, path escaping the folder, wrong shapes) is
  checked by ``CheckpointReader`` and ``validate_shapes`` before the first parameter is touched; the checks are
  local and deterministic, so every rank raises the same error and no collective is left waiting.
- Every megatron parameter must be claimed by exactly one mapping; a leftover parameter is a bridge bug and raises.
- The tied LM head of a last pipeline stage is loaded from the embedding (megatron keeps the two in sync).
"""

from __future__ import annotations

import re

import torch

from loongforge_hf.bridges.mappings import Mapping, ShardContext


def _pattern_to_regex(pattern: str) -> re.Pattern:
    return re.compile("^" + re.escape(pattern).replace(re.escape("{layer}"), r"(\d+)") + "$")


def param_index(bridge, *, tied_output_on_last_stage: bool) -> list[tuple[re.Pattern, Mapping, bool]]:
    """(regex over megatron names, mapping, has a layer index) for every megatron parameter of the bridge."""
    entries = [(_pattern_to_regex(m.megatron), m, True) for m in bridge.layer_mappings()]
    entries.append((_pattern_to_regex(bridge.embedding_mapping().megatron), bridge.embedding_mapping(), False))
    entries += [(_pattern_to_regex(m.megatron), m, False) for m in bridge.final_mappings()]
    if tied_output_on_last_stage:
        emb = bridge.embedding_mapping()
        from loongforge_hf.bridges.mappings import VocabParallel

        entries.append((_pattern_to_regex("output_layer.weight"), VocabParallel("output_layer.weight", emb.hf),
                        False))
    return entries


def match_param(name: str, index) -> tuple[Mapping, int | None]:
    for regex, mapping, layered in index:
        m = regex.match(name)
        if m:
            return mapping, (int(m.group(1)) if layered else None)
    raise KeyError(name)


def shard_context(bridge, *, tp_rank: int, tp_size: int, padded_vocab: int) -> ShardContext:
    from loongforge_hf.bridges.config_map import head_dim_of

    c = bridge.hf_config
    return ShardContext(tp_rank=tp_rank, tp_size=tp_size, num_heads=c.num_attention_heads,
                        num_kv_heads=getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
                        head_dim=head_dim_of(c), vocab_size=c.vocab_size, padded_vocab=padded_vocab)


@torch.no_grad()
def load_into(model, bridge, reader, *, tp_rank: int, tp_size: int) -> None:
    """Copy checkpoint slices into every parameter of ``model.chunks``."""
    reader.validate_shapes(bridge.expected_hf_shapes())
    ctx = shard_context(bridge, tp_rank=tp_rank, tp_size=tp_size, padded_vocab=model.padded_vocab)
    for chunk, offset in zip(model.chunks, model.layer_offsets):
        index = param_index(bridge, tied_output_on_last_stage=bridge.tied and chunk.post_process
                            and not chunk.pre_process)
        for name, param in chunk.named_parameters():
            try:
                mapping, local_layer = match_param(name, index)
            except KeyError:
                raise RuntimeError(f"{type(bridge).__name__} has no mapping for megatron parameter {name!r}") from None
            layer = None if local_layer is None else offset + local_layer
            value = mapping.load(reader, ctx, layer)
            if tuple(value.shape) != tuple(param.shape):
                raise RuntimeError(f"{name}: checkpoint slice has shape {tuple(value.shape)}, megatron parameter "
                                   f"{tuple(param.shape)} (bridge {type(bridge).__name__}).")
            param.copy_(value.to(dtype=param.dtype, device=param.device))
