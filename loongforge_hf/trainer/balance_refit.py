"""Refit the data-parallel balancing cost model from each rank's measured compute time.

Choices:
- What is measured: a rank's time from the start of megatron's forward-backward schedule to the moment
  ``finalize_model_grads`` starts waiting for the data-parallel gradient reduction. Both moments come from megatron's
  own instrumentation hook, ``TransformerConfig.timers`` (the starts of its "forward-backward" and "all-grads-sync"
  timers); nothing in megatron is patched, and a timers object already there keeps receiving every call. With
  ``overlap_grad_reduce`` the buckets' reductions are launched during the backward but not waited on before the second
  moment, so a fast rank's time does not include waiting for a slow one.
- On an accelerator the two moments are timing events on the current (compute) stream, read after the step, so the
  time is device compute, not host launch time; collectives running on their own streams are not waited on. On CPU
  the host clock is exact (work is synchronous).
- A data-parallel replica's time is its slowest rank's (its TP / PP / CP members). The first measured step is not
  used (it pays one-time costs); the next ``steps`` are fitted by ``CostModel.fit`` on world rank 0 and the
  coefficients are broadcast, so every rank balances with bit-identical numbers (ranks must agree on every
  assignment).
- Limitations: ``CostModel.fit`` has no constant term, so work every rank pays per step whatever its samples (the
  micro-batches' launch overheads, the schedule's bookkeeping) is absorbed into a, b and c. With pipeline parallelism
  the measured time includes the pipeline's bubbles and point-to-point waits. The refit is not checkpointed: a resumed
  run measures and refits again (the samples of each step, hence the gradients, are the same either way).
"""

from __future__ import annotations

import logging
import time
from typing import Sequence

import torch
import torch.distributed as dist

from loongforge_hf.trainer.balance import CostModel

logger = logging.getLogger(__name__)

START, END = "forward-backward", "all-grads-sync"


class _NoTimer:
    def start(self, barrier: bool = False) -> None:
        pass

    def stop(self, barrier: bool = False) -> None:
        pass


class _Mark:
    """A megatron timer whose start also calls ``on_start``; forwards to the timer it wraps, if any."""

    def __init__(self, on_start, inner) -> None:
        self._on_start, self._inner = on_start, inner

    def start(self, barrier: bool = False) -> None:
        self._inner.start(barrier=barrier)
        self._on_start()

    def stop(self, barrier: bool = False) -> None:
        self._inner.stop(barrier=barrier)


class ComputeTimer:
    """Megatron's ``config.timers`` protocol: measures each training step's local forward+backward time."""

    def __init__(self, device: torch.device, inner=None) -> None:
        self._device = torch.device(device)
        self._inner = inner
        self._start = None
        self._done = None

    @classmethod
    def install(cls, config, device: torch.device) -> "ComputeTimer":
        """Put a ComputeTimer on megatron's ``TransformerConfig`` (idempotent) and return it."""
        if not isinstance(config.timers, cls):
            config.timers = cls(device, inner=config.timers)
        return config.timers

    def __call__(self, name: str, log_level: int | None = None):
        inner = self._inner(name, log_level=log_level) if self._inner is not None else _NoTimer()
        if name == START:
            return _Mark(self._on_start, inner)
        if name == END:
            return _Mark(self._on_end, inner)
        return inner

    def _mark(self):
        if self._device.type == "cpu":
            return time.perf_counter()
        event = torch.Event(device=self._device, enable_timing=True)
        event.record()
        return event

    def _on_start(self) -> None:
        self._start = self._mark()

    def _on_end(self) -> None:
        # NOTE: a forward-only schedule (evaluation) starts "forward-backward" but never reaches the gradient sync;
        # only a start followed by an end is a training step.
        if self._start is not None:
            self._done = (self._start, self._mark())
            self._start = None

    def take(self) -> float | None:
        """Seconds of the last measured step, once; None when no training step finished since the last call."""
        if self._done is None:
            return None
        start, end = self._done
        self._done = None
        if isinstance(start, float):
            return end - start
        end.synchronize()
        return start.elapsed_time(end) / 1e3


class CostRefit:
    """Collects (samples per replica, replica time) per step and refits the cost model once (collective)."""

    def __init__(self, *, steps: int, dp_rank: int, num_ranks: int, device: torch.device, skip: int = 1) -> None:
        if steps < 1:
            raise ValueError(f"CostRefit: steps must be >= 1, got {steps}")
        self._steps, self._skip = steps, skip
        self._dp_rank, self._num_ranks, self._device = dp_rank, num_ranks, torch.device(device)
        self._lengths: list[list[list[int]]] = []
        self._times: list[list[float]] = []
        self.done = False

    def observe(self, lengths_per_rank: Sequence[Sequence[int]], seconds: float) -> CostModel | None:
        """One measured step; every rank of the world calls this for the same steps.

        ``lengths_per_rank[r]`` are the sample lengths data-parallel rank r trained in the step and ``seconds`` this
        rank's compute time. Returns the refit model at the step that completes the warm-up, else None.
        """
        if self.done:
            return None
        if self._skip > 0:
            self._skip -= 1
            return None
        mine = torch.tensor([float(self._dp_rank), float(seconds)], dtype=torch.float64, device=self._device)
        gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, mine)
        replica = [0.0] * self._num_ranks
        for item in gathered:
            rank, value = int(item[0].item()), float(item[1].item())
            replica[rank] = max(replica[rank], value)
        self._lengths.append([list(x) for x in lengths_per_rank])
        self._times.append(replica)
        if len(self._times) < self._steps:
            return None
        self.done = True
        coefficients = torch.zeros(4, dtype=torch.float64)
        if dist.get_rank() == 0:
            try:
                fitted = CostModel.fit(self._lengths, self._times)
                coefficients = torch.tensor([1.0, fitted.a, fitted.b, fitted.c], dtype=torch.float64)
            except ValueError as err:
                logger.warning("DP load balancing: could not refit the cost model (%s); keeping the FLOP estimate.",
                               err)
        coefficients = coefficients.to(self._device)
        dist.broadcast(coefficients, src=0)
        ok, a, b, c = coefficients.tolist()
        if not ok:
            return None
        model = CostModel(a=a, b=b, c=c)
        if dist.get_rank() == 0:
            logger.info("DP load balancing: cost model refit from %d measured steps: %s", self._steps, model)
        return model
