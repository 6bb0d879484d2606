"""Bring up torch.distributed and megatron-core's parallel state for a ``ParallelConfig``.

Order matters: the layout is validated from the launcher's environment first (pure arithmetic, same verdict on every
rank), then the process group starts, then megatron-core builds its groups. A bad layout therefore raises on every
rank before any collective and never hangs.
"""

from __future__ import annotations

import datetime
import socket

import torch.distributed as dist

from loongforge_hf.parallel.config import ParallelConfig, ParallelLayoutError
from loongforge_hf.parallel.env import read_launch_env
from loongforge_hf.xpu import get_backend

_CURRENT: ParallelConfig | None = None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(timeout_s: float = 600.0) -> None:
    """Start the default process group from the launcher's environment (a one-process world without one)."""
    if dist.is_initialized():
        return
    backend = get_backend()
    env = read_launch_env()
    backend.set_device(env.local_rank)
    port = env.master_port or _free_port()
    dist.init_process_group(backend=backend.dist_backend, init_method=f"tcp://{env.master_addr}:{port}",
                            rank=env.rank, world_size=env.world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))


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
    _CURRENT = parallel
    return parallel


def destroy_parallel() -> None:
    global _CURRENT
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    _CURRENT = None


__all__ = ["ParallelLayoutError", "current_layout", "destroy_parallel", "init_distributed", "initialize_parallel"]
