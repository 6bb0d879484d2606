"""How a training checkpoint's tensors depend on the model's layers and on the layout that wrote it.

Choices:
- Hybrid stacks (decoder layers holding different tensors: Qwen3.5's Gated DeltaNet layers beside attention layers,
  Jamba's Mamba and attention layers, per-type head sizes) are keyed layer by layer (megatron's
  ``non_homogeneous_layers``): megatron stacks a homogeneous block's tensors over one layer axis, which needs every
  layer to hold each of them, and refused to save the hybrids ("Invalid access pattern"). Homogeneous models keep the
  stacked keys their checkpoints already have. LoRA adapters are left out of the comparison (an adapter on some
  layers only is stacked over those, ``lora/layers.stack_over_adapted_layers``).
- megatron reshards a tensor split over TP as the concatenation of the ranks' rows. That is the one-rank tensor for
  megatron's own layouts (q / k / v per KV group; ``[gate; up]`` through its swiglu factory), not for ours that hold
  on each rank its rows of several HF sections side by side: the linear-attention and state-space mixers'
  in-projections and convs (``kv_cache.recurrent_mixers``), JetMoE's shared ``[k; v]`` projection, LoRA's B (and
  DoRA's magnitude) of one HF linear over megatron's ``[gate; up]`` (Phi-3's ``gate_up_proj``), DiffLlama's
  ``linear_qkv`` (each rank holds a slice of both halves of the heads, ``bridges/diffllama.py``) and Laguna's (a
  rank's queries, then their gates, keys, values: ``bridges/laguna.py``). Those modules declare their sections
  (``parallel/tp_sections.py``) and the checkpoint keys each section on its own (``declared_sections``), so a resume
  under another tensor-parallel size reads the rows it needs. ``layout.json`` (beside ``megatron/``) records the
  size and that format (``tp_sections``); a checkpoint written before it holds those tensors whole and is read as
  written, and resuming it, or any module still holding sections it does not declare (a LoRA adapter on one HF
  target whose rows are not whole sections of its projection), under another size is refused by name, on every
  rank, before megatron's load. A checkpoint without the file (written before it) is not checked.
- KV heads replicated over TP ranks (more ranks than KV heads: MQA's Falcon / GPT-BigCode, ``parallel/kv_replicas.py``)
  make ``linear_qkv`` one group per rank; it is keyed head by head as the tensor of megatron's whole-group layout
  (``tp_sections.Blocks``, ``kv_blocks`` in ``layout.json``), so a resume under another size, replicated or not,
  reads the heads it needs. A checkpoint written before that keyed the replicas' rows as megatron's split of a
  tensor whose shape depends on the size: resuming it under another size is refused by name (megatron's load would
  fail on the shape, saying the checkpoint was for another model).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch.distributed as dist


def layers_differ(chunks) -> bool:
    """Whether the decoder layers of a transformer block hold different tensors (names or shapes), anywhere in the
    model (module docstring). Collective: a pipeline stage may hold layers of one kind only."""
    from megatron.core.transformer.transformer_block import TransformerBlock

    kinds = set()
    for chunk in chunks:
        for name, block in chunk.named_modules():
            if isinstance(block, TransformerBlock):
                kinds.update((name, tuple((n, tuple(p.shape)) for n, p in layer.named_parameters()
                                          if ".lora." not in f".{n}")) for layer in block.layers)
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, kinds)
        kinds = set().union(*everyone)
    blocks = [name for name, _ in kinds]
    return len(blocks) != len(set(blocks))


def _tensor_parallel_size() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_world_size() if ps.model_parallel_is_initialized() else 1


def write_layout(path: Path) -> None:
    """Record the layout a checkpoint is written in (rank 0); ``tp_sections``: sectioned rows keyed by section,
    ``kv_blocks``: replicated KV heads keyed by head."""
    path.write_text(json.dumps({"tensor_parallel_size": _tensor_parallel_size(), "tp_sections": True,
                                "kv_blocks": True}))


def read_layout(path: Path) -> dict:
    """``write_layout``'s record, ``{}`` for a checkpoint written before it (local read)."""
    return json.loads(path.read_text()) if path.is_file() else {}


def declared_sections(chunks, *, blocks: bool = True) -> dict:
    """``{id(tensor): tp_sections.Sections}`` of this rank's sectioned parameters (``parallel/tp_sections.py``),
    with ``blocks``: ``{id(tensor): tp_sections.Blocks}`` of those keyed per KV head too."""
    from loongforge_hf.parallel.tp_sections import blocks_of, sections_of, sections_of_adapters

    params = [p for chunk in chunks for p in chunk.parameters()]
    found = {id(p): sections_of(p) for p in params if sections_of(p) is not None}
    found.update(sections_of_adapters((n, m) for chunk in chunks for n, m in chunk.named_modules()))
    if blocks:
        found.update({id(p): blocks_of(p) for p in params if blocks_of(p) is not None})
    return found


def sectioned_modules(chunks, *, declared: dict | None = None) -> list[str]:
    """Type names of this rank's modules whose rows on a TP rank are its share of several HF sections (module
    docstring), leaving out those whose every sectioned tensor is in ``declared`` (``declared_sections``; None: none
    is, the checkpoint holds them whole)."""
    from loongforge_hf.bridges.jetmoe_attention import MoAQueryKV
    from loongforge_hf.kv_cache import recurrent_mixers
    from loongforge_hf.lora.layers import LoraColumnParallelLinear
    from loongforge_hf.parallel.tp_sections import sections_of

    found = set()
    if declared is None:  # NOTE: a checkpoint written before the sections: every module holding some too
        found = {_owner_name(chunk, name) for chunk in chunks for name, p in chunk.named_parameters()
                 if sections_of(p) is not None}
        declared = {}
    found |= {type(m).__name__ for m in recurrent_mixers(chunks) if not _all_declared(m, declared)}
    for chunk in chunks:
        for name, m in chunk.named_modules():
            if (isinstance(m, MoAQueryKV) or _sectioned_attention(m)) and not _all_declared(m, declared):
                found.add(type(m).__name__)
            gated = getattr(getattr(m, "config", None), "gated_linear_unit", False)
            if isinstance(m, LoraColumnParallelLinear) and gated and name.endswith("linear_fc1") and any(
                    a.B.shape[0] == m.weight.shape[0] and id(a.B) not in declared for a in m.lora.values()):
                found.add(f"LoRA on one HF [gate; up] linear ({name.rsplit('.', 1)[-1]})")
    return sorted(found)


def _owner_name(chunk, name: str) -> str:
    """The type name of the module holding parameter ``name``, or of its parent where that is a linear layer."""
    import torch

    path = name.rsplit(".", 1)[0] if "." in name else ""
    owner = chunk.get_submodule(path)
    if isinstance(owner, torch.nn.Linear) or type(owner).__name__.endswith("ParallelLinear"):
        owner = chunk.get_submodule(path.rsplit(".", 1)[0] if "." in path else "")
    return type(owner).__name__


def _all_declared(module, declared: dict) -> bool:
    """Whether ``module`` declares its sections and every LoRA factor on its sectioned linears is declared too."""
    from loongforge_hf.lora.layers import LoraColumnParallelLinear
    from loongforge_hf.parallel.tp_sections import sections_of

    if not any(id(p) in declared for p in module.parameters()):
        return False
    return all(id(a.B) in declared for m in module.modules() if isinstance(m, LoraColumnParallelLinear)
               and sections_of(m.weight) is not None for a in m.lora.values())


# (module, class name) of attention classes built per config by a bridge's factory (a class per call), whose
# ``linear_qkv`` rows on a TP rank are sectioned (module docstring)
_SECTIONED_ATTENTION = {("loongforge_hf.bridges.diffllama", "DifferentialSelfAttention"),
                        ("loongforge_hf.bridges.laguna", "LagunaAttention")}


def _sectioned_attention(module) -> bool:
    return (type(module).__module__, type(module).__name__) in _SECTIONED_ATTENTION


def kv_heads(chunks) -> set[int]:
    """The HF model's numbers of KV heads as this rank's ``linear_qkv`` attention layers hold them (a replica's
    ``kv_replica`` names them; else megatron's ``num_query_groups``: whole heads per rank)."""
    from megatron.core.transformer.attention import Attention

    found = set()
    for chunk in chunks:
        for m in chunk.modules():
            weight = getattr(getattr(m, "linear_qkv", None), "weight", None)
            if isinstance(m, Attention) and weight is not None:
                replica = getattr(weight, "kv_replica", None)
                found.add(replica.heads if replica is not None else m.config.num_query_groups)
    return found


def check_resharding(engine, layout: dict, folder: Path) -> None:
    """Refuse resuming the checkpoint in ``folder``, written in ``layout`` (``read_layout``), under another
    tensor-parallel size where the model has sectioned rows (``sectioned_modules``) or, in a checkpoint written
    before they were keyed per head, KV heads replicated over TP ranks (``kv_heads``), on any rank: run through
    ``run_everywhere``, every rank raises alike. One small all-gather."""
    from loongforge_hf.bridges.checkpoint_files import CheckpointError

    from loongforge_hf.parallel.kv_replicas import replicas_of

    chunks = [c.module for c in engine.chunks]
    found = set(sectioned_modules(chunks, declared=declared_sections(chunks) if layout.get("tp_sections") else None))
    heads = kv_heads(chunks)
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (found, heads))
        found = set().union(*(f for f, _ in everyone))
        heads = set().union(*(h for _, h in everyone))
    if not layout:
        return
    saved, now = layout.get("tensor_parallel_size"), _tensor_parallel_size()
    replicated = saved != now and isinstance(saved, int) and not layout.get("kv_blocks") and any(
        replicas_of(kv, saved) > 1 or replicas_of(kv, now) > 1 for kv in heads)
    if replicated:
        raise CheckpointError(
            f"the checkpoint was written with tensor_parallel_size={saved}, this run has {now}: resharding is not "
            f"supported where KV heads are replicated over tensor-parallel ranks (num_key_value_heads={min(heads)}: "
            f"one group per rank, and this checkpoint was written before loongforge-hf keyed them per head, so its "
            f"q / k / v shape depends on the size). Resume with "
            f"tensor_parallel_size={saved}, or start a new run from its weights: from_pretrained("
            f"{str(folder)!r}) reads the HF export.")
    if found and saved != now:
        why = ("the checkpoint holds them whole: it was written before loongforge-hf keyed them per section" if not
               layout.get("tp_sections") else "not declared per section (parallel/tp_sections.py)")
        raise CheckpointError(
            f"the checkpoint was written with tensor_parallel_size={saved}, this run has {now}: resharding is not "
            f"supported for {sorted(found)} (each TP rank holds its rows of several HF sections side by side, which "
            f"megatron's resharding would reorder; {why}). Resume with tensor_parallel_size={saved}, or start a new "
            f"run from its weights: from_pretrained({str(folder)!r}) reads the HF export.")
