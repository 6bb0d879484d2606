"""Small side messages between consecutive pipeline stages, beside megatron's activation sends.

Choices:
- Two process groups over each pipeline group's ranks, one per direction (to the next stage in the forward, to the
  previous one in the backward), apart from megatron's pipeline group: a message never queues among megatron's own
  point-to-point sends, and on each directed pair of ranks the messages of one direction are sent and received in
  the same order (every rank runs megatron's schedules' forwards in one order and their backwards in one order, the
  interleaved schedule's virtual stages included: the last rank's chunk ``c`` hands on to the first rank's chunk
  ``c + 1``).
- Sends are non-blocking (``isend``), kept until ``flush``; receives block. A stage sends before megatron sends its
  activation (or its input's gradient), and receives after megatron's receive, so no wait closes a cycle.
- The groups are made when a model is built (every rank takes part, in the same order), once per megatron pipeline
  group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_LINK: list = [None, None]  # [megatron pipeline group, this rank's StageLink over it]


class StageLink:
    """This rank's side channels to its pipeline neighbours (next / previous rank, wrapping around for virtual
    stages)."""

    def __init__(self, ranks: list[int], forward_group, backward_group) -> None:
        me = ranks.index(dist.get_rank())
        self.next_rank = ranks[(me + 1) % len(ranks)]
        self.prev_rank = ranks[(me - 1) % len(ranks)]
        self.forward_group = forward_group
        self.backward_group = backward_group
        self.pending: list[tuple] = []  # (work, tensor): a sent tensor stays alive until its send completes

    def _send(self, tensor: torch.Tensor, dst: int, group) -> None:
        tensor = tensor.detach().contiguous()
        self.pending.append((dist.isend(tensor, dst=dst, group=group), tensor))

    def send_next(self, tensor: torch.Tensor) -> None:
        self._send(tensor, self.next_rank, self.forward_group)

    def send_prev(self, tensor: torch.Tensor) -> None:
        self._send(tensor, self.prev_rank, self.backward_group)

    def recv_prev(self, like: torch.Tensor) -> torch.Tensor:
        buf = torch.empty_like(like)
        dist.recv(buf, src=self.prev_rank, group=self.forward_group)
        return buf

    def recv_next(self, like: torch.Tensor) -> torch.Tensor:
        buf = torch.empty_like(like)
        dist.recv(buf, src=self.next_rank, group=self.backward_group)
        return buf

    def flush(self) -> None:
        """Wait for this rank's sends (their receivers have run by the end of a schedule)."""
        pending, self.pending = self.pending, []
        for work, _ in pending:
            work.wait()


def stage_link() -> StageLink | None:
    """This rank's ``StageLink`` over megatron's current pipeline group (None without pipeline parallelism).
    Collective over all ranks the first time for a pipeline layout."""
    from megatron.core import parallel_state as ps

    group = ps.get_pipeline_model_parallel_group()
    ranks = dist.get_process_group_ranks(group)
    if len(ranks) == 1:
        return None
    if _LINK[0] is not group:  # NOTE: a new pipeline layout (destroy_parallel, then another model): new groups
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, ranks)
        mine = None
        for group_ranks in sorted({tuple(r) for r in gathered}):
            groups = (dist.new_group(list(group_ranks)), dist.new_group(list(group_ranks)))
            if dist.get_rank() in group_ranks:
                mine = StageLink(list(group_ranks), *groups)
        _LINK[:] = [group, mine]
    return _LINK[1]
