"""Bring up torch.distributed and megatron-core's parallel state for a ``ParallelConfig``.

Order matters: the layout is validated from the launcher's environment first (pure arithmetic, same verdict on every
rank), then the process group starts, then megatron-core builds its groups. A bad layout therefore raises on every
rank before any collective and never hangs.

Collective timeout: every process group loongforge-hf makes (the default group when ``init_distributed`` starts it,
megatron-core's groups, the pipeline side channels of ``stage_link``) waits ``collective_timeout()`` for a collective,
1800 s unless set, transformers' ``TrainingArguments.ddp_timeout`` default. ``set_collective_timeout`` changes it on
the groups already made (torch's ``_set_pg_timeout``: gloo applies it to its next operations, NCCL gives each later
collective it as the watchdog's limit) and for the groups made later; LoongTrainer calls it with
``TrainingArguments.ddp_timeout``. A default group started by other code (the user, accelerate) keeps its own timeout,
as under transformers.Trainer.
"""

from __future__ import annotations

import datetime
import socket

import torch.distributed as dist

from loongforge_hf.parallel.config import ParallelConfig, ParallelLayoutError
from loongforge_hf.parallel.env import read_launch_env
from loongforge_hf.xpu import get_backend

_CURRENT: ParallelConfig | None = None
DEFAULT_TIMEOUT_S = 1800.0  # transformers.TrainingArguments.ddp_timeout's default
_TIMEOUT = {"seconds": DEFAULT_TIMEOUT_S, "default_group": None}  # default_group: the one init_distributed started


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(timeout_s: float | None = None) -> None:
    """Start the default process group from the launcher's environment (a one-process world without one).
    ``timeout_s``: its collective timeout, and that of the groups made after it (``set_collective_timeout``);
    ``collective_timeout()`` when None."""
    if dist.is_initialized():
        return
    if timeout_s is not None:
        _TIMEOUT["seconds"] = float(timeout_s)
    backend = get_backend()
    env = read_launch_env()
    backend.set_device(env.local_rank)
    port = env.master_port or _free_port()
    dist.init_process_group(backend=backend.dist_backend, init_method=f"tcp://{env.master_addr}:{port}",
                            rank=env.rank, world_size=env.world_size, timeout=collective_timeout())
    _TIMEOUT["default_group"] = dist.group.WORLD


def collective_timeout() -> datetime.timedelta:
    """How long a collective of loongforge-hf's process groups waits before it fails."""
    return datetime.timedelta(seconds=_TIMEOUT["seconds"])


def set_collective_timeout(seconds: float) -> None:
    """Set the collective timeout of loongforge-hf's process groups, those made so far and those made later (no
    collective: each rank sets its own groups)."""
    from torch.distributed.distributed_c10d import _set_pg_timeout

    if seconds <= 0:
        raise ValueError(f"The collective timeout must be > 0 seconds, got {seconds}.")
    _TIMEOUT["seconds"] = float(seconds)
    for group in _groups_made():
        _set_pg_timeout(collective_timeout(), group)


def _groups_made() -> list:
    """This rank's process groups that loongforge-hf made: the default group if ``init_distributed`` started it,
    megatron-core's (this world's), the pipeline side channels."""
    from megatron.core import parallel_state as ps

    from loongforge_hf.parallel.stage_link import side_channel_groups

    if not dist.is_initialized():
        return []
    groups = [dist.group.WORLD] if _TIMEOUT["default_group"] is dist.group.WORLD else []
    # NOTE: megatron-core 0.16.1 parallel_state.py:242-247 lists every group create_group made that holds this rank
    # (None: the default group, covered above); its own update_pg_timeout (:185) would also barrier and synchronise
    # CUDA, which a timeout setting needs neither of.
    groups += [g for g in getattr(ps, "_global_process_group_list", None) or [] if g is not None]
    return groups + side_channel_groups()


def current_layout() -> ParallelConfig | None:
    return _CURRENT


def initialize_parallel(parallel: ParallelConfig, *, seed: int = 1234,
                        cudagraph_rng: bool = False) -> ParallelConfig:
    """Validate ``parallel`` for this world, start distributed, and (re)build megatron-core's groups.

    ``cudagraph_rng``: seed megatron's CUDA RNG tracker with states a CUDA graph can capture (megatron's per-layer
    graphs, ``cuda_graph_impl="local"``, assert it)."""
    global _CURRENT
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

    world = dist.get_world_size() if dist.is_initialized() else read_launch_env().world_size
    parallel.check_world_size(world)
    get_backend()
    init_distributed()
    if ps.model_parallel_is_initialized():
        if _CURRENT == parallel:
            if cudagraph_rng and not getattr(get_cuda_rng_tracker(), "use_cudagraphable_rng", False):
                model_parallel_cuda_manual_seed(seed, use_cudagraphable_rng=True, force_reset_rng=True)
            return parallel
        ps.destroy_model_parallel()
    vpp = parallel.interleaved_stages
    ps.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tensor_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_parallel_size,
        virtual_pipeline_model_parallel_size=vpp,
        context_parallel_size=parallel.context_parallel_size,
        expert_model_parallel_size=parallel.expert_parallel_size,
        expert_tensor_parallel_size=parallel.expert_tensor_parallel_size,
    )
    model_parallel_cuda_manual_seed(seed, use_cudagraphable_rng=cudagraph_rng, force_reset_rng=True)
    set_collective_timeout(_TIMEOUT["seconds"])  # NOTE: megatron made its groups with its own default (30 min)
    _CURRENT = parallel
    return parallel


def destroy_parallel() -> None:
    global _CURRENT
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    _CURRENT = None


__all__ = ["DEFAULT_TIMEOUT_S", "ParallelLayoutError", "collective_timeout", "current_layout", "destroy_parallel",
           "init_distributed", "initialize_parallel", "set_collective_timeout"]
