"""Small side messages between consecutive pipeline stages, beside megatron's activation sends.

Choices:
- Each message is a broadcast within a two-rank process group of its own kind: per pipeline rank ``r``, one group
  for the forward messages ``r -> r + 1`` and one for the backward messages ``r + 1 -> r`` (``r + 1`` wrapping
  around to the first rank: the interleaved schedule's last rank hands chunk ``c`` on to the first rank's chunk
  ``c + 1``). A group thus carries messages one way only, which both of its ranks issue in the same order (every
  rank runs megatron's schedules' forwards in one order and their backwards in one order), apart from megatron's
  pipeline group: a message never queues among megatron's own sends.
- Sends are asynchronous, kept until ``flush``; receives block. A stage sends before megatron sends its activation
  (or its input's gradient) and receives after megatron's receive, so no wait closes a cycle.
- The groups are made the first time a model asks for them (every rank at the same point, in the same order) and
  set up there with one collective each: NCCL builds a communicator at its first use, blocking until both ranks
  come, which in the middle of a schedule would wait on a rank that waits for megatron's send.
- One set of groups per arrangement of pipeline ranks in a world: megatron rebuilds its own groups at every layout
  change, but a later layout with the same pipelines (PP2 then PP2 x VPP2, or back) takes the groups made before,
  so a process that changes layouts makes no new ones, and a model of an earlier layout still finds its groups.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from loongforge_hf.parallel.bootstrap import collective_timeout

_LINK: list = [None, None]  # [megatron pipeline group, this rank's StageLink over it]
_MADE: dict = {}  # pipelines (tuples of ranks) -> this rank's StageLink, for the world in _WORLD
_WORLD: list = [None]


class StageLink:
    """This rank's side channels to its pipeline neighbours (next / previous rank, wrapping around for virtual
    stages)."""

    def __init__(self, ranks: list[int], forward: list, backward: list) -> None:
        me = ranks.index(dist.get_rank())
        self.next_rank = ranks[(me + 1) % len(ranks)]
        self.prev_rank = ranks[(me - 1) % len(ranks)]
        # forward[i]: ranks i -> i + 1 in the forward; backward[i]: ranks i + 1 -> i in the backward
        self.to_next, self.from_prev = forward[me], forward[me - 1]
        self.from_next, self.to_prev = backward[me], backward[me - 1]
        self.pending: list[tuple] = []  # (work, tensor): a sent tensor stays alive until its send completes
        self.groups = list({id(g): g for g in (self.to_next, self.from_prev, self.from_next, self.to_prev)}.values())

    def _send(self, tensor: torch.Tensor, group) -> None:
        tensor = tensor.detach().clone()
        self.pending.append((dist.broadcast(tensor, src=dist.get_rank(), group=group, async_op=True), tensor))

    @staticmethod
    def _recv(like: torch.Tensor, src: int, group) -> torch.Tensor:
        buf = torch.empty_like(like)
        dist.broadcast(buf, src=src, group=group)
        return buf

    def send_next(self, tensor: torch.Tensor) -> None:
        self._send(tensor, self.to_next)

    def send_prev(self, tensor: torch.Tensor) -> None:
        self._send(tensor, self.to_prev)

    def recv_prev(self, like: torch.Tensor) -> torch.Tensor:
        return self._recv(like, self.prev_rank, self.from_prev)

    def recv_next(self, like: torch.Tensor) -> torch.Tensor:
        return self._recv(like, self.next_rank, self.from_next)

    def flush(self) -> None:
        """Wait for this rank's sends (their receivers have run by the end of a schedule)."""
        pending, self.pending = self.pending, []
        for work, _ in pending:
            work.wait()


def stage_link(device: torch.device) -> StageLink | None:
    """This rank's ``StageLink`` over megatron's current pipeline group (None without pipeline parallelism).
    Collective over all ranks the first time for a pipeline layout; ``device``: where the messages live."""
    from megatron.core import parallel_state as ps

    group = ps.get_pipeline_model_parallel_group()
    ranks = dist.get_process_group_ranks(group)
    if len(ranks) == 1:
        return None
    if _LINK[0] is not group:  # NOTE: megatron's groups were (re)built for a layout: its pipelines' groups
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, ranks)
        pipelines = tuple(sorted({tuple(r) for r in gathered}))
        if _WORLD[0] is not dist.group.WORLD:  # NOTE: a new world (the old one destroyed): its groups are gone
            _MADE.clear()
            _WORLD[0] = dist.group.WORLD
        if pipelines not in _MADE:
            _MADE[pipelines] = _make(pipelines, device)
        _LINK[:] = [group, _MADE[pipelines]]
    return _LINK[1]


def side_channel_groups() -> list:
    """This rank's side-channel process groups in the current world (for ``set_collective_timeout``)."""
    if _WORLD[0] is not dist.group.WORLD:
        return []
    return [g for link in _MADE.values() if link is not None for g in link.groups]


def _make(pipelines: tuple, device) -> StageLink | None:
    """The groups of every pipeline's edges (collective: ``new_group`` on every rank), set up now; this rank's
    ``StageLink``."""
    mine = None
    for pipeline in pipelines:
        size = len(pipeline)
        pairs = [sorted((pipeline[i], pipeline[(i + 1) % size])) for i in range(size)]
        timeout = collective_timeout()  # NOTE: new_group's default is the backend's, not the world's
        forward = [dist.new_group(p, timeout=timeout) for p in pairs]
        backward = [dist.new_group(p, timeout=timeout) for p in pairs]
        if dist.get_rank() in pipeline:
            for pair, g in zip(pairs + pairs, forward + backward):
                if dist.get_rank() in pair:
                    dist.all_reduce(torch.zeros(1, device=device), group=g)  # NOTE: set up now (see above)
            mine = StageLink(list(pipeline), forward, backward)
    return mine
