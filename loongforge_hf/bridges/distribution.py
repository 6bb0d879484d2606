"""Which rank owns which slice, and moving slices between ranks. Process groups are always passed in.

Choices:
- Export streams one HF tensor at a time: the TP group that owns it gathers the shards on its first rank, which
  turns them into HF tensors and sends them to the writer rank (global rank 0). Data-parallel and context-parallel
  replicas stay idle, so each tensor is gathered once.
- Failures on the writer rank never strand the senders: the writer keeps receiving (and discards) until the stream
  ends, then the outcome is broadcast and every rank raises the same error.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.distributed as dist


def gather_to_first(tensor: torch.Tensor, *, group) -> list[torch.Tensor] | None:
    """On the first rank of ``group``: every rank's ``tensor`` in group order, its own uncopied; elsewhere None.

    NOTE: point-to-point rather than an all-gather: only the first rank needs the shards, so the others allocate
    nothing and send their shard once, and the first rank holds one buffer per other rank, not one per rank.
    Every rank's ``tensor`` must have the same shape and dtype (tensor-parallel shards do).
    """
    if group is None or dist.get_world_size(group) == 1:
        return [tensor]
    ranks = dist.get_process_group_ranks(group)
    if dist.get_rank() != ranks[0]:
        dist.send(tensor.contiguous(), dst=ranks[0])
        return None
    shards = [tensor]
    for src in ranks[1:]:
        shards.append(torch.empty_like(tensor, memory_format=torch.contiguous_format))
        dist.recv(shards[-1], src=src)
    return shards


def send_tensor(tensor: torch.Tensor, *, dst: int) -> None:
    dist.send(tensor.contiguous(), dst=dst)


def recv_tensor(shape: tuple[int, ...], dtype: torch.dtype, *, src: int, device) -> torch.Tensor:
    out = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(out, src=src)
    return out


def broadcast_outcome(error: str | None, *, src: int = 0) -> str | None:
    """Share ``error`` (None for success) of rank ``src`` with every rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return error
    box = [error]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def _first_error(error: str | None) -> tuple[int, str] | None:
    """(rank, error) of the lowest rank that saw one, the same on every rank; None when none did. Collective."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None if error is None else (0, error)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, error)
    return next(((i, e) for i, e in enumerate(gathered) if e is not None), None)


def agree_on_error(error: str | None) -> str | None:
    """The first error any rank saw (None when none did): every rank gets the same verdict, other ranks' marked."""
    first = _first_error(error)
    if first is None:
        return None
    rank = dist.get_rank() if dist.is_initialized() else 0
    return first[1] if first[0] == rank else f"(on rank {first[0]}) {first[1]}"


def same_error_everywhere(error: str | None) -> str | None:
    """The first error any rank saw, as ``"rank i: <error>"``, the same string on every rank (None when none did).
    Collective: every rank must call it. Without a process group the error is returned as it is."""
    first = _first_error(error)
    if first is None or not dist.is_initialized() or dist.get_world_size() == 1:
        return error
    return f"rank {first[0]}: {first[1]}"


@contextlib.contextmanager
def failing_alike(describe: Callable[[BaseException], str], raise_as: Callable[[str], BaseException],
                  catch: tuple = (Exception,)):
    """Run the block's rank-local work so that a failure on any rank raises on every rank: the first failing rank's
    ``describe(error)`` becomes ``raise_as("rank i: <description>")`` everywhere (collective when the block ends)."""
    error = cause = None
    try:
        yield
    except catch as err:  # noqa: BLE001 - shared with every rank below
        error, cause = describe(err), err
    error = same_error_everywhere(error)
    if error is not None:
        raise raise_as(error) from cause
