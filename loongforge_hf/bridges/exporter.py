"""Stream megatron chunks back into a plain HF checkpoint folder.

Choices:
- Every rank walks the same ordered list of HF tensors (embedding, layers in order, final norm, LM head); the owner
  TP group gathers on its first rank, which converts and sends to global rank 0, which writes through
  ``CheckpointWriter`` (temporary folder, then rename: an interrupted save never leaves a folder that looks complete).
  The writer is given the whole list up front (``plan``), so each tensor goes to disk as it arrives: rank 0 holds one
  tensor at a time, not a shard.
- Mappings that describe their shards' blocks (``export_parts``) are never assembled on rank 0: its own TP shard's
  blocks are written straight from the parameter, then each other TP rank's shard is received and its blocks written
  to their places (``CheckpointWriter.add_part``); the next shard's receive is posted before the writing starts, so
  the two overlap. Rank 0 holds its parameters plus at most two received shards (one at TP=2), not the full tensor
  next to every shard. A first TP rank that is not rank 0 (another pipeline stage) assembles the
  full tensor the same way, into one preallocated buffer, and sends it. Replicated tensors are not sent over TP.
- Routed experts: expert ``g`` of a layer lives on expert-parallel rank ``g // (N / E)`` as a local expert; the
  first expert-data-parallel replica of that rank gathers it over the expert-tensor-parallel group and its first
  rank sends it to rank 0 (which learns who that is from one all-gather of ranks at the start).
- Checkpoint tensors the model does not hold but the bridge keeps (``passthrough_names``: DeepSeek's
  multi-token-prediction layers) are copied by rank 0 from the source folder, bit for bit.
- A mapping's ``hf_dtype`` wins over the model dtype and ``dtype=`` (what transformers keeps in fp32 stays fp32).
- Tensors that live outside megatron (a vision tower) come from ``extra_tensors``: every rank runs it after the
  megatron tensors (it may gather collectively); rank 0 receives ``(name, tensor)`` and writes them, others
  ``(name, None)`` or nothing.
- config.json, generation_config.json, tokenizer files, and what an existing destination keeps: ``export_files``.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist

from loongforge_hf.bridges.builder import layer_owners
from loongforge_hf.bridges.distribution import broadcast_outcome, gather_to_first, recv_tensor, send_tensor
from loongforge_hf.bridges.export_files import check_export_dtype, keeps_old_entry, write_side_files
from loongforge_hf.bridges.fp8_checkpoint import dequantizing_reader
from loongforge_hf.bridges.loader import first_stage_mappings, shard_context
from loongforge_hf.bridges.mappings import streams_export


def _export_items(bridge, model, parallel):
    """(pp rank, vp stage or None, megatron local name, mapping, global layer, expert-parallel rank or None) in HF
    file order; expert mappings come bound to one expert each."""
    from loongforge_hf.bridges.fused_mappings import Expert

    owners = layer_owners(model.config, parallel)
    vpp = max(1, parallel.virtual_pipeline_parallel_size or 1)
    last_pp, last_vp = parallel.pipeline_parallel_size - 1, (vpp - 1 if vpp > 1 else None)
    first_vp = 0 if vpp > 1 else None
    num_experts = bridge.num_experts() or 0
    per_rank = num_experts // parallel.expert_parallel_size
    emb = bridge.embedding_mapping()
    yield 0, first_vp, emb.megatron, emb, None, None
    for m in first_stage_mappings(bridge):
        yield 0, first_vp, m.megatron, m, None, None
    for layer in range(bridge.hf_config.num_hidden_layers):
        pp_rank, vp, local = owners[layer]
        for m in bridge.mappings_for_layer(layer):
            if not isinstance(m, Expert):
                yield pp_rank, vp, m.megatron.format(layer=local), m, layer, None
                continue
            for g in range(num_experts):
                bound = m.bind(global_expert=g, local_expert=g % per_rank)
                yield pp_rank, vp, bound.megatron.format(layer=local), bound, layer, g // per_rank
    for m in bridge.final_mappings():
        yield last_pp, last_vp, m.megatron, m, None, None


def _planned_tensors(bridge, model, parallel, shapes, dtype):
    """(name, shape, dtype) of each tensor the export loop writes, in its order: the writer streams them to disk. A
    tensor written in blocks by several mappings (``Mapping.hf_block``) is planned once, whole."""
    planned = set()
    for _, _, _, mapping, layer, _ in _export_items(bridge, model, parallel):
        for n in mapping.hf_names(layer):
            if n not in planned:
                planned.add(n)
                yield n, shapes[n], mapping.hf_dtype or dtype


def _exported_shape(mapping, layer, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of what ``mapping.export`` gives for an HF tensor of ``shape``: one block of it (``hf_block``) or
    all of it."""
    block = mapping.hf_block(layer)
    if block is None:
        return tuple(shape)
    return (*shape[:block[0]], mapping.hf_block_rows(layer), *shape[block[0] + 1:])


def _write(writer, mapping, layer, name: str, tensor: torch.Tensor) -> None:
    """``tensor`` (``mapping.export``'s for ``name``) to the writer: whole, or as its block (``hf_block``)."""
    block = mapping.hf_block(layer)
    if block is None:
        writer.add(name, tensor)
    else:
        writer.add_part(name, tensor, dim=block[0], start=block[1])


def _for_each_part(local: torch.Tensor, mapping, ctx, layer, group, sink) -> None:
    """On the first rank of ``group``: ``sink(name, dim, start, block)`` for every block (``export_parts``) of every
    rank's shard, in rank order; a mapping without a TP split uses the first rank's own shard alone.

    The other ranks' shards are received one after the other, each receive posted (``irecv``) before the blocks of
    the shard before it go to ``sink``, so the transfer overlaps the writing; at most two received shards are held at
    a time (one being written, one arriving), each dropped once written.
    """
    peers = []
    if mapping.tp_split is not None and group is not None and dist.get_world_size(group) > 1:
        peers = dist.get_process_group_ranks(group)[1:]

    def receive(src: int):
        shard = torch.empty_like(local, memory_format=torch.contiguous_format)
        return shard, dist.irecv(shard, src=src)

    pending = receive(peers[0]) if peers else None
    for part in mapping.export_parts(local, 0, ctx, layer):
        sink(*part)
    for i in range(1, len(peers) + 1):
        shard, work = pending
        work.wait()
        pending = receive(peers[i]) if i < len(peers) else None
        for part in mapping.export_parts(shard, i, ctx, layer):
            sink(*part)
        shard = part = work = None


def _send_to_first(local: torch.Tensor, mapping, group) -> None:
    """On the other ranks of ``group``: send this rank's shard to the first, when the mapping is split over TP."""
    if mapping.tp_split is not None and group is not None and dist.get_world_size(group) > 1:
        dist.send(local.contiguous(), dst=dist.get_process_group_ranks(group)[0])


def _expert_senders(*, pp_rank: int, ep_rank: int, etp_rank: int, edp_rank: int) -> dict[tuple[int, int], int]:
    """(pipeline rank, expert-parallel rank) -> the global rank that sends those experts to rank 0 (collective)."""
    mine = (pp_rank, ep_rank, etp_rank, edp_rank)
    everyone = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    return {(pp, ep): r for r, (pp, ep, etp, edp) in enumerate(everyone) if etp == 0 and edp == 0}


def _passthrough(bridge, source: Path | None, variant: str | None) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of every source tensor the bridge keeps without a megatron home, read now, in source order.

    Only a bridge that keeps such tensors opens the source (safetensors only: a pickle source of such a model fails
    here, naming the file)."""
    if source is None or not getattr(bridge, "has_passthrough", False):
        return []
    from loongforge_hf.bridges.checkpoint_io import CheckpointReader

    with CheckpointReader(source, variant=variant) as raw:
        reader = dequantizing_reader(raw, bridge=bridge)  # FP8 tensors written dequantised; aliases read renamed
        return [(n, reader.get(n).clone()) for n in bridge.passthrough_names(reader.keys())]


def export_hf(model, bridge, parallel, out_dir, *, source: Path | None, max_shard_size="5GB",
              dtype: torch.dtype | None = None, extra_tensors=None, config_changes: dict | None = None,
              generation_config=None, side_files_dir: str | os.PathLike | None = None,
              source_variant: str | None = None) -> None:
    """``source_variant``: the variant of the source's weight files (read for ``passthrough_names``).
    ``config_changes`` / ``generation_config`` / ``side_files_dir``: what ``export_files.write_side_files`` writes
    besides the source's files (config fields changed since load; a generation config to write, None to copy the
    source's; a folder of files to write too, read on rank 0)."""
    from megatron.core import parallel_state as ps

    from loongforge_hf.bridges.writer import CheckpointWriter

    rank = dist.get_rank() if dist.is_initialized() else 0
    tp_group = ps.get_tensor_model_parallel_group()
    tp_rank, tp_size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    pp_rank = ps.get_pipeline_model_parallel_rank()
    is_replica0 = ps.get_data_parallel_rank(with_context_parallel=True) == 0
    pp_ranks = dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group()) if dist.is_initialized() \
        else [0]
    ctx = shard_context(bridge, tp_rank=tp_rank, tp_size=tp_size, padded_vocab=model.padded_vocab)
    shapes = bridge.expected_hf_shapes()
    writer_dtype = dtype or model.config.params_dtype
    device = next(model.chunks[0].parameters()).device

    params = []
    for chunk in model.chunks:
        params.append({**dict(chunk.named_buffers()), **dict(chunk.named_parameters())})
    experts = bool(bridge.num_experts())
    if experts:
        ep_rank, etp_rank = ps.get_expert_model_parallel_rank(), ps.get_expert_tensor_parallel_rank()
        etp_group = ps.get_expert_tensor_parallel_group()
        edp_rank = ps.get_expert_data_parallel_rank()
        ctx = shard_context(bridge, tp_rank=tp_rank, tp_size=tp_size, padded_vocab=model.padded_vocab,
                            ep_rank=ep_rank, ep_size=ps.get_expert_model_parallel_world_size(), etp_rank=etp_rank,
                            etp_size=ps.get_expert_tensor_parallel_world_size())
        senders = _expert_senders(pp_rank=pp_rank, ep_rank=ep_rank, etp_rank=etp_rank, edp_rank=edp_rank)

    check_export_dtype(dtype)
    # NOTE: constructing the writer checks its arguments, alike on every rank. Only rank 0 can tell whether the
    # destination opens, and every rank learns that before the stream starts, so no rank is left in a collective.
    writer = CheckpointWriter(out_dir, max_shard_size=max_shard_size, carry_over=keeps_old_entry)
    error: str | None = None
    if rank == 0:
        try:
            writer.__enter__()
            writer.plan(_planned_tensors(bridge, model, parallel, shapes, writer_dtype))
        except Exception as e:  # noqa: BLE001 - shared with every rank below
            error = f"{type(e).__name__}: {e}"
    error = broadcast_outcome(error, src=0)
    if error is not None:
        raise RuntimeError(f"save_pretrained({os.fspath(out_dir)!r}) failed; nothing was written: {error}")
    if rank != 0:
        writer = None
    try:
        for owner_pp, vp, name, mapping, layer, owner_ep in _export_items(bridge, model, parallel):
            out_dtype = mapping.hf_dtype or writer_dtype
            if owner_ep is None:
                holds, group, first, src = owner_pp == pp_rank and is_replica0, tp_group, tp_rank == 0, None
                map_ctx = ctx
            else:
                holds = owner_pp == pp_rank and owner_ep == ep_rank and edp_rank == 0
                group, first, src, map_ctx = etp_group, etp_rank == 0, senders[(owner_pp, owner_ep)], \
                    ctx.for_experts()
            streamed = holds and streams_export(mapping)
            if holds:
                local = params[vp or 0][name].detach()
                if hasattr(mapping, "local_part"):  # one expert of a stacked expert parameter (moe.ExpertSlice)
                    local = mapping.local_part(local)
                if not streamed:
                    shards = gather_to_first(local, group=group)
                    hf_tensors = mapping.export(shards, map_ctx, layer) if first else {}
                elif not first:
                    _send_to_first(local, mapping, group)
                elif rank == 0:
                    def write_block(n, dim, start, block, out_dtype=out_dtype):
                        nonlocal error
                        if error is None:
                            try:
                                writer.add_part(n, block.to(out_dtype).cpu(), dim=dim, start=start)
                            except Exception as e:  # noqa: BLE001 - shared with every rank below
                                error = f"{type(e).__name__}: {e}"

                    _for_each_part(local, mapping, map_ctx, layer, group, write_block)
                else:
                    hf_tensors = {n: torch.empty(shapes[n], dtype=out_dtype, device=local.device)
                                  for n in mapping.hf_names(layer)}

                    def fill(n, dim, start, block, full=hf_tensors):
                        (full[n] if block.dim() == 0 else full[n].narrow(dim, start, block.shape[dim])).copy_(block)

                    _for_each_part(local, mapping, map_ctx, layer, group, fill)
            if rank == 0:
                if streamed:
                    tensors = {}  # NOTE: already on disk, block by block
                elif holds:
                    tensors = hf_tensors
                else:
                    src = pp_ranks[owner_pp] if src is None else src
                    tensors = {n: recv_tensor(_exported_shape(mapping, layer, shapes[n]), out_dtype, src=src,
                                              device=device)
                               for n in mapping.hf_names(layer)}
                if error is None:
                    try:
                        for n, t in tensors.items():
                            _write(writer, mapping, layer, n, t.to(out_dtype).cpu())
                    except Exception as e:  # noqa: BLE001 - shared with every rank below
                        error = f"{type(e).__name__}: {e}"
            elif holds and first:
                for n in mapping.hf_names(layer):
                    send_tensor(hf_tensors[n].to(out_dtype), dst=0)
            # NOTE: drop this tensor's buffers before the next is gathered, or the peak holds two of them.
            shards = hf_tensors = tensors = local = None
        for n, t in (extra_tensors() if extra_tensors is not None else ()):
            if writer is not None and error is None and t is not None:
                try:
                    writer.add(n, t.to(writer_dtype).cpu())
                except Exception as e:  # noqa: BLE001 - shared with every rank below
                    error = f"{type(e).__name__}: {e}"
        if writer is not None and error is None:
            try:
                for n, t in _passthrough(bridge, source, source_variant):
                    writer.add(n, t)
            except Exception as e:  # noqa: BLE001
                error = f"{type(e).__name__}: {e}"
        if writer is not None and error is None:
            try:
                write_side_files(writer, source, bridge.hf_config, writer_dtype, config_changes, generation_config,
                                 side_files_dir)
            except Exception as e:  # noqa: BLE001
                error = f"{type(e).__name__}: {e}"
    finally:
        if writer is not None:
            if error is None:
                try:
                    writer.__exit__(None, None, None)
                except Exception as e:  # noqa: BLE001
                    error = f"{type(e).__name__}: {e}"
            else:
                exc = RuntimeError(error)
                writer.__exit__(type(exc), exc, None)
    error = broadcast_outcome(error, src=0)
    if error is not None:
        raise RuntimeError(f"save_pretrained({os.fspath(out_dir)!r}) failed; nothing was written: {error}")
