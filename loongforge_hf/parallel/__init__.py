"""Parallel layout: ``ParallelConfig``, the launcher environment, and megatron-core's process groups."""

from loongforge_hf.parallel.bootstrap import (collective_timeout, current_layout, destroy_parallel, init_distributed,
                                              initialize_parallel, set_collective_timeout)
from loongforge_hf.parallel.config import PARALLEL_KWARGS, ParallelConfig, ParallelLayoutError
from loongforge_hf.parallel.env import accelerate_megatron_layout, read_launch_env

__all__ = ["PARALLEL_KWARGS", "ParallelConfig", "ParallelLayoutError", "accelerate_megatron_layout",
           "collective_timeout", "current_layout", "destroy_parallel", "init_distributed", "initialize_parallel",
           "read_launch_env", "set_collective_timeout"]
